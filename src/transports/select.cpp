#include "transports/select.hpp"

#include <unistd.h>

#include <algorithm>
#include <mutex>

#include "core/log.hpp"
#include "transports/asio/asio_stream.hpp"
#include "transports/shm/link.hpp"
#include "weft_config.h"
#if WEFT_HAVE_URING
#include "transports/uring/uring_stream.hpp"
#endif

namespace weft::transports {

std::vector<std::string_view> names() {
#if WEFT_HAVE_URING
  return {"tcp", "uring", "shm"};
#else
  return {"tcp", "shm"};
#endif
}

bool available(std::string_view name, std::string* why) {
  if (name == "tcp" || name == "shm") return true;
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

bool wants_shm(std::string_view choice) noexcept { return choice == "shm" || choice == "shm+uring" || choice == "auto"; }

asio::awaitable<void> link_local(Loop& loop, std::vector<asio::ip::tcp::socket>& sockets, int rank, std::string_view choice,
                                 std::chrono::steady_clock::time_point deadline, LocalLinks& out) {
  const bool want = wants_shm(choice);
  if (want) out.hub = ShmHub::create(loop);
  out.links = co_await shm::link_local_peers(sockets, rank, want, out.hub ? out.hub->wake_fd() : -1, deadline, out.same_host);
  std::size_t linked = 0;
  for (const auto& link : out.links) linked += link ? 1 : 0;
  if (want) log().info("rank {}: shared memory with {} peer(s) on this host", rank, linked);
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  out.arena = shm::share_arena(out.links, rank, static_cast<int>(std::clamp<std::int64_t>(left.count(), 1, 5000)));
  if (out.arena) {
    std::vector<int> wake_fds(out.links.size(), -1);
    for (std::size_t peer = 0; peer < out.links.size(); ++peer) {
      if (out.links[peer]) wake_fds[peer] = ::dup(out.links[peer]->peer_wake_fd);
    }
    out.arena->attach(loop, std::move(wake_fds));
    log().info("rank {}: the {} ranks share a group arena ({} KiB per area)", rank, out.links.size(), out.arena->area_bytes() >> 10);
  }
}

FramedTransport* create(Loop& loop, int rank, int size, std::string_view choice, std::vector<asio::ip::tcp::socket> sockets,
                        LocalLinks links) {
  // The backend for the peers that shared memory does not reach. "auto" takes Asio's: io_uring measured
  // slower for every size below a megabyte and level above, and its best wait, without weft, is slower
  // than a plain send/recv exchange on these kernels (docs/DESIGN.md, "io_uring against plain system calls").
  std::string_view remote = choice == "shm" || choice == "auto" ? "tcp" : choice == "shm+uring" ? "uring" : choice;
  std::string name = "tcp";
  FramedTransport::StreamFactory remote_streams = [&loop](asio::ip::tcp::socket socket, StreamEvents* events, int peer,
                                                          std::weak_ptr<bool> alive) {
    return make_asio_stream(loop, std::move(socket), events, peer, std::move(alive));
  };
#if WEFT_HAVE_URING
  if (remote == "uring") {
    std::string why;
    if (auto ring = UringRing::create(loop, why)) {
      log().info("rank {}: io_uring ring: {}", rank, ring->settings());
      name = "uring";
      remote_streams = [ring](asio::ip::tcp::socket socket, StreamEvents* events, int peer, std::weak_ptr<bool> alive) {
        return std::make_shared<UringStream>(std::move(socket), ring, events, peer, std::move(alive));
      };
    } else {
      static std::once_flag said;
      std::call_once(said, [&] { log().warn("rank {}: io_uring is not available ({}); using the tcp transport (Asio)", rank, why); });
    }
  }
#else
  if (remote == "uring") {
    static std::once_flag said;
    std::call_once(said, [&] {
      log().warn("rank {}: this build has no io_uring (liburing was not found); using the tcp transport (Asio)", rank);
    });
  }
#endif
  const bool any_shm = std::any_of(links.links.begin(), links.links.end(), [](const auto& link) { return link.has_value(); });
  if (!any_shm) return new FramedTransport(loop, rank, size, std::move(sockets), name, remote_streams);
  // Peers on this host: their streams are shared memory (their TCP connection closes here, unused).
  auto shared = std::make_shared<LocalLinks>(std::move(links));
  auto streams = [shared, remote_streams](asio::ip::tcp::socket socket, StreamEvents* events, int peer,
                                          std::weak_ptr<bool> alive) -> std::shared_ptr<Stream> {
    auto& link = shared->links[static_cast<std::size_t>(peer)];
    if (!link) return remote_streams(std::move(socket), events, peer, std::move(alive));
    std::error_code ignored;
    socket.close(ignored);
    auto stream = ShmStream::make(shared->hub, std::move(*link), events, peer, std::move(alive));
    link.reset();
    return stream;
  };
  return new FramedTransport(loop, rank, size, std::move(sockets), "shm+" + name, streams);
}

}  // namespace weft::transports
