// gpu::MultiDeviceGroup (weft/multi_device.hpp): a rank driving several devices, built from the public
// pieces alone (DeviceSet, Stream, Group::on), as a user's library would be. The all_reduce is a
// pipeline of three stages queued at the call and ordered on the devices by fences:
//
//   set streams:     [inputs ready] -> local all_reduce into scratch (every entry)
//   entry 0:         wait(set, 0) -> group.on(entry 0).all_reduce(scratch 0)       (across processes)
//   entry i > 0:     wait(entry 0, and stage 1 of entry i) -> copy scratch 0 -> scratch i
//   every entry i:   [entry 0 waits for every copy] -> divide (avg) -> epilogue or copy -> output i
//   set streams:     wait(entry i)   (the next call's stage 1 rewrites the scratch after this one read it)
#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "weft/error.hpp"
#include "weft/multi_device.hpp"
#include "weft/when.hpp"

namespace weft::gpu {

namespace detail {

struct MultiDeviceState {
  Group group;
  std::vector<Device> devices;
  std::optional<DeviceSet> set;  // made in create
  std::vector<Stream> streams;  // one per entry: stages 2 (entry 0) and 3
  int total = 0;                // every rank's devices together
  int first = 0;                // this rank's first device's place among them
  std::mutex mutex;
  std::vector<DeviceBuffer> scratch;  // guarded: per entry, the reduction in the input's dtype; grown
};

}  // namespace detail

namespace {

constexpr const char* op_name = "MultiDeviceGroup::all_reduce";

// `mine` (the all_gather's input) and `counts` (its output) live in the frame until it completed.
Task<MultiDeviceGroup> finish_create(std::shared_ptr<detail::MultiDeviceState> state, Future<void> gathered,
                                     std::shared_ptr<std::int32_t> mine, std::shared_ptr<std::vector<std::int32_t>> counts,
                                     MultiDeviceGroup (*make)(std::shared_ptr<detail::MultiDeviceState>)) {
  co_await std::move(gathered);
  (void)mine;
  const int rank = state->group.rank();
  for (std::size_t r = 0; r < counts->size(); ++r) {
    state->total += (*counts)[r];
    if (static_cast<int>(r) < rank) state->first += (*counts)[r];
  }
  co_return make(std::move(state));
}

// Device memory is freed off the caller's thread: freeing waits for the device's queued work, which may
// hold a gate of this rank's own earlier call that the loop (maybe driven by this thread) is to open.
void free_off_thread(std::vector<DeviceBuffer> buffers) {
  std::erase_if(buffers, [](const DeviceBuffer& b) { return b.bytes() == 0; });
  if (!buffers.empty()) std::thread([dropped = std::move(buffers)] {}).detach();
}

}  // namespace

Future<MultiDeviceGroup> MultiDeviceGroup::create(Group group, std::vector<Device> devices) {
  if (!group.valid()) throw Error(Errc::invalid_argument, {.op = "MultiDeviceGroup::create"}, "the group is empty");
  auto state = std::make_shared<detail::MultiDeviceState>();
  try {
    state->set.emplace(DeviceSet::create(group.loop(), devices));  // checks the devices
  } catch (const Error& e) {
    // DeviceSet knows no group: the rank is named here, as every other error of a group's call does.
    if (e.context().rank >= 0) throw;
    ErrorContext context = e.context();
    context.rank = group.rank();
    context.op = "MultiDeviceGroup::create";
    throw Error(e.errc(), context, e.context().op.empty() ? e.detail() : e.context().op + ": " + e.detail());
  }
  for (const Device& d : devices) state->streams.emplace_back(group.loop(), d);
  state->scratch.resize(devices.size());
  state->devices = std::move(devices);
  state->group = std::move(group);
  auto counts = std::make_shared<std::vector<std::int32_t>>(static_cast<std::size_t>(state->group.size()));
  auto mine = std::make_shared<std::int32_t>(static_cast<std::int32_t>(state->devices.size()));
  Future<void> gathered = state->group.all_gather(ConstBufferView(mine.get(), 1, DType::i32), BufferView(*counts));
  return spawn(state->group.loop(), finish_create(state, std::move(gathered), mine, counts, [](std::shared_ptr<detail::MultiDeviceState> s) {
                 return MultiDeviceGroup(std::move(s));
               }));
}

const Group& MultiDeviceGroup::group() const { return state_->group; }
const std::vector<Device>& MultiDeviceGroup::devices() const { return state_->devices; }
int MultiDeviceGroup::total_devices() const { return state_->total; }
int MultiDeviceGroup::first_device_rank() const { return state_->first; }
DeviceSet& MultiDeviceGroup::set() { return *state_->set; }

Future<void> MultiDeviceGroup::all_reduce(std::vector<BufferView> inout, ReduceOp op, const Epilogue& epilogue) {
  std::vector<ConstBufferView> inputs(inout.begin(), inout.end());
  return all_reduce(std::move(inputs), std::move(inout), op, epilogue);
}

Future<void> MultiDeviceGroup::all_reduce(std::vector<ConstBufferView> inputs, std::vector<BufferView> outputs, ReduceOp op,
                                          const Epilogue& epilogue) {
  if (!state_) throw Error(Errc::invalid_argument, {.op = op_name}, "an empty MultiDeviceGroup");
  detail::MultiDeviceState& s = *state_;
  const ErrorContext where{.rank = s.group.rank(), .op = op_name};
  const std::size_t n = s.devices.size();
  if (inputs.size() != n || outputs.size() != n) {
    throw Error(Errc::invalid_argument, where,
                fmt::format("{} inputs and {} outputs for {} devices: one of each per device", inputs.size(), outputs.size(), n));
  }
  const DType dtype = inputs[0].dtype;
  const std::size_t count = inputs[0].count;
  const std::size_t bytes = inputs[0].bytes();
  const ReduceOp combine = op == ReduceOp::avg ? ReduceOp::sum : op;
  // The outputs are written last (stage 3), after the group's collective took its number: checked now,
  // so that a bad one fails the call before anything is queued. (The inputs: stage 1, at once.)
  if (!is_defined(dtype, op)) {
    throw Error(Errc::invalid_argument, where, fmt::format("{} is not defined on {}", to_string(op), to_string(dtype)));
  }
  const DType out_dtype = epilogue.output(dtype);
  for (std::size_t i = 0; i < n; ++i) {
    const BufferView& o = outputs[i];
    if (!(o.device == s.devices[i]) || o.dtype != out_dtype || o.count != count) {
      throw Error(Errc::invalid_argument, where,
                  fmt::format("entry {}: the output is {} x {} on {}; it must be {} x {}{} on device {}", i, o.count,
                              to_string(o.dtype), o.device.kind == Device::Kind::host ? std::string("the host") : fmt::format("device {}", o.device.index),
                              count, to_string(out_dtype), epilogue.is_identity() ? "" : " (the epilogue " + epilogue.describe() + ")",
                              s.devices[i].index));
    }
    try {
      check_view(o, op_name, fmt::format("entry {} output", i).c_str());
    } catch (const Error& e) {
      throw Error(e.errc(), where, e.detail());  // with the rank
    }
  }

  // Scratch of the input's dtype per entry (stage 1 writes it, stage 3 reads it): an output of another
  // dtype cannot hold the reduction, and an output that is an input is still being read in stage 1.
  std::vector<BufferView> scratch(n);
  {
    std::vector<DeviceBuffer> dropped;
    std::lock_guard lock(s.mutex);
    for (std::size_t i = 0; i < n; ++i) {
      if (s.scratch[i].bytes() < bytes) {
        dropped.push_back(std::move(s.scratch[i]));
        s.scratch[i] = DeviceBuffer::allocate(s.devices[i], std::max<std::size_t>(bytes, 256));
      }
      scratch[i] = BufferView(s.scratch[i].data(), count, dtype, s.devices[i]);
    }
    free_off_thread(std::move(dropped));
  }

  std::vector<Future<void>> stages;
  // 1. Inside the process: every entry's scratch gets the reduction of this rank's inputs (checks the
  //    inputs, at once).
  try {
    stages.push_back(s.set->all_reduce(inputs, scratch, combine));
  } catch (const Error& e) {
    throw Error(e.errc(), where, e.detail());  // with the rank; nothing was queued
  }

  // 2. Across processes, on entry 0's stream once stage 1 wrote its scratch: the collective takes its
  //    sequence number now, in the caller's order.
  Stream& first = s.streams[0];
  first.wait(s.set->record(0));
  stages.push_back(s.group.on(first).all_reduce(scratch[0], combine));

  // 3. Inside the process again: entry 0's result to every entry; entry 0 rewrites its scratch (the
  //    division) only after every copy read it.
  const Fence reduced = first.record();
  for (std::size_t i = 1; i < n; ++i) {
    s.streams[i].wait(reduced);
    // And after stage 1 wrote this entry's scratch too: entry 0's fence does not say that entry i's
    // copy of the local sum is done (the naive path writes each entry's on its own stream), and that
    // late write over the copy below left this rank's local sum in the output (the sim under load).
    s.streams[i].wait(s.set->record(i));
    stages.push_back(s.streams[i].copy(scratch[i], scratch[0]));
    first.wait(s.streams[i].record());
  }
  for (std::size_t i = 0; i < n; ++i) {
    Stream& on = s.streams[i];
    if (op == ReduceOp::avg && s.total > 1) stages.push_back(on.divide(scratch[i], s.total));
    if (epilogue.is_identity()) stages.push_back(on.copy(outputs[i], scratch[i]));
    else stages.push_back(on.apply(scratch[i], outputs[i], epilogue));
    s.set->wait(i, on.record());  // the set's next call after this one's last read of the scratch
  }
  auto all = [](std::vector<Future<void>> each) -> Task<void> { co_await when_all(std::move(each)); };
  return spawn(s.group.loop(), all(std::move(stages)));
}

}  // namespace weft::gpu
