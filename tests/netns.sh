#!/usr/bin/env bash
# Ranks on separate simulated hosts: one network namespace per rank, each with its own address, joined by
# veth pairs to a bridge that lives in a namespace of its own (nothing touches the machine's network).
# Skips (exit 77, with a message) where namespaces cannot be made. Cleans up after itself.
# usage: netns.sh BUILD_DIR
set -u
build=$(cd "$1" && pwd)
n=3
tag=wt$$
subnet=10.231.$(( $$ % 200 )).
sw=${tag}sw

cleanup() {
  for r in $(seq 0 $((n - 1))); do ip netns del "${tag}h$r" 2>/dev/null; done
  ip netns del "$sw" 2>/dev/null
}
trap cleanup EXIT

if ! ip netns add "$sw" 2>/dev/null; then
  echo "SKIPPED: cannot create network namespaces here (need root and iproute2)"
  exit 77
fi
ip -n "$sw" link add br0 type bridge || { echo "SKIPPED: no bridge support"; exit 77; }
ip -n "$sw" link set br0 up
for r in $(seq 0 $((n - 1))); do
  h=${tag}h$r
  ip netns add "$h"
  ip link add "v$tag$r" type veth peer name "p$tag$r"
  ip link set "v$tag$r" netns "$h"
  ip link set "p$tag$r" netns "$sw"
  ip -n "$sw" link set "p$tag$r" master br0
  ip -n "$sw" link set "p$tag$r" up
  ip -n "$h" link set lo up
  ip -n "$h" link set "v$tag$r" name eth0
  ip -n "$h" addr add "${subnet}$((r + 1))/24" dev eth0
  ip -n "$h" link set eth0 up
done
# Wait until the hosts reach each other (bridge ports take a moment to forward).
for try in $(seq 1 50); do
  ip netns exec "${tag}h1" ping -c1 -W1 "${subnet}1" >/dev/null 2>&1 && break
  sleep 0.2
done

port=29555
run_ranks() {  # run_ranks EXTRA_ENV... -- PROGRAM ARGS
  local pids=() rc=0
  for r in $(seq 0 $((n - 1))); do
    ip netns exec "${tag}h$r" env WEFT_RANK=$r WEFT_WORLD_SIZE=$n WEFT_STORE="${subnet}1:$port" "$@" > "/tmp/$tag.$r.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  cat "/tmp/$tag.0.log"
  [ $rc -eq 0 ] || { for r in $(seq 1 $((n - 1))); do echo "--- rank $r"; cat "/tmp/$tag.$r.log"; done; }
  rm -f /tmp/$tag.*.log
  return $rc
}

echo "hosts: ${subnet}1 .. ${subnet}$n"
run_ranks timeout 120 "$build/bench/weft-bench" -c all_reduce -b 4 -e 4M -f 16 -w 1 -n 3 --check || { echo "FAIL: all_reduce across hosts"; exit 1; }
port=29556
run_ranks WEFT_IFNAME=eth0 timeout 120 "$build/bench/weft-bench" -c all_to_all -b 48 -e 1M -f 16 -w 1 -n 3 --check || { echo "FAIL: all_to_all with WEFT_IFNAME"; exit 1; }
echo "ok: ranks on separate hosts"
