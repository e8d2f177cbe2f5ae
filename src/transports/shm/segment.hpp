#pragma once
// Shared-memory segments that leave nothing behind: a memfd (no name in /dev/shm, gone with the last
// descriptor or mapping, so a crash leaves nothing), sealed against resizing before it is passed on, so
// that a peer cannot shrink it under a mapping (no SIGBUS from a dead or hostile peer). Passed to the
// peer over a unix-domain socket (SCM_RIGHTS).
#include <cstddef>
#include <string>

namespace weft::shm {

class Segment {
 public:
  Segment() = default;
  /// A new segment of `bytes`, zeroed, sealed (no shrink, no grow, no more seals), mapped read-write.
  /// Both mappings (here and the peer's adopt) are populated at once (MAP_POPULATE): the first megabytes
  /// through a fresh ring otherwise fault page by page (bench/RESULTS.md, "first use"). (Where a
  /// hypervisor charges a process's first access to each page on top, both sides of a ring touch its
  /// pages at set-up, the reader in make_ring and the writer when its stream is made: ring.hpp,
  /// touch_pages.)
  /// Throws std::system_error where memfd_create or mmap fails.
  static Segment create(std::size_t bytes, const char* name);
  /// Maps a segment received from a peer, after checking that it is a sealed memfd of at least
  /// `min_bytes`. Takes over `fd`. Throws std::runtime_error naming what is wrong.
  static Segment adopt(int fd, std::size_t min_bytes);
  ~Segment();
  Segment(Segment&& other) noexcept;
  Segment& operator=(Segment&& other) noexcept;

  void* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  int fd() const noexcept { return fd_; }
  explicit operator bool() const noexcept { return data_ != nullptr; }

 private:
  void reset() noexcept;
  int fd_ = -1;
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

/// A segment holding one ring of `capacity` bytes (a power of two), its control initialised and its pages
/// read once through this mapping (ring.hpp, touch_pages): this rank will read it, the peer it is sent to
/// will write it.
Segment make_ring(std::size_t capacity);
/// Maps a ring segment received from a peer (adopt) and checks its control: magic, version, and a
/// capacity that is the one the segment's size holds. Takes over `fd`. Throws std::runtime_error naming
/// what is wrong.
Segment adopt_ring(int fd);
/// The bytes of the ring in a segment from make_ring or adopt_ring, from the segment's size (sealed:
/// neither side can change it), not from the control's word, which the peer can rewrite at any time.
std::size_t ring_capacity(const Segment& ring) noexcept;

/// Sends `fds` (with one byte of payload) over the connected unix socket `socket`; false on failure.
bool send_fds(int socket, const int* fds, std::size_t count);
/// Receives up to `count` descriptors sent by send_fds into `fds` (set to -1 where none came); blocks at
/// most `timeout_ms`. Returns how many came, or -1 on failure or end of stream.
int receive_fds(int socket, int* fds, std::size_t count, int timeout_ms);

}  // namespace weft::shm
