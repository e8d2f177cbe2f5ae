#pragma once
/// The whole public vocabulary of weft.
#include "weft/algorithms.hpp"
#include "weft/buffer.hpp"
#include "weft/dtype.hpp"
#include "weft/error.hpp"
#include "weft/future.hpp"
#include "weft/group.hpp"
#include "weft/loop.hpp"
#include "weft/options.hpp"
#include "weft/reduce_op.hpp"
#include "weft/task.hpp"
#include "weft/transport.hpp"
#include "weft/when.hpp"
