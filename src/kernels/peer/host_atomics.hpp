#pragma once
// The peer protocol's atomic operations on the host (all_reduce.hpp's `Atomics`): what the simulated
// device runs the protocol with (one thread per (device, block), one lane each), and the protocol's own
// tests. A spin gives up after `Bound::limit()` of waiting, so a lost arrival fails instead of hanging.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>

namespace weft::kernels::peer {

/// A spin bound of N seconds.
template <int N>
struct Seconds {
  static std::chrono::milliseconds limit() { return std::chrono::seconds(N); }
};

template <class Bound>
struct HostAtomics {
  static void store_release(std::uint32_t* p, std::uint32_t v) { std::atomic_ref<std::uint32_t>(*p).store(v, std::memory_order_release); }
  static std::uint32_t load_acquire(const std::uint32_t* p) {
    return std::atomic_ref<std::uint32_t>(*const_cast<std::uint32_t*>(p)).load(std::memory_order_acquire);
  }
  // Yields between looks (the sim's devices share the host's cores); looks at the clock every 1024th.
  static bool pause(std::uint64_t spins) {
    thread_local std::chrono::steady_clock::time_point since;
    if (spins == 0) since = std::chrono::steady_clock::now();
    std::this_thread::yield();
    return (spins & 1023) != 1023 || std::chrono::steady_clock::now() - since < Bound::limit();
  }
  static void sync_block() {}  // a simulated block has one lane
  static bool sync_block_all(bool ok) { return ok; }
};

}  // namespace weft::kernels::peer
