#pragma once
/// weft::gpu::MultiDeviceGroup: a rank of a Group that drives several devices of its process (NCCL's one
/// process with many GPUs; issue 17). Its all_reduce is the composition it reads as (src/multi_device):
///
///   1. inside the process: the devices' inputs reduced on every device (DeviceSet, peer to peer where it can);
///   2. across processes: entry 0's copy reduced over every rank (Group::on(entry 0's stream), over TCP,
///      io_uring or shared memory as the group goes);
///   3. inside the process again: entry 0's result copied to every entry, then avg's division (by the
///      number of devices of every rank together) and the epilogue, into the outputs.
///
/// Every stage is queued at the call, ordered on the devices (fences), so the host blocks nowhere and the
/// cross-process collective takes its sequence number at the call, in the caller's order.
#include <cstddef>
#include <memory>
#include <vector>

#include "weft/gpu.hpp"
#include "weft/group.hpp"

namespace weft::gpu {

namespace detail {
struct MultiDeviceState;
}

class MultiDeviceGroup {
 public:
  MultiDeviceGroup() = default;

  /// Collective over `group`: every rank calls it with the devices it drives (1 to 8; a device may
  /// appear more than once; ranks may drive different numbers). Learns how many devices all ranks drive
  /// together (one all_gather). The group is shared, not copied: its collectives and this one's take
  /// sequence numbers from one count, so call them in one order on every rank.
  /// Errors: invalid_argument (as DeviceSet::create); the group's errors.
  static Future<MultiDeviceGroup> create(Group group, std::vector<Device> devices);

  bool valid() const noexcept { return static_cast<bool>(state_); }
  const Group& group() const;
  const std::vector<Device>& devices() const;
  /// The devices of every rank together (avg divides by it).
  int total_devices() const;
  /// This rank's first device's place among all ranks' devices (ranks in order, devices in order).
  int first_device_rank() const;

  /// outputs[i] = epilogue(the reduction of every input of every rank's devices) (avg: the sum divided
  /// by total_devices(), then the epilogue), on every entry i. inputs[i] and outputs[i] on devices()[i],
  /// one count (the same on every rank), inputs of one dtype, outputs of epilogue.output(it); an output may
  /// be its own input. Inputs must be ready (written by work that is done, or ordered with
  /// set().wait()); later work orders after the call with set().record(i) or waits for the Future.
  /// Errors: invalid_argument at once (as DeviceSet::all_reduce, naming the entry); the group's
  /// failures (every rank's call fails) and device_failure through the Future.
  /// Cancellation: cancelling the Future cancels the cross-process part as any collective of the group
  /// (on every member: their calls fail with CancelledError; the group stays usable); the device work
  /// already queued goes on.
  /// Lifetime: the views outlive the Future; the MultiDeviceGroup outlives its calls.
  Future<void> all_reduce(std::vector<ConstBufferView> inputs, std::vector<BufferView> outputs, ReduceOp op = ReduceOp::sum,
                          const Epilogue& epilogue = {});
  /// In place: every view is its entry's input and output.
  Future<void> all_reduce(std::vector<BufferView> inout, ReduceOp op = ReduceOp::sum, const Epilogue& epilogue = {});

  /// The process's devices as a set (stage 1), for stream order with the caller's work: set().wait(i,
  /// stream.record()) before a call, stream.wait(set().record(i)) after one.
  DeviceSet& set();

 private:
  explicit MultiDeviceGroup(std::shared_ptr<detail::MultiDeviceState> state) : state_(std::move(state)) {}
  std::shared_ptr<detail::MultiDeviceState> state_;
};

}  // namespace weft::gpu
