#include "transports/uring/uring_ring.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "core/env.hpp"
#include "core/log.hpp"
#include "core/loop_users.hpp"
#include "core/weak_poller.hpp"
#include "weft/error.hpp"

namespace weft {

// ---------------------------------------------------------------- the ring

namespace {
// Names this thread for note_submitter(): a std::thread::id is reused by the next thread as soon as
// one ends, and a thread that ends is what note_submitter must not miss.
std::atomic<std::uint64_t> next_thread_serial{1};
thread_local const std::uint64_t this_thread_serial = next_thread_serial.fetch_add(1, std::memory_order_relaxed);
}  // namespace

bool UringRing::available(std::string& why) {
  if (const char* v = std::getenv("WEFT_URING_SETUP_FAIL"); v && std::string_view(v) == "1") {
    why = "WEFT_URING_SETUP_FAIL=1 (forced, for tests)";
    return false;
  }
  io_uring ring{};
  if (const int rc = io_uring_queue_init(2, &ring, 0); rc < 0) {
    why = fmt::format("io_uring_queue_init: {}", std::strerror(-rc));
    return false;
  }
  io_uring_queue_exit(&ring);
  return true;
}

bool UringRing::defers_promptly() {
  static const bool prompt = [] {
    io_uring ring{};
    if (io_uring_queue_init(4, &ring, IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_TASKRUN_FLAG) < 0) {
      return false;  // before 6.1, or refused: create() makes a plain ring anyway
    }
    bool signalled = false;
    const int event_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    int pair[2] = {-1, -1};
    char byte = 0;
    if (event_fd >= 0 && io_uring_register_eventfd(&ring, event_fd) == 0 &&
        ::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0) {
      if (io_uring_sqe* sqe = io_uring_get_sqe(&ring)) {
        io_uring_prep_recv(sqe, pair[0], &byte, 1, 0);
        if (io_uring_submit(&ring) == 1 && ::write(pair[1], "x", 1) == 1) {
          pollfd ready{event_fd, POLLIN, 0};
          signalled = ::poll(&ready, 1, 0) == 1;
        }
      }
    }
    // The receive's completion is run and seen before the ring goes (it writes into `byte`).
    io_uring_get_events(&ring);
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(&ring, &cqe) == 0) io_uring_cqe_seen(&ring, cqe);
    io_uring_queue_exit(&ring);
    for (const int fd : {pair[0], pair[1], event_fd}) {
      if (fd >= 0) ::close(fd);
    }
    return signalled;
  }();
  return prompt;
}

namespace {
// WEFT_URING_DEFER: the single-issuer ring with deferred task work where the loop runs on one thread
// and the kernel wakes it at once for that work (1, the default), never (0), or even where the kernel
// wakes the loop late (`always`: for the tests, which keep that path covered on such kernels, where
// each message then waits about 14 ms).
enum class Defer { never, where_prompt, always };
Defer defer_choice() {
  const char* v = std::getenv("WEFT_URING_DEFER");
  if (!v || !*v) return Defer::where_prompt;
  const std::string_view text(v);
  if (text == "always") return Defer::always;
  if (text == "0" || text == "1") return text == "1" ? Defer::where_prompt : Defer::never;
  throw Error(Errc::invalid_argument, ErrorContext{.op = "configuration"},
              fmt::format("WEFT_URING_DEFER='{}' is not valid (valid: 0, 1, always)", text));
}

// A loop made under WEFT_TRANSPORT=uring stays on its progress thread only where the ring will defer.
bool wants_one_thread() {
  const Defer choice = defer_choice();
  return choice == Defer::always || (choice == Defer::where_prompt && UringRing::defers_promptly());
}
const bool answer_registered = (detail::set_uring_wants_one_thread(&wants_one_thread), true);
}  // namespace

std::shared_ptr<UringRing> UringRing::create(Loop& loop, std::string& why) {
  if (const char* v = std::getenv("WEFT_URING_SETUP_FAIL"); v && std::string_view(v) == "1") {
    why = "WEFT_URING_SETUP_FAIL=1 (forced, for tests)";
    return nullptr;
  }
  std::shared_ptr<UringRing> ring(new UringRing(loop));
  // A single-issuer ring with deferred task work needs every submission from one thread: only a loop
  // that runs on one thread gives that, and a kernel that wakes the loop for that work at once
  // (defers_promptly). WEFT_URING_DEFER=0 turns it off, `always` on even where the kernel wakes the
  // loop late; a kernel without it (before 6.1) refuses the flags and gets a plain ring.
  unsigned flags = 0;
  if (const Defer choice = defer_choice(); choice != Defer::never) {
    ring->late_deferred_wakes_ = !defers_promptly();
    if (loop.single_thread() && (!ring->late_deferred_wakes_ || choice == Defer::always)) {
      flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN | IORING_SETUP_TASKRUN_FLAG | IORING_SETUP_R_DISABLED;
    }
  }
  // Otherwise cooperative task work (WEFT_URING_COOP, on by default): the kernel flags the ring instead
  // of interrupting the submitting thread, and the loop's poller runs the work when it sees the flag. A
  // plain ring interrupts a running submitter (an IPI): an 8-byte all_reduce took 40 us that way against
  // 16 us, and 11 us awaited against 33 (bench/RESULTS.md, "Cooperative task work"). A sleeping
  // submitter is still woken at once; one that computes in user space holds its requests' completions
  // until it next enters the kernel, a timer tick at most (docs/DESIGN.md).
  const bool coop_wanted = flags == 0 && detail::env_switch("WEFT_URING_COOP", true);
  if (coop_wanted) flags = IORING_SETUP_COOP_TASKRUN | IORING_SETUP_TASKRUN_FLAG;
  int rc = io_uring_queue_init(256, &ring->ring_, flags);
  if (rc == -EINVAL && flags != 0) {  // before 6.1 (deferred) or 5.19 (cooperative): a plain ring
    flags = 0;
    rc = io_uring_queue_init(256, &ring->ring_, flags);
  }
  if (rc < 0) {
    why = fmt::format("io_uring_queue_init: {}", std::strerror(-rc));
    return nullptr;
  }
  ring->ring_ready_ = true;
  ring->coop_ = (flags & IORING_SETUP_COOP_TASKRUN) != 0;
  ring->defer_ = (flags & IORING_SETUP_DEFER_TASKRUN) != 0;
  ring->enabled_ = !ring->defer_;
  if (io_uring_probe* probe = io_uring_get_probe_ring(&ring->ring_)) {
    if (io_uring_opcode_supported(probe, IORING_OP_SENDMSG_ZC)) {
      ring->zero_copy_bytes_ = 64 << 10;
      if (const char* v = std::getenv("WEFT_URING_ZC_BYTES"); v && *v) {
        const std::string_view text(v);
        if (text.find_first_not_of("0123456789") != std::string_view::npos || text.size() > 18) {
          io_uring_free_probe(probe);
          throw Error(Errc::invalid_argument, ErrorContext{.op = "configuration"},
                      fmt::format("WEFT_URING_ZC_BYTES='{}' is not a byte count (digits; 0 turns zero-copy off)", text));
        }
        ring->zero_copy_bytes_ = std::strtoull(v, nullptr, 10);
        ring->zero_copy_set_ = true;
      }
    }
    io_uring_free_probe(probe);
  }
  ring->event_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (ring->event_fd_ < 0) {
    why = fmt::format("eventfd: {}", std::strerror(errno));
    return nullptr;
  }
  if (const int rc = io_uring_register_eventfd(&ring->ring_, ring->event_fd_); rc < 0) {
    why = fmt::format("io_uring_register_eventfd: {}", std::strerror(-rc));
    return nullptr;
  }
  // Completions wake the loop through the eventfd; the handler reaps every CQE there is.
  ring->watch_ = loop.watch_readable(ring->event_fd_, [weak = std::weak_ptr<UringRing>(ring)] {
    auto self = weak.lock();
    if (!self) return;
    std::uint64_t count = 0;
    [[maybe_unused]] const auto n = ::read(self->event_fd_, &count, sizeof count);
    self->reap();
  });
  // While the loop polls, completions are looked for in the ring's memory on every turn: a CQE, or the
  // kernel's flag that task work waits. The eventfd alone made each one wait for the loop's
  // next ask of the kernel (an epoll_wait, then a read of the eventfd), and kept the loop asking every
  // 10 us; the eventfd stays for the loop's sleeps.
  ring->poller_ = loop.add_poller(std::make_shared<detail::WeakPoller<UringRing>>(ring));
  // Multishot receives are off unless asked for: in weft they measured no faster than direct receives
  // for small frames, and slower with caller-driven progress, where the long-lived receive stays tied
  // to the thread that armed it (bench/RESULTS.md, "io_uring features").
  if (detail::env_switch("WEFT_URING_MULTISHOT", false)) ring->set_up_buffers();
  if (detail::env_switch("WEFT_URING_REGISTERED", true)) ring->set_up_staging();
  return ring;
}

// The provided buffers of the multishot receives (WEFT_URING_MULTISHOT=1). Without them (the default,
// or a kernel before 5.19) every read is a direct receive.
void UringRing::set_up_buffers() {
  const std::size_t ring_bytes = buffer_count * sizeof(io_uring_buf);
  void* memory = ::mmap(nullptr, ring_bytes, PROT_READ | PROT_WRITE, MAP_ANONYMOUS | MAP_PRIVATE, -1, 0);
  if (memory == MAP_FAILED) return;
  io_uring_buf_reg registration{};
  registration.ring_addr = reinterpret_cast<std::uintptr_t>(memory);
  registration.ring_entries = buffer_count;
  registration.bgid = buffer_group;
  if (io_uring_register_buf_ring(&ring_, &registration, 0) < 0) {
    ::munmap(memory, ring_bytes);
    return;
  }
  buffer_ring_ = static_cast<io_uring_buf_ring*>(memory);
  io_uring_buf_ring_init(buffer_ring_);
  buffers_ = std::make_unique_for_overwrite<std::byte[]>(std::size_t{buffer_count} * buffer_bytes);
  for (std::uint32_t id = 0; id < buffer_count; ++id) recycle(static_cast<std::uint16_t>(id));  // all to the kernel
}

// Registered staging for the read-ahead buffers: the kernel maps a registered buffer once, where a plain
// receive walks the destination's pages on every call.
void UringRing::set_up_staging() {
  const std::size_t bytes = staging_slots * staging_bytes;
  void* memory = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_ANONYMOUS | MAP_PRIVATE, -1, 0);
  if (memory == MAP_FAILED) return;
  const iovec whole{memory, bytes};
  if (const int rc = io_uring_register_buffers(&ring_, &whole, 1); rc < 0) {
    log().info("io_uring: no registered staging ({})", std::strerror(-rc));
    ::munmap(memory, bytes);
    return;
  }
  staging_ = static_cast<std::byte*>(memory);
  for (std::size_t i = staging_slots; i-- > 0;) free_staging_.push_back(staging_ + i * staging_bytes);
}

std::byte* UringRing::take_staging() {
  if (free_staging_.empty()) return nullptr;
  std::byte* slot = free_staging_.back();
  free_staging_.pop_back();
  return slot;
}

void UringRing::give_back_staging(std::byte* slot) { free_staging_.push_back(slot); }

int UringRing::fixed_index(const void* data, std::size_t size) const noexcept {
  const auto* p = static_cast<const std::byte*>(data);
  if (!staging_ || p < staging_ || p + size > staging_ + staging_slots * staging_bytes) return -1;
  return 0;
}

std::string UringRing::settings() const {
  return fmt::format("deferred task work {}, cooperative task work {}, multishot receive {}, registered staging {}, zero-copy sends {}",
                     defer_ ? (late_deferred_wakes_ ? "on (though this kernel does not wake the loop at once for it)" : "on")
                     : late_deferred_wakes_ ? "off (this kernel does not wake the loop at once for it)" : "off",
                     coop_ ? "on" : "off", provided_buffers() ? "on" : "off", staging_ ? "on" : "off",
                     zero_copy_bytes_ == 0 ? std::string("off")
                     : zero_copy_set_      ? fmt::format("from {} bytes", zero_copy_bytes_)
                                           : fmt::format("from {} bytes (not towards loopback peers)", zero_copy_bytes_));
}

void UringRing::recycle(std::uint16_t id) {
  io_uring_buf_ring_add(buffer_ring_, buffers_.get() + std::size_t{id} * buffer_bytes, buffer_bytes, id,
                        io_uring_buf_ring_mask(buffer_count), 0);
  io_uring_buf_ring_advance(buffer_ring_, 1);
}

void UringRing::multishot_unsupported() {
  if (!buffer_ring_) return;
  log().info("io_uring: multishot receive is not supported here; receiving directly");
  // The registration stays (the kernel owns it until the ring goes); only new receives stop using it.
  multishot_off_ = true;
}

UringRing::~UringRing() {
  if (loop_alive_->load(std::memory_order_acquire)) {
    if (poller_) loop_.remove_poller(poller_);
    if (watch_) loop_.unwatch(watch_);
  }
  if (ring_ready_) io_uring_queue_exit(&ring_);  // cancels what is still in the kernel
  if (event_fd_ >= 0) ::close(event_fd_);
  if (buffer_ring_) ::munmap(buffer_ring_, buffer_count * sizeof(io_uring_buf));
  if (staging_) ::munmap(staging_, staging_slots * staging_bytes);
}

io_uring_sqe* UringRing::prepare(UringRequest* request, Flush when) {
  io_uring_sqe* sqe = next_sqe(when);
  io_uring_sqe_set_data(sqe, request);
  request->in_kernel = true;
  return sqe;
}

void UringRing::cancel(UringRequest* request) {
  io_uring_sqe* sqe = next_sqe();
  io_uring_prep_cancel(sqe, request, 0);
  io_uring_sqe_set_data(sqe, nullptr);  // its own completion is ignored; the request's last one follows
}

io_uring_sqe* UringRing::next_sqe(Flush when) {
  io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
  if (!sqe) {  // the submission queue is full: hand it over now
    flush();
    sqe = io_uring_get_sqe(&ring_);
  }
  if (when == Flush::when_polled && loop_.owns_thread()) {
    // The loop's next look (poll(), or arm() before it sleeps) submits it, in the same system call as
    // whatever the thread sends meanwhile.
    polled_flush_due_ = true;
    return sqe;
  }
  if (!flush_posted_) {
    // Everything prepared during this turn of the loop goes in one io_uring_enter, after the handlers
    // already queued.
    flush_posted_ = true;
    loop_.post([weak = weak_from_this()] {
      if (auto self = weak.lock()) self->flush();
    });
  }
  return sqe;
}

void UringRing::flush() {
  flush_posted_ = false;
  polled_flush_due_ = false;
  if (!enabled_) {
    // The first submission, on the loop's thread: that thread becomes the ring's one issuer.
    if (const long rc = ::syscall(__NR_io_uring_register, ring_.ring_fd, IORING_REGISTER_ENABLE_RINGS, nullptr, 0); rc < 0) {
      log().error("io_uring: enabling the ring: {}", std::strerror(errno));
    }
    enabled_ = true;
    issuer_ = std::this_thread::get_id();
  }
  if (!issuer_thread()) {
    log().error("io_uring: a submission from a thread other than the ring's issuer was dropped");
    return;
  }
  const int rc = io_uring_submit(&ring_);
  if (rc < 0) log().error("io_uring_submit: {}", std::strerror(-rc));
  if (rc > 0 && this_thread_serial != last_submitter_) note_submitter();
}

// ---------------------------------------------------------------- a submitter that ends

namespace {
// The kernel ties a request to the thread that submitted it: its task work (the receive itself, once
// data came) runs in that thread. Under caller-driven progress any thread that waits on an operation
// submits, among others the receive the stream posts for the next message; a user's thread that waited
// on one collective and then ended (std::async per call, a thread per request) left that receive with a
// task that no longer exists. The kernel completes such a request only when its data comes, through a
// kernel worker a tick later, with ECANCELED (the stream then submits it again: uring_stream.cpp,
// `submitter_ended`); each call from a new thread waited for that: an 8-byte all_reduce from a new
// thread each time took 0.75-6 ms (median), up to 27 ms, over uring, 43-58 us over tcp
// (bench/RESULTS.md, "io_uring under waiters that end"). So a borrower that submitted is noted per
// thread, and its end has the loop cancel the ring's requests while the thread still runs: the
// cancellations' task work runs in it at its next system call, every request comes back ECANCELED at
// once, and the loop's thread submits it again.
class EndingSubmitter {
 public:
  void add(const std::shared_ptr<UringRing>& ring) {
    if (ending_) return;  // the hand-over's own submission
    for (const std::weak_ptr<UringRing>& noted : rings_) {
      if (!noted.owner_before(ring) && !ring.owner_before(noted)) return;
    }
    std::erase_if(rings_, [](const std::weak_ptr<UringRing>& noted) { return noted.expired(); });
    rings_.push_back(ring);
    pid_ = ::getpid();
  }
  ~EndingSubmitter() {
    ending_ = true;
    // A child of fork() that calls exit() shares the parent's rings, not its loops' threads.
    if (::getpid() != pid_) return;
    for (const std::weak_ptr<UringRing>& noted : rings_) {
      if (std::shared_ptr<UringRing> ring = noted.lock()) UringRing::hand_over_from_ending_thread(std::move(ring));
    }
  }

 private:
  std::vector<std::weak_ptr<UringRing>> rings_;
  pid_t pid_ = 0;
  bool ending_ = false;
};
thread_local EndingSubmitter ending_submitter;
}  // namespace

void UringRing::note_submitter() {
  last_submitter_ = this_thread_serial;
  // The progress thread ends with the loop; a loop without one (a borrowed io_context) is run by the
  // user's own threads, which are not waiters passing through.
  if (loop_.owns_thread() && !loop_.on_progress_thread()) ending_submitter.add(shared_from_this());
}

void UringRing::resubmit_everything() {
  io_uring_sqe* sqe = next_sqe();
  io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY | IORING_ASYNC_CANCEL_ALL);  // EINVAL before 5.19: nothing happens
  io_uring_sqe_set_data(sqe, nullptr);  // its own completion (how many) is ignored
  flush();
}

void UringRing::hand_over_from_ending_thread(std::shared_ptr<UringRing> ring) {
  struct Handover {
    std::shared_ptr<UringRing> ring;
    std::atomic<bool> done{false};
    static void run(void* arg) {
      auto& handover = *static_cast<Handover*>(arg);
      const std::shared_ptr<UringRing> ring = std::move(handover.ring);  // released on the loop's thread
      ring->resubmit_everything();
      handover.done.store(true, std::memory_order_release);
    }
  };
  auto handover = std::make_shared<Handover>();
  handover->ring = std::move(ring);
  Loop& loop = handover->ring->loop_;
  // At once when the loop is free (this thread handed it back moments ago), else through its queue.
  if (!loop.run_here(&Handover::run, handover.get())) loop.post([handover] { Handover::run(handover.get()); });
  // The cancellations' task work runs in this thread, at any system call it makes: wait in short sleeps
  // until the loop has asked for them, then make one more. Bounded: a loop that has stopped never runs
  // the post, and this thread's requests then end as the kernel ends them.
  const auto until = std::chrono::steady_clock::now() + hand_over_limit;
  while (!handover->done.load(std::memory_order_acquire) && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
  ::sched_yield();
}

// With deferred or cooperative task work, completions wait in the kernel until the thread they belong
// to enters it (deferred: the issuer, asking for them; cooperative: the submitting thread, at any system
// call); the kernel flags the ring when some wait, so that asking costs a system call only then.
bool UringRing::task_work_flagged() const noexcept {
  return (coop_ || (defer_ && enabled_ && issuer_thread())) && (IO_URING_READ_ONCE(*ring_.sq.kflags) & IORING_SQ_TASKRUN);
}

void UringRing::run_deferred_work() {
  if (task_work_flagged()) io_uring_get_events(&ring_);
}

bool UringRing::see(io_uring_cqe* cqe) {
  auto* request = static_cast<UringRequest*>(io_uring_cqe_get_data(cqe));
  const int result = cqe->res;
  const std::uint32_t flags = cqe->flags;
  io_uring_cqe_seen(&ring_, cqe);
  if (!request) return false;  // the answer to a cancellation
  // Its last CQE (a zero-copy send has a notification to come) hands the request back.
  if (!(flags & IORING_CQE_F_MORE)) request->in_kernel = false;
  deferred_.push_back(Seen{request, result, flags});
  return true;
}

// Before the loop sleeps: cooperative task work flagged for this thread makes its wait return at once
// (the kernel sees the pending work), and flagged work of another thread posts its CQE, and so signals
// the eventfd, when that thread runs it; deferred work is run only by the issuer's own ask.
//
// The eventfd speaks only while the loop sleeps (disarm() silences it): signalled while the loop polls, it
// cost the loop's next kernel poll a read of it and Asio's re-arming epoll_ctl, 0.3 of each per 8-byte
// all_reduce (bench/RESULTS.md). The kernel posts a CQE (or flags deferred work) before it looks at
// the switch, with a full barrier between (the CQ waitqueue's wq_has_sleeper; the work list's cmpxchg),
// and arm() turns the switch on before it looks at the CQ: one of the two sees the other.
bool UringRing::arm() {
  if (polled_flush_due_) flush();
  if (eventfd_silenced_) {
    io_uring_cq_eventfd_toggle(&ring_, true);
    eventfd_silenced_ = false;
    std::atomic_thread_fence(std::memory_order_seq_cst);
  }
  return io_uring_cq_ready(&ring_) > 0 || (defer_ && task_work_flagged());
}

void UringRing::disarm() noexcept {
  if (!eventfd_silenced_ && io_uring_cq_eventfd_toggle(&ring_, false) == 0) eventfd_silenced_ = true;
}

std::size_t UringRing::poll() {
  if (polled_flush_due_) flush();
  if (io_uring_cq_ready(&ring_) == 0) {
    if (!task_work_flagged()) return 0;
    // Cooperative task work runs in the thread that submitted it: flagged work of a thread that has
    // gone to compute (it runs its work at its next system call, or tick) stays flagged however often
    // this thread asks. After two asks that brought nothing, ask every 64th turn only.
    if (fruitless_asks_ >= 2 && ++skipped_asks_ % 64 != 0) return 0;
    io_uring_get_events(&ring_);
    if (io_uring_cq_ready(&ring_) == 0) {
      ++fruitless_asks_;
      // The work is another thread's, and the kernel has woken that thread if it slept (a waiter that
      // went back to its pool, the progress thread parked under a borrower): give it this core. Spun
      // through instead, the work waited for this thread's spin to end: two threads taking turns at
      // waiting took 21-66 us per 8-byte all_reduce, 17-20 with the yield (bench/RESULTS.md, "Flagged
      // work of another thread").
      ::sched_yield();
      return 0;
    }
  }
  fruitless_asks_ = 0;
  reap_ready();
  return 1;
}

void UringRing::reap() {
  run_deferred_work();
  reap_ready();
}

void UringRing::reap_ready() {
  io_uring_cqe* cqe = nullptr;
  while (io_uring_peek_cqe(&ring_, &cqe) == 0) see(cqe);
  // Completions may prepare new requests (and see more): take the batch first.
  std::vector<Seen> batch;
  batch.swap(deferred_);
  for (const Seen& s : batch) s.request->complete(s.result, s.flags);
}

void UringRing::settle(std::initializer_list<UringRequest*> requests) {
  auto busy = [&] {
    for (UringRequest* r : requests) {
      if (r && r->in_kernel) return true;
    }
    return false;
  };
  if (!busy()) return;
  if (!issuer_thread()) {
    // Only the issuer may cancel or wait; this happens only when the ring outlives its loop's thread
    // (a Loop's last drain), where closing the ring cancels everything anyway.
    log().debug("io_uring: requests not settled (not on the ring's thread); the ring's exit cancels them");
    return;
  }
  for (UringRequest* r : requests) {
    if (r && r->in_kernel) cancel(r);
  }
  flush();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (busy()) {
    __kernel_timespec wait{0, 10'000'000};
    io_uring_cqe* cqe = nullptr;
    if (io_uring_wait_cqe_timeout(&ring_, &cqe, &wait) == 0) see(cqe);
    if (std::chrono::steady_clock::now() > deadline) {
      log().error("io_uring: a request did not finish within 1 s of its cancellation");
      break;
    }
  }
  if (!deferred_.empty()) {
    loop_.post([weak = weak_from_this()] {
      if (auto self = weak.lock()) self->reap();
    });
  }
}

}  // namespace weft
