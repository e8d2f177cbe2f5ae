#pragma once
// Copies into shared memory that another core reads next (an arena's areas, a ring's records).
//
// Why not memcpy alone: the lines of such memory sit in the reader's cache, and a plain store must first
// fetch its line from there (a read for ownership). glibc's memcpy avoids that with `rep movsb`, which
// writes whole lines, only while source and destination sit alike in their cache lines and the copy is
// below its threshold for leaving rep movsb (between 512 KiB and 1 MiB here); otherwise every line
// crosses twice. Measured on this project's VMs (AMD EPYC, two processes taking turns, the writer's copy
// from private memory into a buffer the other had just read; bench/RESULTS.md, "Copies into shared
// memory"): 512 KiB 16 us alike, 82 us with the source 16 bytes into its line (malloc's place for a
// large buffer); 1 MiB 177 us even alike. Alike and in pieces of at most 256 KiB: 34 us at 1 MiB, 76 at
// 2 MiB, and the reader's copy out as fast as ever. Non-temporal stores (whole lines, not fetched) were
// as fast for the writer, but then the reader fetches from memory: in the arena they made 32-128 KiB
// collectives 1.4-2.2x slower. So the arena places its contents alike (arena.hpp, `skew`), and this
// copies in pieces; what is still not alike (an all_to_all's later pieces when a call takes several
// chunks) takes non-temporal stores from 256 KiB, where fetching every line costs five times as much.
// Under a sanitizer always memcpy, so that ASan and TSan see the writes.
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace weft::shm {

// A copy alike goes as memcpy calls of at most this many bytes (each stays on rep movsb).
inline constexpr std::size_t copy_piece_most = std::size_t{256} << 10;
// A copy not alike takes non-temporal stores from this many bytes.
inline constexpr std::size_t nontemporal_from = std::size_t{256} << 10;

/// Non-temporal stores of `n` bytes, then a store fence: what the caller publishes next (a release
/// store) is ordered after them. x86-64 only; elsewhere memcpy.
void copy_nontemporal(void* to, const void* from, std::size_t n) noexcept;

/// memcpy of `n` bytes in calls of at most copy_piece_most.
inline void copy_in_pieces(void* to, const void* from, std::size_t n) noexcept {
  auto* d = static_cast<std::byte*>(to);
  const auto* s = static_cast<const std::byte*>(from);
  while (n > 0) {
    const std::size_t piece = n < copy_piece_most ? n : copy_piece_most;
    std::memcpy(d, s, piece);
    d += piece;
    s += piece;
    n -= piece;
  }
}

/// Copies `n` bytes into shared memory that another core reads next (see above). The caller's release
/// store that publishes them comes after this returns.
inline void copy_to_shared(void* to, const void* from, std::size_t n) noexcept {
  const auto skew = (reinterpret_cast<std::uintptr_t>(to) - reinterpret_cast<std::uintptr_t>(from)) & 63;
  if (skew != 0 && n >= nontemporal_from) {
    copy_nontemporal(to, from, n);
    return;
  }
  copy_in_pieces(to, from, n);
}

}  // namespace weft::shm
