#pragma once
/// weft::gpu::EpilogueFunctions: a user's epilogue as plain data, the form that crosses from code nvcc
/// compiled (weft/gpu_epilogue.cuh makes one from a functor) to weft::gpu::Epilogue::custom. This header
/// includes only the standard library, so that nvcc never compiles weft's other headers.
#include <cstddef>
#include <memory>

namespace weft::gpu {

struct EpilogueFunctions {
  int input_dtype = -1;   ///< the reduced elements' weft::DType, as an integer
  int output_dtype = -1;  ///< the stored elements' weft::DType, as an integer
  /// Queues out[i] = f(in[i], i) for i in [0, count) on `stream` (a cudaStream_t); returns the
  /// cudaError_t of the launch (0: queued). Null where the functor was not compiled by nvcc.
  int (*launch)(const void* functor, const void* in, void* out, std::size_t count, void* stream) = nullptr;
  /// out[k] = f(in[k], first + k) for k in [0, count), on the calling thread: how the simulated device
  /// runs it. Null where the functor is device code only.
  void (*host)(const void* functor, const void* in, void* out, std::size_t first, std::size_t count) = nullptr;
  /// The functor, copied (both functions are given it).
  std::shared_ptr<const void> functor;
};

}  // namespace weft::gpu
