// What one superstep of the group arena costs two processes, without weft: the floor under a small shm
// all_reduce on 2 ranks (bench/RESULTS.md, "Three ways to hide the arena's data line"). Two processes
// pinned to two CPUs, each with two 1 MiB areas (page aligned, as src/transports/shm/arena.hpp's) in one
// shared mapping; a step copies an input of BYTES into this process's area of the step's parity,
// publishes, waits for the peer and folds both areas (f32 sum) into an output:
//   header: arena.hpp's layout: the count at the area's start, contents of at most 32 bytes beside it on
//           its line, larger ones from the next line on, SKEW bytes into it; publish is a release store
//           of the count and a full fence (Arena::publish); the reader spins on the peer's count, then
//           reads the contents;
//   lined:  every line holds 56 bytes of contents and the count in its last 8 (release, each line's after
//           its contents; then the fence); the reader spins until every line's count is the step's (all
//           lines looked at in one pass, so their misses overlap), then reads the contents.
//   arena-step-ceiling [BYTES [SKEW [STEPS [CPU_A CPU_B]]]]
// Prints each layout's time per step in us, the two taking turns over 5 runs (median and range).
#include <sched.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr std::size_t area_bytes = std::size_t{1} << 20;
constexpr std::size_t line = 64;
constexpr std::size_t lined_contents = line - 8;

std::atomic<long>& word_at(char* p) { return *reinterpret_cast<std::atomic<long>*>(p); }

void pin(int cpu) {
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  sched_setaffinity(0, sizeof set, &set);
}

// One process's side of `steps` steps; returns us per step. `base`: four areas (rank r, parity p at
// (2r + p) * area_bytes), zeroed. `first`: the count the run starts after (the areas keep the last run's).
double run(char* base, int me, bool lined, std::size_t bytes, std::size_t skew, long first, long steps) {
  const int peer = 1 - me;
  std::vector<float> in(bytes / 4 + 16, 1.0f), out(bytes / 4 + 16), copy[2];
  copy[0].resize(bytes / 4 + 16);
  copy[1].resize(bytes / 4 + 16);
  const std::size_t n = bytes / 4;
  const std::size_t lines = (bytes + lined_contents - 1) / lined_contents;
  const std::size_t offset = bytes <= 32 ? 32 : line + skew;
  auto area = [&](int r, long c) { return base + (static_cast<std::size_t>(r) * 2 + static_cast<std::size_t>(c & 1)) * area_bytes; };
  const auto start = std::chrono::steady_clock::now();
  for (long c = first + 1; c <= first + steps; ++c) {
    char* mine = area(me, c);
    char* theirs = area(peer, c);
    if (!lined) {
      std::memcpy(mine + offset, in.data(), bytes);
      word_at(mine).store(c, std::memory_order_release);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      while (word_at(theirs).load(std::memory_order_acquire) < c) {
      }
      const auto* a = reinterpret_cast<const float*>(area(0, c) + offset);
      const auto* b = reinterpret_cast<const float*>(area(1, c) + offset);
      for (std::size_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
    } else {
      for (std::size_t l = 0; l < lines; ++l) {
        const std::size_t k = std::min(lined_contents, bytes - l * lined_contents);
        std::memcpy(mine + l * line, reinterpret_cast<const char*>(in.data()) + l * lined_contents, k);
        word_at(mine + l * line + lined_contents).store(c, std::memory_order_release);
      }
      std::atomic_thread_fence(std::memory_order_seq_cst);
      for (bool all = false; !all;) {
        all = true;
        for (std::size_t l = 0; l < lines; ++l) all &= word_at(theirs + l * line + lined_contents).load(std::memory_order_acquire) >= c;
      }
      for (int r = 0; r < 2; ++r) {
        const char* a = area(r, c);
        for (std::size_t l = 0; l < lines; ++l) {
          const std::size_t k = std::min(lined_contents, bytes - l * lined_contents);
          std::memcpy(reinterpret_cast<char*>(copy[r].data()) + l * lined_contents, a + l * line, k);
        }
      }
      for (std::size_t i = 0; i < n; ++i) out[i] = copy[0][i] + copy[1][i];
    }
  }
  const auto end = std::chrono::steady_clock::now();
  if (out[0] != 2.0f && n > 0) std::fprintf(stderr, "wrong sum %f\n", out[0]);
  return std::chrono::duration<double, std::micro>(end - start).count() / static_cast<double>(steps);
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t bytes = argc > 1 ? std::strtoul(argv[1], nullptr, 10) / 4 * 4 : 128;
  const std::size_t skew = argc > 2 ? std::strtoul(argv[2], nullptr, 10) % 64 : 16;
  const long steps = argc > 3 ? std::strtol(argv[3], nullptr, 10) : 1000000;
  const int cpu[2] = {argc > 5 ? std::atoi(argv[4]) : 0, argc > 5 ? std::atoi(argv[5]) : 1};
  // Twice the areas: one set per layout (a layout's counts never meet the other's).
  void* mapped = mmap(nullptr, 8 * area_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) {
    std::perror("mmap");
    return 1;
  }
  auto* base = static_cast<char*>(mapped);
  std::memset(base, 0, 8 * area_bytes);
  const pid_t child = fork();
  const int me = child == 0 ? 1 : 0;
  pin(cpu[me]);
  constexpr int runs = 5;
  std::vector<double> times[2];
  for (int k = 0; k < runs; ++k) {
    for (int lined = 0; lined < 2; ++lined) {
      times[lined].push_back(run(base + static_cast<std::size_t>(lined) * 4 * area_bytes, me, lined != 0, bytes, skew, k * steps, steps));
    }
  }
  if (me == 1) return 0;
  waitpid(child, nullptr, 0);
  std::printf("%zu bytes, skew %zu, %ld steps x %d runs (us per step, median [min-max]):\n", bytes, skew, steps, runs);
  const char* names[2] = {"header", "lined"};
  for (int lined = 0; lined < 2; ++lined) {
    auto& t = times[lined];
    std::sort(t.begin(), t.end());
    std::printf("  %-7s %.3f [%.3f-%.3f]\n", names[lined], t[runs / 2], t.front(), t.back());
  }
  return 0;
}
