#pragma once
// A group's state, shared by the Group handles and views (with_timeout) of one group and by its running
// operations. Its fields are grouped by the thread that writes them, as libunifex groups an operation's
// state, so that docs/DESIGN.md's threading table can be read off this file:
//   identity   written once by create / split / shrink before the group is handed out; read by all
//   callers    written by the threads that call collectives (atomics, or under a mutex)
//   loop       written on the loop's thread only (the watchdog, the reports)
// The rooms that use it: create.cpp (bootstrap wiring), p2p.cpp, collectives.cpp (the submit path and
// the collectives' tasks), variable.cpp (the variable-size collectives), membership.cpp (split, shrink),
// watchdog.cpp (deadlines and their reports).
#include <array>
#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "algorithms/selection.hpp"
#include "core/loop_users.hpp"
#include "core/signature.hpp"
#include "rendezvous/store.hpp"
#include "weft/algorithms.hpp"
#include "weft/collective.hpp"
#include "weft/error.hpp"
#include "weft/group.hpp"
#include "weft/loop.hpp"
#include "weft/options.hpp"
#include "weft/task.hpp"
#include "weft/transport.hpp"

namespace weft {

namespace shm {
class Arena;
}

namespace algo = algorithms;

namespace detail {

// Where each rank's block lies in a variable-size collective's buffers on this rank, and the digest of
// the counts every rank passes (group/variable.hpp).
struct BlockLayout;

// One buffer collective as the public methods pack it, as NCCL packs every call into one ncclInfo: all
// that validation, selection and the task need.
struct CollectiveCall {
  Collective collective;
  ConstBufferView in;
  BufferView out;
  ReduceOp op = ReduceOp::sum;
  int root = -1;
  algo::StagedBuffers* staged = nullptr;  // device staging still copying (device_staging.hpp); null: ready
  // The variable-size collectives' blocks (null for the others). Shared: device staging runs the task
  // after the call has returned.
  std::shared_ptr<const BlockLayout> blocks = nullptr;
};

// The group arena's turns: its collectives run one at a time, in the order they were called, which is
// the same on every rank (waiting for the order they reach the loop is not: a device collective reaches
// it after its copy in, which takes a different time on every rank). A ticket is taken at the call, on
// the caller's thread, right after the seq. Its holder runs on the loop, or on the caller's thread for a
// collective of one superstep whose turn has come (the fast path, shm_collectives.cpp): so the turn is
// handed over with atomics (and a mutex when someone waits), not loop-thread state. Callers and the loop; thread-safe.
class ArenaTurns {
 public:
  std::uint64_t take() noexcept { return issued_.fetch_add(1, std::memory_order_relaxed); }
  /// Whether `ticket`'s turn has come (acquire: what the previous holder wrote in the arena is seen).
  bool has_turn(std::uint64_t ticket) const noexcept { return serving_.load(std::memory_order_acquire) == ticket; }
  /// Registers `waiter`, to be resumed on `loop` when `ticket`'s turn comes; false (not registered) when
  /// it has come already.
  bool wait(std::uint64_t ticket, std::coroutine_handle<> waiter) {
    attention_.fetch_add(1, std::memory_order_seq_cst);  // announced before the look (see leave)
    std::lock_guard lock(mutex_);
    if (serving_.load(std::memory_order_seq_cst) == ticket) {
      attention_.fetch_sub(1, std::memory_order_relaxed);
      return false;
    }
    waiting_.emplace_back(ticket, waiter);  // counted in attention_ until it is taken
    return true;
  }
  /// Ends `ticket`'s turn, or, when its operation never ran and never will (a device collective whose
  /// copy in failed), gives it up so that it is skipped; the next holder is resumed on `loop` (at once on
  /// the loop's thread).
  ///
  /// Without a lock when nobody waits and nothing was given up (every small collective of the fast path):
  /// the holder stores the next number, then looks at `attention_`, which a waiter or a ticket given up
  /// raises before it looks at `serving_` (Dekker, both sequentially consistent): either the waiter sees
  /// its turn come, or the holder sees it and hands over under the mutex. Only a ticket's holder moves
  /// `serving_` on from it, so the store needs no exchange; a number given up is passed over under the
  /// mutex by whoever finds the turn there.
  void leave(std::uint64_t ticket, Loop& loop) {
    if (serving_.load(std::memory_order_relaxed) == ticket) {
      serving_.store(ticket + 1, std::memory_order_seq_cst);
      if (attention_.load(std::memory_order_seq_cst) == 0) return;
      hand_over(loop);
      return;
    }
    attention_.fetch_add(1, std::memory_order_seq_cst);  // given up: counted until passed over
    {
      std::lock_guard lock(mutex_);
      if (serving_.load(std::memory_order_seq_cst) != ticket) {
        std::erase_if(waiting_, [&](const auto& w) {
          if (w.first != ticket) return false;
          attention_.fetch_sub(1, std::memory_order_relaxed);
          return true;
        });
        abandoned_.push_back(ticket);
        return;
      }
      // Its turn came meanwhile: it leaves as a holder.
      attention_.fetch_sub(1, std::memory_order_relaxed);
      serving_.store(ticket + 1, std::memory_order_seq_cst);
    }
    hand_over(loop);
  }

 private:
  // After the turn moved on: passes over the numbers given up, drops waiters whose turn is past (a
  // waiting coroutine destroyed before its turn), and resumes the next holder if it waits.
  void hand_over(Loop& loop) {
    std::coroutine_handle<> next;
    {
      std::lock_guard lock(mutex_);
      std::uint64_t serving = serving_.load(std::memory_order_seq_cst);
      while (std::erase(abandoned_, serving) > 0) {
        attention_.fetch_sub(1, std::memory_order_relaxed);
        serving_.store(++serving, std::memory_order_seq_cst);
      }
      for (auto it = waiting_.begin(); it != waiting_.end();) {
        if (it->first > serving) {
          ++it;
          continue;
        }
        if (it->first == serving) next = it->second;
        attention_.fetch_sub(1, std::memory_order_relaxed);
        it = waiting_.erase(it);
      }
    }
    if (!next) return;
    if (loop.in_loop_thread()) {
      next.resume();
    } else {
      loop.post([next] { next.resume(); });
    }
  }

  std::atomic<std::uint64_t> issued_{0};
  std::atomic<std::uint64_t> serving_{0};
  // Waiters registered or registering, and numbers given up not yet passed over: while it is not zero a
  // leaving holder hands over under the mutex.
  std::atomic<std::uint64_t> attention_{0};
  std::mutex mutex_;
  std::vector<std::pair<std::uint64_t, std::coroutine_handle<>>> waiting_;  // guarded by mutex_
  std::vector<std::uint64_t> abandoned_;                                    // guarded by mutex_
};

// Deletes a transport on its loop's thread, where its handlers run, once the frames that tell the
// peers why (an abort, a cancel) are out (Transport::control_pending), for at most end_flush_limit (2 s): a rank
// that left right after a failure closed its connections with the abort queued behind a data frame, and
// its peers saw a lost connection instead of the reason. From another thread of an owned loop it waits
// for that, so that nothing of the transport outlives the Group's destruction (create.cpp).
struct DeleteOnLoop {
  Loop* loop;
  std::uint64_t end_hook = 0;  // the transport's shutdown, should the loop end first (core/loop_users.hpp)
  void operator()(Transport* transport) const;
};

struct DeviceStaging;  // device_staging.cpp
struct DeviceWindows;  // device_windows.cpp

// What a collective's plan is a function of, besides the group's size and this rank (GroupState::plan_for).
struct PlanShape {
  Collective collective = Collective::barrier;
  algo::Kind kind = algo::Kind::dissemination;
  std::uint64_t count = 0;
  int root = -1;
  bool operator==(const PlanShape&) const = default;
};

struct GroupState : std::enable_shared_from_this<GroupState> {
  // ---- identity: written once before the group is handed out
  // Unique among the groups of this process, never reused (a new group may get a freed one's address):
  // the callers' memo of their last call is keyed by it (collectives.cpp, `checked_algorithm`).
  const std::uint64_t id = next_id();
  Loop* loop = nullptr;
  std::uint64_t loop_end_hook = 0;  // leave_loop, should the loop end first (watch_loop_end)
  std::shared_ptr<Transport> transport;         // shared with the groups split from this one
  std::shared_ptr<store::Server> store_server;  // rank 0 of the world group only
  std::uint32_t context = 1;
  int rank = 0;
  int size = 1;
  std::vector<int> members;  // group rank -> transport rank
  Options options;
  // The group arena of the direct shm collectives (group/shm_collectives.cpp): the world group of a job
  // whose ranks all share one host; null otherwise (split and shrunk groups run over the transport).
  std::shared_ptr<shm::Arena> arena;
  // [transport rank]: on this rank's host (the link offers' host identities, the same verdict on both
  // sides of every pair), and whether some member of this group is not: the selection's `across_hosts`,
  // which every member computes alike (being on one host is an equivalence).
  std::vector<bool> on_my_host;
  bool across_hosts = false;
  void place() {
    across_hosts = false;
    for (int m : members) across_hosts = across_hosts || !(static_cast<std::size_t>(m) < on_my_host.size() && on_my_host[static_cast<std::size_t>(m)]);
  }
  algo::Placement placement() const;  // group.cpp
  static std::uint64_t next_id() noexcept {
    static std::atomic<std::uint64_t> ids{0};
    return ids.fetch_add(1, std::memory_order_relaxed) + 1;
  }

  // ---- callers: the threads that call collectives
  algo::Selection selection;                        // which algorithm runs what (override_algorithms)
  std::atomic<std::uint64_t> next_seq{1};           // in program order
  // Point-to-point numbers, per peer (group rank): [2 * peer] this rank's sends to it, [2 * peer + 1] its
  // receives from it. A send or recv takes the next at its call, so an error names "send #3 (peer 1)" as
  // this rank's third send to rank 1, whose receive of that message is its third from this rank where
  // the two use one tag (messages of one peer and tag match in order). Not the group's `next_seq`: a
  // point-to-point call is not a collective, and every member would have to count it. Sized by set_size.
  std::unique_ptr<std::atomic<std::uint64_t>[]> p2p_counts = std::make_unique<std::atomic<std::uint64_t>[]>(2);
  void set_size(int n) {
    size = n;
    p2p_counts = std::make_unique<std::atomic<std::uint64_t>[]>(2 * static_cast<std::size_t>(n));
  }
  /// The number the next send to (receive from) `peer` takes, from 1; take_p2p_seq takes it.
  std::uint64_t next_p2p_seq(int peer, bool sending) const noexcept {
    return p2p_counts[2 * static_cast<std::size_t>(peer) + (sending ? 0 : 1)].load(std::memory_order_relaxed) + 1;
  }
  std::uint64_t take_p2p_seq(int peer, bool sending) noexcept {
    return p2p_counts[2 * static_cast<std::size_t>(peer) + (sending ? 0 : 1)].fetch_add(1, std::memory_order_relaxed) + 1;
  }
  // Which algorithm runs each of the latest collectives (algo::Kind + 1, by seq; 0: not recorded), so
  // that its signature says it (OpSignature::plan, `signed_by`): ranks that chose differently for one
  // call (override_algorithms on some ranks only) would wait on messages the other never sends, or
  // mix up messages that happen to be of one size. A ring of (seq << 8 | plan) words, stored on the
  // caller's thread for each call that goes to the loop (before the loop runs it) and read where the
  // collective's signature is made (64 calls later, or from a rank that no longer remembers: 0, not
  // compared). The arena's fast path (run_on_arena_now) knows its algorithm and signs with it directly
  // (signed_as): a collective it finishes is never noted here (the store cost its smallest all_reduce
  // 20-30 ns, bench/RESULTS.md).
  std::array<std::atomic<std::uint64_t>, 64> planned{};
  static std::uint8_t plan_code(algo::Kind kind) noexcept { return static_cast<std::uint8_t>(static_cast<unsigned>(kind) + 1); }
  void note_planned(std::uint64_t seq, const algo::Algorithm& algorithm) noexcept {
    planned[seq % planned.size()].store(seq << 8 | plan_code(algorithm.kind), std::memory_order_release);
  }
  static OpSignature signed_as(OpSignature signature, algo::Kind kind) noexcept {
    signature.plan = plan_code(kind);
    return signature;
  }
  std::uint8_t planned_of(std::uint64_t seq) const noexcept {
    const std::uint64_t word = planned[seq % planned.size()].load(std::memory_order_acquire);
    return (word >> 8) == (seq & (~std::uint64_t{0} >> 8)) ? static_cast<std::uint8_t>(word & 0xff) : 0;
  }
  OpSignature signed_by(OpSignature signature, std::uint64_t seq) const noexcept {
    signature.plan = planned_of(seq);
    return signature;
  }
  std::atomic<std::uint64_t> shrinks{0};            // shrink() calls so far: each gets its own exchange
  // Deadlines of single operations (Group::with_timeout), by seq, read on the loop when the operation
  // starts. A fixed ring of the latest: a deadline is looked up soon after its call.
  std::atomic<bool> any_deadline_set{false};
  std::mutex deadlines_mutex;
  std::array<std::pair<std::uint64_t, std::chrono::milliseconds>, 64> deadlines{};  // guarded
  std::size_t deadlines_pushed = 0;                                                 // guarded

  // ---- either side: a failure, set on the loop (or by abort()), read by callers
  std::atomic<bool> failed{false};
  std::mutex failure_mutex;
  std::string failure;  // guarded by failure_mutex

  // ---- loop: the watchdog (watchdog.cpp). A timer per operation cost 2600 instructions per 1 KiB
  // all_reduce (+19%, bench/RESULTS.md); instead the running operations are listed with their start, and
  // one timer per group, armed while any runs, looks every min(timeout / 4, 250 ms).
  struct Watched {
    std::uint64_t id;  // the operation's seq; point-to-point operations get ids from p2p_ids
    std::chrono::steady_clock::time_point started;  // start_of: zero until the watchdog's next look
    std::chrono::milliseconds timeout;
    // A collective expires through time_out(id, op, timeout): nothing to allocate per operation (a
    // std::function holding those four words would have allocated on every call).
    const char* op = nullptr;
    // Otherwise (point-to-point): `expire(context)`, called only while the entry is still watched (its
    // owner unwatches before it goes). A pointer and a context, not a std::function: one holding a
    // weak_ptr allocated on every receive that had to wait.
    void (*expire)(void* context) = nullptr;
    void* context = nullptr;
    // A collective still running this long after its start is checked for a silent mismatch
    // (check_calls), then again after twice as long, up to every stall_check_most.
    std::chrono::milliseconds next_check = stall_check_first;
  };
  // A deadline of at least `stamp_at_look_from` (the default, 30 min, and no deadline) starts at the
  // watchdog's next look rather than at the call: a clock read (33 ns on the VMs here) off every
  // operation that waits (a collective's is on its critical path: shm all_reduce of 8 B-2 KiB 4-10 %
  // faster, bench/RESULTS.md "Deadlines started at the watchdog's look"). It passes late by at most one look's
  // period (250 ms: 2.5 % of 10 s), never early. Shorter deadlines start at the call, as the user
  // counts them.
  static constexpr std::chrono::milliseconds stamp_at_look_from{10000};
  static std::chrono::steady_clock::time_point start_of(std::chrono::milliseconds timeout) noexcept {
    return timeout >= stamp_at_look_from ? std::chrono::steady_clock::time_point{} : std::chrono::steady_clock::now();
  }
  // A mismatch that sends no frame (a reduce whose ranks disagree on the root: each waits to receive)
  // was found only at the deadline, 30 min by default. A stalled collective asks the members how they
  // called it after 1 s, 2 s, 4 s, ... (at most every minute): a member that called it differently
  // fails it now. Answers that agree, or none, change nothing: a slow peer is never failed here.
  static constexpr std::chrono::milliseconds stall_check_first{1000};
  static constexpr std::chrono::milliseconds stall_check_most{60000};
  static constexpr std::chrono::milliseconds stall_check_patience{500};  // how long the answers are awaited
  // The `timeout` of a collective watched without a deadline (ten years: never reached, and far from
  // overflowing the nanoseconds it is compared with).
  static constexpr std::chrono::milliseconds no_deadline = std::chrono::hours(24 * 365 * 10);
  // In the order they started. A deque: operations mostly finish in that order (a window of receives),
  // or the last first (one at a time), and unwatch takes either end at once (a vector's erase at the
  // front moved a 64-receive window's entries on every receive).
  std::deque<Watched> watched;
  bool watchdog_armed = false;
  std::uint64_t p2p_ids = std::uint64_t{1} << 63;
  std::vector<std::uint64_t> reporting;  // operations whose progress query is out
  std::uint64_t arena_seq = 0;  // the operation in the arena now on the loop (0: none), for deadline reports
  std::uint64_t device_windows_seq = 0;  // the all_reduce whose kernel runs on device windows now (0: none), likewise
  // ---- the holder of the arena's turn (either thread): the scripts' fold inputs (no allocation per call)
  std::vector<const std::byte*> arena_sources;
  // The last box broadcast this rank finished (shm_collectives.cpp): a rank that went on from it to a
  // superstep and meets a rank still at it names it in the mismatch, not the superstep's own call.
  std::uint64_t last_box_seq = 0;
  OpSignature last_box_signature{};
  // ---- callers and the loop
  ArenaTurns arena_turns;

  // ---- callers and the loop: the plans built lately, by their shape. A collective's plan is a pure
  // function of the collective, the algorithm, this rank, the group's size, the count and the root, so a
  // repeated call takes the one built before: building a 2-rank all_gather's plan (the blocks, the steps:
  // four allocations) was about 14 % of its instructions (bench/RESULTS.md, "The read-ahead buffer, and
  // plans built once").
  /// The plan of `shape`, built by `build()` (an algo::Plan) the first time. Any thread.
  template <class Build>
  std::shared_ptr<const algo::Plan> plan_for(const PlanShape& shape, Build&& build) {
    {
      std::lock_guard lock(plans_mutex);
      for (const auto& [known, plan] : plans)
        if (plan && known == shape) return plan;
    }
    auto plan = std::make_shared<const algo::Plan>(build());  // built outside the lock: callers run alongside
    std::lock_guard lock(plans_mutex);
    plans[plans_next] = {shape, plan};
    plans_next = (plans_next + 1) % plans.size();
    return plan;
  }
  std::mutex plans_mutex;
  std::array<std::pair<PlanShape, std::shared_ptr<const algo::Plan>>, 8> plans;  // guarded, round robin
  std::size_t plans_next = 0;                                                     // guarded

  // ---- Group handles (group.cpp): how many there are, and whether the last one went (any thread). A
  // cancelled arena collective's supersteps go on in the background holding this state
  // (shm_collectives.cpp, finish_cancelled); once nobody holds the group, they stop waiting for peers
  // that may never come, so that the state and its transport are freed while the loop still runs.
  std::atomic<int> handles{0};
  std::atomic<bool> unheld{false};

  // ---- callers: device buffers (device_staging.cpp), made at the first device operation
  std::mutex device_staging_mutex;
  std::shared_ptr<DeviceStaging> device_staging;  // guarded by device_staging_mutex
  std::shared_ptr<DeviceWindows> device_windows;  // guarded by device_staging_mutex: all_reduce on device windows

  // Sets the loop the group runs on; should the loop end while this state still lives (a Future of the
  // group's kept past the Loop holds it), its end calls leave_loop on the loop's thread.
  void watch_loop_end(Loop* on) {
    loop = on;
    loop_end_hook = add_end_hook(*loop, [weak = weak_from_this()] {
      if (auto state = weak.lock()) state->leave_loop();
    });
  }
  // What lives on the loop goes with it, on its thread: the transport (the last state to let go deletes
  // it: DeleteOnLoop), the store's server, the arena. The operations still holding this state never
  // run again (their loop is gone), and its end then touches nothing of the loop's.
  void leave_loop() {
    loop_end_hook = 0;
    transport.reset();
    store_server.reset();
    arena.reset();
  }

  ~GroupState() {
    if (loop_end_hook) remove_end_hook(*loop, loop_end_hook);
    if (!transport) return;
    // A weak reference: the last Group's transport is deleted now (DeleteOnLoop), not by this lambda
    // after the Loop may have stopped.
    loop->post([weak = std::weak_ptr<Transport>(transport), context = context] {
      if (auto t = weak.lock()) t->close_context(context);
    });
  }

  ErrorContext where(const char* op, std::int64_t seq, int peer = -1, std::int64_t tag = -1) const {
    return ErrorContext{rank, peer, op, seq, tag};
  }

  // `what` is most often an earlier error's what(): kept without its "weft: ", which every error that
  // quotes it (a later call refused on the failed group) starts with already.
  void mark_failed(std::string_view what) {
    std::lock_guard lock(failure_mutex);
    if (failed.exchange(true)) return;
    if (what.starts_with("weft: ")) what.remove_prefix(6);
    failure = what;
  }

  /// What the caller asked for, beyond the buffers: the element count every rank passes and the root.
  /// With the collective, dtype and reduce op it makes the operation's signature (mismatch detection).
  struct Call {
    std::uint64_t count = 0;
    int root = -1;
  };

  algo::Channel channel(std::uint64_t seq, const char* op, const OpSignature& signature, std::uint64_t first_tag) const {
    algo::Channel ch{loop, transport.get(), context, seq, rank, members, op, first_tag};
    ch.signature = signature;
    return ch;
  }

  algo::ExecOptions exec_options() const { return algo::ExecOptions{options.segment_bytes, options.pipeline_depth}; }

  /// Runs one collective's plan; a failure fails the group (its peers are told by the abort frame).
  Task<void> run(const algo::Plan& plan, std::uint64_t seq, Collective collective, algo::PlanBuffers buffers, Call call,
                 std::uint64_t first_tag = 0) {
    return run_signed(plan, seq, to_string(collective).data(),
                      signed_by(signature::of(collective, buffers.dtype, buffers.op, call.count, call.root), seq), buffers, first_tag);
  }
  /// The same for a plan of the user's (`op` names it in errors).
  Task<void> run_signed(const algo::Plan& plan, std::uint64_t seq, const char* op, OpSignature signature,
                        algo::PlanBuffers buffers, std::uint64_t first_tag = 0) {
    watch(seq, op);
    try {
      co_await algo::execute(channel(seq, op, signature, first_tag), plan, buffers, exec_options());
    } catch (const Error& e) {
      unwatch(seq);
      // A cancelled operation was cancelled on every member (a cancel frame): the group goes on.
      if (e.errc() != Errc::cancelled) mark_failed(e.what());
      throw;
    }
    unwatch(seq);
  }

  // ---- deadlines and their reports (watchdog.cpp)
  void set_deadline(std::uint64_t seq, std::chrono::milliseconds timeout);
  std::chrono::milliseconds deadline_of(std::uint64_t seq);
  void watch(std::uint64_t seq, const char* op);
  void watch(Watched w);
  void arm_watchdog();
  void unwatch(std::uint64_t id);
  void on_watchdog();
  static std::string duration_text(std::chrono::milliseconds t);
  void time_out(std::uint64_t seq, const char* op, std::chrono::milliseconds timeout);
  void check_calls(std::uint64_t seq, const char* op, std::chrono::milliseconds waited);
  std::string mismatched_calls(std::uint64_t seq, const std::vector<Transport::Progress>& answers) const;
  int group_rank(int transport_rank) const;
  std::string stragglers(std::uint64_t seq, const std::vector<Transport::Progress>& answers, std::chrono::milliseconds patience) const;
};

}  // namespace detail
}  // namespace weft
