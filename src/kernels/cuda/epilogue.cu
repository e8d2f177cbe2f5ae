// The built-in epilogues on the GPU (epilogue.cuh): a grid-stride loop per (input, output) dtype pair,
// with the conversions of kernels/cpu/epilogue.hpp (the reference the tests hold the sim to).
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "kernels/cuda/epilogue.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/types.cuh"

namespace weft::kernels::cuda {
namespace {

template <class T>
__device__ inline double to_double(T v) {
  if constexpr (is_half_like<T>) return static_cast<double>(to_float(v));
  else return static_cast<double>(v);
}

// The limits as constants (std::numeric_limits' functions are host functions to nvcc).
template <class T>
struct Limits {
  static constexpr T max = std::numeric_limits<T>::max();
  static constexpr T min = std::numeric_limits<T>::min();
  static constexpr double high = static_cast<double>(max);
  static constexpr double low = static_cast<double>(min);
};

template <class T>
__device__ inline T from_double(double v) {
  if constexpr (is_half_like<T>) return from_float<T>(static_cast<float>(v));  // twice to nearest even, as the CPU
  else if constexpr (std::is_same_v<T, bool>) return v != 0.0;
  else if constexpr (std::is_floating_point_v<T>) return static_cast<T>(v);
  else {
    if (v != v) return T(0);
    if (v >= Limits<T>::high) return Limits<T>::max;
    if (v <= Limits<T>::low) return Limits<T>::min;
    return static_cast<T>(v);
  }
}

template <class In, class Out>
__global__ void epilogue_kernel(const In* in, Out* out, std::size_t n, double factor) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  constexpr bool integers = std::is_integral_v<In> && std::is_integral_v<Out>;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if (integers && factor == 1.0) {
      if constexpr (integers) out[i] = static_cast<Out>(in[i]);
    } else {
      const double v = factor == 1.0 ? to_double(in[i]) : to_double(in[i]) * factor;
      out[i] = from_double<Out>(v);
    }
  }
}

template <class In, class Out>
int launch_pair(const void* in, void* out, std::size_t n, double factor, cudaStream_t stream) {
  epilogue_kernel<In, Out><<<grid_for(n), threads_per_block, 0, stream>>>(static_cast<const In*>(in), static_cast<Out*>(out), n, factor);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_epilogue(const void* in, int in_dtype, void* out, int out_dtype, std::size_t n, double factor, void* stream_handle) {
  if (n == 0) return 0;
  auto stream = static_cast<cudaStream_t>(stream_handle);
  if (in_dtype < boolean || in_dtype > f64) return static_cast<int>(cudaErrorInvalidValue);
  if (factor == 1.0 && in_dtype == out_dtype) {
    if (in == out) return 0;
    static constexpr std::size_t sizes[] = {1, 1, 1, 2, 2, 4, 4, 8, 8, 2, 2, 4, 8};
    // A kernel, not cudaMemcpyAsync within the device (launch_copy says why).
    return launch_copy(out, in, n * sizes[in_dtype], stream_handle);
  }
  return with_element_type<bool>(in_dtype, [&](auto in_tag) {
    return with_element_type<bool>(out_dtype, [&](auto out_tag) {
      return launch_pair<typename decltype(in_tag)::type, typename decltype(out_tag)::type>(in, out, n, factor, stream);
    });
  });
}

}  // namespace weft::kernels::cuda
