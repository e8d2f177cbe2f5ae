// weft-device-set-bench: issue 17's numbers, the all_reduce across the devices of one process
// (gpu::DeviceSet), N entries on the devices there are (N logical devices on GPU 0 where there is one:
// a device with itself counts as peer to peer), f32 sum, out of place, sizes from --min to --max bytes
// by factors of 4 (and --max itself).
//
// nccl-tests' way: per size, --iters calls queued back to back after --warmup, then the last one waited
// for; the time is the average per call, algbw = bytes / time. Beside each size, the device-to-device
// copy of the same bytes on one stream timed the same way (under CUDA the raw cudaMemcpyAsync, on the
// sim weft's Stream::copy): issue 17 asks the peer path for >= 50% of the copy's bandwidth from 16 MiB.
//
// The path is the one WEFT_DEVICE_SET picks (auto, one_stage, two_stage, naive; src/devices/device_set.cpp),
// printed in every row, so one run per path gives the crossover and the naive path's cost.
//
// Usage: weft-device-set-bench [--entries 2,4,8] [--min B] [--max B] [--iters N] [--warmup N] [--json FILE]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> out;
  std::size_t at = 0;
  while (at < text.size()) {
    const std::size_t comma = text.find(',', at);
    out.push_back(std::atoi(text.substr(at, comma == std::string::npos ? std::string::npos : comma - at).c_str()));
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  return out;
}

// Iterations for a size: enough calls that the queue, not the host, sets the pace, and not minutes.
int iterations_for(std::size_t bytes, int asked) {
  if (asked > 0) return asked;
  if (bytes <= (std::size_t{1} << 20)) return 200;
  if (bytes <= (std::size_t{32} << 20)) return 40;
  return 10;
}

// The device-to-device copy of `bytes` on one stream, timed as the all_reduce: us per copy.
double copy_us(Loop& loop, gpu::DeviceBuffer& dst, gpu::DeviceBuffer& src, std::size_t bytes, int warmup, int iters) {
  (void)loop;
#if WEFT_HAVE_CUDA
  if (gpu::backend() == gpu::Backend::cuda) {
    cudaStream_t raw = nullptr;
    cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking);
    for (int i = 0; i < warmup; ++i) cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, raw);
    cudaStreamSynchronize(raw);
    const auto start = Clock::now();
    for (int i = 0; i < iters; ++i) cudaMemcpyAsync(dst.data(), src.data(), bytes, cudaMemcpyDeviceToDevice, raw);
    cudaStreamSynchronize(raw);
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / iters;
    cudaStreamDestroy(raw);
    return us;
  }
#endif
  gpu::Stream stream(loop, dst.device());
  const BufferView to(dst.data(), bytes, DType::u8, dst.device());
  const ConstBufferView from(src.data(), bytes, DType::u8, src.device());
  for (int i = 0; i < warmup; ++i) stream.copy(to, from).get();
  Future<void> last;
  const auto start = Clock::now();
  for (int i = 0; i < iters; ++i) last = stream.copy(to, from);
  last.get();
  return std::chrono::duration<double, std::micro>(Clock::now() - start).count() / iters;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> entries{2, 4, 8};
  std::size_t min_bytes = 8;
  std::size_t max_bytes = std::size_t{256} << 20;
  int iters = 0;
  int warmup = 3;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--entries" && i + 1 < argc) entries = parse_list(argv[++i]);
    else if (arg == "--min" && i + 1 < argc) min_bytes = std::strtoull(argv[++i], nullptr, 10);
    else if (arg == "--max" && i + 1 < argc) max_bytes = std::strtoull(argv[++i], nullptr, 10);
    else if (arg == "--iters" && i + 1 < argc) iters = std::atoi(argv[++i]);
    else if (arg == "--warmup" && i + 1 < argc) warmup = std::atoi(argv[++i]);
    else if (arg == "--json" && i + 1 < argc) json_path = argv[++i];
    else {
      std::fprintf(stderr, "usage: weft-device-set-bench [--entries 2,4,8] [--min B] [--max B] [--iters N] [--warmup N] [--json FILE]\n");
      return 2;
    }
  }
  std::vector<std::size_t> sizes;
  for (std::size_t b = std::max<std::size_t>(min_bytes, 4); b <= max_bytes; b *= 4) sizes.push_back(b / 4 * 4);
  if (sizes.empty() || sizes.back() != max_bytes / 4 * 4) sizes.push_back(max_bytes / 4 * 4);

  const char* path_env = std::getenv("WEFT_DEVICE_SET");
  const std::string path = path_env && *path_env ? path_env : "auto";
  Loop loop;
  std::string json = fmt::format("{{\"backend\": \"{}\", \"devices\": {}, \"path\": \"{}\", \"rows\": [", gpu::backend_name(),
                                 gpu::device_count(), path);
  fmt::print("backend {} ({} devices), WEFT_DEVICE_SET={}, f32 sum, out of place\n", gpu::backend_name(), gpu::device_count(), path);
  fmt::print("{:>3} {:>11} {:>10} {:>5} {:>11} {:>10} {:>11} {:>10} {:>8}\n", "N", "bytes", "path", "iters", "time(us)",
             "algbw GB/s", "copy(us)", "copy GB/s", "vs copy");
  bool first_row = true;
  for (int n : entries) {
    std::vector<Device> devices;
    for (int i = 0; i < n; ++i) devices.push_back(gpu::device(i % gpu::device_count()));
    gpu::DeviceSet set = gpu::DeviceSet::create(loop, devices);
    std::vector<gpu::DeviceBuffer> inputs, outputs;
    const std::size_t most = sizes.back();
    std::vector<float> ones(std::min<std::size_t>(most, std::size_t{64} << 20) / sizeof(float), 1.0f);
    for (const Device& d : devices) {
      inputs.push_back(gpu::DeviceBuffer::allocate(d, most));
      outputs.push_back(gpu::DeviceBuffer::allocate(d, most));
      // Every input 1.0f (the check below: every output n).
      gpu::Stream s(loop, d);
      for (std::size_t at = 0; at < most; at += ones.size() * sizeof(float)) {
        const std::size_t piece = std::min(ones.size() * sizeof(float), most - at);
        s.copy(BufferView(static_cast<std::byte*>(inputs.back().data()) + at, piece, DType::u8, d),
               ConstBufferView(ones.data(), piece, DType::u8))
            .get();
      }
    }
    for (const std::size_t bytes : sizes) {
      const std::size_t count = bytes / sizeof(float);
      std::vector<ConstBufferView> in;
      std::vector<BufferView> out;
      for (int i = 0; i < n; ++i) {
        in.emplace_back(inputs[static_cast<std::size_t>(i)].data(), count, DType::f32, devices[static_cast<std::size_t>(i)]);
        out.emplace_back(outputs[static_cast<std::size_t>(i)].data(), count, DType::f32, devices[static_cast<std::size_t>(i)]);
      }
      const int runs = iterations_for(bytes, iters);
      for (int i = 0; i < warmup; ++i) set.all_reduce(in, out).get();
      // Queued back to back; each call orders after the last on the set's streams, so waiting for the
      // last waits for all. The Futures are kept (dropping one does not cancel, but keep them plain).
      std::vector<Future<void>> calls;
      calls.reserve(static_cast<std::size_t>(runs));
      const auto start = Clock::now();
      for (int i = 0; i < runs; ++i) calls.push_back(set.all_reduce(in, out));
      for (auto& f : calls) f.get();
      const double us = std::chrono::duration<double, std::micro>(Clock::now() - start).count() / runs;
      // A check that the numbers are of a real reduction: the last output's first and last element.
      float firstlast[2] = {0, 0};
      if (count > 0) {
        gpu::Stream s(loop, devices.back());
        s.copy(BufferView(&firstlast[0], 1, DType::f32), ConstBufferView(out.back().data, 1, DType::f32, devices.back())).get();
        s.copy(BufferView(&firstlast[1], 1, DType::f32),
               ConstBufferView(static_cast<float*>(out.back().data) + count - 1, 1, DType::f32, devices.back()))
            .get();
        if (firstlast[0] != static_cast<float>(n) || firstlast[1] != static_cast<float>(n)) {
          fmt::print(stderr, "N {} bytes {}: output {} .. {}, expected {}\n", n, bytes, firstlast[0], firstlast[1], n);
          return 1;
        }
      }
      const double copy = copy_us(loop, outputs[0], inputs[0], bytes, warmup, runs);
      const double algbw = static_cast<double>(bytes) / us / 1e3;
      const double copybw = static_cast<double>(bytes) / copy / 1e3;
      const std::string taken = set.peer_to_peer() ? path : "naive";
      fmt::print("{:>3} {:>11} {:>10} {:>5} {:>11.1f} {:>10.2f} {:>11.1f} {:>10.2f} {:>7.0f}%\n", n, bytes, taken, runs, us, algbw, copy,
                 copybw, 100 * algbw / copybw);
      json += fmt::format("{}{{\"entries\": {}, \"bytes\": {}, \"path\": \"{}\", \"peer_to_peer\": {}, \"iters\": {}, \"us\": {:.3f}, "
                          "\"copy_us\": {:.3f}}}",
                          first_row ? "" : ", ", n, bytes, taken, set.peer_to_peer() ? "true" : "false", runs, us, copy);
      first_row = false;
      std::fflush(stdout);
    }
  }
  json += "]}\n";
  if (!json_path.empty()) {
    if (FILE* f = std::fopen(json_path.c_str(), "w")) {
      std::fputs(json.c_str(), f);
      std::fclose(f);
    }
  }
  return 0;
}
