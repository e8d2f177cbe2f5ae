#include "rendezvous/bootstrap.hpp"

#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <set>

#include <asio/experimental/as_tuple.hpp>
#include <asio/experimental/awaitable_operators.hpp>
#include <cerrno>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/log.hpp"
#include "core/deadline.hpp"
#include "rendezvous/greeting.hpp"
#include "weft/error.hpp"

namespace weft {
namespace {

using asio::awaitable;
using asio::use_awaitable;
using asio::ip::tcp;
using namespace asio::experimental::awaitable_operators;
using Clock = std::chrono::steady_clock;
constexpr auto no_throw = asio::experimental::as_tuple(asio::use_awaitable);
// A connection must finish its greeting within this; at most this many greet at once, a new one past
// that closing the oldest (docs/PROTOCOL.md).
constexpr auto greeting_timeout = std::chrono::seconds(10);
constexpr int max_pending_greetings = 64;

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
    const auto endpoints = co_await resolve(host, port);
    // The name may resolve later (a DNS record that is not there yet): retried, but said if it never does.
    if (endpoints.empty()) last_error = fmt::format("cannot resolve '{}'", host);
    for (const auto& endpoint : endpoints) {
      tcp::socket socket(executor);
      auto [ec] = co_await socket.async_connect(endpoint, no_throw);
      if (!ec) co_return socket;
      last_error = ec.message();
    }
    if (Clock::now() >= deadline) co_return tcp::socket(executor);
    co_await sleep(std::chrono::milliseconds(20));
  }
}

// What the accepting side of the bootstrap shares with the greetings it runs. Greetings are spawned
// (so that a silent stranger delays nobody) and may outlive the bootstrap's frame: they hold this.
struct Admissions {
  Admissions(const asio::any_io_executor& executor, const Options& options)
      : options(options),
        connected(static_cast<std::size_t>(options.world_size), false),
        admitted(static_cast<std::size_t>(options.world_size)),
        keys(static_cast<std::size_t>(options.world_size)),
        waiting(options.world_size - 1 - options.rank),
        changed(executor),
        refusals(std::make_shared<greeting::RefusalLog>(fmt::format("rank {}: bootstrap", options.rank))),
        greeting(max_pending_greetings, refusals) {}
  Options options;
  std::uint64_t selection = 0;  // the digest of what shapes this rank's plans (bootstrap's `selection`)
  std::vector<bool> connected;  // ranks connected (or reserved by a greeting that proved the secret)
  std::vector<std::optional<tcp::socket>> admitted;
  std::vector<FrameKeys> keys;  // of the admitted connections
  int waiting = 0;  // ranks above this one not admitted yet
  bool finished = false;
  asio::steady_timer changed;  // cancelled when a greeting ends
  std::shared_ptr<greeting::RefusalLog> refusals;
  greeting::PendingGreetings greeting;  // connections still greeting
};

// The accepting side of one connection: the greeting (rank, world size, job, secret). The connection is
// admitted as its rank, or refused and logged with its address.
awaitable<void> admit_peer(std::shared_ptr<Admissions> state, tcp::socket socket, std::string who) {
  const auto& options = state->options;
  const greeting::Local local{greeting::Role::rank, options.rank, options.world_size, options.job_id, options.secret, options.integrity,
                              state->selection};
  int claim = -1;
  const std::function<std::string(const greeting::Greeting&)> check = [&](const greeting::Greeting& g) -> std::string {
    if (static_cast<int>(g.world_size) != options.world_size) {
      return fmt::format("rank {} says the world has {} ranks; this rank says {}", g.rank, g.world_size, options.world_size);
    }
    if (g.rank <= options.rank || g.rank >= options.world_size) {
      return fmt::format("rank {} should not connect to rank {}", g.rank, options.rank);
    }
    if (state->connected[static_cast<std::size_t>(g.rank)]) {
      return fmt::format("rank {} is already connected (duplicate rank)", g.rank);
    }
    claim = g.rank;
    state->connected[static_cast<std::size_t>(g.rank)] = true;
    return {};
  };
  const auto handle = state->greeting.add(socket, who);
  greeting::Greeting theirs;
  const std::string refusal = co_await greeting::admit(socket, local, check, greeting_timeout, &theirs);
  const bool evicted = state->greeting.remove(handle);
  if (state->finished) co_return;
  if (refusal.empty() && !evicted) {
    state->admitted[static_cast<std::size_t>(claim)] = std::move(socket);
    state->keys[static_cast<std::size_t>(claim)] = FrameKeys{theirs.send_key, theirs.recv_key};
    --state->waiting;
  } else {
    if (claim >= 0) state->connected[static_cast<std::size_t>(claim)] = false;
    if (!evicted) state->refusals->refused(who, refusal);
  }
  state->changed.cancel();
}

// Accepts until every rank above this one is admitted. At most max_pending_greetings connections greet
// at once; a new one past that closes the oldest (logged; a real rank greets again).
awaitable<void> accept_peers(tcp::acceptor& acceptor, std::shared_ptr<Admissions> state) {
  struct Finish {  // however this ends (done, failed, cancelled by the deadline): stop the greetings
    Admissions& state;
    ~Finish() {
      state.finished = true;
      state.greeting.close_all();
    }
  } finish{*state};
  state->changed.expires_at(Clock::time_point::max());
  while (state->waiting > 0) {
    tcp::endpoint from;  // as accept saw it: still known when the stranger already reset
    auto next = co_await (acceptor.async_accept(from, no_throw) || state->changed.async_wait(no_throw));
    if (next.index() == 1) continue;  // a greeting ended: see whether anybody is still waited for
    auto [ec, socket] = std::move(std::get<0>(next));
    if (ec) throw std::system_error(ec, "accept");
    asio::co_spawn(acceptor.get_executor(), admit_peer(state, std::move(socket), greeting::address_of(from)), asio::detached);
  }
}

// The connecting side of a greeting (to the store or to a rank), within greeting_timeout and the
// bootstrap's deadline. Returns the other side's greeting; fails as this rank's bootstrap otherwise.
awaitable<greeting::Greeting> greet(tcp::socket& socket, const greeting::Local& local, const std::string& remote,
                                    Clock::time_point deadline) {
  try {
    auto theirs = co_await with_deadline(greeting::connect(socket, local, remote), std::min(deadline, Clock::now() + greeting_timeout));
    if (!theirs) {
      fail(Errc::timeout, local.rank,
           fmt::format("{} did not answer the greeting in time (limit {} s, or the bootstrap deadline)", remote, greeting_timeout.count()));
    }
    co_return std::move(*theirs);
  } catch (const greeting::Refused& e) {
    // Named by address if the refusal does not say whom (a stranger's bytes: "not a weft greeting").
    const std::string_view what = e.what();
    fail(Errc::refused, local.rank, what.starts_with(remote) ? std::string(what) : fmt::format("{} answered: {}", remote, what));
  } catch (const std::system_error& e) {
    if (dynamic_cast<const Error*>(&e)) throw;
    fail(Errc::connection_failed, local.rank, fmt::format("{}: the connection failed during the greeting: {}", remote, e.code().message()));
  }
}

// Connects and greets, and does so again while the other side closes the connection during the greeting
// or does not answer it in time (a listener crowded by strangers closes its oldest greetings), until
// `deadline`. A refusal is final. Returns a closed socket when nothing answered at all (`last_error` says
// why). `name` is how messages name the other side ("rank 2"), followed by its address.
awaitable<tcp::socket> connect_and_greet(const std::string& host, unsigned short port, const greeting::Local& local,
                                         const std::string& name, Clock::time_point deadline, greeting::Greeting& theirs,
                                         std::string& last_error) {
  for (int attempt = 1;; ++attempt) {
    tcp::socket socket = co_await connect_retrying(host, port, deadline, last_error);
    if (!socket.is_open()) co_return socket;
    std::error_code ignored;
    socket.set_option(tcp::no_delay(true), ignored);
    const auto remote = fmt::format("{} at {}", name, greeting::remote_address(socket));
    try {
      theirs = co_await greet(socket, local, remote, deadline);
      co_return socket;
    } catch (const Error& e) {
      if (e.errc() == Errc::refused || Clock::now() >= deadline) throw;
      log().info("rank {}: greeting {} again (attempt {}): {}", local.rank, remote, attempt + 1, e.what());
      last_error = e.what();
    }
    co_await sleep(std::min(std::chrono::milliseconds(10 * attempt), std::chrono::milliseconds(200)));
  }
}

// The connecting side: rank i connects to every rank below it, then greets it.
awaitable<void> connect_peers(const std::vector<std::pair<std::string, unsigned short>>& addresses,
                              const Options& options, std::uint64_t selection, BootstrapResult& out, std::vector<bool>& connected,
                              Clock::time_point deadline) {
  const greeting::Local local{greeting::Role::peer, options.rank, options.world_size, options.job_id, options.secret, options.integrity,
                              selection};
  for (int peer = 0; peer < options.rank; ++peer) {
    const auto& [host, port] = addresses[static_cast<std::size_t>(peer)];
    std::string last_error;
    greeting::Greeting theirs;
    const auto name = fmt::format("rank {}", peer);
    tcp::socket socket = co_await connect_and_greet(host, port, local, name, deadline, theirs, last_error);
    if (!socket.is_open()) {
      fail(Errc::connection_failed, options.rank,
           fmt::format("could not connect to rank {} at {}:{}: {}", peer, host, port, last_error));
    }
    const auto remote = fmt::format("rank {} at {}", peer, greeting::remote_address(socket));
    if (theirs.rank != peer) {
      fail(Errc::refused, options.rank, fmt::format("{} greets as rank {} (the store's address is stale, or a stranger holds it)", remote, theirs.rank));
    }
    connected[static_cast<std::size_t>(peer)] = true;
    out.sockets[static_cast<std::size_t>(peer)] = std::move(socket);
    out.frame_keys[static_cast<std::size_t>(peer)] = FrameKeys{theirs.send_key, theirs.recv_key};
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

awaitable<void> bootstrap(asio::any_io_executor executor, const Options& options, BootstrapResult& out, std::uint64_t selection) {
  const int rank = options.rank;
  const int size = options.world_size;
  const auto deadline = Clock::now() + options.bootstrap_timeout;
  const HostPort store_at = parse_host_port(options.store, "the store address");
  out.sockets.clear();
  for (int i = 0; i < size; ++i) out.sockets.emplace_back(executor);
  out.frame_keys.assign(static_cast<std::size_t>(size), FrameKeys{});
  if (size == 1) co_return;
  if (options.secret.empty()) {
    // Said once per process, as a warning where the store is served (one line per job, not per rank).
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
      const auto text = "connections are unauthenticated: any process that reaches the store or a rank's port can "
                        "take part (set WEFT_SECRET or WEFT_SECRET_FILE on every rank to require a shared secret)";
      if (rank == 0) log().warn("rank {}: {}", rank, text);
      else log().info("rank {}: {}", rank, text);
    }
  }

  if (rank == 0) {
    auto endpoints = co_await resolve(store_at.host, store_at.port);
    if (endpoints.empty()) fail(Errc::connection_failed, rank, fmt::format("cannot resolve the store host '{}'", store_at.host));
    try {
      out.store_server = std::make_unique<store::Server>(
          executor, endpoints.front(),
          store::Admission{options.job_id, options.secret, size, std::chrono::milliseconds(greeting_timeout), 64, options.integrity, selection});
    } catch (const std::system_error& e) {
      // In use: most often by this job's own store, which serves for its group's life: a second
      // Group::create from the same environment. Say so (the other ranks only see "duplicate rank").
      const bool in_use = e.code().value() == EADDRINUSE;
      fail(Errc::connection_failed, rank,
           fmt::format("cannot serve the store on {}: {}{}", options.store, e.code().message(),
                       in_use ? " (by another process, or by this job's store: a group made earlier from the same "
                                "environment serves it for its whole life; make further groups with split())"
                              : ""));
    }
  }

  std::string last_error;
  const greeting::Local as_client{greeting::Role::store_client, rank, size, options.job_id, options.secret, options.integrity, selection};
  greeting::Greeting the_store;
  const std::string store_name = "the store";
  tcp::socket store_socket =
      co_await connect_and_greet(store_at.host, store_at.port, as_client, store_name, deadline, the_store, last_error);
  if (!store_socket.is_open()) {
    fail(Errc::timeout, rank,
         fmt::format("rank 0 never served the store at {} within {} s: {}", options.store,
                     std::chrono::duration_cast<std::chrono::seconds>(options.bootstrap_timeout).count(), last_error));
  }
  store::Client store(std::move(store_socket));

  // Listen where told, else on the address that reaches the store.
  const auto store_local = store.socket().local_endpoint().address();
  const auto listen_address =
      options.interface.empty() ? store_local : interface_address(options.interface, store_local.is_v6());
  tcp::acceptor acceptor(executor);
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
  std::vector<std::string> missing;
  std::string stopped;
  try {
    missing = co_await store.wait(keys, remaining(deadline) + store_grace);
  } catch (const store::Stopped& e) {
    stopped = e.what();
  }
  if (!stopped.empty()) {
    // A process of this job was refused for how it was set up (docs/PROTOCOL.md, "Rendezvous store"):
    // its rank will not come as it is, so nobody waits out the bootstrap timeout for it. The store's
    // rank first serves on until every other rank has heard it, since the store closes with it and a
    // rank that comes later would look for it until its timeout; but at most 10 s (a rank that died
    // before it arrived never hears it, and this rank's own error should not wait for it).
    if (out.store_server) {
      asio::steady_timer pause(executor);
      const auto serve_until = std::min(deadline, Clock::now() + std::chrono::seconds(10));
      while (!out.store_server->told_every_rank() && Clock::now() < serve_until) {
        pause.expires_after(std::chrono::milliseconds(10));
        co_await pause.async_wait(use_awaitable);
      }
    }
    fail(Errc::refused, rank,
         fmt::format("the store at {} refused a process of this job, so the group cannot form: {}", options.store, stopped));
  }
  if (!missing.empty()) {
    std::vector<std::string> ranks;
    for (const auto& key : missing) ranks.push_back(key.substr(key.rfind('/') + 1));
    // Where the store is served, what it refused meanwhile: a rank set up differently (another WEFT_ALGO,
    // secret or world size) was refused by name in its own error and only in this rank's log.
    const std::string refused = out.store_server ? out.store_server->refusals() : std::string();
    fail(Errc::timeout, rank,
         fmt::format("ranks [{}] never arrived at the store {} within {} s{}", fmt::join(ranks, ", "), options.store,
                     std::chrono::duration_cast<std::chrono::seconds>(options.bootstrap_timeout).count(),
                     refused.empty() ? "" : " (the store meanwhile: " + refused + ")"));
  }
  std::vector<std::pair<std::string, unsigned short>> addresses;
  for (int i = 0; i < size; ++i) {
    auto value = co_await store.get(keys[static_cast<std::size_t>(i)]);
    if (!value) fail(Errc::protocol_error, rank, fmt::format("the store lost the address of rank {}", i));
    const auto space = value->find(' ');
    addresses.emplace_back(value->substr(0, space), static_cast<unsigned short>(std::stoi(value->substr(space + 1))));
  }

  auto admissions = std::make_shared<Admissions>(executor, options);
  admissions->selection = selection;
  std::vector<bool> connected_below(static_cast<std::size_t>(size), false);
  // Both directions at once; the first failure (a refusal, above all) ends the bootstrap with its reason
  // at once: with_deadline rethrows it, where Asio's `||` against a timer swallowed it and waited for the
  // deadline (the refused rank said "never connected" 120 s later).
  auto join_everyone = [&]() -> awaitable<bool> {
    co_await (accept_peers(acceptor, admissions) && connect_peers(addresses, options, selection, out, connected_below, deadline));
    co_return true;
  };
  const auto joined = co_await with_deadline(join_everyone(), deadline);
  for (int i = 0; i < size; ++i) {
    if (connected_below[static_cast<std::size_t>(i)]) admissions->connected[static_cast<std::size_t>(i)] = true;
  }
  if (!joined) {
    // What this rank's listener refused meanwhile (a stranger, or a rank that failed its greeting) is
    // otherwise only in the log.
    const std::string refused = admissions->refusals->summary();
    fail(Errc::timeout, rank,
         fmt::format("ranks [{}] never connected within {} s{}", missing_ranks(admissions->connected, rank),
                     std::chrono::duration_cast<std::chrono::seconds>(options.bootstrap_timeout).count(),
                     refused.empty() ? "" : " (this rank's listener meanwhile: " + refused + ")"));
  }
  for (int i = rank + 1; i < size; ++i) {
    out.sockets[static_cast<std::size_t>(i)] = std::move(*admissions->admitted[static_cast<std::size_t>(i)]);
    out.frame_keys[static_cast<std::size_t>(i)] = admissions->keys[static_cast<std::size_t>(i)];
  }
  // Every peer is connected: no more connections are expected, so nothing listens any longer.
  acceptor.close();
}

}  // namespace weft
