#include "src/group/store.hpp"

#include <set>
#include <unordered_map>

#include <asio/experimental/as_tuple.hpp>
#include <fmt/format.h>

#include "src/core/log.hpp"
#include "transports/tcp/wire.hpp"

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

}  // namespace

struct Server::Impl : std::enable_shared_from_this<Impl> {
  explicit Impl(asio::io_context& io, const tcp::endpoint& endpoint) : acceptor(io) {
    acceptor.open(endpoint.protocol());
    acceptor.set_option(tcp::acceptor::reuse_address(true));
    if (endpoint.address().is_v6()) acceptor.set_option(asio::ip::v6_only(true));
    acceptor.bind(endpoint);
    acceptor.listen();
  }

  tcp::acceptor acceptor;
  std::unordered_map<std::string, std::string> data;
  std::set<asio::steady_timer*> waiters;  // WAIT requests asleep until the next change
  std::set<tcp::socket*> clients;
  bool closed = false;

  void changed() {
    for (auto* timer : waiters) timer->cancel();
  }

  awaitable<void> accept_loop() {
    auto self = shared_from_this();
    while (!closed) {
      auto [ec, socket] = co_await acceptor.async_accept(no_throw);
      if (ec) {
        if (closed || ec == asio::error::operation_aborted) co_return;
        continue;
      }
      socket.set_option(tcp::no_delay(true));
      asio::co_spawn(acceptor.get_executor(), serve(std::move(socket)), asio::detached);
    }
  }

  awaitable<void> reply(tcp::socket& socket, Status status, const std::string& payload) {
    std::array<std::byte, response_header_size> header{};
    header[0] = static_cast<std::byte>(status);
    wire::put_u64(header.data() + 4, payload.size());
    std::array<asio::const_buffer, 2> buffers{asio::buffer(header), asio::buffer(payload)};
    co_await asio::async_write(socket, buffers, use_awaitable);
  }

  awaitable<void> serve(tcp::socket socket) {
    auto self = shared_from_this();
    clients.insert(&socket);
    std::string peer;
    {
      std::error_code ec;
      auto ep = socket.remote_endpoint(ec);
      peer = ec ? std::string("?") : fmt::format("{}:{}", ep.address().to_string(), ep.port());
    }
    try {
      for (;;) {
        std::array<std::byte, request_header_size> header{};
        co_await asio::async_read(socket, asio::buffer(header), use_awaitable);
        const auto m = wire::get_u32(header.data());
        const auto command = static_cast<Command>(header[4]);
        const auto key_len = wire::get_u32(header.data() + 8);
        const auto value_len = wire::get_u64(header.data() + 12);
        if (m != magic || key_len > max_key_bytes || value_len > max_value_bytes) {
          log().warn("store: rejected a connection from {}: {}", peer,
                     m != magic ? fmt::format("bad magic 0x{:08x}", m)
                                : fmt::format("key of {} or value of {} bytes is over the limit", key_len, value_len));
          break;
        }
        std::string key(key_len, '\0');
        std::string value(value_len, '\0');
        std::array<asio::mutable_buffer, 2> body{asio::buffer(key), asio::buffer(value)};
        co_await asio::async_read(socket, body, use_awaitable);
        switch (command) {
          case Command::set:
            data[key] = std::move(value);
            changed();
            co_await reply(socket, Status::ok, {});
            break;
          case Command::get: {
            auto it = data.find(key);
            if (it == data.end()) {
              co_await reply(socket, Status::missing, {});
            } else {
              co_await reply(socket, Status::ok, it->second);
            }
            break;
          }
          case Command::add: {
            if (value.size() != 8) {
              co_await reply(socket, Status::bad_request, "add takes an 8-byte integer");
              break;
            }
            std::int64_t current = 0;
            if (auto it = data.find(key); it != data.end() && it->second.size() == 8) {
              current = static_cast<std::int64_t>(wire::get_u64(reinterpret_cast<const std::byte*>(it->second.data())));
            }
            current += static_cast<std::int64_t>(wire::get_u64(reinterpret_cast<const std::byte*>(value.data())));
            std::string stored(8, '\0');
            wire::put_u64(reinterpret_cast<std::byte*>(stored.data()), static_cast<std::uint64_t>(current));
            data[key] = stored;
            changed();
            co_await reply(socket, Status::ok, stored);
            break;
          }
          case Command::wait: {
            if (value.size() != 8) {
              co_await reply(socket, Status::bad_request, "wait takes an 8-byte timeout");
              break;
            }
            const auto timeout = std::chrono::milliseconds(wire::get_u64(reinterpret_cast<const std::byte*>(value.data())));
            const auto deadline = std::chrono::steady_clock::now() + timeout;
            const auto keys = split_lines(key);
            for (;;) {
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
          default:
            log().warn("store: rejected a connection from {}: unknown command {}", peer, static_cast<int>(command));
            co_await reply(socket, Status::bad_request, "unknown command");
            clients.erase(&socket);
            co_return;
        }
      }
    } catch (const std::system_error&) {
      // The client went away: nothing to answer.
    }
    clients.erase(&socket);
  }
};

Server::Server(asio::io_context& io, const tcp::endpoint& endpoint) : impl_(std::make_shared<Impl>(io, endpoint)) {
  asio::co_spawn(io, impl_->accept_loop(), asio::detached);
}

Server::~Server() { close(); }

unsigned short Server::port() const { return impl_->acceptor.local_endpoint().port(); }

void Server::close() {
  asio::post(impl_->acceptor.get_executor(), [impl = impl_] {
    if (impl->closed) return;
    impl->closed = true;
    std::error_code ignored;
    impl->acceptor.close(ignored);
    for (auto* socket : impl->clients) socket->close(ignored);
    impl->changed();
  });
}

// ---------------------------------------------------------------- client

awaitable<std::pair<Status, std::string>> Client::call(Command command, const std::string& key, const std::string& value) {
  std::array<std::byte, request_header_size> header{};
  wire::put_u32(header.data(), magic);
  header[4] = static_cast<std::byte>(command);
  wire::put_u32(header.data() + 8, static_cast<std::uint32_t>(key.size()));
  wire::put_u64(header.data() + 12, value.size());
  std::array<asio::const_buffer, 3> request{asio::buffer(header), asio::buffer(key), asio::buffer(value)};
  co_await asio::async_write(socket_, request, use_awaitable);
  std::array<std::byte, response_header_size> response{};
  co_await asio::async_read(socket_, asio::buffer(response), use_awaitable);
  const auto length = wire::get_u64(response.data() + 4);
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
  wire::put_u64(reinterpret_cast<std::byte*>(value.data()), static_cast<std::uint64_t>(delta));
  auto [status, payload] = co_await call(Command::add, key, value);
  if (status != Status::ok || payload.size() != 8) throw std::runtime_error("store: add failed: " + payload);
  co_return static_cast<std::int64_t>(wire::get_u64(reinterpret_cast<const std::byte*>(payload.data())));
}

awaitable<std::vector<std::string>> Client::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::string value(8, '\0');
  wire::put_u64(reinterpret_cast<std::byte*>(value.data()), static_cast<std::uint64_t>(std::max<std::int64_t>(0, timeout.count())));
  auto [status, payload] = co_await call(Command::wait, join(keys), value);
  if (status == Status::ok) co_return std::vector<std::string>{};
  if (status == Status::missing) co_return split_lines(payload);
  throw std::runtime_error("store: wait failed: " + payload);
}

}  // namespace weft::store
