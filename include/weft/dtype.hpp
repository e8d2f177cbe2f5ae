#pragma once
/// Element types weft moves and reduces, and the 16-bit float types it carries.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>

namespace weft {

enum class DType : std::uint8_t { boolean, i8, u8, i16, u16, i32, u32, i64, u64, f16, bf16, f32, f64 };

inline constexpr DType all_dtypes[] = {DType::boolean, DType::i8,  DType::u8,  DType::i16, DType::u16,
                                       DType::i32,     DType::u32, DType::i64, DType::u64, DType::f16,
                                       DType::bf16,    DType::f32, DType::f64};

/// Whether `type` is one of the values above (an integer cast to DType may not be; every call refuses it).
constexpr bool is_valid(DType type) noexcept { return static_cast<std::uint8_t>(type) <= static_cast<std::uint8_t>(DType::f64); }

/// Size of one element in bytes. (Inline: every layer asks it several times per operation.)
constexpr std::size_t dtype_size(DType type) noexcept {
  switch (type) {
    case DType::boolean:
    case DType::i8:
    case DType::u8: return 1;
    case DType::i16:
    case DType::u16:
    case DType::f16:
    case DType::bf16: return 2;
    case DType::i32:
    case DType::u32:
    case DType::f32: return 4;
    case DType::i64:
    case DType::u64:
    case DType::f64: return 8;
  }
  return 1;
}
/// "bool", "i8", ..., "f64" (nccl-tests spells some differently; parse_dtype accepts both).
std::string_view to_string(DType type) noexcept;
/// Accepts weft's names and nccl-tests' ("float", "half", "bfloat16", "int32", "uint8", ...).
std::optional<DType> parse_dtype(std::string_view name) noexcept;
bool is_floating(DType type) noexcept;

/// Conversions between float and the 16-bit formats: round to nearest even, NaN stays NaN, overflow
/// becomes infinity, subnormals are kept.
constexpr std::uint16_t float_to_half_bits(float value) noexcept {
  std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  const std::uint32_t sign = f & 0x80000000u;
  f ^= sign;
  std::uint16_t out = 0;
  if (f >= (127u + 16u) << 23) {  // too large for half: infinity, or NaN (made quiet)
    out = f > 0x7f800000u ? 0x7e00 : 0x7c00;
  } else if (f < 113u << 23) {  // the result is subnormal or zero: let the FPU round it
    constexpr std::uint32_t magic_bits = ((127u - 15u) + (23u - 10u) + 1u) << 23;
    const float shifted = std::bit_cast<float>(f) + std::bit_cast<float>(magic_bits);
    out = static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(shifted) - magic_bits);
  } else {
    const std::uint32_t mantissa_odd = (f >> 13) & 1u;
    f += (static_cast<std::uint32_t>(15 - 127) << 23) + 0xfffu;  // rebias, and round half ...
    f += mantissa_odd;                                          // ... to even
    out = static_cast<std::uint16_t>(f >> 13);
  }
  return static_cast<std::uint16_t>(out | (sign >> 16));
}

constexpr float half_bits_to_float(std::uint16_t h) noexcept {
  constexpr std::uint32_t shifted_exponent = 0x7c00u << 13;
  std::uint32_t o = (h & 0x7fffu) << 13;
  const std::uint32_t exponent = shifted_exponent & o;
  o += (127u - 15u) << 23;
  if (exponent == shifted_exponent) {  // infinity or NaN
    o += (128u - 16u) << 23;
  } else if (exponent == 0) {  // zero or subnormal: renormalise through the FPU
    o += 1u << 23;
    o = std::bit_cast<std::uint32_t>(std::bit_cast<float>(o) - std::bit_cast<float>(113u << 23));
  }
  o |= static_cast<std::uint32_t>(h & 0x8000u) << 16;
  return std::bit_cast<float>(o);
}

constexpr std::uint16_t float_to_bfloat16_bits(float value) noexcept {
  const std::uint32_t f = std::bit_cast<std::uint32_t>(value);
  if ((f & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((f >> 16) | 0x0040u);  // quiet NaN
  const std::uint32_t rounding = 0x7fffu + ((f >> 16) & 1u);
  return static_cast<std::uint16_t>((f + rounding) >> 16);
}

constexpr float bfloat16_bits_to_float(std::uint16_t b) noexcept {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

/// IEEE binary16.
struct half {
  std::uint16_t bits = 0;
  constexpr half() = default;
  constexpr explicit half(float value) noexcept : bits(float_to_half_bits(value)) {}
  constexpr explicit operator float() const noexcept { return half_bits_to_float(bits); }
  static constexpr half from_bits(std::uint16_t b) noexcept {
    half h;
    h.bits = b;
    return h;
  }
  friend constexpr bool operator==(half a, half b) noexcept { return a.bits == b.bits; }
};

/// bfloat16: the upper half of an IEEE binary32.
struct bfloat16 {
  std::uint16_t bits = 0;
  constexpr bfloat16() = default;
  constexpr explicit bfloat16(float value) noexcept : bits(float_to_bfloat16_bits(value)) {}
  constexpr explicit operator float() const noexcept { return bfloat16_bits_to_float(bits); }
  static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 h;
    h.bits = b;
    return h;
  }
  friend constexpr bool operator==(bfloat16 a, bfloat16 b) noexcept { return a.bits == b.bits; }
};

/// dtype_of<T>: the DType of a C++ element type.
template <class T>
struct dtype_traits;
template <> struct dtype_traits<bool> { static constexpr DType value = DType::boolean; };
template <> struct dtype_traits<std::int8_t> { static constexpr DType value = DType::i8; };
template <> struct dtype_traits<std::uint8_t> { static constexpr DType value = DType::u8; };
template <> struct dtype_traits<std::int16_t> { static constexpr DType value = DType::i16; };
template <> struct dtype_traits<std::uint16_t> { static constexpr DType value = DType::u16; };
template <> struct dtype_traits<std::int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_traits<std::uint32_t> { static constexpr DType value = DType::u32; };
template <> struct dtype_traits<std::int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_traits<std::uint64_t> { static constexpr DType value = DType::u64; };
template <> struct dtype_traits<half> { static constexpr DType value = DType::f16; };
template <> struct dtype_traits<bfloat16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_traits<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_traits<double> { static constexpr DType value = DType::f64; };
template <class T>
inline constexpr DType dtype_of = dtype_traits<std::remove_cv_t<T>>::value;

}  // namespace weft
