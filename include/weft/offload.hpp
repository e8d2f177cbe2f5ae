#pragma once
/// weft::offload and weft::ComputePool: compute off the loop's thread, from a coroutine, and back.
///
/// A weft coroutine runs on its Loop's thread (or on the thread that drives the loop through a blocking
/// wait). Compute placed there stalls every operation of that loop: an all_reduce started before it makes
/// no progress until it ends. `co_await weft::offload(fn)` runs `fn` on a compute thread instead and
/// resumes the coroutine afterwards on the loop it left, so the loop goes on moving bytes meanwhile:
///
///     auto reduced = group.all_reduce(grads);                 // starts now, on the loop
///     co_await weft::offload([&] { compute(next_layer); });   // on a compute thread; the loop goes on
///     co_await std::move(reduced);
///
/// Returns: what `fn` returns. Errors: what `fn` throws is rethrown in the coroutine.
/// Cancellation: none; `fn` runs to its end once started (check your own flag inside it if needed).
/// Lifetime: `fn` is moved into the awaiter, which lives in the coroutine's frame until it resumes; what
/// `fn` references must outlive the co_await (it does when it lives in the same coroutine).
/// Threads: the process's shared pool (ComputePool::shared()) has WEFT_COMPUTE_THREADS threads, else one
/// per core, started at first use. A coroutine that was not on a Loop's thread resumes on the compute
/// thread.
#include <condition_variable>
#include <coroutine>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "weft/loop.hpp"

namespace weft {

/// A fixed set of threads that run submitted jobs in order of submission.
class ComputePool {
 public:
  /// `threads` 0: WEFT_COMPUTE_THREADS, else std::thread::hardware_concurrency() (at least 1).
  explicit ComputePool(unsigned threads = 0);
  /// Runs the jobs already submitted, then joins the threads.
  ~ComputePool();
  ComputePool(const ComputePool&) = delete;
  ComputePool& operator=(const ComputePool&) = delete;

  /// Queues `job` for a pool thread. Thread-safe. A job must not throw (offload catches for you).
  void submit(std::function<void()> job);
  unsigned size() const noexcept { return static_cast<unsigned>(threads_.size()); }

  /// The process's pool, made at first use and kept until exit.
  static ComputePool& shared();

  /// `co_await pool.schedule()` continues the coroutine on one of the pool's threads (come back with
  /// `co_await loop.schedule()`).
  auto schedule() noexcept {
    struct Awaiter {
      ComputePool* pool;
      bool await_ready() const noexcept { return false; }
      void await_suspend(std::coroutine_handle<> h) { pool->submit([h] { h.resume(); }); }
      void await_resume() const noexcept {}
    };
    return Awaiter{this};
  }

 private:
  void work();

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;  // guarded by mutex_
  bool stopping_ = false;                   // guarded by mutex_
  std::vector<std::thread> threads_;
};

namespace detail {

/// Jobs running on compute pools right now, process-wide: a loop does not busy-poll while they keep
/// every core of the rank busy (src/core/loop.cpp).
int compute_jobs_running() noexcept;

template <class F>
class OffloadAwaiter {
  using Result = std::invoke_result_t<F&>;
  using Stored = std::conditional_t<std::is_void_v<Result>, std::monostate, Result>;

 public:
  OffloadAwaiter(ComputePool& pool, F fn) : pool_(&pool), fn_(std::move(fn)) {}

  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) {
    home_ = Loop::current();
    pool_->submit([this, h] {
      try {
        if constexpr (std::is_void_v<Result>) {
          fn_();
          value_.emplace();
        } else {
          value_.emplace(fn_());
        }
      } catch (...) {
        error_ = std::current_exception();
      }
      if (home_) {
        home_->post([h] { h.resume(); });
      } else {
        h.resume();
      }
    });
  }
  Result await_resume() {
    if (error_) std::rethrow_exception(error_);
    if constexpr (!std::is_void_v<Result>) return std::move(*value_);
  }

 private:
  ComputePool* pool_;
  F fn_;
  Loop* home_ = nullptr;
  std::optional<Stored> value_;
  std::exception_ptr error_;
};

}  // namespace detail

/// Runs `fn` on `pool` and resumes the awaiting coroutine on the Loop it was running on (see the top
/// of this header).
template <class F>
detail::OffloadAwaiter<std::decay_t<F>> offload(ComputePool& pool, F&& fn) {
  return detail::OffloadAwaiter<std::decay_t<F>>(pool, std::forward<F>(fn));
}
/// The same on the process's shared pool.
template <class F>
detail::OffloadAwaiter<std::decay_t<F>> offload(F&& fn) {
  return offload(ComputePool::shared(), std::forward<F>(fn));
}

}  // namespace weft
