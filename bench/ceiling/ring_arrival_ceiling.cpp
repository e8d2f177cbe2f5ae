// How a ring's reader learns that a record arrived, without weft: the floor under the shm stream's
// ping-pong (bench/RESULTS.md, "Arrival on the record's line"). Two threads pinned to two CPUs ping-pong
// one record each way through two rings of 1 MiB, with the words and fences of src/transports/shm/ring.hpp:
//   tail:   the record, then a `tail` counter on a line of its own (release, full fence, load `sleeping`);
//           the reader loads `tail`, then the record (ring versions up to 3);
//   header: the record but its header, zero after it, then the header (release, full fence, load
//           `sleeping`); the reader loads the header at its position (ring version 4);
//   prefetch: header, and the writer then asks for the line after the zero's (prefetchw);
//   lines:  header, but the zero after a batch is written only where it falls inside a line (not at a
//           line's start); the reader zeroes the first word of every line it has consumed before it
//           stores `head`, so a line's first word is zero until the writer's next lap puts a header there.
// Both readers then store `head` and fence as ring.hpp's release() does; both spin with a pause between
// looks (a spinning loop looks once per turn, not back to back).
//   ring-arrival-ceiling [PAYLOAD_BYTES [ROUND_TRIPS [CPU_A CPU_B]]]
// Prints each protocol's half round trip in us, the four taking turns over 5 runs.
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace {

constexpr std::size_t capacity = std::size_t{1} << 20;

struct alignas(64) Ring {
  alignas(64) std::atomic<std::uint64_t> tail{0};
  alignas(64) std::atomic<std::uint64_t> head{0};
  alignas(64) std::atomic<std::uint32_t> sleeping{0};
  alignas(64) std::atomic<std::uint32_t> writer_waiting{0};
  // A record may run past the end by up to its size (no wrap here: slack instead).
  alignas(64) unsigned char data[capacity + 65536 + 64];
};

enum class Protocol { tail, header, prefetch, lines };
constexpr const char* names[] = {"tail", "header", "prefetch", "lines"};

void pin(int cpu) {
  if (cpu < 0) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

std::uint64_t* word_at(Ring* r, std::uint64_t position) { return reinterpret_cast<std::uint64_t*>(r->data + (position & (capacity - 1))); }
std::uint64_t rounded(std::size_t bytes) { return (8 + bytes + 7) & ~std::uint64_t{7}; }

struct Side {
  Ring* in;
  Ring* out;
  std::uint64_t head = 0, tail = 0;

  void send(Protocol p, const unsigned char* payload, std::size_t n) {
    const std::uint64_t header = 0x7772 | std::uint64_t{n} << 32;
    const std::uint64_t at = tail;
    std::memcpy(out->data + ((at + 8) & (capacity - 1)), payload, n);
    tail += rounded(n);
    if (p == Protocol::tail) {
      std::memcpy(out->data + (at & (capacity - 1)), &header, 8);
      out->tail.store(tail, std::memory_order_release);
    } else {
      if (p != Protocol::lines || (tail & 63) != 0) __atomic_store_n(word_at(out, tail), 0, __ATOMIC_RELAXED);
      __atomic_store_n(word_at(out, at), header, __ATOMIC_RELEASE);
#if defined(__x86_64__)
      if (p == Protocol::prefetch) asm volatile("prefetchw %0" : : "m"(out->data[((tail | 63) + 1) & (capacity - 1)]));
#endif
    }
    std::atomic_thread_fence(std::memory_order_seq_cst);
    (void)out->sleeping.load(std::memory_order_relaxed);
  }
  void receive(Protocol p, unsigned char* payload) {
    std::uint64_t header;
    if (p == Protocol::tail) {
      while (in->tail.load(std::memory_order_acquire) == head) __builtin_ia32_pause();
      std::memcpy(&header, in->data + (head & (capacity - 1)), 8);
    } else {
      while ((header = __atomic_load_n(word_at(in, head), __ATOMIC_ACQUIRE)) == 0) __builtin_ia32_pause();
    }
    const std::size_t n = header >> 32;
    std::memcpy(payload, in->data + ((head + 8) & (capacity - 1)), n);
    const std::uint64_t from = head;
    head += rounded(n);
    if (p == Protocol::lines) {
      for (std::uint64_t line = (from + 63) & ~std::uint64_t{63}; line < head; line += 64) __atomic_store_n(word_at(in, line), 0, __ATOMIC_RELAXED);
    }
    in->head.store(head, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    (void)in->writer_waiting.load(std::memory_order_relaxed);
  }
};

double half_round_trip_us(Protocol p, std::size_t n, int trips, int cpu_a, int cpu_b) {
  auto a = std::make_unique<Ring>();
  auto b = std::make_unique<Ring>();
  std::thread echo([&] {
    pin(cpu_b);
    Side s{a.get(), b.get()};
    std::vector<unsigned char> buffer(n + 8);
    for (int i = 0; i < trips; ++i) {
      s.receive(p, buffer.data());
      s.send(p, buffer.data(), n);
    }
  });
  pin(cpu_a);
  Side s{b.get(), a.get()};
  std::vector<unsigned char> buffer(n + 8, 1);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < trips; ++i) {
    s.send(p, buffer.data(), n);
    s.receive(p, buffer.data());
  }
  const auto end = std::chrono::steady_clock::now();
  echo.join();
  return std::chrono::duration<double, std::micro>(end - start).count() / trips / 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::size_t n = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 48;
  const int trips = argc > 2 ? std::atoi(argv[2]) : 200000;
  const int cpu_a = argc > 3 ? std::atoi(argv[3]) : 0;
  const int cpu_b = argc > 4 ? std::atoi(argv[4]) : 1;
  if (n == 0 || n > 65536) {
    std::fprintf(stderr, "usage: ring-arrival-ceiling [PAYLOAD_BYTES (1-65536) [ROUND_TRIPS [CPU_A CPU_B]]]\n");
    return 2;
  }
  std::vector<double> times[4];
  for (int run = 0; run < 5; ++run) {
    for (int p = 0; p < 4; ++p) times[p].push_back(half_round_trip_us(static_cast<Protocol>(p), n, trips, cpu_a, cpu_b));
  }
  std::printf("%zu B payload, half round trip (us), median [min, max] of 5:", n);
  for (int p = 0; p < 4; ++p) {
    std::sort(times[p].begin(), times[p].end());
    std::printf(" %s %.3f [%.3f, %.3f]", names[p], times[p][2], times[p][0], times[p][4]);
  }
  std::printf("\n");
}
