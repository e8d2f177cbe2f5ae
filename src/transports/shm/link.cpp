#include "transports/shm/link.hpp"

#include <poll.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <cstdlib>

#include <fmt/format.h>

#include "core/bytes.hpp"
#include "core/deadline.hpp"
#include "core/log.hpp"
#include "transports/shm/arena.hpp"
#include "transports/shm/lendable.hpp"

namespace weft::shm {
namespace {

using asio::awaitable;
using asio::use_awaitable;
using Clock = std::chrono::steady_clock;
using unix_socket = asio::local::stream_protocol;

constexpr std::size_t offer_size = 64;
constexpr char offer_magic[8] = {'w', 'f', 't', 'l', 'i', 'n', 'k', '1'};
// A step of the unix handshake waits at most this long (or to the bootstrap's deadline): a peer that
// fails in the middle leaves the other waiting only this long before both fall back to TCP.
constexpr std::chrono::seconds step_limit{5};

struct Offer {
  bool wants = false;
  std::uint32_t pid = 0;
  std::uint32_t uid = 0;
  std::array<std::byte, 24> host{};
  std::array<std::byte, 16> nonce{};
};

std::array<std::byte, offer_size> encode(const Offer& o) {
  std::array<std::byte, offer_size> b{};
  std::memcpy(b.data(), offer_magic, 8);
  b[8] = static_cast<std::byte>(o.wants ? 1 : 0);
  le::put_u32(b.data() + 12, o.pid);
  le::put_u32(b.data() + 16, o.uid);
  std::memcpy(b.data() + 24, o.host.data(), o.host.size());
  std::memcpy(b.data() + 48, o.nonce.data(), o.nonce.size());
  return b;
}

std::optional<Offer> decode(const std::array<std::byte, offer_size>& b) {
  if (std::memcmp(b.data(), offer_magic, 8) != 0) return std::nullopt;
  Offer o;
  o.wants = b[8] == std::byte{1};
  o.pid = le::get_u32(b.data() + 12);
  o.uid = le::get_u32(b.data() + 16);
  std::memcpy(o.host.data(), b.data() + 24, o.host.size());
  std::memcpy(o.nonce.data(), b.data() + 48, o.nonce.size());
  return o;
}

unix_socket::endpoint endpoint_of(const std::array<std::byte, 16>& nonce) {
  std::string name(1, '\0');  // abstract: no file, gone with the socket
  name += "weft-link-";
  for (std::byte b : nonce) name += fmt::format("{:02x}", static_cast<unsigned>(b));
  return unix_socket::endpoint(name);
}

// The pid and uid at the other end of a connected unix socket, as the kernel saw them.
bool peer_is(int fd, std::uint32_t pid, std::uint32_t uid) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return false;
  return static_cast<std::uint32_t>(cred.pid) == pid && static_cast<std::uint32_t>(cred.uid) == uid;
}

Clock::time_point step_deadline(Clock::time_point deadline) { return std::min(deadline, Clock::now() + step_limit); }

// The smallest write sent by single copy (ring.hpp's reference records): WEFT_SHM_CMA_BYTES, 0 or "off"
// (the default, link.hpp says why) for never.
std::size_t single_copy_from() {
  static const std::size_t bytes = [] {
    const char* v = std::getenv("WEFT_SHM_CMA_BYTES");
    if (!v || !*v || std::string_view(v) == "off") return default_single_copy_bytes;
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v, &end, 10);
    if (*end != '\0') {
      log().warn("WEFT_SHM_CMA_BYTES='{}' is not a byte count or 'off'; single copy stays off", v);
      return default_single_copy_bytes;
    }
    return static_cast<std::size_t>(n);
  }();
  return bytes;
}

// The smallest piece the group arena reads straight from a peer's buffer (arena.hpp, "Direct reads"):
// WEFT_SHM_ARENA_CMA_BYTES, "off" for never, "on" for each collective's measured default, unset for that
// default where the kernel copies fast enough here (`probe`: kernel_copy_is_slow below).
// Options::from_environment refused a malformed value.
struct ArenaDirectSetting {
  std::uint64_t from = Arena::direct_defaults;
  bool probe = true;
};
ArenaDirectSetting arena_direct_setting() {
  static const ArenaDirectSetting setting = [] {
    const char* v = std::getenv("WEFT_SHM_ARENA_CMA_BYTES");
    if (!v || !*v) return ArenaDirectSetting{};
    if (std::string_view(v) == "off") return ArenaDirectSetting{0, false};
    if (std::string_view(v) == "on") return ArenaDirectSetting{Arena::direct_defaults, false};
    char* end = nullptr;
    const unsigned long long n = std::strtoull(v, &end, 10);
    return *end == '\0' ? ArenaDirectSetting{std::max<std::uint64_t>(1, n), false} : ArenaDirectSetting{};
  }();
  return setting;
}

// Whether this machine's kernel copies so slowly against memcpy that the arena's copies through its
// areas beat reading the peers' buffers directly (lendable.hpp, KernelCopyCost::slow). Measured once
// per process, at its first arena's set-up (about a millisecond), and said once.
bool kernel_copy_is_slow(int rank) {
  static const bool slow = [rank] {
    const KernelCopyCost cost = measure_kernel_copy();
    if (cost.slow()) {
      log().info("rank {}: the kernel copies 256 KiB in {:.1f} us against memcpy's {:.1f} (x{:.1f}): the group arena copies through "
                 "its areas (WEFT_SHM_ARENA_CMA_BYTES=on reads directly all the same)",
                 rank, cost.kernel_us, cost.memcpy_us, cost.kernel_us / cost.memcpy_us);
    } else {
      log().debug("rank {}: the kernel copies 256 KiB in {:.1f} us against memcpy's {:.1f}", rank, cost.kernel_us, cost.memcpy_us);
    }
    return cost.slow();
  }();
  return slow;
}

// Whether this process can read `size` bytes at `address` in process `pid` and finds `expected` there
// (the link's probe: Yama, a non-dumpable peer, seccomp or a container may forbid it). `why`: errno's
// words when it cannot.
bool can_read_memory_of(int pid, std::uint64_t address, const std::array<std::byte, 16>& expected, std::string& why) {
  std::array<std::byte, 16> got{};
  iovec local{got.data(), got.size()};
  iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(address)), got.size()};
  const ssize_t n = ::process_vm_readv(pid, &local, 1, &remote, 1, 0);
  if (n != static_cast<ssize_t>(got.size())) {
    why = n < 0 ? std::strerror(errno) : "a short read";
    return false;
  }
  if (got != expected) {
    why = "it read other bytes than the peer's nonce";
    return false;
  }
  return true;
}

// Single copy, both ways at once: each side sends the address of its offer's nonce (whose value the peer
// knows), reads the peer's with process_vm_readv, and says whether it could. Sets the link's single-copy
// fields; false when the peer did not take part in time (the link is then not used).
awaitable<bool> probe_single_copy(unix_socket::socket& socket, int rank, int peer, const std::array<std::byte, 16>& my_nonce,
                                  const Offer& theirs, Clock::time_point deadline, ShmStream::Link& link) {
  const bool enabled = single_copy_from() != 0;
  std::array<std::byte, 8> address{};
  le::put_u64(address.data(), reinterpret_cast<std::uintptr_t>(my_nonce.data()));
  std::array<std::byte, 8> their_address{};
  auto exchanged = co_await with_deadline(
      [&]() -> awaitable<bool> {
        co_await asio::async_write(socket, asio::buffer(address), use_awaitable);
        co_await asio::async_read(socket, asio::buffer(their_address), use_awaitable);
        co_return true;
      }(),
      step_deadline(deadline));
  if (!exchanged) co_return false;
  // Probed whether or not the rings use it: the group arena reads peers directly where every rank can
  // read every other (share_arena), whatever WEFT_SHM_CMA_BYTES says.
  std::string why;
  const bool can_read = can_read_memory_of(static_cast<int>(theirs.pid), le::get_u64(their_address.data()), theirs.nonce, why);
  if (!can_read) {
    log().info("rank {}: cannot read rank {}'s memory (pid {}: {}); its large messages come through the ring, and a group "
               "arena copies through its areas",
               rank, peer, theirs.pid, why);
  }
  const char verdict = enabled && can_read ? 'Y' : 'N';
  char their_verdict = 'N';
  auto told = co_await with_deadline(
      [&]() -> awaitable<bool> {
        co_await asio::async_write(socket, asio::buffer(&verdict, 1), use_awaitable);
        co_await asio::async_read(socket, asio::buffer(&their_verdict, 1), use_awaitable);
        co_return true;
      }(),
      step_deadline(deadline));
  if (!told) co_return false;
  link.peer_pid = can_read ? static_cast<int>(theirs.pid) : 0;
  link.single_copy_from = enabled && their_verdict == 'Y' ? single_copy_from() : 0;
  co_return true;
}

// The unix half of linking one pair; returns the Link, or nullopt with `why` set.
awaitable<std::optional<ShmStream::Link>> connect_locally(int rank, int peer, const Offer& mine, const Offer& theirs,
                                                          std::unique_ptr<unix_socket::acceptor>& listener, int wake_fd,
                                                          std::size_t ring_capacity, Clock::time_point deadline, std::string& why) {
  auto executor = co_await asio::this_coro::executor;
  unix_socket::socket socket(executor);
  if (rank < peer) {
    // A stranger may connect first: only the peer's process (the pid its offer declared) is kept.
    for (;;) {
      auto accepted = co_await with_deadline(listener->async_accept(use_awaitable), step_deadline(deadline));
      if (!accepted) {
        why = "rank " + std::to_string(peer) + " did not connect to the local socket in time";
        co_return std::nullopt;
      }
      if (peer_is(accepted->native_handle(), theirs.pid, theirs.uid)) {
        socket = std::move(*accepted);
        break;
      }
      log().warn("rank {}: a process that is not rank {} (pid {}) connected to its shared-memory socket; closed", rank, peer,
                 theirs.pid);
    }
  } else {
    std::error_code ec;
    auto connected = co_await with_deadline(
        [&]() -> awaitable<bool> {
          co_await socket.async_connect(endpoint_of(theirs.nonce), asio::redirect_error(use_awaitable, ec));
          co_return !ec;
        }(),
        step_deadline(deadline));
    if (!connected || !*connected) {
      why = fmt::format("cannot connect to rank {}'s local socket ({})", peer, ec ? ec.message() : "timed out");
      co_return std::nullopt;
    }
    if (!peer_is(socket.native_handle(), theirs.pid, theirs.uid)) {
      why = fmt::format("the local socket of rank {} is held by another process", peer);
      co_return std::nullopt;
    }
  }
  ShmStream::Link link;
  try {
    link.inbound = make_ring(ring_capacity);
  } catch (const std::exception& e) {
    why = std::string("cannot make a ring: ") + e.what();
    co_return std::nullopt;
  }
  const int out[2] = {link.inbound.fd(), wake_fd};
  if (!send_fds(socket.native_handle(), out, 2)) {
    why = "cannot pass the ring to rank " + std::to_string(peer);
    co_return std::nullopt;
  }
  std::error_code ec;
  auto readable = co_await with_deadline(
      [&]() -> awaitable<bool> {
        co_await socket.async_wait(unix_socket::socket::wait_read, asio::redirect_error(use_awaitable, ec));
        co_return !ec;
      }(),
      step_deadline(deadline));
  int in[2] = {-1, -1};
  if (!readable || !*readable || receive_fds(socket.native_handle(), in, 2, 0) != 2) {
    for (int fd : in) {
      if (fd >= 0) ::close(fd);
    }
    why = "rank " + std::to_string(peer) + " passed no ring";
    co_return std::nullopt;
  }
  try {
    link.outbound = adopt_ring(in[0]);
  } catch (const std::exception& e) {
    ::close(in[1]);
    why = fmt::format("rank {}'s ring: {}", peer, e.what());
    co_return std::nullopt;
  }
  link.peer_wake_fd = in[1];
  bool probed = false;
  try {
    probed = co_await probe_single_copy(socket, rank, peer, mine.nonce, theirs, deadline, link);
  } catch (const std::system_error& e) {
    why = fmt::format("the single-copy probe with rank {} failed ({})", peer, e.what());
  }
  if (!probed) {
    ::close(link.peer_wake_fd);
    if (why.empty()) why = fmt::format("rank {} did not finish the single-copy probe in time", peer);
    co_return std::nullopt;
  }
  link.socket = socket.release();
  co_return link;
}

// Every pair's offer, counted before any ring is made: a rank sizes its inbound rings by the number of
// peers it links on this host (ring_bytes_for), which it knows only once every offer is in. The
// coroutines of one link_local_peers share it, on one executor.
class OfferCount {
 public:
  OfferCount(const asio::any_io_executor& executor, std::size_t pairs, Clock::time_point deadline)
      : pending_(pairs), all_in_(executor, deadline) {}
  /// One pair's offer came (or its exchange failed: `local` false); the last one wakes the waiters.
  void arrived(bool local) {
    local_ += local ? 1 : 0;
    if (--pending_ == 0) all_in_.cancel();
  }
  /// Until every pair's offer came, or the deadline passed (a pair whose offer never comes fails the
  /// link anyway; the others then size their rings by what came).
  awaitable<void> every_offer() {
    if (pending_ == 0) co_return;
    std::error_code ignored;
    co_await all_in_.async_wait(asio::redirect_error(use_awaitable, ignored));
  }
  std::size_t local_peers() const noexcept { return local_; }

 private:
  std::size_t pending_;
  std::size_t local_ = 0;
  asio::steady_timer all_in_;
};

// One pair: offers, then (where both want it) the unix half, then the verdicts.
awaitable<void> link_one(asio::ip::tcp::socket& tcp, int rank, int peer, Offer mine, int wake_fd, Clock::time_point deadline,
                         OfferCount& offers, std::optional<ShmStream::Link>& out, std::vector<bool>::reference same_host,
                         std::exception_ptr& failure) {
  bool counted = false;
  try {
    std::unique_ptr<unix_socket::acceptor> listener;
    if (mine.wants && rank < peer) {
      // Listening before the offer goes out: the peer may connect as soon as it has read it.
      listener = std::make_unique<unix_socket::acceptor>(tcp.get_executor(), endpoint_of(mine.nonce));
    }
    const auto bytes = encode(mine);
    std::array<std::byte, offer_size> got{};
    auto exchanged = co_await with_deadline(
        [&]() -> awaitable<bool> {
          co_await asio::async_write(tcp, asio::buffer(bytes), use_awaitable);
          co_await asio::async_read(tcp, asio::buffer(got), use_awaitable);
          co_return true;
        }(),
        deadline);
    if (!exchanged) throw std::runtime_error(fmt::format("rank {} sent no link offer before the bootstrap deadline", peer));
    const auto theirs = decode(got);
    if (!theirs) throw std::runtime_error(fmt::format("rank {} sent a malformed link offer", peer));
    // Both sides decide alike from the same two offers.
    same_host = mine.host == theirs->host;
    const bool local = mine.wants && theirs->wants && mine.host == theirs->host && mine.uid == theirs->uid;
    counted = true;
    offers.arrived(local);
    if (!local) co_return;
    co_await offers.every_offer();
    std::string why;
    auto link = co_await connect_locally(rank, peer, mine, *theirs, listener, wake_fd, ring_bytes_for(offers.local_peers()), deadline, why);
    listener.reset();
    const std::byte verdict = link ? std::byte{1} : std::byte{0};
    std::byte their_verdict{0};
    auto told = co_await with_deadline(
        [&]() -> awaitable<bool> {
          co_await asio::async_write(tcp, asio::buffer(&verdict, 1), use_awaitable);
          co_await asio::async_read(tcp, asio::buffer(&their_verdict, 1), use_awaitable);
          co_return true;
        }(),
        deadline);
    if (!told) throw std::runtime_error(fmt::format("rank {} did not finish the shared-memory link before the deadline", peer));
    if (link && their_verdict == std::byte{1}) {
      out = std::move(link);
      co_return;
    }
    if (link) {
      ::close(link->socket);
      ::close(link->peer_wake_fd);
      why = fmt::format("rank {} could not set it up on its side", peer);
    }
    log().warn("rank {}: shared memory with rank {} on this host is not used ({}); using TCP", rank, peer, why);
  } catch (...) {
    if (!counted) offers.arrived(false);
    failure = std::current_exception();
  }
}

}  // namespace

std::size_t ring_bytes_for(std::size_t local_peers) noexcept {
  std::size_t bytes = ring_bytes_most;
  while (bytes > ring_bytes_least && bytes * local_peers > inbound_ring_budget) bytes /= 2;
  return bytes;
}

std::array<std::byte, 24> host_identity() {
  std::array<std::byte, 24> id{};
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string text;
  std::getline(boot, text);
  std::size_t at = 0;
  for (std::size_t i = 0; i + 1 < text.size() && at < 16; ++i) {
    if (text[i] == '-') continue;
    id[at++] = static_cast<std::byte>(std::stoi(text.substr(i, 2), nullptr, 16));
    ++i;
  }
  struct stat ns {};
  if (::stat("/proc/self/ns/net", &ns) == 0) le::put_u64(id.data() + 16, static_cast<std::uint64_t>(ns.st_ino));
  return id;
}

awaitable<std::vector<std::optional<ShmStream::Link>>> link_local_peers(std::vector<asio::ip::tcp::socket>& sockets, int rank,
                                                                        bool want, int wake_fd, Clock::time_point deadline,
                                                                        std::vector<bool>& same_host) {
  const auto size = sockets.size();
  same_host.assign(size, false);
  if (rank >= 0 && static_cast<std::size_t>(rank) < size) same_host[static_cast<std::size_t>(rank)] = true;
  std::vector<std::optional<ShmStream::Link>> links(size);
  std::vector<std::exception_ptr> failures(size);
  Offer mine;
  mine.wants = want;
  mine.pid = static_cast<std::uint32_t>(::getpid());
  mine.uid = static_cast<std::uint32_t>(::getuid());
  mine.host = host_identity();
  auto executor = co_await asio::this_coro::executor;
  // Every pair at once: a rank that linked its peers one by one could wait on a peer that waits on another.
  auto remaining = std::make_shared<std::size_t>(0);
  asio::steady_timer all_done(executor, Clock::time_point::max());
  std::size_t pairs = 0;
  for (std::size_t peer = 0; peer < size; ++peer) pairs += static_cast<int>(peer) == rank ? 0 : 1;
  OfferCount offers(executor, pairs, deadline);
  for (std::size_t peer = 0; peer < size; ++peer) {
    if (static_cast<int>(peer) == rank) continue;
    Offer offer = mine;
    if (::getrandom(offer.nonce.data(), offer.nonce.size(), 0) != static_cast<ssize_t>(offer.nonce.size())) {
      offer.wants = false;  // no nonce, no socket name: this pair stays on TCP
    }
    ++*remaining;
    asio::co_spawn(executor,
                   link_one(sockets[peer], rank, static_cast<int>(peer), offer, wake_fd, deadline, offers, links[peer], same_host[peer], failures[peer]),
                   [remaining, &all_done](std::exception_ptr) {
                     if (--*remaining == 0) all_done.cancel();
                   });
  }
  if (*remaining > 0) {
    std::error_code ignored;
    co_await all_done.async_wait(asio::redirect_error(use_awaitable, ignored));
  }
  for (auto& failure : failures) {
    if (failure) std::rethrow_exception(failure);
  }
  co_return links;
}

namespace {

// One byte over a unix socket, both ways, within `timeout_ms`.
bool send_byte(int socket, char byte) {
  for (;;) {
    const ssize_t n = ::send(socket, &byte, 1, MSG_NOSIGNAL);
    if (n == 1) return true;
    if (n < 0 && errno == EINTR) continue;
    return false;
  }
}
int receive_byte(int socket, int timeout_ms) {
  pollfd p{socket, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return -1;
  char byte = 0;
  ssize_t n;
  do {
    n = ::recv(socket, &byte, 1, 0);
  } while (n < 0 && errno == EINTR);
  return n == 1 ? static_cast<unsigned char>(byte) : -1;
}

// This rank's word for the arena's direct reads (arena.hpp): every peer's process where its link's probe
// could read it. Written before this rank's `Y`, so that every rank sees it after rank 0's verdict.
void offer_direct_reads(Arena& arena, const std::vector<std::optional<ShmStream::Link>>& links) {
  std::vector<int> pids(links.size(), 0);
  for (std::size_t peer = 0; peer < links.size(); ++peer) {
    if (links[peer]) pids[peer] = links[peer]->peer_pid;
  }
  const ArenaDirectSetting setting = arena_direct_setting();
  bool every_peer = true;
  for (std::size_t peer = 0; peer < pids.size(); ++peer) every_peer = every_peer && (static_cast<int>(peer) == arena.rank() || pids[peer] > 0);
  // The probe only where it can change something: every peer readable, the sizes left to the defaults.
  const bool slow = setting.probe && setting.from != 0 && every_peer && kernel_copy_is_slow(arena.rank());
  arena.offer_direct_reads(slow ? 0 : setting.from, std::move(pids));
}

// After the verdict: the group's choice, said once (by rank 0, where it is the same for all).
void settle_direct_reads(Arena& arena, int rank) {
  arena.settle_direct_reads();
  if (rank != 0) return;
  if (arena.direct_from() == Arena::direct_defaults) {
    log().info("rank 0: the group arena reads large pieces straight from the peers' buffers (single copy)");
  } else if (arena.direct_from() != 0) {
    log().info("rank 0: the group arena reads pieces of {} bytes or more straight from the peers' buffers (single copy)",
               arena.direct_from());
  } else {
    log().info("rank 0: the group arena copies through its areas (a rank cannot read every peer's memory, its kernel "
               "copies slowly, or WEFT_SHM_ARENA_CMA_BYTES=off)");
  }
}

}  // namespace

std::shared_ptr<Arena> share_arena(std::vector<std::optional<ShmStream::Link>>& links, int rank, int timeout_ms) {
  const int size = static_cast<int>(links.size());
  if (size < 2) return nullptr;
  bool all_linked = true;
  for (int peer = 0; peer < size; ++peer) all_linked = all_linked && (peer == rank || links[static_cast<std::size_t>(peer)]);
  if (rank != 0) {
    auto& to_root = links[0];
    if (!to_root) return nullptr;  // rank 0 is not linked to this rank either: it makes no arena
    if (!send_byte(to_root->socket, all_linked ? 'A' : 'N')) return nullptr;
    int fd = -1;
    const int got = receive_fds(to_root->socket, &fd, 1, timeout_ms);
    if (got != 1) return nullptr;  // 'N' (a byte without a descriptor), or nothing in time
    std::shared_ptr<Arena> arena;
    try {
      arena = Arena::adopt(fd, size, rank);
    } catch (const std::exception& e) {
      log().warn("rank {}: the group's shared-memory arena from rank 0 is unusable ({})", rank, e.what());
    }
    if (arena) offer_direct_reads(*arena, links);
    // Every rank must have it, or none uses it (the others would wait for this rank in vain).
    if (!send_byte(to_root->socket, arena ? 'Y' : 'N')) return nullptr;
    if (receive_byte(to_root->socket, timeout_ms) != 'Y') return nullptr;
    settle_direct_reads(*arena, rank);
    return arena;
  }
  // Rank 0: every linked peer votes; an arena only if every rank is linked to every other.
  bool all_voted_yes = all_linked;
  for (int peer = 1; peer < size; ++peer) {
    auto& link = links[static_cast<std::size_t>(peer)];
    if (!link) continue;
    all_voted_yes = receive_byte(link->socket, timeout_ms) == 'A' && all_voted_yes;
  }
  std::shared_ptr<Arena> arena;
  if (all_voted_yes) {
    try {
      arena = Arena::create(size, rank);
      offer_direct_reads(*arena, links);
    } catch (const std::exception& e) {
      log().warn("rank 0: cannot make the group's shared-memory arena ({}); collectives run over the rings", e.what());
    }
  }
  // The arena to every peer (or 'N'), then the confirmations, then the verdict: the arena is used only
  // if every rank mapped it.
  bool everyone = arena != nullptr;
  std::vector<bool> sent(static_cast<std::size_t>(size), false);
  for (int peer = 1; peer < size; ++peer) {
    auto& link = links[static_cast<std::size_t>(peer)];
    if (!link) continue;
    const int fd = arena ? arena->fd() : -1;
    sent[static_cast<std::size_t>(peer)] = arena && send_fds(link->socket, &fd, 1);
    if (!sent[static_cast<std::size_t>(peer)]) {
      send_byte(link->socket, 'N');
      everyone = false;
    }
  }
  for (int peer = 1; peer < size; ++peer) {
    if (sent[static_cast<std::size_t>(peer)]) everyone = receive_byte(links[static_cast<std::size_t>(peer)]->socket, timeout_ms) == 'Y' && everyone;
  }
  for (int peer = 1; peer < size; ++peer) {
    if (sent[static_cast<std::size_t>(peer)]) send_byte(links[static_cast<std::size_t>(peer)]->socket, everyone ? 'Y' : 'N');
  }
  if (!arena) return nullptr;
  if (!everyone) {
    log().warn("rank 0: a rank could not map the group's shared-memory arena; collectives run over the rings");
    return nullptr;
  }
  settle_direct_reads(*arena, rank);
  return arena;
}

}  // namespace weft::shm
