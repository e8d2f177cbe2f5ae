#!/usr/bin/env bash
# System calls per collective on rank 0 (strace -c -f, every thread), for each transport and size:
# the difference between a run of N+1 iterations and one of 1, divided by 2N collectives (weft-bench
# times out-of-place and in-place). 2 ranks, all_reduce f32.
#   bench/syscalls.sh BUILD_DIR [N]
set -euo pipefail
build=$1
n=${2:-1000}
count() {  # transport bytes iters -> total syscalls on rank 0
  local out; out=$(mktemp)
  WEFT_TRANSPORT=$1 "$build/tools/weft-run" -n 2 -- bash -c 'if [ "$WEFT_RANK" = 0 ]; then exec strace -f -c -o "$0" "$@"; else exec "$@"; fi' \
    "$out" "$build/bench/weft-bench" -b "$2" -e "$2" -w 0 -n "$3" >/dev/null 2>&1
  awk '$NF == "total" {print $(NF-2)}' "$out"
  rm -f "$out"
}
echo "| transport | size | syscalls per collective (rank 0, all threads) |"
echo "|---|---|---|"
for transport in tcp uring; do
  for bytes in 1024 16777216; do
    iters=$n
    [ "$bytes" -gt 1048576 ] && iters=$((n / 20))
    big=$(count "$transport" "$bytes" $((iters + 1)))
    small=$(count "$transport" "$bytes" 1)
    python3 -c "print(f'| $transport | $bytes | {($big - $small) / (2 * $iters):.1f} |')"
  done
done
