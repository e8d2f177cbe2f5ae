#pragma once
/// weft::Future<T>: the eager handle of an operation that is already running on a weft::Loop.
///
/// Every send, recv and collective returns a Future at once; the operation proceeds whether or not anybody
/// looks at it, so computation placed between the call and the wait overlaps the communication.
///
/// - From a coroutine: `co_await future` (once). The coroutine resumes on the thread that completes the
///   operation, which is the loop's thread.
/// - From plain code, on any thread: `ready()`, `wait()`, `wait_for(d)`, `get()`.
/// - `cancel()` asks the operation to stop (thread-safe, idempotent). A cancelled operation completes
///   with weft::CancelledError unless it had already finished. See Group for what cancelling a collective
///   means for the other ranks.
///
/// Completion is thread-safe: the loop thread completes while any thread waits.
/// Lifetime: a Future may be dropped before it completes; the operation still runs to its end (it owns
/// what it needs except the user's buffers, which must outlive the operation, not the Future).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <coroutine>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <stop_token>
#include <thread>
#include <utility>

#include "weft/loop.hpp"
#include "weft/task.hpp"

namespace weft {

template <class T = void>
class Future;

namespace detail {

/// How long Future::wait polls before it sleeps (WEFT_WAIT_SPIN_US, default 0; read once).
std::chrono::microseconds wait_spin() noexcept;

/// Throws weft::Error (Errc::would_deadlock) explaining that `what` (wait, wait_for, get) was called on
/// the thread that runs the operation's loop, which would then wait for itself forever.
[[noreturn]] void throw_wait_on_loop_thread(const char* what);
[[noreturn]] void throw_loop_gone(const char* what);
/// weft::Error (Errc::invalid_argument) naming `what`: a Future without an operation was asked about it.
[[noreturn]] void throw_empty_future(const char* what);
/// weft::Error (Errc::invalid_argument): the value of a Future was asked for a second time.
[[noreturn]] void throw_value_taken();

/// Where plain-code waiters sleep: one of a fixed set of mutex and condition-variable pairs shared by
/// every Future of the process, picked by the state's address. A pair in every state made each operation
/// 88 bytes larger and cost a pthread_cond_destroy when it ended, for a sleep most operations never see
/// (their waiter drives the loop, or co_awaits). Futures that share a pair wake each other now and then;
/// each sleeper looks at its own state again and sleeps on. Lifetime: for the whole process.
struct SleepSlot {
  std::mutex mutex;
  std::condition_variable woken;
};
SleepSlot& sleep_slot(const void* state) noexcept;

class FutureStateBase {
 public:
  bool ready() const noexcept { return state_.load(std::memory_order_acquire) == done; }

  /// Blocks until the operation completes. First it drives the operation's loop on this thread when the
  /// loop can be borrowed (caller-driven progress, WEFT_DRIVE: no hand-off between threads on completion).
  /// Otherwise, by default, it sleeps at once and leaves the core to the loop's thread, which polls while
  /// operations are in flight (measured best on 2 ranks x 2 threads on 2 cores, docs/DESIGN.md);
  /// WEFT_WAIT_SPIN_US makes it poll (yielding) that long before it sleeps, for machines with cores to
  /// spare.
  void wait() {
    if (ready()) return;
    if (loop_gone()) throw_loop_gone("wait");
    // Drive the loop on this thread while waiting, if it can be borrowed: no hand-off on completion.
    // drive_until refuses the loop's own thread, which is told so only then: the thread check walks
    // Asio's call stack, once per wait is enough.
    if (loop_ && loop_->drive_until([this] { return ready(); })) return;
    if (loop_ && loop_->wait_would_block_it()) throw_wait_on_loop_thread("wait");
    const auto spin = wait_spin();
    if (spin.count() > 0) {
      const auto until = std::chrono::steady_clock::now() + spin;
      // Yield while polling: on a machine with fewer cores than busy threads the loop thread needs this
      // core more than the waiter does.
      while (!ready() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
      if (ready()) return;
    }
    Sleeping sleeping(*this);
    SleepSlot& slot = sleep_slot(this);
    std::unique_lock lock(slot.mutex);
    slot.woken.wait(lock, [&] { return done_now(); });
  }

  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> timeout) {
    if (ready()) return true;
    if (loop_gone()) throw_loop_gone("wait_for");
    if (loop_ && loop_->wait_would_block_it()) throw_wait_on_loop_thread("wait_for");
    // The condition variable adds the timeout to the clock's now: nanoseconds::max() (or infinity) wrapped
    // it into the past and "timed out" at once. A century or more is no limit.
    if (!(timeout < std::chrono::hours(24 * 365 * 100))) {
      wait();
      return true;
    }
    Sleeping sleeping(*this);
    SleepSlot& slot = sleep_slot(this);
    std::unique_lock lock(slot.mutex);
    return slot.woken.wait_for(lock, timeout, [&] { return done_now(); });
  }

  /// Registers the coroutine to resume on completion. Returns false when already complete. At most one
  /// of suspend() and notify().
  bool suspend(std::coroutine_handle<> waiter) noexcept {
    // A complete state is left unwritten: the shared ready one (make_ready_future) is read by every
    // thread at once, and two writes of its fields at once were a data race (TSan), harmless or not.
    if (ready()) return false;
    waiter_ = waiter;  // read by finish() only if the exchange below is what it finds
    std::uint8_t expected = pending;
    return state_.compare_exchange_strong(expected, awaited, std::memory_order_acq_rel, std::memory_order_acquire);
  }
  /// Registers `on_done(context)` to run on completion, on the thread that completes it, instead of a
  /// coroutine: for weft's combinators, whose children then need no coroutine frame each. Returns false
  /// when already complete (nothing is called then). At most one of suspend() and notify().
  using DoneCallback = void (*)(void* context) noexcept;
  bool notify(DoneCallback on_done, void* context) noexcept {
    if (ready()) return false;  // (as suspend: the shared ready state is never written)
    on_done_ = on_done;  // read by finish() only if the exchange below is what it finds
    on_done_context_ = context;
    std::uint8_t expected = pending;
    return state_.compare_exchange_strong(expected, awaited, std::memory_order_acq_rel, std::memory_order_acquire);
  }

  /// Asks the operation to stop, once (thread-safe; later calls do nothing): through the operation's
  /// cancel hook when it set one, otherwise through the stop token it was given. `owner`: the caller's
  /// reference to this state, which the hook may keep or watch (a weak_ptr made from it) past this call,
  /// so that an operation needs no reference to itself for a cancel that seldom comes.
  void cancel(const std::shared_ptr<FutureStateBase>& owner) noexcept {
    if (ready() || cancel_asked_.exchange(true, std::memory_order_acq_rel)) return;
    // Its loop is gone: nothing runs it any more, and what a cancel would reach refers to that loop.
    if (loop_gone()) return;
    if (cancel_hook_) {
      cancel_hook_(owner);
    } else {
      source().request_stop();
    }
  }
  /// The loop the operation runs on (set by spawn): wait() drives it.
  void set_loop(Loop* loop) noexcept {
    loop_ = loop;
    loop_alive_ = loop ? loop->alive_word() : nullptr;
  }
  /// The token cancel() stops (for an operation without a cancel hook). The stop state is made on
  /// first use: an operation that never asks for it costs no allocation for it.
  std::stop_token stop_token() noexcept { return source().get_token(); }

  void set_error(std::exception_ptr error) noexcept { error_ = std::move(error); }

  /// Publishes the result: wakes plain-code waiters and resumes the awaiting coroutine, if any. The
  /// caller holds a reference to the state (a waiter may drop its own as soon as it sees it ready).
  void finish() noexcept {
    // Dekker with Sleeping: either a sleeper announced itself before this exchange (and is notified
    // under its slot's mutex), or it finds the state done when it looks, under that mutex, after
    // announcing. notify_all: the slot's other sleepers may wait for other states.
    const std::uint8_t previous = state_.exchange(done, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) != 0) {
      SleepSlot& slot = sleep_slot(this);
      std::lock_guard lock(slot.mutex);
      slot.woken.notify_all();
    }
    if (previous == awaited) {
      if (on_done_) {
        on_done_(on_done_context_);
      } else {
        waiter_.resume();
      }
    }
  }

 protected:
  void rethrow_if_error() const {
    if (error_) std::rethrow_exception(error_);
  }
  /// What cancel() calls instead of stopping the token (at most once, on any thread, while the
  /// operation is not complete), with cancel()'s `owner`. Set before the Future is handed out.
  using CancelHook = void (*)(const std::shared_ptr<FutureStateBase>& owner) noexcept;
  void set_cancel_hook(CancelHook hook) noexcept { cancel_hook_ = hook; }

 private:
  static constexpr std::uint8_t pending = 0, awaited = 1, done = 2;
  // A plain-code waiter going to sleep in its sleep_slot: counted while it may sleep, so that finish()
  // takes the slot's mutex only when somebody sleeps.
  struct Sleeping {
    FutureStateBase& state;
    explicit Sleeping(FutureStateBase& s) : state(s) { state.sleepers_.fetch_add(1, std::memory_order_seq_cst); }
    ~Sleeping() { state.sleepers_.fetch_sub(1, std::memory_order_relaxed); }
    Sleeping(const Sleeping&) = delete;
    Sleeping& operator=(const Sleeping&) = delete;
  };
  bool done_now() const noexcept { return state_.load(std::memory_order_seq_cst) == done; }
  // The operation's loop was destroyed (Loop::alive_word): nothing will complete it.
  bool loop_gone() const noexcept { return loop_ && !loop_alive_->load(std::memory_order_acquire); }
  std::stop_source& source() noexcept {
    if (source_state_.load(std::memory_order_acquire) != source_made) make_source();
    return stop_;
  }
  // Not std::call_once: glibc's pthread_once makes a futex system call every time it runs a function,
  // and every spawned Task asks for its token (measured: +0.1-0.2 us per awaited operation).
  void make_source() noexcept {
    std::uint8_t expected = source_none;
    if (source_state_.compare_exchange_strong(expected, source_making, std::memory_order_acq_rel)) {
      stop_ = std::stop_source();
      source_state_.store(source_made, std::memory_order_release);
      return;
    }
    while (source_state_.load(std::memory_order_acquire) != source_made) std::this_thread::yield();
  }

  std::atomic<std::uint8_t> state_{pending};  // pending -> awaited (suspend) -> done (finish)
  std::atomic<std::uint32_t> sleepers_{0};    // plain-code waiters that may sleep in sleep_slot(this)
  std::atomic<bool> cancel_asked_{false};
  static constexpr std::uint8_t source_none = 0, source_making = 1, source_made = 2;
  std::atomic<std::uint8_t> source_state_{source_none};
  std::coroutine_handle<> waiter_;  // written by suspend() before its exchange, read by finish() after its
  DoneCallback on_done_ = nullptr;  // the same, by notify()
  void* on_done_context_ = nullptr;
  std::exception_ptr error_;        // written before finish(), read after ready()
  CancelHook cancel_hook_ = nullptr;
  std::stop_source stop_{std::nostopstate};  // made by source(), once
  Loop* loop_ = nullptr;
  const std::atomic<bool>* loop_alive_ = nullptr;  // loop_'s alive_word(), which outlives it
};

template <class T>
class FutureState : public FutureStateBase {
 public:
  template <class U>
  void set_value(U&& value) {
    value_.emplace(std::forward<U>(value));
  }
  // Hands the value over, once: a second get() or co_await would return what the first left behind (an
  // empty Group, an empty vector) as if it were a result.
  T take() {
    rethrow_if_error();
    if (taken_) throw_value_taken();
    taken_ = true;
    return std::move(*value_);
  }

 private:
  std::optional<T> value_;
  bool taken_ = false;  // by the one consumer
};

template <>
class FutureState<void> : public FutureStateBase {
 public:
  void take() const { rethrow_if_error(); }
};

}  // namespace detail

template <class T>
class [[nodiscard]] Future {
 public:
  using value_type = T;

  Future() = default;
  explicit Future(std::shared_ptr<detail::FutureState<T>> state) : state_(std::move(state)) {}
  Future(Future&&) noexcept = default;
  Future& operator=(Future&&) noexcept = default;
  Future(const Future&) = delete;
  Future& operator=(const Future&) = delete;

  /// False for a default-constructed or moved-from Future: every other member but cancel() then throws
  /// weft::Error (Errc::invalid_argument) instead of touching an operation that is not there.
  bool valid() const noexcept { return static_cast<bool>(state_); }
  /// True once the operation completed (successfully or not). Never blocks.
  bool ready() const { return checked("ready").ready(); }
  /// Blocks the calling thread until the operation completes.
  /// Errors: on the thread that runs the operation's loop (inside a Task, or the thread running a
  /// borrowed io_context) an operation that is not complete yet throws weft::Error (Errc::would_deadlock)
  /// at once instead of waiting for itself forever: `co_await` it there. A complete one returns.
  void wait() const { checked("wait").wait(); }
  /// Waits at most `timeout`; returns ready(). On the loop's thread: as wait().
  template <class Rep, class Period>
  bool wait_for(std::chrono::duration<Rep, Period> timeout) const {
    return checked("wait_for").wait_for(timeout);
  }
  /// Waits, then returns the result or throws the operation's weft::Error. Call once (or co_await once):
  /// asking a second time for a value throws weft::Error (invalid_argument); a Future<void> may ask again.
  T get() {
    detail::FutureState<T>& state = checked("get");
    state.wait();
    return state.take();
  }
  /// Asks the operation to stop. Thread-safe; a no-op once it completed.
  void cancel() noexcept {
    if (state_) state_->cancel(state_);
  }

  /// Awaiting a Future from a Task forwards the Task's cancellation to the operation.
  struct Awaiter {
    // The awaited Future's reference (never empty: operator co_await checks): the Future outlives the
    // co_await expression, and cancel() takes the reference.
    const std::shared_ptr<detail::FutureState<T>>* owner;
    // Calls cancel() on the operation when the awaiting Task's token stops (no type-erased callable).
    struct ForwardCancel {
      const std::shared_ptr<detail::FutureState<T>>* owner;
      void operator()() const noexcept { (*owner)->cancel(*owner); }
    };
    std::optional<std::stop_callback<ForwardCancel>> forward_stop;
    bool await_ready() const noexcept { return (*owner)->ready(); }
    template <class Promise>
    bool await_suspend(std::coroutine_handle<Promise> parent) {
      std::stop_token token = detail::stop_token_of(parent);
      if (token.stop_possible()) {
        forward_stop.emplace(token, ForwardCancel{owner});
      }
      return (*owner)->suspend(parent);
    }
    T await_resume() {
      forward_stop.reset();
      return (*owner)->take();
    }
  };
  Awaiter operator co_await() && {
    (void)checked("co_await");
    return Awaiter{&state_, std::nullopt};
  }

  /// The shared state; for weft's combinators.
  const std::shared_ptr<detail::FutureState<T>>& state() const noexcept { return state_; }

 private:
  detail::FutureState<T>& checked(const char* what) const {
    if (!state_) [[unlikely]] detail::throw_empty_future(what);
    return *state_;
  }
  std::shared_ptr<detail::FutureState<T>> state_;
};

namespace detail {
template <class T>
Detached drive(Loop& loop, Task<T> task, std::shared_ptr<FutureState<T>> state) {
  loop.operation_started();
  try {
    if constexpr (std::is_void_v<T>) {
      co_await std::move(task);
    } else {
      state->set_value(co_await std::move(task));
    }
  } catch (...) {
    state->set_error(std::current_exception());
  }
  // The task's frame (its parameters, its own copy of a failure) goes before the result is published,
  // on the thread that ran its last step: whoever sees the Future complete finds nothing of the task
  // left to run. (Freed after the post, a parameter's destructor could still be running on another
  // loop's thread when sync_wait returned.)
  task = Task<T>{};
  loop.operation_finished();
  // A task whose last step ran on another thread (it awaited another loop's Future) completes through
  // its own loop: a thread blocked in wait() may be driving that loop, asleep in the kernel, and only
  // work on the loop wakes it. The state goes with the post, so that this thread keeps no reference to
  // it after it is published.
  if (loop.in_loop_thread()) {
    state->finish();
  } else {
    loop.post([state = std::move(state)] { state->finish(); });
  }
}
}  // namespace detail

/// Starts `task` on `loop` and returns its Future. When called on the loop's thread the task starts at
/// once, inline; otherwise it is posted to the loop. The task's stop token is the Future's: cancel()
/// reaches it (and every Task and Future it awaits).
/// Lifetime: the task's frame, its parameters included, is destroyed before the Future completes, so
/// whoever sees it complete (get, wait, co_await, sync_wait) finds them released.
template <class T>
Future<T> spawn(Loop& loop, Task<T> task) {
  auto state = std::allocate_shared<detail::FutureState<T>>(detail::PooledAllocator<detail::FutureState<T>>{});
  state->set_loop(&loop);
  task.set_stop_token(state->stop_token());
  auto driver = detail::drive(loop, std::move(task), state);
  if (loop.in_loop_thread()) {
    driver.handle.resume();
  } else {
    loop.post([handle = driver.handle] { handle.resume(); });
  }
  return Future<T>(std::move(state));
}

/// A Future that is already complete with `value` (or void).
template <class T>
Future<T> make_ready_future(T value) {
  auto state = std::make_shared<detail::FutureState<T>>();
  state->set_value(std::move(value));
  state->finish();
  return Future<T>(std::move(state));
}
inline Future<void> make_ready_future() {
  // One state for all: complete, without an error, it never changes again (cancel, wait and get only
  // read it), and an operation that completes at its call (the shm arena's fast path, a send the ring
  // took whole) costs no allocation for its Future. Never freed, so its references need no count: an
  // aliasing shared_ptr without a control block, whose copies and ends are no atomic operations (a
  // counted one was two locked instructions on every such call, bench/RESULTS.md, "In place,
  // uncounted"), and a Future that outlives the statics at exit touches nothing freed.
  static detail::FutureState<void>* const done = [] {
    auto* state = new detail::FutureState<void>();
    state->finish();
    return state;
  }();
  return Future<void>(std::shared_ptr<detail::FutureState<void>>(std::shared_ptr<void>(), done));
}

/// Runs `task` on `loop` and blocks the calling thread until it finishes; returns its result or throws.
/// On the loop's own thread it throws weft::Error (Errc::would_deadlock) unless the task finished inline.
template <class T>
T sync_wait(Loop& loop, Task<T> task) {
  return spawn(loop, std::move(task)).get();
}

}  // namespace weft
