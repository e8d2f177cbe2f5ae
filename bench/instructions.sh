#!/usr/bin/env bash
# Instructions per collective on rank 0 (every thread, user space; valgrind --tool=callgrind), for one
# or more builds side by side: the difference between a run of N+1 iterations and one of 1, divided by
# the 2N collectives weft-bench times (out of place and in place). 2 ranks, all_reduce f32, tcp, polling
# off (WEFT_SPIN_US=0) so that waiting does not add instructions. Counting instructions is steadier than
# timing on a noisy VM: what a change adds to the hot path shows even when it is far below the noise.
# With MPI=1, a last row for Open MPI (tcp BTL, the first build's mpi-allreduce-bench; the difference
# between N+1 iterations and 1, over N): it cannot turn its polling off, but rank 0 runs under callgrind,
# about 50x slower than rank 1, so it seldom waits and its polling adds little.
#   [MPI=1] bench/instructions.sh BYTES N BUILD_DIR [BUILD_DIR...]
set -euo pipefail
bytes=$1
n=$2
shift 2
count() {  # build iterations -> instructions on rank 0
  local out; out=$(mktemp -d)
  WEFT_SPIN_US=0 WEFT_TRANSPORT=tcp "$1/tools/weft-run" -n 2 --timeout 600 -- bash -c \
    'if [ "$WEFT_RANK" = 0 ]; then exec valgrind --tool=callgrind --callgrind-out-file="$0/cg.%p" "$@"; else exec "$@"; fi' \
    "$out" "$1/bench/weft-bench" -b "$bytes" -e "$bytes" -w 0 -n "$2" >/dev/null 2>&1
  cat "$out"/cg.* | awk '/^summary:/ {s += $2} END {print s}'
  rm -rf "$out"
}
count_mpi() {  # build iterations -> instructions on rank 0
  local out; out=$(mktemp -d)
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --mca btl tcp,self \
    -n 1 valgrind --tool=callgrind --callgrind-out-file="$out/cg.%p" "$1/bench/mpi-allreduce-bench" "$bytes" "$bytes" 2 "$2" all_reduce : \
    -n 1 "$1/bench/mpi-allreduce-bench" "$bytes" "$bytes" 2 "$2" all_reduce >/dev/null 2>&1
  cat "$out"/cg.* | awk '/^summary:/ {s += $2} END {print s}'
  rm -rf "$out"
}
echo "| build | instructions per collective ($bytes B all_reduce, rank 0) |"
echo "|---|---|"
for build in "$@"; do
  big=$(count "$build" $((n + 1)))
  small=$(count "$build" 1)
  python3 -c "print(f'| $build | {($big - $small) / (2 * $n):.0f} |')"
done
if [ "${MPI:-0}" = 1 ]; then
  big=$(count_mpi "$1" $((n + 1)))
  small=$(count_mpi "$1" 1)
  python3 -c "print(f'| Open MPI tcp | {($big - $small) / $n:.0f} |')"
fi
