#pragma once
// Scratch memory for one operation: a collective's work buffer, the copy of an input sent in place,
// gathered slots. From `scratch_pooled_from` bytes it comes from a process-wide pool of buffers kept
// for reuse (at most `scratch_kept_most` bytes in all, the oldest leaving first), mapped in transparent
// huge pages where the kernel gives them. Why: such a buffer is fresh memory otherwise, and glibc maps
// every allocation of 32 MiB or more anew (its mmap threshold stops growing there), so each call paid
// a page fault per 4 KiB, about 10 us each on this project's VMs: a 32 MiB reduce_scatter took 81 ms
// over tcp against 11 ms at 16 MiB, an in-place 32 MiB all_to_all 160 ms against 10 out of place
// (bench/RESULTS.md, "Scratch buffers kept"). Below it, malloc's own reuse serves.
// Thread-safe; under a sanitizer nothing is kept (a use after release must stay visible).
#include <cstddef>
#include <memory>

namespace weft::detail {

inline constexpr std::size_t scratch_pooled_from = std::size_t{4} << 20;
inline constexpr std::size_t scratch_kept_most = std::size_t{256} << 20;

/// Gives a scratch buffer back: to the pool (mapped ones), or to the heap.
struct ScratchRelease {
  std::size_t mapped = 0;  // the mapping's bytes; 0: from new[]
  void operator()(std::byte* bytes) const noexcept;
};
using ScratchBytes = std::unique_ptr<std::byte[], ScratchRelease>;

/// At least max(1, bytes) bytes of uninitialised memory. Throws std::bad_alloc.
ScratchBytes scratch_bytes(std::size_t bytes);

/// What the pool holds now (tests): buffers and their bytes.
struct ScratchKept {
  std::size_t buffers = 0;
  std::size_t bytes = 0;
};
ScratchKept scratch_kept() noexcept;

}  // namespace weft::detail
