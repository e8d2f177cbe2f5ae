#pragma once
/// Your own epilogue, compiled by nvcc: include this in a .cu file and make the functions from a functor
/// whose call operator is `__host__ __device__` (the host copy is what the simulated device runs):
///
///   struct AddBias {
///     const float* bias;  // device memory, `hidden` floats
///     std::size_t hidden;
///     __host__ __device__ __nv_bfloat16 operator()(float x, std::size_t i) const { return __float2bfloat16_rn(x + bias[i % hidden]); }
///   };
///   weft::gpu::EpilogueFunctions add_bias(const float* bias, std::size_t hidden) {
///     return weft::gpu::make_epilogue_functions<float, __nv_bfloat16>(AddBias{bias, hidden});
///   }
///
/// and, in any C++ file: `weft::gpu::Epilogue::custom(add_bias(b, h), "add bias")`. The functor is called
/// as f(value) or f(value, index), index being the element's place in the buffer. It must be trivially
/// copyable (it travels to the kernel by value). In and Out: bool, the fixed-width integers, __half,
/// __nv_bfloat16, float or double. Pointers the functor holds are read where it runs: device memory on
/// a GPU; on the simulated device the host copy runs on the host, where device memory cannot be read
/// (keep such functors to the GPU, or give the sim an Epilogue::on_host of its own).
///
/// Only this header and weft/epilogue_functions.hpp are meant for nvcc; weft's other headers are host C++.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "weft/epilogue_functions.hpp"

namespace weft::gpu {
namespace epilogue_detail {

// weft::DType's values (include/weft/dtype.hpp), spelled for the types nvcc knows.
template <class T>
constexpr int dtype_code() {
  if constexpr (std::is_same_v<T, bool>) return 0;
  else if constexpr (std::is_same_v<T, std::int8_t>) return 1;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return 2;
  else if constexpr (std::is_same_v<T, std::int16_t>) return 3;
  else if constexpr (std::is_same_v<T, std::uint16_t>) return 4;
  else if constexpr (std::is_same_v<T, std::int32_t>) return 5;
  else if constexpr (std::is_same_v<T, std::uint32_t>) return 6;
  else if constexpr (std::is_same_v<T, std::int64_t>) return 7;
  else if constexpr (std::is_same_v<T, std::uint64_t>) return 8;
  else if constexpr (std::is_same_v<T, __half>) return 9;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return 10;
  else if constexpr (std::is_same_v<T, float>) return 11;
  else if constexpr (std::is_same_v<T, double>) return 12;
  else static_assert(sizeof(T) == 0, "an epilogue's element type must be one of weft's dtypes");
}

template <class F, class In>
__host__ __device__ inline auto call(const F& f, In value, std::size_t index) {
  if constexpr (std::is_invocable_v<const F&, In, std::size_t>) return f(value, index);
  else return f(value);
}

template <class In, class Out, class F>
__global__ void apply_kernel(const In* in, Out* out, std::size_t count, F f) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    out[i] = static_cast<Out>(call(f, in[i], i));
  }
}

template <class In, class Out, class F>
int launch(const void* functor, const void* in, void* out, std::size_t count, void* stream) {
  if (count == 0) return 0;
  constexpr std::size_t threads = 256;
  const std::size_t needed = (count + threads - 1) / threads;
  const unsigned blocks = static_cast<unsigned>(needed < 1024 ? needed : 1024);
  apply_kernel<In, Out, F><<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const In*>(in), static_cast<Out*>(out), count, *static_cast<const F*>(functor));
  return static_cast<int>(cudaGetLastError());
}

template <class In, class Out, class F>
void run_on_host(const void* functor, const void* in, void* out, std::size_t first, std::size_t count) {
  const F& f = *static_cast<const F*>(functor);
  const In* src = static_cast<const In*>(in);
  Out* dst = static_cast<Out*>(out);
  for (std::size_t k = 0; k < count; ++k) dst[k] = static_cast<Out>(call(f, src[k], first + k));
}

}  // namespace epilogue_detail

/// The functions of an epilogue out[i] = f(in[i]) (or f(in[i], i)): In the reduced type, Out the stored one.
template <class In, class Out, class F>
EpilogueFunctions make_epilogue_functions(F f) {
  static_assert(std::is_trivially_copyable_v<F>, "an epilogue functor travels to the kernel by value: make it trivially copyable");
  EpilogueFunctions fns;
  fns.input_dtype = epilogue_detail::dtype_code<In>();
  fns.output_dtype = epilogue_detail::dtype_code<Out>();
  fns.launch = &epilogue_detail::launch<In, Out, F>;
  fns.host = &epilogue_detail::run_on_host<In, Out, F>;
  fns.functor = std::make_shared<F>(f);
  return fns;
}

}  // namespace weft::gpu
