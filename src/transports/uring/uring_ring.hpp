#pragma once
// The io_uring ring of the uring backend (liburing): the context that the streams' operations run on. One
// ring per transport; its completions reach the weft loop through an eventfd the loop watches
// (Loop::watch_readable) when it sleeps and through a memory-only poller (Loop::add_poller) while it
// polls, so no thread of its own. Submissions are batched: queued SQEs go to the kernel in one
// io_uring_enter per loop turn, and receives wait for the loop's next look at the ring. Where the loop
// runs on one thread only (and the kernel wakes it at once for deferred work), the ring is set up for a
// single issuer with deferred task work; otherwise for cooperative task work; either way the loop's
// busy-poll runs that work (docs/DESIGN.md).
#include <liburing.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "weft/loop.hpp"

namespace weft {

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
  /// Whether this kernel wakes a loop that sleeps on a single-issuer ring's eventfd as soon as deferred
  /// task work is queued (a receive's data arrived), so that the ring may defer its task work. Linux 6.1
  /// to 6.x signal the eventfd right there; 6.18 signals it about 14 ms later, so every message waited
  /// that long (16 ms per 8-byte all_reduce). Probed once per process: a small ring of that kind, a
  /// receive posted on a socket pair, a byte written, the eventfd looked at as the write returns.
  static bool defers_promptly();
  ~UringRing();
  UringRing(const UringRing&) = delete;
  UringRing& operator=(const UringRing&) = delete;

  /// When a prepared SQE goes to the kernel. at_turn_end: at the end of this loop turn (a send). when_polled:
  /// at the loop's next look at the ring (its next polling turn, or before it sleeps), together with
  /// what is prepared until then: a receive posted again after a message, which would otherwise take a
  /// system call of its own just before the next collective's send takes another (bench/RESULTS.md). A
  /// loop that does not own its thread looks only when the eventfd fires: there, at the turn's end too.
  enum class Flush { at_turn_end, when_polled };
  /// An SQE to fill, with user_data set to `request`; it goes to the kernel as `when` says.
  io_uring_sqe* prepare(UringRequest* request, Flush when = Flush::at_turn_end);
  /// Asks the kernel to cancel `request` (at the end of this loop turn); the request's own completion
  /// follows.
  void cancel(UringRequest* request);
  Loop& loop() noexcept { return loop_; }
  /// Submits what was prepared (one io_uring_enter).
  void flush();
  /// Loop thread: asks the kernel to cancel every request of the ring, whoever submitted it; each
  /// request's ECANCELED then submits it again from the loop's thread (uring_stream.cpp,
  /// `submitter_ended`). What a borrower's end has the loop do (hand_over_from_ending_thread).
  void resubmit_everything();
  /// On a thread that submitted to `ring` while it borrowed the loop, as that thread ends (a
  /// thread_local's destructor, uring_ring.cpp): has the loop's thread resubmit what the ring has in
  /// flight while this thread still runs the cancellations' task work, and waits for that (at most
  /// `hand_over_limit`).
  static void hand_over_from_ending_thread(std::shared_ptr<UringRing> ring);
  static constexpr std::chrono::milliseconds hand_over_limit{50};
  /// Runs the completions that arrived.
  void reap();
  /// The ring as one of the loop's memory pollers (Loop::Poller, through detail::WeakPoller). poll(),
  /// each polling turn: runs the completions in the CQ, asking the kernel first for task work it flagged
  /// (read from the ring's shared memory: no system call when there is none); 1 when it ran some, else
  /// 0. arm(), before the loop sleeps: submits what waits for the loop's look, lets the eventfd speak
  /// again, and says whether completions wait that the eventfd would not wake it for. disarm(), after
  /// the sleep: silences the eventfd while the loop polls.
  std::size_t poll();
  bool arm();
  void disarm() noexcept;
  /// Returns once the kernel is done with `a` and `b` (either may be null): they are cancelled and their
  /// completions awaited (at most a second), so that their buffers may be freed. Their completions, and
  /// any others seen meanwhile, run at the next reap, from the loop's queue.
  void settle(std::initializer_list<UringRequest*> requests);
  /// Whether multishot receives fill provided buffers (set up, and supported by the kernel).
  bool provided_buffers() const noexcept { return buffer_ring_ != nullptr && !multishot_off_; }
  /// Registered staging: slots of `staging_bytes` in one buffer registered with the ring (fixed buffer
  /// 0), for the transports' read-ahead buffers, read with READ_FIXED. Null when none is left or
  /// registration failed (RLIMIT_MEMLOCK, WEFT_URING_REGISTERED=0).
  static constexpr std::size_t staging_bytes = 20 * 1024;  // whole pages, >= the framed transport's inbox
  static constexpr std::size_t staging_slots = 64;
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
  explicit UringRing(Loop& loop) : loop_(loop), loop_alive_(loop.alive_word()) {}
  void set_up_buffers();
  void set_up_staging();
  void run_deferred_work();
  bool task_work_flagged() const noexcept;
  void reap_ready();  // runs the CQEs there are
  unsigned fruitless_asks_ = 0;  // poll(): asks for flagged task work in a row that brought no CQE
  unsigned skipped_asks_ = 0;
  io_uring_sqe* next_sqe(Flush when = Flush::at_turn_end);  // an SQE, with its flush posted or due
  bool issuer_thread() const noexcept { return !defer_ || std::this_thread::get_id() == issuer_; }
  Loop& loop_;
  const std::atomic<bool>* loop_alive_;  // a handler of a borrowed io_context may free the ring after the Loop
  io_uring ring_{};
  bool ring_ready_ = false;
  // IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN: completions need the loop's thread to enter the kernel
  // (reap and the busy-poll do), and only that thread may submit. The ring starts disabled and the
  // first flush, on the loop's thread, enables it and so makes that thread its issuer.
  bool defer_ = false;
  bool late_deferred_wakes_ = false;  // deferred task work was wanted, and this kernel does not wake the loop at once for it (defers_promptly)
  bool enabled_ = false;
  bool coop_ = false;  // IORING_SETUP_COOP_TASKRUN: the kernel flags task work instead of interrupting the submitter
  std::thread::id issuer_{};
  std::uint64_t poller_ = 0;  // Loop::add_poller: completions seen in memory while the loop polls
  io_uring_buf_ring* buffer_ring_ = nullptr;
  std::unique_ptr<std::byte[]> buffers_;
  bool multishot_off_ = false;
  std::byte* staging_ = nullptr;  // staging_slots * staging_bytes, page-aligned, registered
  std::vector<std::byte*> free_staging_;
  int event_fd_ = -1;
  std::uint64_t watch_ = 0;
  bool flush_posted_ = false;
  bool polled_flush_due_ = false;  // SQEs prepared with Flush::when_polled wait for poll() or arm()
  bool eventfd_silenced_ = false;  // IORING_CQ_EVENTFD_DISABLED set by disarm(), while the loop polls
  // The thread that submitted last: a borrower of the loop (caller-driven progress) is noted so that
  // its end hands its requests over (note_submitter, uring_ring.cpp).
  std::uint64_t last_submitter_ = 0;  // a serial number per thread (uring_ring.cpp)
  void note_submitter();
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

}  // namespace weft
