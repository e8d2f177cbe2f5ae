#pragma once
// What the device set hands a backend that runs the peer all_reduce on the device (cuda): one device's
// kernel instance. Apart from backend.hpp so that the rooms that see the device layer's interface (group)
// need not see kernels/peer.
#include <cstddef>
#include <cstdint>

#include "kernels/peer/all_reduce.hpp"
#include "weft/dtype.hpp"
#include "weft/reduce_op.hpp"

namespace weft::gpu::detail {

/// One device's instance of the peer all_reduce kernel (kernels/peer; DeviceSet under cuda).
struct PeerLaunch {
  kernels::peer::Devices devices;
  const void* inputs[kernels::peer::max_devices] = {};
  void* scratch[kernels::peer::max_devices] = {};
  void* out = nullptr;
  std::size_t count = 0;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;  // avg: the sum, each stored element divided by `divisor`
  int divisor = 1;
  bool two_stage = false;
  int blocks = 1;
  int lanes = 1;
  std::uint32_t* failed = nullptr;  // pinned host memory the device reaches: set when a spin gave up
};

}  // namespace weft::gpu::detail
