#pragma once
// The rendezvous store: a small key-value service over TCP that rank 0 serves during bootstrap
// (set, get, add, wait with a timeout that reports the keys still missing). Protocol: docs/PROTOCOL.md.
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio.hpp>

namespace weft::store {

inline constexpr std::uint32_t magic = 0x54535746;  // "FWST" as little-endian bytes
inline constexpr std::size_t request_header_size = 20;
inline constexpr std::size_t response_header_size = 12;
inline constexpr std::uint32_t max_key_bytes = 64 * 1024;
inline constexpr std::uint64_t max_value_bytes = 16 << 20;

enum class Command : std::uint8_t { set = 1, get = 2, add = 3, wait = 4 };
enum class Status : std::uint8_t { ok = 0, missing = 1, bad_request = 2 };

class Server {
 public:
  /// Binds `endpoint` and starts serving on `io`. Throws std::system_error when it cannot bind.
  Server(asio::io_context& io, const asio::ip::tcp::endpoint& endpoint);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  unsigned short port() const;
  /// Stops accepting and closes every connection (on the io_context's thread).
  void close();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

class Client {
 public:
  explicit Client(asio::ip::tcp::socket socket) : socket_(std::move(socket)) {}
  asio::ip::tcp::socket& socket() noexcept { return socket_; }

  asio::awaitable<void> set(const std::string& key, const std::string& value);
  asio::awaitable<std::optional<std::string>> get(const std::string& key);
  asio::awaitable<std::int64_t> add(const std::string& key, std::int64_t delta);
  /// Waits until every key exists or `timeout` passes; returns the keys still missing (empty: all there).
  asio::awaitable<std::vector<std::string>> wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

 private:
  asio::awaitable<std::pair<Status, std::string>> call(Command command, const std::string& key, const std::string& value);
  asio::ip::tcp::socket socket_;
};

}  // namespace weft::store
