#pragma once
// The device layer's inside: one interface that the CUDA and the simulated backends implement, so that
// the public weft::gpu types (device.cpp) and everything above them hold no backend code.
//
// A stream's work is numbered: every queued item gets the next sequence number, a fence is a number, and
// a fence is reached once the item with that number ran (or the stream failed first). Completions come
// back through `notify`, called once from the backend's own thread; the public layer turns them into a
// Loop::post, so both backends complete through the same path into the loop.
#include <cstddef>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weft/buffer.hpp"
#include "weft/gpu.hpp"
#include "weft/loop.hpp"
#include "weft/reduce_op.hpp"

namespace weft::gpu::detail {

/// How many streams that went a backend keeps per device for the next ones made (a stream taken again
/// keeps its hardware queue: docs/DESIGN.md, "Hardware queues").
inline constexpr std::size_t max_pooled_streams = 64;

/// How many items a stream may have queued and not run before the next queueing waits
/// (StreamImpl::make_room): WEFT_GPU_STREAM_DEPTH, 64 where unset, 0 for no bound, at least
/// `min_stream_depth` otherwise (a smaller value is refused). Read once.
std::uint64_t stream_depth();
inline constexpr std::uint64_t min_stream_depth = 16;
/// How long a queueing waits for room before it fails with Errc::timeout: WEFT_TIMEOUT, the
/// operations' deadline (30 minutes where unset; 0: no bound). Read once.
std::chrono::milliseconds room_deadline();

enum class CopyKind : std::uint8_t { host_to_host, host_to_device, device_to_host, device_to_device };
std::string_view to_string(CopyKind kind) noexcept;

/// Called once when the fence is reached: with "" when it was, else with the failure's words.
using Notify = std::function<void(const std::string& failure)>;

/// A stream's record of how far it got, and who waits for what: the bookkeeping both backends share.
/// Not thread-safe by itself: its owner guards it with the stream's mutex, and calls the callbacks that
/// `ran` hands back after letting go of it.
class FenceBook {
 public:
  /// Whether `seq` was reached, or the stream failed at or before it (`failure` then gets the words).
  bool reached(std::uint64_t seq, std::string& failure) const {
    if (failed_at_ != 0 && seq >= failed_at_) {
      failure = failure_;
      return true;
    }
    return done_ >= seq;
  }
  /// Registers `fn` for `seq`; false (and `failure` set) when it is reached already: call it at once.
  bool wait(std::uint64_t seq, Notify& fn, std::string& failure) {
    if (reached(seq, failure)) return false;
    waiters_.emplace(seq, std::move(fn));
    return true;
  }
  /// Item `seq` ran (`why`: "" or its failure, which fails the stream from there on). Returns the waiters
  /// now due, with their words.
  std::vector<std::pair<Notify, std::string>> ran(std::uint64_t seq, const std::string& why) {
    if (seq > done_) done_ = seq;
    if (!why.empty()) fail(seq, why);
    std::vector<std::pair<Notify, std::string>> due;
    for (auto it = waiters_.begin(); it != waiters_.end();) {
      std::string words;
      if (!reached(it->first, words)) break;  // ordered by sequence number
      due.emplace_back(std::move(it->second), std::move(words));
      it = waiters_.erase(it);
    }
    return due;
  }
  /// The stream fails from `seq` on (the first failure stays).
  void fail(std::uint64_t seq, const std::string& why) {
    if (failed_at_ == 0) {
      failed_at_ = seq;
      failure_ = why;
    }
  }
  bool failed() const noexcept { return failed_at_ != 0; }
  const std::string& failure() const noexcept { return failure_; }
  std::uint64_t done() const noexcept { return done_; }

 private:
  std::uint64_t done_ = 0;       // the last item run (successfully or not)
  std::uint64_t failed_at_ = 0;  // the first item that failed (0: none)
  std::string failure_;
  std::multimap<std::uint64_t, Notify> waiters_;
};

/// A gate the host opens (weft::gpu::Gate): stream items queued after a wait on it run once it is open.
/// Opening is final and idempotent; thread-safe.
class GateState {
 public:
  void open() {
    std::vector<std::function<void()>> due;
    {
      std::lock_guard lock(mutex_);
      if (open_) return;
      open_ = true;
      due.swap(on_open_);
    }
    cv_.notify_all();
    for (auto& fn : due) fn();
  }
  bool is_open() const {
    std::lock_guard lock(mutex_);
    return open_;
  }
  /// Blocks the calling thread until the gate opens (the sim's worker).
  void block_until_open() {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return open_; });
  }
  /// Calls `fn` once the gate is open: at once when it is, else from the thread that opens it. `fn` must
  /// be short and must not call weft::gpu (the CUDA backend writes a word the device polls).
  void on_open(std::function<void()> fn) {
    {
      std::lock_guard lock(mutex_);
      if (!open_) {
        on_open_.push_back(std::move(fn));
        return;
      }
    }
    fn();
  }

 private:
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool open_ = false;                             // guarded
  std::vector<std::function<void()>> on_open_;    // guarded
};

struct PeerLaunch;  // peer_launch.hpp: what the device set hands the backend

class StreamImpl {
 public:
  StreamImpl(Loop& loop, int device) : loop_(&loop), device_(device) {}
  virtual ~StreamImpl() = default;
  StreamImpl(const StreamImpl&) = delete;
  StreamImpl& operator=(const StreamImpl&) = delete;

  Loop& loop() const noexcept { return *loop_; }
  int device() const noexcept { return device_; }

  // Each queues one item and returns its sequence number. Arguments were checked by the caller.
  virtual std::uint64_t copy(void* dst, const void* src, std::size_t bytes, CopyKind kind, int src_device,
                             int dst_device) = 0;
  virtual std::uint64_t reduce(void* inout, const void* src, std::size_t count, DType dtype, ReduceOp op) = 0;
  /// data[i] /= divisor (avg's division; integer division for integers).
  virtual std::uint64_t divide(void* data, std::size_t count, DType dtype, int divisor) = 0;
  /// out[i] = epilogue(in[i]) for `count` elements (in_type in, epilogue.output(in_type) out); the
  /// caller checked that the backend runs it (a custom's function for it exists).
  virtual std::uint64_t epilogue(const void* in, DType in_type, void* out, std::size_t count, const Epilogue& epilogue) = 0;
  /// `spins`: the function waits for other items' progress (the sim's peer kernels): FreesAfterSpins.
  virtual std::uint64_t host(std::function<void()> fn, bool spins = false) = 0;
  /// Queues this device's instance of the peer all_reduce kernel (the backends that run it on the
  /// device: cuda). Throws weft::Error (invalid_argument) elsewhere.
  virtual std::uint64_t peer_all_reduce(const PeerLaunch& launch);
  /// Later items wait until `other` reaches `seq` (other != this).
  virtual std::uint64_t wait(const std::shared_ptr<StreamImpl>& other, std::uint64_t seq) = 0;
  /// Later items wait until `gate` is open (the host's signal; the device does not block the host).
  virtual std::uint64_t wait_gate(const std::shared_ptr<GateState>& gate) = 0;
  /// The number of the last item queued (0 before the first): a fence after everything queued.
  virtual std::uint64_t last() = 0;

  /// Whether `seq` was reached or the stream failed first; `failure` gets the words in that case.
  virtual bool poll(std::uint64_t seq, std::string& failure) = 0;
  /// Calls `fn` once `seq` is reached (or failed), from the backend's thread, or at once from this one.
  virtual void notify(std::uint64_t seq, Notify fn) = 0;

  virtual void* native() noexcept { return nullptr; }

  /// Each backend calls it first when it queues an item, before any lock of its own: waits while the
  /// stream has `stream_depth()` items queued and not run, so that weft never fills a device's queue
  /// (docs/DESIGN.md, "A stream's depth"). A CUDA launch into a full queue blocks inside the driver
  /// holding a lock of the whole process, and another thread's call that would let the queue drain
  /// (a second rank of the process joining the collective its kernels wait for) then waits for that
  /// lock: the H200's deadlock of 2026-12-04. Here the caller waits outside every CUDA call and lock, on
  /// a condition variable (the loop's own thread does the loop's work meanwhile). Never waits on a
  /// thread that runs a loop (what drains the stream may be that loop's work), nor when the stream
  /// failed. Errors: timeout, when nothing made room within room_deadline() (nothing was queued).
  void make_room();

  /// The pinned memory that copies from and to pageable host memory are staged through (device.cpp),
  /// made on the first such copy.
  std::mutex pageable_mutex;
  std::shared_ptr<struct PageableSlot> pageable_slot;  // guarded by pageable_mutex

 private:
  Loop* loop_;
  int device_;
};

/// Frees while kernels spin (docs/DESIGN.md, "Frees and spinning kernels"). cudaFree and cudaFreeHost
/// wait for the whole device, and the runtime's calls from every other thread (launches, copies, event
/// queries) wait behind them meanwhile. A kernel that spins waits for the host (a gate, which a loop
/// opens) or for kernels not launched yet (the rest of a peer kernel group): a free queued behind it
/// never returns, and the launch or the loop that would let the kernel go waits for the free. So a free
/// runs only while no spinning kernel is queued, and no spinning kernel is queued while a free runs; a
/// free that comes while some are is kept, and run once the last of them completed. Thread-safe.
class FreesAfterSpins {
 public:
  /// Runs `free` now (holding off spinning kernels meanwhile) or keeps it for later.
  void release(std::function<void()> free) noexcept;
  /// Before a spinning kernel is queued (waits while a free runs).
  void begin_spin();
  /// Once a spinning kernel completed, or was not queued after all; hands the kept frees to a thread of
  /// their own when it was the last (the caller may be what they would wait for: a sim stream's worker).
  void end_spin() noexcept;

 private:
  std::mutex mutex_;
  int spinning_ = 0;                               // guarded: spinning kernels queued, not completed
  std::vector<std::function<void()>> kept_;        // guarded: frees that came while some were
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const noexcept = 0;
  virtual int device_count() = 0;
  virtual bool can_access_peer(int a, int b) = 0;

  virtual void* allocate(int device, std::size_t bytes) = 0;
  /// Waits for the device's queued work (as cudaFree), then frees.
  virtual void free(int device, void* data, std::size_t bytes) noexcept = 0;
  virtual void* allocate_pinned(std::size_t bytes) = 0;
  /// Where host code that runs as device work (the sim's workers) reaches device memory `p`; `p` itself
  /// where the host cannot reach it anyway (cuda) or it is host memory.
  virtual void* worker_address(const void* p) { return const_cast<void*>(p); }
  virtual void free_pinned(void* data, std::size_t bytes) noexcept = 0;

  /// Throws weft::Error (invalid_argument) unless [data, data + bytes) is memory of the kind `device`
  /// says (host memory, or memory of that device); `what` names the argument ("copy: dst").
  virtual void check_memory(const void* data, std::size_t bytes, Device device, const std::string& what) = 0;
  /// Whether host memory at `data` is pinned (copies from pageable memory are staged).
  virtual bool is_pinned(const void* data, std::size_t bytes) = 0;

  virtual std::shared_ptr<StreamImpl> make_stream(Loop& loop, int device) = 0;
  /// Lets kernels on `a` reach `b`'s memory (cudaDeviceEnablePeerAccess; enabled already counts): "" or
  /// why not. The sim's devices reach each other as can_access_peer says.
  virtual std::string enable_peer_access(int a, int b) {
    (void)a;
    (void)b;
    return {};
  }
  /// Device memory shared between processes of one host (CUDA IPC). export_memory: the bytes another
  /// process passes to import_memory (at most 96); import_memory maps that memory here and returns its
  /// address here (memory of `device` in this process), close_imported unmaps it. Errors: weft::Error
  /// (invalid_argument for memory that is not an allocation of this backend's, device_failure when the
  /// backend refuses).
  virtual std::vector<std::byte> export_memory(int device, void* data, std::size_t bytes) = 0;
  virtual void* import_memory(int device, const std::vector<std::byte>& handle, std::size_t bytes) = 0;
  virtual void close_imported(int device, void* data, std::size_t bytes) noexcept = 0;
  /// The device's multiprocessors (0 where the backend has none to count: the sim).
  virtual int multiprocessors(int device) {
    (void)device;
    return 0;
  }
  /// "" while the device works, else why it failed (sticky).
  virtual std::string failure(int device) = 0;
};

/// The process's backend (WEFT_GPU, chosen at first use).
Backend& backend();

std::unique_ptr<Backend> make_sim_backend();
/// nullptr, with the reason in `why_not`, where CUDA was not built or no device answers.
std::unique_ptr<Backend> make_cuda_backend(std::string& why_not);

/// "device 1 (sim)": how errors name a device.
std::string device_name(int device);

}  // namespace weft::gpu::detail
