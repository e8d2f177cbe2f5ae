// gpu::DeviceSet: all_reduce across the devices of one process (issue 17; docs/DESIGN.md, "Several
// devices of one process"): the peer path (kernels/peer's protocol, on the sim's workers for now) and
// the naive path (stream copies into scratch of each entry's own), both with the output epilogue.
#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <string_view>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "devices/backend.hpp"
#include "devices/checks.hpp"
#include "devices/peer_launch.hpp"
#include "devices/sim_peer.hpp"
#include "core/log.hpp"
#include "kernels/cpu/epilogue.hpp"
#include "kernels/cpu/reduce.hpp"
#include "kernels/peer/all_reduce.hpp"
#include "kernels/peer/host_atomics.hpp"
#include "weft/error.hpp"
#include "weft/gpu.hpp"
#include "weft/when.hpp"

namespace weft::gpu {

namespace detail {

// Which path all_reduce takes (WEFT_DEVICE_SET, read when a set is made; for benchmarks and for forcing
// a path while chasing a problem): automatic picks the peer kernels where every pair of devices reaches
// the other and their form by size; one_stage and two_stage
// force the peer kernels' form where the devices reach each other (in place is always two-stage: one
// stage would overwrite an input another device still reads); naive forces the copies.
enum class SetPath { automatic, one_stage, two_stage, naive };

struct DeviceSetState {
  Loop* loop = nullptr;
  SetPath path = SetPath::automatic;
  std::vector<Device> devices;
  std::vector<std::shared_ptr<StreamImpl>> streams;  // one per entry
  bool peer_to_peer = false;
  // The peer path's signals (the sim: host memory its workers share), zeroed once.
  std::vector<std::unique_ptr<kernels::peer::Signal>> signals;
  // The naive path's scratch per entry: the sum so far and the input being added.
  std::mutex mutex;
  std::vector<DeviceBuffer> sums, addends;  // guarded; grown between calls
  // The peer path on a GPU: each entry's signal in its device's memory (zeroed once,
  // copied from `zeros` on its stream before any call), each entry's slice of the two-stage scratch, a
  // word per entry that a kernel whose spin gave up sets, and the most blocks per kernel that keep every
  // entry's instance resident at once (the barriers spin).
  bool kernels_on_device = false;
  std::vector<DeviceBuffer> device_signals;
  PinnedBuffer zeros, failed_words;
  std::vector<DeviceBuffer> peer_scratch;  // guarded; grown between calls
  int most_blocks = kernels::peer::max_blocks;
};

}  // namespace detail

namespace {

using detail::await_fence;
using detail::check_device;
using detail::check_view;
using detail::DeviceSetState;
using detail::SetPath;
using detail::StreamImpl;

// Scratch that only grows: `buffer` becomes at least `bytes` on `device`; the smaller one it replaces
// joins `dropped` (for free_off_thread).
void grow(DeviceBuffer& buffer, Device device, std::size_t bytes, std::vector<DeviceBuffer>& dropped) {
  if (buffer.bytes() >= bytes) return;
  if (buffer.bytes() > 0) dropped.push_back(std::move(buffer));
  buffer = DeviceBuffer::allocate(device, bytes);
}

// Replaced scratch is freed on a thread of its own: freeing waits for the whole device (cudaFree), where
// a gate of another rank's operation may wait for this thread's loop.
void free_off_thread(std::vector<DeviceBuffer> dropped) {
  if (!dropped.empty()) std::thread([gone = std::move(dropped)] {}).detach();
}

SetPath path_from_environment() {
  const char* v = std::getenv("WEFT_DEVICE_SET");
  const std::string_view text = v ? v : "";
  if (text.empty() || text == "auto") return SetPath::automatic;
  if (text == "one_stage") return SetPath::one_stage;
  if (text == "two_stage") return SetPath::two_stage;
  if (text == "naive") return SetPath::naive;
  throw Error(Errc::invalid_argument, {.op = "DeviceSet"},
              fmt::format("WEFT_DEVICE_SET={}: give auto, one_stage, two_stage or naive", text));
}

Task<void> await_all(std::vector<Future<void>> each, std::shared_ptr<std::string> failure) {
  co_await when_all(std::move(each));
  if (!failure->empty()) throw Error(Errc::device_failure, {.op = "DeviceSet::all_reduce"}, *failure);
}

// The peer kernels' calls: once every entry's kernel ran, a word that a kernel whose spin gave up set
// (builds with WEFT_PEER_SPIN_BOUND) fails the call, naming the device. Looked at here, on the loop, once
// the kernels' fences were reached (their stores are visible then), not by a host function queued after
// each kernel: that cost a cudaLaunchHostFunc per entry per call.
Task<void> await_peer_kernels(std::vector<Future<void>> each, std::shared_ptr<DeviceSetState> set) {
  co_await when_all(std::move(each));
  auto* words = static_cast<std::uint32_t*>(set->failed_words.data());
  for (std::size_t i = 0; i < set->devices.size(); ++i) {
    if (std::atomic_ref<std::uint32_t>(words[i]).exchange(0) != 0) {
      throw Error(Errc::device_failure, {.op = "DeviceSet::all_reduce"},
                  fmt::format("device {}: a peer barrier gave up (a peer's kernel never came)", set->devices[i].index));
    }
  }
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
  state->path = path_from_environment();
  for (std::size_t i = 0; i < devices.size(); ++i) {
    check_device(devices[i], "DeviceSet", fmt::format("entry {}", i).c_str());
    state->streams.push_back(detail::backend().make_stream(loop, devices[i].index));
  }
  bool reach = true;
  for (const Device& a : devices) {
    for (const Device& b : devices) reach = reach && can_access_peer(a, b);
  }
  // The peer kernels run on the sim's workers, and on the GPU (opt-in until they passed there: on an
  // H200 on 2026-11-28, N = 1-8 on every dtype and op, one and two stages, 10^4 calls; bench/RESULTS.md).
  const bool on_gpu = backend() == Backend::cuda;
  state->peer_to_peer = reach && state->path != SetPath::naive && (backend() == Backend::sim || on_gpu);
  if (state->peer_to_peer && on_gpu) {
    for (const Device& a : devices) {
      for (const Device& b : devices) {
        if (const std::string why = detail::backend().enable_peer_access(a.index, b.index); !why.empty() && state->peer_to_peer) {
          weft::log().warn("DeviceSet: the naive path, not peer to peer: {}", why);
          state->peer_to_peer = false;
        }
      }
    }
  }
  if (state->peer_to_peer && on_gpu) {
    state->kernels_on_device = true;
    const std::size_t n = devices.size();
    state->zeros = PinnedBuffer::allocate(sizeof(kernels::peer::Signal));
    std::memset(state->zeros.data(), 0, state->zeros.bytes());
    state->failed_words = PinnedBuffer::allocate(n * sizeof(std::uint32_t));
    std::memset(state->failed_words.data(), 0, state->failed_words.bytes());
    std::map<int, int> entries_on;  // physical device -> entries
    for (const Device& d : devices) ++entries_on[d.index];
    for (std::size_t i = 0; i < n; ++i) {
      state->device_signals.push_back(DeviceBuffer::allocate(devices[i], sizeof(kernels::peer::Signal)));
      // Zeroed on the entry's stream: every entry's first call waits for what the others queued before.
      state->streams[i]->copy(state->device_signals[i].data(), state->zeros.data(), sizeof(kernels::peer::Signal),
                              detail::CopyKind::host_to_device, -1, devices[i].index);
      const int sms = detail::backend().multiprocessors(devices[i].index);
      if (sms > 0) state->most_blocks = std::min(state->most_blocks, std::max(1, sms / entries_on[devices[i].index]));
    }
    state->peer_scratch.resize(n);
  } else if (state->peer_to_peer) {
    for (std::size_t i = 0; i < devices.size(); ++i) state->signals.push_back(std::make_unique<kernels::peer::Signal>());
  }
  state->sums.resize(devices.size());
  state->addends.resize(devices.size());
  state->devices = std::move(devices);
  return DeviceSet(std::move(state));
}

const std::vector<Device>& DeviceSet::devices() const noexcept { return state_->devices; }
bool DeviceSet::peer_to_peer() const noexcept { return state_->peer_to_peer; }

Fence DeviceSet::record(std::size_t entry) const {
  if (entry >= state_->streams.size()) {
    throw Error(Errc::invalid_argument, {.op = "DeviceSet::record"}, fmt::format("entry {} of a set of {}", entry, state_->streams.size()));
  }
  return Fence(state_->streams[entry], state_->streams[entry]->last());
}

void DeviceSet::wait(std::size_t entry, const Fence& fence) {
  constexpr const char* op = "DeviceSet::wait";
  if (entry >= state_->streams.size()) {
    throw Error(Errc::invalid_argument, {.op = op}, fmt::format("entry {} of a set of {}", entry, state_->streams.size()));
  }
  if (!fence.stream_) throw Error(Errc::invalid_argument, {.op = op}, "a default-constructed Fence belongs to no stream");
  if (fence.stream_ == state_->streams[entry]) return;
  state_->streams[entry]->wait(fence.stream_, fence.seq_);
}

Future<void> DeviceSet::all_reduce(std::vector<BufferView> inout, ReduceOp op, const Epilogue& epilogue) {
  std::vector<ConstBufferView> inputs(inout.begin(), inout.end());
  return all_reduce(std::move(inputs), std::move(inout), op, epilogue);
}

Future<void> DeviceSet::all_reduce(std::vector<ConstBufferView> inputs, std::vector<BufferView> outputs, ReduceOp op,
                                   const Epilogue& epilogue) {
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
  detail::check_epilogue_runs(epilogue, what);
  const DType out_dtype = epilogue.output(dtype);
  bool in_place = false;
  for (std::size_t i = 0; i < n; ++i) {
    const std::string at = fmt::format("entry {}", i);
    for (const auto* view : {&inputs[i].device, &outputs[i].device}) {
      if (!(*view == set.devices[i])) {
        throw Error(Errc::invalid_argument, {.op = what}, fmt::format("{}: its views must be on device {}", at, set.devices[i].index));
      }
    }
    if (inputs[i].dtype != dtype || inputs[i].count != count || outputs[i].count != count || outputs[i].dtype != out_dtype) {
      throw Error(Errc::invalid_argument, {.op = what},
                  fmt::format("{}: {} x {} in, {} x {} out; every input must be {} x {} (entry 0's) and every output {} x {}{}", at,
                              inputs[i].count, to_string(inputs[i].dtype), outputs[i].count, to_string(outputs[i].dtype), count,
                              to_string(dtype), count, to_string(out_dtype),
                              epilogue.is_identity() ? std::string() : fmt::format(" (the epilogue {})", epilogue.describe())));
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
      if (dtype_size(out_dtype) != dtype_size(dtype)) {
        throw Error(Errc::invalid_argument, {.op = what},
                    fmt::format("{}: in place, but the epilogue {} stores {}-byte elements for {}-byte ones: give it an output of its own",
                                at, epilogue.describe(), dtype_size(out_dtype), dtype_size(dtype)));
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
  const bool two_stage = in_place || set.path == SetPath::two_stage ||
                         (set.path == SetPath::automatic && n > 2 && bytes > (std::size_t{256} << 10));
  // On a GPU the kernels store avg's quotient, not an epilogue's value: a set with an epilogue takes the
  // naive path there (its epilogue is a pass of its own).
  if (set.kernels_on_device && epilogue.is_identity()) {
    std::vector<void*> scratch(n, nullptr);
    if (two_stage) {
      std::vector<DeviceBuffer> dropped;
      std::lock_guard lock(set.mutex);
      for (std::size_t k = 0; k < n; ++k) {
        const auto slice = kernels::peer::share(count, static_cast<int>(k), static_cast<int>(n));
        grow(set.peer_scratch[k], set.devices[k], (slice.last - slice.first + 1) * esize, dropped);
        scratch[k] = set.peer_scratch[k].data();
      }
      free_off_thread(std::move(dropped));
    }
    constexpr int lanes = 512;
    const std::size_t wanted = (count + lanes * 8 - 1) / (lanes * 8);
    const int blocks = static_cast<int>(std::clamp<std::size_t>(wanted, 1, static_cast<std::size_t>(set.most_blocks)));
    auto* failed = static_cast<std::uint32_t*>(set.failed_words.data());
    for (std::size_t i = 0; i < n; ++i) {
      wait_for_others(i, before);
      detail::PeerLaunch l;
      l.devices.rank = static_cast<int>(i);
      l.devices.n = static_cast<int>(n);
      for (std::size_t k = 0; k < n; ++k) {
        l.devices.signals[k] = static_cast<kernels::peer::Signal*>(set.device_signals[k].data());
        l.inputs[k] = inputs[k].data;
        l.scratch[k] = scratch[k];
      }
      l.out = outputs[i].data;
      l.count = count;
      l.dtype = dtype;
      l.op = op == ReduceOp::avg ? ReduceOp::sum : op;
      l.divisor = op == ReduceOp::avg ? static_cast<int>(n) : 1;
      l.two_stage = two_stage;
      l.blocks = blocks;
      l.lanes = lanes;
      l.failed = failed + i;
      const std::uint64_t launched = set.streams[i]->peer_all_reduce(l);
      each.push_back(spawn(*set.loop, await_fence(set.streams[i], launched, what)));
    }
    return spawn(*set.loop, await_peer_kernels(std::move(each), state_));
  }
  if (set.peer_to_peer && !set.kernels_on_device) {
    detail::SimPeerCall call;
    call.devices.n = static_cast<int>(n);
    for (std::size_t k = 0; k < n; ++k) {
      call.devices.signals[k] = set.signals[k].get();
      call.inputs.push_back(detail::backend().worker_address(inputs[k].data));
    }
    call.count = count;
    call.dtype = dtype;
    call.op = op;
    call.divisor = op == ReduceOp::avg ? static_cast<int>(n) : 1;
    call.epilogue = epilogue;
    call.out_dtype = out_dtype;
    call.two_stage = two_stage;
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
      detail::SimPeerCall mine = call;
      mine.devices.rank = static_cast<int>(i);
      mine.output = detail::backend().worker_address(outputs[i].data);
      mine.device = set.devices[i].index;
      auto body = [state = state_, mine = std::move(mine), failure, scratch]() mutable {
        for (auto& slice : *scratch) mine.scratch.push_back(slice.data());
        const std::string why = detail::run_peer_on_sim(mine);
        if (!why.empty()) {
          std::lock_guard lock(state->mutex);
          if (failure->empty()) *failure = why;
        }
      };
      // Spins as the kernel does: it waits for the other entries' bodies.
      each.push_back(spawn(*set.loop, await_fence(set.streams[i], set.streams[i]->host(std::move(body), /*spins=*/true), what)));
    }
    return spawn(*set.loop, await_all(std::move(each), failure));
  }
  // Naive: every entry copies every input (rank order) into scratch of its own and adds it up; then,
  // once every entry has read every input, writes its output (which may be its input), through the
  // epilogue where there is one.
  {
    std::vector<DeviceBuffer> dropped;
    std::lock_guard lock(set.mutex);
    for (std::size_t i = 0; i < n; ++i) {
      grow(set.sums[i], set.devices[i], bytes, dropped);
      if (n > 1) grow(set.addends[i], set.devices[i], bytes, dropped);
    }
    free_off_thread(std::move(dropped));
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
    void* sum = set.sums[i].data();
    if (op == ReduceOp::avg && n > 1) s.divide(sum, count, dtype, static_cast<int>(n));
    if (epilogue.is_identity()) s.copy(outputs[i].data, sum, bytes, detail::CopyKind::device_to_device, me, me);
    else s.epilogue(sum, dtype, outputs[i].data, count, epilogue);
    each.push_back(spawn(*set.loop, await_fence(set.streams[i], s.last(), what)));
  }
  return spawn(*set.loop, await_all(std::move(each), failure));
}

}  // namespace weft::gpu
