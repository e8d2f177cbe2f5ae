// An HTTP/1.1 server on Asio whose one io_context is also weft's loop (borrowed mode): no thread of
// weft's, and every collective awaited inside the server's own coroutines (weft::async_wait). Each rank
// is a server process; a client that wants a sum across the ranks asks every rank.
//
//   GET /ping                 "pong" at once, also while collectives are in flight
//   GET /sum?x=N[&n=E][&seq=K]  all_reduce of x over the ranks, answered "sum=S" by every rank. The K-th
//                             /sum of every rank are reduced together: requests carry K (0, 1, 2, ...) when
//                             they may reach a rank out of order; without it, arrival order counts. E: the
//                             all_reduce moves E elements of x (default 1), to make it take a while.
//   GET /threads              how many threads this process has (/proc/self/task)
//   GET /quit                 waits for every rank's /quit (a barrier), answers "bye", and the server ends
//
// Run: weft-run -n 2 -- example-http-server BASE_PORT     (rank r listens on 127.0.0.1:BASE_PORT + r)
// tests/system/http_server_test.py drives it with real HTTP clients.
#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <asio.hpp>
#include <weft/asio.hpp>
#include <weft/weft.hpp>

using asio::awaitable;
using asio::ip::tcp;
using asio::use_awaitable;

namespace {

int thread_count() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

// The value of `key` in a query string "a=1&b=2", or empty.
std::string query_value(std::string_view query, std::string_view key) {
  while (!query.empty()) {
    const auto amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    const auto eq = pair.find('=');
    if (eq != std::string_view::npos && pair.substr(0, eq) == key) return std::string(pair.substr(eq + 1));
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  return {};
}

// Hands out turns in sequence order: the K-th /sum calls its all_reduce after the (K-1)-th did, whatever
// order the requests arrived in. One thread (the io_context's), so no locks; a waiting turn sleeps on a
// timer that the previous turn cancels.
class Sequencer {
 public:
  explicit Sequencer(asio::any_io_executor executor) : executor_(std::move(executor)) {}

  /// The request's turn: the number it carries, else the next one not handed out yet.
  std::uint64_t assign(const std::string& given) {
    if (given.empty()) return issued_++;
    const std::uint64_t k = std::strtoull(given.c_str(), nullptr, 10);
    issued_ = std::max(issued_, k + 1);
    return k;
  }

  awaitable<void> wait_for_turn(std::uint64_t k) {
    if (k == next_) co_return;
    asio::steady_timer timer(executor_, asio::steady_timer::time_point::max());
    waiting_[k] = &timer;
    std::error_code ec;
    co_await timer.async_wait(asio::redirect_error(use_awaitable, ec));  // cancelled: our turn
    waiting_.erase(k);
  }

  void done(std::uint64_t k) {
    next_ = k + 1;
    if (auto it = waiting_.find(next_); it != waiting_.end()) it->second->cancel();
  }

 private:
  asio::any_io_executor executor_;
  std::uint64_t next_ = 0;
  std::uint64_t issued_ = 0;
  std::map<std::uint64_t, asio::steady_timer*> waiting_;
};

struct Server {
  weft::Group group;
  Sequencer sequencer;
  tcp::acceptor acceptor;
  int quits = 0;  // /quit requests seen
};

std::string response(int status, std::string_view reason, const std::string& body) {
  return "HTTP/1.1 " + std::to_string(status) + " " + std::string(reason) +
         "\r\nContent-Type: text/plain\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\nConnection: close\r\n\r\n" + body;
}

awaitable<std::string> sum(Server& s, std::string_view query) {
  const std::string x_text = query_value(query, "x");
  const std::string n_text = query_value(query, "n");
  const std::string seq_text = query_value(query, "seq");
  if (x_text.empty()) co_return response(400, "Bad Request", "missing x\n");
  const std::int64_t x = std::atoll(x_text.c_str());
  const std::size_t n = n_text.empty() ? 1 : std::strtoull(n_text.c_str(), nullptr, 10);
  if (n == 0 || n > (std::size_t{64} << 20)) co_return response(400, "Bad Request", "n must be 1 to 67108864\n");
  const std::uint64_t k = s.sequencer.assign(seq_text);
  std::vector<std::int64_t> values(n, x);
  co_await s.sequencer.wait_for_turn(k);
  // The other ranks' k-th /sum may come much later: no deadline on this wait (a lost peer still ends it).
  weft::Future<void> reduced = s.group.without_deadline().all_reduce(values);
  s.sequencer.done(k);
  try {
    co_await weft::async_wait(std::move(reduced), use_awaitable);
  } catch (const weft::Error& e) {
    co_return response(500, "Internal Server Error", std::string(e.what()) + "\n");
  }
  co_return response(200, "OK", "sum=" + std::to_string(values[0]) + "\n");
}

awaitable<void> serve(Server& s, tcp::socket socket) {
  try {
    std::string request;
    co_await asio::async_read_until(socket, asio::dynamic_buffer(request, 16384), "\r\n\r\n", use_awaitable);
    // "GET /path?query HTTP/1.1"
    const auto first_space = request.find(' ');
    const auto second_space = request.find(' ', first_space + 1);
    const std::string method = request.substr(0, first_space);
    const std::string target = request.substr(first_space + 1, second_space - first_space - 1);
    const auto question = target.find('?');
    const std::string path = target.substr(0, question);
    const std::string query = question == std::string::npos ? "" : target.substr(question + 1);
    std::string reply;
    bool quit = false;
    if (method != "GET") {
      reply = response(405, "Method Not Allowed", "GET only\n");
    } else if (path == "/ping") {
      reply = response(200, "OK", "pong\n");
    } else if (path == "/sum") {
      reply = co_await sum(s, query);
    } else if (path == "/threads") {
      reply = response(200, "OK", std::to_string(thread_count()) + "\n");
    } else if (path == "/quit") {
      co_await weft::async_wait(s.group.without_deadline().barrier(), use_awaitable);
      reply = response(200, "OK", "bye\n");
      quit = true;
    } else {
      reply = response(404, "Not Found", "no such path\n");
    }
    co_await asio::async_write(socket, asio::buffer(reply), use_awaitable);
    socket.shutdown(tcp::socket::shutdown_send);
    if (quit && ++s.quits == 1) {
      // Stop accepting; the Group goes when the last coroutine using it ends (the accept loop's Server).
      s.acceptor.close();
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "http: %s\n", e.what());
  }
}

awaitable<void> run(weft::Loop& loop, unsigned short base_port) {
  auto executor = co_await asio::this_coro::executor;
  // The Group is created without blocking: its Future is awaited like any other.
  weft::Group group = co_await weft::async_wait(weft::Group::create(loop), use_awaitable);
  const auto port = static_cast<unsigned short>(base_port + group.rank());
  auto server = std::make_shared<Server>(Server{std::move(group), Sequencer(executor),
                                                tcp::acceptor(executor, {asio::ip::make_address("127.0.0.1"), port})});
  std::printf("rank %d of %d: listening on 127.0.0.1:%u (%d threads)\n", server->group.rank(), server->group.size(), port,
              thread_count());
  std::fflush(stdout);
  for (;;) {
    std::error_code ec;
    tcp::socket socket = co_await server->acceptor.async_accept(asio::redirect_error(use_awaitable, ec));
    if (ec) break;  // closed by /quit
    asio::co_spawn(executor, [server, socket = std::move(socket)]() mutable { return serve(*server, std::move(socket)); },
                   asio::detached);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const unsigned short base_port = static_cast<unsigned short>(argc > 1 ? std::atoi(argv[1]) : 8080);
  asio::io_context io(1);
  weft::Loop loop(io);  // borrowed: weft's handlers run inside io.run() below, on this thread
  bool failed = false;
  asio::co_spawn(io, run(loop, base_port), [&](std::exception_ptr e) {
    if (!e) return;
    failed = true;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& error) {
      std::fprintf(stderr, "http server: %s\n", error.what());
    }
  });
  io.run();
  std::printf("server ended\n");
  return failed ? 1 : 0;
}
