// A rank program for the process tests (tests/processes.sh). Configured by the environment like any weft
// program.
//   worker kill-peer VICTIM   every rank runs all_reduces; VICTIM kills itself (SIGKILL) in the middle of
//                             one. The others must fail with an error naming VICTIM, and not hang.
//   worker sum                one all_reduce, checked (used for launcher conventions: torchrun, mpirun).
//   worker loop COLL N COUNT  N checked runs of collective COLL on COUNT elements; on an error prints
//                             "rank R: failed at <epoch ms>: <error>" and, with WEFT_FAULT_SHRINK=1,
//                             shrinks and runs 20 checked all_reduces on the survivors (tests/faults).
//   worker soak N             N random collectives (every kind, sizes 0 to 64 Ki elements), each checked;
//                             prints resident memory after the first 1000 and at the end.
//   worker idle-latency N     N rounds, each after a barrier: rank 0 sleeps 10 ms outside weft, then sends
//                             its CLOCK_MONOTONIC time; rank 1, blocked in recv().get() meanwhile, takes
//                             the difference (the first message after idling, issue 15). Prints the
//                             median, p90 and min in us.
//   worker wake-stress N      N round trips between ranks 0 and 1, each side pausing a random 0-400 us
//                             outside weft before it answers, so that the loops keep going from polling
//                             to sleep as messages come (a wake lost there stalls until the group's
//                             watchdog looks: 50-250 ms). Rank 0 prints the round trips' median, p99 and
//                             max in us and how many took over 2 and over 20 ms.
//   worker thread-hop N       N 8-byte all_reduces, each waited on from a new thread that then ends (as
//                             std::async per call does), then N from this one thread, then N from two
//                             threads that take turns (the idle one asleep); rank 0 prints the median and
//                             max of each in us, and of the new threads' ends (from the call's return to
//                             the join). Under io_uring a request belongs to the thread that
//                             submitted it (uring_ring.cpp, "a submitter that ends").
//   worker start-after-calls N
//                             N rounds: 200 8-byte all_reduces waited on at once (back-to-back blocking
//                             calls: the progress thread stays parked), then one started and left alone,
//                             its Future polled with ready() every 20 us from a thread that neither
//                             borrows the loop nor computes, so that the progress thread must start and
//                             drive it; then N more rounds of one call left alone, without the 200
//                             before (a program that always starts, then computes). Rank 0 prints the
//                             median, p90 and max of each in us, from the start to ready (docs/DESIGN.md,
//                             "The parked thread's looks").
//   worker kill-windows VICTIM [stop]
//                             all_reduce on device windows (WEFT_DEVICE_IPC=1, every rank on this host):
//                             one call every rank completes (the windows made and opened), then VICTIM
//                             calls the next one behind a gate its stream never passes, so that every
//                             other rank's kernel waits for its device at the barrier, and kills itself
//                             (SIGKILL; with `stop`, stops itself: SIGSTOP). The others must fail naming
//                             VICTIM and not hang; each prints "rank R: failed at <epoch ms>: <error>".
// WEFT_TEST_UNDUMPABLE=1 makes the rank's process non-dumpable (PR_SET_DUMPABLE 0) before it joins: a
// peer without CAP_SYS_PTRACE cannot read its memory, even as the same user (the
// single-copy fallback, tests/processes.sh single-copy).
#include <malloc.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <random>
#include <span>
#include <thread>

#include <fmt/format.h>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <weft/gpu.hpp>
#include <weft/weft.hpp>

namespace {

using weft::Group;

long long epoch_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
}

long resident_kb() {
  long pages = 0, resident = 0;
  if (FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * (sysconf(_SC_PAGESIZE) / 1024);
}

const char* const collectives[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                                   "gather",     "scatter",    "all_to_all",     "barrier"};

// The survivors' wait in the kill tests: the Future's outcome, or "rank R: HUNG" and exit 3 after `limit`.
void get_or_hang_up(const Group& group, weft::Future<void> f, std::chrono::seconds limit) {
  if (!f.wait_for(limit)) {
    std::printf("rank %d: HUNG\n", group.rank());
    std::fflush(stdout);
    std::_Exit(3);
  }
  f.get();
}

// When the latest collective was called (epoch ms): a failure's time is measured from it.
long long called_at = 0;

// Runs collective `name` once on `count` elements per block with values that depend on the rank and
// `it`, and checks the result exactly. Returns "" or what was wrong. Errors of weft propagate.
std::string run_checked(Group& g, const std::string& name, std::size_t count, long it) {
  using V = std::int64_t;
  const int p = g.size();
  const int r = g.rank();
  const auto n = count;
  auto bad = [&](std::size_t i, V got, V want) { return fmt::format("{} #{} element {}: {} instead of {}", name, it, i, got, want); };
  if (name == "all_reduce") {
    std::vector<V> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = r + static_cast<V>(i) + it;
    called_at = epoch_ms();
    g.all_reduce(v).get();
    for (std::size_t i = 0; i < n; ++i) {
      const V want = static_cast<V>(p) * (p - 1) / 2 + p * (static_cast<V>(i) + it);
      if (v[i] != want) return bad(i, v[i], want);
    }
  } else if (name == "all_gather") {
    std::vector<V> in(n), out(n * p);
    for (std::size_t i = 0; i < n; ++i) in[i] = r * 1000 + static_cast<V>(i) + it;
    called_at = epoch_ms();
    g.all_gather(in, out).get();
    for (std::size_t k = 0; k < out.size(); ++k) {
      const V want = static_cast<V>(k / n) * 1000 + static_cast<V>(k % n) + it;
      if (out[k] != want) return bad(k, out[k], want);
    }
  } else if (name == "reduce_scatter") {
    std::vector<V> in(n * p), out(n);
    for (std::size_t j = 0; j < in.size(); ++j) in[j] = r + static_cast<V>(j) + it;
    called_at = epoch_ms();
    g.reduce_scatter(in, out).get();
    for (std::size_t i = 0; i < n; ++i) {
      const V want = static_cast<V>(p) * (p - 1) / 2 + p * (static_cast<V>(r * n + i) + it);
      if (out[i] != want) return bad(i, out[i], want);
    }
  } else if (name == "broadcast") {
    const int root = static_cast<int>(it % p);
    std::vector<V> v(n, -1);
    if (r == root) for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<V>(i) + it;
    called_at = epoch_ms();
    g.broadcast(v, root).get();
    for (std::size_t i = 0; i < n; ++i) if (v[i] != static_cast<V>(i) + it) return bad(i, v[i], static_cast<V>(i) + it);
  } else if (name == "reduce") {
    const int root = static_cast<int>(it % p);
    std::vector<V> in(n), out(r == root ? n : 0);
    for (std::size_t i = 0; i < n; ++i) in[i] = r + static_cast<V>(i);
    called_at = epoch_ms();
    g.reduce(in, out, root).get();
    for (std::size_t i = 0; i < out.size(); ++i) {
      const V want = static_cast<V>(p) * (p - 1) / 2 + p * static_cast<V>(i);
      if (out[i] != want) return bad(i, out[i], want);
    }
  } else if (name == "gather") {
    const int root = static_cast<int>(it % p);
    std::vector<V> in(n), out(r == root ? n * p : 0);
    for (std::size_t i = 0; i < n; ++i) in[i] = r * 1000 + static_cast<V>(i);
    called_at = epoch_ms();
    g.gather(in, out, root).get();
    for (std::size_t k = 0; k < out.size(); ++k) {
      const V want = static_cast<V>(k / n) * 1000 + static_cast<V>(k % n);
      if (out[k] != want) return bad(k, out[k], want);
    }
  } else if (name == "scatter") {
    const int root = static_cast<int>(it % p);
    std::vector<V> in(r == root ? n * p : 0), out(n);
    for (std::size_t k = 0; k < in.size(); ++k) in[k] = static_cast<V>(k / n) * 1000 + static_cast<V>(k % n) + it;
    called_at = epoch_ms();
    g.scatter(in, out, root).get();
    for (std::size_t i = 0; i < n; ++i) {
      const V want = r * 1000 + static_cast<V>(i) + it;
      if (out[i] != want) return bad(i, out[i], want);
    }
  } else if (name == "all_to_all") {
    std::vector<V> in(n * p), out(n * p);
    for (std::size_t k = 0; k < in.size(); ++k) in[k] = r * 1000 + static_cast<V>(k / n) * 10 + static_cast<V>(k % n % 10);
    called_at = epoch_ms();
    g.all_to_all(in, out).get();
    for (std::size_t k = 0; k < out.size(); ++k) {
      const V want = static_cast<V>(k / n) * 1000 + r * 10 + static_cast<V>(k % n % 10);
      if (out[k] != want) return bad(k, out[k], want);
    }
  } else if (name == "barrier") {
    called_at = epoch_ms();
    g.barrier().get();
  } else {
    return "unknown collective " + name;
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  using namespace std::chrono_literals;
  const std::string mode = argc > 1 ? argv[1] : "sum";
  if (const char* v = std::getenv("WEFT_TEST_UNDUMPABLE"); v && std::string(v) == "1" && ::prctl(PR_SET_DUMPABLE, 0) != 0) {
    std::perror("prctl(PR_SET_DUMPABLE)");
    return 1;
  }
  weft::Loop loop;
  weft::Group group;
  try {
    group = weft::Group::create(loop).get();
  } catch (const weft::Error& e) {
    std::printf("%s\n", e.what());
    return 1;
  }
  const int p = group.size();
  if (mode == "sum") {
    std::vector<std::int64_t> v(4099, group.rank() + 1);
    group.all_reduce(v).get();
    const std::int64_t expected = static_cast<std::int64_t>(p) * (p + 1) / 2;
    std::printf("rank %d of %d: sum %lld (expected %lld)\n", group.rank(), p, static_cast<long long>(v[0]), static_cast<long long>(expected));
    return v[0] == expected && v[4098] == expected ? 0 : 1;
  }
  if (mode == "idle-cpu") {
    // The CPU a waiting rank uses (issue 15: idle ranks use no CPU): rank 0 waits in a receive while
    // rank 1 sleeps 1 s outside weft before it sends; rank 0 prints the CPU time of its whole process
    // (the waiting thread and the loop's) over the wait.
    std::vector<std::int64_t> v(1, 0);
    auto cpu_ms = [] {
      rusage u{};
      ::getrusage(RUSAGE_SELF, &u);
      return u.ru_utime.tv_sec * 1000.0 + u.ru_utime.tv_usec / 1000.0 + u.ru_stime.tv_sec * 1000.0 + u.ru_stime.tv_usec / 1000.0;
    };
    group.barrier().get();
    // First nothing in flight for 1 s (the loop's own thread alone, asleep), then a receive that waits 1 s.
    const double idle_from = cpu_ms();
    std::this_thread::sleep_for(1s);
    if (group.rank() == 0) std::printf("idle-cpu: nothing in flight for 1 s, used %.1f ms of CPU\n", cpu_ms() - idle_from);
    group.barrier().get();
    if (group.rank() == 1) {
      std::this_thread::sleep_for(1s);
      group.send(weft::ConstBufferView(v.data(), 1, weft::DType::i64), 0).get();
    } else if (group.rank() == 0) {
      rusage before{};
      ::getrusage(RUSAGE_SELF, &before);
      const auto start = std::chrono::steady_clock::now();
      group.recv(weft::BufferView(v.data(), 1, weft::DType::i64), 1).get();
      const auto wall = std::chrono::steady_clock::now() - start;
      rusage after{};
      ::getrusage(RUSAGE_SELF, &after);
      auto ms = [](const timeval& t) { return t.tv_sec * 1000.0 + t.tv_usec / 1000.0; };
      const double cpu = ms(after.ru_utime) + ms(after.ru_stime) - ms(before.ru_utime) - ms(before.ru_stime);
      std::printf("idle-cpu: waited %.0f ms in a receive, used %.1f ms of CPU (%ld voluntary context switches)\n",
                  std::chrono::duration<double, std::milli>(wall).count(), cpu, after.ru_nvcsw - before.ru_nvcsw);
    }
    group.barrier().get();
    return 0;
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
        get_or_hang_up(group, group.all_reduce(v), 20s);
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
  if (mode == "idle-latency") {
    const int rounds = argc > 2 ? std::atoi(argv[2]) : 40;
    std::vector<double> us;
    for (int i = 0; i < rounds; ++i) {
      group.barrier().get();
      std::int64_t sent = 0;
      if (group.rank() == 0) {
        std::this_thread::sleep_for(10ms);
        sent = std::chrono::steady_clock::now().time_since_epoch().count();
        group.send(weft::ConstBufferView(&sent, 1, weft::DType::i64), 1).get();
      } else if (group.rank() == 1) {
        group.recv(weft::BufferView(&sent, 1, weft::DType::i64), 0).get();
        us.push_back((std::chrono::steady_clock::now().time_since_epoch().count() - sent) / 1000.0);
      }
    }
    group.barrier().get();
    if (group.rank() == 1 && !us.empty()) {
      std::sort(us.begin(), us.end());
      std::printf("idle-latency: %d rounds, median %.1f us, p90 %.1f us, min %.1f us\n", rounds, us[us.size() / 2],
                  us[us.size() * 9 / 10], us.front());
    }
    return 0;
  }
  if (mode == "wake-stress") {
    const int rounds = argc > 2 ? std::atoi(argv[2]) : 20000;
    std::mt19937 random(static_cast<unsigned>(group.rank()) + 1);
    std::uniform_int_distribution<int> pause_us(0, 400);
    std::vector<double> us;
    std::int64_t word = 0;
    const weft::BufferView into(&word, 1, weft::DType::i64);
    const weft::ConstBufferView from(&word, 1, weft::DType::i64);
    group.barrier().get();
    if (group.rank() < 2) {
      const int peer = 1 - group.rank();
      for (int i = 0; i < rounds; ++i) {
        const auto start = std::chrono::steady_clock::now();
        if (group.rank() == 0) {
          group.send(from, peer).get();
          group.recv(into, peer).get();
          us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
        } else {
          group.recv(into, peer).get();
        }
        // Outside weft: the loop's thread runs on (polls, then sleeps) while this one waits.
        std::this_thread::sleep_for(std::chrono::microseconds(pause_us(random)));
        if (group.rank() == 1) group.send(from, peer).get();
      }
    }
    group.barrier().get();
    if (group.rank() == 0 && !us.empty()) {
      std::sort(us.begin(), us.end());
      const auto slow = std::count_if(us.begin(), us.end(), [](double v) { return v > 20000.0; });
      const auto over_2ms = std::count_if(us.begin(), us.end(), [](double v) { return v > 2000.0; });
      std::printf("wake-stress: %d round trips, median %.1f us, p99 %.1f us, max %.1f us, %zd over 2 ms, %zd over 20 ms\n",
                  rounds, us[us.size() / 2], us[us.size() * 99 / 100], us.back(), static_cast<std::ptrdiff_t>(over_2ms),
                  static_cast<std::ptrdiff_t>(slow));
    }
    return 0;
  }
  if (mode == "thread-hop") {
    const int rounds = argc > 2 ? std::atoi(argv[2]) : 200;
    std::vector<float> v(2, 1.0F);
    using Clock = std::chrono::steady_clock;
    auto us_since = [](Clock::time_point since) { return std::chrono::duration<double, std::micro>(Clock::now() - since).count(); };
    auto median_max = [](std::vector<double>& us) {
      std::sort(us.begin(), us.end());
      return std::pair<double, double>{us[us.size() / 2], us.back()};
    };
    std::vector<double> hop, ending, stay;
    group.barrier().get();
    for (int i = 0; i < rounds; ++i) {
      const auto start = Clock::now();
      Clock::time_point returned;
      std::thread([&] {
        group.all_reduce(v).get();
        returned = Clock::now();
      }).join();
      ending.push_back(us_since(returned));  // from the call's return to the thread's end (join)
      hop.push_back(us_since(start));
    }
    group.barrier().get();
    for (int i = 0; i < rounds; ++i) {
      const auto start = Clock::now();
      group.all_reduce(v).get();
      stay.push_back(us_since(start));
    }
    // Two threads that live on and take turns, the idle one asleep in a futex meanwhile (a pool's
    // workers); a call's time starts once its thread is awake.
    std::vector<double> turns;
    std::atomic<int> next{0};
    group.barrier().get();
    auto worker = [&](int me) {
      for (int i = me; i < rounds; i += 2) {
        for (int now = next.load(); now != i; now = next.load()) next.wait(now);
        const auto start = Clock::now();
        group.all_reduce(v).get();
        turns.push_back(us_since(start));
        next.store(i + 1);
        next.notify_all();
      }
    };
    std::thread first(worker, 0), second(worker, 1);
    first.join();
    second.join();
    if (group.rank() == 0) {
      const auto [hop_median, hop_max] = median_max(hop);
      const auto [ending_median, ending_max] = median_max(ending);
      const auto [stay_median, stay_max] = median_max(stay);
      const auto [turns_median, turns_max] = median_max(turns);
      std::printf("thread-hop: %d calls, a new thread each: median %.1f us, max %.1f us (the thread's end: median %.1f, max %.1f); "
                  "one thread: median %.1f us, max %.1f us; two threads taking turns: median %.1f us, max %.1f us\n",
                  rounds, hop_median, hop_max, ending_median, ending_max, stay_median, stay_max, turns_median, turns_max);
    }
    return 0;
  }
  if (mode == "start-after-calls") {
    const int rounds = argc > 2 ? std::atoi(argv[2]) : 50;
    std::vector<float> v(2, 1.0F);
    using Clock = std::chrono::steady_clock;
    auto left_alone = [&] {  // one call started and left alone: the time from its start to ready()
      const auto start = Clock::now();
      weft::Future<void> left = group.all_reduce(v);
      while (!left.ready()) std::this_thread::sleep_for(20us);
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
      left.get();
      return us;
    };
    std::vector<double> after_calls, alone;
    for (int i = 0; i < rounds; ++i) {
      group.barrier().get();
      for (int k = 0; k < 200; ++k) group.all_reduce(v).get();
      after_calls.push_back(left_alone());
    }
    group.barrier().get();
    for (int i = 0; i < rounds; ++i) alone.push_back(left_alone());
    group.barrier().get();
    if (group.rank() == 0 && rounds > 0) {
      for (auto* us : {&after_calls, &alone}) std::sort(us->begin(), us->end());
      auto at = [](const std::vector<double>& us, int percent) { return us[us.size() * static_cast<std::size_t>(percent) / 100]; };
      std::printf("start-after-calls: %d rounds, start to ready after 200 blocking calls: median %.1f us, p90 %.1f us, max %.1f us; "
                  "one after another: median %.1f us, p90 %.1f us, max %.1f us\n",
                  rounds, at(after_calls, 50), at(after_calls, 90), after_calls.back(), at(alone, 50), at(alone, 90), alone.back());
    }
    return 0;
  }
  if (mode == "kill-windows") {
    namespace gpu = weft::gpu;
    const int victim = argc > 2 ? std::atoi(argv[2]) : p - 1;
    const std::size_t count = 4099;
    const weft::Device device = gpu::device(group.rank() % gpu::device_count());
    gpu::Stream stream(loop, device);
    gpu::DeviceBuffer in = gpu::DeviceBuffer::allocate(device, count * sizeof(float));
    gpu::DeviceBuffer out = gpu::DeviceBuffer::allocate(device, count * sizeof(float));
    std::vector<float> host(count, static_cast<float>(group.rank() + 1));
    try {
      stream.copy(in.view<float>(), weft::ConstBufferView(host.data(), count, weft::DType::f32)).get();
      group.all_reduce(in.view<float>(), out.view<float>()).get();
      stream.copy(weft::BufferView(host.data(), count, weft::DType::f32), out.view<float>()).get();
      const float want = static_cast<float>(p * (p + 1) / 2);
      if (host[0] != want || host[count - 1] != want) {
        std::printf("rank %d: the first all_reduce gave %g instead of %g\n", group.rank(), host[0], want);
        return 6;
      }
      group.barrier().get();
      if (group.rank() == victim) {
        gpu::Gate never;  // this rank's instance of the next call never starts on its device
        stream.wait(never);
        weft::Future<void> f = group.on(stream).all_reduce(in.view<float>(), out.view<float>());
        std::this_thread::sleep_for(500ms);  // the call's agreement done: the others' kernels wait for this device
        const bool stop = argc > 3 && std::string(argv[3]) == "stop";
        std::printf("rank %d: %s at %lld\n", group.rank(), stop ? "stopped" : "killed", epoch_ms());
        std::fflush(stdout);
        raise(stop ? SIGSTOP : SIGKILL);
        return 0;  // continued after a stop by someone else: the victim's part ends here
      }
      get_or_hang_up(group, group.all_reduce(in.view<float>(), out.view<float>()), 30s);
      std::printf("rank %d: no error after the victim died\n", group.rank());
      return 4;
    } catch (const weft::Error& e) {
      const bool names = std::strstr(e.what(), ("rank " + std::to_string(victim)).c_str()) != nullptr;
      std::printf("rank %d: failed at %lld: %s\n", group.rank(), epoch_ms(), e.what());
      std::fflush(stdout);
      return names ? 0 : 5;
    }
  }
  if (mode == "loop") {
    const std::string name = argc > 2 ? argv[2] : "all_reduce";
    const long iterations = argc > 3 ? std::atol(argv[3]) : 1000;
    const std::size_t count = argc > 4 ? static_cast<std::size_t>(std::atol(argv[4])) : 65536;
    // WEFT_TEST_PAUSE=R:N:MS: rank R sleeps MS ms before its collective #N, while the others wait in it
    // (their loops asleep: tests/system/faults kill-fast).
    int pause_rank = -1;
    long pause_before = -1, pause_ms = 0;
    if (const char* v = std::getenv("WEFT_TEST_PAUSE")) std::sscanf(v, "%d:%ld:%ld", &pause_rank, &pause_before, &pause_ms);
    const long long start = epoch_ms();
    std::printf("rank %d: started at %lld\n", group.rank(), start);
    std::fflush(stdout);
    try {
      for (long it = 0; it < iterations; ++it) {
        if (pause_rank == group.rank() && pause_before == it) {
          std::printf("rank %d: pausing at %lld\n", group.rank(), epoch_ms());
          std::fflush(stdout);
          std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
        }
        const auto wrong = run_checked(group, name, count, it);
        if (!wrong.empty()) {
          std::printf("rank %d: WRONG %s\n", group.rank(), wrong.c_str());
          return 6;
        }
        if ((it + 1) % 10000 == 0 && std::getenv("WEFT_SOAK_TRACE")) {
          std::printf("rank %d: after %ld: resident %ld KiB\n", group.rank(), it + 1, resident_kb());
        }
      }
      std::printf("rank %d: completed %ld\n", group.rank(), iterations);
      return 0;
    } catch (const weft::Error& e) {
      std::printf("rank %d: failed at %lld (its collective called at %lld): %s\n", group.rank(), epoch_ms(), called_at, e.what());
      std::fflush(stdout);
    }
    if (const char* v = std::getenv("WEFT_FAULT_SHRINK"); v && std::string(v) == "1") {
      try {
        weft::Group survivors = group.shrink().get();
        for (long it = 0; it < 20; ++it) {
          for (const char* c : {"all_reduce", "all_gather", "broadcast"}) {
            const auto wrong = run_checked(survivors, c, 1001, it);
            if (!wrong.empty()) {
              std::printf("rank %d: WRONG after shrink: %s\n", group.rank(), wrong.c_str());
              return 6;
            }
          }
        }
        std::printf("rank %d: shrunk to %d, ok\n", group.rank(), survivors.size());
      } catch (const weft::Error& e) {
        std::printf("rank %d: shrink failed: %s\n", group.rank(), e.what());
        return 7;
      }
    }
    std::fflush(stdout);
    return 0;
  }
  if (mode == "soak") {
    const long total = argc > 2 ? std::atol(argv[2]) : 100000;
    std::mt19937_64 random(12345);  // the same sequence on every rank
    const std::size_t sizes[] = {0, 1, 3, 7, 64, 100, 1000, 4097, 16384, 65536};
    long warm_rss = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (long it = 0; it < total; ++it) {
      const std::string name = collectives[random() % std::size(collectives)];
      const std::size_t count = sizes[random() % std::size(sizes)];
      std::string wrong;
      try {
        wrong = run_checked(group, name, count, it);
      } catch (const weft::Error& e) {
        wrong = e.what();
      }
      if (!wrong.empty()) {
        std::printf("rank %d: soak error at %ld: %s\n", group.rank(), it, wrong.c_str());
        return 6;
      }
      if (it == 999) warm_rss = resident_kb();
      if ((it + 1) % (total / 10 > 0 ? total / 10 : 1) == 0 && std::getenv("WEFT_SOAK_TRACE")) {
        std::printf("rank %d: after %ld: resident %ld KiB\n", group.rank(), it + 1, resident_kb());
      }
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (std::getenv("WEFT_SOAK_TRACE")) {
      const auto mi = mallinfo2();
      std::printf("rank %d: heap in use %zu KiB, free in heap %zu KiB, mmapped %zu KiB\n", group.rank(), mi.uordblks / 1024,
                  mi.fordblks / 1024, mi.hblkhd / 1024);
    }
    std::printf("rank %d: soak %ld collectives, 0 errors, %.1f s, resident %ld KiB after 1000, %ld KiB at the end\n",
                group.rank(), total, seconds, warm_rss, resident_kb());
    return 0;
  }
  std::fprintf(stderr, "worker: unknown mode %s\n", mode.c_str());
  return 2;
}
