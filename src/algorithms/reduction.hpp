#pragma once
// The local arithmetic of reductions that is not a plan step: what a reduction does after its last
// combining step, and the rank-order fold of deterministic mode. Here, so that Group never calls kernels
// (the kernels are the algorithms' floor below).
#include <cstddef>
#include <span>

#include "weft/dtype.hpp"
#include "weft/reduce_op.hpp"

namespace weft::algorithms {

/// After the last combining step of a reduction over `ranks` ranks: avg divides by the number of ranks;
/// a logical op on one rank still yields 0 or 1 (x && x), as it does on more.
void finish_reduction(ReduceOp op, void* data, std::size_t count, DType type, int ranks);

/// dst = ((slot 0 op slot 1) op slot 2) ... over `ranks` slots of `count` elements each, in rank order.
/// `dst` may be slot 0.
void fold_in_rank_order(std::byte* dst, const std::byte* slots, std::size_t count, int ranks, DType type, ReduceOp op);
/// The same over `sources` wherever they lie (rank i's at sources[i]): the direct shm collectives read
/// every rank's area of the group arena. `dst` may be sources[0]; no other source may overlap it.
void fold_in_rank_order(std::byte* dst, std::span<const std::byte* const> sources, std::size_t count, DType type, ReduceOp op);

}  // namespace weft::algorithms
