// The in-process multi-device all_reduce's barrier and algorithms (src/kernels/peer/all_reduce.hpp), run
// as the simulated device runs them: one host thread per (device, block), std::atomic_ref for the flags.
// Under ThreadSanitizer (tests/sanitize.sh) a missing release/acquire pair shows as a race on the data.
//
// Each device's threads run the rounds back to back, as kernels on a stream: between two rounds a
// device's blocks meet (the kernel's end) and block 0 checks the output and writes the next round's
// input, which a peer that had not finished reading the last one would see (what the end barrier is
// for).
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include "kernels/peer/all_reduce.hpp"
#include "kernels/peer/host_atomics.hpp"

namespace peer = weft::kernels::peer;

namespace {

// A lost wake-up fails the test after 20 s instead of hanging it.
using HostAtomics = peer::HostAtomics<peer::Seconds<20>>;

enum class Algorithm { one_stage, two_stage, two_stage_in_place };

// Every element of every input differs from round to round and device to device; integers so that the
// reference is exact, float so that the accumulation order shows (sum of values of different scale).
float input_value(int round, int device, std::size_t i) {
  return static_cast<float>((round * 7 + device * 131 + static_cast<int>(i % 1013)) % 977) * (device % 2 ? 1e-3f : 1.0f) + 0.5f;
}

struct Sum {
  float operator()(float a, float b) const { return a + b; }
};
struct Scale {
  float factor;
  float operator()(float v, std::size_t) const { return v * factor; }
};

struct Run {
  int n, blocks;
  std::size_t count;
  int rounds;
  Algorithm algorithm;
  std::uint32_t first_flag = 0;  // signals filled with this (counters near 2^32 wrap)
  float scale = 1.0f;            // the epilogue
};

// Runs `run`; returns "" or the first failure's words.
std::string run_all_reduce(const Run& run) {
  const int n = run.n;
  std::vector<std::unique_ptr<peer::Signal>> signals;
  std::vector<std::vector<float>> in(static_cast<std::size_t>(n)), out(static_cast<std::size_t>(n)), tmp(static_cast<std::size_t>(n));
  std::vector<const float*> in_ptrs(static_cast<std::size_t>(n));
  std::vector<float*> tmp_ptrs(static_cast<std::size_t>(n));
  for (int d = 0; d < n; ++d) {
    auto s = std::make_unique<peer::Signal>();
    std::fill_n(&s->start[0][0], peer::max_blocks * peer::max_devices, run.first_flag);
    std::fill_n(&s->end[0][0], peer::max_blocks * peer::max_devices, run.first_flag);
    std::fill_n(s->flag, peer::max_blocks, run.first_flag);
    signals.push_back(std::move(s));
    auto& input = in[static_cast<std::size_t>(d)];
    input.resize(run.count);
    for (std::size_t i = 0; i < run.count; ++i) input[i] = input_value(0, d, i);
    out[static_cast<std::size_t>(d)].assign(run.count, -1.0f);
    tmp[static_cast<std::size_t>(d)].resize(peer::share(run.count, d, n).last - peer::share(run.count, d, n).first + 1);
    in_ptrs[static_cast<std::size_t>(d)] = input.data();
    tmp_ptrs[static_cast<std::size_t>(d)] = tmp[static_cast<std::size_t>(d)].data();
  }
  std::mutex failure_mutex;
  std::string failure;
  auto fail = [&](std::string why) {
    std::lock_guard lock(failure_mutex);
    if (failure.empty()) failure = std::move(why);
  };
  std::vector<std::unique_ptr<std::barrier<>>> kernel_end;
  for (int d = 0; d < n; ++d) kernel_end.push_back(std::make_unique<std::barrier<>>(run.blocks));
  std::vector<float> reference(run.count);
  std::vector<std::thread> threads;
  for (int d = 0; d < n; ++d) {
    for (int b = 0; b < run.blocks; ++b) {
      threads.emplace_back([&, d, b] {
        peer::Devices devices;
        devices.rank = d;
        devices.n = n;
        for (int k = 0; k < n; ++k) devices.signals[k] = signals[static_cast<std::size_t>(k)].get();
        auto& mine_in = in[static_cast<std::size_t>(d)];
        auto& mine_out = run.algorithm == Algorithm::two_stage_in_place ? mine_in : out[static_cast<std::size_t>(d)];
        std::vector<float> want(run.count);
        for (int round = 0; round < run.rounds; ++round) {
          bool ok = false;
          if (run.algorithm == Algorithm::one_stage) {
            ok = peer::one_stage<HostAtomics, float, float>(devices, b, run.blocks, 0, 1, in_ptrs.data(), mine_out.data(), run.count, Sum{},
                                                           Scale{run.scale});
          } else {
            ok = peer::two_stage<HostAtomics, float, float>(devices, b, run.blocks, 0, 1, in_ptrs.data(), mine_out.data(), tmp_ptrs.data(),
                                                           run.count, Sum{}, Scale{run.scale});
          }
          if (!ok) {
            fail(fmt::format("device {} block {} round {}: a barrier's spin gave up", d, b, round));
            kernel_end[static_cast<std::size_t>(d)]->arrive_and_drop();  // this device's other blocks go on
            return;  // the other devices give up too, at their bound
          }
          kernel_end[static_cast<std::size_t>(d)]->arrive_and_wait();  // the kernel's end on this device
          if (b == 0) {
            // The reference: rank order, then the epilogue, from the round's values (not the peers' memory).
            for (std::size_t i = 0; i < run.count; ++i) {
              float acc = input_value(round, 0, i);
              for (int k = 1; k < n; ++k) acc = acc + input_value(round, k, i);
              want[i] = acc * run.scale;
            }
            if (std::memcmp(mine_out.data(), want.data(), run.count * sizeof(float)) != 0) {
              std::size_t at = 0;
              while (at < run.count && std::memcmp(&mine_out[at], &want[at], sizeof(float)) == 0) ++at;
              fail(fmt::format("device {} round {}: element {} is {}, not {} (bitwise)", d, round, at, mine_out[at], want[at]));
            }
            // The next round's input, written right after this device's kernel, as the next work on its
            // stream would: a peer still reading this round's would read it.
            for (std::size_t i = 0; i < run.count; ++i) mine_in[i] = input_value(round + 1, d, i);
          }
          kernel_end[static_cast<std::size_t>(d)]->arrive_and_wait();
        }
      });
    }
  }
  for (auto& t : threads) t.join();
  return failure;
}

std::string name(const Run& r) {
  const char* a = r.algorithm == Algorithm::one_stage ? "one-stage" : r.algorithm == Algorithm::two_stage ? "two-stage" : "two-stage in place";
  return fmt::format("{} n={} blocks={} count={} rounds={} first flag {:#x}", a, r.n, r.blocks, r.count, r.rounds, r.first_flag);
}

}  // namespace

TEST_CASE("peer all_reduce: every device gets the rank-order sum, bitwise, for 1-8 devices and ragged sizes", "[peer]") {
  for (Algorithm a : {Algorithm::one_stage, Algorithm::two_stage, Algorithm::two_stage_in_place}) {
    for (int n : {1, 2, 3, 4, 8}) {
      for (int blocks : {1, 3}) {
        for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}, std::size_t{4099}}) {
          const Run run{n, blocks, count, count > 1000 ? 4 : 12, a};
          const std::string why = run_all_reduce(run);
          if (!why.empty()) FAIL(name(run) + ": " + why);
          CHECK(why.empty());
        }
      }
    }
  }
}

TEST_CASE("peer all_reduce: the epilogue is applied once per element", "[peer]") {
  for (Algorithm a : {Algorithm::one_stage, Algorithm::two_stage_in_place}) {
    Run run{4, 2, 333, 6, a};
    run.scale = 0.25f;  // applied twice, or to a partial sum, the bits differ
    const std::string why = run_all_reduce(run);
    if (!why.empty()) FAIL(name(run) + ": " + why);
  }
}

TEST_CASE("peer all_reduce: counters that wrap past 2^32, and 10^4 calls back to back", "[peer]") {
  for (Algorithm a : {Algorithm::one_stage, Algorithm::two_stage}) {
    Run wrap{3, 2, 65, 40, a};
    wrap.first_flag = 0xFFFFFFF0u;  // the flags pass 0 in round 16
    const std::string why = run_all_reduce(wrap);
    if (!why.empty()) FAIL(name(wrap) + ": " + why);
  }
  const Run many{4, 2, 16, 10000, Algorithm::two_stage};
  const std::string why = run_all_reduce(many);
  if (!why.empty()) FAIL(name(many) + ": " + why);
}
