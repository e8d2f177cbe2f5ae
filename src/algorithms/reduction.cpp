#include "algorithms/reduction.hpp"

#include <cstring>

#include "kernels/cpu/reduce.hpp"

namespace weft::algorithms {

void finish_reduction(ReduceOp op, void* data, std::size_t count, DType type, int ranks) {
  if (op == ReduceOp::avg) kernels::divide_in_place(data, count, type, ranks);
  if ((op == ReduceOp::logical_and || op == ReduceOp::logical_or) && ranks == 1 && count) {
    kernels::find_reduce(type, ReduceOp::logical_and)(data, data, data, count);
  }
}

void fold_in_rank_order(std::byte* dst, const std::byte* slots, std::size_t count, int ranks, DType type, ReduceOp op) {
  if (count == 0) return;
  const std::size_t bytes = count * dtype_size(type);
  if (dst != slots) std::memcpy(dst, slots, bytes);
  const auto reduce = kernels::find_reduce(type, op);
  for (int i = 1; i < ranks; ++i) reduce(dst, dst, slots + static_cast<std::size_t>(i) * bytes, count);
}

void fold_in_rank_order(std::byte* dst, std::span<const std::byte* const> sources, std::size_t count, DType type, ReduceOp op) {
  if (count == 0 || sources.empty()) return;
  if (sources.size() == 1) {
    if (dst != sources[0]) std::memcpy(dst, sources[0], count * dtype_size(type));
    return;
  }
  const auto reduce = kernels::find_reduce(type, op);
  reduce(dst, sources[0], sources[1], count);
  for (std::size_t i = 2; i < sources.size(); ++i) reduce(dst, dst, sources[i], count);
}

}  // namespace weft::algorithms
