#!/usr/bin/env bash
# Allocations, mutex locks and condition-variable signals per collective on rank 0, weft against Open MPI:
# a preload (bench/call_counter.c, compiled here with cc) counts the calls; the difference between a run
# of N+1 iterations and one of 1 is divided by the collectives in between (weft-bench times out of place
# and in place: 2N). 2 ranks, all_reduce f32, loopback.
#   bench/calls.sh BUILD_DIR [BYTES] [N] [TRANSPORT]
set -euo pipefail
build=$1
bytes=${2:-8}
n=${3:-20000}
transport=${4:-tcp}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cc -O2 -shared -fPIC -o "$work/counter.so" "$(dirname "$0")/call_counter.c" -ldl
weft() {  # iterations -> "malloc free lock signal" of rank 0
  WEFT_TRANSPORT=$transport CALLS_OUT="$work/weft.$1" LD_PRELOAD="$work/counter.so" \
    "$build/tools/weft-run" -n 2 -- "$build/bench/weft-bench" -b "$bytes" -e "$bytes" -w 0 -n "$1" >/dev/null 2>&1
  head -1 "$work/weft.$1"
}
mpi() {
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -n 2 --bind-to core --mca btl tcp,self \
    -x CALLS_OUT="$work/mpi.$1" -x LD_PRELOAD="$work/counter.so" "$build/bench/mpi-allreduce-bench" "$bytes" "$bytes" 4 "$1" all_reduce >/dev/null 2>&1
  head -1 "$work/mpi.$1"
}
echo "| $bytes B all_reduce, per collective (rank 0) | malloc | free | pthread_mutex_lock | cond signal/broadcast |"
echo "|---|---|---|---|---|"
row() {  # label small big collectives
  python3 -c "import sys; a, b, c = sys.argv[2].split(), sys.argv[3].split(), int(sys.argv[4]); print(f'| {sys.argv[1]} | ' + ' | '.join(f'{(int(y) - int(x)) / c:.1f}' for x, y in zip(a, b)) + ' |')" "$@"
}
row "weft $transport" "$(weft 1)" "$(weft $((n + 1)))" $((2 * n))
if command -v mpirun >/dev/null && [ -x "$build/bench/mpi-allreduce-bench" ]; then
  row "Open MPI tcp" "$(mpi 1)" "$(mpi $((n + 1)))" "$n"
fi
