#pragma once
/// weft::gpu: devices, device and pinned memory, streams and fences, with every completion delivered on a
/// weft::Loop like any other operation of weft.
///
/// Two backends sit behind one interface, chosen once per process from WEFT_GPU (auto | cuda | sim):
/// - **cuda**: built when nvcc is found (meson -Dcuda=auto|enabled|disabled) and used when a device answers.
/// - **sim**: always built. "Device memory" is host memory held in a registry (so a host pointer passed as
///   device memory, or freed device memory, is caught and named), freed blocks are poisoned, and every
///   stream is a worker thread of its own, so the work is asynchronous for real. Knobs: WEFT_SIM_DEVICES
///   (device count, default 2), WEFT_SIM_DELAY_US (each operation first sleeps a random 0..N us),
///   WEFT_SIM_FAIL=<n> (the n-th operation of the process fails, and its device with it, as a sticky CUDA
///   error does), WEFT_SIM_P2P=0 (devices cannot access each other; a device can always access itself),
///   WEFT_SIM_COPY_GBPS=<rate> (a copy takes at least bytes / rate, sleeping what the memcpy left: a copy
///   engine's pace without its core, for benchmarks of overlap), WEFT_SIM_QUEUES=<n> (each device's
///   streams share n hardware queues that dispatch in order whatever stream an item came from, as
///   CUDA_DEVICE_MAX_CONNECTIONS: an item waiting behind a gate holds every stream of its queue).
///
/// Streams are pooled per device (a stream whose work all ran is taken again), so that a program that
/// makes a stream per copy keeps reusing the device's hardware queues instead of landing a new stream on
/// the queue of a gated one; more than 32 streams of one device alive at once (or CUDA streams made
/// outside weft) can still share a queue.
///
/// A device is a weft::Device{Device::Kind::cuda, index} (buffer.hpp); a BufferView whose `device` says so
/// holds device memory. Errors (every function below): weft::Error with Errc::invalid_argument for a bad
/// argument (named), Errc::device_failure when the device failed (the device, the operation and the
/// backend's words).
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "weft/buffer.hpp"
#include "weft/epilogue_functions.hpp"
#include "weft/future.hpp"
#include "weft/loop.hpp"
#include "weft/reduce_op.hpp"

namespace weft::gpu {

enum class Backend : std::uint8_t { cuda, sim };

/// The backend of this process (chosen at first use). WEFT_GPU=cuda where CUDA was not built, or where no
/// device answers, throws weft::Error (invalid_argument) saying which; auto falls back to sim.
Backend backend();
std::string_view backend_name();  ///< "cuda" or "sim"

/// The number of devices of the backend (sim: WEFT_SIM_DEVICES).
int device_count();
/// Device{cuda, index}. Errors: invalid_argument when index is not in [0, device_count()).
Device device(int index);
/// Whether kernels on `a` can read and write `b`'s memory (peer to peer). A device with itself: true.
bool can_access_peer(Device a, Device b);

/// Throws weft::Error (invalid_argument, naming `op` and `what`) unless `view`'s memory is what its
/// `device` says: host memory, or an allocation of that device long enough for the view (the sim knows
/// every allocation; under cuda the runtime is asked). An empty view passes.
void check_view(ConstBufferView view, const char* op, const char* what);

namespace detail {
class StreamImpl;
struct GateOwner;
struct DeviceSetState;
class PeerWindow;
}

namespace detail {
/// What DeviceBuffer and ImportedBuffer share: a region of one device's memory, and views of it.
class DeviceRegion {
 public:
  void* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }
  Device device() const noexcept { return device_; }
  /// The whole region as bytes() / dtype_size(dtype) elements of `dtype` (a remainder is left out).
  BufferView view(DType dtype) const noexcept { return BufferView(data_, bytes_ / dtype_size(dtype), dtype, device_); }
  template <class T>
  BufferView view() const noexcept { return view(dtype_of<T>); }

 protected:
  /// Takes `other`'s region, leaving it empty (the owners' moves).
  void take(DeviceRegion& other) noexcept {
    data_ = other.data_;
    bytes_ = other.bytes_;
    device_ = other.device_;
    other.data_ = nullptr;
    other.bytes_ = 0;
  }

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  Device device_{Device::Kind::cuda, 0};
};
}  // namespace detail

/// Device memory: an owning allocation on one device. Move-only; freeing waits for the device's streams
/// to finish the work already queued (as cudaFree does), then releases (sim: poisons) the memory.
class DeviceBuffer : public detail::DeviceRegion {
 public:
  DeviceBuffer() = default;
  /// `bytes` may be 0 (a valid, empty buffer). Errors: invalid_argument (not a device, index out of
  /// range), device_failure (out of memory, failed device).
  static DeviceBuffer allocate(Device device, std::size_t bytes);
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();
};

/// Device memory that another process of this host may open (CUDA IPC: cudaIpcGetMemHandle; the sim:
/// the memory's file, opened through /proc by a process of the same user). Plain bytes: send it any way
/// (a Group's send, a pipe). Valid while the exporting buffer lives.
struct IpcHandle {
  std::uint32_t magic = 0;   ///< 0x77667469 ("weft ipc") once made by export_memory
  std::int32_t device = 0;   ///< the device index the memory belongs to, as the exporter numbers it
  std::uint64_t bytes = 0;   ///< the allocation's size
  std::uint32_t length = 0;  ///< how many of `words` the backend's handle takes
  std::byte words[100] = {};
};

/// The handle of `buffer`'s memory for another process. Errors: invalid_argument (an empty buffer),
/// device_failure (the backend refuses).
IpcHandle export_memory(const DeviceBuffer& buffer);

/// Another process's device memory, opened here (cudaIpcOpenMemHandle). Move-only; dropping it closes
/// the mapping (after the work queued on the device, as cudaIpcCloseMemHandle); the exporter's buffer is
/// what frees the memory, and must outlive every importer's use.
class ImportedBuffer : public detail::DeviceRegion {
 public:
  ImportedBuffer() = default;
  /// Errors: invalid_argument (not a handle of this backend's, a device that does not exist),
  /// device_failure (the exporter is gone or refused, the backend cannot map it).
  static ImportedBuffer open(const IpcHandle& handle);
  ImportedBuffer(ImportedBuffer&& other) noexcept;
  ImportedBuffer& operator=(ImportedBuffer&& other) noexcept;
  ImportedBuffer(const ImportedBuffer&) = delete;
  ImportedBuffer& operator=(const ImportedBuffer&) = delete;
  ~ImportedBuffer();
};

/// Page-locked host memory (sim: ordinary host memory): the fast path for copies between host and device,
/// and the staging memory of device collectives. Move-only.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  static PinnedBuffer allocate(std::size_t bytes);
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();

  void* data() const noexcept { return data_; }
  std::size_t bytes() const noexcept { return bytes_; }
  BufferView view(DType dtype) const noexcept;
  template <class T>
  BufferView view() const noexcept { return view(dtype_of<T>); }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

/// What an all_reduce does to each reduced element before it stores it (issue 17): scale it, cast it to
/// another dtype, both, or a function of your own. The output then has the epilogue's dtype. Built in
/// (usable from any file): identity (the default), scale(f), cast(t), scale_and_cast(f, t), with the
/// arithmetic of src/kernels/cpu/epilogue.hpp on every backend: the value is scaled in double and
/// converted with rounding to nearest even for float types and saturation toward zero for integers (so an
/// integer of more than 53 bits loses its low bits when scaled; a cast between integers is C++'s).
/// Your own: custom(functions) from weft/gpu_epilogue.cuh (compiled by nvcc; runs on a GPU and, through
/// its host copy, on the sim), or on_host<In, Out>(f) (the sim, and host buffers, only).
/// Copyable (a custom's functor is shared); cheap to pass by value.
class Epilogue {
 public:
  enum class Kind : std::uint8_t { identity, scale_and_cast, custom };

  Epilogue() = default;
  static Epilogue identity() { return Epilogue(); }
  /// out = in * factor, in the input's dtype. Errors: invalid_argument for a factor that is not finite.
  static Epilogue scale(double factor);
  /// out = in converted to `to`.
  static Epilogue cast(DType to);
  /// out = (in * factor) converted to `to`.
  static Epilogue scale_and_cast(double factor, DType to);
  /// A function of yours (weft/gpu_epilogue.cuh's make_epilogue_functions). `name` is for messages.
  /// Errors: invalid_argument when neither function is given or a dtype is not one of weft's.
  static Epilogue custom(EpilogueFunctions functions, std::string name = "custom");
  /// A host function f(In) or f(In, std::size_t index) -> Out: runs where device work runs on the host
  /// (the sim) and on host buffers; a GPU refuses it (invalid_argument at the call).
  template <class In, class Out, class F>
  static Epilogue on_host(F f, std::string name = "custom") {
    EpilogueFunctions fns;
    fns.input_dtype = static_cast<int>(dtype_of<In>);
    fns.output_dtype = static_cast<int>(dtype_of<Out>);
    fns.host = [](const void* functor, const void* in, void* out, std::size_t first, std::size_t count) {
      const F& fn = *static_cast<const F*>(functor);
      const In* src = static_cast<const In*>(in);
      Out* dst = static_cast<Out*>(out);
      for (std::size_t k = 0; k < count; ++k) {
        if constexpr (std::is_invocable_v<const F&, In, std::size_t>) dst[k] = static_cast<Out>(fn(src[k], first + k));
        else dst[k] = static_cast<Out>(fn(src[k]));
      }
    };
    fns.functor = std::make_shared<F>(std::move(f));
    return custom(std::move(fns), std::move(name));
  }

  Kind kind() const noexcept { return kind_; }
  bool is_identity() const noexcept { return kind_ == Kind::identity; }
  double factor() const noexcept { return factor_; }
  /// The dtype stored for reduced elements of `input`. Errors: invalid_argument when a custom
  /// epilogue was made for another input dtype (naming both).
  DType output(DType input) const;
  /// "identity", "scale 0.5", "cast to bf16", "scale 0.25 and cast to f16", "custom 'bias' (f32 -> bf16)".
  std::string describe() const;
  /// The custom's functions (null for the built-ins).
  const EpilogueFunctions* functions() const noexcept { return kind_ == Kind::custom ? &functions_ : nullptr; }

  /// Applies the epilogue to host memory, here, on the calling thread: out[i] = epilogue(in[i]). `in`
  /// of the reduced dtype, `out` of output(in.dtype), one count; out may be in where the sizes match.
  /// Errors: invalid_argument (dtypes, counts, device memory, a custom without a host function).
  void apply(ConstBufferView in, BufferView out) const;

 private:
  Kind kind_ = Kind::identity;
  double factor_ = 1.0;
  std::optional<DType> to_;  // scale_and_cast: the stored dtype (none: the input's)
  EpilogueFunctions functions_;
  std::string name_;
};

/// A point in a stream's order: reached once everything queued on the stream before it has run.
/// Copyable; keeps its stream's state alive.
class Fence {
 public:
  Fence() = default;
  /// Whether the stream got here (false for a default-constructed Fence).
  bool reached() const;
  /// Completes on the stream's loop once the fence is reached.
  /// Errors: device_failure when the stream's device failed before it got here.
  /// Cancellation: cancel() completes the Future with CancelledError at once; the device work goes on.
  Future<void> done() const;

 private:
  friend class Stream;
  friend class DeviceSet;
  friend class detail::PeerWindow;
  Fence(std::shared_ptr<detail::StreamImpl> stream, std::uint64_t seq) : stream_(std::move(stream)), seq_(seq) {}
  std::shared_ptr<detail::StreamImpl> stream_;
  std::uint64_t seq_ = 0;
};

/// A point in a stream's order that the host opens: work queued on a stream after `stream.wait(gate)` runs
/// only once `open()` was called. This is how work that the host finishes later (a collective's network
/// part) is put in a stream's order now, so that the kernels queued after it wait on the device, not on
/// the host. Copyable: copies are the same gate. Opening is final; a gate whose last copy goes away
/// opens, so no stream waits for a gate nobody can open. Thread-safe.
class Gate {
 public:
  Gate();
  void open() const;
  bool is_open() const;

 private:
  friend class Stream;
  std::shared_ptr<detail::GateOwner> owner_;
};

/// A FIFO of device work on one device; what is queued runs in order, asynchronously to the host.
/// Enqueueing is thread-safe. Completions (every Future below) resume on `loop`.
///
/// Lifetime: the views given to copy/reduce must stay valid until the returned Future completes (or a
/// later fence of the stream is reached). Dropping the Stream lets queued work finish.
///
/// Blocking: a call that queues waits while the stream has WEFT_GPU_STREAM_DEPTH items (64 by default;
/// 0: no bound) queued and not run (the loop's own thread goes on meanwhile), as a CUDA launch waits for
/// room in a full device queue, but outside the driver: a full queue there blocks every CUDA
/// call of the process, among them the other rank's that would drain it. Never on a thread that runs a
/// loop (a task, a handler): there the call queues at once. So a thread must not queue more than that
/// behind a Gate that it opens itself only afterwards: a warning after 10 s says so, and past WEFT_TIMEOUT
/// (30 minutes by default) the call fails with Errc::timeout, having queued nothing.
class Stream {
 public:
  /// Errors: invalid_argument (not a device, index out of range).
  Stream(Loop& loop, Device device);
  ~Stream();
  Stream(Stream&&) noexcept;
  Stream& operator=(Stream&&) noexcept;

  Device device() const noexcept;
  Loop& loop() const noexcept;

  /// Copies src into dst; host to device, device to host, device to device (peer devices too) or host to
  /// host, from the views' devices. Pageable host memory is staged through pinned memory (cuda).
  /// Errors: invalid_argument at once when the sizes differ, when a view's memory is not what its
  /// `device` says (a host pointer passed as device memory, freed device memory, a buffer too short),
  /// or when the stream's device is not one of the views' devices; device_failure through the Future.
  Future<void> copy(BufferView dst, ConstBufferView src);

  /// inout[i] = inout[i] op src[i] on the device (avg: the sum; dividing is the caller's). Both views on
  /// this stream's device, same dtype and count, op defined on the dtype (weft::is_defined).
  Future<void> reduce(BufferView inout, ConstBufferView src, ReduceOp op);

  /// data[i] /= divisor on the device (avg's division: integer division for integers, bool unchanged,
  /// 16-bit floats through float). Errors: invalid_argument (not on this device, divisor < 1).
  Future<void> divide(BufferView data, int divisor);

  /// out[i] = epilogue(in[i]) on the device: `in` of the reduced dtype, `out` of epilogue.output(in.dtype),
  /// one count, both on this stream's device; out may be in itself where the element sizes match, and
  /// must not overlap it otherwise. Errors: invalid_argument at once (devices, dtypes, counts, overlap, a
  /// custom epilogue without the function this backend runs: launch under cuda, host under the sim);
  /// device_failure through the Future.
  Future<void> apply(ConstBufferView in, BufferView out, const Epilogue& epilogue);

  /// A fence after everything queued so far.
  Fence record();
  /// Later work on this stream waits (on the device, the host does not block) until `fence` is reached.
  /// A fence of this stream is a no-op. Errors: invalid_argument for a default-constructed Fence.
  void wait(const Fence& fence);
  /// Later work on this stream waits (on the device) until `gate` is open. Under cuda a one-thread kernel
  /// polls mapped host memory meanwhile (one resident block per waiting stream).
  void wait(const Gate& gate);
  /// record().done().
  Future<void> synchronize();

  /// The backend's stream (a cudaStream_t under cuda, for the user's own kernels; nullptr under sim).
  void* native_handle() const noexcept;

  /// For tests and the sim only: queue `fn` as if it were a kernel (under cuda it runs on a host thread in
  /// stream order through cudaLaunchHostFunc). It must not call weft::gpu.
  Future<void> enqueue_host(std::function<void()> fn);

 private:
  std::shared_ptr<detail::StreamImpl> impl_;  // knows its device and loop
};

/// The devices of one process that all_reduce together (NCCL's one process, many GPUs; issue 17). A
/// device may appear more than once (logical devices sharing one GPU). The set keeps a stream per entry
/// and what the exchange needs (signals, scratch), made once.
///
/// Paths: **peer to peer** where every pair of entries can access each other (can_access_peer) and the
/// backend runs the peer kernels (the sim, and CUDA where the runtime enables peer access; on a GPU
/// without an epilogue): each device reads every input and writes its own output, in rank order, so the
/// outputs are bitwise the same; one stage for small buffers and two (reduce-scatter, then all-gather)
/// for large ones (above 256 KiB with more than 2 entries) or in place. **Naive** otherwise: each device copies every
/// input into scratch of its own and accumulates in rank order, then writes its output once every device
/// has read every input. Both give the CPU kernels' bits for integers and for the float ops that are
/// exact; sums of floats are added in rank order (0, 1, ..., n-1).
///
/// Lifetime: the set outlives the calls it started; the views outlive their Future.
class DeviceSet {
 public:
  /// Errors: invalid_argument (no device, more than 8, a device that does not exist).
  static DeviceSet create(Loop& loop, std::vector<Device> devices);
  DeviceSet(DeviceSet&&) noexcept;
  DeviceSet& operator=(DeviceSet&&) noexcept;
  ~DeviceSet();

  const std::vector<Device>& devices() const noexcept;
  /// Whether all_reduce takes the peer-to-peer path.
  bool peer_to_peer() const noexcept;

  /// outputs[i] = epilogue(inputs[0] op ... op inputs[n-1]) (avg: the sum divided by n, then the
  /// epilogue) on every entry i, the epilogue applied once per element as it is stored.
  /// inputs[i] and outputs[i] on devices()[i], one count for all, the inputs of one dtype and the outputs
  /// of epilogue.output(it); an output may be its own input (in place, where the epilogue keeps the
  /// element size), not another entry's. The inputs must be ready (the work that wrote them done, or
  /// on the set's streams, or ordered with wait()); the Future completes once every output is written.
  /// Errors: invalid_argument at once (counts, dtypes, devices, op undefined on the dtype, views that
  /// are not what they say); device_failure through the Future.
  /// Cancellation: cancelling completes the Future at once; the device work goes on.
  Future<void> all_reduce(std::vector<ConstBufferView> inputs, std::vector<BufferView> outputs, ReduceOp op = ReduceOp::sum,
                          const Epilogue& epilogue = {});
  /// In place: every view is its entry's input and output.
  Future<void> all_reduce(std::vector<BufferView> inout, ReduceOp op = ReduceOp::sum, const Epilogue& epilogue = {});

  /// Stream order with the set (as Stream::record and Stream::wait, for entry `entry`'s stream): a fence
  /// after everything the set queued for that entry so far (a call's output written), and later work of
  /// the set for that entry waits for `fence` (a kernel of yours that writes the next input) on the
  /// device. Errors: invalid_argument (an entry out of range, a default Fence).
  Fence record(std::size_t entry) const;
  void wait(std::size_t entry, const Fence& fence);

 private:
  explicit DeviceSet(std::shared_ptr<detail::DeviceSetState> state);
  std::shared_ptr<detail::DeviceSetState> state_;
};

/// Copies `host` to a new device buffer on `device`, through `stream` (which must be on `device`).
Future<DeviceBuffer> to_device(ConstBufferView host, Device device, Stream& stream);
/// Copies `device_view` to host memory, through `stream` (on the view's device).
Future<std::vector<std::byte>> to_host(ConstBufferView device_view, Stream& stream);

}  // namespace weft::gpu
