#pragma once
// Little-endian integers in byte buffers: every weft wire format (frames, the greeting, the store) is
// little-endian with a fixed layout. Core owns these, so that neither the control plane (rendezvous) nor
// the data plane (transports) borrows them from the other.
//
// On a little-endian host each is one unaligned load or store (memcpy). GCC 12 does not merge the byte
// loop below into one load: a frame header's decode was 169 instructions of byte loads and shifts, about
// 3 % of a shared-memory round trip (bench/RESULTS.md). The byte loop stays for big-endian hosts.
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace weft::le {

template <class T>
inline void put(std::byte* p, T v) noexcept {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(p, &v, sizeof v);
  } else {
    for (std::size_t i = 0; i < sizeof v; ++i) p[i] = static_cast<std::byte>(v >> (8 * i));
  }
}
template <class T>
inline T get(const std::byte* p) noexcept {
  T v = 0;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, p, sizeof v);
  } else {
    for (std::size_t i = 0; i < sizeof v; ++i) v |= static_cast<T>(static_cast<T>(p[i]) << (8 * i));
  }
  return v;
}

inline void put_u32(std::byte* p, std::uint32_t v) noexcept { put(p, v); }
inline void put_u64(std::byte* p, std::uint64_t v) noexcept { put(p, v); }
inline std::uint32_t get_u32(const std::byte* p) noexcept { return get<std::uint32_t>(p); }
inline std::uint64_t get_u64(const std::byte* p) noexcept { return get<std::uint64_t>(p); }

}  // namespace weft::le
