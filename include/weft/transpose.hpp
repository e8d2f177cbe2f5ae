#pragma once
/// Collective transposes for automatic differentiation (the vector-Jacobian products of the linear
/// collectives), so that a framework can plug weft's collectives into reverse mode:
///
///   all_reduce (sum)   -> all_reduce (sum)        all_gather     -> reduce_scatter (sum)
///   reduce_scatter(sum)-> all_gather              broadcast(root)-> reduce(root, sum); zero elsewhere
///   reduce(root, sum)  -> broadcast(root)         scatter(root)  -> gather(root)
///   gather(root)       -> scatter(root)           all_to_all     -> all_to_all
///   permute(pairs)     -> permute(inverse pairs)
///   all_gatherv        -> reduce_scatterv (sum)   gatherv(root)  -> scatterv(root)
///   all_to_allv        -> all_to_allv (send and receive counts swapped)
///
/// Only sum reductions are linear; the transpose of a min/max/prod reduction is not a collective and is
/// refused.
#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "weft/buffer.hpp"
#include "weft/collective.hpp"
#include "weft/future.hpp"
#include "weft/reduce_op.hpp"

namespace weft {

class Group;

/// The collective that computes the transpose of `c` (barrier's is barrier; split has none and is
/// returned as itself, which apply_transpose refuses).
Collective transpose_of(Collective c) noexcept;

/// The inverse of a permutation given as (src, dst) pairs: every pair reversed.
std::vector<std::pair<int, int>> inverse_pairs(const std::vector<std::pair<int, int>>& pairs);

/// Runs the transpose of `c` (as it was called with `root`, `pairs` and op sum) on this rank's cotangent
/// (shaped like c's output here) and writes this rank's gradient (shaped like c's input here).
/// Returns: the transpose collective's Future. Errors: as the collective; Errc::invalid_argument when
/// `op` is not sum, or `c` is split or a variable-size collective (whose transpose needs the per-rank
/// counts: call transpose_of(c) with them). Lifetime: both buffers must outlive the Future.
Future<void> apply_transpose(Group& group, Collective c, ConstBufferView cotangent, BufferView gradient,
                             ReduceOp op = ReduceOp::sum, int root = 0,
                             const std::vector<std::pair<int, int>>& pairs = {});

}  // namespace weft
