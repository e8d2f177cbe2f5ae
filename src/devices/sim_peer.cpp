// The sim's peer all_reduce instance (sim_peer.hpp): kernels/peer's protocol on host threads.
#include "devices/sim_peer.hpp"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <thread>

#include <fmt/format.h>

#include "kernels/cpu/epilogue.hpp"
#include "kernels/cpu/reduce.hpp"
#include "kernels/peer/host_atomics.hpp"

namespace weft::gpu::detail {

namespace {

// The sim's workers wait for their peers' as long as a device would: a peer may be held by work queued
// before it (a gate the host opens late); only a lost one is a bug, and that fails after 10 minutes
// (WEFT_SIM_PEER_SPIN_MS: another bound, for the tests of a peer that never comes).
struct SimSpinBound {
  static std::chrono::milliseconds limit() {
    static const std::chrono::milliseconds bound = [] {
      const char* text = std::getenv("WEFT_SIM_PEER_SPIN_MS");
      const long ms = text ? std::atol(text) : 0;
      return std::chrono::milliseconds(ms > 0 ? ms : 600000);
    }();
    return bound;
  }
};
using SimAtomics = kernels::peer::HostAtomics<SimSpinBound>;

// One element of `size` bytes, for the peer algorithms over any dtype (the CPU kernels do the arithmetic).
template <std::size_t N>
struct Element {
  std::byte bytes[N];
};

// N: the reduced element's size, M: the stored one's.
template <std::size_t N, std::size_t M>
std::string run_blocks(const SimPeerCall& call) {
  using E = Element<N>;
  using O = Element<M>;
  std::vector<const E*> in(call.inputs.size());
  for (std::size_t k = 0; k < in.size(); ++k) in[k] = static_cast<const E*>(call.inputs[k]);
  O* out = static_cast<O*>(call.output);
  std::vector<E*> tmp(call.scratch.size());
  for (std::size_t k = 0; k < tmp.size(); ++k) tmp[k] = reinterpret_cast<E*>(call.scratch[k]);
  const kernels::ReduceFn fn = kernels::find_reduce(call.dtype, call.op == ReduceOp::avg ? ReduceOp::sum : call.op);
  auto combine = [fn](E a, const E& b) {
    fn(&a, &a, &b, 1);
    return a;
  };
  const EpilogueFunctions* custom = call.epilogue.functions();
  std::atomic<bool> threw{false};  // a user's function that throws: the element stores zeros, the call fails
  auto epilogue = [&call, custom, &threw](E v, std::size_t i) {
    if (call.divisor > 1) kernels::divide_in_place(&v, 1, call.dtype, call.divisor);
    O o{};
    if (!custom) {
      kernels::apply_epilogue(&v, call.dtype, &o, call.out_dtype, 1, call.epilogue.factor());
      return o;
    }
    try {
      custom->host(custom->functor.get(), &v, &o, i, 1);
    } catch (...) {
      threw = true;  // the protocol goes on (the peers wait at its barriers): only the values are lost
      o = O{};
    }
    return o;
  };
  constexpr int blocks = 2;
  std::atomic<bool> ok{true};
  auto block = [&](int b) {
    namespace peer = kernels::peer;
    const bool done = call.two_stage
                          ? peer::two_stage<SimAtomics, E, O>(call.devices, b, blocks, 0, 1, in.data(), out, tmp.data(), call.count, combine, epilogue)
                          : peer::one_stage<SimAtomics, E, O>(call.devices, b, blocks, 0, 1, in.data(), out, call.count, combine, epilogue);
    if (!done) ok = false;
  };
  std::thread second([&] { block(1); });
  block(0);
  second.join();
  if (!ok) {
    const bool aborted = call.devices.abort && std::atomic_ref<std::uint32_t>(*const_cast<std::uint32_t*>(call.devices.abort)).load() != 0;
    return aborted ? fmt::format("device {}: the peer all_reduce was abandoned (its group failed)", call.device)
                   : fmt::format("device {}: a peer barrier gave up (a peer's work never came)", call.device);
  }
  if (threw) return fmt::format("device {}: the epilogue {} threw", call.device, call.epilogue.describe());
  return {};
}

template <std::size_t N>
std::string run_blocks_to(const SimPeerCall& call) {
  switch (dtype_size(call.out_dtype)) {
    case 1: return run_blocks<N, 1>(call);
    case 2: return run_blocks<N, 2>(call);
    case 4: return run_blocks<N, 4>(call);
    default: return run_blocks<N, 8>(call);
  }
}

}  // namespace

std::string run_peer_on_sim(const SimPeerCall& call) {
  switch (dtype_size(call.dtype)) {
    case 1: return run_blocks_to<1>(call);
    case 2: return run_blocks_to<2>(call);
    case 4: return run_blocks_to<4>(call);
    default: return run_blocks_to<8>(call);
  }
}

}  // namespace weft::gpu::detail
