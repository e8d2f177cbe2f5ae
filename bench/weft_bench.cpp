// weft-bench: collective benchmarks in the manner of nccl-tests (algbw, busbw, #wrong; out of place and
// in place). Runs under weft-run, torchrun-style environments, or mpirun.
//
//   weft-bench -c COLLECTIVE -b MINBYTES -e MAXBYTES -f FACTOR -d DTYPE -o OP -r ROOT -w WARMUP -n ITERS
//              [--check] [--await] [--overlap] [--json FILE] [--tune [FILE]]
#include <unistd.h>

#include <algorithm>
#include <ctime>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <weft/gpu.hpp>
#include <weft/weft.hpp>

#include "support/check_data.hpp"

namespace {

// memcpy that takes empty buffers (a zero-length size's vectors have null data: memcpy must not see them).
void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes) std::memcpy(dst, src, bytes);
}

using namespace weft;

enum class Kind { all_reduce, all_gather, reduce_scatter, broadcast, reduce, gather, scatter, all_to_all, barrier, ping_pong, stream };

struct CollectiveInfo {
  Kind kind;
  const char* name;
  bool rooted;
  bool reduces;
};

constexpr CollectiveInfo collectives[] = {
    {Kind::all_reduce, "all_reduce", false, true},
    {Kind::all_gather, "all_gather", false, false},
    {Kind::reduce_scatter, "reduce_scatter", false, true},
    {Kind::broadcast, "broadcast", true, false},
    {Kind::reduce, "reduce", true, true},
    {Kind::gather, "gather", true, false},
    {Kind::scatter, "scatter", true, false},
    {Kind::all_to_all, "all_to_all", false, false},
    {Kind::barrier, "barrier", false, false},
    // Point to point between ranks 0 and 1 (the others wait): half a round trip; and a window of sends
    // in flight at once (time per message), as OSU's osu_latency and osu_bw measure them.
    {Kind::ping_pong, "ping_pong", false, false},
    {Kind::stream, "stream", false, false},
};

// Messages in flight per iteration of `stream` (osu_bw's window).
constexpr int stream_window = 64;

struct Args {
  const CollectiveInfo* collective = &collectives[0];
  std::size_t min_bytes = 8;
  std::size_t max_bytes = 64 << 20;
  double factor = 2;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
  int root = 0;
  int warmup = 5;
  int iters = 20;
  bool check = false;
  bool wait_each = false;  // --wait-each: stream's window waited on one Future after the other
  int receiver_late_us = 0;  // --receiver-late US: stream's receiver posts each window this long after the last
  bool awaited = false;  // --await: the timed loop is one coroutine on weft's loop, co_await-ing each call
  bool overlap = false;  // --overlap: the collective against compute of the same length (IMB-NBC)
  bool device = false;   // --device: buffers in device memory (weft/gpu.hpp)
  bool variable = false;  // --variable: the v-form (all_gatherv, ...) with a count per rank, all equal
  std::string json;
  std::string tune;  // --tune [FILE]: sweep every algorithm, write the winners as a tuning file
};

[[noreturn]] void usage(const std::string& problem) {
  if (!problem.empty()) fmt::print(stderr, "weft-bench: {}\n", problem);
  fmt::print(stderr,
             "usage: weft-bench [-c COLLECTIVE] [-b MINBYTES] [-e MAXBYTES] [-f FACTOR] [-d DTYPE] [-o OP]\n"
             "                  [-r ROOT] [-w WARMUP] [-n ITERS] [--check] [--await] [--wait-each] [--receiver-late US] [--overlap]\n"
             "                  [--device] [--variable]\n"
             "                  [--json FILE] [--tune [FILE]]\n"
             "  --await: run the iterations as one coroutine on weft's loop, co_await-ing each collective (the\n"
             "           coroutine-native use); without it each call is waited on from the calling thread\n"
             "  --wait-each: stream's window is waited on one Future after the other from the calling thread\n"
             "           (as Python's `for w in works: w.wait()`), instead of all at once (MPI_Waitall)\n"
             "  --receiver-late US: stream's receiver sleeps US microseconds before it posts each window, so that\n"
             "           the window's messages have arrived (a consumer behind its producer); the time then counts\n"
             "           the sleep: count the receiver's instructions (callgrind, bench/RESULTS.md) rather than time it\n"
             "  --overlap: per size, the collective alone (t_pure), compute of about that length alone (t_cpu),\n"
             "           and both (start, compute, wait: t_ovrl); prints overlap % (IMB-NBC) and the exposed\n"
             "           communication (from the end of the compute to the collective's end). With --await the\n"
             "           compute is offloaded from a coroutine (weft::offload)\n"
             "  --device: the buffers are device memory (weft/gpu.hpp; WEFT_GPU=cuda|sim, the device of rank % devices):\n"
             "           the time includes weft's copies between the device and its host staging\n"
             "  --variable: all_gather, reduce_scatter, gather, scatter and all_to_all run their variable-size forms\n"
             "           (all_gatherv, ...) with equal counts, as OSU's osu_allgatherv does\n"
             "  --tune: time every algorithm of the collective at every size and write the fastest, as\n"
             "          WEFT_ALGO ranges, to FILE (default weft-tuning.txt); load it with WEFT_TUNING=FILE\n"
             "  COLLECTIVE: all_reduce all_gather reduce_scatter broadcast reduce gather scatter all_to_all barrier\n"
             "              ping_pong (ranks 0 and 1: half the round trip) stream (rank 0 to 1, 64 sends in flight:\n"
             "              time per message)\n"
             "  sizes take K, M, G suffixes (powers of 1024); DTYPE: bool i8 u8 i16 u16 i32 u32 i64 u64 f16 bf16 f32 f64\n"
             "  (or nccl-tests names: float, half, bfloat16, int32, ...); OP: sum prod min max avg land lor band bor bxor\n");
  std::exit(2);
}

std::size_t parse_size(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || v < 0) usage(fmt::format("{} expects a size such as 8, 64K or 256M, got '{}'", flag, text));
  double scale = 1;
  const std::string suffix(end);
  if (suffix == "K" || suffix == "k") scale = 1024.0;
  else if (suffix == "M" || suffix == "m") scale = 1024.0 * 1024;
  else if (suffix == "G" || suffix == "g") scale = 1024.0 * 1024 * 1024;
  else if (!suffix.empty()) usage(fmt::format("{}: unknown size suffix '{}' in '{}'", flag, suffix, text));
  // NaN, infinity and 1e30 would have been cast to a size no double converts to (undefined behaviour).
  if (!(v * scale <= static_cast<double>(weft::max_buffer_bytes))) {
    usage(fmt::format("{} expects a size up to 128T (what a buffer can hold), got '{}'", flag, text));
  }
  return static_cast<std::size_t>(v * scale);
}

int parse_int(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end) usage(fmt::format("{} expects an integer, got '{}'", flag, text));
  return static_cast<int>(v);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(flag + " needs a value");
      return argv[++i];
    };
    if (flag == "-c" || flag == "--collective") {
      const std::string name = value();
      a.collective = nullptr;
      for (const auto& c : collectives) {
        if (name == c.name) a.collective = &c;
      }
      if (!a.collective) usage(fmt::format("unknown collective '{}'", name));
    } else if (flag == "-b" || flag == "--minbytes") {
      a.min_bytes = parse_size(flag, value());
    } else if (flag == "-e" || flag == "--maxbytes") {
      a.max_bytes = parse_size(flag, value());
    } else if (flag == "-f" || flag == "--stepfactor") {
      const std::string text = value();
      char* end = nullptr;
      a.factor = std::strtod(text.c_str(), &end);
      if (end == text.c_str() || *end != '\0' || !(a.factor > 1) || !(a.factor < 1e6)) {  // NaN fails both
        usage(fmt::format("-f expects a factor above 1, got '{}'", text));
      }
    } else if (flag == "-d" || flag == "--datatype") {
      const std::string name = value();
      auto t = parse_dtype(name);
      if (!t) usage(fmt::format("unknown dtype '{}'", name));
      a.dtype = *t;
    } else if (flag == "-o" || flag == "--op") {
      const std::string name = value();
      auto op = parse_reduce_op(name);
      if (!op) usage(fmt::format("unknown op '{}'", name));
      a.op = *op;
    } else if (flag == "-r" || flag == "--root") {
      a.root = parse_int(flag, value());
    } else if (flag == "-w" || flag == "--warmup_iters") {
      a.warmup = parse_int(flag, value());
    } else if (flag == "-n" || flag == "--iters") {
      a.iters = parse_int(flag, value());
      if (a.iters < 1) usage("-n expects at least 1 iteration");
    } else if (flag == "--check") {
      a.check = true;
    } else if (flag == "--await") {
      a.awaited = true;
    } else if (flag == "--wait-each") {
      a.wait_each = true;
    } else if (flag == "--receiver-late") {
      a.receiver_late_us = parse_int(flag, value());
      if (a.receiver_late_us < 0) usage("--receiver-late expects microseconds, 0 or more");
    } else if (flag == "--overlap") {
      a.overlap = true;
    } else if (flag == "--device") {
      a.device = true;
    } else if (flag == "--variable") {
      a.variable = true;
    } else if (flag == "--json") {
      a.json = value();
    } else if (flag == "--tune") {
      a.tune = (i + 1 < argc && argv[i + 1][0] != '-') ? argv[++i] : "weft-tuning.txt";
    } else if (flag == "-h" || flag == "--help") {
      usage("");
    } else {
      usage(fmt::format("unknown option '{}'", flag));
    }
  }
  if (a.min_bytes > a.max_bytes) usage("-b is larger than -e");
  if (a.collective->reduces && !is_defined(a.dtype, a.op)) {
    usage(fmt::format("op {} is not defined on {}", to_string(a.op), to_string(a.dtype)));
  }
  return a;
}

double bus_factor(Kind c, int n) {
  const double p = n;
  switch (c) {
    case Kind::all_reduce: return 2 * (p - 1) / p;
    case Kind::reduce_scatter:
    case Kind::all_gather:
    case Kind::all_to_all:
    case Kind::gather:
    case Kind::scatter: return (p - 1) / p;
    case Kind::broadcast:
    case Kind::reduce:
    case Kind::ping_pong:
    case Kind::stream: return 1;
    case Kind::barrier: return 0;
  }
  return 1;
}

// One size of one collective: the buffers and how to run and check it.
struct Case {
  Case(const Args& a, Group& g) : args(a), group(g) {}
  const Args& args;
  Group& group;
  std::size_t count = 0;        // elements per rank block (the "count" column is count x blocks)
  std::size_t blocks = 1;       // blocks in the full array (p for gathers and scatters)
  std::vector<std::byte> input;   // on the host; with --device, copied to device memory before each run
  std::vector<std::byte> output;
  // --device: the buffers the collective sees are device memory (weft/gpu.hpp), mirrors of the above.
  Device where{};
  std::optional<gpu::Stream> copies;
  gpu::DeviceBuffer device_input;
  gpu::DeviceBuffer device_output;

  std::byte* in_ptr() { return args.device ? static_cast<std::byte*>(device_input.data()) : input.data(); }
  std::byte* out_ptr() { return args.device ? static_cast<std::byte*>(device_output.data()) : output.data(); }

  // --device: the host buffers to the device (the next run's input) and back (for the check).
  void upload() {
    if (!args.device) return;
    if (!copies) {
      where = gpu::device(r() % gpu::device_count());
      copies.emplace(group.loop(), where);
    }
    auto mirror = [&](gpu::DeviceBuffer& on_device, const std::vector<std::byte>& host) {
      if (on_device.bytes() != host.size() || !on_device.data()) on_device = gpu::DeviceBuffer::allocate(where, host.size());
      copies->copy(on_device.view(DType::u8), ConstBufferView(host.data(), host.size(), DType::u8)).get();
    };
    mirror(device_input, input);
    mirror(device_output, output);
  }
  void download() {
    if (!args.device) return;
    copies->copy(BufferView(input.data(), input.size(), DType::u8), device_input.view(DType::u8)).get();
    copies->copy(BufferView(output.data(), output.size(), DType::u8), device_output.view(DType::u8)).get();
  }

  std::size_t esize() const { return dtype_size(args.dtype); }
  int p() const { return group.size(); }
  int r() const { return group.rank(); }
  bool at_root() const { return r() == args.root; }

  void fill() {
    const auto t = args.dtype;
    const auto op = args.collective->reduces ? args.op : ReduceOp::sum;
    const std::size_t b = count * esize();
    switch (args.collective->kind) {
      case Kind::all_reduce:
      case Kind::reduce:
      case Kind::broadcast:
      case Kind::all_gather:
      case Kind::gather:
        input = reference::make_input(t, op, r(), count);
        break;
      case Kind::reduce_scatter:
      case Kind::all_to_all:
      case Kind::scatter:
        input.clear();
        for (int k = 0; k < p(); ++k) {
          auto part = reference::make_input(t, op, r(), count, static_cast<std::size_t>(k) * 13);
          input.insert(input.end(), part.begin(), part.end());
        }
        break;
      case Kind::barrier: input.clear(); break;
      case Kind::ping_pong:
      case Kind::stream:
        input = reference::make_input(t, op, 0, count);
        break;
    }
    const std::size_t out_blocks =
        (args.collective->kind == Kind::all_gather || args.collective->kind == Kind::gather ||
         args.collective->kind == Kind::all_to_all)
            ? static_cast<std::size_t>(p())
            : 1;
    output.assign(args.collective->kind == Kind::barrier ? 0 : out_blocks * b, std::byte{0});
    upload();
  }

  // Runs once. In place: the output buffer is also the input (or holds it, for gathers and scatters).
  Future<void> start(bool in_place) {
    const auto t = args.dtype;
    const std::size_t b = count * esize();
    const auto pn = static_cast<std::size_t>(p());
    auto* out = out_ptr();
    if (args.variable) {
      if (auto f = start_variable(in_place)) return std::move(*f);
    }
    switch (args.collective->kind) {
      case Kind::all_reduce:
        if (in_place) return group.all_reduce(BufferView(out, count, t, where), args.op);
        return group.all_reduce(ConstBufferView(in_ptr(), count, t, where), BufferView(out, count, t, where), args.op);
      case Kind::all_gather:
        if (in_place) return group.all_gather(ConstBufferView(out + static_cast<std::size_t>(r()) * b, count, t, where), BufferView(out, count * pn, t, where));
        return group.all_gather(ConstBufferView(in_ptr(), count, t, where), BufferView(out, count * pn, t, where));
      case Kind::reduce_scatter:
        if (in_place) return group.reduce_scatter(ConstBufferView(in_ptr(), count * pn, t, where), BufferView(in_ptr() + static_cast<std::size_t>(r()) * b, count, t, where), args.op);
        return group.reduce_scatter(ConstBufferView(in_ptr(), count * pn, t, where), BufferView(out, count, t, where), args.op);
      case Kind::broadcast:
        if (!in_place && at_root()) {
          // The root's input into its output first (weft's broadcast is in place). With --device on the
          // device (the host cannot touch device memory), queued, and the broadcast ordered after it on
          // that stream (this may run on the loop, with --await, where nothing can be waited for).
          if (args.device) {
            (void)copies->copy(BufferView(out, count, t, where), ConstBufferView(in_ptr(), count, t, where));
            return group.on(*copies).broadcast(BufferView(out, count, t, where), args.root);
          }
          copy_bytes(out, in_ptr(), b);
        }
        return group.broadcast(BufferView(out, count, t, where), args.root);
      case Kind::reduce:
        if (in_place) return group.reduce(ConstBufferView(out, count, t, where), BufferView(out, count, t, where), args.root, args.op);
        return group.reduce(ConstBufferView(in_ptr(), count, t, where), BufferView(out, count, t, where), args.root, args.op);
      case Kind::gather:
        if (in_place) return group.gather(ConstBufferView(out + static_cast<std::size_t>(r()) * b, count, t, where), BufferView(out, at_root() ? count * pn : 0, t, where), args.root);
        return group.gather(ConstBufferView(in_ptr(), count, t, where), BufferView(out, at_root() ? count * pn : 0, t, where), args.root);
      case Kind::scatter:
        if (in_place) return group.scatter(ConstBufferView(in_ptr(), at_root() ? count * pn : 0, t, where), BufferView(in_ptr() + static_cast<std::size_t>(r()) * b, count, t, where), args.root);
        return group.scatter(ConstBufferView(in_ptr(), at_root() ? count * pn : 0, t, where), BufferView(out, count, t, where), args.root);
      case Kind::all_to_all:
        if (in_place) return group.all_to_all(ConstBufferView(out, count * pn, t, where), BufferView(out, count * pn, t, where));
        return group.all_to_all(ConstBufferView(in_ptr(), count * pn, t, where), BufferView(out, count * pn, t, where));
      case Kind::barrier: return group.barrier();
      // Point to point has no in-place form: both columns send `input` and receive into `output`. Waited
      // on from this thread, each send and receive is waited on by it as MPI_Send and MPI_Recv are (the
      // Future returned is ready); with --await, the coroutine co_awaits them.
      case Kind::ping_pong:
        if (!args.awaited) {
          ping_pong_waited(in_ptr(), out);
          return make_ready_future();
        }
        return spawn(group.loop(), ping_pong(in_ptr(), out));
      case Kind::stream:
        if (!args.awaited) {
          stream_waited(in_ptr(), out);
          return make_ready_future();
        }
        return spawn(group.loop(), stream(in_ptr(), out));
    }
    return group.barrier();
  }

  // --variable: the v-form of the collective over the same buffers, every count `count` (nullopt for a
  // collective without one).
  std::optional<Future<void>> start_variable(bool in_place) {
    const auto t = args.dtype;
    const std::size_t b = count * esize();
    const auto pn = static_cast<std::size_t>(p());
    const std::vector<std::size_t> counts(pn, count);
    auto* out = out_ptr();
    auto* mine_in_out = out + static_cast<std::size_t>(r()) * b;
    auto* mine_in_in = in_ptr() + static_cast<std::size_t>(r()) * b;
    switch (args.collective->kind) {
      case Kind::all_gather:
        return group.all_gatherv(ConstBufferView(in_place ? mine_in_out : in_ptr(), count, t, where), BufferView(out, count * pn, t, where), counts);
      case Kind::reduce_scatter:
        return group.reduce_scatterv(ConstBufferView(in_ptr(), count * pn, t, where),
                                     BufferView(in_place ? mine_in_in : out, count, t, where), counts, args.op);
      case Kind::gather:
        return group.gatherv(ConstBufferView(in_place ? mine_in_out : in_ptr(), count, t, where), BufferView(out, at_root() ? count * pn : 0, t, where),
                             counts, args.root);
      case Kind::scatter:
        return group.scatterv(ConstBufferView(in_ptr(), at_root() ? count * pn : 0, t, where), BufferView(in_place ? mine_in_in : out, count, t, where),
                              counts, args.root);
      case Kind::all_to_all:
        return group.all_to_allv(ConstBufferView(in_place ? out : in_ptr(), count * pn, t, where), BufferView(out, count * pn, t, where), counts, counts);
      default: return std::nullopt;
    }
  }

  // Rank 0 sends and waits for the echo; rank 1 echoes what it received.
  Task<void> ping_pong(const std::byte* send_from, std::byte* receive_into) {
    const auto t = args.dtype;
    if (r() == 0) {
      co_await group.send(ConstBufferView(send_from, count, t, where), 1);
      co_await group.recv(BufferView(receive_into, count, t, where), 1);
    } else if (r() == 1) {
      co_await group.recv(BufferView(receive_into, count, t, where), 0);
      co_await group.send(ConstBufferView(receive_into, count, t, where), 0);
    }
  }

  // The same, each call waited on by this thread.
  void ping_pong_waited(const std::byte* send_from, std::byte* receive_into) {
    const auto t = args.dtype;
    if (r() == 0) {
      group.send(ConstBufferView(send_from, count, t, where), 1).get();
      group.recv(BufferView(receive_into, count, t, where), 1).get();
    } else if (r() == 1) {
      group.recv(BufferView(receive_into, count, t, where), 0).get();
      group.send(ConstBufferView(receive_into, count, t, where), 0).get();
    }
  }

  // Rank 0 starts a window of sends, rank 1 the receives; rank 1 acknowledges the whole window with an
  // empty message once it has them all.
  Task<void> stream(const std::byte* send_from, std::byte* receive_into) {
    const auto t = args.dtype;
    std::vector<Future<void>> window;
    window.reserve(stream_window);
    if (r() == 0) {
      for (int i = 0; i < stream_window; ++i) window.push_back(group.send(ConstBufferView(send_from, count, t, where), 1));
      for (std::size_t i = 0; i < window.size(); ++i) co_await std::move(window[i]);
      co_await group.recv(BufferView(receive_into, 0, t, where), 1);
    } else if (r() == 1) {
      for (int i = 0; i < stream_window; ++i) window.push_back(group.recv(BufferView(receive_into, count, t, where), 0));
      for (std::size_t i = 0; i < window.size(); ++i) co_await std::move(window[i]);
      co_await group.send(ConstBufferView(receive_into, 0, t, where), 0);
    }
  }

  // The window waited on by this thread: at once (when_all, as osu_bw's MPI_Waitall), or with
  // --wait-each one Future after the other, each wait handing the loop back while the others are in
  // flight (docs/DESIGN.md, "Caller-driven progress").
  void wait_window(std::vector<Future<void>>& window) {
    if (args.wait_each) {
      for (auto& f : window) f.get();
    } else {
      (void)sync_wait(group.loop(), when_all(std::move(window)));
    }
  }

  // The same as stream, waited on from this thread.
  void stream_waited(const std::byte* send_from, std::byte* receive_into) {
    const auto t = args.dtype;
    std::vector<Future<void>> window;
    window.reserve(stream_window);
    if (r() == 0) {
      for (int i = 0; i < stream_window; ++i) window.push_back(group.send(ConstBufferView(send_from, count, t, where), 1));
      wait_window(window);
      group.recv(BufferView(receive_into, 0, t, where), 1).get();
    } else if (r() == 1) {
      if (args.receiver_late_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(args.receiver_late_us));
      for (int i = 0; i < stream_window; ++i) window.push_back(group.recv(BufferView(receive_into, count, t, where), 0));
      wait_window(window);
      group.send(ConstBufferView(receive_into, 0, t, where), 0).get();
    }
  }

  // Prepares the buffers of an in-place run from the inputs (in-place runs consume their input).
  void stage_in_place() {
    const std::size_t b = count * esize();
    switch (args.collective->kind) {
      case Kind::all_reduce:
      case Kind::reduce:
        copy_bytes(output.data(), input.data(), b);
        break;
      case Kind::all_gather:
      case Kind::gather:
        copy_bytes(output.data() + static_cast<std::size_t>(r()) * b, input.data(), b);
        break;
      case Kind::all_to_all:
        copy_bytes(output.data(), input.data(), input.size());
        break;
      case Kind::broadcast:
        if (at_root()) copy_bytes(output.data(), input.data(), b);
        break;
      default: break;
    }
    upload();
  }

  // Elements that differ from the reference after one run.
  std::size_t wrong(bool in_place) {
    download();
    const auto t = args.dtype;
    const std::size_t b = count * esize();
    auto count_wrong = [&](const std::byte* got, const std::vector<std::byte>& expected, std::size_t n) {
      std::size_t bad = 0;
      for (std::size_t i = 0; i < n; ++i) {
        if (std::memcmp(got + i * esize(), expected.data() + i * esize(), esize()) != 0) ++bad;
      }
      return bad;
    };
    switch (args.collective->kind) {
      case Kind::all_reduce:
        return count_wrong(output.data(), reference::make_reduced(t, args.op, p(), count), count);
      case Kind::reduce:
        return at_root() ? count_wrong(output.data(), reference::make_reduced(t, args.op, p(), count), count) : 0;
      case Kind::reduce_scatter: {
        const std::byte* got = in_place ? input.data() + static_cast<std::size_t>(r()) * b : output.data();
        return count_wrong(got, reference::make_reduced(t, args.op, p(), count, static_cast<std::size_t>(r()) * 13), count);
      }
      case Kind::broadcast:
        return count_wrong(output.data(), reference::make_input(t, ReduceOp::sum, args.root, count), count);
      case Kind::all_gather:
      case Kind::gather: {
        if (args.collective->kind == Kind::gather && !at_root()) return 0;
        std::size_t bad = 0;
        for (int k = 0; k < p(); ++k) bad += count_wrong(output.data() + static_cast<std::size_t>(k) * b, reference::make_input(t, ReduceOp::sum, k, count), count);
        return bad;
      }
      case Kind::scatter: {
        const std::byte* got = in_place ? input.data() + static_cast<std::size_t>(r()) * b : output.data();
        return count_wrong(got, reference::make_input(t, ReduceOp::sum, args.root, count, static_cast<std::size_t>(r()) * 13), count);
      }
      case Kind::all_to_all: {
        std::size_t bad = 0;
        for (int k = 0; k < p(); ++k) {
          bad += count_wrong(output.data() + static_cast<std::size_t>(k) * b,
                             reference::make_input(t, ReduceOp::sum, k, count, static_cast<std::size_t>(r()) * 13), count);
        }
        return bad;
      }
      case Kind::barrier: return 0;
      case Kind::ping_pong:
        return r() <= 1 ? count_wrong(output.data(), reference::make_input(t, ReduceOp::sum, 0, count), count) : 0;
      case Kind::stream:
        return r() == 1 ? count_wrong(output.data(), reference::make_input(t, ReduceOp::sum, 0, count), count) : 0;
    }
    return 0;
  }
};

struct Measurement {
  double time_us = 0;
  double algbw = 0;
  double busbw = 0;
  std::int64_t wrong = 0;
};

template <class T>
T reduce_across(Group& g, T value, ReduceOp op) {
  std::vector<T> v{value};
  g.all_reduce(v, op).get();
  return v[0];
}

Task<void> await_each(Case& c, bool in_place, int iterations) {
  for (int i = 0; i < iterations; ++i) co_await c.start(in_place);
}

// Runs `iterations` calls one after the other: each waited on by this thread, or (--await) all from one
// coroutine on the group's loop.
void run_calls(Case& c, bool in_place, int iterations) {
  if (c.args.awaited) {
    sync_wait(c.group.loop(), await_each(c, in_place, iterations));
    return;
  }
  for (int i = 0; i < iterations; ++i) c.start(in_place).get();
}

Measurement measure(Case& c, bool in_place, std::size_t bytes) {
  const Args& a = c.args;
  Measurement m;
  if (in_place) c.stage_in_place();
  run_calls(c, in_place, a.warmup);
  c.group.barrier().get();
  const auto t0 = std::chrono::steady_clock::now();
  run_calls(c, in_place, a.iters);
  const auto t1 = std::chrono::steady_clock::now();
  double local_us = std::chrono::duration<double, std::micro>(t1 - t0).count() / a.iters;
  // A ping-pong's time is half its round trip; a stream's, the time per message of its window.
  if (a.collective->kind == Kind::ping_pong) local_us /= 2;
  if (a.collective->kind == Kind::stream) local_us /= stream_window;
  m.time_us = reduce_across(c.group, local_us, ReduceOp::max);  // the slowest rank sets the pace
  const double seconds = m.time_us * 1e-6;
  m.algbw = seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0;
  m.busbw = m.algbw * bus_factor(a.collective->kind, c.p());
  if (a.check) {
    c.fill();
    if (in_place) c.stage_in_place();
    c.start(in_place).get();
    m.wrong = reduce_across(c.group, static_cast<std::int64_t>(c.wrong(in_place)), ReduceOp::sum);
  }
  return m;
}

// ---- --overlap (IMB-NBC's method): t_pure, t_cpu, t_ovrl and the exposed communication

// CPU work that stays in the core's cache (it competes for the core, not for memory bandwidth, as a
// layer's compute would): `reps` passes over 4 KiB of floats. Returns a value so it is not optimized out.
float compute(std::size_t reps) {
  static thread_local std::vector<float> work(1024, 1.0f);
  for (std::size_t k = 0; k < reps; ++k) {
    for (float& x : work) x = x * 0.999f + 0.001f;
  }
  return work[reps % work.size()];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Overlap {
  double pure_us = 0, cpu_us = 0, ovrl_us = 0, exposed_us = 0, percent = 0;
  std::int64_t wrong = 0;
};

// One iteration of "start, compute, wait": the time of it all and from the compute's end to the wait's.
// --await: a coroutine on the loop that offloads the compute (weft::offload), as a training step would.
Task<std::pair<double, double>> overlapped_awaited(Case& c, std::size_t reps, float& sink) {
  const auto t0 = std::chrono::steady_clock::now();
  Future<void> running = c.start(false);
  sink += co_await offload([reps] { return compute(reps); });
  const auto compute_end = std::chrono::steady_clock::now();
  co_await std::move(running);
  co_return std::pair{seconds_since(t0), seconds_since(compute_end)};
}

std::pair<double, double> overlapped(Case& c, std::size_t reps, float& sink) {
  if (c.args.awaited) return sync_wait(c.group.loop(), overlapped_awaited(c, reps, sink));
  const auto t0 = std::chrono::steady_clock::now();
  Future<void> running = c.start(false);
  sink += compute(reps);
  const auto compute_end = std::chrono::steady_clock::now();
  running.wait();
  return {seconds_since(t0), seconds_since(compute_end)};
}

Overlap measure_overlap(Case& c, std::size_t bytes) {
  const Args& a = c.args;
  Overlap o;
  o.pure_us = measure(c, false, bytes).time_us;
  // Compute as long as the collective alone: calibrated here, then every rank takes the slowest's reps.
  float sink = 0;
  std::size_t reps = 1;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    sink += compute(reps);
    const double us = seconds_since(t0) * 1e6;
    if (us >= 2000 || us >= o.pure_us) {
      reps = static_cast<std::size_t>(static_cast<double>(reps) * o.pure_us / std::max(us, 1e-3)) + 1;
      break;
    }
    reps *= 2;
  }
  reps = reduce_across(c.group, static_cast<std::uint64_t>(reps), ReduceOp::max);
  c.group.barrier().get();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.iters; ++i) sink += compute(reps);
  const double cpu = seconds_since(t0) * 1e6 / a.iters;
  for (int i = 0; i < a.warmup; ++i) overlapped(c, reps, sink);
  c.group.barrier().get();
  double total = 0, exposed = 0;
  for (int i = 0; i < a.iters; ++i) {
    const auto [all, tail] = overlapped(c, reps, sink);
    total += all;
    exposed += tail;
  }
  o.cpu_us = reduce_across(c.group, cpu, ReduceOp::max);
  o.ovrl_us = reduce_across(c.group, total * 1e6 / a.iters, ReduceOp::max);
  o.exposed_us = reduce_across(c.group, exposed * 1e6 / a.iters, ReduceOp::max);
  const double shorter = std::min(o.pure_us, o.cpu_us);
  o.percent = shorter > 0 ? 100 * std::clamp((o.pure_us + o.cpu_us - o.ovrl_us) / shorter, 0.0, 1.0) : 0;
  if (a.check) {
    c.fill();
    overlapped(c, reps, sink);
    o.wrong = reduce_across(c.group, static_cast<std::int64_t>(c.wrong(false)), ReduceOp::sum);
  }
  if (sink == 12345.678f) std::fputs("", stdout);  // keeps the compute observable
  return o;
}

// What --json records besides the numbers: where and when it ran, with what.
struct RunInfo {
  std::string transport;
  std::string host;
  std::string date;  // UTC, ISO 8601
};

RunInfo run_info(const Group& group) {
  RunInfo info;
  info.transport = std::string(group.transport_name());
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) == 0) info.host = host;
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  char date[32];
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &utc);
  info.date = date;
  return info;
}

// A JSON string literal of `text` (quotes, backslashes and control characters escaped).
std::string json_string(std::string_view text) {
  std::string out = "\"";
  for (char ch : text) {
    if (ch == '"' || ch == '\\') {
      out += '\\';
      out += ch;
    } else if (static_cast<unsigned char>(ch) < 0x20) {
      out += fmt::format("\\u{:04x}", static_cast<int>(ch));
    } else {
      out += ch;
    }
  }
  return out + "\"";
}

}  // namespace

// --tune: every algorithm at every size (the slowest rank's time, so every rank picks the same), then
// the winners merged into ranges and written in WEFT_ALGO syntax.
int tune(const Args& args, Group& group, const std::vector<std::size_t>& sizes, std::size_t unit) {
  const auto& info = *args.collective;
  const auto& algorithms = algorithms::available_algorithms(info.name);
  const bool leader = group.rank() == 0;
  std::vector<std::string> winners;
  if (leader) fmt::print("# tuning {} on {} ranks: time (us) per algorithm\n#   {:>12}", info.name, group.size(), "size");
  if (leader) {
    for (auto a : algorithms) fmt::print(" {:>20}", a);
    fmt::print("  best\n");
  }
  for (std::size_t bytes : sizes) {
    Case c(args, group);
    c.count = bytes / unit;
    double best_time = 0;
    std::string best;
    if (leader) fmt::print("    {:>12}", bytes);
    for (auto a : algorithms) {
      group.override_algorithms(fmt::format("{}:{}", info.name, a));
      c.fill();
      const Measurement m = measure(c, false, bytes);
      if (leader) fmt::print(" {:>20.2f}", m.time_us);
      if (best.empty() || m.time_us < best_time) {
        best_time = m.time_us;
        best = std::string(a);
      }
    }
    if (leader) fmt::print("  {}\n", best);
    std::fflush(stdout);
    winners.push_back(best);
  }
  if (!leader) return 0;
  // Ranges: a winner holds from its first size to the first size another algorithm won.
  std::string line = std::string(info.name) + ":";
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    if (k > 0 && winners[k] == winners[k - 1]) continue;
    std::size_t end = k;
    while (end < sizes.size() && winners[end] == winners[k]) ++end;
    const std::size_t lo = k == 0 ? 0 : sizes[k];
    if (line.back() != ':') line += ",";
    line += end == sizes.size() ? fmt::format("{}@{}-", winners[k], lo) : fmt::format("{}@{}-{}", winners[k], lo, sizes[end]);
  }
  std::FILE* f = std::fopen(args.tune.c_str(), "w");
  if (!f) {
    fmt::print(stderr, "weft-bench: cannot write {}\n", args.tune);
    return 2;
  }
  fmt::print(f, "# written by weft-bench --tune on {} ranks; load with WEFT_TUNING={}\n{}\n", group.size(), args.tune, line);
  std::fclose(f);
  fmt::print("# wrote {}: {}\n", args.tune, line);
  return 0;
}

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  try {
    Loop loop;
    Group group = Group::create(loop).get();
    const int p = group.size();
    if (args.collective->rooted && (args.root < 0 || args.root >= p)) usage(fmt::format("root {} is not a rank of {}", args.root, p));
    const bool point_to_point = args.collective->kind == Kind::ping_pong || args.collective->kind == Kind::stream;
    if (point_to_point && p < 2) usage(fmt::format("{} needs 2 ranks at least (it runs between ranks 0 and 1)", args.collective->name));
    if (point_to_point && !args.tune.empty()) usage("--tune is for collectives, whose algorithms it picks");
    const bool leader = group.rank() == 0;
    const bool tty = isatty(STDOUT_FILENO) != 0;
    const auto& info = *args.collective;
    const char* root_text = info.rooted ? nullptr : "-1";

    const std::size_t esize = dtype_size(args.dtype);
    const bool blocked = info.kind == Kind::all_gather || info.kind == Kind::reduce_scatter ||
                         info.kind == Kind::gather || info.kind == Kind::scatter ||
                         info.kind == Kind::all_to_all;
    const std::size_t unit = esize * (blocked ? static_cast<std::size_t>(p) : 1);
    std::vector<std::size_t> sizes;
    // Sizes from -b to -e by -f, rounded down to whole elements per rank; -b 0 adds a zero-length run.
    if (args.min_bytes == 0) sizes.push_back(0);
    for (double s = static_cast<double>(std::max<std::size_t>(args.min_bytes, 1));
         s <= static_cast<double>(args.max_bytes) * 1.0000001; s *= args.factor) {
      const auto bytes = static_cast<std::size_t>(s) / unit * unit;
      if (sizes.empty() || sizes.back() != bytes) sizes.push_back(bytes);
    }
    if (info.kind == Kind::barrier) sizes = {0};
    if (!args.tune.empty()) return tune(args, group, sizes, unit);
    std::FILE* json = nullptr;
    if (leader && !args.json.empty()) {
      json = std::fopen(args.json.c_str(), "w");
      if (!json) {
        fmt::print(stderr, "weft-bench: cannot write {}\n", args.json);
        return 2;
      }
      fmt::print(json, "[\n");
    }
    const RunInfo run = run_info(group);
    // Every record carries what ran, where and when (bench/plot.py labels its curves with these).
    const std::string meta = fmt::format(
        "\"collective\": \"{}\", \"transport\": {}, \"ranks\": {}, \"host\": {}, \"weft_version\": {}, \"date\": \"{}\", "
        "\"dtype\": \"{}\", \"op\": \"{}\", \"root\": {}, \"awaited\": {}, \"buffers\": \"{}\"",
        info.name, json_string(run.transport), p, json_string(run.host), json_string(weft::version()), run.date,
        to_string(args.dtype), info.reduces ? std::string(to_string(args.op)) : "none", info.rooted ? args.root : -1,
        args.awaited ? "true" : "false", args.device ? fmt::format("device ({})", gpu::backend_name()) : std::string("host"));
    if (leader) {
      fmt::print("# weft-bench: {} on {} ranks, transport {}, dtype {}, op {}, warmup {}, iters {}{} (algorithm per size in the last column)\n",
                 info.name, p, group.transport_name(), to_string(args.dtype), info.reduces ? to_string(args.op) : "none",
                 args.warmup, args.iters,
                 std::string(args.check ? ", check on" : "") + (args.awaited ? ", awaited" : "") + (args.variable ? ", variable-size form" : "") +
                     (args.device ? fmt::format(", device buffers ({} backend)", gpu::backend_name()) : ""));
      // The transport per peer class: how many peers each backend reaches, and whether the group arena runs
      // the collectives that have a direct shm algorithm.
      std::map<std::string, int> classes;
      for (int peer = 0; peer < p; ++peer) {
        if (peer != group.rank()) ++classes[std::string(group.transport_to(peer))];
      }
      std::string links;
      for (const auto& [backend, count] : classes) links += fmt::format("{}{} to {} peer{}", links.empty() ? "" : ", ", backend, count, count == 1 ? "" : "s");
      fmt::print("# links of rank {}: {}; group arena: {}\n", group.rank(), links.empty() ? "none (one rank)" : links,
                 group.has_shared_arena() ? "yes (shm collectives)" : "no");
      if (args.overlap) {
        fmt::print("# overlap: t_pure = the collective alone, t_cpu = compute alone, t_ovrl = start, compute, wait;\n"
                   "# overlap% = 100 max(0, min(1, (t_pure + t_cpu - t_ovrl) / min(t_pure, t_cpu))) (IMB-NBC);\n"
                   "# exposed = from the end of the compute to the collective's end{}\n#\n",
                   args.awaited ? " (compute offloaded from a coroutine)" : " (compute on the calling thread)");
        fmt::print("# {:>12} {:>12} {:>6} {:>6} {:>5}   {:>10} {:>10} {:>10} {:>8} {:>10} {:>6}  {}\n", "size", "count", "type",
                   "redop", "root", "t_pure", "t_cpu", "t_ovrl", "overlap%", "exposed", "#wrong", "algorithm");
        fmt::print("# {:>12} {:>12} {:>6} {:>6} {:>5}   {:>10} {:>10} {:>10} {:>8} {:>10} {:>6}\n", "(B)", "(elements)", "", "",
                   "", "(us)", "(us)", "(us)", "", "(us)", "");
      } else {
        fmt::print("#\n# {:>12} {:>12} {:>6} {:>6} {:>5}   {:>10} {:>8} {:>8} {:>6}   {:>10} {:>8} {:>8} {:>6}\n", "", "", "",
                   "", "", "out-of-place", "", "", "", "in-place", "", "", "");
        fmt::print("# {:>12} {:>12} {:>6} {:>6} {:>5}   {:>10} {:>8} {:>8} {:>6}   {:>10} {:>8} {:>8} {:>6}  {}\n", "size", "count",
                   "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "algorithm");
        fmt::print("# {:>12} {:>12} {:>6} {:>6} {:>5}   {:>10} {:>8} {:>8} {:>6}   {:>10} {:>8} {:>8} {:>6}\n", "(B)",
                   "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", "");
      }
      std::fflush(stdout);
    }

    double busbw_sum = 0;
    int rows = 0;
    std::int64_t wrong_total = 0;
    bool first_record = true;
    std::size_t done = 0;
    auto record = [&](const std::string& fields) {
      if (!json) return;
      fmt::print(json, "{}  {{{}, {}}}", first_record ? "" : ",\n", meta, fields);
      first_record = false;
    };
    for (std::size_t bytes : sizes) {
      Case c(args, group);
      c.count = bytes / unit;
      c.fill();
      const std::size_t count_column = c.count * (blocked ? static_cast<std::size_t>(p) : 1);
      // --variable runs the v-form, which has its own algorithm (all_gatherv's ring, ...).
      const bool has_v_form = info.kind == Kind::all_gather || info.kind == Kind::reduce_scatter || info.kind == Kind::gather ||
                              info.kind == Kind::scatter || info.kind == Kind::all_to_all;
      const std::string name = args.variable && has_v_form ? std::string(info.name) + "v" : std::string(info.name);
      const std::string algorithm = point_to_point ? std::string("p2p") : group.algorithm_for(name, bytes);
      const std::string root = root_text ? root_text : std::to_string(args.root);
      const std::string op_text = info.reduces ? std::string(to_string(args.op)) : "none";
      auto wrong_text = [&](std::int64_t wrong) { return args.check ? std::to_string(wrong) : std::string("N/A"); };
      if (args.overlap) {
        const Overlap o = measure_overlap(c, bytes);
        wrong_total += o.wrong;
        ++done;
        if (!leader) continue;
        if (tty) fmt::print(stderr, "\r\033[K");
        fmt::print("  {:>12} {:>12} {:>6} {:>6} {:>5}   {:>10.2f} {:>10.2f} {:>10.2f} {:>8.1f} {:>10.2f} {:>6}  {}\n", bytes,
                   count_column, to_string(args.dtype), op_text, root, o.pure_us, o.cpu_us, o.ovrl_us, o.percent,
                   o.exposed_us, wrong_text(o.wrong), algorithm);
        record(fmt::format("\"algorithm\": \"{}\", \"bytes\": {}, \"count\": {}, \"overlap\": true, \"t_pure_us\": {:.3f}, "
                           "\"t_cpu_us\": {:.3f}, \"t_ovrl_us\": {:.3f}, \"overlap_pct\": {:.2f}, \"exposed_us\": {:.3f}, \"wrong\": {}",
                           algorithm, bytes, count_column, o.pure_us, o.cpu_us, o.ovrl_us, o.percent, o.exposed_us,
                           args.check ? o.wrong : -1));
      } else {
        const Measurement out_of_place = measure(c, false, bytes);
        c.fill();
        const Measurement in_place = measure(c, true, bytes);
        wrong_total += out_of_place.wrong + in_place.wrong;
        ++done;
        if (!leader) continue;
        if (tty) fmt::print(stderr, "\r\033[K");
        fmt::print("  {:>12} {:>12} {:>6} {:>6} {:>5}   {:>10.2f} {:>8.3f} {:>8.3f} {:>6}   {:>10.2f} {:>8.3f} {:>8.3f} {:>6}  {}\n",
                   bytes, count_column, to_string(args.dtype), op_text, root, out_of_place.time_us, out_of_place.algbw,
                   out_of_place.busbw, wrong_text(out_of_place.wrong), in_place.time_us, in_place.algbw, in_place.busbw,
                   wrong_text(in_place.wrong), algorithm);
        busbw_sum += out_of_place.busbw + in_place.busbw;
        rows += 2;
        for (const auto* m : {&out_of_place, &in_place}) {
          record(fmt::format("\"algorithm\": \"{}\", \"bytes\": {}, \"count\": {}, \"inplace\": {}, \"time_us\": {:.3f}, "
                             "\"algbw\": {:.6f}, \"busbw\": {:.6f}, \"wrong\": {}",
                             algorithm, bytes, count_column, m == &in_place ? "true" : "false", m->time_us, m->algbw,
                             m->busbw, args.check ? m->wrong : -1));
        }
      }
      std::fflush(stdout);
      if (tty) fmt::print(stderr, "weft-bench: {}/{} sizes done", done, sizes.size());
    }
    if (leader) {
      if (tty) fmt::print(stderr, "\r\033[K");
      fmt::print("# Out of bounds values : {} {}\n", args.check ? wrong_total : 0, args.check ? (wrong_total ? "FAILED" : "OK") : "(not checked)");
      if (!args.overlap) fmt::print("# Avg bus bandwidth    : {:.4f}\n", rows ? busbw_sum / rows : 0.0);
      if (json) {
        fmt::print(json, "\n]\n");
        std::fclose(json);
      }
    }
    return wrong_total ? 1 : 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "weft-bench: {}\n", e.what());
    return 1;
  }
}
