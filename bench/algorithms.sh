#!/usr/bin/env bash
# busbw of every all_reduce algorithm (and of deterministic mode) across sizes, one run, so that the
# built-in selection table is justified by data. Prints a markdown table per rank count.
#   bench/algorithms.sh BUILD_DIR [RANKS...]
set -euo pipefail
build=$1
shift
ranks_list=${*:-2 4}
for ranks in $ranks_list; do
  out=$(mktemp -d)
  variants="ring recursive_doubling rabenseifner tree deterministic"
  for v in $variants; do
    if [ "$v" = deterministic ]; then
      env WEFT_DETERMINISTIC=1 "$build/tools/weft-run" -n "$ranks" -- "$build/bench/weft-bench" -c all_reduce -b 8 -e 64M -f 8 -w 5 -n 20 --json "$out/$v.json" >/dev/null
    else
      env WEFT_ALGO="all_reduce:$v" "$build/tools/weft-run" -n "$ranks" -- "$build/bench/weft-bench" -c all_reduce -b 8 -e 64M -f 8 -w 5 -n 20 --json "$out/$v.json" >/dev/null
    fi
  done
  python3 - "$out" "$ranks" $variants <<'PY'
import json, sys
out, ranks, variants = sys.argv[1], sys.argv[2], sys.argv[3:]
data = {v: {r["bytes"]: r for r in json.load(open(f"{out}/{v}.json")) if not r["inplace"]} for v in variants}
print(f"\nall_reduce f32, {ranks} ranks: time us / busbw GB/s (out of place; deterministic uses the ring's selection for its all-gather)\n")
print("| size | " + " | ".join(variants) + " |")
print("|---" * (len(variants) + 1) + "|")
for b in sorted(data[variants[0]]):
    cells = [f"{data[v][b]['time_us']:.1f} / {data[v][b]['busbw']:.3f}" if b in data[v] else "-" for v in variants]
    print(f"| {b} | " + " | ".join(cells) + " |")
PY
done
