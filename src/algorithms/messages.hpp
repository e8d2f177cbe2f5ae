#pragma once
// A plan of whole messages, run without a coroutine. The executor (execute) runs any plan in a coroutine
// frame of its own, under the collective's task and the group's wrapper: three frames, a plan run's
// cancel hook and a Future's driver per call. Over TCP that chain was most of a small broadcast's user
// time at the root (bench/RESULTS.md, "Where the 2-rank tcp broadcast's extra microsecond goes"). A plan
// whose every message goes whole (one segment), with nothing to reduce or forward segment by segment,
// needs none of it: this runs such a plan step by step from the transport's completions. (A whole
// message that is reduced is reduced once, after it landed: nothing to pipeline.)
#include <cstddef>
#include <exception>
#include <memory>
#include <string>

#include "weft/algorithms.hpp"
#include "weft/error.hpp"
#include "weft/transport.hpp"

namespace weft::algorithms {

/// The first failure among a plan's operations, as both executors report it: the first one recorded, the
/// context aborted for it (a cancellation leaves the context usable: it failed every operation of the
/// seq already), and the error that names the rank, the peer, the operation and its seq.
class FirstFailure {
 public:
  /// Records `op`'s failure if it is the first (aborting the channel's context unless it was a
  /// cancellation); false when `op` failed.
  bool check(const Channel& channel, const TransportOp& op);
  bool failed() const noexcept { return failed_; }
  [[noreturn]] void raise(const Channel& channel) const;

 private:
  bool failed_ = false;
  Errc code_ = Errc::protocol_error;
  std::string reason_;
  int transport_peer_ = -1;
};

class MessagePlan {
 public:
  /// At most this many messages (a binomial broadcast's root of 256 ranks sends 8; a dissemination
  /// barrier of 16 ranks exchanges 8).
  static constexpr std::size_t most_messages = 8;

  /// Whether `plan` runs here: every step's ranges travel in one segment, no staged buffers, at most
  /// most_messages messages, and no step receiving into a range that an earlier send reads (that send
  /// may still be reading it: the executor waits for it, this does not). Steps run in order, each
  /// receive awaited before the next step starts: the order the plans' simulator (test_plans) checks for
  /// deadlocks. A reducing step's message lands in scratch and is reduced into its range once every
  /// message started so far has completed (the sends that read that range among them), as the
  /// executor's reduction waits for an overlapping send; a recv_reduce_send then sends the range on.
  static bool fits(const Plan& plan, const PlanBuffers& buffers, const ExecOptions& options);

  /// A plan that only sends, each message to another peer, sent at once where the transport takes
  /// every message without an operation (Transport::can_send_now, then send_now): no run at all.
  /// Returns how many of the plan's steps went: all of them (the plan is done, as a run that completed
  /// at once), none (nothing happened), or, where the context failed on the way, the first few (a run
  /// started after them, start(sent), fails with the context). Loop thread.
  static std::size_t send_now(const Channel& channel, const Plan& plan, const PlanBuffers& buffers);

  /// `done(context)` is called once, on the loop's thread, when every message of the plan completed (the
  /// sends may be reused, the receives landed) or the plan failed and every message it started ended;
  /// it may destroy this. Lifetime: `channel.members` and the buffers outlive the run.
  using Done = void (*)(void* context) noexcept;
  /// `plan` is shared: a group keeps the plans it built for reuse (GroupState::plan_for).
  MessagePlan(const Channel& channel, std::shared_ptr<const Plan> plan, PlanBuffers buffers, Done done, void* context)
      : ch_(channel), plan_(std::move(plan)), buf_(buffers), esize_(dtype_size(buffers.dtype)), done_(done), context_(context) {}
  MessagePlan(const Channel& channel, Plan plan, PlanBuffers buffers, Done done, void* context)
      : MessagePlan(channel, std::make_shared<const Plan>(std::move(plan)), buffers, done, context) {}
  MessagePlan(const MessagePlan&) = delete;
  MessagePlan& operator=(const MessagePlan&) = delete;
  ~MessagePlan();

  /// Loop thread, once. The messages of the first steps start here; `done` may be called before this
  /// returns. `sent_already`: the plan's first steps that send_now sent (they are not sent again).
  void start(std::size_t sent_already = 0);
  /// Loop thread, before `done`: cancels the operation on every member (the transport's
  /// cancel_operation), as a cancelled plan run does.
  void cancel();
  bool finished() const noexcept { return finished_; }
  /// After `done`: the failure (weft::Error, as execute throws it), or null.
  std::exception_ptr failure() const;

 private:
  static void completed(TransportOp& op, void* context) noexcept;
  void advance();
  TransportOp& start_message(bool sending, int group_peer, const std::byte* at, std::size_t elems);
  std::byte* scratch(std::size_t bytes);
  void reduce(const Step& step);

  Channel ch_;
  std::shared_ptr<const Plan> plan_;
  PlanBuffers buf_;
  std::size_t esize_;
  Done done_;
  void* context_;
  // Loop thread only.
  std::size_t next_step_ = 0;
  TransportOp* awaited_ = nullptr;  // the receive the next step waits for
  bool forward_ = false;            // awaited_ is a recv_copy_send's: its send follows
  const Step* reducing_ = nullptr;  // awaited_ is this reducing step's: it lands in scratch
  std::size_t started_ = 0;
  std::size_t outstanding_ = 0;
  bool advancing_ = false;  // inside advance(): completions inside a start only count
  bool finished_ = false;
  FirstFailure failure_;
  struct Count {
    int peer = -1;
    std::uint64_t sent = 0;
    std::uint64_t received = 0;
  };
  Count counts_[most_messages];  // messages to and from each peer so far (the k-th carries tag k)
  alignas(TransportOp) std::byte ops_[most_messages][sizeof(TransportOp)];
  // Where a reducing step's message lands: inline for small ones (a small all_reduce allocates nothing
  // for it), else a buffer of the loop thread's scratch pool, given back by the destructor.
  static constexpr std::size_t inline_scratch_bytes = 512;
  alignas(std::max_align_t) std::byte inline_scratch_[inline_scratch_bytes];
  std::unique_ptr<std::byte[]> pooled_scratch_;
  std::size_t pooled_capacity_ = 0;
};

}  // namespace weft::algorithms
