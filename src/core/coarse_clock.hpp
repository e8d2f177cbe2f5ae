#pragma once
// CLOCK_MONOTONIC_COARSE as a steady_clock time point: about 7 ns a read where steady_clock::now() costs
// 25-33 ns on these VMs (bench/RESULTS.md, "The loop's clock off the message's path"), for what is read
// per message and counts in seconds: a shared-memory stream's time since its last data (its stuck check).
#include <chrono>

namespace weft {

struct CoarseClock {
  /// The monotonic clock as its last update left it: never after steady_clock::now(). How far before
  /// it is the kernel's affair: clock_getres says 4 ms here, yet 5.3 ms on average and up to 9.3 ms
  /// were seen on the EPYC VM, so it serves checks that count in seconds, never a deadline.
  static std::chrono::steady_clock::time_point now() noexcept;
};

}  // namespace weft
