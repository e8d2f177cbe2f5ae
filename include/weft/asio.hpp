#pragma once
/// weft::async_wait: a weft::Future as an Asio asynchronous operation, for code written with Asio's
/// completion tokens — above all `asio::awaitable` coroutines in a server whose io_context is also weft's
/// loop (borrowed mode: `weft::Loop loop(io)`):
///
///     asio::awaitable<void> handle(weft::Group& group, std::vector<float>& x) {
///       co_await weft::async_wait(group.all_reduce(x), asio::use_awaitable);
///     }
///
/// Signature: void(std::exception_ptr) for Future<void>, void(std::exception_ptr, T) otherwise (T must be
/// default-constructible: it is passed, empty, with an error). With asio::use_awaitable the error is
/// rethrown in the coroutine and the value returned.
/// Errors: the operation's weft::Error, carried in the exception_ptr.
/// Cancellation: a cancellation slot bound to the handler (asio::bind_cancellation_slot, or a
/// cancelled awaitable's) cancels the Future (Future::cancel: see weft::Group for what that means).
/// Threads: the handler runs on its associated executor (the awaitable's io_context), posted, never
/// inline inside weft's completion.
/// Needs standalone Asio (-DASIO_STANDALONE, which weft.pc and the CMake package add).
#include <exception>
#include <type_traits>
#include <utility>

#include <asio/associated_cancellation_slot.hpp>
#include <asio/associated_executor.hpp>
#include <asio/async_result.hpp>
#include <asio/execution/outstanding_work.hpp>
#include <asio/post.hpp>
#include <asio/prefer.hpp>

#include "weft/future.hpp"

namespace weft {
namespace detail {

// Awaits `future` (resuming on the thread that completes it, weft's loop) and hands the outcome to
// `deliver`. Nothing escapes: Detached would terminate on an exception. The operation's state (with its
// copy of a failure) is let go before the outcome is handed on, and the failure moved along with it, so
// that nothing of it is released on weft's thread after the handler has run on the caller's.
template <class T, class Deliver>
Detached await_then(Future<T> future, Deliver deliver) {
  std::exception_ptr error;
  if constexpr (std::is_void_v<T>) {
    try {
      co_await std::move(future);
    } catch (...) {
      error = std::current_exception();
    }
    future = Future<T>{};
    deliver(std::move(error));
  } else {
    T value{};
    try {
      value = co_await std::move(future);
    } catch (...) {
      error = std::current_exception();
    }
    future = Future<T>{};
    deliver(std::move(error), std::move(value));
  }
}

template <class T>
struct AsyncWaitSignature {
  using type = void(std::exception_ptr, T);
};
template <>
struct AsyncWaitSignature<void> {
  using type = void(std::exception_ptr);
};

}  // namespace detail

template <class T, class CompletionToken>
auto async_wait(Future<T> future, CompletionToken&& token) {
  return asio::async_initiate<CompletionToken, typename detail::AsyncWaitSignature<T>::type>(
      [](auto handler, Future<T> future) {
        auto slot = asio::get_associated_cancellation_slot(handler);
        if (slot.is_connected()) {
          slot.assign([state = future.state()](asio::cancellation_type) { state->cancel(state); });
        }
        // Keeps the handler's executor (its io_context) from running out of work meanwhile.
        auto executor = asio::prefer(asio::get_associated_executor(handler), asio::execution::outstanding_work.tracked);
        auto deliver = [handler = std::move(handler), executor](std::exception_ptr error, auto&&... value) mutable {
          asio::post(executor, [handler = std::move(handler), error = std::move(error),
                                ... value = std::forward<decltype(value)>(value)]() mutable {
            auto slot = asio::get_associated_cancellation_slot(handler);
            if (slot.is_connected()) slot.clear();
            std::move(handler)(error, std::move(value)...);
          });
        };
        auto driver = detail::await_then(std::move(future), std::move(deliver));
        driver.handle.resume();
      },
      token, std::move(future));
}

}  // namespace weft
