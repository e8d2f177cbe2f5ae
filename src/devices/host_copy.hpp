#pragma once
// Host memory to host memory, split over a few threads: the host's half of a staged copy from or to
// pageable memory (device.cpp, copy_pageable). One thread's memcpy between pinned and pageable memory ran
// at about 6 GB/s on the H100 machine (bench/RESULTS.md, "The second GPU lease"), where the runtime's own
// pageable copy from the device reached 10.4 GB/s; that memcpy, not the DMA, bounded weft's.
#include <cstddef>

namespace weft::gpu::detail {

/// Copies `bytes` from `src` to `dst` (not overlapping), on the calling thread and, from
/// `host_copy_split_from` bytes on, on up to host_copy_threads() - 1 helper threads as well (started on
/// first use, shared by every caller, kept for the process's life). Returns when every byte is copied.
/// Callable from any thread, several at once; 0 bytes copies nothing (null pointers allowed then).
void host_copy(void* dst, const void* src, std::size_t bytes);

/// How many threads a large host_copy uses, the caller included: WEFT_COPY_THREADS when set (1: the
/// caller alone, as before), otherwise half the CPUs this process may run on, between 1 and 4.
unsigned host_copy_threads();

/// Below this a copy stays on the calling thread: handing parts over costs a few microseconds.
inline constexpr std::size_t host_copy_split_from = std::size_t{1} << 20;

}  // namespace weft::gpu::detail
