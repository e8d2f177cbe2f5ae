// A custom epilogue made by nvcc from weft/gpu_epilogue.cuh (epilogue_functor.cu), used from host C++:
// on the simulated device its host copy runs (CI); on a GPU its kernel (tools/gpu_check.sh). Checked
// against the same function written here with weft's own half type: both round to nearest even.
#include <vector>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <weft/gpu.hpp>
#include <weft/weft.hpp>

#include "support/gpu_backend.hpp"

weft::gpu::EpilogueFunctions plus_index_to_half(float step);

using namespace weft;

TEST_CASE("an epilogue compiled by nvcc runs through Stream::apply and a device set, once per element", "[gpu][epilogue]") {
  weft::test::need_backend();
  const gpu::Epilogue e = gpu::Epilogue::custom(plus_index_to_half(0.5f), "plus index");
  CHECK(e.output(DType::f32) == DType::f16);
  CHECK(e.describe() == "custom 'plus index' (f32 -> f16)");
  Loop loop;
  const std::size_t n = 10007;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 101) * 0.25f - 3.0f;
  auto expected = [&](float scale_of_input) {
    std::vector<half> want(n);
    for (std::size_t i = 0; i < n; ++i) want[i] = half(host[i] * scale_of_input + 0.5f * static_cast<float>(i % 7));
    return want;
  };
  auto same = [&](const std::vector<half>& got, const std::vector<half>& want) {
    for (std::size_t i = 0; i < n; ++i) {
      if (!(got[i] == want[i])) {
        FAIL_CHECK(fmt::format("element {}: {:#x}, not {:#x}", i, got[i].bits, want[i].bits));
        return;
      }
    }
  };
  // One stream.
  const Device d = gpu::device(0);
  gpu::Stream s(loop, d);
  gpu::DeviceBuffer in = gpu::DeviceBuffer::allocate(d, n * sizeof(float));
  gpu::DeviceBuffer out = gpu::DeviceBuffer::allocate(d, n * sizeof(half));
  s.copy(in.view<float>(), ConstBufferView(host.data(), n, DType::f32)).get();
  s.apply(in.view<float>(), out.view(DType::f16), e).get();
  std::vector<half> got(n);
  s.copy(BufferView(got.data(), n, DType::f16), out.view(DType::f16)).get();
  same(got, expected(1.0f));
  // A device set of 3 entries: the sum (3 x the input, exact in float), then the epilogue.
  std::vector<Device> devices{gpu::device(0), gpu::device(1 % gpu::device_count()), gpu::device(0)};
  gpu::DeviceSet set = gpu::DeviceSet::create(loop, devices);
  std::vector<gpu::DeviceBuffer> ins, outs;
  std::vector<ConstBufferView> in_views;
  std::vector<BufferView> out_views;
  std::vector<gpu::Stream> streams;
  for (const Device& dev : devices) {
    streams.emplace_back(loop, dev);
    ins.push_back(gpu::DeviceBuffer::allocate(dev, n * sizeof(float)));
    outs.push_back(gpu::DeviceBuffer::allocate(dev, n * sizeof(half)));
    streams.back().copy(ins.back().view<float>(), ConstBufferView(host.data(), n, DType::f32)).get();
    in_views.push_back(ins.back().view<float>());
    out_views.push_back(outs.back().view(DType::f16));
  }
  set.all_reduce(in_views, out_views, ReduceOp::sum, e).get();
  for (std::size_t k = 0; k < devices.size(); ++k) {
    streams[k].copy(BufferView(got.data(), n, DType::f16), outs[k].view(DType::f16)).get();
    same(got, expected(3.0f));
  }
}
