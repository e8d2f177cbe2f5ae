#pragma once
// Races an Asio awaitable against a deadline (bootstrap and the store's greetings).
#include <chrono>
#include <optional>

#include <asio.hpp>
#include <asio/experimental/awaitable_operators.hpp>

namespace weft {

/// Runs `op` until it completes or `deadline` passes (then `op` is cancelled). Returns nullopt when the
/// deadline won; exceptions of `op` propagate.
template <class T>
asio::awaitable<std::optional<T>> with_deadline(asio::awaitable<T> op, std::chrono::steady_clock::time_point deadline) {
  using namespace asio::experimental::awaitable_operators;
  asio::steady_timer timer(co_await asio::this_coro::executor, deadline);
  auto result = co_await (std::move(op) || timer.async_wait(asio::use_awaitable));
  if (result.index() == 0) co_return std::optional<T>(std::move(std::get<0>(result)));
  co_return std::nullopt;
}

}  // namespace weft
