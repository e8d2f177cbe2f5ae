#pragma once
// CLOCK_MONOTONIC_COARSE as a steady_clock time point: the monotonic clock as its last tick left it
// (steps of 1-4 ms), about 7 ns a read where steady_clock::now() costs 25-33 ns on these VMs
// (bench/RESULTS.md, "The loop's clock off the message's path"). For what counts in milliseconds and
// is read per message: a shared-memory stream's time since its last data, the start of a deadline.
#include <chrono>

namespace weft {

struct CoarseClock {
  /// The monotonic clock at its last tick: never after steady_clock::now(), at most one step before it.
  static std::chrono::steady_clock::time_point now() noexcept;
  /// now() one step later: never before steady_clock::now() read at the same moment, at most one step
  /// after it. The start of a deadline, which may then pass up to one step late but never early.
  static std::chrono::steady_clock::time_point not_before_now() noexcept;
  /// One step: the coarse clock's resolution (clock_getres; 4 ms on a kernel ticking at 250 Hz).
  static std::chrono::nanoseconds step() noexcept;
};

}  // namespace weft
