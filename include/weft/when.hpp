#pragma once
/// Combinators over Futures (and Tasks, which are spawned on a Loop first).
///
/// when_all: completes when every child completed. When one fails, the others are cancelled; the first
/// failure is rethrown once every child has finished (no child outlives the combinator).
/// when_any: completes when the first child completes; the others are cancelled and awaited. Returns the
/// index of the winner and its value (or rethrows its error). Errors: weft::Error (invalid_argument) for
/// no Futures at all.
#include <atomic>
#include <chrono>
#include <string>
#include <coroutine>
#include <exception>
#include <functional>
#include <optional>
#include <utility>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <variant>
#include <vector>

#include "weft/error.hpp"
#include "weft/future.hpp"

namespace weft {

namespace detail {

template <class T>
using NonVoid = std::conditional_t<std::is_void_v<T>, std::monostate, T>;

// Shared by the children of a combinator: counts them down and resumes the parent after the last.
struct Latch {
  explicit Latch(std::size_t n) : remaining(n + 1) {}  // +1: the parent's own arrival in suspend()
  std::atomic<std::size_t> remaining;
  std::coroutine_handle<> parent;
  std::mutex mutex;
  std::exception_ptr first_error;  // guarded by mutex
  std::atomic<long> winner{-1};
  // Cancels every child: `cancel_children(children)`, over the Futures the combinator's frame holds; set
  // before any child starts. A function and the Futures' address, not a copy of every child's state: the
  // copies cost two atomic operations a child (a window of 64 receives awaited with when_all made 128),
  // for a cancel that seldom comes. The frame outlives every call: a child calls it before it arrives,
  // the frame waits for every arrival, and the stop callback is gone before the frame (Children).
  void (*cancel_children)(void* children) = nullptr;
  void* children = nullptr;

  void cancel_others() { cancel_children(children); }
  void record_error(std::exception_ptr e) {
    {
      std::lock_guard lock(mutex);
      if (!first_error) first_error = e;
    }
    cancel_others();
  }
  void arrive() {
    if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) parent.resume();
  }
  // Child `index` finished well: with `any` (when_any), the first to do so wins and cancels the rest.
  void succeeded(long index, bool any) {
    long none = -1;
    if (any && winner.compare_exchange_strong(none, index)) cancel_others();
  }
  // Child `index` failed: for when_all its error counts (the first one is rethrown); for when_any only
  // when it is the first to finish.
  void failed(long index, bool any, std::exception_ptr e) {
    long none = -1;
    if (!any || winner.compare_exchange_strong(none, index)) record_error(std::move(e));
  }
  struct Awaiter {
    Latch* latch;
    bool await_ready() const noexcept { return false; }
    bool await_suspend(std::coroutine_handle<> h) noexcept {
      latch->parent = h;
      return latch->remaining.fetch_sub(1, std::memory_order_acq_rel) != 1;
    }
    void await_resume() const noexcept {}
  };
};

// Awaits one child, hands its value to `on_value`, records its failure, and counts down the latch.
// With `any`, the first child to finish wins and cancels the rest.
template <class T, class OnValue>
Detached watch_child(Future<T>& future, std::shared_ptr<Latch> latch, OnValue on_value, long index, bool any) {
  try {
    if constexpr (std::is_void_v<T>) {
      co_await std::move(future);
      on_value(std::monostate{});
    } else {
      on_value(co_await std::move(future));
    }
    latch->succeeded(index, any);
  } catch (...) {
    latch->failed(index, any, std::current_exception());
  }
  // This child's reference goes before it arrives: the parent's keeps the latch (with the failure it
  // rethrows) until the parent is done with it, on the parent's thread, so that a child finishing on
  // another thread never frees it after the parent went on. Nothing here is touched after arrive().
  Latch* const counted = latch.get();
  latch.reset();
  counted->arrive();
}

// What every combinator sets up around its children: the latch, with the way to cancel them all
// installed before anything can fire, and the awaiting Task's stop token forwarded to the children while
// they run. `futures` (a vector or a tuple of Futures, in the combinator's frame) outlives it.
// Usage: make it, start each child with watch_child(..., latch, ...), co_await all_done(), then finish().
struct Children {
  template <class T>
  Children(std::vector<Future<T>>& futures, const std::stop_token& token)
      : Children(futures.size(), &cancel_vector<T>, &futures, token) {}
  template <class... Ts>
  Children(std::tuple<Future<Ts>...>& futures, const std::stop_token& token)
      : Children(sizeof...(Ts), &cancel_tuple<Ts...>, &futures, token) {}
  Children(std::size_t count, void (*cancel_children)(void*), void* children, const std::stop_token& token)
      : latch(std::make_shared<Latch>(count)) {
    latch->cancel_children = cancel_children;
    latch->children = children;
    if (token.stop_possible()) on_stop.emplace(token, std::function<void()>([l = latch] { l->cancel_others(); }));
  }
  template <class T>
  static void cancel_vector(void* futures) {
    for (auto& f : *static_cast<std::vector<Future<T>>*>(futures)) f.cancel();
  }
  template <class... Ts>
  static void cancel_tuple(void* futures) {
    std::apply([](auto&... f) { (f.cancel(), ...); }, *static_cast<std::tuple<Future<Ts>...>*>(futures));
  }
  std::shared_ptr<Latch> latch;
  std::optional<std::stop_callback<std::function<void()>>> on_stop;

  Latch::Awaiter all_done() const noexcept { return Latch::Awaiter{latch.get()}; }
  // Every child has finished: stop forwarding, and rethrow the failure that decided the outcome.
  void finish() {
    on_stop.reset();
    if (latch->first_error) std::rethrow_exception(latch->first_error);
  }
};

}  // namespace detail

/// when_all over a vector of Futures of one type. Returns the values in order (std::monostate for void).
template <class T>
Task<std::vector<detail::NonVoid<T>>> when_all(std::vector<Future<T>> futures);

/// when_all over Futures of different types; returns a tuple (std::monostate for void).
template <class... Ts>
Task<std::tuple<detail::NonVoid<Ts>...>> when_all(Future<Ts>... futures);

/// The winner of a when_any: its index and its value.
template <class T>
struct WhenAnyResult {
  std::size_t index = 0;
  detail::NonVoid<T> value{};
};

template <class T>
Task<WhenAnyResult<T>> when_any(std::vector<Future<T>> futures);

/// Spawns each Task on `loop`, then when_all / when_any over their Futures.
template <class T>
Task<std::vector<detail::NonVoid<T>>> when_all(Loop& loop, std::vector<Task<T>> tasks) {
  std::vector<Future<T>> futures;
  for (auto& t : tasks) futures.push_back(spawn(loop, std::move(t)));
  co_return co_await when_all(std::move(futures));
}
template <class T>
Task<WhenAnyResult<T>> when_any(Loop& loop, std::vector<Task<T>> tasks) {
  std::vector<Future<T>> futures;
  for (auto& t : tasks) futures.push_back(spawn(loop, std::move(t)));
  co_return co_await when_any(std::move(futures));
}

}  // namespace weft

namespace weft {

namespace detail {
// What when_all and when_any over a vector share: every future watched, each value in its slot, the first
// to finish (first_wins) or the last cancelling the rest as `Children` says; the index of the first.
template <class T>
struct Gathered {
  std::vector<std::optional<NonVoid<T>>> slots;
  std::size_t first = 0;
};
// One child of gather: watch_child without a coroutine frame (FutureStateBase::notify). A window of 64
// receives awaited with when_all made and resumed 64 frames, about 330 instructions a receive.
template <class T>
struct GatheredChild {
  FutureState<T>* state;
  std::optional<NonVoid<T>>* slot;
  Latch* latch;
  long index;
  bool first_wins;

  // The child completed (on the thread that completed it): its value or error, then the latch, which
  // may resume the parent and free this (nothing here is touched after arrive()).
  static void done(void* context) noexcept {
    auto* child = static_cast<GatheredChild*>(context);
    Latch* latch = child->latch;
    child->settle();
    latch->arrive();
  }
  void settle() noexcept {
    try {
      if (!state) throw_empty_future("co_await");  // an empty Future is this child's error, as co_await's
      if constexpr (std::is_void_v<T>) {
        state->take();
        slot->emplace();
      } else {
        slot->emplace(state->take());
      }
      latch->succeeded(index, first_wins);
    } catch (...) {
      latch->failed(index, first_wins, std::current_exception());
    }
  }
};

template <class T>
Task<Gathered<T>> gather(std::vector<Future<T>>& futures, bool first_wins) {
  Gathered<T> out{std::vector<std::optional<NonVoid<T>>>(futures.size())};
  auto& slots = out.slots;
  const std::stop_token token = co_await this_stop_token();
  Children children(futures, token);
  std::vector<GatheredChild<T>> watched(futures.size());
  for (std::size_t i = 0; i < futures.size(); ++i) {
    FutureState<T>* state = futures[i].state().get();
    watched[i] = GatheredChild<T>{state, &slots[i], children.latch.get(), static_cast<long>(i), first_wins};
    if (!state || !state->notify(&GatheredChild<T>::done, &watched[i])) GatheredChild<T>::done(&watched[i]);  // complete
  }
  co_await children.all_done();
  children.finish();
  if (first_wins) out.first = static_cast<std::size_t>(children.latch->winner.load());
  co_return out;
}
}  // namespace detail

template <class T>
Task<std::vector<detail::NonVoid<T>>> when_all(std::vector<Future<T>> futures) {
  auto gathered = co_await detail::gather(futures, false);
  std::vector<detail::NonVoid<T>> out;
  out.reserve(gathered.slots.size());
  for (auto& s : gathered.slots) out.push_back(std::move(*s));
  co_return out;
}

template <class... Ts>
Task<std::tuple<detail::NonVoid<Ts>...>> when_all(Future<Ts>... futures) {
  std::tuple<Future<Ts>...> owned(std::move(futures)...);
  std::tuple<std::optional<detail::NonVoid<Ts>>...> slots;
  const std::stop_token token = co_await this_stop_token();
  detail::Children children(owned, token);
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    (detail::watch_child(std::get<I>(owned), children.latch,
                         [&slots](auto&& v) { std::get<I>(slots).emplace(std::move(v)); }, static_cast<long>(I), false)
         .handle.resume(),
     ...);
  }(std::index_sequence_for<Ts...>{});
  co_await children.all_done();
  children.finish();
  co_return std::apply([](auto&... s) { return std::tuple<detail::NonVoid<Ts>...>(std::move(*s)...); }, slots);
}

template <class T>
Task<WhenAnyResult<T>> when_any(std::vector<Future<T>> futures) {
  if (futures.empty()) {  // there is no winner to name (it returned index SIZE_MAX, and read past the slots)
    throw Error(Errc::invalid_argument, ErrorContext{.op = "when_any"}, "no Futures to wait for: there is no first one");
  }
  auto gathered = co_await detail::gather(futures, true);
  co_return WhenAnyResult<T>{gathered.first, std::move(*gathered.slots[gathered.first])};
}

}  // namespace weft

namespace weft {

/// Awaits `future`, but for at most `timeout`: past it this rank cancels the operation (Future::cancel)
/// and weft::TimeoutError is thrown (once the operation has ended, so its buffers are free again). Not
/// to be confused with a deadline (Options::timeout, Group::with_timeout), which fails a collective on
/// every rank with a report of who had not joined: this is one rank giving up on one awaited result.
/// Errors: the operation's own error, or TimeoutError. Cancellation: the awaiting Task's stop token
/// cancels the operation too.
template <class T>
Task<T> cancel_after(Loop& loop, Future<T> future, std::chrono::nanoseconds timeout) {
  if (!future.valid()) detail::throw_empty_future("cancel_after");  // its timer would look at no state
  auto fired = std::make_shared<std::atomic<bool>>(false);
  const std::uint64_t timer = loop.call_after(timeout, [fired, state = future.state()](bool expired) {
    if (!expired || state->ready()) return;
    fired->store(true);
    state->cancel(state);
  });
  std::exception_ptr error;
  std::optional<detail::NonVoid<T>> value;
  try {
    if constexpr (std::is_void_v<T>) {
      co_await std::move(future);
    } else {
      value.emplace(co_await std::move(future));
    }
  } catch (...) {
    error = std::current_exception();
  }
  loop.cancel_timer(timer);
  if (error) {
    if (fired->load()) {
      throw TimeoutError({.op = "cancel_after"},
                         "the operation did not finish within " +
                             std::to_string(std::chrono::duration_cast<std::chrono::milliseconds>(timeout).count()) + " ms");
    }
    std::rethrow_exception(error);
  }
  if constexpr (!std::is_void_v<T>) co_return std::move(*value);
}

}  // namespace weft
