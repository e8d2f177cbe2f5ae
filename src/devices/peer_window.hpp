#pragma once
// gpu::detail::PeerWindow: one rank's share of the peer all_reduce between processes of one host (issue
// 17, part 4; docs/DESIGN.md, "Device memory between processes"). Each rank owns a window in its
// device's memory, [signals | input], exported as an IpcHandle; once every rank has
// opened every other's (connect), a call copies its input into its own window and runs its device's
// instance of kernels/peer's all_reduce over every window, writing its own output: the same kernel as a
// DeviceSet's, with the windows for inputs, so the output may be the input. One stage only: the
// two-stage form reads the peers' scratch after its last barrier, when a peer process may have left.
// The windows' barriers keep a window from being rewritten (the next call's copy in) while a peer still
// reads it.
//
// Not thread-safe: one owner (the group's loop) queues the calls, in the group's order.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "weft/buffer.hpp"
#include "weft/gpu.hpp"
#include "weft/loop.hpp"
#include "weft/reduce_op.hpp"

namespace weft::gpu::detail {

class StreamImpl;

class PeerWindow {
 public:
  /// This rank's window on `device`: `capacity` bytes of input, its signals
  /// zeroed by work queued on the window's own stream, which every call's work follows.
  /// Errors: device_failure (out of device memory, a failed device).
  PeerWindow(Loop& loop, Device device, std::size_t capacity);
  /// The imports are closed and the window freed on a thread of its own, after the device work on them
  /// (freeing waits for the whole device, where another rank's gate may wait for this thread's loop).
  ~PeerWindow();
  PeerWindow(const PeerWindow&) = delete;
  PeerWindow& operator=(const PeerWindow&) = delete;

  /// Reached once the window's signals are zeroed. Hand the handle to the peers only after it: a peer's
  /// first call writes into this window's signals, and a zeroing that came after would erase it.
  Fence ready() const;
  IpcHandle handle() const;
  std::size_t capacity() const noexcept { return capacity_; }
  Device device() const noexcept { return device_; }

  /// Opens every other rank's window (`handles[rank]` is this one's). Errors: those of
  /// ImportedBuffer::open (device_failure where IPC is refused), invalid_argument (more ranks than
  /// the kernels take, a window smaller than this one).
  void connect(int rank, const std::vector<IpcHandle>& handles);

  /// Queues on the window's stream, after `after` (the caller's work before the call; an empty Fence:
  /// nothing): `in` into this window, then this rank's instance of the all_reduce of every rank's
  /// window into `out` (avg divides by the ranks). `in` and `out`: this window's device, in.bytes() <=
  /// capacity(), the same count and dtype. Returns the fence after it. A barrier that gave up (abort(),
  /// or a bounded spin) does not fail the fence: take_failure() says so once it is reached.
  Fence queue(const Fence& after, ConstBufferView in, BufferView out, ReduceOp op);
  /// Why the calls queued so far failed ("" if none did); cleared by reading. After their fence only.
  std::string take_failure();

  /// Every instance of this rank's that waits at a barrier gives up, now and later (its group failed:
  /// its peers' instances may never come). Thread-safe.
  void abort() noexcept;
  /// Whether abort() was called: the window's later calls give up at their first wait.
  bool aborted() const noexcept;

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;
  std::shared_ptr<StreamImpl> stream_;
  Device device_;
  std::size_t capacity_ = 0;
  std::uint64_t zeroed_ = 0;  // the window stream's item that zeroes the signals
  int rank_ = 0;
  int ranks_ = 0;
};

}  // namespace weft::gpu::detail
