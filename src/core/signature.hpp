#pragma once
// Operation signatures: what every data frame of a collective says about the call it belongs to, so that
// ranks which called different collectives (or the same one with different arguments) at the same
// sequence number fail with a message naming both calls instead of hanging or mixing up bytes
// (docs/PROTOCOL.md, "Signatures"). The transport compares them; this file packs and describes them.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "weft/collective.hpp"
#include "weft/dtype.hpp"
#include "weft/reduce_op.hpp"
#include "weft/transport.hpp"

namespace weft::signature {

/// Packs a collective call: the collective, its dtype, its reduce op (only for the reducing ones), its
/// root (-1: none) and the caller's element count. call = kind (5 bits: the Collective's value + 1) |
/// dtype + 1 (5) | op + 1 (4) | root + 1 (18), count as given.
OpSignature of(Collective collective, DType dtype, ReduceOp op, std::uint64_t count, int root);
/// The same for a user's plan (Group::run_plan, kind 31): dtype and op, whatever its name.
OpSignature of_plan(DType dtype, ReduceOp op, std::uint64_t count);
/// The same for an all_reduce that runs on device windows (kind 30: group/device_windows.cpp), so that a
/// rank that calls all_reduce on host buffers while another runs it on device windows fails as a mismatch
/// instead of waiting on the other.
OpSignature of_device_windows(DType dtype, ReduceOp op, std::uint64_t count);

/// A point-to-point message's (kind 29): its dtype, so that a receive into another dtype fails with
/// Errc::mismatch instead of reinterpreting the bytes (f32 read as i32). The count is left to the size
/// check (a receive of another size fails with size_mismatch, as it did before the dtype was signed).
/// u8 is raw bytes: its signature is none (call 0), which matches every dtype, so that bytes sent as u8
/// can be received typed and the other way round.
OpSignature of_point_to_point(DType dtype);
/// The kind code of_point_to_point packs (a wire constant, docs/PROTOCOL.md "Signatures").
inline constexpr std::uint32_t point_to_point_kind = 29;
/// Whether `signature` is a point-to-point message's (of_point_to_point, not u8). Inline: the transport
/// asks on every frame it notes.
inline bool is_point_to_point(const OpSignature& signature) noexcept { return signature.call >> 27 == point_to_point_kind; }
/// The dtype a signature names ("f32"), or "type N" for a code outside weft's DType.
std::string dtype_of(const OpSignature& signature);

/// What a variable-size collective signs instead of a count: a digest of the per-rank counts that every
/// rank passes, so that a rank whose counts differ fails the operation (named by the peer that meets it).
std::uint64_t counts_digest(std::span<const std::size_t> counts) noexcept;

/// Names plan `plan` (OpSignature::plan) of `collective` for describe ("ring"; empty: unknown). The
/// layer that numbers plans sets it (Group::create: the algorithms' registry); until then describe
/// gives the number.
using PlanNamer = std::string_view (*)(Collective collective, std::uint8_t plan) noexcept;
void set_plan_namer(PlanNamer namer) noexcept;

/// "all_gather #42 (f32 x 1024)", "broadcast #7 (u8 x 16, root 2)", "all_reduce #3 (f32 x 8, sum)", and
/// where the signature says its plan, " as ring" after it; "a message of f32" for a point-to-point one.
std::string describe(const OpSignature& signature, std::uint64_t seq);

}  // namespace weft::signature
