#include "transports/shm/copy.hpp"

#include "core/sanitizer.hpp"
#if !defined(WEFT_UNDER_SANITIZER) && (defined(__x86_64__) || defined(_M_X64))
#include <emmintrin.h>  // SSE2: in every x86-64
#define WEFT_SHM_COPY_STREAM 1
#endif

namespace weft::shm {

void copy_nontemporal(void* to, const void* from, std::size_t n) noexcept {
#if defined(WEFT_SHM_COPY_STREAM)
  auto* d = static_cast<std::byte*>(to);
  const auto* s = static_cast<const std::byte*>(from);
  // The stores need a 16-byte aligned destination; the loads may be anywhere.
  std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(d) & 15)) & 15;
  if (head > n) head = n;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  std::memcpy(d + i, s + i, n - i);
  // Non-temporal stores are weakly ordered: without the fence a reader that sees the publishing store
  // could still read old bytes.
  _mm_sfence();
#else
  if (n > 0) std::memcpy(to, from, n);
#endif
}

}  // namespace weft::shm
