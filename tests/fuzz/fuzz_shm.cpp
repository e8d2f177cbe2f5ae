// libFuzzer harness: a hostile peer on the same host writing garbage into a shared-memory ring. Rank 0's
// FramedTransport reads "rank 1" through a real ShmStream whose inbound ring the input fills: the input
// is a script of writes (raw bytes at the writer's position) and of tail stores (any 64-bit value,
// behind the reader or far ahead of it), with a few receives posted and others made as the bytes come
// (Transport::recv_now, which walks the ring's next frames itself). Whatever it says, nothing may read
// or write outside the ring (ASan), allocations stay bounded (early messages: 1 MiB), and once the
// peer's socket ends every receive has completed (nothing hangs). The group arena's header check is fed
// the same bytes (Arena::adopt on a segment whose header they make).
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "core/log.hpp"
#include "transports/framed/framed_transport.hpp"
#include "transports/shm/arena.hpp"
#include "transports/shm/ring.hpp"
#include "transports/shm/segment.hpp"
#include "transports/shm/shm_stream.hpp"
#include "weft/loop.hpp"

using namespace weft;

namespace {

void drain(asio::io_context& io, Loop& loop) {
  for (int round = 0; round < 64; ++round) {
    loop.poll_memory();
    if (io.poll() == 0) break;
  }
  io.restart();
}

// The next (up to) 8 bytes of the input, little-endian.
std::uint64_t take_u64(const std::uint8_t*& p, const std::uint8_t* end) {
  std::uint64_t v = 0;
  for (int i = 0; i < 8 && p < end; ++i) v |= static_cast<std::uint64_t>(*p++) << (8 * i);
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static asio::io_context io;
  static Loop loop(io);
  static const bool quiet = [] {
    log().set_level(spdlog::level::off);
    return true;
  }();
  (void)quiet;
  constexpr std::size_t capacity = 4096;

  {
    // The arena's header from the input: refused or accepted, never mapped past its segment.
    shm::Segment segment = shm::Segment::create(1 << 16, "fuzz-arena");
    std::memcpy(segment.data(), data, std::min<std::size_t>(size, sizeof(shm::ArenaHeader)));
    try {
      auto arena = shm::Arena::adopt(::dup(segment.fd()), 2, 1);
      (void)arena->reached();
    } catch (const std::exception&) {
    }
  }

  auto hub = ShmHub::create(loop);
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 0;
  shm::Segment inbound = shm::make_ring(capacity);
  shm::Segment outbound = shm::make_ring(capacity);
  auto* ring = static_cast<shm::RingControl*>(inbound.data());
  // The hostile peer also rewrites the ring's size in the control after it was made and checked: the
  // stream must keep to the segment's own size (segment.hpp, ring_capacity).
  ring->capacity_log2 = 40;
  ShmStream::Link link{std::move(inbound), std::move(outbound), ::dup(hub->wake_fd()), sv[0]};

  std::vector<asio::ip::tcp::socket> sockets;
  sockets.emplace_back(io);
  sockets.emplace_back(io);
  auto transport = std::make_unique<FramedTransport>(
      loop, 0, 2, std::move(sockets), "shm",
      [&](asio::ip::tcp::socket, StreamEvents* events, int peer, std::weak_ptr<bool> alive) {
        return ShmStream::make(hub, std::move(link), events, peer, std::move(alive));
      });
  transport->set_early_limit(1 << 20);
  transport->open_context(1, {0, 1});

  // A few receives, their sizes from the input's first bytes: two of key 0, one of key 1.
  std::vector<std::unique_ptr<TransportOp>> ops;
  std::vector<std::vector<std::byte>> buffers;
  const std::uint8_t* p = data;
  const std::uint8_t* end = data + size;
  for (int i = 0; i < 3 && p + 2 <= end; ++i) {
    const std::size_t bytes = (static_cast<std::size_t>(p[0]) | static_cast<std::size_t>(p[1]) << 8) % 8192;
    p += 2;
    buffers.emplace_back(bytes);
    ops.push_back(std::make_unique<TransportOp>());
    transport->start_recv(1, MessageKey{1, static_cast<std::uint64_t>(i / 2), 0}, buffers.back().data(), bytes, *ops.back());
  }

  // The hostile writer's script: 0 = write the next n bytes as they are at its position, the first 8 of
  // them (when it is at a multiple of 8) stored last with release, as a header is; 1 = move its position
  // anywhere; 2 = write the next n bytes as one well-formed inline record (so that the frames behind the
  // records are reached too); 3 = the same as a frame record (the first 24 of them its short header,
  // n of at least 24 unless the input ends); 5 = a receive that takes its message now if it is there
  // (recv_now: a key from 0 to 3, a size); else = let the reader run.
  std::uint64_t position = 0;
  const auto at = [&](std::uint64_t p) { return ring->data + (static_cast<std::size_t>(p) & (capacity - 1)); };
  while (p < end) {
    const std::uint8_t what = *p++ % 6;
    if ((what == 2 || what == 3) && p < end) {
      const bool frame = what == 3;
      const std::size_t wanted = *p++ + (frame ? 24 : 0);
      const std::size_t n = std::min({wanted, static_cast<std::size_t>(end - p), capacity - 2 * shm::record_header_bytes});
      position = (position + 7) & ~std::uint64_t{7};
      shm::copy_into_ring(ring->data, capacity, static_cast<std::size_t>(position + shm::record_header_bytes) & (capacity - 1), p, n);
      p += n;
      const std::uint64_t next = position + shm::record_bytes(0, n);
      shm::store_ring_word(at(next), 0, __ATOMIC_RELAXED);
      const shm::RecordKind kind = frame ? shm::RecordKind::frame : shm::RecordKind::inline_bytes;
      shm::store_ring_word(at(position), shm::encode_record_header({kind, 0, static_cast<std::uint32_t>(n)}), __ATOMIC_RELEASE);
      position = next;
    } else if (what == 0 && p < end) {
      const std::size_t wanted = *p++;
      const std::size_t n = std::min({wanted, static_cast<std::size_t>(end - p), capacity});
      if (position % 8 == 0 && n >= 8) {
        std::uint64_t first;
        std::memcpy(&first, p, 8);
        shm::copy_into_ring(ring->data, capacity, static_cast<std::size_t>(position + 8) & (capacity - 1), p + 8, n - 8);
        shm::store_ring_word(at(position), first, __ATOMIC_RELEASE);
      } else {
        shm::copy_into_ring(ring->data, capacity, static_cast<std::size_t>(position) & (capacity - 1), p, n);
      }
      p += n;
      position += n;
    } else if (what == 1) {
      position = take_u64(p, end);
    } else if (what == 5 && p + 3 <= end) {
      static std::byte now[8192];
      const std::size_t bytes = (static_cast<std::size_t>(p[1]) | static_cast<std::size_t>(p[2]) << 8) % sizeof now;
      (void)transport->recv_now(1, MessageKey{1, static_cast<std::uint64_t>(p[0] % 4), 0}, now, bytes);
      p += 3;
    }
    drain(io, loop);
  }
  // The peer goes: every receive must complete.
  ::close(sv[1]);
  for (int round = 0; round < 1000; ++round) {
    drain(io, loop);
    bool all = true;
    for (const auto& op : ops) all = all && op->done();
    if (all) break;
  }
  for (const auto& op : ops) {
    if (!op->done()) __builtin_trap();  // a receive hangs after the peer's end
  }
  transport.reset();
  hub.reset();
  drain(io, loop);
  return 0;
}
