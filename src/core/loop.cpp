#include "weft/loop.hpp"

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include <asio.hpp>

#include "weft/error.hpp"
#include "weft/future.hpp"
#include "weft/offload.hpp"
#include "core/env.hpp"
#include "core/host.hpp"
#include "core/log.hpp"
#include "core/loop_executor.hpp"
#include "core/loop_users.hpp"

namespace weft {
namespace {

// Timers and watches live in a registry that their handlers reach through a weak_ptr, so a handler that
// runs after the Loop is gone (borrowed mode: the caller's io_context outlives us) does nothing.
// Touched on the loop thread only.
struct Registry {
  // A timer's callback lives here, not in its handler: a handler runs only while the registry does, and
  // the loop's end (~Loop) destroys the callbacks left, uncalled, while the loop still
  // lives, as an owned io_context's end always did; a borrowed io_context runs the aborted handlers
  // later, after the Loop is gone, and they then find nothing to call.
  struct Timer {
    std::unique_ptr<asio::steady_timer> timer;
    std::function<void(bool)> fn;
  };
  std::unordered_map<std::uint64_t, Timer> timers;
  std::unordered_set<std::uint64_t> cancelled_early;  // cancel_timer() that overtook call_after()
  struct Watch {
    asio::posix::stream_descriptor descriptor;
    std::function<void()> on_readable;
  };
  std::unordered_map<std::uint64_t, std::unique_ptr<Watch>> watches;
};

// Polling pays only while every polling rank has a core, or while it gives the core away between looks:
// with more local ranks than cores, a poller that does not yield takes whole time slices from the rank it
// waits for, and one that sleeps pays a kernel wake-up per message. The launchers say how many ranks
// share the host.
bool oversubscribed() {
  const unsigned cores = std::thread::hardware_concurrency();
  return cores > 0 && host::local_ranks() > static_cast<int>(cores);
}

bool default_yield() {
  const char* v = std::getenv("WEFT_SPIN_YIELD");
  return v && *v ? detail::env_switch("WEFT_SPIN_YIELD", false) : oversubscribed();
}

// WEFT_SPIN_YIELD=0 is the user's word: no yielding, found out or not.
bool default_yield_when_preempted() {
  const char* v = std::getenv("WEFT_SPIN_YIELD");
  return !(v && *v && std::string_view(v) == "0");
}

std::chrono::microseconds default_spin() {
  if (const char* v = std::getenv("WEFT_SPIN_US"); v && *v) return detail::env_microseconds("WEFT_SPIN_US", {});
  if (oversubscribed() && !default_yield()) return std::chrono::microseconds(0);
  return Loop::Options{}.spin;
}

std::atomic<bool (*)()> uring_wants_one_thread{nullptr};  // detail::set_uring_wants_one_thread

// Caller-driven progress is on unless WEFT_DRIVE=0, and off by default under WEFT_TRANSPORT=uring where
// the kernel wakes the loop at once for deferred task work: a loop on one thread lets the ring take a
// single issuer with deferred task work, which measured faster than caller-driven progress over a plain
// ring at every size, waited on or awaited (bench/RESULTS.md, "io_uring features"). Where the kernel
// does not (Linux 6.18 here), the ring takes cooperative task work and caller-driven progress is the
// faster of the two (bench/RESULTS.md, "Cooperative task work"). WEFT_DRIVE=1 turns it on regardless.
bool default_caller_drives() {
  if (const char* v = std::getenv("WEFT_DRIVE"); v && *v) return detail::env_switch("WEFT_DRIVE", true);
  const char* transport = std::getenv("WEFT_TRANSPORT");
  if (!(transport && std::string_view(transport) == "uring")) return true;
  const auto answer = uring_wants_one_thread.load(std::memory_order_acquire);
  return !(answer && answer());
}

// The cores this rank may use: its CPU affinity shared among the ranks the launcher put on this host.
int cores_per_rank() {
  static const int cores = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    int allowed = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
    if (allowed <= 0) allowed = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    // weft-run binds each rank to one core: its affinity already says so (allowed is 1 then).
    return std::max(1, allowed / host::local_ranks());
  }();
  return cores;
}

// A polling loop thread only takes a core nobody else of this rank needs: while offloaded compute
// (weft::offload) keeps every core of the rank busy, the loop waits in the kernel instead. Measured with
// examples/overlap.cpp (bench/RESULTS.md, "Overlap"): on one core per rank a polling loop took half the
// core from the compute it was meant to overlap.
bool cores_taken_by_compute() { return detail::compute_jobs_running() >= cores_per_rank(); }

void arm_watch(const std::weak_ptr<Registry>& weak, std::uint64_t id) {
  auto registry = weak.lock();
  if (!registry) return;
  auto it = registry->watches.find(id);
  if (it == registry->watches.end()) return;
  it->second->descriptor.async_wait(asio::posix::stream_descriptor::wait_read,
                                    [weak, id](const std::error_code& ec) {
                                      if (ec) return;
                                      auto registry = weak.lock();
                                      if (!registry) return;
                                      auto found = registry->watches.find(id);
                                      if (found == registry->watches.end()) return;
                                      found->second->on_readable();
                                      arm_watch(weak, id);
                                    });
}

// Every live Loop, for Loop::current() and Loop::post_if_alive: few per process.
std::mutex loops_mutex;
std::atomic<std::uint64_t> next_loop_id{1};
std::vector<Loop*>& live_loops() {
  static auto* loops = new std::vector<Loop*>();  // never destroyed: a static Loop may outlive static destructors
  return *loops;
}
void register_loop(Loop* loop) {
  std::lock_guard lock(loops_mutex);
  live_loops().push_back(loop);
}
void unregister_loop(Loop* loop) {
  std::lock_guard lock(loops_mutex);
  std::erase(live_loops(), loop);
}

// Each Loop's alive word (Loop::alive_word): never freed, reachable from here, a byte per Loop ever made.
std::atomic<bool>* new_alive_word() {
  static auto* words = new std::deque<std::atomic<bool>>();
  std::lock_guard lock(loops_mutex);
  return &words->emplace_back(true);
}

// The Groups using each live Loop (core/loop_users.hpp), under loops_mutex.
std::unordered_map<const Loop*, int>& loop_users() {
  static auto* users = new std::unordered_map<const Loop*, int>();  // never destroyed, as live_loops()
  return *users;
}

// Each live Loop's end hooks (core/loop_users.hpp), under loops_mutex.
struct EndHook {
  std::uint64_t id = 0;
  std::function<void()> end;
  std::function<bool()> flushing;  // may be empty
};
struct EndHooks {
  std::uint64_t next = 1;
  std::unordered_map<const Loop*, std::vector<EndHook>> by_loop;
};
EndHooks& end_hooks() {
  static auto* hooks = new EndHooks();  // never destroyed, as live_loops()
  return *hooks;
}

// Whether a hook still registered on `loop` says it is flushing. A hook removed meanwhile belongs to its
// transport's deletion (DeleteOnLoop), which is posted to the loop's thread after the removal and so
// cannot run while its predicate is asked here (on that thread).
bool any_hook_flushing(const Loop& loop) {
  std::vector<std::function<bool()>> asks;
  {
    std::lock_guard lock(loops_mutex);
    if (auto found = end_hooks().by_loop.find(&loop); found != end_hooks().by_loop.end()) {
      for (const EndHook& hook : found->second) {
        if (hook.flushing) asks.push_back(hook.flushing);
      }
    }
  }
  return std::any_of(asks.begin(), asks.end(), [](const auto& ask) { return ask(); });
}

}  // namespace

namespace {
// The loop whose memory pollers this thread is running (outside any Asio handler): for in_loop_thread(),
// so that code a poller completes (a task that drops the last handle on a transport) knows it runs on
// the loop, as it would inside a handler. (Seen: a progress thread that waited for itself to delete.)
thread_local const Loop::Impl* polling_loop = nullptr;
struct PollingHere {
  const Loop::Impl* previous;
  explicit PollingHere(const Loop::Impl* impl) noexcept : previous(std::exchange(polling_loop, impl)) {}
  ~PollingHere() { polling_loop = previous; }
};

// What Loop::Impl::watch_preemption knows of the thread that polls: involuntary context switches are
// counted per thread, and any thread may drive a loop.
//
// A thread pinned to one core (weft-run binds each rank to one when the ranks fit) is not watched: what
// preempts it there is its own rank's other thread, and yielding to that one measured pathological on
// this project's kernel (6.18, EEVDF): 2 pinned ranks over shm, 8-byte all_reduce 0.8 us polling, 600 us
// polling yielding.
bool pinned_to_one_core() {
  cpu_set_t set;
  CPU_ZERO(&set);
  return sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) == 1;
}
struct PreemptionWatch {
  bool pinned = pinned_to_one_core();
  long switches = -1;
  int preempted = 0;
  unsigned turns = 0;
  std::chrono::steady_clock::time_point window_start{};
};
thread_local PreemptionWatch preemption_here;
}  // namespace

struct Loop::Impl {
  const std::uint64_t id = next_loop_id.fetch_add(1, std::memory_order_relaxed);
  std::atomic<bool>* const alive = new_alive_word();
  std::unique_ptr<asio::io_context> owned_io;
  asio::io_context* io = nullptr;
  // What every Asio object of the loop's is made on and every post goes through: the io_context's own
  // executor when the loop owns it (one thread runs it at a time), a strand over the caller's io_context
  // when it borrows one, which the caller may run on a pool of threads: weft's handlers then still run
  // one at a time, wherever they run (detail::executor_of).
  std::optional<asio::strand<asio::io_context::executor_type>> strand;
  asio::any_io_executor executor;
  bool running_here() const noexcept {
    return strand ? strand->running_in_this_thread() : io->get_executor().running_in_this_thread();
  }
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> keep_running;
  std::thread progress_thread;
  std::atomic<bool> stopping{false};
  std::atomic<bool> ending{false};  // ~Loop runs its end hooks (detail::loop_ending)
  std::chrono::microseconds spin{0};      // the polling bound's ceiling (Options::spin)
  std::chrono::microseconds spin_now{0};  // the bound now: adapted by turn(), touched by the driving thread
  bool caller_drives = false;
  std::atomic<bool> yields{false};  // Options::yield_while_polling, or since polling was preempted
  bool yield_when_preempted = false;  // Options::yield_when_preempted
  std::shared_ptr<Registry> registry = std::make_shared<Registry>();
  std::atomic<std::uint64_t> next_id{1};
  std::atomic<int> in_flight{0};
  std::shared_ptr<Linger::Count> lingering = std::make_shared<Linger::Count>();

  using Clock = std::chrono::steady_clock;

  // Caller-driven progress: a waiting thread may borrow the loop; the progress thread parks meanwhile.
  //
  // Who holds the loop is one word, `borrow`, changed only by compare-and-swap: `parked_bit` (the
  // progress thread is parked and cannot leave while `borrowed_bit` is set), `borrowed_bit` (a thread
  // holds the loop, or waits for the progress thread to park for it), `refused_bit` (a borrow was
  // refused while one was held: the refused thread sleeps on its Future, whose start may still wait in
  // the ready queue, so the holder's hand-back sends the parked thread to drive at once), and above them
  // a count of hand-backs. A borrow of a parked loop and its hand-back are one atomic operation each:
  // the mutex they took before, and the clock read of the hand-back, were a tenth of a small message's
  // instructions over shm from plain code (bench/RESULTS.md). The mutex and condition variable remain
  // for sleeping and waking only: the parked thread's waits, a borrower that waits for a running
  // progress thread to park, and the wake-ups below, which are all off the path of back-to-back calls.
  static constexpr std::uint64_t parked_bit = 1;
  static constexpr std::uint64_t borrowed_bit = 2;
  static constexpr std::uint64_t refused_bit = 4;
  static constexpr std::uint64_t one_hand_back = 8;
  std::atomic<std::uint64_t> borrow{0};
  std::mutex driver_mutex;
  std::condition_variable driver_cv;
  // A drive_until borrow's start (Clock's count), for the parked thread's long-borrow check; the
  // largest count while no drive_until holds the loop (run_here's borrows are short and write nothing).
  static constexpr Clock::rep no_borrow_start = std::numeric_limits<Clock::rep>::max();
  std::atomic<Clock::rep> drive_started{no_borrow_start};
  std::atomic<bool> drive_now{false};     // a hand-back found refused_bit: the parked thread drives at once
  std::atomic<bool> long_sleeping{false};  // the parked thread sleeps a long tick: a hand-back wakes it

  // A parked progress thread stays parked this long after a borrower hands the loop back, in case a
  // thread borrows it again (back-to-back blocking calls): waking it on every hand-back, only to park it
  // again, cost about 11 us per call on the 2-core VMs (bench/RESULTS.md). It resumes at once when the
  // borrower leaves operations in flight, and otherwise finds out on its next tick.
  static constexpr std::chrono::microseconds linger{500};
  // A borrow that lasts (a thread blocked in a receive for a second) would otherwise see the parked
  // thread tick 2000 times a second, most of the CPU such a rank used (issue 15). Once a borrow is this
  // old the parked thread looks only every long_tick, and the borrower wakes it when it hands back.
  // Short borrows (back-to-back blocking calls) keep the short tick and the hand-back without a wake.
  static constexpr std::chrono::milliseconds long_borrow{5};
  static constexpr std::chrono::milliseconds long_tick{50};
  // A borrower that hands back with operations in flight wakes the parked thread, which then waits this
  // much longer before it drives them: a thread waiting on several Futures one after the other (`for
  // (auto& f : window) f.get()`, Python's `for w in works: w.wait()`) borrows again within
  // microseconds, and a parked thread is taken back for the price of an atomic operation, where one that
  // already runs must first be parked again (about 2-3 us a message over shm, bench/RESULTS.md). What a
  // caller leaves in flight while it computes starts moving this much later.
  static constexpr std::chrono::microseconds hand_back_grace{50};
  Clock::time_point grace_until{};  // guarded by driver_mutex
  bool grace_waiting = false;        // guarded by driver_mutex: the parked thread waits for grace_until

  bool borrowed() const noexcept { return (borrow.load(std::memory_order_acquire) & borrowed_bit) != 0; }

  // The progress thread, once a borrower asked for the loop (borrowed_bit): parks until the loop has not
  // been borrowed for `linger` (counted from the first look that saw the last hand-back, so that a
  // hand-back needs no clock read), until a hand-back asks it to drive (refused_bit, work in flight
  // after the grace), or until the loop stops. It leaves only by a compare-and-swap that fails while a
  // borrower holds the loop.
  //
  // Its looks are spaced by `tick`, which starts at `linger` and doubles, up to busy_tick_most, with
  // every look that finds a borrower at work; a look that finds work waiting for this thread (posted,
  // or in flight, with nobody borrowing) brings it back to `linger`, and posted work is started at once.
  // Back-to-back blocking calls keep the loop borrowed nearly all the time, and a look every 500 us
  // woke a thread 2,000 times a second on a core that a rank was using (bench/RESULTS.md, "The parked
  // thread's looks": 4 ranks on 2 cores over tcp, 8 B-8 KiB all_reduce and all_to_all took 0.84-0.92
  // of the time; 2 ranks 0.92-0.97, uring 0.84-0.88). The price: work posted just after a run of
  // blocking calls (a collective started from plain code, then computation) starts at the parked
  // thread's next look, up to busy_tick_most later (median 1.6 ms against 0.9); from then on the looks
  // stay short.
  static constexpr std::chrono::microseconds busy_tick_most{4000};
  void park() {
    std::unique_lock lock(driver_mutex);
    std::uint64_t seen = borrow.fetch_or(parked_bit, std::memory_order_acq_rel) | parked_bit;
    driver_cv.notify_all();  // a borrower that waits for the park (drive_until)
    auto seen_at = Clock::now();
    std::chrono::microseconds tick = linger;
    while (!stopping.load()) {
      std::uint64_t now_state = borrow.load(std::memory_order_acquire);
      const auto now = Clock::now();
      if ((now_state & ~(one_hand_back - 1)) != (seen & ~(one_hand_back - 1))) seen_at = now;  // handed back since
      seen = now_state;
      if (!(now_state & borrowed_bit)) {
        const bool in_flight_now = in_flight.load(std::memory_order_relaxed) > 0;
        // Posted work that no borrower took while nothing is in flight: a blocking caller borrows
        // microseconds after it posts, so a start still waiting at a look was left for this thread
        // (plain code that computes now). With work in flight the grace below decides, as before: a
        // thread waiting on a window of Futures one after the other takes the loop back within it.
        const bool posted = !in_flight_now && ready_any.load(std::memory_order_acquire);
        if (posted || in_flight_now) tick = linger;
        if (drive_now.exchange(false) || posted || (in_flight_now && now >= grace_until) || now - seen_at >= linger) {
          if (borrow.compare_exchange_strong(now_state, now_state & ~parked_bit, std::memory_order_acq_rel)) return;
          drive_now.store(true);  // borrowed meanwhile: it is asked again after that hand-back
          continue;
        }
        if (in_flight_now) {  // a borrower just handed back with work in flight: its next wait may come
          grace_waiting = true;
          driver_cv.wait_until(lock, grace_until);
          grace_waiting = false;
          continue;
        }
        driver_cv.wait_for(lock, tick);
        continue;
      }
      const Clock::rep started = drive_started.load(std::memory_order_relaxed);
      if (started != no_borrow_start && now.time_since_epoch().count() - started >= Clock::duration(long_borrow).count()) {
        // Dekker with hand_back: it changes `borrow`, then looks at long_sleeping.
        long_sleeping.store(true);
        if (borrow.load() & borrowed_bit) driver_cv.wait_for(lock, long_tick);
        long_sleeping.store(false);
      } else {
        driver_cv.wait_for(lock, tick);
        tick = std::min(tick * 2, busy_tick_most);
      }
    }
    borrow.fetch_and(~parked_bit, std::memory_order_acq_rel);
  }

  // Takes the loop for this thread when the progress thread is parked (the borrow of run_here and the
  // common one of drive_until): one compare-and-swap.
  bool borrow_parked() noexcept {
    std::uint64_t state = borrow.load(std::memory_order_relaxed);
    return (state & (parked_bit | borrowed_bit)) == parked_bit &&
           borrow.compare_exchange_strong(state, state | borrowed_bit, std::memory_order_acquire, std::memory_order_relaxed);
  }

  // A borrower lets go (drive_until, run_here). The parked thread is woken when a thread was refused a
  // borrow meanwhile (it sleeps on its Future: drive for it now), when it sleeps a long tick (a long
  // borrow: it must look again within `linger`), and, with `grace_in_flight`, when operations are in
  // flight, to drive them after the grace unless borrowed again; a parked thread already waiting out a
  // grace (an earlier hand-back of a series woke it) only needs the grace moved: it looks at grace_until
  // again when its wait ends. Otherwise it lingers and looks again on its own.
  void hand_back(bool grace_in_flight) {
    bool wake = false;
    if (grace_in_flight && in_flight.load(std::memory_order_relaxed) > 0) {
      // Set while the loop is still held: a parked thread that looks between the release and this
      // would find no grace and leave its park at once.
      std::lock_guard lock(driver_mutex);
      grace_until = Clock::now() + hand_back_grace;
      wake = !grace_waiting;
    }
    std::uint64_t state = borrow.load(std::memory_order_relaxed);
    while (!borrow.compare_exchange_weak(state, (state & ~(borrowed_bit | refused_bit)) + one_hand_back)) {
    }
    wake = wake || long_sleeping.load() || drive_now.load(std::memory_order_relaxed);
    if (state & refused_bit) {
      drive_now.store(true);
      wake = true;
    }
    if (wake) {
      // Under the lock: the parked thread decides to sleep under it, so the notify cannot fall between
      // its look and its wait.
      { std::lock_guard lock(driver_mutex); }
      driver_cv.notify_all();
    }
  }

  // What is posted to a loop that owns its thread (Loop::post, from any thread): taken by the next turn
  // without entering the kernel (an Asio post is only seen by io_context::poll, and every poll is an
  // epoll_wait: a system call per collective started from a waiting thread, about a third of a small
  // all_reduce's cycles, bench/RESULTS.md). A turn about to sleep in the kernel says so (`asleep`, then a look at `ready_any`:
  // Dekker with the poster, which stores `ready_any`, then looks at `asleep` and wakes the loop with an
  // Asio post when it is set).
  std::mutex ready_mutex;
  std::vector<std::function<void()>> ready;  // guarded by ready_mutex
  std::vector<std::function<void()>> running;  // the loop's: the batch being run
  std::atomic<bool> ready_any{false};
  std::atomic<bool> asleep{false};

  void post_ready(std::function<void()> fn) {
    // All of it under the lock: once the work is visible the loop may run it and its owner destroy the
    // Loop (a device stream's worker posts the completion a waiter returns on), and ~Loop takes this lock
    // last, so that no poster is still inside (ThreadSanitizer found the wake-up below reading a freed
    // Impl after the unlock).
    std::lock_guard lock(ready_mutex);
    ready.push_back(std::move(fn));
    ready_any.store(true, std::memory_order_seq_cst);
    if (asleep.load(std::memory_order_seq_cst)) asio::post(*io, [] {});
  }
  // The look is inlined at every call (a turn, each run_here): nearly always nothing was posted, and the
  // whole function's entry cost 20 instructions for that answer, three times per message.
  std::size_t run_ready() { return ready_any.load(std::memory_order_acquire) ? run_ready_now() : 0; }
  [[gnu::noinline]] std::size_t run_ready_now() {
    {
      std::lock_guard lock(ready_mutex);
      running.swap(ready);
      ready_any.store(false, std::memory_order_relaxed);
    }
    PollingHere here(this);
    const std::size_t n = running.size();
    for (auto& fn : running) fn();
    running.clear();
    return n;
  }
  // Before a sleep in the kernel: false (and not asleep) when something was posted meanwhile.
  bool fall_asleep() {
    asleep.store(true, std::memory_order_seq_cst);
    if (ready_any.load(std::memory_order_seq_cst)) {
      asleep.store(false, std::memory_order_relaxed);
      return false;
    }
    return true;
  }

  // Work for the turn that next asks the kernel (before_kernel_poll), loop thread only: a TCP stream's
  // first try at a read waits here, so that the try comes after what the loop had to do first (the
  // handlers of the frame just read, the sends of the operations they started) and replaces a kernel
  // poll instead of adding one (bench/RESULTS.md, "The per-operation floor").
  std::vector<std::function<bool()>> before_poll;
  std::vector<std::function<bool()>> before_poll_running;
  std::size_t run_before_poll() {
    if (before_poll.empty()) return 0;
    before_poll_running.swap(before_poll);
    PollingHere here(this);
    std::size_t found = 0;
    for (auto& fn : before_poll_running) found += fn() ? 1 : 0;
    before_poll_running.clear();
    return found;
  }

  // Memory-only event sources (add_poller), loop thread only.
  std::vector<std::pair<std::uint64_t, std::shared_ptr<Loop::Poller>>> pollers;
  Clock::time_point kernel_polled{};  // while pollers spin, the kernel is asked only every kernel_every
  static constexpr std::chrono::microseconds kernel_every{10};
  static constexpr std::chrono::microseconds kernel_at_most{50};
  // Message sources only the kernel reports (count_kernel_sources): without one, a spinning turn whose
  // pollers find nothing asks the kernel only every kernel_at_most (timers, the shm peers' unix
  // sockets, which only say that a peer ended, and posts through Asio can wait that long).
  std::atomic<int> kernel_sources{0};

  std::size_t run_pollers() {
    PollingHere here(this);
    std::size_t found = 0;
    for (std::size_t i = 0; i < pollers.size(); ++i) found += pollers[i].second->poll();
    return found;
  }
  // Before a sleep in the kernel: every poller announces it; false when one found work meanwhile (the
  // others are disarmed again, and the loop does not sleep).
  bool arm_pollers() {
    PollingHere here(this);
    for (std::size_t i = 0; i < pollers.size(); ++i) {
      if (pollers[i].second->arm()) {
        for (std::size_t j = 0; j <= i; ++j) pollers[j].second->disarm();
        return false;
      }
    }
    return true;
  }
  void disarm_pollers() {
    PollingHere here(this);
    for (auto& [id, poller] : pollers) poller->disarm();
  }

  // One turn of the loop, split in reap and wait: when `polling`, reap ready handlers without sleeping
  // (poll) until `spin_now` passes without an event; otherwise wait in the kernel for
  // the next one (at most `max_wait`; zero: as long as it takes).
  //
  // The bound adapts: a poll that found nothing for the whole bound halves it (down to spin/16), since
  // the peer is evidently busy elsewhere and polling only takes its core; an event that came late in the
  // bound doubles it (up to spin). Back-to-back collectives keep it at `spin`; a rank waiting on a peer
  // that computes between collectives polls for ever shorter stretches.
  //
  // `done` (the borrower's condition; null on the progress thread) is looked at after every handler of a
  // kernel poll: once it holds, the turn ends there instead of asking the kernel once more (the poll's
  // own last look), which would sit between a small collective's last message and its caller.
  void turn(Clock::time_point& last_work, bool polling, std::chrono::milliseconds max_wait,
            const std::function<bool()>* done = nullptr) {
    if (polling) {
      // One clock read per turn: a spinning turn is a few loads, and the clock is a good share of it
      // (33 ns on the EPYC VM, bench/RESULTS.md). Read before the look, not after it: a turn that finds
      // the awaited message then returns at once, instead of reading the clock between the message and
      // its waiter. (`now` is then a poll's length early, which no bound below can tell.)
      const auto now = Clock::now();
      std::size_t found = run_ready();
      found += pollers.empty() ? 0 : run_pollers();
      // A poll of the kernel costs a system call (about 0.5 us on a VM); posted work and memory pollers
      // cost nanoseconds and must not wait behind it on every turn. So the kernel is asked when the
      // turn found nothing else (with pollers, at most every kernel_every), and at least every
      // kernel_at_most whatever the others find, so that sockets and timers are never starved.
      const auto since = now - kernel_polled;
      const auto every = kernel_sources.load(std::memory_order_relaxed) > 0 ? kernel_every : kernel_at_most;
      if (since >= kernel_at_most || (found == 0 && (pollers.empty() || since >= every))) {
        const std::size_t early = run_before_poll();
        if (early == 0 || since >= kernel_at_most) {
          found += poll_kernel(done);
          kernel_polled = now;
        }
        found += early;
      }
      if (found > 0) {
        if (now - last_work > spin_now / 2) spin_now = std::min(spin, spin_now * 2);
        last_work = now;
        return;
      }
      if (now - last_work < spin_now) {
        if (yields.load(std::memory_order_relaxed)) {
          std::this_thread::yield();  // the rank this one waits for may need this core
        } else if (yield_when_preempted) {
          watch_preemption(now);
        }
        return;
      }
      spin_now = std::max(spin / 16, spin_now / 2);
    }
    if (run_ready() > 0 || run_before_poll() > 0) {
      last_work = Clock::now();
      return;
    }
    if (!pollers.empty() && !arm_pollers()) {
      // Work came while arming: take it now, and what the kernel has ready (a loop that does not poll
      // would otherwise spin on arm, and handlers posted meanwhile would wait behind it).
      run_pollers();
      poll_kernel(done);
      last_work = Clock::now();
      return;
    }
    if (fall_asleep()) {
      if (max_wait.count() > 0) {
        io->run_one_for(max_wait);
      } else {
        io->run_one();
      }
      asleep.store(false, std::memory_order_relaxed);
    }
    run_ready();
    if (!pollers.empty()) disarm_pollers();
    last_work = Clock::now();
  }

  // Polling that was not told to yield finds out by itself that its core is shared: a launcher that does
  // not say how many ranks share the host (simulated hosts in network namespaces, containers, a CPU quota)
  // leaves a poller that takes whole time slices from the rank it waits for. With 4 ranks on 2 cores in
  // namespaces an 8-byte all_reduce took 370 us that way against 70 us without polling (bench/RESULTS.md,
  // "Polling on a shared core"). The scheduler says so: a thread that polls and is preempted
  // (involuntary context switches, getrusage) again and again within a short stretch is taking a core
  // that another runnable thread wants; from then on this loop polls yielding. A rare preemption (a
  // kernel worker) does not count: it takes preempted_limit within preemption_window.
  static constexpr int preempted_limit = 3;
  static constexpr std::chrono::milliseconds preemption_window{100};
  static constexpr unsigned turns_per_look = 256;  // a look is a system call: one per few hundred turns
  void watch_preemption(Clock::time_point now) {
    PreemptionWatch& w = preemption_here;
    if (++w.turns % turns_per_look != 0 || w.pinned) return;
    rusage usage{};
    if (getrusage(RUSAGE_THREAD, &usage) != 0) return;
    const long switches = usage.ru_nivcsw;
    if (now - w.window_start > preemption_window) {
      w.window_start = now;
      w.preempted = 0;
    }
    if (w.switches >= 0 && switches > w.switches) ++w.preempted;
    w.switches = switches;
    if (w.preempted >= preempted_limit) {
      yields.store(true, std::memory_order_relaxed);
      weft::log().debug("loop: polling yields from now on: preempted {} times within {} ms while polling (a shared core)",
                 w.preempted, preemption_window.count());
    }
  }

  // io_context::poll, handler by handler: stops early once `done` holds or something was posted (the
  // ready queue runs first in a turn), or, on the progress thread (no `done`), once a borrower waits for
  // it to park; otherwise, as poll, until the kernel has nothing more, but at most poll_at_most handlers.
  // A turn must end: handlers that keep others ready (a timer of 0 ms re-armed by its handler, as
  // WEFT_HEARTBEAT=1ms made, docs/RELIABILITY.md; an application's handler that posts itself on the
  // loop's io_context) kept io_context::poll running for ever, and the pollers, the posted work and a
  // waiting caller with it.
  static constexpr std::size_t poll_at_most = 256;
  std::size_t poll_kernel(const std::function<bool()>* done) {
    std::size_t n = 0;
    while (n < poll_at_most && io->poll_one() > 0) {
      ++n;
      if (done ? (*done)() : (borrow.load(std::memory_order_relaxed) & borrowed_bit) != 0) break;
      if (ready_any.load(std::memory_order_acquire)) break;
    }
    return n;
  }

  // The progress thread: polls while operations are in flight, sleeps otherwise, and parks while a
  // waiting thread drives the loop.
  void run_progress() {
    auto last_work = Clock::now();
    while (!stopping.load(std::memory_order_relaxed)) {
      if (borrowed()) {
        park();
        last_work = Clock::now();
        continue;
      }
      turn(last_work, spin.count() > 0 && in_flight.load(std::memory_order_relaxed) > 0 && !cores_taken_by_compute(),
           std::chrono::milliseconds(0));
    }
    drain();
  }

  // Runs what was posted before the end (e.g. a transport whose last Group was released on the loop
  // thread is deleted by a posted handler, and must still close its connections). The progress thread
  // does it as its last act, so that handlers keep running on the loop's one thread (an io_uring ring
  // set up for a single issuer refuses any other); the destructor repeats it for what came later.
  void drain() {
    io->restart();
    for (int round = 0; round < 100 && run_ready() + run_before_poll() + io->poll() > 0; ++round) {
    }
  }

  // Runs `end` (a loop's last work on its own state: ~Loop) where no handler of the loop's runs beside
  // it. An owned loop's thread has stopped by then, and so has a borrowed io_context that ran out of
  // work (run() returned): here, at once. A borrowed io_context that other threads still run (a
  // server's pool) runs weft's handlers on the strand at the same time: there, and the destructor
  // waits for it (at once when this thread may enter the strand now: asio::dispatch). When nothing
  // takes it within end_grace, nobody may be running the io_context (a program that polls it now and
  // then, a static Loop ending at exit): this thread runs it, a handler at a time, until the end ran
  // (Asio lets several threads run one io_context; the strand keeps the loop's handlers apart). Only a
  // thread that is itself inside the io_context cannot: it waits up to end_wait, then ends the loop
  // here with a warning (its one runner would be this thread, busy in this destructor).
  static constexpr std::chrono::milliseconds end_grace{100};
  static constexpr std::chrono::seconds end_wait{5};
  void end_on_loop(const std::function<void()>& end) {
    if (!strand || io->stopped() || strand->running_in_this_thread()) {
      end();
      return;
    }
    struct Ending {
      std::atomic<bool> claimed{false};
      std::mutex mutex;
      std::condition_variable finished_cv;
      bool finished = false;  // guarded by mutex
    };
    auto ending = std::make_shared<Ending>();
    // `end` is reached only by the side that claims it; when the strand does, this thread waits for it.
    asio::dispatch(*strand, [ending, &end] {
      if (ending->claimed.exchange(true)) return;
      end();
      std::lock_guard lock(ending->mutex);
      ending->finished = true;
      ending->finished_cv.notify_all();
    });
    const auto finished_within = [&](auto limit) {
      std::unique_lock lock(ending->mutex);
      return ending->finished_cv.wait_for(lock, limit, [&] { return ending->finished; });
    };
    if (finished_within(end_grace)) return;
    const bool inside_io = io->get_executor().running_in_this_thread();
    if (!inside_io) {
      while (!finished_within(std::chrono::seconds(0)) && !io->stopped()) io->run_one_for(std::chrono::milliseconds(10));
      if (finished_within(std::chrono::seconds(0))) return;
    } else if (finished_within(end_wait)) {
      return;
    }
    if (ending->claimed.exchange(true)) {  // the strand took it meanwhile
      std::unique_lock lock(ending->mutex);
      ending->finished_cv.wait(lock, [&] { return ending->finished; });
      return;
    }
    // stderr, not the logger: a static Loop ends at exit, after the logger may have gone.
    if (inside_io) {
      std::fprintf(stderr,
                   "weft: a borrowed Loop ends inside a handler of its io_context, which ran none of the loop's "
                   "handlers within %lld s: the loop ends on this thread (end it outside the io_context's handlers)\n",
                   static_cast<long long>(end_wait.count()));
    }
    end();
  }

  template <class Fn>
  void on_loop(Fn&& fn) {
    if (running_here()) {
      fn();
    } else {
      asio::post(executor, std::forward<Fn>(fn));
    }
  }
};

namespace {
// The loop's tuning variables, each refused when malformed (core/env.hpp); WEFT_WAIT_SPIN_US is read
// lazily by Future::wait, which cannot throw, so it is checked here, before any Future exists, and so
// are the thread counts the compute pool and the device's host copies read when first used.
Loop::Options options_from_environment() {
  (void)detail::env_microseconds("WEFT_WAIT_SPIN_US", {});
  (void)detail::env_count("WEFT_COMPUTE_THREADS", 0, 1, 1024);
  (void)detail::env_count("WEFT_COPY_THREADS", 0, 1, 64);
  return Loop::Options{default_spin(), default_caller_drives(), default_yield(), default_yield_when_preempted()};
}
}  // namespace

Loop::Loop() : Loop(options_from_environment()) {}

Loop::Loop(Options options) : impl_(std::make_unique<Impl>()), alive_(impl_->alive) {
  impl_->owned_io = std::make_unique<asio::io_context>(1);
  impl_->io = impl_->owned_io.get();
  impl_->executor = impl_->io->get_executor();
  impl_->spin = options.spin;
  impl_->spin_now = options.spin;
  impl_->caller_drives = options.caller_drives;
  impl_->yields = options.yield_while_polling;
  impl_->yield_when_preempted = options.yield_when_preempted;
  impl_->keep_running.emplace(impl_->io->get_executor());
  impl_->progress_thread = std::thread([impl = impl_.get()] { impl->run_progress(); });
  register_loop(this);
}

Loop::Loop(asio::io_context& io) : impl_(std::make_unique<Impl>()), alive_(impl_->alive) {
  impl_->io = &io;
  impl_->strand.emplace(asio::make_strand(io));
  impl_->executor = *impl_->strand;
  register_loop(this);
}

struct Loop::Linger::Count {
  std::mutex mutex;
  std::condition_variable released;
  int held = 0;  // guarded by mutex
};

Loop::Linger::~Linger() {
  if (!count_) return;
  std::lock_guard lock(count_->mutex);
  if (--count_->held == 0) count_->released.notify_all();
}

Loop::Linger& Loop::Linger::operator=(Linger&& other) noexcept {
  if (this != &other) {
    Linger dropped(std::move(*this));
    count_ = std::move(other.count_);
  }
  return *this;
}

namespace detail {

void set_uring_wants_one_thread(bool (*answer)()) noexcept { uring_wants_one_thread.store(answer, std::memory_order_release); }
void loop_user_added(const Loop& loop) noexcept {
  std::lock_guard lock(loops_mutex);
  ++loop_users()[&loop];
}
std::uint64_t add_end_hook(const Loop& loop, std::function<void()> hook, std::function<bool()> flushing) {
  std::lock_guard lock(loops_mutex);
  const std::uint64_t id = end_hooks().next++;
  end_hooks().by_loop[&loop].push_back(EndHook{id, std::move(hook), std::move(flushing)});
  return id;
}
void while_busy(Loop& loop, std::function<bool()> busy, std::chrono::steady_clock::time_point until,
                std::shared_ptr<Loop::Linger> linger, std::function<void(bool loop_running)> done) {
  if (!busy() || std::chrono::steady_clock::now() >= until) {
    done(true);
    return;
  }
  // `done(false)` when the loop ends first: its end destroys the timer's callback uncalled.
  struct DoneOnce {
    explicit DoneOnce(std::function<void(bool)> fn) : done(std::move(fn)) {}  // (clang: no aggregate make_shared)
    std::function<void(bool)> done;
    ~DoneOnce() {
      if (done) done(false);
    }
  };
  loop.call_after(std::chrono::milliseconds(1), [&loop, busy = std::move(busy), until, linger = std::move(linger),
                                                 once = std::make_shared<DoneOnce>(std::move(done))](bool fired) mutable {
    if (fired) {
      while_busy(loop, std::move(busy), until, std::move(linger), std::exchange(once->done, {}));
    } else {  // the loop is ending
      std::exchange(once->done, {})(false);
    }
  });
}
bool loop_ending(const Loop& loop) noexcept { return LoopExecutor::ending(loop); }
void remove_end_hook(const Loop& loop, std::uint64_t id) noexcept {
  std::lock_guard lock(loops_mutex);
  const auto found = end_hooks().by_loop.find(&loop);
  if (found == end_hooks().by_loop.end()) return;
  std::erase_if(found->second, [id](const EndHook& entry) { return entry.id == id; });
  if (found->second.empty()) end_hooks().by_loop.erase(found);
}
void loop_user_removed(const Loop& loop) noexcept {
  std::lock_guard lock(loops_mutex);
  const auto found = loop_users().find(&loop);
  if (found != loop_users().end() && --found->second <= 0) loop_users().erase(found);
}
}  // namespace detail

Loop::Linger Loop::linger() {
  std::lock_guard lock(impl_->lingering->mutex);
  ++impl_->lingering->held;
  return Linger(impl_->lingering);
}

Loop::~Loop() {
  {
    std::lock_guard lock(loops_mutex);
    const auto found = loop_users().find(this);
    if (found != loop_users().end() && found->second > 0) {
      // Nothing can be made safe from here: the Group's sockets would outlive their io_context.
      std::fprintf(stderr,
                   "weft: a Loop is destroyed while %d Group(s) still run on it: destroy every Group before its "
                   "Loop (a class holding both must declare the Loop first); stopping the process\n",
                   found->second);
      std::fflush(stderr);
      std::abort();
    }
    loop_users().erase(this);
  }
  if (impl_->progress_thread.joinable()) {
    // Frames the end hooks still flush (an abort queued behind a data frame): a Linger, like other work.
    // The Linger is taken here, before the post, so that the wait below counts it from the start.
    post([this, until = std::chrono::steady_clock::now() + detail::end_flush_limit, held = std::make_shared<Linger>(linger())] {
      detail::while_busy(*this, [this] { return any_hook_flushing(*this); }, until, held, [](bool) {});
    });
    // Work the loop's tasks finish (Linger): the progress thread runs them before it stops.
    Linger::Count& count = *impl_->lingering;
    std::unique_lock lock(count.mutex);
    if (!count.released.wait_for(lock, std::chrono::seconds(30), [&] { return count.held == 0; })) {
      log().warn("a loop ends with {} piece(s) of lingering work after 30 s (device work that never completed?); "
                 "what they hold stays allocated", count.held);
    }
  }
  unregister_loop(this);
  if (impl_->progress_thread.joinable()) {
    {
      std::lock_guard lock(impl_->driver_mutex);
      impl_->stopping.store(true);
    }
    impl_->driver_cv.notify_all();
    asio::post(*impl_->io, [] {});
    impl_->progress_thread.join();
    impl_->drain();  // what was posted after the progress thread's own drain (nothing runs concurrently)
  }
  // The groups' transports end (their end hooks), and the timers and watches: on the loop's thread,
  // which for a borrowed loop whose io_context still runs means its strand (Impl::end_on_loop).
  impl_->end_on_loop([this] {
    impl_->ending.store(true, std::memory_order_release);
    // One at a time, each taken out under the lock as it runs: a hook may end what another hook names
    // (a group's state lets its transport go, whose deletion removes the transport's own hook).
    for (;;) {
      EndHook hook;
      {
        std::lock_guard lock(loops_mutex);
        const auto found = end_hooks().by_loop.find(this);
        if (found == end_hooks().by_loop.end()) break;
        hook = std::move(found->second.front());
        found->second.erase(found->second.begin());
        if (found->second.empty()) end_hooks().by_loop.erase(found);
      }
      hook.end();
    }
    // What the hooks posted (a store's close, a ring's poller leaving): an owned loop's thread has
    // stopped, so here; a borrowed io_context runs it on the strand after this.
    if (impl_->owned_io) impl_->drain();
    // The timers' callbacks left go now, uncalled, while the loop lives (what they hold may end work
    // on it: detail::while_busy); handlers still queued in a borrowed io_context find nothing.
    std::unordered_map<std::uint64_t, Registry::Timer> timers = std::move(impl_->registry->timers);
    impl_->registry->timers.clear();
    timers.clear();
    impl_->registry.reset();
    // Operations still in flight never complete now (a Task suspended on this loop, a sleep): a wait on
    // their Futures fails (alive_word) instead of driving a loop that is gone, and this says so first.
    if (const int left = impl_->in_flight.load(std::memory_order_relaxed); left > 0) {
      log().warn("a Loop ends with {} operation(s) in flight: they will not complete, and a wait on their Futures "
                 "fails (end a Loop after what runs on it)", left);
    }
    // From here on what the loop's objects do as they go (a stream that a borrowed io_context's aborted
    // handler frees later, on its strand, after this) leaves the loop alone: they look at this word.
    impl_->alive->store(false, std::memory_order_release);
  });
  { std::lock_guard wait_for_posters(impl_->ready_mutex); }
  impl_->keep_running.reset();
}

asio::io_context& Loop::context() noexcept { return *impl_->io; }
asio::any_io_executor detail::LoopExecutor::of(Loop& loop) noexcept { return loop.impl_->executor; }
bool detail::LoopExecutor::ending(const Loop& loop) noexcept { return loop.impl_->ending.load(std::memory_order_acquire); }
bool Loop::owns_thread() const noexcept { return impl_->progress_thread.joinable(); }
bool Loop::on_progress_thread() const noexcept {
  return impl_->progress_thread.joinable() && impl_->progress_thread.get_id() == std::this_thread::get_id();
}
bool Loop::in_loop_thread() const noexcept {
  return impl_->running_here() || polling_loop == impl_.get();
}
bool Loop::wait_would_block_it() const noexcept {
  return in_loop_thread() || (impl_->strand && impl_->io->get_executor().running_in_this_thread());
}
Loop* Loop::current() noexcept {
  std::lock_guard lock(loops_mutex);
  for (Loop* loop : live_loops()) {
    if (loop->in_loop_thread()) return loop;
  }
  return nullptr;
}

bool Loop::single_thread() const noexcept { return impl_->progress_thread.joinable() && !impl_->caller_drives; }

bool Loop::drive_until(const std::function<bool()>& done) {
  Impl& im = *impl_;
  if (!im.caller_drives || !im.progress_thread.joinable() || in_loop_thread() || im.stopping.load()) return false;
  std::uint64_t state = im.borrow.load(std::memory_order_relaxed);
  for (;;) {
    if (state & Impl::borrowed_bit) {
      // Held by another thread: refused, and the holder wakes the progress thread when it hands back.
      if (im.borrow.compare_exchange_weak(state, state | Impl::refused_bit, std::memory_order_relaxed)) return false;
    } else if (im.borrow.compare_exchange_weak(state, state | Impl::borrowed_bit, std::memory_order_acquire, std::memory_order_relaxed)) {
      break;
    }
  }
  auto last_work = Impl::Clock::now();
  im.drive_started.store(last_work.time_since_epoch().count(), std::memory_order_relaxed);
  bool driving = (state & Impl::parked_bit) != 0;
  if (!driving) {
    asio::post(*im.io, [] {});  // wakes the progress thread if it sleeps in run_one
    // It parks within microseconds when it is polling: wait for that without sleeping (a sleeping
    // waiter's wake-up costs tens of microseconds on a VM), for a bounded while, then sleep.
    const auto parked = [&] { return (im.borrow.load(std::memory_order_acquire) & Impl::parked_bit) != 0; };
    const auto until = last_work + std::chrono::microseconds(200);
    while (!parked() && Impl::Clock::now() < until) std::this_thread::yield();
    std::unique_lock lock(im.driver_mutex);
    im.driver_cv.wait(lock, [&] { return parked() || im.stopping.load(); });
    driving = parked();
    last_work = Impl::Clock::now();
  }
  if (driving) {
    // Poll within `spin` of the last event, else sleep in the kernel and look again. Everything that
    // completes the awaited operation reaches this thread's kernel wait (a socket, the eventfd of the
    // shared-memory rings and of posts), so the slice only bounds a look at done() that no event asks for.
    while (!done()) im.turn(last_work, !cores_taken_by_compute(), std::chrono::milliseconds(50), &done);
  }
  im.drive_started.store(Impl::no_borrow_start, std::memory_order_relaxed);
  im.hand_back(true);
  return driving;
}

bool Loop::run_here(void (*fn)(void*), void* arg) {
  Impl& im = *impl_;
  // Only a parked loop is borrowed here (one that runs is refused, and the caller posts): a load, a
  // compare-and-swap, and another at the hand-back.
  if (!im.caller_drives || !im.progress_thread.joinable()) return false;
  if ((im.borrow.load(std::memory_order_relaxed) & (Impl::parked_bit | Impl::borrowed_bit)) != Impl::parked_bit) return false;
  if (polling_loop == &im || im.running_here()) return false;
  if (!im.borrow_parked()) return false;
  if (im.stopping.load(std::memory_order_relaxed)) {
    im.hand_back(false);
    return false;
  }
  {
    PollingHere here(&im);
    // What this thread posted before (a start refused here a moment ago) runs first: two sends with
    // one key must leave in the order they were called (TSan's timing found a burst overtaken).
    im.run_ready();
    fn(arg);
  }
  // No grace for what fn left in flight: the caller usually waits on it next (a borrow of a parked thread
  // is cheap; one that must first park a running thread costs microseconds), and the parked thread looks
  // on its own within its tick, as for a post.
  im.hand_back(false);
  return true;
}

bool Loop::polls_yielding() const noexcept { return impl_->yields.load(std::memory_order_relaxed); }
bool Loop::polls() const noexcept { return impl_->spin.count() > 0 && !cores_taken_by_compute(); }

void Loop::operation_started() noexcept { impl_->in_flight.fetch_add(1, std::memory_order_relaxed); }
void Loop::operation_finished() noexcept { impl_->in_flight.fetch_sub(1, std::memory_order_relaxed); }

void Loop::before_kernel_poll(std::function<bool()> fn) {
  if (impl_->progress_thread.joinable()) {
    impl_->before_poll.push_back(std::move(fn));
  } else {
    asio::post(impl_->executor, [fn = std::move(fn)] { (void)fn(); });
  }
}

void Loop::count_kernel_sources(int delta) noexcept { impl_->kernel_sources.fetch_add(delta, std::memory_order_relaxed); }

std::uint64_t Loop::id() const noexcept { return impl_->id; }

bool Loop::post_if_alive(std::uint64_t id, std::function<void()> fn) {
  {
    // Held while posting: ~Loop unregisters under this lock first, so the loop cannot go meanwhile.
    std::lock_guard lock(loops_mutex);
    for (Loop* loop : live_loops()) {
      if (loop->impl_->id == id) {
        loop->post(std::move(fn));
        return true;
      }
    }
  }
  return false;  // `fn` is dropped here, outside the lock (it may hold what destroys another loop)
}

void Loop::post(std::function<void()> fn) {
  // An owned loop takes every post through its ready queue: from other threads, and from its own (the
  // shm streams post their completions), which would otherwise wait for the next kernel poll (up to
  // kernel_every while pollers spin). A borrowed io_context, whose turns are the user's, through Asio.
  if (impl_->progress_thread.joinable()) {
    impl_->post_ready(std::move(fn));
  } else {
    asio::post(impl_->executor, std::move(fn));
  }
}

std::uint64_t Loop::call_after(std::chrono::nanoseconds delay, std::function<void(bool)> fn) {
  const std::uint64_t id = impl_->next_id.fetch_add(1);
  std::weak_ptr<Registry> weak = impl_->registry;
  impl_->on_loop([executor = impl_->executor, weak, id, delay, fn = std::move(fn)]() mutable {
    auto registry = weak.lock();
    if (!registry) return;
    if (registry->cancelled_early.erase(id)) {
      fn(false);
      return;
    }
    auto timer = std::make_unique<asio::steady_timer>(executor, delay);
    timer->async_wait([weak, id](const std::error_code& ec) {
      auto registry = weak.lock();
      if (!registry) return;
      auto found = registry->timers.find(id);
      if (found == registry->timers.end()) return;
      std::function<void(bool)> callback = std::move(found->second.fn);
      registry->timers.erase(found);
      callback(!ec);
    });
    registry->timers.emplace(id, Registry::Timer{std::move(timer), std::move(fn)});
  });
  return id;
}

void Loop::cancel_timer(std::uint64_t id) {
  std::weak_ptr<Registry> weak = impl_->registry;
  impl_->on_loop([weak, id] {
    auto registry = weak.lock();
    if (!registry) return;
    auto it = registry->timers.find(id);
    if (it != registry->timers.end()) {
      it->second.timer->cancel();
    } else {
      registry->cancelled_early.insert(id);
    }
  });
}

std::uint64_t Loop::add_poller(std::shared_ptr<Poller> poller) {
  const std::uint64_t id = impl_->next_id.fetch_add(1);
  impl_->on_loop([impl = impl_.get(), id, poller = std::move(poller)]() mutable { impl->pollers.emplace_back(id, std::move(poller)); });
  return id;
}

void Loop::poll_memory() { impl_->run_pollers(); }

void Loop::remove_poller(std::uint64_t id) {
  impl_->on_loop([impl = impl_.get(), id] {
    std::erase_if(impl->pollers, [id](const auto& entry) { return entry.first == id; });
  });
}

std::uint64_t Loop::watch_readable(int fd, std::function<void()> on_readable) {
  const std::uint64_t id = impl_->next_id.fetch_add(1);
  const int own_fd = ::dup(fd);
  if (own_fd < 0) throw std::system_error(errno, std::generic_category(), "weft: watch_readable: dup");
  std::weak_ptr<Registry> weak = impl_->registry;
  impl_->on_loop([executor = impl_->executor, weak, id, own_fd, fn = std::move(on_readable)]() mutable {
    auto registry = weak.lock();
    if (!registry) {
      ::close(own_fd);
      return;
    }
    registry->watches.emplace(
        id, std::make_unique<Registry::Watch>(Registry::Watch{asio::posix::stream_descriptor(executor, own_fd), std::move(fn)}));
    arm_watch(weak, id);
  });
  return id;
}

void Loop::unwatch(std::uint64_t id) {
  std::weak_ptr<Registry> weak = impl_->registry;
  impl_->on_loop([weak, id] {
    if (auto registry = weak.lock()) registry->watches.erase(id);
  });
}

// ---- Future::wait's poll bound ----

std::chrono::microseconds detail::wait_spin() noexcept {
  static const std::chrono::microseconds value = [] {
    return detail::env_microseconds_or("WEFT_WAIT_SPIN_US", std::chrono::microseconds(0));
  }();
  return value;
}

detail::SleepSlot& detail::sleep_slot(const void* state) noexcept {
  // Never destroyed: a thread may still wait on a Future while the process's statics go.
  static constexpr std::size_t slots = 64;
  static SleepSlot* const table = new SleepSlot[slots];
  // States are allocated objects, so their low bits say little; drop them, then mix.
  const auto bits = reinterpret_cast<std::uintptr_t>(state) >> 6;
  return table[(bits ^ (bits >> 6) ^ (bits >> 12)) % slots];
}

void detail::throw_empty_future(const char* what) {
  throw Error(Errc::invalid_argument, ErrorContext{.op = std::string("Future::") + what},
              "this Future is empty (default-constructed or moved from): it has no operation");
}

void detail::throw_value_taken() {
  throw Error(Errc::invalid_argument, ErrorContext{.op = "Future::get"},
              "this Future's value was already taken: get() and co_await hand it over once");
}

void detail::throw_loop_gone(const char* what) {
  throw Error(Errc::invalid_argument, ErrorContext{.op = std::string("Future::") + what},
              "the Loop this operation runs on was destroyed before the operation completed: it never will "
              "(end a Loop only after the operations on it finished, or cancel and await them first)");
}

void detail::throw_wait_on_loop_thread(const char* what) {
  throw Error(Errc::would_deadlock, ErrorContext{.op = std::string("Future::") + what},
              "called on the thread that runs the operation's Loop (inside a Task, or the thread running a "
              "borrowed io_context), where the operation can only progress once this thread returns: it would "
              "wait for itself forever. co_await the Future there (or weft::async_wait from an asio coroutine), "
              "or wait from another thread");
}

// ---- sleep_for ----

struct SleepState {
  std::coroutine_handle<> waiter;
  std::uint64_t home = 0;  // the id of the loop the sleeper came from (Loop::current()), 0 for none
  // The timer's end against the start's registration of on_stop: sleeping on another thread's loop, the
  // timer may fire there before start() has registered it.
  std::mutex mutex;
  bool fired = false;       // the delay passed (not cancelled)
  bool ended = false;       // the timer ran, or its loop ended first
  bool loop_ended = false;  // the loop slept on ended before the timer ran
  std::optional<std::stop_callback<std::function<void()>>> on_stop;
};

namespace {
// Held by the timer's callback and every copy of it. When the last goes without the timer having run
// (its loop ended first: a loop's end drops its timers and queued work, it does not call them), the
// sleeper is resumed on the loop it came from, with an error, instead of staying suspended for ever.
// (Slept on its own loop, it has none to come back to: that Task ends with the loop, ~Loop.)
struct SleepPending {
  explicit SleepPending(std::shared_ptr<SleepState> s) : state(std::move(s)) {}
  SleepPending(const SleepPending&) = delete;
  SleepPending& operator=(const SleepPending&) = delete;
  ~SleepPending() {
    {
      std::lock_guard lock(state->mutex);
      if (state->ended) return;
      state->ended = true;
      state->loop_ended = true;
      state->on_stop.reset();  // its callback names the ended loop
    }
    const std::coroutine_handle<> waiter = state->waiter;
    if (state->home != 0) Loop::post_if_alive(state->home, [waiter] { waiter.resume(); });
  }
  std::shared_ptr<SleepState> state;
};
}  // namespace

void SleepFor::start(std::coroutine_handle<> h, std::stop_token token) {
  // From call_after on, only this call's own references: once the timer fires the coroutine may resume
  // on the loop's thread and free the awaiter (this) with its frame before this returns.
  auto state = std::make_shared<SleepState>();
  state->waiter = h;
  if (const Loop* home = Loop::current(); home && home != loop_) state->home = home->id();
  state_ = state;
  Loop* const loop = loop_;
  const std::uint64_t id = loop->call_after(delay_, [pending = std::make_shared<SleepPending>(state)](bool fired) {
    SleepState& s = *pending->state;
    {
      std::lock_guard lock(s.mutex);
      s.fired = fired;
      s.ended = true;
      s.on_stop.reset();
    }
    s.waiter.resume();
  });
  if (token.stop_possible()) {
    // (A token stopped already runs the callback here: cancel_timer posts, or cancels a timer whose
    // handler asio runs later; neither takes the mutex.)
    std::lock_guard lock(state->mutex);
    if (!state->ended) state->on_stop.emplace(token, std::function<void()>([loop, id] { loop->cancel_timer(id); }));
  }
}

void SleepFor::await_resume() {
  if (!state_ || state_->fired) return;
  if (state_->loop_ended) {
    throw CancelledError({.op = "sleep_for"}, "the Loop it slept on was destroyed before the delay passed");
  }
  throw CancelledError({.op = "sleep_for"}, "cancelled before the delay passed");
}

}  // namespace weft
