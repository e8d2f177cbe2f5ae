// Point-to-point: send and recv, each with its own deadline (a receive past it is withdrawn and the
// group stays usable; a send past it aborts the group, as it cannot be taken back).
#include "weft/group.hpp"

#include <algorithm>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/signature.hpp"
#include "group/checks.hpp"
#include "group/device_staging.hpp"
#include "group/state.hpp"

namespace weft {
namespace {

using namespace detail;

// One send or receive: its Future's state, which owns the transport op, so that an operation costs one
// allocation and no coroutine (docs/DESIGN.md, "The per-operation floor"). Started on the loop (at once
// from its thread), watched by its deadline, cancellable through its Future. Cancelling a receive
// withdraws it; a send on the wire cannot be taken back from the receiver's view, so cancelling it
// aborts the group, as does a send past its deadline. A receive past its deadline is withdrawn and the
// group stays usable. `data` is only read by a send.
class P2pOp final : public FutureState<void> {
 public:
  // `g` by reference: a send the stream takes at once needs no copy of it (two atomic operations).
  // `seq`: its number among this rank's sends to (receives from) `peer` (GroupState::take_p2p_seq).
  // `signature`: the message's dtype (signature::of_point_to_point), carried by a send's frame and
  // compared by the receive.
  static Future<void> start(const std::shared_ptr<GroupState>& g, bool sending, void* data, std::size_t bytes, OpSignature signature,
                            int peer, std::uint32_t tag, std::uint64_t seq, std::chrono::milliseconds timeout) {
    Starting starting{&g, sending, data, bytes, signature, peer, tag, seq, timeout, {}};
    Loop& loop = *g->loop;
    // The borrow first: run_here refuses a loop that runs or is held (as it is whenever this thread
    // runs it) with one load, where the thread check is a walk of Asio's call stack, a call of plain
    // code's every send and receive.
    if (loop.run_here(&P2pOp::start_here, &starting)) {
      // Started on this thread, the loop borrowed for it (caller-driven progress): no post, and a send
      // the stream took whole is done before its Future is waited on.
      return std::move(starting.result);
    }
    if (loop.in_loop_thread()) {
      start_here(&starting);
      return std::move(starting.result);
    }
    // self_ keeps it alive until then, and a plain pointer fits inside the posted std::function (a
    // shared_ptr there is an allocation per call from plain code: a stream's window is 64 of them).
    auto op = make(g, sending, data, bytes, signature, peer, tag, seq, timeout);
    op->self_ = op;
    op->g_->loop->post([raw = op.get()] {
      const std::shared_ptr<P2pOp> self = std::move(raw->self_);
      raw->begin(self);
    });
    return Future<void>(std::move(op));
  }

  P2pOp(std::shared_ptr<GroupState> g, bool sending, void* data, std::size_t bytes, OpSignature signature, int peer, std::uint32_t tag,
        std::uint64_t seq, std::chrono::milliseconds timeout)
      : g_(std::move(g)), sending_(sending), data_(data), bytes_(bytes), peer_(peer), tag_(tag), seq_(seq), timeout_(timeout) {
    op_.signature = signature;
  }

 private:
  // A start on the loop's thread (its own, or borrowed by Loop::run_here): the call and its Future.
  struct Starting {
    const std::shared_ptr<GroupState>* g;
    bool sending;
    void* data;
    std::size_t bytes;
    OpSignature signature;
    int peer;
    std::uint32_t tag;
    std::uint64_t seq;
    std::chrono::milliseconds timeout;
    Future<void> result;
  };

  static std::shared_ptr<P2pOp> make(const std::shared_ptr<GroupState>& g, bool sending, void* data, std::size_t bytes, OpSignature signature,
                                     int peer, std::uint32_t tag, std::uint64_t seq, std::chrono::milliseconds timeout) {
    auto op = std::allocate_shared<P2pOp>(PooledAllocator<P2pOp>{}, g, sending, data, bytes, signature, peer, tag, seq, timeout);
    op->set_loop(op->g_->loop);
    op->set_cancel_hook(&P2pOp::on_cancel);
    return op;
  }

  // Loop thread. A send that the transport takes whole at once (an idle shm connection with room in its
  // ring: Transport::send_now), and a receive whose message already arrived (Transport::recv_now), are
  // done without an operation: the Future is the shared ready one. Anything else is an operation that
  // begins here.
  static void start_here(void* arg) {
    auto& s = *static_cast<Starting*>(arg);
    GroupState& g = **s.g;
    const int transport_peer = g.members[static_cast<std::size_t>(s.peer)];
    const MessageKey key{g.context, 0, s.tag};
    if (s.sending ? g.transport->send_now(transport_peer, key, s.data, s.bytes, s.signature)
                  : g.transport->recv_now(transport_peer, key, s.data, s.bytes, s.signature)) {
      s.result = make_ready_future();
      return;
    }
    auto op = make(*s.g, s.sending, s.data, s.bytes, s.signature, s.peer, s.tag, s.seq, s.timeout);
    op->begin(op);
    s.result = Future<void>(std::move(op));
  }

  // Future::cancel(), on any thread, once, while the Future holds the operation: the loop cancels it if
  // it is still there then. The weak_ptr is made here, from the canceller's reference: one kept in every
  // operation cost three atomic operations each (its count up, and down twice when the operation ends,
  // where a state nobody else watches is freed without any).
  static void on_cancel(const std::shared_ptr<FutureStateBase>& owner) noexcept {
    const auto op = std::static_pointer_cast<P2pOp>(owner);
    op->g_->loop->post([weak = std::weak_ptr<P2pOp>(op)] {
      if (auto op = weak.lock()) op->cancel_now();
    });
  }

  // Loop thread. `self_` keeps the operation alive until the transport completes it, and the caller's
  // `self` until this returns: a transport that completes it inside start_send/start_recv drops self_,
  // and the Future may be gone by then (TSan saw the check of finished_ below read freed memory when
  // self_ was all). A reference: the caller holds it anyway, and a copy is two more atomic operations.
  void begin(const std::shared_ptr<P2pOp>& self) {
    GroupState& g = *g_;
    g.loop->operation_started();
    self_ = self;
    op_.on_complete(&P2pOp::completed, this);
    const int transport_peer = g.members[static_cast<std::size_t>(peer_)];
    const MessageKey key{g.context, 0, tag_};
    if (sending_) {
      g.transport->start_send(transport_peer, key, data_, bytes_, op_);
    } else {
      g.transport->start_recv(transport_peer, key, data_, bytes_, op_);
    }
    if (finished_) return;  // completed at once: nothing to watch
    watch();
  }

  // Loop thread.
  void cancel_now() {
    if (finished_) return;
    GroupState& g = *g_;
    if (sending_) {
      g.transport->abort_context(g.context, Errc::cancelled, fmt::format("rank {} cancelled a send [tag {}]", g.rank, tag_));
    } else {
      g.transport->cancel_recv(op_);
    }
  }

  void watch() {
    if (timeout_.count() <= 0) return;
    GroupState& g = *g_;
    watch_id_ = g.p2p_ids++;
    g.watch(GroupState::Watched{watch_id_, GroupState::start_of(timeout_), timeout_, nullptr, &P2pOp::expire, this});
  }

  // The watchdog found it past its deadline (loop thread; it is still watched, so not finished).
  static void expire(void* context) {
    auto* op = static_cast<P2pOp*>(context);
    if (op->finished_) return;
    const std::shared_ptr<P2pOp> keep = op->self_;  // completing it may release its last owner
    op->timed_out_ = true;
    GroupState& g = *op->g_;
    if (op->sending_) {
      g.transport->abort_context(g.context, Errc::timeout,
                                 fmt::format("a send from rank {} to rank {} [tag {}] passed its deadline: the receiver did not take it "
                                             "(a send cannot be withdrawn once started)",
                                             g.rank, op->peer_, op->tag_));
    } else if (!g.transport->cancel_recv(op->op_)) {  // a withdrawn receive completes inside cancel_recv
      op->timed_out_ = false;  // it matched: let it finish
    }
  }

  // The transport completed op_ (loop thread): the Future completes with its outcome.
  static void completed(TransportOp& transport_op, void* context) noexcept {
    auto* op = static_cast<P2pOp*>(context);
    const std::shared_ptr<P2pOp> keep = std::move(op->self_);  // this may be its last owner
    op->finish_with(transport_op);
  }

  void finish_with(const TransportOp& done) noexcept {
    GroupState& g = *g_;
    finished_ = true;
    if (watch_id_) g.unwatch(watch_id_);
    const char* name = sending_ ? "send" : "recv";
    try {
      if (!sending_ && timed_out_) {
        throw_error(Errc::timeout, g.where(name, static_cast<std::int64_t>(seq_), peer_, tag_),
                    fmt::format("the receive from rank {} [tag {}] passed its deadline ({}) on rank {}; it was withdrawn and the "
                                "group stays usable", peer_, tag_, GroupState::duration_text(timeout_), g.rank));
      }
      if (done.error()) throw_error(static_cast<Errc>(done.error().value()), g.where(name, static_cast<std::int64_t>(seq_), peer_, tag_), done.reason());
    } catch (...) {
      set_error(std::current_exception());
    }
    g.loop->operation_finished();
    finish();
  }

  std::shared_ptr<GroupState> g_;
  bool sending_;
  void* data_;
  std::size_t bytes_;
  int peer_;  // group rank
  std::uint32_t tag_;
  std::uint64_t seq_;
  std::chrono::milliseconds timeout_;
  // Loop thread only.
  TransportOp op_;
  std::shared_ptr<P2pOp> self_;
  bool finished_ = false;
  bool timed_out_ = false;  // its deadline passed (the watchdog withdrew or aborted it)
  std::uint64_t watch_id_ = 0;
};

// The same as a step of a coroutine (a staged device operation's transfer): its cancellation reaches the
// operation through the awaited Future.
Task<void> p2p_task(std::shared_ptr<GroupState> g, bool sending, void* data, std::size_t bytes, OpSignature signature, int peer,
                    std::uint32_t tag, std::uint64_t seq, std::chrono::milliseconds timeout) {
  co_await P2pOp::start(g, sending, data, bytes, signature, peer, tag, seq, timeout);
}

// A send's or recv's checks, then its number among this rank's sends to (receives from) `peer`. A
// refusal names the number the call would have taken (refuse_p2p) and takes none.
std::uint64_t checked_p2p_seq(GroupState& g, bool sending, int peer, std::uint32_t tag, ConstBufferView data) {
  const char* op = sending ? "send" : "recv";
  try {
    check_usable(g, op);
    check_rank(g, op, sending ? "destination" : "source", peer);
    check_buffer(g, op, "data", data.data, data.count, data.dtype, data.device);
  } catch (const Error& e) {
    refuse_p2p(g, e, peer, tag, sending);
  }
  return g.take_p2p_seq(peer, sending);
}

}  // namespace

Future<void> Group::send(ConstBufferView data, int dst, std::uint32_t tag) {
  auto& g = live("send");
  const std::uint64_t seq = checked_p2p_seq(g, true, dst, tag, data);
  const auto timeout = timeout_.count() >= 0 ? timeout_ : g.options.timeout;
  const OpSignature signature = signature::of_point_to_point(data.dtype);
  if (on_device(data.device, data.bytes())) {
    detail::StagedCall staged{"send", data, BufferView{}, true, false, false, false, seq, dst, tag};
    return run_staged(state_, stream_, staged, timeout_, [this, signature, dst, tag, seq, timeout](ConstBufferView in, BufferView, std::uint64_t, algo::StagedBuffers*) {
      return p2p_task(state_, true, const_cast<void*>(in.data), in.bytes(), signature, dst, tag, seq, timeout);
    });
  }
  return P2pOp::start(state_, true, const_cast<void*>(data.data), data.bytes(), signature, dst, tag, seq, timeout);
}

Future<void> Group::recv(BufferView data, int src, std::uint32_t tag) {
  auto& g = live("recv");
  const std::uint64_t seq = checked_p2p_seq(g, false, src, tag, data);
  const auto timeout = timeout_.count() >= 0 ? timeout_ : g.options.timeout;
  const OpSignature signature = signature::of_point_to_point(data.dtype);
  if (on_device(data.device, data.bytes())) {
    detail::StagedCall staged{"recv", ConstBufferView{}, data, false, true, false, false, seq, src, tag};
    return run_staged(state_, stream_, staged, timeout_, [this, signature, src, tag, seq, timeout](ConstBufferView, BufferView out, std::uint64_t, algo::StagedBuffers*) {
      return p2p_task(state_, false, out.data, out.bytes(), signature, src, tag, seq, timeout);
    });
  }
  return P2pOp::start(state_, false, data.data, data.bytes(), signature, src, tag, seq, timeout);
}

}  // namespace weft
