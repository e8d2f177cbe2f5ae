#pragma once
/// weft::Loop: the one event loop of a process (or of a rank, when ranks are threads).
///
/// It is built on an asio::io_context and runs single-threaded: every transport callback, timer and
/// coroutine of weft's runs on the loop's thread (for a borrowed io_context, one at a time on a strand),
/// so weft's own state needs no locks.
///
/// Two modes:
///  - owned (`Loop()`): the Loop owns an io_context and one progress thread that runs it. Futures may be
///    awaited or waited on from any thread.
///  - borrowed (`Loop(io)`): the Loop uses the caller's io_context and starts no thread; the caller runs
///    `io.run()` (e.g. inside an async server), on one thread or on a pool of them: weft's handlers go
///    through a strand of the Loop's, so they run one at a time whichever thread runs them, and several
///    borrowed Loops may share one io_context. Blocking waits (`Future::wait`, `sync_wait`) must come from
///    a thread that is not inside a handler of `io` (they throw Errc::would_deadlock there); the pool's
///    coroutines await weft's Futures with weft::async_wait (weft/asio.hpp). The Loop may end while other
///    threads still run `io`: its end runs on its strand, and the destructor waits for it.
///
/// The completion hook: sources of completions other than Asio's sockets (an io_uring's eventfd, a CUDA
/// host callback) deliver into the same loop through `post()` (thread-safe) or by asking the loop to
/// watch a file descriptor with `watch_readable()`; see docs/DESIGN.md.
#include <atomic>
#include <chrono>
#include <coroutine>
#include <cstdint>
#include <functional>
#include <memory>
#include <stop_token>

#include "weft/task.hpp"

namespace asio {
class io_context;
}

namespace weft {

struct SleepState;
namespace detail {
struct LoopExecutor;
}

class Loop {
 public:
  struct Options {
    /// While operations are in flight, how long the progress thread keeps polling after the last event
    /// before it sleeps in the kernel (owned mode only). A sleeping thread takes tens of microseconds to
    /// wake on a VM, more than a small collective's messages take to arrive; polling only while something
    /// is in flight leaves the cores to the application (and the waiting threads) the rest of the time.
    /// Zero turns polling off. Default: WEFT_SPIN_US, else 1000 us (when ranks oversubscribe the cores
    /// too: they poll yielding, below; with WEFT_SPIN_YIELD=0 they do not poll at all).
    /// The bound adapts between spin/16 and spin: halved after a poll that found nothing, doubled after
    /// an event that came late in it.
    std::chrono::microseconds spin{1000};
    /// Caller-driven progress: Future::wait borrows the loop and runs it on the waiting thread
    /// (drive_until), so a blocking call costs no wake-up hand-off between threads. On by default: on the
    /// 2-core VMs it took the 8-byte all_reduce from about 29 us to 16 us and was as fast or faster at
    /// every size up to 8 MiB (bench/RESULTS.md). WEFT_DRIVE=0 turns it off, WEFT_DRIVE=1 on; when
    /// WEFT_DRIVE is unset and WEFT_TRANSPORT=uring, `Loop()` turns it off, so that the io_uring ring can
    /// be single-issuer with deferred task work (faster there at every size, bench/RESULTS.md).
    bool caller_drives = true;
    /// Polling gives the core away after every look that found nothing (sched_yield), so that a rank
    /// waiting for another on the same core lets it run instead of taking its time slice. For ranks that
    /// oversubscribe the cores, where sleeping instead costs a wake-up through the kernel per message
    /// (bench/RESULTS.md, "4 ranks on 2 cores"). Default: WEFT_SPIN_YIELD (0 or 1), else on when the
    /// launcher's local rank count (WEFT_LOCAL_WORLD_SIZE, LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE,
    /// SLURM_NTASKS_PER_NODE) exceeds the cores; with WEFT_SPIN_YIELD=0 such ranks do not poll at all.
    bool yield_while_polling = false;
    /// Polling that does not yield starts yielding by itself once the scheduler preempts the polling
    /// thread again and again (3 times within 100 ms, counted with getrusage): the core is shared with a
    /// runnable thread this rank may be waiting for, which a launcher did not say (simulated hosts in
    /// namespaces, containers, CPU quotas). Default: on, unless WEFT_SPIN_YIELD=0.
    bool yield_when_preempted = true;
  };

  /// Owned mode: an io_context of its own and a progress thread that runs it.
  Loop();
  explicit Loop(Options options);
  /// Borrowed mode: uses `io`, starts no thread. `io` must outlive the Loop.
  explicit Loop(asio::io_context& io);
  /// Lifetime: every Group on the loop must be gone first (the process stops with a message otherwise).
  /// Futures of the groups' operations may outlive it: what they hold of a group (its transport, the
  /// store's server) goes at the loop's end, on its thread. Operations still in flight (a spawned Task
  /// suspended on the loop, a sleep) never complete: the destructor logs how many it leaves (their
  /// frames stay allocated), and a wait on their Futures throws weft::Error (invalid_argument) instead
  /// of touching the loop; a cancel does nothing. A borrowed loop whose io_context other threads still
  /// run ends on its strand (the destructor waits for that; when nothing runs it within 100 ms, the
  /// destructor runs the io_context itself until it did). Inside a handler of that io_context the
  /// destructor can only wait: up to 5 s, then it ends the loop on the calling thread with a warning.
  ~Loop();
  Loop(const Loop&) = delete;
  Loop& operator=(const Loop&) = delete;

  asio::io_context& context() noexcept;
  bool owns_thread() const noexcept;
  /// True when the calling thread is this loop's own progress thread (not a thread that borrows it).
  bool on_progress_thread() const noexcept;
  /// True when the calling thread is the one running this loop right now.
  bool in_loop_thread() const noexcept;
  /// True when a blocking wait on the calling thread would hold this loop up: in_loop_thread(), or, for
  /// a borrowed loop, any handler of the caller's io_context (run by one thread, weft's handlers wait
  /// behind it; a pool's thread should not block either: weft::async_wait). Future::wait refuses then.
  bool wait_would_block_it() const noexcept;
  /// The Loop whose thread is the calling thread right now (its progress thread, a thread driving it
  /// through a blocking wait, or the thread running a borrowed io_context), or nullptr. weft::offload
  /// uses it to come back to the loop it left.
  static Loop* current() noexcept;
  /// True when every handler runs on one thread for the Loop's whole life: an owned loop that callers
  /// do not drive (Options::caller_drives false). An io_uring ring can then be set up for a single
  /// issuer (IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN).
  bool single_thread() const noexcept;
  /// True when polling gives the core away after every look that found nothing: told so
  /// (Options::yield_while_polling) or found out (Options::yield_when_preempted).
  bool polls_yielding() const noexcept;
  /// Whether waits poll before they sleep now: Options::spin is not zero and the cores are not taken by
  /// compute (offload). What other pollers of this loop's events (the shm arena's fast path) follow.
  bool polls() const noexcept;

  /// Caller-driven progress: when this loop owns a progress thread and the caller is another thread,
  /// parks the progress thread and runs the loop on the caller's thread until `done()` holds (polling
  /// while operations are in flight, then sleeping in the kernel in short slices). Future::wait uses it,
  /// so that a blocking wait costs no hand-off between threads. The borrower hands the loop back when
  /// `done()` holds; the progress thread then stays parked 0.5-1 ms in case the loop is borrowed
  /// again (back-to-back calls), and when operations are still in flight resumes 50 us later unless
  /// borrowed again meanwhile (a thread waiting on several Futures one after the other). Returns false,
  /// having done nothing, when it cannot borrow the loop (borrowed mode, called on the loop's thread, or
  /// another thread drives).
  bool drive_until(const std::function<bool()>& done);

  /// Caller-driven progress, for starting work: runs `fn(arg)` on the calling thread as the loop's
  /// thread (in_loop_thread() holds inside), at once, when the progress thread is parked (a borrower
  /// handed the loop back moments ago) and nobody drives the loop. A send or receive started from plain
  /// code then goes out on the caller's thread instead of through a post and the next borrow. Returns
  /// false, having done nothing, when that cannot be had without waiting (the progress thread runs or
  /// sleeps in the kernel, another thread drives, borrowed mode, the loop's own thread): post then. What
  /// `fn` leaves in flight is driven as posted work would be: by the next borrower, or by the progress
  /// thread, which leaves its park within its 0.5 ms tick once operations are in flight. `fn` must not
  /// block. Thread-safe.
  bool run_here(void (*fn)(void*), void* arg);

  /// Counts operations in flight (spawn does this): the progress thread polls only while some are.
  void operation_started() noexcept;
  void operation_finished() noexcept;

  /// True while this Loop lives, false once its destructor has run: a word that outlives the Loop
  /// (never freed), for the Futures of its operations, which may be waited on after it is gone and
  /// then fail instead of touching it. Thread-safe.
  const std::atomic<bool>* alive_word() const noexcept { return alive_; }

  /// Held by work that the loop's own tasks must finish before the loop may end: device staging that goes
  /// back to its pool once the device's copies ran (a group's memory, whose group is gone already). An
  /// owned loop's destructor keeps its progress thread running until every Linger taken from it is
  /// released, up to 30 s (then it logs how many it left: their frames stay, never resumed). A borrowed
  /// io_context runs on its owner's turns, so there the destructor does not wait. Thread-safe; a Linger
  /// may outlive its loop.
  class Linger {
   public:
    Linger() = default;
    Linger(Linger&&) noexcept = default;
    Linger& operator=(Linger&& other) noexcept;
    Linger(const Linger&) = delete;
    Linger& operator=(const Linger&) = delete;
    ~Linger();

    struct Count;

   private:
    friend class Loop;
    explicit Linger(std::shared_ptr<Count> count) noexcept : count_(std::move(count)) {}
    std::shared_ptr<Count> count_;
  };
  Linger linger();

  /// Runs `fn` on the loop's thread, later. Thread-safe.
  void post(std::function<void()> fn);

  /// A number that names this loop for its whole life and no other loop after it (for post_if_alive).
  std::uint64_t id() const noexcept;
  /// Posts `fn` to the loop `id` names if that loop still lives; returns false and drops `fn` (on the
  /// calling thread) once it is gone. For threads that may outlive a loop: a device stream's worker
  /// finishing work queued before the loop's owner destroyed it. Thread-safe.
  static bool post_if_alive(std::uint64_t id, std::function<void()> fn);

  /// Runs `fn` on the loop's thread when a turn next asks the kernel for events, just before it does (or
  /// before it sleeps): for work that itself costs a system call and is worth doing only once the loop
  /// has nothing else, such as a TCP stream's first try at a read. `fn` returns true when it found work
  /// (completed something); the turn then skips its kernel poll unless one is overdue. A borrowed
  /// io_context, whose turns are the user's, runs it as a post. Loop thread only.
  void before_kernel_poll(std::function<bool()> fn);

  /// A transport's message source that only the kernel reports (a TCP stream, an io_uring ring) opens on
  /// this loop (+1) or closes (-1). While memory pollers spin and find nothing, a turn asks the kernel
  /// every 10 us while such a source is open, else only every 50 us: every ask is a system call, and a
  /// rank whose peers were all in shared memory paid them in its round trips (a fifth of a small
  /// ping-pong's time on these VMs: bench/RESULTS.md). Thread-safe.
  void count_kernel_sources(int delta) noexcept;

  /// Calls `fn(true)` on the loop after `delay`, or `fn(false)` if cancel_timer() came first.
  /// Returns an id for cancel_timer(). Thread-safe.
  std::uint64_t call_after(std::chrono::nanoseconds delay, std::function<void(bool fired)> fn);
  /// Cancels a pending timer; a no-op if it already fired. Thread-safe.
  void cancel_timer(std::uint64_t id);

  /// The completion hook for foreign event sources: calls `on_readable()` on the loop each time `fd`
  /// becomes readable (the callback must drain it, e.g. read the eventfd). `fd` stays owned by the caller
  /// and must stay open until unwatch(). Returns an id for unwatch(). Thread-safe.
  std::uint64_t watch_readable(int fd, std::function<void()> on_readable);
  void unwatch(std::uint64_t id);

  /// An event source that lives in memory (shared-memory rings), looked at without entering the kernel.
  /// The loop calls `poll()` on every polling turn, entering the kernel (sockets, timers, posts) only
  /// every few microseconds while pollers are registered, and the source calls it itself when its
  /// wake-up fd (watch_readable) fires. Before the loop sleeps in the kernel it calls `arm()`: the source
  /// says that it sleeps (its peers then wake it through that fd), looks once more, and returns true if
  /// work came meanwhile (the loop then does not sleep); after the sleep, `disarm()`. A loop that never
  /// sleeps through weft (a borrowed io_context) never arms: a source starts armed, so that its peers
  /// always wake it there. All three run on the loop's thread.
  class Poller {
   public:
    /// Handles what arrived; returns how many events it found (0: none).
    virtual std::size_t poll() = 0;
    virtual bool arm() = 0;
    virtual void disarm() = 0;

   protected:
    ~Poller() = default;
  };
  /// Registers `poller` (kept alive until remove_poller). Returns an id for remove_poller(). Thread-safe.
  std::uint64_t add_poller(std::shared_ptr<Poller> poller);
  void remove_poller(std::uint64_t id);
  /// Runs every poller's poll() now: for a wake-up fd that several sources share (the shared-memory
  /// streams and the group arena of one rank are woken through one eventfd). Loop thread only.
  void poll_memory();

  /// `co_await loop.schedule()` continues the coroutine on the loop's thread.
  auto schedule() noexcept {
    struct Awaiter {
      Loop* loop;
      bool await_ready() const noexcept { return loop->in_loop_thread(); }
      void await_suspend(std::coroutine_handle<> h) { loop->post([h] { h.resume(); }); }
      void await_resume() const noexcept {}
    };
    return Awaiter{this};
  }

  struct Impl;

 private:
  friend struct detail::LoopExecutor;
  std::unique_ptr<Impl> impl_;
  const std::atomic<bool>* alive_;  // impl_'s alive word, here for an inline alive_word() (every operation asks)
};

/// Suspends for `delay` on `loop`. Cancellable through the awaiting Task's stop token, in which case it
/// throws weft::CancelledError.
class SleepFor {
 public:
  SleepFor(Loop& loop, std::chrono::nanoseconds delay) : loop_(&loop), delay_(delay) {}
  bool await_ready() const noexcept { return delay_.count() <= 0; }
  template <class Promise>
  void await_suspend(std::coroutine_handle<Promise> h) {
    start(h, detail::stop_token_of(h));
  }
  void await_resume();

 private:
  void start(std::coroutine_handle<> h, std::stop_token token);

  Loop* loop_;
  std::chrono::nanoseconds delay_;
  std::shared_ptr<SleepState> state_;
};

inline SleepFor sleep_for(Loop& loop, std::chrono::nanoseconds delay) { return SleepFor(loop, delay); }

}  // namespace weft

