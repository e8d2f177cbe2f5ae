#pragma once
// CPU reduction kernels, looked up by (dtype, op). A kernel computes dst[i] = a[i] op b[i] for n elements;
// dst may alias a or b. One type-erased signature (as in Gloo) keeps the algorithms free of templates.
#include <cstddef>

#include "weft/dtype.hpp"
#include "weft/reduce_op.hpp"

namespace weft::kernels {

using ReduceFn = void (*)(void* dst, const void* a, const void* b, std::size_t n);

/// The kernel for (type, op), or nullptr where op is not defined on type. avg returns the sum kernel:
/// the division by the number of ranks is a separate pass (divide_in_place) after the last reduction.
ReduceFn find_reduce(DType type, ReduceOp op) noexcept;

/// data[i] /= divisor (integer division for integer types; bool is left unchanged).
void divide_in_place(void* data, std::size_t n, DType type, int divisor) noexcept;

}  // namespace weft::kernels
