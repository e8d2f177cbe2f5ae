#pragma once
/// Reduction operators.
#include <cstdint>
#include <optional>
#include <string_view>

#include "weft/dtype.hpp"

namespace weft {

enum class ReduceOp : std::uint8_t {
  sum,
  prod,
  min,
  max,
  avg,          ///< sum, then divided by the number of ranks (integer division for integer types)
  logical_and,  ///< result is 1 where every input is non-zero, else 0
  logical_or,   ///< result is 1 where any input is non-zero, else 0
  bitwise_and,  ///< integer and bool types only
  bitwise_or,
  bitwise_xor,
};

inline constexpr ReduceOp all_reduce_ops[] = {ReduceOp::sum,         ReduceOp::prod,       ReduceOp::min,
                                              ReduceOp::max,         ReduceOp::avg,        ReduceOp::logical_and,
                                              ReduceOp::logical_or,  ReduceOp::bitwise_and, ReduceOp::bitwise_or,
                                              ReduceOp::bitwise_xor};

/// Whether `op` is one of the values above (an integer cast to ReduceOp may not be; every call refuses it).
constexpr bool is_valid(ReduceOp op) noexcept {
  return static_cast<std::uint8_t>(op) <= static_cast<std::uint8_t>(ReduceOp::bitwise_xor);
}

std::string_view to_string(ReduceOp op) noexcept;
/// Accepts "sum", "prod", "min", "max", "avg", "land"/"logical_and", "lor"/"logical_or", "band"/"bitwise_and",
/// "bor"/"bitwise_or", "bxor"/"bitwise_xor".
std::optional<ReduceOp> parse_reduce_op(std::string_view name) noexcept;

/// Whether `op` is defined on `type`. Not defined: a value that is not valid (above); bitwise ops on
/// floating types; sum, prod and avg on bool.
bool is_defined(DType type, ReduceOp op) noexcept;

}  // namespace weft
