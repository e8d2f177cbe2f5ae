// Copies into shared memory that another process reads next, without weft (bench/RESULTS.md, "Copies
// into shared memory"; docs/DESIGN.md). Two processes take turns: the writer copies BYTES from its
// private buffer into a shared one, the reader copies them out into its own, many times; each side's
// copy is timed. The ways of writing:
//   memcpy        the shared buffer on a cache line, the source SKEW bytes into one
//   alike         the destination as far into its line as the source (weft's arena), memcpy calls of at
//                 most 256 KiB (weft's shm::copy_to_shared)
//   nontemporal   SSE2 streaming stores (whole lines, not fetched), then a store fence
//   shm_copy_ceiling [BYTES...] (default 64 KiB, 256 KiB, 1 MiB, 4 MiB; skews 0 and 16)
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

namespace {

enum class Way { memcpy_plain, alike, nontemporal };
const char* name(Way w) { return w == Way::memcpy_plain ? "memcpy" : w == Way::alike ? "alike" : "nontemporal"; }

void copy_nontemporal(char* d, const char* s, std::size_t n) {
#if defined(__x86_64__)
  std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(d) & 15)) & 15;
  if (head > n) head = n;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  std::size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    for (int k = 0; k < 4; ++k) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16 * k), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16 * k)));
    }
  }
  std::memcpy(d + i, s + i, n - i);
  _mm_sfence();
#else
  std::memcpy(d, s, n);
#endif
}

double seconds() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// One run: the writer's and the reader's average copy, in us.
void run(std::size_t bytes, std::size_t skew, Way way, int iterations) {
  auto* turn = static_cast<std::atomic<long>*>(mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  auto* times = reinterpret_cast<double*>(reinterpret_cast<char*>(turn) + 64);
  auto* shared = static_cast<char*>(mmap(nullptr, bytes + 8192, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS | MAP_POPULATE, -1, 0));
  if (turn == MAP_FAILED || shared == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  new (turn) std::atomic<long>(0);
  auto* mine = static_cast<char*>(std::aligned_alloc(4096, bytes + 8192));
  std::memset(mine, 1, bytes + 8192);
  char* source = mine + skew;
  char* place = shared + 64 + (way == Way::alike ? reinterpret_cast<std::uintptr_t>(source) % 64 : 0);
  const pid_t child = fork();
  const bool writer = child != 0;
  double busy = 0;
  for (int i = 0; i < iterations; ++i) {
    const long mine_turn = 2L * i + (writer ? 0 : 1);
    while (turn->load(std::memory_order_acquire) != mine_turn) {
    }
    const double t0 = seconds();
    if (writer) {
      if (way == Way::nontemporal) {
        copy_nontemporal(place, source, bytes);
      } else if (way == Way::alike) {
        for (std::size_t at = 0; at < bytes; at += std::size_t{256} << 10) std::memcpy(place + at, source + at, std::min(bytes - at, std::size_t{256} << 10));
      } else {
        std::memcpy(place, source, bytes);
      }
    } else {
      std::memcpy(mine, place, bytes);
    }
    busy += seconds() - t0;
    turn->store(mine_turn + 1, std::memory_order_release);
  }
  times[writer ? 0 : 1] = busy / iterations * 1e6;
  if (!writer) std::_Exit(0);
  waitpid(child, nullptr, 0);
  std::printf("| %zu | %zu | %s | %.1f | %.1f |\n", bytes, skew, name(way), times[0], times[1]);
  std::free(mine);
  munmap(shared, bytes + 8192);
  munmap(turn, 4096);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::size_t> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(std::strtoull(argv[i], nullptr, 10));
  if (sizes.empty()) sizes = {std::size_t{64} << 10, std::size_t{256} << 10, std::size_t{1} << 20, std::size_t{4} << 20};
  std::printf("| bytes | source skew | way | writer us | reader us |\n|---:|---:|---|---:|---:|\n");
  for (std::size_t bytes : sizes) {
    const int iterations = static_cast<int>(std::max<std::size_t>(50, (std::size_t{1} << 30) / bytes / 4));
    for (std::size_t skew : {std::size_t{0}, std::size_t{16}}) {
      for (Way way : {Way::memcpy_plain, Way::alike, Way::nontemporal}) run(bytes, skew, way, std::min(iterations, 2000));
    }
  }
}
