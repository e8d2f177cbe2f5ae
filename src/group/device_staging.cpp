#include "group/device_staging.hpp"

#include <algorithm>
#include <bit>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include <fmt/format.h>

#include "devices/backend.hpp"
#include "group/checks.hpp"
#include "group/state.hpp"

namespace weft::detail {

// What a group keeps for its device operations: its own stream per device (operations given no stream)
// and a pool of page-locked staging buffers, so that an operation does not pay cudaHostAlloc (a
// millisecond or more) each time.
struct DeviceStaging : std::enable_shared_from_this<DeviceStaging> {
  static constexpr std::size_t min_buffer = 4096;
  static constexpr std::size_t max_cached = std::size_t{256} << 20;  // staging kept for reuse, in all

  std::mutex mutex;
  std::map<int, std::unique_ptr<gpu::Stream>> streams;  // guarded
  std::multimap<std::size_t, gpu::PinnedBuffer> free;   // guarded: by size
  std::size_t cached = 0;                                // guarded: bytes in `free`

  gpu::Stream& stream_of(Loop& loop, Device device) {
    std::lock_guard lock(mutex);
    auto& stream = streams[device.index];
    if (!stream) stream = std::make_unique<gpu::Stream>(loop, device);
    return *stream;
  }

  // A buffer of at least `bytes`: a cached one no more than twice as large, else a new one rounded up to
  // a power of two (so that sizes that vary a little reuse each other).
  gpu::PinnedBuffer take(std::size_t bytes) {
    {
      std::lock_guard lock(mutex);
      auto it = free.lower_bound(bytes);
      if (it != free.end() && it->first <= std::max(2 * bytes, min_buffer)) {
        gpu::PinnedBuffer buffer = std::move(it->second);
        cached -= it->first;
        free.erase(it);
        return buffer;
      }
    }
    return gpu::PinnedBuffer::allocate(std::bit_ceil(std::max(bytes, min_buffer)));
  }
  void give_back(gpu::PinnedBuffer buffer) {
    std::lock_guard lock(mutex);
    if (cached + buffer.bytes() > max_cached) return;  // freed here, outside the pool
    cached += buffer.bytes();
    const std::size_t size = buffer.bytes();
    free.emplace(size, std::move(buffer));
  }
};

namespace {

DeviceStaging& staging_of(GroupState& g) {
  std::lock_guard lock(g.device_staging_mutex);
  if (!g.device_staging) g.device_staging = std::make_shared<DeviceStaging>();
  return *g.device_staging;
}

// A staging buffer on loan from the pool, back when the operation ends (however it ends).
class Lease {
 public:
  Lease(std::shared_ptr<DeviceStaging> pool, std::size_t bytes) : pool_(std::move(pool)), buffer_(pool_->take(bytes)) {}
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease() { pool_->give_back(std::move(buffer_)); }
  std::byte* data() const noexcept { return static_cast<std::byte*>(buffer_.data()); }

 private:
  std::shared_ptr<DeviceStaging> pool_;
  gpu::PinnedBuffer buffer_;
};

// Whether [inner, inner + inner_bytes) lies within [outer, outer + outer_bytes).
bool within(const void* inner, std::size_t inner_bytes, const void* outer, std::size_t outer_bytes) {
  const auto i = reinterpret_cast<std::uintptr_t>(inner);
  const auto o = reinterpret_cast<std::uintptr_t>(outer);
  return i >= o && i + inner_bytes <= o + outer_bytes;
}

// A copy failed: the device is gone for this operation and every later one. The peers are waiting for
// this rank's part: abort the group so that they fail now, naming this rank and the device, instead of
// at their deadline.
[[noreturn]] void device_failed(GroupState& g, const char* op, std::uint64_t seq, const Error& e) {
  const std::string text = fmt::format("rank {}: its device failed in {}{}: {}", g.rank, op,
                                       seq ? fmt::format(" #{}", seq) : std::string(), e.detail());
  g.mark_failed(text);
  g.loop->post([state = g.shared_from_this(), text] { state->transport->abort_context(state->context, Errc::aborted, text); });
  throw Error(Errc::device_failure, g.where(op, seq ? static_cast<std::int64_t>(seq) : -1), e.detail());
}

// The copy back that is queued after the host part (the group's own stream; `stream` null: none).
struct CopyBack {
  gpu::Stream* stream = nullptr;  // the group's, alive as long as the group's state
  BufferView to;
  ConstBufferView from;
};

// Awaits a copy; its failure is the device's (device_failed: the group is aborted).
Task<void> device_step(GroupState& g, const char* op, std::uint64_t seq, Future<void> copy) {
  std::optional<Error> failure;
  try {
    co_await std::move(copy);
  } catch (const Error& e) {
    failure = e;
  }
  if (failure) device_failed(g, op, seq, *failure);
}

// The staging of one operation, on loan until the device is done with it.
struct Leases {
  std::unique_ptr<Lease> in;
  std::unique_ptr<Lease> out;
};

// Holds `leases` until `fence` is reached (or its stream failed): the copies that read or write them run
// on the device whatever happened to the operation on the host (cancelled, failed), so the memory
// goes back to the pool only after them.
Task<void> keep_until(gpu::Fence fence, std::shared_ptr<Leases> leases) {
  try {
    co_await fence.done();
  } catch (...) {
    // A failed stream ran nothing more; the memory is free either way.
  }
  leases.reset();
}

Task<void> staged_task(std::shared_ptr<GroupState> g, const char* op, std::uint64_t seq, std::shared_ptr<Leases> leases,
                       gpu::Fence last, std::optional<Future<void>> copied_in, Task<void> host,
                       std::optional<gpu::Gate> gate, std::optional<Future<void>> copied_out, CopyBack back) {
  // On every way out: the gate opens, so that the stream never waits for a host part that gave up, and
  // the staging goes back after the last copy queued on it (`last`).
  struct OnExit {
    Loop& loop;
    std::optional<gpu::Gate> gate;
    std::shared_ptr<Leases> leases;
    gpu::Fence last;
    ~OnExit() {
      if (gate) gate->open();
      (void)spawn(loop, keep_until(std::move(last), std::move(leases)));
    }
  } on_exit{*g->loop, gate, std::move(leases), std::move(last)};
  if (copied_in) co_await device_step(*g, op, seq, std::move(*copied_in));
  co_await std::move(host);
  if (gate) gate->open();
  if (back.stream) {
    try {
      copied_out.emplace(back.stream->copy(back.to, back.from));
      on_exit.last = back.stream->record();
    } catch (const Error& e) {
      device_failed(*g, op, seq, e);
    }
  }
  if (copied_out) co_await device_step(*g, op, seq, std::move(*copied_out));
}

}  // namespace

void check_device_view(const GroupState& g, const char* op, const char* name, const void* data, std::size_t bytes,
                       Device device) {
  const int devices = gpu::device_count();
  if (device.index < 0 || device.index >= devices) {
    invalid(g, op, fmt::format("{} is on device {}, but the {} backend has {} device(s)", name, device.index,
                               gpu::backend_name(), devices));
  }
  try {
    gpu::detail::backend().check_memory(data, bytes, device, name);
  } catch (const Error& e) {
    invalid(g, op, fmt::format("{}: {}", name, e.detail()));
  }
}

Future<void> run_staged(const std::shared_ptr<GroupState>& state, gpu::Stream* stream, const StagedCall& call,
                        std::chrono::milliseconds timeout, const HostOperation& host) {
  GroupState& g = *state;
  // Every device view is staged (the host operation never sees device memory); only what this rank reads
  // is copied in and only what it writes is copied back (a broadcast's root: in, not back).
  const bool in_staged = on_device(call.in.device, call.in.bytes());
  const bool out_staged = on_device(call.out.device, call.out.bytes());
  const bool in_device = call.reads_in && in_staged;
  const bool out_device = call.writes_out && out_staged;
  const Device device = in_staged ? call.in.device : call.out.device;
  if (in_staged && out_staged && !(call.in.device == call.out.device)) {
    invalid(g, call.op, fmt::format("the input is on device {} and the output on device {}: one operation works on one device",
                                    call.in.device.index, call.out.device.index));
  }
  if (stream && !(stream->device() == device)) {
    invalid(g, call.op, fmt::format("the stream is on device {} but the buffers on device {}", stream->device().index,
                                    device.index));
  }
  if (stream && &stream->loop() != g.loop) {
    invalid(g, call.op, "the stream completes on another Loop than the group's");
  }
  if (in_staged) check_device_view(g, call.op, "input", call.in.data, call.in.bytes(), call.in.device);
  if (out_staged) check_device_view(g, call.op, "output", call.out.data, call.out.bytes(), call.out.device);

  DeviceStaging& staging = staging_of(g);
  gpu::Stream& on = stream ? *stream : staging.stream_of(*g.loop, device);

  // Staging: the output's (when it is device memory), and the input's, inside the output's where the
  // input lies inside the output (in place, or all_gather's own block).
  auto leases = std::make_shared<Leases>();
  std::unique_ptr<Lease>& out_lease = leases->out;
  std::unique_ptr<Lease>& in_lease = leases->in;
  BufferView host_out = call.out;
  ConstBufferView host_in = call.in;
  if (out_staged) {
    out_lease = std::make_unique<Lease>(staging.shared_from_this(), call.out.bytes());
    host_out = BufferView(out_lease->data(), call.out.count, call.out.dtype);
  }
  if (in_staged) {
    if (out_staged && within(call.in.data, call.in.bytes(), call.out.data, call.out.bytes())) {
      const auto offset = static_cast<std::size_t>(static_cast<const std::byte*>(call.in.data) -
                                                   static_cast<const std::byte*>(call.out.data));
      host_in = ConstBufferView(out_lease->data() + offset, call.in.count, call.in.dtype);
    } else {
      in_lease = std::make_unique<Lease>(staging.shared_from_this(), call.in.bytes());
      host_in = ConstBufferView(in_lease->data(), call.in.count, call.in.dtype);
    }
  }

  // In the stream's order, now: the input after the work queued before; the output after the gate.
  // On the group's own stream nothing of the caller's comes after, so the copy back is queued when the
  // host part is done, and that stream never holds a gate (a gate waits on the device like a kernel, and
  // a DeviceBuffer's free waits for the whole device).
  std::optional<Future<void>> copied_in;
  std::optional<Future<void>> copied_out;
  std::optional<gpu::Gate> gate;
  if (in_device) {
    copied_in.emplace(on.copy(BufferView(const_cast<void*>(host_in.data), host_in.count, host_in.dtype), call.in));
  }
  if (stream) {
    // Later work on the caller's stream waits for the operation, also where nothing comes back (a send
    // whose buffer a later kernel overwrites).
    gate.emplace();
    on.wait(*gate);
    if (out_device) copied_out.emplace(on.copy(call.out, ConstBufferView(host_out.data, host_out.count, host_out.dtype)));
  }
  CopyBack back;
  if (out_device && !stream) back = CopyBack{&on, call.out, ConstBufferView(host_out.data, host_out.count, host_out.dtype)};
  gpu::Fence last = on.record();  // after every copy queued so far on the staging
  const std::uint64_t seq = call.takes_seq ? take_seq(g, timeout) : 0;
  return spawn(*g.loop, staged_task(state, call.op, seq, std::move(leases), std::move(last), std::move(copied_in),
                                    host(host_in, host_out, seq), std::move(gate), std::move(copied_out), back));
}

}  // namespace weft::detail
