#pragma once
// The built-in epilogues on the GPU (weft::gpu::Epilogue: scale, cast, scale and cast), the device twin
// of kernels/cpu/epilogue.hpp, whose comment is the arithmetic both follow element by element.
// Plain C++ declarations, as reduce.cuh.
#include <cstddef>

namespace weft::kernels::cuda {

/// Queues out[i] = convert<out_dtype>(in[i] * factor) for n elements on `stream` (a cudaStream_t);
/// dtypes as weft::DType integers. in may be out when the dtypes have one size. Returns the cudaError_t
/// of the launch (0: queued).
int launch_epilogue(const void* in, int in_dtype, void* out, int out_dtype, std::size_t n, double factor, void* stream);

}  // namespace weft::kernels::cuda
