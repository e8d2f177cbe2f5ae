// A training step's shape: the gradients come in buckets, last layer first; each bucket's all_reduce
// starts as soon as its gradient is "computed", while the next bucket's compute runs, and the step waits
// for every bucket at the end (as DDP's gradient buckets do).
//
// Three forms of the same step, each timed IMB-NBC's way (t_pure: the all_reduces alone; t_cpu: the
// compute alone; t_ovrl: both as a training step does them; overlap % = 100 max(0, min(1, (t_pure +
// t_cpu - t_ovrl) / min(t_pure, t_cpu)))), plus the exposed communication: the time from the end of the
// compute to the last bucket's completion, which tells "progressed during the compute" from "took turns
// with it" where the cores are few (a loopback transfer keeps a core busy per rank):
//   wait()              plain code: compute on this thread, Future::wait() at the end
//   co_await+offload    a coroutine on weft's loop that offloads each bucket's compute (weft::offload)
//   co_await, inline    the same coroutine computing on the loop's own thread: the loop stalls, so the
//                       all_reduces cannot progress during the compute (shown for contrast)
// Every bucket's result is checked. Run: weft-run -n 2 -- example-overlap [BYTES] [BUCKETS] [ITERS]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <weft/weft.hpp>

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) { return std::chrono::duration<double, std::milli>(Clock::now() - t0).count(); }

// A bucket's backward pass: CPU work over a small activation buffer of its own (in cache: it competes
// for the core, as a layer's math would). `reps` is calibrated so that all buckets take about t_pure.
float compute_bucket(std::vector<float>& activations, std::size_t reps) {
  for (std::size_t k = 0; k < reps; ++k) {
    for (float& a : activations) a = a * 0.999f + 0.001f;
  }
  return activations[reps % activations.size()];
}

struct Step {
  weft::Group& group;
  std::vector<std::vector<float>> buckets;      // gradients, all-reduced in place
  std::vector<std::vector<float>> activations;  // what the compute touches
  std::size_t reps = 1;
  float sink = 0;

  void reset() {
    for (auto& b : buckets) std::fill(b.begin(), b.end(), static_cast<float>(group.rank() + 1));
  }
  // Elements that are not the sum over the ranks.
  std::size_t wrong() const {
    const float expected = static_cast<float>(group.size() * (group.size() + 1) / 2);
    std::size_t bad = 0;
    for (const auto& b : buckets) bad += static_cast<std::size_t>(std::count_if(b.begin(), b.end(), [&](float v) { return v != expected; }));
    return bad;
  }
};

struct Timing {
  double total_ms = 0;    // the whole step
  double exposed_ms = 0;  // from the end of the last compute to the last completion
};

// t_pure: every bucket's all_reduce started back to back, then all waited.
double pure(Step& s) {
  s.reset();
  const auto t0 = Clock::now();
  std::vector<weft::Future<void>> running;
  for (auto& b : s.buckets) running.push_back(s.group.all_reduce(b));
  for (auto& f : running) f.get();
  return ms_since(t0);
}

// t_cpu: every bucket's compute, nothing else.
double cpu(Step& s) {
  const auto t0 = Clock::now();
  for (auto& a : s.activations) s.sink += compute_bucket(a, s.reps);
  return ms_since(t0);
}

// Plain code: compute a bucket, start its all_reduce, go on; wait for all at the end.
Timing step_waited(Step& s) {
  s.reset();
  const auto t0 = Clock::now();
  std::vector<weft::Future<void>> running;
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    s.sink += compute_bucket(s.activations[b], s.reps);
    running.push_back(s.group.all_reduce(s.buckets[b]));
  }
  const auto computed = Clock::now();
  for (auto& f : running) f.get();
  return {ms_since(t0), ms_since(computed)};
}

// The coroutine form. With `offload` the compute runs on a compute thread while this coroutine's loop
// goes on moving the buckets already started; without it, it runs right here, on the loop's thread.
weft::Task<Timing> step_awaited(Step& s, bool offload) {
  s.reset();
  const auto t0 = Clock::now();
  std::vector<weft::Future<void>> running;
  for (std::size_t b = 0; b < s.buckets.size(); ++b) {
    auto& activations = s.activations[b];
    if (offload) {
      s.sink += co_await weft::offload([&] { return compute_bucket(activations, s.reps); });
    } else {
      s.sink += compute_bucket(activations, s.reps);
    }
    running.push_back(s.group.all_reduce(s.buckets[b]));
  }
  const auto computed = Clock::now();
  for (auto& f : running) co_await std::move(f);
  co_return Timing{ms_since(t0), ms_since(computed)};
}

double max_across(weft::Group& g, double v) {
  std::vector<double> x{v};
  g.all_reduce(x, weft::ReduceOp::max).get();
  return x[0];
}

std::size_t parse_bytes(const char* text) {
  char* end = nullptr;
  double v = std::strtod(text, &end);
  const std::string suffix(end);
  if (suffix == "K") v *= 1024;
  if (suffix == "M") v *= 1024 * 1024;
  if (suffix == "G") v *= 1024.0 * 1024 * 1024;
  return static_cast<std::size_t>(v);
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t bytes = argc > 1 ? parse_bytes(argv[1]) : std::size_t{64} << 20;
  const int bucket_count = argc > 2 ? std::atoi(argv[2]) : 8;
  const int iters = argc > 3 ? std::atoi(argv[3]) : 3;
  if (bucket_count < 1 || iters < 1) {
    std::fprintf(stderr, "usage: example-overlap [BYTES] [BUCKETS >= 1] [ITERS >= 1]\n");
    return 2;
  }
  weft::Loop loop;
  weft::Group group = weft::Group::create(loop).get();
  Step s{group, {}, {}};
  const std::size_t per_bucket = std::max<std::size_t>(1, bytes / sizeof(float) / static_cast<std::size_t>(bucket_count));
  s.buckets.assign(static_cast<std::size_t>(bucket_count), std::vector<float>(per_bucket));
  s.activations.assign(static_cast<std::size_t>(bucket_count), std::vector<float>(1024, 1.0f));

  // Calibrate: the compute of all buckets about as long as the all_reduces alone (the hardest case for
  // overlap, as in IMB-NBC). Every rank takes the slowest rank's figures.
  pure(s);  // warm-up: connections, buffers
  std::vector<double> first{pure(s), pure(s), pure(s)};
  std::sort(first.begin(), first.end());
  const double t_pure_first = max_across(group, first[1]);
  for (s.reps = 1;; s.reps *= 2) {
    const double took = cpu(s);
    if (took >= t_pure_first / 4 || took >= 50) {
      s.reps = static_cast<std::size_t>(static_cast<double>(s.reps) * t_pure_first / std::max(took, 1e-3)) + 1;
      break;
    }
  }
  s.reps = static_cast<std::size_t>(max_across(group, static_cast<double>(s.reps)));

  struct Form {
    const char* name;
    std::vector<double> pure, cpu, ovrl, exposed;
  };
  Form forms[] = {{"wait()", {}, {}, {}, {}}, {"co_await+offload", {}, {}, {}, {}}, {"co_await, inline", {}, {}, {}, {}}};
  std::size_t wrong = 0;
  for (int it = 0; it < iters; ++it) {
    for (int f = 0; f < 3; ++f) {
      group.barrier().get();
      const double t_pure = pure(s);
      wrong += s.wrong();
      group.barrier().get();
      const double t_cpu = cpu(s);
      group.barrier().get();
      const Timing t = f == 0 ? step_waited(s) : weft::sync_wait(loop, step_awaited(s, f == 1));
      wrong += s.wrong();
      forms[f].pure.push_back(max_across(group, t_pure));
      forms[f].cpu.push_back(max_across(group, t_cpu));
      forms[f].ovrl.push_back(max_across(group, t.total_ms));
      forms[f].exposed.push_back(max_across(group, t.exposed_ms));
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::vector<double> all_wrong{static_cast<double>(wrong)};
  group.all_reduce(all_wrong).get();
  if (group.rank() == 0) {
    std::printf("overlap: %d ranks over %s, %zu bytes in %d buckets, median of %d (times in ms, the slowest rank's)\n",
                group.size(), std::string(group.transport_name()).c_str(), per_bucket * sizeof(float) * static_cast<std::size_t>(bucket_count),
                bucket_count, iters);
    std::printf("%-18s %10s %10s %10s %9s %12s %10s\n", "form", "t_pure", "t_cpu", "t_ovrl", "overlap%", "exposed", "exposed%");
    for (const Form& f : forms) {
      const double p = median(f.pure), c = median(f.cpu), o = median(f.ovrl), e = median(f.exposed);
      const double shorter = std::min(p, c);
      const double percent = shorter > 0 ? 100 * std::clamp((p + c - o) / shorter, 0.0, 1.0) : 0;
      // exposed%: the share of the communication alone that was still left when the compute ended.
      std::printf("%-18s %10.2f %10.2f %10.2f %9.1f %12.2f %10.1f\n", f.name, p, c, o, percent, e, p > 0 ? 100 * e / p : 0);
    }
  }
  if (all_wrong[0] != 0) {
    std::printf("rank %d: FAILED: %.0f wrong elements over all ranks\n", group.rank(), all_wrong[0]);
    return 1;
  }
  std::printf("rank %d: every bucket reduced correctly\n", group.rank());
  return s.sink == 12345.0f ? 3 : 0;  // keeps the compute observable
}
