#pragma once
// Staging: the copies that put a collective's buffers into the layout its plan runs over and back
// (out-of-place copies, rotated slot buffers for Bruck and the binomial trees, room for a tree's slots).
#include <cstddef>
#include <memory>

#include "core/scratch.hpp"
#include "weft/algorithms.hpp"
#include "weft/dtype.hpp"

namespace weft::detail {

/// memmove of `bytes` unless empty or in place.
void copy_bytes(void* dst, const void* src, std::size_t bytes);

/// Slot buffers of p blocks in rotated order (Bruck, binomial gather/scatter): slot i holds the block of
/// rank (first + i) mod p, or, turned down (all_to_all's way out), of rank (first - i) mod p.
enum class Turn { up, down };
void slots_from_blocks(std::byte* slots, const std::byte* blocks, std::size_t p, std::size_t first, std::size_t block_bytes);
void blocks_from_slots(std::byte* blocks, const std::byte* slots, std::size_t p, std::size_t first, std::size_t block_bytes,
                       Turn turn = Turn::up);

/// Room for what a binomial gather or scatter plan touches on this rank (at least its own block of
/// `count` elements), in virtual-order slots.
ScratchBytes slots_for(const algorithms::Plan& plan, std::size_t count, DType dtype);

}  // namespace weft::detail
