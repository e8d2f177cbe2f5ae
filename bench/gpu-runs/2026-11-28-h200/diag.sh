#!/usr/bin/env bash
# The GPU lease's one script (2026-11-28): every test case in its own process under a bound, then the
# benchmarks; everything written to $OUT as it goes, a line per step in $OUT/diag.log.
set -u
cd "$(dirname "$0")/.."
T0=$SECONDS
DEADLINE=${DEADLINE:-500}
R=${OUT:-/tmp/out}
mkdir -p "$R"
tar xzf .gpu/bundle.tgz -C .gpu
B=.gpu/b
export LD_LIBRARY_PATH=$PWD/$B/lib
if ! $B/test_gpu --list-tests > /dev/null 2>&1; then export LD_LIBRARY_PATH=$PWD/$B/lib:$PWD/$B/lib2; fi
log=$R/diag.log
: > "$log"
kill_tree() { local c; for c in $(pgrep -P "$1"); do kill_tree "$c"; kill -KILL "$c" 2>/dev/null; done; }
run() {  # run NAME LIMIT COMMAND...
  local name=$1 lim=$2 left s rc
  shift 2
  left=$((DEADLINE - (SECONDS - T0)))
  if [ "$left" -lt 8 ]; then echo "$name: skipped (out of time)" >> "$log"; return; fi
  [ "$lim" -gt "$left" ] && lim=$left
  s=$SECONDS
  timeout -k 3 "$lim" "$@" > "$R/$name.txt" 2>&1 &
  local pid=$!
  wait $pid
  rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    kill_tree $pid; pkill -KILL -f "$PWD/$B/" 2>/dev/null; pkill -KILL -f "\.gpu/b/" 2>/dev/null; sleep 1
  fi
  echo "$name: rc $rc, $((SECONDS - s)) s" >> "$log"
  grep -E "FAILED|passed|failed|error|Error|hang|\.\.\. *$" "$R/$name.txt" | tail -n 4 | sed 's/^/   /' >> "$log"
}
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
head -12 "$R/nvidia-smi.txt" >> "$log"
export WEFT_GPU=cuda
esc() { sed 's/,/\\,/g'; }

# 1. test_gpu, one case per process (not [fail]: the sim's injected failures)
i=0
while IFS= read -r t; do
  i=$((i + 1))
  case "$t" in *"injected device failure"*|"ipc: the importing process") continue ;; esac
  run "gpu_$i" 40 $B/test_gpu "$(printf '%s' "$t" | esc)" -d yes
done < <($B/test_gpu --list-test-names-only '~[fail]' | grep -v '^$')

# 2. the device set with the peer kernels (hung at N=3 two-stage on 2026-11-27 before FreesAfterSpins)
i=0
while IFS= read -r t; do
  i=$((i + 1))
  WEFT_CUDA_PEER=1 WEFT_TEST_TRACE=1 run "set_peer_$i" 90 $B/test_gpu "$(printf '%s' "$t" | esc)" -d yes
done < <($B/test_gpu --list-test-names-only '[set]' | grep -v '^$')
run epilogue_cuh 40 $B/test_epilogue_cuh -d yes

# 3. test_device, one case per process; [multi] also with the peer kernels
i=0
while IFS= read -r t; do
  i=$((i + 1))
  run "dev_$i" 60 $B/test_device "$(printf '%s' "$t" | esc)" -d yes
done < <($B/test_device --list-test-names-only '~[device-failure]' | grep -v '^$')
WEFT_CUDA_PEER=1 run dev_multi_peer 90 $B/test_device '[multi]' -d yes

# 4. the device set's paths (issue 17's crossover)
for p in one_stage two_stage naive; do
  WEFT_DEVICE_SET=$p run "dsb_$p" 60 $B/weft-device-set-bench --json "$R/dsb_$p.json"
done
WEFT_CUDA_PEER=1 run dsb_auto 60 $B/weft-device-set-bench --json "$R/dsb_auto.json"

# 5. issue 16's numbers
run gpu_bench 40 $B/weft-gpu-bench --runs 5000 --json "$R/gpu_bench.json"
for round in 1 2; do
  for th in 1 default; do
    if [ $th = default ]; then unset WEFT_COPY_THREADS; else export WEFT_COPY_THREADS=$th; fi
    run "copy_threads_${th}_$round" 25 $B/weft-gpu-bench --runs 200
  done
done
unset WEFT_COPY_THREADS
run small_tcp 40 $B/weft-run -n 2 -- $B/weft-bench --device -c all_reduce -b 8 -e 32K -f 16 --check
run weft_tcp_64M 40 $B/weft-run -n 2 -- $B/weft-bench --device -c all_reduce -b 64M -e 64M -n 20 -w 3 --check
if python3 -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null; then
  PYTHONUNBUFFERED=1 run torch_gloo_64M 60 python3 bench/peers/torch_gloo_device.py --bytes 67108864 --iters 20
fi
run weft_tcp_64M_b 40 $B/weft-run -n 2 -- $B/weft-bench --device -c all_reduce -b 64M -e 64M -n 20 -w 3 --check

# 6. CUDA IPC between processes (device windows; never run on a GPU before)
WEFT_DEVICE_IPC=1 run ipc_small 40 $B/weft-run -n 2 -- $B/weft-bench --device -c all_reduce -b 8 -e 1M -f 16 --check
WEFT_DEVICE_IPC=1 run ipc_64M 40 $B/weft-run -n 2 -- $B/weft-bench --device -c all_reduce -b 64M -e 64M -n 20 -w 3 --check
WEFT_DEVICE_IPC=1 WEFT_TRANSPORT=shm run ipc_shm 40 $B/weft-run -n 2 -- $B/weft-bench --device -c all_reduce -b 8 -e 64M -f 64 --check

# 7. pipelined staging on the device
WEFT_STAGING_COPY_BYTES=65536 WEFT_ALGO='all_reduce:ring;broadcast:scatter_all_gather' \
  run dev_pipelined 60 $B/test_device '[collectives],[order],[large]'
san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$san" ]; then
  run memcheck 60 "$san" --tool memcheck --error-exitcode 3 $B/test_gpu 'device reductions equal the CPU kernels on every dtype and op'
else
  echo "compute-sanitizer: not on this machine" >> "$log"
fi
echo "done at $((SECONDS - T0)) s" >> "$log"
