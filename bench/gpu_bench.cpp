// weft-gpu-bench: the device layer's numbers (issue 16's performance list), on whichever backend WEFT_GPU
// picks. Prints a table and, with --json FILE, the same as JSON.
//
//   completion  a small device reduce queued and its Future awaited by a coroutine on the loop: the time
//               from the enqueue to the coroutine running again, p50 / p99 over --runs (10^4 by default)
//   copy        64 MiB (--bytes) host to device and device to host through weft's Stream::copy, from pinned
//               and from pageable host memory, against the raw runtime (cudaMemcpyAsync + synchronize on a
//               stream of its own) where the backend is CUDA
//   all_reduce  2 ranks (threads of this process, TCP over loopback), f32 sum, interleaved, the median of
//               each: host buffers; the serial path on device buffers (the caller copies to pinned host
//               memory, runs a host all_reduce, copies back, each step waited for); and device buffers
//               given to weft (staged, pipelined from Options::staging_copy_bytes up). device / host is
//               the device path's overhead (on the sim with WEFT_SIM_DELAY_US=0: the copies' and the
//               streams' cost alone); device / serial shows what the pipelining wins
//
// Usage: weft-gpu-bench [--runs N] [--bytes B] [--json FILE] [--completion-only]
// (WEFT_CUDA_NOTIFIER picks how CUDA completions reach the host: poll, spin or hostfunc; see
// src/devices/cuda.cpp)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <weft/gpu.hpp>
#include <weft/weft.hpp>

#include "weft_config.h"
#if WEFT_HAVE_CUDA
#include <cuda_runtime.h>
#endif

using namespace weft;
using Clock = std::chrono::steady_clock;

namespace {

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size())))];
}

Task<std::vector<double>> completion_latency(gpu::Stream& stream, gpu::DeviceBuffer& a, gpu::DeviceBuffer& b, int runs) {
  std::vector<double> us;
  us.reserve(static_cast<std::size_t>(runs));
  for (int i = 0; i < runs; ++i) {
    const auto start = Clock::now();
    co_await stream.reduce(a.view(DType::f32), b.view(DType::f32), ReduceOp::sum);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
  }
  co_return us;
}

struct CopyResult {
  std::string name;
  double gbps;
};

template <class Fn>
double best_gbps(std::size_t bytes, int repeats, Fn&& fn) {
  double best = 0;
  for (int i = 0; i < repeats; ++i) {
    const auto start = Clock::now();
    fn();
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    best = std::max(best, static_cast<double>(bytes) / s / 1e9);
  }
  return best;
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

double median(std::vector<double> v) { return percentile(std::move(v), 0.5); }

struct OverheadRow {
  std::size_t bytes;
  double host_us;
  double serial_us;
  double device_us;
};

// Two ranks as threads; each size: rounds of (iters host all_reduces, iters device all_reduces).
std::vector<OverheadRow> all_reduce_overhead(const std::vector<std::size_t>& sizes, int iters, int rounds) {
  std::vector<OverheadRow> rows(sizes.size());
  const std::string store = "127.0.0.1:" + std::to_string(free_port());
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      Loop loop;
      Options options;
      options.store = store;
      options.rank = r;
      options.world_size = 2;
      Group g = Group::create(loop, options).get();
      const Device device = gpu::device(r % gpu::device_count());
      gpu::Stream stream(loop, device);
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        const std::size_t count = sizes[i] / sizeof(float);
        std::vector<float> host(count, 1.0f);
        auto on_device = gpu::DeviceBuffer::allocate(device, count * sizeof(float));
        auto pinned = gpu::PinnedBuffer::allocate(count * sizeof(float));
        std::vector<double> host_us;
        std::vector<double> serial_us;
        std::vector<double> device_us;
        auto timed = [](std::vector<double>& into, auto&& run) {
          const auto start = Clock::now();
          run();
          into.push_back(std::chrono::duration<double, std::micro>(Clock::now() - start).count());
        };
        for (int round = 0; round < rounds; ++round) {
          for (int k = 0; k < iters; ++k) timed(host_us, [&] { g.all_reduce(BufferView(host.data(), count, DType::f32)).get(); });
          for (int k = 0; k < iters; ++k) {
            timed(serial_us, [&] {
              stream.copy(pinned.view<float>(), on_device.view<float>()).get();
              g.all_reduce(pinned.view<float>()).get();
              stream.copy(on_device.view<float>(), pinned.view<float>()).get();
            });
          }
          for (int k = 0; k < iters; ++k) timed(device_us, [&] { g.all_reduce(on_device.view<float>()).get(); });
        }
        g.barrier().get();
        if (r == 0) rows[i] = OverheadRow{sizes[i], median(host_us), median(serial_us), median(device_us)};
      }
    });
  }
  for (auto& t : ranks) t.join();
  return rows;
}


void write_json(const std::string& path, const std::string& json) {
  if (path.empty()) return;
  if (FILE* f = std::fopen(path.c_str(), "w")) {
    std::fputs(json.c_str(), f);
    std::fclose(f);
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool completion_only = false;
  int runs = 10000;
  std::size_t bytes = std::size_t(64) << 20;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--runs" && i + 1 < argc) runs = std::atoi(argv[++i]);
    else if (arg == "--bytes" && i + 1 < argc) bytes = std::strtoull(argv[++i], nullptr, 10);
    else if (arg == "--json" && i + 1 < argc) json_path = argv[++i];
    else if (arg == "--completion-only") completion_only = true;
    else {
      std::fprintf(stderr, "usage: weft-gpu-bench [--runs N] [--bytes B] [--json FILE] [--completion-only]\n");
      return 2;
    }
  }
  Loop loop;
  const Device d0 = gpu::device(0);
  gpu::Stream stream(loop, d0);
  std::string json = fmt::format("{{\"backend\": \"{}\", \"devices\": {}", gpu::backend_name(), gpu::device_count());

  // Completion: a one-element reduce (a real kernel under CUDA) awaited by a coroutine on the loop.
  auto a = gpu::DeviceBuffer::allocate(d0, 4);
  auto b = gpu::DeviceBuffer::allocate(d0, 4);
  const std::vector<double> us = sync_wait(loop, completion_latency(stream, a, b, runs));
  const double p50 = percentile(us, 0.50);
  const double p99 = percentile(us, 0.99);
  const char* notifier = std::getenv("WEFT_CUDA_NOTIFIER");
  fmt::print("backend {} ({} devices), notifier {}\n", gpu::backend_name(), gpu::device_count(),
             notifier ? notifier : "poll (the default)");
  fmt::print("completion (reduce of 1 element -> coroutine resumed on the loop), {} runs: p50 {:.1f} us, p99 {:.1f} us\n",
             runs, p50, p99);
  json += fmt::format(", \"completion_us\": {{\"runs\": {}, \"p50\": {:.2f}, \"p99\": {:.2f}}}", runs, p50, p99);

  if (completion_only) {
    json += "}\n";
    write_json(json_path, json);
    return 0;
  }

  // Copies of `bytes`: each way through weft's Stream::copy and, under CUDA, the raw runtime's
  // cudaMemcpyAsync + synchronize on a stream of its own, interleaved (weft, raw, weft, raw, ...), the best
  // of 5 of each.
  auto device_buffer = gpu::DeviceBuffer::allocate(d0, bytes);
  auto pinned = gpu::PinnedBuffer::allocate(bytes);
  std::vector<std::byte> pageable(bytes, std::byte{1});
  std::memset(pinned.data(), 1, bytes);
  const BufferView dev = device_buffer.view(DType::u8);
  struct Way {
    std::string name;
    void* dst;
    const void* src;
  };
  const std::vector<Way> ways{{"h2d pinned", dev.data, pinned.data()},
                              {"d2h pinned", pinned.data(), dev.data},
                              {"h2d pageable", dev.data, pageable.data()},
                              {"d2h pageable", pageable.data(), dev.data}};
  auto view_of = [&](void* p) { return BufferView(p, bytes, DType::u8, p == dev.data ? d0 : Device{}); };
  std::vector<CopyResult> results;
#if WEFT_HAVE_CUDA
  const bool raw_too = gpu::backend() == gpu::Backend::cuda;
  cudaStream_t raw = nullptr;
  if (raw_too) cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking);
#else
  const bool raw_too = false;
#endif
  for (const Way& way : ways) {
    double weft_best = 0, raw_best = 0;
    for (int repeat = 0; repeat < 5; ++repeat) {
      weft_best = std::max(weft_best, best_gbps(bytes, 1, [&] { stream.copy(view_of(way.dst), view_of(const_cast<void*>(way.src))).get(); }));
#if WEFT_HAVE_CUDA
      if (raw_too) {
        raw_best = std::max(raw_best, best_gbps(bytes, 1, [&] {
                              cudaMemcpyAsync(way.dst, way.src, bytes, cudaMemcpyDefault, raw);
                              cudaStreamSynchronize(raw);
                            }));
      }
#endif
    }
    results.push_back({way.name + " (weft)", weft_best});
    if (raw_too) results.push_back({way.name + " (raw cudaMemcpyAsync)", raw_best});
  }
#if WEFT_HAVE_CUDA
  if (raw) cudaStreamDestroy(raw);
#endif
  // The host's part of the pageable staging: one thread's memcpy between the pinned and the pageable
  // memory (what bounds a staged pageable copy, however it is pipelined).
  results.push_back({"host memcpy pinned -> pageable", best_gbps(bytes, 5, [&] { std::memcpy(pageable.data(), pinned.data(), bytes); })});
  results.push_back({"host memcpy pageable -> pinned", best_gbps(bytes, 5, [&] { std::memcpy(pinned.data(), pageable.data(), bytes); })});
  json += ", \"copy_gbps\": {";
  for (std::size_t i = 0; i < results.size(); ++i) {
    fmt::print("copy {} bytes, {}: {:.2f} GB/s\n", bytes, results[i].name, results[i].gbps);
    json += fmt::format("{}\"{}\": {:.3f}", i ? ", " : "", results[i].name, results[i].gbps);
  }
  json += "}";

  // all_reduce on device buffers against host buffers.
  std::vector<std::size_t> sizes{4096, std::size_t{1} << 20};
  if (bytes > sizes.back()) sizes.push_back(bytes);
  const auto rows = all_reduce_overhead(sizes, 20, 3);
  json += ", \"all_reduce_us\": [";
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const auto& row = rows[i];
    fmt::print("all_reduce f32 sum, 2 ranks (tcp loopback), {} bytes: host buffers {:.1f} us, serial device path {:.1f} us, "
               "device buffers {:.1f} us (device/host {:.2f}x, device/serial {:.2f}x)\n",
               row.bytes, row.host_us, row.serial_us, row.device_us, row.device_us / row.host_us, row.device_us / row.serial_us);
    json += fmt::format("{}{{\"bytes\": {}, \"host\": {:.2f}, \"serial\": {:.2f}, \"device\": {:.2f}}}", i ? ", " : "",
                        row.bytes, row.host_us, row.serial_us, row.device_us);
  }
  json += "]}\n";
  write_json(json_path, json);
  return 0;
}
