#!/usr/bin/env bash
# The test suite built with ASan + UBSan (g++), in BUILD_DIR: the suites that exercise failure paths,
# hostile input and concurrency. `all` runs every test of the suite there instead (docs/RELIABILITY.md).
# usage: sanitize.sh SOURCE_DIR BUILD_DIR [all | tsan]
set -u
src=$(cd "$1" && pwd)
out=$2
scope=${3:-ci}
# A failed run's report: every failed assertion with the lines around it (Catch2 prints them where they
# happen, often far above the end), then the end of the output.
report() {
  grep -n -B4 -A16 -E 'FAILED|ERROR: AddressSanitizer|runtime error:|ThreadSanitizer' <<< "$1" | head -200
  echo "-- the end of the output:"
  tail -40 <<< "$1"
}
# `tsan`: ThreadSanitizer over the shared-memory suites (the rings, the arena, the collectives and the
# error suites over WEFT_TRANSPORT=shm, ranks as threads of one process, so that TSan sees both sides of
# every shared word). Run by hand (docs/RELIABILITY.md, "Sanitizers"): it is not CI's.
if [ "$scope" = tsan ]; then
  if [ ! -f "$out/build.ninja" ]; then
    meson setup "$out" "$src" -Db_sanitize=thread --buildtype=debugoptimized -Dcuda=disabled -Dpeers=disabled \
      -Ddefault_library=static >/dev/null || exit 1
  fi
  ninja -C "$out" -j2 tests/test_core tests/test_shm tests/test_collectives tests/test_errors tests/test_gpu tests/test_device tests/test_peer >/dev/null || exit 1
  export TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1
  rc=0
  # run_over TRANSPORT CASE...: each CASE ("test_x [tag]") with WEFT_TRANSPORT=TRANSPORT; a failure is
  # reported and counted in rc.
  run_over() {
    local transport=$1 t start
    shift
    for t in "$@"; do
      start=$SECONDS
      # $t unquoted on purpose: the test's binary, then its tag.
      if log=$(WEFT_TRANSPORT=$transport "$out/tests/"$t 2>&1); then
        echo "ok: $t over $transport ($((SECONDS - start)) s)"
      else
        report "$log"
        echo "FAIL: $t over $transport"
        rc=1
      fi
    done
  }
  # test_core's loop, Future and combinator cases first: the loop's borrow (one word changed by
  # compare-and-swap, several threads waiting, starting and refused on one loop), the Futures' Dekker
  # with sleepers, children of when_all / when_any finishing on other loops' threads, and async_wait's
  # outcomes crossing to an io_context's thread.
  run_over shm "test_core [loop]" "test_core [future]" "test_core [when]" "test_core [asio]" "test_shm" "test_collectives [p2]" "test_collectives [p4]" "test_collectives [inflight]" \
    "test_errors [cancel]" "test_errors [peer]" "test_errors [timeout]" "test_errors [mismatch]" "test_errors [abort]"
  # The device layer and device buffers on the simulated device (its workers are threads too), with
  # random delays so that the streams, gates and the loop interleave.
  # The multi-device all_reduce's barrier (kernels/peer): a thread per (device, block); a release or an
  # acquire too weak shows as a race on the data it orders.
  for t in "test_peer" "test_gpu ~[fail]" "test_device ~[device-failure]"; do
    start=$SECONDS
    if log=$(WEFT_GPU=sim WEFT_SIM_DEVICES=4 WEFT_SIM_DELAY_US=100 "$out/tests/"$t 2>&1); then
      echo "ok: $t on the simulated device ($((SECONDS - start)) s)"
    else
      report "$log"
      echo "FAIL: $t on the simulated device"
      rc=1
    fi
  done
  # Pipelined staging: pieces copying in and ranges copying back while the plan runs.
  start=$SECONDS
  if log=$(WEFT_GPU=sim WEFT_SIM_DEVICES=4 WEFT_SIM_DELAY_US=100 WEFT_STAGING_COPY_BYTES=4096 WEFT_SEGMENT_BYTES=1024 \
           WEFT_ALGO='all_reduce:ring;broadcast:scatter_all_gather' "$out/tests/test_device" '[collectives],[order],[cancel]' 2>&1); then
    echo "ok: test_device pipelined on the simulated device ($((SECONDS - start)) s)"
  else
    report "$log"
    echo "FAIL: test_device pipelined on the simulated device"
    rc=1
  fi
  # all_reduce on device windows (WEFT_DEVICE_IPC=1): the ranks' instances of the peer kernel on the sim's
  # workers read each other's windows while the loop's watcher may abort them; over tcp and shm, and a
  # device failing under it.
  for spec in "tcp|[collectives],[order],[cancel],[windows]" "shm|[collectives],[order],[windows]" "tcp|[device-failure]"; do
    start=$SECONDS
    fail_env=""
    [ "${spec#*|}" = "[device-failure]" ] && fail_env="WEFT_SIM_FAIL=40"
    if log=$(env $fail_env WEFT_GPU=sim WEFT_SIM_DEVICES=4 WEFT_SIM_DELAY_US=100 WEFT_DEVICE_IPC=1 WEFT_TRANSPORT=${spec%%|*} \
             "$out/tests/test_device" "${spec#*|}" 2>&1); then
      echo "ok: test_device ${spec#*|} on device windows over ${spec%%|*} ($((SECONDS - start)) s)"
    else
      report "$log"
      echo "FAIL: test_device ${spec#*|} on device windows over ${spec%%|*}"
      rc=1
    fi
  done
  # Single copy: the receiver reads the sender's memory while its send is lent. And the group arena's
  # direct reads at every size: ranks read each other's buffers (process_vm_readv, which TSan does not
  # see) between the supersteps' atomics, loans revoked by the cancels. SETTING|WHAT|TEST;TEST...
  for spec in "WEFT_SHM_CMA_BYTES=4096|single copy|test_shm [stream];test_collectives [p2];test_errors [cancel]" \
              "WEFT_SHM_ARENA_CMA_BYTES=1|the arena's direct reads at every size|test_shm [arena];test_collectives [p2];test_collectives [p3];test_errors [cancel]"; do
    IFS='|' read -r setting what tests <<< "$spec"
    IFS=';' read -r -a cases <<< "$tests"
    for t in "${cases[@]}"; do
      start=$SECONDS
      if log=$(env WEFT_TRANSPORT=shm "$setting" "$out/tests/"$t 2>&1); then
        echo "ok: $t over shm with $what ($((SECONDS - start)) s)"
      else
        report "$log"
        echo "FAIL: $t over shm with $what"
        rc=1
      fi
    done
  done
  # io_uring (where built): under caller-driven progress any waiting thread submits, and a thread that
  # ends hands its requests to the loop (uring_ring.cpp, "a submitter that ends"); thread-hop waits
  # from a new thread per call, then from two threads taking turns.
  if grep -q "WEFT_HAVE_URING 1" "$out/weft_config.h"; then
    ninja -C "$out" -j2 tools/weft-run tests/weft-test-worker >/dev/null || exit 1
    run_over uring "test_core [uring]" "test_collectives [p2]" "test_collectives [inflight]" "test_errors [cancel]" "test_errors [peer]"
    start=$SECONDS
    if log=$(WEFT_TRANSPORT=uring "$out/tools/weft-run" -n 2 --timeout 900 -- "$out/tests/weft-test-worker" thread-hop 300 2>&1) &&
       ! grep -q ThreadSanitizer <<< "$log"; then
      echo "ok: weft-test-worker thread-hop over uring ($((SECONDS - start)) s)"
    else
      report "$log"
      echo "FAIL: weft-test-worker thread-hop over uring"
      rc=1
    fi
  fi
  exit $rc
fi
# CI's share compiles at -O0: four times faster to build here (Asio's coroutine-heavy files take 80 s
# each at -O2 under ASan), and its tests are short. The whole suite runs optimized.
buildtype=debug
[ "$scope" = all ] && buildtype=debugoptimized
if [ ! -f "$out/build.ninja" ]; then
  meson setup "$out" "$src" -Db_sanitize=address,undefined --buildtype=$buildtype -Dcuda=disabled -Dpeers=disabled \
    -Ddefault_library=static >/dev/null || exit 1
fi
# Asio's thread_info_base frees an aligned_alloc block with operator delete (not weft's code).
export ASAN_OPTIONS=alloc_dealloc_mismatch=0:detect_leaks=1:abort_on_error=0
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
if [ "$scope" = all ]; then
  ninja -C "$out" -j2 >/dev/null || exit 1
  meson test -C "$out" --num-processes 1 --timeout-multiplier 4 --print-errorlogs --no-suite fuzz --no-suite sanitize
  exit $?
fi
# CI's share (the whole suite under ASan: docs/RELIABILITY.md): the suites of failures and hostile input, and every
# collective through the worker's checked soak and the kill-peer processes.
ninja -C "$out" -j2 tests/test_core tests/test_errors tests/test_security tests/test_gpu tests/test_device tests/weft-test-worker \
  tools/weft-run >/dev/null || exit 1
rc=0
run() {
  local name=$1
  shift
  local start=$SECONDS
  if out_text=$("$@" 2>&1); then
    echo "ok: $name ($((SECONDS - start)) s)"
  else
    report "$out_text"
    echo "FAIL: $name"
    rc=1
  fi
}
t=$out/tests
# Two lanes side by side: the error suites mostly wait (deadlines, sleeps, peers that never come) and
# the soaks and the simulated device's suites compute, so each lane gets one kind; one after the other
# they took 366 of the step's 666 s in CI. Each lane says what it ran when it ends.
lane_errors() {
  for transport in tcp uring; do
    run "errors ($transport)" env WEFT_TRANSPORT=$transport "$t/test_errors" "~[leaks]"
    # Tests that abandon an operation's frames by design (a Loop that ends under them): leaks not counted.
    run "errors, abandoned frames ($transport)" env WEFT_TRANSPORT=$transport \
      ASAN_OPTIONS=alloc_dealloc_mismatch=0:detect_leaks=0:abort_on_error=0 "$t/test_errors" "[leaks]"
  done
  # Over shm: a cancelled arena collective's background supersteps (leaks counted: they held the group).
  run "errors, cancel (shm)" env WEFT_TRANSPORT=shm "$t/test_errors" "[cancel]"
  run "security" "$t/test_security"
  run "4 ranks, kill -9 of one (processes)" bash "$src/tests/system/processes.sh" "$out" kill-peer
  return $rc
}
lane_computing() {
  run "core" "$t/test_core"
  for transport in tcp uring; do
    run "soak: 2000 random checked collectives on 4 ranks ($transport)" env WEFT_TRANSPORT=$transport \
      "$out/tools/weft-run" -n 4 --timeout 300 -- "$t/weft-test-worker" soak 2000
  done
  run "gpu layer (sim, delays)" env WEFT_GPU=sim WEFT_SIM_DELAY_US=100 "$t/test_gpu" '~[fail]'
  run "device buffers in every operation (sim)" env WEFT_GPU=sim WEFT_SIM_DEVICES=4 "$t/test_device" '~[device-failure]'
  run "a device failing mid-collective (sim)" env WEFT_GPU=sim WEFT_SIM_DEVICES=4 WEFT_SIM_FAIL=40 "$t/test_device" '[device-failure]'
  run "device buffers, pipelined staging (sim)" env WEFT_GPU=sim WEFT_SIM_DEVICES=4 WEFT_STAGING_COPY_BYTES=4096 WEFT_SEGMENT_BYTES=1024 \
    WEFT_ALGO='all_reduce:ring;broadcast:scatter_all_gather' "$t/test_device" '[collectives],[order],[cancel]'
  return $rc
}
lanes=$(mktemp -d)
trap 'rm -rf "$lanes"' EXIT
lane_errors > "$lanes/errors" 2>&1 &
errors_lane=$!
lane_computing > "$lanes/computing" 2>&1 &
computing_lane=$!
wait $errors_lane || rc=1
wait $computing_lane || rc=1
cat "$lanes/errors" "$lanes/computing"
exit $rc
