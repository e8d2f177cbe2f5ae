#pragma once
// The one place that knows which byte-moving backends this build has under the framed transport, and
// how to make one: Group asks for "tcp", "uring", "auto", "shm" or "shm+uring" (Options::transport) and
// gets a transport, never naming a backend's type. A backend that cannot be set up falls back to tcp,
// said once per process. With "shm", peers on this host get shared memory (transports/shm) and the
// others the named backend (tcp for plain "shm"); link_local() finds out which are which.
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <asio.hpp>

#include "transports/framed/framed_transport.hpp"
#include "transports/shm/arena.hpp"
#include "transports/shm/shm_stream.hpp"
#include "weft/loop.hpp"

namespace weft::transports {

/// The backends this build has: "tcp" (Asio) and "shm" (shared memory, between the ranks of a host)
/// always, "uring" when liburing was found.
std::vector<std::string_view> names();

/// Whether `name` can run here (io_uring: the kernel lets this process make a ring). `why` says why not.
bool available(std::string_view name, std::string* why = nullptr);

/// Whether `choice` asks for shared memory between the ranks of a host ("shm", "shm+uring", "auto").
bool wants_shm(std::string_view choice) noexcept;

/// The peers this rank reaches through shared memory, and the hub their streams share.
struct LocalLinks {
  std::shared_ptr<ShmHub> hub;
  std::vector<std::optional<ShmStream::Link>> links;  // [peer]
  /// The group arena, when every rank of the job is linked to every other (for the direct shm
  /// collectives of the world group); attached to the loop, which wakes through the hub's eventfd.
  std::shared_ptr<shm::Arena> arena;
  /// [peer]: on this rank's host (the same boot and network namespace), shared memory or not.
  std::vector<bool> same_host;
};

/// Right after the bootstrap, over every peer's greeted connection: the link offers (docs/PROTOCOL.md),
/// and the shared-memory links of the pairs on one host that both want them (transports/shm/link.hpp).
/// Every rank must call it, whatever its choice. Errors: a peer that sends no or a malformed offer
/// before `deadline` throws.
asio::awaitable<void> link_local(Loop& loop, std::vector<asio::ip::tcp::socket>& sockets, int rank, std::string_view choice,
                                 std::chrono::steady_clock::time_point deadline, LocalLinks& out);

/// The framed transport over `sockets` (one per peer, greeted) with the backend `choice` names ("tcp",
/// "uring", "shm": shared memory with the peers `links` holds, tcp with the others; "shm+uring": the same
/// with uring; "auto": as "shm", the choice that measured fastest). uring that cannot be set up, or that this build lacks,
/// gives tcp, with one log line per process.
/// Errors: none of its own (the choice was validated with the options).
FramedTransport* create(Loop& loop, int rank, int size, std::string_view choice, std::vector<asio::ip::tcp::socket> sockets,
                        LocalLinks links = {});

}  // namespace weft::transports
