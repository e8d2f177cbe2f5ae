#pragma once
// The executor that weft's own Asio objects of a Loop are made on (sockets, acceptors, timers, watched
// descriptors, the bootstrap's coroutines) and that posts go through. An owned Loop's is its
// io_context's executor: one thread runs it at a time. A borrowed Loop's (`Loop(io)`) is a strand over
// the caller's io_context, which the caller may run on a pool of threads: weft's handlers then still
// run one at a time, the loop's state needs no locks, and Loop::in_loop_thread() holds inside them only.
#include <asio/any_io_executor.hpp>

#include "weft/loop.hpp"

namespace weft::detail {

struct LoopExecutor {
  static asio::any_io_executor of(Loop& loop) noexcept;
  static bool ending(const Loop& loop) noexcept;  // detail::loop_ending
};

inline asio::any_io_executor executor_of(Loop& loop) noexcept { return LoopExecutor::of(loop); }

}  // namespace weft::detail
