#include "kernels/cpu/reduce.hpp"

#include <cstdint>
#include <type_traits>

namespace weft::kernels {
namespace {

// Integer arithmetic goes through an unsigned type at least as wide as int: wrap-around instead of the
// undefined behaviour of signed overflow (and of uint16 * uint16 promoted to int).
template <class T>
using Wide = std::conditional_t<(sizeof(T) < sizeof(unsigned)), unsigned, std::make_unsigned_t<T>>;

template <class T>
constexpr bool is_half_like = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

struct Sum {
  template <class T>
  static T apply(T a, T b) {
    if constexpr (is_half_like<T>) return T(float(a) + float(b));
    else if constexpr (std::is_integral_v<T>) return static_cast<T>(static_cast<Wide<T>>(a) + static_cast<Wide<T>>(b));
    else return a + b;
  }
};
struct Prod {
  template <class T>
  static T apply(T a, T b) {
    if constexpr (is_half_like<T>) return T(float(a) * float(b));
    else if constexpr (std::is_integral_v<T>) return static_cast<T>(static_cast<Wide<T>>(a) * static_cast<Wide<T>>(b));
    else return a * b;
  }
};
struct Min {
  template <class T>
  static T apply(T a, T b) {
    if constexpr (is_half_like<T>) return float(b) < float(a) ? b : a;
    else return b < a ? b : a;
  }
};
struct Max {
  template <class T>
  static T apply(T a, T b) {
    if constexpr (is_half_like<T>) return float(a) < float(b) ? b : a;
    else return a < b ? b : a;
  }
};
template <class T>
bool truth(T v) {
  if constexpr (is_half_like<T>) return float(v) != 0.0f;
  else return v != T(0);
}
template <class T>
T from_truth(bool v) {
  if constexpr (is_half_like<T>) return T(v ? 1.0f : 0.0f);
  else return static_cast<T>(v ? 1 : 0);
}
struct LogicalAnd {
  template <class T>
  static T apply(T a, T b) { return from_truth<T>(truth(a) && truth(b)); }
};
struct LogicalOr {
  template <class T>
  static T apply(T a, T b) { return from_truth<T>(truth(a) || truth(b)); }
};
struct BitwiseAnd {
  template <class T>
  static T apply(T a, T b) { return static_cast<T>(a & b); }
};
struct BitwiseOr {
  template <class T>
  static T apply(T a, T b) { return static_cast<T>(a | b); }
};
struct BitwiseXor {
  template <class T>
  static T apply(T a, T b) { return static_cast<T>(a ^ b); }
};

template <class T, class Op>
void reduce_loop(void* dst, const void* a, const void* b, std::size_t n) {
  auto* d = static_cast<T*>(dst);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (std::size_t i = 0; i < n; ++i) d[i] = Op::template apply<T>(x[i], y[i]);
}

template <class T>
ReduceFn for_type(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return &reduce_loop<T, Sum>;
    case ReduceOp::prod: return &reduce_loop<T, Prod>;
    case ReduceOp::min: return &reduce_loop<T, Min>;
    case ReduceOp::max: return &reduce_loop<T, Max>;
    case ReduceOp::logical_and: return &reduce_loop<T, LogicalAnd>;
    case ReduceOp::logical_or: return &reduce_loop<T, LogicalOr>;
    case ReduceOp::bitwise_and:
      if constexpr (std::is_integral_v<T>) return &reduce_loop<T, BitwiseAnd>;
      break;
    case ReduceOp::bitwise_or:
      if constexpr (std::is_integral_v<T>) return &reduce_loop<T, BitwiseOr>;
      break;
    case ReduceOp::bitwise_xor:
      if constexpr (std::is_integral_v<T>) return &reduce_loop<T, BitwiseXor>;
      break;
  }
  return nullptr;
}

template <class T>
void divide_loop(void* data, std::size_t n, int divisor) {
  auto* d = static_cast<T*>(data);
  if constexpr (is_half_like<T>) {
    for (std::size_t i = 0; i < n; ++i) d[i] = T(float(d[i]) / static_cast<float>(divisor));
  } else {
    const T div = static_cast<T>(divisor);
    for (std::size_t i = 0; i < n; ++i) d[i] = static_cast<T>(d[i] / div);
  }
}

}  // namespace

ReduceFn find_reduce(DType type, ReduceOp op) noexcept {
  if (!is_defined(type, op)) return nullptr;
  switch (type) {
    // bool is one byte holding 0 or 1: min is and, max is or, and the bitwise ops keep 0/1.
    case DType::boolean: return for_type<std::uint8_t>(op);
    case DType::i8: return for_type<std::int8_t>(op);
    case DType::u8: return for_type<std::uint8_t>(op);
    case DType::i16: return for_type<std::int16_t>(op);
    case DType::u16: return for_type<std::uint16_t>(op);
    case DType::i32: return for_type<std::int32_t>(op);
    case DType::u32: return for_type<std::uint32_t>(op);
    case DType::i64: return for_type<std::int64_t>(op);
    case DType::u64: return for_type<std::uint64_t>(op);
    case DType::f16: return for_type<half>(op);
    case DType::bf16: return for_type<bfloat16>(op);
    case DType::f32: return for_type<float>(op);
    case DType::f64: return for_type<double>(op);
  }
  return nullptr;
}

void divide_in_place(void* data, std::size_t n, DType type, int divisor) noexcept {
  switch (type) {
    case DType::boolean: return;
    case DType::i8: return divide_loop<std::int8_t>(data, n, divisor);
    case DType::u8: return divide_loop<std::uint8_t>(data, n, divisor);
    case DType::i16: return divide_loop<std::int16_t>(data, n, divisor);
    case DType::u16: return divide_loop<std::uint16_t>(data, n, divisor);
    case DType::i32: return divide_loop<std::int32_t>(data, n, divisor);
    case DType::u32: return divide_loop<std::uint32_t>(data, n, divisor);
    case DType::i64: return divide_loop<std::int64_t>(data, n, divisor);
    case DType::u64: return divide_loop<std::uint64_t>(data, n, divisor);
    case DType::f16: return divide_loop<half>(data, n, divisor);
    case DType::bf16: return divide_loop<bfloat16>(data, n, divisor);
    case DType::f32: return divide_loop<float>(data, n, divisor);
    case DType::f64: return divide_loop<double>(data, n, divisor);
  }
}

}  // namespace weft::kernels
