#pragma once
// One direction of one pair of ranks on a host: a ring of records in shared memory, in a segment the
// receiver creates (segment.hpp). Every shared word has one writer: the records the sender's, `head`
// (bytes ever consumed), `sleeping` and `referenced_read` the receiver's, `writer_waiting` the sender's;
// each word sits on a cache line of its own, so that the two sides never write the same line. The
// counters only grow (64 bits do not wrap in any job's life); the capacity is a power of two, so a
// position is `counter & (capacity - 1)`.
//
// Arrival is seen on the record's own cache line (ring version 4, 2026-12-03). Records start at
// multiples of 8 bytes, and a sender writes one batch of records (what one publish() makes visible) as:
// every byte but the first record's 8-byte header; then zero at the 8 bytes after the batch (where the
// next batch's header will go); then that first header with release. A reader at a record's start loads
// its header with acquire: zero is "nothing yet"; anything else was published with its whole batch, the
// records behind it and the zero after them included. Until version 3 the sender published a `tail`
// counter on a line of its own: the reader then fetched two lines from the writer's core per message
// (the counter, then the record), one after the other; now one (bench/ceiling/ring_arrival_ceiling.cpp:
// 0.42 against 0.30 us a message at 48-byte payloads on the AMD EPYC here; bench/RESULTS.md, "Arrival on
// the record's line"). The 8 bytes after the last record must be free for that zero: the writer's room
// is the capacity less 8, less what the reader has not consumed.
//
// Visibility: records, then the batch's first header with release; the reader loads a header with
// acquire, then the record. The same for `head` and the space it frees. Waking, both ways the same
// (Dekker: of two sides that each store, fence, then load, one sees the other's store, so nobody waits
// for a wake-up that is never sent):
//   data:  a receiver about to sleep stores sleeping = 1, then loads the header at its position once
//          more; a sender stores the batch's header, then loads `sleeping`, and signals the receiver's
//          eventfd when it is 1;
//   room:  a sender about to sleep with a write it could not finish stores writer_waiting = 1, then
//          looks at `head` (and `referenced_read`) once more; a receiver stores `head` (or
//          `referenced_read`), then loads writer_waiting, and signals the sender's eventfd when it is 1.
//
// Records. Each is an 8-byte header (`RecordHeader`) and then:
//   inline:    `lead` bytes that carry nothing (0 to 63), then `length` bytes of the stream. The lead
//              puts a large piece of the record as far into its cache lines in the ring as its source
//              sits in its own (record_lead). The ring's lines are in the reader's cache; glibc's memcpy
//              writes whole lines without fetching them only between buffers placed alike (copy.hpp):
//              256 KiB took 7.7 us alike and 38.2 us with the source 16 bytes off on the AMD EPYC
//              machines, the same either way on an Intel Xeon (bench/RESULTS.md, "Ring records placed
//              alike");
//   reference: 16 bytes, an address and a length in the sender's memory: the receiver copies them
//              straight into its read (process_vm_readv, one copy: "single copy", CMA) and counts them
//              in `referenced_read`; the sender keeps them alive (its send lent) until that word passes them;
//   frame:     one whole data frame with its header in the short form (wire.hpp, 24 bytes) and then its
//              payload, `length` bytes in all (at least the short header), then a pad of 0 to 63 bytes
//              that carry nothing: the stream's bytes are the long header that form stands for and the
//              payload (ring version 6, 2026-12-06). The pad ends the record at a cache line's end, so
//              that frame records after one another each start a line: a message of up to 32 bytes is
//              then one line with its headers (the long header put 16-32 bytes on two), where 40-byte
//              records one after the other would put every other one across two.
// A record takes record_bytes(spare, length) of the ring: rounded up to 8, so that the next starts at a
// multiple of 8 (its header one aligned word, never split by the ring's end). Reference records are sent
// only to a receiver that said at connect time it can read the sender's memory (docs/PROTOCOL.md, "Link
// offer"); any other gets inline records only. The reader trusts nothing of a record but where it
// starts: lengths that do not fit the ring fail the connection above (shm_stream.cpp), and no copy here
// goes outside the ring whatever a header says.
#include <algorithm>
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

// Asks for the cache line at `at` in a state this core may write, without waiting for it: x86's
// prefetchw (Intel processors before Broadwell execute it as a NOP), elsewhere the compiler's prefetch.
inline void prefetch_for_writing(const void* at) noexcept {
#if defined(__x86_64__)
  asm volatile("prefetchw %0" : : "m"(*static_cast<const char*>(at)));
#else
  __builtin_prefetch(at, 1, 3);
#endif
}

inline constexpr std::uint64_t ring_magic = 0x676e69722d746677ull;  // "wft-ring"
// 4: arrival on the record's line, records at multiples of 8; 6: frame records (5: a rewind record, tried
// and never shipped).
inline constexpr std::uint32_t ring_version = 6;

// A record's first 8 bytes: a marker (catches a reader out of step with its writer at once, and is never
// zero, which is "nothing yet"), the kind, its spare bytes (an inline record's lead, a frame record's pad;
// 0 for a reference), and the length: of the stream's bytes in an inline record, of the short header and
// the payload in a frame record.
enum class RecordKind : std::uint8_t { inline_bytes = 1, reference = 2, frame = 3 };
inline constexpr std::uint16_t record_marker = 0x7772;  // "rw"
inline constexpr std::size_t record_header_bytes = 8;
inline constexpr std::size_t reference_record_bytes = record_header_bytes + 16;
// Records start at multiples of this.
inline constexpr std::size_t record_alignment = 8;
// A cache line (x86-64's): a frame record's pad ends it at a multiple of this.
inline constexpr std::size_t cache_line_bytes = 64;
// A record's spare bytes (an inline record's lead, a frame record's pad): at most this many (a cache line
// less one).
inline constexpr std::uint32_t lead_most = 63;
// An inline record is placed alike (a lead before its bytes) when a piece of at least this many bytes is
// in it: below, the lines fetched cost less than the lead's bytes.
inline constexpr std::size_t align_records_from = 4096;
// The most of the ring one inline record takes: a quarter. A write larger than that goes as several
// records, each made visible as soon as it is written, and the reader hands back the space of each
// eighth of the ring it has read without waiting for its read to end, so that the two copy at once.
// With one record filling the free ring, the writer waited while the reader copied it and the reader
// while the writer filled it again: streams of messages as large as the ring ran at half the speed of
// smaller ones (1 MiB ring, 2 ranks, AMD EPYC: 1 MiB messages 17.7 GB/s against 28.5 at 512 KiB;
// bench/RESULTS.md, "Writes larger than the ring, in pieces").
inline constexpr std::size_t record_share_of_ring = 4;
inline constexpr std::size_t release_share_of_ring = 8;

// The ring bytes a record takes: its header, spare bytes and bytes, rounded up to record_alignment.
constexpr std::size_t record_bytes(std::size_t spare, std::size_t length) noexcept {
  return (record_header_bytes + spare + length + record_alignment - 1) & ~(record_alignment - 1);
}

// The lead (0 to 63) that puts a byte which would land at ring position `position` (with no lead) as
// far into its cache line as `source` is into its own: the byte lands at position + the result.
inline std::size_t record_lead(std::uint64_t position, const void* source) noexcept {
  return static_cast<std::size_t>((reinterpret_cast<std::uintptr_t>(source) - position) & 63);
}

struct RecordHeader {
  RecordKind kind{};
  // Bytes of the record that carry nothing (0 to 63): an inline record's lead, before the stream's bytes;
  // a frame record's pad, after its bytes, that ends it at a cache line's end.
  std::uint8_t spare = 0;
  std::uint32_t length = 0;  // inline: the stream's bytes that follow the lead; frame: the bytes before the pad
};
inline std::uint64_t encode_record_header(RecordHeader h) noexcept {
  std::byte out[record_header_bytes];
  const std::uint16_t marker = record_marker;
  std::memcpy(out, &marker, 2);
  out[2] = static_cast<std::byte>(h.kind);
  out[3] = static_cast<std::byte>(h.spare);
  std::memcpy(out + 4, &h.length, 4);
  std::uint64_t word;
  std::memcpy(&word, out, sizeof word);
  return word;
}
// False when the word is no record header (a broken or hostile writer).
inline bool decode_record_header(std::uint64_t word, RecordHeader& h) noexcept {
  std::byte in[record_header_bytes];
  std::memcpy(in, &word, sizeof word);
  std::uint16_t marker = 0;
  std::memcpy(&marker, in, 2);
  const auto kind = static_cast<std::uint8_t>(in[2]);
  const auto spare = static_cast<std::uint8_t>(in[3]);
  if (marker != record_marker || kind < 1 || kind > 3) return false;
  if (spare > (kind == 2 ? 0 : lead_most)) return false;
  h.kind = static_cast<RecordKind>(kind);
  h.spare = spare;
  std::memcpy(&h.length, in + 4, 4);
  return true;
}

struct alignas(64) RingControl {
  // Written once by the receiver when it makes the segment, before the segment is passed on. Checked
  // once by the writer (adopt_ring) and then not read again: a peer can rewrite them at any time.
  std::uint64_t magic = 0;
  std::uint32_t version = 0;
  std::uint32_t capacity_log2 = 0;
  alignas(64) std::atomic<std::uint32_t> writer_waiting{0};  // sender: 1 while it sleeps on a full ring
  alignas(64) std::atomic<std::uint64_t> head{0};      // receiver
  alignas(64) std::atomic<std::uint32_t> sleeping{1};  // receiver: 1 while its loop may sleep (starts 1)
  alignas(64) std::atomic<std::uint64_t> referenced_read{0};  // receiver: bytes of reference records read
  alignas(64) std::byte data[1];                       // capacity bytes from here (zero in a new segment)
};

// Bytes a segment holding a ring of `capacity` bytes needs.
constexpr std::size_t ring_segment_bytes(std::size_t capacity) noexcept { return offsetof(RingControl, data) + capacity; }

// The 8-byte word at a ring position (a multiple of 8): a header, or zero. The builtins rather than
// std::atomic_ref: the ring's bytes are not objects of one type (TSan sees these accesses all the same).
inline std::uint64_t load_ring_word(const std::byte* at) noexcept {
  return __atomic_load_n(reinterpret_cast<const std::uint64_t*>(at), __ATOMIC_ACQUIRE);
}
inline void store_ring_word(std::byte* at, std::uint64_t word, int order) noexcept {
  __atomic_store_n(reinterpret_cast<std::uint64_t*>(at), word, order);
}

// This process's first access to every page of a ring's bytes, made at set-up rather than by the first
// lap of messages. On the VMs here (a hypervisor with shadow page tables) a process's first write to a
// page through its own mapping costs 4.5-6.5 us and its first read 1.7-4.3 us, once per page and
// mapping, whoever wrote the page before and whether or not the mapping was populated (MAP_POPULATE,
// MADV_POPULATE_WRITE: the kernel's own fill does not count): a ping-pong of 8 bytes took 0.49 us a
// message through a 1 MiB ring's first lap (16,384 records) and 0.34 from the second on
// (bench/RESULTS.md, "A ring's first lap"; bench/ceiling/page_touch_ceiling.cpp). `for_writing`: the
// sender's touch, an atomic add of zero (a write that changes nothing, whatever the word holds); else the
// receiver's, a load. `capacity`: the one the side read when it was made (the word in the segment is the
// peer's to change). Elsewhere it costs a pass over one word a page.
inline void touch_pages(std::byte* data, std::size_t capacity, std::size_t page_bytes, bool for_writing) noexcept {
  if (page_bytes < 8) page_bytes = 4096;
  std::uint64_t seen = 0;
  const auto touch = [&](std::size_t at) {  // at: a multiple of 8 inside the ring
    auto* word = reinterpret_cast<std::uint64_t*>(data + at);
    if (for_writing) {
      __atomic_fetch_add(word, 0, __ATOMIC_RELAXED);
    } else {
      seen += __atomic_load_n(word, __ATOMIC_RELAXED);
    }
  };
  for (std::size_t at = 0; at < capacity; at += page_bytes) touch(at);
  touch(capacity - 8);  // the last page, which the ring's bytes reach only partly (they start past the control)
  asm volatile("" : : "r"(seen));  // the loads are made
}

// The sender's side of a ring. A batch is what put_header, put_fitting and skip wrote since the last
// publish(): records, each begun by put_header and its bytes wholly written before the next begins.
class RingWriter {
 public:
  RingWriter() = default;
  // Writes from the reader's position: the ring must hold nothing unread (a new ring, or a test that
  // plays the writer of a ring whose real writer is quiet). `capacity`: the ring's bytes as its segment's
  // size says (segment.hpp, ring_capacity), never the control's word, which the peer can rewrite after it
  // was checked.
  RingWriter(RingControl* ring, std::size_t capacity) noexcept
      : ring_(ring),
        capacity_(capacity),
        head_seen_(ring->head.load(std::memory_order_acquire)),
        tail_(head_seen_),
        batch_start_(tail_) {}

  // Begins a record at the writer's position (a multiple of 8): its header. The caller asked room() for
  // the whole record. The batch's first header is kept until publish() (the reader's sign of arrival).
  void put_header(RecordHeader h) noexcept { put_header_word(encode_record_header(h)); }
  void put_header_word(std::uint64_t word) noexcept {
    if (tail_ == batch_start_) {
      first_header_ = word;
    } else {
      store_ring_word(ring_->data + (static_cast<std::size_t>(tail_) & (capacity_ - 1)), word, __ATOMIC_RELAXED);
    }
    tail_ += record_header_bytes;
  }
  // The record's bytes, which the caller knows fit (it asked room() for all of them).
  void put_fitting(const void* data, std::size_t size) noexcept {
    copy_into_ring(ring_->data, capacity_, static_cast<std::size_t>(tail_) & (capacity_ - 1), data, size);
    tail_ += size;
  }
  // The record's next `size` bytes in place, where they lie in one piece in the ring (the caller asked
  // room() for them; null when they wrap past its end): the caller writes them, then skip()s them.
  std::byte* fitting_in_one_piece(std::size_t size) noexcept {
    const std::size_t at = static_cast<std::size_t>(tail_) & (capacity_ - 1);
    return size <= capacity_ - at ? ring_->data + at : nullptr;
  }
  // Bytes of the record passed over: a lead, which carries nothing, or bytes written in place.
  void skip(std::size_t size) noexcept { tail_ += size; }
  // Ends the record: the next starts at the next multiple of 8.
  void end_record() noexcept { tail_ = (tail_ + record_alignment - 1) & ~std::uint64_t{record_alignment - 1}; }
  // Where the next byte put goes: bytes ever written (its place in the ring is this mod the capacity).
  std::uint64_t position() const noexcept { return tail_; }
  // Makes the batch visible (the ring's comment: zero after it, then its first header); true when the
  // receiver may be asleep (signal it).
  bool publish() noexcept {
    if (tail_ == batch_start_) return false;
    store_ring_word(ring_->data + (static_cast<std::size_t>(tail_) & (capacity_ - 1)), 0, __ATOMIC_RELAXED);
    store_ring_word(ring_->data + (static_cast<std::size_t>(batch_start_) & (capacity_ - 1)), first_header_, __ATOMIC_RELEASE);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    const std::uint64_t batch = tail_ - batch_start_;
    batch_start_ = tail_;
    ask_for_next_batch(batch);
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
  // No room for the smallest record.
  bool full() const noexcept { return room() < record_bytes(0, 1); }
  // Bytes that may be written now (a multiple of 8), at least `wanted` when the ring has that much room:
  // the receiver's `head` is loaded only when the room last seen holds less. That line is the
  // receiver's, written at every read, so a load of it per message was a transfer between the cores each
  // way (the reader's next store fetches it back). The room seen only grows, so an old one is never too
  // much. With no `wanted`, always loaded (a sleep's last look, a write that takes all it can). The
  // peer's word is not trusted: a head behind what was written, or ahead of it, gives no room (never more
  // than the capacity less the 8 bytes the next header needs, whatever the counters say).
  std::size_t room(std::size_t wanted = SIZE_MAX) const noexcept {
    const std::size_t seen = room_after(head_seen_);
    if (seen >= wanted) return seen;
    head_seen_ = ring_->head.load(std::memory_order_acquire);
    return room_after(head_seen_);
  }
  explicit operator bool() const noexcept { return ring_ != nullptr; }
  std::size_t capacity() const noexcept { return capacity_; }
  // The sender's first write to every page of the ring, now (touch_pages).
  void touch_pages(std::size_t page_bytes) noexcept { shm::touch_pages(ring_->data, capacity_, page_bytes, true); }

 private:
  std::size_t room_after(std::uint64_t head) const noexcept {
    const std::uint64_t used = tail_ - head;
    const std::size_t most = capacity_ - record_alignment;
    return used <= most ? (most - static_cast<std::size_t>(used)) & ~(record_alignment - 1) : 0;
  }

  // Asks for the lines a next batch like the one just published (`batch` bytes) will take, for writing,
  // past its first two lines: a reader that keeps up polls the first and its prefetcher takes the next.
  // The batch's stores are visible to the reader only after the lines they go to came over from it (the
  // ring's lines stay in its cache from the lap before), and its header, stored last, after all of them:
  // with the lines here already, a 512 B-2 KiB message's header is out as soon as it is stored. Streams
  // of 512 B-2 KiB 0.66-0.89 of the time, ping-pong 0.84-0.96 (bench/RESULTS.md, "The ring's next lines
  // asked for early"); from 4 KiB (records placed alike, often in several batches) 0.93-1.23, and at
  // 128-256 B 1.02-1.12, so only between.
  void ask_for_next_batch(std::uint64_t batch) noexcept {
    if (batch < 512 || batch >= align_records_from) return;
    const std::uint64_t end = tail_ + std::min<std::uint64_t>(batch, room_after(head_seen_));  // never lines still unread
    for (std::uint64_t at = tail_ + 2 * cache_line_bytes; at < end; at += cache_line_bytes) {
      prefetch_for_writing(ring_->data + (static_cast<std::size_t>(at) & (capacity_ - 1)));
    }
  }

  RingControl* ring_ = nullptr;
  std::size_t capacity_ = 0;
  mutable std::uint64_t head_seen_ = 0;  // the receiver's head when last loaded (room())
  std::uint64_t tail_ = 0;         // bytes ever written, the unpublished batch included
  std::uint64_t batch_start_ = 0;  // where the unpublished batch starts (its first header goes last)
  std::uint64_t first_header_ = 0;
};

// The receiver's side of a ring. It reads records at its position: header() says whether one is there;
// the bytes of a record it returned are all there, and take, peek and view stay inside the ring whatever
// the record says.
class RingReader {
 public:
  RingReader() = default;
  // `capacity`: as RingWriter's.
  RingReader(RingControl* ring, std::size_t capacity) noexcept
      : ring_(ring), capacity_(capacity), head_(ring->head.load(std::memory_order_relaxed)), released_(head_) {}

  // The header word at the reader's position, which must be a record's start: 0 when nothing is there yet.
  std::uint64_t header() const noexcept { return header_at(0); }
  // The same `offset` bytes past it (a multiple of record_alignment: the word never straddles the ring's
  // end), where a record after the one there would start.
  std::uint64_t header_at(std::size_t offset) const noexcept {
    return load_ring_word(ring_->data + (static_cast<std::size_t>(head_ + offset) & (capacity_ - 1)));
  }
  // Copies `size` bytes (at most the capacity) from the reader's position to `dst` (null: drops them),
  // and passes them. The space is handed back to the sender by release().
  void take(void* dst, std::size_t size) noexcept {
    if (dst) copy_from_ring(ring_->data, capacity_, static_cast<std::size_t>(head_) & (capacity_ - 1), dst, size < capacity_ ? size : capacity_);
    head_ += size;
  }
  // Copies `size` bytes (at most the capacity) `offset` past the reader's position, without taking them.
  void peek(std::size_t offset, void* dst, std::size_t size) const noexcept {
    copy_from_ring(ring_->data, capacity_, static_cast<std::size_t>(head_ + offset) & (capacity_ - 1), dst, size < capacity_ ? size : capacity_);
  }
  // The `size` bytes `offset` past the reader's position where they lie in one piece in the ring; null
  // when they do not (they wrap past its end). Still the writer's memory: a hostile one may change them
  // while they are read, so copy what decides anything first.
  const std::byte* view(std::size_t offset, std::size_t size) const noexcept {
    const std::size_t at = static_cast<std::size_t>(head_ + offset) & (capacity_ - 1);
    return size <= capacity_ - at ? ring_->data + at : nullptr;
  }
  // Ends the record read: the reader's position moves to the next multiple of 8, the next record's start.
  void end_record() noexcept { head_ = (head_ + record_alignment - 1) & ~std::uint64_t{record_alignment - 1}; }
  // Hands the bytes taken back to the sender. True when the sender sleeps waiting for room (signal it).
  bool release() noexcept {
    released_ = head_;
    store_and_fence(ring_->head, head_, std::memory_order_release);
    return ring_->writer_waiting.load(std::memory_order_relaxed) != 0;
  }
  // Bytes taken since the last release().
  std::uint64_t unreleased() const noexcept { return head_ - released_; }
  // Tells the sender how many bytes of its reference records this receiver has read in all. True when
  // the sender sleeps waiting for it (signal it).
  bool referenced(std::uint64_t total) noexcept {
    store_and_fence(ring_->referenced_read, total, std::memory_order_release);
    return ring_->writer_waiting.load(std::memory_order_relaxed) != 0;
  }
  std::size_t capacity() const noexcept { return capacity_; }
  std::uint64_t position() const noexcept { return head_; }

  // The receiver's sleep announcement (RingControl's comment): arm() returns true when a record came.
  bool arm() noexcept {
    store_and_fence(ring_->sleeping, std::uint32_t{1}, std::memory_order_relaxed);
    return header() != 0;
  }
  void disarm() noexcept { ring_->sleeping.store(0, std::memory_order_relaxed); }
  explicit operator bool() const noexcept { return ring_ != nullptr; }

 private:
  RingControl* ring_ = nullptr;
  std::size_t capacity_ = 0;
  std::uint64_t head_ = 0;  // the receiver's own copy: only it writes head
  std::uint64_t released_ = 0;  // head_ at the last release()
};

}  // namespace weft::shm
