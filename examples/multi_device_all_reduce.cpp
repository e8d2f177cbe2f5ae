// One process, several devices, several processes (NCCL's "one process, many GPUs" across ranks): each
// rank drives `per_rank` devices and all_reduces every device's gradients across every rank's devices,
// averaging and storing them as bf16 through an epilogue. On a machine without a GPU the simulated
// device runs it (WEFT_GPU=sim, WEFT_SIM_DEVICES=2 by default).
// Run: weft-run -n 2 -- example-multi-device-all-reduce 2        (2 processes x 2 devices)
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <weft/gpu.hpp>
#include <weft/multi_device.hpp>
#include <weft/weft.hpp>

namespace gpu = weft::gpu;

int main(int argc, char** argv) {
  const int per_rank = argc > 1 ? std::atoi(argv[1]) : 2;
  const std::size_t count = argc > 2 ? static_cast<std::size_t>(std::atol(argv[2])) : 100003;
  weft::Loop loop;
  weft::Group world = weft::Group::create(loop).get();

  std::vector<weft::Device> devices;
  for (int k = 0; k < per_rank; ++k) devices.push_back(gpu::device((world.rank() * per_rank + k) % gpu::device_count()));
  gpu::MultiDeviceGroup group = gpu::MultiDeviceGroup::create(world, devices).get();

  // Device k of this rank holds the gradients of "device" first_device_rank() + k: (d + 1) * (i % 97).
  std::vector<gpu::Stream> streams;
  std::vector<gpu::DeviceBuffer> grads, out;
  std::vector<weft::ConstBufferView> in_views;
  std::vector<weft::BufferView> out_views;
  for (int k = 0; k < per_rank; ++k) {
    const int d = group.first_device_rank() + k;
    std::vector<float> host(count);
    for (std::size_t i = 0; i < count; ++i) host[i] = static_cast<float>(d + 1) * static_cast<float>(i % 97);
    streams.emplace_back(loop, devices[static_cast<std::size_t>(k)]);
    grads.push_back(gpu::DeviceBuffer::allocate(devices[static_cast<std::size_t>(k)], count * sizeof(float)));
    out.push_back(gpu::DeviceBuffer::allocate(devices[static_cast<std::size_t>(k)], count * sizeof(weft::bfloat16)));
    streams.back().copy(grads.back().view<float>(), weft::ConstBufferView(host.data(), count, weft::DType::f32)).get();
    in_views.push_back(grads.back().view<float>());
    out_views.push_back(out.back().view<weft::bfloat16>());
  }

  // The mean over every device of every rank, stored as bf16.
  group.all_reduce(in_views, out_views, weft::ReduceOp::avg, gpu::Epilogue::cast(weft::DType::bf16)).get();

  const int n = group.total_devices();
  std::size_t wrong = 0;
  for (int k = 0; k < per_rank; ++k) {
    std::vector<weft::bfloat16> got(count);
    streams[static_cast<std::size_t>(k)].copy(weft::BufferView(got.data(), count, weft::DType::bf16), out[static_cast<std::size_t>(k)].view<weft::bfloat16>()).get();
    for (std::size_t i = 0; i < count; ++i) {
      const float sum = static_cast<float>(n * (n + 1) / 2) * static_cast<float>(i % 97);  // exact in float
      wrong += !(got[i] == weft::bfloat16(sum / static_cast<float>(n)));
    }
  }
  std::printf("rank %d (%d devices of %d): %zu of %zu elements wrong\n", world.rank(), per_rank, n, wrong,
              count * static_cast<std::size_t>(per_rank));
  world.barrier().get();  // before the device memory goes: freeing waits for the whole device
  return wrong == 0 ? 0 : 1;
}
