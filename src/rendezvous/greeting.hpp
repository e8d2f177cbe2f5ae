#pragma once
// The greeting: the first bytes on every connection weft opens (to the store, and between ranks). When
// the job has a shared secret it first runs a mutual challenge-response (HMAC-SHA256 over both sides'
// hellos, through OpenSSL's libcrypto), and only then do the sides say which job and which rank they
// are: a process without the secret learns nothing about the job, reserves nothing, and is refused
// before it can send a single command or frame.
// Protocol: docs/PROTOCOL.md, "Greeting and authentication".
#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <asio.hpp>

#include "weft/options.hpp"

namespace weft::greeting {

inline constexpr std::uint32_t magic = 0x47544657;  // "WFTG" as little-endian bytes
inline constexpr std::uint16_t version = 3;
inline constexpr std::size_t nonce_size = 32;
inline constexpr std::size_t proof_size = 32;  // HMAC-SHA256
inline constexpr std::size_t hello_size = 40;
inline constexpr std::size_t details_fixed_size = 20;  // the details without their job id
inline constexpr std::size_t max_job_bytes = 255;
inline constexpr std::size_t verdict_header_size = 8;
inline constexpr std::size_t max_reason_bytes = 1024;

enum class Role : std::uint8_t { store_client = 1, peer = 2, store = 3, rank = 4 };

/// What a side says before anybody proved the secret: nothing about the job.
struct Hello {
  Role role = Role::peer;
  bool has_secret = false;
  std::array<std::byte, nonce_size> nonce{};
};
/// What a side says once the other side proved the secret (or at once, without one).
struct Details {
  std::int32_t rank = -1;  // the rank that speaks; -1 for the store
  std::uint32_t world_size = 0;
  std::string job;
  Integrity integrity = Integrity::off;  // what its frames will carry: every side must agree
  std::uint64_t selection = 0;           // the digest of what shapes its plans (group/create.cpp): likewise
};
/// The other side, as the greeting learnt it.
struct Greeting {
  Role role = Role::peer;
  bool has_secret = false;
  std::int32_t rank = -1;
  std::uint32_t world_size = 0;
  std::string job;
  Integrity integrity = Integrity::off;
  std::uint64_t selection = 0;
  /// With a secret: the keys of this connection's frame MACs (Integrity::hmac), one per direction, from
  /// the secret and both hellos' nonces; zeros without one.
  std::array<std::byte, 32> send_key{};
  std::array<std::byte, 32> recv_key{};
};

/// Encodes a hello (hello_size bytes).
std::vector<std::byte> encode(const Hello& hello);
/// Decodes hello_size bytes, or nullopt with `error` (bad magic, version, role, flags).
std::optional<Hello> decode_hello(const std::byte* data, std::string& error);
/// Encodes details; the job id must be at most max_job_bytes.
std::vector<std::byte> encode(const Details& details);
/// The job id's length from the details' fixed part, or nullopt with `error`.
std::optional<std::size_t> job_length(const std::byte* fixed, std::string& error);
/// Decodes whole details of exactly `size` bytes, or nullopt with `error`.
std::optional<Details> decode_details(const std::byte* data, std::size_t size, std::string& error);

/// A verdict: status 0 accepts; otherwise `reason` says why the connection is refused.
struct Verdict {
  std::uint32_t status = 0;
  std::string reason;
};
std::vector<std::byte> encode(const Verdict& verdict);
/// The reason's length from the 8-byte verdict header, or nullopt with `error`.
std::optional<std::size_t> reason_length(const std::byte* header, std::string& error);

/// HMAC-SHA256(secret, label || 0 || a || b).
std::array<std::byte, proof_size> proof(const std::string& secret, const char* label, const std::vector<std::byte>& a,
                                        const std::vector<std::byte>& b);
/// Constant-time comparison of two proofs.
bool proofs_equal(const std::array<std::byte, proof_size>& a, const std::array<std::byte, proof_size>& b);

/// Who this side is.
struct Local {
  Role role = Role::peer;
  int rank = -1;
  int world_size = 0;
  std::string job;
  std::string secret;  // empty: unauthenticated
  Integrity integrity = Integrity::off;
  std::uint64_t selection = 0;  // what shapes its plans (group/create.cpp, plans_digest)
};

/// A refusal of the other side or by it; `what()` says why, naming the remote address.
class Refused : public std::runtime_error {
 public:
  explicit Refused(const std::string& what, std::optional<int> member = std::nullopt)
      : std::runtime_error(what), member(member) {}
  /// The rank a refused side claimed, when it proved the secret (where there is one) and named this job
  /// (the same job id, which was not empty, or a secret): a process of this job set up otherwise, not a
  /// stranger.
  std::optional<int> member;
};

/// The connecting side: greets, checks the other side's greeting and proof, proves itself. Returns the
/// other side's greeting. Throws Refused (the other side refused us, or could not prove the secret)
/// or std::system_error (the connection failed). `remote` names the other side in messages.
asio::awaitable<Greeting> connect(asio::ip::tcp::socket& socket, const Local& local, const std::string& remote);

/// The accepting side. `check` looks at the connecting side's greeting (rank, world size) and returns a
/// refusal reason, or an empty string; it runs only once the other side proved the secret (when there
/// is one) and agreed on the job, so that it may reserve what the greeting claims (a rank): the caller
/// releases the reservation when accept() ends otherwise than with the greeting. Returns the other
/// side's greeting. Throws Refused (logged by the caller with the address) or std::system_error.
asio::awaitable<Greeting> accept(asio::ip::tcp::socket& socket, const Local& local,
                                 const std::function<std::string(const Greeting&)>& check);

/// accept() within `timeout`, for a listener: returns "" when the connection is admitted (the other
/// side's greeting in `*admitted`, when given), else why not (refused by `check` or by the greeting,
/// refused by the other side, silent past `timeout`, or failed), for the caller to log with the address.
/// `*member`, when given, is the rank a refused process of this job claimed (Refused::member).
asio::awaitable<std::string> admit(asio::ip::tcp::socket& socket, const Local& local,
                                   const std::function<std::string(const Greeting&)>& check,
                                   std::chrono::milliseconds timeout, Greeting* admitted = nullptr,
                                   std::optional<int>* member = nullptr);

/// "host:port" of the socket's remote end ("[v6]:port"), or "?".
std::string remote_address(const asio::ip::tcp::socket& socket);
/// "host:port" of an endpoint, as accept reported it (reliable even when the peer already reset the
/// connection, which leaves remote_address "?").
std::string address_of(const asio::ip::tcp::endpoint& endpoint);

/// The log of refused connections of one listener: at most `burst` lines per `window`; past that the
/// refusals are counted and the count logged when the window ends (or the listener goes), so that a
/// flood of strangers cannot flood the log.
class RefusalLog {
 public:
  explicit RefusalLog(std::string listener, int burst = 10, std::chrono::seconds window = std::chrono::seconds(10))
      : listener_(std::move(listener)), burst_(burst), window_(window) {}
  ~RefusalLog();
  RefusalLog(const RefusalLog&) = delete;
  RefusalLog& operator=(const RefusalLog&) = delete;
  void refused(const std::string& from, const std::string& why);
  /// Logs the count of refusals not logged one by one, if any (the listener closes).
  void say_suppressed();
  /// The refusals so far, for an error that would otherwise leave them to the log: "" for none, else
  /// "N connection(s) refused, the last from ADDRESS: WHY".
  std::string summary() const;

 private:
  std::string listener_;  // "store", "rank 2: bootstrap"
  int burst_;
  std::chrono::seconds window_;
  std::chrono::steady_clock::time_point window_start_{};
  int logged_ = 0;
  long suppressed_ = 0;
  long total_ = 0;
  std::string last_;  // "ADDRESS: WHY" of the latest refusal
};

/// The connections of one listener that are still greeting, oldest first, at most `limit` of them. A
/// connection past the limit closes the oldest one: silent strangers cannot crowd real ranks out, since
/// a real rank greets within a round trip (and greets again when its connection was closed on it).
/// Used on the listener's thread only.
class PendingGreetings {
 public:
  PendingGreetings(std::size_t limit, std::shared_ptr<RefusalLog> log) : limit_(std::max<std::size_t>(limit, 1)), log_(std::move(log)) {}
  struct Entry {
    asio::ip::tcp::socket* socket;
    std::string from;
    bool evicted = false;
  };
  using Handle = std::list<Entry>::iterator;
  /// Registers a connection that starts greeting, first closing the oldest one (logged) when at the limit.
  Handle add(asio::ip::tcp::socket& socket, std::string from);
  /// The greeting ended: forgets it. Returns whether it was closed to make room (then already logged).
  bool remove(Handle handle);
  /// Closes every connection still greeting (the listener is done).
  void close_all();
  /// Connections greeting and not closed to make room.
  std::size_t size() const { return live_; }

 private:
  std::size_t limit_;
  std::shared_ptr<RefusalLog> log_;
  std::list<Entry> entries_;
  std::size_t live_ = 0;
};

}  // namespace weft::greeting
