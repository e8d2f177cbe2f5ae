#pragma once
// Device buffers in every operation (docs/DESIGN.md, "Device buffers"): an operation whose buffers are
// device memory runs the same host operation (the same plans, transports and algorithm choice) on
// page-locked staging memory, with the copies put in a stream's order at the call:
//
//   stream: [work queued before] -> copy in (device -> staging) -> gate -> copy out (staging -> device) -> [later work]
//   loop:   await copy in -> run the host operation on the staging -> open the gate -> await copy out
//
// Pipelined (StagedCall::pipelined, large buffers): the copy in is queued in pieces and the plan starts
// at once, waiting only for the pieces it touches; each range the plan finishes goes back on a stream of
// the operation's own; the gate opens when all of it is back:
//
//   stream: [work queued before] -> piece 0 -> piece 1 -> ... -> gate -> [later work]
//   back:   (after the work queued before) -> range -> range -> ...
//   loop:   the plan, piece by piece -> the rest back -> await the back stream -> open the gate
//
// The gate is what makes it stream-ordered without the host blocking: kernels the caller queues after
// the call wait on the device until the host part is done, and the input is read only after the work
// queued before it. A device failure aborts the group (every member fails, naming this rank and device).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "weft/algorithms.hpp"
#include "weft/task.hpp"
#include "weft/buffer.hpp"
#include "weft/future.hpp"
#include "weft/gpu.hpp"

namespace weft::detail {

namespace algo = algorithms;
struct GroupState;

/// Whether a view holds device memory that the operation moves (an empty view moves nothing).
inline bool on_device(Device device, std::size_t bytes) noexcept { return device.kind == Device::Kind::cuda && bytes > 0; }

/// Checks a device view where check_buffer checks host ones: the device exists and the memory is that
/// device's, long enough. Errors: weft::Error (invalid_argument) naming the operation and the buffer.
void check_device_view(const GroupState& g, const char* op, const char* name, const void* data, std::size_t bytes,
                       Device device);

/// How a staged operation's device failures name it: a collective by its sequence number, a send or
/// recv as their other errors do, by its number among this rank's sends to (receives from) the peer,
/// with the peer and the tag ("send #2 (peer 1) [tag 0]").
struct Naming {
  const char* op = "";
  std::uint64_t seq = 0;  // 0: none
  int peer = -1;
  std::int64_t tag = -1;
  ErrorContext where(const GroupState& g) const;
  std::string text() const;
};

/// One operation on the device path: which of its views it reads and writes on this rank.
struct StagedCall {
  const char* op;
  ConstBufferView in;
  BufferView out;
  bool reads_in = true;    // the input is read here (not at a scatter's non-root, a broadcast's non-root)
  bool writes_out = true;  // the output is written here (not at a reduce's or gather's non-root, a broadcast's root)
  bool takes_seq = true;   // a collective (numbered); send and recv are not
  /// The host operation touches the staging only through one plan given the StagedBuffers, and writes
  /// nothing after it: the copies then go in pieces (Options::staging_copy_bytes), overlapped with the plan.
  bool pipelined = false;
  /// A send's or recv's own number, peer and tag, for its errors (GroupState::take_p2p_seq).
  std::uint64_t p2p_seq = 0;
  int peer = -1;
  std::int64_t tag = -1;
  /// Its naming, given the collective's sequence number (0 for send and recv).
  Naming naming(std::uint64_t seq) const { return takes_seq ? Naming{op, seq} : Naming{op, p2p_seq, peer, tag}; }
};

/// The host operation on staged views, given its sequence number (0 for send and recv) and, for a
/// pipelined call, the staging still being copied (its plan must be given it; null otherwise).
using HostOperation = std::function<Task<void>(ConstBufferView in, BufferView out, std::uint64_t seq, algo::StagedBuffers* staged)>;

/// The group's own stream of `device` (what an operation given no stream uses); made at the first use.
gpu::Stream& own_stream(GroupState& g, Device device);

/// Runs `call` through staging on `stream` (the caller's, or the group's own stream of the buffers' device
/// when null). Queues the copies and the gate now, in the caller's order, then takes the sequence number.
/// Errors: invalid_argument at once (views on two devices, a stream of another device, bad device memory);
/// the host operation's errors; device_failure (and the group aborted) when a copy fails.
Future<void> run_staged(const std::shared_ptr<GroupState>& g, gpu::Stream* stream, const StagedCall& call,
                        std::chrono::milliseconds timeout, const HostOperation& host);

}  // namespace weft::detail
