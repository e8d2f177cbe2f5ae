#include "transports/shm/segment.hpp"

#include "transports/shm/ring.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace weft::shm {
namespace {
constexpr int required_seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
}

Segment Segment::create(std::size_t bytes, const char* name) {
  Segment s;
  s.fd_ = ::memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (s.fd_ < 0) throw std::system_error(errno, std::generic_category(), "memfd_create");
  if (::ftruncate(s.fd_, static_cast<off_t>(bytes)) != 0) throw std::system_error(errno, std::generic_category(), "ftruncate");
  if (::fcntl(s.fd_, F_ADD_SEALS, required_seals) != 0) throw std::system_error(errno, std::generic_category(), "F_ADD_SEALS");
  s.data_ = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, s.fd_, 0);
  if (s.data_ == MAP_FAILED) {
    s.data_ = nullptr;
    throw std::system_error(errno, std::generic_category(), "mmap");
  }
  s.size_ = bytes;
  return s;
}

Segment Segment::adopt(int fd, std::size_t min_bytes) {
  Segment s;
  s.fd_ = fd;
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0 || (seals & required_seals) != required_seals) {
    throw std::runtime_error("the peer's segment is not a sealed memfd (it could be resized under the mapping)");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || st.st_size < 0 || static_cast<std::size_t>(st.st_size) < min_bytes) {
    throw std::runtime_error("the peer's segment is smaller than a ring needs");
  }
  s.size_ = static_cast<std::size_t>(st.st_size);
  s.data_ = ::mmap(nullptr, s.size_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (s.data_ == MAP_FAILED) {
    s.data_ = nullptr;
    throw std::runtime_error(std::string("cannot map the peer's segment: ") + std::strerror(errno));
  }
  return s;
}

Segment::~Segment() { reset(); }

Segment::Segment(Segment&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void Segment::reset() noexcept {
  if (data_) ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
  data_ = nullptr;
  fd_ = -1;
  size_ = 0;
}

Segment make_ring(std::size_t capacity) {
  unsigned log2 = 0;
  while ((std::size_t{1} << log2) < capacity) ++log2;
  Segment s = Segment::create(ring_segment_bytes(std::size_t{1} << log2), "weft-ring");
  auto* ring = new (s.data()) RingControl();
  ring->capacity_log2 = log2;
  ring->version = ring_version;
  ring->magic = ring_magic;
  // The reader's first read of every page, while nobody else has the segment (ring.hpp, touch_pages; the
  // writer touches its own mapping when its stream is made).
  touch_pages(ring->data, std::size_t{1} << log2, static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)), false);
  return s;
}

Segment adopt_ring(int fd) {
  Segment s = Segment::adopt(fd, sizeof(RingControl));
  const auto* ring = static_cast<const RingControl*>(s.data());
  if (ring->magic != ring_magic || ring->version != ring_version) {
    throw std::runtime_error("the peer's segment is not a weft ring of this version");
  }
  // (The claim is read once: ring_capacity is what the streams use afterwards.)
  const std::uint32_t log2 = __atomic_load_n(&ring->capacity_log2, __ATOMIC_RELAXED);
  if (log2 > 40 || ring_segment_bytes(std::size_t{1} << log2) != s.size()) {
    throw std::runtime_error("the peer's ring claims " + (log2 > 40 ? std::string("2^") + std::to_string(log2) : std::to_string(std::size_t{1} << log2)) +
                             " bytes, but its segment holds " + std::to_string(ring_capacity(s)));
  }
  return s;
}

std::size_t ring_capacity(const Segment& ring) noexcept {
  return ring.size() > ring_segment_bytes(0) ? ring.size() - ring_segment_bytes(0) : 0;
}

namespace {
// One byte of payload with room for `count` descriptors beside it: what send_fds and receive_fds pass.
struct FdMessage {
  char byte = 'w';
  iovec iov{&byte, 1};
  std::vector<char> control;
  msghdr msg{};
  explicit FdMessage(std::size_t count) : control(CMSG_SPACE(sizeof(int) * count)) {
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
  }
  FdMessage(const FdMessage&) = delete;
  FdMessage& operator=(const FdMessage&) = delete;
};
}  // namespace

bool send_fds(int socket, const int* fds, std::size_t count) {
  FdMessage message(count);
  msghdr& msg = message.msg;
  cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
  cmsg->cmsg_level = SOL_SOCKET;
  cmsg->cmsg_type = SCM_RIGHTS;
  cmsg->cmsg_len = CMSG_LEN(sizeof(int) * count);
  std::memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * count);
  for (;;) {
    const ssize_t n = ::sendmsg(socket, &msg, MSG_NOSIGNAL);
    if (n == 1) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{socket, POLLOUT, 0};
      if (::poll(&p, 1, 1000) <= 0) return false;
      continue;
    }
    return false;
  }
}

int receive_fds(int socket, int* fds, std::size_t count, int timeout_ms) {
  for (std::size_t i = 0; i < count; ++i) fds[i] = -1;
  pollfd p{socket, POLLIN, 0};
  if (::poll(&p, 1, timeout_ms) <= 0) return -1;
  FdMessage message(count);
  msghdr& msg = message.msg;
  ssize_t n;
  do {
    n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n != 1) return -1;
  int got = 0;
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t n_fds = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < n_fds; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(cmsg) + i * sizeof(int), sizeof(int));
      if (static_cast<std::size_t>(got) < count) {
        fds[got++] = fd;
      } else {
        ::close(fd);
      }
    }
  }
  if (msg.msg_flags & MSG_CTRUNC) return -1;
  return got;
}

}  // namespace weft::shm
