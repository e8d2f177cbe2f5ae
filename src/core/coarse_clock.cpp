#include "core/coarse_clock.hpp"

#include <time.h>

namespace weft {

namespace {
std::chrono::steady_clock::time_point read(clockid_t clock) noexcept {
  timespec ts{};
  ::clock_gettime(clock, &ts);
  return std::chrono::steady_clock::time_point(std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec));
}
}  // namespace

std::chrono::steady_clock::time_point CoarseClock::now() noexcept { return read(CLOCK_MONOTONIC_COARSE); }

std::chrono::steady_clock::time_point CoarseClock::not_before_now() noexcept { return now() + step(); }

std::chrono::nanoseconds CoarseClock::step() noexcept {
  // Fixed for the kernel's life; a kernel that cannot say gets the slowest tick's 10 ms (100 Hz).
  static const std::chrono::nanoseconds step = [] {
    timespec res{};
    if (::clock_getres(CLOCK_MONOTONIC_COARSE, &res) != 0 || (res.tv_sec == 0 && res.tv_nsec == 0)) return std::chrono::nanoseconds(std::chrono::milliseconds(10));
    return std::chrono::nanoseconds(std::chrono::seconds(res.tv_sec) + std::chrono::nanoseconds(res.tv_nsec));
  }();
  return step;
}

}  // namespace weft
