#pragma once
// The in-process multi-device all_reduce's kernels (peer.cu): kernels/peer/all_reduce.hpp's protocol and
// algorithms on the GPU. Compiled and linked; not yet called by weft (issue 17's next part) and not yet
// run on a GPU.
#include <cstddef>
#include <cstdint>

#include "kernels/peer/all_reduce.hpp"

namespace weft::kernels::cuda {

/// Every device's pointers, by value (a kernel parameter).
struct PeerPointers {
  const void* inputs[peer::max_devices];
  void* scratch[peer::max_devices];
};

/// Queues device `devices.rank`'s instance of the f32 sum all_reduce on `stream` (cudaStream_t): the
/// one-stage form, or the two-stage one (`two_stage`, which allows out == inputs[rank]). `blocks` must
/// let every device's instance be resident at once (the barriers spin). `failed` (mapped host memory, or
/// null) is set when a bounded spin gave up. Returns a cudaError_t.
int launch_peer_all_reduce_f32_sum(const peer::Devices& devices, const PeerPointers& pointers, void* out, std::size_t count,
                                   bool two_stage, int blocks, int lanes, std::uint32_t* failed, void* stream);

}  // namespace weft::kernels::cuda
