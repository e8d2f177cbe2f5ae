// Every collective against the reference: every dtype, every defined op, world sizes 1, 2, 3, 4, 5 and 8,
// counts 0, 1, 7, 4099 and a little over 1 MiB, in place and out of place. Ranks are threads.
#include <catch2/catch.hpp>

#include "support/harness.hpp"
#include "weft/asio.hpp"
#include "support/check_data.hpp"
#include "group/checks.hpp"
#include "group/state.hpp"
#include "transports/framed/framed_transport.hpp"

#include <sys/mman.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <random>
#include <future>
#include <latch>
#include <thread>

using namespace weft;
using namespace weft::test;
using namespace weft::reference;

namespace {

std::vector<std::size_t> counts_for(DType t) {
  return {0, 1, 7, 4099, (std::size_t{1} << 20) / dtype_size(t) + 3};
}

std::string where(const char* what, DType t, ReduceOp op, std::size_t count, bool in_place) {
  return fmt::format("{} {} {} x {}{}: ", what, to_string(t), to_string(op), count, in_place ? " (in place)" : "");
}

void reductions(Group& g, DType t, std::size_t count) {
  const int p = g.size();
  const int r = g.rank();
  const std::size_t esize = dtype_size(t);
  for (ReduceOp op : all_reduce_ops) {
    if (!is_defined(t, op)) continue;
    const auto expected = make_reduced(t, op, p, count);
    {  // all_reduce, out of place and in place
      auto in = make_input(t, op, r, count);
      std::vector<std::byte> out(in.size());
      g.all_reduce(ConstBufferView(in.data(), count, t), BufferView(out.data(), count, t), op).get();
      auto diff = compare(t, out.data(), expected.data(), count);
      check(diff.empty(), where("all_reduce", t, op, count, false) + diff);
      g.all_reduce(BufferView(in.data(), count, t), op).get();
      diff = compare(t, in.data(), expected.data(), count);
      check(diff.empty(), where("all_reduce", t, op, count, true) + diff);
    }
    {  // reduce_scatter: block i of every rank's input is reduced into rank i's output
      std::vector<std::byte> in(static_cast<std::size_t>(p) * count * esize);
      for (int b = 0; b < p; ++b) {
        auto part = make_input(t, op, r, count, static_cast<std::size_t>(b) * 13);
        std::copy(part.begin(), part.end(), in.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(b) * count * esize));
      }
      std::vector<std::byte> out(count * esize);
      g.reduce_scatter(ConstBufferView(in.data(), in.size() / esize, t), BufferView(out.data(), count, t), op).get();
      const auto mine = make_reduced(t, op, p, count, static_cast<std::size_t>(r) * 13);
      const auto diff = compare(t, out.data(), mine.data(), count);
      check(diff.empty(), where("reduce_scatter", t, op, count, false) + diff);
    }
    {  // reduce to a root that moves with the count
      const int root = static_cast<int>(count % static_cast<std::size_t>(p));
      auto in = make_input(t, op, r, count);
      std::vector<std::byte> out(r == root ? in.size() : 0);
      g.reduce(ConstBufferView(in.data(), count, t), BufferView(out.data(), r == root ? count : 0, t), root, op).get();
      if (r == root) {
        const auto diff = compare(t, out.data(), expected.data(), count);
        check(diff.empty(), where("reduce", t, op, count, false) + diff);
      }
    }
  }
}

void movements(Group& g, DType t, std::size_t count) {
  const int p = g.size();
  const int r = g.rank();
  const std::size_t esize = dtype_size(t);
  const std::size_t bytes = count * esize;
  auto block_of = [&](int rank, std::size_t salt) { return make_input(t, ReduceOp::sum, rank, count, salt); };
  const int root = static_cast<int>((count + 1) % static_cast<std::size_t>(p));
  {  // all_gather, out of place and in place
    auto in = block_of(r, 0);
    std::vector<std::byte> out(bytes * static_cast<std::size_t>(p));
    g.all_gather(ConstBufferView(in.data(), count, t), BufferView(out.data(), count * p, t)).get();
    for (int b = 0; b < p; ++b) {
      const auto diff = compare(t, out.data() + static_cast<std::size_t>(b) * bytes, block_of(b, 0).data(), count);
      check(diff.empty(), where("all_gather", t, ReduceOp::sum, count, false) + fmt::format("block {}: ", b) + diff);
    }
    std::vector<std::byte> in_place(bytes * static_cast<std::size_t>(p));
    if (bytes) std::memcpy(in_place.data() + static_cast<std::size_t>(r) * bytes, in.data(), bytes);
    g.all_gather(ConstBufferView(in_place.data() + static_cast<std::size_t>(r) * bytes, count, t),
                 BufferView(in_place.data(), count * p, t)).get();
    check(in_place == out, where("all_gather", t, ReduceOp::sum, count, true) + "differs from out of place");
  }
  {  // broadcast
    auto data = r == root ? block_of(root, 5) : std::vector<std::byte>(bytes, std::byte{0x5a});
    g.broadcast(BufferView(data.data(), count, t), root).get();
    const auto diff = compare(t, data.data(), block_of(root, 5).data(), count);
    check(diff.empty(), where("broadcast", t, ReduceOp::sum, count, true) + diff);
  }
  {  // gather and scatter
    auto in = block_of(r, 9);
    std::vector<std::byte> out(r == root ? bytes * static_cast<std::size_t>(p) : 0);
    g.gather(ConstBufferView(in.data(), count, t), BufferView(out.data(), r == root ? count * p : 0, t), root).get();
    if (r == root) {
      for (int b = 0; b < p; ++b) {
        const auto diff = compare(t, out.data() + static_cast<std::size_t>(b) * bytes, block_of(b, 9).data(), count);
        check(diff.empty(), where("gather", t, ReduceOp::sum, count, false) + fmt::format("block {}: ", b) + diff);
      }
    }
    std::vector<std::byte> all;
    if (r == root) {
      for (int b = 0; b < p; ++b) {
        auto part = block_of(b, 21);
        all.insert(all.end(), part.begin(), part.end());
      }
    }
    std::vector<std::byte> mine(bytes);
    g.scatter(ConstBufferView(all.data(), r == root ? count * p : 0, t), BufferView(mine.data(), count, t), root).get();
    const auto diff = compare(t, mine.data(), block_of(r, 21).data(), count);
    check(diff.empty(), where("scatter", t, ReduceOp::sum, count, false) + diff);
  }
  {  // all_to_all: block j of rank i's input lands in block i of rank j's output
    std::vector<std::byte> in;
    for (int j = 0; j < p; ++j) {
      auto part = block_of(r, static_cast<std::size_t>(j) * 31);
      in.insert(in.end(), part.begin(), part.end());
    }
    std::vector<std::byte> out(in.size());
    g.all_to_all(ConstBufferView(in.data(), count * p, t), BufferView(out.data(), count * p, t)).get();
    for (int i = 0; i < p; ++i) {
      const auto diff = compare(t, out.data() + static_cast<std::size_t>(i) * bytes,
                                block_of(i, static_cast<std::size_t>(r) * 31).data(), count);
      check(diff.empty(), where("all_to_all", t, ReduceOp::sum, count, false) + fmt::format("block {}: ", i) + diff);
    }
    g.all_to_all(ConstBufferView(in.data(), count * p, t), BufferView(in.data(), count * p, t)).get();
    check(in == out, where("all_to_all", t, ReduceOp::sum, count, true) + "differs from out of place");
  }
  {  // permute: a shift by one, except that the last rank sends nowhere and rank 0 receives nothing
    std::vector<std::pair<int, int>> pairs;
    for (int i = 0; i + 1 < p; ++i) pairs.emplace_back(i, i + 1);
    if (p == 1) pairs.emplace_back(0, 0);
    auto in = block_of(r, 3);
    std::vector<std::byte> out(bytes, std::byte{0x77});
    g.permute(ConstBufferView(in.data(), count, t), BufferView(out.data(), count, t), pairs).get();
    const std::vector<std::byte> expected =
        p == 1 ? block_of(0, 3) : (r == 0 ? std::vector<std::byte>(bytes, std::byte{0}) : block_of(r - 1, 3));
    const auto diff = compare(t, out.data(), expected.data(), count);
    check(diff.empty(), where("permute", t, ReduceOp::sum, count, false) + diff);
  }
}

void matrix(int p) {
  const long before = checks_made.load();
  run_ranks(p, [](Group& g) {
    for (DType t : all_dtypes) {
      for (std::size_t count : counts_for(t)) {
        reductions(g, t, count);
        movements(g, t, count);
      }
    }
    g.barrier().get();
  });
  REQUIRE(checks_made.load() > before);
}

}  // namespace

TEST_CASE("every collective matches the reference on 1 rank", "[collectives][p1]") { matrix(1); }
TEST_CASE("every collective matches the reference on 2 ranks", "[collectives][p2]") { matrix(2); }
TEST_CASE("every collective matches the reference on 3 ranks", "[collectives][p3]") { matrix(3); }
TEST_CASE("every collective matches the reference on 4 ranks", "[collectives][p4]") { matrix(4); }
TEST_CASE("every collective matches the reference on 5 ranks", "[collectives][p5]") { matrix(5); }
TEST_CASE("every collective matches the reference on 8 ranks", "[collectives][p8]") { matrix(8); }

// In place and out of place take separate paths for some collectives (a copy of the input to send from,
// a block copied out after; the task where a block passes one segment): ranks on either path must meet.
TEST_CASE("ranks that call in place and ranks that call out of place meet in one collective", "[collectives][inflight]") {
  const long before = checks_made.load();
  for (int ranks : {2, 3, 4}) {
    run_ranks(ranks, [](Group& g) {
      const int p = g.size();
      const int r = g.rank();
      const bool in_place = r % 2 == 1;
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4099}, std::size_t{300'000}}) {
        const auto pn = static_cast<std::size_t>(p) * count;
        // all_to_all: element k of rank i's block for rank j is i * 1000 + j * 100 + k % 97
        auto value = [](int from, int to, std::size_t k) { return static_cast<float>(from * 1000 + to * 100 + static_cast<int>(k % 97)); };
        std::vector<float> in(pn);
        for (int j = 0; j < p; ++j) {
          for (std::size_t k = 0; k < count; ++k) in[static_cast<std::size_t>(j) * count + k] = value(r, j, k);
        }
        std::vector<float> out(pn, -1.0F);
        std::vector<float>& result = in_place ? in : out;
        g.all_to_all(ConstBufferView(in.data(), pn, DType::f32), BufferView(result.data(), pn, DType::f32)).get();
        std::string wrong;
        for (int i = 0; i < p && wrong.empty(); ++i) {
          for (std::size_t k = 0; k < count; ++k) {
            const float got = result[static_cast<std::size_t>(i) * count + k];
            if (got != value(i, r, k)) {
              wrong = fmt::format("block {} element {} is {}, expected {}", i, k, got, value(i, r, k));
              break;
            }
          }
        }
        check(wrong.empty(), fmt::format("all_to_all, {} ranks, count {}, rank {} ({}): {}", p, count, r, in_place ? "in place" : "out of place", wrong));
        // all_reduce: the sum of r + k % 13 over the ranks
        std::vector<float> mine(count);
        for (std::size_t k = 0; k < count; ++k) mine[k] = static_cast<float>(r + static_cast<int>(k % 13));
        std::vector<float> sum(count, -1.0F);
        std::vector<float>& reduced = in_place ? mine : sum;
        g.all_reduce(ConstBufferView(mine.data(), count, DType::f32), BufferView(reduced.data(), count, DType::f32)).get();
        wrong.clear();
        for (std::size_t k = 0; k < count && wrong.empty(); ++k) {
          const auto expected = static_cast<float>(p * (p - 1) / 2 + p * static_cast<int>(k % 13));
          if (reduced[k] != expected) wrong = fmt::format("element {} is {}, expected {}", k, reduced[k], expected);
        }
        check(wrong.empty(), fmt::format("all_reduce, {} ranks, count {}, rank {} ({}): {}", p, count, r, in_place ? "in place" : "out of place", wrong));
      }
      g.barrier().get();
    });
  }
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("no rank leaves a barrier before every rank entered it", "[collectives][inflight]") {
  // Rank 2 enters late (a pause, not a timing check): with the dissemination rounds sent at once, rank 0
  // of 5 left having heard from ranks 4, 3 and 1 only (and rank 1 of 4 from ranks 0 and 3). The check is
  // each rank's flag, set before it enters.
  for (int p : {2, 3, 4, 5, 6, 8}) {
    std::vector<std::atomic<bool>> entered(static_cast<std::size_t>(p));
    for (auto& e : entered) e = false;
    run_ranks(p, [&](Group& g) {
      g.barrier().get();
      for (int round = 0; round < 3; ++round) {
        if (g.rank() == std::min(2, p - 1)) std::this_thread::sleep_for(std::chrono::milliseconds(20));
        entered[static_cast<std::size_t>(g.rank())] = true;
        g.barrier().get();
        for (int r = 0; r < p; ++r) {
          check(entered[static_cast<std::size_t>(r)].load(),
                fmt::format("p={} round {}: rank {} left the barrier before rank {} entered it", p, round, g.rank(), r));
        }
        g.barrier().get();  // every rank has checked: the flags may be reset
        if (g.rank() == 0) {
          for (auto& e : entered) e = false;
        }
        g.barrier().get();
      }
    });
  }
}

TEST_CASE("several operations are in flight on one group at once", "[collectives][inflight]") {
  run_ranks(4, [](Group& g) {
    const int p = g.size();
    std::vector<std::vector<float>> sums(6, std::vector<float>(5000));
    std::vector<std::vector<std::int32_t>> gathered(6, std::vector<std::int32_t>(3 * static_cast<std::size_t>(p)));
    std::vector<std::int32_t> mine(3, g.rank());
    std::vector<Future<void>> futures;
    for (std::size_t k = 0; k < sums.size(); ++k) {
      std::fill(sums[k].begin(), sums[k].end(), static_cast<float>(g.rank() + static_cast<int>(k)));
      futures.push_back(g.all_reduce(sums[k]));
      futures.push_back(g.all_gather(mine, gathered[k]));
    }
    // Point-to-point messages with the same tag match in order, and overtake nothing.
    const int next = (g.rank() + 1) % p;
    const int prev = (g.rank() + p - 1) % p;
    std::vector<std::int32_t> first{g.rank() * 10}, second{g.rank() * 10 + 1}, got1(1), got2(1);
    futures.push_back(g.send(first, next, 5));
    futures.push_back(g.send(second, next, 5));
    futures.push_back(g.recv(got1, prev, 5));
    futures.push_back(g.recv(got2, prev, 5));
    for (auto& f : futures) f.get();
    for (std::size_t k = 0; k < sums.size(); ++k) {
      const float expected = static_cast<float>(p * (p - 1) / 2 + p * static_cast<int>(k));
      check(sums[k][4999] == expected, fmt::format("all_reduce #{} gave {}, expected {}", k, sums[k][4999], expected));
      for (int b = 0; b < p; ++b) check(gathered[k][3 * static_cast<std::size_t>(b)] == b, "all_gather block mismatch");
    }
    check(got1[0] == prev * 10 && got2[0] == prev * 10 + 1, "point-to-point messages overtook each other");
  });
}

TEST_CASE("collectives waited on from threads that end one after the other", "[collectives][inflight]") {
  // A thread that waits drives the loop (caller-driven progress): the receives it posts while it waits
  // belong to it as far as the kernel is concerned (an io_uring request's task work runs in the thread
  // that submitted it, and the thread's end cancels it). The next message must still arrive, through
  // the progress thread or the next waiter, and no rank may read the end of a thread as a failure.
  run_ranks(3, [](Group& g) {
    const int p = g.size();
    for (int round = 0; round < 12; ++round) {
      std::vector<float> sums(round % 2 ? 3 : 700, static_cast<float>(g.rank() + round));
      std::exception_ptr failure;
      std::thread([&] {
        try {
          g.all_reduce(sums).get();
        } catch (...) {
          failure = std::current_exception();
        }
      }).join();
      if (failure) std::rethrow_exception(failure);
      const float expected = static_cast<float>(p * (p - 1) / 2 + p * round);
      check(sums.back() == expected, fmt::format("round {}: all_reduce gave {}, expected {}", round, sums.back(), expected));
      // The waiter is gone; the rank rests while its peers may still be sending to it.
      std::this_thread::sleep_for(std::chrono::milliseconds(round % 3 == 0 ? 30 : 1));
    }
    std::vector<float> last(5, 1.0F);
    g.all_reduce(last).get();
    check(last[0] == static_cast<float>(p), "the all_reduce after the last waiter thread ended gave the wrong sum");
  });
}

TEST_CASE("a group's operations awaited from a Task on another loop, back and forth, and cancelled from there", "[collectives][inflight]") {
  // An application's own Loop drives its coroutines; the group runs on the rank's loop. Awaiting the
  // group's Futures moves the Task onto the group's loop thread, sleep_for onto the application's again:
  // calls made from either thread, a when_all over a tuple, and a cancel from the application's side
  // (the receive withdrawn, the group still usable).
  const long before = checks_made.load();
  run_ranks(3, [](Group& g) {
    Loop app;
    const int p = g.size();
    const int next = (g.rank() + 1) % p;
    const int prev = (g.rank() + p - 1) % p;
    auto step = [](Group& g, Loop& app, int round, int next, int prev) -> Task<float> {
      std::vector<float> x(round % 2 ? 3 : 3000, static_cast<float>(g.rank() + round));
      co_await g.all_reduce(x);  // from the application's thread; resumes on the group's loop
      std::vector<float> y(5, 1.0F);
      co_await g.all_reduce(y);  // from the group's loop thread
      co_await sleep_for(app, std::chrono::microseconds(round % 3 * 50));  // back on the application's
      std::vector<std::int32_t> mine{g.rank() * 100 + round}, got(1, -1);
      co_await when_all(g.send(mine, next, 7), g.recv(got, prev, 7));
      co_return x.back() + y.back() + static_cast<float>(got[0]);
    };
    for (int round = 0; round < 40; ++round) {
      const float got = sync_wait(app, step(g, app, round, next, prev));
      const float expected = static_cast<float>(p * (p - 1) / 2 + p * round) + static_cast<float>(p) + static_cast<float>(prev * 100 + round);
      check(got == expected, fmt::format("round {}: {} where {} was expected", round, got, expected));
    }
    // A receive that nothing sends, awaited on the application's loop and cancelled from its thread.
    std::vector<std::int32_t> never(1);
    auto waits = [](Group& g, std::vector<std::int32_t>& into, int from) -> Task<void> { co_await g.recv(into, from, 8); };
    Future<void> waiting = spawn(app, waits(g, never, prev));
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    waiting.cancel();
    check(ends_cancelled(waiting), "a receive cancelled from another loop's Task did not end cancelled");
    std::vector<float> last(4, 1.0F);
    sync_wait(app, [](Group& g, std::vector<float>& v) -> Task<void> { co_await g.all_reduce(v); }(g, last));
    check(last[0] == static_cast<float>(p), "the group after a cancelled receive gave the wrong sum");
  });
  CHECK(checks_made.load() - before == 3 * 42);
}

TEST_CASE("groups on borrowed loops of one io_context that a pool of threads runs", "[collectives][inflight]") {
  // A server whose io_context runs on a pool lends it to weft (Loop(io)): three ranks' loops borrow the
  // one io_context that four threads run, and the pool's coroutines await the groups' operations. Each
  // borrowed loop's handlers run one at a time (a strand): before, they ran at once on the pool's
  // threads and the process crashed or hung within a few rounds.
  const int p = 3;
  asio::io_context io;
  auto work = asio::make_work_guard(io);
  std::vector<std::thread> pool;
  for (int t = 0; t < 4; ++t) pool.emplace_back([&] { io.run(); });
  std::vector<std::unique_ptr<Loop>> loops;
  for (int r = 0; r < p; ++r) loops.push_back(std::make_unique<Loop>(io));
  const Options base = suite_options();
  std::vector<std::optional<Group>> groups(p);
  {
    std::vector<Future<Group>> made;
    for (int r = 0; r < p; ++r) {
      Options options = base;
      options.rank = r;
      options.world_size = p;
      made.push_back(Group::create(*loops[static_cast<std::size_t>(r)], options));
    }
    for (int r = 0; r < p; ++r) groups[static_cast<std::size_t>(r)].emplace(made[static_cast<std::size_t>(r)].get());
  }
  const int rounds = 60;
  std::atomic<int> good{0};
  std::vector<std::string> errors(p);
  std::latch finished(p);
  for (int r = 0; r < p; ++r) {
    asio::co_spawn(io, [&, r]() -> asio::awaitable<void> {
      Group& g = *groups[static_cast<std::size_t>(r)];
      const int next = (r + 1) % p;
      const int prev = (r + p - 1) % p;
      try {
        for (int round = 0; round < rounds; ++round) {
          std::vector<float> x(round % 2 ? 5 : 5000, static_cast<float>(r + round));
          co_await async_wait(g.all_reduce(x), asio::use_awaitable);
          std::vector<std::int32_t> mine{r * 100 + round}, got(1, -1);
          Future<void> receive = g.recv(got, prev, 3);
          co_await async_wait(g.send(mine, next, 3), asio::use_awaitable);
          co_await async_wait(std::move(receive), asio::use_awaitable);
          const float sum = static_cast<float>(p * (p - 1) / 2 + p * round);
          if (x.front() == sum && x.back() == sum && got[0] == prev * 100 + round) ++good;
        }
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
      finished.count_down();
    }, asio::detached);
  }
  finished.wait();
  for (int r = 0; r < p; ++r) CHECK(errors[static_cast<std::size_t>(r)] == "");
  CHECK(good.load() == p * rounds);
  // A receive that nothing sends, cancelled from a plain thread; the group still works after it.
  std::vector<std::int32_t> never(1);
  Future<void> waiting = groups[0]->recv(never, 1, 9);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  waiting.cancel();
  CHECK(ends_cancelled(waiting));
  std::vector<Future<void>> last;  // kept past the loops' end
  std::vector<std::vector<float>> ones(p, std::vector<float>(7, 1.0F));
  for (int r = 0; r < p; ++r) last.push_back(groups[static_cast<std::size_t>(r)]->all_reduce(ones[static_cast<std::size_t>(r)]));
  for (auto& f : last) f.get();
  for (int r = 0; r < p; ++r) CHECK(ones[static_cast<std::size_t>(r)][6] == static_cast<float>(p));
  // The groups and their loops end while the pool still runs the io_context: each loop's end runs on
  // its strand (it crashed in a transport's read handler that ran beside it on another thread).
  groups.clear();
  loops.clear();
  work.reset();
  for (auto& t : pool) t.join();
}

TEST_CASE("Futures of a group's operations kept past the end of its Loop", "[collectives][inflight]") {
  // A Future holds its operation, which holds the group's state: declared before the Loop, it outlives
  // it. The state's end posted to the freed loop and destroyed the store's server and the transport's
  // sockets after their io_context (a segmentation fault every run); the loop's end now lets them go.
  // A split group's Futures too, and a split group itself kept only by them.
  const Options base = suite_options();
  const int p = 3;
  std::vector<std::string> errors(p);
  std::vector<std::thread> ranks;
  for (int r = 0; r < p; ++r) {
    ranks.emplace_back([&, r] {
      try {
        std::vector<Future<void>> kept;
        std::vector<float> x(1000, 1.0F), y(3, 2.0F);
        {
          Loop loop(Loop::Options{std::chrono::microseconds(0), true});
          Options options = base;
          options.rank = r;
          options.world_size = p;
          Group g = Group::create(loop, options).get();
          kept.push_back(g.all_reduce(x));
          kept.push_back(g.barrier());
          Group half = g.split(r % 2, r).get();
          kept.push_back(half.all_reduce(y));
          for (auto& f : kept) f.get();
        }
        if (x[0] != static_cast<float>(p)) errors[static_cast<std::size_t>(r)] = "wrong sum " + std::to_string(x[0]);
        if (y[0] != 2.0F * static_cast<float>(r % 2 ? p / 2 : p - p / 2)) errors[static_cast<std::size_t>(r)] += " wrong half sum";
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < p; ++r) CHECK(errors[static_cast<std::size_t>(r)] == "");
}

TEST_CASE("point-to-point: to itself in either order, by tag, from a coroutine and from plain code", "[collectives][inflight]") {
  // A send completes when its bytes are out (to itself: delivered or kept), a receive when they arrived;
  // neither waits for a loop turn it does not need (the operation is its Future's state, p2p.cpp).
  const long before = checks_made.load();
  for (const int ranks : {1, 2}) {
    run_ranks(ranks, [](Group& g) {
      const int me = g.rank();
      // To itself: the receive first, then the send; then the send first (kept until received).
      std::vector<std::int32_t> out{me + 1, me + 2}, in(2);
      Future<void> r1 = g.recv(in, me, 1);
      g.send(out, me, 1).get();
      r1.get();
      check(in[0] == me + 1 && in[1] == me + 2, "a message to itself, receive posted first");
      std::fill(in.begin(), in.end(), 0);
      g.send(out, me, 2).get();
      g.recv(in, me, 2).get();
      check(in[0] == me + 1 && in[1] == me + 2, "a message to itself, sent first");
      if (g.size() < 2) return;
      // With a peer: tags 3 and 4 sent in one order, received in the other, from a coroutine on the loop.
      const int peer = 1 - me;
      std::vector<std::int32_t> three{30 + me}, four{40 + me}, got3(1), got4(1);
      sync_wait(g.loop(), [&]() -> Task<void> {
        Future<void> s3 = g.send(three, peer, 3);
        Future<void> s4 = g.send(four, peer, 4);
        co_await g.recv(got4, peer, 4);
        co_await g.recv(got3, peer, 3);
        co_await std::move(s3);
        co_await std::move(s4);
      }());
      check(got3[0] == 30 + peer && got4[0] == 40 + peer, "messages matched by tag");
      // A zero-byte message carries nothing and still matches.
      std::vector<std::int32_t> none;
      Future<void> s0 = g.send(none, peer, 5);
      g.recv(none, peer, 5).get();
      s0.get();
      // A burst of small messages on one tag, received once they are all out: one read brings many
      // frames (the transport handles up to 64 of them in a loop, then the rest from the loop's queue),
      // and they still meet their receives in the order they were sent.
      constexpr std::size_t burst = 200;
      std::vector<std::int32_t> sent(burst), got(burst, -1);
      std::vector<Future<void>> sends;
      for (std::size_t i = 0; i < burst; ++i) {
        sent[i] = 1000 * me + static_cast<std::int32_t>(i);
        sends.push_back(g.send(ConstBufferView(&sent[i], 1, DType::i32), peer, 6));
      }
      for (auto& s : sends) s.get();
      for (std::size_t i = 0; i < burst; ++i) g.recv(BufferView(&got[i], 1, DType::i32), peer, 6).get();
      bool in_order = true;
      for (std::size_t i = 0; i < burst; ++i) in_order = in_order && got[i] == 1000 * peer + static_cast<std::int32_t>(i);
      check(in_order, "a burst of 200 small messages on one tag arrived in the order sent");
      // Sizes around the reader's read-ahead buffer (16 KiB + 256; 4 KiB on shm, and 4 KiB after a frame
      // bigger than it), back to back so that one read holds the end of one frame and the start of the
      // next: first all sent before any receive (early messages), then every receive posted first.
      const std::vector<std::size_t> sizes{1, 4095, 4096, 4097, 16383, 16384, 16639, 16640, 16641, 70000, 3,
                                           20000, 5, 16384, 100000, 4096, 16640, 2, 9000};
      auto fill = [](std::vector<std::uint8_t>& v, std::size_t i, int from) {
        for (std::size_t b = 0; b < v.size(); ++b) v[b] = static_cast<std::uint8_t>(b * 7 + i * 13 + static_cast<std::size_t>(from) * 101);
      };
      for (const bool receives_first : {false, true}) {
        std::vector<std::vector<std::uint8_t>> outs(sizes.size()), ins(sizes.size());
        std::vector<Future<void>> ops;
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          outs[i].resize(sizes[i]);
          ins[i].assign(sizes[i], 0);
          fill(outs[i], i, me);
        }
        if (receives_first)
          for (std::size_t i = 0; i < sizes.size(); ++i) ops.push_back(g.recv(ins[i], peer, 7));
        for (std::size_t i = 0; i < sizes.size(); ++i) ops.push_back(g.send(outs[i], peer, 7));
        if (!receives_first) {
          for (auto& op : ops) op.get();
          ops.clear();
          for (std::size_t i = 0; i < sizes.size(); ++i) ops.push_back(g.recv(ins[i], peer, 7));
        }
        for (auto& op : ops) op.get();
        bool whole = true;
        for (std::size_t i = 0; i < sizes.size(); ++i) {
          std::vector<std::uint8_t> expected(sizes[i]);
          fill(expected, i, peer);
          whole = whole && ins[i] == expected;
        }
        check(whole, fmt::format("messages of sizes around the read-ahead buffer arrived whole ({})",
                                 receives_first ? "receives posted first" : "sent before their receives"));
      }
    });
  }
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a call of the shape called last skips the checks, and never one that would fail them", "[collectives][inflight]") {
  // detail::checked_algorithm remembers this thread's last call that passed, per group; a key too loose
  // would let through a root, a null buffer or a dtype that the checks refuse, or keep a choice that
  // override_algorithms has changed.
  detail::GroupState big;
  big.size = 4;
  big.rank = 1;
  detail::GroupState small;
  small.size = 2;
  std::vector<float> a(8), b(8);
  std::vector<std::int32_t> ints(8);
  const auto refused = [](detail::GroupState& g, const detail::CollectiveCall& call, const char* what) {
    try {
      detail::checked_algorithm(g, call);
    } catch (const Error& e) {
      REQUIRE(e.errc() == Errc::invalid_argument);
      REQUIRE_THAT(e.what(), Catch::Contains(what));
      return;
    }
    FAIL("accepted a call the checks refuse: " << what);
  };
  const detail::CollectiveCall broadcast{Collective::broadcast, ConstBufferView(a.data(), 8, DType::f32), BufferView(a.data(), 8, DType::f32),
                                         ReduceOp::sum, 3};
  const auto& chosen = detail::checked_algorithm(big, broadcast);
  REQUIRE(&chosen == big.selection.choose(Collective::broadcast, 32, 4));
  REQUIRE(&detail::checked_algorithm(big, broadcast) == &chosen);  // remembered
  refused(small, broadcast, "root 3 is not a rank");                 // another group: checked
  REQUIRE(&detail::checked_algorithm(big, broadcast) == &chosen);
  // The same counts and types with a null buffer, or another root, are other shapes.
  detail::CollectiveCall null_data = broadcast;
  null_data.out.data = nullptr;
  refused(big, null_data, "is null");
  detail::CollectiveCall bad_root = broadcast;
  bad_root.root = 4;
  refused(big, bad_root, "root 4 is not a rank");
  // all_reduce: an output of another type or count than the input's, after the matching call passed.
  const detail::CollectiveCall all_reduce{Collective::all_reduce, ConstBufferView(a.data(), 8, DType::f32), BufferView(b.data(), 8, DType::f32)};
  detail::checked_algorithm(big, all_reduce);
  detail::CollectiveCall other_type = all_reduce;
  other_type.out = BufferView(ints.data(), 8, DType::i32);
  refused(big, other_type, "input is f32 but output is i32");
  detail::CollectiveCall other_count = all_reduce;
  other_count.out.count = 7;
  refused(big, other_count, "expected 8");
  detail::checked_algorithm(big, all_reduce);
  detail::CollectiveCall undefined_op = all_reduce;  // the same but for the reduce op
  undefined_op.op = ReduceOp::bitwise_xor;
  refused(big, undefined_op, "is not defined on f32");
  // An override changes the answer for the remembered shape at once.
  REQUIRE(&detail::checked_algorithm(big, broadcast) == &chosen);
  big.selection.override_with(chosen.kind == algorithms::Kind::chain ? "broadcast:binomial" : "broadcast:chain", "the test");
  const auto& overridden = detail::checked_algorithm(big, broadcast);
  REQUIRE(&overridden != &chosen);
  REQUIRE(&overridden == big.selection.choose(Collective::broadcast, 32, 4));
}

TEST_CASE("a group builds each plan once per shape and never hands out another shape's", "[collectives][inflight]") {
  // GroupState::plan_for: the collectives' tasks and their plans of whole messages take their plans
  // from it; a wrong key would run another count's or root's plan on valid buffers.
  detail::GroupState g;
  g.size = 5;
  g.rank = 2;
  int built = 0;
  auto broadcast = [&](std::uint64_t count, int root) {
    return g.plan_for({Collective::broadcast, algorithms::Kind::binomial, count, root}, [&] {
      ++built;
      return algorithms::binomial_broadcast(g.size, g.rank, root, count);
    });
  };
  const auto first = broadcast(10, 0);
  REQUIRE(broadcast(10, 0) == first);
  REQUIRE(built == 1);
  REQUIRE(*broadcast(10, 1) == algorithms::binomial_broadcast(5, 2, 1, 10));
  REQUIRE(*broadcast(11, 0) == algorithms::binomial_broadcast(5, 2, 0, 11));
  const auto other_kind = g.plan_for({Collective::broadcast, algorithms::Kind::chain, 10, 0},
                                     [&] { ++built; return algorithms::chain_broadcast(5, 2, 0, 10); });
  REQUIRE(*other_kind == algorithms::chain_broadcast(5, 2, 0, 10));
  REQUIRE(built == 4);
  // Past the cache's size the oldest is built again; a plan handed out stays valid meanwhile.
  for (std::uint64_t count = 100; count < 110; ++count) broadcast(count, 0);
  const int before = built;
  REQUIRE(*broadcast(10, 0) == *first);
  REQUIRE(built == before + 1);
  // Callers on several threads, each checking what it got against a plan built on the spot.
  std::atomic<bool> all_right{true};
  std::vector<std::thread> callers;
  for (int t = 0; t < 4; ++t) {
    callers.emplace_back([&, t] {
      std::mt19937 rng(static_cast<unsigned>(t));
      for (int i = 0; i < 2000; ++i) {
        const std::uint64_t count = rng() % 12;
        const int root = static_cast<int>(rng() % 5);
        const auto plan = g.plan_for({Collective::broadcast, algorithms::Kind::binomial, count, root},
                                     [&] { return algorithms::binomial_broadcast(5, 2, root, count); });
        if (*plan != algorithms::binomial_broadcast(5, 2, root, count)) all_right = false;
      }
    });
  }
  for (auto& c : callers) c.join();
  REQUIRE(all_right);
}

TEST_CASE("split forms sub-groups whose collectives stay apart", "[collectives][split]") {
  const long before = checks_made.load();
  run_ranks(5, [](Group& g) {
    const int color = g.rank() % 2;
    Group sub = g.split(color, -g.rank()).get();  // key reverses the order
    const int expected_size = color == 0 ? 3 : 2;
    check(sub.size() == expected_size, fmt::format("sub-group size {}", sub.size()));
    std::vector<std::int64_t> v{g.rank()};
    sub.all_reduce(v).get();
    const std::int64_t expected = color == 0 ? 0 + 2 + 4 : 1 + 3;
    check(v[0] == expected, fmt::format("sub-group sum {}, expected {}", v[0], expected));
    std::vector<std::int32_t> ranks(static_cast<std::size_t>(sub.size()));
    std::vector<std::int32_t> me{g.rank()};
    sub.all_gather(me, ranks).get();
    check(std::is_sorted(ranks.rbegin(), ranks.rend()), "split did not order by key");
    // The parent still works, and a rank can leave with a negative color.
    Group none = g.split(g.rank() == 0 ? -1 : 0, 0).get();
    check(none.valid() == (g.rank() != 0), "negative color");
    std::vector<float> x{1.0f};
    g.all_reduce(x).get();
    check(x[0] == 5.0f, "parent group after split");
  });
  REQUIRE(checks_made.load() >= before + 5 * 5);
}

TEST_CASE("split and shrink keep the parent's algorithm selection", "[collectives][split]") {
  // Before the fix, split() gave the sub-group the built-in table (recursive doubling for 8 bytes)
  // while shrink() kept the parent's: both now derive the child the same way (child_of).
  Options base;
  base.algorithms = "all_reduce:ring;all_gather:bruck";
  const long before = checks_made.load();
  run_ranks(4, [](Group& g) {
    g.override_algorithms("broadcast:scatter_all_gather");
    const auto same_choices = [&](const Group& child, const char* how) {
      check(child.algorithm_for("all_reduce", 8) == "ring",
            fmt::format("{}: all_reduce of 8 bytes runs {}, not the parent's ring", how, child.algorithm_for("all_reduce", 8)));
      check(child.algorithm_for("all_gather", 64) == "bruck", fmt::format("{}: all_gather runs {}", how, child.algorithm_for("all_gather", 64)));
      check(child.algorithm_for("broadcast", 64) == "scatter_all_gather",
            fmt::format("{}: broadcast runs {}, not the override", how, child.algorithm_for("broadcast", 64)));
    };
    Group sub = g.split(g.rank() % 2, g.rank()).get();
    same_choices(sub, "split");
    std::vector<float> x{static_cast<float>(g.rank())};
    sub.all_reduce(x).get();
    check(x[0] == (g.rank() % 2 == 0 ? 2.0f : 4.0f), fmt::format("split group's ring all_reduce gave {}", x[0]));
    Group shrunk = g.shrink().get();
    same_choices(shrunk, "shrink");
  }, base);
  REQUIRE(checks_made.load() >= before + 4 * 7);
}

TEST_CASE("a message over 4 GiB arrives whole", "[collectives][large]") {
  constexpr std::size_t bytes = (std::size_t{1} << 32) + 16;
  const std::size_t marks[] = {0, (std::size_t{1} << 31) + 3, (std::size_t{1} << 32) - 1, std::size_t{1} << 32, bytes - 1};
  const long before = checks_made.load();
  run_ranks(2, [&](Group& g) {
    // The copies fault every page in, and on this VM 2M faults of 4 KiB pages cost 40 s of system time
    // (the whole test took 41 s). So: transparent huge pages where the kernel has them, and a sender's
    // buffer that is read-only but for the pages of its marks (its reads map the zero page).
    const int protection = g.rank() == 0 ? PROT_READ : PROT_READ | PROT_WRITE;
    void* const mapped = ::mmap(nullptr, bytes, protection, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    check(mapped != MAP_FAILED, "mmap of the 4 GiB buffer");
    ::madvise(mapped, bytes, MADV_HUGEPAGE);
    const std::shared_ptr<void> unmap(mapped, [n = bytes](void* p) { ::munmap(p, n); });
    auto* const buffer = static_cast<std::uint8_t*>(mapped);
    if (g.rank() == 0) {
      const auto page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
      for (std::size_t m : marks) {
        check(::mprotect(buffer + m / page * page, page, PROT_READ | PROT_WRITE) == 0, "mprotect of a mark's page");
        buffer[m] = static_cast<std::uint8_t>(0xa0 + (m % 7));
      }
      g.send(ConstBufferView(buffer, bytes, DType::u8), 1, 1).get();
    } else {
      for (std::size_t m : marks) buffer[m] = 0;
      g.recv(BufferView(buffer, bytes, DType::u8), 0, 1).get();
      for (std::size_t m : marks) check(buffer[m] == static_cast<std::uint8_t>(0xa0 + (m % 7)), fmt::format("byte {} of the 4 GiB message", m));
    }
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("every all_reduce algorithm matches the reference", "[collectives][algorithms]") {
  REQUIRE(algorithms::available_algorithms("all_reduce").size() == 6);
  for (std::string_view algorithm : algorithms::available_algorithms("all_reduce")) {
    for (int p : {1, 2, 3, 4, 5, 8}) {
      Options options;
      options.algorithms = "all_reduce:" + std::string(algorithm);
      const long before = checks_made.load();
      run_ranks(p, [&](Group& g) {
        check(g.algorithm_for("all_reduce", 1 << 20) == algorithm, "the override was not taken");
        for (DType t : {DType::f32, DType::i64, DType::bf16, DType::u8}) {
          for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::prod, ReduceOp::bitwise_xor, ReduceOp::avg}) {
            if (!is_defined(t, op)) continue;
            for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4099}, std::size_t{300000}}) {
              const auto expected = make_reduced(t, op, g.size(), count);
              auto in = make_input(t, op, g.rank(), count);
              std::vector<std::byte> out(in.size());
              g.all_reduce(ConstBufferView(in.data(), count, t), BufferView(out.data(), count, t), op).get();
              auto diff = compare(t, out.data(), expected.data(), count);
              check(diff.empty(), std::string(algorithm) + " " + where("all_reduce", t, op, count, false) + diff);
              g.all_reduce(BufferView(in.data(), count, t), op).get();
              diff = compare(t, in.data(), expected.data(), count);
              check(diff.empty(), std::string(algorithm) + " " + where("all_reduce", t, op, count, true) + diff);
            }
          }
        }
      }, options);
      REQUIRE(checks_made.load() > before);
    }
  }
}

namespace {

// Floats whose sums depend on the order of addition: mixed magnitudes from a seeded generator.
// The same bits (memcmp on empty vectors would pass it a null pointer: UBSan says so).
bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

std::vector<float> messy_floats(int rank, std::size_t n) {
  std::vector<float> v(n);
  std::uint64_t x = 0x9e3779b97f4a7c15ull * static_cast<std::uint64_t>(rank + 1);
  for (auto& f : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const int exponent = static_cast<int>(x % 40) - 20;
    f = std::ldexp(static_cast<float>((x >> 20) % 100000) / 100000.0f - 0.5f, exponent);
  }
  return v;
}

std::uint64_t fingerprint(const void* data, std::size_t bytes) {
  std::uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace

TEST_CASE("every rank receives bitwise identical all_reduce results, for every algorithm", "[collectives][bitwise]") {
  for (std::string_view algorithm : algorithms::available_algorithms("all_reduce")) {
    Options options;
    options.algorithms = "all_reduce:" + std::string(algorithm);
    const long before = checks_made.load();
    run_ranks(5, [&](Group& g) {
      for (std::size_t n : {std::size_t{1}, std::size_t{1000}, std::size_t{100003}}) {
        auto v = messy_floats(g.rank(), n);
        g.all_reduce(v).get();
        std::vector<std::uint64_t> mine{fingerprint(v.data(), v.size() * sizeof(float))};
        std::vector<std::uint64_t> all(static_cast<std::size_t>(g.size()));
        g.all_gather(mine, all).get();
        for (auto h : all) check(h == all[0], fmt::format("{}: ranks hold different bits for {} elements", algorithm, n));
      }
    }, options);
    REQUIRE(checks_made.load() > before);
  }
}

TEST_CASE("deterministic mode reduces in rank order, the same for every algorithm and segment size", "[collectives][deterministic]") {
  const int p = 5;
  for (std::size_t segment : {std::size_t{1024}, std::size_t{256 * 1024}}) {
    for (const char* algorithm : {"ring", "recursive_doubling", "tree"}) {
      Options options;
      options.deterministic = true;
      options.segment_bytes = segment;
      options.algorithms = "all_reduce:" + std::string(algorithm);
      const long before = checks_made.load();
      run_ranks(p, [&](Group& g) {
        for (std::size_t n : {std::size_t{0}, std::size_t{3}, std::size_t{1001}, std::size_t{70001}}) {
          // The reference: ((x0 + x1) + x2) + ... in float, element by element.
          std::vector<float> expected = messy_floats(0, n);
          for (int r = 1; r < p; ++r) {
            const auto x = messy_floats(r, n);
            for (std::size_t i = 0; i < n; ++i) expected[i] = expected[i] + x[i];
          }
          auto v = messy_floats(g.rank(), n);
          std::vector<float> out(n);
          g.all_reduce(v, out).get();
          check(bitwise_equal(out, expected),
                fmt::format("deterministic all_reduce ({}, segment {}) differs from the rank-order sum, {} elements", algorithm, segment, n));
          g.all_reduce(BufferView(v)).get();
          check(bitwise_equal(v, expected), "deterministic all_reduce in place");
          // reduce_scatter and reduce follow the same order.
          std::vector<float> all;
          for (int b = 0; b < p; ++b) {
            auto part = messy_floats(g.rank() * 7 + b, n);
            all.insert(all.end(), part.begin(), part.end());
          }
          std::vector<float> block(n);
          g.reduce_scatter(all, block).get();
          std::vector<float> want = messy_floats(0 * 7 + g.rank(), n);
          for (int r = 1; r < p; ++r) {
            const auto x = messy_floats(r * 7 + g.rank(), n);
            for (std::size_t i = 0; i < n; ++i) want[i] = want[i] + x[i];
          }
          check(bitwise_equal(block, want), "deterministic reduce_scatter");
          auto mine = messy_floats(g.rank(), n);
          std::vector<float> at_root(g.rank() == 2 ? n : 0);
          g.reduce(mine, at_root, 2).get();
          if (g.rank() == 2) check(bitwise_equal(at_root, expected), "deterministic reduce");
        }
      }, options);
      REQUIRE(checks_made.load() > before);
    }
  }
}

TEST_CASE("each collective's transpose passes the dot-product test across ranks", "[collectives][transpose]") {
  // <A x, y> == <x, A^T y>, each inner product summed over ranks; integer-valued doubles keep it exact.
  const long before = checks_made.load();
  run_ranks(4, [](Group& g) {
    const int p = g.size();
    const int r = g.rank();
    const std::size_t n = 6;
    auto vec = [&](int salt, std::size_t len) {
      std::vector<double> v(len);
      for (std::size_t i = 0; i < len; ++i) v[i] = static_cast<double>(((r + 3) * (salt + 5) * 31 + static_cast<int>(i) * 17) % 23) - 11;
      return v;
    };
    auto dot = [&](const std::vector<double>& a, const std::vector<double>& b) {
      double s = 0;
      for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
      std::vector<double> total{s};
      g.all_reduce(total).get();
      return total[0];
    };
    const std::size_t pn = n * static_cast<std::size_t>(p);
    const int root = 2;
    const std::vector<std::pair<int, int>> pairs{{0, 3}, {3, 1}, {1, 2}};  // rank 2 sends nowhere, rank 0 gets zeros
    for (Collective c : {Collective::all_reduce, Collective::all_gather, Collective::reduce_scatter, Collective::broadcast,
                         Collective::reduce, Collective::gather, Collective::scatter, Collective::all_to_all,
                         Collective::permute}) {
      // Input and output lengths of c on this rank.
      std::size_t in_len = n, out_len = n;
      if (c == Collective::all_gather) out_len = pn;
      if (c == Collective::reduce_scatter) in_len = pn;
      if (c == Collective::reduce) out_len = r == root ? n : 0;
      if (c == Collective::gather) out_len = r == root ? pn : 0;
      if (c == Collective::scatter) in_len = r == root ? pn : 0;
      if (c == Collective::all_to_all) in_len = out_len = pn;
      const auto x = vec(1 + static_cast<int>(c), in_len);
      const auto y = vec(20 + static_cast<int>(c), out_len);
      std::vector<double> ax(out_len);
      switch (c) {
        case Collective::all_reduce: g.all_reduce(x, ax).get(); break;
        case Collective::all_gather: g.all_gather(x, ax).get(); break;
        case Collective::reduce_scatter: g.reduce_scatter(x, ax).get(); break;
        case Collective::broadcast: {
          ax = x;
          g.broadcast(ax, root).get();
          break;
        }
        case Collective::reduce: g.reduce(x, ax, root).get(); break;
        case Collective::gather: g.gather(x, ax, root).get(); break;
        case Collective::scatter: g.scatter(x, ax, root).get(); break;
        case Collective::all_to_all: g.all_to_all(x, ax).get(); break;
        case Collective::permute: g.permute(x, ax, pairs).get(); break;
        case Collective::barrier:
        case Collective::split: break;  // not linear maps of a buffer: not in the list above
        case Collective::all_gatherv:
        case Collective::gatherv:
        case Collective::scatterv:
        case Collective::all_to_allv:
        case Collective::reduce_scatterv: break;  // their transposes need the counts: "variable" below
      }
      std::vector<double> aty(in_len);
      apply_transpose(g, c, ConstBufferView(y), BufferView(aty), ReduceOp::sum, root, pairs).get();
      const double left = dot(ax, y);
      const double right = dot(x, aty);
      check(left == right, fmt::format("{}: <Ax, y> = {} but <x, A^T y> = {}", to_string(c), left, right));
      check(transpose_of(transpose_of(c)) == c, fmt::format("{}: the transpose of the transpose", to_string(c)));
    }
    try {
      (void)apply_transpose(g, Collective::all_reduce, ConstBufferView(vec(0, n)), BufferView(nullptr, 0, DType::f64), ReduceOp::max);
      check(false, "the transpose of a max all_reduce was accepted");
    } catch (const Error& e) {
      check(e.errc() == Errc::invalid_argument, e.what());
    }
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("every all_gather, broadcast, reduce, reduce_scatter, all_to_all, gather and scatter algorithm matches the reference", "[collectives][algorithms2]") {
  const char* specs[] = {"all_gather:bruck;broadcast:scatter_all_gather;reduce:reduce_scatter_gather;all_to_all:bruck;"
                         "reduce_scatter:recursive_halving;gather:binomial;scatter:binomial",
                         "all_gather:ring;broadcast:binomial;reduce:binomial;all_to_all:pairwise;reduce_scatter:ring;"
                         "gather:direct;scatter:direct",
                         "all_gather:recursive_doubling;broadcast:chain",
                         // The direct shm algorithms: on the group arena over WEFT_TRANSPORT=shm, the built-in
                         // framed choice elsewhere (no arena).
                         "all_gather:shm;broadcast:shm;all_to_all:shm;reduce_scatter:shm"};
  for (const char* spec : specs) {
    for (int p : {1, 2, 3, 4, 5, 8}) {
      Options options;
      options.algorithms = spec;
      const long before = checks_made.load();
      run_ranks(p, [&](Group& g) {
        for (DType t : {DType::f32, DType::i16, DType::f16}) {
          for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{4099}, std::size_t{200003}}) {
            movements(g, t, count);
            reductions(g, t, count > 5000 ? 4099 : count);
            for (ReduceOp op : {ReduceOp::sum, ReduceOp::min}) {
              const int root = static_cast<int>(count % static_cast<std::size_t>(g.size()));
              auto in = make_input(t, op, g.rank(), count);
              std::vector<std::byte> out(g.rank() == root ? in.size() : 0);
              g.reduce(ConstBufferView(in.data(), count, t), BufferView(out.data(), g.rank() == root ? count : 0, t), root, op).get();
              if (g.rank() == root) {
                const auto diff = compare(t, out.data(), make_reduced(t, op, g.size(), count).data(), count);
                check(diff.empty(), std::string(spec) + " " + where("reduce", t, op, count, false) + diff);
              }
            }
          }
        }
      }, options);
      REQUIRE(checks_made.load() > before);
    }
  }
}

TEST_CASE("random sequences of collectives, algorithms, dtypes, ops, counts and roots, many in flight", "[collectives][property]") {
  const char* collectives[] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "gather", "scatter"};
  for (int p : {3, 4, 5}) {
    const long before = checks_made.load();
    run_ranks(p, [&](Group& g) {
      std::uint64_t seed = 12345 + static_cast<std::uint64_t>(p);  // the same sequence on every rank
      auto next = [&](std::uint64_t bound) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        return (seed >> 33) % bound;
      };
      struct Pending {
        Future<void> done;
        std::vector<std::byte> in, out, expected;
        std::string what;
        DType type;
        std::size_t count;
        bool check_out = true;
      };
      for (int batch = 0; batch < 12; ++batch) {
        std::vector<std::unique_ptr<Pending>> pending;
        for (int k = 0; k < 12; ++k) {
          const std::string collective = collectives[next(std::size(collectives))];
          const auto& algos = algorithms::available_algorithms(collective);
          const std::string algorithm(algos[next(algos.size())]);
          g.override_algorithms(collective + ":" + algorithm);
          const DType t = all_dtypes[next(std::size(all_dtypes))];
          ReduceOp op = all_reduce_ops[next(std::size(all_reduce_ops))];
          while (!is_defined(t, op)) op = all_reduce_ops[next(std::size(all_reduce_ops))];
          const std::size_t counts[] = {0, 1, 2, 5, 17, 1000, 4099, 30001};
          const std::size_t count = counts[next(std::size(counts))];
          const int root = static_cast<int>(next(static_cast<std::uint64_t>(p)));
          const std::size_t salt = next(1000);
          auto job = std::make_unique<Pending>();
          job->type = t;
          job->what = fmt::format("batch {} #{}: {}/{} {} {} x {} root {}", batch, k, collective, algorithm, to_string(t), to_string(op), count, root);
          const std::size_t esize = dtype_size(t);
          const auto pn = static_cast<std::size_t>(p);
          if (collective == "all_reduce") {
            job->in = make_input(t, op, g.rank(), count, salt);
            job->out.resize(job->in.size());
            job->expected = make_reduced(t, op, p, count, salt);
            job->count = count;
            job->done = g.all_reduce(ConstBufferView(job->in.data(), count, t), BufferView(job->out.data(), count, t), op);
          } else if (collective == "all_gather") {
            job->in = make_input(t, ReduceOp::sum, g.rank(), count, salt);
            job->out.resize(count * esize * pn);
            for (int b = 0; b < p; ++b) {
              auto part = make_input(t, ReduceOp::sum, b, count, salt);
              job->expected.insert(job->expected.end(), part.begin(), part.end());
            }
            job->count = count * pn;
            job->done = g.all_gather(ConstBufferView(job->in.data(), count, t), BufferView(job->out.data(), count * pn, t));
          } else if (collective == "reduce_scatter") {
            for (int b = 0; b < p; ++b) {
              auto part = make_input(t, op, g.rank(), count, salt + static_cast<std::size_t>(b) * 13);
              job->in.insert(job->in.end(), part.begin(), part.end());
            }
            job->out.resize(count * esize);
            job->expected = make_reduced(t, op, p, count, salt + static_cast<std::size_t>(g.rank()) * 13);
            job->count = count;
            job->done = g.reduce_scatter(ConstBufferView(job->in.data(), count * pn, t), BufferView(job->out.data(), count, t), op);
          } else if (collective == "broadcast") {
            job->out = g.rank() == root ? make_input(t, ReduceOp::sum, root, count, salt) : std::vector<std::byte>(count * esize);
            job->expected = make_input(t, ReduceOp::sum, root, count, salt);
            job->count = count;
            job->done = g.broadcast(BufferView(job->out.data(), count, t), root);
          } else if (collective == "reduce") {
            job->in = make_input(t, op, g.rank(), count, salt);
            job->out.resize(g.rank() == root ? job->in.size() : 0);
            job->expected = make_reduced(t, op, p, count, salt);
            job->count = count;
            job->check_out = g.rank() == root;
            job->done = g.reduce(ConstBufferView(job->in.data(), count, t), BufferView(job->out.data(), g.rank() == root ? count : 0, t), root, op);
          } else if (collective == "gather") {
            job->in = make_input(t, ReduceOp::sum, g.rank(), count, salt);
            for (int b = 0; b < p; ++b) {
              auto part = make_input(t, ReduceOp::sum, b, count, salt);
              job->expected.insert(job->expected.end(), part.begin(), part.end());
            }
            job->out.resize(g.rank() == root ? count * esize * pn : 0);
            job->count = count * pn;
            job->check_out = g.rank() == root;
            job->done = g.gather(ConstBufferView(job->in.data(), count, t), BufferView(job->out.data(), g.rank() == root ? count * pn : 0, t), root);
          } else if (collective == "scatter") {
            if (g.rank() == root) {
              for (int b = 0; b < p; ++b) {
                auto part = make_input(t, ReduceOp::sum, b, count, salt + 7);
                job->in.insert(job->in.end(), part.begin(), part.end());
              }
            }
            job->expected = make_input(t, ReduceOp::sum, g.rank(), count, salt + 7);
            job->out.resize(count * esize);
            job->count = count;
            job->done = g.scatter(ConstBufferView(job->in.data(), g.rank() == root ? count * pn : 0, t), BufferView(job->out.data(), count, t), root);
          } else {  // all_to_all
            for (int j = 0; j < p; ++j) {
              auto part = make_input(t, ReduceOp::sum, g.rank(), count, salt + static_cast<std::size_t>(j) * 31);
              job->in.insert(job->in.end(), part.begin(), part.end());
            }
            for (int i = 0; i < p; ++i) {
              auto part = make_input(t, ReduceOp::sum, i, count, salt + static_cast<std::size_t>(g.rank()) * 31);
              job->expected.insert(job->expected.end(), part.begin(), part.end());
            }
            job->out.resize(job->in.size());
            job->count = count * pn;
            job->done = g.all_to_all(ConstBufferView(job->in.data(), count * pn, t), BufferView(job->out.data(), count * pn, t));
          }
          pending.push_back(std::move(job));
        }
        for (auto& job : pending) {
          job->done.get();
          if (!job->check_out) continue;
          const auto diff = compare(job->type, job->out.data(), job->expected.data(), job->count);
          check(diff.empty(), job->what + ": " + diff);
        }
      }
    });
    REQUIRE(checks_made.load() > before);
  }
}

TEST_CASE("a collective completes on the loop while its caller computes", "[collectives][drive]") {
  // Rank 0's thread drives the loop for 2 ms (so over uring it submits the all_reduce's send and receive
  // itself), then computes without a system call while rank 1 rests 30 ms. The loop's own thread, asleep
  // in the kernel by then, must be woken when the message lands: over uring the caller's task work posts
  // the CQE at its next tick and the ring's eventfd wakes the loop. What this catches is a loop never
  // woken; a late wake it does not: the group's watchdog timer (every 50-250 ms while operations are in
  // flight) ends such a sleep too (an eventfd left silent, tried: 50-144 ms instead of 30).
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    for (int round = 0; round < 6; ++round) {
      std::vector<float> sums(round % 2 ? 3000 : 5, static_cast<float>(g.rank() + round));
      if (g.rank() == 1) {
        std::this_thread::sleep_for(std::chrono::milliseconds(30));
        g.all_reduce(sums).get();
      } else {
        Future<void> f = g.all_reduce(sums);
        const auto start = std::chrono::steady_clock::now();
        g.loop().drive_until([&] { return f.ready() || std::chrono::steady_clock::now() - start > std::chrono::milliseconds(2); });
        const auto computed_until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
        while (!f.ready() && std::chrono::steady_clock::now() < computed_until) {
        }
        check(f.ready(), fmt::format("round {}: the all_reduce was not done 1 s after its caller began to compute", round));
        f.get();
      }
      check(sums.back() == static_cast<float>(1 + 2 * round), fmt::format("round {}: all_reduce gave {}", round, sums.back()));
    }
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("with progress on the loop's own thread only, collectives behave the same", "[collectives][drive]") {
  harness_caller_drives = false;
  struct Reset {
    ~Reset() { harness_caller_drives = true; }
  } reset;
  matrix(3);
  const long before = checks_made.load();
  run_ranks(4, [](Group& g) {
    std::vector<std::vector<float>> sums(8, std::vector<float>(3000, static_cast<float>(g.rank())));
    std::vector<Future<void>> futures;
    for (auto& s : sums) futures.push_back(g.all_reduce(s));
    for (auto& f : futures) f.get();
    for (auto& s : sums) check(s[2999] == 6.0f, "all_reduce in flight, progress thread only");
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a send buffer overwritten right after its send completes does not change what arrives", "[collectives][reuse]") {
  // Zero-copy sends on every size from 64 KiB, loopback included (off there by default): the send may
  // complete only once the kernel has let go of the pages (io_uring's notification), whatever the
  // transport.
  setenv("WEFT_URING_ZC_BYTES", "65536", 1);
  struct Unset {
    ~Unset() { unsetenv("WEFT_URING_ZC_BYTES"); }
  } unset;
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    constexpr std::size_t n = 1 << 20;  // 4 MiB of u32
    std::vector<std::uint32_t> buffer(n);
    for (std::uint32_t round = 0; round < 12; ++round) {
      if (g.rank() == 0) {
        for (std::size_t i = 0; i < n; ++i) buffer[i] = round * 7919u + static_cast<std::uint32_t>(i);
        g.send(ConstBufferView(buffer.data(), n, DType::u32), 1, round).get();
        std::fill(buffer.begin(), buffer.end(), 0xdeadbeefu);  // reused at once
      } else {
        // Receive late, so that the message is still on its way when the sender reuses its buffer.
        std::this_thread::sleep_for(std::chrono::milliseconds(3));
        g.recv(BufferView(buffer.data(), n, DType::u32), 0, round).get();
        std::size_t wrong = 0;
        for (std::size_t i = 0; i < n; ++i) wrong += buffer[i] != round * 7919u + static_cast<std::uint32_t>(i);
        check(wrong == 0, fmt::format("round {}: {} of {} elements changed after the send completed", round, wrong, n));
      }
    }
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a receiver behind its sender gets every small message whole and in order, whatever it posted before", "[collectives][reuse]") {
  // Over shm a receive whose message is already in the ring takes it, and the messages of the receives
  // of its key posted before (at most 7), straight from the ring (Transport::recv_now); with more posted
  // before it leaves them to the loop. Block after block, the receiver posts 0 to 9 receives while the
  // ring is empty, then holds its loop while the sender sends the block, and makes the block's other
  // receives from the loop's own thread before letting it go (so that the messages are still in the
  // ring then): every message must reach its own receive, in order, with the bytes of its send.
  const long before = checks_made.load();
  constexpr int blocks = 36;
  constexpr int block = 12;
  std::atomic<int> go{0}, sent{0};
  const auto wait_for = [](std::atomic<int>& counter, int at_least) {
    while (counter.load() < at_least) std::this_thread::yield();
  };
  run_ranks(2, [&](Group& g) {
    const auto size_of = [](int i) { return static_cast<std::size_t>(1 + i % 29); };
    const auto byte_of = [](int i, std::size_t j) { return static_cast<std::uint8_t>(i * 37 + j * 11 + 5); };
    if (g.rank() == 0) {
      std::vector<std::uint8_t> buffer(32);
      for (int b = 0; b < blocks; ++b) {
        wait_for(go, b + 1);
        for (int i = b * block; i < (b + 1) * block; ++i) {
          const std::size_t n = size_of(i);
          for (std::size_t j = 0; j < n; ++j) buffer[j] = byte_of(i, j);
          g.send(ConstBufferView(buffer.data(), n, DType::u8), 1, 3).get();
          std::fill_n(buffer.begin(), n, std::uint8_t{0xee});
        }
        sent.store(b + 1);
      }
    } else {
      std::vector<std::vector<std::uint8_t>> in(blocks * block);
      const auto receive = [&](int i) {
        in[static_cast<std::size_t>(i)].assign(size_of(i), 0);
        return g.recv(BufferView(in[static_cast<std::size_t>(i)].data(), size_of(i), DType::u8), 0, 3);
      };
      for (int b = 0; b < blocks; ++b) {
        const int first = b * block;
        const int posted = std::array{0, 1, 3, 7, 8, 9}[static_cast<std::size_t>(b) % 6];
        std::vector<Future<void>> futures;
        for (int i = first; i < first + posted; ++i) futures.push_back(receive(i));  // before their messages
        std::promise<void> held, made;
        g.loop().post([&] {
          held.set_value();
          wait_for(sent, b + 1);  // the loop's thread: nothing reads the ring meanwhile
          for (int i = first + posted; i < first + block; ++i) futures.push_back(receive(i));
          made.set_value();
        });
        held.get_future().wait();
        go.store(b + 1);
        made.get_future().wait();
        for (auto& f : futures) f.get();
      }
      for (int i = 0; i < blocks * block; ++i) {
        std::size_t wrong = 0;
        for (std::size_t j = 0; j < size_of(i); ++j) wrong += in[static_cast<std::size_t>(i)][j] != byte_of(i, j) ? 1 : 0;
        check(wrong == 0, fmt::format("message {}: {} of {} bytes wrong", i, wrong, size_of(i)));
      }
    }
    g.barrier().get();
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("small sends to a rank that does not read yet arrive whole and in order, their buffers reused at once", "[collectives][reuse]") {
  // Over tcp a small send on an idle connection goes straight to the socket (Transport::send_now); a
  // socket buffer that is nearly full takes part of its frame, and the rest is copied and written after
  // it, the send already done. The receiver's loop is held first, so that the buffers fill: every
  // message must still arrive whole and in order, with the bytes it had when its send completed, though
  // each send's buffer is overwritten at once. (Its loop, not only its thread: a loop left to run reads
  // every frame into early-message buffers, and on a fast machine it kept up with the sender, so that no
  // socket ever filled; seen on an Intel Xeon, 2026-12-02.)
  const long before = checks_made.load();
  std::atomic<std::uint64_t> kept{0};
  std::string transport;
  std::latch receiver_held(1);
  run_ranks(2, [&](Group& g) {
    constexpr int messages = 1200;  // about 34 MB: more than loopback's socket buffers hold
    const auto size_of = [](int i) { return std::size_t{4096} + static_cast<std::size_t>(i % 7) * 8191; };
    const auto byte_of = [](int i, std::size_t j) { return static_cast<std::uint8_t>(i * 131 + j * 7 + (j >> 9)); };
    std::vector<std::uint8_t> buffer(size_of(6));
    if (g.rank() == 0) {
      transport = std::string(g.transport_name());
      receiver_held.wait();
      for (int i = 0; i < messages; ++i) {
        const std::size_t n = size_of(i);
        for (std::size_t j = 0; j < n; ++j) buffer[j] = byte_of(i, j);
        g.send(ConstBufferView(buffer.data(), n, DType::u8), 1, static_cast<std::uint32_t>(i)).get();
        std::fill_n(buffer.begin(), n, std::uint8_t{0xee});
      }
      if (auto* framed = dynamic_cast<FramedTransport*>(g.state()->transport.get())) kept = framed->sends_partly_kept();
    } else {
      std::promise<void> held;
      g.loop().post([&] {
        held.set_value();
        std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the loop's thread: nothing reads
      });
      held.get_future().wait();
      receiver_held.count_down();
      for (int i = 0; i < messages; ++i) {
        const std::size_t n = size_of(i);
        g.recv(BufferView(buffer.data(), n, DType::u8), 0, static_cast<std::uint32_t>(i)).get();
        std::size_t wrong = 0;
        for (std::size_t j = 0; j < n; ++j) wrong += buffer[j] != byte_of(i, j) ? 1 : 0;
        check(wrong == 0, fmt::format("message {}: {} of {} bytes wrong", i, wrong, n));
      }
    }
    g.barrier().get();
  });
  REQUIRE(checks_made.load() > before);
  // Over tcp the full buffers made some send keep the rest of its frame: the path was taken.
  if (transport == "tcp") CHECK(kept.load() > 0);
}

TEST_CASE("ranks that finish their last collective first and leave at once fail nobody", "[collectives][leave]") {
  // A rank whose part of the last collective is done closes its Group while the others still take in
  // what it sent: its goodbye, its closed socket and its last completions race with their reads. Many
  // short groups, every all_reduce algorithm, small and large, so that the end comes at every moment.
  const long before = checks_made.load();
  for (std::string_view algorithm : algorithms::available_algorithms("all_reduce")) {
    for (int p : {2, 3, 4}) {
      for (std::size_t count : {std::size_t{1}, std::size_t{300000}}) {
        for (int round = 0; round < 4; ++round) {
          Options options;
          options.algorithms = "all_reduce:" + std::string(algorithm);
          INFO(algorithm << " p=" << p << " count=" << count << " round " << round);
          run_ranks(p, [&](Group& g) {
            std::vector<std::uint8_t> v(count, static_cast<std::uint8_t>(g.rank() + 1));
            g.all_reduce(BufferView(v.data(), count, DType::u8), ReduceOp::sum).get();
            const auto want = static_cast<std::uint8_t>(p * (p + 1) / 2);
            check(v.front() == want && v.back() == want,
                  fmt::format("{} p={} count={}: {} and {}, expected {}", algorithm, p, count, v.front(), v.back(), want));
          }, options);
        }
      }
    }
  }
  REQUIRE(checks_made.load() > before);
}

namespace {

// Staged buffers as device staging makes them, without a device: the "copy in" lands a piece only when
// the plan first waits for it (after a random pause on the loop), and until then the piece holds junk;
// each range reported finished is remembered with its bytes at that moment.
class JunkUntilLanded final : public algorithms::StagedBuffers {
 public:
  JunkUntilLanded(Loop& loop, std::byte* buffer, std::vector<std::byte> contents, std::size_t piece, unsigned seed)
      : loop_(loop), buffer_(buffer), contents_(std::move(contents)), piece_(piece), random_(seed) {
    landed_.assign((contents_.size() + piece_ - 1) / piece_, false);
    std::fill(buffer_, buffer_ + contents_.size(), std::byte{0xa5});
  }
  /// Where the receive buffer is `recv` (`bytes` long): what finished() reports is checked against it.
  void watch_output(std::byte* recv, std::size_t bytes) {
    out_ = recv;
    final_.assign(bytes, std::nullopt);
  }

  bool ready(const std::byte* lo, const std::byte* hi) override {
    auto [a, b] = pieces_of(lo, hi);
    for (std::size_t k = a; k < b; ++k) {
      if (!landed_[k]) return false;
    }
    return true;
  }
  Task<void> until_ready(const std::byte* lo, const std::byte* hi) override {
    auto [a, b] = pieces_of(lo, hi);
    for (std::size_t k = a; k < b; ++k) {
      if (landed_[k]) continue;
      co_await sleep_for(loop_, std::chrono::microseconds(random_() % 300));
      if (landed_[k]) continue;
      const std::size_t at = k * piece_;
      std::memcpy(buffer_ + at, contents_.data() + at, std::min(piece_, contents_.size() - at));
      landed_[k] = true;
    }
  }
  void finished(std::byte* lo, std::byte* hi) override {
    for (std::byte* b = lo; b < hi; ++b) {
      auto& seen = final_.at(static_cast<std::size_t>(b - out_));
      if (seen) twice_ = true;
      seen = *b;
    }
  }

  /// What is wrong with the reports: a byte reported twice, a byte written after it was reported, or
  /// (with `all`) a byte never reported.
  std::string problems(bool all) const {
    if (twice_) return "a range was reported finished twice";
    for (std::size_t i = 0; i < final_.size(); ++i) {
      if (final_[i] && *final_[i] != out_[i]) return fmt::format("byte {} changed after it was reported finished", i);
      if (all && !final_[i]) return fmt::format("byte {} of {} was never reported finished", i, final_.size());
    }
    return {};
  }

 private:
  std::pair<std::size_t, std::size_t> pieces_of(const std::byte* lo, const std::byte* hi) const {
    const std::byte* end = buffer_ + contents_.size();
    if (hi <= buffer_ || lo >= end || lo >= hi) return {0, 0};
    const auto from = static_cast<std::size_t>(std::max(lo, static_cast<const std::byte*>(buffer_)) - buffer_);
    const auto to = static_cast<std::size_t>(std::min(hi, end) - buffer_);
    return {from / piece_, (to + piece_ - 1) / piece_};
  }

  Loop& loop_;
  std::byte* buffer_;
  std::vector<std::byte> contents_;
  std::size_t piece_;
  std::minstd_rand random_;
  std::vector<bool> landed_;
  std::byte* out_ = nullptr;
  std::vector<std::optional<std::byte>> final_;
  bool twice_ = false;
};

}  // namespace

TEST_CASE("a plan over staged buffers touches no byte before it landed and none after it was finished", "[collectives][staged]") {
  // The executor's side of device staging (algorithms::StagedBuffers): if a plan read a piece before it
  // landed, junk would reach the result; if it wrote one before, the landing would overwrite it; if a
  // range reported finished were written again, its bytes would differ from the end's. Ring and
  // bidirectional ring all_reduce (in and out of place), recursive doubling (every range written
  // several times), and both broadcasts; small segments and pieces so that every step spans several.
  namespace algo = weft::algorithms;
  const long before = checks_made.load();
  Options options;
  options.segment_bytes = 1024;
  for (int p : {2, 3, 4, 5}) {
    run_ranks(p, [&](Group& g) {
      const int r = g.rank();
      for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}, std::size_t{5003}}) {
        const std::size_t bytes = count * sizeof(std::int64_t);
        std::vector<std::int64_t> input(count), expected(count);
        for (std::size_t i = 0; i < count; ++i) {
          input[i] = static_cast<std::int64_t>(r) * 1000003 + static_cast<std::int64_t>(i) * 7 + 1;
          expected[i] = 0;
          for (int q = 0; q < p; ++q) expected[i] += static_cast<std::int64_t>(q) * 1000003 + static_cast<std::int64_t>(i) * 7 + 1;
        }
        const auto as_bytes = [](const std::vector<std::int64_t>& v) {
          std::vector<std::byte> b(v.size() * sizeof(std::int64_t));
          if (!b.empty()) std::memcpy(b.data(), v.data(), b.size());
          return b;
        };
        const unsigned seed = static_cast<unsigned>(r * 7919 + count);
        struct Shape {
          const char* what;
          algo::Plan plan;
          bool in_place;
          bool all_finished;  // the plan writes every byte of the output
        };
        std::vector<Shape> shapes{{"ring", algo::ring_all_reduce(p, r, count), false, true},
                                  {"ring in place", algo::ring_all_reduce(p, r, count), true, true},
                                  {"bidirectional ring", algo::bidirectional_ring_all_reduce(p, r, count), false, true},
                                  {"bidirectional ring in place", algo::bidirectional_ring_all_reduce(p, r, count), true, true},
                                  {"recursive doubling in place", algo::recursive_doubling_all_reduce(p, r, count), true, true}};
        for (const Shape& shape : shapes) {
          std::vector<std::int64_t> in(count), out(count, -1);
          std::byte* staged_in = shape.in_place ? reinterpret_cast<std::byte*>(out.data()) : reinterpret_cast<std::byte*>(in.data());
          JunkUntilLanded staging(g.loop(), staged_in, as_bytes(input), 512, seed);
          staging.watch_output(reinterpret_cast<std::byte*>(out.data()), bytes);
          algo::PlanBuffers buffers{staged_in, reinterpret_cast<std::byte*>(out.data()), DType::i64, ReduceOp::sum};
          if (!shape.in_place) buffers.local = staged_in;
          buffers.staged = &staging;
          g.run_plan(shape.plan, buffers, "all_reduce").get();
          const std::string at = fmt::format("{} p={} rank {} count {}: ", shape.what, p, r, count);
          check(out == expected, at + "the result differs from the reference");
          const std::string problems = staging.problems(shape.all_finished && count > 0);
          check(problems.empty(), at + problems);
        }
        for (int kind : {0, 1, 2}) {  // binomial, scatter + all-gather, chain
          const int root = static_cast<int>(count % static_cast<std::size_t>(p));
          std::vector<std::int64_t> data(count, -1);
          auto* bytes_at = reinterpret_cast<std::byte*>(data.data());
          const algo::Plan plan = kind == 1   ? algo::scatter_all_gather_broadcast(p, r, root, count)
                                  : kind == 2 ? algo::chain_broadcast(p, r, root, count)
                                              : algo::binomial_broadcast(p, r, root, count);
          // The root's buffer is copied in; the others' are copied back.
          JunkUntilLanded staging(g.loop(), bytes_at, r == root ? as_bytes(input) : std::vector<std::byte>{}, 512, seed);
          staging.watch_output(bytes_at, bytes);
          algo::PlanBuffers buffers{bytes_at, bytes_at, DType::i64, ReduceOp::sum};
          buffers.staged = &staging;
          g.run_plan(plan, buffers, "broadcast").get();
          std::vector<std::int64_t> want(count);
          for (std::size_t i = 0; i < count; ++i) want[i] = static_cast<std::int64_t>(root) * 1000003 + static_cast<std::int64_t>(i) * 7 + 1;
          const std::string at = fmt::format("{} broadcast p={} rank {} root {} count {}: ", kind == 1 ? "scatter+all-gather" : kind == 2 ? "chain" : "binomial", p, r, root, count);
          check(data == want, at + "the result differs from the root's data");
          const std::string problems = staging.problems(r != root && count > 0);
          check(problems.empty(), at + problems);
        }
      }
    }, options);
  }
  REQUIRE(checks_made.load() > before);
}

// ---- the variable-size collectives against references written with plain loops

namespace {

// Pattern k of per-rank counts for p ranks: all empty; zeros among ones; uneven, the last a few
// thousand (more than one segment with small segments); one rank far larger than the others (several
// default segments).
std::vector<std::size_t> counts_pattern(int k, int p) {
  std::vector<std::size_t> c(static_cast<std::size_t>(p));
  for (int i = 0; i < p; ++i) {
    const auto u = static_cast<std::size_t>(i);
    switch (k) {
      case 0: c[u] = 0; break;
      case 1: c[u] = i % 2; break;
      case 2: c[u] = (u * 7 + 3) % 11 + (i == p - 1 ? 4099 : 0); break;
      default: c[u] = i == p / 2 ? (std::size_t{1} << 17) + 5 : u * 2; break;
    }
  }
  return c;
}

// Displacements that place the blocks in reverse rank order with gaps of 3 elements (empty: packed).
std::vector<std::size_t> gapped_displs(const std::vector<std::size_t>& counts, bool gapped, std::size_t& reach) {
  std::vector<std::size_t> displs;
  reach = 0;
  if (!gapped) {
    for (std::size_t c : counts) reach += c;
    return displs;
  }
  displs.resize(counts.size());
  std::size_t at = 0;
  for (std::size_t i = counts.size(); i-- > 0;) {
    at += 3;
    displs[i] = at;
    at += counts[i];
  }
  reach = at + 2;  // a tail the collective must not touch either
  return displs;
}

std::size_t offset_of(const std::vector<std::size_t>& counts, const std::vector<std::size_t>& displs, std::size_t i) {
  if (!displs.empty()) return displs[i];
  std::size_t at = 0;
  for (std::size_t j = 0; j < i; ++j) at += counts[j];
  return at;
}

// all_to_allv's counts: what rank `from` sends rank `to` (zeros among them), scaled up by `big`.
std::size_t pair_count(int from, int to, int k) {
  const auto c = static_cast<std::size_t>((from * 3 + to * 5 + k) % 7);
  return k == 3 && from == to + 1 ? c + 70001 : c;
}

void variable_movements(Group& g, DType t, int k, bool gapped) {
  const int p = g.size();
  const int r = g.rank();
  const auto ur = static_cast<std::size_t>(r);
  const std::size_t esize = dtype_size(t);
  const std::byte fill{0xa5};
  auto block_of = [&](int rank, std::size_t count, std::size_t salt) { return make_input(t, ReduceOp::sum, rank, count, salt); };
  const auto counts = counts_pattern(k, p);
  std::size_t reach = 0;
  const auto displs = gapped_displs(counts, gapped, reach);
  const std::string at = fmt::format("{} pattern {}{}: ", to_string(t), k, gapped ? " gapped" : "");
  // Every byte of `out` outside the blocks must still hold `fill`.
  auto check_untouched = [&](const char* what, const std::vector<std::byte>& out) {
    std::vector<bool> inside(out.size() / esize, false);
    for (std::size_t i = 0; i < counts.size(); ++i) {
      for (std::size_t e = 0; e < counts[i]; ++e) inside[offset_of(counts, displs, i) + e] = true;
    }
    for (std::size_t e = 0; e < inside.size(); ++e) {
      if (inside[e]) continue;
      for (std::size_t b = 0; b < esize; ++b) check(out[e * esize + b] == fill, at + what + fmt::format(": element {} outside every block was written", e));
    }
  };
  {  // all_gatherv, out of place and in place
    const auto in = block_of(r, counts[ur], 1);
    std::vector<std::byte> out(reach * esize, fill);
    g.all_gatherv(ConstBufferView(in.data(), counts[ur], t), BufferView(out.data(), reach, t), counts, displs).get();
    for (int i = 0; i < p; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      const auto diff = compare(t, out.data() + offset_of(counts, displs, ui) * esize, block_of(i, counts[ui], 1).data(), counts[ui]);
      check(diff.empty(), at + fmt::format("all_gatherv block {}: ", i) + diff);
    }
    check_untouched("all_gatherv", out);
    std::vector<std::byte> in_place(reach * esize, fill);
    if (!in.empty()) std::memcpy(in_place.data() + offset_of(counts, displs, ur) * esize, in.data(), in.size());
    g.all_gatherv(ConstBufferView(in_place.data() + offset_of(counts, displs, ur) * esize, counts[ur], t), BufferView(in_place.data(), reach, t),
                  counts, displs).get();
    check(in_place == out, at + "all_gatherv in place differs from out of place");
  }
  const int root = (k + 1) % p;
  {  // gatherv: the output at the root only
    const auto in = block_of(r, counts[ur], 2);
    std::vector<std::byte> out(r == root ? reach * esize : 0, fill);
    g.gatherv(ConstBufferView(in.data(), counts[ur], t), BufferView(out.data(), r == root ? reach : 0, t), counts, root,
              r == root ? displs : std::vector<std::size_t>{}).get();
    if (r == root) {
      for (int i = 0; i < p; ++i) {
        const auto ui = static_cast<std::size_t>(i);
        const auto diff = compare(t, out.data() + offset_of(counts, displs, ui) * esize, block_of(i, counts[ui], 2).data(), counts[ui]);
        check(diff.empty(), at + fmt::format("gatherv block {}: ", i) + diff);
      }
      check_untouched("gatherv", out);
    }
  }
  {  // scatterv: the root's blocks, each to its rank
    std::vector<std::byte> all(r == root ? reach * esize : 0, fill);
    if (r == root) {
      for (int i = 0; i < p; ++i) {
        const auto ui = static_cast<std::size_t>(i);
        const auto part = block_of(i, counts[ui], 3);
        if (!part.empty()) std::memcpy(all.data() + offset_of(counts, displs, ui) * esize, part.data(), part.size());
      }
    }
    std::vector<std::byte> mine(counts[ur] * esize, fill);
    g.scatterv(ConstBufferView(all.data(), r == root ? reach : 0, t), BufferView(mine.data(), counts[ur], t), counts, root, displs).get();
    const auto diff = compare(t, mine.data(), block_of(r, counts[ur], 3).data(), counts[ur]);
    check(diff.empty(), at + "scatterv: " + diff);
  }
  {  // all_to_allv: rank r's block for rank j lands in rank j's block from r; out of place and in place
    std::vector<std::size_t> sends(static_cast<std::size_t>(p)), recvs(static_cast<std::size_t>(p));
    for (int j = 0; j < p; ++j) {
      sends[static_cast<std::size_t>(j)] = pair_count(r, j, k);
      recvs[static_cast<std::size_t>(j)] = pair_count(j, r, k);
    }
    std::size_t in_reach = 0, out_reach = 0;
    const auto send_displs = gapped_displs(sends, gapped, in_reach);
    const auto recv_displs = gapped_displs(recvs, gapped, out_reach);
    std::vector<std::byte> in(in_reach * esize, fill);
    for (int j = 0; j < p; ++j) {
      const auto uj = static_cast<std::size_t>(j);
      const auto part = block_of(r, sends[uj], uj * 31);
      if (!part.empty()) std::memcpy(in.data() + offset_of(sends, send_displs, uj) * esize, part.data(), part.size());
    }
    std::vector<std::byte> out(out_reach * esize, fill);
    g.all_to_allv(ConstBufferView(in.data(), in_reach, t), BufferView(out.data(), out_reach, t), sends, recvs, send_displs, recv_displs).get();
    for (int i = 0; i < p; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      const auto diff = compare(t, out.data() + offset_of(recvs, recv_displs, ui) * esize, block_of(i, recvs[ui], ur * 31).data(), recvs[ui]);
      check(diff.empty(), at + fmt::format("all_to_allv block from {}: ", i) + diff);
    }
    // In place: one buffer long enough for both layouts.
    std::vector<std::byte> both(std::max(in_reach, out_reach) * esize, fill);
    std::memcpy(both.data(), in.data(), in.size());
    g.all_to_allv(ConstBufferView(both.data(), in_reach, t), BufferView(both.data(), out_reach, t), sends, recvs, send_displs, recv_displs).get();
    for (int i = 0; i < p; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      const auto diff = compare(t, both.data() + offset_of(recvs, recv_displs, ui) * esize, block_of(i, recvs[ui], ur * 31).data(), recvs[ui]);
      check(diff.empty(), at + fmt::format("all_to_allv in place, block from {}: ", i) + diff);
    }
  }
}

void variable_reductions(Group& g, DType t, int k) {
  const int p = g.size();
  const int r = g.rank();
  const auto ur = static_cast<std::size_t>(r);
  const std::size_t esize = dtype_size(t);
  const auto counts = counts_pattern(k, p);
  std::size_t total = 0;
  for (std::size_t c : counts) total += c;
  for (ReduceOp op : all_reduce_ops) {
    if (!is_defined(t, op)) continue;
    // Block i of every rank's input is reduced into rank i's output.
    std::vector<std::byte> in(total * esize);
    for (int i = 0; i < p; ++i) {
      const auto ui = static_cast<std::size_t>(i);
      const auto part = make_input(t, op, r, counts[ui], ui * 13);
      if (!part.empty()) std::memcpy(in.data() + offset_of(counts, {}, ui) * esize, part.data(), part.size());
    }
    std::vector<std::byte> out(counts[ur] * esize);
    g.reduce_scatterv(ConstBufferView(in.data(), total, t), BufferView(out.data(), counts[ur], t), counts, op).get();
    const auto expected = make_reduced(t, op, p, counts[ur], ur * 13);
    const auto diff = compare(t, out.data(), expected.data(), counts[ur]);
    check(diff.empty(), fmt::format("reduce_scatterv {} {} pattern {}: ", to_string(t), to_string(op), k) + diff);
  }
}

void variable_matrix(int p, Options options = {}) {
  const long before = checks_made.load();
  run_ranks(p, [](Group& g) {
    for (DType t : all_dtypes) {
      for (int k = 0; k < 4; ++k) {
        if (k == 3 && t != DType::f32 && t != DType::u8 && t != DType::f16) continue;  // the large pattern on three sizes of element
        variable_movements(g, t, k, false);
        variable_movements(g, t, k, true);
        variable_reductions(g, t, k);
      }
    }
    g.barrier().get();
  }, options);
  REQUIRE(checks_made.load() > before);
}

}  // namespace

TEST_CASE("the variable-size collectives match plain loops on 1, 2, 3, 4 and 5 ranks", "[collectives][variable]") {
  for (int p : {1, 2, 3, 4, 5}) variable_matrix(p);
}

TEST_CASE("deterministic reduce_scatterv and small segments give the same results", "[collectives][variable]") {
  Options options;
  options.deterministic = true;
  options.segment_bytes = 4096;
  variable_matrix(3, options);
}

// ---- collectives over n-d views (weft/tensor.hpp) against references written with plain loops

namespace {

using Shape = std::vector<std::size_t>;

void for_each_index(const Shape& shape, const std::function<void(const Shape&)>& fn) {
  for (std::size_t e : shape) {
    if (e == 0) return;
  }
  Shape idx(shape.size(), 0);
  for (;;) {
    fn(idx);
    std::size_t k = shape.size();
    for (;;) {
      if (k == 0) return;
      --k;
      if (++idx[k] < shape[k]) break;
      idx[k] = 0;
    }
  }
}

std::size_t flat(const Shape& shape, const Shape& idx) {
  std::size_t at = 0;
  for (std::size_t k = 0; k < shape.size(); ++k) at = at * shape[k] + idx[k];
  return at;
}

// A tensor in memory in one of three layouts: row-major; every row padded by 2 elements; and transposed
// (the axes stored in reverse order), which is contiguous in no axis order a collective can use.
struct Stored {
  DType t;
  Shape shape;
  std::vector<std::ptrdiff_t> strides;
  std::vector<std::byte> memory;

  Stored(DType type, Shape s, int layout) : t(type), shape(std::move(s)) {
    const std::size_t n = shape.size();
    strides.assign(n, 1);
    Shape storage = shape;
    if (layout == 1 && n > 0) storage[n - 1] += 2;
    std::ptrdiff_t step = 1;
    if (layout == 2) {
      for (std::size_t k = 0; k < n; ++k) {
        strides[k] = step;
        step *= static_cast<std::ptrdiff_t>(std::max<std::size_t>(1, shape[k]));
      }
    } else {
      for (std::size_t k = n; k-- > 0;) {
        strides[k] = step;
        step *= static_cast<std::ptrdiff_t>(std::max<std::size_t>(1, storage[k]));
      }
    }
    memory.assign(static_cast<std::size_t>(step) * dtype_size(t) + 1, std::byte{0x5c});
  }
  std::size_t offset(const Shape& idx) const {
    std::ptrdiff_t at = 0;
    for (std::size_t k = 0; k < idx.size(); ++k) at += static_cast<std::ptrdiff_t>(idx[k]) * strides[k];
    return static_cast<std::size_t>(at);
  }
  double get(const Shape& idx) const { return load(t, memory.data(), offset(idx)); }
  void set(const Shape& idx, double v) { reference::store(t, memory.data(), offset(idx), v); }
  TensorView view() { return TensorView{memory.data(), t, shape, strides}; }
  ConstTensorView cview() const { return ConstTensorView(memory.data(), t, shape, strides); }
};

// Rank r's input element at idx: small integers, exact in every dtype and every sum of 5 of them.
double element(DType t, int r, const Shape& shape, const Shape& idx, std::size_t salt) {
  return value(t, ReduceOp::sum, r, flat(shape, idx) + salt);
}

Stored input_of(DType t, int r, const Shape& shape, int layout, std::size_t salt) {
  Stored s(t, shape, layout);
  for_each_index(shape, [&](const Shape& idx) { s.set(idx, element(t, r, shape, idx, salt)); });
  return s;
}

// Compares every element of `got` with expected(idx), through the dtype (as stored).
void check_tensor(const Stored& got, const std::function<double(const Shape&)>& expected, const std::string& what) {
  std::vector<std::byte> one(8);
  for_each_index(got.shape, [&](const Shape& idx) {
    reference::store(got.t, one.data(), 0, expected(idx));
    const double want = load(got.t, one.data(), 0);
    const double have = got.get(idx);
    if (have != want) {
      check(false, fmt::format("{}: at {} got {}, expected {}", what, fmt::join(idx, ","), have, want));
    }
  });
  check(true, what);
}

Shape erase_at(Shape s, std::size_t at) {
  s.erase(s.begin() + static_cast<std::ptrdiff_t>(at));
  return s;
}
Shape insert_at(Shape s, std::size_t at, std::size_t v) {
  s.insert(s.begin() + static_cast<std::ptrdiff_t>(at), v);
  return s;
}

void tensor_cases(Group& g) {
  const int p = g.size();
  const int r = g.rank();
  const auto up = static_cast<std::size_t>(p);
  const auto ur = static_cast<std::size_t>(r);
  for (DType t : {DType::f32, DType::i32, DType::bf16, DType::u8, DType::f64}) {
    for (int layout_in = 0; layout_in < 3; ++layout_in) {
      const int layout_out = (layout_in + 1) % 3;  // every pairing of layouts across the loop
      for (std::size_t a = 0; a < 4; ++a) {
        const std::string at = fmt::format("{} axis {} layouts {}/{}", to_string(t), a, layout_in, layout_out);
        const Shape base{3, 2, 5, 1};  // uneven extents, one of them 1
        {  // all_gather, tiled: blocks of base along a, concatenated
          const auto in = input_of(t, r, base, layout_in, 1);
          Stored out(t, all_gather_shape(base, static_cast<int>(a), p, true), layout_out);
          all_gather(g, in.cview(), out.view(), static_cast<int>(a), true).get();
          check_tensor(out, [&](const Shape& idx) {
            Shape src = idx;
            const auto from = static_cast<int>(idx[a] / base[a]);
            src[a] = idx[a] % base[a];
            return element(t, from, base, src, 1);
          }, "all_gather tiled " + at);
        }
        {  // all_gather, untiled: a new axis of p at a (a in 0..4 covers the end too)
          const std::size_t where = a + (a == 3 ? 1 : 0);
          const auto in = input_of(t, r, base, layout_in, 2);
          Stored out(t, insert_at(base, where, up), layout_out);
          all_gather(g, in.cview(), out.view(), static_cast<int>(where)).get();
          check_tensor(out, [&](const Shape& idx) { return element(t, static_cast<int>(idx[where]), base, erase_at(idx, where), 2); },
                       "all_gather untiled " + at);
        }
        {  // all_gather, tiled and uneven: rank i holds i % 3 along the axis (zero for some)
          Shape extents(up);
          for (std::size_t i = 0; i < up; ++i) extents[i] = i % 3;
          Shape mine = base;
          mine[a] = extents[ur];
          const auto in = input_of(t, r, mine, layout_in, 3);
          Shape full = base;
          full[a] = std::accumulate(extents.begin(), extents.end(), std::size_t{0});
          Stored out(t, full, layout_out);
          all_gather(g, in.cview(), out.view(), static_cast<int>(a), true, extents).get();
          check_tensor(out, [&](const Shape& idx) {
            std::size_t from = 0, off = 0;
            while (idx[a] >= off + extents[from]) off += extents[from++];
            Shape theirs = base;
            theirs[a] = extents[from];
            Shape src = idx;
            src[a] = idx[a] - off;
            return element(t, static_cast<int>(from), theirs, src, 3);
          }, "all_gather uneven " + at);
        }
        {  // reduce_scatter, tiled (the axis 2p long) and untiled (the axis p long)
          Shape shape = base;
          shape[a] = 2 * up;
          const auto in = input_of(t, r, shape, layout_in, 4);
          Stored out(t, reduce_scatter_shape(shape, static_cast<int>(a), p, true), layout_out);
          reduce_scatter(g, in.cview(), out.view(), static_cast<int>(a), ReduceOp::sum, true).get();
          check_tensor(out, [&](const Shape& idx) {
            Shape src = idx;
            src[a] += 2 * ur;
            double sum = 0;
            for (int i = 0; i < p; ++i) sum += element(t, i, shape, src, 4);
            return sum;
          }, "reduce_scatter tiled " + at);
          shape[a] = up;
          const auto in1 = input_of(t, r, shape, layout_in, 5);
          Stored out1(t, erase_at(shape, a), layout_out);
          reduce_scatter(g, in1.cview(), out1.view(), static_cast<int>(a) - 4, ReduceOp::sum).get();  // a negative axis
          check_tensor(out1, [&](const Shape& idx) {
            double sum = 0;
            for (int i = 0; i < p; ++i) sum += element(t, i, shape, insert_at(idx, a, ur), 5);
            return sum;
          }, "reduce_scatter untiled " + at);
        }
        {  // reduce_scatter, tiled and uneven: block i is (i + 1) % 3 long
          Shape extents(up);
          for (std::size_t i = 0; i < up; ++i) extents[i] = (i + 1) % 3;
          Shape shape = base;
          shape[a] = std::accumulate(extents.begin(), extents.end(), std::size_t{0});
          const auto in = input_of(t, r, shape, layout_in, 6);
          Shape mine = base;
          mine[a] = extents[ur];
          Stored out(t, mine, layout_out);
          reduce_scatter(g, in.cview(), out.view(), static_cast<int>(a), ReduceOp::sum, true, extents).get();
          const std::size_t off = std::accumulate(extents.begin(), extents.begin() + r, std::size_t{0});
          check_tensor(out, [&](const Shape& idx) {
            Shape src = idx;
            src[a] += off;
            double sum = 0;
            for (int i = 0; i < p; ++i) sum += element(t, i, shape, src, 6);
            return sum;
          }, "reduce_scatter uneven " + at);
        }
        for (std::size_t c = 0; c < 4; ++c) {  // all_to_all from split axis a to concat axis c
          {  // tiled: the split axis 2p long
            Shape shape = base;
            shape[a] = 2 * up;
            const auto in = input_of(t, r, shape, layout_in, 7);
            Stored out(t, all_to_all_shape(shape, static_cast<int>(a), static_cast<int>(c), p, true), layout_out);
            all_to_all(g, in.cview(), out.view(), static_cast<int>(a), static_cast<int>(c), true).get();
            Shape block = shape;
            block[a] = 2;
            check_tensor(out, [&](const Shape& idx) {
              Shape src = idx;
              const std::size_t from = idx[c] / block[c];
              src[c] = idx[c] % block[c];
              src[a] += 2 * ur;
              return element(t, static_cast<int>(from), shape, src, 7);
            }, fmt::format("all_to_all tiled {} concat {}", at, c));
          }
          {  // untiled: the split axis p long, a new axis p long at c
            Shape shape = base;
            shape[a] = up;
            const auto in = input_of(t, r, shape, layout_in, 8);
            Stored out(t, insert_at(erase_at(shape, a), c, up), layout_out);
            all_to_all(g, in.cview(), out.view(), static_cast<int>(a), static_cast<int>(c)).get();
            check_tensor(out, [&](const Shape& idx) {
              return element(t, static_cast<int>(idx[c]), shape, insert_at(erase_at(idx, c), a, ur), 8);
            }, fmt::format("all_to_all untiled {} concat {}", at, c));
          }
        }
      }
      {  // ppermute (a shift by one), all_reduce and broadcast on a strided 3-d tensor
        const Shape shape{2, 3, 4};
        const int layout_out = (layout_in + 2) % 3;
        std::vector<std::pair<int, int>> pairs;
        for (int i = 0; i < p; ++i) pairs.emplace_back(i, (i + 1) % p);
        const auto in = input_of(t, r, shape, layout_in, 9);
        Stored out(t, shape, layout_out);
        permute(g, in.cview(), out.view(), pairs).get();
        check_tensor(out, [&](const Shape& idx) { return element(t, (r + p - 1) % p, shape, idx, 9); }, "permute");
        Stored sum(t, shape, layout_out);
        all_reduce(g, in.cview(), sum.view()).get();
        check_tensor(sum, [&](const Shape& idx) {
          double s = 0;
          for (int i = 0; i < p; ++i) s += element(t, i, shape, idx, 9);
          return s;
        }, "all_reduce");
        const int root = p - 1;
        auto data = r == root ? input_of(t, r, shape, layout_in, 10) : Stored(t, shape, layout_in);
        broadcast(g, data.view(), root).get();
        check_tensor(data, [&](const Shape& idx) { return element(t, root, shape, idx, 10); }, "broadcast");
      }
    }
  }
}

}  // namespace

TEST_CASE("collectives over n-d views match plain loops: axes 0..3, tiled and untiled, uneven, strided", "[collectives][tensor]") {
  for (int p : {1, 2, 3, 4}) {
    const long before = checks_made.load();
    run_ranks(p, [](Group& g) { tensor_cases(g); });
    REQUIRE(checks_made.load() > before);
  }
}

TEST_CASE("collectives over n-d views refuse what does not fit, before anything is sent", "[collectives][tensor]") {
  run_ranks(2, [](Group& g) {
    std::vector<float> a(24), b(48);
    const ConstTensorView in(a.data(), DType::f32, {2, 3, 4});
    auto refused = [&](const std::function<void()>& fn, const std::string& words) {
      try {
        fn();
      } catch (const Error& e) {
        check(e.errc() == Errc::invalid_argument && std::string(e.what()).find(words) != std::string::npos,
              fmt::format("expected '{}', got: {}", words, e.what()));
        return;
      }
      check(false, "nothing was refused: " + words);
    };
    refused([&] { (void)all_gather(g, in, TensorView{b.data(), DType::f32, {2, 3, 8}, {}}, 3, true); }, "axis 3 is out of range for 3 dimensions");
    refused([&] { (void)all_gather(g, in, TensorView{b.data(), DType::f32, {2, 3, 4}, {}}, 0, true); }, "output has shape [2, 3, 4], expected [4, 3, 4]");
    refused([&] { (void)all_gather(g, in, TensorView{b.data(), DType::f64, {4, 3, 4}, {}}, 0, true); }, "input is f32 but output is f64");
    refused([&] { (void)reduce_scatter(g, in, TensorView{b.data(), DType::f32, {2, 4}, {}}, 1); }, "untiled, it must be the group's size 2");
    refused([&] { (void)reduce_scatter(g, in, TensorView{b.data(), DType::f32, {2, 1, 4}, {}}, 1, ReduceOp::sum, true); }, "does not split into 2 equal blocks");
    refused([&] { (void)all_to_all(g, in, TensorView{b.data(), DType::f32, {4, 3, 2}, {}}, 1, 0, true); }, "split axis 1 has extent 3");
    refused([&] { (void)all_gather(g, in, TensorView{b.data(), DType::f32, {4, 3, 4}, {0, 4, 1}}, 0, true); }, "overlap itself");
    refused([&] { (void)all_gather(g, in, TensorView{b.data(), DType::f32, {6, 3, 4}, {}}, 0, true, {3, 3}); }, "= 3 but this rank's input has 2 along axis 0");
    // Views larger than memory: a shape whose product wraps (2^80 elements were a view of none, all-reduced
    // "successfully"), a stride that wraps the address space back onto the first row (it read a's first
    // row four times), the most negative stride.
    const std::size_t big = std::size_t{1} << 40;
    refused([&] { (void)all_reduce(g, TensorView{a.data(), DType::f32, {big, big}, {}}, TensorView{a.data(), DType::f32, {big, big}, {}}); },
            "input of shape [1099511627776, 1099511627776] and strides [] spans more than memory can hold");
    refused([&] { (void)all_reduce(g, ConstTensorView{a.data(), DType::f32, {4, 4}, {PTRDIFF_MAX / 2, 1}}, TensorView{b.data(), DType::f32, {4, 4}, {}}); },
            "spans more than memory can hold");
    refused([&] { (void)all_reduce(g, ConstTensorView{a.data(), DType::f32, {2, 4}, {PTRDIFF_MIN, 1}}, TensorView{b.data(), DType::f32, {2, 4}, {}}); },
            "spans more than memory can hold");
    refused([&] { (void)broadcast(g, TensorView{a.data(), DType::f32, {4}, {std::ptrdiff_t{1} << 46}}, 0); }, "data of shape [4]");
    // A view of nothing is no view of too much, whatever its other extents and strides.
    all_reduce(g, ConstTensorView{a.data(), DType::f32, {0, big}, {}}, TensorView{b.data(), DType::f32, {0, big}, {}}).get();
    // Nothing was sent: the group still works.
    std::vector<float> one{1.0f};
    g.all_reduce(one).get();
    check(one[0] == 2.0f, "the group works after refused calls");
  });
}

TEST_CASE("every all_gatherv algorithm matches plain loops at every size", "[collectives][variable]") {
  // The table picks Bruck (padded) below 16 KiB on more than 2 ranks and the ring above: each forced here
  // over every pattern, small and large.
  for (const char* spec : {"all_gatherv:ring", "all_gatherv:bruck"}) {
    for (int p : {3, 4}) {
      const long before = checks_made.load();
      run_ranks(p, [spec](Group& g) {
        g.override_algorithms(spec);
        for (DType t : {DType::f32, DType::u8, DType::f64}) {
          for (int k = 0; k < 4; ++k) {
            variable_movements(g, t, k, false);
            variable_movements(g, t, k, true);
          }
        }
        g.barrier().get();
      });
      REQUIRE(checks_made.load() > before);
    }
  }
}
