#include "rendezvous/store.hpp"

#include <functional>
#include <set>
#include <unordered_map>

#include <asio/experimental/as_tuple.hpp>
#include <fmt/format.h>

#include "core/bytes.hpp"
#include "core/log.hpp"

namespace weft::store {
namespace {

using asio::awaitable;
using asio::use_awaitable;
using asio::ip::tcp;
constexpr auto no_throw = asio::experimental::as_tuple(asio::use_awaitable);

std::string join(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) {
    if (!out.empty()) out += '\n';
    out += k;
  }
  return out;
}

}  // namespace

std::optional<Request> parse_request(const std::byte* header, std::string& error) {
  const auto m = le::get_u32(header);
  const auto command = static_cast<unsigned>(header[4]);
  Request r{static_cast<Command>(command), le::get_u32(header + 8), le::get_u64(header + 12)};
  if (m != magic) {
    error = fmt::format("bad magic 0x{:08x}", m);
  } else if (command < 1 || command > 4) {
    error = fmt::format("unknown command {}", command);
  } else if (r.key_bytes > max_key_bytes || r.value_bytes > max_value_bytes) {
    error = fmt::format("a key of {} or a value of {} bytes is over the limit ({} and {})", r.key_bytes, r.value_bytes,
                        max_key_bytes, max_value_bytes);
  } else {
    return r;
  }
  return std::nullopt;
}

Reply apply(Table& data, Command command, const std::string& key, std::string value) {
  switch (command) {
    case Command::set:
      data[key] = std::move(value);
      return Reply{Status::ok, {}, true};
    case Command::get: {
      auto it = data.find(key);
      if (it == data.end()) return Reply{Status::missing, {}, false};
      return Reply{Status::ok, it->second, false};
    }
    case Command::add: {
      if (value.size() != 8) return Reply{Status::bad_request, "add takes an 8-byte integer", false};
      std::uint64_t current = 0;  // unsigned: wraps like two's complement, never overflows
      if (auto it = data.find(key); it != data.end() && it->second.size() == 8) {
        current = le::get_u64(reinterpret_cast<const std::byte*>(it->second.data()));
      }
      current += le::get_u64(reinterpret_cast<const std::byte*>(value.data()));
      std::string stored(8, '\0');
      le::put_u64(reinterpret_cast<std::byte*>(stored.data()), current);
      data[key] = stored;
      return Reply{Status::ok, stored, true};
    }
    case Command::wait: break;
  }
  return Reply{Status::bad_request, "not a command apply() runs", false};
}

std::optional<std::chrono::milliseconds> wait_timeout(const std::string& value) {
  if (value.size() != 8) return std::nullopt;
  // Clamped: a client's u64 must not overflow the deadline's arithmetic.
  const auto ms = std::min<std::uint64_t>(le::get_u64(reinterpret_cast<const std::byte*>(value.data())), 86'400'000);
  return std::chrono::milliseconds(static_cast<std::int64_t>(ms));
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start <= text.size() && !text.empty()) {
    const auto end = text.find('\n', start);
    out.push_back(text.substr(start, end == std::string::npos ? std::string::npos : end - start));
    if (end == std::string::npos) break;
    start = end + 1;
  }
  return out;
}


struct Server::Impl : std::enable_shared_from_this<Impl> {
  explicit Impl(const asio::any_io_executor& executor, const tcp::endpoint& endpoint, Admission admission)
      : acceptor(executor),
        admission(std::move(admission)),
        pending(static_cast<std::size_t>(this->admission.max_pending), refusals) {
    acceptor.open(endpoint.protocol());
    acceptor.set_option(tcp::acceptor::reuse_address(true));
    if (endpoint.address().is_v6()) acceptor.set_option(asio::ip::v6_only(true));
    acceptor.bind(endpoint);
    acceptor.listen();
  }

  tcp::acceptor acceptor;
  Admission admission;
  std::unordered_map<int, std::string> claimed;  // rank -> the address it greeted from
  std::shared_ptr<greeting::RefusalLog> refusals = std::make_shared<greeting::RefusalLog>("store");
  greeting::PendingGreetings pending;  // connections still greeting
  Table data;
  std::set<asio::steady_timer*> waiters;  // WAIT requests asleep until the next change
  std::set<tcp::socket*> clients;
  bool closed = false;
  // Set by the first process of this job refused for how it was set up: the ranks that wait for it would
  // wait out the bootstrap timeout for a rank that will not come as it is, so every WAIT ends with this.
  std::string stopped;
  std::set<int> refused_members;  // the ranks such processes claimed
  std::set<int> told_stopped;     // the ranks whose WAIT was answered with it (it ends their bootstrap)

  void changed() {
    for (auto* timer : waiters) timer->cancel();
  }

  awaitable<void> accept_loop() {
    auto self = shared_from_this();
    while (!closed) {
      tcp::endpoint from_endpoint;  // as accept saw it: still known when the stranger already reset
      auto [ec, socket] = co_await acceptor.async_accept(from_endpoint, no_throw);
      if (ec) {
        if (closed || ec == asio::error::operation_aborted) co_return;
        continue;
      }
      const std::string from = greeting::address_of(from_endpoint);
      std::error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      asio::co_spawn(acceptor.get_executor(), serve(std::move(socket), from), asio::detached);
    }
  }

  awaitable<void> reply(tcp::socket& socket, Status status, const std::string& payload) {
    std::array<std::byte, response_header_size> header{};
    header[0] = static_cast<std::byte>(status);
    le::put_u64(header.data() + 4, payload.size());
    std::array<asio::const_buffer, 2> buffers{asio::buffer(header), asio::buffer(payload)};
    co_await asio::async_write(socket, buffers, use_awaitable);
  }

  // The greeting: who connects (greeting.hpp). Returns the rank admitted, or nullopt (logged, with the
  // address) for a connection that may not use the store.
  awaitable<std::optional<int>> admit(tcp::socket& socket, const std::string& peer) {
    const greeting::Local local{greeting::Role::store, -1, admission.world_size, admission.job, admission.secret, admission.integrity,
                                      admission.selection};
    int claim = -1;
    bool duplicate = false;  // a second process of one rank: the first may still form the group
    const std::function<std::string(const greeting::Greeting&)> check = [&](const greeting::Greeting& g) -> std::string {
      if (static_cast<int>(g.world_size) != admission.world_size) {
        return fmt::format("rank {} says the world has {} ranks; the store (rank 0) says {}", g.rank, g.world_size,
                           admission.world_size);
      }
      if (g.rank < 0 || g.rank >= admission.world_size) {
        return fmt::format("rank {} is not below the world size {}", g.rank, admission.world_size);
      }
      if (auto it = claimed.find(g.rank); it != claimed.end()) {
        duplicate = true;
        return fmt::format("rank {} already arrived from {} (duplicate rank: two processes were given rank {}, or a "
                           "process made a second group from the same environment; make further groups with split())",
                           g.rank, it->second, g.rank);
      }
      claim = g.rank;
      claimed.emplace(g.rank, peer);
      return {};
    };
    const auto handle = pending.add(socket, peer);
    std::optional<int> member;
    const std::string refusal = co_await greeting::admit(socket, local, check, admission.greeting_timeout, nullptr, &member);
    const bool evicted = pending.remove(handle);
    if (refusal.empty() && !evicted) co_return claim;
    if (claim >= 0) claimed.erase(claim);
    if (!evicted) refusals->refused(peer, refusal);
    if (member && !duplicate) {
      refused_members.insert(*member);
      if (stopped.empty()) {
        stopped = fmt::format("{} (refused from {})", refusal, peer);
        changed();
      }
    }
    co_return std::nullopt;
  }

  awaitable<void> serve(tcp::socket socket, std::string peer) {
    auto self = shared_from_this();
    clients.insert(&socket);
    const std::optional<int> admitted = co_await admit(socket, peer);
    if (!admitted || closed) {
      clients.erase(&socket);
      co_return;
    }
    try {
      for (;;) {
        std::array<std::byte, request_header_size> header{};
        co_await asio::async_read(socket, asio::buffer(header), use_awaitable);
        std::string error;
        const auto request = parse_request(header.data(), error);
        if (!request) {
          log().warn("store: rejected a connection from {}: {}", peer, error);
          break;
        }
        const auto command = request->command;
        const auto key_len = request->key_bytes;
        const auto value_len = request->value_bytes;
        std::string key(key_len, '\0');
        std::string value(value_len, '\0');
        std::array<asio::mutable_buffer, 2> body{asio::buffer(key), asio::buffer(value)};
        co_await asio::async_read(socket, body, use_awaitable);
        switch (command) {
          case Command::set:
          case Command::get:
          case Command::add: {
            auto answer = apply(data, command, key, std::move(value));
            if (answer.changed) changed();
            co_await reply(socket, answer.status, answer.payload);
            break;
          }
          case Command::wait: {
            const auto timeout = wait_timeout(value);
            if (!timeout) {
              co_await reply(socket, Status::bad_request, "wait takes an 8-byte timeout");
              break;
            }
            const auto deadline = std::chrono::steady_clock::now() + *timeout;
            const auto keys = split_lines(key);
            for (;;) {
              if (!stopped.empty()) {
                told_stopped.insert(*admitted);
                co_await reply(socket, Status::stopped, stopped);
                break;
              }
              std::vector<std::string> missing;
              for (const auto& k : keys) {
                if (!data.contains(k)) missing.push_back(k);
              }
              if (missing.empty()) {
                co_await reply(socket, Status::ok, {});
                break;
              }
              if (closed || std::chrono::steady_clock::now() >= deadline) {
                co_await reply(socket, Status::missing, join(missing));
                break;
              }
              asio::steady_timer timer(socket.get_executor(), deadline);
              waiters.insert(&timer);
              co_await timer.async_wait(no_throw);
              waiters.erase(&timer);
            }
            break;
          }
        }
      }
    } catch (const std::system_error&) {
      // The client went away: nothing to answer.
    }
    clients.erase(&socket);
  }
};

Server::Server(const asio::any_io_executor& executor, const tcp::endpoint& endpoint, Admission admission)
    : impl_(std::make_shared<Impl>(executor, endpoint, std::move(admission))) {
  asio::co_spawn(executor, impl_->accept_loop(), asio::detached);
}

Server::~Server() { close(); }

unsigned short Server::port() const { return impl_->acceptor.local_endpoint().port(); }

std::string Server::refusals() const { return impl_->refusals->summary(); }

bool Server::told_every_rank() const {
  for (int r = 0; r < impl_->admission.world_size; ++r) {
    if (!impl_->told_stopped.contains(r) && !impl_->refused_members.contains(r)) return false;
  }
  return true;
}

void Server::close() {
  asio::post(impl_->acceptor.get_executor(), [impl = impl_] {
    if (impl->closed) return;
    impl->closed = true;
    impl->refusals->say_suppressed();  // now: the Impl itself may outlive this in pending handlers
    std::error_code ignored;
    impl->acceptor.close(ignored);
    for (auto* socket : impl->clients) socket->close(ignored);
    impl->changed();
  });
}

// ---------------------------------------------------------------- client

awaitable<std::pair<Status, std::string>> Client::call(Command command, const std::string& key, const std::string& value) {
  std::array<std::byte, request_header_size> header{};
  le::put_u32(header.data(), magic);
  header[4] = static_cast<std::byte>(command);
  le::put_u32(header.data() + 8, static_cast<std::uint32_t>(key.size()));
  le::put_u64(header.data() + 12, value.size());
  std::array<asio::const_buffer, 3> request{asio::buffer(header), asio::buffer(key), asio::buffer(value)};
  co_await asio::async_write(socket_, request, use_awaitable);
  std::array<std::byte, response_header_size> response{};
  co_await asio::async_read(socket_, asio::buffer(response), use_awaitable);
  const auto length = le::get_u64(response.data() + 4);
  if (length > max_value_bytes) throw std::system_error(asio::error::message_size, "store: oversized reply");
  std::string payload(length, '\0');
  co_await asio::async_read(socket_, asio::buffer(payload), use_awaitable);
  co_return std::pair{static_cast<Status>(response[0]), std::move(payload)};
}

awaitable<void> Client::set(const std::string& key, const std::string& value) {
  auto [status, payload] = co_await call(Command::set, key, value);
  if (status != Status::ok) throw std::runtime_error("store: set failed: " + payload);
}

awaitable<std::optional<std::string>> Client::get(const std::string& key) {
  auto [status, payload] = co_await call(Command::get, key, {});
  if (status == Status::missing) co_return std::nullopt;
  if (status != Status::ok) throw std::runtime_error("store: get failed: " + payload);
  co_return std::optional<std::string>(std::move(payload));
}

awaitable<std::int64_t> Client::add(const std::string& key, std::int64_t delta) {
  std::string value(8, '\0');
  le::put_u64(reinterpret_cast<std::byte*>(value.data()), static_cast<std::uint64_t>(delta));
  auto [status, payload] = co_await call(Command::add, key, value);
  if (status != Status::ok || payload.size() != 8) throw std::runtime_error("store: add failed: " + payload);
  co_return static_cast<std::int64_t>(le::get_u64(reinterpret_cast<const std::byte*>(payload.data())));
}

awaitable<std::vector<std::string>> Client::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::string value(8, '\0');
  le::put_u64(reinterpret_cast<std::byte*>(value.data()), static_cast<std::uint64_t>(std::max<std::int64_t>(0, timeout.count())));
  auto [status, payload] = co_await call(Command::wait, join(keys), value);
  if (status == Status::ok) co_return std::vector<std::string>{};
  if (status == Status::missing) co_return split_lines(payload);
  if (status == Status::stopped) throw Stopped(payload);
  throw std::runtime_error("store: wait failed: " + payload);
}

}  // namespace weft::store
