#!/usr/bin/env bash
# Side by side in one run: weft-bench (by default all_reduce, f32 sum, RANKS ranks, 8 B to 64 MiB) under several
# variants taking turns in each of ROUNDS rounds, so that the machine's drift hits them alike. A variant
# is LABEL=BUILD_DIR[:VAR=VALUE...]: another build (before/after a change) or other settings (WEFT_*).
# Prints the median out-of-place time and busbw per size and variant, and each variant's time against
# the first's, paired by round (the median of the per-round ratios).
#   bench/ab.sh ROUNDS RANKS LABEL=BUILD[:VAR=VALUE...] LABEL=BUILD[:VAR=VALUE...] ...
# e.g. bench/ab.sh 5 2 before=/tmp/before/build after=build
#      bench/ab.sh 5 2 off=build crc32c=build:WEFT_INTEGRITY=crc32c
# AB_INPLACE=1 reports the in-place runs instead of the out-of-place ones; AB_INPLACE=both, both.
# AB_ARGS replaces the weft-bench arguments (default: all_reduce, 8 B to 64 MiB), e.g.
#      AB_ARGS="-c broadcast -b 8 -e 2K -f 4 -w 100 -n 2000" bench/ab.sh 5 4 before=/tmp/before after=build:WEFT_TRANSPORT=shm
set -euo pipefail
read -r -a bench_args <<< "${AB_ARGS:--c all_reduce -b 8 -e 64M -f 8 -w 3 -n 20}"
rounds=$1
ranks=$2
shift 2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
labels=()
for round in $(seq 1 "$rounds"); do
  for variant in "$@"; do
    label=${variant%%=*}
    rest=${variant#*=}
    IFS=: read -r -a parts <<< "$rest"
    build=${parts[0]}
    [ "$round" = 1 ] && labels+=("$label")
    env "${parts[@]:1}" "$build/tools/weft-run" -n "$ranks" -- "$build/bench/weft-bench" \
      "${bench_args[@]}" --check --json "$out/$label.$round.json" >/dev/null
  done
done
python3 - "$out" "$rounds" "$ranks" "${labels[@]}" <<'PY'
import json, os, statistics, sys
out, rounds, ranks, labels = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:]
mode = os.environ.get("AB_INPLACE", "0")
for inplace in ([False, True] if mode == "both" else [mode == "1"]):
    rows, transports = {}, set()
    for label in labels:
        for r in range(1, rounds + 1):
            for rec in json.load(open(f"{out}/{label}.{r}.json")):
                if bool(rec["inplace"]) != inplace:
                    continue
                assert rec["wrong"] == 0, rec
                transports.add(rec["transport"])
                rows.setdefault(rec["bytes"], {}).setdefault(label, []).append((rec["time_us"], rec["busbw"]))
    print(f"{ranks} ranks, {'/'.join(sorted(transports))}, {'in place' if inplace else 'out of place'}, median of {rounds} interleaved rounds (time us / busbw GB/s)")
    # "paired": the median over rounds of each round's time ratio against the first variant, which this
    # machine's drift (up to several times between rounds) moves far less than the medians themselves.
    print("| size | " + " | ".join(labels) + " | " + " | ".join(f"{l} vs {labels[0]} (paired)" for l in labels[1:]) + " |")
    print("|---:|" + "---:|" * (2 * len(labels) - 1))
    for size in sorted(rows):
        m = {k: (statistics.median(t for t, _ in v), statistics.median(b for _, b in v)) for k, v in rows[size].items()}
        cells = [f"{m[l][0]:.2f} / {m[l][1]:.2f}" for l in labels]
        first = [t for t, _ in rows[size][labels[0]]]
        costs = [f"{statistics.median(t / f for (t, _), f in zip(rows[size][l], first)):.2f}" for l in labels[1:]]
        print(f"| {size} | " + " | ".join(cells + costs) + " |")
PY
