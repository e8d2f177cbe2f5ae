#pragma once
// The one place that knows which byte-moving backends this build has under the framed transport, and
// how to make one: Group asks for "tcp", "uring" or "auto" (Options::transport) and gets a transport,
// never naming a backend's type. A backend that cannot be set up falls back to tcp, said once per process.
#include <string>
#include <string_view>
#include <vector>

#include <asio.hpp>

#include "transports/framed/framed_transport.hpp"
#include "weft/loop.hpp"

namespace weft::transports {

/// The backends this build has: "tcp" (Asio) always, "uring" when liburing was found.
std::vector<std::string_view> names();

/// Whether `name` can run here (io_uring: the kernel lets this process make a ring). `why` says why not.
bool available(std::string_view name, std::string* why = nullptr);

/// The framed transport over `sockets` (one per peer, greeted) with the backend `choice` names ("tcp",
/// "uring", or "auto": uring where it works). uring that cannot be set up, or that this build lacks,
/// gives tcp, with one log line per process.
/// Errors: none of its own (the choice was validated with the options).
FramedTransport* create(Loop& loop, int rank, int size, std::string_view choice, std::vector<asio::ip::tcp::socket> sockets);

}  // namespace weft::transports
