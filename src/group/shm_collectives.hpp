#pragma once
// The direct shared-memory collectives: the registry's "shm" algorithms, which run a collective of a
// group whose ranks all live on one host through the group arena (transports/shm/arena.hpp) instead of
// messages: every rank writes its part into its own area, publishes, waits for the others' step, and
// reads what it needs straight from their areas (no frames, no matching, no per-message copy through a
// ring). Mismatch detection (each area's header names the operation), deadlines, cancellation and
// failures are kept; a cancelled operation makes the group leave the arena (arena.hpp says why), and
// its later collectives run over the framed transport.
#include <cstdint>
#include <memory>

#include "group/state.hpp"
#include "weft/task.hpp"

namespace weft::detail {

/// Runs `call` (operation `seq`) on the group's arena. Returns false, having sent and written nothing
/// that anybody reads, when the group has no arena or has left it: the caller then runs the
/// collective's framed algorithm. Errors: as any collective (mismatch, timeout, cancelled, a failed peer).
Task<bool> run_on_arena(std::shared_ptr<GroupState> g, std::uint64_t seq, CollectiveCall call);

}  // namespace weft::detail
