#include "group/device_staging.hpp"

#include <algorithm>
#include <bit>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
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
  std::map<int, std::vector<std::unique_ptr<gpu::Stream>>> spare_streams;  // guarded: copy-back streams, by device
  std::multimap<std::size_t, gpu::PinnedBuffer> free;   // guarded: by size
  std::size_t cached = 0;                                // guarded: bytes in `free`

  DeviceStaging() = default;
  DeviceStaging(const DeviceStaging&) = delete;
  DeviceStaging& operator=(const DeviceStaging&) = delete;
  // The pool's buffers are freed on a thread of their own: freeing pinned memory waits for the whole
  // device (cudaFreeHost), and the last holder may be a loop that another group's gate waits for.
  ~DeviceStaging() {
    if (!free.empty()) std::thread([dropped = std::move(free)] {}).detach();
  }

  gpu::Stream& stream_of(Loop& loop, Device device) {
    std::lock_guard lock(mutex);
    auto& stream = streams[device.index];
    if (!stream) stream = std::make_unique<gpu::Stream>(loop, device);
    return *stream;
  }

  // A stream of its own for one operation's copies back (pipelined): its queue then holds nothing of
  // another operation's, so it cannot wait behind a gate that this operation opens.
  std::unique_ptr<gpu::Stream> take_stream(Loop& loop, Device device) {
    {
      std::lock_guard lock(mutex);
      auto& spare = spare_streams[device.index];
      if (!spare.empty()) {
        auto stream = std::move(spare.back());
        spare.pop_back();
        return stream;
      }
    }
    return std::make_unique<gpu::Stream>(loop, device);
  }
  void give_back(std::unique_ptr<gpu::Stream> stream) {
    std::lock_guard lock(mutex);
    auto& spare = spare_streams[stream->device().index];
    if (spare.size() < 4) spare.push_back(std::move(stream));
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
    if (cached + buffer.bytes() > max_cached) {
      // Freeing pinned memory waits for the whole device (cudaFreeHost), gates included, and this runs
      // on the loop that opens them: the free goes to a thread of its own.
      std::thread([dropped = std::move(buffer)] {}).detach();
      return;
    }
    cached += buffer.bytes();
    const std::size_t size = buffer.bytes();
    free.emplace(size, std::move(buffer));
  }
};

ErrorContext Naming::where(const GroupState& g) const { return g.where(op, seq ? static_cast<std::int64_t>(seq) : -1, peer, tag); }

std::string Naming::text() const {
  std::string s = op;
  if (seq) s += fmt::format(" #{}", seq);
  if (peer >= 0) s += fmt::format(" (peer {})", peer);
  if (tag >= 0) s += fmt::format(" [tag {}]", tag);
  return s;
}

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
void abort_for_device(GroupState& g, const Naming& name, const Error& e) {
  const std::string text = fmt::format("rank {}: its device failed in {}: {}", g.rank, name.text(), e.detail());
  g.mark_failed(text);
  g.loop->post([state = g.shared_from_this(), text] { state->transport->abort_context(state->context, Errc::aborted, text); });
}
[[noreturn]] void device_failed(GroupState& g, const Naming& name, const Error& e) {
  abort_for_device(g, name, e);
  throw Error(Errc::device_failure, name.where(g), e.detail());
}

// The copy back that is queued after the host part (the group's own stream; `stream` null: none).
struct CopyBack {
  gpu::Stream* stream = nullptr;  // the group's, alive as long as the group's state
  BufferView to;
  ConstBufferView from;
};

// Continues on the loop after what was posted to it before (an abort) has run.
struct AfterPosted {
  Loop* loop;
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) { loop->post([h] { h.resume(); }); }
  void await_resume() const noexcept {}
};

// Awaits a copy; its failure is the device's (device_failed: the group is aborted).
Task<void> device_step(GroupState& g, Naming name, Future<void> copy) {
  std::optional<Error> failure;
  try {
    co_await std::move(copy);
  } catch (const Error& e) {
    failure = e;
  }
  if (failure) {
    // The abort first, then this rank's failure: its caller may leave the group at once, and the peers
    // are to learn the cause from the abort rather than from a connection that went.
    abort_for_device(g, name, *failure);
    co_await AfterPosted{g.loop};
    throw Error(Errc::device_failure, name.where(g), failure->detail());
  }
}

// The staging of one operation, on loan until the device is done with it.
struct Leases {
  std::unique_ptr<Lease> in;
  std::unique_ptr<Lease> out;
};

// Holds `leases` until each of `done` completed: fences after the copies that read or write them (or,
// where queueing failed half way, those copies themselves, since the failed stream may give no fence).
// The copies run on the device whatever happened to the operation on the host (cancelled, failed), so
// the memory goes back to the pool only after them.
// The loop lingers until then (Loop::Linger): a group that failed is often dropped, and its loop with
// it, while its copies still run; the memory then goes back, and the frame is not left suspended.
Task<void> keep_until(std::vector<Future<void>> done, std::shared_ptr<Leases> leases, Loop::Linger) {
  for (Future<void>& step : done) {
    try {
      co_await std::move(step);
    } catch (...) {
      // Ran, or skipped by a failed stream: either way the memory is no longer the device's.
    }
  }
  leases.reset();
}

Task<void> staged_task(std::shared_ptr<GroupState> g, Naming name, std::shared_ptr<Leases> leases,
                       std::optional<gpu::Fence> last, gpu::Stream* own, std::optional<Future<void>> copied_in, Task<void> host,
                       std::optional<gpu::Gate> gate, std::optional<Future<void>> copied_out, CopyBack back) {
  // On every way out: the gate opens, so that the stream never waits for a host part that gave up, and
  // the staging goes back after the last copy queued on it (`last`).
  // `last` is the caller's stream's fence taken at the call (that stream may be gone by now); the
  // group's own stream is asked for one only if the operation ends before its copies did.
  struct OnExit {
    Loop& loop;
    std::optional<gpu::Gate> gate;
    std::shared_ptr<Leases> leases;  // null once every copy queued on them was awaited
    std::optional<gpu::Fence> last;
    gpu::Stream* own = nullptr;
    ~OnExit() {
      if (gate) gate->open();
      if (!leases) return;
      if (own) {
        try {
          last = own->record();
        } catch (const Error&) {
          return;  // its device failed: nothing more runs there, the memory is free
        }
      }
      if (!last) return;
      std::vector<Future<void>> done;
      done.push_back(last->done());
      (void)spawn(loop, keep_until(std::move(done), std::move(leases), loop.linger()));
    }
  } on_exit{*g->loop, gate, std::move(leases), std::move(last), own};
  if (copied_in) co_await device_step(*g, name, std::move(*copied_in));
  co_await std::move(host);
  if (gate) gate->open();
  if (back.stream) {
    try {
      copied_out.emplace(back.stream->copy(back.to, back.from));
    } catch (const Error& e) {
      device_failed(*g, name, e);
    }
  }
  if (copied_out) co_await device_step(*g, name, std::move(*copied_out));
  on_exit.leases.reset();  // every copy that used them ran
}


// The copies of a pipelined operation (the plan runs over buffers still being filled): the copy in,
// queued at the call piece by piece, each piece awaited only when the plan first touches it; and the
// copy back, queued range by range as the plan finishes them (adjacent ranges joined up to a piece), on
// a stream of the operation's own. Loop thread only, one plan at a time (algo::StagedBuffers).
class Pieces final : public algo::StagedBuffers {
 public:
  Pieces(GroupState& g, const char* op, std::size_t piece_bytes) : g_(g), name_{op}, piece_(piece_bytes) {}

  void set_name(const Naming& name) noexcept { name_ = name; }

  /// Queues the copy of `from` (device) into `to` (staging) on `stream`, piece by piece.
  void copy_in(gpu::Stream& stream, std::byte* to, ConstBufferView from) {
    in_ = to;
    in_bytes_ = from.bytes();
    const auto* source = static_cast<const std::byte*>(from.data);
    for (std::size_t at = 0; at < in_bytes_; at += piece_) {
      const std::size_t n = std::min(piece_, in_bytes_ - at);
      pieces_in_.push_back(PieceIn{stream.copy(BufferView(to + at, n, DType::u8), ConstBufferView(source + at, n, DType::u8, from.device)),
                                   PieceIn::State::copying});
    }
  }
  /// Copies back go from `from` (staging) to `to` (device) on `stream`.
  void copy_back_on(gpu::Stream& stream, BufferView to, std::byte* from) {
    back_ = &stream;
    out_device_ = to;
    out_ = from;
    out_bytes_ = to.bytes();
  }

  bool ready(const std::byte* lo, const std::byte* hi) override {
    auto [first, last] = pieces_of(lo, hi);
    for (std::size_t k = first; k < last; ++k) {
      PieceIn& piece = pieces_in_[k];
      if (piece.state == PieceIn::State::copying && piece.copied.ready()) settle(piece);
      if (piece.state != PieceIn::State::landed) return false;
    }
    return true;
  }

  Task<void> until_ready(const std::byte* lo, const std::byte* hi) override {
    auto [first, last] = pieces_of(lo, hi);
    for (std::size_t k = first; k < last; ++k) {
      PieceIn& piece = pieces_in_[k];
      if (piece.state != PieceIn::State::copying) continue;
      try {
        co_await std::move(piece.copied);
        piece.state = PieceIn::State::landed;
      } catch (const Error& e) {
        lost(piece, e);
      }
    }
    // The group's abort is posted: the plan goes on only after it ran, so that nothing of a piece that
    // never landed is sent (a peer could otherwise finish on it before the abort reaches it).
    if (failure) co_await AfterPosted{g_.loop};
  }

  void finished(std::byte* lo, std::byte* hi) override {
    if (!back_ || failure) return;
    lo = std::max(lo, out_);
    hi = std::min(hi, out_ + out_bytes_);
    if (lo >= hi) return;
    if (lo != waiting_hi_) flush();
    if (!waiting_lo_) waiting_lo_ = lo;
    waiting_hi_ = hi;
    if (static_cast<std::size_t>(waiting_hi_ - waiting_lo_) >= piece_) flush();
  }

  /// After the plan: copies back what is still waiting and every range the plan did not report.
  void finish_rest() {
    if (!back_ || failure) return;
    flush();
    std::sort(copied_back_.begin(), copied_back_.end());
    std::size_t at = 0;
    for (auto [lo, hi] : copied_back_) {
      if (lo > at) copy_back(at, lo);
      at = std::max(at, hi);
    }
    if (at < out_bytes_) copy_back(at, out_bytes_);
  }

  /// The pieces still copying in, handed over (queueing failed half way: see keep_until).
  std::vector<Future<void>> still_copying() {
    std::vector<Future<void>> copying;
    for (PieceIn& piece : pieces_in_) {
      if (piece.state != PieceIn::State::copying) continue;
      copying.push_back(std::move(piece.copied));
      piece.state = PieceIn::State::gone;
    }
    return copying;
  }

  std::optional<Error> failure;  // the first copy that failed

 private:
  struct PieceIn {
    Future<void> copied;
    enum class State : std::uint8_t { copying, landed, gone } state;
  };

  std::pair<std::size_t, std::size_t> pieces_of(const std::byte* lo, const std::byte* hi) const {
    if (in_bytes_ == 0 || hi <= in_ || lo >= in_ + in_bytes_) return {0, 0};
    const auto from = static_cast<std::size_t>(std::max(lo, static_cast<const std::byte*>(in_)) - in_);
    const auto to = static_cast<std::size_t>(std::min(hi, static_cast<const std::byte*>(in_ + in_bytes_)) - in_);
    return {from / piece_, (to + piece_ - 1) / piece_};
  }

  void settle(PieceIn& piece) {
    try {
      piece.copied.get();  // ready: does not block
      piece.state = PieceIn::State::landed;
    } catch (const Error& e) {
      lost(piece, e);
    }
  }
  // A piece that will not land: cancelled (the operation is ending), or failed (the group is aborted).
  void lost(PieceIn& piece, const Error& e) {
    piece.state = PieceIn::State::gone;
    if (e.errc() != Errc::cancelled) fail(e);
  }

  void fail(const Error& e) {
    if (failure) return;
    failure = e;
    abort_for_device(g_, name_, e);
  }

  void flush() {
    if (waiting_lo_) copy_back(static_cast<std::size_t>(waiting_lo_ - out_), static_cast<std::size_t>(waiting_hi_ - out_));
    waiting_lo_ = waiting_hi_ = nullptr;
  }

  void copy_back(std::size_t from, std::size_t to) {
    try {
      // Its failure shows at the stream's last fence, which the operation awaits.
      (void)back_->copy(BufferView(static_cast<std::byte*>(out_device_.data) + from, to - from, DType::u8, out_device_.device),
                        ConstBufferView(out_ + from, to - from, DType::u8));
      copied_back_.emplace_back(from, to);
    } catch (const Error& e) {
      fail(e);
    }
  }

  GroupState& g_;
  Naming name_;
  std::size_t piece_;
  std::byte* in_ = nullptr;  // staging being copied in
  std::size_t in_bytes_ = 0;
  std::vector<PieceIn> pieces_in_;
  gpu::Stream* back_ = nullptr;  // null: nothing is copied back
  BufferView out_device_;
  std::byte* out_ = nullptr;  // staging copied back
  std::size_t out_bytes_ = 0;
  std::byte* waiting_lo_ = nullptr;  // finished, not yet copied back
  std::byte* waiting_hi_ = nullptr;
  std::vector<std::pair<std::size_t, std::size_t>> copied_back_;  // byte ranges of the staging
};

// A pipelined operation (run_staged): the plan runs while the pieces copy; then what is left goes back,
// and the gate opens once everything is back on the device.
Task<void> pipelined_task(std::shared_ptr<GroupState> g, Naming name, std::shared_ptr<Leases> leases,
                          gpu::Fence last_in, std::shared_ptr<Pieces> pieces, std::unique_ptr<gpu::Stream> back,
                          std::shared_ptr<DeviceStaging> staging, Task<void> host, std::optional<gpu::Gate> gate) {
  struct OnExit {
    Loop& loop;
    std::optional<gpu::Gate> gate;
    std::shared_ptr<Leases> leases;
    gpu::Fence last_in;
    std::unique_ptr<gpu::Stream> back;
    std::shared_ptr<DeviceStaging> staging;
    ~OnExit() {
      if (gate) gate->open();
      std::vector<Future<void>> done;
      done.push_back(last_in.done());
      if (back) {
        try {
          done.push_back(back->record().done());
        } catch (const Error&) {
          // Its device failed: nothing more runs on it.
        }
        staging->give_back(std::move(back));
      }
      (void)spawn(loop, keep_until(std::move(done), std::move(leases), loop.linger()));
    }
  } on_exit{*g->loop, gate, std::move(leases), std::move(last_in), std::move(back), std::move(staging)};
  std::exception_ptr error;
  try {
    co_await std::move(host);
  } catch (...) {
    error = std::current_exception();
  }
  // A failed copy aborted the group: the host part then failed as aborted, but the cause is the device.
  if (pieces->failure) device_failed(*g, name, *pieces->failure);
  if (error) std::rethrow_exception(error);
  pieces->finish_rest();
  if (pieces->failure) device_failed(*g, name, *pieces->failure);
  if (on_exit.back) {
    gpu::Fence copied_back;
    try {
      copied_back = on_exit.back->record();
    } catch (const Error& e) {
      device_failed(*g, name, e);
    }
    co_await device_step(*g, name, copied_back.done());
  }
  if (gate) gate->open();
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

  // Pipelined: the pieces, where the buffers are large enough to have several and the staging of the
  // input is its own or lies inside the output's (a device input that overlaps the output otherwise
  // could be written back before a piece of it was copied in).
  const std::size_t piece = g.options.staging_copy_bytes;
  const bool apart = !in_device || !out_device || in_lease == nullptr ||
                     call.in.bytes_ptr() + call.in.bytes() <= call.out.bytes_ptr() ||
                     call.out.bytes_ptr() + call.out.bytes() <= call.in.bytes_ptr();
  if (call.pipelined && piece > 0 && apart &&
      std::max(in_device ? call.in.bytes() : 0, out_device ? call.out.bytes() : 0) > piece) {
    auto pieces = std::make_shared<Pieces>(g, call.op, piece);
    std::unique_ptr<gpu::Stream> back;
    if (out_device) {
      back = staging.take_stream(*g.loop, device);
      // The caller's work queued before the call may still use the output.
      if (stream) back->wait(on.record());
      pieces->copy_back_on(*back, call.out, host_out.bytes_ptr());
    }
    std::optional<gpu::Gate> gate;
    gpu::Fence last_in;
    try {
      if (in_device) pieces->copy_in(on, const_cast<std::byte*>(host_in.bytes_ptr()), call.in);
      if (stream) {
        gate.emplace();
        on.wait(*gate);
      }
      last_in = on.record();
    } catch (...) {
      (void)spawn(*g.loop, keep_until(pieces->still_copying(), std::move(leases), g.loop->linger()));
      if (back) staging.give_back(std::move(back));
      throw;
    }
    const std::uint64_t seq = call.takes_seq ? take_seq(g, timeout) : 0;
    const Naming name = call.naming(seq);
    pieces->set_name(name);
    return spawn(*g.loop, pipelined_task(state, name, std::move(leases), std::move(last_in), pieces, std::move(back),
                                         staging.shared_from_this(), host(host_in, host_out, seq, pieces.get()), std::move(gate)));
  }

  // In the stream's order, now: the input after the work queued before; the output after the gate.
  // On the group's own stream nothing of the caller's comes after, so the copy back is queued when the
  // host part is done, and that stream never holds a gate (a gate waits on the device like a kernel, and
  // a DeviceBuffer's free waits for the whole device).
  std::optional<Future<void>> copied_in;
  std::optional<Future<void>> copied_out;
  std::optional<gpu::Gate> gate;
  std::optional<gpu::Fence> last;  // the caller's stream: after every copy queued on the staging
  try {
    if (in_device) {
      copied_in.emplace(on.copy(BufferView(const_cast<void*>(host_in.data), host_in.count, host_in.dtype), call.in));
    }
    if (stream) {
      // Later work on the caller's stream waits for the operation, also where nothing comes back (a send
      // whose buffer a later kernel overwrites).
      gate.emplace();
      on.wait(*gate);
      if (out_device) copied_out.emplace(on.copy(call.out, ConstBufferView(host_out.data, host_out.count, host_out.dtype)));
      last = on.record();
    }
  } catch (...) {
    std::vector<Future<void>> queued;
    if (copied_in) queued.push_back(std::move(*copied_in));
    if (copied_out) queued.push_back(std::move(*copied_out));
    (void)spawn(*g.loop, keep_until(std::move(queued), std::move(leases), g.loop->linger()));
    throw;
  }
  CopyBack back;
  if (out_device && !stream) back = CopyBack{&on, call.out, ConstBufferView(host_out.data, host_out.count, host_out.dtype)};
  const std::uint64_t seq = call.takes_seq ? take_seq(g, timeout) : 0;
  return spawn(*g.loop, staged_task(state, call.naming(seq), std::move(leases), std::move(last), stream ? nullptr : &on, std::move(copied_in),
                                    host(host_in, host_out, seq, nullptr), std::move(gate), std::move(copied_out), back));
}

gpu::Stream& own_stream(GroupState& g, Device device) { return staging_of(g).stream_of(*g.loop, device); }

}  // namespace weft::detail
