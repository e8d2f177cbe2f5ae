#include <array>
#include <cstddef>
#include <cstdint>
#include <new>

#include "weft/task.hpp"

namespace weft::detail {
namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool pooled = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool pooled = false;
#else
constexpr bool pooled = true;
#endif
#else
constexpr bool pooled = true;
#endif

constexpr std::size_t granule = 64;      // bytes per size class
constexpr std::size_t classes = 64;      // up to 4 KiB; larger frames go to the allocator every time
// Kept per class and thread: a window's worth of the small ones (a receive's state and the frame that
// awaits it in when_all: 64 receives in flight took 48 of each from malloc when 16 were kept), a few
// calls' worth of the large ones (at most 16 x 4 KiB per class).
constexpr std::size_t kept_small = 64;
constexpr std::size_t small_classes = 8;  // up to 512 bytes
constexpr std::size_t kept_large = 16;
constexpr std::size_t kept(std::size_t c) noexcept { return c <= small_classes ? kept_small : kept_large; }

// Freed frames of this thread, by size class. A frame freed on another thread than the one that made
// it joins that thread's lists (the loop's thread frees what callers made): each thread keeps at most
// `kept` per class, so nothing piles up.
struct Pool {
  std::array<std::array<void*, kept_small>, classes> frames{};
  std::array<std::uint8_t, classes> count{};
  ~Pool();
};
thread_local bool pool_gone = false;  // trivially destructible: readable after the pool's destructor
thread_local Pool pool;

Pool::~Pool() {
  for (std::size_t c = 0; c < classes; ++c) {
    for (std::size_t i = 0; i < count[c]; ++i) ::operator delete(frames[c][i]);
  }
  pool_gone = true;  // frames freed later on this thread (other thread_locals' destructors) go straight back
}

}  // namespace

void* allocate_frame(std::size_t size) {
  const std::size_t c = (size + granule - 1) / granule;
  if (!pooled || c >= classes || pool_gone) return ::operator new(size);
  Pool& p = pool;
  if (p.count[c] > 0) return p.frames[c][--p.count[c]];
  return ::operator new(c * granule);
}

void free_frame(void* frame, std::size_t size) noexcept {
  const std::size_t c = (size + granule - 1) / granule;
  if (pooled && c < classes && !pool_gone) {
    Pool& p = pool;
    if (p.count[c] < kept(c)) {
      p.frames[c][p.count[c]++] = frame;
      return;
    }
  }
  ::operator delete(frame);
}

bool frames_pooled() noexcept { return pooled; }

}  // namespace weft::detail
