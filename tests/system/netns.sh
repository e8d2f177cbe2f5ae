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

source "$(dirname "$0")/hosts.sh"
trap 'remove_hosts "$tag" $n' EXIT
make_hosts "$tag" "$subnet" $n

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

# Across hosts the selection spreads large broadcasts and all_reduces over the links (scatter + all-gather,
# the ring): every rank sees the peers on other hosts and chooses alike, and the results are checked.
port=29558
out=$(run_ranks timeout 120 "$build/bench/weft-bench" -c broadcast -b 64K -e 1M -f 16 -w 1 -n 3 --check) || { echo "$out"; echo "FAIL: broadcast across hosts"; exit 1; }
echo "$out" | grep -Eq "^ *1048576 .* scatter_all_gather *$" && echo "$out" | grep -Eq "^ *65536 .* binomial *$" ||
  { echo "$out"; echo "FAIL: across hosts, a 1 MiB broadcast should take scatter_all_gather and a 64 KiB one binomial"; exit 1; }
port=29559
out=$(run_ranks timeout 120 "$build/bench/weft-bench" -c all_reduce -b 1M -e 1M -w 1 -n 3 --check) || { echo "$out"; echo "FAIL: all_reduce across hosts"; exit 1; }
echo "$out" | grep -Eq "^ *1048576 .* ring *$" || { echo "$out"; echo "FAIL: across hosts, a 1 MiB all_reduce on 3 ranks should take the ring"; exit 1; }
echo "ok: across hosts the selection takes the algorithms that spread the data over the links"

# Two hosts of two ranks each, with shared memory asked for: each rank reaches its host-mate through
# shared memory and the other host's ranks over TCP (a host is a network namespace here: the link offer
# names it by boot id and namespace).
port=29557
pids=()
rc=0
for r in 0 1 2 3; do
  ip netns exec "${tag}h$((r / 2))" env WEFT_RANK=$r WEFT_WORLD_SIZE=4 WEFT_STORE="${subnet}1:$port" WEFT_TRANSPORT=shm \
    WEFT_LOG_LEVEL=info timeout 120 "$build/bench/weft-bench" -c all_reduce -b 4 -e 4M -f 16 -w 1 -n 3 --check \
    > "/tmp/$tag.m$r.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || rc=1; done
for r in 0 1 2 3; do
  grep -q "shared memory with 1 peer(s) on this host" "/tmp/$tag.m$r.log" || { echo "rank $r did not reach exactly its host-mate through shared memory"; rc=1; }
  grep -q "group ready over shm+tcp" "/tmp/$tag.m$r.log" || { echo "rank $r: no shm+tcp group"; rc=1; }
done
[ $rc -eq 0 ] || { for r in 0 1 2 3; do echo "--- rank $r"; cat "/tmp/$tag.m$r.log"; done; rm -f /tmp/$tag.m*.log; echo "FAIL: two hosts of two ranks with shared memory"; exit 1; }
rm -f /tmp/$tag.m*.log
echo "ok: two hosts of two ranks: shared memory within each host, TCP between them, all_reduce checked"
