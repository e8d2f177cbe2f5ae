#!/bin/bash
# weft under mpirun with its default transport, with WEFT_TRANSPORT=tcp, and Open MPI with its own default
# (vader on one host), taking turns for 5 rounds; prints the medians (us) as a markdown table.
#   bench/launcher_default.sh BUILD_DIR
build=${1:-build}
set -euo pipefail
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
out=$(mktemp -d)
# weft's ranks under mpirun, with mpirun's extra flags (-x ...): the table's rows of weft-bench.
weft_under_mpirun() {
  local port
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  mpirun -n 2 -x WEFT_STORE=127.0.0.1:$port "$@" $build/bench/weft-bench -c all_reduce -b 8 -e 1M -f 8 -w 200 -n 2000 2>/dev/null | grep -E "^ +[0-9]"
}
for round in 1 2 3 4 5; do
  weft_under_mpirun > $out/auto.$round
  weft_under_mpirun -x WEFT_TRANSPORT=tcp > $out/tcp.$round
  mpirun -n 2 $build/bench/mpi-allreduce-bench 8 1048576 8 2000 all_reduce 2>/dev/null | grep -E "^ +[0-9]" > $out/mpi.$round
done
OUT=$out python3 - <<'P'
import glob, os, statistics as st
OUT = os.environ["OUT"]
def load(k, col):
    d={}
    for f in glob.glob(f'{OUT}/{k}.*'):
        for l in open(f):
            x=l.split()
            d.setdefault(int(x[0]),[]).append(float(x[col]))
    return {s:st.median(v) for s,v in d.items()}
a=load('auto',5); t=load('tcp',5); m=load('mpi',2)
print("| size | weft, default (auto: shm) | weft, WEFT_TRANSPORT=tcp | Open MPI, default (vader) | auto / vader |")
print("|---:|---:|---:|---:|---:|")
for s in sorted(m):
    if s in a: print(f"| {s} | {a[s]:.2f} | {t.get(s,float('nan')):.2f} | {m[s]:.2f} | {a[s]/m[s]:.2f} |")
P
rm -rf "$out"
