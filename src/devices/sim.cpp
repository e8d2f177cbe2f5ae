// The simulated device: what CI runs every line of GPU host logic on (no GPU there).
//
// It is asynchronous for real, so ordering bugs show: every stream is a worker thread that runs its queue
// in order, after an optional random delay per item (WEFT_SIM_DELAY_US), while the host goes on; a copy
// may be given a copy engine's pace (WEFT_SIM_COPY_GBPS: it then sleeps what it has left). Device
// memory is host memory held in a registry, so that a host pointer passed as device memory, memory of
// another device, a buffer too short, or freed device memory are caught and named; freed blocks are
// poisoned and held back for a while (a quarantine) so that a late use reads poison instead of a new
// allocation. As on a GPU, the host cannot touch device memory: an allocation is one shared mapping seen
// twice, at the address handed out (no access: a host read or write of device memory faults here as it
// would under CUDA) and at a second address that only the streams' workers use (`worker_address`). WEFT_SIM_FAIL=<n> fails the n-th item the process runs, and its device with it, for good
// (a sticky CUDA error): the item, everything after it on the device's streams, and waits on them fail.
#include <algorithm>
#include <cerrno>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <random>
#include <string_view>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include "core/log.hpp"
#include "devices/backend.hpp"
#include "kernels/cpu/epilogue.hpp"
#include "kernels/cpu/reduce.hpp"
#include "weft/error.hpp"

namespace weft::gpu::detail {
namespace {

constexpr std::byte poison{0xDB};
constexpr std::size_t alignment = 256;  // cudaMalloc's guarantee
constexpr std::size_t quarantine_bytes = 64u << 20;
constexpr std::size_t quarantine_blocks = 1024;  // each holds two mappings, and a process has ~65,000

long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 0) {
    throw Error(Errc::invalid_argument, {.op = "gpu"}, fmt::format("{}={} is not a non-negative integer", name, v));
  }
  return n;
}

// WEFT_SIM_COPY_GBPS (a decimal number; 0 or unset: copies run at memcpy's pace), in MB/s.
long copy_mbps() {
  static const long mbps = [] {
    const char* v = std::getenv("WEFT_SIM_COPY_GBPS");
    if (!v || !*v) return 0L;
    char* end = nullptr;
    const double gbps = std::strtod(v, &end);
    if (*end != '\0' || !(gbps >= 0) || gbps > 1e6) {
      throw Error(Errc::invalid_argument, {.op = "gpu"}, fmt::format("WEFT_SIM_COPY_GBPS={} is not a rate in GB/s", v));
    }
    return static_cast<long>(gbps * 1000);
  }();
  return mbps;
}

class SimBackend;

/// Where a stream's worker reads and writes `p`: the second view of a device allocation, or `p` itself
/// for host memory (defined below, with the backend's registry).
void* worker_address(SimBackend& backend, const void* p);
bool host_pinned(SimBackend& backend, const void* p, std::size_t bytes);
/// The runtime's lock as the sim plays it: every queueing holds it shared, a free holds it alone while it
/// waits for the device (as cudaFree holds the CUDA runtime: other threads' calls wait behind it).
std::shared_mutex& runtime_lock(SimBackend& backend);
/// WEFT_SIM_QUEUE_DEPTH=D (with WEFT_SIM_QUEUES): a hardware queue holds D items at most, and a
/// queueing into a full one waits for room holding `driver_lock`, which every queueing takes: as a CUDA
/// launch or event record into a full queue blocks inside the driver under a lock of the whole process,
/// so that every other thread's CUDA call waits too (the H200, 2026-12-04: docs/DESIGN.md, "A stream's
/// depth"). 0: queues without bound, and no such lock.
long queue_depth(SimBackend& backend);
std::mutex& driver_lock(SimBackend& backend);
FreesAfterSpins& frees_of(SimBackend& backend);
class SimQueue;
/// WEFT_SIM_D2D_SYNC=1, an experiment (bench/RESULTS.md, 2026-11-28): a copy between two addresses of
/// one device makes the device's later work wait for all its earlier work, as the CUDA programming
/// guide lists such a cudaMemcpyAsync among the implicit synchronizations. `implicit_waits`: what a push
/// on `self` must wait for first (empty unless set).
std::vector<std::pair<std::shared_ptr<SimQueue>, std::uint64_t>> implicit_waits(SimBackend& backend, int device, const SimQueue* self);
void implicit_barrier(SimBackend& backend, int device);
/// A stream went: its hardware queue may serve the next stream made (WEFT_SIM_QUEUES; as weft's CUDA
/// streams, which are pooled: CudaBackend::take_stream).
void stream_gone(SimBackend& backend, const std::shared_ptr<SimQueue>& queue);
/// Held by a spinning item's function: the spin ends when the function goes (ran, or skipped by a
/// failed stream).
std::shared_ptr<void> spin_guard(SimBackend& backend) {
  frees_of(backend).begin_spin();
  return std::shared_ptr<void>(nullptr, [&backend](void*) { frees_of(backend).end_spin(); });
}

/// WEFT_SIM_QUEUES=N: a device's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS), which the sim plays
/// only when asked. A device spreads its streams over its queues in the order they were made, and a
/// queue dispatches its items in the order they were queued, whatever stream they came from: an item
/// whose stream has not finished its previous one (the copy after a gate that spins) holds every item
/// queued behind it on that queue, of any stream. Kernels and copies leave the queue once dispatched (a
/// gate spins without holding it); waits for another stream's fence and host functions hold it until
/// they are done, as a semaphore acquire in the queue does. This is what made eight ranks on one H100
/// hang with 8 queues (docs/DESIGN.md, "Hardware queues").
std::string running_on(const std::shared_ptr<SimQueue>& queue);  // what its worker runs (or ran last)

class Lane {
 public:
  /// Called under the queue's own lock, so `seq` (that queue's next) enters in the queue's order.
  void enter(const std::shared_ptr<SimQueue>& queue, std::uint64_t seq, const std::string& what) {
    std::lock_guard lock(mutex_);
    order_.push_back(Ticket{queue.get(), queue, seq, what});
  }
  /// The worker of `queue` waits until its item `seq` is the first of the lane. One held long names
  /// what holds it (as a free that waits long does).
  void wait_turn(const SimQueue* queue, std::uint64_t seq, int device) {
    std::unique_lock lock(mutex_);
    const auto turn = [&] { return !order_.empty() && order_.front().queue == queue && order_.front().seq == seq; };
    if (turn_cv_.wait_for(lock, std::chrono::seconds(10), turn)) return;
    std::string mine = "?";
    for (const Ticket& t : order_) {
      if (t.queue == queue && t.seq == seq) mine = t.what;
    }
    const std::string ahead = order_.front().what;  // not empty: this item is in it
    const std::weak_ptr<SimQueue> ahead_queue = order_.front().owner;
    const std::size_t queued = order_.size();
    lock.unlock();  // a queue's lock is taken before a lane's (enter), never after
    const std::shared_ptr<SimQueue> held = ahead_queue.lock();
    weft::log().warn("sim: '{}' has waited 10 s on a hardware queue of {} behind '{}' of another stream, whose stream still runs '{}' "
                     "({} items queued there)",
                     mine, device_name(device), ahead, held ? running_on(held) : std::string("?"), queued);
    lock.lock();
    turn_cv_.wait(lock, turn);
  }
  /// WEFT_SIM_QUEUE_DEPTH: waits while the queue holds `depth` items (a full queue). The caller holds the
  /// driver's lock meanwhile, so one held long says what every other thread's queueing waits for.
  void wait_for_room(std::size_t depth, int device, const std::string& what) {
    std::unique_lock lock(mutex_);
    const auto room = [&] { return order_.size() < depth; };
    if (turn_cv_.wait_for(lock, std::chrono::seconds(10), room)) return;
    const std::string first = order_.front().what;
    lock.unlock();
    weft::log().warn("sim: queueing '{}' has waited 10 s for room in a full hardware queue of {} ({} items, the first '{}'), "
                     "holding the driver's lock as CUDA does: every other queueing of the process waits too",
                     what, device_name(device), depth, first);
    lock.lock();
    turn_cv_.wait(lock, room);
  }
  /// The first item leaves: dispatched (kernels, copies) or done (waits, host functions).
  void leave() {
    {
      std::lock_guard lock(mutex_);
      order_.pop_front();
    }
    turn_cv_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable turn_cv_;
  struct Ticket {
    const SimQueue* queue;
    std::weak_ptr<SimQueue> owner;
    std::uint64_t seq;
    std::string what;
  };
  std::deque<Ticket> order_;  // guarded: items in the order queued
};

/// A stream's queue and worker. The worker thread holds the queue (not the stream), so that a stream
/// can go at any time and from any thread, its queued work still runs, and no thread ever joins another
/// (a wait item holds the queue it waits on: two streams that waited on each other and went on two
/// workers would otherwise each join the other).
class SimQueue : public std::enable_shared_from_this<SimQueue> {
 public:
  SimQueue(SimBackend& backend, int device, std::shared_ptr<Lane> lane) : backend_(backend), device_(device), lane_(std::move(lane)) {}

  void start() {
    std::thread([self = shared_from_this()] { self->run_worker(); }).detach();
  }
  void stop() {
    std::lock_guard lock(mutex_);
    stopping_ = true;
    work_cv_.notify_all();
  }

  /// `holds_lane`: the item holds its hardware queue until done (Lane), not only until dispatched.
  std::uint64_t push(std::string what, std::function<std::string()> run, bool holds_lane = false) {
    for (auto& [waited, seq] : implicit_waits(backend_, device_, this)) {
      push_raw(fmt::format("implicit wait for fence {} of another stream", seq),
               [waited = std::move(waited), seq = seq] { return waited->block_until(seq); }, true);
    }
    return push_raw(std::move(what), std::move(run), holds_lane);
  }
  std::uint64_t push_raw(std::string what, std::function<std::string()> run, bool holds_lane) {
    std::shared_lock runtime(runtime_lock(backend_));
    std::unique_lock<std::mutex> driver;
    if (const long depth = queue_depth(backend_); depth > 0 && lane_) {
      driver = std::unique_lock(driver_lock(backend_));
      lane_->wait_for_room(static_cast<std::size_t>(depth), device_, what);
    }
    std::lock_guard lock(mutex_);
    const std::uint64_t seq = ++queued_;
    if (lane_) lane_->enter(shared_from_this(), seq, what);
    queue_.push_back(Item{seq, std::move(what), std::move(run), holds_lane});
    work_cv_.notify_one();
    return seq;
  }
  std::uint64_t last() {
    std::lock_guard lock(mutex_);
    return queued_;
  }
  bool poll(std::uint64_t seq, std::string& failure) {
    std::lock_guard lock(mutex_);
    return book_.reached(seq, failure);
  }
  void notify(std::uint64_t seq, Notify fn) {
    std::string failure;
    {
      std::lock_guard lock(mutex_);
      if (book_.wait(seq, fn, failure)) return;
    }
    fn(failure);
  }
  /// For a wait item of another stream: blocks that stream's worker until this one reaches `seq`.
  std::string block_until(std::uint64_t seq) {
    std::unique_lock lock(mutex_);
    std::string failure;
    reached_cv_.wait(lock, [&] { return book_.reached(seq, failure); });
    return failure.empty() ? std::string() : fmt::format("the stream it waited for failed: {}", failure);
  }
  /// Blocks until everything queued so far ran (DeviceBuffer's free).
  void drain() {
    std::unique_lock lock(mutex_);
    const std::uint64_t target = queued_;
    // A free that waits long names what it waits for (a gate nobody opens is a deadlock in the making:
    // freeing device memory waits for the whole device, as cudaFree does).
    if (!reached_cv_.wait_for(lock, std::chrono::seconds(10), [&] { return book_.done() >= target; })) {
      std::string held = fmt::format("running '{}'", running_);
      for (std::size_t k = 0; k < queue_.size() && k < 3; ++k) held += fmt::format(", then '{}'", queue_[k].what);
      weft::log().warn("sim: freeing memory of {} has waited 10 s for a stream of it: {}", device_name(device_), held);
      reached_cv_.wait(lock, [&] { return book_.done() >= target; });
    }
  }
  int device() const noexcept { return device_; }
  const std::shared_ptr<Lane>& lane() const noexcept { return lane_; }
  /// Everything queued so far ran.
  bool idle() {
    std::lock_guard lock(mutex_);
    return book_.done() >= queued_;
  }
  std::string running() {
    std::lock_guard lock(mutex_);
    return running_;
  }

 private:
  struct Item {
    std::uint64_t seq = 0;
    std::string what;
    std::function<std::string()> run;  // "" or the failure's words
    bool holds_lane = false;
  };

  void run_worker();

  SimBackend& backend_;
  const int device_;
  const std::shared_ptr<Lane> lane_;  // WEFT_SIM_QUEUES: the hardware queue it shares; null without

  std::mutex mutex_;
  std::condition_variable work_cv_;     // the worker: work queued, or stopping
  std::condition_variable reached_cv_;  // streams waiting on this one, drain()
  std::deque<Item> queue_;              // guarded by mutex_
  std::string running_;                 // guarded by mutex_: what the worker runs (or ran last)
  std::uint64_t queued_ = 0;            // guarded: the last sequence number given out
  FenceBook book_;                      // guarded
  bool stopping_ = false;               // guarded
};

class SimStream final : public StreamImpl {
 public:
  SimStream(SimBackend& backend, Loop& loop, int device, std::shared_ptr<Lane> lane)
      : StreamImpl(loop, device), backend_(backend), queue_(std::make_shared<SimQueue>(backend, device, std::move(lane))) {
    queue_->start();
  }
  ~SimStream() override {
    queue_->stop();
    stream_gone(backend_, queue_);
  }

  std::uint64_t copy(void* dst, const void* src, std::size_t bytes, CopyKind kind, int src_device, int dst_device) override {
    make_room();
    const std::uint64_t seq = push_copy(dst, src, bytes, kind);
    if (kind == CopyKind::device_to_device && src_device == dst_device) implicit_barrier(backend_, device());
    // As cudaMemcpyAsync: a copy from the device into pageable memory returns only once it ran.
    if (kind == CopyKind::device_to_host && !host_pinned(backend_, dst, bytes)) queue_->block_until(seq);
    return seq;
  }
  std::uint64_t push_copy(void* dst, const void* src, std::size_t bytes, CopyKind kind) {
    return queue_->push(fmt::format("copy {} of {} bytes", to_string(kind), bytes), [this, dst, src, bytes] {
      const auto start = std::chrono::steady_clock::now();
      if (bytes > 0) std::memmove(worker_address(backend_, dst), worker_address(backend_, src), bytes);
      // A copy engine's pace (WEFT_SIM_COPY_GBPS): the worker sleeps what the copy has left, so the
      // copy takes time without taking a core, as DMA does.
      // (Not for what is left under 50 us: a sleep that short lasts the timer's slack and a wake-up,
      // far longer.)
      if (const long mbps = copy_mbps(); mbps > 0) {
        const auto end = start + std::chrono::nanoseconds(static_cast<long long>(bytes) * 1000 / mbps);
        if (end - std::chrono::steady_clock::now() > std::chrono::microseconds(50)) std::this_thread::sleep_until(end);
      }
      return std::string();
    });
  }
  std::uint64_t reduce(void* inout, const void* src, std::size_t count, DType dtype, ReduceOp op) override {
    make_room();
    const kernels::ReduceFn fn = kernels::find_reduce(dtype, op);
    return queue_->push(fmt::format("reduce {} {} of {} elements", to_string(op), to_string(dtype), count), [=, this] {
      if (count > 0) {
        void* at = worker_address(backend_, inout);
        fn(at, at, worker_address(backend_, src), count);
      }
      return std::string();
    });
  }
  std::uint64_t divide(void* data, std::size_t count, DType dtype, int divisor) override {
    make_room();
    return queue_->push(fmt::format("divide {} elements of {} by {}", count, to_string(dtype), divisor), [=, this] {
      if (count > 0) kernels::divide_in_place(worker_address(backend_, data), count, dtype, divisor);
      return std::string();
    });
  }
  std::uint64_t epilogue(const void* in, DType in_type, void* out, std::size_t count, const Epilogue& epilogue) override {
    make_room();
    return queue_->push(fmt::format("epilogue {} on {} elements of {}", epilogue.describe(), count, to_string(in_type)),
                        [=, this] {
                          if (count == 0) return std::string();
                          const void* src = worker_address(backend_, in);
                          void* dst = worker_address(backend_, out);
                          if (const EpilogueFunctions* fns = epilogue.functions()) {
                            // A user's function that throws fails the item (and the device, as a kernel
                            // that traps fails its context), instead of ending the process.
                            try {
                              fns->host(fns->functor.get(), src, dst, 0, count);
                            } catch (const std::exception& e) {
                              return fmt::format("the epilogue {} threw: {}", epilogue.describe(), e.what());
                            } catch (...) {
                              return fmt::format("the epilogue {} threw", epilogue.describe());
                            }
                          } else {
                            kernels::apply_epilogue(src, in_type, dst, epilogue.output(in_type), count, epilogue.factor());
                          }
                          return std::string();
                        });
  }
  std::uint64_t host(std::function<void()> fn, bool spins) override {
    make_room();
    std::shared_ptr<void> spin = spins ? spin_guard(backend_) : nullptr;
    // A host function holds its hardware queue while it runs; a spinning one stands for a kernel.
    return queue_->push("host function", [fn = std::move(fn), spin = std::move(spin)] {
      fn();
      return std::string();
    }, /*holds_lane=*/!spins);
  }
  std::uint64_t wait(const std::shared_ptr<StreamImpl>& other, std::uint64_t seq) override {
    make_room();
    std::shared_ptr<SimQueue> waited = static_cast<SimStream&>(*other).queue_;
    return queue_->push(fmt::format("wait for {}'s fence {}", device_name(other->device()), seq),
                        [waited, seq] { return waited->block_until(seq); }, /*holds_lane=*/true);
  }
  std::uint64_t wait_gate(const std::shared_ptr<GateState>& gate) override {
    make_room();
    return queue_->push("wait for the host's gate", [gate, spin = spin_guard(backend_)] {
      gate->block_until_open();
      return std::string();
    });
  }
  std::uint64_t last() override { return queue_->last(); }
  bool poll(std::uint64_t seq, std::string& failure) override { return queue_->poll(seq, failure); }
  void notify(std::uint64_t seq, Notify fn) override { queue_->notify(seq, std::move(fn)); }

  const std::shared_ptr<SimQueue>& queue() const noexcept { return queue_; }

 private:
  SimBackend& backend_;  // outlives every stream (the process's backend)
  std::shared_ptr<SimQueue> queue_;
};

class SimBackend final : public Backend {
 public:
  SimBackend()
      : devices_(static_cast<int>(env_long("WEFT_SIM_DEVICES", 2))),
        delay_us_(env_long("WEFT_SIM_DELAY_US", 0)),
        fail_at_(env_long("WEFT_SIM_FAIL", 0)),
        peer_access_(env_long("WEFT_SIM_P2P", 1) != 0),
        d2d_sync_(env_long("WEFT_SIM_D2D_SYNC", 0) != 0),
        hardware_queues_(env_long("WEFT_SIM_QUEUES", 0)),
        queue_depth_(env_long("WEFT_SIM_QUEUE_DEPTH", 0)),
        failures_(static_cast<std::size_t>(std::max(devices_, 0))) {
    (void)copy_mbps();  // read (and a bad value refused) here, not first on a stream's worker
  }

  std::string_view name() const noexcept override { return "sim"; }
  int device_count() override { return devices_; }
  bool can_access_peer(int a, int b) override { return a == b || peer_access_; }

  void* allocate(int device, std::size_t bytes) override {
    if (auto why = failure(device); !why.empty()) {
      throw Error(Errc::device_failure, {.op = "allocate"}, fmt::format("{} failed earlier: {}", device_name(device), why));
    }
    const std::size_t size = mapped_size(bytes);
    void* seen = MAP_FAILED;
    void* worker = MAP_FAILED;
    // The memory's file stays open while the block lives: it is what another process opens to share it
    // (export_memory, as CUDA IPC).
    const int fd = memfd_create("weft-sim-device", MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, static_cast<off_t>(size)) == 0) {
      seen = mmap(nullptr, size, PROT_NONE, MAP_SHARED, fd, 0);
      worker = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    }
    if (seen == MAP_FAILED || worker == MAP_FAILED) {
      if (seen != MAP_FAILED) munmap(seen, size);
      if (worker != MAP_FAILED) munmap(worker, size);
      if (fd >= 0) ::close(fd);
      throw Error(Errc::device_failure, {.op = "allocate"}, fmt::format("{}: out of memory for {} bytes", device_name(device), bytes));
    }
    std::memset(worker, 0xA5, size);  // uninitialised device memory is not zero: nothing may count on it
    std::lock_guard lock(mutex_);
    blocks_[reinterpret_cast<std::uintptr_t>(seen)] = Block{bytes, device, worker, fd, false};
    return seen;
  }
  void free(int device, void* data, std::size_t bytes) noexcept override {
    if (!data) return;
    frees_.release([this, device, data, bytes] { free_now(device, data, bytes); });
  }
  void free_now(int device, void* data, std::size_t bytes) noexcept {
    std::unique_lock runtime(runtime_);
    for (const auto& queue : queues_of(device)) queue->drain();
    std::lock_guard lock(mutex_);
    auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(data));
    if (it == blocks_.end()) return;
    void* worker = it->second.worker;
    if (it->second.fd >= 0) ::close(it->second.fd);
    blocks_.erase(it);
    std::memset(worker, static_cast<int>(poison), std::max<std::size_t>(bytes, 1));
    quarantine_.push_back({data, bytes, device, worker});
    quarantined_ += bytes;
    while ((quarantined_ > quarantine_bytes || quarantine_.size() > quarantine_blocks) && !quarantine_.empty()) {
      const Quarantined& q = quarantine_.front();
      quarantined_ -= q.bytes;
      munmap(q.data, mapped_size(q.bytes));
      munmap(q.worker, mapped_size(q.bytes));
      quarantine_.pop_front();
    }
  }

  // A handle is "weft-sim-ipc", the exporter's pid, the file's descriptor there, the size and the
  // device: the importer opens /proc/<pid>/fd/<fd> (same user, as CUDA IPC wants one host).
  struct IpcWords {
    char magic[12] = {'w', 'e', 'f', 't', '-', 's', 'i', 'm', '-', 'i', 'p', 'c'};
    std::int64_t pid = 0;
    std::int32_t fd = -1;
    std::int32_t device = 0;
    std::uint64_t bytes = 0;
  };
  std::vector<std::byte> export_memory(int device, void* data, std::size_t bytes) override {
    std::lock_guard lock(mutex_);
    auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(data));
    if (it == blocks_.end() || it->second.device != device || it->second.imported || it->second.bytes < bytes) {
      throw Error(Errc::invalid_argument, {.op = "export_memory"},
                  fmt::format("{} is not the start of an allocation of {} of {} bytes or more", data, device_name(device), bytes));
    }
    IpcWords words;
    words.pid = static_cast<std::int64_t>(::getpid());
    words.fd = it->second.fd;
    words.device = device;
    words.bytes = it->second.bytes;
    std::vector<std::byte> handle(sizeof words);
    std::memcpy(handle.data(), &words, sizeof words);
    return handle;
  }
  void* import_memory(int device, const std::vector<std::byte>& handle, std::size_t bytes) override {
    // As a platform that refuses CUDA IPC (containers without the right capabilities, MIG slices): what
    // the device windows' fallback is tested with.
    if (const char* refuse = std::getenv("WEFT_SIM_IPC_REFUSE"); refuse && std::string_view(refuse) == "1") {
      throw Error(Errc::device_failure, {.op = "import_memory"}, fmt::format("{}: IPC refused (WEFT_SIM_IPC_REFUSE=1)", device_name(device)));
    }
    IpcWords words;
    if (handle.size() != sizeof words) {
      throw Error(Errc::invalid_argument, {.op = "import_memory"}, fmt::format("a handle of {} bytes is not the sim's", handle.size()));
    }
    std::memcpy(&words, handle.data(), sizeof words);
    if (std::memcmp(words.magic, IpcWords{}.magic, sizeof words.magic) != 0 || words.bytes < bytes) {
      throw Error(Errc::invalid_argument, {.op = "import_memory"}, "not a handle of the sim's device memory, or shorter than asked");
    }
    if (words.device != device) {
      throw Error(Errc::invalid_argument, {.op = "import_memory"},
                  fmt::format("the handle is memory of {}, not of {}", device_name(words.device), device_name(device)));
    }
    const std::string path = fmt::format("/proc/{}/fd/{}", words.pid, words.fd);
    // The descriptor must still be the memory's file (a freed buffer's number may name another file now).
    char target[256] = {};
    const ssize_t length = ::readlink(path.c_str(), target, sizeof target - 1);
    if (length > 0 && std::string_view(target, static_cast<std::size_t>(length)).find("weft-sim-device") == std::string_view::npos) {
      throw Error(Errc::invalid_argument, {.op = "import_memory"},
                  fmt::format("{} is no longer device memory (the exporter freed it)", path));
    }
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      throw Error(Errc::device_failure, {.op = "import_memory"},
                  fmt::format("{}: cannot open {} ({}): the exporting process is gone, or not this user's", device_name(device), path,
                              std::strerror(errno)));
    }
    const std::size_t size = mapped_size(static_cast<std::size_t>(words.bytes));
    struct stat file {};
    if (::fstat(fd, &file) != 0 || static_cast<std::size_t>(file.st_size) < size) {
      ::close(fd);
      throw Error(Errc::invalid_argument, {.op = "import_memory"}, fmt::format("{} is no longer the memory the handle names", path));
    }
    void* seen = mmap(nullptr, size, PROT_NONE, MAP_SHARED, fd, 0);
    void* worker = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (seen == MAP_FAILED || worker == MAP_FAILED) {
      if (seen != MAP_FAILED) munmap(seen, size);
      if (worker != MAP_FAILED) munmap(worker, size);
      throw Error(Errc::device_failure, {.op = "import_memory"}, fmt::format("{}: cannot map {}", device_name(device), path));
    }
    std::lock_guard lock(mutex_);
    blocks_[reinterpret_cast<std::uintptr_t>(seen)] = Block{static_cast<std::size_t>(words.bytes), device, worker, -1, true};
    return seen;
  }
  void close_imported(int device, void* data, std::size_t bytes) noexcept override {
    frees_.release([this, device, data, bytes] { close_imported_now(device, data, bytes); });
  }
  void close_imported_now(int device, void* data, std::size_t) noexcept {
    std::unique_lock runtime(runtime_);
    for (const auto& queue : queues_of(device)) queue->drain();  // as cudaIpcCloseMemHandle: after the work on it
    std::lock_guard lock(mutex_);
    auto it = blocks_.find(reinterpret_cast<std::uintptr_t>(data));
    if (it == blocks_.end() || !it->second.imported) return;
    const std::size_t size = mapped_size(it->second.bytes);
    munmap(data, size);
    munmap(it->second.worker, size);
    blocks_.erase(it);
  }

  void* worker_address(const void* p) override { return worker_view(p); }

  /// The worker's view of `p` (see worker_address).
  void* worker_view(const void* p) {
    const auto at = reinterpret_cast<std::uintptr_t>(p);
    std::lock_guard lock(mutex_);
    auto it = blocks_.upper_bound(at);
    if (it != blocks_.begin()) {
      --it;
      if (at < it->first + mapped_size(it->second.bytes)) return static_cast<std::byte*>(it->second.worker) + (at - it->first);
    }
    return const_cast<void*>(p);
  }
  void* allocate_pinned(std::size_t bytes) override {
    void* p = std::aligned_alloc(alignment, std::max<std::size_t>(alignment, (bytes + alignment - 1) / alignment * alignment));
    if (!p) throw Error(Errc::device_failure, {.op = "allocate_pinned"}, fmt::format("out of memory for {} bytes", bytes));
    std::lock_guard lock(mutex_);
    pinned_[reinterpret_cast<std::uintptr_t>(p)] = bytes;
    return p;
  }
  void free_pinned(void* data, std::size_t bytes) noexcept override {
    if (data) frees_.release([this, data, bytes] { free_pinned_now(data, bytes); });
  }
  void free_pinned_now(void* data, std::size_t) noexcept {
    std::unique_lock runtime(runtime_);
    // cudaFreeHost waits for every device's queued work (gates too): so does the sim, so that a free on
    // a thread the work waits for hangs here as it would on a GPU.
    for (int d = 0; d < devices_; ++d) {
      for (const auto& queue : queues_of(d)) queue->drain();
    }
    {
      std::lock_guard lock(mutex_);
      pinned_.erase(reinterpret_cast<std::uintptr_t>(data));
    }
    std::free(data);
  }

  void check_memory(const void* data, std::size_t bytes, Device device, const std::string& what) override {
    const auto at = reinterpret_cast<std::uintptr_t>(data);
    std::lock_guard lock(mutex_);
    const Block* block = nullptr;
    std::uintptr_t base = 0;
    if (auto it = blocks_.upper_bound(at); it != blocks_.begin()) {
      --it;
      if (at < it->first + std::max<std::size_t>(it->second.bytes, 1)) {
        block = &it->second;
        base = it->first;
      }
    }
    if (device.kind == Device::Kind::host) {
      if (block) {
        throw Error(Errc::invalid_argument, {.op = what},
                    fmt::format("the view says host memory, but {} is memory of {}", data, device_name(block->device)));
      }
      return;
    }
    if (!block) {
      const bool freed = std::any_of(quarantine_.begin(), quarantine_.end(), [&](const Quarantined& q) {
        const auto b = reinterpret_cast<std::uintptr_t>(q.data);
        return at >= b && at < b + std::max<std::size_t>(q.bytes, 1);
      });
      throw Error(Errc::invalid_argument, {.op = what},
                  freed ? fmt::format("{} is device memory that was freed", data)
                        : fmt::format("the view says {}, but {} is not device memory (a host pointer?)",
                                      device_name(device.index), data));
    }
    if (block->device != device.index) {
      throw Error(Errc::invalid_argument, {.op = what},
                  fmt::format("the view says {}, but {} is memory of {}", device_name(device.index), data,
                              device_name(block->device)));
    }
    if (at + bytes > base + block->bytes) {
      throw Error(Errc::invalid_argument, {.op = what},
                  fmt::format("{} bytes from {} run past the end of its device allocation ({} bytes at {:#x})", bytes,
                              data, block->bytes, base));
    }
  }
  bool is_pinned(const void* data, std::size_t bytes) override {
    const auto at = reinterpret_cast<std::uintptr_t>(data);
    std::lock_guard lock(mutex_);
    auto it = pinned_.upper_bound(at);
    if (it == pinned_.begin()) return false;
    --it;
    return at >= it->first && at + bytes <= it->first + it->second;
  }

  std::shared_ptr<StreamImpl> make_stream(Loop& loop, int device) override {
    std::shared_ptr<Lane> lane;
    if (hardware_queues_ > 0) {
      std::lock_guard lock(mutex_);
      auto& lanes = lanes_[device];
      if (lanes.empty()) {
        for (long k = 0; k < hardware_queues_; ++k) lanes.push_back(std::make_shared<Lane>());
      }
      // A stream that went, idle, lends its queue, as a pooled CUDA stream keeps its own; otherwise
      // round robin in the order made, as CUDA spreads new streams.
      auto& gone = gone_[device];
      const auto idle = std::find_if(gone.begin(), gone.end(), [](const auto& q) { return q->idle(); });
      if (idle != gone.end()) {
        lane = (*idle)->lane();
        gone.erase(idle);
      } else {
        lane = lanes[streams_made_[device]++ % lanes.size()];
      }
    }
    auto stream = std::make_shared<SimStream>(*this, loop, device, std::move(lane));
    std::lock_guard lock(mutex_);
    std::erase_if(queues_, [](const auto& q) { return q.second.expired(); });
    queues_.emplace_back(device, stream->queue());
    return stream;
  }

  std::string failure(int device) override {
    std::lock_guard lock(mutex_);
    return failures_.at(static_cast<std::size_t>(device));
  }

  // --- for the streams' workers ---

  /// A random delay before each item, when WEFT_SIM_DELAY_US asks for one.
  void delay() {
    if (delay_us_ <= 0) return;
    thread_local std::minstd_rand random{std::random_device{}()};
    std::this_thread::sleep_for(std::chrono::microseconds(std::uniform_int_distribution<long>(0, delay_us_)(random)));
  }
  /// Counts the item; "" unless the device failed or this is the item WEFT_SIM_FAIL names.
  std::string fails(int device, const std::string& what) {
    const long n = ++items_run_;
    std::lock_guard lock(mutex_);
    auto& failure = failures_.at(static_cast<std::size_t>(device));
    if (failure.empty() && fail_at_ > 0 && n == fail_at_) {
      failure = fmt::format("injected failure (WEFT_SIM_FAIL={}) in {}", fail_at_, what);
    }
    return failure;
  }

  std::shared_mutex& runtime() noexcept { return runtime_; }
  long queue_depth() const noexcept { return queue_depth_; }
  std::mutex& driver() noexcept { return driver_; }
  FreesAfterSpins& frees() noexcept { return frees_; }
  // WEFT_SIM_D2D_SYNC's implicit synchronization: a copy within a device first marks every queue of that
  // device (set_barrier), and a queue's next item waits for the others to pass their marks (waits_of).
  void set_barrier(int device) {
    if (!d2d_sync_) return;
    const auto queues = queues_of(device);
    std::lock_guard lock(barrier_mutex_);
    auto& barrier = barriers_[device];
    barrier.clear();
    for (const auto& q : queues) barrier.emplace_back(q, q->last());
  }
  std::vector<std::pair<std::shared_ptr<SimQueue>, std::uint64_t>> waits_of(int device, const SimQueue* self) {
    std::vector<std::pair<std::shared_ptr<SimQueue>, std::uint64_t>> waits;
    if (!d2d_sync_) return waits;
    std::lock_guard lock(barrier_mutex_);
    for (const auto& [weak, seq] : barriers_[device]) {
      std::string failure;
      if (auto q = weak.lock(); q && q.get() != self && !q->poll(seq, failure)) waits.emplace_back(std::move(q), seq);
    }
    return waits;
  }

 private:
  std::shared_mutex runtime_;  // as the CUDA runtime's lock that frees hold (runtime_lock)
  std::mutex driver_;          // WEFT_SIM_QUEUE_DEPTH: the driver's lock that a queueing holds (driver_lock)
  FreesAfterSpins frees_;
  struct Block {
    std::size_t bytes;
    int device;
    void* worker;  // the second view, the only one the host may touch (the workers do)
    int fd = -1;   // the memory's file (export_memory); -1 for memory imported from another process
    bool imported = false;
  };
  struct Quarantined {
    void* data;
    std::size_t bytes;
    int device;
    void* worker;
  };

  static std::size_t mapped_size(std::size_t bytes) {
    static const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    return (std::max<std::size_t>(bytes, 1) + page - 1) / page * page;
  }

  std::vector<std::shared_ptr<SimQueue>> queues_of(int device) {
    std::vector<std::shared_ptr<SimQueue>> found;
    std::lock_guard lock(mutex_);
    for (const auto& [d, weak] : queues_) {
      if (d != device) continue;
      if (auto q = weak.lock()) found.push_back(std::move(q));
    }
    return found;
  }

  const int devices_;
  const long delay_us_;
  const long fail_at_;
  const bool peer_access_;
  const bool d2d_sync_;    // WEFT_SIM_D2D_SYNC=1 (implicit_waits)
  const long hardware_queues_;  // WEFT_SIM_QUEUES: 0, a stream's items wait for their stream alone (Lane)
  const long queue_depth_;      // WEFT_SIM_QUEUE_DEPTH: 0, no bound (queue_depth)
  std::mutex barrier_mutex_;
  std::map<int, std::vector<std::pair<std::weak_ptr<SimQueue>, std::uint64_t>>> barriers_;  // guarded

  std::atomic<long> items_run_{0};

  std::mutex mutex_;
  std::map<std::uintptr_t, Block> blocks_;       // guarded: live device allocations by address
  std::map<std::uintptr_t, std::size_t> pinned_;  // guarded
  std::deque<Quarantined> quarantine_;           // guarded: freed blocks, poisoned, not yet returned
  std::size_t quarantined_ = 0;                  // guarded
  std::vector<std::string> failures_;            // guarded: per device, "" while it works
  std::vector<std::pair<int, std::weak_ptr<SimQueue>>> queues_;  // guarded: the queues of live workers
  std::map<int, std::vector<std::shared_ptr<Lane>>> lanes_;         // guarded: each device's hardware queues
  std::map<int, std::size_t> streams_made_;                         // guarded: per device
  std::map<int, std::vector<std::shared_ptr<SimQueue>>> gone_;      // guarded: queues of streams that went

 public:
  void stream_gone(const std::shared_ptr<SimQueue>& queue) {
    if (!queue->lane()) return;
    std::lock_guard lock(mutex_);
    auto& gone = gone_[queue->device()];
    if (gone.size() < max_pooled_streams) gone.push_back(queue);
  }
};

void* worker_address(SimBackend& backend, const void* p) { return backend.worker_view(p); }
std::shared_mutex& runtime_lock(SimBackend& backend) { return backend.runtime(); }
long queue_depth(SimBackend& backend) { return backend.queue_depth(); }
std::mutex& driver_lock(SimBackend& backend) { return backend.driver(); }
std::vector<std::pair<std::shared_ptr<SimQueue>, std::uint64_t>> implicit_waits(SimBackend& backend, int device, const SimQueue* self) {
  return backend.waits_of(device, self);
}
void implicit_barrier(SimBackend& backend, int device) { backend.set_barrier(device); }
FreesAfterSpins& frees_of(SimBackend& backend) { return backend.frees(); }
void stream_gone(SimBackend& backend, const std::shared_ptr<SimQueue>& queue) { backend.stream_gone(queue); }
bool host_pinned(SimBackend& backend, const void* p, std::size_t bytes) { return backend.is_pinned(p, bytes); }

std::string running_on(const std::shared_ptr<SimQueue>& queue) { return queue->running(); }

void SimQueue::run_worker() {
  for (;;) {
    Item item;
    {
      std::unique_lock lock(mutex_);
      work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued ran
      item = std::move(queue_.front());
      queue_.pop_front();
      running_ = item.what;
    }
    if (lane_) {
      lane_->wait_turn(this, item.seq, device_);
      if (!item.holds_lane) lane_->leave();  // dispatched: the queue goes on to the next item
    }
    backend_.delay();
    bool failed = false;
    {
      std::lock_guard lock(mutex_);
      failed = book_.failed();  // a failed stream stays failed
    }
    std::string failure;
    if (!failed) failure = backend_.fails(device_, item.what);
    if (!failed && failure.empty()) failure = item.run();
    std::vector<std::pair<Notify, std::string>> ready;
    {
      std::lock_guard lock(mutex_);
      ready = book_.ran(item.seq, failure.empty() ? failure
                                                  : fmt::format("{} failed in {}: {}", device_name(device_), item.what, failure));
    }
    if (lane_ && item.holds_lane) lane_->leave();
    reached_cv_.notify_all();
    for (auto& [fn, words] : ready) fn(words);
  }
}

}  // namespace

std::unique_ptr<Backend> make_sim_backend() { return std::make_unique<SimBackend>(); }

}  // namespace weft::gpu::detail
