#pragma once
// The direct shared-memory collectives: the registry's "shm" algorithms, which run a collective of a
// group whose ranks all live on one host through the group arena (transports/shm/arena.hpp) instead of
// messages: every rank writes its part into its own area, publishes, waits for the others' step, and
// reads what it needs straight from their areas (no frames, no matching, no per-message copy through a
// ring). Small broadcasts go through the root's box instead, and the root does not wait for its readers
// (arena.hpp, "Boxes"). Mismatch detection (each area's and slot's header names the operation),
// deadlines, cancellation and failures are kept; a cancelled operation's remaining steps are finished in
// the background, so that every rank stays in the arena (arena.hpp, "Cancelling").
#include <cstdint>
#include <memory>
#include <utility>

#include "group/state.hpp"
#include "weft/task.hpp"

namespace weft::detail {

/// A collective's place in the arena's order (ArenaTurns, group/state.hpp), taken at the call on the
/// caller's thread. Its operation leaves the turn when done; dropped before that (its operation never
/// ran), the place is given up so that the later ones are not held back. Move-only.
class ArenaTicket {
 public:
  ArenaTicket() = default;
  explicit ArenaTicket(GroupState& g) : turns_(&g.arena_turns), loop_(g.loop), number_(g.arena_turns.take()) {}
  ArenaTicket(ArenaTicket&& other) noexcept
      : turns_(std::exchange(other.turns_, nullptr)), loop_(other.loop_), number_(other.number_) {}
  ArenaTicket& operator=(ArenaTicket&&) = delete;
  ~ArenaTicket() { leave(); }
  std::uint64_t number() const noexcept { return number_; }
  /// Ends the turn, or gives up the place; the next collective goes on. Idempotent.
  void leave() {
    if (ArenaTurns* turns = std::exchange(turns_, nullptr)) turns->leave(number_, *loop_);
  }

 private:
  ArenaTurns* turns_ = nullptr;
  Loop* loop_ = nullptr;
  std::uint64_t number_ = 0;
};

/// Runs `call` (operation `seq`) on the group's arena, on the loop, once `ticket`'s turn came
/// (`published`: run_on_arena_now holds it and published that many supersteps already: ArenaNow). Returns false,
/// having sent and written nothing that anybody reads, when the group has no arena or has left it: the
/// caller then runs the collective's framed algorithm. Errors: as any collective (mismatch, timeout,
/// cancelled, a failed peer). `failed_at_call`: arena_group_failed when the collective was called; a
/// failure after it does not fail a superstep that every rank reached (docs/RELIABILITY.md, "A failure
/// after every rank came").
Task<bool> run_on_arena(std::shared_ptr<GroupState> g, std::uint64_t seq, CollectiveCall call, ArenaTicket ticket,
                        std::uint32_t published, bool failed_at_call);

/// Whether this rank knows its group to have failed, or cannot tell (Transport::context_may_have_failed).
/// Any thread. Another group's failure on the same transport (a split's sibling) does not count: it
/// would fail, in this group, a superstep that every rank reached (ends_in_error), and leave every
/// collective of it to the loop.
bool arena_group_failed(const GroupState& g);

/// What run_on_arena_now did.
enum class ArenaNow {
  not_started,  // nothing: run_on_arena(..., false) runs it
  done,         // the whole collective, and the ticket was left
  published,    // its first step, then a rank was late or disagreed: run_on_arena(..., 1) goes on
  published_both,  // both steps of a direct collective (arena.hpp, "Direct reads"): run_on_arena(..., 2)
};
/// The supersteps run_on_arena_now published.
constexpr std::uint32_t steps_published(ArenaNow now) noexcept {
  return now == ArenaNow::published_both ? 2 : now == ArenaNow::published ? 1 : 0;
}

/// The fast path, on the caller's thread: a collective of one superstep whose turn has come is written,
/// published and, when every rank published within a short poll (WEFT_INLINE_SPIN_US, default 20 us),
/// read and finished here; a direct collective's two supersteps the same way, each polled for. Nothing here throws, waits unboundedly or reports: whatever is not the plain
/// case is left to run_on_arena on the loop.
ArenaNow run_on_arena_now(GroupState& g, std::uint64_t seq, const CollectiveCall& call, ArenaTicket& ticket);

}  // namespace weft::detail
