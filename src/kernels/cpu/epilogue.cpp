#include "kernels/cpu/epilogue.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace weft::kernels {
namespace {

template <class T>
constexpr bool is_half_like = std::is_same_v<T, half> || std::is_same_v<T, bfloat16>;

template <class T>
double to_double(T v) {
  if constexpr (is_half_like<T>) return static_cast<double>(static_cast<float>(v));
  else return static_cast<double>(v);
}

template <class T>
T from_double(double v) {
  if constexpr (is_half_like<T>) return T(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, bool>) return v != 0.0;
  else if constexpr (std::is_floating_point_v<T>) return static_cast<T>(v);
  else {
    if (std::isnan(v)) return T(0);
    // The limits as doubles: the maximum of a 64-bit type rounds up to 2^63 or 2^64, which is past it.
    constexpr double high = static_cast<double>(std::numeric_limits<T>::max());
    constexpr double low = static_cast<double>(std::numeric_limits<T>::min());
    if (v >= high) return std::numeric_limits<T>::max();
    if (v <= low) return std::numeric_limits<T>::min();
    return static_cast<T>(v);  // toward zero
  }
}

template <class In, class Out>
void convert_loop(const void* in, void* out, std::size_t n, double factor) {
  const auto* src = static_cast<const In*>(in);
  auto* dst = static_cast<Out*>(out);
  constexpr bool integers = (std::is_integral_v<In>) && (std::is_integral_v<Out>);
  if constexpr (integers) {
    if (factor == 1.0) {
      for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<Out>(src[i]);
      return;
    }
  }
  if (factor == 1.0) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = from_double<Out>(to_double(src[i]));
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = from_double<Out>(to_double(src[i]) * factor);
  }
}

template <class In>
void convert_from(const void* in, void* out, DType out_type, std::size_t n, double factor) {
  switch (out_type) {
    case DType::boolean: return convert_loop<In, bool>(in, out, n, factor);
    case DType::i8: return convert_loop<In, std::int8_t>(in, out, n, factor);
    case DType::u8: return convert_loop<In, std::uint8_t>(in, out, n, factor);
    case DType::i16: return convert_loop<In, std::int16_t>(in, out, n, factor);
    case DType::u16: return convert_loop<In, std::uint16_t>(in, out, n, factor);
    case DType::i32: return convert_loop<In, std::int32_t>(in, out, n, factor);
    case DType::u32: return convert_loop<In, std::uint32_t>(in, out, n, factor);
    case DType::i64: return convert_loop<In, std::int64_t>(in, out, n, factor);
    case DType::u64: return convert_loop<In, std::uint64_t>(in, out, n, factor);
    case DType::f16: return convert_loop<In, half>(in, out, n, factor);
    case DType::bf16: return convert_loop<In, bfloat16>(in, out, n, factor);
    case DType::f32: return convert_loop<In, float>(in, out, n, factor);
    case DType::f64: return convert_loop<In, double>(in, out, n, factor);
  }
}

}  // namespace

void apply_epilogue(const void* in, DType in_type, void* out, DType out_type, std::size_t count, double factor) noexcept {
  if (count == 0) return;
  if (factor == 1.0 && in_type == out_type) {
    if (in != out) std::memmove(out, in, count * dtype_size(in_type));
    return;
  }
  switch (in_type) {
    case DType::boolean: return convert_from<bool>(in, out, out_type, count, factor);
    case DType::i8: return convert_from<std::int8_t>(in, out, out_type, count, factor);
    case DType::u8: return convert_from<std::uint8_t>(in, out, out_type, count, factor);
    case DType::i16: return convert_from<std::int16_t>(in, out, out_type, count, factor);
    case DType::u16: return convert_from<std::uint16_t>(in, out, out_type, count, factor);
    case DType::i32: return convert_from<std::int32_t>(in, out, out_type, count, factor);
    case DType::u32: return convert_from<std::uint32_t>(in, out, out_type, count, factor);
    case DType::i64: return convert_from<std::int64_t>(in, out, out_type, count, factor);
    case DType::u64: return convert_from<std::uint64_t>(in, out, out_type, count, factor);
    case DType::f16: return convert_from<half>(in, out, out_type, count, factor);
    case DType::bf16: return convert_from<bfloat16>(in, out, out_type, count, factor);
    case DType::f32: return convert_from<float>(in, out, out_type, count, factor);
    case DType::f64: return convert_from<double>(in, out, out_type, count, factor);
  }
}

}  // namespace weft::kernels
