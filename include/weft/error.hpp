#pragma once
/// weft errors. Every public operation reports failure by throwing a weft::Error (a std::system_error)
/// whose message names the rank, the peer, the operation and its sequence number.
#include <cstdint>
#include <string>
#include <system_error>

namespace weft {

/// Error codes in weft's own category.
enum class Errc : int {
  invalid_argument = 1,  ///< a precondition failed; nothing was sent
  peer_failure,          ///< a peer's connection was lost (the peer died or closed it)
  timeout,               ///< a deadline passed
  cancelled,             ///< the operation was cancelled
  size_mismatch,         ///< a peer sent a different number of bytes than this rank expected
  protocol_error,        ///< a frame that does not follow docs/PROTOCOL.md
  group_failed,          ///< the group failed earlier (see the message) and cannot be used
  aborted,               ///< the group was aborted, by a peer or by this rank (the message names which and why)
  connection_failed,     ///< a connection could not be made
  mismatch,              ///< ranks called different collectives, or the same with different arguments, as the same operation; or a receive met a message of another dtype
  refused,               ///< the store or a rank refused this rank (wrong secret, another job, a duplicate rank, a world-size disagreement)
  would_deadlock,        ///< a blocking wait on the thread that runs the operation's loop (it would wait for itself)
  device_failure,        ///< a device failed (a CUDA error, or the simulated device's injected failure); sticky
};

const std::error_category& error_category() noexcept;
inline std::error_code make_error_code(Errc e) noexcept { return {static_cast<int>(e), error_category()}; }

/// Where an error happened. Fields that do not apply are -1 / empty.
struct ErrorContext {
  int rank = -1;            ///< rank (in the group) that reports the error
  int peer = -1;            ///< the peer involved, if any
  std::string op;           ///< "all_reduce", "recv", "bootstrap", ...
  std::int64_t seq = -1;    ///< the operation's sequence number on its group; for send and recv, its number among this rank's sends to (receives from) `peer`
  std::int64_t tag = -1;    ///< the message tag, for point-to-point operations
};

/// The one exception type of weft's public API.
class Error : public std::system_error {
 public:
  Error(Errc code, ErrorContext context, const std::string& detail);
  const ErrorContext& context() const noexcept { return context_; }
  Errc errc() const noexcept { return static_cast<Errc>(code().value()); }
  /// The detail text without the context prefix.
  const std::string& detail() const noexcept { return detail_; }

 private:
  ErrorContext context_;
  std::string detail_;
};

/// A peer was lost: `context().peer` is the failed rank.
class PeerFailure : public Error {
 public:
  PeerFailure(ErrorContext context, const std::string& detail) : Error(Errc::peer_failure, std::move(context), detail) {}
};

/// A deadline passed.
class TimeoutError : public Error {
 public:
  TimeoutError(ErrorContext context, const std::string& detail) : Error(Errc::timeout, std::move(context), detail) {}
};

/// The operation was cancelled.
class CancelledError : public Error {
 public:
  CancelledError(ErrorContext context, const std::string& detail) : Error(Errc::cancelled, std::move(context), detail) {}
};

/// Throws the right subclass of Error for `code`.
[[noreturn]] void throw_error(Errc code, ErrorContext context, const std::string& detail);

}  // namespace weft

template <>
struct std::is_error_code_enum<weft::Errc> : std::true_type {};
