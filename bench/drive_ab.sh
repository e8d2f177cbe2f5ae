#!/usr/bin/env bash
# A/B of the progress policy: WEFT_DRIVE=1 (the waiting thread runs the loop, the default) against
# WEFT_DRIVE=0 (the loop's own thread alone), all_reduce f32 8 B..8 MiB, interleaved rounds, medians of
# the time per call (in and out of place pooled).
#   bench/drive_ab.sh BUILD_DIR [RANKS] [ROUNDS] [ITERS]
set -euo pipefail
build=$1
ranks=${2:-2}
rounds=${3:-4}
iters=${4:-100}
out=$(mktemp -d)
for r in $(seq 1 "$rounds"); do
  for d in 1 0; do
    WEFT_DRIVE=$d "$build/tools/weft-run" -n "$ranks" -- "$build/bench/weft-bench" -b 8 -e 8M -f 4 -w 10 -n "$iters" \
      --json "$out/$d.$r.json" >/dev/null
  done
done
python3 - "$out" "$ranks" "$rounds" <<'PY'
import glob, json, statistics, sys
out, ranks, rounds = sys.argv[1], sys.argv[2], sys.argv[3]
times = {}
for d in "10":
    for path in glob.glob(f"{out}/{d}.*.json"):
        for rec in json.load(open(path)):
            times.setdefault((rec["bytes"], d), []).append(rec["time_us"])
print(f"all_reduce f32, {ranks} ranks, median of {rounds} interleaved rounds\n")
print("| size (B) | WEFT_DRIVE=1 us | WEFT_DRIVE=0 us | 0 / 1 |")
print("|---|---|---|---|")
for b in sorted({k[0] for k in times}):
    a, z = statistics.median(times[(b, "1")]), statistics.median(times[(b, "0")])
    print(f"| {b} | {a:.1f} | {z:.1f} | {z / a:.2f} |")
PY
