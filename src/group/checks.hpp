#pragma once
// The preconditions of every Group call, checked on the caller's thread before anything is sent: each
// failure is a weft::Error (invalid_argument, or group_failed) naming the rank, the operation and the
// sequence number it would have had.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "group/state.hpp"
#include "weft/buffer.hpp"
#include "weft/dtype.hpp"
#include "weft/reduce_op.hpp"

namespace weft::detail {

[[noreturn]] void invalid(const GroupState& g, const char* op, const std::string& detail, int peer = -1);
// check_usable, check_buffer and check_rank run on every call, point-to-point included: what they
// accept is decided inline by a few compares (out of line, with a division, they were about 4 % of a
// small shm message's instructions); what they refuse is reported by the out-of-line half.
[[noreturn]] void refuse_unusable(GroupState& g, const char* op);
inline void check_usable(GroupState& g, const char* op) {
  if (g.failed.load()) refuse_unusable(g, op);
}
void check_device_kind(const GroupState& g, const char* op, Device device);
/// A send's or recv's refusal at its call (`e`, thrown by the checks above) again, naming the peer, the
/// tag and the number the call would have taken among this rank's sends to (receives from) that peer,
/// not the group's next collective number.
[[noreturn]] void refuse_p2p(const GroupState& g, const Error& e, int peer, std::uint32_t tag, bool sending);
[[noreturn]] void refuse_buffer(const GroupState& g, const char* op, const char* name, const void* data, std::size_t count,
                                DType dtype, Device device);
inline void check_buffer(const GroupState& g, const char* op, const char* name, const void* data, std::size_t count,
                         DType dtype, Device device) {
  // count * size > max_buffer_bytes is count > max_buffer_bytes / size (every size divides it), and the
  // product cannot wrap once count is at most max_buffer_bytes.
  if ((device.kind != Device::Kind::host && device.kind != Device::Kind::cuda) || !is_valid(dtype) || count > max_buffer_bytes ||
      count * dtype_size(dtype) > max_buffer_bytes || (count > 0 && data == nullptr))
    refuse_buffer(g, op, name, data, count, dtype, device);
}
std::size_t per_rank_total(const GroupState& g, const char* op, std::size_t count);
void check_same_type(const GroupState& g, const char* op, DType a, DType b);
void check_count(const GroupState& g, const char* op, const char* what, std::size_t got, std::size_t expected);
void check_op(const GroupState& g, const char* op, DType type, ReduceOp reduce);
[[noreturn]] void refuse_rank(const GroupState& g, const char* op, const char* what, int r);
inline void check_rank(const GroupState& g, const char* op, const char* what, int r) {
  if (r < 0 || r >= g.size) refuse_rank(g, op, what, r);
}
std::uint64_t take_seq(GroupState& g, std::chrono::milliseconds timeout);
/// Whether two views have a byte in common (empty views share none).
bool share_bytes(ConstBufferView a, ConstBufferView b) noexcept;

/// A buffer collective's preconditions (collectives.cpp, `validate`), then the algorithm the group's table
/// chooses for it. A call of the same shape as this thread's last call that passed on this group (every
/// field the checks and the table read, the buffers' addresses aside: only whether they are null), with
/// the table not overridden since, gets the answer of then without either. The variable-size
/// collectives are checked every time (their blocks are not part of the shape).
/// Returns: a registry entry. Errors: weft::Error (invalid_argument) naming the operation; nothing is
/// remembered of a call that failed.
const algo::Algorithm& checked_algorithm(GroupState& g, const CollectiveCall& call);

}  // namespace weft::detail
