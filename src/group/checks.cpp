#include "group/checks.hpp"

#include <cstdint>

#include <fmt/format.h>

namespace weft::detail {

[[noreturn]] void invalid(const GroupState& g, const char* op, const std::string& detail, int peer) {
  throw Error(Errc::invalid_argument, g.where(op, static_cast<std::int64_t>(g.next_seq.load()), peer), detail);
}

void refuse_unusable(GroupState& g, const char* op) {
  std::lock_guard lock(g.failure_mutex);
  throw Error(Errc::group_failed, g.where(op, static_cast<std::int64_t>(g.next_seq.load())),
              fmt::format("an earlier operation failed: {}", g.failure));
}

void refuse_p2p(const GroupState& g, const Error& e, int peer, std::uint32_t tag, bool sending) {
  ErrorContext c = e.context();
  c.peer = peer;
  c.tag = tag;
  c.seq = peer >= 0 && peer < g.size ? static_cast<std::int64_t>(g.next_p2p_seq(peer, sending)) : -1;
  throw_error(e.errc(), std::move(c), e.detail());
}

// Host or device memory (a device view is checked, and staged, by the device path: device_staging.cpp).
void check_device_kind(const GroupState& g, const char* op, Device device) {
  if (device.kind != Device::Kind::host && device.kind != Device::Kind::cuda) invalid(g, op, "the buffer's device kind is unknown");
}

// max_buffer_bytes (weft/buffer.hpp) bounds every count here.

void refuse_buffer(const GroupState& g, const char* op, const char* name, const void* data, std::size_t count,
                   DType dtype, Device device) {
  check_device_kind(g, op, device);
  if (!is_valid(dtype)) {
    invalid(g, op, fmt::format("{}'s dtype {} is not a weft DType", name, static_cast<unsigned>(dtype)));
  }
  if (count > max_buffer_bytes / dtype_size(dtype)) {
    invalid(g, op, fmt::format("{} claims {} elements of {} ({} bytes each): more than memory can hold (at most 2^47 "
                               "bytes per buffer)", name, count, to_string(dtype), dtype_size(dtype)));
  }
  if (count > 0 && data == nullptr) invalid(g, op, fmt::format("{} is null with {} elements", name, count));
  invalid(g, op, fmt::format("{} was refused by the inline check and accepted by its report (a weft bug)", name));
}

// count x the group's size, for collectives whose buffer holds a block per rank; refused past what a
// buffer can hold rather than wrapped.
std::size_t per_rank_total(const GroupState& g, const char* op, std::size_t count) {
  const auto p = static_cast<std::size_t>(g.size);
  if (count > max_buffer_bytes / p) {
    invalid(g, op, fmt::format("{} elements per rank x {} ranks is more than a buffer can hold", count, p));
  }
  return count * p;
}

void check_same_type(const GroupState& g, const char* op, DType a, DType b) {
  if (a != b) invalid(g, op, fmt::format("input is {} but output is {}", to_string(a), to_string(b)));
}

void check_count(const GroupState& g, const char* op, const char* what, std::size_t got, std::size_t expected) {
  if (got != expected) invalid(g, op, fmt::format("{} has {} elements, expected {}", what, got, expected));
}

void check_op(const GroupState& g, const char* op, DType type, ReduceOp reduce) {
  if (!is_valid(reduce)) invalid(g, op, fmt::format("reduce op {} is not a weft ReduceOp", static_cast<unsigned>(reduce)));
  if (!is_defined(type, reduce)) {
    invalid(g, op, fmt::format("reduce op {} is not defined on {}", to_string(reduce), to_string(type)));
  }
}

void refuse_rank(const GroupState& g, const char* op, const char* what, int r) {
  invalid(g, op, fmt::format("{} {} is not a rank of this group of {}", what, r, g.size), r);
}

// The operation's sequence number; a view made by with_timeout() records its deadline for it.
std::uint64_t take_seq(GroupState& g, std::chrono::milliseconds timeout) {
  const std::uint64_t seq = g.next_seq.fetch_add(1);
  if (timeout.count() >= 0) g.set_deadline(seq, timeout);
  return seq;
}

bool share_bytes(ConstBufferView a, ConstBufferView b) noexcept {
  if (a.bytes() == 0 || b.bytes() == 0 || !a.data || !b.data) return false;
  const auto x = reinterpret_cast<std::uintptr_t>(a.data);
  const auto y = reinterpret_cast<std::uintptr_t>(b.data);
  return x < y + b.bytes() && y < x + a.bytes();
}

}  // namespace weft::detail
