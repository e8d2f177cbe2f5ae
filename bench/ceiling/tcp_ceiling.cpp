// What plain TCP on this host can do, without weft: the ceiling the collectives are measured against.
// Two processes (one per core, as weft-run places ranks), one thread each, nonblocking sockets:
//   tcp-ceiling pingpong ROLE [spin|block]   56-byte exchanges (a 48-byte header + 8 bytes), us each
//   tcp-ceiling stream ROLE K                2 GiB one way over K connections, GB/s
//   tcp-ceiling both ROLE K                  2 GiB each way at once over K connections, GB/s each way
// ROLE is 0 (listens, prints) or 1 (connects); run both, e.g. `tcp-ceiling stream 0 2 & tcp-ceiling stream 1 2`.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

constexpr unsigned short port = 45679;

std::vector<int> connect_pair(int role, int k) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::vector<int> fds;
  if (role == 0) {
    const int l = socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(l, 16) != 0) {
      perror("tcp-ceiling: listen");
      std::exit(1);
    }
    for (int i = 0; i < k; ++i) fds.push_back(accept(l, nullptr, nullptr));
    close(l);
  } else {
    for (int i = 0; i < k; ++i) {
      const int fd = socket(AF_INET, SOCK_STREAM, 0);
      for (int tries = 0; connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0; ++tries) {
        if (tries > 200) {
          perror("tcp-ceiling: connect");
          std::exit(1);
        }
        usleep(10000);
      }
      fds.push_back(fd);
    }
  }
  for (int fd : fds) {
    const int one = 1;
    const int size = 4 << 20;  // as weft's connections
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &size, sizeof size);
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &size, sizeof size);
    fcntl(fd, F_SETFL, O_NONBLOCK);
  }
  return fds;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void pingpong(int role, bool spin) {
  const int fd = connect_pair(role, 1)[0];
  char buf[56] = {};
  const int n = 20000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    (void)send(fd, buf, sizeof buf, 0);
    for (std::size_t got = 0; got < sizeof buf;) {
      if (!spin) {
        pollfd p{fd, POLLIN, 0};
        poll(&p, 1, -1);
      }
      const ssize_t r = recv(fd, buf + got, sizeof buf - got, 0);
      if (r > 0) got += static_cast<std::size_t>(r);
    }
  }
  if (role == 0) std::printf("pingpong (%s): %.2f us per exchange\n", spin ? "spinning" : "blocking", seconds_since(t0) * 1e6 / n);
}

void transfer(int role, int k, bool both_ways) {
  const auto fds = connect_pair(role, k);
  const std::size_t total = std::size_t{1} << 31;
  std::vector<char> out(256 << 10, 1), in(256 << 10);
  const bool sends = both_ways || role == 1;
  const bool receives = both_ways || role == 0;
  std::vector<std::size_t> to_send(fds.size(), sends ? total / fds.size() : 0);
  std::vector<std::size_t> to_recv(fds.size(), receives ? total / fds.size() : 0);
  std::vector<pollfd> polls(fds.size());
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    bool busy = false;
    for (std::size_t i = 0; i < fds.size(); ++i) {
      polls[i] = pollfd{fds[i], static_cast<short>((to_send[i] ? POLLOUT : 0) | (to_recv[i] ? POLLIN : 0)), 0};
      busy = busy || to_send[i] || to_recv[i];
    }
    if (!busy) break;
    poll(polls.data(), polls.size(), -1);
    for (std::size_t i = 0; i < fds.size(); ++i) {
      if ((polls[i].revents & POLLOUT) && to_send[i]) {
        const ssize_t r = send(fds[i], out.data(), std::min(out.size(), to_send[i]), 0);
        if (r > 0) to_send[i] -= static_cast<std::size_t>(r);
      }
      if ((polls[i].revents & POLLIN) && to_recv[i]) {
        const ssize_t r = recv(fds[i], in.data(), std::min(in.size(), to_recv[i]), 0);
        if (r > 0) to_recv[i] -= static_cast<std::size_t>(r);
      }
    }
  }
  if (role == 0) {
    std::printf("%s over %d connection(s): %.2f GB/s%s\n", both_ways ? "both ways" : "one way", k,
                static_cast<double>(total) / seconds_since(t0) / 1e9, both_ways ? " each way" : "");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: tcp-ceiling pingpong|stream|both ROLE [spin|block|K]\n");
    return 2;
  }
  const std::string mode = argv[1];
  const int role = std::atoi(argv[2]);
  cpu_set_t cpus;
  CPU_ZERO(&cpus);
  CPU_SET(role, &cpus);
  sched_setaffinity(0, sizeof cpus, &cpus);
  const std::string arg = argc > 3 ? argv[3] : "";
  if (mode == "pingpong") pingpong(role, arg != "block");
  else transfer(role, arg.empty() ? 1 : std::atoi(arg.c_str()), mode == "both");
  return 0;
}
