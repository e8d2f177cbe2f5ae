#include "src/group/bootstrap.hpp"

#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <cstring>

#include <asio/experimental/as_tuple.hpp>
#include <asio/experimental/awaitable_operators.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "src/core/log.hpp"
#include "transports/tcp/tcp_transport.hpp"
#include "transports/tcp/wire.hpp"
#include "weft/error.hpp"

namespace weft {
namespace {

using asio::awaitable;
using asio::use_awaitable;
using asio::ip::tcp;
using namespace asio::experimental::awaitable_operators;
using Clock = std::chrono::steady_clock;
constexpr auto no_throw = asio::experimental::as_tuple(asio::use_awaitable);
constexpr auto handshake_timeout = std::chrono::seconds(10);

[[noreturn]] void fail(Errc code, int rank, const std::string& detail) {
  throw_error(code, ErrorContext{.rank = rank, .op = "bootstrap"}, detail);
}

std::chrono::milliseconds remaining(Clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(0),
                  std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
}

awaitable<std::vector<tcp::endpoint>> resolve(const std::string& host, unsigned short port) {
  std::error_code ec;
  auto address = asio::ip::make_address(host, ec);
  if (!ec) co_return std::vector<tcp::endpoint>{tcp::endpoint(address, port)};
  tcp::resolver resolver(co_await asio::this_coro::executor);
  auto [rec, results] = co_await resolver.async_resolve(host, std::to_string(port), no_throw);
  std::vector<tcp::endpoint> out;
  if (!rec) {
    for (const auto& r : results) out.push_back(r.endpoint());
  }
  co_return out;
}

awaitable<void> sleep(std::chrono::milliseconds d) {
  asio::steady_timer timer(co_await asio::this_coro::executor, d);
  co_await timer.async_wait(no_throw);
}

// Connects to the first endpoint that answers, retrying until `deadline` (the other side may not be up).
awaitable<tcp::socket> connect_retrying(const std::string& host, unsigned short port, Clock::time_point deadline,
                                        std::string& last_error) {
  auto executor = co_await asio::this_coro::executor;
  for (;;) {
    for (const auto& endpoint : co_await resolve(host, port)) {
      tcp::socket socket(executor);
      auto [ec] = co_await socket.async_connect(endpoint, no_throw);
      if (!ec) co_return socket;
      last_error = ec.message();
    }
    if (Clock::now() >= deadline) co_return tcp::socket(executor);
    co_await sleep(std::chrono::milliseconds(20));
  }
}

// Races `op` against a deadline. Returns nullopt when the deadline won.
template <class T>
awaitable<std::optional<T>> with_deadline(awaitable<T> op, Clock::time_point deadline) {
  asio::steady_timer timer(co_await asio::this_coro::executor, deadline);
  auto result = co_await (std::move(op) || timer.async_wait(use_awaitable));
  if (result.index() == 0) co_return std::optional<T>(std::move(std::get<0>(result)));
  co_return std::nullopt;
}

awaitable<wire::Header> read_frame_header(tcp::socket& socket) {
  wire::HeaderBytes bytes{};
  co_await asio::async_read(socket, asio::buffer(bytes), use_awaitable);
  std::string error;
  auto header = wire::decode(bytes, error);
  if (!header) throw std::runtime_error(error);
  co_return *header;
}

awaitable<void> write_frame(tcp::socket& socket, wire::FrameKind kind, const void* payload, std::size_t bytes) {
  wire::Header h;
  h.kind = kind;
  h.bytes = bytes;
  wire::HeaderBytes header{};
  wire::encode(h, header);
  std::array<asio::const_buffer, 2> buffers{asio::buffer(header), asio::buffer(payload, bytes)};
  co_await asio::async_write(socket, buffers, use_awaitable);
}

awaitable<void> send_ack(tcp::socket& socket, std::uint32_t status, const std::string& reason) {
  std::string payload(4, '\0');
  wire::put_u32(reinterpret_cast<std::byte*>(payload.data()), status);
  payload += reason;
  co_await write_frame(socket, wire::FrameKind::hello_ack, payload.data(), payload.size());
}

std::string endpoint_text(const tcp::socket& socket) {
  std::error_code ec;
  auto ep = socket.remote_endpoint(ec);
  if (ec) return "?";
  return ep.address().is_v6() ? fmt::format("[{}]:{}", ep.address().to_string(), ep.port())
                              : fmt::format("{}:{}", ep.address().to_string(), ep.port());
}

// The acceptor's side of the handshake. Returns the peer's rank, or -1 (logged) for a connection that is
// not a rank of this job.
awaitable<int> accept_handshake(tcp::socket& socket, const Options& options, const std::vector<bool>& connected) {
  const std::string who = endpoint_text(socket);
  try {
    auto header = co_await with_deadline(read_frame_header(socket), Clock::now() + handshake_timeout);
    if (!header) {
      log().warn("rank {}: bootstrap: dropped a connection from {}: no hello within {} s", options.rank, who,
                 handshake_timeout.count());
      co_return -1;
    }
    if (header->kind != wire::FrameKind::hello || header->bytes != wire::hello_size) {
      log().warn("rank {}: bootstrap: dropped a connection from {}: expected a hello frame", options.rank, who);
      co_return -1;
    }
    std::array<std::byte, wire::hello_size> payload{};
    co_await asio::async_read(socket, asio::buffer(payload), use_awaitable);
    const auto hello = wire::decode_hello(payload.data());
    std::string refusal;
    if (static_cast<int>(hello.world_size) != options.world_size) {
      refusal = fmt::format("world size {} disagrees with this rank's {}", hello.world_size, options.world_size);
    } else if (static_cast<int>(hello.rank) <= options.rank || static_cast<int>(hello.rank) >= options.world_size) {
      refusal = fmt::format("rank {} should not connect to rank {}", hello.rank, options.rank);
    } else if (connected[hello.rank]) {
      refusal = fmt::format("rank {} is already connected (duplicate rank)", hello.rank);
    }
    if (!refusal.empty()) {
      log().warn("rank {}: bootstrap: refused {}: {}", options.rank, who, refusal);
      co_await send_ack(socket, 1, refusal);
      co_return -1;
    }
    co_await send_ack(socket, 0, {});
    co_return static_cast<int>(hello.rank);
  } catch (const std::exception& e) {
    log().warn("rank {}: bootstrap: dropped a connection from {}: {}", options.rank, who, e.what());
  }
  co_return -1;
}

awaitable<void> accept_peers(tcp::acceptor& acceptor, const Options& options, BootstrapResult& out,
                             std::vector<bool>& connected) {
  int waiting = options.world_size - 1 - options.rank;
  while (waiting > 0) {
    tcp::socket socket = co_await acceptor.async_accept(use_awaitable);
    const int peer = co_await accept_handshake(socket, options, connected);
    if (peer < 0) continue;
    connected[static_cast<std::size_t>(peer)] = true;
    out.sockets[static_cast<std::size_t>(peer)] = std::move(socket);
    --waiting;
  }
}

awaitable<void> connect_peers(const std::vector<std::pair<std::string, unsigned short>>& addresses,
                              const Options& options, BootstrapResult& out, std::vector<bool>& connected,
                              Clock::time_point deadline) {
  for (int peer = 0; peer < options.rank; ++peer) {
    const auto& [host, port] = addresses[static_cast<std::size_t>(peer)];
    std::string last_error;
    tcp::socket socket = co_await connect_retrying(host, port, deadline, last_error);
    if (!socket.is_open()) {
      fail(Errc::connection_failed, options.rank,
           fmt::format("could not connect to rank {} at {}:{}: {}", peer, host, port, last_error));
    }
    const auto hello = wire::encode_hello(wire::Hello{static_cast<std::uint32_t>(options.rank),
                                                      static_cast<std::uint32_t>(options.world_size), 0});
    co_await write_frame(socket, wire::FrameKind::hello, hello.data(), hello.size());
    auto header = co_await read_frame_header(socket);
    if (header.kind != wire::FrameKind::hello_ack || header.bytes < 4) {
      fail(Errc::protocol_error, options.rank, fmt::format("rank {} answered the hello with something else", peer));
    }
    std::string payload(header.bytes, '\0');
    co_await asio::async_read(socket, asio::buffer(payload), use_awaitable);
    const auto status = wire::get_u32(reinterpret_cast<const std::byte*>(payload.data()));
    if (status != 0) {
      fail(Errc::connection_failed, options.rank, fmt::format("rank {} refused the connection: {}", peer, payload.substr(4)));
    }
    connected[static_cast<std::size_t>(peer)] = true;
    out.sockets[static_cast<std::size_t>(peer)] = std::move(socket);
  }
}

std::string missing_ranks(const std::vector<bool>& connected, int self) {
  std::vector<int> missing;
  for (std::size_t i = 0; i < connected.size(); ++i) {
    if (!connected[i] && static_cast<int>(i) != self) missing.push_back(static_cast<int>(i));
  }
  return fmt::format("{}", fmt::join(missing, ", "));
}

}  // namespace

asio::ip::address interface_address(const std::string& interface, bool prefer_v6) {
  std::error_code ec;
  auto address = asio::ip::make_address(interface, ec);
  if (!ec) return address;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    throw Error(Errc::invalid_argument, ErrorContext{.op = "bootstrap"}, "getifaddrs failed");
  }
  std::optional<asio::ip::address> v4;
  std::optional<asio::ip::address> v6;
  for (ifaddrs* it = list; it; it = it->ifa_next) {
    if (!it->ifa_addr || interface != it->ifa_name) continue;
    if (it->ifa_addr->sa_family == AF_INET && !v4) {
      const auto* sin = reinterpret_cast<const sockaddr_in*>(it->ifa_addr);
      v4 = asio::ip::address_v4(ntohl(sin->sin_addr.s_addr));
    } else if (it->ifa_addr->sa_family == AF_INET6 && !v6) {
      const auto* sin6 = reinterpret_cast<const sockaddr_in6*>(it->ifa_addr);
      asio::ip::address_v6::bytes_type bytes;
      std::memcpy(bytes.data(), sin6->sin6_addr.s6_addr, 16);
      v6 = asio::ip::address_v6(bytes, sin6->sin6_scope_id);
    }
  }
  freeifaddrs(list);
  if (prefer_v6 && v6) return *v6;
  if (v4) return *v4;
  if (v6) return *v6;
  throw Error(Errc::invalid_argument, ErrorContext{.op = "bootstrap"},
              fmt::format("interface '{}' (WEFT_IFNAME or Options::interface) has no address", interface));
}

awaitable<void> bootstrap(asio::io_context& io, const Options& options, BootstrapResult& out) {
  const int rank = options.rank;
  const int size = options.world_size;
  const auto deadline = Clock::now() + options.bootstrap_timeout;
  const HostPort store_at = parse_host_port(options.store, "the store address");
  out.sockets.clear();
  for (int i = 0; i < size; ++i) out.sockets.emplace_back(io);
  if (size == 1) co_return;

  if (rank == 0) {
    auto endpoints = co_await resolve(store_at.host, store_at.port);
    if (endpoints.empty()) fail(Errc::connection_failed, rank, fmt::format("cannot resolve the store host '{}'", store_at.host));
    try {
      out.store_server = std::make_unique<store::Server>(io, endpoints.front());
    } catch (const std::system_error& e) {
      fail(Errc::connection_failed, rank, fmt::format("cannot serve the store on {}: {}", options.store, e.code().message()));
    }
  }

  std::string last_error;
  tcp::socket store_socket = co_await connect_retrying(store_at.host, store_at.port, deadline, last_error);
  if (!store_socket.is_open()) {
    fail(Errc::timeout, rank,
         fmt::format("rank 0 never served the store at {} within {} s: {}", options.store,
                     std::chrono::duration_cast<std::chrono::seconds>(options.bootstrap_timeout).count(), last_error));
  }
  store_socket.set_option(tcp::no_delay(true));
  store::Client store(std::move(store_socket));

  // Listen where told, else on the address that reaches the store.
  const auto store_local = store.socket().local_endpoint().address();
  const auto listen_address =
      options.interface.empty() ? store_local : interface_address(options.interface, store_local.is_v6());
  tcp::acceptor acceptor(io);
  acceptor.open(tcp::endpoint(listen_address, 0).protocol());
  if (listen_address.is_v6()) acceptor.set_option(asio::ip::v6_only(true));
  acceptor.bind(tcp::endpoint(listen_address, 0));
  acceptor.listen();
  const unsigned short listen_port = acceptor.local_endpoint().port();
  log().debug("rank {}: listening on {} port {}", rank, listen_address.to_string(), listen_port);

  std::vector<std::string> keys;
  for (int i = 0; i < size; ++i) keys.push_back(fmt::format("weft/addr/{}", i));
  co_await store.set(keys[static_cast<std::size_t>(rank)], fmt::format("{} {}", listen_address.to_string(), listen_port));
  // Rank 0 hosts the store: it waits a little longer than everybody else, so that the other ranks'
  // WAITs time out first and learn which ranks are missing, rather than seeing the store vanish.
  const auto store_grace = rank == 0 ? std::chrono::milliseconds(1000) : std::chrono::milliseconds(0);
  const auto missing = co_await store.wait(keys, remaining(deadline) + store_grace);
  if (!missing.empty()) {
    std::vector<std::string> ranks;
    for (const auto& key : missing) ranks.push_back(key.substr(key.rfind('/') + 1));
    fail(Errc::timeout, rank,
         fmt::format("ranks [{}] never arrived at the store {} within {} s", fmt::join(ranks, ", "), options.store,
                     std::chrono::duration_cast<std::chrono::seconds>(options.bootstrap_timeout).count()));
  }
  std::vector<std::pair<std::string, unsigned short>> addresses;
  for (int i = 0; i < size; ++i) {
    auto value = co_await store.get(keys[static_cast<std::size_t>(i)]);
    if (!value) fail(Errc::protocol_error, rank, fmt::format("the store lost the address of rank {}", i));
    const auto space = value->find(' ');
    addresses.emplace_back(value->substr(0, space), static_cast<unsigned short>(std::stoi(value->substr(space + 1))));
  }

  std::vector<bool> connected(static_cast<std::size_t>(size), false);
  asio::steady_timer timer(io, deadline);
  auto result = co_await ((accept_peers(acceptor, options, out, connected) &&
                           connect_peers(addresses, options, out, connected, deadline)) ||
                          timer.async_wait(use_awaitable));
  if (result.index() == 1) {
    fail(Errc::timeout, rank,
         fmt::format("ranks [{}] never connected within {} s", missing_ranks(connected, rank),
                     std::chrono::duration_cast<std::chrono::seconds>(options.bootstrap_timeout).count()));
  }
  // Every peer is connected: no more connections are expected, so nothing listens any longer.
  acceptor.close();
}

}  // namespace weft
