#include "group/staging.hpp"

#include <algorithm>
#include <cstring>

namespace weft::detail {

void copy_bytes(void* dst, const void* src, std::size_t bytes) {
  if (bytes && dst != src) std::memmove(dst, src, bytes);
}

void slots_from_blocks(std::byte* slots, const std::byte* blocks, std::size_t p, std::size_t first, std::size_t block_bytes) {
  for (std::size_t i = 0; i < p; ++i) copy_bytes(slots + i * block_bytes, blocks + ((first + i) % p) * block_bytes, block_bytes);
}
void blocks_from_slots(std::byte* blocks, const std::byte* slots, std::size_t p, std::size_t first, std::size_t block_bytes,
                       Turn turn) {
  for (std::size_t i = 0; i < p; ++i) {
    const std::size_t owner = turn == Turn::up ? (first + i) % p : (first + p - i) % p;
    copy_bytes(blocks + owner * block_bytes, slots + i * block_bytes, block_bytes);
  }
}

ScratchBytes slots_for(const algorithms::Plan& plan, std::size_t count, DType dtype) {
  std::size_t end = count;
  for (const algorithms::Step& step : plan) end = std::max({end, step.send.offset + step.send.count, step.recv.offset + step.recv.count});
  return scratch_bytes(end * dtype_size(dtype));
}

}  // namespace weft::detail
