#!/usr/bin/env bash
# Side by side in one run: weft, Open MPI (--mca btl tcp,self) and, for all_reduce, all_gather,
# reduce_scatter and broadcast, Gloo (the best of its algorithms: bench/peers/gloo_allreduce.cpp), f32 (sum) on loopback, taking turns ROUNDS times so that the
# machine's drift hits all of them alike. Prints a markdown table of the medians and every round, and
# writes beside it (in OUT_DIR, default a new temporary folder) compare.md (the table), compare.csv (the
# medians: label,bytes,time_us,busbw) and compare.svg (bench/plot.py: busbw and time against size).
#   bench/compare.sh BUILD_DIR [RANKS] [ROUNDS] [MINBYTES] [MAXBYTES] [COLLECTIVE] [OUT_DIR]
# The peers are not installed by tools/quickstart.sh bench; this script says what to install.
# GLOO=0 leaves Gloo out (its rounds take minutes at many iterations of small sizes).
# MPI_BTL picks Open MPI's path (default tcp,self; vader,self is its shared memory on one host, the
# peer to weft's WEFT_TRANSPORT=shm, which weft-run passes on to the ranks). ITERS (default 20) sets the
# timed iterations per size of every side (more steadies the small sizes). COLLECTIVE all_gatherv or
# all_to_allv compares the variable-size forms (equal counts: weft-bench --variable, MPI_Allgatherv,
# MPI_Alltoallv). WEFT_BENCH_FLAGS adds flags to weft-bench (e.g. --await). INPLACE=1 takes weft's
# in-place runs instead of its out-of-place ones: for broadcast, whose weft-bench "out of place" copies
# the root's input into its buffer before every call, while MPI_Bcast (the peer's) works in place.
set -euo pipefail
build=$1
ranks=${2:-2}
rounds=${3:-3}
min=${4:-1024}
max=${5:-268435456}
collective=${6:-all_reduce}
out=${7:-$(mktemp -d)}
iters=${ITERS:-20}
mkdir -p "$out"
if ! command -v mpirun >/dev/null || [ ! -x "$build/bench/mpi-allreduce-bench" ]; then
  echo "compare.sh: Open MPI is missing (no mpirun, or $build/bench/mpi-allreduce-bench was not built). Install it with" >&2
  echo "  apt-get install openmpi-bin libopenmpi-dev && meson setup --reconfigure $build && ninja -C $build" >&2
  echo "(meson's summary, section Peers, says why a peer was not built)" >&2
  exit 2
fi
weft_collective=$collective
weft_flags=()
case $collective in all_gatherv | all_to_allv) weft_collective=${collective%v}; weft_flags=(--variable) ;; esac
# WEFT_BENCH_FLAGS: more weft-bench flags, e.g. --await (the calls co_awaited from one coroutine).
read -r -a extra_flags <<< "${WEFT_BENCH_FLAGS:-}"
weft_flags+=("${extra_flags[@]}")
gloo_has=0
case $collective in all_reduce | all_gather | reduce_scatter | broadcast) gloo_has=1 ;; esac
[ "${GLOO:-1}" != 0 ] || gloo_has=0
if [ $gloo_has = 1 ] && [ ! -x "$build/bench/gloo-allreduce-bench" ]; then
  echo "compare.sh: Gloo is missing, its columns stay empty (apt-get install libgloo-dev, then reconfigure as above)" >&2
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
btl=${MPI_BTL:-tcp,self}
export MPI_LABEL="Open MPI ${btl%%,*}"
for round in $(seq 1 "$rounds"); do
  echo "== round $round: weft" >&2
  # Three warm-up calls a size, as the peers' benches make (bench/peers).
  "$build/tools/weft-run" -n "$ranks" -- "$build/bench/weft-bench" -c "$weft_collective" "${weft_flags[@]}" -b "$min" -e "$max" -f 4 -w 3 -n "$iters" \
    --json "$out/weft.$round.json" > "$out/weft.$round.txt"
  echo "== round $round: open mpi" >&2
  oversubscribe=""
  [ "$ranks" -le "$(nproc)" ] || oversubscribe=--oversubscribe
  mpirun -n "$ranks" $oversubscribe --mca btl "$btl" "$build/bench/mpi-allreduce-bench" "$min" "$max" 4 "$iters" "$collective" > "$out/mpi.$round.txt" 2>/dev/null
  if [ $gloo_has = 1 ] && [ -x "$build/bench/gloo-allreduce-bench" ]; then
    echo "== round $round: gloo" >&2
    "$build/tools/weft-run" -n "$ranks" -- "$build/bench/gloo-allreduce-bench" "$min" "$max" 4 "$iters" "$collective" > "$out/gloo.$round.txt"
  fi
done
python3 - "$out" "$rounds" "$ranks" "$collective" <<'PY' | tee "$out/compare.md"
import csv, json, statistics, sys, glob, os
out, rounds, ranks, collective = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
weft, mpi, gloo = {}, {}, {}
for r in range(1, rounds + 1):
    for rec in json.load(open(f"{out}/weft.{r}.json")):
        if rec["inplace"] == (os.environ.get("INPLACE") == "1"):
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
                gloo.setdefault(int(f[0]), []).append((min(map(float, f[1:-3])), float(f[-2]), f[-1]))
def med(xs, i):
    return statistics.median(x[i] for x in xs) if xs else float("nan")
def size(b):
    for unit, n in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= n: return f"{b // n} {unit}"
    return f"{b} B"
print(f"{collective} f32, {ranks} ranks, one host; median of {rounds} rounds (busbw GB/s, time us)\n")
mpi_label = os.environ.get("MPI_LABEL", "Open MPI tcp")
print(f"| size | weft time | weft busbw | {mpi_label} time | {mpi_label} busbw | Gloo best time | Gloo busbw | weft / MPI busbw | per-round weft / MPI busbw |")
print("|---|---|---|---|---|---|---|---|---|")
# The ratios come from the times (MPI's / weft's, which is weft's busbw over MPI's): the busbw columns
# are printed to 0.001 GB/s, a step of 5-10 % of an 8-byte message's.
def ratio_of(wt, mt):
    return mt / wt if wt > 0 else float("nan")
for b in sorted(weft):
    w, m, g = weft[b], mpi.get(b, []), gloo.get(b, [])
    rounds_txt = " ".join(f"{ratio_of(x[0], y[0]):.2f}" for x, y in zip(w, m))
    ratio = ratio_of(med(w, 0), med(m, 0)) if m else float("nan")
    print(f"| {size(b)} | {med(w,0):.2f} | {med(w,1):.3f} | {med(m,0):.2f} | {med(m,1):.3f} | {med(g,0):.2f} | {med(g,1):.3f} | {ratio:.2f} | {rounds_txt} |")
transport = json.load(open(f"{out}/weft.1.json"))[0].get("transport", "tcp") if weft else "tcp"
with open(f"{out}/compare.csv", "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["label", "bytes", "time_us", "busbw"])
    for label, data in ((f"weft {transport}", weft), (mpi_label, mpi), ("Gloo (best)", gloo)):
        for b in sorted(data):
            w.writerow([f"{label}, {ranks} ranks", b, f"{med(data[b], 0):.3f}", f"{med(data[b], 1):.6f}"])
PY
if /usr/bin/python3 -c 'import matplotlib' 2>/dev/null; then
  "$(dirname "$0")/plot.py" "$out/compare.svg" "$out/compare.csv" --title "$collective f32, $ranks ranks, loopback: median of $rounds rounds" >&2
else
  echo "compare.sh: no plot (apt-get install python3-matplotlib)" >&2
fi
echo "table, medians and plot: $out/compare.md, $out/compare.csv, $out/compare.svg; raw outputs: $out" >&2
