#pragma once
// The variable-size collectives (all_gatherv, gatherv, scatterv, all_to_allv, reduce_scatterv): their
// block layouts, the checks of a call against them, and their tasks. They go through the one submit path
// (collectives.cpp) like every buffer collective; this room owns what counts per rank add.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "group/state.hpp"
#include "weft/algorithms.hpp"
#include "weft/task.hpp"

namespace weft::detail {

// Where each rank's block lies in this rank's buffers, in elements.
struct BlockLayout {
  std::vector<algo::Range> in;   // per rank, its block of this rank's input: all_to_allv's sends, scatterv's (the
                                 // root's) blocks, reduce_scatterv's packed blocks; empty where the input is one block
  std::vector<algo::Range> out;  // per rank, where its block lands in this rank's output: all_gatherv, gatherv
                                 // (the root's), all_to_allv's receives; empty where the output is one block
  std::size_t in_reach = 0;      // elements the input must hold: the furthest end of `in`
  std::size_t out_reach = 0;     // ... and the output: the furthest end of `out`
  std::size_t total = 0;         // elements of every block together: the size the selection looks at ...
  std::size_t padded = 0;        // ... except for all_gatherv: size() x the largest block (its Bruck pads to it)
  std::uint64_t digest = 0;      // signature::counts_digest of the counts every rank passes (0: all_to_allv)
};

// The layout of a call of `collective` from its counts and displacements (validated: a list's length,
// sums that overflow, output blocks that overlap, all_to_allv's own block sent and received alike).
// Errors: weft::Error (invalid_argument) naming the rank, the operation and the list at fault.
std::shared_ptr<const BlockLayout> block_layout(const GroupState& g, Collective collective, std::span<const std::size_t> counts,
                                                std::span<const std::size_t> displs, std::span<const std::size_t> recv_counts = {},
                                                std::span<const std::size_t> recv_displs = {}, int root = -1);

// The buffers of `call` against its layout (after the common checks of buffers, op and dtype).
void check_blocks(const GroupState& g, const char* op, const CollectiveCall& call, bool input_here, bool output_here);

// The task of a variable-size `call` with `algorithm`.
Task<void> variable_task(std::shared_ptr<GroupState> g, std::uint64_t seq, const CollectiveCall& call,
                         const algo::Algorithm& algorithm);

// collectives.cpp's deterministic reduction of block `mine` of every rank (rank-order fold), which
// reduce_scatterv shares.
Task<void> ordered_reduce(GroupState& g, std::uint64_t seq, Collective name, const std::byte* in,
                          std::span<const algo::Range> blocks, std::byte* dst, DType type, ReduceOp op, GroupState::Call call);

}  // namespace weft::detail
