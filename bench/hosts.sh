#!/usr/bin/env bash
# A collective across simulated hosts whose links are shaped: one network namespace per rank
# (tests/system/hosts.sh: a bridge in a namespace of its own, nothing touches the machine's network),
# each host's eth0 limited to RATE with `tc tbf` (its sending direction: a NIC of that speed). weft (its
# default choice, then every algorithm of the collective through WEFT_ALGO) and Gloo (each of its
# algorithms for the collective: bench/peers/gloo_allreduce.cpp) take turns ROUNDS times; prints the
# median busbw (GB/s) per size for each, and weft's default against Gloo's best. COLL: all_reduce
# (default), all_gather, reduce_scatter, broadcast. Needs root; cleans up its namespaces.
#   [COLL=...] [ITERS=...] bench/hosts.sh BUILD_DIR [RANKS] [RATE] [ROUNDS] [MINBYTES] [MAXBYTES]
# e.g. bench/hosts.sh build 4 1gbit 3 1024 16777216
set -euo pipefail
build=$(cd "$1" && pwd)
n=${2:-4}
rate=${3:-1gbit}
rounds=${4:-3}
min=${5:-1024}
max=${6:-16777216}
iters=${ITERS:-5}
coll=${COLL:-all_reduce}
case $coll in
  all_reduce) algos="default ring bidirectional_ring recursive_doubling rabenseifner tree" ;;
  all_gather) algos="default ring bruck recursive_doubling" ;;
  reduce_scatter) algos="default ring recursive_halving" ;;
  broadcast) algos="default binomial scatter_all_gather chain" ;;
  *) echo "hosts.sh: COLL=$coll: all_reduce, all_gather, reduce_scatter or broadcast" >&2; exit 2 ;;
esac
tag=wb$$
subnet=10.232.$(( $$ % 200 )).
out=$(mktemp -d)
source "$(dirname "$0")/../tests/system/hosts.sh"
port=$((30100 + ($$ % 500) * 50))  # the store's port; Gloo's file store is /tmp/gloo-store-PORT
first_port=$port
trap 'remove_hosts "$tag" $n; rm -rf "$out"; for p in $(seq $first_port $port); do rm -rf /tmp/gloo-store-$p; done' EXIT
make_hosts "$tag" "$subnet" "$n"
for r in $(seq 0 $((n - 1))); do
  ip netns exec "${tag}h$r" tc qdisc add dev eth0 root tbf rate "$rate" burst 512kb latency 100ms
done
ranks() {  # ranks LOG ENV... -- runs one program per host, waits, keeps rank 0's output in LOG
  local log=$1 pids=() rc=0
  shift
  port=$((port + 1))
  rm -rf "/tmp/gloo-store-$port"
  for r in $(seq 0 $((n - 1))); do
    ip netns exec "${tag}h$r" env WEFT_RANK=$r WEFT_WORLD_SIZE=$n WEFT_STORE="${subnet}1:$port" GLOO_HOSTNAME="${subnet}$((r + 1))" \
      WEFT_TRANSPORT=tcp "$@" > "$out/rank$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  [ $rc -eq 0 ] || { cat "$out"/rank*.log; echo "hosts.sh: a run failed" >&2; exit 1; }
  cp "$out/rank0.log" "$log"
}
for round in $(seq 1 "$rounds"); do
  for a in $algos; do
    echo "== round $round: weft $a" >&2
    extra=()
    [ "$a" = default ] || extra=(WEFT_ALGO="$coll:$a")
    ranks "$out/weft.$a.$round.txt" "${extra[@]}" timeout 600 "$build/bench/weft-bench" -c "$coll" -b "$min" -e "$max" -f 4 -w 1 -n "$iters" \
      --json "$out/weft.$a.$round.json"
  done
  if [ -x "$build/bench/gloo-allreduce-bench" ]; then
    echo "== round $round: gloo" >&2
    ranks "$out/gloo.$round.txt" timeout 600 "$build/bench/gloo-allreduce-bench" "$min" "$max" 4 "$iters" "$coll"
  fi
done
python3 - "$out" "$rounds" "$n" "$rate" "$coll" $algos <<'PY'
import json, os, statistics, sys
out, rounds, n, rate, coll, algos = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6:]
weft = {a: {} for a in algos}
chosen = {}
for a in algos:
    for r in range(1, rounds + 1):
        for rec in json.load(open(f"{out}/weft.{a}.{r}.json")):
            if rec["inplace"]:
                continue
            weft[a].setdefault(rec["bytes"], []).append(rec["busbw"])
            if a == "default":
                chosen[rec["bytes"]] = rec.get("algorithm", "?")
gloo_names = {"all_reduce": ["ring", "ring_chunked", "halving_doubling", "bcube"], "all_gather": ["ring", "allgather"],
              "broadcast": ["one_to_all", "broadcast"], "reduce_scatter": ["halving_doubling"]}[coll]
bus = {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0}.get(coll, (n - 1) / n)
gloo = {}
for r in range(1, rounds + 1):
    path = f"{out}/gloo.{r}.txt"
    if not os.path.exists(path):
        continue
    for line in open(path):
        f = line.replace("[0]", "").split()
        if f and f[0].isdigit():
            b = int(f[0])
            for i, name in enumerate(gloo_names):
                us = float(f[1 + i])
                gloo.setdefault(b, {}).setdefault(name, []).append(b / us / 1e3 * bus)
med = lambda xs: statistics.median(xs) if xs else float("nan")
def size(b):
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= k: return f"{b // k} {unit}"
    return f"{b} B"
print(f"{coll} f32, {n} simulated hosts, links shaped to {rate}; busbw GB/s, median of {rounds} rounds\n")
head = ["size", "weft (choice)"] + [f"weft {a}" for a in algos[1:]] + [f"Gloo {g}" for g in gloo_names] + ["weft / best Gloo"]
print("| " + " | ".join(head) + " |")
print("|" + "---|" * len(head))
for b in sorted(weft["default"]):
    row = [size(b), f"{med(weft['default'][b]):.3f} ({chosen.get(b, '?')})"]
    row += [f"{med(weft[a].get(b, [])):.3f}" for a in algos[1:]]
    g = {name: med(gloo.get(b, {}).get(name, [])) for name in gloo_names}
    row += [f"{g[name]:.3f}" for name in gloo_names]
    best = max((v for v in g.values() if v == v), default=float("nan"))
    row.append(f"{med(weft['default'][b]) / best:.2f}" if best == best and best > 0 else "nan")
    print("| " + " | ".join(row) + " |")
PY
