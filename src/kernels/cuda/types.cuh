#pragma once
// What the GPU kernels share (nvcc only): weft's dtype and op codes as integers, the 16-bit float types
// as their bits, the element arithmetic of every reduction op, the dtype dispatch and the launch shape.
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

// One element op another, as the CPU kernels compute it (reduce.cuh's words): integers through a wide
// unsigned type (they wrap), 16-bit floats through float, min and max keep the operand the CPU picks.
template <class T>
using Wide = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

template <class T>
__device__ inline bool truth(T v) {
  if constexpr (is_half_like<T>) return to_float(v) != 0.0f;
  else return v != T(0);
}
template <class T>
__device__ inline T from_truth(bool v) {
  if constexpr (is_half_like<T>) return from_float<T>(v ? 1.0f : 0.0f);
  else return static_cast<T>(v ? 1 : 0);
}

template <class T, int Op>
__device__ inline T apply(T a, T b) {
  if constexpr (Op == sum) {
    if constexpr (is_half_like<T>) return from_float<T>(to_float(a) + to_float(b));
    else if constexpr (std::is_integral_v<T>) return static_cast<T>(static_cast<Wide<T>>(a) + static_cast<Wide<T>>(b));
    else return a + b;
  } else if constexpr (Op == prod) {
    if constexpr (is_half_like<T>) return from_float<T>(to_float(a) * to_float(b));
    else if constexpr (std::is_integral_v<T>) return static_cast<T>(static_cast<Wide<T>>(a) * static_cast<Wide<T>>(b));
    else return a * b;
  } else if constexpr (Op == min_op) {
    if constexpr (is_half_like<T>) return to_float(b) < to_float(a) ? b : a;
    else return b < a ? b : a;
  } else if constexpr (Op == max_op) {
    if constexpr (is_half_like<T>) return to_float(a) < to_float(b) ? b : a;
    else return a < b ? b : a;
  } else if constexpr (Op == logical_and) {
    return from_truth<T>(truth(a) && truth(b));
  } else if constexpr (Op == logical_or) {
    return from_truth<T>(truth(a) || truth(b));
  } else if constexpr (Op == bitwise_and) {
    return static_cast<T>(a & b);
  } else if constexpr (Op == bitwise_or) {
    return static_cast<T>(a | b);
  } else {
    return static_cast<T>(a ^ b);
  }
}

/// Calls fn(TypeTag<T>{}) with T the element type of weft dtype `dtype` (bool as Bool: a byte for the
/// reductions, `bool` for the conversions) and returns what it returns; cudaErrorInvalidValue for a code
/// that is no dtype.
template <class T>
struct TypeTag {
  using type = T;
};
template <class Bool, class Fn>
int with_element_type(int dtype, Fn&& fn) {
  switch (dtype) {
    case boolean: return fn(TypeTag<Bool>{});
    case i8: return fn(TypeTag<std::int8_t>{});
    case u8: return fn(TypeTag<std::uint8_t>{});
    case i16: return fn(TypeTag<std::int16_t>{});
    case u16: return fn(TypeTag<std::uint16_t>{});
    case i32: return fn(TypeTag<std::int32_t>{});
    case u32: return fn(TypeTag<std::uint32_t>{});
    case i64: return fn(TypeTag<std::int64_t>{});
    case u64: return fn(TypeTag<std::uint64_t>{});
    case f16: return fn(TypeTag<Half>{});
    case bf16: return fn(TypeTag<BFloat>{});
    case f32: return fn(TypeTag<float>{});
    case f64: return fn(TypeTag<double>{});
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

inline constexpr int threads_per_block = 256;

inline dim3 grid_for(std::size_t n) {
  // Enough blocks to fill a large GPU a few times (132 SMs on an H100), never more than the elements need.
  const std::size_t needed = (n + threads_per_block - 1) / threads_per_block;
  const std::size_t most = 132 * 8;
  return dim3(static_cast<unsigned>(needed < most ? (needed > 0 ? needed : 1) : most));
}

}  // namespace weft::kernels::cuda
