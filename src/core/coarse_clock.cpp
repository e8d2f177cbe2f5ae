#include "core/coarse_clock.hpp"

#include <time.h>

namespace weft {

std::chrono::steady_clock::time_point CoarseClock::now() noexcept {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
  return std::chrono::steady_clock::time_point(std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec));
}

}  // namespace weft
