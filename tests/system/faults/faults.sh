#!/usr/bin/env bash
# Fault tests with ranks as processes (docs/RELIABILITY.md quotes what they print).
# usage: faults.sh BUILD_DIR CASE [TRANSPORT]
#   kill TRANSPORT       for every collective: kill -9 one random rank of 4 at a random point; every survivor
#                        must fail naming it within the deadline + 1 s, shrink, and run checked collectives
#   stop TRANSPORT       SIGSTOP one random rank of 4 during a collective: every survivor's error must name
#                        it (the deadline's straggler report) within the deadline + 1 s of the later of
#                        the stop and its call; then shrink
#   kill-fast TRANSPORT  kill -9 of one rank of 4 in a loop of small all_reduces, in the middle of a 64 MiB
#                        all_reduce (on 4 ranks and on 2) and of an all_gather of 32 MiB blocks, and while the others wait for it asleep: every survivor must fail naming
#                        it within 100 ms (400 ms for 64 MiB; no deadline involved: WEFT_TIMEOUT=60s), and nothing is left in
#                        /dev/shm (shared memory: the unix socket's end is the signal)
#   strangers            strangers connect to the store and to every rank's listening port during the
#                        bootstrap (garbage, silence, a hang-up); the job must not notice, the ranks log them
#   secret               a rank with another WEFT_SECRET is refused; the others name it
#   heartbeat            two ranks on two network namespaces; the link of one is cut: the other must fail
#                        with the heartbeat's error, long before its deadline
#   soak N               N random checked collectives on 4 ranks; resident memory must stay flat
set -u
build=$(cd "$1" && pwd)
case_name=$2
transport=${3:-tcp}
worker=$build/tests/weft-test-worker
run=$build/tools/weft-run
tmp=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -CONT "$p" 2>/dev/null; kill -9 "$p" 2>/dev/null; done
  rm -rf "$tmp"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
now_ms() { date +%s%3N; }
fail() { echo "FAIL: $*"; for f in "$tmp"/*.log; do [ -f "$f" ] && { echo "--- $f"; cat "$f"; }; done; exit 1; }

# start_ranks N PORT ENV... : starts ranks 0..N-1 of `worker ARGS` (ARGS in $worker_args), logs in $tmp/R.log
start_ranks() {
  local n=$1 port=$2
  shift 2
  pids=()
  for r in $(seq 0 $((n - 1))); do
    env WEFT_RANK=$r WEFT_WORLD_SIZE=$n WEFT_STORE=127.0.0.1:$port WEFT_TRANSPORT=$transport "$@" \
      "$worker" $worker_args > "$tmp/$r.log" 2>&1 &
    pids+=($!)
  done
}

# wait_started N: until every rank printed "started" (the group is up), at most 30 s
wait_started() {
  for try in $(seq 1 300); do
    local up=0
    for r in $(seq 0 $(($1 - 1))); do grep -q "started at" "$tmp/$r.log" 2>/dev/null && up=$((up + 1)); done
    [ $up -eq "$1" ] && return 0
    sleep 0.1
  done
  fail "the ranks did not start"
}

# wait_ranks SECONDS PIDS...: waits for them; fails if any is still running after SECONDS
wait_ranks() {
  local limit=$1
  shift
  local deadline=$(( $(date +%s) + limit ))
  for p in "$@"; do
    while kill -0 "$p" 2>/dev/null; do
      [ "$(date +%s)" -lt $deadline ] || fail "rank process $p hung"
      sleep 0.05
    done
    wait "$p" 2>/dev/null
  done
}

# check_survivors VICTIM T0 LIMIT_MS WORDS: every rank but VICTIM (of RANKS, default 4) failed at most
# LIMIT_MS after T0 with an error containing WORDS, then shrank to RANKS - 1. Prints the times.
# With FROM_CALL=1 the time counts from the later of the fault and the call of the failed collective
# (its deadline runs from the call; a rank may call it after the fault, when its inputs took a while).
check_survivors() {
  local victim=$1 t0=$2 limit=$3 words=$4 times="" ranks=${RANKS:-4}
  for r in $(seq 0 $((ranks - 1))); do
    [ $r -eq "$victim" ] && continue
    local line at from
    line=$(grep "failed at" "$tmp/$r.log") || fail "rank $r did not fail"
    echo "$line" | grep -qF -- "$words" || fail "rank $r's error does not say '$words': $line"
    at=$(echo "$line" | sed -E 's/.*failed at ([0-9]+).*/\1/')
    from=$t0
    if [ "${FROM_CALL:-0}" = 1 ]; then
      local called
      called=$(echo "$line" | sed -E 's/.*called at ([0-9]+).*/\1/')
      [ "$called" -gt "$from" ] && from=$called
    fi
    [ $((at - from)) -le "$limit" ] || fail "rank $r failed $((at - from)) ms after the fault or its call (limit $limit)"
    times="$times $((at - from))"
    [ "${SHRINK:-1}" = 0 ] || grep -q "shrunk to $((ranks - 1)), ok" "$tmp/$r.log" || fail "rank $r did not shrink and go on"
  done
  echo "$times"
}

# strike SIGNAL DEADLINE COLLECTIVE LIMIT_MS WORDS [ELEMENTS]: RANKS ranks (default 4) loop COLLECTIVE
# (deadline DEADLINE); at a random point one random rank gets SIGNAL; the survivors must fail within
# LIMIT_MS saying WORDS (%d: the victim), shrink to RANKS - 1 and go on. Sets $victim and $times.
strike() {
  local signal=$1 deadline=$2 collective=$3 limit=$4 words=$5 elements=${6:-65536} ranks=${RANKS:-4}
  local port
  port=$(free_port)
  worker_args="loop $collective 1000000 $elements"
  start_ranks "$ranks" "$port" WEFT_TIMEOUT="$deadline" WEFT_FAULT_SHRINK="${SHRINK:-1}"
  wait_started "$ranks"
  sleep "0.$(( RANDOM % 8 + 2 ))"
  victim=$(( RANDOM % ranks ))
  local t0
  t0=$(now_ms)
  kill -"$signal" "${pids[$victim]}"
  # A stop counts from when the victim is seen stopped (on a loaded machine this script can be
  # scheduled late between the clock and the kill, and the stop is delivered when the victim next runs).
  if [ "$signal" = STOP ]; then
    for try in $(seq 1 2000); do
      [ "$(cut -d' ' -f3 "/proc/${pids[$victim]}/stat" 2>/dev/null)" = T ] && break
    done
    t0=$(now_ms)
  fi
  local survivors=()
  for r in $(seq 0 $((ranks - 1))); do [ $r -eq $victim ] || survivors+=("${pids[$r]}"); done
  wait_ranks 40 "${survivors[@]}"
  # shellcheck disable=SC2059
  # (A fail inside $(...) ends only the subshell: its FAIL line comes back in the output, and ends us here.)
  times=$(check_survivors $victim "$t0" "$limit" "$(printf "$words" $victim)")
  case $times in *FAIL:*) echo "$times"; exit 1 ;; esac
  kill -9 "${pids[$victim]}" 2>/dev/null
  kill -CONT "${pids[$victim]}" 2>/dev/null
  wait "${pids[$victim]}" 2>/dev/null
  rm -f "$tmp"/*.log
}

case $case_name in
  kill)
    for c in all_reduce all_gather reduce_scatter broadcast reduce gather scatter all_to_all barrier; do
      strike KILL 5s "$c" 6000 "connection to rank %d lost"
      echo "ok: kill -9 of rank $victim during $c ($transport): survivors failed after [$times ] ms, shrank to 3 and went on"
    done
    ;;
  stop)
    # From the later of the stop and the survivor's call: its deadline runs from its call, and a
    # survivor may call a collective well after the kill (CI once saw all three call the next broadcast
    # 2.76 s after it, the previous one complete and checked; not reproduced here, loaded or not).
    for c in all_reduce all_gather broadcast all_to_all; do
      FROM_CALL=1 strike STOP 2s "$c" 3000 "rank %d (no answer within"
      echo "ok: SIGSTOP of rank $victim during $c ($transport, WEFT_TIMEOUT=2s): survivors failed after [$times ] ms naming it, shrank to 3 and went on"
    done
    ;;
  stop-large)
    # A rank stopped in the middle of 64 MiB frames, far beyond the socket buffers, so that survivors are
    # stuck writing to it and reading a payload from it; nothing here kills the survivors (as mpirun,
    # srun and torchrun do not). Every survivor must fail within the deadline + 1 s. (No shrink here: after
    # a stop in the middle of 64 MiB frames, shrink() sometimes left live members out; docs/RELIABILITY.md.)
    for c in all_reduce broadcast all_gather; do
      SHRINK=0 FROM_CALL=1 strike STOP 5s "$c" 6000 "rank %d (no answer within" 8388608
      echo "ok: SIGSTOP of rank $victim mid-transfer of 64 MiB during $c ($transport, WEFT_TIMEOUT=5s): survivors failed [$times ] ms after the fault or their call, naming it"
    done
    ;;
  kill-fast)
    before=$(ls -A /dev/shm 2>/dev/null | sort)
    strike KILL 60s all_reduce 100 "connection to rank %d lost" 16
    echo "ok: kill -9 of rank $victim in a loop of 128-byte all_reduces ($transport): survivors failed after [$times ] ms"
    # (From the later of the kill and the call: a survivor may be filling or checking its 64 MiB then.
    # 400 ms, not 100: the kernel frees a killed process's memory before it closes its descriptors, and
    # the victim's hundreds of MiB took 57-161 ms of that here; its socket's end is the first sign.)
    FROM_CALL=1 strike KILL 60s all_reduce 400 "connection to rank %d lost" 8388608
    echo "ok: kill -9 of rank $victim in the middle of 64 MiB all_reduces ($transport): survivors failed [$times ] ms after the kill or their call"
    # all_gather of 32 MiB blocks: over shm the survivors read the victim's input straight out of its
    # memory (the arena's direct reads); a read from a process being torn down is its death too.
    FROM_CALL=1 strike KILL 60s all_gather 400 "connection to rank %d lost" 8388608
    echo "ok: kill -9 of rank $victim in the middle of all_gathers of 32 MiB blocks ($transport): survivors failed [$times ] ms after the kill or their call"
    # 2 ranks, 64 MiB all_reduces: over shm the arena reads the peer's input and then its output straight
    # out of its memory (the direct all_reduce, 2 ranks from 2 MiB).
    RANKS=2 FROM_CALL=1 strike KILL 60s all_reduce 400 "connection to rank %d lost" 16777216
    echo "ok: kill -9 of rank $victim of 2 in the middle of 64 MiB all_reduces ($transport): the survivor failed [$times ] ms after the kill or its call"
    # The victim pauses before its collective #5 while the others wait in it, their loops asleep.
    victim=$(( RANDOM % 4 ))
    port=$(free_port)
    worker_args="loop all_reduce 1000000 1001"
    start_ranks 4 "$port" WEFT_TIMEOUT=60s WEFT_FAULT_SHRINK=1 WEFT_TEST_PAUSE="$victim:5:30000"
    wait_started 4
    for try in $(seq 1 100); do grep -q "pausing at" "$tmp/$victim.log" && break; sleep 0.05; done
    grep -q "pausing at" "$tmp/$victim.log" || fail "rank $victim did not pause"
    sleep 0.5  # long past any polling: the others sleep in the kernel
    t0=$(now_ms)
    kill -KILL "${pids[$victim]}"
    survivors=()
    for r in 0 1 2 3; do [ $r -eq $victim ] || survivors+=("${pids[$r]}"); done
    wait_ranks 40 "${survivors[@]}"
    times=$(check_survivors $victim "$t0" 100 "connection to rank $victim lost")
    case $times in *FAIL:*) echo "$times"; exit 1 ;; esac
    wait "${pids[$victim]}" 2>/dev/null
    echo "ok: kill -9 of rank $victim while the others slept waiting for it ($transport): survivors failed after [$times ] ms"
    after=$(ls -A /dev/shm 2>/dev/null | sort)
    [ "$before" = "$after" ] || fail "/dev/shm changed: before [$before], after [$after]"
    echo "ok: nothing left in /dev/shm"
    ;;
  strangers)
    port=$(free_port)
    worker_args="loop all_reduce 20 1001"
    pids=()
    for r in 0 1 2; do
      env WEFT_RANK=$r WEFT_WORLD_SIZE=4 WEFT_STORE=127.0.0.1:$port WEFT_LOG_LEVEL=debug WEFT_BOOTSTRAP_TIMEOUT=60 \
        "$worker" $worker_args > "$tmp/$r.log" 2>&1 &
      pids+=($!)
    done
    # Every port that listens now: the store's and ranks 0-2's (rank 3 has not come yet).
    ports="$port"
    for try in $(seq 1 100); do
      n=$(grep -h "listening on" "$tmp"/*.log 2>/dev/null | wc -l)
      [ "$n" -ge 3 ] && break
      sleep 0.1
    done
    ports="$ports $(grep -h "listening on" "$tmp"/*.log | sed -E 's/.* port ([0-9]+)$/\1/' | tr '\n' ' ')"
    python3 - $ports <<'PY' || fail "the strangers could not connect"
import os, socket, sys
for port in map(int, sys.argv[1:]):
    s = socket.create_connection(("127.0.0.1", port)); s.sendall(os.urandom(4096))                 # garbage
    s2 = socket.create_connection(("127.0.0.1", port))                                              # silence
    s3 = socket.create_connection(("127.0.0.1", port)); s3.close()                                  # a hang-up
    s4 = socket.create_connection(("127.0.0.1", port)); s4.sendall(b"GET / HTTP/1.0\r\n\r\n")      # another protocol
    # keep the silent ones open while the job runs; the process exits when the test does
    globals().setdefault("keep", []).extend([s, s2, s4])
import time; time.sleep(0.5)
PY
    env WEFT_RANK=3 WEFT_WORLD_SIZE=4 WEFT_STORE=127.0.0.1:$port WEFT_LOG_LEVEL=debug "$worker" $worker_args > "$tmp/3.log" 2>&1 &
    pids+=($!)
    wait_ranks 60 "${pids[@]}"
    for r in 0 1 2 3; do grep -q "completed 20" "$tmp/$r.log" || fail "rank $r did not complete"; done
    refused=$(grep -h "refused a connection from 127.0.0.1" "$tmp"/*.log | wc -l)
    [ "$refused" -ge 8 ] || fail "only $refused strangers were logged"
    grep -h "refused a connection from" "$tmp"/*.log | sed -E 's/^\[[^]]*\] \[weft\] \[[a-z]+\] //' | sort | uniq -c | sed -E 's/127.0.0.1:[0-9]+/127.0.0.1:PORT/' | head -8
    echo "ok: strangers on $(echo $ports | wc -w) ports ($refused refusals logged); the job completed"
    ;;
  secret)
    port=$(free_port)
    worker_args="loop all_reduce 5 100"
    pids=()
    for r in 0 1 2; do
      s=right; [ $r -eq 2 ] && s=wrong
      env WEFT_RANK=$r WEFT_WORLD_SIZE=3 WEFT_STORE=127.0.0.1:$port WEFT_SECRET=$s WEFT_BOOTSTRAP_TIMEOUT=3 \
        "$worker" $worker_args > "$tmp/$r.log" 2>&1 &
      pids+=($!)
    done
    wait_ranks 30 "${pids[@]}"
    grep -q "the store at 127.0.0.1:$port: the proof of the shared secret from the store does not match" "$tmp/2.log" || fail "rank 2 not told"
    grep -q "ranks \[2\] never arrived" "$tmp/0.log" || fail "rank 0 does not name rank 2"
    grep -q "store: refused a connection from 127.0.0.1:.*shared secret" "$tmp/0.log" || fail "the store did not log it"
    grep -h "bootstrap" "$tmp/2.log" "$tmp/0.log" | head -3
    echo "ok: a wrong secret is refused and named on both sides"
    ;;
  heartbeat)
    tag=wf$$
    subnet=10.232.$(( $$ % 200 )).
    source "$(dirname "$0")/../hosts.sh"
    trap 'cleanup; remove_hosts "$tag" 2' EXIT
    make_hosts "$tag" "$subnet" 2
    pids=()
    for r in 0 1; do
      ip netns exec "${tag}h$r" env WEFT_RANK=$r WEFT_WORLD_SIZE=2 WEFT_STORE="${subnet}1:29577" WEFT_TRANSPORT=$transport \
        WEFT_HEARTBEAT=1s WEFT_TIMEOUT=60s "$worker" loop all_reduce 100000000 16 > "$tmp/$r.log" 2>&1 &
      pids+=($!)
    done
    wait_started 2
    sleep 0.5
    t0=$(now_ms)
    ip -n "${tag}h1" link set eth0 down  # the cable is cut: no FIN, no RST, nothing
    wait_ranks 30 "${pids[0]}"
    line=$(grep "failed at" "$tmp/0.log") || fail "rank 0 did not fail"
    echo "$line" | grep -q "did not acknowledge heartbeats or data in time" || fail "not the heartbeat's error: $line"
    at=$(echo "$line" | sed -E 's/.*failed at ([0-9]+).*/\1/')
    took=$((at - t0))
    [ $took -le 8000 ] || fail "the heartbeat took $took ms"
    echo "$line" | sed -E 's/failed at [0-9]+/failed/'
    echo "ok: a cut link is caught by heartbeats (WEFT_HEARTBEAT=1s) after $took ms, the deadline being 60 s ($transport)"
    ;;
  soak)
    total=${3:-20000}
    transport=tcp
    out=$("$run" -n 4 --timeout 600 -- "$worker" soak "$total" 2>&1) || { echo "$out"; fail "soak"; }
    echo "$out"
    # Resident memory flat: at the end at most 64 MiB above what it was after the first 1000.
    echo "$out" | python3 -c '
import re, sys
ok = True
for line in sys.stdin:
    m = re.search(r"resident (\d+) KiB after 1000, (\d+) KiB at the end", line)
    if m and int(m.group(2)) - int(m.group(1)) > 64 * 1024: ok = False
sys.exit(0 if ok else 1)' || fail "resident memory grew"
    [ "$(echo "$out" | grep -c ", 0 errors,")" -eq 4 ] || fail "not every rank reported"
    ;;
  *)
    echo "usage: faults.sh BUILD_DIR kill|stop|stop-large|strangers|secret|heartbeat|soak [TRANSPORT|N]" >&2
    exit 2
    ;;
esac
