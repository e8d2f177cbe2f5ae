// The public device layer (weft/gpu.hpp) over the process's backend (backend.hpp): argument checks,
// the backend's choice, and completions turned into Futures that resume on the stream's loop.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "weft/when.hpp"

#include "core/log.hpp"
#include "kernels/cpu/reduce.hpp"
#include "kernels/peer/all_reduce.hpp"
#include "devices/backend.hpp"
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

}  // namespace detail

namespace {

using detail::StreamImpl;

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
    // By the loop's id, not a pointer: the backend's thread may reach the fence after the loop's owner
    // destroyed the loop (a rank that failed and left while its device work still ran), and the
    // waiter, whose frame went with the loop, is then not resumed.
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

Task<void> await_fence(std::shared_ptr<StreamImpl> stream, std::uint64_t seq, const char* op) {
  const std::stop_token token = co_await this_stop_token();
  FenceAwait wait{stream, seq, token, std::make_shared<FenceAwait::Outcome>(), std::nullopt};
  co_await wait;
  if (wait.outcome->cancelled) {
    throw CancelledError({.op = op}, "cancelled; the device work queued before it goes on");
  }
  if (!wait.outcome->failure.empty()) throw Error(Errc::device_failure, {.op = op}, wait.outcome->failure);
}

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

// ---- Copies from and to pageable host memory ----

namespace detail {

// Pageable host memory is staged through a pinned slot of the stream's, in pieces: for each piece, to
// the device, a host function copies it into the slot and the device copies the slot out; from the
// device, the device copies into the slot and a host function copies it out. The stream's order keeps a
// piece's slot from being written before the last piece's copy read it, so one slot serves every copy of
// the stream. Why not hand pageable memory to the runtime: cudaMemcpyAsync from the device to pageable
// memory returns only once the copy ran, so it blocks the calling thread behind whatever the stream
// waits for first (a gate that this very thread's loop is to open: a deadlock, seen on an H100), and it
// holds the stream meanwhile. Every call here returns at once.
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
      stream.host([slot, from, n] { std::memcpy(slot->data, from, n); });
      seq = stream.copy(static_cast<std::byte*>(dst) + at, slot->data, n, kind, -1, device);
    } else {
      auto* to = static_cast<std::byte*>(dst) + at;
      stream.copy(slot->data, static_cast<const std::byte*>(src) + at, n, kind, device, -1);
      seq = stream.host([slot, to, n] { std::memcpy(to, slot->data, n); });
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

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)), device_(other.device_) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    DeviceBuffer old(std::move(*this));
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    device_ = other.device_;
  }
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_) detail::backend().free(device_.index, data_, bytes_);
}

BufferView DeviceBuffer::view(DType dtype) const noexcept {
  return BufferView(data_, bytes_ / dtype_size(dtype), dtype, device_);
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

// ---- DeviceSet ----

namespace detail {

struct DeviceSetState {
  Loop* loop = nullptr;
  std::vector<Device> devices;
  std::vector<std::shared_ptr<StreamImpl>> streams;  // one per entry
  bool peer_to_peer = false;
  // The peer path's signals (the sim: host memory its workers share), zeroed once.
  std::vector<std::unique_ptr<kernels::peer::Signal>> signals;
  // The naive path's scratch per entry: the sum so far and the input being added.
  std::mutex mutex;
  std::vector<DeviceBuffer> sums, addends;  // guarded; grown between calls
};

}  // namespace detail

namespace {

using detail::DeviceSetState;

// One element of `size` bytes, for the peer algorithms over any dtype (the CPU kernels do the arithmetic).
template <std::size_t N>
struct Element {
  std::byte bytes[N];
};

// Runs entry `rank`'s part of the peer all_reduce as the sim's device work: a thread per block, the same
// code as the GPU's (kernels/peer). Returns "" or why it gave up.
template <std::size_t N>
std::string run_peer_blocks(const DeviceSetState& set, int rank, const std::vector<const void*>& inputs, void* output,
                            std::size_t count, DType dtype, ReduceOp op, bool two_stage, const std::vector<std::byte*>& scratch) {
  struct HostAtomics {
    static void store_release(std::uint32_t* p, std::uint32_t v) { std::atomic_ref<std::uint32_t>(*p).store(v, std::memory_order_release); }
    static std::uint32_t load_acquire(const std::uint32_t* p) {
      return std::atomic_ref<std::uint32_t>(*const_cast<std::uint32_t*>(p)).load(std::memory_order_acquire);
    }
    static bool pause(std::uint64_t spins) {
      std::this_thread::yield();
      return spins < (std::uint64_t{1} << 34);  // the peers' workers all run; a lost one is a bug, not a wait
    }
    static void sync_block() {}
    static bool sync_block_all(bool ok) { return ok; }
  };
  using E = Element<N>;
  kernels::peer::Devices devices;
  devices.rank = rank;
  devices.n = static_cast<int>(set.devices.size());
  for (int k = 0; k < devices.n; ++k) devices.signals[k] = set.signals[static_cast<std::size_t>(k)].get();
  std::vector<const E*> in(inputs.size());
  for (std::size_t k = 0; k < inputs.size(); ++k) in[k] = static_cast<const E*>(detail::backend().worker_address(inputs[k]));
  E* out = static_cast<E*>(detail::backend().worker_address(output));
  std::vector<E*> tmp(scratch.size());
  for (std::size_t k = 0; k < scratch.size(); ++k) tmp[k] = reinterpret_cast<E*>(scratch[k]);
  const kernels::ReduceFn fn = kernels::find_reduce(dtype, op == ReduceOp::avg ? ReduceOp::sum : op);
  const int divisor = op == ReduceOp::avg ? devices.n : 1;
  auto combine = [fn](E a, const E& b) {
    fn(&a, &a, &b, 1);
    return a;
  };
  auto epilogue = [dtype, divisor](E v) {
    if (divisor > 1) kernels::divide_in_place(&v, 1, dtype, divisor);
    return v;
  };
  constexpr int blocks = 2;
  std::atomic<bool> ok{true};
  auto block = [&](int b) {
    const bool done = two_stage ? kernels::peer::two_stage<HostAtomics, E, E>(devices, b, blocks, 0, 1, in.data(), out, tmp.data(),
                                                                               count, combine, epilogue)
                                : kernels::peer::one_stage<HostAtomics, E, E>(devices, b, blocks, 0, 1, in.data(), out, count, combine,
                                                                              epilogue);
    if (!done) ok = false;
  };
  std::thread second([&] { block(1); });
  block(0);
  second.join();
  return ok ? std::string() : fmt::format("device {}: a peer barrier gave up (a peer's work never came)", set.devices[static_cast<std::size_t>(rank)].index);
}

Task<void> await_all(std::vector<Future<void>> each, std::shared_ptr<std::string> failure) {
  co_await when_all(std::move(each));
  if (!failure->empty()) throw Error(Errc::device_failure, {.op = "DeviceSet::all_reduce"}, *failure);
}

}  // namespace

DeviceSet::DeviceSet(std::shared_ptr<detail::DeviceSetState> state) : state_(std::move(state)) {}
DeviceSet::DeviceSet(DeviceSet&&) noexcept = default;
DeviceSet& DeviceSet::operator=(DeviceSet&&) noexcept = default;
DeviceSet::~DeviceSet() = default;

DeviceSet DeviceSet::create(Loop& loop, std::vector<Device> devices) {
  if (devices.empty() || devices.size() > static_cast<std::size_t>(kernels::peer::max_devices)) {
    throw Error(Errc::invalid_argument, {.op = "DeviceSet"},
                fmt::format("{} devices: a set holds 1 to {}", devices.size(), kernels::peer::max_devices));
  }
  auto state = std::make_shared<DeviceSetState>();
  state->loop = &loop;
  for (std::size_t i = 0; i < devices.size(); ++i) {
    check_device(devices[i], "DeviceSet", fmt::format("entry {}", i).c_str());
    state->streams.push_back(detail::backend().make_stream(loop, devices[i].index));
  }
  bool reach = true;
  for (const Device& a : devices) {
    for (const Device& b : devices) reach = reach && can_access_peer(a, b);
  }
  // The peer kernels run on the sim's workers; on a GPU they are compiled but not yet wired.
  state->peer_to_peer = reach && backend() == Backend::sim;
  if (state->peer_to_peer) {
    for (std::size_t i = 0; i < devices.size(); ++i) state->signals.push_back(std::make_unique<kernels::peer::Signal>());
  }
  state->sums.resize(devices.size());
  state->addends.resize(devices.size());
  state->devices = std::move(devices);
  return DeviceSet(std::move(state));
}

const std::vector<Device>& DeviceSet::devices() const noexcept { return state_->devices; }
bool DeviceSet::peer_to_peer() const noexcept { return state_->peer_to_peer; }

Future<void> DeviceSet::all_reduce(std::vector<BufferView> inout, ReduceOp op) {
  std::vector<ConstBufferView> inputs(inout.begin(), inout.end());
  return all_reduce(std::move(inputs), std::move(inout), op);
}

Future<void> DeviceSet::all_reduce(std::vector<ConstBufferView> inputs, std::vector<BufferView> outputs, ReduceOp op) {
  DeviceSetState& set = *state_;
  const std::size_t n = set.devices.size();
  constexpr const char* what = "DeviceSet::all_reduce";
  if (inputs.size() != n || outputs.size() != n) {
    throw Error(Errc::invalid_argument, {.op = what},
                fmt::format("{} inputs and {} outputs for a set of {} devices: one of each per device", inputs.size(), outputs.size(), n));
  }
  const DType dtype = inputs[0].dtype;
  const std::size_t count = inputs[0].count;
  if (!is_defined(dtype, op)) {
    throw Error(Errc::invalid_argument, {.op = what}, fmt::format("{} is not defined on {}", to_string(op), to_string(dtype)));
  }
  bool in_place = false;
  for (std::size_t i = 0; i < n; ++i) {
    const std::string at = fmt::format("entry {}", i);
    for (const auto* view : {&inputs[i].device, &outputs[i].device}) {
      if (!(*view == set.devices[i])) {
        throw Error(Errc::invalid_argument, {.op = what}, fmt::format("{}: its views must be on device {}", at, set.devices[i].index));
      }
    }
    if (inputs[i].dtype != dtype || outputs[i].dtype != dtype || inputs[i].count != count || outputs[i].count != count) {
      throw Error(Errc::invalid_argument, {.op = what},
                  fmt::format("{}: {} x {} in, {} x {} out; entry 0 has {} x {}: every view holds the same", at, inputs[i].count,
                              to_string(inputs[i].dtype), outputs[i].count, to_string(outputs[i].dtype), count, to_string(dtype)));
    }
    check_view(inputs[i].data, inputs[i].bytes(), inputs[i].device, what, (at + " input").c_str());
    check_view(outputs[i].data, outputs[i].bytes(), outputs[i].device, what, (at + " output").c_str());
    const auto* o = static_cast<const std::byte*>(outputs[i].data);
    for (std::size_t k = 0; k < n && count > 0; ++k) {
      const auto* in = static_cast<const std::byte*>(inputs[k].data);
      const bool overlap = o < in + inputs[k].bytes() && in < o + outputs[i].bytes();
      if (!overlap) continue;
      if (k != i || o != in) {
        throw Error(Errc::invalid_argument, {.op = what},
                    fmt::format("{}: its output overlaps entry {}'s input: an output may only be its own input", at, k));
      }
      in_place = true;
    }
  }
  auto failure = std::make_shared<std::string>();
  std::vector<Future<void>> each;
  if (count == 0) {
    for (auto& stream : set.streams) each.push_back(spawn(*set.loop, await_fence(stream, stream->last(), what)));
    return spawn(*set.loop, await_all(std::move(each), failure));
  }
  // Each entry's work waits for what every other stream of the set queued before (the last call's
  // outputs, which may be this call's inputs).
  std::vector<std::uint64_t> before(n);
  for (std::size_t i = 0; i < n; ++i) before[i] = set.streams[i]->last();
  auto wait_for_others = [&](std::size_t i, const std::vector<std::uint64_t>& seqs) {
    for (std::size_t k = 0; k < n; ++k) {
      if (k != i && seqs[k] > 0) set.streams[i]->wait(set.streams[k], seqs[k]);
    }
  };
  const std::size_t bytes = inputs[0].bytes();
  const std::size_t esize = dtype_size(dtype);
  if (set.peer_to_peer) {
    const bool two_stage = in_place || (n > 2 && bytes > (std::size_t{256} << 10));
    std::vector<const void*> in(n);
    for (std::size_t k = 0; k < n; ++k) in[k] = inputs[k].data;
    // Two-stage: every entry's slice of the sum, shared by this call's bodies (host memory on the sim).
    auto scratch = std::make_shared<std::vector<std::vector<std::byte>>>(n);
    if (two_stage) {
      for (std::size_t k = 0; k < n; ++k) {
        const auto slice = kernels::peer::share(count, static_cast<int>(k), static_cast<int>(n));
        (*scratch)[k].resize((slice.last - slice.first + 1) * esize);
      }
    }
    for (std::size_t i = 0; i < n; ++i) {
      wait_for_others(i, before);
      auto body = [state = state_, i, in, out = outputs[i].data, count, dtype, op, two_stage, failure, esize, scratch] {
        std::vector<std::byte*> tmp(scratch->size());
        for (std::size_t k = 0; k < tmp.size(); ++k) tmp[k] = (*scratch)[k].data();
        std::string why;
        const int rank = static_cast<int>(i);
        switch (esize) {
          case 1: why = run_peer_blocks<1>(*state, rank, in, out, count, dtype, op, two_stage, tmp); break;
          case 2: why = run_peer_blocks<2>(*state, rank, in, out, count, dtype, op, two_stage, tmp); break;
          case 4: why = run_peer_blocks<4>(*state, rank, in, out, count, dtype, op, two_stage, tmp); break;
          default: why = run_peer_blocks<8>(*state, rank, in, out, count, dtype, op, two_stage, tmp); break;
        }
        if (!why.empty()) {
          std::lock_guard lock(state->mutex);
          if (failure->empty()) *failure = why;
        }
      };
      each.push_back(spawn(*set.loop, await_fence(set.streams[i], set.streams[i]->host(std::move(body)), what)));
    }
    return spawn(*set.loop, await_all(std::move(each), failure));
  }
  // Naive: every entry copies every input (rank order) into scratch of its own and adds it up; then,
  // once every entry has read every input, writes its output (which may be its input).
  {
    std::lock_guard lock(set.mutex);
    for (std::size_t i = 0; i < n; ++i) {
      if (set.sums[i].bytes() < bytes) set.sums[i] = DeviceBuffer::allocate(set.devices[i], bytes);
      if (n > 1 && set.addends[i].bytes() < bytes) set.addends[i] = DeviceBuffer::allocate(set.devices[i], bytes);
    }
  }
  const ReduceOp combine = op == ReduceOp::avg ? ReduceOp::sum : op;
  std::vector<std::uint64_t> summed(n);
  for (std::size_t i = 0; i < n; ++i) {
    StreamImpl& s = *set.streams[i];
    wait_for_others(i, before);
    void* sum = set.sums[i].data();
    void* addend = set.addends[i].data();
    const int me = set.devices[i].index;
    constexpr auto d2d = detail::CopyKind::device_to_device;
    s.copy(sum, inputs[0].data, bytes, d2d, set.devices[0].index, me);
    for (std::size_t k = 1; k < n; ++k) {
      s.copy(addend, inputs[k].data, bytes, d2d, set.devices[k].index, me);
      s.reduce(sum, addend, count, dtype, combine);
    }
    summed[i] = s.last();
  }
  for (std::size_t i = 0; i < n; ++i) {
    StreamImpl& s = *set.streams[i];
    wait_for_others(i, summed);
    const int me = set.devices[i].index;
    s.copy(outputs[i].data, set.sums[i].data(), bytes, detail::CopyKind::device_to_device, me, me);
    if (op == ReduceOp::avg && n > 1) s.divide(outputs[i].data, count, dtype, static_cast<int>(n));
    each.push_back(spawn(*set.loop, await_fence(set.streams[i], s.last(), what)));
  }
  return spawn(*set.loop, await_all(std::move(each), failure));
}

}  // namespace weft::gpu
