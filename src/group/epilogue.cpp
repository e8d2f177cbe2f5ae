// Group::all_reduce through an epilogue (issue 17, part 2): the reduction, then the epilogue where the
// output is, composed from the public pieces (all_reduce, gpu::Stream::apply, gpu::Epilogue::apply):
//
//   keeps the dtype:    all_reduce(in -> out)     -> epilogue(out -> out)
//   changes the dtype:  all_reduce(in -> scratch) -> epilogue(scratch -> out)
//
// On a caller's stream (on()) both are queued at the call, in the stream's order; on the group's own
// stream the epilogue is queued once the reduction's copy back is done (that stream gets its copies
// back only then: device_staging.hpp). Host memory: the loop applies it once the reduction is done.
#include <cstddef>
#include <memory>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "devices/checks.hpp"
#include "group/checks.hpp"
#include "group/device_staging.hpp"
#include "group/state.hpp"
#include "weft/gpu.hpp"
#include "weft/group.hpp"
#include "weft/when.hpp"

namespace weft {
namespace {

// Device scratch is freed off the loop: freeing device memory waits for the whole device (cudaFree),
// which may hold another rank's gate that this loop is to open.
void free_off_loop(gpu::DeviceBuffer buffer) {
  if (buffer.bytes() > 0) std::thread([dropped = std::move(buffer)] {}).detach();
}

// `scratch` (the reduction, where the dtype changes) is held by the frame until the epilogue ran.
Task<void> reduce_then_apply_on_host(Future<void> reduced, std::vector<std::byte> scratch, ConstBufferView sum, BufferView out,
                                     gpu::Epilogue epilogue) {
  co_await std::move(reduced);
  (void)scratch;
  epilogue.apply(sum, out);
}

// The group's own stream: the epilogue goes after the reduction's copy back, queued once it is done.
Task<void> reduce_then_apply_on_device(Future<void> reduced, gpu::Stream* stream, gpu::DeviceBuffer scratch, ConstBufferView sum,
                                       BufferView out, gpu::Epilogue epilogue) {
  std::exception_ptr failure;
  try {
    co_await std::move(reduced);
    co_await stream->apply(sum, out, epilogue);
  } catch (...) {
    failure = std::current_exception();
  }
  free_off_loop(std::move(scratch));
  if (failure) std::rethrow_exception(failure);
}

// A caller's stream: both were queued at the call; the scratch lives until the epilogue ran.
Task<void> await_queued(Future<void> reduced, Future<void> applied, gpu::DeviceBuffer scratch) {
  std::exception_ptr failure;
  try {
    co_await std::move(reduced);
  } catch (...) {
    failure = std::current_exception();
  }
  try {
    co_await std::move(applied);  // the stream's order: after the reduction's copy back, whatever became of it
  } catch (...) {
    if (!failure) failure = std::current_exception();
  }
  free_off_loop(std::move(scratch));
  if (failure) std::rethrow_exception(failure);
}

}  // namespace

Future<void> Group::all_reduce(ConstBufferView in, BufferView out, ReduceOp op, const gpu::Epilogue& epilogue) {
  constexpr const char* name = "all_reduce";
  if (epilogue.is_identity()) return all_reduce(in, out, op);
  detail::GroupState& g = live(name);
  DType to = in.dtype;
  try {
    to = epilogue.output(in.dtype);
  } catch (const Error& e) {
    detail::invalid(g, name, e.detail());
  }
  if (out.dtype != to || out.count != in.count) {
    detail::invalid(g, name,
                    fmt::format("the output is {} x {}; the epilogue {} stores {} x {} for an input of {} x {}", out.count,
                                to_string(out.dtype), epilogue.describe(), in.count, to_string(to), in.count, to_string(in.dtype)));
  }
  const bool out_on_device = out.device.kind == Device::Kind::cuda;
  const gpu::EpilogueFunctions* custom = epilogue.functions();
  if (out_on_device) {
    try {
      gpu::detail::check_epilogue_runs(epilogue, name);
    } catch (const Error& e) {
      detail::invalid(g, name, e.detail());
    }
  } else if (custom && !custom->host) {
    detail::invalid(g, name, fmt::format("the epilogue {} has no host function, and the output is host memory", epilogue.describe()));
  }
  const bool same_dtype = to == in.dtype;
  if (!out_on_device) {
    std::vector<std::byte> scratch(same_dtype ? 0 : in.bytes());
    const BufferView sum = same_dtype ? BufferView(out.data, out.count, in.dtype) : BufferView(scratch.data(), in.count, in.dtype);
    Future<void> reduced = all_reduce(in, sum, op);
    return spawn(*g.loop, reduce_then_apply_on_host(std::move(reduced), std::move(scratch), sum, out, epilogue));
  }
  gpu::DeviceBuffer scratch;
  if (!same_dtype) scratch = gpu::DeviceBuffer::allocate(out.device, in.bytes());
  const BufferView sum = same_dtype ? BufferView(out.data, out.count, in.dtype, out.device) : scratch.view(in.dtype);
  Future<void> reduced = all_reduce(in, sum, op);
  if (stream_) {
    Future<void> applied = stream_->apply(sum, out, epilogue);
    return spawn(*g.loop, await_queued(std::move(reduced), std::move(applied), std::move(scratch)));
  }
  gpu::Stream& own = detail::own_stream(g, out.device);
  return spawn(*g.loop, reduce_then_apply_on_device(std::move(reduced), &own, std::move(scratch), sum, out, epilogue));
}

}  // namespace weft
