// The public device layer (weft/gpu.hpp) over the process's backend (backend.hpp): argument checks,
// the backend's choice, and completions turned into Futures that resume on the stream's loop.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <thread>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "weft/when.hpp"

#include "core/env.hpp"
#include "core/log.hpp"
#include "kernels/cpu/reduce.hpp"
#include "devices/backend.hpp"
#include "devices/peer_launch.hpp"
#include "devices/checks.hpp"
#include "devices/host_copy.hpp"
#include "weft/error.hpp"
#include "weft/gpu.hpp"

namespace weft::gpu {
namespace detail {

std::string_view to_string(CopyKind kind) noexcept {
  switch (kind) {
    case CopyKind::host_to_host: return "host to host";
    case CopyKind::host_to_device: return "host to device";
    case CopyKind::device_to_host: return "device to host";
    case CopyKind::device_to_device: return "device to device";
  }
  return "?";
}

namespace {

Backend* choose_backend() {
  // Bad values are refused at the first device call, not at a later queueing.
  (void)stream_depth();
  (void)room_deadline();
  const char* v = std::getenv("WEFT_GPU");
  const std::string mode = v && *v ? v : "auto";
  if (mode != "auto" && mode != "cuda" && mode != "sim") {
    throw Error(Errc::invalid_argument, {.op = "gpu"}, fmt::format("WEFT_GPU={} is not one of auto, cuda, sim", mode));
  }
  if (mode == "sim") return make_sim_backend().release();
  std::string why_not;
  if (auto cuda = make_cuda_backend(why_not)) return cuda.release();
  if (mode == "cuda") throw Error(Errc::invalid_argument, {.op = "gpu"}, "WEFT_GPU=cuda, but " + why_not);
  log().debug("gpu: no CUDA ({}); the simulated device runs device work", why_not);
  return make_sim_backend().release();
}

}  // namespace

Backend& backend() {
  // Never destroyed: stream workers may still be finishing queued work while the process exits.
  static Backend* const chosen = choose_backend();
  return *chosen;
}

std::string device_name(int device) { return fmt::format("device {} ({})", device, backend().name()); }

std::uint64_t stream_depth() {
  static const std::uint64_t depth = [] {
    const long long n = weft::detail::env_count("WEFT_GPU_STREAM_DEPTH", 64, 0, std::int64_t{1} << 40);
    // One call of weft's queues several items on one stream behind a gate of its own (a multi-device
    // group's with 8 entries about a dozen), which opens only once the call returned: a depth below
    // that would wait for itself (depth 1 hung the device suite on the sim).
    if (n > 0 && static_cast<std::uint64_t>(n) < min_stream_depth) {
      throw Error(Errc::invalid_argument, {.op = "configuration"},
                  fmt::format("WEFT_GPU_STREAM_DEPTH={} is below {}: one weft call queues up to about a dozen items on a stream "
                              "behind its own gate, and would wait for itself (0: no bound)", n, min_stream_depth));
    }
    return static_cast<std::uint64_t>(n);
  }();
  return depth;
}

std::chrono::milliseconds room_deadline() {
  static const std::chrono::milliseconds deadline = weft::detail::env_duration("WEFT_TIMEOUT", std::chrono::minutes(30));
  return deadline;
}

void StreamImpl::make_room() {
  const std::uint64_t depth = stream_depth();
  if (depth == 0) return;
  const std::uint64_t queued = last();
  if (queued < depth) return;
  // With the next item, `depth` items at most not run: the one `depth` back from it must have run.
  const std::uint64_t must_have_run = queued + 1 - depth;
  std::string failure;
  if (poll(must_have_run, failure)) return;
  if (Loop::current() != nullptr) return;  // a loop's thread: what would drain the stream may be its work

  // A condition variable, not a borrow of the loop (Future::wait's way): a queueing call may come with
  // locks of its caller held (a pageable copy holds its stream's slot), and handlers run by a borrower
  // may queue on the same stream. The loop's own thread does the loop's work meanwhile.
  struct Room {
    std::mutex mutex;
    std::condition_variable cv;
    bool made = false;  // guarded
  };
  auto room = std::make_shared<Room>();
  notify(must_have_run, [room](const std::string&) {
    {
      std::lock_guard lock(room->mutex);
      room->made = true;
    }
    room->cv.notify_all();
  });
  std::unique_lock lock(room->mutex);
  // Long waits are legitimate (a big collective ahead in the stream); one that lasts names itself, as
  // the sim's full queue and its frees do, since a gate that this thread opens only later never opens.
  // None waits past the operations' deadline (WEFT_TIMEOUT): nothing hangs, a self-inflicted wait
  // included.
  const auto made = [&] { return room->made; };
  const auto warn_after = std::chrono::milliseconds(std::chrono::seconds(10));
  const std::chrono::milliseconds deadline = room_deadline();
  const bool bounded = deadline.count() > 0;
  if (room->cv.wait_for(lock, bounded ? std::min(warn_after, deadline) : warn_after, made)) return;
  if (!bounded || deadline > warn_after) {
    log().warn("gpu: queueing on a stream of {} has waited 10 s for its item {} to run ({} items queued and not run, "
               "WEFT_GPU_STREAM_DEPTH); a gate that this thread opens only later would never let it go",
               device_name(device()), must_have_run, depth);
    if (!bounded) return room->cv.wait(lock, made);
    if (room->cv.wait_for(lock, deadline - warn_after, made)) return;
  }
  throw Error(Errc::timeout, {.op = "gpu::Stream"},
              fmt::format("queueing on a stream of {} waited {} ms (WEFT_TIMEOUT) for its item {} to run: {} items queued and not run "
                          "(WEFT_GPU_STREAM_DEPTH) and none moved; a gate that the calling thread opens only later never lets "
                          "them go. Nothing was queued by this call",
                          device_name(device()), deadline.count(), must_have_run, depth));
}

std::uint64_t StreamImpl::peer_all_reduce(const PeerLaunch&) {
  throw Error(Errc::invalid_argument, {.op = "peer all_reduce"}, fmt::format("the {} backend runs no peer kernels", backend().name()));
}

}  // namespace detail

namespace detail {

void check_device(Device d, const char* op, const char* what) {
  if (d.kind != Device::Kind::cuda) {
    throw Error(Errc::invalid_argument, {.op = op}, fmt::format("{} is not a device (Device::Kind::host)", what));
  }
  const int n = device_count();
  if (d.index < 0 || d.index >= n) {
    throw Error(Errc::invalid_argument, {.op = op},
                fmt::format("{}: device {} does not exist ({} has {} device{})", what, d.index, backend_name(), n,
                            n == 1 ? "" : "s"));
  }
}

void check_view(const void* data, std::size_t bytes, Device d, const char* op, const char* what) {
  if (bytes == 0) return;
  // Past any memory (a view's bytes() is SIZE_MAX where its count wrapped): a pointer plus it wraps round
  // the address space, and the allocation's bounds would pass it (DeviceSet::all_reduce of SIZE_MAX / 2
  // floats ran its kernel over them and crashed).
  if (bytes > max_buffer_bytes) {
    throw Error(Errc::invalid_argument, {.op = op},
                fmt::format("{} claims {} bytes: more than memory can hold (at most 2^47 bytes per buffer)", what,
                            bytes == SIZE_MAX ? std::string("more than 2^64") : std::to_string(bytes)));
  }
  if (data == nullptr) {
    throw Error(Errc::invalid_argument, {.op = op}, fmt::format("{} is null and holds {} bytes", what, bytes));
  }
  if (d.kind == Device::Kind::cuda) check_device(d, op, what);
  detail::backend().check_memory(data, bytes, d, fmt::format("{}: {}", op, what));
}

/// Suspends until `seq` of `stream` is reached, and resumes on the stream's loop. The first of the
/// stream's notification and a cancel wins; the other finds `fired` set and does nothing.
struct FenceAwait {
  struct Outcome {
    std::atomic<bool> fired{false};
    std::string failure;
    bool cancelled = false;
  };

  std::shared_ptr<StreamImpl> stream;
  std::uint64_t seq;
  std::stop_token token;
  std::shared_ptr<Outcome> outcome;
  std::optional<std::stop_callback<std::function<void()>>> on_stop;

  bool await_ready() { return stream->poll(seq, outcome->failure); }
  void await_suspend(std::coroutine_handle<> waiter) {
    // By the loop's id, not a pointer: the backend's thread may still reach the fence after the loop is
    // gone (an owned loop waits 30 s for the fence, a loop that borrows an io_context not at all), and
    // the waiter is then not resumed.
    auto fire = [outcome = outcome, waiter, loop = stream->loop().id()](const std::string& failure, bool cancelled) {
      if (outcome->fired.exchange(true)) return;
      outcome->failure = failure;
      outcome->cancelled = cancelled;
      Loop::post_if_alive(loop, [waiter] { waiter.resume(); });
    };
    stream->notify(seq, [fire](const std::string& failure) { fire(failure, false); });
    if (token.stop_possible()) on_stop.emplace(token, std::function<void()>([fire] { fire({}, true); }));
  }
  void await_resume() { on_stop.reset(); }
};

namespace {
// `linger` lives in the frame from the call on, before the Task is started (spawn posts the start from
// any thread but the loop's): an owned loop's destructor then waits for the fence, and the waiter's last
// resume runs in the loop's final drain. Without it, a Future dropped by its caller
// (`(void)stream.enqueue_host(...)`) whose notification came after the loop's owner had seen the work
// done and destroyed the loop was never resumed, and its frame leaked (ASan, tests/sanitize.sh).
Task<void> await_fence_lingering(std::shared_ptr<StreamImpl> stream, std::uint64_t seq, const char* op, Loop::Linger linger) {
  const std::stop_token token = co_await this_stop_token();
  FenceAwait wait{stream, seq, token, std::make_shared<FenceAwait::Outcome>(), std::nullopt};
  co_await wait;
  if (wait.outcome->cancelled) {
    throw CancelledError({.op = op}, "cancelled; the device work queued before it goes on");
  }
  if (!wait.outcome->failure.empty()) throw Error(Errc::device_failure, {.op = op}, wait.outcome->failure);
  (void)linger;
}
}  // namespace

Task<void> await_fence(std::shared_ptr<StreamImpl> stream, std::uint64_t seq, const char* op) {
  Loop::Linger linger = stream->loop().linger();
  return await_fence_lingering(std::move(stream), seq, op, std::move(linger));
}

}  // namespace detail

namespace {

using detail::StreamImpl;
using detail::await_fence;
using detail::check_device;
using detail::check_view;

detail::CopyKind copy_kind(Device dst, Device src) {
  const bool from_device = src.kind == Device::Kind::cuda;
  const bool to_device = dst.kind == Device::Kind::cuda;
  if (from_device && to_device) return detail::CopyKind::device_to_device;
  if (from_device) return detail::CopyKind::device_to_host;
  if (to_device) return detail::CopyKind::host_to_device;
  return detail::CopyKind::host_to_host;
}

}  // namespace

Backend backend() { return detail::backend().name() == "cuda" ? Backend::cuda : Backend::sim; }
std::string_view backend_name() { return detail::backend().name(); }
int device_count() { return detail::backend().device_count(); }

void check_view(ConstBufferView view, const char* op, const char* what) {
  detail::check_view(view.data, view.bytes(), view.device, op, what);
}

Device device(int index) {
  const Device d{Device::Kind::cuda, index};
  check_device(d, "gpu::device", "the index");
  return d;
}

bool can_access_peer(Device a, Device b) {
  check_device(a, "can_access_peer", "a");
  check_device(b, "can_access_peer", "b");
  return a.index == b.index || detail::backend().can_access_peer(a.index, b.index);
}

// ---- Frees and spinning kernels (backend.hpp) ----

namespace detail {

void FreesAfterSpins::release(std::function<void()> free) noexcept {
  std::lock_guard lock(mutex_);
  if (spinning_ > 0) {
    kept_.push_back(std::move(free));
    // Kept memory goes back only when no spinning kernel is queued at all: a program that always has a
    // stream-ordered collective in flight and frees device memory all along would grow. Said once per
    // 4096 kept frees, not silently.
    if (kept_.size() % 4096 == 0) {
      log().warn("gpu: {} frees are held because gates or peer kernels have been queued all the while (freeing under them "
                 "could hang the device; docs/DESIGN.md, \"Frees and spinning kernels\"): the memory goes back once none is",
                 kept_.size());
    }
    return;
  }
  free();  // under the lock: no spinning kernel is queued while it waits for the device
}

void FreesAfterSpins::begin_spin() {
  std::lock_guard lock(mutex_);
  ++spinning_;
}

void FreesAfterSpins::end_spin() noexcept {
  std::vector<std::function<void()>> kept;
  {
    std::lock_guard lock(mutex_);
    if (--spinning_ > 0 || kept_.empty()) return;
    kept.swap(kept_);
  }
  // Each is released again there: a spinning kernel queued since keeps it once more.
  std::thread([this, kept = std::move(kept)]() mutable {
    for (auto& free : kept) release(std::move(free));
  }).detach();
}

}  // namespace detail

// ---- Copies from and to pageable host memory ----

namespace detail {

// Pageable host memory is staged through a pinned slot of the stream's, in pieces: for each piece, to
// the device, a host function copies it into the slot and the device copies the slot out; from the
// device, the device copies into the slot and a host function copies it out. The stream's order keeps a
// piece's slot from being written before the last piece's copy read it, so one slot serves every copy of
// the stream. Why not hand pageable memory to the runtime: cudaMemcpyAsync from the device to pageable
// memory returns only once the copy ran, so it blocks the calling thread behind whatever the stream
// waits for first (a gate that this very thread's loop is to open: a deadlock, seen on an H100), and it
// holds the stream meanwhile. Every call here returns at once. The host's half of each piece is split
// over a few threads (host_copy): one thread's memcpy, at about 6 GB/s on the H100 machine, bounded it.
struct PageableSlot {
  static constexpr std::size_t bytes = std::size_t{4} << 20;
  void* data = nullptr;

  PageableSlot() : data(backend().allocate_pinned(bytes)) {}
  PageableSlot(const PageableSlot&) = delete;
  PageableSlot& operator=(const PageableSlot&) = delete;
  ~PageableSlot() {
    // Freeing pinned memory waits for the whole device (cudaFreeHost), gates included: not on the
    // thread that dropped the stream, which may be a loop's.
    std::thread([data = data] { backend().free_pinned(data, bytes); }).detach();
  }
};

std::uint64_t copy_pageable(StreamImpl& stream, void* dst, const void* src, std::size_t size, CopyKind kind,
                            int device) {
  if (size == 0) return stream.copy(dst, src, 0, kind, device, device);
  std::lock_guard lock(stream.pageable_mutex);
  if (!stream.pageable_slot) stream.pageable_slot = std::make_shared<PageableSlot>();
  const std::shared_ptr<PageableSlot> slot = stream.pageable_slot;  // held by each host function
  std::uint64_t seq = 0;
  for (std::size_t at = 0; at < size; at += PageableSlot::bytes) {
    const std::size_t n = std::min(PageableSlot::bytes, size - at);
    if (kind == CopyKind::host_to_device) {
      const auto* from = static_cast<const std::byte*>(src) + at;
      stream.host([slot, from, n] { host_copy(slot->data, from, n); });
      seq = stream.copy(static_cast<std::byte*>(dst) + at, slot->data, n, kind, -1, device);
    } else {
      auto* to = static_cast<std::byte*>(dst) + at;
      stream.copy(slot->data, static_cast<const std::byte*>(src) + at, n, kind, device, -1);
      seq = stream.host([slot, to, n] { host_copy(to, slot->data, n); });
    }
  }
  return seq;
}

}  // namespace detail

// ---- DeviceBuffer / PinnedBuffer ----

DeviceBuffer DeviceBuffer::allocate(Device device, std::size_t bytes) {
  check_device(device, "DeviceBuffer::allocate", "the device");
  DeviceBuffer buffer;
  buffer.data_ = detail::backend().allocate(device.index, bytes);
  buffer.bytes_ = bytes;
  buffer.device_ = device;
  return buffer;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept { take(other); }

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    DeviceBuffer old(std::move(*this));
    take(other);
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) detail::backend().free(device_.index, data_, bytes_);
}

// ---- Device memory between processes (IPC) ----

namespace {
constexpr std::uint32_t ipc_magic = 0x77667469;
}

IpcHandle export_memory(const DeviceBuffer& buffer) {
  if (!buffer.data()) throw Error(Errc::invalid_argument, {.op = "export_memory"}, "an empty DeviceBuffer has no memory to share");
  const std::vector<std::byte> words = detail::backend().export_memory(buffer.device().index, buffer.data(), buffer.bytes());
  IpcHandle handle;
  if (words.size() > sizeof handle.words) {
    throw Error(Errc::device_failure, {.op = "export_memory"}, fmt::format("the backend's handle takes {} bytes", words.size()));
  }
  handle.magic = ipc_magic;
  handle.device = buffer.device().index;
  handle.bytes = buffer.bytes();
  handle.length = static_cast<std::uint32_t>(words.size());
  std::memcpy(handle.words, words.data(), words.size());
  return handle;
}

ImportedBuffer ImportedBuffer::open(const IpcHandle& handle) {
  constexpr const char* op = "ImportedBuffer::open";
  if (handle.magic != ipc_magic || handle.length > sizeof handle.words) {
    throw Error(Errc::invalid_argument, {.op = op}, "not a handle that export_memory made");
  }
  const Device device{Device::Kind::cuda, handle.device};
  check_device(device, op, "the handle's device");
  const std::vector<std::byte> words(handle.words, handle.words + handle.length);
  ImportedBuffer b;
  b.data_ = detail::backend().import_memory(handle.device, words, static_cast<std::size_t>(handle.bytes));
  b.bytes_ = static_cast<std::size_t>(handle.bytes);
  b.device_ = device;
  return b;
}

ImportedBuffer::ImportedBuffer(ImportedBuffer&& other) noexcept { take(other); }

ImportedBuffer& ImportedBuffer::operator=(ImportedBuffer&& other) noexcept {
  if (this != &other) {
    ImportedBuffer old(std::move(*this));
    take(other);
  }
  return *this;
}

ImportedBuffer::~ImportedBuffer() {
  if (data_) detail::backend().close_imported(device_.index, data_, bytes_);
}

PinnedBuffer PinnedBuffer::allocate(std::size_t bytes) {
  PinnedBuffer buffer;
  buffer.data_ = detail::backend().allocate_pinned(bytes);
  buffer.bytes_ = bytes;
  return buffer;
}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    PinnedBuffer old(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_) detail::backend().free_pinned(data_, bytes_);
}

BufferView PinnedBuffer::view(DType dtype) const noexcept { return BufferView(data_, bytes_ / dtype_size(dtype), dtype); }

// ---- Fence ----

bool Fence::reached() const {
  if (!stream_) return false;
  std::string failure;
  return stream_->poll(seq_, failure);
}

Future<void> Fence::done() const {
  if (!stream_) throw Error(Errc::invalid_argument, {.op = "Fence::done"}, "a default-constructed Fence belongs to no stream");
  return spawn(stream_->loop(), await_fence(stream_, seq_, "fence"));
}

// ---- Gate ----

namespace detail {
// The handles' shared part: the state outlives it in the streams that wait on it; the last handle gone
// opens the gate.
struct GateOwner {
  std::shared_ptr<GateState> state = std::make_shared<GateState>();
  GateOwner() = default;
  GateOwner(const GateOwner&) = delete;
  GateOwner& operator=(const GateOwner&) = delete;
  ~GateOwner() { state->open(); }
};
}  // namespace detail

Gate::Gate() : owner_(std::make_shared<detail::GateOwner>()) {}
void Gate::open() const { owner_->state->open(); }
bool Gate::is_open() const { return owner_->state->is_open(); }

// ---- Stream ----

Stream::Stream(Loop& loop, Device device) {
  check_device(device, "Stream", "the device");
  impl_ = detail::backend().make_stream(loop, device.index);
}

Stream::~Stream() = default;
Stream::Stream(Stream&&) noexcept = default;
Stream& Stream::operator=(Stream&&) noexcept = default;

Device Stream::device() const noexcept { return Device{Device::Kind::cuda, impl_->device()}; }
Loop& Stream::loop() const noexcept { return impl_->loop(); }
void* Stream::native_handle() const noexcept { return impl_->native(); }

Future<void> Stream::copy(BufferView dst, ConstBufferView src) {
  if (dst.bytes() != src.bytes()) {
    throw Error(Errc::invalid_argument, {.op = "copy"},
                fmt::format("dst holds {} bytes and src {}: a copy moves equal sizes", dst.bytes(), src.bytes()));
  }
  check_view(dst.data, dst.bytes(), dst.device, "copy", "dst");
  check_view(src.data, src.bytes(), src.device, "copy", "src");
  const Device mine = device();
  const bool involves_device = dst.device.kind == Device::Kind::cuda || src.device.kind == Device::Kind::cuda;
  if (involves_device && !(dst.device == mine) && !(src.device == mine)) {
    throw Error(Errc::invalid_argument, {.op = "copy"},
                fmt::format("the stream is on {}, which is neither the source's nor the destination's device",
                            detail::device_name(mine.index)));
  }
  const detail::CopyKind kind = copy_kind(dst.device, src.device);
  std::uint64_t seq = 0;
  if (kind == detail::CopyKind::host_to_device && !detail::backend().is_pinned(src.data, src.bytes())) {
    seq = detail::copy_pageable(*impl_, dst.data, src.data, src.bytes(), kind, dst.device.index);
  } else if (kind == detail::CopyKind::device_to_host && !detail::backend().is_pinned(dst.data, dst.bytes())) {
    seq = detail::copy_pageable(*impl_, dst.data, src.data, src.bytes(), kind, src.device.index);
  } else {
    seq = impl_->copy(dst.data, src.data, src.bytes(), kind, src.device.index, dst.device.index);
  }
  return spawn(impl_->loop(), await_fence(impl_, seq, "copy"));
}

Future<void> Stream::reduce(BufferView inout, ConstBufferView src, ReduceOp op) {
  const Device mine = device();
  if (!(inout.device == mine) || !(src.device == mine)) {
    throw Error(Errc::invalid_argument, {.op = "reduce"},
                fmt::format("both views must be on the stream's device ({})", detail::device_name(mine.index)));
  }
  if (inout.dtype != src.dtype || inout.count != src.count) {
    throw Error(Errc::invalid_argument, {.op = "reduce"},
                fmt::format("inout is {} x {} and src {} x {}: they must match", inout.count, to_string(inout.dtype),
                            src.count, to_string(src.dtype)));
  }
  if (!is_defined(inout.dtype, op)) {
    throw Error(Errc::invalid_argument, {.op = "reduce"},
                fmt::format("{} is not defined on {}", to_string(op), to_string(inout.dtype)));
  }
  check_view(inout.data, inout.bytes(), inout.device, "reduce", "inout");
  check_view(src.data, src.bytes(), src.device, "reduce", "src");
  const std::uint64_t seq =
      impl_->reduce(inout.data, src.data, inout.count, inout.dtype, op == ReduceOp::avg ? ReduceOp::sum : op);
  return spawn(impl_->loop(), await_fence(impl_, seq, "reduce"));
}

Future<void> Stream::divide(BufferView data, int divisor) {
  constexpr const char* op = "Stream::divide";
  if (!(data.device == device())) {
    throw Error(Errc::invalid_argument, {.op = op}, fmt::format("the view must be on the stream's device ({})", detail::device_name(device().index)));
  }
  if (divisor < 1) throw Error(Errc::invalid_argument, {.op = op}, fmt::format("the divisor {} is not positive", divisor));
  check_view(data.data, data.bytes(), data.device, op, "data");
  const std::uint64_t seq = impl_->divide(data.data, data.count, data.dtype, divisor);
  return spawn(impl_->loop(), await_fence(impl_, seq, op));
}

Future<void> Stream::apply(ConstBufferView in, BufferView out, const Epilogue& epilogue) {
  constexpr const char* op = "Stream::apply";
  const Device mine = device();
  if (!(in.device == mine) || !(out.device == mine)) {
    throw Error(Errc::invalid_argument, {.op = op},
                fmt::format("both views must be on the stream's device ({})", detail::device_name(mine.index)));
  }
  const DType to = epilogue.output(in.dtype);
  if (out.dtype != to || out.count != in.count) {
    throw Error(Errc::invalid_argument, {.op = op},
                fmt::format("{} x {} in, {} x {} out: the epilogue {} stores {} x {}", in.count, to_string(in.dtype), out.count,
                            to_string(out.dtype), epilogue.describe(), in.count, to_string(to)));
  }
  detail::check_epilogue_runs(epilogue, op);
  check_view(in.data, in.bytes(), in.device, op, "in");
  check_view(out.data, out.bytes(), out.device, op, "out");
  detail::check_overlap(in, out, op);
  const std::uint64_t seq = impl_->epilogue(in.data, in.dtype, out.data, in.count, epilogue);
  return spawn(impl_->loop(), await_fence(impl_, seq, op));
}

Fence Stream::record() { return Fence(impl_, impl_->last()); }

void Stream::wait(const Fence& fence) {
  if (!fence.stream_) throw Error(Errc::invalid_argument, {.op = "Stream::wait"}, "a default-constructed Fence belongs to no stream");
  if (fence.stream_ == impl_) return;  // FIFO already orders it
  impl_->wait(fence.stream_, fence.seq_);
}

void Stream::wait(const Gate& gate) { impl_->wait_gate(gate.owner_->state); }

Future<void> Stream::synchronize() { return record().done(); }

Future<void> Stream::enqueue_host(std::function<void()> fn) {
  const std::uint64_t seq = impl_->host(std::move(fn));
  return spawn(impl_->loop(), await_fence(impl_, seq, "enqueue_host"));
}

// ---- to_device / to_host ----

namespace {
Task<DeviceBuffer> finish_to_device(Future<void> copied, DeviceBuffer buffer) {
  co_await std::move(copied);
  co_return std::move(buffer);
}
Task<std::vector<std::byte>> finish_to_host(Future<void> copied, std::vector<std::byte> host) {
  co_await std::move(copied);
  co_return std::move(host);
}
}  // namespace

Future<DeviceBuffer> to_device(ConstBufferView host, Device device, Stream& stream) {
  if (host.device.kind != Device::Kind::host) {
    throw Error(Errc::invalid_argument, {.op = "to_device"}, "the source is not host memory");
  }
  DeviceBuffer buffer = DeviceBuffer::allocate(device, host.bytes());
  // Queued now, in the caller's order on the stream; the Future only waits for it.
  Future<void> copied = stream.copy(buffer.view(DType::u8), ConstBufferView(host.data, host.bytes(), DType::u8));
  return spawn(stream.loop(), finish_to_device(std::move(copied), std::move(buffer)));
}

Future<std::vector<std::byte>> to_host(ConstBufferView device_view, Stream& stream) {
  if (device_view.device.kind != Device::Kind::cuda) {
    throw Error(Errc::invalid_argument, {.op = "to_host"}, "the source is not device memory");
  }
  std::vector<std::byte> host(device_view.bytes());
  Future<void> copied = stream.copy(BufferView(host.data(), host.size(), DType::u8),
                                    ConstBufferView(device_view.data, device_view.bytes(), DType::u8, device_view.device));
  return spawn(stream.loop(), finish_to_host(std::move(copied), std::move(host)));
}

}  // namespace weft::gpu
