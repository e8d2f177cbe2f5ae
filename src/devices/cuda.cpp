// The CUDA backend: devices, memory and streams of the CUDA runtime, with completions brought back to the
// host off the driver's threads.
//
// Every queued item is followed by an event (cudaEventDisableTiming | cudaEventBlockingSync): the item's
// sequence number is that event. One completion thread per stream takes the events in order, learns that
// each was reached, marks the item done and calls the notifications, which post to the loop (device.cpp).
// How it learns it is the notifier, WEFT_CUDA_NOTIFIER (measured against each other in weft-gpu-bench):
//   poll      (the default) cudaEventQuery for 50 us (a completion soon after it is asked for costs no
//             sleep), then cudaEventSynchronize, which sleeps with the blocking-sync flag;
//   spin      cudaEventQuery until reached, yielding in between: no sleep ever, a core busy while any
//             work is queued (a closed gate too);
//   hostfunc  a host function queued after each event counts it and wakes the completion thread, which
//             then reads the event's status (cudaLaunchHostFunc; the host function makes no CUDA call).
// No CUDA call runs inside a host function: the others are Stream::enqueue_host's, which run the user's
// callable and nothing else.
//
// A CUDA error while queueing or completing fails the stream from that item on, with the error's words;
// a sticky error (the context is lost: illegal address, launch failure, ...) fails the device, and with
// it every later item of its streams.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "core/log.hpp"
#include "devices/backend.hpp"
#include "devices/peer_launch.hpp"
#include "kernels/cuda/gate.cuh"
#include "kernels/cuda/epilogue.cuh"
#include "kernels/cuda/peer.cuh"
#include "kernels/cuda/reduce.cuh"
#include "weft/error.hpp"

namespace weft::gpu::detail {
namespace {

std::string words(cudaError_t e) { return fmt::format("{} ({})", cudaGetErrorString(e), cudaGetErrorName(e)); }

/// Errors that leave the context unusable (the CUDA runtime documents these as sticky).
bool sticky(cudaError_t e) {
  switch (e) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorECCUncorrectable:
    case cudaErrorAssert:
      return true;
    default:
      return false;
  }
}

class CudaBackend;

/// An event shared by its stream's completion thread and the waits queued on it (cudaEventDestroy when
/// the last lets go).
using SharedEvent = std::shared_ptr<std::remove_pointer_t<cudaEvent_t>>;

enum class Notifier { poll, spin, hostfunc };

Notifier notifier_from_environment() {
  const char* v = std::getenv("WEFT_CUDA_NOTIFIER");
  const std::string_view name = v ? v : "poll";
  if (name == "poll" || name.empty()) return Notifier::poll;
  if (name == "spin") return Notifier::spin;
  if (name == "hostfunc") return Notifier::hostfunc;
  throw Error(Errc::invalid_argument, {.op = "gpu"}, fmt::format("WEFT_CUDA_NOTIFIER={} is not one of poll, spin, hostfunc", name));
}

/// What a `hostfunc` notifier's host functions count: shared with them, since a stream destroyed with work
/// queued is not waited for and its host functions run after it is gone.
struct HostSignal {
  std::mutex mutex;
  std::condition_variable cv;
  std::uint64_t ran = 0;  // guarded: host functions run so far

  static void on_reached(void* p) {
    std::unique_ptr<std::shared_ptr<HostSignal>> self(static_cast<std::shared_ptr<HostSignal>*>(p));
    {
      std::lock_guard lock((*self)->mutex);
      ++(*self)->ran;
    }
    (*self)->cv.notify_one();
  }
};

class CudaStream final : public StreamImpl {
 public:
  CudaStream(CudaBackend& backend, Loop& loop, int device);
  ~CudaStream() override;

  std::uint64_t copy(void* dst, const void* src, std::size_t bytes, CopyKind kind, int src_device,
                     int dst_device) override {
    return enqueue(fmt::format("copy {} of {} bytes", to_string(kind), bytes), [&] {
      if (bytes == 0) return cudaSuccess;
      if (kind == CopyKind::device_to_device && src_device != dst_device) {
        return cudaMemcpyPeerAsync(dst, dst_device, src, src_device, bytes, stream_);
      }
      // Within one device, a kernel: cudaMemcpyAsync there makes the device's later work wait for all
      // its earlier work, a deadlock behind a gate or a peer kernel that waits for later work (seen on an
      // H200: docs/DESIGN.md, "Copies within a device"). Overlapping ranges (no caller makes them) keep
      // the runtime's copy.
      const auto d = reinterpret_cast<std::uintptr_t>(dst);
      const auto s = reinterpret_cast<std::uintptr_t>(src);
      if (kind == CopyKind::device_to_device && (d + bytes <= s || s + bytes <= d || d == s)) {
        return static_cast<cudaError_t>(kernels::cuda::launch_copy(dst, src, bytes, stream_));
      }
      return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream_);
    });
  }
  std::uint64_t reduce(void* inout, const void* src, std::size_t count, DType dtype, ReduceOp op) override {
    return enqueue(fmt::format("reduce {} {} of {} elements", to_string(op), to_string(dtype), count), [&] {
      return static_cast<cudaError_t>(kernels::cuda::launch_reduce(inout, inout, src, count, static_cast<int>(dtype),
                                                                   static_cast<int>(op), stream_));
    });
  }
  std::uint64_t divide(void* data, std::size_t count, DType dtype, int divisor) override {
    return enqueue(fmt::format("divide {} elements of {} by {}", count, to_string(dtype), divisor), [&] {
      return static_cast<cudaError_t>(kernels::cuda::launch_divide(data, count, static_cast<int>(dtype), divisor, stream_));
    });
  }
  std::uint64_t epilogue(const void* in, DType in_type, void* out, std::size_t count, const Epilogue& epilogue) override {
    return enqueue(fmt::format("epilogue {} on {} elements of {}", epilogue.describe(), count, to_string(in_type)), [&] {
      if (const EpilogueFunctions* fns = epilogue.functions()) {
        return count == 0 ? cudaSuccess : static_cast<cudaError_t>(fns->launch(fns->functor.get(), in, out, count, stream_));
      }
      return static_cast<cudaError_t>(kernels::cuda::launch_epilogue(in, static_cast<int>(in_type), out,
                                                                     static_cast<int>(epilogue.output(in_type)), count,
                                                                     epilogue.factor(), stream_));
    });
  }
  std::uint64_t peer_all_reduce(const PeerLaunch& l) override {
    return enqueue(fmt::format("peer all_reduce {} {} of {} elements ({} stage{}, {} blocks)", to_string(l.op), to_string(l.dtype), l.count,
                               l.two_stage ? 2 : 1, l.two_stage ? "s" : "", l.blocks),
                   [&] {
                     kernels::cuda::PeerPointers pointers{};
                     for (int k = 0; k < kernels::peer::max_devices; ++k) {
                       pointers.inputs[k] = l.inputs[k];
                       pointers.scratch[k] = l.scratch[k];
                     }
                     return static_cast<cudaError_t>(kernels::cuda::launch_peer_all_reduce(
                         l.devices, pointers, l.out, l.count, static_cast<int>(l.dtype), static_cast<int>(l.op), l.divisor, l.two_stage,
                         l.blocks, l.lanes, l.failed, stream_));
                   },
                   {}, /*spins=*/true);  // waits for the other devices' instances
  }
  std::uint64_t host(std::function<void()> fn, bool spins) override {
    return enqueue("host function", [&] {
      auto* call = new std::function<void()>(std::move(fn));
      const cudaError_t e = cudaLaunchHostFunc(
          stream_,
          [](void* p) {
            std::unique_ptr<std::function<void()>> f(static_cast<std::function<void()>*>(p));
            (*f)();
          },
          call);
      if (e != cudaSuccess) delete call;
      return e;
    }, {}, spins);
  }
  std::uint64_t wait(const std::shared_ptr<StreamImpl>& other, std::uint64_t seq) override {
    auto& waited = static_cast<CudaStream&>(*other);
    const SharedEvent event = waited.event_of(seq);  // null: reached (or failed) already
    // The shared event is destroyed once the last holder lets go, also where this wait is still queued:
    // CUDA defers an event's destruction until the work that waits on it has.
    return enqueue(fmt::format("wait for {}'s fence {}", device_name(other->device()), seq), [&] {
      return event ? cudaStreamWaitEvent(stream_, event.get(), 0) : cudaSuccess;
    });
  }
  std::uint64_t wait_gate(const std::shared_ptr<GateState>& gate) override;
  std::uint64_t last() override {
    std::lock_guard lock(mutex_);
    return queued_;
  }
  bool poll(std::uint64_t seq, std::string& failure) override {
    std::lock_guard lock(mutex_);
    return book_.reached(seq, failure);
  }
  void notify(std::uint64_t seq, Notify fn) override {
    std::string failure;
    {
      std::lock_guard lock(mutex_);
      if (book_.wait(seq, fn, failure)) return;
    }
    fn(failure);
  }
  void* native() noexcept override { return stream_; }

 private:
  struct Pending {
    std::uint64_t seq;
    SharedEvent event;  // recorded right after the item: its fence, for this thread and for waits
    std::shared_ptr<void> keep;  // what the item's kernel reads, held until it ran (a gate's word)
    std::uint64_t signal = 0;    // hostfunc: the count of host functions run once this item's has
    bool spins = false;          // a kernel that spins (a gate, a peer kernel): FreesAfterSpins counts it
  };

  /// Queues one item (`launch`, under the stream's device) and its event; the number is the item's.
  /// `spins`: the item is a kernel that spins until the host or other kernels let it go (frees wait
  /// for it to end: FreesAfterSpins).
  template <class Launch>
  std::uint64_t enqueue(std::string what, Launch&& launch, std::shared_ptr<void> keep = {}, bool spins = false);
  /// The event recorded right after item `seq`, or null when that was reached (or failed) already.
  SharedEvent event_of(std::uint64_t seq);

  void run_completions();
  /// Waits until `next`'s event is reached or failed, the notifier's way; returns its status.
  cudaError_t await_event(const Pending& next);
  void finish(std::uint64_t seq, const std::string& failure);

  CudaBackend& backend_;
  const Notifier notifier_;
  cudaStream_t stream_ = nullptr;
  std::thread completer_;
  std::shared_ptr<HostSignal> signal_ = std::make_shared<HostSignal>();
  std::mutex launch_mutex_;            // held across an item's CUDA calls (enqueue): their order
  std::uint64_t signals_queued_ = 0;  // guarded by launch_mutex_: host functions queued (hostfunc)

  std::mutex mutex_;  // never held across a CUDA call that can block (enqueue)
  std::condition_variable work_cv_;
  std::deque<Pending> pending_;  // guarded: events not yet reached, in order
  std::uint64_t queued_ = 0;     // guarded
  FenceBook book_;               // guarded
  bool stopping_ = false;        // guarded
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int devices)
      : devices_(devices), failures_(static_cast<std::size_t>(devices)), idle_streams_(static_cast<std::size_t>(devices)),
        notifier_(notifier_from_environment()) {}

  // Streams are pooled per device. A device spreads streams over its hardware queues round robin in
  // the order they are made, whatever else lives, and a queue dispatches in order whatever stream an
  // item came from ("Hardware queues" below): a program that makes a stream per copy (ranks of one
  // process copying their inputs while another rank's gate spins) soon puts a new stream on the queue
  // of a gated one, behind the item waiting for that gate, and nothing there moves again (the sim's
  // WEFT_SIM_QUEUES played it: the multi-device group's test hung with 32 queues, as on the H200 on
  // 2026-12-04). Reused, a stream keeps its queue, so as long as no more than 32 streams of a device are
  // alive at once each has a queue of its own. Only a stream whose work all ran is taken again (one
  // still busy would order the new owner's work behind the old).
  // The idle streams are taken out of the pool while they are asked (cudaStreamQuery), so that no
  // CUDA call runs under the backend's lock (its other users: gate words, failures, frees' callers).
  cudaStream_t take_stream(int device) {
    std::vector<cudaStream_t> asked;
    {
      std::lock_guard lock(mutex_);
      asked.swap(idle_streams_.at(static_cast<std::size_t>(device)));
    }
    cudaStream_t taken = nullptr;
    std::vector<cudaStream_t> still_busy;
    for (const cudaStream_t stream : asked) {
      const cudaError_t e = taken ? cudaErrorNotReady : cudaStreamQuery(stream);
      if (e == cudaSuccess) {
        taken = stream;
        continue;
      }
      if (e != cudaErrorNotReady) cudaGetLastError();  // a failed device's: not ours to report here
      still_busy.push_back(stream);
    }
    std::lock_guard lock(mutex_);
    auto& idle = idle_streams_.at(static_cast<std::size_t>(device));
    idle.insert(idle.begin(), still_busy.begin(), still_busy.end());  // the oldest first, as before
    return taken;
  }
  void give_back_stream(int device, cudaStream_t stream) {
    {
      std::lock_guard lock(mutex_);
      auto& idle = idle_streams_.at(static_cast<std::size_t>(device));
      if (failures_.at(static_cast<std::size_t>(device)).empty() && idle.size() < max_pooled_streams) {
        idle.push_back(stream);
        return;
      }
    }
    cudaStreamDestroy(stream);  // queued work still runs; the call does not wait for it
  }

  Notifier notifier() const noexcept { return notifier_; }

  std::string_view name() const noexcept override { return "cuda"; }
  int device_count() override { return devices_; }
  bool can_access_peer(int a, int b) override {
    if (a == b) return true;  // a device with itself: yes (cudaDeviceCanAccessPeer says no)
    int can = 0;
    return cudaDeviceCanAccessPeer(&can, a, b) == cudaSuccess && can != 0;
  }

  std::string enable_peer_access(int a, int b) override {
    if (a == b) return {};
    cudaError_t e = cudaSetDevice(a);
    if (e == cudaSuccess) e = cudaDeviceEnablePeerAccess(b, 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();  // not sticky: clear it
      return {};
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      return fmt::format("{} cannot reach {}: {}", device_name(a), device_name(b), words(e));
    }
    return {};
  }
  std::vector<std::byte> export_memory(int device, void* data, std::size_t) override {
    cudaIpcMemHandle_t handle{};
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaIpcGetMemHandle(&handle, data);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw Error(Errc::device_failure, {.op = "export_memory"}, fmt::format("{}: cudaIpcGetMemHandle: {}", device_name(device), words(e)));
    }
    std::vector<std::byte> bytes(sizeof handle);
    std::memcpy(bytes.data(), &handle, sizeof handle);
    return bytes;
  }
  void* import_memory(int device, const std::vector<std::byte>& bytes, std::size_t) override {
    cudaIpcMemHandle_t handle{};
    if (bytes.size() != sizeof handle) {
      throw Error(Errc::invalid_argument, {.op = "import_memory"}, fmt::format("a handle of {} bytes is not CUDA's", bytes.size()));
    }
    std::memcpy(&handle, bytes.data(), sizeof handle);
    void* p = nullptr;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaIpcOpenMemHandle(&p, handle, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess) {
      cudaGetLastError();
      throw Error(Errc::device_failure, {.op = "import_memory"}, fmt::format("{}: cudaIpcOpenMemHandle: {}", device_name(device), words(e)));
    }
    return p;
  }
  void close_imported(int device, void* data, std::size_t) noexcept override {
    if (!data) return;
    cudaSetDevice(device);
    cudaIpcCloseMemHandle(data);
  }
  int multiprocessors(int device) override {
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return count;
  }

  void* allocate(int device, std::size_t bytes) override {
    if (auto why = failure(device); !why.empty()) {
      throw Error(Errc::device_failure, {.op = "allocate"}, fmt::format("{} failed earlier: {}", device_name(device), why));
    }
    void* p = nullptr;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaMalloc(&p, bytes == 0 ? 1 : bytes);
    if (e != cudaSuccess) {
      note(device, e);
      throw Error(Errc::device_failure, {.op = "allocate"}, fmt::format("{}: cudaMalloc of {} bytes: {}", device_name(device), bytes, words(e)));
    }
    return p;
  }
  void free(int device, void* data, std::size_t) noexcept override {
    if (!data) return;
    frees_.release([device, data] {
      cudaSetDevice(device);
      cudaFree(data);  // waits for the work queued on the device first, as DeviceBuffer promises
    });
  }
  void* allocate_pinned(std::size_t bytes) override {
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, bytes == 0 ? 1 : bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      throw Error(Errc::device_failure, {.op = "allocate_pinned"}, fmt::format("cudaHostAlloc of {} bytes: {}", bytes, words(e)));
    }
    return p;
  }
  void free_pinned(void* data, std::size_t) noexcept override {
    if (data) frees_.release([data] { cudaFreeHost(data); });
  }

  // Frees wait for no spinning kernel (backend.hpp, FreesAfterSpins: the hangs it ended).
  FreesAfterSpins& frees() noexcept { return frees_; }

  void check_memory(const void* data, std::size_t, Device device, const std::string& what) override {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it
      attributes.type = cudaMemoryTypeUnregistered;
    }
    const bool on_device = attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
    if (device.kind == Device::Kind::host) {
      if (attributes.type == cudaMemoryTypeDevice) {
        throw Error(Errc::invalid_argument, {.op = what},
                    fmt::format("the view says host memory, but {} is memory of {}", data, device_name(attributes.device)));
      }
      return;
    }
    if (!on_device) {
      throw Error(Errc::invalid_argument, {.op = what},
                  fmt::format("the view says {}, but {} is not device memory (a host pointer?)", device_name(device.index), data));
    }
    if (attributes.type == cudaMemoryTypeDevice && attributes.device != device.index) {
      throw Error(Errc::invalid_argument, {.op = what},
                  fmt::format("the view says {}, but {} is memory of {}", device_name(device.index), data,
                              device_name(attributes.device)));
    }
  }
  bool is_pinned(const void* data, std::size_t) override {
    cudaPointerAttributes attributes{};
    if (cudaPointerGetAttributes(&attributes, data) != cudaSuccess) {
      cudaGetLastError();
      return false;
    }
    return attributes.type == cudaMemoryTypeHost;
  }

  std::shared_ptr<StreamImpl> make_stream(Loop& loop, int device) override {
    return std::make_shared<CudaStream>(*this, loop, device);
  }

  std::string failure(int device) override {
    std::lock_guard lock(mutex_);
    return failures_.at(static_cast<std::size_t>(device));
  }
  /// A word of mapped host memory, zeroed, that the device can read (a gate's); back to the slab when the
  /// last holder lets go.
  std::shared_ptr<volatile std::uint32_t> gate_word() {
    std::lock_guard lock(mutex_);
    if (free_words_.empty()) {
      constexpr std::size_t page = 4096;
      void* p = nullptr;
      const cudaError_t e = cudaHostAlloc(&p, page, cudaHostAllocMapped | cudaHostAllocPortable);
      if (e != cudaSuccess) {
        throw Error(Errc::device_failure, {.op = "Stream::wait(Gate)"}, fmt::format("cudaHostAlloc of a gate page: {}", words(e)));
      }
      auto* words_of_page = static_cast<std::uint32_t*>(p);
      // 64 bytes apart: a word per cache line, so that opening one gate does not touch its neighbours'.
      for (std::size_t i = 0; i < page / 64; ++i) free_words_.push_back(words_of_page + i * 16);
    }
    volatile std::uint32_t* word = free_words_.back();
    free_words_.pop_back();
    *word = 0;
    return std::shared_ptr<volatile std::uint32_t>(word, [this](volatile std::uint32_t* w) {
      std::lock_guard relock(mutex_);
      free_words_.push_back(const_cast<std::uint32_t*>(w));
    });
  }

  /// Remembers a sticky error as the device's failure.
  void note(int device, cudaError_t e) {
    if (!sticky(e)) return;
    std::lock_guard lock(mutex_);
    auto& failure = failures_.at(static_cast<std::size_t>(device));
    if (failure.empty()) failure = words(e);
  }

 private:
  const int devices_;
  std::mutex mutex_;
  std::vector<std::string> failures_;  // guarded
  std::vector<std::uint32_t*> free_words_;  // guarded: gate words not in use (pages are never freed)
  std::vector<std::vector<cudaStream_t>> idle_streams_;  // guarded: per device, streams given back (take_stream)
  const Notifier notifier_;
  FreesAfterSpins frees_;
};

CudaStream::CudaStream(CudaBackend& backend, Loop& loop, int device)
    : StreamImpl(loop, device), backend_(backend), notifier_(backend.notifier()) {
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) {
    stream_ = backend.take_stream(device);
    if (!stream_) e = cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
  }
  if (e != cudaSuccess) {
    backend_.note(device, e);
    throw Error(Errc::device_failure, {.op = "Stream"}, fmt::format("{}: cudaStreamCreate: {}", device_name(device), words(e)));
  }
  completer_ = std::thread([this] { run_completions(); });
}

CudaStream::~CudaStream() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  // The completion thread never holds the stream: the last reference goes on a loop or user thread.
  if (completer_.joinable()) completer_.join();
  backend_.give_back_stream(device(), stream_);
}

template <class Launch>
std::uint64_t CudaStream::enqueue(std::string what, Launch&& launch, std::shared_ptr<void> keep, bool spins) {
  // The book (mutex_) is not held across the CUDA calls, only launch_mutex_, which keeps this stream's
  // items in the order of their numbers: a launch or an event record can block in the driver until the
  // device frees room in its queue, which may need a gate that the loop opens only after it polled
  // this stream (poll and the completions take mutex_). Held across, that was a deadlock on the H200
  // (2026-12-04: one rank, 3 entries on one GPU, 36 multi-device all_reduces queued back to back; the
  // caller in cudaEventRecord under mutex_, the loop in CudaStream::poll waiting for it).
  make_room();  // never lets the device's queue fill: a full one blocks the caller inside the driver's lock
  std::lock_guard launching(launch_mutex_);
  {
    std::lock_guard lock(mutex_);
    if (book_.failed()) return ++queued_;  // reached at once, with the stream's failure
  }
  std::string why = backend_.failure(device());
  const bool counted = spins && why.empty();
  if (counted) backend_.frees().begin_spin();
  cudaEvent_t event = nullptr;
  std::uint64_t signal = 0;
  if (why.empty()) {
    cudaError_t e = cudaSetDevice(device());
    if (e == cudaSuccess) e = launch();
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync);
    if (e == cudaSuccess) e = cudaEventRecord(event, stream_);
    if (e == cudaSuccess && notifier_ == Notifier::hostfunc) {
      auto* held = new std::shared_ptr<HostSignal>(signal_);
      e = cudaLaunchHostFunc(stream_, &HostSignal::on_reached, held);
      if (e != cudaSuccess) delete held;
      if (e == cudaSuccess) signal = ++signals_queued_;
    }
    if (e != cudaSuccess) {
      backend_.note(device(), e);
      if (event) cudaEventDestroy(event);
      why = words(e);
    }
  }
  std::lock_guard lock(mutex_);
  const std::uint64_t seq = ++queued_;
  if (!why.empty()) {
    if (counted) backend_.frees().end_spin();  // no event will say it ended (and a failed device runs nothing more)
    book_.fail(seq, fmt::format("{} failed in {}: {}", device_name(device()), what, why));
    return seq;
  }
  pending_.push_back(Pending{seq, SharedEvent(event, cudaEventDestroy), std::move(keep), signal, counted});
  work_cv_.notify_one();
  return seq;
}

// The device spins on a mapped word that the gate's opening sets; the word stays allocated until the
// wait kernel has run (the item's keep), whether the gate or the stream goes first.
std::uint64_t CudaStream::wait_gate(const std::shared_ptr<GateState>& gate) {
  std::shared_ptr<volatile std::uint32_t> word = backend_.gate_word();
  gate->on_open([word] {
    std::atomic_thread_fence(std::memory_order_release);
    *word = 1;
  });
  return enqueue("wait for the host's gate", [&] {
    return static_cast<cudaError_t>(kernels::cuda::launch_gate_wait(word.get(), stream_));
  }, std::shared_ptr<void>(word, nullptr), /*spins=*/true);  // holds the word (aliasing: volatile does not convert to void)
}

SharedEvent CudaStream::event_of(std::uint64_t seq) {
  std::lock_guard lock(mutex_);
  std::string failure;
  if (book_.reached(seq, failure)) return nullptr;
  // The item's own event, not a fresh one recorded now: that would also wait for everything queued
  // since, and what was queued since may be a gate that opens only once the waiting stream went on (a
  // stream-ordered collective: the caller's stream waits at a gate for the collective, whose copy in
  // waits for the caller's earlier work). That deadlock hung the device suites on an H100.
  for (auto it = pending_.rbegin(); it != pending_.rend(); ++it) {
    if (it->seq == seq) return it->event;
    if (it->seq < seq) break;
  }
  return nullptr;  // not pending: it failed to queue, and the book has its failure
}

void CudaStream::run_completions() {
  for (;;) {
    Pending next{};
    {
      std::unique_lock lock(mutex_);
      work_cv_.wait(lock, [&] { return stopping_ || !pending_.empty(); });
      if (pending_.empty()) return;
      next = pending_.front();
    }
    const cudaError_t e = await_event(next);
    next.event.reset();
    std::string failure;
    if (e != cudaSuccess) {
      backend_.note(device(), e);
      failure = fmt::format("{} failed: {}", device_name(device()), words(e));
    }
    finish(next.seq, failure);
  }
}

cudaError_t CudaStream::await_event(const Pending& next) {
  cudaEvent_t event = next.event.get();
  cudaError_t e = cudaEventQuery(event);
  switch (notifier_) {
    case Notifier::spin:
      while (e == cudaErrorNotReady) {
        std::this_thread::yield();
        e = cudaEventQuery(event);
      }
      return e;
    case Notifier::hostfunc:
      while (e == cudaErrorNotReady) {
        // The host function may never run after a failure that ends the context: look at the event again
        // every few milliseconds, so an error is still seen.
        std::unique_lock lock(signal_->mutex);
        signal_->cv.wait_for(lock, std::chrono::milliseconds(5), [&] { return signal_->ran >= next.signal; });
        lock.unlock();
        e = cudaEventQuery(event);
      }
      return e;
    case Notifier::poll:
      break;
  }
  // Poll first: a completion that comes within a few tens of microseconds costs no sleep.
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
  while (e == cudaErrorNotReady && std::chrono::steady_clock::now() < until) {
    std::this_thread::yield();
    e = cudaEventQuery(event);
  }
  if (e == cudaErrorNotReady) e = cudaEventSynchronize(event);
  return e;
}

void CudaStream::finish(std::uint64_t seq, const std::string& failure) {
  std::vector<std::pair<Notify, std::string>> ready;
  bool spun = false;
  {
    std::lock_guard lock(mutex_);
    spun = pending_.front().spins;
    pending_.pop_front();
    ready = book_.ran(seq, failure);
  }
  if (spun) backend_.frees().end_spin();
  for (auto& [fn, why] : ready) fn(why);
}

}  // namespace

namespace {

// How many hardware queues the streams of a device are spread over. A gate is a kernel that spins until
// the host opens it (kernels/cuda/gate.cu), and a queue runs its work in order whatever stream it came
// from: with more busy streams than queues, a gate holds the work of every stream that shares its
// queue, among them the very copies its collective waits for. The runtime's default is 8, and eight
// ranks sharing an H100, with a stream of their own and the group's each, hung there; with 32 (CUDA's
// most) the device suites pass. The variable is read when the runtime starts, so it is set before
// weft's first CUDA call, and only where the user did not set it.
constexpr int wanted_connections = 32;

void ask_for_hardware_queues() {
  const char* set = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  if (!set) {
    ::setenv("CUDA_DEVICE_MAX_CONNECTIONS", std::to_string(wanted_connections).c_str(), 0);
    return;
  }
  if (std::atoi(set) < wanted_connections) {
    log().warn("CUDA_DEVICE_MAX_CONNECTIONS={}: stream-ordered operations (Group::on) on more busy streams of a "
               "device than that can hang, since a stream's gate holds every stream that shares its hardware "
               "queue; weft asks for {} where the variable is not set",
               set, wanted_connections);
  }
}

// How the runtime loads kernels. Since CUDA 12 it loads each kernel on its first launch (lazy loading),
// and a load may wait for every kernel running on the context, as NVIDIA's lazy-loading notes warn: a
// kernel that spins until another is launched then never ends, since that launch waits for it. weft's
// peer kernels and gates spin by design, and its epilogue, copy and reduction kernels are many template
// instances, each loaded when first used: on the H200 (2026-12-04) a multi-device group's first
// all_reduce with a cast epilogue hung in `cudaLaunchKernel` of the epilogue, behind its own device
// set's spinning kernels (every thread's stack: bench/RESULTS.md). So weft asks for every kernel at the
// context's start (EAGER) where the user did not choose, and warns where LAZY was chosen.
void ask_for_eager_loading() {
  const char* set = std::getenv("CUDA_MODULE_LOADING");
  if (!set) {
    ::setenv("CUDA_MODULE_LOADING", "EAGER", 0);
    return;
  }
  if (std::string_view(set) == "LAZY") {
    log().warn("CUDA_MODULE_LOADING=LAZY: a kernel of weft's loaded while another spins (a gate, a device set's peer kernels) can "
               "wait for it forever; weft asks for EAGER where the variable is not set");
  }
}

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(std::string& why_not) {
  // Too late where CUDA was started before weft (by a framework): its settings hold then.
  ask_for_hardware_queues();
  ask_for_eager_loading();
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    why_not = fmt::format("no CUDA device answers: {}", words(e));
    return nullptr;
  }
  if (count == 0) {
    why_not = "the CUDA runtime sees no device";
    return nullptr;
  }
  return std::make_unique<CudaBackend>(count);
}

}  // namespace weft::gpu::detail
