#pragma once
// The group arena: one shared segment that every rank of a group on one host maps, for the direct
// shared-memory collectives (group/shm_collectives.cpp). It knows nothing of collectives. It holds, per
// rank, a control line and two areas, and moves the ranks through supersteps, as a BSP machine does:
//
//   write into my area (the one of parity count % 2), publish (count + 1), wait until every rank's count
//   reached mine, read the other ranks' areas of that parity.
//
// Where the counts live: in each area's header, on the first cache line of the area (`published`: the
// count that made the area visible). A reader waits on the very line it then checks, and contents start
// right after the header, on that line: an 8-byte all_reduce costs a reader one line from each peer, not
// three (a count line, a header line, a data line), and contents below `placed_from` bytes go on over
// the lines after it, the next one being the header's 128-byte buddy, which the adjacent-line prefetcher
// brings with it (bench/RESULTS.md, "Contents right after the area's header": 64 B-512 B all_reduce
// 4-16 % and all_gather 13-24 % faster than when they started on the next line). Larger contents start on the next line, `skew` bytes
// into it (below 64, in the header): as far into its line as the writer's source is into its own, so that
// the copy in sits alike on both sides of every line and writes whole lines without fetching them from the
// readers' caches (copy.hpp: 512 KiB from a malloc'd buffer into an area took 82 us at skew 0 against 17
// at the source's).
//
// Why two areas and no "done reading" word: a rank reads parity b's areas between its wait for count
// x + 1 and its next publish (x + 2); a writer writes parity b again only at count x + 2, after it has
// waited for every rank to reach x + 2, so every reader has left. Every word has one writer (its rank);
// what a rank reads of another (counts, headers, data) only decides what it computes or reports, never
// an address or a length: a peer writing garbage gets garbage results or a mismatch error, no access
// outside the segment.
//
// Waking (ring.hpp's Dekker pair): a waiting rank about to sleep stores sleeping = 1, fences, and looks at
// the counts once more; a publishing rank stores its count (in the area's header), fences, and writes
// the eventfd of every peer whose sleeping word it finds set.
//
// Boxes (small broadcasts that do not wait for the readers, as vader's fast boxes): per rank a ring of
// `box_slots` slots. Box broadcasts take slots in turn, counted alike on every rank (one, or as many as
// their size needs: the contents of each after its header, which only the first uses): one starting at
// slot number b takes slots b, b + 1, ... (mod box_slots) of its root's box. The root waits only until
// every rank finished the slots' last use (`box_done`, per rank on a line of its own, counts the slots of
// the box broadcasts it finished), writes the contents and the first slot's header, stamps that slot
// b + 1 and goes on; a reader waits for that stamp, checks the header, copies and moves its own box_done
// past the slots. So a root runs up to box_slots slots ahead of its readers, and readers that get their
// core late take several broadcasts at once. Boxes and supersteps do not touch each other's
// words: each rank runs its arena collectives in call order, so its box broadcasts and supersteps
// interleave alike everywhere.
// Mismatches nobody waits for: the slot b of a root that another rank also stamped (two ranks that each
// believe they are the root: each stamps, fences and then looks at the others' slot b, so at least one of
// them sees the other, as in the Dekker pair below); a rank in a superstep that finds a rank behind it
// which stamped slot b (a box broadcast where this rank has a superstep); a rank waiting for a slot
// that finds a rank past it in the supersteps while the slot is not stamped (or still in use).
//
// Direct reads (single copy, as vader's CMA): where every rank can read every other's memory
// (process_vm_readv, probed per pair at connect time), a collective that moves large pieces between
// buffers (broadcast, all_gather, all_to_all; all_reduce in three, shm_collectives.cpp's
// all_reduce_directly) takes two supersteps whatever its size: each rank announces
// the address and length of what it lends in its area, publishes, waits, reads what it needs straight
// from the peers' buffers into its output, publishes again and waits: after that second wait nobody reads
// its buffer any more. Which collectives go direct follows from the call and `direct_from()`, the same on
// every rank: each rank's `reads_from` is written before its `Y` at set-up, and after rank 0's verdict
// every rank takes the largest of them, or 0 (no direct reads) where any is 0.
// A rank whose operation ends before its second superstep (a failure, a deadline, a cancel) revokes its
// loans first: it stores the operation's seq in its `revoked` word and fences, before its Future
// completes. A reader fences after each read and loads the lender's `revoked`: equal to the seq, and the
// bytes it read are dropped and its operation fails. If it loaded the word before the revoke, its read
// had ended before the lender's Future completed, so the bytes were still the caller's. What a peer
// announces is only an address in its own process: the kernel checks it (a bad one fails the read with
// EFAULT, a protocol error naming it), nothing in this process is touched.
//
// Cancelling: the ranks never leave the arena. A collective cancelled on one rank (its Future) is
// cancelled on every rank (the transport's cancel frame, operation_cancelled): each fails its Future at
// once and goes on with the collective's remaining supersteps in the background, headers only (marked
// cancelled: nothing is read from or written to the caller's buffers), so that every rank's count stays
// where the next collective expects it. A rank that never comes holds everyone's next collective, as it
// would without the cancel, until that one's deadline names it.
#include <algorithm>
#include <atomic>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "transports/shm/segment.hpp"
#include "weft/loop.hpp"
#include "weft/transport.hpp"

namespace weft::shm {

inline constexpr std::uint64_t arena_magic = 0x616e72612d746677ull;  // "wft-arna"
// 7: reads_from and revoked (direct reads); 8: the direct all_reduce (its areas hold loans where 7's
// held contents: a rank of each would read the other's bytes as addresses); 9: the sizes from which
// all_gather and all_to_all read directly by default moved (ranks of 8 and 9 would disagree on them);
// 10: the 32-byte area header (the cancelled mark and the skew in the count's top byte); 11: contents
// below placed_from start right after the header (they started on the next line from 33 bytes)
inline constexpr std::uint32_t arena_version = 11;

struct alignas(64) ArenaHeader {  // written once by the rank that makes the segment
  std::uint64_t magic = 0;
  std::uint32_t version = 0;
  std::uint32_t ranks = 0;
  std::uint64_t area_bytes = 0;
};

struct alignas(64) RankControl {
  std::atomic<std::uint32_t> sleeping{0};  // 1 while its loop may sleep with a step to wait for
  // The slots of the box broadcasts this rank finished (release). On a line of its own: it moves at
  // every box broadcast, where `sleeping` is read by every rank that publishes anything and seldom
  // changes; on one line the readers' sleeping words missed in the root's cache at every broadcast.
  alignas(64) std::atomic<std::uint64_t> box_done{0};
  // Direct reads ("Direct reads" above). On a line of their own: written at set-up and on a revoke only,
  // read after every direct read (a line that stays in the reader's cache).
  // The smallest piece this rank reads straight out of a peer's buffer; 0: it cannot read every peer's
  // memory (its link probes), or will not (WEFT_SHM_ARENA_CMA_BYTES=off). Written before its `Y` at set-up.
  alignas(64) std::atomic<std::uint64_t> reads_from{0};
  // The seq of the last operation whose lent buffers this rank took back before its readers finished.
  std::atomic<std::uint64_t> revoked{0};
};

// What an area holds: which operation (seq, signature), which step, and since when. It opens the area's
// first cache line (areas start on a page); contents below `Arena::placed_from` bytes follow it (at
// most `Arena::bytes_beside_header` on its line), larger ones start on the next. 32 bytes, so that 32
// bytes of contents fit beside it (a 2-rank all_reduce of 32 B, an all_to_all of 16 B a rank): the
// cancelled mark and the skew share the top byte of the signature's count, which no count reaches (2^56
// elements).
struct AreaHeader {
  std::atomic<std::uint64_t> published{0};  // the rank's count when it published this area (release)
  std::uint64_t seq = 0;
  // The signature's element count (its low 56 bits), the skew (6 bits) and the cancelled mark (the top bit).
  std::uint64_t count_and_marks = 0;
  std::uint32_t call = 0;  // the signature's call word
  std::uint32_t step = 0;  // the operation's superstep

  static constexpr int marks_shift = 56;
  static constexpr std::uint64_t count_mask = (std::uint64_t{1} << marks_shift) - 1;
  static constexpr std::uint64_t cancelled_mark = std::uint64_t{1} << 63;
  static constexpr std::uint64_t skew_marks = std::uint64_t{63} << marks_shift;

  /// Names the operation (its seq, signature and step, and whether it was cancelled here: the area
  /// holds nothing then). The skew stays 0 until Arena::publish sets it.
  void name(std::uint64_t op_seq, const OpSignature& signature, std::uint32_t op_step, bool cancelled) noexcept {
    seq = op_seq;
    count_and_marks = (signature.count & count_mask) | (cancelled ? cancelled_mark : 0);
    call = signature.call;
    step = op_step;
  }
  std::uint64_t count() const noexcept { return count_and_marks & count_mask; }
  bool cancelled() const noexcept { return (count_and_marks & cancelled_mark) != 0; }
  /// Where contents of Arena::placed_from bytes or more start: 64 + skew from the area's start (at
  /// most 63, so a peer's garbage moves them at most within the room every area keeps).
  std::uint32_t skew() const noexcept { return static_cast<std::uint32_t>((count_and_marks & skew_marks) >> marks_shift); }
  void set_skew(std::uint32_t skew) noexcept {
    count_and_marks = (count_and_marks & ~skew_marks) | (std::uint64_t{skew & 63} << marks_shift);
  }
  /// Whether it names operation `op_seq` with `signature` at step `op_step` (cancelled there or not).
  bool same_operation(std::uint64_t op_seq, const OpSignature& signature, std::uint32_t op_step) const noexcept {
    return seq == op_seq && count() == (signature.count & count_mask) && call == signature.call && step == op_step;
  }
  /// The same, and not cancelled.
  bool names(std::uint64_t op_seq, const OpSignature& signature, std::uint32_t op_step) const noexcept {
    return same_operation(op_seq, signature, op_step) && !cancelled();
  }
  /// The signature it names (the count as far as the header keeps it), for reports.
  OpSignature signature() const noexcept { return OpSignature{.call = call, .count = count()}; }
};
static_assert(sizeof(AreaHeader) == 32, "32 bytes of contents start beside the header, on its line");

class Arena : public std::enable_shared_from_this<Arena> {
 public:
  /// Bytes of each area for a group of `ranks` (two areas per rank): 1 MiB up to 16 ranks, less beyond.
  static std::size_t area_bytes_for(int ranks) noexcept;
  /// A new arena for `ranks` ranks (this one `rank`). Throws std::system_error.
  static std::shared_ptr<Arena> create(int ranks, int rank);
  /// Maps an arena a peer made (adopt), checking its header against `ranks`. Takes over `fd`. Throws
  /// std::runtime_error naming what is wrong.
  static std::shared_ptr<Arena> adopt(int fd, int ranks, int rank);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  int fd() const noexcept { return segment_.fd(); }
  int ranks() const noexcept { return ranks_; }
  int rank() const noexcept { return rank_; }
  std::size_t area_bytes() const noexcept { return area_bytes_; }

  /// The eventfds that wake the other ranks (owned; -1 for this rank), and the loop that waits here.
  void attach(Loop& loop, std::vector<int> wake_fds);

  // ---- one superstep: write, publish, wait (until_ready), read
  std::uint64_t count() const noexcept { return count_; }
  /// This rank's area for the next superstep, to hold `bytes` (written before publish()), and its
  /// header. Every rank of a superstep passes the same `bytes` for an area (they follow from the call,
  /// which the headers check): where the contents start depends on it, and on `like`: contents of
  /// placed_from bytes or more start as far into their cache line as `like` is into its own (the source
  /// the caller copies them from; the skew goes out with the header at publish()).
  std::byte* next_area(std::size_t bytes, const void* like = nullptr) noexcept {
    next_skew_ = bytes >= placed_from && like ? static_cast<std::uint32_t>(reinterpret_cast<std::uintptr_t>(like) & 63) : 0;
    return area_at(rank_, count_ & 1, bytes, next_skew_);
  }
  AreaHeader& next_header() const noexcept { return header_at(rank_, count_ & 1); }
  /// Rank r's area of the superstep last published, holding `bytes` (read after the wait), and its header.
  const std::byte* area(int r, std::size_t bytes) const noexcept {
    const std::uint64_t parity = (count_ - 1) & 1;
    return area_at(r, parity, bytes, header_at(r, parity).skew());
  }
  const AreaHeader& header(int r) const noexcept { return header_at(r, (count_ - 1) & 1); }
  /// Makes this rank's area visible (count + 1) and wakes the ranks that sleep.
  void publish() noexcept;
  /// Whether every rank has published as many supersteps as this one.
  bool reached() const noexcept {
    // Inline, as every check here: the fast path looks at the counts once or a few times per collective.
    for (int r = 0; r < ranks_; ++r) {
      if (r != rank_ && behind(r)) return false;
    }
    return true;
  }
  /// Whether rank r has not; the ranks that have not (for reports). Rank r has published count_ when
  /// its area of that parity says so: it cannot publish into that area again (count_ + 2) before this
  /// rank published count_ + 1.
  bool behind(int r) const noexcept {
    return count_ != 0 && header_at(r, (count_ - 1) & 1).published.load(std::memory_order_acquire) < count_;
  }
  /// How many of an area's bytes share the cache line of its header.
  static constexpr std::size_t bytes_beside_header = 64 - sizeof(AreaHeader);
  /// Contents of fewer bytes start right after the header and go on over the lines after it; larger ones
  /// start on the next line, as far into it as their source is into its own (`skew`). Placing pays only
  /// where memcpy writes with rep movsb, from glibc's rep_movsb_threshold up: 2048 * (vector size / 16),
  /// so 4 KiB with AVX2 and 8 KiB with AVX-512; below it vector stores copy as fast either way.
  static constexpr std::size_t placed_from = 4096;
  /// The ranks this rank waits for now (for reports): those behind its superstep, the root whose slot is
  /// not stamped yet, or the ranks that have not finished the last use of the slot it is to write.
  std::vector<int> behind() const;

  // ---- box broadcasts (the header comment): slots b, b + 1, ... (mod box_slots) of a rank's box
  static constexpr std::uint64_t box_slots = 256;
  static constexpr std::size_t box_slot_bytes = 256;
  /// The contents one slot holds (a slot less its header); a larger box broadcast takes the slots after
  /// it too, the contents of each after its (unused) header.
  static constexpr std::size_t slot_contents = box_slot_bytes - sizeof(AreaHeader);
  /// The most a box broadcast carries.
  static constexpr std::size_t box_capacity = 2048;
  static constexpr std::uint64_t slots_for(std::size_t bytes) noexcept {
    return bytes <= slot_contents ? 1 : (bytes + slot_contents - 1) / slot_contents;
  }
  /// Slots of box broadcasts this rank finished (as root or reader); its next one starts at box_count().
  std::uint64_t box_count() const noexcept { return box_count_; }
  /// Starts this rank's next box broadcast, of `bytes` (the same on every rank: the call says so, the
  /// headers check it): the slots it takes, from box_count() on.
  void begin_box(std::size_t bytes) noexcept {
    box_taking_ = slots_for(bytes);
    box_bytes_ = bytes;
  }
  /// Rank r's first slot for this rank's next box broadcast: its header.
  AreaHeader& slot_header(int r) const noexcept { return *reinterpret_cast<AreaHeader*>(slot_at(r, 0)); }
  /// Copies `bytes` into this rank's slots for its next box broadcast, or out of rank r's.
  void write_box(const void* from, std::size_t bytes) const noexcept;
  void read_box(int r, void* to, std::size_t bytes) const noexcept;
  /// Whether rank r stamped its first slot for this rank's next box broadcast.
  bool stamped(int r) const noexcept { return slot_header(r).published.load(std::memory_order_acquire) == box_count_ + 1; }
  /// Whether rank r has not finished the last use of a slot this rank's next box broadcast takes.
  bool slot_in_use_by(int r) const noexcept {
    return control(r).box_done.load(std::memory_order_acquire) + box_slots < box_count_ + box_taking_;
  }
  /// Whether this rank may write its slots for its next box broadcast: every rank finished their last use.
  /// The least box_done of the others seen last is remembered (they only grow): the readers' control
  /// lines, which they write at every broadcast, are read again only when the root comes near it, not
  /// at every broadcast (a cache line from the reader's core each time).
  bool slot_free() const noexcept {
    const std::uint64_t need = box_count_ + box_taking_;
    if (need <= others_done_.load(std::memory_order_relaxed) + box_slots) return true;
    std::uint64_t least = ~std::uint64_t{0};
    for (int r = 0; r < ranks_; ++r) {
      if (r != rank_) least = std::min(least, control(r).box_done.load(std::memory_order_acquire));
    }
    if (least == ~std::uint64_t{0}) return true;  // a group of one
    others_done_.store(least, std::memory_order_relaxed);
    return need <= least + box_slots;
  }
  /// Stamps this rank's slot (written before), fences (so that a look at the other ranks' slots after it
  /// is ordered after it), wakes the ranks that sleep, and, for contents beside the header, asks for the
  /// line of its next slot (arena.cpp).
  void stamp_slot() noexcept;
  /// Ends this rank's box broadcast (box_count() and box_done move past its slots, fenced) and wakes the
  /// ranks that sleep (a root may wait for it to reuse a slot).
  void finish_box() noexcept;
  /// Whether rank r has published a superstep that this rank has not, and that superstep's header.
  bool ahead(int r) const noexcept { return header_at(r, count_ & 1).published.load(std::memory_order_acquire) > count_; }
  const AreaHeader& ahead_header(int r) const noexcept { return header_at(r, count_ & 1); }

  // ---- direct reads ("Direct reads" above)
  /// `reads_from` of a rank that leaves the sizes to the collectives' measured defaults.
  static constexpr std::uint64_t direct_defaults = ~std::uint64_t{0};
  /// Writes this rank's `reads_from`: `from_bytes` (or direct_defaults) where `pids` (every rank's
  /// process, this one's unused) holds every peer (0: this rank cannot read it), else 0. Before this
  /// rank's `Y` at set-up.
  void offer_direct_reads(std::uint64_t from_bytes, std::vector<int> pids) noexcept;
  /// After the set-up's verdict: the group's choice (direct_from), alike on every rank: 0 where any rank
  /// offered 0, else the largest offer (so direct_defaults unless every rank named a size).
  void settle_direct_reads() noexcept;
  /// The smallest piece the arena's collectives read straight from a peer's buffer; 0: never;
  /// direct_defaults: each collective's measured size (shm_collectives.cpp, reads_directly).
  std::uint64_t direct_from() const noexcept { return direct_from_; }
  /// Reads `bytes` at `address` in rank r's process into `to`: 0, or the errno that stopped it (EIO:
  /// the kernel read nothing more).
  int read_direct(int r, std::uint64_t address, void* to, std::size_t bytes) const noexcept;
  /// Takes back this rank's loans of operation `seq` (its Future completes before its readers finished).
  void revoke(std::uint64_t seq) noexcept;
  /// Whether rank r took back its loans of operation `seq` (fenced: after a read, says whether the read
  /// may have come after the lender's Future completed).
  bool revoked(int r, std::uint64_t seq) const noexcept {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return control(r).revoked.load(std::memory_order_acquire) == seq;
  }

  /// What this rank waits for in the arena now: what its wait's readiness and conflict checks look at
  /// (shm_collectives.cpp), and whom the deadline's report names (waits_on).
  enum class Waiting { step, slot, free_slot };
  void waiting_for(Waiting what, int root = -1) noexcept {
    waiting_ = what;
    waiting_root_ = root;
  }
  Waiting waiting() const noexcept { return waiting_; }
  /// Whether this rank waits for rank r now (waiting_for: a step, a root's slot, a slot to reuse).
  bool waits_on(int r) const noexcept {
    if (r == rank_) return false;
    switch (waiting_) {
      case Waiting::slot: return r == waiting_root_ && !stamped(r);
      case Waiting::free_slot: return slot_in_use_by(r);
      case Waiting::step: break;
    }
    return behind(r);
  }

  /// What waits in the arena: resumed when ready() holds (by default: every rank reached this rank's
  /// superstep), or when interrupted() (a failure, a deadline, a cancel: it decides) becomes true. Loop
  /// thread only; one at a time.
  struct Waiter {
    virtual bool interrupted() = 0;
    virtual bool ready(const Arena& arena) { return arena.reached(); }
    std::coroutine_handle<> handle;

   protected:
    ~Waiter() = default;
  };
  struct Awaiter {
    Arena* arena;
    Waiter* waiter;
    bool await_ready() const noexcept { return waiter->ready(*arena) || waiter->interrupted(); }
    void await_suspend(std::coroutine_handle<> h) noexcept {
      waiter->handle = h;
      arena->waiter_ = waiter;
    }
    void await_resume() const noexcept {}
  };
  Awaiter until_ready(Waiter& waiter) noexcept { return Awaiter{this, &waiter}; }

  // The loop's poller calls, on its thread.
  std::size_t poll();
  bool arm();
  void disarm();

 private:
  // `area_bytes`: as checked by adopt (or chosen by create), not read again from the header.
  Arena(Segment segment, int ranks, int rank, std::size_t area_bytes);
  RankControl& control(int r) const noexcept { return controls_[r]; }
  std::byte* line_at(int r, std::uint64_t parity) const noexcept {
    return areas_ + (static_cast<std::size_t>(r) * 2 + static_cast<std::size_t>(parity)) * area_stride_;
  }
  std::byte* area_at(int r, std::uint64_t parity, std::size_t bytes, std::uint32_t skew) const noexcept {
    return line_at(r, parity) + (bytes < placed_from ? sizeof(AreaHeader) : 64 + (skew & 63));
  }
  AreaHeader& header_at(int r, std::uint64_t parity) const noexcept { return *reinterpret_cast<AreaHeader*>(line_at(r, parity)); }
  std::byte* slot_at(int r, std::uint64_t k) const noexcept {
    return boxes_ + (static_cast<std::size_t>(r) * box_slots + (box_count_ + k) % box_slots) * box_slot_bytes;
  }
  void wake_sleepers() noexcept;
  bool ready_or_interrupted() const noexcept { return waiter_ && (waiter_->ready(*this) || waiter_->interrupted()); }

  Segment segment_;
  int ranks_ = 0;
  int rank_ = 0;
  std::size_t area_bytes_ = 0;
  std::size_t area_stride_ = 0;
  std::byte* areas_ = nullptr;
  std::byte* boxes_ = nullptr;
  RankControl* controls_ = nullptr;
  std::uint64_t count_ = 0;      // this rank's, as published
  std::uint32_t next_skew_ = 0;  // of the area next_area() gave, for its header at publish()
  std::uint64_t box_count_ = 0;   // slots of this rank's box broadcasts finished
  std::uint64_t box_taking_ = 1;  // slots its box broadcast now takes
  std::size_t box_bytes_ = 0;      // and its contents
  // The least box_done of the other ranks as slot_free() last read it (this rank's threads only; atomic
  // because the loop's poller and a caller's fast path may both ask, one after the other).
  mutable std::atomic<std::uint64_t> others_done_{0};
  std::uint64_t direct_from_ = 0;  // settle_direct_reads
  std::vector<int> pids_;          // every rank's process (offer_direct_reads)
  Waiting waiting_ = Waiting::step;
  int waiting_root_ = -1;
  Waiter* waiter_ = nullptr;
  Loop* loop_ = nullptr;
  const std::atomic<bool>* loop_alive_ = nullptr;  // the state holding the arena may go after the Loop
  std::uint64_t poller_ = 0;
  std::vector<int> wake_fds_;
};

}  // namespace weft::shm
