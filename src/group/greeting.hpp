#pragma once
// The greeting: the first bytes on every connection weft opens (to the store, and between ranks). It
// says which job and which rank connects, and, when the job has a shared secret, runs a mutual
// challenge-response (HMAC-SHA256 over both sides' greetings, through OpenSSL's libcrypto) so that a
// process without the secret is refused before it can send a single command or frame.
// Protocol: docs/PROTOCOL.md, "Greeting and authentication".
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <asio.hpp>

namespace weft::greeting {

inline constexpr std::uint32_t magic = 0x47544657;  // "WFTG" as little-endian bytes
inline constexpr std::uint16_t version = 1;
inline constexpr std::size_t nonce_size = 32;
inline constexpr std::size_t proof_size = 32;  // HMAC-SHA256
inline constexpr std::size_t fixed_size = 56;  // the greeting without its job id
inline constexpr std::size_t max_job_bytes = 255;
inline constexpr std::size_t verdict_header_size = 8;
inline constexpr std::size_t max_reason_bytes = 1024;

enum class Role : std::uint8_t { store_client = 1, peer = 2, store = 3, rank = 4 };

struct Greeting {
  Role role = Role::peer;
  bool has_secret = false;
  std::int32_t rank = -1;  // the rank that speaks; -1 for the store
  std::uint32_t world_size = 0;
  std::array<std::byte, nonce_size> nonce{};
  std::string job;
};

/// Encodes a whole greeting (fixed part, then the job id). The job id must be at most max_job_bytes.
std::vector<std::byte> encode(const Greeting& greeting);
/// The job id's length from the fixed part, or nullopt with `error` (bad magic, version, role, flags,
/// length over max_job_bytes).
std::optional<std::size_t> job_length(const std::byte* fixed, std::string& error);
/// Decodes a whole greeting of exactly `size` bytes, or nullopt with `error`.
std::optional<Greeting> decode(const std::byte* data, std::size_t size, std::string& error);

/// A verdict: status 0 accepts; otherwise `reason` says why the connection is refused.
struct Verdict {
  std::uint32_t status = 0;
  std::string reason;
};
std::vector<std::byte> encode(const Verdict& verdict);
/// The reason's length from the 8-byte verdict header, or nullopt with `error`.
std::optional<std::size_t> reason_length(const std::byte* header, std::string& error);

/// HMAC-SHA256(secret, label || a || b).
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
};

/// A refusal of the other side or by it; `what()` says why, naming the remote address.
class Refused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The connecting side: greets, checks the other side's greeting and proof, proves itself. Returns the
/// other side's greeting. Throws Refused (the other side refused us, or could not prove the secret)
/// or std::system_error (the connection failed). `remote` names the other side in messages.
asio::awaitable<Greeting> connect(asio::ip::tcp::socket& socket, const Local& local, const std::string& remote);

/// The accepting side. `check` looks at the connecting side's greeting (rank, world size) and returns a
/// refusal reason, or an empty string. Returns the other side's greeting. Throws Refused (logged by the
/// caller with the address) or std::system_error.
asio::awaitable<Greeting> accept(asio::ip::tcp::socket& socket, const Local& local,
                                 const std::function<std::string(const Greeting&)>& check);

/// accept() within `timeout`, for a listener: returns "" when the connection is admitted, else why not
/// (refused by `check` or by the greeting, refused by the other side, silent past `timeout`, or failed),
/// for the caller to log with the address.
asio::awaitable<std::string> admit(asio::ip::tcp::socket& socket, const Local& local,
                                   const std::function<std::string(const Greeting&)>& check,
                                   std::chrono::milliseconds timeout);

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

 private:
  std::string listener_;  // "store", "rank 2: bootstrap"
  int burst_;
  std::chrono::seconds window_;
  std::chrono::steady_clock::time_point window_start_{};
  int logged_ = 0;
  long suppressed_ = 0;
};

}  // namespace weft::greeting
