#pragma once
// The io_uring backend of Stream (liburing). One ring per transport; its completions reach the weft loop
// through an eventfd the loop watches (Loop::watch_readable), so no thread of its own. Submissions are
// batched: queued SQEs go to the kernel in one io_uring_enter per loop turn. Small frames arrive through
// one multishot receive per connection into a ring of provided buffers; large payloads are received
// straight into the caller's memory. Where the loop runs on one thread only, the ring is set up for a
// single issuer with deferred task work, and the loop's busy-poll runs that work (docs/DESIGN.md).
#include <liburing.h>

#include <cstdint>
#include <deque>
#include <initializer_list>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include <asio.hpp>

#include "transports/framed/stream.hpp"
#include "weft/loop.hpp"

namespace weft {

class UringRing;

/// One request in flight on a ring: `complete` runs on the loop thread with the CQE's result.
struct UringRequest {
  virtual void complete(int result, std::uint32_t flags) = 0;
  bool in_kernel = false;  // its SQE was prepared and its CQE not seen yet

 protected:
  ~UringRequest() = default;
};

class UringRing : public std::enable_shared_from_this<UringRing> {
 public:
  /// Sets up a ring and registers its eventfd with `loop`. Returns null and fills `why` when io_uring
  /// cannot be used here (disabled by sysctl, blocked by seccomp, too old, or WEFT_URING_SETUP_FAIL=1,
  /// the tests' way to force the fallback).
  static std::shared_ptr<UringRing> create(Loop& loop, std::string& why);
  /// Whether create() could make a ring here (a small ring is set up and torn down); `why` if not.
  static bool available(std::string& why);
  ~UringRing();
  UringRing(const UringRing&) = delete;
  UringRing& operator=(const UringRing&) = delete;

  /// An SQE to fill, with user_data set to `request`; it goes to the kernel at the end of this loop turn.
  io_uring_sqe* prepare(UringRequest* request);
  /// Asks the kernel to cancel `request` (at the end of this loop turn); the request's own completion
  /// follows.
  void cancel(UringRequest* request);
  Loop& loop() noexcept { return loop_; }
  /// Submits what was prepared (one io_uring_enter).
  void flush();
  /// Runs the completions that arrived.
  void reap();
  /// Returns once the kernel is done with `a` and `b` (either may be null): they are cancelled and their
  /// completions awaited (at most a second), so that their buffers may be freed. Their completions, and
  /// any others seen meanwhile, run at the next reap, from the loop's queue.
  void settle(std::initializer_list<UringRequest*> requests);
  /// Whether multishot receives fill provided buffers (set up, and supported by the kernel).
  bool provided_buffers() const noexcept { return buffer_ring_ != nullptr && !multishot_off_; }
  /// Registered staging: slots of `staging_bytes` in one buffer registered with the ring (fixed buffer
  /// 0), for the transports' read-ahead buffers, read with READ_FIXED. Null when none is left or
  /// registration failed (RLIMIT_MEMLOCK, WEFT_URING_REGISTERED=0).
  static constexpr std::size_t staging_bytes = 4096;
  static constexpr std::size_t staging_slots = 256;
  std::byte* take_staging();
  void give_back_staging(std::byte* slot);
  /// The registered buffer's index when [data, data + size) lies inside it, else -1.
  int fixed_index(const void* data, std::size_t size) const noexcept;
  /// The ring's settings in words, for the log (a test reads them there).
  std::string settings() const;

  // The provided-buffer ring (buffer group 0) that multishot receives fill: `buffer_bytes` each.
  static constexpr std::uint32_t buffer_count = 128;
  static constexpr std::uint32_t buffer_bytes = 4096;
  static constexpr std::uint16_t buffer_group = 0;
  const std::byte* buffer(std::uint16_t id) const noexcept { return buffers_.get() + std::size_t{id} * buffer_bytes; }
  /// Hands buffer `id` back to the kernel once its bytes were taken.
  void recycle(std::uint16_t id);
  /// Multishot receive turned out unsupported (its first completion said EINVAL): direct receives only.
  void multishot_unsupported();
  /// Sends of at least this many bytes use SENDMSG_ZC (the kernel sends from the caller's pages and
  /// says when it is done with them); 0: never (no SENDMSG_ZC in this kernel, or off). Default 64 KiB,
  /// but off towards a loopback peer, where the kernel copies anyway and holds the notification until
  /// the receiver has read (2 MiB all_reduce 10 ms instead of 0.8 ms, bench/RESULTS.md).
  /// WEFT_URING_ZC_BYTES sets it for every peer (0 turns zero-copy off).
  std::size_t zero_copy_bytes(bool loopback_peer) const noexcept {
    return loopback_peer && !zero_copy_set_ ? 0 : zero_copy_bytes_;
  }

 private:
  explicit UringRing(Loop& loop) : loop_(loop) {}
  void set_up_buffers();
  void set_up_staging();
  void run_deferred_work();
  io_uring_sqe* next_sqe();  // an SQE, with this turn's flush posted
  bool issuer_thread() const noexcept { return !defer_ || std::this_thread::get_id() == issuer_; }
  Loop& loop_;
  io_uring ring_{};
  bool ring_ready_ = false;
  // IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN: completions need the loop's thread to enter the kernel
  // (reap and the busy-poll do), and only that thread may submit. The ring starts disabled and the
  // first flush, on the loop's thread, enables it and so makes that thread its issuer.
  bool defer_ = false;
  bool enabled_ = false;
  std::thread::id issuer_{};
  std::uint64_t poller_ = 0;
  io_uring_buf_ring* buffer_ring_ = nullptr;
  std::unique_ptr<std::byte[]> buffers_;
  bool multishot_off_ = false;
  std::byte* staging_ = nullptr;  // staging_slots * staging_bytes, page-aligned, registered
  std::vector<std::byte*> free_staging_;
  int event_fd_ = -1;
  std::uint64_t watch_ = 0;
  bool flush_posted_ = false;
  std::size_t zero_copy_bytes_ = 0;
  bool zero_copy_set_ = false;  // by WEFT_URING_ZC_BYTES
  struct Seen {
    UringRequest* request;
    int result;
    std::uint32_t flags;
  };
  std::vector<Seen> deferred_;  // completions seen by settle(), run by the next reap()
  bool see(io_uring_cqe* cqe);  // records a CQE as seen; false for our own cancellations
};

class UringStream final : public Stream, public std::enable_shared_from_this<UringStream> {
 public:
  /// Takes over `socket`'s descriptor.
  UringStream(asio::ip::tcp::socket socket, std::shared_ptr<UringRing> ring, StreamEvents* events, int peer,
              std::weak_ptr<bool> alive);
  ~UringStream() override;

  std::string_view backend() const noexcept override { return "uring"; }
  int native_handle() const noexcept override { return fd_; }
  std::byte* staging(std::size_t bytes) override;
  void write(ConstBytes first, ConstBytes second, ConstBytes third) override;
  void read(void* dst, std::size_t min, std::size_t cap) override;
  void write_blocking(const void* data, std::size_t size) override;
  void shutdown_send() override;
  void close() override;

 private:
  struct Writer final : UringRequest {
    UringStream* stream = nullptr;
    iovec iov[3]{};
    msghdr msg{};
    std::size_t left = 0;
    // Zero-copy: every SENDMSG_ZC that reports bytes sent also reports, later, a notification when the
    // kernel is done with the pages. The write is done (and its buffer reusable) only after both.
    bool zero_copy = false;
    int notifications_due = 0;
    bool sent_all = false;
    std::error_code failure;
    void finish_if_done();
    std::shared_ptr<UringStream> keep;  // the stream lives while its request is in the kernel
    void complete(int result, std::uint32_t flags) override;
    void submit();
  };
  // The read asked for (one at a time), served from landed bytes first, then by a direct receive.
  struct Reader final : UringRequest {
    UringStream* stream = nullptr;
    bool wanted = false;     // a read is asked for and not answered yet
    // A direct receive is under way, until its completion has run. (in_kernel says when the kernel is
    // done, which is earlier: other completions of the same batch may run in between.)
    bool receiving = false;
    std::byte* dst = nullptr;
    std::size_t got = 0;
    std::size_t min = 0;
    std::size_t cap = 0;
    std::shared_ptr<UringStream> keep;
    void complete(int result, std::uint32_t flags) override;
    void submit();
  };
  // The multishot receive: while armed, every arrival lands in a provided buffer of the ring.
  struct Multishot final : UringRequest {
    UringStream* stream = nullptr;
    bool armed = false;  // until its last completion has run (see Reader::receiving)
    bool cancelling = false;
    bool seen_data = false;  // an EINVAL after data is an error, not a missing feature
    std::shared_ptr<UringStream> keep;
    void complete(int result, std::uint32_t flags) override;
  };
  struct Landed {  // received bytes not taken yet, in a provided buffer
    std::uint16_t buffer;
    std::uint32_t offset;
    std::uint32_t size;
  };
  // A read whose remainder is at least this big is received directly into its destination (the
  // multishot receive is stopped first, so that the bytes keep their order); smaller ones are served
  // from the provided buffers.
  static constexpr std::size_t direct_bytes = 16 << 10;
  // Moves the read along: landed bytes, then the multishot or a direct receive. `from_completion`: may
  // answer at once (else through the loop's queue: read() must not answer inline).
  void serve(bool from_completion);
  static constexpr int direct_after_large = 16;
  int direct_reads_left_ = 0;
  void take_landed();      // copies landed bytes into the read
  void arm_multishot();
  void answer_read(const std::error_code& ec);  // answers the read from the loop's queue
  void finish_read(const std::error_code& ec);  // answers it now (from a completion)
  void report_written(const std::error_code& ec);
  void report_read(const std::error_code& ec, std::size_t n);

  int fd_ = -1;
  bool closed_ = false;
  bool loopback_peer_ = false;
  std::shared_ptr<UringRing> ring_;
  StreamEvents* events_;
  int peer_;
  std::weak_ptr<bool> alive_;
  Writer writer_;
  Reader reader_;
  Multishot multishot_;
  std::deque<Landed> landed_;
  std::byte* staging_ = nullptr;  // a slot of the ring's registered staging, while this stream has one
  std::error_code receive_end_;  // how the connection's receiving side ended (end of stream, an error)
  bool out_of_buffers_ = false;  // the multishot receive ran out of buffers: this read goes direct
};

}  // namespace weft
