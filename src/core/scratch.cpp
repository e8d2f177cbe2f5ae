#include "core/scratch.hpp"

#include <sys/mman.h>

#include <deque>
#include <mutex>
#include <new>

#include "core/sanitizer.hpp"

namespace weft::detail {
namespace {

constexpr std::size_t huge_page = std::size_t{2} << 20;

struct Kept {
  std::byte* data;
  std::size_t mapped;
};

struct Pool {
  std::mutex mutex;
  std::deque<Kept> kept;  // oldest first
  std::size_t bytes = 0;
};

Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: buffers may come back during static destruction
  return *p;
}

void unmap(std::byte* data, std::size_t mapped) noexcept { ::munmap(data, mapped); }

}  // namespace

void ScratchRelease::operator()(std::byte* bytes) const noexcept {
  if (!bytes) return;
  if (mapped == 0) {
    delete[] bytes;
    return;
  }
  if (mapped > scratch_kept_most) {
    unmap(bytes, mapped);
    return;
  }
  Pool& p = pool();
  std::deque<Kept> leaving;
  {
    std::lock_guard lock(p.mutex);
    while (p.bytes + mapped > scratch_kept_most && !p.kept.empty()) {
      p.bytes -= p.kept.front().mapped;
      leaving.push_back(p.kept.front());
      p.kept.pop_front();
    }
    p.kept.push_back(Kept{bytes, mapped});
    p.bytes += mapped;
  }
  for (const Kept& k : leaving) unmap(k.data, k.mapped);  // outside the lock: munmap takes its time
}

ScratchBytes scratch_bytes(std::size_t bytes) {
  if (bytes == 0) bytes = 1;
#if defined(WEFT_UNDER_SANITIZER)
  return ScratchBytes(new std::byte[bytes], ScratchRelease{0});
#else
  if (bytes < scratch_pooled_from) return ScratchBytes(new std::byte[bytes], ScratchRelease{0});
  {
    // The smallest kept buffer that fits and is not more than twice as large (a small call does not
    // hold a huge buffer while a large one maps another).
    Pool& p = pool();
    std::lock_guard lock(p.mutex);
    auto best = p.kept.end();
    for (auto it = p.kept.begin(); it != p.kept.end(); ++it) {
      if (it->mapped >= bytes && it->mapped <= 2 * bytes && (best == p.kept.end() || it->mapped < best->mapped)) best = it;
    }
    if (best != p.kept.end()) {
      const Kept found = *best;
      p.kept.erase(best);
      p.bytes -= found.mapped;
      return ScratchBytes(found.data, ScratchRelease{found.mapped});
    }
  }
  const std::size_t mapped = (bytes + huge_page - 1) / huge_page * huge_page;
  void* data = ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (data == MAP_FAILED) throw std::bad_alloc();
  // Where THP is "madvise" (Debian's default) this asks for it; elsewhere it changes nothing.
  ::madvise(data, mapped, MADV_HUGEPAGE);
  return ScratchBytes(static_cast<std::byte*>(data), ScratchRelease{mapped});
#endif
}

ScratchKept scratch_kept() noexcept {
  Pool& p = pool();
  std::lock_guard lock(p.mutex);
  return ScratchKept{p.kept.size(), p.bytes};
}

}  // namespace weft::detail
