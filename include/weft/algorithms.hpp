#pragma once
/// Algorithms as plans and stages.
///
/// Glossary (one meaning per word, here and in the code):
///   block    one rank's share of a buffer: blocks_of(count, p) cuts `count` elements into p of them
///   segment  the unit a step's range travels in (Options::segment_bytes); pipeline_depth of them are in
///            flight per step
///   slot     a block-sized place in a staging buffer laid out in another order than the ranks' (Bruck's
///            rotated order, a binomial tree's virtual order); copied into rank order at the end
///   range    [offset, offset + count) in elements: what a step sends or receives
///   seq      an operation's sequence number on its group: every rank's n-th collective has the same one
///   tag      which message of an operation this is, between one sender and one receiver
///   context  a group's id on the shared transport (split and shrink derive new ones)
///   plan     one rank's script of steps for one operation: plain data, built without I/O
///   step     one send, receive, or both, of one range each (the kinds below)
///
/// A Plan is plain data: one rank's script of Steps (who sends which range to whom, who receives and
/// reduces into which range), built without any I/O and testable against a reference on its own. The
/// executor (a coroutine stage) runs a plan over a Channel, with several segments of each step in flight,
/// so that the reduction of one segment overlaps the transfer of the next.
///
/// The step names are the textbook's (NCCL's ring primitives):
///   send              send `send` range of the send buffer to `send_to`
///   recv              receive into `recv` range of the receive buffer from `recv_from`
///   recv_reduce       receive, then recv[i] = recv[i] op incoming[i]
///   recv_reduce_send  recv_reduce, then forward the reduced range to `send_to`
///   recv_copy_send    receive, then forward the received range to `send_to`
///   send_recv         send `send` and receive `recv` at the same time (exchanges)
///   send_recv_reduce  send `send` and recv_reduce `recv` at the same time
/// Forwarding steps send from the receive buffer (the range they just received); plain sends read the send
/// buffer. Both sides of a transfer must agree on its element count: plans are built symmetrically.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "weft/dtype.hpp"
#include "weft/loop.hpp"
#include "weft/reduce_op.hpp"
#include "weft/task.hpp"
#include "weft/transport.hpp"

namespace weft::algorithms {

/// A range of elements: [offset, offset + count).
struct Range {
  std::size_t offset = 0;
  std::size_t count = 0;
  friend bool operator==(const Range&, const Range&) = default;
};

enum class StepKind : std::uint8_t { send, recv, recv_reduce, recv_reduce_send, recv_copy_send, send_recv, send_recv_reduce };

std::string_view to_string(StepKind kind) noexcept;

struct Step {
  StepKind kind = StepKind::send;
  int send_to = -1;    ///< group rank, for kinds that send
  int recv_from = -1;  ///< group rank, for kinds that receive
  Range send{};        ///< elements sent (forwarding kinds: equal to `recv`)
  Range recv{};        ///< elements received (and reduced) into
  friend bool operator==(const Step&, const Step&) = default;
};

/// One rank's script.
using Plan = std::vector<Step>;

/// The i-th of `parts` nearly equal blocks of `count` elements (the first count % parts get one more).
Range block(std::size_t count, int parts, int i) noexcept;
/// All `parts` blocks of `count` elements, in order.
std::vector<Range> blocks_of(std::size_t count, int parts);

// ---- plans (rank `r` of `p`) ----

/// Ring reduce-scatter over the blocks `blocks[0..p)` of one buffer. With shift s, rank r finishes holding
/// the fully reduced block (r + s + 1) mod p; s = -1 leaves block r at rank r.
Plan ring_reduce_scatter(int p, int r, std::span<const Range> blocks, int shift);
/// Ring all-gather of blocks: rank r starts with block (r + shift + 1) mod p (complete), ends with all.
Plan ring_all_gather(int p, int r, std::span<const Range> blocks, int shift);
/// Ring all-reduce: reduce-scatter then all-gather, of `count` elements in place.
Plan ring_all_reduce(int p, int r, std::size_t count);
/// Bidirectional ring all-reduce, in place: the lower half of the buffer runs the ring r -> r+1 and the
/// upper half the ring r -> r-1 at the same time, so every connection carries data both ways.
Plan bidirectional_ring_all_reduce(int p, int r, std::size_t count);
/// Recursive doubling all-reduce, in place: lg p exchanges of the whole buffer (best for small ones).
/// Non-powers of two fold the first 2(p - 2^k) ranks in pairs before and unfold them after.
Plan recursive_doubling_all_reduce(int p, int r, std::size_t count);
/// Rabenseifner all-reduce, in place: recursive-halving reduce-scatter, then recursive-doubling
/// all-gather over 2^k blocks (with the same fold for non-powers of two).
Plan rabenseifner_all_reduce(int p, int r, std::size_t count);
/// Binomial reduce to rank 0 followed by binomial broadcast, in place.
Plan tree_all_reduce(int p, int r, std::size_t count);
/// Ordered exchange (the first half of deterministic reductions): rank r receives block r of every other
/// rank i into slot i of its receive buffer (slot size blocks[r].count), and sends its block j to rank j.
/// Its own slot is not in the plan (a local copy).
Plan ordered_exchange(int p, int r, std::span<const Range> blocks);
/// Bruck all-gather over a rotated buffer of p blocks of `count` elements: rank r starts with its block in
/// slot 0 and ends with block (r + i) mod p in slot i (the caller rotates). ceil(lg p) rounds, any p.
Plan bruck_all_gather(int p, int r, std::size_t count);
/// Recursive-doubling all-gather for a power-of-two p, over p blocks of `count` elements in rank order:
/// lg p exchanges, each of everything gathered so far. (Empty for other p: use Bruck.)
Plan recursive_doubling_all_gather(int p, int r, std::size_t count);
/// Broadcast for large buffers (van de Geijn): the root scatters the p blocks, then a ring all-gather.
Plan scatter_all_gather_broadcast(int p, int r, int root, std::size_t count);
/// Reduce for large buffers: a ring reduce-scatter, then every block gathered at the root.
Plan reduce_scatter_gather_reduce(int p, int r, int root, std::size_t count);
/// Bruck all-to-all for small blocks, over a rotated buffer of p blocks (slot i holds the block for rank
/// r + i; the caller rotates in and out): in round k every slot whose index has bit k set moves 2^k ranks
/// on. ceil(lg p) rounds instead of p - 1.
Plan bruck_all_to_all(int p, int r, std::size_t count);
/// Recursive-halving reduce-scatter for a power-of-two p, in place over p blocks of `count` elements:
/// lg p rounds, each exchanging half of what is left; block r ends reduced at rank r.
Plan recursive_halving_reduce_scatter(int p, int r, std::size_t count);
/// Binomial-tree broadcast of `count` elements from `root`.
Plan binomial_broadcast(int p, int r, int root, std::size_t count);
/// Chain (pipelined) broadcast from `root`: root -> root+1 -> ... -> root-1, each rank forwarding every
/// segment as it lands. Every rank sends at most once per segment, so back-to-back broadcasts are paced
/// by one send per rank instead of the binomial root's lg p; a lone broadcast takes p - 1 hops.
Plan chain_broadcast(int p, int r, int root, std::size_t count);
/// Binomial-tree reduce of `count` elements to `root` (every rank's receive buffer is its accumulator).
Plan binomial_reduce(int p, int r, int root, std::size_t count);
/// Gather: block i (count elements) of the root's receive buffer comes from rank i. The root's own block
/// is not in the plan (a local copy).
Plan direct_gather(int p, int r, int root, std::size_t count);
/// Binomial gather, over a buffer in virtual order (slot i: the block of rank root + r' + i, where
/// r' = r - root; slot 0 is this rank's own block, a local copy): lg p rounds, each child's subtree in one
/// message. The root's buffer ends with every block (the caller rotates it into rank order); the others
/// need room for their subtree.
Plan binomial_gather(int p, int r, int root, std::size_t count);
/// Binomial scatter, the gather reversed, over the same virtual-order buffer: the root's holds every
/// block; each rank ends with its own block in slot 0.
Plan binomial_scatter(int p, int r, int root, std::size_t count);
/// Gather of blocks of any size (gatherv): the root receives rank i's block into blocks[i] of its
/// receive buffer; rank i sends [0, blocks[i].count) of its send buffer. The root's own block is not in
/// the plan (a local copy). Every rank passes the same counts (the offsets matter at the root only).
Plan direct_gather(int p, int r, int root, std::span<const Range> blocks);
/// Scatter: block i of the root's send buffer goes to rank i, into [0, count) of its receive buffer.
Plan direct_scatter(int p, int r, int root, std::size_t count);
/// Scatter of blocks of any size (scatterv): blocks[i] of the root's send buffer goes to rank i, into
/// [0, blocks[i].count) of its receive buffer. The root's own block is not in the plan.
Plan direct_scatter(int p, int r, int root, std::span<const Range> blocks);
/// All-to-all: block j of the send buffer goes to rank j, arriving as block r of its receive buffer
/// (pairwise exchange order). The rank's own block is a local copy, not in the plan.
Plan pairwise_all_to_all(int p, int r, std::size_t count);
/// All-to-all of blocks of any size (all_to_allv): `sends[j]` of the send buffer goes to rank j, and
/// rank i's block for this rank lands in `recvs[i]`, in the same pairwise order. The two sides of each
/// pair must agree on its count (rank i's sends[j].count == rank j's recvs[i].count); a zero count still
/// travels as an empty message, so that a disagreement is found rather than waited on.
Plan pairwise_all_to_all(int p, int r, std::span<const Range> sends, std::span<const Range> recvs);
/// Dissemination barrier: ceil(log2 p) rounds of zero-byte exchanges.
Plan dissemination_barrier(int p, int r);

/// The algorithms this build implements for `collective` ("all_reduce", ...); empty for an unknown one.
/// The names are those of WEFT_ALGO and tuning files.
const std::vector<std::string_view>& available_algorithms(std::string_view collective);

// ---- execution ----

/// Where a plan's messages go: a transport, a context (the Group's), the operation's sequence number,
/// and the transport rank of each group rank.
struct Channel {
  Loop* loop = nullptr;             ///< the transport's loop (cancellation is posted to it)
  Transport* transport = nullptr;
  std::uint32_t context = 0;
  std::uint64_t seq = 0;
  int rank = 0;                     ///< this rank in the group
  std::span<const int> members;     ///< group rank -> transport rank
  const char* op_name = "collective";
  std::uint64_t first_tag = 0;      ///< tags start here: a second plan of the same operation uses its own
  /// The operation's signature, carried by every frame and compared with the peers' (mismatch detection;
  /// a call of 0 is not compared). Group fills it in from the collective's arguments.
  OpSignature signature{};
};

struct ExecOptions {
  std::size_t segment_bytes = 256 * 1024;  ///< a step's range travels in segments of this size
  int pipeline_depth = 8;                  ///< segments in flight per step (Options::pipeline_depth): of a
                                           ///< reducing step, at least this many are posted ahead ...
  std::size_t scratch_bytes = 16 << 20;    ///< ... and up to this many bytes of them (scratch memory)
};

/// Buffers that someone else fills and empties while a plan runs over them (device staging: the copy in
/// from the device lands piece by piece, and each range goes back to the device as soon as the plan has
/// written it for the last time). The executor asks before it reads or writes a byte of the buffers, and
/// says when a range of the receive buffer is final. Called on the loop's thread, by one plan at a time.
class StagedBuffers {
 public:
  /// Whether [lo, hi) may be read and written now (every piece of the copy in that overlaps it landed).
  virtual bool ready(const std::byte* lo, const std::byte* hi) = 0;
  /// Completes once [lo, hi) is ready. Never throws: a copy in that failed or was cancelled completes it
  /// too, and its owner fails the operation (the group is aborted, so the plan's transfers end).
  virtual Task<void> until_ready(const std::byte* lo, const std::byte* hi) = 0;
  /// [lo, hi) of the receive buffer holds its final value: no later step of the plan writes it.
  virtual void finished(std::byte* lo, std::byte* hi) = 0;

 protected:
  ~StagedBuffers() = default;
};

/// The buffers a plan runs over. `send` may equal `recv`.
struct PlanBuffers {
  const std::byte* send = nullptr;
  std::byte* recv = nullptr;
  DType dtype = DType::u8;
  ReduceOp op = ReduceOp::sum;  ///< used by the reducing kinds
  /// Where reducing steps read this rank's own contribution: recv[i] = local[i] op incoming[i]. Null: the
  /// receive buffer already holds it (recv[i] = recv[i] op incoming[i]). A non-null `local` spares the
  /// copy of the input into the receive buffer, for plans that reduce each range at most once (the ring).
  const std::byte* local = nullptr;
  /// Null: the buffers are ready and nobody else touches them. Otherwise: see StagedBuffers.
  StagedBuffers* staged = nullptr;
};

/// Runs `plan` (this rank's script). Completes when every send of the plan may be reused and every
/// receive has landed. Errors: weft::Error naming the channel's rank, op name, seq and the peer involved.
/// Cancellation: through the awaiting Task's stop token (the channel's context is aborted).
Task<void> execute(const Channel& channel, const Plan& plan, PlanBuffers buffers, ExecOptions options = {});

}  // namespace weft::algorithms
