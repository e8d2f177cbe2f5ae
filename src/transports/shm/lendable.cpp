#include "transports/shm/lendable.hpp"

#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace weft::shm {

bool kernel_can_read(const void* data, std::size_t bytes) noexcept {
  if (bytes == 0) return true;
  const auto* at = static_cast<const char*>(data);
  char got[2];
  iovec local{got, bytes > 1 ? 2u : 1u};
  iovec remote[2] = {{const_cast<char*>(at), 1}, {const_cast<char*>(at + bytes - 1), 1}};
  for (;;) {
    const ssize_t n = ::process_vm_readv(::getpid(), &local, 1, remote, bytes > 1 ? 2 : 1, 0);
    if (n >= 0) return static_cast<std::size_t>(n) == local.iov_len;
    if (errno != EINTR) return false;
  }
}

bool KernelCopyCost::slow() const noexcept {
  return kernel_us > 0 && memcpy_us > 0 && kernel_us >= kernel_copy_slow_ratio * memcpy_us;
}

KernelCopyCost measure_kernel_copy(std::size_t bytes, int rounds) noexcept {
  KernelCopyCost cost;
  try {
    std::vector<std::byte> from(bytes, std::byte{1}), to(bytes, std::byte{2});
    using Clock = std::chrono::steady_clock;
    const auto us = [](Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); };
    double kernel = 1e300, plain = 1e300;
    // Taking turns, so that a moment of load hits both alike; the fastest of each (the machine's cost,
    // not its noise). In bursts a random pause apart: the ranks of a host probe at the same set-up, and
    // two memcpys at once on a core's two hardware threads took twice as long each (the kernel's copy
    // did not), which made the EPYC look like a machine whose kernel copies fast. The first round of a
    // burst only warms the buffers and the kernel's path (a pause leaves them colder).
    std::minstd_rand jitter(static_cast<unsigned>(::getpid()) ^ static_cast<unsigned>(Clock::now().time_since_epoch().count()));
    constexpr int bursts = 3;
    for (int burst = 0; burst < bursts; ++burst) {
      if (burst > 0) std::this_thread::sleep_for(std::chrono::microseconds(100 + jitter() % 400));
      for (int round = 0; round <= rounds; ++round) {
        auto start = Clock::now();
        std::memcpy(to.data(), from.data(), bytes);
        asm volatile("" : : "r"(to.data()) : "memory");  // the copy is not optimised away
        const double m = us(Clock::now() - start);
        iovec local{to.data(), bytes};
        iovec remote{from.data(), bytes};
        start = Clock::now();
        const ssize_t n = ::process_vm_readv(::getpid(), &local, 1, &remote, 1, 0);
        const double k = us(Clock::now() - start);
        if (n != static_cast<ssize_t>(bytes)) return cost;
        if (round == 0) continue;
        plain = std::min(plain, m);
        kernel = std::min(kernel, k);
      }
    }
    cost.kernel_us = kernel;
    cost.memcpy_us = plain;
  } catch (...) {  // no memory for the buffers: nothing measured
  }
  return cost;
}

}  // namespace weft::shm
