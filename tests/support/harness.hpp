#pragma once
// Multi-rank test harness: ranks as threads in one process (Gloo's spawn harness), each with its own Loop
// and its own TCP connections over loopback. Catch2 assertions are not thread-safe, so rank bodies
// throw (check()) and the harness rethrows the first failure on the test's thread.
#include <cstdlib>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <chrono>
#include <exception>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <weft/weft.hpp>

namespace weft::test {

/// A TCP port nobody listens on right now (bind to 0, read it, close).
inline unsigned short free_port(bool v6 = false) {
  const int fd = ::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM, 0);
  unsigned short port = 0;
  if (v6) {
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_loopback;
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin6_port);
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
    socklen_t len = sizeof a;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

/// Checks made by rank threads; a test asserts that some ran, so that it cannot pass by checking nothing.
inline std::atomic<long> checks_made{0};

inline void check(bool ok, const std::string& what) {
  checks_made.fetch_add(1, std::memory_order_relaxed);
  if (!ok) {
    // Said at once too: the throw unwinds the rank's frames, and a destructor there that waits (freeing
    // device memory waits for the device) may hang the test before run_ranks could report it.
    std::fprintf(stderr, "check failed: %s\n", what.c_str());
    throw std::runtime_error(what);
  }
}

/// Waits for `f`; whether it ended cancelled (a CancelledError, or any weft::Error that says cancelled).
inline bool ends_cancelled(Future<void>& f) {
  try {
    f.get();
    return false;
  } catch (const Error& e) {
    return e.errc() == Errc::cancelled;
  }
}

struct RankFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Loops made by run_ranks let the waiting thread drive them (Loop::Options::caller_drives, the
/// default); one test turns it off to run everything on the progress threads alone.
inline bool harness_caller_drives = true;

/// What the suites' ranks share unless told otherwise: a store on a free port, a 30 s bootstrap, and
/// the transport WEFT_TRANSPORT names (meson runs each suite over tcp, uring and shm); unset, tcp, as
/// before the library's default became auto: the suites' shm runs are the ones that say so, and
/// tests/system/processes.sh launcher-default checks the default itself.
inline Options suite_options(Options base = {}) {
  if (base.store.empty()) base.store = "127.0.0.1:" + std::to_string(free_port());
  if (base.bootstrap_timeout == Options{}.bootstrap_timeout) base.bootstrap_timeout = std::chrono::seconds(30);
  if (base.transport.empty() && !std::getenv("WEFT_TRANSPORT")) base.transport = "tcp";
  return base;
}

/// Runs `body(group)` on `n` ranks as threads and rethrows the first failure, prefixed with its rank.
inline void run_ranks(int n, const std::function<void(Group&)>& body, Options base = {}) {
  base = suite_options(std::move(base));
  std::vector<std::string> errors(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        // Ranks oversubscribe the cores here: a spinning progress thread would starve the others.
        Loop loop(Loop::Options{std::chrono::microseconds(0), harness_caller_drives});
        Options options = base;
        options.rank = r;
        options.world_size = n;
        Group group = Group::create(loop, options).get();
        body(group);
      } catch (const std::exception& e) {
        errors[static_cast<std::size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  // The first failure leads (tests match on it); the others follow, since the first to fail is not
  // always the first in rank order (a rank that fails and leaves makes the ranks waiting on it fail).
  std::string what;
  for (int r = 0; r < n; ++r) {
    if (errors[static_cast<std::size_t>(r)].empty()) continue;
    what += (what.empty() ? "" : "\n  also ") + ("rank " + std::to_string(r) + ": " + errors[static_cast<std::size_t>(r)]);
  }
  if (!what.empty()) throw RankFailure(what);
}

}  // namespace weft::test
