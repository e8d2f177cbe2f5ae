#pragma once
// One direction of one pair of ranks on a host: a byte ring in shared memory, in a segment the receiver
// creates (segment.hpp). Every shared word has one writer: `tail` (bytes ever written) the sender's,
// `head` (bytes ever consumed) and `sleeping` the receiver's; each sits on a cache line of its own, so
// that the two sides never write the same line. The counters only grow (64 bits do not wrap in any
// job's life); the capacity is a power of two, so a position is `counter & (capacity - 1)`.
//
// Visibility: data, then `tail` with release; the reader loads `tail` with acquire, then the data. The
// same for `head` and the space it frees. Waking, both ways the same (Dekker: of two sides that each
// store, fence, then load, one sees the other's store, so nobody waits for a wake-up that is never sent):
//   data:  a receiver about to sleep stores sleeping = 1, then looks at `tail` once more; a sender
//          stores `tail`, then loads `sleeping`, and signals the receiver's eventfd when it is 1;
//   room:  a sender about to sleep with a write it could not finish stores writer_waiting = 1, then
//          looks at `head` (and `referenced_read`) once more; a receiver stores `head` (or
//          `referenced_read`), then loads writer_waiting, and signals the sender's eventfd when it is 1.
//
// Records. The bytes in the ring are records, each an 8-byte header (`RecordHeader`) and then:
//   inline:    `length` bytes of the stream, in the ring;
//   reference: 16 bytes, an address and a length in the sender's memory: the receiver copies them
//              straight into its read (process_vm_readv, one copy: "single copy", CMA) and counts them
//              in `referenced_read`; the sender keeps them alive (its send lent) until that word passes them;
//   padding:   `length` bytes (0 to 63) that carry nothing: they put the inline record after them where
//              its large piece sits in the ring as far into its cache lines as its source sits in its own
//              (record_padding). The ring's lines are in the reader's cache; glibc's memcpy writes whole
//              lines without fetching them only between buffers placed alike (copy.hpp): 256 KiB took
//              7.7 us alike and 38.2 us with the source 16 bytes off on the AMD EPYC machines, the same
//              either way on an Intel Xeon (bench/RESULTS.md, "Ring records placed alike").
// A sender publishes a header with its whole record (never half a header), so a reader that sees fewer
// bytes than a header waits. Reference records are sent only to a receiver that said at connect time it
// can read the sender's memory (docs/PROTOCOL.md, "Link offer"); any other gets inline records only.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "transports/shm/copy.hpp"

namespace weft::shm {

// Copies between a ring's bytes at position `at` (wrapping at `capacity`) and flat memory, in memcpy
// calls of at most 256 KiB (copy.hpp's copy_in_pieces: a larger one leaves rep movsb and writes lines
// out of the caches, the reader's and the writer's). (Not copy_to_shared's non-temporal stores: tried
// here on 2026-12-01, they made streams of 1-4 MiB 1.1-1.2x slower, the reader fetching from memory while
// the writer goes on.)
inline void copy_into_ring(std::byte* ring, std::size_t capacity, std::size_t at, const void* from, std::size_t n) noexcept {
  const std::size_t first = n < capacity - at ? n : capacity - at;
  copy_in_pieces(ring + at, from, first);
  if (n > first) copy_in_pieces(ring, static_cast<const std::byte*>(from) + first, n - first);
}
inline void copy_from_ring(const std::byte* ring, std::size_t capacity, std::size_t at, void* to, std::size_t n) noexcept {
  const std::size_t first = n < capacity - at ? n : capacity - at;
  copy_in_pieces(to, ring + at, first);
  if (n > first) copy_in_pieces(static_cast<std::byte*>(to) + first, ring, n - first);
}

// This side's store to its own word, then a full fence: of two sides that each do this and then load the
// other's word, at least one sees the other's store (Dekker, the comment above). Every wake-up decision
// of the ring goes through it.
template <class T>
inline void store_and_fence(std::atomic<T>& word, T value, std::memory_order order) noexcept {
  word.store(value, order);
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

inline constexpr std::uint64_t ring_magic = 0x676e69722d746677ull;  // "wft-ring"
inline constexpr std::uint32_t ring_version = 3;  // 3: padding records

// A record's first 8 bytes: a marker (catches a reader out of step with its writer at once), the kind,
// and for an inline or a padding record the length of what follows.
enum class RecordKind : std::uint8_t { inline_bytes = 1, reference = 2, padding = 3 };
inline constexpr std::uint16_t record_marker = 0x7772;  // "rw"
inline constexpr std::size_t record_header_bytes = 8;
inline constexpr std::size_t reference_record_bytes = record_header_bytes + 16;
// A padding record's bytes after its header: at most this many (a cache line less one).
inline constexpr std::uint32_t padding_most = 63;
// An inline record is placed alike (padding before it) when a piece of at least this many bytes is in it:
// below, the lines fetched cost less than the padding's header read and written.
inline constexpr std::size_t align_records_from = 4096;

// The bytes of a padding record (0: none; else its header and 0-63 bytes, 8 to 71 in all) that put a
// byte which would land at ring position `position` as far into its cache line as `source` is into
// its own. `position` counts the padding's place too: the byte lands at position + the result.
inline std::size_t record_padding(std::uint64_t position, const void* source) noexcept {
  const auto off = static_cast<std::size_t>((reinterpret_cast<std::uintptr_t>(source) - position) & 63);
  if (off == 0) return 0;
  return off >= record_header_bytes ? off : off + 64;
}

struct RecordHeader {
  RecordKind kind{};
  std::uint32_t length = 0;  // inline: the bytes that follow
};
inline void encode_record_header(std::byte* out, RecordHeader h) noexcept {
  const std::uint16_t marker = record_marker;
  std::memcpy(out, &marker, 2);
  out[2] = static_cast<std::byte>(h.kind);
  out[3] = std::byte{0};
  std::memcpy(out + 4, &h.length, 4);
}
// False when the bytes are no record header (a broken or hostile writer).
inline bool decode_record_header(const std::byte* in, RecordHeader& h) noexcept {
  std::uint16_t marker = 0;
  std::memcpy(&marker, in, 2);
  const auto kind = static_cast<std::uint8_t>(in[2]);
  if (marker != record_marker || in[3] != std::byte{0} || kind < 1 || kind > 3) return false;
  h.kind = static_cast<RecordKind>(kind);
  std::memcpy(&h.length, in + 4, 4);
  return true;
}

struct alignas(64) RingControl {
  // Written once by the receiver when it makes the segment, before the segment is passed on.
  std::uint64_t magic = 0;
  std::uint32_t version = 0;
  std::uint32_t capacity_log2 = 0;
  alignas(64) std::atomic<std::uint64_t> tail{0};      // sender
  alignas(64) std::atomic<std::uint32_t> writer_waiting{0};  // sender: 1 while it sleeps on a full ring
  alignas(64) std::atomic<std::uint64_t> head{0};      // receiver
  alignas(64) std::atomic<std::uint32_t> sleeping{1};  // receiver: 1 while its loop may sleep (starts 1)
  alignas(64) std::atomic<std::uint64_t> referenced_read{0};  // receiver: bytes of reference records read
  alignas(64) std::byte data[1];                       // capacity bytes from here
};

// Bytes a segment holding a ring of `capacity` bytes needs.
constexpr std::size_t ring_segment_bytes(std::size_t capacity) noexcept { return offsetof(RingControl, data) + capacity; }

// The sender's side of a ring.
class RingWriter {
 public:
  RingWriter() = default;
  explicit RingWriter(RingControl* ring) noexcept
      : ring_(ring),
        capacity_(std::size_t{1} << ring->capacity_log2),
        tail_(ring->tail.load(std::memory_order_relaxed)),
        head_seen_(ring->head.load(std::memory_order_acquire)) {}

  // Copies as much of [data, data + size) as the ring has room for; returns how much. Not yet visible:
  // publish() makes it so.
  std::size_t put(const void* data, std::size_t size) noexcept {
    const std::size_t free = room(size);
    const std::size_t n = size < free ? size : free;
    if (n == 0) return 0;
    copy_into_ring(ring_->data, capacity_, static_cast<std::size_t>(tail_) & (capacity_ - 1), data, n);
    tail_ += n;
    return n;
  }
  // As put(), for bytes the caller knows fit (it asked room() for all of them): no look at the peer's
  // `head` per piece.
  void put_fitting(const void* data, std::size_t size) noexcept {
    copy_into_ring(ring_->data, capacity_, static_cast<std::size_t>(tail_) & (capacity_ - 1), data, size);
    tail_ += size;
  }
  // Where the next byte put goes: bytes ever written (its place in the ring is this mod the capacity).
  std::uint64_t position() const noexcept { return tail_; }
  // Makes what put() copied visible; true when the receiver may be asleep (signal it).
  bool publish() noexcept {
    store_and_fence(ring_->tail, tail_, std::memory_order_release);
    return ring_->sleeping.load(std::memory_order_relaxed) != 0;
  }
  // The sender's sleep announcement while a write waits for room: true when room came meanwhile.
  bool arm_wait() noexcept {
    store_and_fence(ring_->writer_waiting, std::uint32_t{1}, std::memory_order_relaxed);
    return !full();
  }
  void disarm_wait() noexcept { ring_->writer_waiting.store(0, std::memory_order_relaxed); }
  // The sender's sleep announcement while a write waits for the receiver to read its reference
  // records: true when it has read up to `issued` meanwhile.
  bool arm_wait_referenced(std::uint64_t issued) noexcept {
    store_and_fence(ring_->writer_waiting, std::uint32_t{1}, std::memory_order_relaxed);
    return referenced_read() >= issued;
  }
  // Bytes of reference records the receiver has read (its word: a value beyond what was issued only
  // completes the write early, which harms nobody but the liar).
  std::uint64_t referenced_read() const noexcept { return ring_->referenced_read.load(std::memory_order_acquire); }
  bool full() const noexcept { return room() == 0; }
  // Bytes that may be written now, at least `wanted` when the ring has that much room: the receiver's
  // `head` is loaded only when the room last seen holds less. That line is the receiver's, written at
  // every read, so a load of it per message was a transfer between the cores each way (the reader's next
  // store fetches it back). The room seen only grows, so an old one is never too much. With no `wanted`,
  // always loaded (a sleep's last look, a write that takes all it can). The peer's word is not trusted: a
  // head behind what was written, or ahead of it, gives no room (never more than the capacity, whatever
  // the counters say).
  std::size_t room(std::size_t wanted = SIZE_MAX) const noexcept {
    const std::size_t seen = room_after(head_seen_);
    if (seen >= wanted) return seen;
    head_seen_ = ring_->head.load(std::memory_order_acquire);
    return room_after(head_seen_);
  }
  explicit operator bool() const noexcept { return ring_ != nullptr; }

 private:
  std::size_t room_after(std::uint64_t head) const noexcept {
    const std::uint64_t used = tail_ - head;
    return used <= capacity_ ? capacity_ - static_cast<std::size_t>(used) : 0;
  }

  RingControl* ring_ = nullptr;
  std::size_t capacity_ = 0;
  std::uint64_t tail_ = 0;  // the sender's own copy: only it writes tail
  mutable std::uint64_t head_seen_ = 0;  // the receiver's head when last loaded (room())
};

// The receiver's side of a ring.
class RingReader {
 public:
  RingReader() = default;
  explicit RingReader(RingControl* ring) noexcept
      : ring_(ring), capacity_(std::size_t{1} << ring->capacity_log2), head_(ring->head.load(std::memory_order_relaxed)) {}

  // Bytes written and not read yet.
  // Bytes written and not read yet, never more than the capacity: a hostile or broken writer's tail
  // (behind the reader, or too far ahead) yields at most a ring of garbage, which the framing above
  // refuses, never a read outside the ring.
  std::size_t available() const noexcept {
    const std::uint64_t have = ring_->tail.load(std::memory_order_acquire) - head_;
    return have <= capacity_ ? static_cast<std::size_t>(have) : capacity_;
  }
  // Copies up to `size` available bytes to `dst` (null: drops them); returns how many. The space is
  // handed back to the sender by release().
  std::size_t take(void* dst, std::size_t size) noexcept {
    const std::size_t have = available();
    const std::size_t n = size < have ? size : have;
    if (n == 0) return 0;
    if (dst) copy_from_ring(ring_->data, capacity_, static_cast<std::size_t>(head_) & (capacity_ - 1), dst, n);
    head_ += n;
    return n;
  }
  // Copies `size` bytes at the reader's position without taking them; false when fewer are there.
  bool peek(void* dst, std::size_t size) const noexcept {
    if (available() < size) return false;
    copy_from_ring(ring_->data, capacity_, static_cast<std::size_t>(head_) & (capacity_ - 1), dst, size);
    return true;
  }
  // The `size` available bytes `offset` past the reader's position, where they lie in one piece in the
  // ring; null when they do not (fewer available, or they wrap past its end). Still the writer's memory:
  // a hostile one may change them while they are read, so copy what decides anything first.
  const std::byte* view(std::size_t offset, std::size_t size) const noexcept {
    if (available() < offset + size) return nullptr;
    const std::size_t at = static_cast<std::size_t>(head_ + offset) & (capacity_ - 1);
    return at + size <= capacity_ ? ring_->data + at : nullptr;
  }
  // Hands the bytes taken back to the sender. True when the sender sleeps waiting for room (signal it).
  bool release() noexcept {
    store_and_fence(ring_->head, head_, std::memory_order_release);
    return ring_->writer_waiting.load(std::memory_order_relaxed) != 0;
  }
  // Tells the sender how many bytes of its reference records this receiver has read in all. True when
  // the sender sleeps waiting for it (signal it).
  bool referenced(std::uint64_t total) noexcept {
    store_and_fence(ring_->referenced_read, total, std::memory_order_release);
    return ring_->writer_waiting.load(std::memory_order_relaxed) != 0;
  }
  std::size_t capacity() const noexcept { return capacity_; }

  // The receiver's sleep announcement (RingControl's comment): arm() returns true when data came.
  bool arm() noexcept {
    store_and_fence(ring_->sleeping, std::uint32_t{1}, std::memory_order_relaxed);
    return available() > 0;
  }
  void disarm() noexcept { ring_->sleeping.store(0, std::memory_order_relaxed); }
  explicit operator bool() const noexcept { return ring_ != nullptr; }

 private:
  RingControl* ring_ = nullptr;
  std::size_t capacity_ = 0;
  std::uint64_t head_ = 0;  // the receiver's own copy: only it writes head
};

}  // namespace weft::shm
