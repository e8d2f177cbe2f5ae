// Errors: bad arguments are refused before any byte moves; a rank that never arrives is named; a peer
// that leaves mid-collective fails every other rank's future (nothing hangs); mismatched sizes fail.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <sys/wait.h>
#include <csignal>
#include <optional>

#include <algorithm>
#include <array>
#include <filesystem>
#include <latch>
#include <future>
#include <random>

#include "support/harness.hpp"
#include "support/log_capture.hpp"
#include "core/bytes.hpp"
#include "core/sanitizer.hpp"
#include "transports/framed/integrity.hpp"
#include "transports/asio/asio_stream.hpp"
#include "transports/framed/framed_transport.hpp"
#include "transports/framed/wire.hpp"
#include "group/state.hpp"
#include "transports/shm/arena.hpp"

using namespace weft;
using namespace weft::test;
using namespace std::chrono_literals;

namespace {

// Expects `fn` to throw a weft::Error with one of `codes` whose message contains every one of `words`.
template <class Fn>
void expect_error(Fn&& fn, std::initializer_list<Errc> codes, std::initializer_list<std::string> words) {
  try {
    fn();
  } catch (const Error& e) {
    bool expected = false;
    for (Errc c : codes) expected = expected || e.errc() == c;
    check(expected, fmt::format("expected {}, got: {}", error_category().message(static_cast<int>(*codes.begin())), e.what()));
    for (const auto& w : words) check(std::string(e.what()).find(w) != std::string::npos, fmt::format("'{}' not in: {}", w, e.what()));
    return;
  }
  check(false, "no error was thrown");
}

template <class Fn>
void expect_error(Fn&& fn, Errc code, std::initializer_list<std::string> words) {
  expect_error(std::forward<Fn>(fn), {code}, words);
}

// A getenv for Options::from_environment: rank 0 of 1, and `value` for each variable in `names`.
std::function<const char*(const char*)> environment_with(const char* value, std::vector<std::string> names) {
  return [value, names = std::move(names)](const char* name) -> const char* {
    const std::string n(name);
    if (n == "WEFT_RANK") return "0";
    if (n == "WEFT_WORLD_SIZE") return "1";
    return std::find(names.begin(), names.end(), n) != names.end() ? value : nullptr;
  };
}

}  // namespace

TEST_CASE("bad arguments are rejected before anything is sent, naming rank and operation", "[errors][preconditions]") {
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    std::vector<float> f(8);
    std::vector<float> small(3);
    std::vector<std::int32_t> ints(8);
    const std::string me = fmt::format("rank {}", g.rank());
    expect_error([&] { (void)g.broadcast(f, 2); }, Errc::invalid_argument, {me, "broadcast", "root 2"});
    expect_error([&] { (void)g.reduce(f, f, -1); }, Errc::invalid_argument, {me, "reduce", "root -1"});
    expect_error([&] { (void)g.send(f, 5); }, Errc::invalid_argument, {me, "send", "destination 5"});
    expect_error([&] { (void)g.recv(f, -3); }, Errc::invalid_argument, {me, "recv", "source -3"});
    expect_error([&] { (void)g.all_reduce(f, ReduceOp::bitwise_xor); }, Errc::invalid_argument, {me, "all_reduce", "bxor", "f32"});
    expect_error([&] { (void)g.all_reduce(f, small); }, Errc::invalid_argument, {"all_reduce", "3 elements, expected 8"});
    expect_error([&] { (void)g.all_reduce(f, ints); }, Errc::invalid_argument, {"all_reduce", "f32", "i32"});
    expect_error([&] { (void)g.all_gather(f, small); }, Errc::invalid_argument, {"all_gather", "expected 16"});
    expect_error([&] { (void)g.reduce_scatter(small, f); }, Errc::invalid_argument, {"reduce_scatter", "expected 16"});
    expect_error([&] { (void)g.all_to_all(small, small); }, Errc::invalid_argument, {"all_to_all", "equal blocks"});
    expect_error([&] { (void)g.permute(f, f, {{0, 1}, {0, 0}}); }, Errc::invalid_argument, {"permute", "sends more than once"});
    // Integers cast to the enums (from a file, a flag, another language) that name no dtype or op: refused
    // (they reached the reduction's dispatch and crashed before).
    const BufferView no_dtype(f.data(), f.size(), static_cast<DType>(99));
    expect_error([&] { (void)g.all_reduce(no_dtype); }, Errc::invalid_argument, {me, "all_reduce", "dtype 99 is not a weft DType"});
    expect_error([&] { (void)g.broadcast(no_dtype, 0); }, Errc::invalid_argument, {"broadcast", "dtype 99"});
    expect_error([&] { (void)g.send(no_dtype, 1 - g.rank()); }, Errc::invalid_argument, {"send", "dtype 99"});
    expect_error([&] { (void)g.all_reduce(f, static_cast<ReduceOp>(77)); }, Errc::invalid_argument,
                 {me, "all_reduce", "reduce op 77 is not a weft ReduceOp"});
    std::vector<float> four(4);
    expect_error([&] { (void)g.reduce_scatter(f, four, static_cast<ReduceOp>(200)); }, Errc::invalid_argument,
                 {"reduce_scatter", "reduce op 200"});
    CHECK_FALSE(is_defined(static_cast<DType>(99), ReduceOp::max));
    CHECK_FALSE(is_defined(DType::f32, static_cast<ReduceOp>(77)));
    BufferView device_view(f.data(), f.size(), DType::f32, Device{Device::Kind::cuda, 0});
    expect_error([&] { (void)g.all_reduce(device_view); }, Errc::invalid_argument, {"all_reduce", "not device memory"});
    // Counts whose bytes wrap or exceed what memory can hold: refused before anything is allocated
    // (SIZE_MAX / 2 floats used to wrap to a small byte count and grow memory until killed).
    const BufferView huge(f.data(), SIZE_MAX / 2, DType::f32);
    expect_error([&] { (void)g.all_reduce(huge); }, Errc::invalid_argument, {me, "all_reduce", "more than memory can hold"});
    const BufferView petabytes(f.data(), std::size_t{1} << 50, DType::f32);
    expect_error([&] { (void)g.broadcast(petabytes, 0); }, Errc::invalid_argument, {"broadcast", "more than memory can hold"});
    expect_error([&] { (void)g.send(huge, 1 - g.rank()); }, Errc::invalid_argument, {"send", "more than memory can hold"});
    // all_gather's output must hold count x ranks: a count whose product wraps is refused, not matched.
    const ConstBufferView wraps(f.data(), (SIZE_MAX / 2 + 1) / 4, DType::u8);
    expect_error([&] { (void)g.all_gather(wraps, f); }, Errc::invalid_argument, {"all_gather"});
    // Nothing was sent and no sequence number was used: the group still works.
    std::vector<float> one{1.0f};
    g.all_reduce(one).get();
    check(one[0] == 2.0f, "the group works after refused calls");
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("an empty or moved-from Group throws, naming the operation, instead of crashing", "[errors][preconditions]") {
  Group empty;
  CHECK_FALSE(empty.valid());
  CHECK(empty.rank() == -1);
  CHECK(empty.size() == 0);
  CHECK(empty.transport_name().empty());
  std::vector<float> x(4);
  const long before = checks_made.load();
  expect_error([&] { (void)empty.all_reduce(x); }, Errc::invalid_argument, {"all_reduce", "this Group is empty"});
  expect_error([&] { (void)empty.barrier(); }, Errc::invalid_argument, {"barrier", "empty"});
  expect_error([&] { (void)empty.send(x, 0); }, Errc::invalid_argument, {"send", "empty"});
  expect_error([&] { (void)empty.recv(x, 0); }, Errc::invalid_argument, {"recv", "empty"});
  expect_error([&] { (void)empty.split(0, 0); }, Errc::invalid_argument, {"split", "empty"});
  expect_error([&] { (void)empty.shrink(); }, Errc::invalid_argument, {"shrink", "empty"});
  expect_error([&] { (void)empty.with_timeout(1s); }, Errc::invalid_argument, {"with_timeout", "empty"});
  expect_error([&] { empty.abort(); }, Errc::invalid_argument, {"abort", "empty"});
  expect_error([&] { (void)empty.loop(); }, Errc::invalid_argument, {"loop", "empty"});
  expect_error([&] { (void)empty.algorithm_for("all_reduce", 8); }, Errc::invalid_argument, {"algorithm_for", "empty"});
  run_ranks(2, [](Group& g) {
    Group moved = std::move(g);
    std::vector<float> y(4, 1.0f);
    expect_error([&] { (void)g.all_reduce(y); }, Errc::invalid_argument, {"all_reduce", "empty"});
    moved.all_reduce(y).get();  // the group lives on in `moved`
    check(y[0] == 2.0f, "the moved-to group works");
    g = std::move(moved);  // the harness ends with it
  });
  REQUIRE(checks_made.load() > before);
}

// Runs `body` in a child process with its stderr captured; returns (wait status, stderr).
static std::pair<int, std::string> in_child(const std::function<void()>& body) {
  int out[2];
  REQUIRE(::pipe(out) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The child's abort is the outcome under test, not a failure for Catch's handler (inherited) to
    // report as this test's; its output goes to the pipe, not into the parent's report.
    std::signal(SIGABRT, SIG_DFL);
    ::dup2(out[1], 1);
    ::dup2(out[1], 2);
    ::close(out[0]);
    try {
      body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "threw: %s\n", e.what());
      ::_exit(3);
    }
    ::_exit(0);
  }
  ::close(out[1]);
  std::string text;
  char chunk[512];
  for (ssize_t n; (n = ::read(out[0], chunk, sizeof chunk)) > 0;) text.append(chunk, static_cast<std::size_t>(n));
  ::close(out[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return {status, text};
}

TEST_CASE("a Loop destroyed under a live Group stops the process, naming the mistake", "[errors][preconditions]") {
  // A class whose members are `Group group; Loop loop;` destroys the loop first: its Group then ran on
  // freed memory (a segfault at the next call, or a collective that "succeeded").
  enum class Order { group_first, group_first_receive_pending, loop_first };
  auto one_rank = [](Order order) {
    return [order] {
      Options o;
      o.rank = 0;
      o.world_size = 1;
      o.store = "127.0.0.1:" + std::to_string(free_port());
      std::optional<Loop> loop(std::in_place);
      std::optional<Group> group(Group::create(*loop, o).get());
      std::vector<float> x(4, 1.0f);
      group->all_reduce(x).get();
      {
        Group copy = *group;  // a second handle, gone before the loop in every order
        copy.barrier().get();
      }
      // A receive nobody sends to, dropped with its Group: an operation in flight is not a handle (a
      // rank unwinding from an exception between a call and its wait does exactly this).
      if (order == Order::group_first_receive_pending) (void)group->recv(x, 0, 7);
      if (order != Order::loop_first) group.reset();
      loop.reset();
    };
  };
  for (Order order : {Order::group_first, Order::group_first_receive_pending}) {
    const auto [status, text] = in_child(one_rank(order));
    INFO(text);
    CHECK((WIFEXITED(status) && WEXITSTATUS(status) == 0));
  }
  const auto [status, text] = in_child(one_rank(Order::loop_first));
  INFO(text);
  CHECK((WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT));
  CHECK(text.find("a Loop is destroyed while 1 Group(s) still run on it") != std::string::npos);
  CHECK(text.find("declare the Loop first") != std::string::npos);
}

TEST_CASE("durations that would overflow a deadline are refused", "[errors][preconditions]") {
  const auto env_with = [](const char* value) { return environment_with(value, {"WEFT_TIMEOUT", "WEFT_HEARTBEAT"}); };
  const long before = checks_made.load();
  // 2562048 hours is past what nanoseconds hold: every operation failed at once before.
  for (const char* value : {"2562048h", "8761h", "999999999999s"}) {
    expect_error([&] { Options{}.from_environment(env_with(value)); }, Errc::invalid_argument, {"longer than a year"});
  }
  CHECK(Options{}.from_environment(env_with("8760h")).timeout == std::chrono::hours(8760));
  Loop loop;
  Options options;
  options.rank = 0;
  options.world_size = 1;
  options.timeout = std::chrono::hours(2562048);
  expect_error([&] { (void)Group::create(loop, options); }, Errc::invalid_argument, {"Options::timeout", "a year"});
  options.timeout = 1s;
  options.heartbeat = -1s;
  expect_error([&] { (void)Group::create(loop, options); }, Errc::invalid_argument, {"Options::heartbeat"});
  // Below a second the keepalive cannot follow, and the unacknowledged-data limit called live peers dead
  // (1 ms: the first collective failed over tcp, and hung over shm).
  for (const auto too_short : {1ms, 999ms}) {
    options.heartbeat = too_short;
    expect_error([&] { (void)Group::create(loop, options); }, Errc::invalid_argument,
                 {"Options::heartbeat (WEFT_HEARTBEAT) is " + std::to_string(too_short.count()) + " ms", "at least 1 s"});
  }
  options.heartbeat = 1s;
  Group alone = Group::create(loop, options).get();
  check(alone.size() == 1, "a 1 s heartbeat is taken");
  // One operation's deadline: the same bounds (a negative one meant "none", 100 million hours wrapped).
  expect_error([&] { (void)alone.with_timeout(-1ms); }, Errc::invalid_argument, {"with_timeout", "the timeout is -1 ms", "a year"});
  expect_error([&] { (void)alone.with_timeout(std::chrono::hours(8761)); }, Errc::invalid_argument, {"with_timeout"});
  std::vector<float> one{1.0f};
  alone.with_timeout(0ms).all_reduce(one).get();
  alone.with_timeout(std::chrono::hours(8760)).all_reduce(one).get();
  check(one[0] == 1.0f, "deadlines of none and of a year are taken");
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a rank that never arrives is named by the bootstrap timeout", "[errors][bootstrap]") {
  Options base;
  base.store = "127.0.0.1:" + std::to_string(free_port());
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < 2; ++r) {  // world size 3: rank 2 never comes
    threads.emplace_back([&, r] {
      Loop loop(Loop::Options{0us});
      Options o = base;
      o.rank = r;
      o.world_size = 3;
      o.bootstrap_timeout = 2s;
      try {
        Group::create(loop, o).get();
      } catch (const TimeoutError& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = std::string("wrong error type: ") + e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK(std::chrono::steady_clock::now() - start < 10s);
  for (int r = 0; r < 2; ++r) {
    INFO(errors[static_cast<std::size_t>(r)]);
    CHECK(errors[static_cast<std::size_t>(r)].find("ranks [2] never arrived") != std::string::npos);
    CHECK(errors[static_cast<std::size_t>(r)].find("bootstrap") != std::string::npos);
  }
}

TEST_CASE("a peer that leaves mid-collective fails every other rank's future", "[errors][peer]") {
  const long before = checks_made.load();
  std::atomic<int> survivors_done{0};
  run_ranks(4, [&](Group& g) {
    if (g.rank() == 3) {
      // Join one collective, then leave without joining the next: the Group's destructor closes its
      // connections, as a process that exits would.
      std::vector<float> x(1000, 1.0f);
      g.all_reduce(x).get();
      return;
    }
    // Survivors stay up until all of them have seen the failure (as they would to shrink and go on):
    // one that left at once would be a second failure, reported in its own name.
    struct StayUntilAllSurvivorsAreDone {
      std::atomic<int>& done;
      ~StayUntilAllSurvivorsAreDone() {
        done.fetch_add(1);
        while (done.load() < 3) std::this_thread::sleep_for(1ms);
      }
    } stay{survivors_done};
    std::vector<float> x(1000, 1.0f);
    g.all_reduce(x).get();
    std::vector<float> big(1 << 20, 1.0f);
    Future<void> f = g.all_reduce(big);
    const bool finished = f.wait_for(15s);
    check(finished, "the all_reduce hung after rank 3 left");
    try {
      f.get();
      check(false, "the all_reduce succeeded without rank 3");
    } catch (const PeerFailure& e) {
      check(std::string(e.what()).find("rank 3") != std::string::npos, std::string("failure does not name rank 3: ") + e.what());
      check(std::string(e.what()).find("all_reduce #2") != std::string::npos, std::string("failure does not name the op: ") + e.what());
    } catch (const Error& e) {
      // A rank whose own peer was alive may learn of the failure through that peer's abort.
      check(e.errc() == Errc::aborted && std::string(e.what()).find("rank 3") != std::string::npos,
            std::string("unexpected error: ") + e.what());
    }
    // The group is failed now, and says so.
    expect_error([&] { (void)g.barrier(); }, Errc::group_failed, {"earlier operation failed"});
  });
  REQUIRE(checks_made.load() > before);
}

#ifdef WEFT_UNDER_THREAD_SANITIZER
constexpr bool under_thread_sanitizer = true;
#else
constexpr bool under_thread_sanitizer = false;
#endif

// [leaks]: the operation's frames are abandoned by design (the Loop ends under them), so LeakSanitizer
// runs it with leak detection off (tests/sanitize.sh); every other ASan check stays on.
TEST_CASE("a rank whose Loop ends with a send still being written: its peer fails at once, naming it", "[errors][peer][leaks]") {
  // Rank 1 leaves with a 64 MiB frame half written to rank 0, whose loop reads nothing for a while:
  // its Group dropped, then the harness destroys its Loop. Two ways:
  // (1) it cancels the send: the cancelled send's operation held the transport past the Loop's end, its
  //     connection stayed open with nobody behind it, and rank 0's barrier waited until its deadline
  //     (30 min). The loop's end now shuts the transport down (core/loop_users.hpp).
  // (2) it calls abort(reason): the abort frame is queued behind the data frame, and the loop's end
  //     closed the connection in the middle of the frame, so rank 0 read "closed in the middle of a
  //     frame" instead of the reason (every run on tcp, shm and uring). The loop's end now lets the
  //     frames that say why go out first (end_flush_limit).
  // The send's buffer outlives both Loops: the dropped Future's write still reads it until it ends.
  static std::vector<float> big(16 << 20, 1.0f);
  for (const bool abort : {false, true}) {
    INFO((abort ? "abort(reason), then leave" : "cancel the send, then leave"));
    const long before = checks_made.load();
    std::atomic<bool> left{false};
    run_ranks(2, [&](Group& g) {
      if (g.rank() == 1) {
        Future<void> send = g.send(big, 0, 5);
        std::this_thread::sleep_for(200ms);
        if (abort) {
          g.abort("stopping early");
        } else {
          send.cancel();
        }
        g = Group();  // the last handle
        left = true;
        return;  // the harness destroys this rank's Loop now
      }
      // Rank 0's loop reads nothing meanwhile (for less than the stuck-frame grace of 1 s in (2), after
      // which a frame that does not move is cut and the reason is lost).
      g.loop().post([abort] { std::this_thread::sleep_for(abort ? 500ms : 1s); });
      while (!left) std::this_thread::sleep_for(1ms);
      Future<void> barrier = g.barrier();
      check(barrier.wait_for(20s), "rank 0's barrier waited on for rank 1, whose Loop had ended");
      try {
        barrier.get();
        check(false, "a barrier succeeded after rank 1 left");
      } catch (const Error& e) {
        const std::string what = e.what();
        check(what.find("rank 1") != std::string::npos, "rank 1 not named: " + what);
        // Under TSan a shm ring's copies are plain, instrumented loops (core/sanitizer.hpp), about 5 MB/s
        // here: the 64 MiB frame cannot go out within the loop end's flush limit (2 s), so the end cuts
        // it and the reason is lost (seen 3 of 3 runs, 2026-12-06); the peer is still named above.
        if (abort && !under_thread_sanitizer) check(what.find("rank 1 called abort(): stopping early") != std::string::npos, "the reason did not arrive: " + what);
      }
    });
    REQUIRE(checks_made.load() > before);
  }
}

TEST_CASE("messages that no receive took are named when their group closes", "[errors][mismatch]") {
  // A send without its receive completes (its bytes wait at the receiver) and nothing fails: ranks whose
  // plans differ (rank 0 sends, rank 1's plan receives nothing), or a point-to-point message nobody
  // receives. Before 2026-11-29 they were dropped without a word when the group closed. A later message
  // on the same connection (tag 9) is the fence that has them arrive before the group closes.
  LogCapture log;
  run_ranks(2, [](Group& g) {
    std::vector<float> x(4, 1.0f), y(4, 0.0f);
    algorithms::Plan plan;
    if (g.rank() == 0) plan.push_back(algorithms::Step{algorithms::StepKind::send, 1, -1, {0, 4}, {}});
    g.run_plan(plan, algorithms::PlanBuffers{reinterpret_cast<const std::byte*>(x.data()), reinterpret_cast<std::byte*>(y.data()), DType::f32}).get();
    if (g.rank() == 0) {
      g.send(x, 1, 7).get();
      g.send(x, 1, 9).get();
    } else {
      g.recv(y, 0, 9).get();
    }
    g.barrier().get();
  });
  INFO(log.text());
  CHECK(log.count({"rank 1: a group closed with 2 messages (32 bytes) that no receive of this rank took",
                   "from rank 0: a plan #1 (f32", "from rank 0: a point-to-point message of f32 [tag 7], 16 bytes"}) == 1);
  CHECK(log.count({"rank 0: a group closed with"}) == 0);

  // A group that closes with every message received says nothing.
  LogCapture quiet;
  run_ranks(2, [](Group& g) {
    std::vector<float> x(4, 1.0f);
    if (g.rank() == 0) g.send(x, 1, 7).get();
    else g.recv(x, 0, 7).get();
    g.all_reduce(x).get();
  });
  CHECK(quiet.count({"a group closed with"}) == 0);
}

TEST_CASE("ranks that disagree on the size of a collective fail instead of hanging", "[errors][mismatch]") {
  const long before = checks_made.load();
  run_ranks(3, [](Group& g) {
    std::vector<float> x(g.rank() == 1 ? 600 : 300, 1.0f);
    Future<void> f = g.all_reduce(x);
    check(f.wait_for(15s), "a mismatched all_reduce hung");
    // The counts differ, so the signatures do: named as a mismatch of calls (or relayed by a peer).
    expect_error([&] { f.get(); }, {Errc::mismatch, Errc::aborted}, {"all_reduce #1 (f32 x 600, sum)", "all_reduce #1 (f32 x 300, sum)"});
  });
  REQUIRE(checks_made.load() > before);
}

namespace {

// Runs `call(g)` on 2 ranks: it must fail within 15 s with Errc::mismatch (found here) or Errc::aborted
// (relayed by the peer that found it), with a message that contains every one of `words`, and the group
// is failed afterwards. `may_complete`: a call that receives nothing (both ranks a root that only sends)
// can complete before the peer's frame shows the mismatch; then the next call must fail, naming both.
void expect_mismatch(const std::function<Future<void>(Group&)>& call, std::initializer_list<std::string> words,
                     bool may_complete = false, int ranks = 2, Errc found_as = Errc::mismatch) {
  const long before = checks_made.load();
  // Every rank keeps its group until all have seen their outcome: a rank that shut down at once could
  // close its connections before its abort frame left (docs/RELIABILITY.md, known gaps), and the others
  // would see a lost peer instead of the mismatch. A rank whose check threw leaves without waiting.
  std::latch checked(ranks);
  struct Arrival {
    std::latch& latch;
    bool waited = false;
    void wait() {
      waited = true;
      latch.arrive_and_wait();
    }
    ~Arrival() {
      if (!waited) latch.count_down();
    }
  };
  run_ranks(ranks, [&](Group& g) {
    Arrival arrival{checked};
    Future<void> f = call(g);
    check(f.wait_for(15s), "a mismatched collective hung");
    try {
      f.get();
      check(may_complete, "a mismatched collective succeeded");
      Future<void> next = g.barrier();
      check(next.wait_for(15s), "the call after a mismatch hung");
      expect_error([&] { next.get(); }, {found_as, Errc::aborted, Errc::group_failed}, words);
      arrival.wait();
      return;
    } catch (const Error&) {
      expect_error([] { throw; }, {found_as, Errc::aborted}, words);
    }
    try {
      g.barrier().get();
      check(false, "a barrier on the failed group completed");
    } catch (const Error& e) {
      // The earlier failure is quoted without a second "weft: " (it read "failed: weft: rank 1: ...").
      check(e.errc() == Errc::group_failed && std::string_view(e.what()).find("earlier operation failed") != std::string_view::npos &&
                std::string_view(e.what()).find("weft: ", 1) == std::string_view::npos,
            std::string("the refused barrier said: ") + e.what());
    }
    arrival.wait();
  });
  REQUIRE(checks_made.load() > before);
}

}  // namespace

TEST_CASE("ranks that call different collectives as the same operation fail, naming both calls", "[errors][mismatch]") {
  std::vector<float> a(1024, 1.0f), a0(1024, 1.0f), b(2048, 0.0f);
  SECTION("all_reduce against all_gather") {
    // Rank 0's all_reduce writes its buffer in place: not the one rank 1 sends from (threads of one process).
    expect_mismatch([&](Group& g) { return g.rank() == 0 ? g.all_reduce(a0) : g.all_gather(a, b); },
                    {"rank 1 called all_gather #1 (f32 x 1024)", "rank 0 called all_reduce #1 (f32 x 1024, sum)"});
  }
  // Small broadcasts over shm go through the root's box and do not wait for anyone (arena.hpp, "Boxes"):
  // the root may finish, and the rank in the all_reduce finds its stamp, or the reader finds the root in a
  // superstep. (A buffer per rank: the ranks are threads of this process, and readers write theirs.)
  std::vector<std::vector<float>> small(3, std::vector<float>(8, 1.0f));
  const auto mine = [&](const Group& g) -> std::vector<float>& { return small[static_cast<std::size_t>(g.rank())]; };
  SECTION("a small broadcast's root against an all_reduce") {
    expect_mismatch([&](Group& g) { return g.rank() == 0 ? g.broadcast(mine(g), 0) : g.all_reduce(mine(g)); },
                    {"broadcast #1 (f32 x 8, root 0)", "all_reduce #1 (f32 x 8, sum)"}, true);
  }
  SECTION("a small broadcast's reader against an all_reduce") {
    expect_mismatch([&](Group& g) { return g.rank() == 0 ? g.broadcast(mine(g), 1) : g.all_reduce(mine(g)); },
                    {"broadcast #1 (f32 x 8, root 1)", "all_reduce #1 (f32 x 8, sum)"}, true);
  }
  SECTION("3 ranks: a small broadcast's root and reader against an all_reduce") {
    expect_mismatch([&](Group& g) { return g.rank() == 0 ? g.all_reduce(mine(g)) : g.broadcast(mine(g), 1); },
                    {"#1"}, true, 3);
  }
}

TEST_CASE("a mismatch of any kind reaches every rank of 3: that operation fails, or the next one says why", "[errors][mismatch]") {
  // Issue 13: a root whose sends completed reported success while the others failed. Every rank that
  // took part must fail the operation or, where it finished before anyone could know, its next one.
  std::vector<float> f(8, 1.0f), g8(24, 0.0f), big(16, 1.0f);
  std::vector<std::int32_t> i(8, 1);
  // A buffer per rank wherever ranks write theirs (the ranks are threads of this process: ThreadSanitizer
  // caught the in-place all_reduces sharing `f`; over shm a small broadcast's reader copies from its root's
  // box while the roots read theirs).
  std::vector<std::vector<float>> each(4, f);
  const auto mine = [&](const Group& g) -> std::vector<float>& { return each[static_cast<std::size_t>(g.rank())]; };
  SECTION("op") {
    expect_mismatch([&](Group& g) { return g.all_reduce(mine(g), g.rank() == 2 ? ReduceOp::max : ReduceOp::sum); },
                    {"all_reduce #1"}, false, 3);
  }
  SECTION("dtype") {
    expect_mismatch([&](Group& g) { return g.rank() == 1 ? g.all_reduce(i) : g.all_reduce(mine(g)); }, {"all_reduce #1"}, false, 3);
  }
  SECTION("count") {
    expect_mismatch([&](Group& g) { return g.rank() == 0 ? g.all_reduce(big) : g.all_reduce(mine(g)); }, {"all_reduce #1"}, false, 3);
  }
  SECTION("root: the root alone says root 0, the others say root 1") {
    expect_mismatch([&](Group& g) { return g.broadcast(mine(g), g.rank() == 0 ? 0 : 1); }, {"broadcast #1"}, true, 3);
  }
  SECTION("root: every rank its own root (on 3 and 4 ranks the chain, where each rank then only sends)") {
    expect_mismatch([&](Group& g) { return g.broadcast(mine(g), g.rank()); }, {"broadcast #1"}, true, 3);
    expect_mismatch([&](Group& g) { return g.broadcast(mine(g), g.rank()); }, {"broadcast #1"}, true, 4);
  }
  SECTION("root: two ranks say root 2, two say root 0: nobody is a root to all of them, so nothing is sent") {
    // As for the reduce below: each rank waits for a rank that waits too, and the deadline's progress
    // answers carry each rank's call.
    expect_mismatch([&](Group& g) { return g.with_timeout(1500ms).broadcast(mine(g), g.rank() < 2 ? 2 : 0); },
                    {"broadcast #1", "root 2", "root 0"}, true, 4);
  }
  SECTION("root of a reduce: no rank sends anything to a rank that would notice, so the deadline says it") {
    // Ranks 0 and 1 say root 0, rank 2 says root 2: rank 0 waits for rank 2, rank 2 for the others, and no
    // frame meets a receive of another call. At the deadline the progress answers carry each rank's call.
    // One output per rank: two ranks believe they are the root and both write theirs (ThreadSanitizer
    // caught the shared one).
    std::vector<std::vector<float>> out(3, std::vector<float>(8));
    expect_mismatch([&](Group& g) { return g.with_timeout(1500ms).reduce(f, out[static_cast<std::size_t>(g.rank())], g.rank() == 2 ? 2 : 0); },
                    {"reduce #1", "the ranks called it differently", "root 2", "root 0"}, true, 3);
  }
  SECTION("collective") {
    expect_mismatch([&](Group& g) { return g.rank() == 2 ? g.all_gather(f, g8) : g.all_reduce(mine(g)); }, {"#1"}, false, 3);
  }
  SECTION("all_to_all's count, and all_to_all against all_reduce (a plan of whole messages: sends before receives)") {
    // Pairwise all_to_all runs as a MessagePlan: every rank's sends leave before its first receive is
    // posted, so each rank meets the mismatch in a frame that came early.
    std::vector<std::vector<float>> in(3), out(3);
    for (std::size_t r = 0; r < 3; ++r) {
      in[r].assign(r == 0 ? 6 : 3, 1.0f);
      out[r].assign(r == 0 ? 6 : 3, 0.0f);
    }
    expect_mismatch([&](Group& g) {
      const auto r = static_cast<std::size_t>(g.rank());
      return g.all_to_all(in[r], out[r]);
    }, {"all_to_all #1"}, false, 3);
    expect_mismatch([&](Group& g) {
      const auto r = static_cast<std::size_t>(g.rank());
      return g.rank() == 1 ? g.all_reduce(mine(g)) : g.all_to_all(in[r], out[r]);
    }, {"#1"}, false, 3);
  }
}

TEST_CASE("a mismatch that sends no frame is found within seconds, long before the deadline", "[errors][mismatch]") {
  // Ranks that disagree on a reduce's root each wait to receive, and no frame meets a receive of another
  // call: only the deadline's progress query found it (30 min by default; the cases above shorten the
  // deadline to 1.5 s). A collective stalled for 1 s now asks the members how they called it
  // (GroupState::check_calls). The deadline here is 10 minutes; expect_mismatch waits 15 s.
  std::vector<float> f(8, 1.0f);
  std::vector<std::vector<float>> out(4, std::vector<float>(8));  // two ranks believe they are the root
  std::vector<std::vector<float>> each(4, f);
  const auto mine = [](std::vector<std::vector<float>>& v, const Group& g) -> std::vector<float>& { return v[static_cast<std::size_t>(g.rank())]; };
  SECTION("reduce: ranks 0 and 1 say root 0, rank 2 says root 2") {
    expect_mismatch([&](Group& g) { return g.with_timeout(10min).reduce(f, mine(out, g), g.rank() == 2 ? 2 : 0); },
                    {"reduce #1", "has waited", "the ranks called it differently", "root 2", "root 0"}, true, 3);
  }
  SECTION("broadcast: two ranks say root 2, two say root 0") {
    expect_mismatch([&](Group& g) { return g.with_timeout(10min).broadcast(mine(each, g), g.rank() < 2 ? 2 : 0); },
                    {"broadcast #1", "root 2", "root 0"}, true, 4);
  }
  SECTION("reduce without a deadline (it waited forever)") {
    expect_mismatch([&](Group& g) { return g.without_deadline().reduce(f, mine(out, g), g.rank() == 2 ? 2 : 0); },
                    {"reduce #1", "has waited", "the ranks called it differently"}, true, 3);
  }
}

TEST_CASE("ranks that run one call with different algorithms (override_algorithms on one rank) fail naming both", "[errors][mismatch]") {
  // Rank 1 alone overrides its choice. Over tcp a tree against recursive doubling exchanged messages
  // of one size and ranks 0 and 1 completed all_reduce #1 with wrong sums; a ring against the group
  // arena waited out the deadline, "every rank had joined it". Each frame's signature now says the
  // algorithm that sent it (OpSignature::plan), and so do the progress answers.
  std::vector<std::vector<float>> each(3, std::vector<float>(8, 1.0f));
  for (const char* spec : {"all_reduce:tree", "all_reduce:ring"}) {
    DYNAMIC_SECTION(spec) {
      const std::string algorithm = std::string(spec).substr(std::string("all_reduce:").size());
      expect_mismatch([&](Group& g) {
        if (g.rank() == 1) g.override_algorithms(spec);
        return g.with_timeout(10min).all_reduce(each[static_cast<std::size_t>(g.rank())]);
      }, {"all_reduce #1", "as " + algorithm}, false, 3);
    }
  }
}

TEST_CASE("a collective called with a different dtype, op or root on one rank fails instead of mixing bytes", "[errors][mismatch]") {
  SECTION("dtype: f32 against i32 of the same size") {
    std::vector<float> f(8, 1.0f);
    std::vector<std::int32_t> i(8, 1);
    expect_mismatch([&](Group& g) { return g.rank() == 0 ? g.all_reduce(f) : g.all_reduce(i); },
                    {"all_reduce #1 (f32 x 8, sum)", "all_reduce #1 (i32 x 8, sum)"});
  }
  SECTION("reduce op: sum against max") {
    std::vector<float> f(8, 1.0f);
    expect_mismatch([&](Group& g) { return g.all_reduce(f, g.rank() == 0 ? ReduceOp::sum : ReduceOp::max); },
                    {"all_reduce #1 (f32 x 8, sum)", "all_reduce #1 (f32 x 8, max)"});
  }
  SECTION("root: 0 against 1") {
    std::vector<float> f(8, 1.0f);
    expect_mismatch([&](Group& g) { return g.broadcast(f, g.rank()); },
                    {"broadcast #1 (f32 x 8, root 0)", "broadcast #1 (f32 x 8, root 1)"}, true);
  }
}

TEST_CASE("variable-size collectives whose ranks disagree about the counts fail on every rank, naming the rank", "[errors][mismatch]") {
  // Buffers of their own per rank: the ranks are threads of this process.
  std::vector<std::vector<float>> ins(3, std::vector<float>(8, 1.0f)), outs(3, std::vector<float>(64, 0.0f));
  auto in_of = [&](const Group& g) -> std::vector<float>& { return ins[static_cast<std::size_t>(g.rank())]; };
  auto out_of = [&](const Group& g) -> std::vector<float>& { return outs[static_cast<std::size_t>(g.rank())]; };
  // Rank 2 believes rank 0 contributes 4 elements, the others 3: the counts are signed, so the rank that
  // meets rank 2's frames (or rank 2, meeting theirs) names it, whatever the sizes would have said.
  auto counts_of = [](const Group& g) {
    return g.rank() == 2 ? std::vector<std::size_t>{4, 2, 1} : std::vector<std::size_t>{3, 2, 1};
  };
  auto mine = [&](const Group& g, std::vector<float>& v) {
    return ConstBufferView(v.data(), counts_of(g)[static_cast<std::size_t>(g.rank())], DType::f32);
  };
  SECTION("all_gatherv") {
    expect_mismatch([&](Group& g) { return g.all_gatherv(mine(g, in_of(g)), out_of(g), counts_of(g)); },
                    {"all_gatherv #1 (f32, counts digest", "rank 2"}, false, 3);
  }
  SECTION("gatherv: the root finds it") {
    expect_mismatch([&](Group& g) { return g.gatherv(mine(g, in_of(g)), out_of(g), counts_of(g), 0); },
                    {"gatherv #1 (f32, counts digest", "rank 2", "root 0"}, true, 3);
  }
  SECTION("scatterv: the rank that differs finds it") {
    expect_mismatch([&](Group& g) {
      const auto counts = counts_of(g);
      return g.scatterv(in_of(g), BufferView(out_of(g).data(), counts[static_cast<std::size_t>(g.rank())], DType::f32), counts, 0);
    }, {"scatterv #1 (f32, counts digest", "rank 2"}, true, 3);
  }
  SECTION("reduce_scatterv") {
    expect_mismatch([&](Group& g) {
      const auto counts = counts_of(g);
      const std::size_t total = counts[0] + counts[1] + counts[2];
      return g.reduce_scatterv(ConstBufferView(out_of(g).data(), total, DType::f32),
                               BufferView(in_of(g).data(), counts[static_cast<std::size_t>(g.rank())], DType::f32), counts);
    }, {"reduce_scatterv #1 (f32, counts digest", "rank 2"}, false, 3);
  }
  SECTION("all_to_allv: rank 0 sends rank 1 three elements where rank 1 expects two") {
    // Counts differ by rank by nature: the receive's size names the sender.
    expect_mismatch([&](Group& g) {
      std::vector<std::size_t> sends{1, 1, 1}, recvs{1, 1, 1};
      if (g.rank() == 0) sends[1] = 3;
      if (g.rank() == 1) recvs[0] = 2;
      return g.all_to_allv(in_of(g), out_of(g), sends, recvs);
    }, {"all_to_allv #1", "rank 0 sent 12 bytes", "expected 8"}, true, 3, Errc::size_mismatch);
  }
  SECTION("all_to_allv: a pair that disagrees about an empty message is found, not waited on") {
    expect_mismatch([&](Group& g) {
      std::vector<std::size_t> sends{1, 1}, recvs{1, 1};
      if (g.rank() == 0) sends[1] = 0;
      return g.all_to_allv(in_of(g), out_of(g), sends, recvs);
    }, {"all_to_allv #1", "rank 0 sent 0 bytes", "expected 4"}, true, 2, Errc::size_mismatch);
  }
}

TEST_CASE("variable-size collectives refuse bad counts and displacements before anything is sent", "[errors][preconditions]") {
  const long before = checks_made.load();
  run_ranks(3, [](Group& g) {
    std::vector<float> f(32, 1.0f), out(32);
    const std::string me = fmt::format("rank {}", g.rank());
    const std::size_t mine = static_cast<std::size_t>(g.rank()) + 1;  // counts {1, 2, 3}
    const std::vector<std::size_t> counts{1, 2, 3};
    const ConstBufferView in(f.data(), mine, DType::f32);
    expect_error([&] { (void)g.all_gatherv(in, out, {1, 2}); }, Errc::invalid_argument, {me, "all_gatherv", "counts has 2 entries", "group of 3"});
    expect_error([&] { (void)g.all_gatherv(in, out, counts, {0, 1}); }, Errc::invalid_argument, {"all_gatherv", "displs has 2 entries"});
    expect_error([&] { (void)g.all_gatherv(ConstBufferView(f.data(), 7, DType::f32), out, counts); }, Errc::invalid_argument,
                 {"all_gatherv", "input has 7 elements, expected " + std::to_string(mine)});
    expect_error([&] { (void)g.all_gatherv(in, BufferView(out.data(), 5, DType::f32), counts); }, Errc::invalid_argument,
                 {"all_gatherv", "output has 5 elements, but its blocks reach element 6"});
    expect_error([&] { (void)g.all_gatherv(in, out, counts, {0, 0, 10}); }, Errc::invalid_argument,
                 {"all_gatherv", "output blocks of ranks 0 ([0, 1)) and 1 ([0, 2)) overlap"});
    std::vector<float> adjacent(13);  // blocks that touch do not overlap
    g.all_gatherv(in, adjacent, counts, {0, 1, 10}).get();
    check(adjacent[0] == 1.0f && adjacent[2] == 1.0f && adjacent[12] == 1.0f && adjacent[3] == 0.0f, "adjacent blocks gathered");
    expect_error([&] { (void)g.all_gatherv(in, out, counts, {4, 0, 1}); }, Errc::invalid_argument, {"overlap"});
    expect_error([&] { (void)g.gatherv(in, out, counts, 3); }, Errc::invalid_argument, {"gatherv", "root 3"});
    expect_error([&] { (void)g.scatterv(f, BufferView(out.data(), 9, DType::f32), counts, 0); }, Errc::invalid_argument,
                 {"scatterv", "output has 9 elements, expected " + std::to_string(mine)});
    expect_error([&] { (void)g.reduce_scatterv(ConstBufferView(f.data(), 5, DType::f32), BufferView(out.data(), mine, DType::f32), counts); },
                 Errc::invalid_argument, {"reduce_scatterv", "input has 5 elements, expected 6"});
    expect_error([&] { (void)g.reduce_scatterv(ConstBufferView(f.data(), 6, DType::f32), BufferView(out.data(), mine, DType::f32), counts,
                                                ReduceOp::bitwise_or); },
                 Errc::invalid_argument, {"reduce_scatterv", "bor", "f32"});
    std::vector<std::size_t> sends{1, 1, 1}, recvs{1, 1, 1};
    recvs[static_cast<std::size_t>(g.rank())] = 2;
    expect_error([&] { (void)g.all_to_allv(f, out, sends, recvs); }, Errc::invalid_argument,
                 {"all_to_allv", "sends itself send_counts[" + std::to_string(g.rank()) + "] = 1 elements but receives"});
    expect_error([&] { (void)g.all_to_allv(ConstBufferView(f.data(), 2, DType::f32), out, {1, 1, 1}, {1, 1, 1}); }, Errc::invalid_argument,
                 {"all_to_allv", "input has 2 elements, but its blocks reach element 3"});
    expect_error([&] { (void)g.all_to_allv(f, out, {1, 1, 1}, {1, 1, 1}, {}, {0, 0, 5}); }, Errc::invalid_argument,
                 {"all_to_allv", "overlap", "recv_displs"});
    const std::vector<std::size_t> huge{std::size_t{1} << 46, std::size_t{1} << 46, std::size_t{1} << 46};
    expect_error([&] { (void)g.all_gatherv(in, out, huge); }, Errc::invalid_argument, {"all_gatherv", "add up to more than a buffer can hold"});
    // Nothing was sent and no sequence number was used: the group still works.
    std::vector<float> got(6, 0.0f);
    g.all_gatherv(ConstBufferView(f.data(), mine, DType::f32), got, counts).get();
    check(got == std::vector<float>(6, 1.0f), "the group works after refused calls");
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a receive of the wrong size fails and nothing is truncated", "[errors][mismatch]") {
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    if (g.rank() == 0) {
      std::vector<std::int32_t> v(10, 1);
      g.send(v, 1, 3).get();
      g.send(v, 1, 4).get();
      // Numbered among this rank's sends to rank 1: two so far, so a refused one would be the third and
      // takes no number (the next is the third again); the group's collectives do not count.
      g.barrier().get();
      const BufferView null_data(nullptr, 4, DType::i32);
      expect_error([&] { (void)g.send(null_data, 1, 7); }, Errc::invalid_argument, {"rank 0: send #3 (peer 1) [tag 7]", "null"});
      g.send(v, 1, 5).get();
    } else {
      std::vector<std::int32_t> small(4, 0);
      // The first receive from rank 0, named with its number, the peer and the tag.
      expect_error([&] { g.recv(small, 0, 3).get(); }, Errc::size_mismatch,
                   {"rank 1: recv #1 (peer 0) [tag 3]", "sent 40 bytes", "expected 16"});
      std::vector<std::int32_t> right(10, 0);
      g.recv(right, 0, 4).get();  // point-to-point errors leave the group usable
      check(right[9] == 1, "the next message arrived intact");
      g.barrier().get();
      try {
        g.recv(small, 0, 5).get();
        check(false, "a short receive of the third message was taken");
      } catch (const Error& e) {
        check(e.context().seq == 3 && e.context().peer == 0 && e.context().tag == 5 && e.context().op == "recv", e.what());
      }
    }
  });
  REQUIRE(checks_made.load() > before);
}

// A message is signed with its dtype: a receive into another dtype of the same size fails instead of
// reinterpreting the bytes (f32 read as i32), whichever way the message met it (posted first, arrived
// first, sent to itself); u8 is raw bytes and agrees with every dtype, either side.
TEST_CASE("a receive into another dtype fails (u8 agrees with any) and the group stays usable", "[errors][mismatch]") {
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    const std::vector<float> f32s{1.5f, 2.5f, 3.5f, 4.5f};
    const std::vector<double> f64s{1.5, 2.5};
    std::vector<std::uint8_t> bytes(16);
    std::memcpy(bytes.data(), f32s.data(), bytes.size());
    if (g.rank() == 0) {
      g.barrier().get();  // rank 1's receive of tag 1 is posted
      g.send(f32s, 1, 1).get();
      g.send(f32s, 1, 2).get();  // arrives before its receive
      g.barrier().get();
      g.send(bytes, 1, 3).get();
      g.send(f32s, 1, 4).get();
      g.send(f64s, 1, 5).get();
    } else {
      std::vector<std::int32_t> ints(4, 0);
      Future<void> posted = g.recv(ints, 0, 1);
      g.barrier().get();
      expect_error([&] { posted.get(); }, Errc::mismatch,
                   {"rank 1: recv #1 (peer 0) [tag 1]", "rank 0 sent f32 data where rank 1 receives i32", "mismatched operation"});
      g.barrier().get();
      expect_error([&] { g.recv(ints, 0, 2).get(); }, Errc::mismatch, {"recv #2 (peer 0) [tag 2]", "sent f32 data where rank 1 receives i32"});
      std::vector<float> typed(4, 0.0f);
      g.recv(typed, 0, 3).get();  // sent as u8, received as f32
      check(typed == f32s, "bytes sent as u8 arrive intact as f32");
      std::vector<std::uint8_t> raw(16, 0);
      g.recv(raw, 0, 4).get();  // sent as f32, received as u8
      check(raw == bytes, "f32 received as u8 arrives intact");
      expect_error([&] { g.recv(typed, 0, 5).get(); }, Errc::mismatch, {"recv #5 (peer 0) [tag 5]", "sent f64 data where rank 1 receives f32"});
    }
    // To itself, the same.
    g.send(f32s, g.rank(), 6).get();
    std::vector<std::int32_t> mine(4, 0);
    expect_error([&] { g.recv(mine, g.rank(), 6).get(); }, Errc::mismatch, {"receives i32"});
    std::vector<float> x{1.0f};
    g.all_reduce(x).get();
    check(x[0] == 2.0f, "the group works after mismatched receives");
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a cancelled receive is withdrawn and the group stays usable", "[errors][cancel]") {
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    std::vector<float> v(4);
    if (g.rank() == 1) {
      Future<void> f = g.recv(v, 0, 99);  // nobody sends this
      f.cancel();
      try {
        f.get();
        check(false, "a cancelled receive succeeded");
      } catch (const CancelledError& e) {
        check(std::string(e.what()).find("recv") != std::string::npos, e.what());
      }
    }
    std::vector<float> x{1.0f};
    g.all_reduce(x).get();
    check(x[0] == 2.0f, "the group works after a cancelled receive");
  });
  REQUIRE(checks_made.load() > before);
}

// The other ways a cancel reaches a receive: the Task that awaits it (its stop token, forwarded by the
// Future's awaiter), when_all after a sibling failed, and a cancel whose Future is dropped at once (the
// loop withdraws the receive later, from a reference the cancel made: the operation keeps none to
// itself). None may take a message meant for a later receive.
TEST_CASE("a receive cancelled through its awaiting Task, through when_all, or dropped right after its cancel, is withdrawn", "[errors][cancel]") {
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    std::vector<float> v(4, 0.0f);
    if (g.rank() == 1) {
      auto awaiting = [](Group& g, std::vector<float>& v) -> Task<void> { co_await g.recv(v, 0, 97); };
      Future<void> task = spawn(g.loop(), awaiting(g, v));
      task.cancel();
      check(task.wait_for(20s), "the cancel of the Task never reached the receive it awaits");
      expect_error([&] { task.get(); }, Errc::cancelled, {"recv"});
      auto failing = []() -> Task<void> {
        throw std::logic_error("a sibling failed");
        co_return;
      };
      std::vector<Future<void>> pair;
      pair.push_back(g.recv(v, 0, 97));
      pair.push_back(spawn(g.loop(), failing()));
      std::string failure;
      try {
        sync_wait(g.loop(), when_all(std::move(pair)));
      } catch (const std::logic_error& e) {
        failure = e.what();
      }
      check(failure == "a sibling failed", "when_all did not fail with its failing child: " + failure);
      for (int i = 0; i < 100; ++i) {
        Future<void> dropped = g.recv(v, 0, 97);
        dropped.cancel();
      }
    }
    g.barrier().get();
    // One message of tag 97 now: only a receive made after the cancels may take it.
    if (g.rank() == 0) {
      std::vector<float> sent{1.0f, 2.0f, 3.0f, 4.0f};
      g.send(sent, 1, 97).get();
    } else {
      std::vector<float> got(4, 0.0f);
      Future<void> received = g.recv(got, 0, 97);
      check(received.wait_for(20s), "the receive after the cancelled ones never got the message (a cancelled one took it)");
      received.get();
      check(got == std::vector<float>{1.0f, 2.0f, 3.0f, 4.0f}, "a receive after the cancelled ones got the message");
    }
    std::vector<float> x{1.0f};
    g.all_reduce(x).get();
    check(x[0] == 2.0f, "the group works after the cancelled receives");
  });
  REQUIRE(checks_made.load() > before);
}

namespace {

// all_reduce #1 of `x`, which rank 0 cancels 50 ms after its call while rank `late` comes 500 ms late:
// every rank must fail it as cancelled.
void cancel_with_a_late_rank(Group& g, int late, std::vector<float>& x) {
  if (g.rank() == late) {
    // The late rank calls the collective after rank 0 cancelled it: its call fails at once.
    std::this_thread::sleep_for(500ms);
    expect_error([&] { g.all_reduce(x).get(); }, Errc::cancelled, {"rank 0 cancelled all_reduce #1"});
    return;
  }
  Future<void> f = g.all_reduce(x);
  if (g.rank() == 0) {
    std::this_thread::sleep_for(50ms);
    f.cancel();
  }
  check(f.wait_for(15s), "the all_reduce hung after rank 0 cancelled it");
  // Rank 0 sees its own cancellation; the other rank in the operation learns it from the cancel frame
  // (or, over shm, from the arena), naming rank 0.
  expect_error([&] { f.get(); }, Errc::cancelled, {g.rank() == 0 ? "cancelled" : "rank 0 cancelled all_reduce #1"});
}

}  // namespace

TEST_CASE("a cancelled collective is cancelled on every rank, and the group goes on", "[errors][cancel]") {
  const long before = checks_made.load();
  for (const int late : {1, 2}) {
    run_ranks(3, [&](Group& g) {
      std::vector<float> x(1000, 1.0f);
      cancel_with_a_late_rank(g, late, x);
      // The group is still usable: the next collective is correct everywhere.
      std::vector<float> y(1001, static_cast<float>(g.rank() + 1));
      g.all_reduce(y).get();
      check(y[0] == 6.0f && y[1000] == 6.0f, "the group works after a cancelled collective");
    });
  }
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a collective cancelled while its peer never joins leaves nothing behind when the group and its loop end", "[errors][cancel]") {
  // Over shm the cancelled collective's remaining supersteps go on in the background, holding the group;
  // rank 0 drops its group and ends its loop long before rank 1 leaves. They stop when the last handle
  // goes (2026-11-29: they stayed suspended, and the group and its transport leaked; the ASan suite runs
  // this over shm with leak detection, tests/sanitize.sh).
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    std::vector<float> x(1025, 1.0f);
    if (g.rank() == 0) {
      Future<void> f = g.all_reduce(x);
      std::this_thread::sleep_for(50ms);
      f.cancel();
      expect_error([&] { f.get(); }, Errc::cancelled, {"cancelled"});
    } else {
      std::this_thread::sleep_for(500ms);  // joins nothing, and leaves after rank 0 is gone
    }
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a small broadcast cancelled while its root is late is cancelled on every rank, and small broadcasts go on", "[errors][cancel]") {
  // Over shm a broadcast this small goes through the root's box (arena.hpp, "Boxes"): the readers wait
  // for the root's slot, the cancel ends their wait, and the late root fails at once; every rank's box
  // count must still agree for the broadcasts after it.
  const long before = checks_made.load();
  run_ranks(3, [&](Group& g) {
    std::vector<float> x(6, g.rank() == 2 ? 5.0f : 0.0f);
    if (g.rank() == 2) {
      std::this_thread::sleep_for(500ms);
      expect_error([&] { g.broadcast(x, 2).get(); }, Errc::cancelled, {"rank 0 cancelled broadcast #1"});
    } else {
      Future<void> f = g.broadcast(x, 2);
      if (g.rank() == 0) {
        std::this_thread::sleep_for(50ms);
        f.cancel();
      }
      check(f.wait_for(15s), "the broadcast hung after rank 0 cancelled it");
      expect_error([&] { f.get(); }, Errc::cancelled, {g.rank() == 0 ? "cancelled" : "rank 0 cancelled broadcast #1"});
    }
    for (int i = 0; i < 50; ++i) {
      const int root = i % g.size();
      std::vector<float> y(1 + i % 7, g.rank() == root ? static_cast<float>(i) : -1.0f);
      g.broadcast(y, root).get();
      check(std::all_of(y.begin(), y.end(), [&](float v) { return v == static_cast<float>(i); }),
            fmt::format("broadcast {} after the cancelled one", i));
    }
    std::vector<float> z(3, static_cast<float>(g.rank() + 1));
    g.all_reduce(z).get();
    check(z[2] == 6.0f, "an all_reduce after the cancelled broadcast");
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a root that cancels a large broadcast and reuses its buffer at once never leaves a reader with a mix", "[errors][cancel]") {
  // Where the group arena reads a broadcast straight out of the root's buffer (arena.hpp, "Direct
  // reads"; broadcast only with WEFT_SHM_ARENA_CMA_BYTES set: the suite's "arena direct" variant) the
  // reader copies 64 MiB for milliseconds, while the root's cancel can end the root's wait for the
  // second superstep, whose Future fails, and the root overwrites its buffer at once. The root takes its
  // loan back before its Future fails, and a reader that read across that must fail too (cancelled),
  // never finish with a mix of the two contents. (Without the revoke each of 3 runs here ended with one:
  // 4.6-13.6 million of the 16.8 million elements not the root's, 2026-12-02; an all_gather, whose ranks
  // read each other at the same time, did not show it.) Elsewhere the check is the same: the root's
  // bytes whole, or cancelled.
  const long before = checks_made.load();
  run_ranks(2, [&](Group& g) {
    const std::size_t n = std::size_t{16} << 20;  // 64 MiB of f32
    std::vector<float> x(n);
    for (const int delay_us : {100, 500, 2000, 5000}) {
      std::fill(x.begin(), x.end(), g.rank() == 0 ? 1.0f : 0.0f);
      Future<void> f = g.broadcast(x, 0);
      if (g.rank() == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
        f.cancel();
      }
      check(f.wait_for(30s), fmt::format("the broadcast cancelled after {} us hung", delay_us));
      try {
        f.get();
        if (g.rank() == 1) {
          const auto wrong = std::count_if(x.begin(), x.end(), [](float v) { return v != 1.0f; });
          check(wrong == 0, fmt::format("rank 1's broadcast finished with {} of {} elements not the root's (cancelled after {} us)",
                                        wrong, n, delay_us));
        }
      } catch (const Error& e) {
        check(e.errc() == Errc::cancelled, fmt::format("rank {}: {}", g.rank(), e.what()));
      }
      if (g.rank() == 0) std::fill(x.begin(), x.end(), 2.0f);  // reused as soon as the Future is done
    }
    // The group goes on: a broadcast after the cancelled ones is whole.
    std::vector<float> y(std::size_t{1} << 16, g.rank() == 1 ? 3.0f : 0.0f);
    g.broadcast(y, 1).get();
    check(std::all_of(y.begin(), y.end(), [](float v) { return v == 3.0f; }), "a broadcast after the cancelled ones");
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a rank that cancels a large all_reduce and reuses its buffers at once never leaves its peer with a mix", "[errors][cancel]") {
  // On 2 ranks that read each other's memory the arena's all_reduce reads the peer's input (its block
  // to reduce) and then its output (the peer's reduced block) straight from its buffers (shm_collectives.cpp,
  // all_reduce_directly): a rank whose cancel ends its operation early takes both loans back before its
  // Future fails and it overwrites its buffers. The peer must fail (cancelled) or finish with the sum,
  // never with a mix. Rank 1 writes into an output it never touched (every page a fault in its reads), so
  // that rank 0 finishes its reads first and its cancel, swept over the call's length, can come while rank
  // 1 still reads rank 0's output. (Without the revoke, 2026-12-02: a mix in each of 3 runs, 0.6-1.7 million of the 8.4 million
  // elements, with the cancel at 14-17 ms of about 28.) Elsewhere the check is the same.
  const long before = checks_made.load();
  run_ranks(2, [&](Group& g) {
    const std::size_t n = std::size_t{8} << 20;  // 32 MiB of f32
    std::vector<float> x(n), touched(g.rank() == 0 ? n : 0);
    for (int delay_us = 1000; delay_us <= 30000; delay_us += 500) {
      std::fill(x.begin(), x.end(), g.rank() == 0 ? 1.0f : 2.0f);
      std::unique_ptr<float[]> fresh(g.rank() == 1 ? new float[n] : nullptr);  // not touched: fresh pages
      float* y = g.rank() == 1 ? fresh.get() : touched.data();
      Future<void> f = g.all_reduce(x, BufferView(y, n, DType::f32));
      if (g.rank() == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
        f.cancel();
      }
      check(f.wait_for(30s), fmt::format("the all_reduce cancelled after {} us hung", delay_us));
      try {
        f.get();
        const auto wrong = std::count_if(y, y + n, [](float v) { return v != 3.0f; });
        check(wrong == 0, fmt::format("rank {}'s all_reduce finished with {} of {} elements not the sum (cancelled after {} us)",
                                      g.rank(), wrong, n, delay_us));
      } catch (const Error& e) {
        check(e.errc() == Errc::cancelled, fmt::format("rank {}: {}", g.rank(), e.what()));
      }
      if (g.rank() == 0) {  // reused as soon as the Future is done
        std::fill(y, y + n, 100.0f);  // the output first: what rank 1 reads last
        std::fill(x.begin(), x.end(), 100.0f);
      }
      g.barrier().get();  // rank 0's buffers freed only after rank 1 is done with this round
    }
    // The group goes on: an all_reduce after the cancelled ones is whole, in place.
    std::vector<float> z(std::size_t{1} << 20, static_cast<float>(g.rank() + 1));
    g.all_reduce(z).get();
    check(std::all_of(z.begin(), z.end(), [](float v) { return v == 3.0f; }), "an all_reduce after the cancelled ones");
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a collective of several steps cancelled halfway, with one rank late, leaves the group right for every kind after it", "[errors][cancel]") {
  // Over shm the arena keeps every rank in it: each rank fails the cancelled collective and finishes its
  // supersteps in the background (docs/DESIGN.md, "Direct shm collectives"), so the ones after it find
  // every rank's count where they expect it; elsewhere the cancel frame does it. 3 MiB: several chunks
  // of the arena's areas (the direct shm algorithms asked for at every size; without an arena they are
  // the built-in choice), and a late rank that comes after the cancel.
  const long before = checks_made.load();
  Options options;
  options.algorithms = "all_reduce:shm;all_gather:shm;broadcast:shm;reduce_scatter:shm";
  for (const int late : {1, 2}) {
    run_ranks(3, [&](Group& g) {
      std::vector<float> big(std::size_t{3} << 18, 1.0f);
      cancel_with_a_late_rank(g, late, big);
      // Every kind of collective after it, small and of several steps, in flight together.
      const int p = g.size();
      const int r = g.rank();
      for (const std::size_t n : {std::size_t{3}, std::size_t{1} << 19}) {
        std::vector<float> sum(n, static_cast<float>(r + 1));
        std::vector<float> in(n, static_cast<float>(r)), gathered(n * static_cast<std::size_t>(p));
        std::vector<float> bcast(n, r == 1 ? 7.0f : 0.0f);
        std::vector<float> blocks(n * static_cast<std::size_t>(p), 1.0f), mine(n);
        Future<void> a = g.all_reduce(sum);
        Future<void> b = g.all_gather(in, gathered);
        Future<void> c = g.broadcast(bcast, 1);
        Future<void> d = g.reduce_scatter(blocks, mine);
        Future<void> e = g.barrier();
        for (Future<void>* f : {&a, &b, &c, &d, &e}) {
          check(f->wait_for(30s), "a collective after the cancelled one hung");
          f->get();
        }
        check(sum.front() == 6.0f && sum.back() == 6.0f, "all_reduce after the cancel");
        check(gathered.front() == 0.0f && gathered.back() == static_cast<float>(p - 1), "all_gather after the cancel");
        check(bcast.front() == 7.0f && bcast.back() == 7.0f, "broadcast after the cancel");
        check(mine.front() == static_cast<float>(p) && mine.back() == static_cast<float>(p), "reduce_scatter after the cancel");
      }
      // And they ran in the arena: the ten collectives after the cancel take 20 supersteps there (a
      // group that left the arena on a cancel stopped at 1 or 2). Read once all are done: nothing else
      // writes the count then.
      if (const auto& arena = g.state()->arena) {
        // (The small broadcast went through the root's box, not a superstep.)
        check(arena->count() + arena->box_count() >= 20,
              fmt::format("only {} supersteps and {} box broadcasts in the arena: the collectives after the cancel left it",
                          arena->count(), arena->box_count()));
      }
    }, options);
  }
  REQUIRE(checks_made.load() > before);
}

namespace {

// A transport of rank 0 whose "rank 1" is a raw socket played by the test: what rank 1 writes, the
// transport reads as its peer's stream. `expect_lost(words)` posts a receive from rank 1 and checks that
// it fails with PeerFailure and a reason containing every one of `words`.
class RawPeer {
 public:
  explicit RawPeer(std::size_t early_limit = std::size_t{1} << 20, Integrity integrity = Integrity::off, FrameKeys keys = {}) {
    std::promise<void> ready;
    loop_.post([&] {
      asio::ip::tcp::acceptor acceptor(loop_.context(), {asio::ip::address_v4::loopback(), 0});
      raw_ = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in to{};
      to.sin_family = AF_INET;
      to.sin_port = htons(acceptor.local_endpoint().port());
      to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      check(::connect(raw_, reinterpret_cast<sockaddr*>(&to), sizeof to) == 0, "connect");
      std::vector<asio::ip::tcp::socket> sockets;
      sockets.emplace_back(loop_.context());
      sockets.emplace_back(acceptor.accept());
      transport_ = std::make_unique<FramedTransport>(
          loop_, 0, 2, std::move(sockets), "tcp", [this](asio::ip::tcp::socket socket, StreamEvents* events, int peer, std::weak_ptr<bool> alive) {
            return make_asio_stream(loop_, std::move(socket), events, peer, std::move(alive));
          });
      transport_->set_early_limit(early_limit);
      transport_->seal_frames(integrity, {FrameKeys{}, keys});
      transport_->open_context(1, {0, 1});
      ready.set_value();
    });
    ready.get_future().wait();
  }
  ~RawPeer() {
    std::promise<void> gone;
    loop_.post([&] {
      transport_.reset();
      gone.set_value();
    });
    gone.get_future().wait();
    if (raw_ >= 0) ::close(raw_);
  }

  void write(const void* data, std::size_t size) {
    REQUIRE(::send(raw_, data, size, MSG_NOSIGNAL) == static_cast<ssize_t>(size));
  }
  void write(const wire::Header& h, std::uint16_t version = wire::version) {
    wire::HeaderBytes bytes;
    wire::encode(h, bytes);
    bytes[4] = static_cast<std::byte>(version & 0xff);
    bytes[5] = static_cast<std::byte>(version >> 8);
    write(bytes.data(), bytes.size());
  }
  void hang_up() {
    ::close(raw_);
    raw_ = -1;
  }

  /// Receives `size` bytes of message (context 1, #seq) from rank 1 on the transport; returns the op's
  /// outcome and fills `into`.
  struct Received {
    std::error_code error;
    int failed_peer = -1;
    std::string reason;
  };
  Received receive(std::uint64_t seq, std::vector<std::byte>& into) {
    TransportOp op;
    auto wait = [&]() -> Task<void> {
      transport_->start_recv(1, MessageKey{1, seq, 0}, into.data(), into.size(), op);
      co_await op.wait();
    };
    sync_wait(loop_, wait());
    return Received{op.error(), op.failed_peer(), op.reason()};
  }

  void expect_lost(std::initializer_list<std::string> words) {
    std::vector<std::byte> buffer(8);
    TransportOp op;
    auto wait_for_failure = [&]() -> Task<void> {
      transport_->start_recv(1, MessageKey{1, 8, 0}, buffer.data(), buffer.size(), op);
      co_await op.wait();
    };
    sync_wait(loop_, wait_for_failure());
    CHECK(op.error() == make_error_code(Errc::peer_failure));
    CHECK(op.failed_peer() == 1);
    for (const auto& w : words) CHECK_THAT(op.reason(), Catch::Contains(w));
  }

 private:
  Loop loop_{Loop::Options{std::chrono::microseconds(0), false}};
  std::unique_ptr<FramedTransport> transport_;
  int raw_ = -1;
};

// A frame as a sealed peer writes it (transports/framed/integrity.hpp): header, its CRC-32C, payload,
// trailer from `seal` (the writer's side of the connection).
std::vector<std::byte> sealed_frame(const wire::Header& h, const std::vector<std::byte>& payload, FrameSeal& seal) {
  wire::HeaderBytes header;
  wire::encode(h, header);
  std::vector<std::byte> out(header.begin(), header.end());
  out.resize(out.size() + 4);
  le::put_u32(out.data() + wire::header_size, crc32c(0, header.data(), header.size()));
  out.insert(out.end(), payload.begin(), payload.end());
  seal.begin();
  seal.update(header.data(), header.size());
  seal.update(payload.data(), payload.size());
  std::array<std::byte, FrameSeal::max_trailer> trailer{};
  seal.seal(trailer.data());
  out.insert(out.end(), trailer.begin(), trailer.begin() + static_cast<std::ptrdiff_t>(seal.trailer_size()));
  return out;
}

wire::Header data_frame(std::uint64_t bytes) {
  wire::Header h;
  h.kind = wire::FrameKind::data;
  h.context = 1;
  h.seq = 7;
  h.bytes = bytes;
  return h;
}

}  // namespace

TEST_CASE("the early-message bound is shared among the ranks on the host", "[errors][hostile]") {
  // 4 ranks on a host may not each keep half the memory (twice the memory together): the default is half
  // divided by the launcher's local rank count (here WEFT_LOCAL_WORLD_SIZE=4), at least 1 GiB. A message
  // just over it, sent before its receive, is refused naming that limit; nothing of it is allocated.
  const std::size_t half = static_cast<std::size_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)) / 2;
  const std::size_t limit = std::max(std::size_t{1} << 30, half / 4);
  ::setenv("WEFT_LOCAL_WORLD_SIZE", "4", 1);
  const long before = checks_made.load();
  run_ranks(2, [&](Group& g) {
    if (g.rank() == 0) {
      // Uninitialised: the pages the refused write never reaches cost nothing.
      std::unique_ptr<std::uint8_t[]> big(new std::uint8_t[limit + 4096]);
      Future<void> f = g.send(ConstBufferView(big.get(), limit + 4096, DType::u8), 1, 9);
      check(f.wait_for(60s), "the refused send hung");
      expect_error([&] { f.get(); }, {Errc::peer_failure, Errc::aborted}, {});
    } else {
      std::vector<std::uint8_t> small(1);
      Future<void> f = g.recv(small, 0, 8);  // another tag: the big message arrives with no receive posted
      check(f.wait_for(60s), "the receive hung");
      expect_error([&] { f.get(); }, {Errc::peer_failure, Errc::aborted},
                   {fmt::format("the limit is {} bytes (WEFT_MAX_EARLY_BYTES)", limit)});
    }
  });
  ::unsetenv("WEFT_LOCAL_WORLD_SIZE");
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a forged length from a peer fails its connection, naming the sizes, and allocates nothing", "[errors][hostile]") {
  RawPeer peer;
  peer.write(data_frame(std::uint64_t{1} << 50));  // 2^50 bytes claimed, no receive posted for it
  peer.expect_lost({"a message of 1125899906842624 bytes arrived before its receive",
                    "the limit is 1048576 bytes (WEFT_MAX_EARLY_BYTES)"});
}

TEST_CASE("a peer that breaks the protocol loses its connection with the reason logged, and nothing hangs", "[errors][hostile]") {
  SECTION("wrong magic") {
    RawPeer peer;
    std::array<std::byte, wire::header_size> bytes{};
    bytes.fill(std::byte{0x41});
    peer.write(bytes.data(), bytes.size());
    peer.expect_lost({"protocol error from rank 1", "bad magic 0x41414141 (expected 0x54464557)"});
  }
  SECTION("wrong version") {
    RawPeer peer;
    peer.write(data_frame(0), 1);
    peer.expect_lost({"protocol error from rank 1", "protocol version 1 (this build speaks 2)"});
  }
  SECTION("unknown frame kinds: 9, and 2, protocol 1's retired hello") {
    for (int kind : {9, 2}) {
      RawPeer peer;
      wire::Header h = data_frame(0);
      h.kind = static_cast<wire::FrameKind>(kind);
      peer.write(h);
      peer.expect_lost({"protocol error from rank 1", fmt::format("unknown frame kind {}", kind)});
    }
  }
  SECTION("a control frame over 64 KiB") {
    RawPeer peer;
    wire::Header h = data_frame(1 << 20);
    h.kind = wire::FrameKind::abort;
    peer.write(h);
    peer.expect_lost({"protocol error from rank 1", "control frame of 1048576 bytes (limit 65536)"});
  }
  SECTION("random bytes") {
    RawPeer peer;
    std::vector<std::byte> noise(4096);
    std::uint32_t x = 12345;
    for (auto& b : noise) {
      x = x * 1664525u + 1013904223u;
      b = static_cast<std::byte>(x >> 24);
    }
    peer.write(noise.data(), noise.size());
    peer.expect_lost({"protocol error from rank 1", "bad magic"});
  }
  SECTION("half a header, then the peer hangs up") {
    RawPeer peer;
    wire::HeaderBytes bytes;
    wire::encode(data_frame(16), bytes);
    peer.write(bytes.data(), 20);
    peer.hang_up();
    peer.expect_lost({"connection to rank 1 lost", "the peer closed the connection in the middle of a frame"});
  }
  SECTION("a header and half its payload, then the peer hangs up") {
    RawPeer peer;
    peer.write(data_frame(4096));
    std::vector<std::byte> half(2048);
    peer.write(half.data(), half.size());
    peer.hang_up();
    peer.expect_lost({"connection to rank 1 lost", "the peer closed the connection in the middle of a frame"});
  }
}

TEST_CASE("a collective past its deadline fails on every rank, naming whom it waited for", "[errors][timeout]") {
  const long before = checks_made.load();
  Options options;
  options.timeout = 500ms;
  SECTION("2 ranks, rank 1 late") {
    run_ranks(2, [](Group& g) {
      std::vector<float> x(64, 1.0f);
      if (g.rank() == 1) std::this_thread::sleep_for(2s);
      const auto t0 = std::chrono::steady_clock::now();
      Future<void> f = g.all_reduce(x);
      check(f.wait_for(10s), "an all_reduce past its deadline hung");
      const auto took = std::chrono::steady_clock::now() - t0;
      if (g.rank() == 0) {
        // The deadline plus 1 s at most, as the issue asks.
        check(took < 1500ms, fmt::format("the deadline error took {} ms", std::chrono::duration_cast<std::chrono::milliseconds>(took).count()));
        // Rank 1 sleeps outside weft: its transport answers that it has not started #1, or not at all.
        expect_error([&] { f.get(); }, Errc::timeout, {"rank 0", "all_reduce #1 passed its deadline (500 ms) on rank 0, still waiting for rank 1",
                                                       "not joined: rank 1 ("});
      } else {
        // The late rank finds the operation aborted by rank 0, with rank 0's report.
        expect_error([&] { f.get(); }, Errc::aborted, {"rank 0 aborted", "still waiting for rank 1"});
      }
      expect_error([&] { g.barrier().get(); }, Errc::group_failed, {"earlier operation failed"});
    }, options);
  }
  SECTION("3 ranks, rank 2 late: nobody hangs") {
    run_ranks(3, [](Group& g) {
      std::vector<float> x(1000, 1.0f);
      if (g.rank() == 2) std::this_thread::sleep_for(2s);
      Future<void> f = g.all_reduce(x);
      check(f.wait_for(10s), "an all_reduce past its deadline hung");
      // Whichever rank reports, the report names rank 2, although in a ring rank 1 waits on rank 0.
      expect_error([&] { f.get(); }, {Errc::timeout, Errc::aborted}, {"passed its deadline (500 ms)", "not joined: rank 2 ("});
    }, options);
  }
  SECTION("4 ranks with progress threads, rank 3 busy: its transport answers that it has not joined") {
    harness_caller_drives = false;
    run_ranks(4, [](Group& g) {
      std::vector<float> x(1000, 1.0f);
      g.all_reduce(x).get();  // #1 everywhere
      if (g.rank() == 3) std::this_thread::sleep_for(2s);
      Future<void> f = g.all_reduce(x);  // #2
      check(f.wait_for(10s), "an all_reduce past its deadline hung");
      if (g.rank() != 3) {
        expect_error([&] { f.get(); }, {Errc::timeout, Errc::aborted}, {"all_reduce #2 passed its deadline", "not joined: rank 3 (its latest is #1)"});
      } else {
        expect_error([&] { f.get(); }, {Errc::timeout, Errc::aborted, Errc::group_failed}, {"not joined: rank 3 (its latest is #1)"});
      }
    }, options);
    harness_caller_drives = true;
  }
  SECTION("3 ranks, a small broadcast's root late: the readers' report names it; a root waits for nobody") {
    // Over shm this goes through the root's box (arena.hpp, "Boxes"): the readers wait for the root's
    // slot, and the deadline's report names the root.
    run_ranks(3, [](Group& g) {
      std::vector<float> x(4, 1.0f);
      if (g.rank() == 2) std::this_thread::sleep_for(2s);
      Future<void> f = g.broadcast(x, 2);
      check(f.wait_for(10s), "a broadcast past its deadline hung");
      expect_error([&] { f.get(); }, {Errc::timeout, Errc::aborted, Errc::group_failed}, {"broadcast #1", "not joined: rank 2 ("});
    }, options);
  }
  SECTION("4 ranks, rank 3 last into every collective, then busy: what it finished at the call counts as started") {
    // Arriving last, rank 3 finds every other rank's step published: over shm its collectives finish
    // on its own thread inside the call (the arena's fast path), and its transport must still answer
    // that it started them.
    run_ranks(4, [](Group& g) {
      std::vector<float> x(2, 1.0f);
      for (int i = 0; i < 5; ++i) {
        if (g.rank() == 3) std::this_thread::sleep_for(30ms);
        g.all_reduce(x).get();  // #1 .. #5
      }
      if (g.rank() == 3) std::this_thread::sleep_for(2s);
      Future<void> f = g.all_reduce(x);  // #6
      check(f.wait_for(10s), "an all_reduce past its deadline hung");
      if (g.rank() != 3) {
        expect_error([&] { f.get(); }, {Errc::timeout, Errc::aborted}, {"all_reduce #6 passed its deadline", "not joined: rank 3 (its latest is #5)"});
      } else {
        expect_error([&] { f.get(); }, {Errc::timeout, Errc::aborted, Errc::group_failed}, {"not joined: rank 3 (its latest is #5)"});
      }
    }, options);
  }
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a plan with a step of no kind, a range past memory or a null buffer is refused before anything is sent", "[errors][preconditions]") {
  namespace algo = weft::algorithms;
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    const int other = 1 - g.rank();
    std::vector<float> a(8, 1.0f), b(8, 0.0f);
    const algo::PlanBuffers buffers{reinterpret_cast<const std::byte*>(a.data()), reinterpret_cast<std::byte*>(b.data()), DType::f32,
                                    ReduceOp::sum};
    const auto exchange = [&](algo::Range send, algo::Range recv) {
      return algo::Plan{algo::Step{algo::StepKind::send_recv, other, other, send, recv}};
    };
    // A kind that is no StepKind hung both ranks; a range whose end wrapped wrote before the buffer.
    expect_error([&] { (void)g.run_plan({algo::Step{static_cast<algo::StepKind>(99), other, other, {0, 8}, {0, 8}}}, buffers); },
                 Errc::invalid_argument, {"plan", "step 0 has kind 99, which is no StepKind"});
    expect_error([&] { (void)g.run_plan(exchange({SIZE_MAX - 2, 4}, {0, 8}), buffers); }, Errc::invalid_argument,
                 {"step 0 (send_recv): its send range [18446744073709551613, +4) of f32 reaches past what memory can hold"});
    expect_error([&] { (void)g.run_plan(exchange({0, 8}, {std::size_t{1} << 46, 1}), buffers); }, Errc::invalid_argument, {"its recv range"});
    algo::PlanBuffers no_recv = buffers;
    no_recv.recv = nullptr;
    expect_error([&] { (void)g.run_plan(exchange({0, 8}, {0, 8}), no_recv); }, Errc::invalid_argument,
                 {"moves 8 elements through the receive buffer, which is null"});
    // A forwarding step sends from the receive buffer.
    expect_error([&] { (void)g.run_plan({algo::Step{algo::StepKind::recv_copy_send, other, other, {0, 8}, {0, 8}}}, no_recv); },
                 Errc::invalid_argument, {"recv_copy_send", "the receive buffer, which is null"});
    algo::PlanBuffers no_type = buffers;
    no_type.dtype = static_cast<DType>(99);
    expect_error([&] { (void)g.run_plan(exchange({0, 8}, {0, 8}), no_type); }, Errc::invalid_argument, {"dtype 99 is not a weft DType"});
    // Empty ranges move nothing: a null buffer is fine there. Then a real exchange.
    algo::PlanBuffers nothing{};
    g.run_plan(exchange({0, 0}, {0, 0}), nothing).get();
    g.run_plan(exchange({0, 8}, {0, 8}), buffers).get();
    check(b[0] == 1.0f && b[7] == 1.0f, "the plan after refused ones exchanged its buffers");
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a transpose refused at the call leaves its buffers alone, and a null or short one is refused, not copied", "[errors][preconditions]") {
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    std::vector<float> cotangent(8, 3.0f), gradient(8, 7.0f);
    // The broadcast transpose zeroed a non-root's gradient before its reduce refused the root.
    expect_error([&] { (void)apply_transpose(g, Collective::broadcast, cotangent, gradient, ReduceOp::sum, 5); }, Errc::invalid_argument,
                 {"apply_transpose", "root 5"});
    check(gradient[0] == 7.0f && gradient[7] == 7.0f, "a refused transpose wrote nothing");
    // A null gradient of 8 elements: memset(nullptr) on the non-root before.
    const BufferView null_gradient(nullptr, 8, DType::f32);
    expect_error([&] { (void)apply_transpose(g, Collective::broadcast, cotangent, null_gradient, ReduceOp::sum, 0); },
                 Errc::invalid_argument, {"is null with 8 elements"});
    // The reduce transpose's root copied the gradient's size out of the cotangent, however short: alone
    // (each rank a group of one), so that only the refusing root is involved.
    Group alone = g.split(g.rank(), 0).get();
    const ConstBufferView short_cotangent(cotangent.data(), 4, DType::f32);
    expect_error([&] { (void)apply_transpose(alone, Collective::reduce, short_cotangent, gradient, ReduceOp::sum, 0); },
                 Errc::invalid_argument, {"the cotangent has 4 elements, expected 8"});
    const BufferView on_device(gradient.data(), 8, DType::f32, Device{Device::Kind::cuda, 0});
    expect_error([&] { (void)apply_transpose(alone, Collective::reduce, cotangent, on_device, ReduceOp::sum, 0); },
                 Errc::invalid_argument, {"gradient is device memory"});
    apply_transpose(alone, Collective::reduce, cotangent, gradient, ReduceOp::sum, 0).get();
    check(gradient[0] == 3.0f, "the reduce transpose alone copies the cotangent");
    // The group goes on: a broadcast transpose (the root's gradient sums every cotangent).
    apply_transpose(g, Collective::broadcast, cotangent, gradient, ReduceOp::sum, 0).get();
    check(gradient[0] == (g.rank() == 0 ? 6.0f : 0.0f), "the broadcast transpose after refused ones");
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("variables read lazily (WEFT_INLINE_SPIN_US and others) are refused at the group's creation when malformed", "[errors][preconditions]") {
  const auto env_with = [](const char* value) { return environment_with(value, {"WEFT_INLINE_SPIN_US"}); };
  for (const char* bad : {"-1", "abc", "99999999999999999999"}) {
    expect_error([&] { Options{}.from_environment(env_with(bad)); }, Errc::invalid_argument,
                 {"WEFT_INLINE_SPIN_US='", "is not a whole number of microseconds"});
  }
  Options{}.from_environment(env_with("0"));
  Options{}.from_environment(env_with("50"));
  // Read lazily as well, and silently wrong before: "four" local ranks meant the next convention's
  // count (or 1), WEFT_DEVICE_IPC=yes meant off.
  for (const char* bad : {"four", "0", "-2", "99999999999"}) {
    expect_error([&] { Options{}.from_environment(environment_with(bad, {"WEFT_LOCAL_WORLD_SIZE"})); }, Errc::invalid_argument,
                 {"WEFT_LOCAL_WORLD_SIZE='", "is not a whole number from 1 to 16777216"});
  }
  Options{}.from_environment(environment_with("4", {"WEFT_LOCAL_WORLD_SIZE"}));
  expect_error([&] { Options{}.from_environment(environment_with("yes", {"WEFT_DEVICE_IPC"})); }, Errc::invalid_argument,
               {"WEFT_DEVICE_IPC='yes' is not a switch"});
  Options{}.from_environment(environment_with("1", {"WEFT_DEVICE_IPC"}));
  // Single copy's threshold: a warning and "off" before.
  expect_error([&] { Options{}.from_environment(environment_with("64k", {"WEFT_SHM_CMA_BYTES"})); }, Errc::invalid_argument,
               {"WEFT_SHM_CMA_BYTES='64k' is not off or a whole number from 0"});
  Options{}.from_environment(environment_with("off", {"WEFT_SHM_CMA_BYTES"}));
  Options{}.from_environment(environment_with("65536", {"WEFT_SHM_CMA_BYTES"}));
  // The arena's direct reads: a byte count of at least 1, or off.
  expect_error([&] { Options{}.from_environment(environment_with("32k", {"WEFT_SHM_ARENA_CMA_BYTES"})); }, Errc::invalid_argument,
               {"WEFT_SHM_ARENA_CMA_BYTES='32k' is not on, off or a whole number from 1"});
  expect_error([&] { Options{}.from_environment(environment_with("0", {"WEFT_SHM_ARENA_CMA_BYTES"})); }, Errc::invalid_argument,
               {"WEFT_SHM_ARENA_CMA_BYTES='0'"});
  Options{}.from_environment(environment_with("off", {"WEFT_SHM_ARENA_CMA_BYTES"}));
  Options{}.from_environment(environment_with("on", {"WEFT_SHM_ARENA_CMA_BYTES"}));
  Options{}.from_environment(environment_with("on", {"WEFT_SHM_ARENA_CMA_BYTES"}));
  Options{}.from_environment(environment_with("16384", {"WEFT_SHM_ARENA_CMA_BYTES"}));
}

TEST_CASE("WEFT_TIMEOUT takes a duration and refuses anything else", "[errors][timeout]") {
  const auto env_with = [](const char* value) { return environment_with(value, {"WEFT_TIMEOUT"}); };
  CHECK(Options{}.from_environment(env_with("250ms")).timeout == 250ms);
  CHECK(Options{}.from_environment(env_with("30")).timeout == 30s);
  CHECK(Options{}.from_environment(env_with("2m")).timeout == std::chrono::minutes(2));
  CHECK(Options{}.from_environment(env_with("0")).timeout == 0ms);
  for (const char* bad : {"", "soon", "1.5s", "-3s", "10us"}) {
    expect_error([&] { Options{}.from_environment(env_with(bad)); }, Errc::invalid_argument, {"WEFT_TIMEOUT", "is not a duration"});
  }
}

TEST_CASE("abort() fails everything in flight on every rank at once; shrink() then makes a working group", "[errors][abort]") {
  const long before = checks_made.load();
  run_ranks(3, [](Group& g) {
    std::vector<float> x(1000, 1.0f);
    Future<void> f;
    if (g.rank() != 2) f = g.all_reduce(x);  // rank 2 never joins: the collective cannot finish
    if (g.rank() == 0) {
      std::this_thread::sleep_for(100ms);
      g.abort("giving up");
    }
    if (g.rank() != 2) {
      check(f.wait_for(10s), "the aborted all_reduce hung");
      expect_error([&] { f.get(); }, Errc::aborted, {"rank 0 called abort(): giving up"});
    }
    if (g.rank() == 2) {
      // Rank 2 learns of the abort through the frame: its next collective fails with rank 0's reason.
      std::this_thread::sleep_for(500ms);
      expect_error([&] { g.all_reduce(x).get(); }, Errc::aborted, {"rank 0 called abort(): giving up"});
    }
    expect_error([&] { (void)g.all_reduce(x); }, Errc::group_failed, {"rank 0 called abort(): giving up"});
    Group fresh = g.shrink().get();
    check(fresh.size() == 3 && fresh.rank() == g.rank(), "every member is still there");
    std::vector<float> y(1001, static_cast<float>(g.rank()));
    fresh.all_reduce(y).get();
    check(y[1000] == 3.0f, "all_reduce on the shrunk group");
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a collective that every rank reached completes on every rank, even when one aborts right after it", "[errors][abort]") {
  // Rank 1 finishes the collective and aborts at once; rank 0, which arrived first and waits on its loop,
  // may learn of the abort before it looks at the arena again. The collective was whole before the abort
  // (every rank contributed), so it completes; the abort fails what comes after. Found in CI over shm,
  // where rank 0's barrier failed with "rank 1 aborted" about one run in fifty. From round 12 a sibling
  // group of the same ranks (a split) has failed first: another group's failure is not this group's, and
  // counting it as such (any failed context of the transport, until 2026-11-29) failed these rounds again.
  const long before = checks_made.load();
  for (int round = 0; round < 21; ++round) {
    run_ranks(2, [round](Group& g) {
      if (round >= 12) {
        Group sibling = g.split(0, g.rank()).get();
        sibling.abort("the sibling gave up");
        expect_error([&] { sibling.barrier().get(); }, {Errc::aborted, Errc::group_failed}, {"the sibling gave up"});
      }
      const int kind = round % 3;  // a barrier, a small all_reduce, a broadcast from the aborting rank
      std::vector<float> x(33, static_cast<float>(g.rank() + 1));
      const auto call = [&] {
        if (kind == 0) return g.barrier();
        if (kind == 1) return g.all_reduce(x);
        return g.broadcast(x, 1);
      };
      const float expected = kind == 1 ? 3.0f : 2.0f;
      if (g.rank() == 1) {
        std::this_thread::sleep_for(30ms);  // rank 0 is waiting on its loop by now
        call().get();
        g.abort("finished");
        if (kind != 0) check(x[32] == expected, "the aborting rank's result");
        return;
      }
      Future<void> f = call();
      check(f.wait_for(10s), "the collective hung");
      f.get();  // whole before the abort: no error
      if (kind != 0) check(x[32] == expected, fmt::format("round {}: the result", round));
      // The abort comes; what this rank calls after it fails with it.
      const auto t0 = std::chrono::steady_clock::now();
      while (std::chrono::steady_clock::now() - t0 < 10s) {
        try {
          g.barrier().get();
        } catch (const Error& e) {
          check(e.errc() == Errc::aborted || e.errc() == Errc::group_failed, e.what());
          check(std::string(e.what()).find("finished") != std::string::npos, e.what());
          return;
        }
      }
      check(false, "the abort never reached rank 0");
    });
  }
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("the survivors shrink past a member that stopped answering, and their collectives are correct", "[errors][shrink]") {
  const long before = checks_made.load();
  Options options;
  options.timeout = 500ms;
  for (const bool progress_threads : {false, true}) {
    harness_caller_drives = !progress_threads;
    run_ranks(4, [](Group& g) {
      std::vector<float> x(1000, 1.0f);
      g.all_reduce(x).get();
      if (g.rank() == 2) {
        std::this_thread::sleep_for(3s);  // stopped, as far as the others can tell
        expect_error([&] { g.all_reduce(x).get(); }, {Errc::aborted, Errc::timeout, Errc::peer_failure, Errc::group_failed}, {});
        Group alone = g.shrink().get();
        check(alone.size() == 1 && alone.rank() == 0, fmt::format("the left-out rank got a group of {}", alone.size()));
        alone.all_reduce(x).get();
        return;
      }
      Future<void> f = g.all_reduce(x);
      check(f.wait_for(10s), "the all_reduce with a silent member hung");
      expect_error([&] { f.get(); }, {Errc::timeout, Errc::aborted}, {"not joined: rank 2"});
      Group s = g.shrink().get();
      check(s.size() == 3, fmt::format("shrunk to {} ranks", s.size()));
      check(s.rank() == (g.rank() < 2 ? g.rank() : g.rank() - 1), "ranks keep their order");
      for (int round = 0; round < 5; ++round) {
        std::vector<std::int64_t> v(777 + static_cast<std::size_t>(round), s.rank() + 1);
        s.all_reduce(v).get();
        check(v.front() == 6 && v.back() == 6, "all_reduce after shrink");
        std::vector<std::int32_t> mine(5, s.rank());
        std::vector<std::int32_t> all(15);
        s.all_gather(mine, all).get();
        check(all[0] == 0 && all[5] == 1 && all[14] == 2, "all_gather after shrink");
        std::vector<double> b(33, s.rank() == 1 ? 2.5 : 0.0);
        s.broadcast(b, 1).get();
        check(b[32] == 2.5, "broadcast after shrink");
      }
    }, options);
  }
  harness_caller_drives = true;
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("one operation's deadline: with_timeout on a collective and on a receive", "[errors][deadline]") {
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    // The group's deadline stays the default (30 minutes); single operations get their own.
    std::vector<float> x(100, 1.0f);
    if (g.rank() == 1) {
      const auto t0 = std::chrono::steady_clock::now();
      Future<void> r = g.with_timeout(300ms).recv(x, 0, 5);  // rank 0 never sends tag 5
      check(r.wait_for(5s), "a receive past its deadline hung");
      const auto took = std::chrono::steady_clock::now() - t0;
      check(took < 1300ms, "the receive's deadline took too long");
      expect_error([&] { r.get(); }, Errc::timeout, {"rank 1", "recv", "the receive from rank 0 [tag 5] passed its deadline (300 ms)",
                                                    "withdrawn", "stays usable"});
    }
    g.all_reduce(x).get();  // the group still works
    check(x[0] == 2.0f, "all_reduce after a receive's deadline");
    if (g.rank() == 1) std::this_thread::sleep_for(1500ms);
    Future<void> f = g.with_timeout(400ms).all_reduce(x);
    check(f.wait_for(10s), "an all_reduce past its own deadline hung");
    expect_error([&] { f.get(); }, {Errc::timeout, Errc::aborted}, {"all_reduce #2 passed its deadline (400 ms)", "not joined: rank 1"});
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a deadline of 10 s or more, counted from the watchdog's first look, passes neither early nor long after", "[errors][deadline]") {
  // From 10 s on a deadline starts at the watchdog's next look instead of a clock read in the call
  // (GroupState::start_of): it may pass up to two looks (500 ms) late, never early. Transport-blind,
  // and 10 s long: over tcp only.
  const char* transport = std::getenv("WEFT_TRANSPORT");
  if (transport && std::string_view(transport) != "tcp") {
    SUCCEED("the watchdog is the same over every transport: checked over tcp");
    return;
  }
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    std::vector<float> x(4, 1.0f);
    if (g.rank() == 1) {
      const auto t0 = std::chrono::steady_clock::now();
      Future<void> r = g.with_timeout(10s).recv(x, 0, 7);  // rank 0 never sends tag 7
      check(!r.wait_for(9900ms), "a receive with a 10 s deadline ended before it");
      check(r.wait_for(5s), "a receive past its 10 s deadline hung");
      const auto took = std::chrono::steady_clock::now() - t0;
      check(took >= 10s, "the receive's 10 s deadline passed early");
      check(took < 12s, "the receive's 10 s deadline passed long after it (more than the two looks it may take, and a loaded machine's 1.5 s)");
      expect_error([&] { r.get(); }, Errc::timeout, {"rank 1", "recv", "[tag 7] passed its deadline (10 s)"});
    }
    g.all_reduce(x).get();
    check(x[0] == 2.0f, "the group works after the deadline");
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("receives that finish out of order leave the deadline of the one still waiting", "[errors][deadline]") {
  // The group's watchdog lists what runs in the order it started and lets go of an entry as its
  // operation finishes: from the front, the back, or the middle. Entry 0 must still expire after the
  // others finished around it, and every other entry must be gone (none expires late).
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    std::vector<std::vector<float>> bufs(6, std::vector<float>(4, 0.0f));
    if (g.rank() == 1) {
      std::vector<Future<void>> receives;
      for (std::uint32_t tag = 0; tag < 6; ++tag) receives.push_back(g.with_timeout(600ms).recv(bufs[tag], 0, tag));
      g.barrier().get();  // rank 0 sends tags 3, 5, 1, 4, 2 now: the middle, the back, ...; never tag 0
      for (std::uint32_t tag : {3u, 5u, 1u, 4u, 2u}) {
        check(receives[tag].wait_for(5s), fmt::format("the receive of tag {} hung", tag));
        receives[tag].get();
        check(bufs[tag][0] == static_cast<float>(tag), fmt::format("tag {} got the wrong message", tag));
      }
      check(receives[0].wait_for(5s), "the receive whose message never came hung past its deadline");
      expect_error([&] { receives[0].get(); }, Errc::timeout, {"rank 1", "recv", "[tag 0] passed its deadline (600 ms)"});
    } else {
      g.barrier().get();
      for (std::uint32_t tag : {3u, 5u, 1u, 4u, 2u}) {
        std::vector<float> message(4, static_cast<float>(tag));
        g.send(message, 1, tag).get();
      }
    }
    std::vector<float> one{1.0f};
    g.all_reduce(one).get();
    check(one[0] == 2.0f, "the group works after the deadline");
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a send past its own deadline aborts the group, naming the send", "[errors][deadline]") {
  // 64 MiB, more than any stream holds (socket buffers, the shm ring), to a rank whose loop reads
  // nothing for 4 s (a receiver that reads keeps an unexpected message, so the send would complete).
  const long before = checks_made.load();
  // Rank 0 sends only once rank 1's loop is blocked: a send that starts earlier is read (kept as an
  // unexpected message) for as long as that loop runs, and on a loaded machine it ran long enough to
  // take all 64 MiB, so the send completed and nothing failed (seen once in CI, under ASan over uring).
  std::latch receiver_blocked(1);
  run_ranks(2, [&](Group& g) {
    std::vector<float> data(std::size_t{16} << 20, 1.0f);
    if (g.rank() == 1) {
      std::promise<void> blocked;
      g.loop().post([&] {
        blocked.set_value();
        std::this_thread::sleep_for(4s);  // the loop's thread, busy elsewhere: nothing reads
      });
      blocked.get_future().wait();
      receiver_blocked.count_down();
    }
    if (g.rank() == 0) {
      receiver_blocked.wait();
      const auto t0 = std::chrono::steady_clock::now();
      Future<void> s = g.with_timeout(300ms).send(data, 1, 9);
      check(s.wait_for(10s), "a send past its deadline hung");
      // Its frame is half written: the Future ends once the stream lets go of the buffer, when the
      // frame has not moved for a while (stuck_grace, 1 s) and the connection is closed; well before
      // the receiver would read again.
      check(std::chrono::steady_clock::now() - t0 < 3500ms, "the send's deadline took too long");
      expect_error([&] { s.get(); }, Errc::timeout,
                   {"rank 0", "send", "a send from rank 0 to rank 1 [tag 9] passed its deadline", "cannot be withdrawn"});
    }
    // The group failed on both ranks: a later collective fails at once (rank 1 learns it from the
    // closed connection, rank 0 names its own deadline).
    Future<void> f = g.all_reduce(data);
    check(f.wait_for(10s), "a collective after the send's deadline hung");
    if (g.rank() == 0) {
      expect_error([&] { f.get(); }, {Errc::timeout, Errc::aborted}, {"passed its deadline"});
    } else {
      expect_error([&] { f.get(); }, {Errc::peer_failure, Errc::aborted, Errc::timeout}, {"rank 0"});
    }
  });
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("a rank that stops reading for longer than four heartbeats is alive, not dead", "[errors][liveness]") {
  // Rank 1's loop is blocked for 7 s (its process alive, nothing reading its sockets) while rank 0 sends
  // it 64 MiB: rank 0 sees a zero window for most of that, four heartbeats being 4 s. TCP_USER_TIMEOUT
  // (used before) ended that connection with "Connection timed out"; the liveness check must not.
  Options base;
  base.heartbeat = 1s;
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    const std::size_t count = std::size_t{16} << 20;  // 64 MiB of floats: far beyond the socket buffers
    std::vector<float> data(count, 1.0f);
    // When the send started and ended (rank 0) and when rank 1's loop read again, on the host's
    // monotonic clock: the sender must have been held until then, however late either rank came on a
    // loaded machine (comparing the send's length with the block's failed in CI when rank 0 came late).
    std::vector<std::int64_t> times(3, 0);
    const auto now_ns = [] { return std::chrono::steady_clock::now().time_since_epoch().count(); };
    g.barrier().get();
    if (g.rank() == 1) {
      std::promise<void> blocked;
      g.loop().post([&] {
        blocked.set_value();
        std::this_thread::sleep_for(7s);  // the loop's thread, busy elsewhere: nothing reads
        times[2] = now_ns();
      });
      blocked.get_future().wait();
      g.recv(data, 0, 1).get();
      check(data[0] == 2.0f && data[count - 1] == 2.0f, "the message did not arrive whole");
    } else {
      std::fill(data.begin(), data.end(), 2.0f);
      times[0] = now_ns();
      g.send(data, 1, 1).get();
      times[1] = now_ns();
    }
    g.all_reduce(BufferView(times.data(), times.size(), DType::i64)).get();
    if (g.rank() == 0) {
      check(times[2] - times[0] >= std::chrono::nanoseconds(4s).count(),
            "the send started less than four heartbeats before the receiver read again: the test means nothing");
      check(times[1] >= times[2] - std::chrono::nanoseconds(100ms).count(), "the receiver did not hold the sender back");
    }
    std::vector<float> x{1.0f};
    g.all_reduce(x).get();
    check(x[0] == 2.0f, "all_reduce after the pause");
  }, base);
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("without_deadline: a long-lived wait outlasts the group's deadline while other calls keep it", "[errors][deadline]") {
  // A server's command channel: rank 0 waits for rank 1's next command, which comes after 1.2 s, four
  // times the group's deadline (300 ms); the same wait with the default deadline would fail.
  Options base;
  base.timeout = 300ms;
  const long before = checks_made.load();
  run_ranks(2, [](Group& g) {
    std::vector<std::int32_t> command{g.rank() == 1 ? 42 : 0};
    if (g.rank() == 1) std::this_thread::sleep_for(1200ms);
    g.without_deadline().broadcast(command, 1).get();
    check(command[0] == 42, "the command did not arrive");
    // The rest keeps the deadline: a collective that rank 1 joins late fails.
    if (g.rank() == 1) std::this_thread::sleep_for(1200ms);
    Future<void> late = g.barrier();
    check(late.wait_for(10s), "a barrier past its deadline hung");
    expect_error([&] { late.get(); }, {Errc::timeout, Errc::aborted}, {"barrier #2 passed its deadline (300 ms)"});
  }, base);
  REQUIRE(checks_made.load() > before);
}

namespace {

// The connections between ranks of this process: pairs of loopback TCP sockets connected to each other,
// found through /proc/self/fd. `skip_port` (the store's) is left out.
std::vector<std::pair<int, int>> rank_connections(unsigned short skip_port) {
  struct End {
    int fd;
    unsigned short local, peer;
  };
  std::vector<End> ends;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd")) {
    const int fd = std::atoi(entry.path().filename().c_str());
    sockaddr_in local{}, peer{};
    socklen_t a = sizeof local, b = sizeof peer;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &a) != 0 || local.sin_family != AF_INET) continue;
    if (::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &b) != 0) continue;
    if (ntohs(local.sin_port) == skip_port || ntohs(peer.sin_port) == skip_port) continue;
    ends.push_back(End{fd, ntohs(local.sin_port), ntohs(peer.sin_port)});
  }
  std::vector<std::pair<int, int>> pairs;
  for (const End& x : ends) {
    for (const End& y : ends) {
      if (x.fd < y.fd && x.local == y.peer && x.peer == y.local) pairs.emplace_back(x.fd, y.fd);
    }
  }
  return pairs;
}

}  // namespace

TEST_CASE("bytes injected into a live connection between two ranks, or a socket closed mid-frame, fail it; nothing hangs", "[errors][hostile]") {
  const char* transport = std::getenv("WEFT_TRANSPORT");
  if (transport && std::string_view(transport).starts_with("shm")) {
    SUCCEED("over shared memory the ranks of one host have no TCP connection to tamper with (the shm suites test a hostile ring)");
    return;
  }
  const long before = checks_made.load();
  const auto port = free_port();
  Options options;
  options.store = "127.0.0.1:" + std::to_string(port);
  std::atomic<int> protocol_errors{0};
  for (const bool mid_frame : {false, true}) {
    protocol_errors = 0;
    std::latch done(2);
    run_ranks(2, [&](Group& g) {
      std::vector<float> x(mid_frame ? (16 << 20) : 100, 1.0f);
      g.all_reduce(x).get();
      g.barrier().get();
      if (g.rank() == 0 && !mid_frame) {
        const auto pairs = rank_connections(port);
        check(pairs.size() == 1, fmt::format("found {} connections between the ranks", pairs.size()));
        std::array<unsigned char, 64> noise{};
        for (std::size_t i = 0; i < noise.size(); ++i) noise[i] = static_cast<unsigned char>(i * 37 + 11);
        // Through a duplicate of the descriptor: the transport owns (and closes) the original, on its thread.
        const int fd = ::dup(pairs[0].first);
        check(::send(fd, noise.data(), noise.size(), MSG_NOSIGNAL) == 64, "inject");
        ::close(fd);
      }
      // The garbage may land behind a frame that completes this operation: the connection fails at the
      // latest when the next header is read.
      bool failed = false;
      for (int attempt = 0; attempt < 3 && !failed; ++attempt) {
        Future<void> f = g.all_reduce(x);
        if (g.rank() == 0 && mid_frame && attempt == 0) {
          std::this_thread::sleep_for(5ms);  // 64 MiB each way: still in flight
          const auto pairs = rank_connections(port);
          check(pairs.size() == 1, fmt::format("found {} connections between the ranks", pairs.size()));
          const int fd = ::dup(pairs[0].first);
          ::shutdown(fd, SHUT_RDWR);  // shuts the socket down for both descriptors
          ::close(fd);
        }
        check(f.wait_for(10s), "the collective hung");
        try {
          f.get();
        } catch (const Error& e) {
          failed = true;
          check(e.errc() == Errc::peer_failure || e.errc() == Errc::aborted || e.errc() == Errc::group_failed, e.what());
          if (std::string(e.what()).find("protocol error from rank") != std::string::npos) ++protocol_errors;
        }
      }
      check(failed, "three all_reduces succeeded over a broken connection");
      // Each rank is alone now: shrink makes a group of one that works.
      Group alone = g.shrink().get();
      check(alone.size() == 1, fmt::format("a group of {} after the connection failed", alone.size()));
      // Rank 0 touched a descriptor that the other rank's transport closes when its group goes: both
      // finish here first, so that the close comes after the touch (TSan sees the order).
      done.arrive_and_wait();
    }, options);
    if (!mid_frame) CHECK(protocol_errors.load() >= 1);
  }
  REQUIRE(checks_made.load() > before);
}

TEST_CASE("CRC-32C: the known answer, and the instruction and the table agree on every length and alignment", "[errors][integrity]") {
  const char* nine = "123456789";
  CHECK(crc32c(0, nine, 9) == 0xE3069283u);  // the standard check value (RFC 3720)
  CHECK(crc32c_portable(0, nine, 9) == 0xE3069283u);
  CHECK(crc32c(crc32c(0, nine, 4), nine + 4, 5) == 0xE3069283u);  // continues
  std::vector<unsigned char> data(40000 + 16);
  std::mt19937 random(3);
  for (auto& b : data) b = static_cast<unsigned char>(random());
  for (std::size_t offset = 0; offset < 16; ++offset) {
    // Past 3 x 256 and 3 x 8192 bytes the instruction runs three streams and joins them.
    for (std::size_t length : {0, 1, 7, 8, 9, 63, 64, 65, 767, 768, 769, 1000, 4096, 24575, 24576, 24577, 40000}) {
      CHECK(crc32c(0, data.data() + offset, length) == crc32c_portable(0, data.data() + offset, length));
    }
  }
}

TEST_CASE("sealed frames: a flipped bit in a payload or a header, a forged MAC and a replayed frame each fail the connection, naming the peer and the frame", "[errors][integrity]") {
  // Issue 13, part 7: frames carried no checksum; flipped payload bytes, or bytes injected with a valid
  // framing, went unnoticed. The test plays rank 1 and writes frames by hand.
  const std::vector<std::byte> payload(64, std::byte{5});
  std::vector<std::byte> into(64);
  SECTION("crc32c: a whole frame arrives; one with a payload bit flipped fails the connection") {
    RawPeer peer(std::size_t{1} << 20, Integrity::crc32c);
    FrameSeal writer(Integrity::crc32c, {});
    auto good = sealed_frame(data_frame(64), payload, writer);
    peer.write(good.data(), good.size());
    auto ok = peer.receive(7, into);
    CHECK_FALSE(ok.error);
    CHECK(into == payload);
    auto h = data_frame(64);
    h.seq = 8;
    auto bad = sealed_frame(h, payload, writer);
    bad[wire::header_size + 4 + 10] ^= std::byte{0x10};  // a bit of the payload, after the trailer was computed
    peer.write(bad.data(), bad.size());
    auto lost = peer.receive(8, into);
    CHECK(lost.error == make_error_code(Errc::peer_failure));
    CHECK(lost.failed_peer == 1);
    CHECK_THAT(lost.reason, Catch::Contains("connection to rank 1 lost: frame integrity: the CRC-32C of frame 1 from rank 1") &&
                                Catch::Contains("#8") && Catch::Contains("64 bytes") && Catch::Contains("corrupted or forged") &&
                                Catch::Contains("WEFT_INTEGRITY=crc32c"));
  }
  SECTION("crc32c: a header whose length was corrupted is caught before its length is believed") {
    RawPeer peer(std::size_t{1} << 20, Integrity::crc32c);
    FrameSeal writer(Integrity::crc32c, {});
    auto bad = sealed_frame(data_frame(64), payload, writer);
    bad[33] ^= std::byte{0x40};  // bytes: 64 -> 16448, which would wait for bytes that never come
    peer.write(bad.data(), bad.size());
    peer.expect_lost({"frame integrity: the header of frame 0 from rank 1 does not match its CRC-32C"});
  }
  SECTION("hmac: a frame sealed with another key is a forgery") {
    FrameKeys keys;
    keys.recv.fill(std::byte{1});
    RawPeer peer(std::size_t{1} << 20, Integrity::hmac, keys);
    std::array<std::byte, 32> other{};
    other.fill(std::byte{2});
    FrameSeal forger(Integrity::hmac, other);
    auto forged = sealed_frame(data_frame(64), payload, forger);
    peer.write(forged.data(), forged.size());
    auto lost = peer.receive(7, into);
    CHECK(lost.error == make_error_code(Errc::peer_failure));
    CHECK_THAT(lost.reason, Catch::Contains("frame integrity: the HMAC of frame 0 from rank 1") && Catch::Contains("WEFT_INTEGRITY=hmac"));
  }
  SECTION("hmac: the same frame sent twice (a replay) fails: frames are counted") {
    FrameKeys keys;
    keys.recv.fill(std::byte{1});
    RawPeer peer(std::size_t{1} << 20, Integrity::hmac, keys);
    FrameSeal writer(Integrity::hmac, keys.recv);
    auto frame = sealed_frame(data_frame(64), payload, writer);
    peer.write(frame.data(), frame.size());
    CHECK_FALSE(peer.receive(7, into).error);
    peer.write(frame.data(), frame.size());
    peer.expect_lost({"frame integrity: the HMAC of frame 1 from rank 1"});
  }
}

TEST_CASE("an input and an output that overlap other than in place are refused; every in-place layout is right", "[errors][preconditions]") {
  const long before = checks_made.load();
  // Sizes that take the arena or whole messages, the tree and ring plans, and the large pipelines (an
  // all_reduce whose output started one element into its input went wrong there, an all_to_all
  // whose output started one block in went wrong at every size, both without a word). permute has no
  // layout to refuse: it sends from a copy whenever its buffers share bytes.
  for (std::size_t n : {std::size_t{5}, std::size_t{4099}, std::size_t{300001}}) {
    for (int p : {2, 3}) {
      run_ranks(p, [p, n](Group& g) {
        const int r = g.rank();
        const auto ur = static_cast<std::size_t>(r);
        const std::string me = fmt::format("rank {}", r);
        const auto up = static_cast<std::size_t>(p);
        auto filled = [&](std::size_t count, int salt) {
          std::vector<float> v(count);
          for (std::size_t i = 0; i < count; ++i) v[i] = static_cast<float>(r * 100 + salt + static_cast<int>(i % 1000));
          return v;
        };
        auto view = [](std::vector<float>& v, std::size_t at, std::size_t count) { return BufferView(v.data() + at, count, DType::f32); };
        const std::string sizes = fmt::format("p={} n={}: ", p, n);
        {  // refused, on every rank, before anything is sent
          std::vector<float> buf(n * up + n);
          expect_error([&] { (void)g.all_reduce(view(buf, 0, n), view(buf, 1, n)); }, Errc::invalid_argument,
                       {me, "all_reduce", "overlap", "same address"});
          expect_error([&] { (void)g.all_to_all(view(buf, 0, n * up), view(buf, n, n * up)); }, Errc::invalid_argument,
                       {me, "all_to_all", "overlap"});
          if (r != 0) {  // block 0 of the output is rank 0's in-place layout, nobody else's
            expect_error([&] { (void)g.all_gather(view(buf, 0, n), view(buf, 0, n * up)); }, Errc::invalid_argument,
                         {me, "all_gather", "overlap", fmt::format("{} bytes into the output", ur * n * 4)});
            expect_error([&] { (void)g.reduce_scatter(view(buf, 0, n * up), view(buf, 0, n)); }, Errc::invalid_argument,
                         {me, "reduce_scatter", "overlap"});
          }
        }
        {  // all_reduce in place
          auto in = filled(n, 1);
          std::vector<float> out(n);
          g.all_reduce(in, out).get();
          g.all_reduce(view(in, 0, n)).get();
          check(in == out, sizes + "all_reduce in place differs from out of place");
        }
        {  // all_gather: the input is this rank's block of the output
          auto in = filled(n, 2);
          std::vector<float> out(n * up), buf(n * up);
          g.all_gather(in, out).get();
          std::copy(in.begin(), in.end(), buf.begin() + static_cast<std::ptrdiff_t>(ur * n));
          g.all_gather(view(buf, ur * n, n), view(buf, 0, n * up)).get();
          check(buf == out, sizes + "all_gather in place differs from out of place");
        }
        {  // reduce_scatter: the output is this rank's block of the input (NCCL's in place)
          auto in = filled(n * up, 3);
          std::vector<float> out(n);
          g.reduce_scatter(in, out).get();
          g.reduce_scatter(view(in, 0, n * up), view(in, ur * n, n)).get();
          check(std::equal(out.begin(), out.end(), in.begin() + static_cast<std::ptrdiff_t>(ur * n)),
                sizes + "reduce_scatter in place differs from out of place");
        }
        {  // all_to_all: one buffer
          auto in = filled(n * up, 4);
          std::vector<float> out(n * up);
          g.all_to_all(in, out).get();
          g.all_to_all(view(in, 0, n * up), view(in, 0, n * up)).get();
          check(in == out, sizes + "all_to_all in place differs from out of place");
        }
        {  // reduce, gather and scatter in place at the root
          const int root = p - 1;
          const bool at_root = r == root;
          auto in = filled(n, 5);
          std::vector<float> out(at_root ? n : 0);
          g.reduce(in, out, root).get();
          g.reduce(in, at_root ? view(in, 0, n) : BufferView(), root).get();
          if (at_root) check(in == out, sizes + "reduce in place differs from out of place");
          auto mine = filled(n, 6);
          std::vector<float> gathered(at_root ? n * up : 0), buf(at_root ? n * up : n);
          g.gather(mine, at_root ? view(gathered, 0, n * up) : BufferView(), root).get();
          std::copy(mine.begin(), mine.end(), buf.begin() + static_cast<std::ptrdiff_t>(at_root ? ur * n : 0));
          g.gather(view(buf, at_root ? ur * n : 0, n), at_root ? view(buf, 0, n * up) : BufferView(), root).get();
          if (at_root) check(buf == gathered, sizes + "gather in place differs from out of place");
          auto all = filled(at_root ? n * up : 0, 7);
          std::vector<float> part(n);
          g.scatter(all, part, root).get();
          if (at_root) {
            g.scatter(view(all, 0, n * up), view(all, ur * n, n), root).get();
            check(std::equal(part.begin(), part.end(), all.begin() + static_cast<std::ptrdiff_t>(ur * n)),
                  sizes + "scatter in place differs from out of place");
          } else {
            std::vector<float> again(n);
            g.scatter(ConstBufferView(), again, root).get();
            check(again == part, sizes + "scatter differs between two calls");
          }
        }
        {  // permute in place, and with the output one element into the input (sent from a copy)
          auto in = filled(n + 1, 8);
          std::vector<float> out(n);
          std::vector<std::pair<int, int>> shift;
          for (int i = 0; i < p; ++i) shift.emplace_back(i, (i + 1) % p);
          g.permute(ConstBufferView(in.data(), n, DType::f32), out, shift).get();
          auto same = in;
          g.permute(view(same, 0, n), view(same, 0, n), shift).get();
          check(std::equal(out.begin(), out.end(), same.begin()), sizes + "permute in place differs from out of place");
          auto shifted = in;
          g.permute(view(shifted, 0, n), view(shifted, 1, n), shift).get();
          check(std::equal(out.begin(), out.end(), shifted.begin() + 1), sizes + "permute into its input shifted by one differs");
        }
        {  // the variable-size forms' in-place layouts: gatherv and scatterv at the root, reduce_scatterv
          std::vector<std::size_t> counts(up);
          for (std::size_t i = 0; i < up; ++i) counts[i] = n + i;
          std::size_t total = 0;
          std::vector<std::size_t> displs(up);
          for (std::size_t i = 0; i < up; ++i) {
            displs[i] = total;
            total += counts[i];
          }
          const int root = 0;
          const bool at_root = r == root;
          auto mine = filled(counts[ur], 9);
          std::vector<float> gathered(at_root ? total : 0), buf(at_root ? total : counts[ur]);
          g.gatherv(mine, at_root ? view(gathered, 0, total) : BufferView(), counts, root).get();
          std::copy(mine.begin(), mine.end(), buf.begin() + static_cast<std::ptrdiff_t>(at_root ? displs[ur] : 0));
          g.gatherv(view(buf, at_root ? displs[ur] : 0, counts[ur]), at_root ? view(buf, 0, total) : BufferView(), counts, root).get();
          if (at_root) check(buf == gathered, sizes + "gatherv in place differs from out of place");
          auto all = filled(at_root ? total : 0, 10);
          std::vector<float> part(counts[ur]);
          g.scatterv(all, part, counts, root).get();
          if (at_root) {
            g.scatterv(view(all, 0, total), view(all, displs[ur], counts[ur]), counts, root).get();
            check(std::equal(part.begin(), part.end(), all.begin() + static_cast<std::ptrdiff_t>(displs[ur])),
                  sizes + "scatterv in place differs from out of place");
          } else {
            std::vector<float> again(counts[ur]);
            g.scatterv(ConstBufferView(), again, counts, root).get();
          }
          auto blocks = filled(total, 11);
          std::vector<float> reduced(counts[ur]);
          g.reduce_scatterv(blocks, reduced, counts).get();
          g.reduce_scatterv(view(blocks, 0, total), view(blocks, displs[ur], counts[ur]), counts).get();
          check(std::equal(reduced.begin(), reduced.end(), blocks.begin() + static_cast<std::ptrdiff_t>(displs[ur])),
                sizes + "reduce_scatterv in place differs from out of place");
          if (r != 0) {
            std::vector<float> one(total);
            expect_error([&] { (void)g.reduce_scatterv(view(one, 0, total), view(one, 0, counts[ur]), counts); }, Errc::invalid_argument,
                         {me, "reduce_scatterv", "overlap"});
          }
        }
        std::vector<float> one{1.0f};
        g.all_reduce(one).get();
        check(one[0] == static_cast<float>(p), "the group works after refused calls");
      });
    }
  }
  REQUIRE(checks_made.load() > before);
}
