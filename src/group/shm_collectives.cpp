// The direct shared-memory collectives (shm_collectives.hpp): one script per collective, each a
// sequence of supersteps on the group arena (write my area, publish, wait, read theirs). Large buffers
// go in chunks of one area. Every rank folds in rank order, so a reduction gives the same bits on every
// rank, and deterministic mode is met as it stands. A broadcast small enough for a box slot is no
// superstep: the root writes its slot and goes on, the readers copy from it (box_broadcast).
//
// A collective of one superstep whose turn has come runs on the caller's thread (run_on_arena_now): it
// writes, publishes and polls the other ranks' counts there for a short while, and when they all came
// it reads and returns a Future that is ready, without a loop turn, a coroutine frame or a thread hand-off
// (docs/DESIGN.md, "The per-operation floor"). Anything else (a rank late past the poll, a mismatch, a
// failure) goes on from the published step on the loop, which has the deadlines, the cancel and the
// reports.
#include "group/shm_collectives.hpp"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <span>
#include <stop_token>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "algorithms/reduction.hpp"
#include "core/env.hpp"
#include "core/scratch.hpp"
#include "core/signature.hpp"
#include "group/checks.hpp"
#include "transports/shm/arena.hpp"
#include "transports/shm/copy.hpp"
#include "transports/shm/lendable.hpp"
#include "weft/future.hpp"

namespace weft::detail {
namespace {

// all_reduce reduces every rank's whole chunk on every rank below this many bytes (one superstep a
// chunk); from it on, each rank reduces one block and the blocks are gathered (two supersteps, 1/p of
// the arithmetic). bench/RESULTS.md, "Direct shm collectives", has the measurements behind it.
constexpr std::size_t reduce_everywhere_below = std::size_t{256} << 10;

// How long the caller's thread polls for the other ranks before the loop takes over (WEFT_INLINE_SPIN_US;
// 0: the caller only looks once). Long enough for ranks that arrive together (a few microseconds apart),
// short enough that a caller whose peers are late gets its Future back soon.
std::chrono::microseconds inline_spin() {
  static const std::chrono::microseconds value = [] {
    // Checked by Options::from_environment (Group::create) before any collective: no throw here.
    return detail::env_microseconds_or("WEFT_INLINE_SPIN_US", std::chrono::microseconds(20));
  }();
  return value;
}

// What the stop callback and the arena's poller share with the operation.
struct Hook {
  bool finished = false;
  bool cancelled = false;
};

OpSignature signature_of_call(const CollectiveCall& call) {
  const DType dtype = call.collective == Collective::barrier ? DType::u8 : call.out.dtype;
  const std::uint64_t count = call.collective == Collective::reduce_scatter ? call.out.count
                              : call.collective == Collective::broadcast     ? call.out.count
                                                                             : call.in.count;
  return signature::of(call.collective, dtype, reduces(call.collective) ? call.op : ReduceOp::sum, count, call.root);
}

// Thrown by a wait of a cancelled collective (this rank's cancel, or another member's): its Future fails
// with `error` and its remaining supersteps go on in the background (finish_cancelled).
struct Detach {
  std::exception_ptr error;
};

class ArenaRun final : public shm::Arena::Waiter {
 public:
  // `failed_at_call`: the group had failed (as far as this rank knew) when the collective was called
  // (arena_group_failed); only then does a failure win over a superstep every rank reached.
  ArenaRun(GroupState& g, std::uint64_t seq, const char* op, OpSignature signature, std::shared_ptr<Hook> hook,
           bool failed_at_call)
      : g_(g), arena_(*g.arena), seq_(seq), op_(op), signature_(signature), hook_(std::move(hook)), failed_at_call_(failed_at_call) {}

  // Loop thread (the transport's state).
  bool interrupted() override { return failed() || called_off() || departed(); }

  /// The group failed: an abort, a lost peer, a deadline, another operation's failure (or, for a
  /// cancelled collective's background supersteps, nobody holds the group any more: state.hpp).
  bool failed() {
    if (cancelled_ && g_.unheld.load(std::memory_order_acquire)) return true;
    return g_.failed.load(std::memory_order_relaxed) || g_.transport->context_failed(g_.context, nullptr, nullptr);
  }
  /// This operation was cancelled (here or by another member), or a rank called something else.
  bool called_off() {
    if (!cancelled_ && (hook_->cancelled || g_.transport->operation_cancelled(g_.context, seq_, nullptr))) return true;
    return !cancelled_ && (box_mismatch_ = box_conflict()) >= 0;
  }
  /// A rank that left the group normally (its Group closed) does not fail the context by itself: a
  /// rank that waits on it must (the framed transport fails such a receive the same way).
  bool departed() {
    for (int r = 0; r < g_.size; ++r) {
      if (arena_.waits_on(r) && !g_.transport->connected(g_.members[static_cast<std::size_t>(r)])) {
        departed_ = r;
        return true;
      }
    }
    return false;
  }

  /// Whether a wait that ended must throw: what it waited for did not come, or it came and the
  /// operation was called off, or the group failed before the collective was called. A failure after
  /// the call (a rank that finished this superstep and aborted at once, a deadline that fired as the
  /// last rank came) does not undo a superstep that every rank reached: its areas were all written
  /// before, so the result is whole, and the failure fails what comes next. (It did: a rank that ran
  /// `barrier().get(); abort()` failed its peer's barrier whenever the peer's loop read the abort
  /// before it looked at the arena again.)
  bool ends_in_error(bool came) {
    if (!came) {
      (void)interrupted();  // what throw_interruption() reports (departed_, box_mismatch_)
      return true;
    }
    return called_off() || (failed_at_call_ && (failed() || departed()));
  }

  // What the wait waits for: every rank's superstep, or (box broadcasts) a root's stamp or a free slot.
  bool ready(const shm::Arena& arena) override {
    switch (arena.waiting()) {
      case shm::Arena::Waiting::slot: return arena.stamped(root_);
      case shm::Arena::Waiting::free_slot: return arena.slot_free();
      case shm::Arena::Waiting::step: break;
    }
    return arena.reached();
  }

  /// A rank whose arena words say it called something else where this rank is now (arena.hpp, "Boxes");
  /// -1 when none does. Any thread (memory only).
  int box_conflict() const { return arena_.waiting() == shm::Arena::Waiting::step ? step_conflict() : conflict_in_box(); }
  /// In a superstep: a rank behind it that stamped this rank's next box broadcast. (The stamp is read
  /// first: a rank that stamped after publishing this superstep is then seen to have published it.)
  int step_conflict() const {
    for (int r = 0; r < g_.size; ++r) {
      if (r != g_.rank && arena_.stamped(r) && arena_.behind(r)) return r;
    }
    return -1;
  }
  /// In a box broadcast (begin_box given), before this rank stamped or read a slot: another root of it, or
  /// a rank in a superstep past it, which it could not have reached without the slot this rank waits for
  /// (read after the superstep, so that a rank that published it after the slot is seen to have).
  int conflict_in_box() const {
    const bool root = root_ == g_.rank;
    for (int r = 0; r < g_.size; ++r) {
      if (r == g_.rank) continue;
      if (r != root_ && arena_.stamped(r)) return r;
      if (arena_.ahead(r) && (root ? arena_.slot_in_use_by(r) : !arena_.stamped(root_))) return r;
    }
    return -1;
  }
  /// After this rank stamped its slot as the root: another rank that stamped the same box broadcast.
  int other_root() const {
    for (int r = 0; r < g_.size; ++r) {
      if (r != g_.rank && arena_.stamped(r)) return r;
    }
    return -1;
  }

  /// Box broadcasts: this rank is the root (or a reader of `root`) of the one it is in, of `bytes`.
  void begin_box(int root, std::size_t bytes) noexcept {
    root_ = root;
    arena_.begin_box(bytes);
  }
  /// Writes this rank's slot (the contents unless cancelled; the header naming the operation) and stamps
  /// it. The root's first step.
  void write_slot(const CollectiveCall& call) {
    shm::AreaHeader& mine = arena_.slot_header(g_.rank);
    if (!cancelled_) arena_.write_box(call.out.data, call.out.bytes());
    mine.name(seq_, signature_, 0, cancelled_);
    arena_.stamp_slot();
    published_ = 1;
  }
  /// Whether the root's stamped slot names another operation than this one (cancelled or not).
  bool slot_disagrees() const {
    const shm::AreaHeader& theirs = arena_.slot_header(root_);
    return !theirs.same_operation(seq_, signature_, 0);
  }
  bool slot_cancelled() const { return arena_.slot_header(root_).cancelled(); }
  /// Ends this rank's part of the box broadcast (and remembers it, for a later mismatch report).
  void finish_box() {
    arena_.finish_box();
    g_.last_box_seq = seq_;
    g_.last_box_signature = signature_;
  }

  /// Waits for the root's stamp (`slot`) or for a slot this rank may write (`free_slot`); throws as
  /// wait() does, a box conflict being a mismatch. Loop thread.
  Task<void> wait_box(shm::Arena::Waiting what) {
    arena_.waiting_for(what, root_);
    co_await arena_.until_ready(*this);
    const bool error = ends_in_error(ready(arena_));
    arena_.waiting_for(shm::Arena::Waiting::step);
    if (error) throw_interruption();
  }

  shm::Arena& arena() noexcept { return arena_; }
  /// This rank's next area and rank r's last one, holding `bytes` (the same on every rank: arena.hpp).
  /// `like`: the source the contents are copied from (they start as far into a cache line as it does).
  std::byte* area(std::size_t bytes, const void* like = nullptr) noexcept { return arena_.next_area(bytes, like); }
  const std::byte* area_of(int r, std::size_t bytes) const noexcept { return arena_.area(r, bytes); }
  /// Supersteps of this operation published so far (`n` before this run: the caller's thread's).
  std::uint32_t published() const noexcept { return published_; }
  void published_before(std::uint32_t n) noexcept { published_ = n; }

  /// From now on the operation is cancelled: its headers say so and its waits compare nothing.
  void mark_cancelled() noexcept { cancelled_ = true; }

  std::uint64_t seq() const noexcept { return seq_; }

  /// Direct reads (arena.hpp): how a read from a lender went.
  enum class Read { done, short_loan, refused, taken_back };
  /// Reads `bytes` at `offset` into what rank r lent for this operation (the address and length its
  /// area of the last superstep announces) into `to`: a loan shorter than `lent_bytes` (what the call
  /// needs) is not read; `error` gets the kernel's errno of a read it refused; a loan taken back
  /// (revoked) after or during the read means the bytes may not be the caller's. Nothing thrown.
  Read try_read_lent(int r, std::size_t offset, std::byte* to, std::size_t bytes, std::size_t lent_bytes, int& error) const noexcept {
    const Announced loan = announced_by(r);
    if (loan.bytes != lent_bytes) return Read::short_loan;
    error = bytes == 0 ? 0 : arena_.read_direct(r, loan.address + offset, to, bytes);
    if (arena_.revoked(r, seq_)) return Read::taken_back;
    return error == 0 ? Read::done : Read::refused;
  }
  /// try_read_lent, throwing: naming r and aborting the group (the others wait for this rank's next
  /// superstep) for a loan shorter than the call says or a read the kernel refused (ESRCH: its process is
  /// gone, a peer failure; anything else a protocol error). A loan taken back is not an error here: it is
  /// remembered (lent_taken_back) and the operation fails once its last superstep is over.
  void read_lent(int r, std::size_t offset, std::byte* to, std::size_t bytes, std::size_t lent_bytes) {
    int error = 0;
    switch (try_read_lent(r, offset, to, bytes, lent_bytes, error)) {
      case Read::done: return;
      case Read::taken_back: taken_back_ = r; return;
      case Read::short_loan:
        fail_read(r, Errc::protocol_error,
                  fmt::format("rank {} lent {} bytes for {} #{} where the call needs {} (seen in the group's shared-memory arena)", r,
                              announced_by(r).bytes, op_, seq_, lent_bytes));
      case Read::refused: break;
    }
    if (error == ESRCH) {
      fail_read(r, Errc::peer_failure,
                fmt::format("connection to rank {} lost: its process is gone (process_vm_readv: {}) while rank {} read its "
                            "buffer in {} #{}",
                            r, std::strerror(error), g_.rank, op_, seq_));
    }
    fail_read(r, Errc::protocol_error,
              fmt::format("rank {} cannot read the {} bytes rank {} lent for {} #{} (process_vm_readv: {})", g_.rank, bytes, r, op_, seq_,
                          error == EIO ? "it read nothing more" : std::strerror(error)));
  }
  /// What rank r announced in its area of the last superstep: the address and length of its loan.
  struct Announced {
    std::uint64_t address = 0;
    std::uint64_t bytes = 0;
  };
  Announced announced_by(int r) const noexcept {
    Announced loan;
    static_assert(sizeof loan == 16, "two words, as announce() writes them");
    std::memcpy(&loan, arena_.area(r, sizeof loan), sizeof loan);
    return loan;
  }
  /// A rank whose loan was taken back during this operation's reads; -1 when none was.
  int lent_taken_back() const noexcept { return taken_back_; }
  /// Fails this operation after rank r took its loan back: with the group's failure where this rank
  /// knows of it, else as cancelled (Detach; a lender's operation ends early only through a cancel,
  /// which every rank gets, or a failure, which reaches every rank too).
  [[noreturn]] void throw_taken_back(int r) {
    std::error_code code;
    std::string reason;
    if (g_.transport->context_failed(g_.context, &code, &reason)) {
      throw_error(static_cast<Errc>(code.value()), g_.where(op_, static_cast<std::int64_t>(seq_)), reason);
    }
    if (!g_.transport->operation_cancelled(g_.context, seq_, &reason)) {
      reason = fmt::format("rank {} took back the buffer it lent for {} #{} while rank {} read it (its {} ended early: cancelled, "
                           "failed or past its deadline)",
                           r, op_, seq_, g_.rank, op_);
    }
    detach(reason);
  }

  /// Publishes this rank's area for step `step` (written before, unless cancelled), naming the operation
  /// in its header.
  void publish(std::uint32_t step) {
    shm::AreaHeader& mine = arena_.next_header();
    mine.name(seq_, signature_, step, cancelled_);
    arena_.publish();
    published_ = step + 1;
  }

  /// Waits for every rank's step `step`; then checks that they all are in the same operation, not
  /// cancelled. Throws on anything else (Detach for a cancel; otherwise why; a mismatch). Loop thread.
  Task<void> wait(std::uint32_t step) {
    co_await arena_.until_ready(*this);
    if (ends_in_error(arena_.reached())) throw_interruption();
    if (cancelled_) co_return;
    if (const int r = cancelled_by(); r >= 0) throw_cancelled_in_arena(r);
    if (const int r = disagreeing(step); r >= 0) throw_mismatch(r);
  }

  /// Throws Detach when the operation was cancelled (here or by another member) before its first
  /// superstep. Loop thread.
  void check_cancelled() {
    if (hook_->cancelled || g_.transport->operation_cancelled(g_.context, seq_, nullptr)) throw_interruption();
  }

  /// A rank whose header for step `step` names another operation; -1 when none does. Any thread.
  int disagreeing(std::uint32_t step) const {
    for (int r = 0; r < g_.size; ++r) {
      if (r == g_.rank) continue;
      const shm::AreaHeader& theirs = arena_.header(r);
      if (!theirs.names(seq_, signature_, step)) return r;
    }
    return -1;
  }

 private:
  // A rank whose header of the last step says this operation was cancelled there; -1 when none.
  int cancelled_by() const {
    for (int r = 0; r < g_.size; ++r) {
      const shm::AreaHeader& theirs = arena_.header(r);
      if (r != g_.rank && theirs.seq == seq_ && theirs.cancelled()) return r;
    }
    return -1;
  }

  [[noreturn]] void fail_read(int r, Errc errc, const std::string& reason) const {
    g_.transport->abort_context(g_.context, errc, reason);
    throw_error(errc, g_.where(op_, static_cast<std::int64_t>(seq_), r), reason);
  }

  [[noreturn]] void detach(const std::string& reason) const {
    try {
      throw_error(Errc::cancelled, g_.where(op_, static_cast<std::int64_t>(seq_)), reason);
    } catch (...) {
      throw Detach{std::current_exception()};
    }
  }

 public:
  // Another rank's header says so before this rank's transport did (its cancel frame is on its way).
  [[noreturn]] void throw_cancelled_in_arena(int r) const {
    std::string reason;
    if (!g_.transport->operation_cancelled(g_.context, seq_, &reason)) {
      reason = fmt::format("{} #{} was cancelled (rank {} said so in the group's shared-memory arena)", op_, seq_, r);
    }
    detach(reason);
  }

 private:
  [[noreturn]] void throw_interruption() {
    std::string reason;
    if (!cancelled_ && hook_->cancelled) detach(fmt::format("rank {} cancelled {} #{}", g_.rank, op_, seq_));
    if (!cancelled_ && g_.transport->operation_cancelled(g_.context, seq_, &reason)) detach(reason);
    std::error_code code;
    if (box_mismatch_ >= 0 && !g_.transport->context_failed(g_.context, nullptr, nullptr)) throw_box_mismatch(box_mismatch_);
    if (departed_ >= 0 && !g_.transport->context_failed(g_.context, nullptr, nullptr)) {
      reason = fmt::format("rank {} left the group (its connection closed) while rank {} waited for it in {} #{}", departed_,
                           g_.rank, op_, seq_);
      g_.transport->abort_context(g_.context, Errc::peer_failure, reason);
      throw_error(Errc::peer_failure, g_.where(op_, static_cast<std::int64_t>(seq_), departed_), reason);
    }
    if (g_.transport->context_failed(g_.context, &code, &reason)) {
      throw_error(static_cast<Errc>(code.value()), g_.where(op_, static_cast<std::int64_t>(seq_)), reason);
    }
    std::string failure;
    {
      std::lock_guard lock(g_.failure_mutex);
      failure = g_.failure;
    }
    throw_error(Errc::group_failed, g_.where(op_, static_cast<std::int64_t>(seq_)), failure);
  }

  // (A rank that stamped this rank's next box broadcast called that where this rank is in a superstep.)
  [[noreturn]] void throw_mismatch(int r) const { throw_mismatch(r, arena_.stamped(r) ? arena_.slot_header(r) : arena_.header(r)); }

 public:
  /// Rank r called something else where this rank is now, as its slot or its next area says.
  [[noreturn]] void throw_box_mismatch(int r) const {
    throw_mismatch(r, arena_.stamped(r) ? arena_.slot_header(r) : arena_.ahead_header(r));
  }

 private:
  [[noreturn]] void throw_mismatch(int r, const shm::AreaHeader& theirs) const {
    // A rank still at the box broadcast this rank finished before this operation called something else there.
    const bool at_last_box = theirs.seq != seq_ && theirs.seq == g_.last_box_seq;
    const std::string reason =
        fmt::format("rank {} called {} while rank {} called {} (seen in the group's shared-memory arena)", r,
                    signature::describe(theirs.signature(), theirs.seq), g_.rank,
                    at_last_box ? signature::describe(g_.last_box_signature, g_.last_box_seq) : signature::describe(signature_, seq_));
    g_.transport->abort_context(g_.context, Errc::mismatch, reason);
    throw_error(Errc::mismatch, g_.where(op_, static_cast<std::int64_t>(seq_), r), reason);
  }

  GroupState& g_;
  shm::Arena& arena_;
  std::uint64_t seq_;
  const char* op_;
  OpSignature signature_;
  std::shared_ptr<Hook> hook_;
  int departed_ = -1;
  int box_mismatch_ = -1;  // a box conflict found by interrupted()
  int taken_back_ = -1;    // read_lent: a rank that revoked its loan
  std::uint32_t published_ = 0;
  bool cancelled_ = false;
  int root_ = -1;  // box broadcasts: the root
  bool failed_at_call_;
};

// The chunks of `n` elements a script goes through when each rank writes `pieces` pieces of a chunk into
// its area: at least one, empty for n = 0 (every collective takes at least one superstep, so that its
// header is compared and the ranks stay in step). Computed as they are visited: a small collective's one
// chunk costs no allocation.
struct Chunks {
  std::size_t n;
  std::size_t chunk;
  std::size_t unit;  // bytes an area holds per element of a chunk: the element's size times the pieces
  std::size_t count() const noexcept { return n == 0 ? 1 : (n + chunk - 1) / chunk; }
  algo::Range operator[](std::size_t k) const noexcept {
    return algo::Range{k * chunk, n == 0 ? 0 : std::min(chunk, n - k * chunk)};
  }
  /// What each rank's area holds for chunk k (where its contents start follows from it: arena.hpp).
  std::size_t area_bytes(std::size_t k) const noexcept { return (*this)[k].count * unit; }
};

// The chunks of `call` on `arena`: one piece per chunk, but for reduce_scatter and all_to_all, whose
// areas hold, per chunk, one piece for every rank (piece q: elements [off, off + c) of input block q).
Chunks chunks_of(const shm::Arena& arena, const CollectiveCall& call, int ranks) {
  const auto p = static_cast<std::size_t>(ranks);
  std::size_t n = 0;
  std::size_t pieces = 1;
  std::size_t esize = 1;
  switch (call.collective) {
    case Collective::all_reduce:
    case Collective::broadcast: n = call.out.count, esize = dtype_size(call.out.dtype); break;
    case Collective::all_gather: n = call.in.count, esize = dtype_size(call.in.dtype); break;
    case Collective::reduce_scatter:
    case Collective::all_to_all: n = call.in.count / p, esize = dtype_size(call.in.dtype), pieces = p; break;
    default: break;  // barrier: one empty chunk
  }
  return Chunks{n, std::max<std::size_t>(1, arena.area_bytes() / (esize * pieces)), esize * pieces};
}

// The collectives with a script on the arena.
bool has_script(Collective c) {
  switch (c) {
    case Collective::all_reduce:
    case Collective::all_gather:
    case Collective::reduce_scatter:
    case Collective::all_to_all:
    case Collective::broadcast:
    case Collective::barrier: return true;
    default: return false;
  }
}

// all_reduce's second form: each rank reduces one block of the chunk and the blocks are gathered.
bool reduces_in_blocks(const CollectiveCall& call) {
  return call.collective == Collective::all_reduce && call.out.count * dtype_size(call.out.dtype) >= reduce_everywhere_below;
}

// Whether this rank's own piece of a reduce_scatter or all_to_all goes from its input straight to where
// it is used (all_to_all: the output; reduce_scatter: the fold) instead of through its area, where nobody
// else reads it: a copy less, and one read from local memory. Not for a reduce_scatter whose output
// shares bytes with its input (in place: the output is its own input block): the fold writes its output
// while it still reads its sources.
bool own_piece_from_input(const CollectiveCall& call) {
  if (call.collective == Collective::all_to_all) return true;
  return call.collective == Collective::reduce_scatter && !share_bytes(call.in, call.out);
}

// Whether `call` reads the peers' buffers directly (arena.hpp, "Direct reads"): a collective that moves
// pieces between buffers, each piece (what one read moves) at least the arena's direct_from(), or by
// default at least its collective's measured size. The same on every rank: the call's signature (which
// the headers compare) and direct_from() decide it.
// The defaults were measured on two machines that disagree (bench/RESULTS.md, "Direct reads in the
// arena" for the Intel Xeon of 2026-12-02, "Direct reads on an AMD EPYC" for the EPYC of 2026-12-02;
// 2 ranks, paired medians of direct / through the areas or the table's rings). The kernel's copy
// (process_vm_readv) runs at about 16 GB/s alone on both, but the EPYC's own copies between cores are
// about twice as fast as the Xeon's (bench/shm-copy-ceiling's 256 KiB: 7.7 us against 13.2; the 2 MiB
// ring all_reduce: 242 us against about 500), so what the Xeon gains by a copy less the EPYC loses by
// the slower kernel copy and the system call per read. Where the two disagree the default takes the
// choice whose loss on the other machine is the smaller; `weft-bench --tune` (or WEFT_ALGO,
// WEFT_SHM_ARENA_CMA_BYTES) gives a machine its own. (The EPYC's figures: 200 iterations a size.)
// - all_gather, 2 ranks only, from blocks of 128 KiB: the Xeon 0.78 at 8 KiB blocks, 0.40 at 128 KiB,
//   0.57 at 8 MiB; the EPYC 2.6 at 8 KiB blocks and 1.45 at 32 KiB (a system call per read against a
//   2 us copy; 30 iterations), 1.08-1.16 at 128-512 KiB, 0.96-0.98 at 1-2 MiB, 1.06 at 4 MiB and 1.43
//   at 8 MiB (against the rings): from 128 KiB the Xeon gains more than the EPYC loses.
//   Through the areas an all_gather copies a rank's block once for all its readers, so reading
//   directly saves one copy in p and costs a superstep (4 ranks on the Xeon's 2 cores, 8 KiB-512 KiB
//   blocks: 1.13-1.81, 2 MiB 0.93): 2 ranks only.
// - all_to_all from pieces of 1 MiB: 2 ranks, the Xeon 0.94 at 32 KiB pieces, 0.54 at 128 KiB, 0.60 at
//   8 MiB; the EPYC 2.3 at 32 KiB, 1.16-1.33 at 128-512 KiB (30 iterations), 0.81 at 1 MiB, 1.04 at
//   2 MiB, 1.22-1.25 at 4-8 MiB.
//   4 ranks on 2 cores: the Xeon 0.56-0.87 at every size (it saves half the copies), the EPYC 1.15-2.5
//   at 32 KiB-1 MiB pieces (2.5 at 32 KiB, 1.15 at 1 MiB) and level at 4 MiB. From 1 MiB the EPYC
//   loses less than the Xeon gains.
// - broadcast never: a root waits for its readers' reads, where through the areas it goes on once they
//   are written, and a root buffer its own core just wrote is read across cores slower by the kernel
//   than by the readers' own copies (the Xeon: 1.64-2.46 at 4-256 KiB with the bench's copy into the
//   root's buffer before each call; without it 0.6 at 64 KiB-1 MiB but 1.2 at 4 MiB).
// - all_reduce (all_reduce_directly) only where the arena is chosen for it (WEFT_ALGO, a tuning file)
//   or WEFT_SHM_ARENA_CMA_BYTES names a size; then on 2 ranks from blocks of 1 MiB. Against the
//   table's bidirectional ring the Xeon took 0.61-0.83 of its time at 2-8 MiB and 0.84-1.09 at 1 MiB;
//   the EPYC 1.7-2.3x at 2-8 MiB and 1.15-1.45x at 16-64 MiB (its rings run twice as fast as the Xeon's,
//   its direct all_reduce as fast), so the table keeps the rings (selection.cpp). 4 ranks on the Xeon's
//   2 cores 1.05-1.90 (three supersteps of wake-ups, and the kernel's copy is slower than memcpy: it
//   saves only the areas' local copies).
constexpr std::size_t all_reduce_direct_from = std::size_t{1} << 20;
constexpr std::size_t all_gather_direct_from = std::size_t{128} << 10;
constexpr std::size_t all_to_all_direct_from = std::size_t{1} << 20;

// Whether a broadcast goes through its root's box (box_broadcast, below): the box wins over direct reads.
bool in_box(const CollectiveCall& call, int ranks) {
  if (call.collective != Collective::broadcast) return false;
  const std::size_t bytes = call.out.bytes();
  return bytes <= shm::Arena::slot_contents || (ranks >= 3 && bytes <= shm::Arena::box_capacity);
}

bool reads_directly(const shm::Arena& arena, const CollectiveCall& call, int ranks) {
  const std::uint64_t from = arena.direct_from();
  if (from == 0) return false;
  const bool defaults = from == shm::Arena::direct_defaults;
  switch (call.collective) {
    case Collective::broadcast: return !defaults && call.out.bytes() >= from && !in_box(call, ranks);
    case Collective::all_gather: return defaults ? ranks == 2 && call.in.bytes() >= all_gather_direct_from : call.in.bytes() >= from;
    case Collective::all_to_all: {
      const std::size_t piece = call.in.count / static_cast<std::size_t>(ranks) * dtype_size(call.in.dtype);
      return piece >= (defaults ? all_to_all_direct_from : from);
    }
    case Collective::all_reduce: {
      const std::size_t block = call.out.count / static_cast<std::size_t>(ranks) * dtype_size(call.out.dtype);
      return defaults ? ranks == 2 && block >= all_reduce_direct_from : block >= from;
    }
    default: return false;
  }
}

// One superstep's work on chunk `k`, for every collective but all_reduce in blocks: what this rank writes
// into its area before publishing, and what it reads from the areas after every rank published.
void write_chunk(ArenaRun& run, const GroupState& g, const CollectiveCall& call, const Chunks& chunks, std::size_t k) {
  const algo::Range chunk = chunks[k];
  const std::size_t off = chunk.offset;
  const std::size_t c = chunk.count;
  if (c == 0) return;  // nothing to write (and an empty view's pointer may be null, which memcpy may not be given)
  switch (call.collective) {
    case Collective::all_reduce:
    case Collective::all_gather: {
      const std::size_t esize = dtype_size(call.in.dtype);
      const std::byte* from = call.in.bytes_ptr() + off * esize;
      shm::copy_to_shared(run.area(chunks.area_bytes(k), from), from, c * esize);
      break;
    }
    case Collective::reduce_scatter:
    case Collective::all_to_all: {
      const std::size_t esize = dtype_size(call.in.dtype);
      const auto p = static_cast<std::size_t>(g.size);
      const std::size_t n = call.in.count / p;
      // Aligned like the first piece's source (the others are alike too when the call is one chunk).
      std::byte* area = run.area(chunks.area_bytes(k), call.in.bytes_ptr() + off * esize);
      const bool own_direct = own_piece_from_input(call);
      for (std::size_t q = 0; q < p; ++q) {
        if (own_direct && q == static_cast<std::size_t>(g.rank)) continue;  // read_chunk takes it from the input
        shm::copy_to_shared(area + q * c * esize, call.in.bytes_ptr() + (q * n + off) * esize, c * esize);
      }
      break;
    }
    case Collective::broadcast: {
      const std::size_t esize = dtype_size(call.out.dtype);
      const std::byte* from = call.out.bytes_ptr() + off * esize;
      if (g.rank == call.root) shm::copy_to_shared(run.area(chunks.area_bytes(k), from), from, c * esize);
      break;
    }
    default: break;  // barrier: the header says it all
  }
}

void read_chunk(ArenaRun& run, GroupState& g, const CollectiveCall& call, const Chunks& chunks, std::size_t k) {
  const algo::Range chunk = chunks[k];
  const std::size_t off = chunk.offset;
  const std::size_t c = chunk.count;
  if (c == 0) return;  // nothing to read or fold
  const auto p = static_cast<std::size_t>(g.size);
  std::vector<const std::byte*>& sources = g.arena_sources;
  switch (call.collective) {
    case Collective::all_reduce: {
      const std::size_t esize = dtype_size(call.out.dtype);
      sources.resize(p);
      for (std::size_t r = 0; r < p; ++r) sources[r] = run.area_of(static_cast<int>(r), chunks.area_bytes(k));
      algo::fold_in_rank_order(call.out.bytes_ptr() + off * esize, sources, c, call.out.dtype, call.op);
      break;
    }
    case Collective::all_gather: {
      const std::size_t esize = dtype_size(call.in.dtype);
      const std::size_t n = call.in.count;
      for (int r = 0; r < g.size; ++r) {
        std::byte* to = call.out.bytes_ptr() + (static_cast<std::size_t>(r) * n + off) * esize;
        // In place this rank's block is where its input already is: copying it back is a third copy.
        if (r == g.rank && to == call.in.bytes_ptr() + off * esize) continue;
        std::memcpy(to, run.area_of(r, chunks.area_bytes(k)), c * esize);
      }
      break;
    }
    case Collective::reduce_scatter:
    case Collective::all_to_all: {
      // Rank r takes piece r of every area.
      const std::size_t esize = dtype_size(call.in.dtype);
      const std::size_t n = call.in.count / p;
      const std::size_t mine = static_cast<std::size_t>(g.rank) * c * esize;
      if (call.collective == Collective::reduce_scatter) {
        sources.resize(p);
        for (std::size_t r = 0; r < p; ++r) sources[r] = run.area_of(static_cast<int>(r), chunks.area_bytes(k)) + mine;
        const auto me = static_cast<std::size_t>(g.rank);
        if (own_piece_from_input(call)) sources[me] = call.in.bytes_ptr() + (me * n + off) * esize;
        algo::fold_in_rank_order(call.out.bytes_ptr() + off * esize, sources, c, call.out.dtype, call.op);
      } else {
        for (std::size_t r = 0; r < p; ++r) {
          std::byte* to = call.out.bytes_ptr() + (r * n + off) * esize;
          if (r == static_cast<std::size_t>(g.rank)) {
            // This rank's own piece, straight from its input (own_piece_from_input); in place it is
            // already where it belongs. Out of place the input does not overlap the output.
            const std::byte* from = call.in.bytes_ptr() + (r * n + off) * esize;
            if (from != to) std::memcpy(to, from, c * esize);
            continue;
          }
          std::memcpy(to, run.area_of(static_cast<int>(r), chunks.area_bytes(k)) + mine, c * esize);
        }
      }
      break;
    }
    case Collective::broadcast: {
      const std::size_t esize = dtype_size(call.out.dtype);
      if (g.rank != call.root) std::memcpy(call.out.bytes_ptr() + off * esize, run.area_of(call.root, chunks.area_bytes(k)), c * esize);
      break;
    }
    default: break;
  }
}

// After the last chunk: the reductions' average divides.
void finish_call(const GroupState& g, const CollectiveCall& call) {
  if (call.collective == Collective::all_reduce || call.collective == Collective::reduce_scatter) {
    algo::finish_reduction(call.op, call.out.data, call.out.count, call.out.dtype, g.size);
  }
}

Task<void> all_reduce_in_blocks(ArenaRun& run, GroupState& g, const CollectiveCall& call, const Chunks& chunks) {
  const std::size_t esize = dtype_size(call.out.dtype);
  const auto p = static_cast<std::size_t>(g.size);
  const std::byte* in = call.in.bytes_ptr();
  std::byte* out = call.out.bytes_ptr();
  std::vector<const std::byte*>& sources = g.arena_sources;
  sources.resize(p);
  std::uint32_t step = 0;
  for (std::size_t k = 0; k < chunks.count(); ++k) {
    const algo::Range chunk = chunks[k];
    const std::size_t off = chunk.offset;
    const std::size_t c = chunk.count;
    const std::size_t held = chunks.area_bytes(k);
    // Every block of the chunk but this rank's own goes into its area: only this rank reduces its own
    // block, and it reads that one from its input (a copy of 1/p of the chunk less; in place too, since
    // the fold writes into the area and the output is written only after the next wait).
    const algo::Range mine = algo::block(c, g.size, g.rank);
    const std::byte* from = in + off * esize;
    std::byte* area = run.area(held, from);
    const std::size_t own_end = (mine.offset + mine.count) * esize;
    shm::copy_to_shared(area, from, mine.offset * esize);
    shm::copy_to_shared(area + own_end, from + own_end, c * esize - own_end);
    run.publish(step);
    co_await run.wait(step++);
    // This rank's block of the chunk, reduced from every area (its own from its input) into its own next
    // area; then every block from its owner's area.
    for (std::size_t r = 0; r < p; ++r) sources[r] = run.area_of(static_cast<int>(r), held) + mine.offset * esize;
    sources[static_cast<std::size_t>(g.rank)] = from + mine.offset * esize;
    std::byte* reduced = run.area(held) + mine.offset * esize;
    algo::fold_in_rank_order(reduced, sources, mine.count, call.out.dtype, call.op);
    run.publish(step);
    co_await run.wait(step++);
    for (int r = 0; r < g.size; ++r) {
      const algo::Range theirs = algo::block(c, g.size, r);
      std::memcpy(out + (off + theirs.offset) * esize, run.area_of(r, held) + theirs.offset * esize, theirs.count * esize);
    }
  }
}

// What a rank lends its readers in a direct collective, from its announce until its second superstep
// is over; the loan is taken back (revoked) if the script ends before: an error, a cancel, a deadline,
// the coroutine dropped. Declared after what it lends, so that the revoke comes before that is freed.
struct Loan {
  shm::Arena& arena;
  std::uint64_t seq;
  bool over = false;
  Loan(shm::Arena& a, std::uint64_t s) : arena(a), seq(s) {}
  Loan(const Loan&) = delete;
  Loan& operator=(const Loan&) = delete;
  ~Loan() {
    if (!over) arena.revoke(seq);
  }
};

using LentBytes = std::span<const std::byte>;

// What a rank lends in a direct collective: the root's buffer (broadcast), its input (all_gather,
// all_to_all); nothing for a broadcast's readers. (all_reduce_directly lends its input, then its output.)
LentBytes lent_by(const GroupState& g, const CollectiveCall& call) {
  switch (call.collective) {
    case Collective::broadcast: return g.rank == call.root ? LentBytes{call.out.bytes_ptr(), call.out.bytes()} : LentBytes{};
    case Collective::all_gather:
    case Collective::all_to_all: return LentBytes{call.in.bytes_ptr(), call.in.bytes()};
    default: return LentBytes{};
  }
}
// A rank lends a copy of what it would lend (read_directly) where the peers could not read it, or not
// for long enough: an all_to_all in place overwrites its input with what it reads while the peers still
// read it; a buffer the kernel cannot read for them (driver-mapped or secret memory: shm/lendable.hpp)
// would fail their reads. The second costs a system call, made only for a loan.
bool lends_a_copy(const CollectiveCall& call, LentBytes lent) {
  return (call.collective == Collective::all_to_all && share_bytes(call.in, call.out)) || !shm::kernel_can_read(lent.data(), lent.size());
}
// Copies `lent` into `copy` (scratch, ordinary memory the peers can read) and returns the copy's bytes.
LentBytes lend_a_copy(LentBytes lent, ScratchBytes& copy) {
  copy = scratch_bytes(lent.size());
  if (!lent.empty()) std::memcpy(copy.get(), lent.data(), lent.size());
  return LentBytes{copy.get(), lent.size()};
}
// `lent` where the kernel can read it for the peers, else a copy of it in `copy`.
LentBytes readable_loan(LentBytes lent, ScratchBytes& copy) {
  return shm::kernel_can_read(lent.data(), lent.size()) ? lent : lend_a_copy(lent, copy);
}

// Announces `lent` in this rank's next area (address and length, beside its header).
void announce(ArenaRun& run, LentBytes lent) {
  const std::uint64_t words[2] = {reinterpret_cast<std::uintptr_t>(lent.data()), lent.size()};
  std::memcpy(run.area(sizeof words), words, sizeof words);
}

// The reads of a direct collective, after every rank announced its loan: `read(r, offset, to, bytes,
// lent_bytes)` for every piece from a peer (false: stop), this rank's own piece copied from `lent` (what
// it lent: its own part of the input, or its copy of it). Whether every read returned true.
template <class ReadFn>
bool read_pieces(const GroupState& g, const CollectiveCall& call, const std::byte* lent, ReadFn&& read) {
  const auto p = static_cast<std::size_t>(g.size);
  const auto me = static_cast<std::size_t>(g.rank);
  std::byte* out = call.out.bytes_ptr();
  switch (call.collective) {
    case Collective::broadcast: return g.rank == call.root || read(call.root, 0, out, call.out.bytes(), call.out.bytes());
    case Collective::all_gather: {
      const std::size_t block = call.in.bytes();
      for (std::size_t r = 0; r < p; ++r) {
        if (r != me) {
          if (!read(static_cast<int>(r), 0, out + r * block, block, block)) return false;
        } else if (out + r * block != lent) {  // in place it is there already
          std::memcpy(out + r * block, lent, block);
        }
      }
      return true;
    }
    case Collective::all_to_all: {
      const std::size_t piece = call.in.count / p * dtype_size(call.in.dtype);
      for (std::size_t r = 0; r < p; ++r) {
        if (r != me) {
          if (!read(static_cast<int>(r), me * piece, out + r * piece, piece, call.in.bytes())) return false;
        } else if (out + r * piece != lent + r * piece) {
          std::memcpy(out + r * piece, lent + r * piece, piece);
        }
      }
      return true;
    }
    default: return true;
  }
}

// broadcast, all_gather and all_to_all reading the peers' buffers directly (reads_directly; arena.hpp,
// "Direct reads"): every rank announces what it lends (address and length, beside its header), then
// reads its pieces straight from the lenders into its output, then says it has finished; one copy of
// every byte, where the areas take two, and two supersteps at any size. `published`: the supersteps the
// caller's thread published already (run_on_arena_now; never for a loan of a copy).
Task<void> read_directly(ArenaRun& run, GroupState& g, const CollectiveCall& call, std::uint32_t published) {
  LentBytes lent = lent_by(g, call);
  ScratchBytes copy;
  if (published == 0 && lends_a_copy(call, lent)) lent = lend_a_copy(lent, copy);
  Loan loan(run.arena(), run.seq());  // from the announce on (or from the caller's thread's)
  if (published == 0) {
    announce(run, lent);
    run.publish(0);
  }
  if (published < 2) {
    co_await run.wait(0);
    read_pieces(g, call, lent.data(), [&](int r, std::size_t offset, std::byte* to, std::size_t bytes, std::size_t lent_bytes) {
      run.read_lent(r, offset, to, bytes, lent_bytes);
      return true;
    });
    // Every rank has read what it needed once every rank published this: the loans end.
    run.publish(1);
  }
  co_await run.wait(1);
  loan.over = true;
  // A lender that took its loan back while this rank read it ended its operation early: before its
  // second superstep (which it then publishes as cancelled, or never: the wait above failed), or during
  // its wait for it, where a cancel or the group's failure may not have reached this rank yet. The
  // bytes read may be the lender's next ones: this operation fails as the lender's did.
  if (const int r = run.lent_taken_back(); r >= 0) run.throw_taken_back(r);
}

// How much of each peer's block all_reduce_directly reads before it folds: the reads land in scratch that
// stays in the cache for the fold, and each is one system call (the kernel's copy here: 256 KiB 12 us).
constexpr std::size_t direct_fold_piece = std::size_t{256} << 10;

// all_reduce reading the peers' buffers directly (reads_directly): reduce-scatter, then all-gather, each
// read straight from the peers' buffers, three supersteps at any size. Every rank lends its input (the
// announce of step 0); folds its own block (algo::block) from every rank's input, the peers' read piece by
// piece into scratch, in rank order, into its output; lends its output (the announce of step 1); reads
// every other block from its owner's output; and says it has finished (step 2), after which nobody reads
// its buffers. The peers' inputs are read once (1/p each) and their reduced blocks once, where the areas
// copy every byte in and out twice. In place needs no copy: the peers read this rank's other blocks while
// it writes its own, and it writes the others only after every peer has read them (step 1's wait).
// Never started on the caller's thread (run_on_arena_now leaves it to the loop): it starts at step 0.
Task<void> all_reduce_directly(ArenaRun& run, GroupState& g, const CollectiveCall& call) {
  const std::size_t esize = dtype_size(call.out.dtype);
  const std::size_t n = call.out.count;
  const std::byte* in = call.in.bytes_ptr();
  std::byte* out = call.out.bytes_ptr();
  const algo::Range mine = algo::block(n, g.size, g.rank);
  // Lent as copies where the peers could not read them (lends_a_copy): the input at step 0, the output
  // (of which the peers read this rank's reduced block) at step 1.
  ScratchBytes input_copy, output_copy;
  Loan loan(run.arena(), run.seq());
  announce(run, readable_loan(LentBytes{in, call.in.bytes()}, input_copy));
  run.publish(0);
  co_await run.wait(0);
  {
    // This rank's block, piece by piece: every peer's piece read into scratch, then the fold. In place
    // from rank 2 on, the fold's first write (sources 0 and 1 into the output) would land on this rank's
    // own source before it is read: that source is copied into scratch too.
    const auto p = static_cast<std::size_t>(g.size);
    const std::size_t piece = std::max<std::size_t>(1, direct_fold_piece / esize);
    const std::size_t held = std::min(piece, mine.count) * esize;
    const bool own_copied = g.rank >= 2 && share_bytes(call.in, call.out);
    ScratchBytes scratch = scratch_bytes(held * p);
    std::vector<const std::byte*>& sources = g.arena_sources;
    sources.resize(p);
    for (std::size_t done = 0; done < mine.count; done += piece) {
      const std::size_t c = std::min(piece, mine.count - done);
      const std::size_t offset = (mine.offset + done) * esize;
      for (std::size_t r = 0; r < p; ++r) {
        std::byte* to = scratch.get() + r * held;
        if (r != static_cast<std::size_t>(g.rank)) {
          run.read_lent(static_cast<int>(r), offset, to, c * esize, call.in.bytes());
          sources[r] = to;
        } else if (own_copied) {
          std::memcpy(to, in + offset, c * esize);
          sources[r] = to;
        } else {
          sources[r] = in + offset;
        }
      }
      algo::fold_in_rank_order(out + offset, sources, c, call.out.dtype, call.op);
    }
  }
  announce(run, readable_loan(LentBytes{out, call.out.bytes()}, output_copy));
  run.publish(1);
  co_await run.wait(1);
  for (int r = 0; r < g.size; ++r) {
    if (r == g.rank) continue;
    const algo::Range theirs = algo::block(n, g.size, r);
    run.read_lent(r, theirs.offset * esize, out + theirs.offset * esize, theirs.count * esize, call.out.bytes());
  }
  run.publish(2);
  co_await run.wait(2);
  loan.over = true;
  if (const int r = run.lent_taken_back(); r >= 0) run.throw_taken_back(r);
  // Only now: the peers read this rank's block as its fold left it (the average's sum).
  finish_call(g, call);
}

// A broadcast that goes through its root's box: the root does not wait for its readers (arena.hpp,
// "Boxes"). One slot's worth on any group; up to box_capacity from 3 ranks. Measured (bench/RESULTS.md,
// "Small broadcasts that do not wait"): on 2 ranks, each on a core of its own, the reader keeps up and a
// superstep costs one line each way, and the box took 1.3x its time at 512 B and 1.9x at 2 KiB; from 3
// ranks the root running ahead made 512 B - 2 KiB 2.8-7x faster.
bool in_box(const GroupState& g, const CollectiveCall& call) { return in_box(call, g.size); }

// A box broadcast on the loop (`first_published`: the root's slot was written on the caller's thread).
Task<void> box_broadcast(ArenaRun& run, GroupState& g, const CollectiveCall& call, bool first_published) {
  shm::Arena& arena = run.arena();
  run.begin_box(call.root, call.out.bytes());
  if (g.rank == call.root) {
    if (!first_published) {
      co_await run.wait_box(shm::Arena::Waiting::free_slot);
      run.write_slot(call);
    }
    if (const int r = run.other_root(); r >= 0) run.throw_box_mismatch(r);
    run.finish_box();
    co_return;
  }
  co_await run.wait_box(shm::Arena::Waiting::slot);
  if (run.slot_disagrees()) run.throw_box_mismatch(call.root);
  if (run.slot_cancelled()) {
    run.finish_box();  // nothing to read, and the slot is done with
    run.throw_cancelled_in_arena(call.root);
  }
  arena.read_box(call.root, call.out.data, call.out.bytes());
  run.finish_box();
}

// The collective's script. `published`: its first supersteps (one, or two of a direct collective) were
// written and published already (by run_on_arena_now, on the caller's thread).
Task<void> run_script(ArenaRun& run, GroupState& g, const CollectiveCall& call, std::uint32_t published) {
  const bool first_published = published > 0;
  if (!has_script(call.collective)) {
    throw std::logic_error(fmt::format("weft: {} has no direct shared-memory algorithm", to_string(call.collective)));
  }
  if (in_box(g, call)) {
    co_await box_broadcast(run, g, call, first_published);
    co_return;
  }
  if (reads_directly(run.arena(), call, g.size)) {
    if (call.collective == Collective::all_reduce) {
      co_await all_reduce_directly(run, g, call);
    } else {
      co_await read_directly(run, g, call, published);
    }
    co_return;
  }
  const Chunks chunks = chunks_of(run.arena(), call, g.size);
  if (reduces_in_blocks(call)) {
    co_await all_reduce_in_blocks(run, g, call, chunks);
  } else {
    for (std::size_t k = 0; k < chunks.count(); ++k) {
      const auto step = static_cast<std::uint32_t>(k);
      if (k > 0 || !first_published) {
        write_chunk(run, g, call, chunks, k);
        run.publish(step);
      }
      co_await run.wait(step);
      read_chunk(run, g, call, chunks, k);
    }
  }
  finish_call(g, call);
}

// Waits for the ticket's turn (resumed on the loop by the holder before it, ArenaTurns::leave).
struct TakeTurn {
  ArenaTurns& turns;
  std::uint64_t ticket;
  bool await_ready() const noexcept { return turns.has_turn(ticket); }
  bool await_suspend(std::coroutine_handle<> h) { return turns.wait(ticket, h); }
  void await_resume() const noexcept {}
};

// A cancel of the Future: from any thread, handled on the loop. (A callable of its own, not a
// std::function: registered on every collective, it must not allocate.)
struct CancelOnArena {
  std::shared_ptr<GroupState> g;
  std::shared_ptr<Hook> hook;
  std::uint64_t seq;
  const char* op;
  void operator()() const {
    g->loop->post([g = g, hook = hook, seq = seq, op = op] {
      if (hook->finished) return;
      hook->cancelled = true;
      g->transport->cancel_operation(g->context, seq, fmt::format("rank {} cancelled {} #{}", g->rank, op, seq));
    });
  }
};

// The supersteps of `call` on `arena`.
std::uint32_t steps_of(const shm::Arena& arena, const CollectiveCall& call, int ranks) {
  if (reads_directly(arena, call, ranks)) return call.collective == Collective::all_reduce ? 3 : 2;
  const auto chunks = static_cast<std::uint32_t>(chunks_of(arena, call, ranks).count());
  return reduces_in_blocks(call) ? 2 * chunks : chunks;
}

// A cancelled collective's supersteps from `published` on, in the background: the one in progress
// waited for, the others published as cancelled (headers only) and waited for, so that every rank's
// count stays where the next collective expects it (arena.hpp, "Cancelling"). Holds the turn until then.
// A failure ends it: the group's later collectives report it.
Task<void> finish_cancelled(std::shared_ptr<GroupState> g, std::uint64_t seq, const char* op, OpSignature signature,
                            std::uint32_t published, std::uint32_t steps, ArenaTicket ticket) {
  ArenaRun run(*g, seq, op, signature, std::make_shared<Hook>(), true);
  run.mark_cancelled();
  try {
    if (published > 0) co_await run.wait(published - 1);
    for (std::uint32_t step = published; step < steps; ++step) {
      run.publish(step);
      co_await run.wait(step);
    }
  } catch (...) {
  }
  ticket.leave();
}

// The same for a cancelled box broadcast (`box`: its first slot): unless it was finished, the root writes
// its slot (marked cancelled, without contents) where it had not, a reader waits for the root's stamp;
// both then finish it, so that every rank's box count stays where the next one expects it.
Task<void> finish_box_cancelled(std::shared_ptr<GroupState> g, std::uint64_t seq, const char* op, OpSignature signature, int root,
                                std::size_t bytes, bool slot_written, std::uint64_t box, ArenaTicket ticket) {
  ArenaRun run(*g, seq, op, signature, std::make_shared<Hook>(), true);
  run.mark_cancelled();
  run.begin_box(root, bytes);
  try {
    if (g->arena->box_count() == box) {
      if (g->rank == root && !slot_written) {
        co_await run.wait_box(shm::Arena::Waiting::free_slot);
        run.write_slot(CollectiveCall{});
      } else if (g->rank != root) {
        co_await run.wait_box(shm::Arena::Waiting::slot);
      }
      run.finish_box();
    }
  } catch (...) {
  }
  ticket.leave();
}

}  // namespace

bool arena_group_failed(const GroupState& g) {
  return g.failed.load(std::memory_order_relaxed) || g.transport->context_may_have_failed(g.context);
}

Task<bool> run_on_arena(std::shared_ptr<GroupState> g, std::uint64_t seq, CollectiveCall call, ArenaTicket ticket,
                        std::uint32_t published, bool failed_at_call) {
  if (!g->arena) co_return false;
  const char* op = to_string(call.collective).data();
  const OpSignature signature = g->signed_by(signature_of_call(call), seq);
  const bool first_published = published > 0;
  if (!first_published) co_await TakeTurn{g->arena_turns, ticket.number()};
  auto hook = std::make_shared<Hook>();
  ArenaRun run(*g, seq, op, signature, hook, failed_at_call);
  run.published_before(published);
  const std::uint64_t box = g->arena->box_count();  // a box broadcast's first slot (the turn is this one's)
  std::exception_ptr failure;
  std::exception_ptr cancelled;
  {
    const std::stop_token token = co_await this_stop_token();
    std::optional<std::stop_callback<CancelOnArena>> on_stop;
    if (token.stop_possible()) on_stop.emplace(token, CancelOnArena{g, hook, seq, op});
    g->arena_seq = seq;
    g->transport->note_started(g->context, seq, signature);
    g->watch(seq, op);
    try {
      if (!first_published) run.check_cancelled();
      co_await run_script(run, *g, call, published);
    } catch (const Detach& detach) {
      cancelled = detach.error;
    } catch (const Error& e) {
      if (e.errc() != Errc::cancelled) g->mark_failed(e.what());
      failure = std::current_exception();
    } catch (...) {
      failure = std::current_exception();
    }
    hook->finished = true;
    g->unwatch(seq);
  }
  g->arena_seq = 0;
  if (cancelled) {
    // The Future fails now; the supersteps left go on in the background, holding the turn.
    if (in_box(*g, call)) {
      (void)spawn(*g->loop, finish_box_cancelled(g, seq, op, signature, call.root, call.out.bytes(), run.published() > 0, box, std::move(ticket)));
    } else {
      (void)spawn(*g->loop, finish_cancelled(g, seq, op, signature, run.published(), steps_of(*g->arena, call, g->size), std::move(ticket)));
    }
    std::rethrow_exception(cancelled);
  }
  // Whatever happened, the next collective waiting for the arena gets its turn.
  ticket.leave();
  if (failure) std::rethrow_exception(failure);
  co_return true;
}

ArenaNow run_on_arena_now(GroupState& g, std::uint64_t seq, const CollectiveCall& call, ArenaTicket& ticket) {
  if (!g.arena || !g.arena_turns.has_turn(ticket.number())) return ArenaNow::not_started;
  shm::Arena& arena = *g.arena;
  // Whatever failed (an abort, a lost peer, a mismatch) the loop sorts out: it knows which context and why.
  const auto failed = [&] { return arena_group_failed(g); };
  // A collective that may have been cancelled already (another member's cancel frame) is the loop's too.
  if (reduces_in_blocks(call) || failed() || g.transport->maybe_cancelled(seq)) return ArenaNow::not_started;
  // A direct collective's loan of a copy lives in the loop's script (read_directly). One that reads more
  // than an area holds is the loop's too: its reads would hold the caller as long as they take (64 MiB:
  // milliseconds), where the loop's thread lets the caller compute meanwhile, as the areas' chunks do.
  // (Bounding the output instead, at an area, made 2 MiB all_gathers on 2 ranks 1.3x slower.)
  const bool direct = reads_directly(arena, call, g.size);
  if (direct) {
    const auto p = static_cast<std::size_t>(g.size);
    const std::size_t reads = call.collective == Collective::broadcast ? call.out.bytes() : call.out.bytes() / p * (p - 1);
    if (call.collective == Collective::all_reduce || reads > arena.area_bytes() || lends_a_copy(call, lent_by(g, call))) {
      return ArenaNow::not_started;
    }
  }
  const Chunks chunks = chunks_of(arena, call, g.size);
  if ((!direct && chunks.count() != 1) || !has_script(call.collective)) return ArenaNow::not_started;
  const OpSignature signature = GroupState::signed_as(signature_of_call(call), algo::Kind::shm);
  const char* op = to_string(call.collective).data();
  // Polls until `done` holds: memory only, bounded, as long as the loop would (not at all where it does
  // not poll); a failed group ends it at once. Whether `done` held.
  const auto poll_until = [&](const auto& done) {
    const bool yielding = g.loop->polls_yielding();
    const std::chrono::microseconds spin = g.loop->polls() ? inline_spin() : std::chrono::microseconds(0);
    std::chrono::steady_clock::time_point until{};
    for (std::uint32_t polls = 1; !done(); ++polls) {
      if (polls % 64 != 0) continue;
      if (failed()) return false;
      const auto now = std::chrono::steady_clock::now();
      if (until == std::chrono::steady_clock::time_point{}) until = now + spin;
      if (now >= until) return false;
      // With more busy threads than cores the ranks being waited for need this core.
      if (yielding) std::this_thread::yield();
    }
    return true;
  };
  const auto finished = [&] {
    ticket.leave();
    g.transport->note_started(g.context, seq, signature);
    return ArenaNow::done;
  };
  // No hook: nothing here waits where a cancel could reach it (the loop's part makes its own).
  ArenaRun run(g, seq, op, signature, nullptr, false);
  if (direct) {
    // Announce, publish, read, publish, each wait polled for. Anything else (a rank late, a mismatch, a
    // read that did not go plainly) is the loop's from the last superstep published: its script reads
    // again after the first (the same bytes into the same place) and reports what went wrong. Nothing
    // here completes the Future, so the loan needs no revoke until the loop's script holds it.
    const LentBytes lent = lent_by(g, call);
    announce(run, lent);
    run.publish(0);
    poll_until([&] { return arena.reached(); });
    if (!arena.reached() || run.disagreeing(0) >= 0 || failed()) return ArenaNow::published;
    const bool read = read_pieces(g, call, lent.data(), [&](int r, std::size_t offset, std::byte* to, std::size_t bytes, std::size_t lent_bytes) {
      int error = 0;
      return run.try_read_lent(r, offset, to, bytes, lent_bytes, error) == ArenaRun::Read::done;
    });
    if (!read) return ArenaNow::published;
    run.publish(1);
    poll_until([&] { return arena.reached(); });
    if (!arena.reached() || run.disagreeing(1) >= 0 || failed()) return ArenaNow::published_both;
    return finished();
  }
  if (in_box(g, call)) {
    // The root writes its slot once it is free and goes on; a reader takes the root's slot once it is
    // stamped. Anything else (a slot not free or not stamped in time, a conflict, a failure) is the
    // loop's: from the stamped slot for a root (it reports the conflict), from the start for a reader
    // (it wrote nothing).
    run.begin_box(call.root, call.out.bytes());
    if (g.rank == call.root) {
      if (!poll_until([&] { return arena.slot_free(); })) return ArenaNow::not_started;
      run.write_slot(call);
      if (run.other_root() >= 0 || failed()) return ArenaNow::published;
      run.finish_box();
      return finished();
    }
    if (!poll_until([&] { return arena.stamped(call.root) || run.conflict_in_box() >= 0; }) || run.conflict_in_box() >= 0 ||
        run.slot_disagrees() || run.slot_cancelled() || failed()) {
      return ArenaNow::not_started;
    }
    arena.read_box(call.root, call.out.data, call.out.bytes());
    run.finish_box();
    return finished();
  }
  write_chunk(run, g, call, chunks, 0);
  run.publish(0);
  poll_until([&] { return arena.reached(); });
  // Otherwise the loop goes on from the published step: the wait, its deadline, the cancel, the reports.
  if (!arena.reached() || run.disagreeing(0) >= 0 || failed()) return ArenaNow::published;
  read_chunk(run, g, call, chunks, 0);
  finish_call(g, call);
  return finished();
}

}  // namespace weft::detail
