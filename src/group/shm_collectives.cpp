// The direct shared-memory collectives (shm_collectives.hpp): one script per collective, each a
// sequence of supersteps on the group arena (write my area, publish, wait, read theirs). Large buffers
// go in chunks of one area. Every rank folds in rank order, so a reduction gives the same bits on every
// rank, and deterministic mode is met as it stands.
#include "group/shm_collectives.hpp"

#include <algorithm>
#include <cstring>
#include <functional>
#include <optional>
#include <stop_token>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "algorithms/reduction.hpp"
#include "core/signature.hpp"
#include "transports/shm/arena.hpp"
#include "weft/future.hpp"

namespace weft::detail {
namespace {

// all_reduce reduces every rank's whole chunk on every rank below this many bytes (one superstep a
// chunk); from it on, each rank reduces one block and the blocks are gathered (two supersteps, 1/p of
// the arithmetic). bench/RESULTS.md, "Direct shm collectives", has the measurements behind it.
constexpr std::size_t reduce_everywhere_below = std::size_t{256} << 10;

// What the stop callback and the arena's poller share with the operation.
struct Hook {
  bool finished = false;
  bool cancelled = false;
};

class ArenaRun final : public shm::Arena::Waiter {
 public:
  ArenaRun(GroupState& g, std::uint64_t seq, const char* op, OpSignature signature, std::shared_ptr<Hook> hook)
      : g_(g), arena_(*g.arena), seq_(seq), op_(op), signature_(signature), hook_(std::move(hook)) {}

  bool interrupted() override {
    if (hook_->cancelled || arena_.retired_peer(nullptr) >= 0 || g_.failed.load(std::memory_order_relaxed) ||
        g_.transport->context_failed(g_.context, nullptr, nullptr)) {
      return true;
    }
    // A rank that left the group normally (its Group closed) does not fail the context by itself: a
    // rank that waits on it must (the framed transport fails such a receive the same way).
    for (int r = 0; r < g_.size; ++r) {
      if (r != g_.rank && arena_.behind(r) && !g_.transport->connected(g_.members[static_cast<std::size_t>(r)])) {
        departed_ = r;
        return true;
      }
    }
    return false;
  }

  shm::Arena& arena() noexcept { return arena_; }
  std::byte* area() noexcept { return arena_.next_area(); }
  const std::byte* area_of(int r) const noexcept { return arena_.area(r); }

  /// Publishes this rank's area for step `step` and waits for every rank's; then checks that they all
  /// are in the same operation. Throws on anything else (interrupted: why; a mismatch).
  Task<void> step(std::uint32_t step) {
    shm::AreaHeader& mine = arena_.next_header();
    mine.seq = seq_;
    mine.count = signature_.count;
    mine.call = signature_.call;
    mine.step = step;
    arena_.publish();
    co_await arena_.until_reached(*this);
    if (!arena_.reached() || interrupted()) throw_interruption(step);
    check_headers(step);
  }

  /// Before the first step: whether the arena may still be used (false: the caller runs the framed
  /// algorithm). Throws when a rank left it in this very operation (it was cancelled).
  bool usable() {
    if (arena_.retired()) return false;
    std::uint64_t left_in = 0;
    const int who = arena_.retired_peer(&left_in);
    if (who < 0) return true;
    arena_.retire(left_in);
    if (left_in == seq_) throw_cancelled_by(who);
    return false;
  }

 private:
  [[noreturn]] void throw_cancelled_by(int who) const {
    throw_error(Errc::cancelled, g_.where(op_, static_cast<std::int64_t>(seq_), who),
                fmt::format("rank {} cancelled {} #{}", who, op_, seq_));
  }

  [[noreturn]] void throw_interruption(std::uint32_t step) {
    if (hook_->cancelled) {
      arena_.retire(seq_);
      throw_error(Errc::cancelled, g_.where(op_, static_cast<std::int64_t>(seq_)),
                  fmt::format("rank {} cancelled {} #{}", g_.rank, op_, seq_));
    }
    std::uint64_t left_in = 0;
    if (const int who = arena_.retired_peer(&left_in); who >= 0) {
      arena_.retire(left_in);
      // A rank that left in an earlier collective never published this one's first step, so only there
      // can the framed algorithm take over (nobody read this rank's area yet); past it, the leaver was in
      // this very collective.
      if (left_in == seq_ || step > 0) throw_cancelled_by(who);
      throw FallBack{};
    }
    std::error_code code;
    std::string reason;
    if (departed_ >= 0 && !g_.transport->context_failed(g_.context, nullptr, nullptr)) {
      reason = fmt::format("rank {} left the group (its connection closed) while rank {} waited for it in {} #{}", departed_,
                           g_.rank, op_, seq_);
      g_.transport->abort_context(g_.context, Errc::peer_failure, reason);
      throw_error(Errc::peer_failure, g_.where(op_, static_cast<std::int64_t>(seq_), departed_), reason);
    }
    if (g_.transport->context_failed(g_.context, &code, &reason)) {
      throw_error(static_cast<Errc>(code.value()), g_.where(op_, static_cast<std::int64_t>(seq_)), reason);
    }
    std::string failure;
    {
      std::lock_guard lock(g_.failure_mutex);
      failure = g_.failure;
    }
    throw_error(Errc::group_failed, g_.where(op_, static_cast<std::int64_t>(seq_)), failure);
  }

  void check_headers(std::uint32_t step) const {
    for (int r = 0; r < g_.size; ++r) {
      if (r == g_.rank) continue;
      const shm::AreaHeader& theirs = arena_.header(r);
      const OpSignature their_signature{theirs.call, theirs.count};
      if (theirs.seq == seq_ && their_signature == signature_ && theirs.step == step) continue;
      const std::string reason =
          fmt::format("rank {} called {} while rank {} called {} (seen in the group's shared-memory arena)", r,
                      signature::describe(their_signature, theirs.seq), g_.rank, signature::describe(signature_, seq_));
      g_.transport->abort_context(g_.context, Errc::mismatch, reason);
      throw_error(Errc::mismatch, g_.where(op_, static_cast<std::int64_t>(seq_), r), reason);
    }
  }

 public:
  struct FallBack {};

 private:
  GroupState& g_;
  shm::Arena& arena_;
  std::uint64_t seq_;
  const char* op_;
  OpSignature signature_;
  std::shared_ptr<Hook> hook_;
  int departed_ = -1;
};

// The chunks of `n` elements a script goes through when each rank writes `pieces` pieces of a chunk into
// its area: at least one, empty for n = 0 (every collective takes at least one superstep, so that its
// header is compared and the ranks stay in step). Computed as they are visited: a small collective's one
// chunk costs no allocation.
struct Chunks {
  std::size_t n;
  std::size_t chunk;
  std::size_t count() const noexcept { return n == 0 ? 1 : (n + chunk - 1) / chunk; }
  algo::Range operator[](std::size_t k) const noexcept {
    return algo::Range{k * chunk, n == 0 ? 0 : std::min(chunk, n - k * chunk)};
  }
};

Chunks chunks_of(const shm::Arena& arena, std::size_t n, std::size_t esize, std::size_t pieces) {
  return Chunks{n, std::max<std::size_t>(1, arena.area_bytes() / (esize * pieces))};
}

Task<void> all_reduce(ArenaRun& run, GroupState& g, const CollectiveCall& call) {
  const std::size_t esize = dtype_size(call.out.dtype);
  const std::size_t n = call.out.count;
  const auto p = static_cast<std::size_t>(g.size);
  const std::byte* in = call.in.bytes_ptr();
  std::byte* out = call.out.bytes_ptr();
  const bool everywhere = n * esize < reduce_everywhere_below;
  std::vector<const std::byte*>& sources = g.arena_sources;
  sources.resize(p);
  std::uint32_t step = 0;
  const Chunks chunks = chunks_of(run.arena(), n, esize, 1);
  for (std::size_t k = 0; k < chunks.count(); ++k) {
    const algo::Range chunk = chunks[k];
    const std::size_t off = chunk.offset;
    const std::size_t c = chunk.count;
    std::memcpy(run.area(), in + off * esize, c * esize);
    co_await run.step(step++);
    if (everywhere) {
      for (std::size_t r = 0; r < p; ++r) sources[r] = run.area_of(static_cast<int>(r));
      algo::fold_in_rank_order(out + off * esize, sources, c, call.out.dtype, call.op);
    } else {
      // This rank's block of the chunk, reduced from every area into its own next area; then every
      // block from its owner's area.
      const algo::Range mine = algo::block(c, g.size, g.rank);
      for (std::size_t r = 0; r < p; ++r) sources[r] = run.area_of(static_cast<int>(r)) + mine.offset * esize;
      std::byte* reduced = run.area() + mine.offset * esize;
      algo::fold_in_rank_order(reduced, sources, mine.count, call.out.dtype, call.op);
      co_await run.step(step++);
      for (int r = 0; r < g.size; ++r) {
        const algo::Range theirs = algo::block(c, g.size, r);
        std::memcpy(out + (off + theirs.offset) * esize, run.area_of(r) + theirs.offset * esize, theirs.count * esize);
      }
    }
  }
  algo::finish_reduction(call.op, out, n, call.out.dtype, g.size);
}

Task<void> all_gather(ArenaRun& run, GroupState& g, const CollectiveCall& call) {
  const std::size_t esize = dtype_size(call.in.dtype);
  const std::size_t n = call.in.count;
  std::uint32_t step = 0;
  const Chunks chunks = chunks_of(run.arena(), n, esize, 1);
  for (std::size_t k = 0; k < chunks.count(); ++k) {
    const algo::Range chunk = chunks[k];
    const std::size_t off = chunk.offset;
    const std::size_t c = chunk.count;
    std::memcpy(run.area(), call.in.bytes_ptr() + off * esize, c * esize);
    co_await run.step(step++);
    for (int r = 0; r < g.size; ++r) {
      std::memcpy(call.out.bytes_ptr() + (static_cast<std::size_t>(r) * n + off) * esize, run.area_of(r), c * esize);
    }
  }
}

// reduce_scatter and all_to_all: each rank's area holds, per chunk, one piece for every rank (piece q:
// elements [off, off + c) of input block q); rank r takes piece r of every area.
Task<void> pieces_exchange(ArenaRun& run, GroupState& g, const CollectiveCall& call, bool reducing) {
  const std::size_t esize = dtype_size(call.in.dtype);
  const auto p = static_cast<std::size_t>(g.size);
  const std::size_t n = call.in.count / p;  // elements per block
  std::vector<const std::byte*> sources(p);
  std::uint32_t step = 0;
  const Chunks chunks = chunks_of(run.arena(), n, esize, p);
  for (std::size_t k = 0; k < chunks.count(); ++k) {
    const algo::Range chunk = chunks[k];
    const std::size_t off = chunk.offset;
    const std::size_t c = chunk.count;
    for (std::size_t q = 0; q < p; ++q) {
      std::memcpy(run.area() + q * c * esize, call.in.bytes_ptr() + (q * n + off) * esize, c * esize);
    }
    co_await run.step(step++);
    const std::size_t mine = static_cast<std::size_t>(g.rank) * c * esize;
    if (reducing) {
      for (std::size_t r = 0; r < p; ++r) sources[r] = run.area_of(static_cast<int>(r)) + mine;
      algo::fold_in_rank_order(call.out.bytes_ptr() + off * esize, sources, c, call.out.dtype, call.op);
    } else {
      for (std::size_t r = 0; r < p; ++r) {
        std::memcpy(call.out.bytes_ptr() + (r * n + off) * esize, run.area_of(static_cast<int>(r)) + mine, c * esize);
      }
    }
  }
  if (reducing) algo::finish_reduction(call.op, call.out.data, call.out.count, call.out.dtype, g.size);
}

Task<void> broadcast(ArenaRun& run, GroupState& g, const CollectiveCall& call) {
  const std::size_t esize = dtype_size(call.out.dtype);
  std::uint32_t step = 0;
  const Chunks chunks = chunks_of(run.arena(), call.out.count, esize, 1);
  for (std::size_t k = 0; k < chunks.count(); ++k) {
    const algo::Range chunk = chunks[k];
    const std::size_t off = chunk.offset;
    const std::size_t c = chunk.count;
    if (g.rank == call.root) std::memcpy(run.area(), call.out.bytes_ptr() + off * esize, c * esize);
    co_await run.step(step++);
    if (g.rank != call.root) std::memcpy(call.out.bytes_ptr() + off * esize, run.area_of(call.root), c * esize);
  }
}

Task<void> run_script(ArenaRun& run, GroupState& g, const CollectiveCall& call) {
  switch (call.collective) {
    case Collective::all_reduce: co_await all_reduce(run, g, call); break;
    case Collective::all_gather: co_await all_gather(run, g, call); break;
    case Collective::reduce_scatter: co_await pieces_exchange(run, g, call, true); break;
    case Collective::all_to_all: co_await pieces_exchange(run, g, call, false); break;
    case Collective::broadcast: co_await broadcast(run, g, call); break;
    case Collective::barrier: co_await run.step(0); break;
    default:
      throw std::logic_error(fmt::format("weft: {} has no direct shared-memory algorithm", to_string(call.collective)));
  }
}

// The arena's turn: one collective at a time, in the order they started on this rank (which is the
// order of their seqs, the same on every rank).
struct TakeTurn {
  GroupState& g;
  bool await_ready() {
    if (g.arena_busy) return false;
    g.arena_busy = true;
    return true;
  }
  void await_suspend(std::coroutine_handle<> h) { g.arena_queue.push_back(h); }
  void await_resume() const noexcept {}
};

// A cancel of the Future: from any thread, handled on the loop. (A callable of its own, not a
// std::function: registered on every collective, it must not allocate.)
struct CancelOnArena {
  std::shared_ptr<GroupState> g;
  std::shared_ptr<Hook> hook;
  std::uint64_t seq;
  const char* op;
  void operator()() const {
    g->loop->post([g = g, hook = hook, seq = seq, op = op] {
      if (hook->finished) return;
      hook->cancelled = true;
      g->transport->cancel_operation(g->context, seq, fmt::format("rank {} cancelled {} #{}", g->rank, op, seq));
    });
  }
};

void pass_turn(GroupState& g) {
  g.arena_seq = 0;
  if (g.arena_queue.empty()) {
    g.arena_busy = false;
    return;
  }
  auto next = g.arena_queue.front();
  g.arena_queue.pop_front();
  next.resume();  // it holds the turn now (arena_busy stays true)
}

}  // namespace

Task<bool> run_on_arena(std::shared_ptr<GroupState> g, std::uint64_t seq, CollectiveCall call) {
  if (!g->arena) co_return false;
  const char* op = to_string(call.collective).data();
  const DType dtype = call.collective == Collective::barrier ? DType::u8 : call.out.dtype;
  const std::uint64_t count = call.collective == Collective::reduce_scatter ? call.out.count : call.in.count;
  const OpSignature signature =
      signature::of(call.collective, dtype, reduces(call.collective) ? call.op : ReduceOp::sum,
                    call.collective == Collective::broadcast ? call.out.count : count, call.root);
  co_await TakeTurn{*g};
  auto hook = std::make_shared<Hook>();
  ArenaRun run(*g, seq, op, signature, hook);
  bool ran = false;
  std::exception_ptr failure;
  try {
    if (run.usable()) {
      const std::stop_token token = co_await this_stop_token();
      std::optional<std::stop_callback<CancelOnArena>> on_stop;
      if (token.stop_possible()) on_stop.emplace(token, CancelOnArena{g, hook, seq, op});
      g->arena_seq = seq;
      g->transport->note_started(g->context, seq, signature);
      g->watch(seq, op);
      try {
        co_await run_script(run, *g, call);
        ran = true;
      } catch (const ArenaRun::FallBack&) {
        // A rank left the arena in an earlier operation: this one goes over the transport.
      }
      hook->finished = true;
      g->unwatch(seq);
    }
  } catch (const Error& e) {
    if (e.errc() != Errc::cancelled) g->mark_failed(e.what());
    failure = std::current_exception();
  } catch (...) {
    failure = std::current_exception();
  }
  if (failure) {
    hook->finished = true;
    g->unwatch(seq);
  }
  // Whatever happened, the next collective waiting for the arena gets its turn.
  pass_turn(*g);
  if (failure) std::rethrow_exception(failure);
  co_return ran;
}

}  // namespace weft::detail
