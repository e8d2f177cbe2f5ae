#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, builds weft with CUDA, runs the device suites on the real
# device, compute-sanitizer (memcheck and synccheck) on them, and the GPU benchmarks (weft-gpu-bench and
# weft-bench --device), writing everything
# (text and JSON) to the directory given as the argument, and a summary line per step.
#
#   tools/gpu_check.sh OUT_DIR          (BUILD=<dir> to use or make another build directory)
#
# The device suites run one test case per process, each under its own bound: a case that hangs costs
# its bound and is named, and the others still run (2026-11-27: one hung case took a whole suite and the
# steps after it). PACK=1 also packs OUT_DIR into OUT_DIR.tar.gz (a channel that returns few files).
# A case that crashes prints its stack, and one stopped at its bound every thread's (tests/support/
# test_main.cpp): `addr2line -f -C -e PROGRAM +OFFSET` on the same binary names the functions.
#
# PREBUILT=1 runs the programs already in BUILD (tests/, bench/, tools/) without configuring or building:
# for a GPU machine that has the driver but not the build's dependencies (their .so files on
# LD_LIBRARY_PATH). Each step has a time limit (seconds, SCALE multiplies them), so one that hangs is
# reported as failed (rc 124) and the others still run.
#
# Needs what the README's build needs plus nvcc (the CUDA toolkit) and a driver. Exits non-zero when a
# step failed; a step whose tool is missing (compute-sanitizer) is reported as skipped, not passed.
set -uo pipefail
# Stopped from outside (a time limit): take every step's processes down too. A hung test left running
# keeps the GPU busy with its spinning kernels and makes whatever runs next on it slow (seen: 10x on
# small device all_reduces after an outer timeout killed this script but not its step).
kill_tree() {  # kill_tree PID: every descendant of PID
  local child
  for child in $(pgrep -P "$1"); do
    kill_tree "$child"
    kill -KILL "$child" 2> /dev/null
  done
}
trap 'kill_tree $$; exit 143' TERM INT
out=${1:?usage: tools/gpu_check.sh OUT_DIR}
src=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$src/build-gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary="$out/summary.txt"
: > "$summary"
rc=0
step() {  # step NAME RC
  local word=passed
  [ "$2" -eq 0 ] || { word="failed (rc $2)"; rc=1; }
  [ "$2" -eq 77 ] && { word="skipped (rc 77)"; rc=1; }
  echo "$1: $word" | tee -a "$summary"
}

limit() {  # limit SECONDS COMMAND...: the command, killed after SECONDS x SCALE
  local s=$(( $1 * ${SCALE:-1} ))
  shift
  # In the background and waited for: bash runs the trap above only once a foreground command ends.
  timeout -k 5 "$s" "$@" &
  wait $!
}

# cases SECONDS NAME PROGRAM FILTER: each Catch2 test case that FILTER selects, in a process of its own
# under its own bound, a step each; their outputs one after the other in $out/NAME.txt.
cases() {
  local s=$1 name=$2 program=$3 filter=$4 t
  : > "$out/$name.txt"
  while IFS= read -r t; do
    [ -n "$t" ] || continue
    echo "=== $t" >> "$out/$name.txt"
    # A comma in a name would split the filter: escaped.
    limit "$s" "$program" "${t//,/\\,}" -d yes >> "$out/$name.txt" 2>&1
    step "$name: $t" $?
  done < <("$program" --list-test-names-only "$filter" 2>/dev/null)
}

{ nvidia-smi || echo "nvidia-smi: not found"; } > "$out/nvidia-smi.txt" 2>&1
if [ -z "${PREBUILT:-}" ]; then
  if [ ! -f "$build/build.ninja" ]; then
    meson setup "$build" -Dcuda=enabled --buildtype=release > "$out/configure.txt" 2>&1
    step configure $?
  fi
  ninja -C "$build" > "$out/build.txt" 2>&1
  step build $?
fi

# The device suites on the real device (WEFT_GPU=cuda: no fallback to the simulated one), a case each.
# ([.ipc-child] is the [ipc] test's other process, run by it.)
export WEFT_GPU=cuda
cases 40 test_gpu "$build/tests/test_gpu" '~[fail]~[.ipc-child]'
unset WEFT_GPU

# The device set's tests again on the naive path (the peer kernels are the default, run above), each
# call named before and after (WEFT_TEST_TRACE=1: where one hangs).
export WEFT_GPU=cuda WEFT_DEVICE_SET=naive WEFT_TEST_TRACE=1
cases 60 test_gpu_set_naive "$build/tests/test_gpu" '[set]'
unset WEFT_GPU WEFT_DEVICE_SET WEFT_TEST_TRACE

# The multi-device groups (ranks driving several devices each): they hung on the H200 until copies
# within a device became a kernel (docs/DESIGN.md, "Copies within a device").
# Each step named as it starts (WEFT_TEST_TRACE=1): where a case hangs or crashes.
export WEFT_GPU=cuda WEFT_TEST_TRACE=1
cases 90 test_device_multi "$build/tests/test_device" '[multi]'
# 200 calls back to back, four times what the case does: the stream's depth (WEFT_GPU_STREAM_DEPTH) keeps
# two ranks on one GPU out of the driver's lock (the H200 hung at 36-50 before it, 2026-12-04).
WEFT_TEST_BACK_TO_BACK=200 cases 180 test_device_multi_200 "$build/tests/test_device" 'a group whose ranks drive several devices*'
unset WEFT_GPU WEFT_TEST_TRACE

if [ -x "$build/tests/test_epilogue_cuh" ]; then
  WEFT_GPU=cuda limit 60 "$build/tests/test_epilogue_cuh" > "$out/test_epilogue_cuh.txt" 2>&1
  step "test_epilogue_cuh (cuda: a user's nvcc epilogue)" $?
fi
# Every operation on device buffers, ranks as threads sharing the device(s), stream-ordered and not.
export WEFT_GPU=cuda WEFT_TEST_TRACE=1
cases 60 test_device "$build/tests/test_device" '~[device-failure]~[multi]'
unset WEFT_GPU WEFT_TEST_TRACE
# Python device arrays on the real device (where the module was built: needs python3-numpy, pybind11).
if [ -f "$build/python/weft/__init__.py" ]; then
  WEFT_GPU=cuda PYTHONPATH="$build/python" limit 60 /usr/bin/python3 -m pytest -q -p no:cacheprovider python/tests -k 'device or dlpack' \
    > "$out/python_device.txt" 2>&1
  step "python device arrays (cuda)" $?
fi
# The same program on the simulated device, for comparison on this machine, a case each (the whole
# program under one 30 s bound timed out on the H200 on 2026-12-04: it takes 33 s on 2 cores, 15 of
# them the device set's 1-8 entries with every delay).
export WEFT_GPU=sim WEFT_SIM_DELAY_US=300
cases 120 test_gpu_sim "$build/tests/test_gpu" '~[fail]~[.ipc-child]'
unset WEFT_GPU WEFT_SIM_DELAY_US

sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$sanitizer" ]; then
  for tool in memcheck synccheck; do
    WEFT_GPU=cuda limit 90 "$sanitizer" --tool "$tool" --error-exitcode 3 "$build/tests/test_gpu" \
      'device reductions equal the CPU kernels on every dtype and op' > "$out/$tool.txt" 2>&1
    step "compute-sanitizer $tool (device reductions)" $?
  done
else
  echo "compute-sanitizer: not found (skipped)" | tee -a "$summary"
  rc=1
fi

# The pipelined staging with its pieces small enough to pipeline every size above 64 KiB, on the device.
WEFT_GPU=cuda WEFT_STAGING_COPY_BYTES=65536 WEFT_ALGO='all_reduce:ring;broadcast:scatter_all_gather' \
  limit 60 "$build/tests/test_device" '[collectives],[order],[large]' > "$out/test_device_pipelined.txt" 2>&1
step "test_device pipelined (cuda)" $?

WEFT_GPU=cuda limit 40 "$build/bench/weft-gpu-bench" --json "$out/gpu_bench.json" > "$out/gpu_bench.txt" 2>&1
step "weft-gpu-bench" $?
cat "$out/gpu_bench.txt"
# The same without the pieces (WEFT_STAGING_COPY_BYTES=0: the serial staging), to see what pipelining wins.
WEFT_GPU=cuda WEFT_STAGING_COPY_BYTES=0 limit 40 "$build/bench/weft-gpu-bench" --runs 1000 --json "$out/gpu_bench_serial_staging.json" \
  > "$out/gpu_bench_serial_staging.txt" 2>&1
step "weft-gpu-bench (serial staging)" $?
grep all_reduce "$out/gpu_bench_serial_staging.txt"
# Pageable copies with the host's half on one thread (WEFT_COPY_THREADS=1, before 2026-11-27) against the
# default split (src/devices/host_copy.cpp), interleaved, the copies only.
for round in 1 2 3; do
  for threads in 1 default; do
    if [ $threads = default ]; then unset WEFT_COPY_THREADS; else export WEFT_COPY_THREADS=$threads; fi
    WEFT_GPU=cuda limit 20 "$build/bench/weft-gpu-bench" --runs 200 > "$out/gpu_bench_copy_threads_${threads}_$round.txt" 2>&1
    step "weft-gpu-bench (copy threads $threads, round $round)" $?
    grep -E 'pageable|memcpy' "$out/gpu_bench_copy_threads_${threads}_$round.txt" | sed "s/^/threads=$threads round=$round /"
  done
done
unset WEFT_COPY_THREADS
# nccl-tests' columns on device buffers: 2 processes sharing the GPU(s), all_reduce and broadcast up to 256 MiB.
for c in all_reduce broadcast; do
  WEFT_GPU=cuda WEFT_TRANSPORT=tcp limit 45 "$build/tools/weft-run" -n 2 -- "$build/bench/weft-bench" --device -c "$c" -b 8 -e 256M -f 4 \
    --check --json "$out/weft_bench_device_$c.json" > "$out/weft_bench_device_$c.txt" 2>&1
  step "weft-bench --device -c $c (2 processes, tcp)" $?
  cat "$out/weft_bench_device_$c.txt"
done
# all_reduce on device windows between 2 processes (CUDA IPC, WEFT_DEVICE_IPC=1), over tcp and shm, checked.
for transport in tcp shm; do
  WEFT_GPU=cuda WEFT_DEVICE_IPC=1 WEFT_TRANSPORT=$transport limit 60 "$build/tools/weft-run" -n 2 -- "$build/bench/weft-bench" --device \
    -c all_reduce -b 8 -e 64M -f 16 --check > "$out/weft_bench_device_ipc_$transport.txt" 2>&1
  step "weft-bench --device with WEFT_DEVICE_IPC=1 (2 processes, $transport)" $?
  cat "$out/weft_bench_device_ipc_$transport.txt"
done
# Issue 17: the device set's all_reduce, N = 2, 4, 8 entries on the GPU(s), 8 B .. 256 MiB, each path
# forced in turn (the crossover, the naive path's cost), against the device-to-device copy.
for path in one_stage two_stage naive; do
  WEFT_GPU=cuda WEFT_DEVICE_SET=$path limit 90 "$build/bench/weft-device-set-bench" --json "$out/device_set_$path.json" \
    > "$out/device_set_$path.txt" 2>&1
  step "weft-device-set-bench ($path)" $?
  cat "$out/device_set_$path.txt"
done
# What torch offers beside it (an in-process reduction on one GPU; whether NCCL takes 2 ranks on one GPU).
if python3 -c 'import torch; assert torch.cuda.is_available()' 2> /dev/null; then
  PYTHONUNBUFFERED=1 limit 120 python3 "$src/bench/peers/torch_device_set.py" --nccl > "$out/torch_device_set.txt" 2>&1
  step "torch_device_set.py" $?
  cat "$out/torch_device_set.txt"
  # Issue 16's peer: torch.distributed's gloo on CUDA tensors, 64 MiB, interleaved with weft over tcp and shm.
  for round in 1 2; do
    for transport in tcp shm; do
      WEFT_GPU=cuda WEFT_TRANSPORT=$transport limit 60 "$build/tools/weft-run" -n 2 -- "$build/bench/weft-bench" --device -c all_reduce \
        -b 64M -e 64M -n 20 -w 3 --check > "$out/gloo_round${round}_weft_$transport.txt" 2>&1
      step "round $round: weft-bench --device 64 MiB ($transport)" $?
      grep -E '^ *[0-9]' "$out/gloo_round${round}_weft_$transport.txt"
    done
    PYTHONUNBUFFERED=1 limit 90 python3 "$src/bench/peers/torch_gloo_device.py" --bytes 67108864 --iters 20 > "$out/gloo_round${round}_torch.txt" 2>&1
    step "round $round: torch gloo on CUDA tensors, 64 MiB" $?
    cat "$out/gloo_round${round}_torch.txt"
  done
else
  echo "torch with CUDA: not found (the torch comparisons skipped)" | tee -a "$summary"
fi
echo "results in $out"
[ -n "${PACK:-}" ] && tar czf "$out.tar.gz" -C "$out" . && echo "packed: $out.tar.gz"
exit $rc
