#pragma once
/// The transport concept: framed, tag-matched messages between the ranks of a job.
///
/// A transport never knows about collectives: it moves a message identified by a MessageKey from one rank
/// to another. Messages with the same (source, key) match in order (non-overtaking). A message that arrives
/// before its receive is posted is kept until a receive with its key is posted, never lost.
///
/// Threading: every call and every completion happens on the transport's Loop thread. A TransportOp is
/// awaited from a coroutine that runs on that loop.
#include <chrono>
#include <coroutine>
#include <functional>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "weft/error.hpp"

namespace weft {

/// Identifies a message: a context (one per Group), the operation's sequence number on that group (0 for
/// point-to-point messages) and a tag (the user's tag, or step and segment inside a collective).
struct MessageKey {
  std::uint32_t context = 0;
  std::uint64_t seq = 0;
  std::uint64_t tag = 0;
  friend bool operator==(const MessageKey&, const MessageKey&) = default;
};

/// What operation a message belongs to (docs/PROTOCOL.md, "Signatures"): `call` packs the collective,
/// dtype, reduce op and root, `count` is the caller's element count, `plan` the algorithm that runs it
/// (its family's number + 1, as the group's registry numbers them; 0: not said). Every frame of a
/// collective carries its operation's signature; a receive whose signature differs from the arriving
/// message's (both calls non-zero) fails with Errc::mismatch, naming both calls, and the message's bytes
/// are discarded. A call of 0 (control frames, u8 point-to-point messages) is not compared; a plan of 0
/// matches any. Point-to-point messages sign their dtype (kind 29), compared only by their receive.
struct OpSignature {
  std::uint32_t call = 0;
  std::uint8_t plan = 0;  // beside `call`, in its padding: the signature stays 16 bytes
  std::uint64_t count = 0;
  friend bool operator==(const OpSignature& a, const OpSignature& b) noexcept {
    return a.call == b.call && a.count == b.count && (a.plan == b.plan || a.plan == 0 || b.plan == 0);
  }
};
static_assert(sizeof(OpSignature) == 16, "a signature is carried by every operation and slot: keep it 16 bytes");

/// One send or receive in flight. It lives in the frame of the coroutine that started it, or in the
/// object that owns the operation (no allocation per operation), and must stay alive, at the same
/// address, until it completes.
class TransportOp {
 public:
  TransportOp() = default;
  TransportOp(const TransportOp&) = delete;
  TransportOp& operator=(const TransportOp&) = delete;

  bool done() const noexcept { return done_; }
  /// Empty on success; an Errc otherwise, with failed_peer() and reason() filled in.
  std::error_code error() const noexcept { return error_; }
  /// The transport rank whose failure failed this op, or -1.
  int failed_peer() const noexcept { return failed_peer_; }
  const std::string& reason() const noexcept { return reason_; }

  /// `co_await op.wait()` suspends until the op completes (loop thread only; one waiter).
  struct Awaiter {
    TransportOp* op;
    bool await_ready() const noexcept { return op->done_; }
    void await_suspend(std::coroutine_handle<> waiter) noexcept { op->waiter_ = waiter; }
    void await_resume() const noexcept {}
  };
  Awaiter wait() noexcept { return Awaiter{this}; }

  /// Instead of a coroutine: `fn(op, context)` is called on completion (loop thread), and may destroy
  /// the op. Set before the op starts; not together with wait().
  using Completion = void (*)(TransportOp&, void*) noexcept;
  void on_complete(Completion fn, void* context) noexcept {
    completion_ = fn;
    completion_context_ = context;
  }

  /// Called by the transport, once. Resumes the awaiting coroutine (or calls the completion) inline,
  /// which may destroy the op: the transport must have finished touching its own lists before it calls
  /// complete(), and must not touch the op after.
  void complete(std::error_code error, int failed_peer = -1, std::string reason = {}) noexcept {
    error_ = error;
    failed_peer_ = failed_peer;
    reason_ = std::move(reason);
    complete();
  }
  /// The same, successfully: the outcome fields keep what they were made with (an op completes once),
  /// and a received message's completion makes no error_code and no string.
  void complete() noexcept {
    done_ = true;
    if (auto waiter = std::exchange(waiter_, {})) {
      waiter.resume();
    } else if (completion_) {
      completion_(*this, completion_context_);
    }
  }

  // Filled in by start_send / start_recv, for the transport's own bookkeeping.
  int peer = -1;
  MessageKey key{};
  const void* send_data = nullptr;
  void* recv_data = nullptr;
  std::size_t bytes = 0;
  /// Set by the caller before start_send / start_recv (default: not compared).
  OpSignature signature{};

 private:
  bool done_ = false;
  std::error_code error_;
  int failed_peer_ = -1;
  std::string reason_;
  std::coroutine_handle<> waiter_;
  Completion completion_ = nullptr;
  void* completion_context_ = nullptr;
};

class Transport {
 public:
  virtual ~Transport() = default;

  virtual std::string_view name() const noexcept = 0;
  /// This process's rank among the transport's ranks (the world), and the number of ranks.
  virtual int rank() const noexcept = 0;
  virtual int size() const noexcept = 0;

  /// Starts sending `bytes` bytes to `peer`. `op` completes when `data` may be reused.
  virtual void start_send(int peer, const MessageKey& key, const void* data, std::size_t bytes, TransportOp& op) = 0;
  /// Sends `bytes` bytes to `peer` at once when that needs no operation in flight: nothing is queued
  /// to `peer` and its stream takes the whole message now (shared memory with room in the ring), or a
  /// socket takes what it has room for and the rest of a small message is copied and written after it.
  /// Returns true when the message went (as a start_send that completed at once: `data` may be reused);
  /// false when nothing happened (start_send it). `signature` goes in the frame's header as start_send's
  /// op.signature does. Default: false. A point-to-point send from plain code then costs no operation
  /// state (docs/DESIGN.md, "The shm round trip, counted", "Over tcp too").
  virtual bool send_now(int /*peer*/, const MessageKey& /*key*/, const void* /*data*/, std::size_t /*bytes*/,
                        const OpSignature& /*signature*/ = {}) {
    return false;
  }
  /// Whether send_now(peer, key, data, bytes) would send now, as far as the connection to `peer` can
  /// tell (nothing is sent; the key's context may still have failed). Loop thread. A plan of sends to
  /// several peers asks for all of them before it sends any. Default: false.
  virtual bool can_send_now(int /*peer*/, std::size_t /*bytes*/) const { return false; }
  /// Receives `bytes` bytes from `peer` at once when a point-to-point message with `key` already
  /// arrived, of exactly that size and with a signature that agrees with `signature` (as start_recv's
  /// op.signature is compared): it is copied into `data` and true returned, as a start_recv that
  /// completed at once. The message may be kept here, or wait in a shared-memory ring behind the
  /// messages of receives of `key` posted before: those are then delivered too, and their receives
  /// completed (in order, before this returns). False when nothing happened (no such message, or one
  /// that start_recv would fail: start_recv it). Default: false.
  virtual bool recv_now(int /*peer*/, const MessageKey& /*key*/, void* /*data*/, std::size_t /*bytes*/,
                        const OpSignature& /*signature*/ = {}) {
    return false;
  }
  /// Posts a receive of exactly `bytes` bytes from `peer`. A message of another size completes `op` with
  /// Errc::size_mismatch (its bytes are discarded, nothing is truncated silently).
  virtual void start_recv(int peer, const MessageKey& key, void* data, std::size_t bytes, TransportOp& op) = 0;
  /// Withdraws a receive that has not matched a message yet and completes it with Errc::cancelled.
  /// Returns false (and does nothing) when the receive already matched or completed.
  virtual bool cancel_recv(TransportOp& op) = 0;

  /// Contexts: a Group registers its context id and the transport ranks it spans. When one of them fails,
  /// or a member aborts the context, every pending and later operation of the context fails.
  virtual void open_context(std::uint32_t context, std::vector<int> members) = 0;
  virtual void close_context(std::uint32_t context) = 0;
  /// Fails every pending and later operation of `context` here with `code` and `reason`, and tells the
  /// other members (an abort frame), whose operations then fail with Errc::aborted.
  virtual void abort_context(std::uint32_t context, Errc code, const std::string& reason) = 0;
  /// Cancels one operation, (context, seq), here and on every other member (a cancel frame): its pending
  /// and later sends and receives fail with Errc::cancelled and `reason`, and its messages that arrive
  /// are dropped. The context stays usable for every other operation. A receive whose payload is being
  /// read, or a send being written, completes normally.
  virtual void cancel_operation(std::uint32_t context, std::uint64_t seq, const std::string& reason) = 0;
  /// True, with the failure, when `context` can no longer be used.
  virtual bool context_failed(std::uint32_t context, std::error_code* code, std::string* reason) const = 0;
  /// Whether operation (context, seq) was cancelled here or by another member (cancel_operation), and
  /// why; for operations that run beside the transport (the shm arena), which then stop waiting too.
  /// Default: never.
  virtual bool operation_cancelled(std::uint32_t context, std::uint64_t seq, std::string* reason) const {
    (void)context, (void)seq, (void)reason;
    return false;
  }
  /// Whether an operation numbered `seq` of some context may have been cancelled (false: surely not).
  /// Any thread: the arena's fast path leaves such a collective to the loop. Default: true.
  virtual bool maybe_cancelled(std::uint64_t seq) const noexcept {
    (void)seq;
    return true;
  }

  /// The transport ranks that operation (context, seq) here still waits on: the sources of its posted
  /// receives and the destinations of its sends not written yet. For deadline reports.
  virtual std::vector<int> waiting_on(std::uint32_t context, std::uint64_t seq) const = 0;

  /// How far another member is in a context, as it answered a progress query.
  struct Progress {
    int rank = -1;              ///< transport rank
    bool answered = false;      ///< false: no answer in time (stopped, hung, or its connection is gone)
    std::uint64_t started = 0;  ///< the latest operation (seq) it had started in the context; 0: none
    /// How it called the operation asked about (call 0: it has not, or no longer remembers): a deadline
    /// report compares it with this rank's call, which finds mismatches that send no frame to anyone.
    OpSignature signature{};
  };
  /// Records that this rank started operation `seq` of `context` as `signature` without a message of
  /// this transport (a collective that runs in shared memory beside it), so that progress queries and
  /// deadline reports see it as they see the others. Any thread (the arena's fast path calls it on the
  /// caller's). Default: nothing.
  virtual void note_started(std::uint32_t context, std::uint64_t seq, const OpSignature& signature) {
    (void)context, (void)seq, (void)signature;
  }
  /// False only when `context` is known not to have failed (an abort, a lost peer, a mismatch) so far;
  /// true may also mean "cannot tell" (many contexts failed). Any thread: the group arena's fast path,
  /// which finishes a collective on the caller's thread, leaves its group's collectives to the loop (which
  /// knows which context and why) once this is true. Another group's failure on the same transport (a
  /// split's sibling) does not count. Default: true.
  virtual bool context_may_have_failed(std::uint32_t /*context*/) const noexcept { return true; }
  /// How this rank called operation `seq` of `context` (call 0: not yet, or no longer remembered).
  virtual OpSignature signature_of(std::uint32_t context, std::uint64_t seq) const = 0;
  /// Asks every other member of `context` how far it is (a query frame, answered by the member's
  /// transport from its loop whatever its program does). `done` runs on the loop thread once every
  /// member answered or `patience` passed, with one entry per other member. For deadline reports.
  virtual void ask_progress(std::uint32_t context, std::uint64_t seq, std::chrono::milliseconds patience,
                            std::function<void(std::vector<Progress>)> done) = 0;

  /// Whether the connection to `peer` (a transport rank) is up. Always true for this rank.
  virtual bool connected(int peer) const = 0;
  /// What carries the bytes to `peer` (a transport rank): "shm", "tcp", "uring"; "self" for this rank.
  /// Default: name().
  virtual std::string_view backend_to(int peer) const { return peer == rank() ? "self" : name(); }
  /// Closes the connection to `peer` as failed with `reason` (its pending operations and contexts fail
  /// as for a lost connection). For ranks left out by shrink.
  virtual void disconnect(int peer, const std::string& reason) = 0;

  /// Whether frames that tell peers why (an abort, a cancel) are still queued or being written: the last
  /// Group, and the end of an owned Loop, wait for them (at most 2 s) before the transport is shut down,
  /// so that peers learn the reason rather than see a connection close. Called on the loop's thread.
  virtual bool control_pending() const noexcept { return false; }

  /// Closes every connection; pending operations fail.
  virtual void shutdown() = 0;
};

}  // namespace weft
