// all_reduce on device windows between the processes of one host (device_windows.hpp).
#include "group/device_windows.hpp"

#include <algorithm>
#include <bit>
#include <coroutine>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "algorithms/reduction.hpp"
#include "core/env.hpp"
#include "core/log.hpp"
#include "core/signature.hpp"
#include "devices/peer_window.hpp"
#include "group/checks.hpp"
#include "group/device_staging.hpp"
#include "group/state.hpp"
#include "weft/algorithms.hpp"

namespace weft::detail {

namespace {

constexpr const char* op_name = "all_reduce";

// A call's place in the group's order of calls on device windows. The barriers' flags count calls, so
// every rank must queue its calls' kernels in the same order: each call waits for the previous one's
// turn to end (loop thread only, except the chaining at the call, under DeviceWindows::mutex).
struct Turn {
  bool done = false;
  std::vector<std::coroutine_handle<>> waiters;

  void finish(Loop& loop) {
    done = true;
    for (auto h : std::exchange(waiters, {})) loop.post([h] { h.resume(); });
  }
};

struct TurnAwait {
  Turn* previous;
  bool await_ready() const noexcept { return !previous || previous->done; }
  void await_suspend(std::coroutine_handle<> h) { previous->waiters.push_back(h); }
  void await_resume() const noexcept {}
};

// Awaits a Future without forwarding the task's cancellation to it: the kernels run on whatever the
// caller wants, since the peers' devices wait for this one's at the same barriers.
struct IgnoringStop {
  detail::FutureState<void>* state;
  bool await_ready() const noexcept { return state->ready(); }
  bool await_suspend(std::coroutine_handle<> h) { return state->suspend(h); }
  void await_resume() { state->take(); }
};

bool ipc_wanted() {
  static const bool on = [] {
    return detail::env_switch("WEFT_DEVICE_IPC", false);  // refused by Group::create when malformed
  }();
  return on;
}

}  // namespace

struct DeviceWindows {
  std::mutex mutex;
  std::shared_ptr<Turn> last_turn;  // guarded: the latest call's
  // ---- the loop, one call at a time (the turns)
  std::unique_ptr<gpu::detail::PeerWindow> window;
  bool refused = false;  // a rank could not make or open a window: through host memory, for the group's life
  // A call's instance gave up half way (a peer cancelled or failed): the windows' barrier counts no
  // longer agree between the ranks, so every rank makes new windows at the next call (the agreement).
  bool broken = false;
};

namespace {

DeviceWindows& windows_of(GroupState& g) {
  std::lock_guard lock(g.device_staging_mutex);
  if (!g.device_windows) g.device_windows = std::make_shared<DeviceWindows>();
  return *g.device_windows;
}

// A device failed under this operation: abort the group (the peers wait for this rank's device), then fail.
[[noreturn]] void fail_for_device(GroupState& g, std::uint64_t seq, const Error& e) {
  const std::string text = fmt::format("rank {}: its device failed in {} #{}: {}", g.rank, op_name, seq, e.detail());
  g.mark_failed(text);
  g.transport->abort_context(g.context, Errc::aborted, text);
  throw Error(Errc::device_failure, g.where(op_name, static_cast<std::int64_t>(seq)), e.detail());
}

// Awaits a copy or a fence: its failure is the device's.
Task<void> device_step(GroupState& g, std::uint64_t seq, Future<void> step) {
  std::optional<Error> failure;
  try {
    co_await IgnoringStop{step.state().get()};
  } catch (const Error& e) {
    failure = e;
  }
  if (failure) fail_for_device(g, seq, *failure);
}

// A small all_reduce(max) of u64 words through the host plans, under the call's number and signature;
// `part` keeps its messages apart from the call's other exchanges.
Task<void> agree(GroupState& g, std::uint64_t seq, OpSignature signature, std::uint64_t* words, std::size_t n, std::uint64_t part) {
  const algo::Plan plan = algo::recursive_doubling_all_reduce(g.size, g.rank, n);
  auto* bytes = reinterpret_cast<std::byte*>(words);
  co_await g.run_signed(plan, seq, op_name, signature, algo::PlanBuffers{bytes, bytes, DType::u64, ReduceOp::max}, part << 32);
}

// New windows on every rank (every rank comes here in the same call: the agreement said so): made,
// handles exchanged, opened, and agreed that every rank could.
Task<void> open_windows(GroupState& g, DeviceWindows& w, std::uint64_t seq, OpSignature signature, Device device, std::size_t bytes) {
  const std::size_t capacity = std::max<std::size_t>(std::size_t{1} << 20, std::bit_ceil(bytes));
  w.window.reset();
  std::string refusal;
  std::vector<gpu::IpcHandle> handles(static_cast<std::size_t>(g.size));
  try {
    w.window = std::make_unique<gpu::detail::PeerWindow>(*g.loop, device, capacity);
    handles[static_cast<std::size_t>(g.rank)] = w.window->handle();
  } catch (const Error& e) {
    refusal = e.what();
  }
  // The signals zeroed before any peer can have the handle (its first call writes into them).
  if (w.window) co_await device_step(g, seq, w.window->ready().done());
  const std::size_t each = sizeof(gpu::IpcHandle);
  auto* all = reinterpret_cast<std::byte*>(handles.data());
  const auto blocks = algo::blocks_of(each * static_cast<std::size_t>(g.size), g.size);
  co_await g.run_signed(algo::ring_all_gather(g.size, g.rank, blocks, -1), seq, op_name, signature,
                        algo::PlanBuffers{all, all, DType::u8, ReduceOp::sum}, std::uint64_t{1} << 32);
  if (refusal.empty()) {
    try {
      w.window->connect(g.rank, handles);
    } catch (const Error& e) {
      refusal = e.what();
    }
  }
  std::uint64_t refused = refusal.empty() ? 0 : 1;
  co_await agree(g, seq, signature, &refused, 1, 2);
  if (refused == 0) log().debug("rank {}: device windows of {} bytes on device {}, opened by every rank", g.rank, capacity, device.index);
  if (refused != 0) {
    w.refused = true;
    w.window.reset();
    log().warn("rank {}: all_reduce on device windows refused ({}): it goes through host memory from now on", g.rank,
               refusal.empty() ? std::string("another rank could not make or open a window") : refusal);
  }
}

// The fallback: the input through pinned memory, the host all_reduce, back.
Task<void> through_host(GroupState& g, std::uint64_t seq, OpSignature signature, ConstBufferView in, BufferView out, ReduceOp op,
                        std::optional<gpu::Fence> before) {
  // Freed on a thread of its own: freeing pinned memory waits for the whole device, where the caller's
  // stream waits at this call's gate until this task ends.
  struct FreedOffThread {
    gpu::PinnedBuffer buffer;
    ~FreedOffThread() {
      if (buffer.data()) std::thread([gone = std::move(buffer)] {}).detach();
    }
  } host;
  gpu::Stream& own = own_stream(g, in.device);
  try {
    if (before) own.wait(*before);
    host.buffer = gpu::PinnedBuffer::allocate(in.bytes());
  } catch (const Error& e) {
    fail_for_device(g, seq, e);
  }
  const BufferView staged(host.buffer.data(), in.count, in.dtype);
  co_await device_step(g, seq, own.copy(staged, in));
  const algo::Plan plan = algo::ring_all_reduce(g.size, g.rank, in.count);
  co_await g.run_signed(plan, seq, op_name, signature, algo::PlanBuffers{staged.bytes_ptr(), staged.bytes_ptr(), in.dtype, op},
                        std::uint64_t{3} << 32);
  algo::finish_reduction(op, staged.data, staged.count, staged.dtype, g.size);
  co_await device_step(g, seq, own.copy(out, staged));
}

// While a call's kernel runs: every 2 ms, whether the group failed, a peer left or cancelled the call (the
// cancel came before its kernel was queued there); if so this rank's instance gives up (the peers' may
// never come).
void watch_peers(std::shared_ptr<GroupState> g, std::shared_ptr<DeviceWindows> w, std::uint64_t seq, std::shared_ptr<bool> watching) {
  GroupState& state = *g;
  state.loop->call_after(std::chrono::milliseconds(2), [g = std::move(g), w = std::move(w), seq, watching](bool) mutable {
    if (!*watching) return;
    bool gone = g->failed.load(std::memory_order_relaxed) || g->transport->context_failed(g->context, nullptr, nullptr) ||
                g->transport->operation_cancelled(g->context, seq, nullptr);
    for (int r = 0; r < g->size && !gone; ++r) {
      gone = r != g->rank && !g->transport->connected(g->members[static_cast<std::size_t>(r)]);
    }
    if (gone) {
      if (w->window) w->window->abort();
      return;
    }
    watch_peers(std::move(g), std::move(w), seq, std::move(watching));
  });
}

// Why the instance gave up, as the group sees it.
[[noreturn]] void throw_abandoned(GroupState& g, std::uint64_t seq, const std::string& device_words) {
  const ErrorContext where = g.where(op_name, static_cast<std::int64_t>(seq));
  std::error_code code;
  std::string reason;
  if (g.transport->context_failed(g.context, &code, &reason)) throw Error(static_cast<Errc>(code.value()), where, reason);
  if (g.transport->operation_cancelled(g.context, seq, &reason)) throw CancelledError(where, reason);
  for (int r = 0; r < g.size; ++r) {
    if (r == g.rank || g.transport->connected(g.members[static_cast<std::size_t>(r)])) continue;
    reason = fmt::format("rank {} left the group while rank {} waited for it in {} #{} (on device windows)", r, g.rank, op_name, seq);
    g.mark_failed(reason);
    g.transport->abort_context(g.context, Errc::peer_failure, reason);
    throw Error(Errc::peer_failure, g.where(op_name, static_cast<std::int64_t>(seq), r), reason);
  }
  if (g.failed.load()) {
    std::lock_guard lock(g.failure_mutex);
    throw Error(Errc::group_failed, where, g.failure);
  }
  const std::string text = fmt::format("rank {}: {} #{}: {}", g.rank, op_name, seq, device_words);
  g.mark_failed(text);
  g.transport->abort_context(g.context, Errc::aborted, text);
  throw Error(Errc::device_failure, where, device_words);
}

Task<void> windows_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, ReduceOp op,
                        std::optional<gpu::Fence> before, std::optional<gpu::Gate> gate, std::shared_ptr<Turn> previous,
                        std::shared_ptr<Turn> mine, Loop::Linger) {
  // (The Linger: a Loop dropped while this rank's kernel waits keeps running until the call ends, so that
  // the watcher can still abort the kernel where the group failed, instead of leaving it spinning.)
  // On every way out: the caller's stream goes on, and the next call's turn comes.
  struct OnExit {
    Loop& loop;
    std::optional<gpu::Gate> gate;
    std::shared_ptr<Turn> turn;
    ~OnExit() {
      if (gate) gate->open();
      turn->finish(loop);
    }
  } on_exit{*g->loop, std::move(gate), std::move(mine)};
  co_await TurnAwait{previous.get()};
  previous.reset();
  std::shared_ptr<DeviceWindows> w = g->device_windows;
  const OpSignature signature = signature::of_device_windows(in.dtype, op, in.count);
  // The windows every rank needs: the largest input, and whether some rank has none on this device.
  std::uint64_t need[2] = {in.bytes(), w->window && w->window->device() == in.device && !w->broken ? 0u : 1u};
  co_await agree(*g, seq, signature, need, 2, 0);
  if (!w->refused && (need[1] != 0 || w->window->capacity() < need[0])) {
    w->broken = false;
    co_await open_windows(*g, *w, seq, signature, in.device, static_cast<std::size_t>(need[0]));
  }
  if (w->refused) {
    co_await through_host(*g, seq, signature, in, out, op, before);
    co_return;
  }
  std::optional<Future<void>> done;
  try {
    done.emplace(w->window->queue(before ? *before : gpu::Fence(), in, out, op).done());
  } catch (const Error& e) {
    fail_for_device(*g, seq, e);
  }
  g->watch(seq, op_name);  // its deadline, as any collective's
  g->device_windows_seq = seq;  // what its deadline report says it waits for
  auto watching = std::make_shared<bool>(true);
  watch_peers(g, w, seq, watching);
  std::optional<Error> failure;
  try {
    co_await IgnoringStop{done->state().get()};
  } catch (const Error& e) {
    failure = e;
  }
  *watching = false;
  g->device_windows_seq = 0;
  g->unwatch(seq);
  if (failure) fail_for_device(*g, seq, *failure);
  if (const std::string why = w->window->take_failure(); !why.empty()) {
    w->broken = true;
    throw_abandoned(*g, seq, why);
  }
  if (w->window->aborted()) w->broken = true;  // aborted after its instance got through: new windows next time
}

}  // namespace

bool takes_device_windows(const GroupState& g, const CollectiveCall& call) {
  return ipc_wanted() && call.collective == Collective::all_reduce && on_device(call.in.device, call.in.bytes()) &&
         on_device(call.out.device, call.out.bytes()) && call.in.device == call.out.device && g.size >= 2 && g.size <= 8 &&
         !g.across_hosts;
}

Future<void> run_on_device_windows(const std::shared_ptr<GroupState>& state, gpu::Stream* stream, const CollectiveCall& call,
                                   std::chrono::milliseconds timeout) {
  GroupState& g = *state;
  const Device device = call.in.device;
  if (stream && !(stream->device() == device)) {
    invalid(g, op_name, fmt::format("the stream is on device {} but the buffers on device {}", stream->device().index, device.index));
  }
  if (stream && &stream->loop() != g.loop) invalid(g, op_name, "the stream completes on another Loop than the group's");
  check_device_view(g, op_name, "input", call.in.data, call.in.bytes(), device);
  check_device_view(g, op_name, "output", call.out.data, call.out.bytes(), device);
  DeviceWindows& w = windows_of(g);
  std::optional<gpu::Fence> before;
  std::optional<gpu::Gate> gate;
  if (stream) {
    before = stream->record();
    gate.emplace();
    stream->wait(*gate);
  }
  auto mine = std::make_shared<Turn>();
  std::shared_ptr<Turn> previous;
  std::uint64_t seq = 0;
  try {
    seq = take_seq(g, timeout);
  } catch (...) {
    if (gate) gate->open();
    throw;
  }
  {
    std::lock_guard lock(w.mutex);
    previous = std::exchange(w.last_turn, mine);
  }
  return spawn(*g.loop, windows_task(state, seq, call.in, call.out, call.op, std::move(before), std::move(gate), std::move(previous),
                                     std::move(mine), g.loop->linger()));
}

}  // namespace weft::detail
