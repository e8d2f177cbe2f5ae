#pragma once
// What the device layer's files share (device.cpp defines them): argument checks that name the
// operation, and the wait that turns a stream's fence into a Task resuming on the stream's loop.
#include <cstddef>
#include <cstdint>
#include <memory>

#include "weft/buffer.hpp"
#include "weft/gpu.hpp"
#include "weft/task.hpp"

namespace weft::gpu::detail {

class StreamImpl;  // backend.hpp

/// Throws weft::Error (invalid_argument) unless `d` is an existing device; `what` names the argument.
void check_device(Device d, const char* op, const char* what);
/// Throws weft::Error (invalid_argument) unless [data, data + bytes) is memory of the kind `d` says.
void check_view(const void* data, std::size_t bytes, Device d, const char* op, const char* what);
/// Throws weft::Error (invalid_argument) when `out` overlaps `in` other than being it (same start, same
/// element size: an elementwise pass may write in place).
void check_overlap(ConstBufferView in, BufferView out, const char* op);
/// Throws weft::Error (invalid_argument) when this backend cannot run `epilogue` (a custom one without
/// the function it needs: launch under cuda, host under the sim).
void check_epilogue_runs(const Epilogue& epilogue, const char* op);
/// Completes on the stream's loop once `seq` is reached. Errors: device_failure (the stream's words);
/// CancelledError when cancelled (the device work goes on).
Task<void> await_fence(std::shared_ptr<StreamImpl> stream, std::uint64_t seq, const char* op);

}  // namespace weft::gpu::detail
