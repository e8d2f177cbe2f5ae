// What io_uring on this host can do for weft's small exchanges, without weft: the ways a loop can wait
// for a receive, measured side by side (docs/DESIGN.md, "io_uring"). Two processes, one thread each; each
// round both send 56 bytes (a 48-byte header + 8) and wait for the other's 56; a receive is always
// posted before the data comes, as weft's reader has one.
//   uring-ceiling WAIT ROLE [PORT]
// WAIT is one of
//   peek       plain ring, spin on the completion queue without system calls
//   enter      plain ring, spin on io_uring_enter(GETEVENTS) (what a loop polling with syscalls does)
//   sleep      plain ring, sleep in io_uring_enter until a completion (the loop driven by the ring)
//   epoll      plain ring, sleep in epoll on the ring's eventfd (the ring's eventfd watched by the loop)
//   coop       COOP_TASKRUN | TASKRUN_FLAG, spin, entering the kernel only when the flag says so
//   defer      SINGLE_ISSUER | DEFER_TASKRUN, spin on io_uring_get_events
//   multishot  as defer, the receive multishot into a provided buffer ring
// ROLE is 0 (listens, prints) or 1 (connects); run both, e.g. `uring-ceiling defer 0 & uring-ceiling defer 1`.
#include <arpa/inet.h>
#include <liburing.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

int connect_pair(int role, unsigned short port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  int fd = -1;
  if (role == 0) {
    const int l = socket(AF_INET, SOCK_STREAM, 0);
    const int one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(l, 1) != 0) {
      perror("uring-ceiling: listen");
      std::exit(1);
    }
    fd = accept(l, nullptr, nullptr);
    close(l);
  } else {
    for (int tries = 0;; ++tries) {
      fd = socket(AF_INET, SOCK_STREAM, 0);
      if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) break;
      close(fd);
      if (tries > 200) {
        perror("uring-ceiling: connect");
        std::exit(1);
      }
      usleep(10000);
    }
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: uring-ceiling peek|enter|sleep|epoll|coop|defer|multishot ROLE [PORT]\n");
    return 2;
  }
  const std::string wait = argv[1];
  const int role = std::atoi(argv[2]);
  const auto port = static_cast<unsigned short>(argc > 3 ? std::atoi(argv[3]) : 45681);
  const bool defer = wait == "defer" || wait == "multishot";
  const bool multishot = wait == "multishot";
  const bool coop = wait == "coop";
  const int fd = connect_pair(role, port);

  io_uring ring;
  const unsigned flags = defer  ? IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN
                         : coop ? IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG
                                : 0;
  if (const int rc = io_uring_queue_init(64, &ring, flags); rc < 0) {
    std::fprintf(stderr, "uring-ceiling: io_uring_queue_init: %s\n", std::strerror(-rc));
    return 1;
  }
  constexpr unsigned buffers = 64, buffer_bytes = 4096;
  io_uring_buf_ring* buffer_ring = nullptr;
  static char pool[buffers * buffer_bytes];
  if (multishot) {
    buffer_ring = static_cast<io_uring_buf_ring*>(
        mmap(nullptr, buffers * sizeof(io_uring_buf), PROT_READ | PROT_WRITE, MAP_ANONYMOUS | MAP_PRIVATE, -1, 0));
    io_uring_buf_reg reg{};
    reg.ring_addr = reinterpret_cast<unsigned long>(buffer_ring);
    reg.ring_entries = buffers;
    reg.bgid = 1;
    if (const int rc = io_uring_register_buf_ring(&ring, &reg, 0); rc < 0) {
      std::fprintf(stderr, "uring-ceiling: io_uring_register_buf_ring: %s\n", std::strerror(-rc));
      return 1;
    }
    io_uring_buf_ring_init(buffer_ring);
    for (unsigned i = 0; i < buffers; ++i) {
      io_uring_buf_ring_add(buffer_ring, pool + i * buffer_bytes, buffer_bytes, i, io_uring_buf_ring_mask(buffers), i);
    }
    io_uring_buf_ring_advance(buffer_ring, buffers);
  }
  const int event_fd = eventfd(0, EFD_NONBLOCK);
  const int epoll_fd = epoll_create1(0);
  if (wait == "epoll") {
    io_uring_register_eventfd(&ring, event_fd);
    epoll_event ev{};
    ev.events = EPOLLIN;
    epoll_ctl(epoll_fd, EPOLL_CTL_ADD, event_fd, &ev);
  }

  char out[56] = {};
  static char in[4096];
  auto post_receive = [&] {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (multishot) {
      io_uring_prep_recv_multishot(sqe, fd, nullptr, 0, 0);
      sqe->flags |= IOSQE_BUFFER_SELECT;
      sqe->buf_group = 1;
    } else {
      io_uring_prep_recv(sqe, fd, in, sizeof in, 0);
    }
    io_uring_sqe_set_data64(sqe, 2);
    io_uring_submit(&ring);
  };
  post_receive();

  const int rounds = 20000;
  int received = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < rounds; ++i) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    io_uring_prep_send(sqe, fd, out, sizeof out, MSG_NOSIGNAL);
    io_uring_sqe_set_data64(sqe, 1);
    io_uring_submit(&ring);
    bool sent = false;
    while (received < 56 || !sent) {
      io_uring_cqe* cqe = nullptr;
      if (defer || wait == "enter") {
        io_uring_get_events(&ring);
      } else if (coop && (IO_URING_READ_ONCE(*ring.sq.kflags) & IORING_SQ_TASKRUN)) {
        io_uring_get_events(&ring);
      } else if (wait == "sleep") {
        io_uring_wait_cqe(&ring, &cqe);
      } else if (wait == "epoll" && io_uring_peek_cqe(&ring, &cqe) != 0) {
        epoll_event e;
        epoll_wait(epoll_fd, &e, 1, -1);
        std::uint64_t count;
        [[maybe_unused]] auto n = read(event_fd, &count, sizeof count);
      }
      while (io_uring_peek_cqe(&ring, &cqe) == 0) {
        const int res = cqe->res;
        const auto what = cqe->user_data;
        const unsigned f = cqe->flags;
        io_uring_cqe_seen(&ring, cqe);
        if (what == 1) {
          sent = true;
          continue;
        }
        if (res <= 0) {
          std::fprintf(stderr, "uring-ceiling: receive: %s\n", res == 0 ? "end of stream" : std::strerror(-res));
          return 1;
        }
        received += res;
        if (multishot) {
          const unsigned id = f >> IORING_CQE_BUFFER_SHIFT;
          io_uring_buf_ring_add(buffer_ring, pool + id * buffer_bytes, buffer_bytes, id, io_uring_buf_ring_mask(buffers), 0);
          io_uring_buf_ring_advance(buffer_ring, 1);
          if (!(f & IORING_CQE_F_MORE)) post_receive();
        } else {
          post_receive();
        }
      }
    }
    received -= 56;
  }
  const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / rounds;
  if (role == 0) std::printf("%-10s %.2f us per exchange\n", wait.c_str(), us);
  return 0;
}
