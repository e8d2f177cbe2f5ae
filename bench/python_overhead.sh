#!/usr/bin/env bash
# The Python layer's per-call cost against C++ (issue 19): an 8-byte all_reduce on N local ranks, from
# weft-bench (C++, wait()), then from Python (wait() and asyncio await), alternating for ROUNDS rounds in
# one run. Prints one line per round and the medians.
#
#   bench/python_overhead.sh [BUILD] [RANKS] [ROUNDS] [ITERS]      (WEFT_TRANSPORT as usual; default shm)
set -euo pipefail
build=${1:-build}
ranks=${2:-2}
rounds=${3:-5}
iters=${4:-5000}
python=${PYTHON:-/usr/bin/python3}
here=$(cd "$(dirname "$0")" && pwd)
cpp=() wait=() await=()
for round in $(seq 1 "$rounds"); do
  # weft-bench's out-of-place time column (us) of its one row
  c=$("$build/tools/weft-run" -n "$ranks" -- "$build/bench/weft-bench" -c all_reduce -b 8 -e 8 -w 200 -n "$iters" -d f32 |
      awk '{ sub(/^\[[0-9]+\] */, "") } $1 == "8" && $2 == "2" { print $6; exit }')
  out=$("$build/tools/weft-run" -n "$ranks" -- "$python" "$here/python_overhead.py" "$iters")
  w=$(echo "$out" | awk '/python wait/ { print $NF }')
  a=$(echo "$out" | awk '/python await/ { print $NF }')
  echo "round $round: C++ $c us, Python wait() $w us, Python await $a us"
  cpp+=("$c") wait+=("$w") await+=("$a")
done
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo "median of $rounds rounds, $ranks ranks, transport ${WEFT_TRANSPORT:-shm}: C++ $(median "${cpp[@]}") us, Python wait() $(median "${wait[@]}") us, Python await $(median "${await[@]}") us"
