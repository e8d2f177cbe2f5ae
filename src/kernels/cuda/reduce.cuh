#pragma once
// GPU reduction kernels, the device twin of kernels/cpu/reduce.hpp: dst[i] = a[i] op b[i] for every
// (dtype, op) that weft::is_defined allows, and the division pass of avg. Same arithmetic as the CPU
// kernels, element by element (integers through a wide unsigned type, so they wrap; f16 and bf16 computed
// in float and rounded to nearest even once; min and max keep the operand as the CPU kernels pick it), so
// results are bitwise equal to the CPU's; only NaN payloads may differ.
//
// Plain C++ declarations: the host code that launches them (devices/cuda.cpp) is compiled by the host
// compiler and needs no CUDA headers beyond the stream handle, passed as void*.
#include <cstddef>

namespace weft::kernels::cuda {

/// Queues dst[i] = a[i] op b[i] for n elements on `stream` (a cudaStream_t). dtype and op are
/// weft::DType and weft::ReduceOp as integers (avg: the sum). Returns the cudaError_t of the launch
/// (0: queued).
int launch_reduce(void* dst, const void* a, const void* b, std::size_t n, int dtype, int op, void* stream);

/// Queues data[i] /= divisor (integer division for integer types; bool unchanged) on `stream`.
int launch_divide(void* data, std::size_t n, int dtype, int divisor, void* stream);

/// Queues a copy of `bytes` bytes from `src` to `dst`, both memory of the stream's device, as a kernel:
/// cudaMemcpyAsync between two addresses of one device is an implicit synchronization (the device's work
/// queued after it waits for all its work queued before), which deadlocks where that earlier work is a
/// gate or a peer kernel waiting for work queued later (docs/DESIGN.md, "Copies within a device"). The
/// ranges must not overlap unless they are the same (then nothing is queued).
int launch_copy(void* dst, const void* src, std::size_t bytes, void* stream);

}  // namespace weft::kernels::cuda
