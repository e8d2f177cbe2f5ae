#include <string>

#include "weft/dtype.hpp"
#include "weft/reduce_op.hpp"

namespace weft {

std::string_view to_string(DType type) noexcept {
  switch (type) {
    case DType::boolean: return "bool";
    case DType::i8: return "i8";
    case DType::u8: return "u8";
    case DType::i16: return "i16";
    case DType::u16: return "u16";
    case DType::i32: return "i32";
    case DType::u32: return "u32";
    case DType::i64: return "i64";
    case DType::u64: return "u64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::f32: return "f32";
    case DType::f64: return "f64";
  }
  return "unknown dtype";
}

std::optional<DType> parse_dtype(std::string_view name) noexcept {
  struct Alias {
    std::string_view name;
    DType type;
  };
  static constexpr Alias aliases[] = {
      {"bool", DType::boolean}, {"i8", DType::i8},     {"int8", DType::i8},       {"char", DType::i8},
      {"u8", DType::u8},        {"uint8", DType::u8},  {"i16", DType::i16},       {"int16", DType::i16},
      {"u16", DType::u16},      {"uint16", DType::u16}, {"i32", DType::i32},      {"int32", DType::i32},
      {"int", DType::i32},      {"u32", DType::u32},   {"uint32", DType::u32},    {"i64", DType::i64},
      {"int64", DType::i64},    {"u64", DType::u64},   {"uint64", DType::u64},    {"f16", DType::f16},
      {"half", DType::f16},     {"float16", DType::f16}, {"bf16", DType::bf16},   {"bfloat16", DType::bf16},
      {"f32", DType::f32},      {"float", DType::f32}, {"float32", DType::f32},   {"f64", DType::f64},
      {"double", DType::f64},   {"float64", DType::f64},
  };
  for (const auto& alias : aliases) {
    if (alias.name == name) return alias.type;
  }
  return std::nullopt;
}

bool is_floating(DType type) noexcept {
  return type == DType::f16 || type == DType::bf16 || type == DType::f32 || type == DType::f64;
}

std::string_view to_string(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::prod: return "prod";
    case ReduceOp::min: return "min";
    case ReduceOp::max: return "max";
    case ReduceOp::avg: return "avg";
    case ReduceOp::logical_and: return "land";
    case ReduceOp::logical_or: return "lor";
    case ReduceOp::bitwise_and: return "band";
    case ReduceOp::bitwise_or: return "bor";
    case ReduceOp::bitwise_xor: return "bxor";
  }
  return "unknown op";
}

std::optional<ReduceOp> parse_reduce_op(std::string_view name) noexcept {
  struct Alias {
    std::string_view name;
    ReduceOp op;
  };
  static constexpr Alias aliases[] = {
      {"sum", ReduceOp::sum},         {"prod", ReduceOp::prod},          {"min", ReduceOp::min},
      {"max", ReduceOp::max},         {"avg", ReduceOp::avg},            {"land", ReduceOp::logical_and},
      {"logical_and", ReduceOp::logical_and}, {"lor", ReduceOp::logical_or}, {"logical_or", ReduceOp::logical_or},
      {"band", ReduceOp::bitwise_and}, {"bitwise_and", ReduceOp::bitwise_and}, {"bor", ReduceOp::bitwise_or},
      {"bitwise_or", ReduceOp::bitwise_or}, {"bxor", ReduceOp::bitwise_xor}, {"bitwise_xor", ReduceOp::bitwise_xor},
  };
  for (const auto& alias : aliases) {
    if (alias.name == name) return alias.op;
  }
  return std::nullopt;
}

bool is_defined(DType type, ReduceOp op) noexcept {
  if (!is_valid(type) || !is_valid(op)) return false;
  const bool bitwise = op == ReduceOp::bitwise_and || op == ReduceOp::bitwise_or || op == ReduceOp::bitwise_xor;
  if (bitwise && is_floating(type)) return false;
  const bool arithmetic = op == ReduceOp::sum || op == ReduceOp::prod || op == ReduceOp::avg;
  if (arithmetic && type == DType::boolean) return false;
  return true;
}

}  // namespace weft
