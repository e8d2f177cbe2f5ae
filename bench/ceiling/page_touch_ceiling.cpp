// What a process's first access to a page of shared memory costs, without weft: why the shm rings touch
// their pages at set-up (src/transports/shm/ring.hpp, touch_pages; bench/RESULTS.md, "A ring's first
// lap"). A 1 MiB memfd, mapped populated (MAP_POPULATE, as weft's segments are), written one word a cache
// line at a time:
//   first write:     through a fresh mapping, after the kernel populated it;
//   second write:    the same mapping again (every line already written once);
//   after populate-write: a fresh mapping after madvise(MADV_POPULATE_WRITE);
//   after a touch:   a fresh mapping after one atomic add of zero per page (what touch_pages does);
//   first read:      a fresh mapping read one word a line.
// A child process maps the same memfd afresh for each line, so every case after the first also shows
// that a page written through another mapping is no cheaper through this one.
//   page-touch-ceiling [MIB]
// Prints ns per cache line for each case and the touch's own time.
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace {

using Clock = std::chrono::steady_clock;

double ns_since(Clock::time_point start) { return std::chrono::duration<double, std::nano>(Clock::now() - start).count(); }

char* map(int fd, std::size_t bytes) {
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  return static_cast<char*>(p);
}

double write_lines(char* p, std::size_t bytes) {
  const auto start = Clock::now();
  for (std::size_t i = 0; i < bytes; i += 64) *reinterpret_cast<volatile std::uint64_t*>(p + i) = i;
  return ns_since(start) / static_cast<double>(bytes / 64);
}

double read_lines(const char* p, std::size_t bytes) {
  std::uint64_t sum = 0;
  const auto start = Clock::now();
  for (std::size_t i = 0; i < bytes; i += 64) sum += *reinterpret_cast<const volatile std::uint64_t*>(p + i);
  const double ns = ns_since(start) / static_cast<double>(bytes / 64);
  if (sum == 1) std::puts("");  // the loads are used
  return ns;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t bytes = (argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 1) << 20;
  const int fd = ::memfd_create("page-touch-ceiling", 0);
  if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    std::perror("memfd_create");
    return 1;
  }
  char* first = map(fd, bytes);
  std::printf("first write:          %6.1f ns a line\n", write_lines(first, bytes));
  std::printf("second write:         %6.1f ns a line\n", write_lines(first, bytes));
  std::fflush(stdout);
  if (::fork() == 0) {
    char* populated = map(fd, bytes);
    ::madvise(populated, bytes, MADV_POPULATE_WRITE);
    std::printf("after populate-write: %6.1f ns a line (another process, pages written before)\n", write_lines(populated, bytes));
    char* touched = map(fd, bytes);
    const auto start = Clock::now();
    for (std::size_t i = 0; i < bytes; i += 4096) __atomic_fetch_add(reinterpret_cast<std::uint64_t*>(touched + i), 0, __ATOMIC_RELAXED);
    const double touch_us = ns_since(start) / 1000;
    std::printf("after a touch:        %6.1f ns a line (the touch took %.0f us for %zu pages)\n", write_lines(touched, bytes), touch_us,
                bytes / 4096);
    char* reading = map(fd, bytes);
    std::printf("first read:           %6.1f ns a line\n", read_lines(reading, bytes));
    std::printf("second read:          %6.1f ns a line\n", read_lines(reading, bytes));
    std::fflush(stdout);
    ::_exit(0);
  }
  ::wait(nullptr);
  return 0;
}
