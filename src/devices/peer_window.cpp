// gpu::detail::PeerWindow (peer_window.hpp): the peer all_reduce over windows that processes of one host
// opened in each other (IpcHandle), on the sim's workers or, under cuda, as the peer kernel.
#include "devices/peer_window.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "devices/backend.hpp"
#include "devices/peer_launch.hpp"
#include "devices/sim_peer.hpp"
#include "kernels/peer/all_reduce.hpp"
#include "weft/error.hpp"

namespace weft::gpu::detail {

namespace {

constexpr std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }
constexpr std::size_t signal_bytes = round_up(sizeof(kernels::peer::Signal), 256);

}  // namespace

// What queued work uses: kept by every item that reads it, so that it outlives the window's owner.
struct PeerWindow::Shared {
  DeviceBuffer mine;
  std::vector<ImportedBuffer> peers;  // every other rank's window, in rank order without this one
  std::vector<std::byte*> bases;      // every rank's window as this device addresses it, in rank order
  PinnedBuffer zeros;                 // the signals' first value (read by the zeroing copy)
  PinnedBuffer words;                 // [0]: abort (the host sets it), [1]: a barrier gave up (the device sets it)
  std::uint32_t* abort_word() const { return static_cast<std::uint32_t*>(words.data()); }
  std::uint32_t* failed_word() const { return static_cast<std::uint32_t*>(words.data()) + 1; }
};

PeerWindow::PeerWindow(Loop& loop, Device device, std::size_t capacity)
    : shared_(std::make_shared<Shared>()),
      stream_(backend().make_stream(loop, device.index)),
      device_(device),
      capacity_(round_up(std::max<std::size_t>(capacity, 256), 256)) {
  Shared& s = *shared_;
  s.mine = DeviceBuffer::allocate(device, signal_bytes + capacity_);
  s.zeros = PinnedBuffer::allocate(signal_bytes);
  std::memset(s.zeros.data(), 0, signal_bytes);
  s.words = PinnedBuffer::allocate(2 * sizeof(std::uint32_t));
  std::memset(s.words.data(), 0, s.words.bytes());
  zeroed_ = stream_->copy(s.mine.data(), s.zeros.data(), signal_bytes, CopyKind::host_to_device, -1, device.index);
}

Fence PeerWindow::ready() const { return Fence(stream_, zeroed_); }

PeerWindow::~PeerWindow() {
  // Closing an import and freeing device memory both wait for the device's work.
  std::thread([shared = std::move(shared_), stream = std::move(stream_)] {}).detach();
}

IpcHandle PeerWindow::handle() const { return export_memory(shared_->mine); }

void PeerWindow::connect(int rank, const std::vector<IpcHandle>& handles) {
  constexpr const char* op = "all_reduce (device windows)";
  const int n = static_cast<int>(handles.size());
  if (n < 1 || n > kernels::peer::max_devices || rank < 0 || rank >= n) {
    throw Error(Errc::invalid_argument, {.op = op}, fmt::format("{} ranks: the peer kernels take 1 to {}", n, kernels::peer::max_devices));
  }
  Shared& s = *shared_;
  std::vector<ImportedBuffer> peers;
  std::vector<std::byte*> bases;
  for (int k = 0; k < n; ++k) {
    if (k == rank) {
      bases.push_back(static_cast<std::byte*>(s.mine.data()));
      continue;
    }
    const IpcHandle& h = handles[static_cast<std::size_t>(k)];
    if (h.bytes < signal_bytes + capacity_) {
      throw Error(Errc::invalid_argument, {.op = op}, fmt::format("rank {}'s window holds {} bytes, this rank's {}", k, h.bytes,
                                                                  signal_bytes + capacity_));
    }
    peers.push_back(ImportedBuffer::open(h));
    bases.push_back(static_cast<std::byte*>(peers.back().data()));
  }
  s.peers = std::move(peers);
  s.bases = std::move(bases);
  rank_ = rank;
  ranks_ = n;
}

std::string PeerWindow::take_failure() {
  if (std::atomic_ref<std::uint32_t>(*shared_->failed_word()).exchange(0, std::memory_order_acq_rel) == 0) return {};
  const bool aborted = std::atomic_ref<std::uint32_t>(*shared_->abort_word()).load(std::memory_order_acquire) != 0;
  return aborted ? fmt::format("device {}: the peer all_reduce was abandoned (the group failed)", device_.index)
                 : fmt::format("device {}: a peer barrier gave up (a peer's work never came)", device_.index);
}

bool PeerWindow::aborted() const noexcept {
  return std::atomic_ref<std::uint32_t>(*shared_->abort_word()).load(std::memory_order_acquire) != 0;
}

void PeerWindow::abort() noexcept {
  std::atomic_ref<std::uint32_t>(*shared_->abort_word()).store(1, std::memory_order_release);
}

Fence PeerWindow::queue(const Fence& after, ConstBufferView in, BufferView out, ReduceOp op) {
  Shared& s = *shared_;
  const std::size_t count = in.count;
  const std::size_t bytes = in.bytes();
  constexpr const char* what = "all_reduce (device windows)";
  if (ranks_ == 0) throw Error(Errc::invalid_argument, {.op = what}, "the window is not connected to its peers' yet");
  if (bytes > capacity_ || in.count != out.count || in.dtype != out.dtype || !(in.device == device_) || !(out.device == device_)) {
    throw Error(Errc::invalid_argument, {.op = what},
                fmt::format("{} x {} in, {} x {} out, for a window of {} bytes on device {}: the same count and dtype, on the "
                            "window's device, at most its size",
                            in.count, to_string(in.dtype), out.count, to_string(out.dtype), capacity_, device_.index));
  }
  if (after.stream_ && after.stream_ != stream_) stream_->wait(after.stream_, after.seq_);
  if (count == 0) return Fence(stream_, stream_->last());
  std::byte* input = static_cast<std::byte*>(s.mine.data()) + signal_bytes;
  stream_->copy(input, in.data, bytes, CopyKind::device_to_device, in.device.index, device_.index);
  const int n = ranks_;
  // One stage: every instance reads every window, then meets the others at the end barrier, after
  // which nothing reads a peer's memory (a peer may then leave and free it). The two-stage form reads the
  // peers' scratch after its last barrier: not between processes until the protocol has a third one.
  constexpr bool two_stage = false;
  const ReduceOp combine = op == ReduceOp::avg ? ReduceOp::sum : op;
  const int divisor = op == ReduceOp::avg ? n : 1;
  if (backend().name() == "sim") {
    SimPeerCall call;
    call.devices.rank = rank_;
    call.devices.n = n;
    call.devices.abort = s.abort_word();
    for (int k = 0; k < n; ++k) {
      std::byte* base = static_cast<std::byte*>(backend().worker_address(s.bases[static_cast<std::size_t>(k)]));
      call.devices.signals[k] = reinterpret_cast<kernels::peer::Signal*>(base);
      call.inputs.push_back(base + signal_bytes);
    }
    call.output = backend().worker_address(out.data);
    call.count = count;
    call.dtype = in.dtype;
    call.op = combine;
    call.divisor = divisor;
    call.out_dtype = out.dtype;
    call.two_stage = two_stage;
    call.device = device_.index;
    // The body keeps the windows open while it runs; a barrier that gave up fails the item (and, as a
    // trapped kernel does, the device's later work).
    stream_->host([call = std::move(call), keep = shared_] {
      const std::string why = run_peer_on_sim(call);
      if (!why.empty()) std::atomic_ref<std::uint32_t>(*keep->failed_word()).store(1, std::memory_order_release);
    }, /*spins=*/true);  // as the kernel: waits for the other ranks' devices
  } else {
    PeerLaunch l;
    l.devices.rank = rank_;
    l.devices.n = n;
    l.devices.abort = s.abort_word();
    for (int k = 0; k < n; ++k) {
      std::byte* base = s.bases[static_cast<std::size_t>(k)];
      l.devices.signals[k] = reinterpret_cast<kernels::peer::Signal*>(base);
      l.inputs[k] = base + signal_bytes;
    }
    l.out = out.data;
    l.count = count;
    l.dtype = in.dtype;
    l.op = combine;
    l.divisor = divisor;
    l.two_stage = two_stage;
    constexpr int lanes = 512;
    const std::size_t wanted = (count + lanes * 8 - 1) / (lanes * 8);
    const int sms = backend().multiprocessors(device_.index);
    // Every rank's instance resident at once (the barriers spin): at most the multiprocessors shared by
    // the ranks on this device; the ranks' devices are assumed alike.
    const int most = std::max(1, std::min(kernels::peer::max_blocks, sms > 0 ? sms / n : kernels::peer::max_blocks));
    l.blocks = static_cast<int>(std::clamp<std::size_t>(wanted, 1, static_cast<std::size_t>(most)));
    l.lanes = lanes;
    l.failed = s.failed_word();
    stream_->peer_all_reduce(l);
  }
  return Fence(stream_, stream_->last());
}

}  // namespace weft::gpu::detail
