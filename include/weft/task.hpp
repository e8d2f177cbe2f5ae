#pragma once
/// weft::Task<T>: a lazy coroutine. Nothing runs until it is awaited (or handed to weft::spawn).
///
/// - Move-only and [[nodiscard]]: a Task that is dropped never runs.
/// - Symmetric transfer: awaiting a Task jumps straight into it and its final suspend jumps straight back
///   to the awaiter, so long pipelines of Tasks do not grow the stack.
/// - Exceptions propagate to the awaiter.
/// - Cancellation: every Task carries a std::stop_token, inherited from the Task that awaits it (or from
///   the Future that spawned it). Read it with `co_await weft::this_stop_token()`.
#include <coroutine>
#include <cstddef>
#include <exception>
#include <stop_token>
#include <type_traits>
#include <utility>
#include <variant>

namespace weft {

template <class T = void>
class Task;

namespace detail {
struct TaskPromiseBase;
}

/// `co_await weft::this_stop_token()` inside a Task yields the Task's std::stop_token without suspending.
/// (An awaiter that reads its promise, rather than an await_transform: no awaiter is ever copied.)
struct this_stop_token {
  std::stop_token token;
  bool await_ready() const noexcept { return false; }
  template <class Promise>
  bool await_suspend(std::coroutine_handle<Promise> h) noexcept {
    if constexpr (std::is_base_of_v<detail::TaskPromiseBase, Promise>) token = h.promise().stop_token_;
    return false;
  }
  std::stop_token await_resume() const noexcept { return token; }
};

namespace detail {

/// Coroutine frames (Task, and the detached drivers of spawn): a collective makes and frees a handful per
/// call, and glibc's per-thread cache keeps only chunks of up to about 1 KiB, seven of a size. These keep
/// freed frames per 64-byte size class on each thread, for the next calls: a window's worth (64) of each
/// class up to 512 bytes, 16 of each larger one up to 4 KiB (user-space
/// instructions per 8 B all_reduce, bench/RESULTS.md). Bypassed under AddressSanitizer, so that it still
/// sees a frame used after it was freed.
void* allocate_frame(std::size_t size);
void free_frame(void* frame, std::size_t size) noexcept;
/// Whether frames are kept for reuse in this build (not under AddressSanitizer).
bool frames_pooled() noexcept;

/// The same pool for a Future's operation state made per call (a send's or a small collective's, through
/// std::allocate_shared): a state of more than about 1 KiB misses glibc's per-thread cache every time
/// (a small broadcast's MessagePlanOp is 2.6 KiB: about 300 instructions of malloc and free per call).
template <class T>
struct PooledAllocator {
  using value_type = T;
  PooledAllocator() noexcept = default;
  template <class U>
  PooledAllocator(const PooledAllocator<U>&) noexcept {}
  static_assert(alignof(T) <= __STDCPP_DEFAULT_NEW_ALIGNMENT__, "the pool's blocks have operator new's alignment");
  T* allocate(std::size_t n) { return static_cast<T*>(allocate_frame(n * sizeof(T))); }
  void deallocate(T* p, std::size_t n) noexcept { free_frame(p, n * sizeof(T)); }
  template <class U>
  friend bool operator==(const PooledAllocator&, const PooledAllocator<U>&) noexcept { return true; }
};

/// The allocation functions of weft's promise types.
struct PooledFrame {
  static void* operator new(std::size_t size) { return allocate_frame(size); }
  static void operator delete(void* frame, std::size_t size) noexcept { free_frame(frame, size); }
};

struct TaskPromiseBase : PooledFrame {
  std::coroutine_handle<> continuation_;
  std::stop_token stop_token_;

  struct FinalAwaiter {
    bool await_ready() const noexcept { return false; }
    template <class Promise>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<Promise> self) noexcept {
      if (auto next = self.promise().continuation_) return next;
      return std::noop_coroutine();
    }
    void await_resume() const noexcept {}
  };

  std::suspend_always initial_suspend() const noexcept { return {}; }
  FinalAwaiter final_suspend() const noexcept { return {}; }

};

/// The stop token of the coroutine behind `handle`, if it is a Task; an empty token otherwise.
template <class Promise>
std::stop_token stop_token_of(std::coroutine_handle<Promise> handle) noexcept {
  if constexpr (std::is_base_of_v<TaskPromiseBase, Promise>) {
    return handle.promise().stop_token_;
  } else {
    return {};
  }
}

template <class T>
struct TaskPromise : TaskPromiseBase {
  std::variant<std::monostate, T, std::exception_ptr> result_;

  Task<T> get_return_object() noexcept;
  void unhandled_exception() noexcept { result_.template emplace<2>(std::current_exception()); }
  template <class U>
    requires std::is_convertible_v<U&&, T>
  void return_value(U&& value) noexcept(std::is_nothrow_constructible_v<T, U&&>) {
    result_.template emplace<1>(std::forward<U>(value));
  }
  T take_result() {
    if (result_.index() == 2) std::rethrow_exception(std::get<2>(result_));
    return std::move(std::get<1>(result_));
  }
};

template <>
struct TaskPromise<void> : TaskPromiseBase {
  std::exception_ptr error_;

  Task<void> get_return_object() noexcept;
  void unhandled_exception() noexcept { error_ = std::current_exception(); }
  void return_void() noexcept {}
  void take_result() {
    if (error_) std::rethrow_exception(error_);
  }
};

}  // namespace detail

template <class T>
class [[nodiscard]] Task {
 public:
  using promise_type = detail::TaskPromise<T>;
  using value_type = T;

  Task() noexcept = default;
  explicit Task(std::coroutine_handle<promise_type> handle) noexcept : handle_(handle) {}
  Task(Task&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  Task& operator=(Task&& other) noexcept {
    if (this != &other) {
      if (handle_) handle_.destroy();
      handle_ = std::exchange(other.handle_, {});
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() {
    if (handle_) handle_.destroy();
  }

  bool valid() const noexcept { return static_cast<bool>(handle_); }

  /// Sets the stop token the Task (and everything it awaits) sees. Used by spawn; awaiting a Task
  /// from another Task passes the parent's token down instead.
  void set_stop_token(std::stop_token token) noexcept { handle_.promise().stop_token_ = std::move(token); }

  struct Awaiter {
    std::coroutine_handle<promise_type> handle;
    bool await_ready() const noexcept { return !handle || handle.done(); }
    template <class Parent>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<Parent> parent) noexcept {
      handle.promise().continuation_ = parent;
      if constexpr (std::is_base_of_v<detail::TaskPromiseBase, Parent>) {
        handle.promise().stop_token_ = parent.promise().stop_token_;
      }
      return handle;
    }
    T await_resume() { return handle.promise().take_result(); }
  };
  Awaiter operator co_await() && noexcept { return Awaiter{handle_}; }

 private:
  std::coroutine_handle<promise_type> handle_;
};

namespace detail {
template <class T>
Task<T> TaskPromise<T>::get_return_object() noexcept {
  return Task<T>(std::coroutine_handle<TaskPromise<T>>::from_promise(*this));
}
inline Task<void> TaskPromise<void>::get_return_object() noexcept {
  return Task<void>(std::coroutine_handle<TaskPromise<void>>::from_promise(*this));
}

/// A fire-and-forget coroutine that starts suspended and frees itself when it finishes. The building
/// block of spawn and when_all; not for users (it would swallow errors).
struct Detached {
  struct promise_type : PooledFrame {
    Detached get_return_object() noexcept {
      return Detached{std::coroutine_handle<promise_type>::from_promise(*this)};
    }
    std::suspend_always initial_suspend() const noexcept { return {}; }
    std::suspend_never final_suspend() const noexcept { return {}; }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { std::terminate(); }
  };
  std::coroutine_handle<promise_type> handle;
};
}  // namespace detail

}  // namespace weft
