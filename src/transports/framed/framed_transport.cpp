#include "transports/framed/framed_transport.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>

#include <algorithm>
#include <cstring>
#include <new>
#include <optional>

#include <fmt/format.h>

#include "core/bytes.hpp"
#include "core/log.hpp"
#include "core/loop_executor.hpp"
#include "core/signature.hpp"

namespace weft {
namespace {

constexpr std::size_t discard_chunk = 1 << 20;
constexpr int socket_buffer_bytes = 4 << 20;

std::error_code code_of(Errc e) { return make_error_code(e); }

}  // namespace

namespace {
// A socket error, said so that the reader knows what to look at: a timeout here is the heartbeat's.
std::string describe_error(const std::error_code& ec) {
  if (ec == std::errc::timed_out || ec == asio::error::timed_out) {
    return ec.message() + " (the peer did not acknowledge heartbeats or data in time: its host is down or the network is cut; WEFT_HEARTBEAT)";
  }
  return ec.message();
}
}  // namespace

void FramedTransport::set_heartbeat(asio::ip::tcp::socket& socket, std::chrono::milliseconds interval) {
  if (interval.count() <= 0) return;
  const int fd = socket.native_handle();
  const int on = 1;
  const int seconds = static_cast<int>(std::max<long long>(1, std::chrono::duration_cast<std::chrono::seconds>(interval).count()));
  const int probes = heartbeat_probes;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &seconds, sizeof seconds);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &seconds, sizeof seconds);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
  // No TCP_USER_TIMEOUT: on this kernel it also ends a connection whose peer keeps advertising a zero
  // window (alive, its application busy), which must survive. Busy connections are watched by
  // watch_liveness instead, which tells the two apart.
  const unsigned no_user_timeout = 0;
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &no_user_timeout, sizeof no_user_timeout);
}

namespace {
// The kernel's view of the connection (TCP_INFO), or nullopt once its socket is closed.
std::optional<tcp_info> tcp_info_of(const auto& connection) {
  const int fd = connection.stream->native_handle();
  tcp_info info{};
  socklen_t length = sizeof info;
  if (fd < 0 || ::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &length) != 0) return std::nullopt;
  return info;
}
}  // namespace

void FramedTransport::watch_liveness(std::chrono::milliseconds interval) {
  if (interval.count() <= 0 || liveness_interval_.count() > 0) return;
  liveness_interval_ = interval;
  arm_liveness_check();
}

// Twice per interval: a lost peer is named at most half an interval after the limit.
void FramedTransport::arm_liveness_check() {
  // In nanoseconds: half of a millisecond count rounds 1 ms down to 0, a timer that fired at once for ever
  // (65,000 times a second, and the loop's thread never parked for a waiting caller: the group hung).
  liveness_timer_ = loop_.call_after(std::chrono::nanoseconds(liveness_interval_) / 2, [this, alive = std::weak_ptr<bool>(alive_)](bool fired) {
    if (fired && !alive.expired()) check_liveness();
  });
}

// Reads each connection's TCP_INFO. The peer's kernel acknowledges data and window probes whether or
// not its application reads, so silence from it means its host or the network is gone:
//  - data in flight (tcpi_unacked) with no acknowledgement for (probes + 1) intervals: lost mid-transfer;
//  - heartbeat_probes window or keepalive probes unanswered (tcpi_probes; an answer resets it).
// A zero window alone (everything sent acknowledged, the rest waiting for room) is a live, busy peer.
void FramedTransport::check_liveness() {
  liveness_timer_ = 0;
  if (shut_down_) return;
  const auto limit = liveness_interval_ * (heartbeat_probes + 1);
  for (const auto& connection : connections_) {
    if (!connection || !connection->alive || !connection->stream) continue;
    const auto found = tcp_info_of(*connection);
    if (!found) continue;
    const tcp_info& info = *found;
    std::string reason;
    if (info.tcpi_unacked > 0 && std::chrono::milliseconds(info.tcpi_last_ack_recv) >= limit) {
      reason = fmt::format("no acknowledgement of data sent for {} ms", info.tcpi_last_ack_recv);
    } else if (info.tcpi_probes >= heartbeat_probes) {
      reason = fmt::format("{} probes unanswered", static_cast<int>(info.tcpi_probes));
    }
    if (!reason.empty()) {
      fail_connection(*connection, fmt::format("{} (the peer did not acknowledge heartbeats or data in time: its host is down or "
                                               "the network is cut; WEFT_HEARTBEAT={} ms)",
                                               reason, liveness_interval_.count()));
    }
  }
  arm_liveness_check();
}

void FramedTransport::encode_header(const wire::Header& h, Connection& c) {
  wire::HeaderBytes bytes{};
  wire::encode(h, bytes);
  std::copy(bytes.begin(), bytes.end(), c.send_header.begin());
}

void FramedTransport::seal_frames(Integrity mode, const std::vector<FrameKeys>& keys) {
  integrity_ = mode;
  for (auto& c : connections_) {
    if (!c) continue;
    const FrameKeys k = static_cast<std::size_t>(c->peer) < keys.size() ? keys[static_cast<std::size_t>(c->peer)] : FrameKeys{};
    c->send_seal = FrameSeal(mode, k.send);
    c->recv_seal = FrameSeal(mode, k.recv);
  }
}

void FramedTransport::tune_socket(asio::ip::tcp::socket& socket) {
  std::error_code ignored;
  socket.set_option(asio::ip::tcp::no_delay(true), ignored);
  if (socket_buffer_bytes > 0) {
    socket.set_option(asio::socket_base::send_buffer_size(socket_buffer_bytes), ignored);
    socket.set_option(asio::socket_base::receive_buffer_size(socket_buffer_bytes), ignored);
  }
}

FramedTransport::FramedTransport(Loop& loop, int rank, int size, std::vector<asio::ip::tcp::socket> sockets, std::string_view backend,
                           const StreamFactory& make_stream)
    : loop_(loop), backend_(backend), rank_(rank), size_(size) {
  connections_.resize(static_cast<std::size_t>(size));
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    auto& socket = sockets[static_cast<std::size_t>(peer)];
    tune_socket(socket);
    auto c = std::make_shared<Connection>();
    c->peer = peer;
    c->stream = make_stream(std::move(socket), this, peer, alive_);
    c->inbox = c->stream->staging(Connection::inbox_size);
    if (!c->inbox) {
      c->own_inbox = std::make_unique_for_overwrite<std::byte[]>(Connection::inbox_size);
      c->inbox = c->own_inbox.get();
    }
    c->read_ahead_most = std::min(Connection::inbox_size, c->stream->read_ahead_limit());
    c->read_ahead = c->read_ahead_most;
    connections_[static_cast<std::size_t>(peer)] = std::move(c);
  }
  // Reading starts on the loop thread, where every handler of this transport runs.
  loop_.post([this, alive = std::weak_ptr<bool>(alive_)] {
    if (alive.expired()) return;
    for (auto& c : connections_) {
      if (c && c->alive) start_read_header(*c);
    }
  });
}

FramedTransport::~FramedTransport() {
  shutdown();
  alive_.reset();
  for (auto& c : connections_) {
    if (c) c->incoming = Matcher::Early{};  // its charge points into matcher_
  }
}

// ---------------------------------------------------------------- contexts

void FramedTransport::open_context(std::uint32_t context, std::vector<int> members) {
  auto& state = contexts_.at(context);
  state.members = std::move(members);
  // A member that is already gone fails the context from the start.
  for (int m : state.members) {
    if (m == rank_) continue;
    auto& c = connections_[static_cast<std::size_t>(m)];
    if (c && !c->alive) state.fail(code_of(Errc::peer_failure), m, c->lost_reason);
  }
}

void FramedTransport::close_context(std::uint32_t context) {
  if (!shut_down_) report_unreceived(context);
  contexts_.erase(context);
  matcher_.forget_context(context);
}

// A group that closes healthy with messages no receive took: sends without their receive (plans or
// calls that differ across ranks, a receive withdrawn at its deadline before its message came). They
// would go unnoticed (nothing waits on them); one line names them. A failed group's leftovers are its
// failure's, already reported.
void FramedTransport::report_unreceived(std::uint32_t context) const {
  const ContextState* state = contexts_.find(context);
  if (!state || state->failed || state->members.empty()) return;
  std::size_t count = 0, bytes = 0;
  std::string named;
  matcher_.for_each_unreceived(context, [&](int peer, const MessageKey& key, const Matcher::Early& message) {
    ++count;
    bytes += message.bytes;
    if (count > 4) return;
    const std::string what = noted_per_seq(message.signature)
                                 ? signature::describe(message.signature, key.seq)
                                 : fmt::format("a point-to-point message{} [tag {}]",
                                               message.signature.call != 0 ? " of " + signature::dtype_of(message.signature) : "", key.tag);
    named += fmt::format("{}from rank {}: {}, {} bytes", named.empty() ? "" : "; ", peer, what, message.bytes);
  });
  if (count == 0) return;
  log().warn("rank {}: a group closed with {} message{} ({} bytes) that no receive of this rank took: {}{} (a send "
             "without its receive: plans or calls that differ across ranks, or a receive withdrawn before its "
             "message came)",
             rank_, count, count == 1 ? "" : "s", bytes, named, count > 4 ? fmt::format("; and {} more", count - 4) : "");
}

bool FramedTransport::context_failed(std::uint32_t context, std::error_code* code, std::string* reason) const {
  const ContextState* state = contexts_.find(context);
  if (!state || !state->failed) return false;
  if (code) *code = state->code;
  if (reason) *reason = state->reason;
  return true;
}

bool FramedTransport::context_usable(std::uint32_t context, TransportOp& op) {
  if (shut_down_) {
    op.complete(code_of(Errc::group_failed), -1, "the transport was shut down");
    return false;
  }
  if (const ContextState* state = contexts_.find(context); state && state->failed) {
    op.complete(state->code, state->failed_peer, state->reason);
    return false;
  }
  return true;
}

void FramedTransport::collect_context_ops(std::uint32_t context, std::vector<TransportOp*>& out) {
  // Messages that arrived before the failure stay receivable (close_context drops them).
  matcher_.take_posted_if([context](const Matcher::Key& key) { return key.key.context == context; }, out);
  for (auto& c : connections_) {
    if (!c) continue;
    // The operation being written (front, while writing) completes from its write handler.
    auto first = c->send_queue.begin() + (c->writing && !c->writing_control && !c->send_queue.empty() ? 1 : 0);
    for (auto it = first; it != c->send_queue.end();) {
      if ((*it)->key.context == context) {
        out.push_back(*it);
        it = c->send_queue.erase(it);
      } else {
        ++it;
      }
    }
    // A receive whose payload is being read right now (c->current_op) is left alone: the kernel is
    // writing into its buffer, so it completes (with the context's failure) when that read ends.
  }
}

void FramedTransport::complete_all(const std::vector<TransportOp*>& ops, std::uint32_t context) {
  const auto& state = contexts_.at(context);
  const auto code = state.code;
  const int peer = state.failed_peer;
  const std::string reason = state.reason;
  for (TransportOp* op : ops) op->complete(code, peer, reason);
}

void FramedTransport::abort_context(std::uint32_t context, Errc code, const std::string& reason) {
  auto& state = contexts_.at(context);
  if (!state.fail(code_of(code), -1, reason)) return;
  send_abort(context, state.members, reason);
  std::vector<TransportOp*> ops;
  collect_context_ops(context, ops);
  complete_all(ops, context);
  watch_stuck_io(context);
}

bool FramedTransport::carries_frame_of(const Connection& c, std::uint32_t context) const {
  if (!c.alive) return false;
  const bool writing = c.writing && (c.writing_kept ? c.kept_context == context
                                                    : !c.writing_control && !c.send_queue.empty() && c.send_queue.front()->key.context == context);
  const bool reading = c.current_op && c.current_op->key.context == context;
  // A lent send's payload is still being read by the peer: a frame in flight as much as a write is.
  const bool lent = std::any_of(c.lent.begin(), c.lent.end(), [context](const TransportOp* op) { return op->key.context == context; });
  return writing || reading || lent;
}

void FramedTransport::watch_stuck_io(std::uint32_t context, bool at_once) {
  bool any = false;
  for (const auto& c : connections_) any = any || (c && carries_frame_of(*c, context));
  if (!any || shut_down_) return;
  // The kernel already knows how long the frame has not moved: the first look comes at once (on the
  // next turn of the loop, outside the failure path that called us), the next ones a few times per grace.
  auto look = [this, alive = std::weak_ptr<bool>(alive_), context](bool fired) {
    if (fired && !alive.expired()) check_stuck_io(context);
  };
  if (at_once) {
    loop_.post([look] { look(true); });
  } else {
    loop_.call_after(stuck_grace / 4, look);
  }
}

// The kernel's own clocks say whether the frame moves: milliseconds since data was last received (for
// the payload being read) or sent (for the write in flight; a peer that does not read leaves a zero
// window, and only probes go out). A live peer keeps them small; a stopped or hung one does not.
void FramedTransport::check_stuck_io(std::uint32_t context) {
  if (shut_down_) return;
  const auto grace = static_cast<std::uint32_t>(stuck_grace.count());
  bool again = false;
  for (const auto& connection : connections_) {
    if (!connection || !carries_frame_of(*connection, context)) continue;
    Connection& c = *connection;
    const bool reading = c.current_op && c.current_op->key.context == context;
    const auto since = c.stream->ms_since_data(reading);
    if (!since) continue;
    const std::uint32_t still = *since;
    if (still < grace) {
      again = true;
      continue;
    }
    const ContextState* state = contexts_.find(context);
    fail_connection(c, fmt::format("closed in the middle of {} a frame of an operation that failed ({}): no byte moved for {} ms, "
                                   "so rank {} is stopped or hung; its later operations with this rank fail",
                                   reading ? "reading" : "writing",
                                   state ? state->reason : std::string("aborted"), still, c.peer));
  }
  if (again) watch_stuck_io(context, false);
}

void FramedTransport::note_started(std::uint32_t context, std::uint64_t seq, const OpSignature& signature) {
  if (loop_.in_loop_thread()) {
    note_local_signature(context, seq, signature);
    return;
  }
  const std::uint64_t number = noted_elsewhere_pushed_.fetch_add(1, std::memory_order_acq_rel);
  NotedElsewhere& slot = noted_elsewhere_[number % noted_elsewhere_.size()];
  slot.stamp.store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);  // the 0 is seen before any word of the new entry
  slot.seq.store(seq, std::memory_order_relaxed);
  slot.count.store(signature.count, std::memory_order_relaxed);
  slot.context.store(context, std::memory_order_relaxed);
  slot.call.store(signature.call, std::memory_order_relaxed);
  slot.plan.store(signature.plan, std::memory_order_relaxed);
  slot.stamp.store(number + 1, std::memory_order_release);
}

void FramedTransport::take_noted_elsewhere() {
  const std::uint64_t pushed = noted_elsewhere_pushed_.load(std::memory_order_acquire);
  const std::uint64_t size = noted_elsewhere_.size();
  std::uint64_t number = std::max(noted_elsewhere_taken_, pushed > size ? pushed - size : 0);
  for (; number < pushed; ++number) {
    const NotedElsewhere& slot = noted_elsewhere_[number % size];
    const std::uint64_t stamp = slot.stamp.load(std::memory_order_acquire);
    if (stamp < number + 1) break;      // still being written: taken next time
    if (stamp != number + 1) continue;  // written over by a later push, taken in its place
    const std::uint32_t context = slot.context.load(std::memory_order_relaxed);
    const std::uint64_t seq = slot.seq.load(std::memory_order_relaxed);
    const OpSignature signature{.call = slot.call.load(std::memory_order_relaxed),
                                .plan = slot.plan.load(std::memory_order_relaxed),
                                .count = slot.count.load(std::memory_order_relaxed)};
    std::atomic_thread_fence(std::memory_order_acquire);
    if (slot.stamp.load(std::memory_order_relaxed) != stamp) continue;  // written over while read
    if (!noted_per_seq(signature) || contexts_.noted_last(context, seq)) continue;
    note_new_local_signature(context, seq, signature);
  }
  noted_elsewhere_taken_ = number;
}

// The searches visit only the kept entries of the seq sought (contexts.hpp, Recent): a check runs per
// message and must cost little (bench/RESULTS.md, "Mismatch detection"). An entry no longer kept (64
// newer ones came) can only hide a mismatch from this early check; a receive still compares every frame
// it takes.
void FramedTransport::note_new_local_signature(std::uint32_t context, std::uint64_t seq, const OpSignature& signature) {
  ContextState* state = contexts_.find(context);
  if (state) state->started = std::max(state->started, seq);
  if (!state || state->failed) return;
  contexts_.note_last(context, seq);
  if (const auto* latest = state->local.latest(); latest && latest->seq == seq) return;
  state->local.push(ContextState::Seen{seq, signature, rank_});
  if (const auto* seen = state->early.disagreeing(seq, signature)) {
    const std::string reason = mismatch_reason(seq, seen->peer, seen->signature, signature);
    abort_context(context, Errc::mismatch, reason);
  }
}

void FramedTransport::note_early_signature(std::uint32_t context, std::uint64_t seq, const OpSignature& signature, int peer) {
  if (!noted_per_seq(signature)) return;
  ContextState* state = contexts_.find(context);
  if (!state || state->failed) return;
  if (const auto* seen = state->local.disagreeing(seq, signature)) {
    abort_context(context, Errc::mismatch, mismatch_reason(seq, peer, signature, seen->signature));
    return;
  }
  if (const auto* latest = state->early.latest(); latest && latest->seq == seq && latest->peer == peer) return;
  state->early.push(ContextState::Seen{seq, signature, peer});
}

std::vector<int> FramedTransport::waiting_on(std::uint32_t context, std::uint64_t seq) const {
  std::vector<int> peers;
  matcher_.peers_posted(context, seq, peers);
  for (const auto& c : connections_) {
    if (!c) continue;
    for (const TransportOp* op : c->send_queue) {
      if (op->key.context == context && op->key.seq == seq) {
        peers.push_back(c->peer);
        break;
      }
    }
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  return peers;
}

// ---------------------------------------------------------------- sending

void FramedTransport::start_send(int peer, const MessageKey& key, const void* data, std::size_t bytes, TransportOp& op) {
  op.peer = peer;
  op.key = key;
  op.send_data = data;
  op.bytes = bytes;
  note_local_signature(key.context, key.seq, op.signature);
  if (!context_usable(key.context, op)) return;
  if (const std::string* why = cancellation_of(key)) {
    op.complete(code_of(Errc::cancelled), -1, *why);
    return;
  }
  if (peer == rank_) {
    deliver_local(key, data, bytes, op.signature);
    op.complete();
    return;
  }
  auto& c = *connections_[static_cast<std::size_t>(peer)];
  if (!c.alive) {
    op.complete(code_of(Errc::peer_failure), peer, c.lost_reason);
    return;
  }
  c.send_queue.push_back(&op);
  if (!c.writing) start_write(c, &op);
}

bool FramedTransport::send_now(int peer, const MessageKey& key, const void* data, std::size_t bytes, const OpSignature& signature) {
  Connection* idle = idle_for_send_now(peer, bytes);
  if (!idle) return false;
  Connection& c = *idle;
  const bool whole = c.stream->writes_whole_now();  // (write_whole_now asks for the room itself)
  note_local_signature(key.context, key.seq, signature);
  if (const ContextState* state = contexts_.find(key.context); state && state->failed) return false;
  if (cancellation_of(key)) return false;
  wire::Header h;
  h.kind = wire::FrameKind::data;
  h.context = key.context;
  h.seq = key.seq;
  h.tag = key.tag;
  h.bytes = bytes;
  h.call = signature.call;
  h.count = signature.count;
  h.flags = signature.plan;
  // Frames are not sealed here (idle_for_send_now): the long form is the whole header, and a stream that
  // takes the frame whole encodes it only if it sends it.
  if (whole) return c.stream->write_frame_now(h, ConstBytes{data, bytes});
  encode_header(h, c);
  const ConstBytes header{c.send_header.data(), header_bytes()};
  // A socket takes what its buffer has room for; the rest is copied and written as the connection's
  // own bytes (the send is done: its buffer may be reused, as once the kernel has it). A failure
  // meets that write and fails the connection as any write's does.
  const std::size_t sent = c.stream->write_some_now(header, ConstBytes{data, bytes}, ConstBytes{});
  if (sent == header.size + bytes) return true;
  c.control_payload.clear();
  if (sent < header.size) c.control_payload.append(reinterpret_cast<const char*>(header.data) + sent, header.size - sent);
  const std::size_t payload_sent = sent > header.size ? sent - header.size : 0;
  c.control_payload.append(static_cast<const char*>(data) + payload_sent, bytes - payload_sent);
  c.writing = true;
  c.writing_control = true;
  c.kept_context = key.context;
  c.writing_kept = true;
  sends_partly_kept_.fetch_add(1, std::memory_order_relaxed);
  c.stream->write(ConstBytes{}, ConstBytes{c.control_payload.data(), c.control_payload.size()}, ConstBytes{});
  return true;
}

// The connection to `peer` when a message of `bytes` may go on it without an operation: alone on an
// idle, unsealed connection (a sealed frame needs its trailer: start_write's path), whose stream can
// take a whole frame at once (shm, when its ring has the room) or take some of a small one and let the
// rest be kept (a socket). Null otherwise.
FramedTransport::Connection* FramedTransport::idle_for_send_now(int peer, std::size_t bytes) const noexcept {
  if (shut_down_ || peer == rank_ || peer < 0 || static_cast<std::size_t>(peer) >= connections_.size()) return nullptr;
  const auto& connection = connections_[static_cast<std::size_t>(peer)];
  if (!connection) return nullptr;
  Connection& c = *connection;
  if (!c.alive || c.write_failed || c.writing || !c.send_queue.empty() || !c.control_queue.empty() || c.send_seal.on() ||
      integrity_ != Integrity::off)
    return nullptr;
  const bool takes = c.stream->writes_whole_now() || (c.stream->writes_some_now() && bytes <= send_now_socket_most);
  return takes ? &c : nullptr;
}

bool FramedTransport::can_send_now(int peer, std::size_t bytes) const {
  const Connection* c = idle_for_send_now(peer, bytes);
  return c && (!c->stream->writes_whole_now() || c->stream->takes_whole_now(header_bytes(), bytes));
}

bool FramedTransport::recv_now(int peer, const MessageKey& key, void* data, std::size_t bytes, const OpSignature& signature) {
  const Matcher::Key where{peer, key};
  const Matcher::Early* early = matcher_.peek_early(where);
  if (!early) return recv_from_stream_now(where, data, bytes, signature);
  // Only what start_recv would deliver without an error: the size asked for, a signature that agrees.
  if (early->bytes != bytes || disagree(signature, early->signature)) return false;
  note_local_signature(key.context, key.seq, signature);
  auto message = matcher_.take_early(where);
  if (bytes) std::memcpy(data, message->data.get(), bytes);
  matcher_.give_back(std::move(*message));
  return true;
}

// What recv_from_stream_now asks of the stream's next frames: the messages of the receives of its key
// posted before (`posted`, oldest first), then its own, and where each payload goes.
struct FramedTransport::DirectReceive {
  DirectReceive(FramedTransport* t, Connection* c, const Matcher::Key* w, void* d, std::size_t b, const OpSignature* s,
                std::span<TransportOp* const> p) noexcept
      : transport(t), connection(c), where(w), data(d), bytes(b), signature(s), posted(p) {}
  FramedTransport* transport;
  Connection* connection;
  const Matcher::Key* where;
  void* data;
  std::size_t bytes;
  const OpSignature* signature;
  std::span<TransportOp* const> posted;
  TransportOp* served[Stream::most_offered_frames];  // the posted ones that got their message (take_direct; not initialised)
};

// No early message for `where`: its message may be in the peer's stream (a shm ring written ahead of
// this receive), behind the messages of the receives of its key posted before (the next messages of a
// key are theirs, in order). When the stream's next frames are exactly those messages and then this
// receive's, every one is taken straight into its receive's buffer: this one needs no operation posted,
// matched and completed (about a third of a small message's instructions on the receiving side,
// bench/RESULTS.md, "The ring's next frames"), and the ones posted before complete here rather than on
// the loop's next look. Only where take_data_frame would give each to a receive posted now: between
// frames, nothing read ahead, the context usable; only what start_recv would deliver without an error
// (anything else stays for the receive posted next). A few posted before at most (one fewer than
// Stream::most_offered_frames): a longer window's messages are left to the loop's reading.
bool FramedTransport::recv_from_stream_now(const Matcher::Key& where, void* data, std::size_t bytes, const OpSignature& signature) {
  const auto posted = matcher_.posted(where);
  if (posted.size() >= Stream::most_offered_frames) return false;
  const auto peer = static_cast<std::size_t>(where.peer);
  if (where.peer == rank_ || where.peer < 0 || peer >= connections_.size() || !connections_[peer]) return false;
  Connection& c = *connections_[peer];
  if (!between_frames(c) || drops_data(contexts_.find(where.key.context), where.key.seq)) return false;
  DirectReceive want(this, &c, &where, data, bytes, &signature, posted);
  const std::size_t served = posted.size();
  if (c.stream->take_next_data_frames(&FramedTransport::take_direct, &want, served + 1) != served + 1) return false;
  // This receive's message is taken: the ones before may complete now, in order, and a receive their
  // completions make comes after it. A completion may end the transport: nothing of it is touched after
  // (`want` is this frame's).
  for (std::size_t i = 0; i < served; ++i) want.served[i]->complete();
  return true;
}

std::size_t FramedTransport::take_direct(void* context, const Stream::OfferedFrame* frames, std::size_t n) {
  auto& want = *static_cast<DirectReceive*>(context);
  const std::size_t served = want.posted.size();
  if (n < served + 1) return 0;
  const MessageKey& key = want.where->key;
  // All or none: each frame of the key, its size within the inbox's, and its receive's size and signature.
  for (std::size_t i = 0; i <= served; ++i) {
    const wire::Header& h = frames[i].header;
    if (!takes_whole(h) || h.context != key.context || h.seq != key.seq || h.tag != key.tag) return 0;
    const bool takes = i < served ? completes(want.posted[i]->signature, want.posted[i]->bytes, h) : completes(*want.signature, want.bytes, h);
    if (!takes) return 0;
  }
  FramedTransport& t = *want.transport;
  t.note_local_signature(key.context, key.seq, *want.signature);
  for (std::size_t i = 0; i < served; ++i) {
    TransportOp* op = t.matcher_.take_posted(*want.where);  // the oldest: posted[i] (the span goes with it)
    want.served[i] = op;
    if (op->bytes) std::memcpy(op->recv_data, frames[i].payload, op->bytes);
  }
  begin_frame(*want.connection, frames[served].header);
  if (want.bytes) std::memcpy(want.data, frames[served].payload, want.bytes);
  return served + 1;
}

void FramedTransport::start_write(Connection& c, TransportOp* starting) {
  if (!c.alive || c.write_failed) return;
  wire::Header h;
  ConstBytes first{c.send_header.data(), header_bytes()};
  ConstBytes second;
  if (!c.control_queue.empty()) {
    h = c.control_queue.front().first;
    c.control_payload = std::move(c.control_queue.front().second);
    c.control_queue.pop_front();
    c.writing_control = true;
    encode_header(h, c);
    second = ConstBytes{c.control_payload.data(), c.control_payload.size()};
  } else if (!c.send_queue.empty()) {
    TransportOp& op = *c.send_queue.front();
    h.kind = wire::FrameKind::data;
    h.context = op.key.context;
    h.seq = op.key.seq;
    h.tag = op.key.tag;
    h.bytes = op.bytes;
    h.call = op.signature.call;
    h.count = op.signature.count;
    h.flags = op.signature.plan;
    c.writing_control = false;
    encode_header(h, c);
    second = ConstBytes{op.send_data, op.bytes};
  } else {
    return;
  }
  if (c.send_seal.on()) {
    // The header's own check, so that a corrupted length or kind is caught before it is acted on.
    le::put_u32(c.send_header.data() + wire::header_size, crc32c(0, c.send_header.data(), wire::header_size));
  }
  ConstBytes third;
  if (c.send_seal.on()) {
    c.send_seal.begin();
    c.send_seal.update(c.send_header.data(), wire::header_size);
    c.send_seal.update(second.data, second.size);
    c.send_seal.seal(c.send_trailer.data());
    third = ConstBytes{c.send_trailer.data(), c.send_seal.trailer_size()};
  }
  c.writing = true;
  // The send just started, alone on its connection: where the stream takes the whole frame at once it
  // completes here, without the loop turn a reported write costs (a small collective's sends then finish
  // within the turn that started them: docs/DESIGN.md, "The per-operation floor"). Its starter has not
  // waited on it yet, so completing it resumes nothing inline.
  if (starting && !c.writing_control && c.send_queue.size() == 1 && c.send_queue.front() == starting) {
    if (c.stream->write_now(first, second, third)) {
      c.writing = false;
      c.send_queue.pop_front();
      starting->complete();
    }
    return;  // (false: the write is under way, on_written to come)
  }
  c.stream->write(first, second, third);
}

void FramedTransport::on_written(int peer, const std::error_code& ec) { on_write_done(*connections_[static_cast<std::size_t>(peer)], ec); }

// The send's frame is out, its payload lent: it completes when the peer has read it (on_released), or
// fails with the connection (close_connection, after the stream's close).
void FramedTransport::on_lent(int peer) {
  Connection& c = *connections_[static_cast<std::size_t>(peer)];
  c.writing = false;
  if (c.writing_control || c.send_queue.empty()) {  // only data frames lend; nothing else to do
    c.writing_control = false;
    c.writing_kept = false;
    c.control_payload.clear();
  } else {
    c.lent.push_back(c.send_queue.front());
    c.send_queue.pop_front();
  }
  if (c.alive) start_write(c);
}

void FramedTransport::on_released(int peer, std::size_t writes) {
  Connection& c = *connections_[static_cast<std::size_t>(peer)];
  for (std::size_t i = 0; i < writes && !c.lent.empty(); ++i) {
    TransportOp* done = c.lent.front();
    c.lent.pop_front();
    done->complete();
  }
}

void FramedTransport::on_write_done(Connection& c, const std::error_code& ec) {
  c.writing = false;
  TransportOp* done = nullptr;
  if (c.writing_control) {
    c.writing_control = false;
    c.writing_kept = false;
    c.control_payload.clear();
  } else if (!c.send_queue.empty()) {
    done = c.send_queue.front();
    c.send_queue.pop_front();
  }
  if (ec) {
    if (!c.alive) {
      if (done) complete_cut_off(*done, c);
      return;
    }
    // A write fails when the peer closed (broken pipe, reset), often with its last frames still unread
    // here: its abort among them, which names the cause (a rank whose device failed aborts the group and
    // leaves). Reading those first, the operations fail naming the cause, not the closed connection. So
    // nothing more is written, the frame goes back to the queue, and the connection fails a little later
    // if its read side has not failed it first.
    if (done) c.send_queue.push_front(done);
    c.write_failed = true;  // nothing more is written
    auto timer = std::make_shared<asio::steady_timer>(detail::executor_of(loop_), std::chrono::milliseconds(20));
    timer->async_wait([this, timer, peer = c.peer, alive = std::weak_ptr<bool>(alive_),
                       reason = fmt::format("write failed: {}", describe_error(ec))](const std::error_code&) {
      if (alive.expired()) return;
      Connection& conn = *connections_[static_cast<std::size_t>(peer)];
      if (conn.alive) fail_connection(conn, reason);
    });
    return;
  }
  // Without an error the frame was wholly handed to the stream, also where the connection ended since
  // (a peer that took it and said goodbye while this handler was on its way): the send is done, as a
  // socket write is once the kernel has the bytes. Failing it would fail a collective the peer finished
  // with these very bytes. (start_write does nothing on a connection that is no longer alive.)
  start_write(c);
  if (done) done->complete();
}

// ---------------------------------------------------------------- receiving

void FramedTransport::start_recv(int peer, const MessageKey& key, void* data, std::size_t bytes, TransportOp& op) {
  op.peer = peer;
  op.key = key;
  op.recv_data = data;
  op.bytes = bytes;
  note_local_signature(key.context, key.seq, op.signature);
  // A message that already arrived is delivered even when its sender or the context failed since.
  if (auto message = matcher_.take_early(Matcher::Key{peer, key})) {
    deliver(op, peer, message->data.get(), message->bytes, message->signature);
    matcher_.give_back(std::move(*message));
    return;
  }
  if (!context_usable(key.context, op)) return;
  if (const std::string* why = cancellation_of(key)) {
    op.complete(code_of(Errc::cancelled), -1, *why);
    return;
  }
  if (peer != rank_) {
    auto& c = *connections_[static_cast<std::size_t>(peer)];
    if (!c.alive) {
      op.complete(code_of(Errc::peer_failure), peer, c.lost_reason);
      return;
    }
  }
  matcher_.post(Matcher::Key{peer, key}, op);
}

bool FramedTransport::cancel_recv(TransportOp& op) {
  if (!matcher_.withdraw(op)) return false;
  op.complete(code_of(Errc::cancelled), -1, "the receive was cancelled");
  return true;
}

std::string FramedTransport::mismatch_reason(std::uint64_t seq, int from, const OpSignature& theirs, const OpSignature& mine) const {
  if (signature::is_point_to_point(theirs) || signature::is_point_to_point(mine)) {
    return fmt::format("rank {} sent {} data where rank {} receives {} (a send and its receive agree on the dtype, or one of them is "
                       "u8: raw bytes); the message was discarded",
                       from, signature::dtype_of(theirs), rank_, signature::dtype_of(mine));
  }
  return fmt::format("rank {} called {} while rank {} called {}", from, signature::describe(theirs, seq), rank_,
                     signature::describe(mine, seq));
}

void FramedTransport::deliver(TransportOp& op, int from, const void* data, std::size_t bytes, const OpSignature& signature) {
  if (mismatched(op, signature)) {
    op.complete(code_of(Errc::mismatch), -1, mismatch_reason(op.key.seq, from, signature, op.signature));
    return;
  }
  if (op.bytes != bytes) {
    op.complete(code_of(Errc::size_mismatch), -1,
                fmt::format("rank {} sent {} bytes, this rank expected {}", from, bytes, op.bytes));
    return;
  }
  if (bytes) std::memcpy(op.recv_data, data, bytes);
  op.complete();
}

void FramedTransport::deliver_local(const MessageKey& key, const void* data, std::size_t bytes, const OpSignature& signature) {
  if (TransportOp* op = matcher_.take_posted(Matcher::Key{rank_, key})) {
    deliver(*op, rank_, data, bytes, signature);
    return;
  }
  Matcher::Early message = matcher_.take_buffer(bytes);
  message.signature = signature;
  if (bytes) std::memcpy(message.data.get(), data, bytes);
  matcher_.keep_early(Matcher::Key{rank_, key}, std::move(message));
}

void FramedTransport::start_read_header(Connection& c) {
  const std::size_t have = c.inbox_end - c.inbox_begin;
  const std::size_t need = header_bytes();
  if (have >= need) {
    // A whole header is here already: handled after this frame by the loop in handle_frames (not by
    // recursion: a run of small frames would nest one call per frame), or, outside one, from the loop's
    // queue.
    take_from_inbox(c, c.recv_header.data(), need);
    if (c.handling) {
      c.header_waiting = true;
      return;
    }
    post_frames(c);
    return;
  }
  if (c.inbox_begin > 0) {
    std::memmove(c.inbox, c.inbox + c.inbox_begin, have);
    c.inbox_begin = 0;
    c.inbox_end = have;
  }
  c.reading = Reading::header;
  c.stream->read(c.inbox + c.inbox_end, need - have, c.read_ahead - c.inbox_end);
}

void FramedTransport::post_frames(Connection& c) {
  loop_.post([this, peer = c.peer, alive = std::weak_ptr<bool>(alive_)] {
    if (alive.expired()) return;
    Connection& conn = *connections_[static_cast<std::size_t>(peer)];
    if (conn.alive) handle_frames(conn, FrameStep::header);
  });
}

void FramedTransport::handle_frames(Connection& c, FrameStep step) {
  // A completion runs the user's code, which may drop the group and with it this transport: after each
  // frame, `alive` says whether it still exists, and `keep` holds the connection.
  const std::weak_ptr<bool> alive = alive_;
  const std::shared_ptr<Connection> keep = connections_[static_cast<std::size_t>(c.peer)];
  c.handling = true;
  switch (step) {
    case FrameStep::header: on_header(c); break;
    case FrameStep::payload: on_payload(c, false); break;
    case FrameStep::trailer: on_trailer(c); break;
  }
  for (int frames = 1; !alive.expired() && c.alive && c.header_waiting; ++frames) {
    c.header_waiting = false;
    if (frames == frames_per_turn) {  // the others' turn: the rest from the loop's queue
      c.handling = false;
      post_frames(c);
      return;
    }
    on_header(c);
  }
  c.handling = false;
  c.header_waiting = false;
}

void FramedTransport::on_read(int peer, const std::error_code& ec, std::size_t bytes) {
  Connection& c = *connections_[static_cast<std::size_t>(peer)];
  if (!c.alive) return;
  if (ec) {
    // Bytes that came before the end still count: a peer that hangs up after half a header has not
    // closed cleanly between frames.
    if (c.reading == Reading::header) c.inbox_end += bytes;
    const bool between_frames = c.reading == Reading::header && c.inbox_begin == c.inbox_end;
    if (ec == asio::error::eof) {
      fail_connection(c, between_frames ? std::string("the peer closed the connection")
                                        : std::string("the peer closed the connection in the middle of a frame"));
    } else {
      fail_connection(c, fmt::format("read failed: {}", describe_error(ec)));
    }
    return;
  }
  switch (c.reading) {
    case Reading::header:
      c.inbox_end += bytes;
      take_from_inbox(c, c.recv_header.data(), header_bytes());
      handle_frames(c, FrameStep::header);
      return;
    case Reading::payload:
      handle_frames(c, FrameStep::payload);
      return;
    case Reading::trailer:
      handle_frames(c, FrameStep::trailer);
      return;
    case Reading::discard:
      if (c.recv_seal.on()) c.recv_seal.update(c.scratch.get(), c.discard_chunk);
      if (c.discard_after > 0) {
        read_payload_into(c, nullptr, c.discard_after, true);
      } else {
        on_payload(c, true);
      }
      return;
  }
}

// A whole data frame the stream holds in one piece (StreamEvents::take_frame), taken by the receive
// posted for it: exactly what on_header, on_data_header, read_payload_into and on_frame do for such a
// frame, without the copy into the inbox and those steps. Anything else (a control frame, an early
// message, a mismatch or a wrong size to report, a failed or cancelled operation, sealed frames, a frame
// larger than the inbox) is left to them: null.
TransportOp* FramedTransport::take_frame(int peer, const std::byte* data, std::size_t size) {
  if (size < wire::header_size) return nullptr;
  wire::HeaderBytes header_bytes;
  std::memcpy(header_bytes.data(), data, wire::header_size);
  std::string error;
  const auto header = wire::decode(header_bytes, error);
  if (!header || header->bytes != size - wire::header_size) return nullptr;
  return take_data_frame(peer, *header, data + wire::header_size);
}

// The same for a frame the stream carried in a form of its own (a short header): the header as the
// long form would have said it.
TransportOp* FramedTransport::take_data_frame(int peer, const wire::Header& h, const std::byte* payload) {
  Connection& c = *connections_[static_cast<std::size_t>(peer)];
  if (!between_frames(c) || !takes_whole(h)) return nullptr;
  if (drops_data(contexts_.find(h.context), h.seq)) return nullptr;
  TransportOp* op = matcher_.take_posted_accepted(Matcher::Key{peer, MessageKey{h.context, h.seq, h.tag}},
                                                  [&](const TransportOp& posted) { return completes(posted.signature, posted.bytes, h); });
  if (!op) return nullptr;
  begin_frame(c, h);
  if (h.bytes) std::memcpy(op->recv_data, payload, h.bytes);
  return op;
}

// Nothing happened on this thread since take_frame found the operation usable.
void FramedTransport::complete_taken(int /*peer*/, TransportOp& op) { op.complete(); }

std::size_t FramedTransport::take_from_inbox(Connection& c, void* dst, std::size_t bytes) {
  const std::size_t n = std::min(bytes, c.inbox_end - c.inbox_begin);
  if (n > 0 && dst) std::memcpy(dst, c.inbox + c.inbox_begin, n);
  c.inbox_begin += n;
  return n;
}

void FramedTransport::on_header(Connection& c) {
  std::string error;
  if (c.recv_seal.on() &&
      le::get_u32(c.recv_header.data() + wire::header_size) != crc32c(0, c.recv_header.data(), wire::header_size)) {
    fail_connection(c, fmt::format("frame integrity: the header of frame {} from rank {} does not match its CRC-32C: it was "
                                   "corrupted on the way (WEFT_INTEGRITY={})",
                                   c.recv_seal.frames(), c.peer, to_string(c.recv_seal.mode())));
    return;
  }
  wire::HeaderBytes header_bytes{};
  std::copy_n(c.recv_header.begin(), wire::header_size, header_bytes.begin());
  auto header = wire::decode(header_bytes, error);
  if (!header) {
    fail_connection(c, fmt::format("protocol error from rank {}: {}", c.peer, error));
    return;
  }
  begin_frame(c, *header);
  if (c.recv_seal.on()) {
    c.recv_seal.begin();
    c.recv_seal.update(c.recv_header.data(), wire::header_size);
  }
  if (header->kind == wire::FrameKind::data) {
    on_data_header(c, *header);
    return;
  }
  on_control_header(c, *header);
}

// A data frame: its receive, if posted (the signature and size checked first), else an early message
// kept within the early-message bound; dropped for a failed or cancelled operation.
void FramedTransport::on_data_header(Connection& c, const wire::Header& h) {
  const ContextState* ctx = contexts_.find(h.context);
  if (drops_data(ctx, h.seq)) {
    read_payload_into(c, nullptr, h.bytes, true);
    return;
  }
  if (TransportOp* op = matcher_.take_posted(Matcher::Key{c.peer, MessageKey{h.context, h.seq, h.tag}})) {
    // The signature first: a different collective usually means a different size too, and naming
    // both calls says more than naming both sizes.
    if (const OpSignature theirs = signature_of(h); mismatched(*op, theirs)) {
      read_payload_into(c, nullptr, h.bytes, true);
      op->complete(code_of(Errc::mismatch), -1, mismatch_reason(op->key.seq, c.peer, theirs, op->signature));
      return;
    }
    if (op->bytes != h.bytes) {
      read_payload_into(c, nullptr, h.bytes, true);
      op->complete(code_of(Errc::size_mismatch), -1,
                   fmt::format("rank {} sent {} bytes, this rank expected {}", c.peer, h.bytes, op->bytes));
      return;
    }
    c.current_op = op;
    read_payload_into(c, op->recv_data, h.bytes, false);
    return;
  }
  note_early_signature(h.context, h.seq, signature_of(h), c.peer);
  if (ctx && ctx->failed) {  // the signature disagreed with this rank's call
    read_payload_into(c, nullptr, h.bytes, true);
    return;
  }
  // Bounded before anything is allocated: the length is the peer's word.
  if (!matcher_.fits(h.bytes)) {
    fail_connection(c, fmt::format("protocol error from rank {}: a message of {} bytes arrived before its receive while "
                                   "{} bytes of early messages wait; the limit is {} bytes (WEFT_MAX_EARLY_BYTES)",
                                   c.peer, h.bytes, matcher_.charged(), matcher_.limit()));
    return;
  }
  try {
    c.incoming = matcher_.take_buffer(h.bytes);
  } catch (const std::bad_alloc&) {
    fail_connection(c, fmt::format("out of memory for an early message of {} bytes from rank {}", h.bytes, c.peer));
    return;
  }
  c.incoming.charge = matcher_.charge(h.bytes);
  c.incoming.signature = signature_of(h);
  read_payload_into(c, c.incoming.data.get(), h.bytes, false);
}

// A control frame (abort, cancel, heartbeat, goodbye, query, progress).
void FramedTransport::on_control_header(Connection& c, const wire::Header& h) {
  switch (h.kind) {
    case wire::FrameKind::data:
      return;  // on_data_header's
    case wire::FrameKind::abort:
    case wire::FrameKind::cancel:
      c.scratch = std::make_unique_for_overwrite<std::byte[]>(h.bytes);
      c.scratch_size = h.bytes;
      read_payload_into(c, c.scratch.get(), h.bytes, false);
      return;
    case wire::FrameKind::heartbeat:
      read_payload_into(c, nullptr, h.bytes, true);
      return;
    case wire::FrameKind::goodbye:
    case wire::FrameKind::query:
    case wire::FrameKind::progress:
      if (h.kind != wire::FrameKind::goodbye && h.bytes != 0) {
        fail_connection(c, fmt::format("protocol error from rank {}: a {} frame with a payload of {} bytes", c.peer,
                                       h.kind == wire::FrameKind::query ? "query" : "progress", h.bytes));
        return;
      }
      if (c.recv_seal.on()) {
        read_trailer(c, AfterTrailer::header_only);
        return;
      }
      on_header_only(c);
      return;
  }
}

void FramedTransport::on_header_only(Connection& c) {
  const wire::Header h = c.current;
  if (h.kind == wire::FrameKind::goodbye) {
    peer_departed(c);
    return;
  }
  const int peer = c.peer;
  start_read_header(c);
  if (h.kind == wire::FrameKind::progress) {
    on_progress(peer, h);
    return;
  }
  wire::Header answer;
  answer.kind = wire::FrameKind::progress;
  answer.context = h.context;
  answer.seq = h.seq;
  if (any_noted_elsewhere()) take_noted_elsewhere();
  const ContextState* state = contexts_.find(h.context);
  answer.tag = state ? state->started : 0;
  // How this rank called the operation asked about: the asker compares it with its own call.
  const OpSignature mine = signature_of(h.context, h.seq);
  answer.call = mine.call;
  answer.count = mine.count;
  answer.flags = mine.plan;
  if (c.alive) send_control(c, answer);
}

void FramedTransport::read_trailer(Connection& c, AfterTrailer after) {
  c.after_trailer = after;
  const std::size_t size = c.recv_seal.trailer_size();
  const std::size_t got = take_from_inbox(c, c.recv_trailer.data(), size);
  if (got == size) {
    on_trailer(c);
    return;
  }
  c.reading = Reading::trailer;
  c.stream->read(c.recv_trailer.data() + got, size - got, size - got);
}

void FramedTransport::on_trailer(Connection& c) {
  if (!c.recv_seal.check(c.recv_trailer.data())) {
    const wire::Header& h = c.current;
    c.incoming = Matcher::Early{};  // an early message being read: not to be kept
    fail_connection(c, fmt::format("frame integrity: the {} of frame {} from rank {} (kind {}, context {}, #{}, tag {}, {} bytes) "
                                   "does not match its bytes: they were corrupted or forged on the way (WEFT_INTEGRITY={})",
                                   c.recv_seal.mode() == Integrity::hmac ? "HMAC" : "CRC-32C", c.recv_seal.frames() - 1, c.peer,
                                   static_cast<int>(h.kind), h.context, h.seq, h.tag, h.bytes, to_string(c.recv_seal.mode())));
    return;
  }
  switch (c.after_trailer) {
    case AfterTrailer::payload: on_frame(c, false); return;
    case AfterTrailer::discarded: on_frame(c, true); return;
    case AfterTrailer::header_only: on_header_only(c); return;
  }
}

void FramedTransport::read_payload_into(Connection& c, void* dst, std::size_t bytes, bool discard) {
  if (c.recv_seal.on()) {
    if (discard) {
      c.recv_seal.update(c.inbox + c.inbox_begin, std::min(bytes, c.inbox_end - c.inbox_begin));
    } else {
      c.payload_start = static_cast<const std::byte*>(dst);
      c.payload_size = bytes;
    }
  }
  const std::size_t buffered = take_from_inbox(c, discard ? nullptr : dst, bytes);
  bytes -= buffered;
  if (!discard && dst) dst = static_cast<std::byte*>(dst) + buffered;
  if (bytes == 0) {
    on_payload(c, discard);
    return;
  }
  if (discard) {
    // Read and drop in bounded chunks: a message nobody can take must not cost its size in memory.
    if (!c.scratch || c.scratch_size < std::min(bytes, discard_chunk)) {
      c.scratch = std::make_unique_for_overwrite<std::byte[]>(discard_chunk);
      c.scratch_size = discard_chunk;
    }
    const std::size_t chunk = std::min(bytes, discard_chunk);
    c.discard_chunk = chunk;
    c.reading = Reading::discard;
    c.discard_after = bytes - chunk;
    c.stream->read(c.scratch.get(), chunk, chunk);
    return;
  }
  c.reading = Reading::payload;
  c.stream->read(dst, bytes, bytes);
}

void FramedTransport::on_payload(Connection& c, bool discard) {
  if (c.recv_seal.on()) {
    if (!discard) c.recv_seal.update(c.payload_start, c.payload_size);
    read_trailer(c, discard ? AfterTrailer::discarded : AfterTrailer::payload);
    return;
  }
  on_frame(c, discard);
}

void FramedTransport::on_frame(Connection& c, bool discard) {
  const wire::Header h = c.current;
  if (discard) {
    c.current_op = nullptr;
    start_read_header(c);
    return;
  }
  if (h.kind == wire::FrameKind::cancel || h.kind == wire::FrameKind::abort) {
    // Their payload is the reason, read into scratch.
    std::string reason(reinterpret_cast<const char*>(c.scratch.get()), c.scratch_size);
    c.scratch.reset();
    c.scratch_size = 0;
    start_read_header(c);
    if (h.kind == wire::FrameKind::cancel) {
      cancel_locally(h.context, h.seq, reason);
      return;
    }
    // A relayed abort names the rank it came from (tag: that rank + 1); one that names nobody valid is
    // the sender's own.
    const int world = static_cast<int>(connections_.size());
    const bool relayed = h.tag != 0 && h.tag <= static_cast<std::uint64_t>(world) && static_cast<int>(h.tag - 1) != rank_ &&
                         static_cast<int>(h.tag - 1) != c.peer;
    const int origin = relayed ? static_cast<int>(h.tag - 1) : c.peer;
    const std::string what = relayed ? fmt::format("rank {} aborted: {} (relayed by rank {})", origin, reason, c.peer)
                                     : fmt::format("rank {} aborted: {}", origin, reason);
    auto& state = contexts_.at(h.context);
    if (!state.fail(code_of(Errc::aborted), origin, what)) return;
    // Passed on once (a context fails once), to every member but the sender and the origin: a member
    // whose connection to the origin is slow or cut (the origin left right after its abort) learns the
    // cause from this rank before it could see this rank leave, since the abort precedes the goodbye.
    send_abort(h.context, state.members, reason, origin, c.peer);
    std::vector<TransportOp*> ops;
    collect_context_ops(h.context, ops);
    complete_all(ops, h.context);
    watch_stuck_io(h.context);
    return;
  }
  if (TransportOp* op = std::exchange(c.current_op, nullptr)) {
    start_read_header(c);
    if (const ContextState* ctx = contexts_.find(op->key.context); ctx && ctx->failed) {
      op->complete(ctx->code, ctx->failed_peer, ctx->reason);
    } else {
      op->complete();
    }
    return;
  }
  // An unexpected message: a receive may have been posted while its payload was arriving.
  Matcher::Early message = std::move(c.incoming);
  start_read_header(c);
  const Matcher::Key key{c.peer, MessageKey{h.context, h.seq, h.tag}};
  if (TransportOp* op = matcher_.take_posted(key)) {
    deliver(*op, c.peer, message.data.get(), message.bytes, message.signature);
    matcher_.give_back(std::move(message));
    return;
  }
  matcher_.keep_early(key, std::move(message));
}

// ---------------------------------------------------------------- failures

void FramedTransport::fail_connection(Connection& c, const std::string& reason) {
  if (!c.alive) return;
  c.alive = false;
  c.lost_reason = fmt::format("connection to rank {} lost: {}", c.peer, reason);
  const bool pending = !c.send_queue.empty() || !c.lent.empty() || c.current_op || matcher_.any_posted();
  // A peer that leaves while nothing waits on it is a normal end of a job; one that leaves mid-operation
  // is the news every rank's log should carry.
  if (!shut_down_) {
    if (pending) {
      log().warn("rank {}: {}", rank_, c.lost_reason);
    } else {
      log().debug("rank {}: {}", rank_, c.lost_reason);
    }
  }
  std::vector<TransportOp*> ops;
  std::vector<std::uint32_t> failed_now;  // their frames in flight on other connections are watched
  close_connection(c, ops);
  // Every context the peer belongs to fails: its other members may be waiting on a rank that waits on
  // the dead one, and would otherwise hang.
  for (auto& [context, state] : contexts_) {
    if (std::find(state.members.begin(), state.members.end(), c.peer) == state.members.end()) continue;
    if (!state.fail(code_of(Errc::peer_failure), c.peer, c.lost_reason)) continue;
    failed_now.push_back(context);
    collect_context_ops(context, ops);
    // Tell the other members the root cause: if this rank stops before they notice the loss themselves,
    // they learn which rank failed rather than only that this one went away.
    send_abort(context, state.members, fmt::format("rank {} reports: {}", rank_, c.lost_reason));
  }
  for (TransportOp* op : ops) complete_cut_off(*op, c);
  for (std::uint32_t context : failed_now) watch_stuck_io(context);
}

// An operation the lost connection `c` ends. Its context's failure, when the context failed first (a
// send past its deadline, an abort: the connection was then closed because the operation's frame could
// not move), is the cause the caller needs, with the code that goes with it; otherwise the loss itself.
void FramedTransport::complete_cut_off(TransportOp& op, const Connection& c) {
  const ContextState* state = contexts_.find(op.key.context);
  if (state && state->failed && state->reason != c.lost_reason) {
    op.complete(state->code, state->failed_peer >= 0 ? state->failed_peer : c.peer, fmt::format("{} (its frame was cut off: {})", state->reason, c.lost_reason));
    return;
  }
  op.complete(code_of(Errc::peer_failure), c.peer, c.lost_reason);
}

// The peer said goodbye: it finished everything it had to send. Receives from it that are not satisfied
// by what already arrived fail, and so do sends to it; the contexts it belongs to do not fail, because
// ranks that finished their part of a collective and left are a normal end. A rank that waits on it
// fails its collective and aborts the context, which tells everybody else.
void FramedTransport::peer_departed(Connection& c) {
  if (!c.alive) return;
  c.alive = false;
  c.lost_reason = fmt::format("rank {} left the group (it closed its connection normally)", c.peer);
  log().debug("rank {}: {}", rank_, c.lost_reason);
  std::vector<TransportOp*> ops;
  close_connection(c, ops);
  for (TransportOp* op : ops) op->complete(code_of(Errc::peer_failure), c.peer, c.lost_reason);
}

// Closes `c` and takes out every operation that can no longer complete on it: queued sends (the one
// being written completes from its handler), the receive being read into (closing the socket stops the
// read) and receives posted for the peer. Messages that already arrived stay receivable.
void FramedTransport::close_connection(Connection& c, std::vector<TransportOp*>& ops) {
  c.stream->close();
  // Closed: the peer reads no lent buffer any more (Stream::close), so the lent sends may end.
  ops.insert(ops.end(), c.lent.begin(), c.lent.end());
  c.lent.clear();
  const std::size_t skip = c.writing && !c.writing_control && !c.send_queue.empty() ? 1 : 0;
  ops.insert(ops.end(), c.send_queue.begin() + static_cast<std::ptrdiff_t>(skip), c.send_queue.end());
  c.send_queue.erase(c.send_queue.begin() + static_cast<std::ptrdiff_t>(skip), c.send_queue.end());
  c.control_queue.clear();
  if (c.current_op) ops.push_back(std::exchange(c.current_op, nullptr));
  matcher_.take_posted_if([peer = c.peer](const Matcher::Key& key) { return key.peer == peer; }, ops);
}

const std::string* FramedTransport::cancellation_of(const MessageKey& key) const {
  if (key.seq == 0) return nullptr;  // point-to-point messages: cancelled one by one, not by seq
  const ContextState* state = contexts_.find(key.context);
  if (!state || state->cancelled.empty()) return nullptr;
  return state->cancellation(key.seq);
}

bool FramedTransport::operation_cancelled(std::uint32_t context, std::uint64_t seq, std::string* reason) const {
  const std::string* why = cancellation_of(MessageKey{context, seq, 0});
  if (why && reason) *reason = *why;
  return why != nullptr;
}

void FramedTransport::cancel_operation(std::uint32_t context, std::uint64_t seq, const std::string& reason) {
  ContextState* state = contexts_.find(context);
  if (!state || state->failed || state->cancellation(seq)) return;
  wire::Header h;
  h.kind = wire::FrameKind::cancel;
  h.context = context;
  h.seq = seq;
  const std::string payload = reason.substr(0, wire::max_control_payload);
  h.bytes = payload.size();
  for (int m : state->members) {
    if (m == rank_) continue;
    auto& c = connections_[static_cast<std::size_t>(m)];
    if (c && c->alive) send_control(*c, h, payload);
  }
  cancel_locally(context, seq, reason);
}

void FramedTransport::cancel_locally(std::uint32_t context, std::uint64_t seq, const std::string& reason) {
  ContextState* state = contexts_.find(context);
  if (!state || state->failed || state->cancellation(seq)) return;
  state->note_cancelled(seq, reason);
  cancelled_seqs_[cancelled_word(seq)].fetch_or(cancelled_bit(seq), std::memory_order_release);
  std::vector<TransportOp*> ops;
  matcher_.take_posted_if([&](const Matcher::Key& key) { return key.key.context == context && key.key.seq == seq; }, ops,
                          /*drop_early=*/true);
  for (auto& c : connections_) {
    if (!c) continue;
    // The send being written completes from its write handler (the receiver drops it).
    auto first = c->send_queue.begin() + (c->writing && !c->writing_control && !c->send_queue.empty() ? 1 : 0);
    for (auto it = first; it != c->send_queue.end();) {
      if ((*it)->key.context == context && (*it)->key.seq == seq) {
        ops.push_back(*it);
        it = c->send_queue.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (TransportOp* op : ops) op->complete(code_of(Errc::cancelled), -1, reason);
}

std::string_view FramedTransport::backend_to(int peer) const {
  if (peer == rank_) return "self";
  const auto& c = connections_[static_cast<std::size_t>(peer)];
  if (!c || !c->stream) return name();
  const std::string_view backend = c->stream->backend();
  return backend;
}

bool FramedTransport::connected(int peer) const {
  if (peer == rank_) return true;
  const auto& c = connections_[static_cast<std::size_t>(peer)];
  return c && c->alive;
}

void FramedTransport::disconnect(int peer, const std::string& reason) {
  if (peer == rank_) return;
  auto& c = connections_[static_cast<std::size_t>(peer)];
  if (c && c->alive) fail_connection(*c, reason);
}

void FramedTransport::send_control(Connection& c, const wire::Header& h, std::string payload) {
  c.control_queue.emplace_back(h, std::move(payload));
  if (!c.writing) start_write(c);
}

void FramedTransport::send_abort(std::uint32_t context, const std::vector<int>& members, const std::string& reason, int origin,
                                 int skip) {
  wire::Header h;
  h.kind = wire::FrameKind::abort;
  h.context = context;
  h.tag = origin < 0 ? 0 : static_cast<std::uint64_t>(origin) + 1;
  std::string payload = reason.substr(0, wire::max_control_payload);
  h.bytes = payload.size();
  for (int m : members) {
    if (m == rank_ || m == skip || m == origin) continue;
    auto& c = connections_[static_cast<std::size_t>(m)];
    if (!c || !c->alive) continue;
    send_control(*c, h, payload);
  }
}

void FramedTransport::ask_progress(std::uint32_t context, std::uint64_t seq, std::chrono::milliseconds patience,
                                std::function<void(std::vector<Progress>)> done) {
  if (any_noted_elsewhere()) take_noted_elsewhere();  // signature_of reads them after
  auto query = std::make_shared<Query>();
  query->context = context;
  query->seq = seq;
  query->done = std::move(done);
  wire::Header ask;
  ask.kind = wire::FrameKind::query;
  ask.context = context;
  ask.seq = seq;
  const ContextState* state = contexts_.find(context);
  for (int m : state ? state->members : std::vector<int>{}) {
    if (m == rank_) continue;
    query->answers.push_back(Progress{m, false, 0});
    auto& c = connections_[static_cast<std::size_t>(m)];
    if (!c || !c->alive) continue;  // a lost connection cannot answer
    ++query->awaiting;
    send_control(*c, ask);
  }
  queries_.push_back(query);
  // Answered or not, the asker hears back within `patience`; a query nobody can answer ends at once
  // (posted, so that `done` never runs inside the caller).
  const auto wait = query->awaiting == 0 ? std::chrono::milliseconds(0) : patience;
  loop_.call_after(wait, [this, alive = std::weak_ptr<bool>(alive_), query](bool) {
    if (alive.lock()) finish_query(query);
  });
}

void FramedTransport::on_progress(int peer, const wire::Header& h) {
  for (const auto& query : queries_) {
    if (query->context != h.context || query->seq != h.seq) continue;
    for (auto& answer : query->answers) {
      if (answer.rank != peer || answer.answered) continue;
      answer.answered = true;
      answer.started = h.tag;
      answer.signature = signature_of(h);
      if (--query->awaiting == 0) finish_query(query);
      return;
    }
  }
}

OpSignature FramedTransport::signature_of(std::uint32_t context, std::uint64_t seq) const {
  const ContextState* state = contexts_.find(context);
  if (!state) return {};
  const auto* seen = state->local.find(seq);
  return seen ? seen->signature : OpSignature{};
}

void FramedTransport::finish_query(const std::shared_ptr<Query>& query) {
  auto it = std::find(queries_.begin(), queries_.end(), query);
  if (it == queries_.end()) return;  // finished already
  queries_.erase(it);
  query->done(query->answers);
}

bool FramedTransport::control_pending() const noexcept {
  for (const auto& c : connections_) {
    // A control frame queued behind a data frame goes out once that frame is written (start_write
    // takes control frames first); a connection that cannot write any more has nothing pending.
    if (c && c->alive && !c->write_failed && (!c->control_queue.empty() || (c->writing && c->writing_control))) return true;
  }
  return false;
}

void FramedTransport::shutdown() {
  if (shut_down_) return;
  // The groups whose close_context did not run first (the last group's transport is deleted as it goes,
  // before the close it posted): their leftovers, unless an operation still waits (its group is gone,
  // and its messages are its own).
  if (!matcher_.any_posted()) {
    for (const auto& entry : contexts_) report_unreceived(entry.first);
  }
  shut_down_ = true;
  // A pending liveness timer would keep a borrowed io_context running after the Group is gone.
  if (liveness_timer_) loop_.cancel_timer(std::exchange(liveness_timer_, 0));
  std::vector<TransportOp*> ops;
  for (auto& c : connections_) {
    if (!c) continue;
    if (c->alive && !c->writing) {
      // Say goodbye, so that the peer can tell a normal end from a crash. 48 bytes fit in any socket
      // buffer; a blocking write is fine here.
      wire::Header bye;
      bye.kind = wire::FrameKind::goodbye;
      std::array<std::byte, wire::header_size + header_check_size + FrameSeal::max_trailer> bytes{};
      wire::HeaderBytes header{};
      wire::encode(bye, header);
      std::copy(header.begin(), header.end(), bytes.begin());
      std::size_t size = wire::header_size;
      if (c->send_seal.on()) {
        le::put_u32(bytes.data() + size, crc32c(0, header.data(), header.size()));
        size += header_check_size;
        c->send_seal.begin();
        c->send_seal.update(header.data(), header.size());
        c->send_seal.seal(bytes.data() + size);
        size += c->send_seal.trailer_size();
      }
      c->stream->write_blocking(bytes.data(), size);
      c->stream->shutdown_send();
    }
    c->alive = false;
    c->lost_reason = "the transport was shut down";
    c->stream->close();
    ops.insert(ops.end(), c->lent.begin(), c->lent.end());
    c->lent.clear();
    ops.insert(ops.end(), c->send_queue.begin(), c->send_queue.end());
    c->send_queue.clear();
    if (c->current_op) ops.push_back(std::exchange(c->current_op, nullptr));
  }
  std::size_t stranded = 0;
  std::size_t stranded_bytes = 0;
  matcher_.take_posted_if([](const Matcher::Key&) { return true; }, ops);
  for (const auto& [key, box] : matcher_.mailboxes()) {
    for (const auto& message : box.early) {
      ++stranded;
      stranded_bytes += message.bytes;
      log().debug("rank {}: a message from rank {} (context {}, #{}, tag {}, {} bytes) was never received", rank_, key.peer,
                  key.key.context, key.key.seq, key.key.tag, message.bytes);
    }
  }
  if (stranded) log().info("rank {}: {} messages ({} bytes) arrived that no receive took", rank_, stranded, stranded_bytes);
  matcher_.clear();
  for (TransportOp* op : ops) {
    if (!op->done()) op->complete(code_of(Errc::group_failed), -1, "the transport was shut down");
  }
}

}  // namespace weft
