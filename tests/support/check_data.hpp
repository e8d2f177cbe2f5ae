#pragma once
// Check data (shared by weft-bench --check and the tests) and an independent reference for every (dtype, op): values are small so that every
// reduction order gives the same exact result, and the reference reduces in rank order in wide types.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <weft/weft.hpp>

namespace weft::reference {

/// value() repeats every `period` elements (i * 3 + i / 5 modulo 11 does: 55 * 3 and 55 / 5 are both
/// multiples of 11), so a buffer of inputs or of results is its first `period` elements over and over.
inline constexpr std::size_t period = 55;

/// Element i of rank r's input for reduction `op` (also used, with op sum, for data movement tests).
inline double value(DType t, ReduceOp op, int r, std::size_t i) {
  const auto k = static_cast<long long>((static_cast<std::size_t>(r) * 7 + i * 3 + i / 5) % 11);
  const bool is_unsigned = t == DType::u8 || t == DType::u16 || t == DType::u32 || t == DType::u64;
  if (t == DType::boolean) return static_cast<double>(k % 3 == 0 ? 0 : 1);
  switch (op) {
    case ReduceOp::prod: {
      const long long choices[] = {1, 2, -1};
      return static_cast<double>(is_unsigned ? (k % 2) + 1 : choices[k % 3]);
    }
    case ReduceOp::logical_and:
    case ReduceOp::logical_or: return static_cast<double>(k % 4 == 0 ? 0 : k % 3);
    case ReduceOp::bitwise_and:
    case ReduceOp::bitwise_or:
    case ReduceOp::bitwise_xor: return static_cast<double>((k * 37 + r) % 120);
    default: return static_cast<double>(is_unsigned ? k : k - 5);
  }
}

inline void store(DType t, void* base, std::size_t i, double v) {
  auto* p = static_cast<std::byte*>(base) + i * dtype_size(t);
  auto put = [&](auto x) { std::memcpy(p, &x, sizeof x); };
  switch (t) {
    case DType::boolean: put(static_cast<std::uint8_t>(v != 0)); break;
    case DType::i8: put(static_cast<std::int8_t>(static_cast<long long>(v))); break;
    case DType::u8: put(static_cast<std::uint8_t>(static_cast<long long>(v))); break;
    case DType::i16: put(static_cast<std::int16_t>(static_cast<long long>(v))); break;
    case DType::u16: put(static_cast<std::uint16_t>(static_cast<long long>(v))); break;
    case DType::i32: put(static_cast<std::int32_t>(static_cast<long long>(v))); break;
    case DType::u32: put(static_cast<std::uint32_t>(static_cast<long long>(v))); break;
    case DType::i64: put(static_cast<std::int64_t>(v)); break;
    case DType::u64: put(static_cast<std::uint64_t>(static_cast<long long>(v))); break;
    case DType::f16: put(half(static_cast<float>(v))); break;
    case DType::bf16: put(bfloat16(static_cast<float>(v))); break;
    case DType::f32: put(static_cast<float>(v)); break;
    case DType::f64: put(v); break;
  }
}

inline double load(DType t, const void* base, std::size_t i) {
  const auto* p = static_cast<const std::byte*>(base) + i * dtype_size(t);
  auto get = [&](auto x) {
    std::memcpy(&x, p, sizeof x);
    return x;
  };
  switch (t) {
    case DType::boolean: return get(std::uint8_t{});
    case DType::i8: return get(std::int8_t{});
    case DType::u8: return get(std::uint8_t{});
    case DType::i16: return get(std::int16_t{});
    case DType::u16: return get(std::uint16_t{});
    case DType::i32: return get(std::int32_t{});
    case DType::u32: return get(std::uint32_t{});
    case DType::i64: return static_cast<double>(get(std::int64_t{}));
    case DType::u64: return static_cast<double>(get(std::uint64_t{}));
    case DType::f16: return static_cast<float>(get(half{}));
    case DType::bf16: return static_cast<float>(get(bfloat16{}));
    case DType::f32: return get(float{});
    case DType::f64: return get(double{});
  }
  return 0;
}

/// Fills `out` past its first `filled` bytes (one period of elements) with copies of them. (The tests
/// build megabyte buffers for every dtype, op and rank; computed element by element, the reference was
/// a third of the collectives suite's time.)
inline void repeat_period(std::vector<std::byte>& out, std::size_t filled) {
  if (filled == 0) return;
  for (std::size_t done = filled; done < out.size();) {
    const std::size_t n = std::min(done, out.size() - done);  // done stays a multiple of the period
    std::memcpy(out.data() + done, out.data(), n);
    done += n;
  }
}

/// Rank r's input buffer.
inline std::vector<std::byte> make_input(DType t, ReduceOp op, int r, std::size_t count, std::size_t salt = 0) {
  std::vector<std::byte> out(count * dtype_size(t));
  const std::size_t first = std::min(count, period);
  for (std::size_t i = 0; i < first; ++i) store(t, out.data(), i, value(t, op, r, i + salt));
  repeat_period(out, first * dtype_size(t));
  return out;
}

/// The reduction over ranks 0..p-1 of element i (inputs built by make_input), stored as the dtype stores
/// it: integer results wrap as the dtype wraps.
inline std::vector<std::byte> make_reduced(DType t, ReduceOp op, int p, std::size_t count, std::size_t salt = 0) {
  std::vector<std::byte> out(count * dtype_size(t));
  const bool floating = is_floating(t);
  const std::size_t first = std::min(count, period);
  for (std::size_t i = 0; i < first; ++i) {
    double acc = value(t, op, 0, i + salt);
    long long iacc = static_cast<long long>(acc);
    for (int r = 1; r < p; ++r) {
      const double v = value(t, op, r, i + salt);
      const auto iv = static_cast<long long>(v);
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::avg: acc += v; iacc += iv; break;
        case ReduceOp::prod: acc *= v; iacc *= iv; break;
        case ReduceOp::min: acc = std::min(acc, v); iacc = std::min(iacc, iv); break;
        case ReduceOp::max: acc = std::max(acc, v); iacc = std::max(iacc, iv); break;
        case ReduceOp::logical_and: acc = (acc != 0 && v != 0); iacc = (iacc != 0 && iv != 0); break;
        case ReduceOp::logical_or: acc = (acc != 0 || v != 0); iacc = (iacc != 0 || iv != 0); break;
        case ReduceOp::bitwise_and: iacc &= iv; break;
        case ReduceOp::bitwise_or: iacc |= iv; break;
        case ReduceOp::bitwise_xor: iacc ^= iv; break;
      }
    }
    if (floating) {
      if (op == ReduceOp::logical_and || op == ReduceOp::logical_or) acc = acc != 0 ? 1 : 0;
      if (op == ReduceOp::avg) {
        // The same arithmetic the dtype does: the exact sum in the element's compute type, divided there.
        if (t == DType::f64) acc = acc / p;
        else acc = static_cast<double>(static_cast<float>(acc) / static_cast<float>(p));
      }
      store(t, out.data(), i, acc);
    } else {
      if (op == ReduceOp::logical_and || op == ReduceOp::logical_or) iacc = iacc != 0 ? 1 : 0;
      // Wrap to the dtype first (as the kernel does), then divide in the dtype.
      alignas(8) std::byte tmp[8]{};
      store(t, tmp, 0, static_cast<double>(iacc));
      if (t == DType::i64 || t == DType::u64) {
        std::int64_t w = iacc;
        if (op == ReduceOp::avg) w = t == DType::i64 ? w / p : static_cast<std::int64_t>(static_cast<std::uint64_t>(w) / static_cast<std::uint64_t>(p));
        std::memcpy(out.data() + i * 8, &w, 8);
        continue;
      }
      double wrapped = load(t, tmp, 0);
      if (op == ReduceOp::avg && t != DType::boolean) wrapped = static_cast<double>(static_cast<long long>(wrapped) / p);
      store(t, out.data(), i, wrapped);
    }
  }
  repeat_period(out, first * dtype_size(t));
  return out;
}

/// "" when equal, else a description of the first difference.
inline std::string compare(DType t, const void* got, const void* expected, std::size_t count) {
  const auto bytes = count * dtype_size(t);
  if (bytes == 0 || std::memcmp(got, expected, bytes) == 0) return {};
  for (std::size_t i = 0; i < count; ++i) {
    const auto size = dtype_size(t);
    if (std::memcmp(static_cast<const std::byte*>(got) + i * size, static_cast<const std::byte*>(expected) + i * size, size) != 0) {
      return fmt::format("{} element {} of {}: got {}, expected {}", to_string(t), i, count, load(t, got, i), load(t, expected, i));
    }
  }
  return "differs";
}

}  // namespace weft::reference
