#pragma once
// Groups that run on a Loop. A Group must be destroyed before its Loop (weft/group.hpp): its sockets
// live in the loop's io_context. A Loop destroyed under a live Group used to leave the Group working on
// freed memory (a segfault at its next call, or results computed by a loop that no longer exists); the
// loop's destructor now stops the process with a message that names the mistake instead, as
// std::thread's does for a thread never joined. (A class whose members are `Group group; Loop loop;`
// destroys the loop first: declare the Loop first.)
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>

#include "weft/loop.hpp"

namespace weft::detail {

/// Counts a Group's transport as using `loop` / releases it. Thread-safe.
void loop_user_added(const Loop& loop) noexcept;
void loop_user_removed(const Loop& loop) noexcept;

/// What must end with the loop: the loop's destructor calls each hook still registered once, after its
/// progress thread stopped (nothing else runs the loop then). A transport registers its shutdown: a
/// Loop destroyed while an operation of its group was still in flight (a cancelled send being written,
/// a Future dropped) left the transport, held by that operation, with its connections open and nobody
/// behind them, so the peers waited for this rank until their deadline. Its sockets are closed now, its
/// operations fail, and the peers see this rank leave. Thread-safe.
///
/// `flushing` (optional): whether the transport still has frames that tell the peers why (an abort
/// queued behind a data frame being written). An owned loop's destructor first keeps its progress
/// thread running while any registered hook's `flushing()` holds, asked on the loop's thread every
/// millisecond, for at most `end_flush_limit`; then the hooks end. A rank that returned right after an
/// abort otherwise closed its connections in the middle of the frame, and its peers read "closed in
/// the middle of a frame" instead of the reason (docs/RELIABILITY.md).
inline constexpr std::chrono::milliseconds end_flush_limit{2000};
std::uint64_t add_end_hook(const Loop& loop, std::function<void()> hook, std::function<bool()> flushing = {});

/// On `loop`'s thread (call it there): asks `busy()` now and every millisecond while it holds, up to
/// `until`, then calls `done(true)`; `done(false)` if the loop ends first. `linger` is held until then,
/// so that an owned loop's end waits for it. The loop's end and a transport's deletion flush this way.
void while_busy(Loop& loop, std::function<bool()> busy, std::chrono::steady_clock::time_point until,
                std::shared_ptr<Loop::Linger> linger, std::function<void(bool loop_running)> done);
void remove_end_hook(const Loop& loop, std::uint64_t id) noexcept;
/// True while `loop`'s destructor runs its end hooks: on the loop's thread (its strand), or with its
/// thread stopped. What a hook lets go ends there and then, not through a post the loop will not run.
bool loop_ending(const Loop& loop) noexcept;

/// Whether a loop made under WEFT_TRANSPORT=uring (without WEFT_DRIVE) keeps to its progress thread:
/// only a loop on one thread lets the io_uring ring take a single issuer with deferred task work, which
/// is worth it only where the kernel wakes the loop at once when such work is queued. The io_uring room
/// registers the answer (UringRing::defers_promptly); without it (no io_uring in the build: the ranks
/// fall back to tcp) a loop takes caller-driven progress as under any other transport. Set before
/// main (a static initializer); read when a Loop is made.
void set_uring_wants_one_thread(bool (*answer)()) noexcept;

}  // namespace weft::detail
