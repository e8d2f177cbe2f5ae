// The variable-size collectives: each rank's block has its own count (and, in the buffer it lies in, its
// own displacement). The plans are the equal-block ones over ranges (a ring over the blocks, direct
// gather and scatter, the pairwise exchange); what this room adds is the layout, its checks, and the
// digest of the counts that the signature carries so that ranks that disagree about them fail.
#include "group/variable.hpp"

#include <algorithm>
#include <cstring>
#include <numeric>

#include <fmt/format.h>

#include "algorithms/reduction.hpp"
#include "algorithms/registry.hpp"
#include "core/scratch.hpp"
#include "core/signature.hpp"
#include "group/checks.hpp"
#include "group/staging.hpp"

namespace weft::detail {
namespace {

// The most elements of any dtype a buffer can hold (max_buffer_bytes at one byte each): sums are refused
// past it rather than wrapped.
constexpr std::size_t max_elements = max_buffer_bytes;

void check_length(const GroupState& g, const char* op, const char* list, std::size_t length) {
  if (length != static_cast<std::size_t>(g.size)) {
    invalid(g, op, fmt::format("{} has {} entries; it needs one per rank of this group of {}", list, length, g.size));
  }
}

// The blocks of `counts` at `displs` (empty: packed in rank order), and how far they reach.
std::vector<algo::Range> blocks_at(const GroupState& g, const char* op, const char* counts_name, std::span<const std::size_t> counts,
                                   const char* displs_name, std::span<const std::size_t> displs, std::size_t& reach) {
  check_length(g, op, counts_name, counts.size());
  if (!displs.empty()) check_length(g, op, displs_name, displs.size());
  std::vector<algo::Range> blocks(counts.size());
  std::size_t packed = 0;
  reach = 0;
  for (std::size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] > max_elements) invalid(g, op, fmt::format("{}[{}] = {} is more than a buffer can hold", counts_name, i, counts[i]));
    const std::size_t offset = displs.empty() ? packed : displs[i];
    if (offset > max_elements) invalid(g, op, fmt::format("{}[{}] = {} is past what a buffer can hold", displs_name, i, offset));
    blocks[i] = algo::Range{offset, counts[i]};
    packed += counts[i];  // at most p * 2^47: no wrap for any group a machine can form
    if (packed > max_elements) invalid(g, op, fmt::format("the {} add up to more than a buffer can hold", counts_name));
    reach = std::max(reach, offset + counts[i]);
  }
  return blocks;
}

// Blocks that one buffer receives must not overlap (every byte of them has one writer).
void check_disjoint(const GroupState& g, const char* op, const char* displs_name, const std::vector<algo::Range>& blocks) {
  std::vector<std::size_t> order(blocks.size());
  std::iota(order.begin(), order.end(), std::size_t{0});
  std::erase_if(order, [&](std::size_t i) { return blocks[i].count == 0; });
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return blocks[a].offset != blocks[b].offset ? blocks[a].offset < blocks[b].offset : a < b;
  });
  for (std::size_t k = 1; k < order.size(); ++k) {
    const algo::Range& before = blocks[order[k - 1]];
    const algo::Range& after = blocks[order[k]];
    if (before.offset + before.count > after.offset) {
      invalid(g, op, fmt::format("the output blocks of ranks {} ([{}, {})) and {} ([{}, {})) overlap; {} must keep them apart",
                                 order[k - 1], before.offset, before.offset + before.count, order[k], after.offset,
                                 after.offset + after.count, displs_name));
    }
  }
}

std::size_t sum(std::span<const std::size_t> counts) { return std::accumulate(counts.begin(), counts.end(), std::size_t{0}); }

}  // namespace

std::shared_ptr<const BlockLayout> block_layout(const GroupState& g, Collective collective, std::span<const std::size_t> counts,
                                                std::span<const std::size_t> displs, std::span<const std::size_t> recv_counts,
                                                std::span<const std::size_t> recv_displs, int root) {
  const char* op = to_string(collective).data();
  auto layout = std::make_shared<BlockLayout>();
  switch (collective) {
    case Collective::all_gatherv:
    case Collective::gatherv: {
      layout->out = blocks_at(g, op, "counts", counts, "displs", displs, layout->out_reach);
      // gatherv's displacements are the root's; elsewhere only the counts are used.
      if (collective == Collective::all_gatherv || g.rank == root) check_disjoint(g, op, "displs", layout->out);
      break;
    }
    case Collective::scatterv:
      layout->in = blocks_at(g, op, "counts", counts, "displs", displs, layout->in_reach);
      break;
    case Collective::reduce_scatterv:
      if (!displs.empty()) invalid(g, op, "takes no displacements: its input holds the blocks packed in rank order");
      layout->in = blocks_at(g, op, "counts", counts, "displs", {}, layout->in_reach);
      break;
    case Collective::all_to_allv: {
      layout->in = blocks_at(g, op, "send_counts", counts, "send_displs", displs, layout->in_reach);
      layout->out = blocks_at(g, op, "recv_counts", recv_counts, "recv_displs", recv_displs, layout->out_reach);
      check_disjoint(g, op, "recv_displs", layout->out);
      const auto r = static_cast<std::size_t>(g.rank);
      if (counts[r] != recv_counts[r]) {
        invalid(g, op, fmt::format("this rank sends itself send_counts[{}] = {} elements but receives recv_counts[{}] = {}", r,
                                   counts[r], r, recv_counts[r]), g.rank);
      }
      layout->total = std::max(sum(counts), sum(recv_counts));
      return layout;  // counts differ by rank: no digest (the receives' sizes are checked instead)
    }
    default: throw std::logic_error(fmt::format("weft: {} is not a variable-size collective", op));
  }
  layout->total = sum(counts);
  layout->padded = counts.empty() ? 0 : *std::max_element(counts.begin(), counts.end()) * counts.size();
  layout->digest = signature::counts_digest(counts);
  return layout;
}

void check_blocks(const GroupState& g, const char* op, const CollectiveCall& call, bool input_here, bool output_here) {
  const BlockLayout& b = *call.blocks;
  const auto r = static_cast<std::size_t>(g.rank);
  auto reaches = [&](const char* what, std::size_t count, std::size_t reach, const char* lists) {
    if (count < reach) invalid(g, op, fmt::format("{} has {} elements, but its blocks reach element {} ({})", what, count, reach, lists));
  };
  switch (call.collective) {
    case Collective::all_gatherv:
    case Collective::gatherv:
      if (input_here) check_count(g, op, "input", call.in.count, b.out[r].count);
      if (output_here) reaches("output", call.out.count, b.out_reach, "displs + counts");
      break;
    case Collective::scatterv:
      if (input_here) reaches("input", call.in.count, b.in_reach, "displs + counts");
      if (output_here) check_count(g, op, "output", call.out.count, b.in[r].count);
      break;
    case Collective::reduce_scatterv:
      check_count(g, op, "input", call.in.count, b.in_reach);
      check_count(g, op, "output", call.out.count, b.in[r].count);
      break;
    case Collective::all_to_allv:
      reaches("input", call.in.count, b.in_reach, "send_displs + send_counts");
      reaches("output", call.out.count, b.out_reach, "recv_displs + recv_counts");
      break;
    default: throw std::logic_error(fmt::format("weft: {} is not a variable-size collective", op));
  }
}

namespace {

// Bruck over blocks padded to the largest count: ceil(lg p) rounds instead of the ring's p - 1, for
// the small sizes where rounds cost more than the padding's bytes. Slot i of the rotated staging holds
// rank (r + i)'s block; each lands at its displacement at the end.
Task<void> padded_bruck_all_gatherv(GroupState& g, std::uint64_t seq, ConstBufferView in, BufferView out, const BlockLayout& b) {
  const std::size_t esize = dtype_size(out.dtype);
  const auto p = static_cast<std::size_t>(g.size);
  const auto r = static_cast<std::size_t>(g.rank);
  const std::size_t widest = b.padded / p;
  // Zeroed: the padding travels too, and bytes that travel are defined.
  auto slots = scratch_bytes(p * widest * esize);
  std::memset(slots.get(), 0, p * widest * esize);
  copy_bytes(slots.get(), in.data, in.bytes());
  const auto plan = algo::bruck_all_gather(g.size, g.rank, widest);
  co_await g.run(plan, seq, Collective::all_gatherv, algo::PlanBuffers{slots.get(), slots.get(), out.dtype, ReduceOp::sum}, {b.digest});
  for (std::size_t i = 0; i < p; ++i) {
    const algo::Range block = b.out[(r + i) % p];
    copy_bytes(out.bytes_ptr() + block.offset * esize, slots.get() + i * widest * esize, block.count * esize);
  }
}

Task<void> all_gatherv_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out,
                            std::shared_ptr<const BlockLayout> b, algo::Kind kind) {
  if (kind == algo::Kind::bruck && g->size > 2) {
    co_await padded_bruck_all_gatherv(*g, seq, in, out, *b);
    co_return;
  }
  const std::size_t esize = dtype_size(out.dtype);
  // In place (`in` is this rank's block of `out`), the copy is no copy.
  copy_bytes(out.bytes_ptr() + b->out[static_cast<std::size_t>(g->rank)].offset * esize, in.data, in.bytes());
  const auto plan = algo::ring_all_gather(g->size, g->rank, b->out, -1);
  co_await g->run(plan, seq, Collective::all_gatherv, algo::PlanBuffers{out.bytes_ptr(), out.bytes_ptr(), out.dtype, ReduceOp::sum},
                  {b->digest});
}

Task<void> gatherv_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, int root,
                        std::shared_ptr<const BlockLayout> b) {
  const bool at_root = g->rank == root;
  if (at_root) copy_bytes(out.bytes_ptr() + b->out[static_cast<std::size_t>(root)].offset * dtype_size(in.dtype), in.data, in.bytes());
  const auto plan = algo::direct_gather(g->size, g->rank, root, b->out);
  co_await g->run(plan, seq, Collective::gatherv, algo::PlanBuffers{in.bytes_ptr(), at_root ? out.bytes_ptr() : nullptr, in.dtype, ReduceOp::sum},
                  {b->digest, root});
}

Task<void> scatterv_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, int root,
                         std::shared_ptr<const BlockLayout> b) {
  const bool at_root = g->rank == root;
  if (at_root) copy_bytes(out.data, in.bytes_ptr() + b->in[static_cast<std::size_t>(root)].offset * dtype_size(out.dtype), out.bytes());
  const auto plan = algo::direct_scatter(g->size, g->rank, root, b->in);
  co_await g->run(plan, seq, Collective::scatterv, algo::PlanBuffers{at_root ? in.bytes_ptr() : nullptr, out.bytes_ptr(), out.dtype, ReduceOp::sum},
                  {b->digest, root});
}

Task<void> all_to_allv_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out,
                            std::shared_ptr<const BlockLayout> b) {
  const std::size_t esize = dtype_size(in.dtype);
  ScratchBytes copy;
  const std::byte* source = in.bytes_ptr();
  if (in.data == out.data && b->in_reach) {  // in place: send from a copy of what the sends read
    copy = scratch_bytes(b->in_reach * esize);
    std::memcpy(copy.get(), in.data, b->in_reach * esize);
    source = copy.get();
  }
  const auto r = static_cast<std::size_t>(g->rank);
  copy_bytes(out.bytes_ptr() + b->out[r].offset * esize, source + b->in[r].offset * esize, b->in[r].count * esize);
  const auto plan = algo::pairwise_all_to_all(g->size, g->rank, b->in, b->out);
  co_await g->run(plan, seq, Collective::all_to_allv, algo::PlanBuffers{source, out.bytes_ptr(), in.dtype, ReduceOp::sum}, {b->digest});
}

Task<void> reduce_scatterv_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, ReduceOp op,
                                std::shared_ptr<const BlockLayout> b) {
  const std::size_t esize = dtype_size(in.dtype);
  const algo::Range mine = b->in[static_cast<std::size_t>(g->rank)];
  if (g->options.deterministic && g->size > 1) {
    co_await ordered_reduce(*g, seq, Collective::reduce_scatterv, in.bytes_ptr(), b->in, out.bytes_ptr(), out.dtype, op, {b->digest});
    algo::finish_reduction(op, out.data, out.count, out.dtype, g->size);
    co_return;
  }
  // The ring reduces into scratch, reading this rank's contributions from `in`; its own block is the
  // result (one rank: the input is).
  auto work = scratch_bytes(in.bytes());
  if (g->size == 1) copy_bytes(work.get(), in.data, in.bytes());
  const auto plan = algo::ring_reduce_scatter(g->size, g->rank, b->in, -1);
  co_await g->run(plan, seq, Collective::reduce_scatterv, algo::PlanBuffers{in.bytes_ptr(), work.get(), out.dtype, op, in.bytes_ptr()},
                  {b->digest});
  copy_bytes(out.data, work.get() + mine.offset * esize, mine.count * esize);
  algo::finish_reduction(op, out.data, out.count, out.dtype, g->size);
}

}  // namespace

Task<void> variable_task(std::shared_ptr<GroupState> g, std::uint64_t seq, const CollectiveCall& call, const algo::Algorithm& algorithm) {
  // The kinds this room runs; a registry entry it does not run fails loudly instead of running nothing.
  const bool runs = call.collective == Collective::all_gatherv ? algorithm.kind == algo::Kind::ring || algorithm.kind == algo::Kind::bruck
                                                               : algorithm.kind == algo::Selection::built_in(call.collective, 0, g->size)->kind;
  if (!runs) {
    throw std::logic_error(fmt::format("weft: {} has no implementation of the algorithm '{}'", to_string(call.collective), algorithm.name));
  }
  switch (call.collective) {
    case Collective::all_gatherv: return all_gatherv_task(std::move(g), seq, call.in, call.out, call.blocks, algorithm.kind);
    case Collective::gatherv: return gatherv_task(std::move(g), seq, call.in, call.out, call.root, call.blocks);
    case Collective::scatterv: return scatterv_task(std::move(g), seq, call.in, call.out, call.root, call.blocks);
    case Collective::all_to_allv: return all_to_allv_task(std::move(g), seq, call.in, call.out, call.blocks);
    case Collective::reduce_scatterv: return reduce_scatterv_task(std::move(g), seq, call.in, call.out, call.op, call.blocks);
    default: break;
  }
  throw std::logic_error(fmt::format("weft: {} is not a variable-size collective", to_string(call.collective)));
}

}  // namespace weft::detail

namespace weft {

using detail::block_layout;

Future<void> Group::all_gatherv(ConstBufferView in, BufferView out, const std::vector<std::size_t>& counts,
                                const std::vector<std::size_t>& displs) {
  const auto& g = live("all_gatherv");
  detail::CollectiveCall call{Collective::all_gatherv, in, out};
  call.blocks = block_layout(g, Collective::all_gatherv, counts, displs);
  return submit(call);
}

Future<void> Group::gatherv(ConstBufferView in, BufferView out, const std::vector<std::size_t>& counts, int root,
                            const std::vector<std::size_t>& displs) {
  const auto& g = live("gatherv");
  detail::check_rank(g, "gatherv", "root", root);
  detail::CollectiveCall call{Collective::gatherv, in, out, ReduceOp::sum, root};
  call.blocks = block_layout(g, Collective::gatherv, counts, displs, {}, {}, root);
  return submit(call);
}

Future<void> Group::scatterv(ConstBufferView in, BufferView out, const std::vector<std::size_t>& counts, int root,
                             const std::vector<std::size_t>& displs) {
  const auto& g = live("scatterv");
  detail::check_rank(g, "scatterv", "root", root);
  detail::CollectiveCall call{Collective::scatterv, in, out, ReduceOp::sum, root};
  call.blocks = block_layout(g, Collective::scatterv, counts, displs, {}, {}, root);
  return submit(call);
}

Future<void> Group::all_to_allv(ConstBufferView in, BufferView out, const std::vector<std::size_t>& send_counts,
                                const std::vector<std::size_t>& recv_counts, const std::vector<std::size_t>& send_displs,
                                const std::vector<std::size_t>& recv_displs) {
  const auto& g = live("all_to_allv");
  detail::CollectiveCall call{Collective::all_to_allv, in, out};
  call.blocks = block_layout(g, Collective::all_to_allv, send_counts, send_displs, recv_counts, recv_displs);
  return submit(call);
}

Future<void> Group::reduce_scatterv(ConstBufferView in, BufferView out, const std::vector<std::size_t>& counts, ReduceOp op) {
  const auto& g = live("reduce_scatterv");
  detail::CollectiveCall call{Collective::reduce_scatterv, in, out, op};
  call.blocks = block_layout(g, Collective::reduce_scatterv, counts, {});
  return submit(call);
}

}  // namespace weft
