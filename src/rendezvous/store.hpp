#pragma once
// The rendezvous store: a small key-value service over TCP that rank 0 serves during bootstrap
// (set, get, add, wait with a timeout that reports the keys still missing). Protocol: docs/PROTOCOL.md.
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include <asio.hpp>

#include "rendezvous/greeting.hpp"

namespace weft::store {

inline constexpr std::uint32_t magic = 0x54535746;  // "FWST" as little-endian bytes
inline constexpr std::size_t request_header_size = 20;
inline constexpr std::size_t response_header_size = 12;
inline constexpr std::uint32_t max_key_bytes = 64 * 1024;
inline constexpr std::uint64_t max_value_bytes = 16 << 20;

enum class Command : std::uint8_t { set = 1, get = 2, add = 3, wait = 4 };
/// `stopped`: WAIT's answer once the store refused a process of its own job for how it was set up
/// (another world size, algorithm choice or integrity mode): no group can form, the reason is the payload.
enum class Status : std::uint8_t { ok = 0, missing = 1, bad_request = 2, stopped = 3 };

/// A request's header, checked: the magic, a known command, key and value within their limits.
struct Request {
  Command command;
  std::uint32_t key_bytes;
  std::uint64_t value_bytes;
};
/// Parses the request_header_size bytes at `header`, or returns nullopt with `error` saying what is wrong.
std::optional<Request> parse_request(const std::byte* header, std::string& error);
/// The store's contents.
using Table = std::unordered_map<std::string, std::string>;
/// A reply, and whether the request changed the table (WAITs then look again).
struct Reply {
  Status status;
  std::string payload;
  bool changed = false;
};
/// Runs SET, GET or ADD on `data` (WAIT is the server's own: it sleeps). ADD's 8-byte integers wrap.
Reply apply(Table& data, Command command, const std::string& key, std::string value);
/// WAIT's timeout from its 8-byte value (at most a day), or nullopt when the value is not 8 bytes.
std::optional<std::chrono::milliseconds> wait_timeout(const std::string& value);
/// The keys of a WAIT request (separated by '\n').
std::vector<std::string> split_lines(const std::string& text);

/// Who may use the store: every connection greets first (greeting.hpp) and is refused, with its address
/// and the reason logged, unless it proves `secret` (when set), belongs to `job`, agrees with
/// `world_size` and claims a rank that no other connection claimed before (a claim is looked at only
/// once the secret is proven).
struct Admission {
  std::string job;
  std::string secret;
  int world_size = 0;
  /// A connection that has not finished its greeting within this is dropped.
  std::chrono::milliseconds greeting_timeout{std::chrono::seconds(10)};
  /// At most this many connections may be greeting at once; a new one past that closes the oldest
  /// greeting (logged), so that silent strangers cannot keep real ranks out.
  int max_pending = 64;
  /// What the job's frames carry: a rank that says otherwise is refused at once.
  Integrity integrity = Integrity::off;
  /// The digest of what shapes the job's plans (rank 0's; bootstrap's `selection`): likewise.
  std::uint64_t selection = 0;
};

class Server {
 public:
  /// Binds `endpoint` and starts serving on `executor` (a loop's: detail::executor_of). Throws
  /// std::system_error when it cannot bind.
  Server(const asio::any_io_executor& executor, const asio::ip::tcp::endpoint& endpoint, Admission admission);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  unsigned short port() const;
  /// Stops accepting and closes every connection (on the io_context's thread).
  void close();
  /// The connections refused so far (greeting::RefusalLog::summary); on the io_context's thread.
  std::string refusals() const;
  /// Whether every rank of the world was answered Status::stopped, but those whose process was refused;
  /// on the io_context's thread.
  bool told_every_rank() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

/// WAIT's Status::stopped: `what()` is the store's reason.
class Stopped : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Client {
 public:
  explicit Client(asio::ip::tcp::socket socket) : socket_(std::move(socket)) {}
  asio::ip::tcp::socket& socket() noexcept { return socket_; }

  asio::awaitable<void> set(const std::string& key, const std::string& value);
  asio::awaitable<std::optional<std::string>> get(const std::string& key);
  asio::awaitable<std::int64_t> add(const std::string& key, std::int64_t delta);
  /// Waits until every key exists or `timeout` passes; returns the keys still missing (empty: all there).
  /// Throws Stopped when the store stopped the bootstrap.
  asio::awaitable<std::vector<std::string>> wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

 private:
  asio::awaitable<std::pair<Status, std::string>> call(Command command, const std::string& key, const std::string& value);
  asio::ip::tcp::socket socket_;
};

}  // namespace weft::store
