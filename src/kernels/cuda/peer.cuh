#pragma once
// The in-process multi-device all_reduce's kernels (peer.cu): kernels/peer/all_reduce.hpp's protocol and
// algorithms on the GPU, for every dtype and op, with avg's division as the store's epilogue. Called by
// the device set under cuda where every pair of its devices reaches the other (run on an H100 and an
// H200: bench/RESULTS.md; docs/DESIGN.md).
#include <cstddef>
#include <cstdint>

#include "kernels/peer/all_reduce.hpp"

namespace weft::kernels::cuda {

/// Every device's pointers, by value (a kernel parameter).
struct PeerPointers {
  const void* inputs[peer::max_devices];
  void* scratch[peer::max_devices];
};

/// Queues device `devices.rank`'s instance of the all_reduce on `stream` (cudaStream_t): the one-stage
/// form, or the two-stage one (`two_stage`, which allows out == inputs[rank]). dtype and op are weft's
/// as integers (avg: the sum, each stored element divided by `divisor`, integer division for integers).
/// `blocks` must let every device's instance be resident at once (the barriers spin). `failed` (pinned
/// host memory the device reaches, or null) is set when a bounded spin gave up (builds with
/// WEFT_PEER_SPIN_BOUND). Returns a cudaError_t (cudaErrorInvalidValue: an op not defined on the dtype,
/// bad blocks or lanes).
int launch_peer_all_reduce(const peer::Devices& devices, const PeerPointers& pointers, void* out, std::size_t count, int dtype, int op,
                           int divisor, bool two_stage, int blocks, int lanes, std::uint32_t* failed, void* stream);

}  // namespace weft::kernels::cuda
