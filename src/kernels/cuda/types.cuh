#pragma once
// What the GPU kernels share (nvcc only): weft's dtype and op codes as integers, the 16-bit float types
// as their bits, and the launch shape.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace weft::kernels::cuda {

// weft::DType and weft::ReduceOp by value (include/weft/dtype.hpp, reduce_op.hpp): kept as integers so
// that nvcc does not compile the public headers.
enum DTypeCode : int { boolean, i8, u8, i16, u16, i32, u32, i64, u64, f16, bf16, f32, f64 };
enum OpCode : int { sum, prod, min_op, max_op, avg, logical_and, logical_or, bitwise_and, bitwise_or, bitwise_xor };

// 16-bit floats travel as their bits; arithmetic goes through float.
struct Half {
  std::uint16_t bits;
};
struct BFloat {
  std::uint16_t bits;
};
__device__ inline float to_float(Half h) { return __half2float(__ushort_as_half(h.bits)); }
__device__ inline float to_float(BFloat h) { return __bfloat162float(__ushort_as_bfloat16(h.bits)); }
template <class T>
__device__ inline T from_float(float f);
template <>
__device__ inline Half from_float<Half>(float f) { return Half{__half_as_ushort(__float2half_rn(f))}; }
template <>
__device__ inline BFloat from_float<BFloat>(float f) { return BFloat{__bfloat16_as_ushort(__float2bfloat16_rn(f))}; }

template <class T>
constexpr bool is_half_like = std::is_same_v<T, Half> || std::is_same_v<T, BFloat>;

inline constexpr int threads_per_block = 256;

inline dim3 grid_for(std::size_t n) {
  // Enough blocks to fill a large GPU a few times (132 SMs on an H100), never more than the elements need.
  const std::size_t needed = (n + threads_per_block - 1) / threads_per_block;
  const std::size_t most = 132 * 8;
  return dim3(static_cast<unsigned>(needed < most ? (needed > 0 ? needed : 1) : most));
}

}  // namespace weft::kernels::cuda
