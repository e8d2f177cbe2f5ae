#pragma once
// Groups that run on a Loop. A Group must be destroyed before its Loop (weft/group.hpp): its sockets
// live in the loop's io_context. A Loop destroyed under a live Group used to leave the Group working on
// freed memory (a segfault at its next call, or results computed by a loop that no longer exists); the
// loop's destructor now stops the process with a message that names the mistake instead, as
// std::thread's does for a thread never joined. (A class whose members are `Group group; Loop loop;`
// destroys the loop first: declare the Loop first.)
#include "weft/loop.hpp"

namespace weft::detail {

/// Counts a Group's transport as using `loop` / releases it. Thread-safe.
void loop_user_added(const Loop& loop) noexcept;
void loop_user_removed(const Loop& loop) noexcept;

}  // namespace weft::detail
