# Simulated hosts for the process tests (sourced by netns.sh and faults/faults.sh): one network namespace
# per host, each with its own address on eth0, joined by veth pairs to a bridge that lives in a namespace
# of its own (nothing touches the machine's network).
#   make_hosts TAG SUBNET N   creates hosts ${TAG}h0 .. ${TAG}h(N-1) with addresses ${SUBNET}1 .. ${SUBNET}N;
#                             exits 77 (skipped, with a message) where namespaces cannot be made
#   remove_hosts TAG N        deletes them (call it from an EXIT trap)
make_hosts() {
  local tag=$1 subnet=$2 n=$3
  local sw=${tag}sw
  if ! ip netns add "$sw" 2>/dev/null; then
    echo "SKIPPED: cannot create network namespaces here (need root and iproute2)"
    exit 77
  fi
  ip -n "$sw" link add br0 type bridge || { echo "SKIPPED: no bridge support"; exit 77; }
  ip -n "$sw" link set br0 up
  for r in $(seq 0 $((n - 1))); do
    local h=${tag}h$r
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
}

remove_hosts() {
  local tag=$1 n=$2
  for r in $(seq 0 $((n - 1))); do ip netns del "${tag}h$r" 2>/dev/null; done
  ip netns del "${tag}sw" 2>/dev/null
}
