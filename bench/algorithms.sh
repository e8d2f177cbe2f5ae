#!/usr/bin/env bash
# busbw of every algorithm of a collective across sizes (and, for all_reduce, of deterministic mode),
# one run, so that the built-in selection table is justified by data. Prints a markdown table per
# (collective, rank count).
#   bench/algorithms.sh BUILD_DIR COLLECTIVE[,COLLECTIVE...] [RANKS...]
set -euo pipefail
build=$1
collectives=${2:-all_reduce}
shift 2 || true
ranks_list=${*:-2 4}
declare -A variants=(
  [all_reduce]="ring bidirectional_ring recursive_doubling rabenseifner tree deterministic"
  [all_gather]="ring bruck recursive_doubling"
  [all_to_all]="pairwise bruck"
  [reduce_scatter]="ring recursive_halving"
  [broadcast]="binomial scatter_all_gather chain"
  [reduce]="binomial reduce_scatter_gather"
  [gather]="direct binomial"
  [scatter]="direct binomial"
)
for collective in ${collectives//,/ }; do
  for ranks in $ranks_list; do
    out=$(mktemp -d)
    for v in ${variants[$collective]}; do
      if [ "$v" = deterministic ]; then
        env WEFT_DETERMINISTIC=1 "$build/tools/weft-run" -n "$ranks" -- "$build/bench/weft-bench" -c "$collective" -b 8 -e 64M -f 8 -w 5 -n 20 --json "$out/$v.json" >/dev/null
      else
        env WEFT_ALGO="$collective:$v" "$build/tools/weft-run" -n "$ranks" -- "$build/bench/weft-bench" -c "$collective" -b 8 -e 64M -f 8 -w 5 -n 20 --json "$out/$v.json" >/dev/null
      fi
    done
    python3 - "$out" "$ranks" "$collective" ${variants[$collective]} <<'PY'
import json, sys
out, ranks, collective, variants = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
data = {v: {r["bytes"]: r for r in json.load(open(f"{out}/{v}.json")) if not r["inplace"]} for v in variants}
print(f"\n{collective} f32, {ranks} ranks: time us / busbw GB/s (out of place)\n")
print("| size | " + " | ".join(variants) + " |")
print("|---" * (len(variants) + 1) + "|")
for b in sorted(data[variants[0]]):
    cells = [f"{data[v][b]['time_us']:.1f} / {data[v][b]['busbw']:.3f}" if b in data[v] else "-" for v in variants]
    print(f"| {b} | " + " | ".join(cells) + " |")
PY
  done
done
