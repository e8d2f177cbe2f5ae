#!/usr/bin/env bash
# Side by side in one run: weft, Open MPI (--mca btl tcp,self) and, for all_reduce, Gloo (best of ring,
# ring_chunked, halving_doubling, bcube), f32 (sum) on loopback, taking turns ROUNDS times so that the
# machine's drift hits all of them alike. Prints a markdown table of the medians and every round.
#   bench/compare.sh BUILD_DIR [RANKS] [ROUNDS] [MINBYTES] [MAXBYTES] [COLLECTIVE]
set -euo pipefail
build=$1
ranks=${2:-2}
rounds=${3:-3}
min=${4:-1024}
max=${5:-268435456}
collective=${6:-all_reduce}
out=$(mktemp -d)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for round in $(seq 1 "$rounds"); do
  echo "== round $round: weft" >&2
  "$build/tools/weft-run" -n "$ranks" -- "$build/bench/weft-bench" -c "$collective" -b "$min" -e "$max" -f 4 -w 5 -n 20 \
    --json "$out/weft.$round.json" > "$out/weft.$round.txt"
  echo "== round $round: open mpi" >&2
  oversubscribe=""
  [ "$ranks" -le "$(nproc)" ] || oversubscribe=--oversubscribe
  mpirun -n "$ranks" $oversubscribe --mca btl tcp,self "$build/bench/mpi-allreduce-bench" "$min" "$max" 4 20 "$collective" > "$out/mpi.$round.txt" 2>/dev/null
  if [ "$collective" = all_reduce ] && [ -x "$build/bench/gloo-allreduce-bench" ]; then
    echo "== round $round: gloo" >&2
    "$build/tools/weft-run" -n "$ranks" -- "$build/bench/gloo-allreduce-bench" "$min" "$max" 4 20 > "$out/gloo.$round.txt"
  fi
done
python3 - "$out" "$rounds" "$ranks" "$collective" <<'PY'
import json, statistics, sys, glob, os
out, rounds, ranks, collective = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
weft, mpi, gloo = {}, {}, {}
for r in range(1, rounds + 1):
    for rec in json.load(open(f"{out}/weft.{r}.json")):
        if not rec["inplace"]:
            weft.setdefault(rec["bytes"], []).append((rec["time_us"], rec["busbw"]))
    for line in open(f"{out}/mpi.{r}.txt"):
        f = line.split()
        if f and not line.startswith("#"):
            mpi.setdefault(int(f[0]), []).append((float(f[2]), float(f[4])))
    path = f"{out}/gloo.{r}.txt"
    if os.path.exists(path):
        for line in open(path):
            f = line.replace("[0]", "").split()
            if f and not f[0].startswith("#") and f[0].isdigit():
                gloo.setdefault(int(f[0]), []).append((min(map(float, f[1:5])), float(f[6]), f[7]))
def med(xs, i):
    return statistics.median(x[i] for x in xs) if xs else float("nan")
def size(b):
    for unit, n in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= n: return f"{b // n} {unit}"
    return f"{b} B"
print(f"{collective} f32, {ranks} ranks, loopback; median of {rounds} rounds (busbw GB/s, time us)\n")
print("| size | weft time | weft busbw | Open MPI tcp time | Open MPI busbw | Gloo best time | Gloo busbw | weft / MPI busbw | per-round weft / MPI busbw |")
print("|---|---|---|---|---|---|---|---|---|")
for b in sorted(weft):
    w, m, g = weft[b], mpi.get(b, []), gloo.get(b, [])
    rounds_txt = " ".join(f"{x[1]:.2f}/{y[1]:.2f}" for x, y in zip(w, m))
    ratio = med(w, 1) / med(m, 1) if m and med(m, 1) > 0 else float("nan")
    print(f"| {size(b)} | {med(w,0):.1f} | {med(w,1):.3f} | {med(m,0):.1f} | {med(m,1):.3f} | {med(g,0):.1f} | {med(g,1):.3f} | {ratio:.2f} | {rounds_txt} |")
PY
echo "raw outputs: $out" >&2
