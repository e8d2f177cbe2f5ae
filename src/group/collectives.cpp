// The collectives: the submit path (one typed call record, validated against its collective's rule, the
// algorithm chosen, the sequence number taken) and each collective's task, which stages the buffers and
// runs the chosen algorithm's plan; permute and run_plan, which have rules of their own.
#include "weft/group.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "algorithms/messages.hpp"
#include "algorithms/reduction.hpp"
#include "algorithms/registry.hpp"
#include "core/scratch.hpp"
#include "core/signature.hpp"
#include "group/checks.hpp"
#include "group/device_staging.hpp"
#include "group/device_windows.hpp"
#include "group/shm_collectives.hpp"
#include "group/staging.hpp"
#include "group/state.hpp"
#include "group/variable.hpp"

namespace weft {
namespace detail {

// Deterministic reduction of block `mine` of every rank: an ordered exchange brings every rank's block
// here (slot i from rank i), and the fold runs in rank order: ((x0 op x1) op x2) ...
Task<void> ordered_reduce(GroupState& g, std::uint64_t seq, Collective name, const std::byte* in,
                          std::span<const algo::Range> blocks, std::byte* dst, DType type, ReduceOp op,
                          GroupState::Call call) {
  const std::size_t esize = dtype_size(type);
  const algo::Range mine = blocks[static_cast<std::size_t>(g.rank)];
  auto slots = scratch_bytes(mine.count * esize * static_cast<std::size_t>(g.size));
  copy_bytes(slots.get() + static_cast<std::size_t>(g.rank) * mine.count * esize, in + mine.offset * esize, mine.count * esize);
  const auto plan = algo::ordered_exchange(g.size, g.rank, blocks);
  co_await g.run(plan, seq, name, algo::PlanBuffers{in, slots.get(), type, op}, call);
  algo::fold_in_rank_order(dst, slots.get(), mine.count, g.size, type, op);
}

}  // namespace detail

namespace {

using namespace detail;

Task<void> deterministic_all_reduce(std::shared_ptr<GroupState> g, std::uint64_t seq, Collective name,
                                    ConstBufferView in, BufferView out, ReduceOp op, GroupState::Call call) {
  const auto blocks = algo::blocks_of(out.count, g->size);
  const algo::Range mine = blocks[static_cast<std::size_t>(g->rank)];
  const std::size_t esize = dtype_size(out.dtype);
  // The fold lands after the exchange has ended, and the exchange never sends this rank's own block:
  // in place, it may write straight over the input.
  co_await ordered_reduce(*g, seq, name, in.bytes_ptr(), blocks, out.bytes_ptr() + mine.offset * esize, out.dtype, op, call);
  algo::finish_reduction(op, out.bytes_ptr() + mine.offset * esize, mine.count, out.dtype, g->size);
  const auto gather = algo::ring_all_gather(g->size, g->rank, blocks, -1);
  co_await g->run(gather, seq, name, algo::PlanBuffers{out.bytes_ptr(), out.bytes_ptr(), out.dtype, op}, call, std::uint64_t{1} << 32);
}

// Every task starts by checking that it implements the algorithm it was given: a registry entry whose
// kind a task does not handle fails here, loudly, instead of running an empty plan.
void require(const algo::Algorithm& algorithm, std::initializer_list<algo::Kind> handled) {
  if (std::find(handled.begin(), handled.end(), algorithm.kind) == handled.end()) {
    throw std::logic_error(fmt::format("weft: {} has no implementation of the algorithm '{}'", to_string(algorithm.collective),
                                       algorithm.name));
  }
}

// Whether `call`'s task runs on its buffers only through one plan and writes nothing after it, so that
// device staging may run that plan while the copies in and back are still going (StagedBuffers): the
// rings of all_reduce (not avg, whose division comes after the plan; not deterministic) and broadcast.
bool pipelines(const GroupState& g, const detail::CollectiveCall& call, const algo::Algorithm& algorithm) {
  if (g.size == 1) return false;
  switch (call.collective) {
    case Collective::all_reduce:
      return (algorithm.kind == algo::Kind::ring || algorithm.kind == algo::Kind::bidirectional_ring) &&
             call.op != ReduceOp::avg && !g.options.deterministic;
    case Collective::broadcast:
      return algorithm.kind == algo::Kind::binomial || algorithm.kind == algo::Kind::scatter_all_gather || algorithm.kind == algo::Kind::chain;
    default: return false;
  }
}

// A (non-deterministic) all_reduce's plan and its buffers; `copy_first` when the plan runs in place on
// `out` and the input must be copied there first.
struct AllReducePlan {
  std::shared_ptr<const algo::Plan> plan;
  algo::PlanBuffers buffers;
  bool copy_first = false;
};
AllReducePlan all_reduce_plan(GroupState& g, ConstBufferView in, BufferView out, ReduceOp op, const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::ring, Kind::bidirectional_ring, Kind::recursive_doubling, Kind::rabenseifner, Kind::tree});
  AllReducePlan made{{}, algo::PlanBuffers{out.bytes_ptr(), out.bytes_ptr(), out.dtype, op}, false};
  made.plan = g.plan_for({Collective::all_reduce, algorithm.kind, out.count}, [&] {
    switch (algorithm.kind) {
      case Kind::ring: return g.size > 1 ? algo::ring_all_reduce(g.size, g.rank, out.count) : algo::Plan{};
      case Kind::bidirectional_ring: return g.size > 1 ? algo::bidirectional_ring_all_reduce(g.size, g.rank, out.count) : algo::Plan{};
      case Kind::recursive_doubling: return algo::recursive_doubling_all_reduce(g.size, g.rank, out.count);
      case Kind::rabenseifner: return algo::rabenseifner_all_reduce(g.size, g.rank, out.count);
      case Kind::tree: return algo::tree_all_reduce(g.size, g.rank, out.count);
      default: return algo::Plan{};
    }
  });
  const bool ring = algorithm.kind == Kind::ring || algorithm.kind == Kind::bidirectional_ring;
  if (ring && g.size > 1) {
    // The rings reduce every block once and write every block of `out`: out of place, they read this
    // rank's contribution straight from `in` (no staging copy).
    made.buffers.send = in.bytes_ptr();
    if (in.data != out.data) made.buffers.local = in.bytes_ptr();
    return made;
  }
  // The others run in place on `out`, sending what they have reduced so far. (A ring on one rank:
  // nothing to exchange, the copy is the result.)
  made.copy_first = true;
  return made;
}

Task<void> all_reduce_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, ReduceOp op,
                           const algo::Algorithm& algorithm, algo::StagedBuffers* staged) {
  if (staged && !pipelines(*g, detail::CollectiveCall{Collective::all_reduce, in, out, op}, algorithm)) {
    throw std::logic_error("weft: all_reduce was given staged buffers where it does not run one plan over them");
  }
  if (g->options.deterministic && g->size > 1) {
    co_await deterministic_all_reduce(g, seq, Collective::all_reduce, in, out, op, {out.count});
    co_return;
  }
  AllReducePlan made = all_reduce_plan(*g, in, out, op, algorithm);
  if (made.copy_first) copy_bytes(out.data, in.data, out.bytes());
  made.buffers.staged = staged;
  co_await g->run(*made.plan, seq, Collective::all_reduce, made.buffers, {out.count});
  algo::finish_reduction(op, out.data, out.count, out.dtype, g->size);
}

// The ring all_gather's plan (all_gather_task's last path, and its plan of whole messages).
std::shared_ptr<const algo::Plan> ring_all_gather_plan(GroupState& g, std::size_t count) {
  return g.plan_for({Collective::all_gather, algo::Kind::ring, count},
                    [&] { return algo::ring_all_gather(g.size, g.rank, algo::blocks_of(count, g.size), -1); });
}

Task<void> all_gather_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out,
                           const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::ring, Kind::bruck, Kind::recursive_doubling});
  const std::size_t block_bytes = in.bytes();
  const bool power_of_two = (g->size & (g->size - 1)) == 0;
  if (algorithm.kind == Kind::recursive_doubling && power_of_two && g->size > 1) {
    copy_bytes(out.bytes_ptr() + static_cast<std::size_t>(g->rank) * block_bytes, in.data, block_bytes);
    const auto plan = algo::recursive_doubling_all_gather(g->size, g->rank, in.count);
    co_await g->run(plan, seq, Collective::all_gather, algo::PlanBuffers{out.bytes_ptr(), out.bytes_ptr(), out.dtype, ReduceOp::sum}, {in.count});
    co_return;
  }
  // Bruck also serves recursive doubling on a non-power-of-two group (the same lg p rounds).
  if ((algorithm.kind == Kind::bruck || algorithm.kind == Kind::recursive_doubling) && g->size > 1) {
    // Bruck gathers into a rotated buffer (slot i holds rank r+i's block); rotate it into place.
    const auto p = static_cast<std::size_t>(g->size);
    auto rotated = scratch_bytes(p * block_bytes);
    copy_bytes(rotated.get(), in.data, block_bytes);
    const auto plan = algo::bruck_all_gather(g->size, g->rank, in.count);
    co_await g->run(plan, seq, Collective::all_gather, algo::PlanBuffers{rotated.get(), rotated.get(), out.dtype, ReduceOp::sum}, {in.count});
    blocks_from_slots(out.bytes_ptr(), rotated.get(), p, static_cast<std::size_t>(g->rank), block_bytes);
    co_return;
  }
  copy_bytes(out.bytes_ptr() + static_cast<std::size_t>(g->rank) * block_bytes, in.data, block_bytes);
  const auto plan = ring_all_gather_plan(*g, out.count);
  co_await g->run(*plan, seq, Collective::all_gather, algo::PlanBuffers{out.bytes_ptr(), out.bytes_ptr(), out.dtype, ReduceOp::sum}, {in.count});
}

// A (non-deterministic) reduce_scatter's plan over `work` (in.bytes() of scratch, at least one byte);
// this rank's block of `work` is the result. Recursive halving on a power of two accumulates into the
// same ranges round after round: it works on a copy of the input (`copy_first`). The ring (also where
// halving was asked for on a non-power-of-two group) reduces into `work`, reading this rank's
// contributions from `in`. (One rank has no ring: its input, copied, is the result.)
struct ReduceScatterPlan {
  std::shared_ptr<const algo::Plan> plan;
  algo::PlanBuffers buffers;
  bool copy_first = false;
};
ReduceScatterPlan reduce_scatter_plan(GroupState& g, ConstBufferView in, BufferView out, ReduceOp op,
                                      const algo::Algorithm& algorithm, std::byte* work) {
  using algo::Kind;
  require(algorithm, {Kind::ring, Kind::recursive_halving});
  const bool power_of_two = (g.size & (g.size - 1)) == 0;
  if (algorithm.kind == Kind::recursive_halving && power_of_two && g.size > 1) {
    return {g.plan_for({Collective::reduce_scatter, Kind::recursive_halving, in.count},
                       [&] { return algo::recursive_halving_reduce_scatter(g.size, g.rank, out.count); }),
            algo::PlanBuffers{work, work, out.dtype, op}, true};
  }
  return {g.plan_for({Collective::reduce_scatter, Kind::ring, in.count},
                     [&] { return algo::ring_reduce_scatter(g.size, g.rank, algo::blocks_of(in.count, g.size), -1); }),
          algo::PlanBuffers{in.bytes_ptr(), work, out.dtype, op, in.bytes_ptr()}, g.size == 1};
}

Task<void> reduce_scatter_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, ReduceOp op,
                               const algo::Algorithm& algorithm) {
  require(algorithm, {algo::Kind::ring, algo::Kind::recursive_halving});
  if (g->options.deterministic && g->size > 1) {
    const auto blocks = algo::blocks_of(in.count, g->size);
    co_await ordered_reduce(*g, seq, Collective::reduce_scatter, in.bytes_ptr(), blocks, out.bytes_ptr(), out.dtype, op, {out.count});
    algo::finish_reduction(op, out.data, out.count, out.dtype, g->size);
    co_return;
  }
  auto work = scratch_bytes(in.bytes());
  const ReduceScatterPlan made = reduce_scatter_plan(*g, in, out, op, algorithm, work.get());
  if (made.copy_first) copy_bytes(work.get(), in.data, in.bytes());
  co_await g->run(*made.plan, seq, Collective::reduce_scatter, made.buffers, {out.count});
  copy_bytes(out.data, work.get() + static_cast<std::size_t>(g->rank) * out.bytes(), out.bytes());
  algo::finish_reduction(op, out.data, out.count, out.dtype, g->size);
}

std::shared_ptr<const algo::Plan> broadcast_plan(GroupState& g, std::size_t count, int root, const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::binomial, Kind::scatter_all_gather, Kind::chain});
  return g.plan_for({Collective::broadcast, algorithm.kind, count, root}, [&] {
    return algorithm.kind == Kind::scatter_all_gather ? algo::scatter_all_gather_broadcast(g.size, g.rank, root, count)
           : algorithm.kind == Kind::chain            ? algo::chain_broadcast(g.size, g.rank, root, count)
                                                      : algo::binomial_broadcast(g.size, g.rank, root, count);
  });
}

Task<void> broadcast_task(std::shared_ptr<GroupState> g, std::uint64_t seq, BufferView data, int root,
                          const algo::Algorithm& algorithm, algo::StagedBuffers* staged) {
  const auto plan = broadcast_plan(*g, data.count, root, algorithm);
  algo::PlanBuffers buffers{data.bytes_ptr(), data.bytes_ptr(), data.dtype, ReduceOp::sum};
  buffers.staged = staged;
  co_await g->run(*plan, seq, Collective::broadcast, buffers, {data.count, root});
}

Task<void> reduce_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, int root, ReduceOp op,
                       const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::binomial, Kind::reduce_scatter_gather});
  if (g->options.deterministic && g->size > 1) {
    // Every rank computes the rank-order result; only the root keeps it.
    ScratchBytes scratch;
    BufferView result = out;
    if (g->rank != root) {
      scratch = scratch_bytes(in.bytes());
      result = BufferView(scratch.get(), in.count, in.dtype);
    }
    co_await deterministic_all_reduce(g, seq, Collective::reduce, in, result, op, {in.count, root});
    co_return;
  }
  ScratchBytes scratch;
  std::byte* work = out.bytes_ptr();
  if (g->rank != root) {
    scratch = scratch_bytes(in.bytes());
    work = scratch.get();
  }
  copy_bytes(work, in.data, in.bytes());
  const auto plan = algorithm.kind == Kind::reduce_scatter_gather ? algo::reduce_scatter_gather_reduce(g->size, g->rank, root, in.count)
                                                                  : algo::binomial_reduce(g->size, g->rank, root, in.count);
  co_await g->run(plan, seq, Collective::reduce, algo::PlanBuffers{work, work, in.dtype, op}, {in.count, root});
  if (g->rank == root) algo::finish_reduction(op, out.data, out.count, out.dtype, g->size);
}

Task<void> gather_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, int root,
                       const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::direct, Kind::binomial});
  const std::size_t block_bytes = in.bytes();
  const auto p = static_cast<std::size_t>(g->size);
  if (algorithm.kind == Kind::binomial && g->size > 1) {
    // Blocks travel in virtual order (slot i: rank root + r' + i), own block first; the root rotates.
    const auto plan = algo::binomial_gather(g->size, g->rank, root, in.count);
    auto staging = slots_for(plan, in.count, in.dtype);
    copy_bytes(staging.get(), in.data, block_bytes);
    co_await g->run(plan, seq, Collective::gather, algo::PlanBuffers{staging.get(), staging.get(), in.dtype, ReduceOp::sum}, {in.count, root});
    if (g->rank == root) blocks_from_slots(out.bytes_ptr(), staging.get(), p, static_cast<std::size_t>(root), block_bytes);
    co_return;
  }
  if (g->rank == root) copy_bytes(out.bytes_ptr() + static_cast<std::size_t>(root) * in.bytes(), in.data, in.bytes());
  const auto plan = algo::direct_gather(g->size, g->rank, root, in.count);
  co_await g->run(plan, seq, Collective::gather,
                  algo::PlanBuffers{in.bytes_ptr(), g->rank == root ? out.bytes_ptr() : nullptr, in.dtype, ReduceOp::sum},
                  {in.count, root});
}

Task<void> scatter_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out, int root,
                        const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::direct, Kind::binomial});
  const std::size_t block_bytes = out.bytes();
  const auto p = static_cast<std::size_t>(g->size);
  if (algorithm.kind == Kind::binomial && g->size > 1) {
    const auto plan = algo::binomial_scatter(g->size, g->rank, root, out.count);
    auto staging = slots_for(plan, out.count, out.dtype);
    if (g->rank == root) slots_from_blocks(staging.get(), in.bytes_ptr(), p, static_cast<std::size_t>(root), block_bytes);
    co_await g->run(plan, seq, Collective::scatter, algo::PlanBuffers{staging.get(), staging.get(), out.dtype, ReduceOp::sum}, {out.count, root});
    copy_bytes(out.data, staging.get(), block_bytes);
    co_return;
  }
  if (g->rank == root) copy_bytes(out.data, in.bytes_ptr() + static_cast<std::size_t>(root) * out.bytes(), out.bytes());
  const auto plan = algo::direct_scatter(g->size, g->rank, root, out.count);
  co_await g->run(plan, seq, Collective::scatter,
                  algo::PlanBuffers{g->rank == root ? in.bytes_ptr() : nullptr, out.bytes_ptr(), out.dtype, ReduceOp::sum},
                  {out.count, root});
}

// The pairwise exchange as whole messages (start_as_messages): every send first, then the receives in the
// exchange's order. The executor posts the exchanges of the pairwise plan at once too (none sends what
// another receives); MessagePlan awaits each receive before its next step, so the sends go first here.
std::shared_ptr<const algo::Plan> all_to_all_message_plan(GroupState& g, std::size_t block) {
  return g.plan_for({Collective::all_to_all, algo::Kind::pairwise, block}, [&] {
    const algo::Plan exchanges = algo::pairwise_all_to_all(g.size, g.rank, block);
    algo::Plan plan;
    for (const algo::Step& s : exchanges) plan.push_back(algo::Step{algo::StepKind::send, s.send_to, -1, s.send, {}});
    for (const algo::Step& s : exchanges) plan.push_back(algo::Step{algo::StepKind::recv, -1, s.recv_from, {}, s.recv});
    return plan;
  });
}

Task<void> all_to_all_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out,
                           const algo::Algorithm& algorithm) {
  using algo::Kind;
  require(algorithm, {Kind::pairwise, Kind::bruck});
  const std::size_t block = in.count / static_cast<std::size_t>(g->size);
  const std::size_t block_bytes = block * dtype_size(in.dtype);
  if (algorithm.kind == Kind::bruck && g->size > 1) {
    // Rotate in (slot i: the block for rank r+i), run, rotate out (slot i came from rank r-i).
    const auto p = static_cast<std::size_t>(g->size);
    const auto r = static_cast<std::size_t>(g->rank);
    auto slots = scratch_bytes(p * block_bytes);
    slots_from_blocks(slots.get(), in.bytes_ptr(), p, r, block_bytes);
    const auto plan = algo::bruck_all_to_all(g->size, g->rank, block);
    co_await g->run(plan, seq, Collective::all_to_all, algo::PlanBuffers{slots.get(), slots.get(), in.dtype, ReduceOp::sum}, {in.count});
    blocks_from_slots(out.bytes_ptr(), slots.get(), p, r, block_bytes, Turn::down);
    co_return;
  }
  ScratchBytes copy;
  const std::byte* source = in.bytes_ptr();
  if (in.data == out.data && in.bytes()) {  // in place: send from a copy
    copy = scratch_bytes(in.bytes());
    std::memcpy(copy.get(), in.data, in.bytes());
    source = copy.get();
  }
  copy_bytes(out.bytes_ptr() + static_cast<std::size_t>(g->rank) * block_bytes,
             source + static_cast<std::size_t>(g->rank) * block_bytes, block_bytes);
  const auto plan = algo::pairwise_all_to_all(g->size, g->rank, block);
  co_await g->run(plan, seq, Collective::all_to_all, algo::PlanBuffers{source, out.bytes_ptr(), in.dtype, ReduceOp::sum}, {in.count});
}

std::shared_ptr<const algo::Plan> barrier_plan(GroupState& g, const algo::Algorithm& algorithm) {
  require(algorithm, {algo::Kind::dissemination});
  return g.plan_for({Collective::barrier, algorithm.kind}, [&] { return algo::dissemination_barrier(g.size, g.rank); });
}

Task<void> barrier_task(std::shared_ptr<GroupState> g, std::uint64_t seq, const algo::Algorithm& algorithm) {
  const auto plan = barrier_plan(*g, algorithm);
  co_await g->run(*plan, seq, Collective::barrier, algo::PlanBuffers{nullptr, nullptr, DType::u8, ReduceOp::sum}, {});
}

// What a collective's task does around its plan, done by MessagePlanOp too: a copy of the input into the
// buffer the plan runs over (on the loop's thread, when the plan starts, as the task does), and once the
// plan succeeded a copy of the result out of it (reduce_scatter's block) and the reduction's last step
// (avg's division).
struct AroundPlan {
  std::byte* copy_to = nullptr;
  const std::byte* copy_from = nullptr;
  std::size_t copy_bytes = 0;
  ScratchBytes work;  // the buffer the plan runs over, when it is neither the input nor the output
  std::byte* copy_out_to = nullptr;
  const std::byte* copy_out_from = nullptr;
  std::size_t copy_out_bytes = 0;
  bool finish_reduction = false;
  BufferView reduced{};
  ReduceOp op = ReduceOp::sum;
};

// A collective whose task is one plan of whole messages over the caller's buffers, run as its Future's
// state without a coroutine (algorithms/messages.hpp says why): one allocation for the state and one for
// the plan (and reduce_scatter's work buffer, as its task has). What GroupState::run does around a plan run is done here too: the watchdog watches the seq,
// a failure other than a cancellation fails the group, and cancel() cancels the operation on every member.
class MessagePlanOp final : public FutureState<void> {
 public:
  static Future<void> start(std::shared_ptr<GroupState> g, std::uint64_t seq, const char* name, OpSignature signature,
                            std::shared_ptr<const algo::Plan> plan, algo::PlanBuffers buffers, AroundPlan around) {
    const bool sends_only = std::all_of(plan->begin(), plan->end(), [](const algo::Step& s) { return s.kind == algo::StepKind::send; });
    // A plan that only sends (a broadcast's root) starts on this thread when the loop's thread is parked
    // (Loop::run_here, as a send does): its messages usually leave whole, and its Future is done before
    // the call returns (2-rank broadcast, 8 B-2 KiB: 0.94-0.97 of the old path's time against 0.95-0.98
    // posted, bench/RESULTS.md "Plans of whole messages"). Where the transport takes every message at
    // once (MessagePlan::send_now) there is no operation at all (bench/RESULTS.md, "Sends over tcp
    // without an operation"). Others are posted, as the collectives' tasks are (bench/RESULTS.md,
    // "Starting on the caller's thread": a collective that waits, started here, cost the loop more
    // wake-ups than it saved).
    if (sends_only) {
      Loop& loop = *g->loop;
      SendingNow now{&g, seq, name, signature, &plan, buffers, &around, {}};
      if (loop.in_loop_thread()) {
        send_here(&now);
        return std::move(now.result);
      }
      if (loop.run_here(&MessagePlanOp::send_here, &now)) return std::move(now.result);
    }
    auto op = make(std::move(g), seq, name, signature, std::move(plan), buffers, std::move(around));
    if (op->g_->loop->in_loop_thread()) {
      op->begin(op);
    } else {
      // self_ keeps it alive until then, and a plain pointer fits inside the posted std::function
      // without an allocation.
      op->self_ = op;
      op->g_->loop->post([raw = op.get()] { raw->begin(std::move(raw->self_)); });
    }
    return Future<void>(std::move(op));
  }

  MessagePlanOp(std::shared_ptr<GroupState> g, std::uint64_t seq, const char* name, OpSignature signature,
                std::shared_ptr<const algo::Plan> plan, algo::PlanBuffers buffers)
      : g_(std::move(g)), seq_(seq), name_(name),
        run_(g_->channel(seq, name, signature, 0), std::move(plan), buffers, &MessagePlanOp::done, this) {}

 private:
  // Future::cancel(), on any thread, once, while the Future holds the operation. The weak_ptr is made
  // here, from the canceller's reference, as P2pOp's (p2p.cpp): not kept in every operation.
  static void on_cancel(const std::shared_ptr<FutureStateBase>& owner) noexcept {
    const auto op = std::static_pointer_cast<MessagePlanOp>(owner);
    op->g_->loop->post([weak = std::weak_ptr<MessagePlanOp>(op)] {
      if (auto op = weak.lock(); op && !op->run_.finished()) op->run_.cancel();
    });
  }

  static std::shared_ptr<MessagePlanOp> make(std::shared_ptr<GroupState> g, std::uint64_t seq, const char* name, OpSignature signature,
                                             std::shared_ptr<const algo::Plan> plan, algo::PlanBuffers buffers, AroundPlan around) {
    auto op = std::allocate_shared<MessagePlanOp>(PooledAllocator<MessagePlanOp>{}, std::move(g), seq, name, signature, std::move(plan), buffers);
    op->around_ = std::move(around);
    op->set_loop(op->g_->loop);
    op->set_cancel_hook(&MessagePlanOp::on_cancel);
    return op;
  }

  // What follows a plan that succeeded: the result copied out, the reduction's last step.
  static void finish_around(const GroupState& g, const AroundPlan& around) {
    copy_bytes(around.copy_out_to, around.copy_out_from, around.copy_out_bytes);
    if (around.finish_reduction) algo::finish_reduction(around.op, around.reduced.data, around.reduced.count, around.reduced.dtype, g.size);
  }

  // A plan that only sends, started on the loop's thread (its own, or borrowed): its messages sent at
  // once where the transport takes them all (no operation, a ready Future), else an operation that
  // begins here, after the messages that did go.
  struct SendingNow {
    std::shared_ptr<GroupState>* g;
    std::uint64_t seq;
    const char* name;
    OpSignature signature;
    std::shared_ptr<const algo::Plan>* plan;
    algo::PlanBuffers buffers;
    AroundPlan* around;
    Future<void> result;
  };
  static void send_here(void* arg) {
    auto& now = *static_cast<SendingNow*>(arg);
    GroupState& g = **now.g;
    copy_bytes(now.around->copy_to, now.around->copy_from, now.around->copy_bytes);
    const algo::Plan& plan = **now.plan;
    const std::size_t sent = algo::MessagePlan::send_now(g.channel(now.seq, now.name, now.signature, 0), plan, now.buffers);
    if (sent == plan.size()) {
      finish_around(g, *now.around);
      now.result = make_ready_future();
      return;
    }
    now.around->copy_bytes = 0;  // done above
    auto op = make(std::move(*now.g), now.seq, now.name, now.signature, std::move(*now.plan), now.buffers, std::move(*now.around));
    op->begin(op, sent);
    now.result = Future<void>(std::move(op));
  }

  // Loop thread. self_ keeps the operation alive until its plan is done, `self` until this returns.
  // `sent_already`: the plan's first messages, which send_here sent.
  void begin(std::shared_ptr<MessagePlanOp> self, std::size_t sent_already = 0) {
    g_->loop->operation_started();
    g_->watch(seq_, name_);
    self_ = self;
    copy_bytes(around_.copy_to, around_.copy_from, around_.copy_bytes);
    run_.start(sent_already);
  }

  // The plan run is done (loop thread).
  static void done(void* context) noexcept {
    auto* op = static_cast<MessagePlanOp*>(context);
    const std::shared_ptr<MessagePlanOp> keep = std::move(op->self_);  // this may be its last owner
    GroupState& g = *op->g_;
    g.unwatch(op->seq_);
    if (std::exception_ptr failure = op->run_.failure()) {
      try {
        std::rethrow_exception(failure);
      } catch (const Error& e) {
        // A cancelled operation was cancelled on every member (a cancel frame): the group goes on.
        if (e.errc() != Errc::cancelled) g.mark_failed(e.what());
      } catch (...) {
      }
      op->set_error(std::move(failure));
    } else {
      finish_around(g, op->around_);
    }
    g.loop->operation_finished();
    op->finish();
  }

  std::shared_ptr<GroupState> g_;
  std::uint64_t seq_;
  const char* name_;
  AroundPlan around_;
  // Loop thread only.
  algo::MessagePlan run_;
  std::shared_ptr<MessagePlanOp> self_;
};

// `call` as a plan of whole messages (broadcast, the barrier, all_reduce, reduce_scatter, the ring
// all_gather and the pairwise all_to_all: their tasks are that plan, with copies before and after and
// avg's division), or an invalid Future when it is not one (another collective, another algorithm, a
// message past one segment, a deterministic reduction).
Future<void> start_as_messages(const std::shared_ptr<GroupState>& g, std::uint64_t seq, const detail::CollectiveCall& call,
                               const algo::Algorithm& algorithm) {
  if (call.staged || algorithm.kind == algo::Kind::shm) return {};
  std::shared_ptr<const algo::Plan> plan;
  algo::PlanBuffers buffers;
  GroupState::Call shape;
  AroundPlan around;
  switch (call.collective) {
    case Collective::all_reduce: {
      if (g->options.deterministic && g->size > 1) return {};
      AllReducePlan made = all_reduce_plan(*g, call.in, call.out, call.op, algorithm);
      plan = std::move(made.plan);
      buffers = made.buffers;
      shape = {call.out.count};
      if (made.copy_first) {
        around.copy_to = call.out.bytes_ptr();
        around.copy_from = call.in.bytes_ptr();
        around.copy_bytes = call.out.bytes();
      }
      break;
    }
    case Collective::reduce_scatter: {
      // reduce_scatter_task's plan, on more than one rank, over a work buffer the operation owns.
      if (g->options.deterministic || g->size == 1) return {};
      // Each step of either plan moves at least a block: past one segment it cannot fit (spares the allocation).
      if (call.out.bytes() > g->options.segment_bytes) return {};
      around.work = scratch_bytes(call.in.bytes());
      std::byte* work = around.work.get();
      ReduceScatterPlan made = reduce_scatter_plan(*g, call.in, call.out, call.op, algorithm, work);
      plan = std::move(made.plan);
      buffers = made.buffers;
      shape = {call.out.count};
      if (made.copy_first) {
        around.copy_to = work;
        around.copy_from = call.in.bytes_ptr();
        around.copy_bytes = call.in.bytes();
      }
      around.copy_out_to = call.out.bytes_ptr();
      around.copy_out_from = work + static_cast<std::size_t>(g->rank) * call.out.bytes();
      around.copy_out_bytes = call.out.bytes();
      break;
    }
    case Collective::all_gather: {
      // The ring's (all_gather_task's last path): this rank's block copied into place, then p - 1
      // exchanges of one block each.
      if (algorithm.kind != algo::Kind::ring || g->size == 1) return {};
      const std::size_t block_bytes = call.in.bytes();
      plan = ring_all_gather_plan(*g, call.out.count);
      buffers = algo::PlanBuffers{call.out.bytes_ptr(), call.out.bytes_ptr(), call.out.dtype, ReduceOp::sum};
      shape = {call.in.count};
      around.copy_to = call.out.bytes_ptr() + static_cast<std::size_t>(g->rank) * block_bytes;
      around.copy_from = call.in.bytes_ptr();
      around.copy_bytes = block_bytes;
      break;
    }
    case Collective::broadcast:
      plan = broadcast_plan(*g, call.out.count, call.root, algorithm);
      buffers = algo::PlanBuffers{call.out.bytes_ptr(), call.out.bytes_ptr(), call.out.dtype, ReduceOp::sum};
      shape = {call.out.count, call.root};
      break;
    case Collective::all_to_all: {
      // all_to_all_task's pairwise path: this rank's own block copied, and one message to and from each
      // peer. In place (or sharing bytes at all) the sends read a copy of the input, a work buffer the
      // operation owns, and the own block comes out of it once the receives landed.
      if (algorithm.kind != algo::Kind::pairwise || g->size == 1) return {};
      const std::size_t block = call.in.count / static_cast<std::size_t>(g->size);
      const std::size_t block_bytes = block * dtype_size(call.in.dtype);
      // A message per block each way: past one segment, or past MessagePlan's count, it cannot fit (spares
      // the allocation below, and a plan that would only take a slot of the group's plan cache).
      const auto messages = 2 * static_cast<std::size_t>(g->size - 1);
      if (block_bytes > g->options.segment_bytes || messages > algo::MessagePlan::most_messages) return {};
      const std::size_t own = static_cast<std::size_t>(g->rank) * block_bytes;  // this rank's block, in bytes
      plan = all_to_all_message_plan(*g, block);
      const std::byte* source = call.in.bytes_ptr();
      if (share_bytes(call.in, call.out)) {
        around.work = scratch_bytes(call.in.bytes());
        around.copy_to = around.work.get();
        around.copy_from = call.in.bytes_ptr();
        around.copy_bytes = call.in.bytes();
        around.copy_out_to = call.out.bytes_ptr() + own;
        around.copy_out_from = around.work.get() + own;
        around.copy_out_bytes = block_bytes;
        source = around.work.get();
      } else {
        around.copy_to = call.out.bytes_ptr() + own;
        around.copy_from = call.in.bytes_ptr() + own;
        around.copy_bytes = block_bytes;
      }
      buffers = algo::PlanBuffers{source, call.out.bytes_ptr(), call.in.dtype, ReduceOp::sum};
      shape = {call.in.count};
      break;
    }
    case Collective::barrier:
      plan = barrier_plan(*g, algorithm);
      buffers = algo::PlanBuffers{nullptr, nullptr, DType::u8, ReduceOp::sum};
      break;
    default: return {};
  }
  if (!algo::MessagePlan::fits(*plan, buffers, g->exec_options())) return {};
  if (call.collective == Collective::all_reduce || call.collective == Collective::reduce_scatter) {
    around.finish_reduction = true;  // the reduction's last step (avg's division), into `out`
    around.reduced = call.out;
    around.op = call.op;
  }
  const char* name = to_string(call.collective).data();
  return MessagePlanOp::start(g, seq, name, g->signed_by(signature::of(call.collective, buffers.dtype, buffers.op, shape.count, shape.root), seq),
                              std::move(plan), buffers, std::move(around));
}

Task<void> permute_task(std::shared_ptr<GroupState> g, std::uint64_t seq, ConstBufferView in, BufferView out,
                        std::vector<std::pair<int, int>> pairs) {
  int send_to = -1;
  int recv_from = -1;
  for (auto [src, dst] : pairs) {
    if (src == g->rank) send_to = dst;
    if (dst == g->rank) recv_from = src;
  }
  ScratchBytes copy;
  const std::byte* source = in.bytes_ptr();
  // Sharing bytes with the output at all (in place, or a partial overlap): send from a copy.
  if (share_bytes(in, out) && send_to >= 0) {
    copy = scratch_bytes(in.bytes());
    std::memcpy(copy.get(), in.data, in.bytes());
    source = copy.get();
  }
  algo::Plan plan;
  const algo::Range all{0, in.count};
  if (send_to == g->rank) {
    copy_bytes(out.data, source, out.bytes());
  } else {
    if (recv_from < 0 && out.bytes()) std::memset(out.data, 0, out.bytes());
    if (send_to >= 0 && recv_from >= 0) {
      plan.push_back(algo::Step{algo::StepKind::send_recv, send_to, recv_from, all, all});
    } else if (send_to >= 0) {
      plan.push_back(algo::Step{algo::StepKind::send, send_to, -1, all, {}});
    } else if (recv_from >= 0) {
      plan.push_back(algo::Step{algo::StepKind::recv, -1, recv_from, {}, all});
    }
  }
  co_await g->run(plan, seq, Collective::permute, algo::PlanBuffers{source, out.bytes_ptr(), in.dtype, ReduceOp::sum}, {in.count});
}

// ---------------------------------------------------------------- the submit path

// What each buffer collective requires of its call: one row per collective, read by validate() and
// selection_bytes(), so that the public methods hold no checks of their own.
struct Rule {
  enum class Counts : std::uint8_t {
    none,          // no buffers (barrier)
    one_buffer,    // in and out are one buffer ("data": broadcast)
    equal,         // out has in's count
    out_is_p_in,   // out holds a block per rank of in's count (all_gather, gather)
    in_is_p_out,   // in holds a block per rank of out's count (reduce_scatter, scatter)
    blocks,        // a count per rank: the call's BlockLayout (group/variable.hpp)
  };
  enum class Size : std::uint8_t { out, in, p_in, p_out, blocks };  // the bytes the algorithm is chosen by
  Counts counts;
  Size size;
  bool root = false;            // takes a root
  bool input_root_only = false;   // only the root's input is read (scatter)
  bool output_root_only = false;  // only the root's output is written (reduce, gather)
  bool equal_blocks = false;      // the count splits into size() equal blocks (all_to_all)
};

const Rule& rule_of(Collective c) {
  using C = Rule::Counts;
  using S = Rule::Size;
  static const Rule all_reduce{C::equal, S::out};
  static const Rule all_gather{C::out_is_p_in, S::out};
  static const Rule reduce_scatter{C::in_is_p_out, S::in};
  static const Rule broadcast{C::one_buffer, S::out, true};
  static const Rule reduce{C::equal, S::in, true, false, true};
  static const Rule gather{C::out_is_p_in, S::p_in, true, false, true};
  static const Rule scatter{C::in_is_p_out, S::p_out, true, true, false};
  static const Rule all_to_all{C::equal, S::in, false, false, false, true};
  static const Rule barrier{C::none, S::in};
  static const Rule all_gatherv{C::blocks, S::blocks};
  static const Rule gatherv{C::blocks, S::blocks, true, false, true};
  static const Rule scatterv{C::blocks, S::blocks, true, true, false};
  static const Rule all_to_allv{C::blocks, S::blocks};
  static const Rule reduce_scatterv{C::blocks, S::blocks};
  switch (c) {
    case Collective::all_reduce: return all_reduce;
    case Collective::all_gather: return all_gather;
    case Collective::reduce_scatter: return reduce_scatter;
    case Collective::broadcast: return broadcast;
    case Collective::reduce: return reduce;
    case Collective::gather: return gather;
    case Collective::scatter: return scatter;
    case Collective::all_to_all: return all_to_all;
    case Collective::barrier: return barrier;
    case Collective::all_gatherv: return all_gatherv;
    case Collective::gatherv: return gatherv;
    case Collective::scatterv: return scatterv;
    case Collective::all_to_allv: return all_to_allv;
    case Collective::reduce_scatterv: return reduce_scatterv;
    case Collective::permute:
    case Collective::split: break;
  }
  throw std::logic_error(fmt::format("weft: {} does not go through the submit path", to_string(c)));
}

// The preconditions of `call` on this rank, from its collective's rule. Errors: weft::Error
// (invalid_argument) naming the operation, before anything is sent.
void validate(GroupState& g, const detail::CollectiveCall& call) {
  const char* name = to_string(call.collective).data();
  const Rule& rule = rule_of(call.collective);
  if (rule.root) check_rank(g, name, "root", call.root);
  if (rule.counts == Rule::Counts::none) return;
  if (rule.counts == Rule::Counts::one_buffer) {
    check_buffer(g, name, "data", call.out.data, call.out.count, call.out.dtype, call.out.device);
    return;
  }
  const bool root_here = g.rank == call.root;
  const bool input_here = !rule.input_root_only || root_here;
  const bool output_here = !rule.output_root_only || root_here;
  if (input_here) check_buffer(g, name, "input", call.in.data, call.in.count, call.in.dtype, call.in.device);
  if (reduces(call.collective)) check_op(g, name, call.in.dtype, call.op);
  if (output_here) check_buffer(g, name, "output", call.out.data, call.out.count, call.out.dtype, call.out.device);
  if (input_here && output_here) check_same_type(g, name, call.in.dtype, call.out.dtype);
  if (rule.counts == Rule::Counts::blocks) {
    check_blocks(g, name, call, input_here, output_here);
    return;
  }
  if (!input_here || !output_here) return;  // a rank that uses one of the buffers: nothing to compare
  switch (rule.counts) {
    case Rule::Counts::equal: check_count(g, name, "output", call.out.count, call.in.count); break;
    case Rule::Counts::out_is_p_in: check_count(g, name, "output", call.out.count, per_rank_total(g, name, call.in.count)); break;
    case Rule::Counts::in_is_p_out: check_count(g, name, "input", call.in.count, per_rank_total(g, name, call.out.count)); break;
    case Rule::Counts::none:
    case Rule::Counts::one_buffer:
    case Rule::Counts::blocks: break;
  }
  if (rule.equal_blocks && call.in.count % static_cast<std::size_t>(g.size) != 0) {
    invalid(g, name, fmt::format("{} elements do not split into {} equal blocks", call.in.count, g.size));
  }
}

// Where `in` must start for `call` to run in place, as a byte offset from `out` (negative: `out`
// starts inside `in`): the one layout of each collective whose input and output may share bytes.
// None (nullopt) for the collectives that have no in-place form.
std::optional<std::ptrdiff_t> in_place_offset(const GroupState& g, const detail::CollectiveCall& call) {
  const auto r = static_cast<std::size_t>(g.rank);
  const std::size_t esize = dtype_size(call.out.dtype);
  const auto bytes = [](std::size_t n) { return static_cast<std::ptrdiff_t>(n); };
  switch (call.collective) {
    case Collective::all_reduce:
    case Collective::reduce:
    case Collective::all_to_all:
    case Collective::all_to_allv: return 0;
    case Collective::all_gather:
    case Collective::gather: return bytes(r * call.in.bytes());  // in is this rank's block of out
    case Collective::reduce_scatter:
    case Collective::scatter: return -bytes(r * call.out.bytes());  // out is this rank's block of in
    case Collective::all_gatherv:
    case Collective::gatherv:
      if (!call.blocks || r >= call.blocks->out.size()) break;
      return bytes(call.blocks->out[r].offset * esize);
    case Collective::scatterv:
    case Collective::reduce_scatterv:
      if (!call.blocks || r >= call.blocks->in.size()) break;
      return -bytes(call.blocks->in[r].offset * esize);
    case Collective::broadcast:
    case Collective::barrier:
    case Collective::permute:
    case Collective::split: break;
  }
  return std::nullopt;
}

// An input and an output that share bytes other than in their collective's in-place layout: the
// algorithms read the input while they write the output, so such a call would give wrong results
// without a word (an all_to_all whose output starts one block into its input did). Checked on every
// call, not remembered with the shape: it depends on where the buffers are.
void check_overlap(GroupState& g, const detail::CollectiveCall& call) {
  const Rule& rule = rule_of(call.collective);
  if (rule.counts == Rule::Counts::none || rule.counts == Rule::Counts::one_buffer) return;
  if (call.in.device != call.out.device || !share_bytes(call.in, call.out)) return;
  const bool root_here = g.rank == call.root;
  if ((rule.input_root_only && !root_here) || (rule.output_root_only && !root_here)) return;
  const std::ptrdiff_t offset =
      static_cast<std::ptrdiff_t>(reinterpret_cast<std::uintptr_t>(call.in.data) - reinterpret_cast<std::uintptr_t>(call.out.data));
  const std::optional<std::ptrdiff_t> allowed = in_place_offset(g, call);
  if (allowed && offset == *allowed) return;
  const char* name = to_string(call.collective).data();
  std::string layout = "it has no in-place form";
  if (allowed) {
    layout = *allowed == 0 ? std::string("in place, input and output start at the same address")
             : *allowed > 0 ? fmt::format("in place, the input starts {} bytes into the output (this rank's block)", *allowed)
                            : fmt::format("in place, the output starts {} bytes into the input (this rank's block)", -*allowed);
  }
  invalid(g, name, fmt::format("the input ({} bytes) and the output ({} bytes) overlap, the input starting {} bytes {} the output; "
                               "{}: pass that layout or buffers apart",
                               call.in.bytes(), call.out.bytes(), offset < 0 ? -offset : offset, offset < 0 ? "before" : "after", layout));
}

// The bytes the selection table looks at for `call`.
std::size_t selection_bytes(const GroupState& g, const detail::CollectiveCall& call) {
  const auto p = static_cast<std::size_t>(g.size);
  switch (rule_of(call.collective).size) {
    case Rule::Size::out: return call.out.bytes();
    case Rule::Size::in: return call.in.bytes();
    case Rule::Size::p_in: return call.in.bytes() * p;
    case Rule::Size::p_out: return call.out.bytes() * p;
    // (scatterv's input is the root's only: the output's dtype is the one every rank has.)
    case Rule::Size::blocks: {
      // all_gatherv is chosen by the bytes its Bruck would move (every block padded to the largest), so
      // that skewed counts, which padding would multiply, go to the ring.
      const std::size_t elements = call.collective == Collective::all_gatherv ? call.blocks->padded : call.blocks->total;
      return elements * dtype_size(rule_of(call.collective).input_root_only ? call.out.dtype : call.in.dtype);
    }
  }
  return 0;
}

// What validate() and the selection read of a call: everything but where its buffers are (only whether
// they are null). A loop calls the same few shapes again and again, and checking them and choosing
// again cost a fifth of a small collective on the group arena (about 350 of 1,450 instructions per
// 8 B all_reduce in Group::submit, bench/RESULTS.md).
struct CallShape {
  Collective collective;
  ReduceOp op;
  int root;
  std::size_t in_count, out_count;
  DType in_dtype, out_dtype;
  Device in_device, out_device;
  bool in_null, out_null;
  friend bool operator==(const CallShape&, const CallShape&) = default;
};

CallShape shape_of(const detail::CollectiveCall& call) {
  return {call.collective, call.op,           call.root,         call.in.count,           call.out.count,
          call.in.dtype,   call.out.dtype,    call.in.device,    call.out.device,          call.in.data == nullptr,
          call.out.data == nullptr};
}

// This thread's last call that passed validate(), and the algorithm chosen for it: per thread, so that
// callers on several threads need no lock; keyed by the group's id (never reused) and the selection's
// version (override_algorithms moves it).
struct LastCall {
  std::uint64_t group = 0;
  std::uint64_t selection_version = 0;
  CallShape shape{};
  const algo::Algorithm* algorithm = nullptr;
};
thread_local LastCall last_call;

Task<void> start_collective(std::shared_ptr<GroupState> g, std::uint64_t seq, const detail::CollectiveCall& call,
                            const algo::Algorithm& algorithm);

// A direct shm algorithm: on the group arena, or (no arena, or the group left it) the built-in choice
// over the transport.
Task<void> on_arena_or_framed(std::shared_ptr<GroupState> g, std::uint64_t seq, detail::CollectiveCall call, ArenaTicket ticket,
                              std::uint32_t published, bool failed_at_call) {
  const bool ran = co_await run_on_arena(g, seq, call, std::move(ticket), published, failed_at_call);
  if (ran) co_return;
  const algo::Algorithm& framed = *algo::Selection::built_in(call.collective, selection_bytes(*g, call), g->size);
  co_await start_collective(std::move(g), seq, call, framed);
}

// The task of `call`'s collective (not a coroutine: no frame of its own).
Task<void> start_collective(std::shared_ptr<GroupState> g, std::uint64_t seq, const detail::CollectiveCall& call,
                            const algo::Algorithm& algorithm) {
  if (algorithm.kind == algo::Kind::shm) {
    ArenaTicket ticket = g->arena ? ArenaTicket(*g) : ArenaTicket();
    const bool failed_at_call = arena_group_failed(*g);
    return on_arena_or_framed(std::move(g), seq, call, std::move(ticket), 0, failed_at_call);
  }
  switch (call.collective) {
    case Collective::all_reduce: return all_reduce_task(std::move(g), seq, call.in, call.out, call.op, algorithm, call.staged);
    case Collective::all_gather: return all_gather_task(std::move(g), seq, call.in, call.out, algorithm);
    case Collective::reduce_scatter: return reduce_scatter_task(std::move(g), seq, call.in, call.out, call.op, algorithm);
    case Collective::broadcast: return broadcast_task(std::move(g), seq, call.out, call.root, algorithm, call.staged);
    case Collective::reduce: return reduce_task(std::move(g), seq, call.in, call.out, call.root, call.op, algorithm);
    case Collective::gather: return gather_task(std::move(g), seq, call.in, call.out, call.root, algorithm);
    case Collective::scatter: return scatter_task(std::move(g), seq, call.in, call.out, call.root, algorithm);
    case Collective::all_to_all: return all_to_all_task(std::move(g), seq, call.in, call.out, algorithm);
    case Collective::barrier: return barrier_task(std::move(g), seq, algorithm);
    case Collective::all_gatherv:
    case Collective::gatherv:
    case Collective::scatterv:
    case Collective::all_to_allv:
    case Collective::reduce_scatterv: return variable_task(std::move(g), seq, call, algorithm);
    case Collective::permute:
    case Collective::split: break;
  }
  throw std::logic_error(fmt::format("weft: {} does not go through the submit path", to_string(call.collective)));
}

}  // namespace

const algo::Algorithm& detail::checked_algorithm(GroupState& g, const detail::CollectiveCall& call) {
  const bool memo = rule_of(call.collective).counts != Rule::Counts::blocks;
  CallShape shape{};
  if (memo) {
    shape = shape_of(call);
    LastCall& last = last_call;
    if (last.group == g.id && last.selection_version == g.selection.version() && last.shape == shape) {
      check_overlap(g, call);
      return *last.algorithm;
    }
  }
  validate(g, call);
  check_overlap(g, call);
  // Chosen on the caller's thread, where override_algorithms changes the table.
  const algo::Algorithm* algorithm = g.selection.choose(call.collective, selection_bytes(g, call), g.size, g.placement());
  if (memo) last_call = LastCall{g.id, g.selection.version(), shape, algorithm};
  return *algorithm;
}

Future<void> Group::all_reduce(BufferView data, ReduceOp op) { return all_reduce(ConstBufferView(data), data, op); }

Future<void> Group::all_reduce(ConstBufferView in, BufferView out, ReduceOp op) {
  return submit(detail::CollectiveCall{Collective::all_reduce, in, out, op});
}
Future<void> Group::all_gather(ConstBufferView in, BufferView out) {
  return submit(detail::CollectiveCall{Collective::all_gather, in, out});
}
Future<void> Group::reduce_scatter(ConstBufferView in, BufferView out, ReduceOp op) {
  return submit(detail::CollectiveCall{Collective::reduce_scatter, in, out, op});
}
Future<void> Group::broadcast(BufferView data, int root) {
  return submit(detail::CollectiveCall{Collective::broadcast, data, data, ReduceOp::sum, root});
}
Future<void> Group::reduce(ConstBufferView in, BufferView out, int root, ReduceOp op) {
  return submit(detail::CollectiveCall{Collective::reduce, in, out, op, root});
}
Future<void> Group::gather(ConstBufferView in, BufferView out, int root) {
  return submit(detail::CollectiveCall{Collective::gather, in, out, ReduceOp::sum, root});
}
Future<void> Group::scatter(ConstBufferView in, BufferView out, int root) {
  return submit(detail::CollectiveCall{Collective::scatter, in, out, ReduceOp::sum, root});
}
Future<void> Group::all_to_all(ConstBufferView in, BufferView out) {
  return submit(detail::CollectiveCall{Collective::all_to_all, in, out});
}

Future<void> Group::submit(const detail::CollectiveCall& call) {
  const char* name = to_string(call.collective).data();
  auto& g = live(name);
  check_usable(g, name);
  const algo::Algorithm& algorithm = checked_algorithm(g, call);
  if (takes_device_windows(g, call)) return run_on_device_windows(state_, stream_, call, timeout_);
  if (on_device(call.in.device, call.in.bytes()) || on_device(call.out.device, call.out.bytes())) {
    const Rule& rule = rule_of(call.collective);
    const bool root_here = g.rank == call.root;
    detail::StagedCall staged{name, call.in, call.out};
    staged.reads_in = !rule.input_root_only || root_here;
    staged.writes_out = !rule.output_root_only || root_here;
    if (call.collective == Collective::broadcast) {  // one buffer: the root's is read, the others' written
      staged.reads_in = root_here;
      staged.writes_out = !root_here;
    }
    staged.pipelined = pipelines(g, call, algorithm);
    return run_staged(state_, stream_, staged, timeout_,
                      [this, call, &algorithm](ConstBufferView in, BufferView out, std::uint64_t seq, algo::StagedBuffers* pieces) {
                        detail::CollectiveCall on_host = call;
                        on_host.in = in;
                        on_host.out = out;
                        on_host.staged = pieces;
                        state_->note_planned(seq, algorithm);
                        return start_collective(state_, seq, on_host, algorithm);
                      });
  }
  const std::uint64_t seq = take_seq(g, timeout_);
  if (algorithm.kind == algo::Kind::shm && g.arena) {
    // The arena's fast path: a small collective whose turn has come runs here, on this thread, signed
    // with its algorithm directly; what it leaves to the loop is noted first (GroupState::planned).
    ArenaTicket ticket(g);
    const bool failed_at_call = arena_group_failed(g);
    const ArenaNow now = run_on_arena_now(g, seq, call, ticket);
    if (now == ArenaNow::done) return make_ready_future();
    g.note_planned(seq, algorithm);
    return spawn(*g.loop, on_arena_or_framed(state_, seq, call, std::move(ticket), steps_published(now), failed_at_call));
  }
  g.note_planned(seq, algorithm);
  if (Future<void> messages = start_as_messages(state_, seq, call, algorithm); messages.valid()) return messages;
  return spawn(*g.loop, start_collective(state_, seq, call, algorithm));
}

Future<void> Group::barrier() { return submit(detail::CollectiveCall{Collective::barrier, {}, {}}); }

Future<void> Group::permute(ConstBufferView in, BufferView out, std::vector<std::pair<int, int>> pairs) {
  const char* name = "permute";
  auto& g = live(name);
  check_usable(g, name);
  check_buffer(g, name, "input", in.data, in.count, in.dtype, in.device);
  check_buffer(g, name, "output", out.data, out.count, out.dtype, out.device);
  check_same_type(g, name, in.dtype, out.dtype);
  check_count(g, name, "output", out.count, in.count);
  std::vector<int> sends(static_cast<std::size_t>(g.size), 0);
  std::vector<int> recvs(static_cast<std::size_t>(g.size), 0);
  for (auto [src, dst] : pairs) {
    check_rank(g, name, "source", src);
    check_rank(g, name, "destination", dst);
    if (++sends[static_cast<std::size_t>(src)] > 1) invalid(g, name, fmt::format("rank {} sends more than once", src), src);
    if (++recvs[static_cast<std::size_t>(dst)] > 1) invalid(g, name, fmt::format("rank {} receives more than once", dst), dst);
  }
  if (on_device(in.device, in.bytes()) || on_device(out.device, out.bytes())) {
    detail::StagedCall staged{name, in, out};
    staged.reads_in = std::any_of(pairs.begin(), pairs.end(), [&](const auto& pair) { return pair.first == g.rank; });
    return run_staged(state_, stream_, staged, timeout_, [this, pairs](ConstBufferView host_in, BufferView host_out, std::uint64_t seq, algo::StagedBuffers*) {
      return permute_task(state_, seq, host_in, host_out, pairs);
    });
  }
  return spawn(*g.loop, permute_task(state_, take_seq(g, timeout_), in, out, std::move(pairs)));
}

namespace {
Task<void> plan_task(std::shared_ptr<GroupState> g, std::uint64_t seq, algo::Plan plan, algo::PlanBuffers buffers,
                     const char* name) {
  co_await g->run_signed(plan, seq, name, signature::of_plan(buffers.dtype, buffers.op, 0), buffers);
}
}  // namespace

Future<void> Group::run_plan(algorithms::Plan plan, algorithms::PlanBuffers buffers, const char* name) {
  auto& g = live(name);
  check_usable(g, name);
  if (!is_valid(buffers.dtype)) invalid(g, name, fmt::format("the buffers' dtype {} is not a weft DType", static_cast<unsigned>(buffers.dtype)));
  // PlanBuffers carries no sizes, so a range is the caller's to fit in its buffer (as MPI's counts are);
  // what can be told is refused: a range past any memory (its end wrapped the pointer: [SIZE_MAX - 2, +4)
  // wrote 12 bytes before the buffer), a null buffer a range moves from or into, a kind that is no
  // StepKind (it hung both ranks).
  const std::size_t limit = max_buffer_bytes / dtype_size(buffers.dtype);
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const algo::Step& step = plan[i];
    if (static_cast<std::uint8_t>(step.kind) > static_cast<std::uint8_t>(algo::StepKind::send_recv_reduce)) {
      invalid(g, name, fmt::format("step {} has kind {}, which is no StepKind", i, static_cast<unsigned>(step.kind)));
    }
    const bool sends = step.kind != algo::StepKind::recv && step.kind != algo::StepKind::recv_reduce;
    const bool receives = step.kind != algo::StepKind::send;
    const bool forwards = step.kind == algo::StepKind::recv_reduce_send || step.kind == algo::StepKind::recv_copy_send;
    if (sends) check_rank(g, name, "send_to", step.send_to);
    if (receives) check_rank(g, name, "recv_from", step.recv_from);
    const bool reduces = step.kind == algo::StepKind::recv_reduce || step.kind == algo::StepKind::recv_reduce_send ||
                         step.kind == algo::StepKind::send_recv_reduce;
    if (reduces) check_op(g, name, buffers.dtype, buffers.op);
    const auto check_range = [&](const char* which, const algo::Range& range, const void* buffer, const char* buffer_name) {
      if (range.count == 0) return;
      if (range.offset > limit || range.count > limit - range.offset) {
        invalid(g, name, fmt::format("step {} ({}): its {} range [{}, +{}) of {} reaches past what memory can hold (2^47 bytes)", i,
                                     algo::to_string(step.kind), which, range.offset, range.count, to_string(buffers.dtype)));
      }
      if (buffer == nullptr) {
        invalid(g, name, fmt::format("step {} ({}) moves {} elements through {}, which is null", i, algo::to_string(step.kind),
                                     range.count, buffer_name));
      }
    };
    if (sends) check_range("send", step.send, forwards ? static_cast<const void*>(buffers.recv) : buffers.send, forwards ? "the receive buffer" : "the send buffer");
    if (receives) check_range("recv", step.recv, buffers.recv, "the receive buffer");
  }
  return spawn(*g.loop, plan_task(state_, take_seq(g, timeout_), std::move(plan), buffers, name));
}

}  // namespace weft
