#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU, builds weft with CUDA, runs the device suites on the real
# device, compute-sanitizer (memcheck and synccheck) on them, and the GPU benchmark, writing everything
# (text, JUnit XML, JSON) to the directory given as the argument, and a summary line per step.
#
#   tools/gpu_check.sh OUT_DIR          (BUILD=<dir> to use or make another build directory)
#
# Needs what the README's build needs plus nvcc (the CUDA toolkit) and a driver. Exits non-zero when a
# step failed; a step whose tool is missing (compute-sanitizer) is reported as skipped, not passed.
set -uo pipefail
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

{ nvidia-smi || echo "nvidia-smi: not found"; } > "$out/nvidia-smi.txt" 2>&1
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" -Dcuda=enabled --buildtype=release > "$out/configure.txt" 2>&1
  step configure $?
fi
ninja -C "$build" > "$out/build.txt" 2>&1
step build $?

# The device suites on the real device (WEFT_GPU=cuda: no fallback to the simulated one).
WEFT_GPU=cuda "$build/tests/test_gpu" '~[fail]' -r junit -o "$out/test_gpu.xml" > "$out/test_gpu.txt" 2>&1
step "test_gpu (cuda)" $?
# Every operation on device buffers, ranks as threads sharing the device(s), stream-ordered and not.
WEFT_GPU=cuda "$build/tests/test_device" '~[device-failure]' -r junit -o "$out/test_device.xml" > "$out/test_device.txt" 2>&1
step "test_device (cuda)" $?
# The same program on the simulated device, for comparison on this machine.
WEFT_GPU=sim WEFT_SIM_DELAY_US=300 "$build/tests/test_gpu" '~[fail]' > "$out/test_gpu_sim.txt" 2>&1
step "test_gpu (sim, delays)" $?

sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ -x "$sanitizer" ]; then
  for tool in memcheck synccheck; do
    WEFT_GPU=cuda "$sanitizer" --tool "$tool" --error-exitcode 3 "$build/tests/test_gpu" \
      'device reductions equal the CPU kernels on every dtype and op' > "$out/$tool.txt" 2>&1
    step "compute-sanitizer $tool (device reductions)" $?
  done
else
  echo "compute-sanitizer: not found (skipped)" | tee -a "$summary"
  rc=1
fi

WEFT_GPU=cuda "$build/bench/weft-gpu-bench" --json "$out/gpu_bench.json" > "$out/gpu_bench.txt" 2>&1
step "weft-gpu-bench" $?
cat "$out/gpu_bench.txt"
echo "results in $out"
exit $rc
