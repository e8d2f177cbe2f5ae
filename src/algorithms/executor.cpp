// The stage that runs a plan: each step's ranges travel in segments, several in flight at once, and a
// received segment is reduced (and forwarded) while the next ones are still on the wire.
#include <algorithm>
#include <array>
#include <deque>
#include <functional>
#include <memory>
#include <new>
#include <optional>

#include <fmt/format.h>

#include "algorithms/messages.hpp"
#include "kernels/cpu/reduce.hpp"
#include "weft/algorithms.hpp"
#include "weft/error.hpp"

namespace weft::algorithms {
namespace {

// Scratch buffers are reused from one operation to the next: a fresh multi-megabyte allocation costs an
// mmap and a page fault per 4 KiB every time. One pool per thread (each loop runs on one thread), so no
// locking; at most scratch_pool_bytes kept.
class ScratchPool {
 public:
  struct Buffer {
    std::unique_ptr<std::byte[]> data;
    std::size_t capacity = 0;
  };
  static Buffer take(std::size_t bytes) {
    auto& spare = pool().spare;
    for (auto it = spare.begin(); it != spare.end(); ++it) {
      if (it->capacity >= bytes && it->capacity <= 2 * bytes) {
        Buffer found = std::move(*it);
        pool().kept -= found.capacity;
        spare.erase(it);
        return found;
      }
    }
    return Buffer{std::make_unique_for_overwrite<std::byte[]>(bytes), bytes};
  }
  // When the pool is full the oldest buffers go first: sizes in use now stay, sizes of operations long
  // past leave. (Refusing new ones instead kept whatever sizes came first, and a mix of sizes then
  // allocated afresh every time while the pool held the limit: the soak's memory grew by 64 MiB.)
  static void give(Buffer&& buffer) {
    if (!buffer.data || buffer.capacity > scratch_pool_bytes) return;
    auto& p = pool();
    while (p.kept + buffer.capacity > scratch_pool_bytes && !p.spare.empty()) {
      p.kept -= p.spare.front().capacity;
      p.spare.erase(p.spare.begin());
    }
    p.kept += buffer.capacity;
    p.spare.push_back(std::move(buffer));
  }

 private:
  // Bytes of scratch buffers a thread keeps for reuse (docs/DESIGN.md quotes it by name).
  static constexpr std::size_t scratch_pool_bytes = 16 << 20;
  struct State {
    std::vector<Buffer> spare;
    std::size_t kept = 0;
  };
  static State& pool() {
    thread_local State state;
    return state;
  }
};

// Reached from a stop callback on any thread; the abort itself runs on the loop, and only while the
// plan is still running.
struct CancelHook {
  Channel channel;
  bool finished = false;  // loop thread only
};
// The stop callback itself: a type of its own rather than a std::function (one allocation less per plan).
struct CancelOnStop {
  std::shared_ptr<CancelHook> hook;
  void operator()() const {
    hook->channel.loop->post([hook = hook] {
      if (hook->finished) return;
      const Channel& c = hook->channel;
      c.transport->cancel_operation(c.context, c.seq, fmt::format("rank {} cancelled {} #{}", c.rank, c.op_name, c.seq));
    });
  }
};

// Every operation a plan started, at addresses that stay put until the plan ends. A small plan's few
// operations live inside the executor (a deque allocates its map and first block when made: two of a
// small all_reduce's allocations, bench/RESULTS.md "The per-operation floor"); more go to a deque.
class PlanOps {
 public:
  PlanOps() = default;
  PlanOps(const PlanOps&) = delete;
  PlanOps& operator=(const PlanOps&) = delete;
  ~PlanOps() {
    for (std::size_t i = 0; i < std::min(count_, in_place); ++i) slot(i)->~TransportOp();
  }
  TransportOp& emplace_back() {
    if (count_ < in_place) return *new (storage_[count_++]) TransportOp();
    if (!more_) more_.emplace();
    ++count_;
    return more_->emplace_back();
  }
  std::size_t size() const noexcept { return count_; }
  TransportOp& operator[](std::size_t i) noexcept { return i < in_place ? *slot(i) : (*more_)[i - in_place]; }

 private:
  static constexpr std::size_t in_place = 4;
  TransportOp* slot(std::size_t i) noexcept { return std::launder(reinterpret_cast<TransportOp*>(storage_[i])); }
  alignas(TransportOp) std::byte storage_[in_place][sizeof(TransportOp)];
  std::size_t count_ = 0;
  std::optional<std::deque<TransportOp>> more_;
};

// A list whose first N entries live inside it: a small collective's steps post one or two receives
// and sends each, and every std::vector of them was an allocation per call (bench/RESULTS.md, "The
// per-operation floor"). Only what the executor needs: append, index, size.
template <class T, std::size_t N>
class InlineList {
 public:
  InlineList() = default;
  InlineList(std::size_t n, const T& value) {
    for (std::size_t i = 0; i < n; ++i) push_back(value);
  }
  void push_back(const T& value) {
    if (size_ < N) {
      first_[size_] = value;
    } else {
      more_.push_back(value);
    }
    ++size_;
  }
  T& operator[](std::size_t i) noexcept { return i < N ? first_[i] : more_[i - N]; }
  const T& operator[](std::size_t i) const noexcept { return i < N ? first_[i] : more_[i - N]; }
  std::size_t size() const noexcept { return size_; }

 private:
  std::array<T, N> first_{};
  std::vector<T> more_;
  std::size_t size_ = 0;
};

class Executor {
 public:
  Executor(const Channel& channel, PlanBuffers buffers, ExecOptions options)
      : ch_(channel), buf_(buffers), esize_(dtype_size(buffers.dtype)) {
    seg_elems_ = std::max<std::size_t>(1, options.segment_bytes / esize_);
    depth_ = std::max<std::size_t>({1, static_cast<std::size_t>(std::max(1, options.pipeline_depth)),
                                      options.scratch_bytes / (seg_elems_ * esize_)});
    // Per group rank, messages sent to it and receives posted from it so far: in the executor for
    // groups of up to `counted_in_place` ranks.
    const std::size_t p = channel.members.size();
    if (p > counted_in_place) counts_more_.assign(2 * p, 0);
    sent_to_ = p > counted_in_place ? counts_more_.data() : counts_;
    received_from_ = sent_to_ + p;
  }
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  Task<void> run(const Plan& plan);

 private:
  struct InflightSend {
    TransportOp* op;
    const std::byte* lo;
    const std::byte* hi;
  };

  std::size_t segments(const Range& r) const noexcept {
    return r.count == 0 ? 1 : (r.count + seg_elems_ - 1) / seg_elems_;
  }
  Range segment(const Range& r, std::size_t k) const noexcept {
    const std::size_t first = k * seg_elems_;
    return Range{r.offset + first, r.count == 0 ? 0 : std::min(seg_elems_, r.count - first)};
  }
  std::byte* recv_at(const Range& r) const noexcept { return buf_.recv + r.offset * esize_; }
  const std::byte* send_at(const Range& r) const noexcept { return buf_.send + r.offset * esize_; }

  int transport_rank(int group_rank) const { return ch_.members[static_cast<std::size_t>(group_rank)]; }

  // The k-th message from one rank to another in this operation carries tag k: plans are symmetric, so
  // the sender's k-th send to a peer is that peer's k-th receive from the sender.
  TransportOp& start_send(int to, const std::byte* data, std::size_t elems) {
    TransportOp& op = ops_.emplace_back();
    op.signature = ch_.signature;
    const MessageKey key{ch_.context, ch_.seq, ch_.first_tag + sent_to_[static_cast<std::size_t>(to)]++};
    ch_.transport->start_send(transport_rank(to), key, data, elems * esize_, op);
    sends_.push_back(InflightSend{&op, data, data + elems * esize_});
    return op;
  }
  TransportOp& start_recv(int from, std::byte* data, std::size_t elems) {
    TransportOp& op = ops_.emplace_back();
    op.signature = ch_.signature;
    const MessageKey key{ch_.context, ch_.seq, ch_.first_tag + received_from_[static_cast<std::size_t>(from)]++};
    ch_.transport->start_recv(transport_rank(from), key, data, elems * esize_, op);
    return op;
  }

  bool ok(const TransportOp& op) { return failure_.check(ch_, op); }

  // A send still reading [lo, hi) of a buffer that is about to be written.
  TransportOp* overlapping_send(const std::byte* lo, const std::byte* hi) {
    for (std::size_t i = 0; i < sends_.size(); ++i) {
      const InflightSend& s = sends_[i];
      if (!s.op->done() && s.lo < hi && lo < s.hi) return s.op;
    }
    return nullptr;
  }

  // Scratch for incoming segments of reducing steps: as many slots as the largest such step can use.
  std::byte* temp(std::size_t slot) {
    if (!temp_.data) temp_ = ScratchPool::take(temp_slots_ * seg_elems_ * esize_);
    return temp_.data.get() + slot * seg_elems_ * esize_;
  }
  const std::byte* local_at(const Range& r) const noexcept {
    return buf_.local ? buf_.local + r.offset * esize_ : recv_at(r);
  }

  // Staged buffers (device staging): whether `elems` elements at `at` are still being copied in, and,
  // once a segment of step `step` landed, which of it is final (no later step writes it).
  bool must_wait(const std::byte* at, std::size_t elems) const {
    return buf_.staged && elems && !buf_.staged->ready(at, at + elems * esize_);
  }
  Task<void> until_ready(const std::byte* at, std::size_t elems) const {
    return buf_.staged->until_ready(at, at + elems * esize_);
  }
  void find_final_parts(const Plan& plan);
  void landed(std::size_t step, const Range& seg) {
    if (!buf_.staged || seg.count == 0 || failure_.failed()) return;
    for (const Range& part : final_parts_[step]) {
      const std::size_t lo = std::max(part.offset, seg.offset);
      const std::size_t hi = std::min(part.offset + part.count, seg.offset + seg.count);
      if (lo < hi) buf_.staged->finished(buf_.recv + lo * esize_, buf_.recv + hi * esize_);
    }
  }

  Channel ch_;
  PlanBuffers buf_;
  std::size_t esize_;
  std::size_t seg_elems_ = 1;
  std::size_t depth_ = 1;
  std::size_t temp_slots_ = 0;
  kernels::ReduceFn reduce_ = nullptr;
  PlanOps ops_;  // every operation this plan started
  InlineList<InflightSend, 4> sends_;
  static constexpr std::size_t counted_in_place = 16;
  std::uint64_t counts_[2 * counted_in_place] = {};
  std::vector<std::uint64_t> counts_more_;
  std::uint64_t* sent_to_ = nullptr;        // messages sent to each group rank so far
  std::uint64_t* received_from_ = nullptr;  // receives posted from each group rank so far
  std::vector<std::vector<Range>> final_parts_;  // staged buffers only: per step, what of its `recv` is final
  ScratchPool::Buffer temp_;
  FirstFailure failure_;
};

bool receives(StepKind kind) { return kind != StepKind::send; }

// For each step, the parts of its receive range that no later step receives into: once such a part has
// landed (received, or reduced), the plan never writes it again. Later steps first, with the ranges they
// cover kept merged.
void Executor::find_final_parts(const Plan& plan) {
  final_parts_.assign(plan.size(), {});
  std::vector<Range> later;  // disjoint, by offset
  for (std::size_t i = plan.size(); i-- > 0;) {
    const Step& step = plan[i];
    if (!receives(step.kind) || step.recv.count == 0) continue;
    std::size_t at = step.recv.offset;
    const std::size_t end = step.recv.offset + step.recv.count;
    for (const Range& taken : later) {
      if (taken.offset + taken.count <= at) continue;
      if (taken.offset >= end) break;
      if (taken.offset > at) final_parts_[i].push_back(Range{at, taken.offset - at});
      at = std::max(at, taken.offset + taken.count);
    }
    if (at < end) final_parts_[i].push_back(Range{at, end - at});
    later.push_back(step.recv);
    std::sort(later.begin(), later.end(), [](const Range& a, const Range& b) { return a.offset < b.offset; });
    std::vector<Range> merged;
    for (const Range& r : later) {
      if (!merged.empty() && r.offset <= merged.back().offset + merged.back().count) {
        merged.back().count = std::max(merged.back().offset + merged.back().count, r.offset + r.count) - merged.back().offset;
      } else {
        merged.push_back(r);
      }
    }
    later = std::move(merged);
  }
}

Task<void> Executor::run(const Plan& plan) {
  reduce_ = kernels::find_reduce(buf_.dtype, buf_.op);
  if (buf_.staged) find_final_parts(plan);
  for (const Step& step : plan) {
    if (step.kind == StepKind::recv_reduce || step.kind == StepKind::recv_reduce_send ||
        step.kind == StepKind::send_recv_reduce) {
      temp_slots_ = std::max(temp_slots_, std::min(segments(step.recv), depth_));
    }
  }

  auto hook = std::make_shared<CancelHook>(CancelHook{ch_});
  std::optional<std::stop_callback<CancelOnStop>> on_stop;
  const std::stop_token token = co_await this_stop_token();
  if (token.stop_possible() && ch_.loop) on_stop.emplace(token, CancelOnStop{hook});

  for (std::size_t i = 0; i < plan.size() && !failure_.failed();) {
    const Step& step = plan[i];
    // A kind no case takes would never move `i` on: the loop's thread spun here for ever. (Group::run_plan
    // refuses it at the call; execute() is public too.)
    if (static_cast<std::uint8_t>(step.kind) > static_cast<std::uint8_t>(StepKind::send_recv_reduce)) {
      throw Error(Errc::invalid_argument, ErrorContext{ch_.rank, -1, ch_.op_name, static_cast<std::int64_t>(ch_.seq), -1},
                  fmt::format("step {} has kind {}, which is no StepKind", i, static_cast<unsigned>(step.kind)));
    }
    switch (step.kind) {
      case StepKind::send: {
        for (std::size_t k = 0, n = segments(step.send); k < n; ++k) {
          const Range seg = segment(step.send, k);
          if (must_wait(send_at(seg), seg.count)) co_await until_ready(send_at(seg), seg.count);
          start_send(step.send_to, send_at(seg), seg.count);
        }
        ++i;
        break;
      }
      case StepKind::recv:
      case StepKind::send_recv: {
        // A run of receive steps is posted at once, so that no message of the run waits as unexpected.
        // A later exchange joins the run only if what it sends does not depend on what the run receives
        // (recursive doubling forwards what it just received: those exchanges go one at a time). A message
        // without data depends on the run by its timing alone: a dissemination barrier's round k + 1 may
        // go only once round k's message came, or a rank leaves having heard from lg p ranks, not all.
        InlineList<TransportOp*, 4> pending;
        InlineList<std::pair<std::size_t, Range>, 4> pending_at;  // (step, segment) of each pending receive
        InlineList<std::pair<const std::byte*, const std::byte*>, 4> landing;  // receive ranges of the run
        auto depends_on_run = [&](const Step& s) {
          if (s.kind != StepKind::send_recv) return false;
          if (s.send.count == 0) return true;
          const std::byte* lo = send_at(s.send);
          const std::byte* hi = lo + s.send.count * esize_;
          for (std::size_t r = 0; r < landing.size(); ++r) {
            if (landing[r].first < hi && lo < landing[r].second) return true;
          }
          return false;
        };
        std::size_t j = i;
        for (; j < plan.size() && (plan[j].kind == StepKind::recv || plan[j].kind == StepKind::send_recv); ++j) {
          const Step& s = plan[j];
          if (j > i && depends_on_run(s)) break;
          if (s.recv.count) landing.push_back({recv_at(s.recv), recv_at(s.recv) + s.recv.count * esize_});
          if (s.kind == StepKind::send_recv) {
            for (std::size_t k = 0, n = segments(s.send); k < n; ++k) {
              const Range seg = segment(s.send, k);
              if (must_wait(send_at(seg), seg.count)) co_await until_ready(send_at(seg), seg.count);
              start_send(s.send_to, send_at(seg), seg.count);
            }
          }
          for (std::size_t k = 0, n = segments(s.recv); k < n; ++k) {
            const Range seg = segment(s.recv, k);
            std::byte* dst = recv_at(seg);
            while (TransportOp* busy = overlapping_send(dst, dst + seg.count * esize_)) co_await busy->wait();
            if (must_wait(dst, seg.count)) co_await until_ready(dst, seg.count);
            pending.push_back(&start_recv(s.recv_from, dst, seg.count));
            pending_at.push_back({j, seg});
          }
        }
        for (std::size_t k = 0; k < pending.size(); ++k) {
          co_await pending[k]->wait();
          if (ok(*pending[k])) landed(pending_at[k].first, pending_at[k].second);
        }
        i = j;
        break;
      }
      case StepKind::recv_copy_send: {
        const std::size_t n = segments(step.recv);
        InlineList<TransportOp*, 4> pending;
        for (std::size_t k = 0; k < n; ++k) {
          const Range seg = segment(step.recv, k);
          std::byte* dst = recv_at(seg);
          while (TransportOp* busy = overlapping_send(dst, dst + seg.count * esize_)) co_await busy->wait();
          if (must_wait(dst, seg.count)) co_await until_ready(dst, seg.count);
          pending.push_back(&start_recv(step.recv_from, dst, seg.count));
        }
        for (std::size_t k = 0; k < n; ++k) {
          co_await pending[k]->wait();
          if (!ok(*pending[k])) break;
          const Range seg = segment(step.recv, k);
          start_send(step.send_to, recv_at(seg), seg.count);
          landed(i, seg);
        }
        ++i;
        break;
      }
      case StepKind::recv_reduce:
      case StepKind::recv_reduce_send:
      case StepKind::send_recv_reduce: {
        if (step.kind == StepKind::send_recv_reduce) {
          for (std::size_t k = 0, n = segments(step.send); k < n; ++k) {
            const Range seg = segment(step.send, k);
            if (must_wait(send_at(seg), seg.count)) co_await until_ready(send_at(seg), seg.count);
            start_send(step.send_to, send_at(seg), seg.count);
          }
        }
        const bool forward = step.kind == StepKind::recv_reduce_send;
        const std::size_t n = segments(step.recv);
        const std::size_t ahead = std::min(n, depth_);
        InlineList<TransportOp*, 4> pending(n, nullptr);
        auto post = [&](std::size_t k) {
          const Range seg = segment(step.recv, k);
          pending[k] = &start_recv(step.recv_from, temp(k % ahead), seg.count);
        };
        for (std::size_t k = 0; k < std::min(n, ahead); ++k) post(k);
        for (std::size_t k = 0; k < n; ++k) {
          co_await pending[k]->wait();
          if (!ok(*pending[k])) break;
          const Range seg = segment(step.recv, k);
          std::byte* dst = recv_at(seg);
          while (TransportOp* busy = overlapping_send(dst, dst + seg.count * esize_)) co_await busy->wait();
          if (must_wait(dst, seg.count)) co_await until_ready(dst, seg.count);
          if (must_wait(local_at(seg), seg.count)) co_await until_ready(local_at(seg), seg.count);
          if (seg.count) reduce_(dst, local_at(seg), temp(k % ahead), seg.count);
          if (forward) start_send(step.send_to, dst, seg.count);
          landed(i, seg);
          if (k + ahead < n) post(k + ahead);
        }
        ++i;
        break;
      }
    }
  }

  // Drain: every operation this plan started completes before the plan does (their buffers and this
  // frame must outlive them). After a failure the aborted context completes the rest promptly.
  for (std::size_t k = 0; k < ops_.size(); ++k) {
    TransportOp& op = ops_[k];
    if (!op.done()) co_await op.wait();
    ok(op);
  }
  hook->finished = true;
  on_stop.reset();
  ScratchPool::give(std::move(temp_));
  if (failure_.failed()) failure_.raise(ch_);
}

}  // namespace

bool FirstFailure::check(const Channel& channel, const TransportOp& op) {
  if (!op.error()) return true;
  if (failed_) return false;
  failed_ = true;
  code_ = static_cast<Errc>(op.error().value());
  reason_ = op.reason();
  transport_peer_ = op.failed_peer() >= 0 ? op.failed_peer() : op.peer;
  // A cancellation already failed every operation of this seq, here and on the other members, and leaves
  // the context usable; any other failure aborts the context, which completes every other pending
  // operation of the plan (here and on the other members), so that draining cannot hang.
  if (code_ != Errc::cancelled) {
    channel.transport->abort_context(channel.context, code_,
                                     fmt::format("rank {} failed {} #{}: {}", channel.rank, channel.op_name, channel.seq, op.reason()));
  }
  return false;
}

void FirstFailure::raise(const Channel& channel) const {
  int peer = -1;
  for (std::size_t i = 0; i < channel.members.size(); ++i) {
    if (channel.members[i] == transport_peer_) peer = static_cast<int>(i);
  }
  throw_error(code_, ErrorContext{channel.rank, peer, channel.op_name, static_cast<std::int64_t>(channel.seq), -1}, reason_);
}

bool MessagePlan::fits(const Plan& plan, const PlanBuffers& buffers, const ExecOptions& options) {
  if (buffers.staged) return false;
  const std::size_t esize = dtype_size(buffers.dtype);
  const std::size_t most_bytes = std::max<std::size_t>(options.segment_bytes, esize);
  std::size_t messages = 0;
  // What the sends started so far read: [lo, hi) each (a forward reads the receive buffer).
  std::pair<const std::byte*, const std::byte*> read[most_messages];
  std::size_t reads = 0;
  auto overlaps_a_send = [&](const std::byte* lo, const std::byte* hi) {
    for (std::size_t k = 0; k < reads; ++k) {
      if (read[k].first < hi && lo < read[k].second) return true;
    }
    return false;
  };
  for (const Step& step : plan) {
    const bool reduces = step.kind == StepKind::recv_reduce || step.kind == StepKind::recv_reduce_send ||
                         step.kind == StepKind::send_recv_reduce;
    const bool sends = step.kind == StepKind::send || step.kind == StepKind::send_recv || step.kind == StepKind::send_recv_reduce;
    const bool forwards = step.kind == StepKind::recv_copy_send || step.kind == StepKind::recv_reduce_send;
    const bool receives = step.kind != StepKind::send;
    messages += (sends || forwards ? 1 : 0) + (receives ? 1 : 0);
    if (messages > most_messages) return false;
    // One segment each, as the executor would cut them (segments of at least one element).
    if (sends && step.send.count * esize > most_bytes) return false;
    if (receives && step.recv.count * esize > most_bytes) return false;
    if (sends && step.send.count) read[reads++] = {buffers.send + step.send.offset * esize, buffers.send + (step.send.offset + step.send.count) * esize};
    if (reduces) {
      // Reduced once every message started so far completed: no send reads anything any more.
      reads = 0;
      if (forwards && step.recv.count) read[reads++] = {buffers.recv + step.recv.offset * esize, buffers.recv + (step.recv.offset + step.recv.count) * esize};
    } else if (receives && step.recv.count) {
      const std::byte* lo = buffers.recv + step.recv.offset * esize;
      const std::byte* hi = lo + step.recv.count * esize;
      if (overlaps_a_send(lo, hi)) return false;
      if (forwards) read[reads++] = {lo, hi};
    }
  }
  return true;
}

MessagePlan::~MessagePlan() {
  for (std::size_t i = 0; i < started_; ++i) std::launder(reinterpret_cast<TransportOp*>(ops_[i]))->~TransportOp();
  if (pooled_scratch_) ScratchPool::give(ScratchPool::Buffer{std::move(pooled_scratch_), pooled_capacity_});
}

std::byte* MessagePlan::scratch(std::size_t bytes) {
  if (bytes <= inline_scratch_bytes) return inline_scratch_;
  if (pooled_capacity_ < bytes) {
    if (pooled_scratch_) ScratchPool::give(ScratchPool::Buffer{std::move(pooled_scratch_), pooled_capacity_});
    ScratchPool::Buffer taken = ScratchPool::take(bytes);
    pooled_scratch_ = std::move(taken.data);
    pooled_capacity_ = taken.capacity;
  }
  return pooled_scratch_.get();
}

// recv[i] = local[i] op incoming[i], as the executor's reducing steps (local: the receive buffer unless
// the plan reads this rank's contribution from elsewhere).
void MessagePlan::reduce(const Step& step) {
  if (step.recv.count == 0) return;
  const std::size_t at = step.recv.offset * esize_;
  const std::byte* local = (buf_.local ? buf_.local : buf_.recv) + at;
  kernels::find_reduce(buf_.dtype, buf_.op)(buf_.recv + at, local, scratch(step.recv.count * esize_), step.recv.count);
}

std::size_t MessagePlan::send_now(const Channel& ch, const Plan& plan, const PlanBuffers& buf) {
  if (plan.size() > most_messages) return 0;
  const std::size_t esize = dtype_size(buf.dtype);
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const Step& step = plan[i];
    if (step.kind != StepKind::send) return 0;
    // Each to another peer: a message taken now changes what its connection can take next.
    for (std::size_t j = 0; j < i; ++j) {
      if (plan[j].send_to == step.send_to) return 0;
    }
    if (!ch.transport->can_send_now(ch.members[static_cast<std::size_t>(step.send_to)], step.send.count * esize)) return 0;
  }
  std::size_t sent = 0;
  for (const Step& step : plan) {
    // Every peer's first message of the operation: tag first_tag, as start_message numbers it.
    const MessageKey key{ch.context, ch.seq, ch.first_tag};
    if (!ch.transport->send_now(ch.members[static_cast<std::size_t>(step.send_to)], key, buf.send + step.send.offset * esize,
                                step.send.count * esize, ch.signature))
      break;  // the context failed on the way (a mismatch that a signature just revealed): start() from here fails it
    ++sent;
  }
  return sent;
}

void MessagePlan::start(std::size_t sent_already) {
  next_step_ = sent_already;
  advance();
}

void MessagePlan::cancel() {
  if (finished_) return;
  ch_.transport->cancel_operation(ch_.context, ch_.seq, fmt::format("rank {} cancelled {} #{}", ch_.rank, ch_.op_name, ch_.seq));
}

std::exception_ptr MessagePlan::failure() const {
  if (!failure_.failed()) return nullptr;
  try {
    failure_.raise(ch_);
  } catch (...) {
    return std::current_exception();
  }
}

// The k-th message between this rank and a peer, each way, carries tag first_tag + k, as in execute.
TransportOp& MessagePlan::start_message(bool sending, int group_peer, const std::byte* at, std::size_t elems) {
  Count* count = nullptr;
  for (Count& c : counts_) {
    if (c.peer == group_peer || c.peer < 0) {
      c.peer = group_peer;
      count = &c;
      break;
    }
  }
  auto* op = new (ops_[started_++]) TransportOp();
  op->signature = ch_.signature;
  op->on_complete(&MessagePlan::completed, this);
  ++outstanding_;
  const int peer = ch_.members[static_cast<std::size_t>(group_peer)];
  if (sending) {
    const MessageKey key{ch_.context, ch_.seq, ch_.first_tag + count->sent++};
    ch_.transport->start_send(peer, key, at, elems * esize_, *op);
  } else {
    const MessageKey key{ch_.context, ch_.seq, ch_.first_tag + count->received++};
    ch_.transport->start_recv(peer, key, const_cast<std::byte*>(at), elems * esize_, *op);
  }
  return *op;
}

void MessagePlan::completed(TransportOp& op, void* context) noexcept {
  auto* run = static_cast<MessagePlan*>(context);
  --run->outstanding_;
  run->failure_.check(run->ch_, op);
  run->advance();
}

// Starts steps until one waits for its receive; after the last step (or a failure), calls done once
// every message started has completed. A completion inside a start (a send the stream took whole, a
// receive that found its message waiting) comes back here while the loop below runs: it only counts.
void MessagePlan::advance() {
  if (advancing_ || finished_) return;
  advancing_ = true;
  while (!failure_.failed() && (!awaited_ || awaited_->done())) {
    if (reducing_) {
      // A send started earlier may still read the range the reduction writes: wait for all of them.
      if (outstanding_ > 0) break;
      const Step& step = *reducing_;
      reducing_ = nullptr;
      awaited_ = nullptr;
      reduce(step);
      if (step.kind == StepKind::recv_reduce_send) {
        start_message(true, step.send_to, buf_.recv + step.recv.offset * esize_, step.recv.count);
      }
      continue;
    }
    awaited_ = nullptr;
    if (forward_) {  // the receive of a recv_copy_send landed: send it on
      forward_ = false;
      const Step& step = (*plan_)[next_step_ - 1];
      start_message(true, step.send_to, buf_.recv + step.recv.offset * esize_, step.recv.count);
      continue;
    }
    if (next_step_ == plan_->size()) break;
    const Step& step = (*plan_)[next_step_++];
    if (step.kind == StepKind::send || step.kind == StepKind::send_recv || step.kind == StepKind::send_recv_reduce) {
      start_message(true, step.send_to, buf_.send + step.send.offset * esize_, step.send.count);
    }
    if (step.kind == StepKind::send || failure_.failed()) continue;
    const bool reduces = step.kind == StepKind::recv_reduce || step.kind == StepKind::recv_reduce_send ||
                         step.kind == StepKind::send_recv_reduce;
    std::byte* landing = reduces ? scratch(step.recv.count * esize_) : buf_.recv + step.recv.offset * esize_;
    awaited_ = &start_message(false, step.recv_from, landing, step.recv.count);
    forward_ = step.kind == StepKind::recv_copy_send;
    if (reduces) reducing_ = &step;
  }
  advancing_ = false;
  const bool all_started = next_step_ == plan_->size() && !forward_ && !reducing_;
  if (outstanding_ > 0 || (!failure_.failed() && !all_started)) return;
  finished_ = true;
  done_(context_);  // may destroy this
}

Task<void> execute(const Channel& channel, const Plan& plan, PlanBuffers buffers, ExecOptions options) {
  Executor executor(channel, buffers, options);
  co_await executor.run(plan);
}

}  // namespace weft::algorithms
