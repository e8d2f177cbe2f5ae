#include "transports/select.hpp"

#include <mutex>

#include "core/log.hpp"
#include "transports/asio/asio_stream.hpp"
#include "weft_config.h"
#if WEFT_HAVE_URING
#include "transports/uring/uring_stream.hpp"
#endif

namespace weft::transports {

std::vector<std::string_view> names() {
#if WEFT_HAVE_URING
  return {"tcp", "uring"};
#else
  return {"tcp"};
#endif
}

bool available(std::string_view name, std::string* why) {
  if (name == "tcp") return true;
#if WEFT_HAVE_URING
  if (name == "uring") {
    std::string reason;
    const bool ok = UringRing::available(reason);
    if (why) *why = reason;
    return ok;
  }
#endif
  if (why) *why = name == "uring" ? "this build has no io_uring (liburing was not found)" : "no such backend";
  return false;
}

FramedTransport* create(Loop& loop, int rank, int size, std::string_view choice, std::vector<asio::ip::tcp::socket> sockets) {
#if WEFT_HAVE_URING
  if (choice == "uring" || choice == "auto") {
    std::string why;
    if (auto ring = UringRing::create(loop, why)) {
      log().info("rank {}: io_uring ring: {}", rank, ring->settings());
      return new FramedTransport(loop, rank, size, std::move(sockets), "uring",
                              [ring](asio::ip::tcp::socket socket, StreamEvents* events, int peer, std::weak_ptr<bool> alive) {
                                return std::make_shared<UringStream>(std::move(socket), ring, events, peer, std::move(alive));
                              });
    }
    static std::once_flag said;
    std::call_once(said, [&] { log().warn("rank {}: io_uring is not available ({}); using the tcp transport (Asio)", rank, why); });
  }
#else
  if (choice == "uring") {
    static std::once_flag said;
    std::call_once(said, [&] {
      log().warn("rank {}: this build has no io_uring (liburing was not found); using the tcp transport (Asio)", rank);
    });
  }
#endif
  return new FramedTransport(loop, rank, size, std::move(sockets), "tcp", make_asio_stream);
}

}  // namespace weft::transports
