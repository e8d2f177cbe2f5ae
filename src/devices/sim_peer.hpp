#pragma once
// The peer all_reduce (kernels/peer) as the simulated device runs it: one instance of one device, a host
// thread per block, the very protocol code the GPU kernels run. Shared by the device sets of one process
// (DeviceSet) and the windows of several processes of one host (PeerWindow).
#include <cstddef>
#include <string>
#include <vector>

#include "kernels/peer/all_reduce.hpp"
#include "weft/dtype.hpp"
#include "weft/gpu.hpp"
#include "weft/reduce_op.hpp"

namespace weft::gpu::detail {

/// One device's instance. Every pointer is as the sim's workers see the memory (worker_address).
struct SimPeerCall {
  kernels::peer::Devices devices;       // this instance's rank, the set's size, every signal, the abort word
  std::vector<const void*> inputs;      // every rank's input, in rank order
  void* output = nullptr;               // this rank's
  std::vector<std::byte*> scratch;      // two-stage: every rank's slice of the sum
  std::size_t count = 0;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;          // avg: the sum, each stored element divided by `divisor`
  int divisor = 1;
  Epilogue epilogue;
  DType out_dtype = DType::f32;
  bool two_stage = false;
  int device = 0;                       // for the words of a failure
};

/// Runs it (on the calling thread and one more); returns "" or why it gave up (a barrier's spin ended:
/// its bound, WEFT_SIM_PEER_SPIN_MS, passed, or the abort word was set; a user's epilogue threw).
std::string run_peer_on_sim(const SimPeerCall& call);

}  // namespace weft::gpu::detail
