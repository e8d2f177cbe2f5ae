#pragma once
/// weft::Group: a set of ranks that communicate. Every operation returns a weft::Future at once and runs
/// on the Group's Loop; the Future can be co_awaited, polled, waited on from plain code, or cancelled.
///
/// Ordering: collectives must be called in the same order on every rank of the group (they are matched
/// by their sequence number). Several may be in flight at once. Point-to-point messages match by
/// (source, tag), in order.
///
/// Errors (for every operation):
///  - Preconditions (a bad root or peer, a wrong buffer size, an op not defined on the dtype, a buffer
///    whose byte count would exceed 2^47, an empty Group, a group that already failed) throw weft::Error
///    from the call itself, before any byte is sent or allocated.
///  - Failures while running complete the Future with a weft::Error naming this rank, the operation, its
///    sequence number and the peer: weft::PeerFailure when a member's connection is lost (every pending
///    operation of the group on every surviving rank then fails), Errc::size_mismatch when a peer sent a
///    different size, Errc::aborted when another rank's operation failed, Errc::timeout past a deadline
///    (Options::timeout, with_timeout), Errc::cancelled when a rank cancelled it.
///  - After a collective fails (other than by cancellation) the group is failed: later calls throw
///    Errc::group_failed; shrink() makes a new group of the members still reachable.
///
/// Cancellation: Future::cancel() (or the stop token of an awaiting Task). A cancelled receive that has not
/// matched is withdrawn. A cancelled collective is cancelled on every member (a cancel frame): its
/// Future fails with weft::CancelledError here and on the ranks in it ("rank 0 cancelled all_reduce #5"),
/// a rank that calls it later fails at once the same way, its messages are dropped, and the group goes on
/// with the next operation. A cancelled send cannot be withdrawn from the receiver's view: the group is
/// aborted on every member (their pending operations fail with Errc::aborted naming this rank) and later
/// calls say so (Errc::group_failed).
/// Lifetime: buffers must stay valid until the operation's Future completes. The Group must be destroyed
/// before its Loop; destroying it shuts its connections down (peers see this rank leave).
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "weft/algorithms.hpp"
#include "weft/buffer.hpp"
#include "weft/future.hpp"
#include "weft/loop.hpp"
#include "weft/options.hpp"
#include "weft/reduce_op.hpp"

namespace weft {

namespace detail {
struct GroupState;
struct CollectiveCall;
}
namespace gpu {
class Stream;
class Epilogue;
}

class Group {
 public:
  /// An empty group (valid() is false).
  Group() = default;

  /// Bootstraps a group: every rank calls it with the same store and world size (Options::from_environment
  /// fills what is unset). Rank 0 serves the store. Returns when every pair of ranks is connected.
  /// Errors: weft::Error; a weft::TimeoutError names the ranks that never arrived.
  /// The one-argument form takes every option from the environment. (Two overloads rather than a
  /// defaulted `Options options = {}`: g++ 12 frees such a default argument twice inside a co_await
  /// expression, so `co_await Group::create(loop)` crashed with "free(): invalid pointer". Under g++ 12
  /// name the Options before a co_await: `co_await Group::create(loop, {})` still trips that bug.)
  static Future<Group> create(Loop& loop);
  static Future<Group> create(Loop& loop, const Options& options);

  /// False for an empty Group (default-constructed, moved from, or what split() gives a rank with a
  /// negative color). Every operation of an empty Group throws weft::Error (invalid_argument) naming
  /// the operation; rank() is then -1, size() 0 and transport_name() empty.
  bool valid() const noexcept { return static_cast<bool>(state_); }
  int rank() const noexcept;
  int size() const noexcept;
  /// How this rank's bytes move: "tcp" (Asio) or "uring" (Options::transport, after any fallback), with
  /// "shm+" before it where some peers are reached through shared memory.
  std::string_view transport_name() const noexcept;
  /// How this rank's bytes move to group rank `peer`: "shm", "tcp" or "uring"; "self" for this rank.
  /// Errors: weft::Error (invalid_argument) for a rank outside the group.
  std::string_view transport_to(int peer) const;
  /// Whether the group's collectives can run in a group arena (every rank on this host, over shm: the
  /// registry's "shm" algorithms; docs/DESIGN.md, "Direct shm collectives").
  bool has_shared_arena() const noexcept;
  Loop& loop() const;

  // ---- point to point ----
  /// Sends `data` to `dst`. Completes when `data` may be reused.
  /// Errors name the call as "send #n (peer dst) [tag t]": n counts this rank's sends to `dst` from 1
  /// (a refused call takes no number), not the group's collectives.
  Future<void> send(ConstBufferView data, int dst, std::uint32_t tag = 0);
  /// Receives exactly data.bytes() bytes from `src` with `tag`. A message of another dtype fails the
  /// receive with Errc::mismatch (u8 is raw bytes and agrees with every dtype, either side), one of another
  /// size with Errc::size_mismatch; either way its bytes are discarded and the group stays usable.
  /// Errors name it "recv #n (peer src) [tag t]", n counting this rank's receives from `src`: with one
  /// tag, the n-th receive takes the sender's send #n.
  Future<void> recv(BufferView data, int src, std::uint32_t tag = 0);

  // ---- collectives ----
  // Buffers that share bytes: each collective below has one in-place layout (the same address; the
  // input as this rank's block of the output; or the output as this rank's block of the input, as each
  // says). An input and an output that overlap in any other way fail at the call with
  // Errc::invalid_argument, before anything is sent: the algorithms read the input while they write
  // the output.
  /// In place: every rank ends with the reduction of every rank's `data`.
  Future<void> all_reduce(BufferView data, ReduceOp op = ReduceOp::sum);
  /// Out of place: `out` (same count and dtype as `in`) receives the reduction.
  Future<void> all_reduce(ConstBufferView in, BufferView out, ReduceOp op = ReduceOp::sum);
  /// Out of place, through an epilogue (weft/gpu.hpp: scale, cast, both, or your own): `out`, of
  /// epilogue.output(in.dtype) and in.count elements, receives the epilogue of the reduction (avg: of
  /// the mean), applied once per element. It runs where `out` is: on its device, in the operation's
  /// stream order (on(stream): queued after the operation's copy back, and later work on the stream
  /// waits for it), or on the loop for host memory. `out` may be `in`'s memory (the reduction is taken
  /// first). An epilogue that keeps the dtype is applied in `out`; one that changes it reduces into
  /// scratch of in.dtype first (device memory of `out`'s device, freed off the loop afterwards).
  /// Errors (at the call): invalid_argument for an out of another dtype or count, a custom epilogue made
  /// for another input dtype or without the function where `out` is (a GPU needs its launch function,
  /// the sim and host memory its host function); then as all_reduce.
  Future<void> all_reduce(ConstBufferView in, BufferView out, ReduceOp op, const gpu::Epilogue& epilogue);
  /// `out` holds size() blocks of in.count elements, block i from rank i. `in` may be block rank() of `out`.
  Future<void> all_gather(ConstBufferView in, BufferView out);
  /// `in` holds size() blocks of out.count elements; rank i receives the reduction of every rank's block i.
  /// `out` may be block rank() of `in` (in place).
  Future<void> reduce_scatter(ConstBufferView in, BufferView out, ReduceOp op = ReduceOp::sum);
  /// `data` of `root` is copied to every rank's `data`.
  Future<void> broadcast(BufferView data, int root);
  /// The reduction of every rank's `in` lands in `out` at `root`; `out` is not touched elsewhere (it may be
  /// empty there). At the root `out` may be `in` (in place).
  Future<void> reduce(ConstBufferView in, BufferView out, int root, ReduceOp op = ReduceOp::sum);
  /// `out` at root holds size() blocks of in.count elements, block i from rank i; ignored elsewhere. At the
  /// root `in` may be block root of `out` (in place).
  Future<void> gather(ConstBufferView in, BufferView out, int root);
  /// Block i of root's `in` (size() blocks of out.count elements) lands in rank i's `out`. At the root
  /// `out` may be block root of `in` (in place).
  Future<void> scatter(ConstBufferView in, BufferView out, int root);
  /// `in` and `out` hold size() blocks each; block j of rank i's `in` lands in block i of rank j's `out`.
  /// `in` may be `out` (in place).
  Future<void> all_to_all(ConstBufferView in, BufferView out);
  /// Completes on every rank once every rank has called it.
  Future<void> barrier();

  // ---- variable-size collectives (MPI's v-forms: a count per rank)
  // `counts` has one entry per rank, in elements; a displacement (`displs`) is where that rank's block
  // starts in the buffer it describes, in elements; empty `displs`: the blocks packed in rank order
  // (prefix sums of the counts). Every rank passes the same `counts` (for gatherv and scatterv too, not
  // only the root): they are part of the operation's signature, so a rank whose counts differ fails the
  // operation on every rank with Errc::mismatch naming it ("rank 2 called all_gatherv #4 (f32, counts
  // digest ...) while rank 0 called ..."), however its blocks would have lined up. Displacements are
  // this rank's own business and may differ between ranks. The blocks an output receives must not
  // overlap; a buffer may be longer than its blocks reach (the rest is not touched). Zero counts are
  // fine. Errors at the call (invalid_argument): a counts or displs list whose length is not size(), an
  // input whose count is not this rank's count, an output too short for its blocks, overlapping output
  // blocks, sums past what a buffer can hold.

  /// Rank i's `in` (counts[i] elements) lands in every rank's `out` at displs[i]. `in` may be this
  /// rank's own block of `out` (in place).
  Future<void> all_gatherv(ConstBufferView in, BufferView out, const std::vector<std::size_t>& counts,
                           const std::vector<std::size_t>& displs = {});
  /// Rank i's `in` (counts[i] elements) lands in root's `out` at displs[i] (displs matter at the root
  /// only); `out` is not touched elsewhere (it may be empty there). At the root `in` may be its own block
  /// of `out` (in place).
  Future<void> gatherv(ConstBufferView in, BufferView out, const std::vector<std::size_t>& counts, int root,
                       const std::vector<std::size_t>& displs = {});
  /// counts[i] elements at displs[i] of root's `in` land in rank i's `out` (counts[i] elements). `in` is
  /// read at the root only (it may be empty elsewhere); blocks of `in` may overlap. At the root `out` may
  /// be its own block of `in` (in place).
  Future<void> scatterv(ConstBufferView in, BufferView out, const std::vector<std::size_t>& counts, int root,
                        const std::vector<std::size_t>& displs = {});
  /// send_counts[j] elements at send_displs[j] of this rank's `in` land in rank j's `out` at its
  /// recv_displs[i] (i: this rank). Counts differ from rank to rank by nature, so they are not signed:
  /// rank i's send_counts[j] must equal rank j's recv_counts[i], and a pair that disagrees fails the
  /// receiving rank's operation with Errc::size_mismatch naming the sender (then every rank's, as any
  /// failure). A zero count still travels as an empty message, so a disagreement is found, not waited on.
  /// `in` may be `out` (in place: the input is copied first).
  Future<void> all_to_allv(ConstBufferView in, BufferView out, const std::vector<std::size_t>& send_counts,
                           const std::vector<std::size_t>& recv_counts, const std::vector<std::size_t>& send_displs = {},
                           const std::vector<std::size_t>& recv_displs = {});
  /// `in` holds size() blocks packed in rank order, block i of counts[i] elements; rank i's `out`
  /// (counts[i] elements) receives the reduction of every rank's block i. `out` may be block rank() of
  /// `in` (in place).
  Future<void> reduce_scatterv(ConstBufferView in, BufferView out, const std::vector<std::size_t>& counts,
                               ReduceOp op = ReduceOp::sum);
  /// Each (src, dst) pair: src's `in` lands in dst's `out`. A rank sends to at most one rank and receives
  /// from at most one; a rank that receives from nobody gets zeros. Every rank passes the same pairs.
  /// `in` and `out` may share bytes in any way (what is sent is copied first).
  Future<void> permute(ConstBufferView in, BufferView out, std::vector<std::pair<int, int>> pairs);
  /// Collective over this group: ranks with the same `color` form a new group, ordered by (key, rank).
  /// A negative color leaves the rank out (its Future yields an invalid Group).
  Future<Group> split(int color, int key);

  /// A view of this group whose operations have `timeout` as their deadline instead of Options::timeout
  /// (0: none); everything else is shared: `co_await group.with_timeout(5s).all_reduce(x)`.
  /// A collective past its deadline fails as described at Options::timeout (every member, with a report
  /// of the ranks that had not joined it). A receive past its deadline that has not matched is withdrawn
  /// and fails with Errc::timeout; the group stays usable. A send past its deadline (the receiver did not
  /// take it) aborts the group, as cancelling it would.
  /// Errors: weft::Error (invalid_argument) for a negative timeout or one longer than a year
  /// (max_duration), as for Options::timeout.
  Group with_timeout(std::chrono::milliseconds timeout) const;

  /// A view of this group whose operations are ordered on `stream` (weft::gpu): each waits for the work
  /// queued on the stream before it reads its input, and work queued on the stream after the call waits
  /// (on the device, the host does not block) until the operation has written its output:
  /// `backward(stream); group.on(stream).all_reduce(grads); optimizer(stream);` with no host sync.
  /// Without a stream, an operation on device buffers runs on a stream of the group's own, after nothing
  /// the caller queued elsewhere (synchronise first, as with any other stream). Everything else is
  /// shared, as with_timeout's view. Device buffers: docs/DESIGN.md, "Device buffers": the same host
  /// operation runs on page-locked staging memory, so results are bitwise those of host buffers.
  /// Errors (at the call): weft::Error (invalid_argument) when the stream is on another device than the
  /// buffers or completes on another Loop. A device that fails aborts the group (every member's
  /// operation fails naming this rank); this rank's Future fails with Errc::device_failure.
  /// Lifetime: the stream must outlive the calls made through the view (not their Futures).
  /// Ranks of one process that share a device: the wait holds the stream on the device (a one-thread
  /// kernel under cuda), and freeing device memory waits for the whole device (cudaFree, DeviceBuffer),
  /// so a rank must not free device memory while another rank of that device has an operation through
  /// on() in flight that needs this rank (it would wait for itself). NCCL's kernels carry the same rule.
  Group on(gpu::Stream& stream) const;

  /// A view whose operations have no deadline (`with_timeout(0ms)`), for long-lived waits such as a
  /// server's command channel: a rank waiting in `broadcast` or `recv` for the next request, however long
  /// it comes, while every other call keeps Options::timeout. Such a wait still ends on a lost peer
  /// (PeerFailure), an abort() or a cancel(): `co_await group.without_deadline().broadcast(command, 0)`.
  Group without_deadline() const { return with_timeout(std::chrono::milliseconds(0)); }

  /// Fails every operation in flight on this group at once, here and on every other member (an abort
  /// frame): their Futures fail with Errc::aborted and a message naming this rank and `reason`. The group
  /// is failed afterwards (later calls throw Errc::group_failed); shrink() makes a new group of the
  /// members still reachable. Thread-safe; returns at once.
  void abort(const std::string& reason = {});

  /// After a failure (or at any time): the members this rank still reaches agree on who they are and
  /// form a new group of them, in this group's order. Every surviving member must call it, as many times
  /// as the others; it works on a failed group. A member that neither answers nor fails within
  /// clamp(Options::timeout, 100 ms, 30 s) per round is left out and its connection closed.
  /// Returns: the new Group (its rank() and size() may differ). A rank every other member left out gets
  /// a group of one. Errors: none of its own; the new group's collectives report failures as usual.
  /// Limits: members that fail *during* the shrink may leave the survivors with different groups; the
  /// next collective then fails (at its deadline at worst) and shrinking again converges.
  Future<Group> shrink();

  /// Runs a plan (algorithms.hpp: a public builder's or your own) as one collective of this group: it
  /// takes the next sequence number, so every rank must call it in the same order as the other
  /// collectives, each with its own rank's plan. This is how new collectives are built from public
  /// pieces (examples/hierarchical_all_reduce.cpp).
  /// Errors: weft::Error (invalid_argument), before anything is sent, for a step naming a rank outside the
  /// group, a kind that is no StepKind, a range that reaches past 2^47 bytes or moves through a null
  /// buffer, a dtype or op that is none or not defined; failures while running as for any collective.
  /// PlanBuffers has no sizes: that each range fits its buffer is the caller's to ensure, as MPI's counts.
  /// Lifetime: the buffers must outlive the Future.
  Future<void> run_plan(algorithms::Plan plan, algorithms::PlanBuffers buffers, const char* name = "plan");

  /// Replaces this rank's algorithm choices for the collectives `spec` names (WEFT_ALGO syntax). Every
  /// rank must make the same change before its next collective, and not while calling collectives from
  /// another thread: a call that ranks run with different algorithms fails on every rank with
  /// Errc::mismatch naming both. Errors: weft::Error (invalid_argument) saying what was expected.
  void override_algorithms(std::string_view spec);

  /// The algorithm this group runs for `collective` ("all_reduce", ...) on a buffer of `bytes` bytes
  /// (the built-in table, overridden by Options::algorithms / WEFT_ALGO); empty for a collective without
  /// a choice (permute). Errors: weft::Error (invalid_argument) when `collective` names none.
  std::string algorithm_for(std::string_view collective, std::size_t bytes) const;

  /// The group's state; for weft's own layers.
  const std::shared_ptr<detail::GroupState>& state() const noexcept { return state_; }
  explicit Group(std::shared_ptr<detail::GroupState> state);

  /// Copies are handles to the same group. Lifetime: every handle must be gone before the group's Loop
  /// is destroyed; a Loop destroyed under one stops the process with a message saying so (the handle
  /// would otherwise run on freed memory). Operations still in flight without a handle do not count.
  Group(const Group& other);
  Group(Group&& other) noexcept = default;
  Group& operator=(const Group& other);
  Group& operator=(Group&& other) noexcept;
  ~Group();

 private:
  // The state, or weft::Error naming `op` for an empty Group.
  detail::GroupState& live(const char* op) const;
  // The one path of every buffer collective: validate the call against its collective's rules, choose
  // the algorithm, take the sequence number, start the task.
  Future<void> submit(const detail::CollectiveCall& call);

  std::shared_ptr<detail::GroupState> state_;
  std::chrono::milliseconds timeout_{-1};  // with_timeout(); negative: the group's Options::timeout
  gpu::Stream* stream_ = nullptr;          // on(); null: device operations use the group's own stream
};

}  // namespace weft
