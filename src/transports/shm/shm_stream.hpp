#pragma once
// The shared-memory backend of Stream, for a peer on the same host. Bytes go through two rings
// (ring.hpp): the inbound one in a segment this rank made, the outbound one in the peer's. A unix-domain
// socket stays open beside them for the group's life: the kernel closes it on any death of the peer
// (SIGKILL included), and that end is how a dead peer is noticed, as a TCP close is.
//
// ShmHub is the context (one per transport): the eventfd this rank is woken through, and the loop's
// memory poller (Loop::Poller) that moves every stream's reads and writes while the loop spins, so that
// an awake rank sends and receives without a system call. A stream whose peer's loop sleeps writes the
// peer's eventfd (ring.hpp says why no wake-up is lost).
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <string_view>
#include <system_error>
#include <vector>

#include "core/coarse_clock.hpp"
#include "transports/framed/stream.hpp"
#include "transports/framed/wire.hpp"
#include "transports/shm/ring.hpp"
#include "transports/shm/segment.hpp"
#include "weft/loop.hpp"

namespace weft {

class ShmStream;

class ShmHub : public std::enable_shared_from_this<ShmHub> {
 public:
  /// An eventfd watched by `loop` and a poller registered with it. Throws std::system_error.
  static std::shared_ptr<ShmHub> create(Loop& loop);
  ~ShmHub();
  ShmHub(const ShmHub&) = delete;
  ShmHub& operator=(const ShmHub&) = delete;

  Loop& loop() noexcept { return loop_; }
  /// False once the loop has ended (Loop::alive_word): what goes then leaves it alone.
  bool loop_lives() const noexcept { return loop_alive_->load(std::memory_order_acquire); }
  /// The descriptor peers write to wake this rank (sent to them at connect time).
  int wake_fd() const noexcept { return event_fd_; }

  void attach(const std::shared_ptr<ShmStream>& stream);
  // The poller's three calls (Loop::Poller), on the loop's thread.
  std::size_t poll();
  bool arm();
  void disarm();

 private:
  explicit ShmHub(Loop& loop) : loop_(loop), loop_alive_(loop.alive_word()) {}
  Loop& loop_;
  const std::atomic<bool>* loop_alive_;  // a handler of a borrowed io_context may free the hub after the Loop
  int event_fd_ = -1;
  std::uint64_t watch_ = 0;
  std::uint64_t poller_ = 0;
  std::vector<std::weak_ptr<ShmStream>> streams_;
};

class ShmStream final : public Stream, public std::enable_shared_from_this<ShmStream> {
 public:
  /// What connecting to a local peer produced (rendezvous with it over the unix socket).
  struct Link {
    shm::Segment inbound;   // this rank's: the peer writes, this rank reads
    shm::Segment outbound;  // the peer's: this rank writes
    int peer_wake_fd = -1;  // the peer's eventfd (owned)
    int socket = -1;        // the connected unix socket (owned)
    // Single copy (ring.hpp's reference records): writes of at least `single_copy_from` bytes go to the
    // peer as references when it can read this process's memory (0: never); reference records from the
    // peer are read from process `peer_pid` (0: this rank cannot read the peer's memory, and a reference
    // record from it is a protocol error).
    std::size_t single_copy_from = 0;
    int peer_pid = 0;
  };
  /// Use make(): the stream attaches to the hub and watches its socket once it is shared.
  static std::shared_ptr<ShmStream> make(std::shared_ptr<ShmHub> hub, Link link, StreamEvents* events, int peer,
                                         std::weak_ptr<bool> alive);
  ShmStream(std::shared_ptr<ShmHub> hub, Link link, StreamEvents* events, int peer, std::weak_ptr<bool> alive);
  ~ShmStream() override;

  /// "shm", or "shm+cma" where large writes to the peer go by single copy (the peer reads them).
  std::string_view backend() const noexcept override { return link_.single_copy_from ? "shm+cma" : "shm"; }
  int native_handle() const noexcept override { return socket_; }
  void write(ConstBytes first, ConstBytes second, ConstBytes third) override;
  bool write_now(ConstBytes first, ConstBytes second, ConstBytes third) override;
  /// With room in the ring for one inline record of all three (no single-copy piece, no write in flight).
  bool write_whole_now(ConstBytes first, ConstBytes second, ConstBytes third) override;
  /// A data frame whose header has a short form (wire.hpp) and whose payload is under
  /// shm::align_records_from goes as one frame record (ring.hpp); any other as write_whole_now.
  bool write_frame_now(const wire::Header& header, ConstBytes payload) override;
  bool writes_whole_now() const noexcept override { return true; }
  bool takes_whole_now(std::size_t first, std::size_t second) const noexcept override;
  void read(void* dst, std::size_t min, std::size_t cap) override;
  std::size_t take_next_data_frames(TakeDataFrames take, void* context, std::size_t most) override;
  /// 4 KiB: a read is a copy out of the ring, so reading ahead saves no system call.
  std::size_t read_ahead_limit() const override { return 4096; }
  void write_blocking(const void* data, std::size_t size) override;
  void shutdown_send() override;
  void close() override;
  /// Since the ring last moved bytes in that direction (this stream's own clock: no TCP_INFO here).
  std::optional<std::uint32_t> ms_since_data(bool received) const override;

  // The hub's calls, on the loop's thread: move the read and the write as far as the rings allow and
  // report what finished; returns how many events it found.
  std::size_t progress();
  bool arm();
  void disarm();

 private:
  void start();
  void post_progress();
  void wake_peer();
  void on_socket_readable();
  bool push_write();  // true when the write in flight is all in the ring
  bool push_some();   // moves what fits now; true when every piece is in the ring
  std::size_t take_released();  // lent writes whose references the receiver has read all of
  // A piece of this many bytes goes by reference where the peer can read it (single copy on, and large
  // enough); by_reference also asks the write in flight.
  bool reference_sized(std::size_t bytes) const noexcept;
  inline bool record_fits_now(std::size_t length) const noexcept;  // (takes_whole_now's and write_frame_now's; shm_stream.cpp)
  bool by_reference(const ConstBytes& piece) const noexcept;
  // The lead (0 to 63) that places alike the inline record about to start at the writer's position, holding
  // pieces[piece] from `offset` and the inline pieces after it: when one of them has at least
  // shm::align_records_from bytes and `room` holds the record's header, the lead and that many of its
  // bytes; else 0.
  std::size_t lead_for(const ConstBytes* pieces, int piece, std::size_t offset, std::size_t room) const noexcept;
  // An inline or frame record's spare bytes and length fit this rank's ring, and a frame record holds its short
  // header (a hostile or broken writer's may not).
  bool fits(const shm::RecordHeader& h) const noexcept;
  // A frame record's short header (the record's first bytes; the record `offset` bytes past the reader's
  // position), decoded; empty when it is malformed.
  std::optional<wire::Header> peek_short_header(const shm::RecordHeader& h, std::size_t offset = 0) const noexcept;
  // Its bytes, copied out of the ring.
  void copy_short_header(std::size_t offset, wire::ShortHeaderBytes& bytes) const noexcept;
  // A record being read is not done: bytes of it, or of the header a frame record stands for, are left.
  bool in_record() const noexcept { return record_.left != 0 || record_.expanded_left != 0; }
  // Whole records the transport takes as frames for its posted receives (StreamEvents::take_frame), up
  // to frames_taken_most, while the read in flight has nothing yet; returns how many. `ended`: a
  // completion closed this stream or ended the transport, and nothing more may be done here. After a
  // frame it looks for the next record only while such looks find one (looks_ahead_); else it stops
  // there (held_back_) and the next turn looks (once the peer's socket closed, progress looks at once).
  std::size_t take_whole_frames(bool& ended);
  const std::byte* whole_record(std::uint64_t word, shm::RecordHeader& h, std::size_t offset = 0) const noexcept;
  static constexpr std::size_t frames_taken_most = 64;
  bool pull_read();   // true when the read in flight has its minimum; read_error_ when it failed
  void read_referenced(std::size_t limit);  // from the current reference record into the read (read_error_ on failure)
  bool peer_still_there() const noexcept;

  std::shared_ptr<ShmHub> hub_;
  Link link_;
  shm::RingReader in_;
  shm::RingWriter out_;
  StreamEvents* events_;
  int peer_;
  std::weak_ptr<bool> alive_;
  int socket_ = -1;
  std::uint64_t socket_watch_ = 0;
  bool closed_ = false;
  bool peer_closed_ = false;  // the socket ended: the peer is gone (or shut its side down)
  bool progress_posted_ = false;
  // The loop is spinning (disarmed after its last sleep): its pollers will look again soon, so nothing
  // needs announcing. False until the first disarm, so that a loop weft never arms (a borrowed
  // io_context) always has its peers wake it.
  bool awake_ = false;
  // For ms_since_data (the stuck check counts in seconds, for frames in flight): the coarse clock, read
  // when a write in flight begins and moves, and when a read moves; frames written or taken whole (the
  // small messages' path) leave it alone.
  std::chrono::steady_clock::time_point last_received_ = CoarseClock::now();
  std::chrono::steady_clock::time_point last_sent_ = CoarseClock::now();

  struct Write {
    bool active = false;
    ConstBytes pieces[3];
    int piece = 0;
    std::size_t offset = 0;
    // A piece the kernel cannot read for the peer (shm/lendable.hpp): the whole write goes inline.
    bool inline_only = false;
  } write_;
  // Whether every piece of `write` that would go by reference can be read by the peer (checked once, as
  // the write starts: a system call per such piece).
  bool lendable(const Write& write) const noexcept;
  void begin_write(ConstBytes first, ConstBytes second, ConstBytes third);
  // Bytes of reference records written, in all; the receiver's ring word counts those it has read.
  std::uint64_t referenced_written_ = 0;
  std::uint64_t referenced_seen_ = 0;  // its last value seen: progress for ms_since_data
  // The writes lent (StreamEvents::on_lent), oldest first: each is released once the receiver has read
  // up to the value here (referenced_written_ at its end).
  std::deque<std::uint64_t> lent_;
  std::chrono::steady_clock::time_point last_lent_read_;  // since the receiver last read lent bytes (CoarseClock)
  struct Read {
    bool active = false;
    std::byte* dst = nullptr;
    std::size_t min = 0;
    std::size_t cap = 0;
    std::size_t got = 0;
  } read_;
  std::error_code read_error_;
  // The record being read: what is left of an inline one (or of a frame record's payload), or where the
  // rest of a reference one is.
  struct Record {
    shm::RecordKind kind = shm::RecordKind::inline_bytes;
    std::uint64_t left = 0;
    std::uint64_t address = 0;
    std::size_t expanded_left = 0;  // a frame record: bytes of `expanded_` not yet read (they come first)
    std::size_t pad = 0;            // a frame record: its pad, passed over once the rest is read
  } record_;
  wire::HeaderBytes expanded_{};  // a frame record's header in the long form, as the stream's bytes carry it
  std::uint64_t referenced_read_ = 0;  // bytes of the peer's reference records read, in all
  // The look for a record right after a frame taken is a load of the line the writer zeroed when it
  // published that frame (ring.hpp): when nothing more came, that line is still in the writer's cache, and
  // the load is a transfer between the cores made before the thread waiting on the receive just
  // completed gets back to its caller (the reply of a ping-pong: 8 bytes took 0.69-0.88 us a half round
  // trip with the look and 0.58-0.74 without it, where the cores are far apart; bench/RESULTS.md, "The
  // look past a frame"). So that look is made only while it pays: a look past a frame that found nothing
  // turns it off, and a turn whose first look, right after a turn that held back, finds a record waiting
  // (a burst) turns it back on.
  bool looks_ahead_ = false;
  bool held_back_ = false;  // the last take stopped after a frame without looking further
};

}  // namespace weft
