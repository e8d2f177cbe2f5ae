#include "weft/error.hpp"

#include <fmt/format.h>

namespace weft {
namespace {

class Category final : public std::error_category {
 public:
  const char* name() const noexcept override { return "weft"; }
  std::string message(int code) const override {
    switch (static_cast<Errc>(code)) {
      case Errc::invalid_argument: return "invalid argument";
      case Errc::peer_failure: return "peer failure";
      case Errc::timeout: return "timed out";
      case Errc::cancelled: return "cancelled";
      case Errc::size_mismatch: return "size mismatch";
      case Errc::protocol_error: return "protocol error";
      case Errc::group_failed: return "group failed";
      case Errc::aborted: return "aborted";  // by this rank or a peer: the message names which
      case Errc::connection_failed: return "connection failed";
      case Errc::mismatch: return "mismatched operation";  // a collective, or a message's dtype
      case Errc::refused: return "refused";
      case Errc::would_deadlock: return "would deadlock";
      case Errc::device_failure: return "device failure";
    }
    return "unknown weft error";
  }
};

std::string render(Errc code, const ErrorContext& c, const std::string& detail) {
  std::string s = "weft";
  if (c.rank >= 0) s += fmt::format(": rank {}", c.rank);
  if (!c.op.empty()) {
    s += fmt::format(": {}", c.op);
    if (c.seq >= 0) s += fmt::format(" #{}", c.seq);
  }
  if (c.peer >= 0) s += fmt::format(" (peer {})", c.peer);
  if (c.tag >= 0) s += fmt::format(" [tag {}]", c.tag);
  // std::system_error appends ": <category message>" after this text.
  if (!detail.empty()) s += ": " + detail;
  (void)code;
  return s;
}

}  // namespace

const std::error_category& error_category() noexcept {
  static const Category category;
  return category;
}

Error::Error(Errc code, ErrorContext context, const std::string& detail)
    : std::system_error(make_error_code(code), render(code, context, detail)),
      context_(std::move(context)),
      detail_(detail) {}

void throw_error(Errc code, ErrorContext context, const std::string& detail) {
  switch (code) {
    case Errc::peer_failure: throw PeerFailure(std::move(context), detail);
    case Errc::timeout: throw TimeoutError(std::move(context), detail);
    case Errc::cancelled: throw CancelledError(std::move(context), detail);
    default: throw Error(code, std::move(context), detail);
  }
}

}  // namespace weft
