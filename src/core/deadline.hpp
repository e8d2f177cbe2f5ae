#pragma once
// Races an Asio awaitable against a deadline: the control plane's helper (bootstrap, the store's
// greetings, the shared-memory links).
#include <chrono>
#include <exception>
#include <utility>
#include <optional>

#include <asio.hpp>
#include <asio/experimental/awaitable_operators.hpp>

namespace weft {

namespace detail {
// `op`'s result or its exception, as a value: Asio's `||` waits on for the other operation when one
// throws, which would turn every failure into a timeout.
template <class T>
asio::awaitable<std::pair<std::optional<T>, std::exception_ptr>> captured(asio::awaitable<T> op) {
  std::exception_ptr error;
  try {
    co_return std::pair<std::optional<T>, std::exception_ptr>(co_await std::move(op), nullptr);
  } catch (...) {
    error = std::current_exception();
  }
  co_return std::pair<std::optional<T>, std::exception_ptr>(std::nullopt, error);
}
}  // namespace detail

/// Runs `op` until it completes or `deadline` passes (then `op` is cancelled). Returns nullopt when the
/// deadline won; an exception of `op` propagates at once.
template <class T>
asio::awaitable<std::optional<T>> with_deadline(asio::awaitable<T> op, std::chrono::steady_clock::time_point deadline) {
  using namespace asio::experimental::awaitable_operators;
  asio::steady_timer timer(co_await asio::this_coro::executor, deadline);
  auto result = co_await (detail::captured(std::move(op)) || timer.async_wait(asio::use_awaitable));
  if (result.index() == 1) co_return std::nullopt;
  auto& [value, error] = std::get<0>(result);
  if (error) std::rethrow_exception(error);
  co_return std::move(value);
}

}  // namespace weft
