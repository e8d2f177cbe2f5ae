#!/usr/bin/env bash
# The figures of bench/RESULTS.md, "Frame integrity": all_reduce (f32 sum) on 2 ranks over tcp with
# WEFT_INTEGRITY=off, crc32c and hmac taking turns, ROUNDS rounds; prints the median out-of-place time
# and bus bandwidth per size and mode, and each mode's cost against off.
#   bench/integrity.sh BUILD_DIR [ROUNDS] [TRANSPORT]
set -euo pipefail
build=$1
rounds=${2:-3}
transport=${3:-tcp}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for round in $(seq 1 "$rounds"); do
  for mode in off crc32c hmac; do
    WEFT_TRANSPORT=$transport WEFT_INTEGRITY=$mode "$build/tools/weft-run" -n 2 -- "$build/bench/weft-bench" \
      -c all_reduce -b 8 -e 64M -f 8 -w 3 -n 20 --check --json "$out/$mode.$round.json" >/dev/null
  done
done
python3 - "$out" "$rounds" "$transport" <<'PY'
import json, statistics, sys
out, rounds, transport = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rows = {}
for mode in ("off", "crc32c", "hmac"):
    for r in range(1, rounds + 1):
        for rec in json.load(open(f"{out}/{mode}.{r}.json")):
            if rec["inplace"]:
                continue
            assert rec["wrong"] == 0, rec
            rows.setdefault(rec["bytes"], {}).setdefault(mode, []).append((rec["time_us"], rec["busbw"]))
print(f"all_reduce f32 sum, 2 ranks, {transport}, median of {rounds} interleaved rounds (time us / busbw GB/s)")
print("| size | off | crc32c | hmac | crc32c cost | hmac cost |")
print("|---:|---:|---:|---:|---:|---:|")
for size in sorted(rows):
    m = {k: (statistics.median(t for t, _ in v), statistics.median(b for _, b in v)) for k, v in rows[size].items()}
    cell = lambda k: f"{m[k][0]:.1f} / {m[k][1]:.2f}"
    cost = lambda k: f"{(m[k][0] / m['off'][0] - 1) * 100:+.0f} %"
    print(f"| {size} | {cell('off')} | {cell('crc32c')} | {cell('hmac')} | {cost('crc32c')} | {cost('hmac')} |")
PY
