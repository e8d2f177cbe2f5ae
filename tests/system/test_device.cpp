// Every operation on device buffers (weft/gpu.hpp, Group::on): ranks as threads, each on a device of its
// own where there are enough (rank % device_count()), run each collective once on host buffers and once
// on device buffers with the same input, and the outputs must be bitwise equal. Stream order is checked by
// queueing the input's copy, the collective and the output's copy back to back on one stream, with no
// host wait between them: the result is right only if the collective waited for the first and the last
// waited for it (WEFT_SIM_DELAY_US makes a missing wait show). [device-failure] needs WEFT_SIM_FAIL in a
// process of its own. Runs on whichever backend WEFT_GPU picks (sim in CI; cuda: tools/gpu_check.sh).
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <optional>
#include <string_view>
#include <thread>

#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <weft/gpu.hpp>
#include <weft/multi_device.hpp>

#include "support/check_data.hpp"
#include "support/gpu_backend.hpp"
#include "support/harness.hpp"

using namespace weft;
using namespace weft::test;
using namespace weft::reference;

namespace {


Device device_of(const Group& g) { return gpu::device(g.rank() % gpu::device_count()); }

/// WEFT_TEST_TRACE=1: each step named on stderr as it starts (where a case crashes or hangs on a real
/// device, whose machine is gone by the time the log is read).
void trace(const std::string& step) {
  static const bool on = std::getenv("WEFT_TEST_TRACE") != nullptr;
  if (on) fmt::print(stderr, "trace: {}\n", step);
}

using Operation = std::function<Future<void>(Group&, ConstBufferView in, BufferView out)>;

/// One operation with its buffers: `in` is the input's bytes; the output starts as `out_init`; with
/// `in_at`, the input lies inside the output at that byte offset (in place).
struct Case {
  std::string what;
  DType dtype;
  std::vector<std::byte> in;
  std::vector<std::byte> out_init;
  std::optional<std::size_t> in_at;
  Operation op;
};

std::vector<std::byte> pattern(std::size_t bytes, int rank, std::size_t salt) {
  std::vector<std::byte> v(bytes);
  for (std::size_t i = 0; i < bytes; ++i) v[i] = static_cast<std::byte>((i * 131 + static_cast<std::size_t>(rank) * 17 + salt) & 0xff);
  return v;
}

std::vector<std::byte> on_host(Group& g, const Case& c) {
  const std::size_t es = dtype_size(c.dtype);
  std::vector<std::byte> out = c.out_init;
  std::vector<std::byte> in = c.in;
  const void* in_data = in.data();
  if (c.in_at) {
    if (!c.in.empty()) std::memcpy(out.data() + *c.in_at, c.in.data(), c.in.size());
    in_data = out.data() + *c.in_at;
  }
  c.op(g, ConstBufferView(in_data, c.in.size() / es, c.dtype), BufferView(out.data(), out.size() / es, c.dtype)).get();
  return out;
}

/// The same on device buffers. `ordered`: the input's copies, the operation and the copy back go on one
/// stream with no host wait between them (Group::on); otherwise each is waited for in turn.
/// Device buffers are freed only after a barrier (free_kept): freeing waits for the whole device, and a
/// rank sharing this device may hold its stream at a gate until this rank does its part (Group::on).
thread_local std::deque<gpu::DeviceBuffer> kept;  // a deque: references stay valid as it grows

void free_kept(Group& g) {
  g.barrier().get();
  kept.clear();
}

std::vector<std::byte> on_device(Group& g, gpu::Stream& stream, const Case& c, bool ordered) {
  const std::size_t es = dtype_size(c.dtype);
  const Device device = stream.device();
  gpu::DeviceBuffer& out = kept.emplace_back(gpu::DeviceBuffer::allocate(device, c.out_init.size()));
  gpu::DeviceBuffer& in = kept.emplace_back(gpu::DeviceBuffer::allocate(device, c.in.size()));
  std::vector<Future<void>> pending;
  auto step = [&](Future<void> f) {
    if (ordered) {
      pending.push_back(std::move(f));
    } else {
      f.get();
    }
  };
  step(stream.copy(out.view(DType::u8), ConstBufferView(c.out_init.data(), c.out_init.size(), DType::u8)));
  const std::byte* in_device = static_cast<const std::byte*>(in.data());
  if (c.in_at) {
    in_device = static_cast<const std::byte*>(out.data()) + *c.in_at;
    step(stream.copy(BufferView(const_cast<std::byte*>(in_device), c.in.size(), DType::u8, device),
                     ConstBufferView(c.in.data(), c.in.size(), DType::u8)));
  } else {
    step(stream.copy(in.view(DType::u8), ConstBufferView(c.in.data(), c.in.size(), DType::u8)));
  }
  Group through = ordered ? g.on(stream) : g;
  step(c.op(through, ConstBufferView(in_device, c.in.size() / es, c.dtype, device),
            BufferView(out.data(), c.out_init.size() / es, c.dtype, device)));
  std::vector<std::byte> result(c.out_init.size());
  Future<void> back = stream.copy(BufferView(result.data(), result.size(), DType::u8), out.view(DType::u8));
  back.get();  // ordered: only this is waited for; it comes after everything above on the stream
  for (auto& f : pending) f.get();
  return result;
}

void check_same(Group& g, gpu::Stream& stream, const Case& c) {
  trace(fmt::format("rank {}: {} on host buffers", g.rank(), c.what));
  const auto expected = on_host(g, c);
  for (bool ordered : {false, true}) {
    trace(fmt::format("rank {}: {} on device buffers ({})", g.rank(), c.what, ordered ? "stream-ordered" : "waited step by step"));
    const auto got = on_device(g, stream, c, ordered);
    std::string diff;
    if (got != expected) {
      std::size_t i = 0;
      while (i < got.size() && got[i] == expected[i]) ++i;
      diff = fmt::format(": first difference at byte {} of {}", i, got.size());
    }
    check(diff.empty(), fmt::format("rank {}: {} on device buffers ({}) differs from host buffers{}", g.rank(), c.what,
                                    ordered ? "stream-ordered" : "waited step by step", diff));
  }
}

void every_collective(Group& g, gpu::Stream& stream, std::size_t n) {
  const int p = g.size();
  const int r = g.rank();
  const auto pn = static_cast<std::size_t>(p) * n;
  const std::string at = fmt::format(" p={} n={}", p, n);
  // all_reduce on every dtype and op; the other reductions on a spread of them (the staging moves
  // bytes: what differs between dtypes is the host operation, tested on host buffers).
  for (DType t : all_dtypes) {
    const std::size_t es = dtype_size(t);
    for (ReduceOp op : all_reduce_ops) {
      if (!is_defined(t, op)) continue;
      const std::string w = fmt::format(" {} {}{}", to_string(t), to_string(op), at);
      check_same(g, stream, Case{"all_reduce" + w, t, make_input(t, op, r, n), std::vector<std::byte>(n * es), std::nullopt,
                                 [op](Group& g, ConstBufferView in, BufferView out) { return g.all_reduce(in, out, op); }});
      check_same(g, stream, Case{"all_reduce in place" + w, t, make_input(t, op, r, n), std::vector<std::byte>(n * es), 0,
                                 [op](Group& g, ConstBufferView, BufferView out) { return g.all_reduce(out, op); }});
    }
  }
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::i64, DType::u8}) {
    const std::size_t es = dtype_size(t);
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::prod, ReduceOp::bitwise_xor, ReduceOp::avg}) {
      if (!is_defined(t, op)) continue;
      const std::string w = fmt::format(" {} {}{}", to_string(t), to_string(op), at);
      check_same(g, stream, Case{"reduce_scatter" + w, t, make_input(t, op, r, pn), std::vector<std::byte>(n * es), std::nullopt,
                                 [op](Group& g, ConstBufferView in, BufferView out) { return g.reduce_scatter(in, out, op); }});
      check_same(g, stream, Case{"reduce to 0" + w, t, make_input(t, op, r, n), pattern(n * es, r, 1), std::nullopt,
                                 [op](Group& g, ConstBufferView in, BufferView out) { return g.reduce(in, out, 0, op); }});
    }
  }
  for (DType t : {DType::f32, DType::u8}) {
    const std::size_t es = dtype_size(t);
    const std::string w = fmt::format(" {}{}", to_string(t), at);
    check_same(g, stream, Case{"all_gather" + w, t, pattern(n * es, r, 2), std::vector<std::byte>(pn * es), std::nullopt,
                               [](Group& g, ConstBufferView in, BufferView out) { return g.all_gather(in, out); }});
    check_same(g, stream, Case{"all_gather, own block in place" + w, t, pattern(n * es, r, 3), pattern(pn * es, r, 4),
                               static_cast<std::size_t>(r) * n * es,
                               [](Group& g, ConstBufferView in, BufferView out) { return g.all_gather(in, out); }});
    check_same(g, stream, Case{"broadcast from the last rank" + w, t, {}, pattern(n * es, r, 5), std::nullopt,
                               [p](Group& g, ConstBufferView, BufferView out) { return g.broadcast(out, p - 1); }});
    check_same(g, stream, Case{"gather to 0" + w, t, pattern(n * es, r, 6), pattern(pn * es, r, 7), std::nullopt,
                               [](Group& g, ConstBufferView in, BufferView out) { return g.gather(in, out, 0); }});
    check_same(g, stream, Case{"scatter from the last rank" + w, t, pattern(pn * es, r, 8), pattern(n * es, r, 9), std::nullopt,
                               [p](Group& g, ConstBufferView in, BufferView out) { return g.scatter(in, out, p - 1); }});
    check_same(g, stream, Case{"all_to_all" + w, t, pattern(pn * es, r, 10), std::vector<std::byte>(pn * es), std::nullopt,
                               [](Group& g, ConstBufferView in, BufferView out) { return g.all_to_all(in, out); }});
    check_same(g, stream, Case{"permute, a ring" + w, t, pattern(n * es, r, 11), pattern(n * es, r, 12), std::nullopt,
                               [p](Group& g, ConstBufferView in, BufferView out) {
                                 std::vector<std::pair<int, int>> pairs;
                                 for (int i = 0; i < p; ++i) pairs.emplace_back(i, (i + 1) % p);
                                 return g.permute(in, out, pairs);
                               }});
    // The variable-size collectives: rank i's block is n + i elements (zero where n is 0 on rank 0).
    std::vector<std::size_t> counts(static_cast<std::size_t>(p));
    std::size_t total = 0;
    for (int i = 0; i < p; ++i) total += counts[static_cast<std::size_t>(i)] = n + static_cast<std::size_t>(i);
    const std::size_t mine = counts[static_cast<std::size_t>(r)];
    check_same(g, stream, Case{"all_gatherv" + w, t, pattern(mine * es, r, 15), pattern(total * es, r, 16), std::nullopt,
                               [counts](Group& g, ConstBufferView in, BufferView out) { return g.all_gatherv(in, out, counts); }});
    check_same(g, stream, Case{"scatterv from 0" + w, t, pattern(total * es, r, 17), pattern(mine * es, r, 18), std::nullopt,
                               [counts](Group& g, ConstBufferView in, BufferView out) { return g.scatterv(in, out, counts, 0); }});
    check_same(g, stream, Case{"reduce_scatterv" + w, t, make_input(t, ReduceOp::sum, r, total), std::vector<std::byte>(mine * es),
                               std::nullopt, [counts](Group& g, ConstBufferView in, BufferView out) { return g.reduce_scatterv(in, out, counts); }});
    if (p > 1) {
      // send and recv, a ring: the send's Future is waited for after the receive's.
      check_same(g, stream, Case{"send and recv, a ring" + w, t, pattern(n * es, r, 13), pattern(n * es, r, 14), std::nullopt,
                                 [p](Group& g, ConstBufferView in, BufferView out) {
                                   Future<void> sent = g.send(in, (g.rank() + 1) % p, 7);
                                   g.recv(out, (g.rank() + p - 1) % p, 7).get();
                                   return sent;
                                 }});
    }
  }
}

}  // namespace

TEST_CASE("every operation on device buffers gives the bytes it gives on host buffers", "[device][collectives]") {
  need_backend();
  const long before = checks_made.load();
  for (int p : {1, 2, 3, 4, 8}) {
    run_ranks(p, [p](Group& g) {
      gpu::Stream stream(g.loop(), device_of(g));
      // Eight ranks (threads on 2 cores) take the sizes that matter most: one element and unaligned.
      const std::vector<std::size_t> counts = p == 8 ? std::vector<std::size_t>{1, 4099} : std::vector<std::size_t>{0, 1, 7, 4099};
      for (std::size_t n : counts) {
        every_collective(g, stream, n);
        free_kept(g);
      }
    });
  }
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("eight ranks and large buffers on device", "[device][large]") {
  need_backend();
  const long before = checks_made.load();
  run_ranks(8, [](Group& g) {
    gpu::Stream stream(g.loop(), device_of(g));
    const std::size_t n = 300000;
    const auto in = make_input(DType::f32, ReduceOp::sum, g.rank(), n);
    check_same(g, stream, Case{"all_reduce f32 sum p=8 n=300000", DType::f32, in, std::vector<std::byte>(n * 4), std::nullopt,
                               [](Group& g, ConstBufferView i, BufferView o) { return g.all_reduce(i, o); }});
    check_same(g, stream, Case{"all_gather f32 p=8 n=30000", DType::f32, pattern(120000, g.rank(), 1), std::vector<std::byte>(8 * 120000),
                               std::nullopt, [](Group& g, ConstBufferView i, BufferView o) { return g.all_gather(i, o); }});
    free_kept(g);
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("later work on the stream waits for the collective, and the collective for earlier work", "[device][order]") {
  need_backend();
  const long before = checks_made.load();
  run_ranks(3, [](Group& g) {
    gpu::Stream stream(g.loop(), device_of(g));
    const std::size_t n = 50000;
    gpu::DeviceBuffer data = gpu::DeviceBuffer::allocate(stream.device(), n * sizeof(float));
    for (int round = 0; round < 20; ++round) {
      // Written on the device right before (a copy standing in for the kernel that made the gradients),
      // reduced, read right after (the optimizer's kernel); the host waits only for the last.
      std::vector<float> in(n, static_cast<float>(g.rank() + round));
      std::vector<float> out(n, -1.0f);
      Future<void> written = stream.copy(data.view<float>(), ConstBufferView(in.data(), n, DType::f32));
      Future<void> reduced = g.on(stream).all_reduce(data.view<float>());
      Future<void> read = stream.copy(BufferView(out.data(), n, DType::f32), data.view<float>());
      read.get();
      check(reduced.ready(), "the copy queued after the all_reduce finished before it");
      reduced.get();
      written.get();
      const float want = static_cast<float>(3 * round + 3);
      std::size_t wrong = 0;
      for (float v : out) wrong += v != want;
      check(wrong == 0, fmt::format("round {}: {} of {} elements are not {} (out[0] = {})", round, wrong, n, want, out[0]));
    }
    g.barrier().get();  // before `data` is freed (free_kept)
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a host collective called right after a device one runs after it, on every rank", "[device][order]") {
  // The device collective starts its host part only once its copy in is done, at a different time on
  // every rank; the host one called after it must still come second everywhere (on the shm arena, which
  // runs one collective at a time, taking them in the order they reached the loop made the ranks
  // disagree on which came first: a mismatch).
  need_backend();
  const long before = checks_made.load();
  run_ranks(3, [](Group& g) {
    const char* transport = std::getenv("WEFT_TRANSPORT");
    if (transport && std::string(transport) == "shm") check(g.has_shared_arena(), "no arena over shm");
    gpu::Stream stream(g.loop(), device_of(g));
    const std::size_t n = 16;
    gpu::DeviceBuffer data = gpu::DeviceBuffer::allocate(stream.device(), n * sizeof(float));
    for (int round = 0; round < 30; ++round) {
      std::vector<float> in(n, static_cast<float>(g.rank() + round));
      std::vector<float> out(n, -1.0f);
      std::vector<std::int32_t> host(5, g.rank() * round);
      Future<void> written = stream.copy(data.view<float>(), ConstBufferView(in.data(), n, DType::f32));
      Future<void> on_device = g.on(stream).all_reduce(data.view<float>());
      // Some ranks call the next one before their copy in is done, some after.
      std::this_thread::sleep_for(std::chrono::microseconds((g.rank() * 7 + round * 13) % 5 * 100));
      Future<void> on_host = g.all_reduce(host);
      Future<void> read = stream.copy(BufferView(out.data(), n, DType::f32), data.view<float>());
      on_host.get();
      read.get();
      on_device.get();
      written.get();
      check(host[0] == 3 * round && host[4] == 3 * round, fmt::format("round {}: host all_reduce gave {}", round, host[0]));
      check(out[0] == static_cast<float>(3 * round + 3) && out[n - 1] == out[0], fmt::format("round {}: device all_reduce gave {}", round, out[0]));
    }
    g.barrier().get();  // before `data` is freed (free_kept)
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("device buffers that are not what they say fail at the call, naming the operation", "[device][preconditions]") {
  need_backend();
  run_ranks(2, [](Group& g) {
    gpu::Stream stream(g.loop(), device_of(g));
    std::vector<float> host(16);
    // A host pointer that claims to be device memory.
    try {
      (void)g.all_reduce(BufferView(host.data(), host.size(), DType::f32, device_of(g)));
      check(false, "a host pointer passed as device memory was taken");
    } catch (const Error& e) {
      check(e.errc() == Errc::invalid_argument && std::string(e.what()).find("all_reduce") != std::string::npos &&
                std::string(e.what()).find("not device memory") != std::string::npos,
            std::string("wrong error: ") + e.what());
    }
    // A device that does not exist.
    try {
      (void)g.broadcast(BufferView(host.data(), host.size(), DType::f32, Device{Device::Kind::cuda, 99}), 0);
      check(false, "device 99 was taken");
    } catch (const Error& e) {
      check(e.errc() == Errc::invalid_argument && std::string(e.what()).find("device 99") != std::string::npos,
            std::string("wrong error: ") + e.what());
    }
    if (gpu::device_count() > g.size()) {
      // A stream of another device than the buffers': a device no rank uses (freeing memory of a rank's
      // device waits for that rank's stream, which may wait at a gate for this rank).
      gpu::DeviceBuffer other = gpu::DeviceBuffer::allocate(gpu::device(g.size()), 64);
      try {
        (void)g.on(stream).all_reduce(other.view<float>());
        check(false, "a stream of another device was taken");
      } catch (const Error& e) {
        check(e.errc() == Errc::invalid_argument && std::string(e.what()).find("the stream is on device") != std::string::npos,
              std::string("wrong error: ") + e.what());
      }
    }
    // Nothing was sent: the group still works.
    gpu::DeviceBuffer ok = gpu::DeviceBuffer::allocate(stream.device(), 64);
    g.on(stream).all_reduce(ok.view<float>()).get();
    check(true, "");
  });
}

// Runs `body` on n ranks and returns each rank's error ("<errc>|<what>"; empty where it threw none),
// with the rank whose own device failed (device_failure; REQUIREd to be one). For the cases where
// WEFT_SIM_FAIL makes some rank's device fail and no rank may hang or succeed past it.
namespace {
std::pair<std::vector<std::string>, int> failed_device_run(int n, const std::function<void(Group&)>& body) {
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  try {
    run_ranks(n, [&](Group& g) {
      try {
        body(g);
      } catch (const Error& e) {
        errors[static_cast<std::size_t>(g.rank())] = fmt::format("{}|{}", static_cast<int>(e.errc()), e.what());
        throw;
      }
    });
  } catch (const RankFailure&) {
  }
  int failed_device = -1;
  for (int r = 0; r < n; ++r) {
    const auto& e = errors[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << e);
    REQUIRE(!e.empty());
    if (e.rfind(fmt::format("{}|", static_cast<int>(Errc::device_failure)), 0) == 0) failed_device = r;
  }
  REQUIRE(failed_device >= 0);
  return {errors, failed_device};
}
}  // namespace

TEST_CASE("a rank whose device fails mid-collective fails every rank, naming it", "[device-failure]") {
  need_backend();
  // WEFT_SIM_FAIL=<n> (meson) fails the n-th device item of the process: a copy of some rank, whichever
  // comes n-th. That rank fails with device_failure; every other fails too (the group is aborted), naming
  // that rank. No rank may hang or succeed past the failure.
  const auto [errors, failed_device] = failed_device_run(4, [](Group& g) {
    gpu::Stream stream(g.loop(), device_of(g));
    gpu::DeviceBuffer data = gpu::DeviceBuffer::allocate(stream.device(), 4096 * sizeof(float));
    for (int i = 0; i < 50; ++i) g.on(stream).all_reduce(data.view<float>()).get();
  });
  for (int r = 0; r < 4; ++r) {
    const auto& e = errors[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << e);
    if (r != failed_device) CHECK(e.find(fmt::format("rank {}: its device failed", failed_device)) != std::string::npos);
  }
}

TEST_CASE("a send or recv whose device fails is named by its number, peer and tag on both ranks", "[.device-failure-p2p]") {
  need_backend();
  // Its own process (meson: WEFT_SIM_FAIL=<n>, the n-th device item of the process fails, sticky): a
  // ping-pong on device buffers, tag 5. The rank whose copy failed reports device_failure naming its
  // call as its other errors do ("send #7 (peer 1) [tag 5]"); the other fails through the abort, which
  // names that rank and call (2026-12-05: "rank 1: send: device 1 failed ...", no number, peer or tag).
  // Catch2 2 runs hidden cases under a filter that only excludes ("~[device-failure]"): there, without
  // a failure to inject, it has nothing to check.
  if (!std::getenv("WEFT_SIM_FAIL")) return;
  const auto [errors, failed_device] = failed_device_run(2, [](Group& g) {
    gpu::Stream stream(g.loop(), device_of(g));
    gpu::DeviceBuffer data = gpu::DeviceBuffer::allocate(stream.device(), 256 * sizeof(float));
    const int peer = 1 - g.rank();
    for (int i = 0; i < 100; ++i) {
      for (const bool sending : {g.rank() == 0, g.rank() != 0}) {
        if (sending) g.on(stream).send(data.view<float>(), peer, 5).get();
        else g.on(stream).recv(data.view<float>(), peer, 5).get();
      }
    }
  });
  const int other = 1 - failed_device;
  const std::string& failed = errors[static_cast<std::size_t>(failed_device)];
  INFO("failed rank " << failed_device << ": " << failed << "\nother: " << errors[static_cast<std::size_t>(other)]);
  const bool sent = failed.find(fmt::format("rank {}: send #", failed_device)) != std::string::npos;
  const bool received = failed.find(fmt::format("rank {}: recv #", failed_device)) != std::string::npos;
  CHECK(sent != received);
  CHECK(failed.find(fmt::format("(peer {}) [tag 5]: device", other)) != std::string::npos);
  CHECK(errors[static_cast<std::size_t>(other)].find(fmt::format("rank {}: its device failed in {} #", failed_device, sent ? "send" : "recv")) !=
        std::string::npos);
  CHECK(errors[static_cast<std::size_t>(other)].find(fmt::format("(peer {}) [tag 5]", other)) != std::string::npos);
}

TEST_CASE("cancelling a stream-ordered operation ends it and lets the stream go on", "[device][cancel]") {
  need_backend();
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    gpu::Stream stream(g.loop(), device_of(g));
    // 1025 elements: two pieces where the pipelined suites cut 4 KiB pieces (cancelled mid-pipeline).
    gpu::DeviceBuffer data = gpu::DeviceBuffer::allocate(stream.device(), 1025 * sizeof(float));
    if (g.rank() == 0) {
      // Rank 1 never joins: the all_reduce waits until cancelled; the stream's later work waits with it.
      Future<void> reduced = g.on(stream).all_reduce(data.view<float>());
      Future<void> later = stream.synchronize();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      check(!reduced.ready() && !later.ready(), "the all_reduce finished without its peer");
      reduced.cancel();
      check(ends_cancelled(reduced), "the cancelled all_reduce did not end as cancelled");
      later.get();  // the gate opened: the stream went on
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));  // stays (leaving would fail rank 0's call)
    }
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("all_reduce through an epilogue: host buffers, device buffers, and on a stream in its order", "[device][epilogue]") {
  need_backend();
  const long before = checks_made.load();
  for (int p : {1, 2, 3}) {
    run_ranks(p, [p](Group& g) {
      gpu::Stream stream(g.loop(), device_of(g));
      const gpu::Epilogue plus_index = gpu::Epilogue::on_host<float, double>([](float x, std::size_t i) { return double(x) + double(i); }, "plus index");
      struct EpilogueCase {
        DType dtype;
        ReduceOp op;
        gpu::Epilogue epilogue;
        bool in_place;  // the output is the input's memory
      };
      const std::vector<EpilogueCase> cases{{DType::f32, ReduceOp::avg, gpu::Epilogue::cast(DType::bf16), false},
                                            {DType::i32, ReduceOp::sum, gpu::Epilogue::scale_and_cast(0.5, DType::f32), true},
                                            {DType::f64, ReduceOp::sum, gpu::Epilogue::scale(0.25), true},
                                            {DType::f32, ReduceOp::sum, plus_index, false}};
      for (const EpilogueCase& c : cases) {
        // A user's epilogue made with on_host runs on the sim only; under CUDA it needs nvcc
        // (weft/gpu_epilogue.cuh: tests/unit/test_epilogue_cuh).
        if (gpu::backend() == gpu::Backend::cuda && c.epilogue.describe() == "custom 'plus index' (f32 -> f64)") continue;
        for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(4099)}) {
          const DType to = c.epilogue.output(c.dtype);
          const std::string what = fmt::format("p={} {} {} x {} through {}{}", p, to_string(c.op), to_string(c.dtype), n,
                                               c.epilogue.describe(), c.in_place ? ", in place" : "");
          const std::vector<std::byte> input = make_input(c.dtype, c.op, g.rank(), n);
          // The reference: the plain all_reduce on host memory, then the epilogue on the host.
          std::vector<std::byte> sum(input.size()), want(n * dtype_size(to));
          g.all_reduce(ConstBufferView(input.data(), n, c.dtype), BufferView(sum.data(), n, c.dtype), c.op).get();
          c.epilogue.apply(ConstBufferView(sum.data(), n, c.dtype), BufferView(want.data(), n, to));
          const std::size_t bytes = std::max(input.size(), want.size());
          // Host buffers.
          {
            std::vector<std::byte> in = input, out(bytes);
            in.resize(bytes);
            BufferView o(c.in_place ? in.data() : out.data(), n, to);
            g.all_reduce(ConstBufferView(in.data(), n, c.dtype), o, c.op, c.epilogue).get();
            check(want.empty() || std::memcmp(o.data, want.data(), want.size()) == 0, what + ", host: " + compare(to, o.data, want.data(), n));
          }
          // Device buffers, on the group's own stream and on the caller's (copies queued back to back).
          for (bool ordered : {false, true}) {
            // Freed between two barriers: freeing waits for the whole device, which a rank of the same
            // device must not hold with a gate of an operation that needs this rank (Group::on).
            g.barrier().get();
            gpu::DeviceBuffer in = gpu::DeviceBuffer::allocate(stream.device(), bytes);
            gpu::DeviceBuffer out = gpu::DeviceBuffer::allocate(stream.device(), bytes);
            const BufferView o(c.in_place ? in.data() : out.data(), n, to, stream.device());
            std::vector<std::byte> got(want.size());
            Future<void> written = stream.copy(BufferView(in.data(), input.size(), DType::u8, stream.device()),
                                               ConstBufferView(input.data(), input.size(), DType::u8));
            if (!ordered) written.get();
            // On a stream, the copy back is queued right after: it reads the epilogue's output only if it
            // waited for it on the device.
            Future<void> reduced = (ordered ? g.on(stream) : g).all_reduce(ConstBufferView(in.data(), n, c.dtype, stream.device()), o, c.op, c.epilogue);
            if (!ordered) reduced.get();
            Future<void> read = stream.copy(BufferView(got.data(), got.size(), DType::u8), ConstBufferView(o.data, got.size(), DType::u8, stream.device()));
            read.get();
            reduced.get();
            written.get();
            check(got == want, fmt::format("{}, device{}: {}", what, ordered ? " (on a stream)" : "", compare(to, got.data(), want.data(), n)));
            g.barrier().get();  // before the buffers go
          }
        }
      }
      // Refused at the call, naming the rank and the operation.
      std::vector<float> host(8);
      try {
        (void)g.all_reduce(ConstBufferView(host.data(), 8, DType::f32), BufferView(host.data(), 8, DType::f32), ReduceOp::sum,
                           gpu::Epilogue::cast(DType::f16));
        check(false, "an output of the wrong dtype was taken");
      } catch (const Error& e) {
        check(std::string(e.what()).find("the epilogue cast to f16 stores 8 x f16") != std::string::npos, e.what());
        check(std::string(e.what()).find("all_reduce") != std::string::npos, e.what());
      }
    });
  }
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a group whose ranks drive several devices all_reduces over every device of every rank", "[device][multi]") {
  need_backend();
  const long before = checks_made.load();
  // 1 rank x 3 devices, 2 ranks x 2 devices (the issue's case), 3 ranks with 2, 1 and 3.
  const std::vector<std::vector<int>> layouts{{3}, {2, 2}, {2, 1, 3}};
  for (const std::vector<int>& layout : layouts) {
    const int p = static_cast<int>(layout.size());
    run_ranks(p, [&layout, p](Group& g) {
      std::vector<Device> devices;
      for (int k = 0; k < layout[static_cast<std::size_t>(g.rank())]; ++k) devices.push_back(gpu::device((g.rank() + k) % gpu::device_count()));
      gpu::MultiDeviceGroup multi = gpu::MultiDeviceGroup::create(g, devices).get();
      int total = 0;
      for (int c : layout) total += c;
      check(multi.total_devices() == total, fmt::format("{} devices in all, not {}", multi.total_devices(), total));
      gpu::Stream copier(g.loop(), devices[0]);
      struct MultiCase {
        DType dtype;
        ReduceOp op;
        gpu::Epilogue epilogue;
      };
      const std::vector<MultiCase> cases{{DType::f32, ReduceOp::sum, {}},         {DType::i32, ReduceOp::max, {}},
                                         {DType::f64, ReduceOp::avg, {}},         {DType::bf16, ReduceOp::sum, {}},
                                         {DType::u8, ReduceOp::bitwise_xor, {}},  {DType::i64, ReduceOp::prod, {}},
                                         {DType::f32, ReduceOp::avg, gpu::Epilogue::cast(DType::bf16)},
                                         {DType::i32, ReduceOp::sum, gpu::Epilogue::scale_and_cast(0.5, DType::f32)}};
      for (const MultiCase& c : cases) {
        for (std::size_t n : {std::size_t(0), std::size_t(1), std::size_t(7), std::size_t(4099)}) {
          for (bool in_place : {false, true}) {
            const DType to = c.epilogue.output(c.dtype);
            if (in_place && to != c.dtype) continue;
            const std::string what = fmt::format("layout {} rank {}: {} {} x {}{}{}", fmt::join(layout, "+"), g.rank(), to_string(c.op),
                                                 to_string(c.dtype), n, in_place ? ", in place" : "",
                                                 c.epilogue.is_identity() ? "" : ", then " + c.epilogue.describe());
            trace(what);
            // Buffers are freed between two barriers: freeing waits for the whole device, which a rank
            // of the same device must not hold with a gate of an operation that needs this rank.
            g.barrier().get();
            std::vector<gpu::DeviceBuffer> ins, outs;
            std::vector<ConstBufferView> in_views;
            std::vector<BufferView> out_views;
            for (std::size_t k = 0; k < devices.size(); ++k) {
              const auto input = make_input(c.dtype, c.op, multi.first_device_rank() + static_cast<int>(k), n);
              ins.push_back(gpu::DeviceBuffer::allocate(devices[k], input.size()));
              outs.push_back(gpu::DeviceBuffer::allocate(devices[k], n * dtype_size(to)));
              gpu::Stream(g.loop(), devices[k]).copy(ins.back().view(DType::u8), ConstBufferView(input.data(), input.size(), DType::u8)).get();
              in_views.push_back(ins.back().view(c.dtype));
              out_views.push_back(in_place ? ins.back().view(c.dtype) : outs.back().view(to));
            }
            multi.all_reduce(in_views, out_views, c.op, c.epilogue).get();
            const auto reduced = make_reduced(c.dtype, c.op, total, n);
            std::vector<std::byte> want(n * dtype_size(to));
            c.epilogue.apply(ConstBufferView(reduced.data(), n, c.dtype), BufferView(want.data(), n, to));
            for (std::size_t k = 0; k < devices.size(); ++k) {
              std::vector<std::byte> got(want.size());
              gpu::Stream(g.loop(), devices[k]).copy(BufferView(got.data(), got.size(), DType::u8),
                                                     ConstBufferView(out_views[k].data, got.size(), DType::u8, devices[k])).get();
              check(got == want, fmt::format("{}, device entry {}: {}", what, k, compare(to, got.data(), want.data(), n)));
            }
            g.barrier().get();  // before the buffers go (freeing waits for the device)
          }
        }
      }
      // Back to back without waiting: every call's output is the next one's input (in place), ordered
      // on the devices alone. max makes every element total - 1, and each sum multiplies it by total
      // (i64, wrapping: exact at any size).
      {
        g.barrier().get();  // after every rank freed the last case's buffers
        const std::size_t n = 1000;
        std::vector<gpu::DeviceBuffer> data;
        std::vector<BufferView> views;
        for (std::size_t k = 0; k < devices.size(); ++k) {
          const std::vector<std::int64_t> init(n, multi.first_device_rank() + static_cast<int>(k));
          data.push_back(gpu::DeviceBuffer::allocate(devices[k], n * sizeof(std::int64_t)));
          gpu::Stream(g.loop(), devices[k]).copy(data.back().view<std::int64_t>(), ConstBufferView(init.data(), n, DType::i64)).get();
          views.push_back(data.back().view<std::int64_t>());
        }
        // WEFT_TEST_BACK_TO_BACK: fewer calls (a diagnosis on a GPU: the H200 hung in this part with 50
        // calls of 2 ranks on one device, bench/RESULTS.md, 2026-12-04).
        const char* asked = std::getenv("WEFT_TEST_BACK_TO_BACK");
        const int calls_made = asked ? std::max(2, std::atoi(asked)) / 2 * 2 : 50;  // even: max then sum
        trace(fmt::format("layout {} rank {}: {} calls back to back", fmt::join(layout, "+"), g.rank(), calls_made));
        std::vector<Future<void>> calls;
        for (int round = 0; round < calls_made; ++round) calls.push_back(multi.all_reduce(views, round % 2 ? ReduceOp::sum : ReduceOp::max));
        for (auto& f : calls) f.get();
        std::uint64_t want = static_cast<std::uint64_t>(total - 1);
        for (int round = 1; round < calls_made; round += 2) want *= static_cast<std::uint64_t>(total);
        for (std::size_t k = 0; k < devices.size(); ++k) {
          std::vector<std::int64_t> got(n);
          gpu::Stream(g.loop(), devices[k]).copy(BufferView(got.data(), n, DType::i64), views[k]).get();
          const auto wrong = std::count_if(got.begin(), got.end(), [&](std::int64_t v) { return static_cast<std::uint64_t>(v) != want; });
          check(wrong == 0, fmt::format("{} calls back to back, entry {}: {} of {} elements are not {} (got {})", calls_made, k, wrong, n,
                                        static_cast<std::int64_t>(want), got[0]));
        }
        g.barrier().get();
      }
      // A bad output fails at the call, before anything is queued (the group's count stays in step).
      g.barrier().get();
      gpu::DeviceBuffer one = gpu::DeviceBuffer::allocate(devices[0], 64);
      std::vector<BufferView> wrong_dtype(devices.size(), BufferView(one.data(), 4, DType::i32, devices[0]));
      std::vector<ConstBufferView> fine(devices.size(), ConstBufferView(one.data(), 4, DType::f32, devices[0]));
      try {
        (void)multi.all_reduce(fine, wrong_dtype);
        check(false, "an output of the wrong dtype was taken");
      } catch (const Error& e) {
        check(std::string(e.what()).find("entry 0: the output is 4 x i32") != std::string::npos, e.what());
      }
      // A bad device list too, naming the rank (DeviceSet, which checks it, knows no group).
      try {
        (void)gpu::MultiDeviceGroup::create(g, std::vector<Device>(9, devices[0]));
        check(false, "a set of 9 devices was taken");
      } catch (const Error& e) {
        const std::string want = fmt::format("rank {}: MultiDeviceGroup::create: DeviceSet: 9 devices", g.rank());
        check(std::string(e.what()).find(want) != std::string::npos, std::string(e.what()) + " does not say " + want);
      }
      g.barrier().get();
    });
  }
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a multi-device all_reduce whose peer rank aborts fails naming it, and its devices go on", "[device][multi]") {
  need_backend();
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    std::vector<Device> devices{gpu::device(g.rank() % gpu::device_count()), gpu::device((g.rank() + 1) % gpu::device_count())};
    gpu::MultiDeviceGroup multi = gpu::MultiDeviceGroup::create(g, devices).get();
    std::vector<gpu::DeviceBuffer> data;
    std::vector<BufferView> views;
    for (const Device& d : devices) {
      data.push_back(gpu::DeviceBuffer::allocate(d, 4099 * sizeof(float)));
      views.push_back(data.back().view<float>());
    }
    multi.all_reduce(views).get();  // one that works
    g.barrier().get();
    if (g.rank() == 1) {
      g.abort("rank 1 leaves");
      return;
    }
    bool failed = false;
    try {
      multi.all_reduce(views, ReduceOp::avg, gpu::Epilogue::scale(2.0)).get();
    } catch (const Error& e) {
      failed = true;
      check(e.errc() == Errc::aborted || e.errc() == Errc::group_failed, fmt::format("not an abort: {}", e.what()));
      check(std::string(e.what()).find("rank 1") != std::string::npos, fmt::format("the error does not name rank 1: {}", e.what()));
    }
    check(failed, "the all_reduce succeeded without its peer");
    // The stages after the failed one ran (their gate opened): the devices' streams go on.
    for (std::size_t k = 0; k < devices.size(); ++k) multi.set().record(k).done().get();
    gpu::Stream(g.loop(), devices[0]).synchronize().get();
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("all_reduce on device windows: a rank that passes host buffers fails every rank as a mismatch", "[device][windows]") {
  need_backend();
  const char* ipc = std::getenv("WEFT_DEVICE_IPC");
  if (!ipc || std::string_view(ipc) != "1") {
    SUCCEED("only where WEFT_DEVICE_IPC=1 (the device windows are opt-in)");
    return;
  }
  std::vector<std::string> errors(2);
  try {
    run_ranks(2, [&](Group& g) {
      gpu::Stream stream(g.loop(), device_of(g));
      std::vector<float> host(1000, 1.0f);
      gpu::DeviceBuffer data = gpu::DeviceBuffer::allocate(stream.device(), host.size() * sizeof(float));
      try {
        // Rank 0 on device buffers (the windows), rank 1 on host buffers (the host path).
        if (g.rank() == 0) {
          g.on(stream).all_reduce(data.view<float>()).get();
        } else {
          g.all_reduce(BufferView(host)).get();
        }
      } catch (const Error& e) {
        errors[static_cast<std::size_t>(g.rank())] = fmt::format("{}|{}", static_cast<int>(e.errc()), e.what());
      }
      stream.synchronize().get();  // the gate opened: the stream goes on
      g.barrier().get();
    });
  } catch (const RankFailure&) {
    // the barrier after the failure fails too
  }
  for (int r = 0; r < 2; ++r) {
    const std::string& e = errors[static_cast<std::size_t>(r)];
    INFO("rank " << r << ": " << e);
    CHECK(e.find("all_reduce on device windows") != std::string::npos);
  }
  // The rank that sees it first fails with mismatch; the other with mismatch or with its abort.
  const std::string mismatch = fmt::format("{}|", static_cast<int>(Errc::mismatch));
  CHECK((errors[0].rfind(mismatch, 0) == 0 || errors[1].rfind(mismatch, 0) == 0));
}
