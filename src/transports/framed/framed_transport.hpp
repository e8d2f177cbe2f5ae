#pragma once
// The framed transport: one connection per peer pair, framed messages (wire.hpp), tag matching and early
// messages (matcher.hpp), contexts with their failures, cancels and signatures (contexts.hpp), sealed
// frames (integrity.hpp). It moves
// its bytes through a Stream (stream.hpp): Asio's reactor (transports/asio) or io_uring
// (transports/uring); transports/select.hpp picks one.
#include <array>
#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include <asio.hpp>

#include "core/signature.hpp"
#include "transports/framed/contexts.hpp"
#include "transports/framed/integrity.hpp"
#include "transports/framed/matcher.hpp"
#include "transports/framed/stream.hpp"
#include "transports/framed/wire.hpp"
#include "weft/loop.hpp"
#include "weft/transport.hpp"

namespace weft {

class FramedTransport final : public Transport, private StreamEvents {
 public:
  /// `sockets[peer]` is the connected, handshaken socket to each peer (sockets[rank] is unused). Their
  /// bytes move through the streams made by `make_stream(socket, events, peer, alive)` for each peer
  /// (make_asio_stream, or the io_uring backend's); `backend` names it.
  using StreamFactory = std::function<std::shared_ptr<Stream>(asio::ip::tcp::socket, StreamEvents*, int, std::weak_ptr<bool>)>;
  FramedTransport(Loop& loop, int rank, int size, std::vector<asio::ip::tcp::socket> sockets, std::string_view backend,
               const StreamFactory& make_stream);
  ~FramedTransport() override;

  std::string_view name() const noexcept override { return backend_; }
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override { return size_; }

  void start_send(int peer, const MessageKey& key, const void* data, std::size_t bytes, TransportOp& op) override;
  bool send_now(int peer, const MessageKey& key, const void* data, std::size_t bytes, const OpSignature& signature = {}) override;
  bool can_send_now(int peer, std::size_t bytes) const override;
  bool recv_now(int peer, const MessageKey& key, void* data, std::size_t bytes, const OpSignature& signature = {}) override;
  void start_recv(int peer, const MessageKey& key, void* data, std::size_t bytes, TransportOp& op) override;
  bool cancel_recv(TransportOp& op) override;

  void open_context(std::uint32_t context, std::vector<int> members) override;
  void close_context(std::uint32_t context) override;
  void abort_context(std::uint32_t context, Errc code, const std::string& reason) override;
  void cancel_operation(std::uint32_t context, std::uint64_t seq, const std::string& reason) override;
  bool context_failed(std::uint32_t context, std::error_code* code, std::string* reason) const override;
  std::vector<int> waiting_on(std::uint32_t context, std::uint64_t seq) const override;
  bool connected(int peer) const override;
  void disconnect(int peer, const std::string& reason) override;
  void ask_progress(std::uint32_t context, std::uint64_t seq, std::chrono::milliseconds patience,
                    std::function<void(std::vector<Progress>)> done) override;
  OpSignature signature_of(std::uint32_t context, std::uint64_t seq) const override;
  std::string_view backend_to(int peer) const override;
  void note_started(std::uint32_t context, std::uint64_t seq, const OpSignature& signature) override;
  bool context_may_have_failed(std::uint32_t context) const noexcept override { return contexts_.may_have_failed(context); }
  bool operation_cancelled(std::uint32_t context, std::uint64_t seq, std::string* reason) const override;
  bool maybe_cancelled(std::uint64_t seq) const noexcept override {
    return (cancelled_seqs_[cancelled_word(seq)].load(std::memory_order_acquire) & cancelled_bit(seq)) != 0;
  }

  bool control_pending() const noexcept override;
  void shutdown() override;

  /// At most this many bytes of messages that arrive before their receive are kept, all peers together
  /// (Options::max_early_bytes). A frame that would go beyond fails its connection with a protocol error
  /// naming the sizes: a forged or runaway length must not drive an allocation. Default 4 GiB here; Group
  /// sets Options::max_early_bytes (default half the physical memory).
  void set_early_limit(std::size_t bytes) noexcept { matcher_.set_limit(bytes); }

  /// Frame integrity (Options::integrity): from now on every frame written ends with a trailer and every
  /// frame read must end with a matching one (integrity.hpp), else its connection fails, naming the peer
  /// and the frame. `keys[peer]` key the MACs (Integrity::hmac). Call right after construction, on the
  /// loop's thread, before any frame moves; every rank of the job must do the same.
  void seal_frames(Integrity mode, const std::vector<FrameKeys>& keys);

  /// Socket options every weft connection gets (TCP_NODELAY, large buffers).
  static void tune_socket(asio::ip::tcp::socket& socket);
  /// Heartbeats (Options::heartbeat): the kernel probes an idle connection's peer after `interval` of
  /// silence, every `interval`, and fails the connection after heartbeat_probes unanswered probes. The
  /// kernel answers probes, so a rank busy outside weft (or stopped) still answers: its lateness is the
  /// deadlines' to catch; these catch a host that is down or a network that is cut. 0: off.
  static constexpr int heartbeat_probes = 3;
  static void set_heartbeat(asio::ip::tcp::socket& socket, std::chrono::milliseconds interval);
  /// Liveness of busy connections, every `interval` (0: off): a connection whose sent data has gone
  /// unacknowledged for (heartbeat_probes + 1) intervals, or whose window probes went unanswered
  /// heartbeat_probes times, has lost its peer's host, and fails. A peer that is alive but not reading
  /// (a zero window) acknowledges the probes and is never failed: TCP_USER_TIMEOUT, used before, also
  /// ended such connections (a rank busy for 20 s lost its peers; docs/RELIABILITY.md).
  void watch_liveness(std::chrono::milliseconds interval);

  /// How many sends send_now finished by copying the part of their frame a full socket buffer did not
  /// take (diagnostics; the test of that path counts them). Any thread.
  std::uint64_t sends_partly_kept() const noexcept { return sends_partly_kept_.load(std::memory_order_relaxed); }

 private:
  enum class Reading : std::uint8_t { header, payload, discard, trailer };
  // What a frame's trailer, once checked, lets go on (seal_frames).
  enum class AfterTrailer : std::uint8_t { payload, discarded, header_only };
  // The largest message send_now writes to a socket: what the socket does not take is copied, and a
  // copy of a few KiB costs less than the operation it spares, one of megabytes does not.
  static constexpr std::size_t send_now_socket_most = 64 * 1024;
  struct Connection {
    int peer = -1;
    std::shared_ptr<Stream> stream;
    bool alive = true;
    std::string lost_reason;
    // Writer: one write at a time, the rest queued in order.
    std::deque<TransportOp*> send_queue;
    std::deque<TransportOp*> lent;  // sends written whose buffers the peer still reads (StreamEvents::on_lent)
    std::deque<std::pair<wire::Header, std::string>> control_queue;  // abort frames, sent before data
    bool writing = false;
    bool write_failed = false;  // a write failed: the connection fails shortly (on_write_done)
    bool writing_control = false;  // the write in flight is a control frame, not send_queue.front()
    bool writing_kept = false;     // ... or the rest of a data frame send_now copied (of kept_context)
    std::uint32_t kept_context = 0;
    std::array<std::byte, wire::header_size + 4> send_header{};  // the header, then its check (sealed frames)
    std::string control_payload;
    // Reader. Headers are read through a read-ahead buffer, so that one recv usually brings a header
    // with its payload, and often the frames after it; payloads beyond what it holds are read straight
    // into their destination. Its size is where a second system call starts to cost more than copying
    // the payload out: a loopback recv costs about as much as copying 16-32 KiB, and with 4 KiB an
    // 8 KiB all_reduce took two recvs per message where Open MPI takes one (bench/RESULTS.md, "The
    // read-ahead buffer"). The slack past 16 KiB lets a 16 KiB message come with its header.
    static constexpr std::size_t inbox_size = 16 * 1024 + 256;
    // How much a header read may take: the stream's limit (Stream::read_ahead_limit), and after a frame
    // too big for the inbox only 4 KiB, since a run of big frames would otherwise copy up to 16 KiB of
    // each next payload through the inbox for no system call saved (32-64 KiB all_reduce 1-3 % slower).
    static constexpr std::size_t read_ahead_after_big = 4096;
    std::size_t read_ahead_most = inbox_size;  // min(inbox_size, the stream's limit)
    std::size_t read_ahead = inbox_size;
    std::byte* inbox = nullptr;           // the stream's staging memory, or own_inbox
    std::unique_ptr<std::byte[]> own_inbox;
    std::size_t inbox_begin = 0;
    std::size_t inbox_end = 0;
    Reading reading = Reading::header;  // what the read in flight is for
    bool handling = false;        // handle_frames is below on the stack
    bool header_waiting = false;  // a header taken whole from the inbox, for handle_frames's next round
    std::size_t discard_after = 0;      // Reading::discard: bytes still to drop after this chunk
    std::array<std::byte, wire::header_size + 4> recv_header{};
    wire::Header current{};
    TransportOp* current_op = nullptr;  // the receive the payload is read into, if any
    std::unique_ptr<std::byte[]> scratch;  // control payloads and discarded bytes
    std::size_t scratch_size = 0;
    Matcher::Early incoming;               // an early message being read
    // Integrity (seal_frames): the trailer of every frame, sealed when written, checked when read.
    FrameSeal send_seal;
    FrameSeal recv_seal;
    std::array<std::byte, FrameSeal::max_trailer> send_trailer{};
    std::array<std::byte, FrameSeal::max_trailer> recv_trailer{};
    const std::byte* payload_start = nullptr;  // the payload being read (not discarded), for recv_seal
    std::size_t payload_size = 0;
    std::size_t discard_chunk = 0;  // Reading::discard: the bytes of the chunk being read into scratch
    AfterTrailer after_trailer = AfterTrailer::payload;
  };
  // Fails operation (context, seq) here: its posted receives, queued sends and kept early messages.
  void cancel_locally(std::uint32_t context, std::uint64_t seq, const std::string& reason);
  // The cancellation of the operation `key` belongs to, if any (cheap when nothing was cancelled).
  const std::string* cancellation_of(const MessageKey& key) const;
  // Progress queries this rank asked and waits on (ask_progress).
  struct Query {
    std::uint32_t context = 0;
    std::uint64_t seq = 0;
    std::vector<Progress> answers;
    int awaiting = 0;
    std::function<void(std::vector<Progress>)> done;
  };
  std::vector<std::shared_ptr<Query>> queries_;
  void on_progress(int peer, const wire::Header& h);
  void finish_query(const std::shared_ptr<Query>& query);
  void send_control(Connection& c, const wire::Header& h, std::string payload = {});
  // Records a signature of `context` (this rank's own operation, or a message from `peer` that came
  // early) and aborts the context with Errc::mismatch when the other side disagrees for the same seq.
  // Not a point-to-point message's: those are no operation of the context's sequence (they all have seq
  // 0, and messages of several dtypes may be in flight); only their receive compares them.
  void note_local_signature(std::uint32_t context, std::uint64_t seq, const OpSignature& signature) {
    if (any_noted_elsewhere()) take_noted_elsewhere();
    // Once per operation: its later messages return here.
    if (!noted_per_seq(signature) || contexts_.noted_last(context, seq)) return;
    note_new_local_signature(context, seq, signature);
  }
  void note_new_local_signature(std::uint32_t context, std::uint64_t seq, const OpSignature& signature);
  // Whether the context's rings keep `signature` (note_local_signature's rule, for every way in): a
  // collective's, not a point-to-point message's nor an unsigned frame's.
  static bool noted_per_seq(const OpSignature& signature) noexcept {
    return signature.call != 0 && !signature::is_point_to_point(signature);
  }
  void note_early_signature(std::uint32_t context, std::uint64_t seq, const OpSignature& signature, int peer);

  void complete_cut_off(TransportOp& op, const Connection& c);
  void on_written(int peer, const std::error_code& ec) override;
  void on_lent(int peer) override;
  void on_released(int peer, std::size_t writes) override;
  void on_read(int peer, const std::error_code& ec, std::size_t bytes) override;
  TransportOp* take_frame(int peer, const std::byte* data, std::size_t size) override;
  TransportOp* take_data_frame(int peer, const wire::Header& header, const std::byte* payload) override;
  // A connection between frames, nothing read ahead, its read posted for the next header, frames not
  // sealed: where a stream's whole frame may be taken as it stands (take_data_frame, recv_from_stream_now).
  static bool between_frames(const Connection& c) noexcept {
    return c.alive && c.reading == Reading::header && !c.handling && !c.header_waiting && c.inbox_begin == c.inbox_end && !c.recv_seal.on();
  }
  // A data frame such a connection may take whole: one that the inbox could have held.
  static bool takes_whole(const wire::Header& h) noexcept {
    return h.kind == wire::FrameKind::data && h.bytes <= Connection::inbox_size - wire::header_size;
  }
  struct DirectReceive;
  bool recv_from_stream_now(const Matcher::Key& where, void* data, std::size_t bytes, const OpSignature& signature);
  static std::size_t take_direct(void* context, const Stream::OfferedFrame* frames, std::size_t n);
  void complete_taken(int peer, TransportOp& op) override;
  // Writes the connection's next frame. `starting`: the send start_send just queued, completed at once
  // when its frame is the only one and the stream takes it whole (Stream::write_now).
  void start_write(Connection& c, TransportOp* starting = nullptr);
  void on_write_done(Connection& c, const std::error_code& ec);
  void start_read_header(Connection& c);
  // Runs `step` (what a read event brought: a header, a payload, a trailer), then, in a loop, the frames
  // whose headers the inbox already held (start_read_header leaves them here, Connection::header_waiting,
  // instead of a post per frame), up to frames_per_turn; the rest through the loop's queue.
  enum class FrameStep { header, payload, trailer };
  void handle_frames(Connection& c, FrameStep step);
  // handle_frames from the loop's queue, for a header already taken from the inbox.
  void post_frames(Connection& c);
  static constexpr int frames_per_turn = 64;
  // Moves up to `bytes` already-read bytes from the inbox to `dst` (null: drops them); returns how many.
  std::size_t take_from_inbox(Connection& c, void* dst, std::size_t bytes);
  // A header was read whole: checked (its CRC with sealed frames), decoded, and handed to one of:
  void on_header(Connection& c);
  // The frame whose header `h` is now the connection's (on_header, take_frame).
  static void begin_frame(Connection& c, const wire::Header& h) noexcept {
    c.current = h;
    c.read_ahead = h.bytes > Connection::inbox_size ? std::min(Connection::read_ahead_after_big, c.read_ahead_most) : c.read_ahead_most;
  }
  // Whether a data frame of operation `seq` in `ctx` is read only to be dropped: its context failed, or
  // the operation was cancelled (on_data_header discards it; take_frame leaves it to that).
  static bool drops_data(const ContextState* ctx, std::uint64_t seq) {
    return ctx && (ctx->failed || (!ctx->cancelled.empty() && ctx->cancellation(seq)));
  }
  void on_data_header(Connection& c, const wire::Header& header);
  void on_control_header(Connection& c, const wire::Header& header);
  void read_payload_into(Connection& c, void* dst, std::size_t bytes, bool discard);
  void on_payload(Connection& c, bool discard);
  // Sealed frames (seal_frames): the header is followed by a CRC-32C of it, checked before the header is
  // acted on; the trailer after the payload covers header and payload.
  static constexpr std::size_t header_check_size = 4;
  Integrity integrity_ = Integrity::off;
  std::size_t header_bytes() const noexcept { return wire::header_size + (integrity_ != Integrity::off ? header_check_size : 0); }
  static void encode_header(const wire::Header& h, Connection& c);
  // The frame was read whole (and its trailer checked, when frames are sealed): act on it.
  void on_frame(Connection& c, bool discarded);
  // Frames without a payload (goodbye, query, progress), once their trailer is checked.
  void on_header_only(Connection& c);
  void read_trailer(Connection& c, AfterTrailer after);
  void on_trailer(Connection& c);
  void deliver_local(const MessageKey& key, const void* data, std::size_t bytes, const OpSignature& signature);
  // Completes `op` with `bytes` bytes from rank `from`: copied when the sizes agree, else failed with
  // size_mismatch (nothing is truncated).
  void deliver(TransportOp& op, int from, const void* data, std::size_t bytes, const OpSignature& signature);
  // Whether a message of `theirs` cannot complete `op` (both calls known, and different).
  static bool mismatched(const TransportOp& op, const OpSignature& theirs) noexcept { return disagree(op.signature, theirs); }
  static bool disagree(const OpSignature& mine, const OpSignature& theirs) noexcept {
    return mine.call != 0 && theirs.call != 0 && !(mine == theirs);
  }
  // The signature a data frame's header carries (its operation's).
  static OpSignature signature_of(const wire::Header& h) noexcept { return OpSignature{.call = h.call, .plan = h.flags, .count = h.count}; }
  // Whether data frame `h` completes a receive of `bytes` called as `mine` without an error: the size
  // asked for, a signature that agrees (take_data_frame, take_direct).
  static bool completes(const OpSignature& mine, std::size_t bytes, const wire::Header& h) noexcept {
    return h.bytes == bytes && !disagree(mine, signature_of(h));
  }
  // The error text: both calls of operation `seq`, named (`from` called `theirs`, this rank `mine`).
  std::string mismatch_reason(std::uint64_t seq, int from, const OpSignature& theirs, const OpSignature& mine) const;
  void fail_connection(Connection& c, const std::string& reason);
  void peer_departed(Connection& c);
  void close_connection(Connection& c, std::vector<TransportOp*>& ops);
  /// Tells every member of `context` but this rank (and `skip`) that it failed. `origin`: the rank whose
  /// failure it is, where this rank relays another's abort (-1: this rank's own).
  void send_abort(std::uint32_t context, const std::vector<int>& members, const std::string& reason, int origin = -1,
                  int skip = -1);
  void collect_context_ops(std::uint32_t context, std::vector<TransportOp*>& out);
  void complete_all(const std::vector<TransportOp*>& ops, std::uint32_t context);
  bool context_usable(std::uint32_t context, TransportOp& op);
  // Logs the messages of a closing group that no receive took (close_context, shutdown).
  void report_unreceived(std::uint32_t context) const;

  // Operations started on another thread (the group arena's fast path, which runs on the caller's):
  // kept here, the latest 64, and noted on the loop before anything reads the contexts' records (a
  // progress query's answer, this rank's own signatures). Callers push, the loop takes, without a lock:
  // a push claims a slot (`noted_elsewhere_pushed_`), writes it, and stamps it with its number + 1; the
  // loop takes the slots in order up to the first not stamped yet (it looks again next time), and skips
  // one written over by a push 64 later (older ones only answer older queries). Every word is atomic, so
  // a slot read while it is written over is only seen torn by its stamp, and skipped.
  struct NotedElsewhere {
    std::atomic<std::uint64_t> stamp{0};  // the push's number + 1 once written; 0 while it is
    std::atomic<std::uint64_t> seq{0};
    std::atomic<std::uint64_t> count{0};
    std::atomic<std::uint32_t> context{0};
    std::atomic<std::uint32_t> call{0};
    std::atomic<std::uint8_t> plan{0};
  };
  std::array<NotedElsewhere, 64> noted_elsewhere_{};
  std::atomic<std::uint64_t> noted_elsewhere_pushed_{0};
  std::uint64_t noted_elsewhere_taken_ = 0;  // loop thread
  bool any_noted_elsewhere() const noexcept { return noted_elsewhere_pushed_.load(std::memory_order_relaxed) != noted_elsewhere_taken_; }
  // The seqs of operations cancelled so far, as bits (seq modulo 1024, any context): written on the
  // loop, read by maybe_cancelled on any thread. A bit set by another seq only sends a collective the
  // slower way.
  std::array<std::atomic<std::uint64_t>, 16> cancelled_seqs_{};
  static std::size_t cancelled_word(std::uint64_t seq) noexcept { return seq / 64 % std::tuple_size_v<decltype(cancelled_seqs_)>; }
  static std::uint64_t cancelled_bit(std::uint64_t seq) noexcept { return std::uint64_t{1} << (seq % 64); }
  void take_noted_elsewhere();

  Loop& loop_;
  std::string backend_;
  int rank_;
  int size_;
  Matcher matcher_;  // before connections_: a connection's early message in flight is charged to it
  // shared_ptr: every pending Asio handler holds its connection, so that a socket outlives the handlers
  // (and composed reads) still queued for it when the transport goes away.
  std::vector<std::shared_ptr<Connection>> connections_;
  ContextTable contexts_;
  bool shut_down_ = false;
  std::atomic<std::uint64_t> sends_partly_kept_{0};
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // handlers check it after we are gone
  // After a context fails, its I/O that is in the middle of a frame (the write in flight, the payload
  // being read) cannot be withdrawn without breaking the framing, and would complete only when its peer
  // moves again: a stopped peer held the operation (and the deadline) for as long as it stayed stopped.
  // watch_stuck_io looks (at once, then every quarter grace): a connection on which that I/O moved no
  // byte for stuck_grace is closed (fail_connection), its operations failing now. The kernel counts
  // from the last byte, long before the failure for a stopped peer, so the grace does not delay that
  // case; it is how long a live peer, busy elsewhere, may pause mid-frame without losing the connection.
  static constexpr std::chrono::milliseconds stuck_grace{1000};
  void watch_stuck_io(std::uint32_t context, bool at_once = true);
  void check_stuck_io(std::uint32_t context);
  bool carries_frame_of(const Connection& c, std::uint32_t context) const;
  Connection* idle_for_send_now(int peer, std::size_t bytes) const noexcept;
  // watch_liveness: the check's interval and its pending timer (0: none).
  std::chrono::milliseconds liveness_interval_{0};
  std::uint64_t liveness_timer_ = 0;
  void arm_liveness_check();
  void check_liveness();
};

}  // namespace weft
