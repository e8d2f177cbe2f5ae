// A rank program for the process tests (tests/processes.sh). Configured by the environment like any weft
// program.
//   worker kill-peer VICTIM   every rank runs all_reduces; VICTIM kills itself (SIGKILL) in the middle of
//                             one. The others must fail with an error naming VICTIM, and not hang.
//   worker sum                one all_reduce, checked (used for launcher conventions: torchrun, mpirun).
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <weft/weft.hpp>

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  const std::string mode = argc > 1 ? argv[1] : "sum";
  weft::Loop loop;
  weft::Group group = weft::Group::create(loop).get();
  const int p = group.size();
  if (mode == "sum") {
    std::vector<std::int64_t> v(4099, group.rank() + 1);
    group.all_reduce(v).get();
    const std::int64_t expected = static_cast<std::int64_t>(p) * (p + 1) / 2;
    std::printf("rank %d of %d: sum %lld (expected %lld)\n", group.rank(), p, static_cast<long long>(v[0]), static_cast<long long>(expected));
    return v[0] == expected && v[4098] == expected ? 0 : 1;
  }
  if (mode == "kill-peer") {
    const int victim = argc > 2 ? std::atoi(argv[2]) : p - 1;
    std::vector<float> v(1 << 20, 1.0f);
    const auto start = std::chrono::steady_clock::now();
    try {
      group.all_reduce(v).get();
      if (group.rank() == victim) {
        weft::Future<void> f = group.all_reduce(v);  // in flight when the process dies
        std::this_thread::sleep_for(2ms);
        raise(SIGKILL);
      }
      for (int i = 0; i < 1000; ++i) {
        weft::Future<void> f = group.all_reduce(v);
        if (!f.wait_for(20s)) {
          std::printf("rank %d: HUNG\n", group.rank());
          std::fflush(stdout);
          std::_Exit(3);
        }
        f.get();
      }
      std::printf("rank %d: no error after the victim died\n", group.rank());
      return 4;
    } catch (const weft::Error& e) {
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
      const bool names = std::strstr(e.what(), ("rank " + std::to_string(victim)).c_str()) != nullptr;
      std::printf("rank %d: failed after %.1f ms: %s\n", group.rank(), ms, e.what());
      std::fflush(stdout);
      std::this_thread::sleep_for(500ms);  // survivors live on (as they would to shrink and continue)
      return names ? 0 : 5;
    }
  }
  std::fprintf(stderr, "worker: unknown mode %s\n", mode.c_str());
  return 2;
}
