#include "transports/shm/shm_stream.hpp"

#include "transports/shm/lendable.hpp"
#include "core/weak_poller.hpp"

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <chrono>
#include <thread>
#include <utility>

#include <asio/error.hpp>

#include "core/bytes.hpp"

namespace weft {

namespace {

// What a peer wrote into the ring that this rank cannot take (the connection fails with these words).
enum class RingError { not_a_record = 1, bad_length, unreadable_reference, empty_reference, bad_short_header };

class RingErrorCategory final : public std::error_category {
 public:
  const char* name() const noexcept override { return "weft-shm-ring"; }
  std::string message(int value) const override {
    switch (static_cast<RingError>(value)) {
      case RingError::not_a_record: return "protocol error: the peer wrote bytes into the ring that are not a record";
      case RingError::bad_length:
        return "protocol error: a record in the ring has a length of 0, less than a frame record's short header, or more than "
               "the ring holds";
      case RingError::unreadable_reference:
        return "protocol error: a single-copy reference from a peer whose memory this rank cannot read (it said so at connect time)";
      case RingError::empty_reference: return "protocol error: a single-copy reference with a length of 0";
      case RingError::bad_short_header: return "protocol error: a frame record whose short header has bytes set that must be zero";
    }
    return "unknown ring error";
  }
};

std::error_code make_error(RingError e) {
  static const RingErrorCategory category;
  return {static_cast<int>(e), category};
}

// process_vm_readv's errno, said as what failed.
class SingleCopyCategory final : public std::error_category {
 public:
  const char* name() const noexcept override { return "weft-shm-single-copy"; }
  std::string message(int value) const override {
    return std::string("the single-copy read of the peer's memory failed: ") + std::generic_category().message(value);
  }
  static const std::error_category& get() {
    static const SingleCopyCategory category;
    return category;
  }
};

}  // namespace

// ---------------------------------------------------------------- the hub

std::shared_ptr<ShmHub> ShmHub::create(Loop& loop) {
  std::shared_ptr<ShmHub> hub(new ShmHub(loop));
  hub->event_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (hub->event_fd_ < 0) throw std::system_error(errno, std::generic_category(), "eventfd");
  hub->watch_ = loop.watch_readable(hub->event_fd_, [weak = std::weak_ptr<ShmHub>(hub)] {
    auto self = weak.lock();
    if (!self) return;
    std::uint64_t count = 0;
    [[maybe_unused]] const auto n = ::read(self->event_fd_, &count, sizeof count);
    // The eventfd wakes every memory source of this rank (the streams and the group arena).
    self->loop().poll_memory();
  });
  hub->poller_ = loop.add_poller(std::make_shared<detail::WeakPoller<ShmHub>>(hub));
  return hub;
}

ShmHub::~ShmHub() {
  if (loop_lives()) {
    loop_.remove_poller(poller_);
    loop_.unwatch(watch_);
  }
  // The loop's watch holds a duplicate of the descriptor, closed with the watch.
  if (event_fd_ >= 0) ::close(event_fd_);
}

void ShmHub::attach(const std::shared_ptr<ShmStream>& stream) { streams_.push_back(stream); }

std::size_t ShmHub::poll() {
  std::size_t found = 0;
  for (std::size_t i = 0; i < streams_.size();) {
    auto stream = streams_[i].lock();
    if (!stream) {
      streams_.erase(streams_.begin() + static_cast<std::ptrdiff_t>(i));
      continue;
    }
    found += stream->progress();
    ++i;
  }
  return found;
}

bool ShmHub::arm() {
  bool work = false;
  for (const auto& weak : streams_) {
    if (auto stream = weak.lock()) work = stream->arm() || work;  // every stream arms, work or not
  }
  return work;
}

void ShmHub::disarm() {
  for (const auto& weak : streams_) {
    if (auto stream = weak.lock()) stream->disarm();
  }
}

// ---------------------------------------------------------------- a stream

std::shared_ptr<ShmStream> ShmStream::make(std::shared_ptr<ShmHub> hub, Link link, StreamEvents* events, int peer,
                                           std::weak_ptr<bool> alive) {
  auto stream = std::make_shared<ShmStream>(std::move(hub), std::move(link), events, peer, std::move(alive));
  stream->start();
  return stream;
}

ShmStream::ShmStream(std::shared_ptr<ShmHub> hub, Link link, StreamEvents* events, int peer, std::weak_ptr<bool> alive)
    : hub_(std::move(hub)),
      link_(std::move(link)),
      in_(static_cast<shm::RingControl*>(link_.inbound.data()), shm::ring_capacity(link_.inbound)),
      out_(static_cast<shm::RingControl*>(link_.outbound.data()), shm::ring_capacity(link_.outbound)),
      events_(events),
      peer_(peer),
      alive_(std::move(alive)),
      socket_(link_.socket) {
  // The outbound ring's pages, written once now through this process's mapping (ring.hpp, touch_pages):
  // the first lap of messages would otherwise pay each page's first write (the inbound ring's pages were
  // read when it was made: make_ring). Before this side writes anything, so that every access the peer
  // makes meanwhile is a header's atomic load. About 1 ms a MiB on the VMs here, at most the 16 MiB of
  // rings a host's ranks keep for each other (link.hpp).
  out_.touch_pages(static_cast<std::size_t>(::sysconf(_SC_PAGESIZE)));
}

ShmStream::~ShmStream() {
  if (socket_watch_ && hub_->loop_lives()) hub_->loop().unwatch(socket_watch_);
  if (link_.socket >= 0) ::close(link_.socket);
  if (link_.peer_wake_fd >= 0) ::close(link_.peer_wake_fd);
}

void ShmStream::start() {
  // A loop with a thread of its own arms its pollers before every sleep: until then it is awake, and
  // peers need not wake it (they did, on every message, where the caller drives the loop and it never
  // sleeps: a write and a read of the eventfd per message). A borrowed io_context never arms: its
  // streams stay armed (ring.hpp's `sleeping` starts 1), so that peers always wake it.
  if (hub_->loop().owns_thread()) {
    awake_ = true;
    in_.disarm();
  }
  hub_->attach(shared_from_this());
  socket_watch_ = hub_->loop().watch_readable(link_.socket, [weak = weak_from_this()] {
    if (auto self = weak.lock()) self->on_socket_readable();
  });
}

// Nothing but the end of the stream comes on the socket after the connect: readable means the peer is gone
// (or shut its side down after its goodbye). What it wrote before stays readable in the ring.
void ShmStream::on_socket_readable() {
  if (closed_ || peer_closed_) return;
  char byte;
  const ssize_t n = ::recv(socket_, &byte, 1, MSG_DONTWAIT | MSG_PEEK);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
  peer_closed_ = true;
  hub_->loop().unwatch(std::exchange(socket_watch_, 0));
  post_progress();
}

void ShmStream::post_progress() {
  if (progress_posted_) return;
  progress_posted_ = true;
  hub_->loop().post([weak = weak_from_this()] {
    if (auto self = weak.lock()) {
      self->progress_posted_ = false;
      self->progress();
    }
  });
}

void ShmStream::wake_peer() {
  const std::uint64_t one = 1;
  [[maybe_unused]] const auto n = ::write(link_.peer_wake_fd, &one, sizeof one);
}

void ShmStream::write(ConstBytes first, ConstBytes second, ConstBytes third) {
  begin_write(first, second, third);
  // The bytes go into the ring now (the peer may be spinning on it: a turn of this loop later was a
  // fifth of a small ping-pong, 2.5 -> 2.0 us); the completion comes from the loop, never inline.
  if (!peer_closed_ && !closed_) push_some();
  post_progress();
}

// A write in flight: ms_since_data's clock starts with it (the writes done at once, write_frame_now's
// and write_whole_now's, leave it: once one returns, nothing of it is in flight).
void ShmStream::begin_write(ConstBytes first, ConstBytes second, ConstBytes third) {
  write_ = Write{true, {first, second, third}, 0, 0};
  write_.inline_only = !lendable(write_);
  last_sent_ = CoarseClock::now();
}

// Done at once when the whole write went into the ring as inline records and nothing written before is
// still lent: then there is nothing to wait for (a reference record, or an earlier lent write, keeps the
// loop's path, which completes writes in order).
bool ShmStream::write_now(ConstBytes first, ConstBytes second, ConstBytes third) {
  if (peer_closed_ || closed_ || !lent_.empty()) {
    write(first, second, third);
    return false;
  }
  const std::uint64_t referenced_before = referenced_written_;
  begin_write(first, second, third);
  if (push_some() && referenced_written_ == referenced_before) {
    write_.active = false;
    return true;
  }
  post_progress();
  return false;
}

void ShmStream::read(void* dst, std::size_t min, std::size_t cap) {
  read_ = Read{true, static_cast<std::byte*>(dst), min, cap, 0};
  // A loop with a thread of its own looks at this stream on its next turn (the hub's poller), and does
  // not sleep past bytes already in the ring (arm() says so): the read needs no post of its own, which
  // cost a lock, an allocation and a queue turn per frame read. A borrowed io_context runs no pollers.
  if (!hub_->loop().owns_thread()) post_progress();
}

bool ShmStream::push_write() {
  for (;;) {
    if (push_some()) return true;
    // A loop that does not spin now (asleep, or a borrowed io_context that weft never arms) must be
    // woken when room comes: say so, then look once more (the reader may have made room meanwhile).
    if (awake_ || !out_.arm_wait()) return false;
  }
}

std::size_t ShmStream::take_released() {
  if (lent_.empty()) return 0;
  const std::uint64_t read = out_.referenced_read();
  if (read != referenced_seen_) {
    referenced_seen_ = read;
    last_lent_read_ = CoarseClock::now();  // the receiver is reading what was lent: it moves
  }
  std::size_t released = 0;
  while (!lent_.empty() && lent_.front() <= read) {
    lent_.pop_front();
    ++released;
  }
  return released;
}

bool ShmStream::reference_sized(std::size_t bytes) const noexcept {
  return link_.single_copy_from != 0 && bytes >= link_.single_copy_from;
}

bool ShmStream::by_reference(const ConstBytes& piece) const noexcept {
  return reference_sized(piece.size) && !(write_.active && write_.inline_only);
}

bool ShmStream::lendable(const Write& write) const noexcept {
  for (const ConstBytes& piece : write.pieces) {
    if (reference_sized(piece.size) && !shm::kernel_can_read(piece.data, piece.size)) return false;
  }
  return true;
}

std::size_t ShmStream::lead_for(const ConstBytes* pieces, int piece, std::size_t offset, std::size_t room) const noexcept {
  std::size_t before = 0;  // the record's bytes ahead of the piece looked at
  for (int i = piece; i < 3; ++i) {
    if (i != piece && by_reference(pieces[i])) break;
    const std::size_t from = i == piece ? offset : 0;
    const std::size_t left = pieces[i].size - from;
    if (left >= shm::align_records_from) {
      const std::size_t lead = shm::record_lead(out_.position() + shm::record_header_bytes + before,
                                                static_cast<const std::byte*>(pieces[i].data) + from);
      return room >= shm::record_bytes(lead, before + shm::align_records_from) ? lead : 0;
    }
    before += left;
  }
  return 0;
}

// One record of `length` bytes, written now and whole: nothing in flight or lent before it (writes go in
// order), the room holds it all (asked once rather than per piece), and within push_some's most for a
// record (ring.hpp, record_share_of_ring): a larger write goes in pieces. Inline, and defined before its
// callers, both in this file: write_frame_now asks it on every small send (a call was 14 of a streamed
// message's instructions).
inline bool ShmStream::record_fits_now(std::size_t length) const noexcept {
  if (peer_closed_ || closed_ || write_.active || !lent_.empty()) return false;
  return length != 0 && length <= UINT32_MAX && length <= out_.capacity() / shm::record_share_of_ring &&
         out_.room(shm::record_bytes(0, length)) >= shm::record_bytes(0, length);
}

bool ShmStream::takes_whole_now(std::size_t first, std::size_t second) const noexcept {
  // One inline record of every piece (push_some's, written straight); no piece to send by reference
  // (with no write in flight, by_reference asks only the size).
  return !reference_sized(first) && !reference_sized(second) && record_fits_now(first + second);
}

bool ShmStream::write_whole_now(ConstBytes first, ConstBytes second, ConstBytes third) {
  if (by_reference(third) || !takes_whole_now(first.size, second.size + third.size)) return false;
  const std::size_t total = first.size + second.size + third.size;
  // Placed alike when the room holds the lead too (takes_whole_now asked for the record alone).
  std::size_t lead = 0;
  // (No piece of a smaller record can be large enough to be placed: not asked, on every small send.)
  if (total >= shm::align_records_from) {
    const ConstBytes pieces[3] = {first, second, third};
    const std::size_t room = out_.room(shm::record_bytes(shm::lead_most, total));
    lead = lead_for(pieces, 0, 0, room);
    if (room < shm::record_bytes(lead, total)) lead = 0;
  }
  out_.put_header({shm::RecordKind::inline_bytes, static_cast<std::uint8_t>(lead), static_cast<std::uint32_t>(total)});
  out_.skip(lead);
  for (const ConstBytes& piece : {first, second, third}) {
    if (piece.size) out_.put_fitting(piece.data, piece.size);
  }
  out_.end_record();
  if (out_.publish()) wake_peer();
  return true;
}

bool ShmStream::write_frame_now(const wire::Header& header, ConstBytes payload) {
  if (!wire::has_short_form(header) || payload.size >= shm::align_records_from) {
    wire::HeaderBytes encoded;
    wire::encode(header, encoded);
    return write_whole_now(ConstBytes{encoded.data(), encoded.size()}, payload, ConstBytes{});
  }
  const std::size_t length = wire::short_header_size + payload.size;
  if (reference_sized(payload.size) || !record_fits_now(length)) return false;
  const std::size_t used = shm::record_bytes(0, length);
  // The pad that ends the record at a line's end (ring.hpp), where the room holds it too.
  std::size_t pad = (shm::cache_line_bytes - ((out_.position() + used) & (shm::cache_line_bytes - 1))) & (shm::cache_line_bytes - 1);
  if (pad && out_.room(used + pad) < used + pad) pad = 0;
  out_.put_header({shm::RecordKind::frame, static_cast<std::uint8_t>(pad), static_cast<std::uint32_t>(length)});
  if (std::byte* at = out_.fitting_in_one_piece(length)) {
    // Nearly always: the short header encoded in place and the payload copied behind it (below 4 KiB a
    // copy into the ring is memcpy's, copy.hpp).
    wire::encode_short(header, at);
    if (payload.size) std::memcpy(at + wire::short_header_size, payload.data, payload.size);
    out_.skip(length);
  } else {
    wire::ShortHeaderBytes short_header;
    wire::encode_short(header, short_header);
    out_.put_fitting(short_header.data(), short_header.size());
    if (payload.size) out_.put_fitting(payload.data, payload.size);
  }
  out_.end_record();
  out_.skip(pad);
  if (out_.publish()) wake_peer();
  return true;
}

bool ShmStream::push_some() {
  bool moved = false;
  while (write_.piece < 3) {
    const ConstBytes& piece = write_.pieces[write_.piece];
    if (write_.offset >= piece.size) {
      ++write_.piece;
      write_.offset = 0;
      continue;
    }
    if (by_reference(piece)) {
      // A reference record: the receiver copies the piece out of this process; the write is lent (the
      // piece must live) until it has (take_released).
      if (out_.room(shm::reference_record_bytes) < shm::reference_record_bytes) break;
      std::byte where[16];
      le::put_u64(where, reinterpret_cast<std::uintptr_t>(piece.data));
      le::put_u64(where + 8, piece.size);
      out_.put_header({shm::RecordKind::reference, 0, 0});
      out_.put_fitting(where, sizeof where);
      referenced_written_ += piece.size;
      write_.offset = piece.size;
      moved = true;
      continue;
    }
    // An inline record: as much of this piece and the inline pieces after it as fits, placed alike
    // (lead_for) where a large piece is in it.
    std::size_t length = 0;
    for (int i = write_.piece; i < 3; ++i) {
      const ConstBytes& next = write_.pieces[i];
      if (i != write_.piece && by_reference(next)) break;
      length += next.size - (i == write_.piece ? write_.offset : 0);
    }
    // The room for all of it with its lead, if the ring has it (the reader's head loaded only when the
    // room last seen is short).
    const std::size_t room = out_.room(shm::record_bytes(shm::lead_most, length));
    if (room < shm::record_bytes(0, 1)) break;
    std::size_t lead = lead_for(write_.pieces, write_.piece, write_.offset, room);
    if (room < shm::record_bytes(lead, 1)) lead = 0;
    // (room and every record a multiple of 8: a record of room - header - lead bytes fills it exactly.)
    // At most a quarter of the ring (ring.hpp, record_share_of_ring).
    length = std::min({length, room - shm::record_header_bytes - lead, out_.capacity() / shm::record_share_of_ring,
                       std::size_t{UINT32_MAX}});
    out_.put_header({shm::RecordKind::inline_bytes, static_cast<std::uint8_t>(lead), static_cast<std::uint32_t>(length)});
    out_.skip(lead);
    while (length > 0) {
      const ConstBytes& current = write_.pieces[write_.piece];
      const std::size_t n = std::min(length, current.size - write_.offset);
      out_.put_fitting(static_cast<const std::byte*>(current.data) + write_.offset, n);
      write_.offset += n;
      length -= n;
      if (write_.offset == current.size) {
        ++write_.piece;
        write_.offset = 0;
      }
    }
    out_.end_record();
    moved = true;
    if (write_.piece < 3) {
      // More of this write follows: the reader may copy this record while the next is written.
      if (out_.publish()) wake_peer();
    }
  }
  if (moved) {
    last_sent_ = CoarseClock::now();
    if (out_.publish()) wake_peer();
  }
  return write_.piece == 3;
}

// The ring's record `offset` bytes past the reader's position (header word `word`, not 0) when it is a
// whole inline or frame record in one piece: its bytes (a frame record's from its short header, an
// inline record's past its spare). Null for anything else, which is pull_read's, and pull_read judges a
// bad one.
const std::byte* ShmStream::whole_record(std::uint64_t word, shm::RecordHeader& h, std::size_t offset) const noexcept {
  if (!shm::decode_record_header(word, h) || h.kind == shm::RecordKind::reference || !fits(h)) return nullptr;
  return in_.view(offset + shm::record_header_bytes + (h.kind == shm::RecordKind::frame ? 0 : h.spare), h.length);
}

std::size_t ShmStream::take_next_data_frames(TakeDataFrames take, void* context, std::size_t most) {
  // Between records with the transport's read posted, as take_whole_frames takes them.
  if (!read_.active || read_.got != 0 || in_record() || read_error_ || closed_) return 0;
  // Left uninitialised, each made as it is found (eight headers set to zero first were a sixth of a
  // small message's instructions here).
  union Offered {
    Offered() noexcept {}
    OfferedFrame frames[most_offered_frames];
  } offered;
  OfferedFrame* const frames = offered.frames;
  std::size_t ends[most_offered_frames];  // each frame's record's end, past the reader's position
  most = std::min(most, most_offered_frames);
  std::size_t n = 0;
  std::size_t offset = 0;
  // Record after record: a nonzero header is published with its whole batch, and a batch ends in a zero
  // word until the next is published (ring.hpp), so the walk stops at what is not there yet.
  for (; n < most; ++n) {
    const std::uint64_t word = in_.header_at(offset);
    shm::RecordHeader h;
    const std::byte* bytes = word == 0 ? nullptr : whole_record(word, h, offset);
    if (!bytes || h.kind != shm::RecordKind::frame) break;
    // No further than a writer can have written ahead of the reader (a hostile one's headers could lead
    // the walk round the ring, onto records already offered).
    const std::size_t end = offset + shm::record_bytes(h.spare, h.length);
    if (end > in_.capacity() - shm::record_alignment) break;
    wire::ShortHeaderBytes short_header;
    copy_short_header(offset, short_header);
    if (!wire::short_form_well_formed(short_header)) break;
    // The header decoded in place (a prvalue member of the aggregate made here), not through a copy.
    ::new (static_cast<void*>(frames + n))
        OfferedFrame{wire::decode_well_formed_short(short_header, h.length - wire::short_header_size), bytes + wire::short_header_size};
    offset = end;
    ends[n] = offset;
  }
  const std::size_t taken = n == 0 ? 0 : std::min(take(context, frames, n), n);
  if (taken == 0) return 0;
  in_.take(nullptr, ends[taken - 1]);
  if (in_.release()) wake_peer();
  return taken;  // (whole frames: nothing in flight for ms_since_data's clock)
}

std::size_t ShmStream::take_whole_frames(bool& ended) {
  std::size_t taken = 0;
  const bool after_hold = std::exchange(held_back_, false);
  while (taken < frames_taken_most && read_.active && read_.got == 0 && !in_record() && !read_error_ && !alive_.expired()) {
    if (taken > 0 && !looks_ahead_) {
      held_back_ = true;
      break;
    }
    const std::uint64_t word = in_.header();
    if (word == 0) {
      if (taken > 0) looks_ahead_ = false;
      break;
    }
    if (taken == 0 && after_hold) looks_ahead_ = true;
    shm::RecordHeader h;
    const std::byte* bytes = whole_record(word, h);
    if (!bytes) break;
    const bool frame = h.kind == shm::RecordKind::frame;
    TransportOp* op = nullptr;
    if (frame) {
      const auto header = peek_short_header(h);
      if (!header) break;  // (pull_read names it)
      op = events_->take_data_frame(peer_, *header, bytes + wire::short_header_size);
    } else {
      op = events_->take_frame(peer_, bytes, h.length);
    }
    if (!op) break;
    in_.take(nullptr, shm::record_bytes(h.spare, h.length));
    if (in_.release()) wake_peer();
    ++taken;
    events_->complete_taken(peer_, *op);
    if (closed_ || alive_.expired()) {
      ended = true;
      break;
    }
  }
  return taken;  // (whole frames: nothing in flight for ms_since_data's clock)
}

void ShmStream::copy_short_header(std::size_t offset, wire::ShortHeaderBytes& bytes) const noexcept {
  // Copied out first: a hostile writer may still change the ring's bytes while they are decoded. In one
  // piece (nearly always) by a copy of fixed size, a few moves; across the ring's end by pieces.
  if (const std::byte* at = in_.view(offset + shm::record_header_bytes, bytes.size())) {
    std::memcpy(bytes.data(), at, bytes.size());
  } else {
    in_.peek(offset + shm::record_header_bytes, bytes.data(), bytes.size());
  }
}

std::optional<wire::Header> ShmStream::peek_short_header(const shm::RecordHeader& h, std::size_t offset) const noexcept {
  wire::ShortHeaderBytes bytes;
  copy_short_header(offset, bytes);
  return wire::decode_short(bytes, h.length - wire::short_header_size);
}

bool ShmStream::fits(const shm::RecordHeader& h) const noexcept {
  // The most a writer can put: the ring less the 8 bytes its next header needs.
  const std::size_t least = h.kind == shm::RecordKind::frame ? wire::short_header_size : 1;
  return h.length >= least && shm::record_bytes(h.spare, h.length) <= in_.capacity() - shm::record_alignment;
}

bool ShmStream::pull_read() {
  if (read_error_) return false;
  bool ring_moved = false;
  while (read_.got < read_.cap) {
    if (!in_record()) {
      const std::uint64_t word = in_.header();
      if (word == 0) break;
      shm::RecordHeader h;
      if (!shm::decode_record_header(word, h)) {
        read_error_ = make_error(RingError::not_a_record);
        break;
      }
      if (h.kind == shm::RecordKind::inline_bytes) {
        if (!fits(h)) {
          read_error_ = make_error(RingError::bad_length);
          break;
        }
        in_.take(nullptr, shm::record_header_bytes + h.spare);
        record_ = Record{shm::RecordKind::inline_bytes, h.length, 0, 0, 0};
      } else if (h.kind == shm::RecordKind::frame) {
        // Read as the bytes of the long header it stands for, then its payload.
        if (!fits(h)) {
          read_error_ = make_error(RingError::bad_length);
          break;
        }
        const auto header = peek_short_header(h);
        if (!header) {
          read_error_ = make_error(RingError::bad_short_header);
          break;
        }
        wire::encode(*header, expanded_);
        in_.take(nullptr, shm::record_header_bytes + wire::short_header_size);
        record_ = Record{shm::RecordKind::frame, h.length - wire::short_header_size, 0, wire::header_size, h.spare};
      } else {
        // Only from a peer this rank said it can read (the link's probe); never trusted further than
        // that: a bad address fails the read (process_vm_readv checks it), it cannot touch this process.
        if (link_.peer_pid == 0) {
          read_error_ = make_error(RingError::unreadable_reference);
          break;
        }
        std::byte where[16];
        in_.peek(shm::record_header_bytes, where, sizeof where);
        const std::uint64_t length = le::get_u64(where + 8);
        if (length == 0) {
          read_error_ = make_error(RingError::empty_reference);
          break;
        }
        in_.take(nullptr, shm::reference_record_bytes);
        record_ = Record{shm::RecordKind::reference, length, le::get_u64(where), 0, 0};
      }
      ring_moved = true;
    }
    if (record_.kind != shm::RecordKind::reference) {
      // A frame record's long header first, from expanded_.
      if (record_.expanded_left > 0) {
        const std::size_t n = std::min(record_.expanded_left, read_.cap - read_.got);
        std::memcpy(read_.dst + read_.got, expanded_.data() + (expanded_.size() - record_.expanded_left), n);
        read_.got += n;
        record_.expanded_left -= n;
      }
      // All of the record is there (its header was): as much as the read holds.
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(record_.left, read_.cap - read_.got));
      in_.take(read_.dst + read_.got, n);
      read_.got += n;
      record_.left -= n;
      if (!in_record()) {
        in_.take(nullptr, record_.pad);
        in_.end_record();
        // A large write's space handed back as it is read, not when the read ends (ring.hpp,
        // release_share_of_ring): its writer may be waiting for it to write the rest.
        if (in_.unreleased() >= in_.capacity() / shm::release_share_of_ring && in_.release()) wake_peer();
      }
      ring_moved = true;
      continue;
    }
    // A reference: read ahead only into a read that still needs bytes (its bytes go straight into the
    // read that wants them, the posted receive), and one chunk per turn of the loop.
    if (read_.got >= read_.min) break;
    read_referenced(read_.cap - read_.got);
    break;
  }
  if (ring_moved) {
    last_received_ = CoarseClock::now();
    // The peer may sleep waiting for room to write: wake it.
    if (in_.release()) wake_peer();
  }
  return read_.got >= read_.min;
}

void ShmStream::read_referenced(std::size_t limit) {
  // Bounded per call, so that the loop's other work (deadlines, failures, other peers) runs between chunks.
  constexpr std::uint64_t chunk_limit = std::uint64_t{1} << 20;
  const std::size_t chunk = static_cast<std::size_t>(std::min({record_.left, static_cast<std::uint64_t>(limit), chunk_limit}));
  iovec local{read_.dst + read_.got, chunk};
  iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(record_.address)), chunk};
  ssize_t n;
  do {
    n = ::process_vm_readv(link_.peer_pid, &local, 1, &remote, 1, 0);
  } while (n < 0 && errno == EINTR);
  if (n <= 0) {
    const int error = n < 0 ? errno : EFAULT;
    // The peer's process is gone (or going: its memory is being torn down): its end, as a socket's.
    if (error == ESRCH || !peer_still_there()) {
      read_error_ = asio::error::eof;
    } else {
      read_error_ = std::error_code(error, SingleCopyCategory::get());
    }
    return;
  }
  // The peer shuts its socket down before it lets go of what it lent (close()): still there after the
  // copy means the bytes were still its write's.
  if (!peer_still_there()) {
    read_error_ = asio::error::eof;
    return;
  }
  const auto got = static_cast<std::size_t>(n);
  read_.got += got;
  record_.address += got;
  record_.left -= got;
  referenced_read_ += got;
  last_received_ = CoarseClock::now();
  if (in_.referenced(referenced_read_)) wake_peer();
}

bool ShmStream::peer_still_there() const noexcept {
  if (peer_closed_) return false;
  char byte;
  const ssize_t n = ::recv(socket_, &byte, 1, MSG_DONTWAIT | MSG_PEEK);
  return n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR));
}

std::size_t ShmStream::progress() {
  if (closed_) return 0;
  std::size_t found = 0;
  if (write_.active) {
    std::error_code failed;
    bool done = false;
    if (write_.piece == 3) {
      done = true;  // wholly in the ring already (write pushes at once): the peer's end comes after it
    } else if (peer_closed_) {
      failed = std::make_error_code(std::errc::broken_pipe);
    } else {
      done = push_write();
    }
    if (done || failed) {
      write_.active = false;
      out_.disarm_wait();
      ++found;
      // Its references not all read yet: lent (the transport keeps the buffers until released).
      const bool lent = done && out_.referenced_read() < referenced_written_;
      if (lent) {
        if (lent_.empty()) last_lent_read_ = CoarseClock::now();
        lent_.push_back(referenced_written_);
      }
      if (!alive_.expired()) {
        if (lent) {
          events_->on_lent(peer_);
        } else {
          events_->on_written(peer_, failed);
        }
      }
      if (closed_) return found;
    }
  }
  // Releases are taken after the read: a peer reads our references before it writes anything after
  // them (its goodbye included), so what the read brings is never handed on before the releases that
  // came earlier; a goodbye seen first would fail lent sends the peer had in fact read.
  const bool reading = read_.active;
  bool read_done = false;
  if (reading) {
    bool ended = false;
    found += take_whole_frames(ended);
    if (ended) return found;
  }
  const std::size_t before = read_.got;
  // (Held back: pull_read's first look would be the one take_whole_frames did not make. Not when the
  // peer is gone: the hold spares a live writer's line, and the end below must come after a look at
  // what the peer wrote before it left; a hold until the next turn could sleep past it, nothing left to
  // wake the loop.)
  if (reading && (!held_back_ || peer_closed_)) read_done = pull_read();
  if (const std::size_t released = take_released(); released > 0) {
    ++found;
    if (!alive_.expired()) events_->on_released(peer_, released);
    if (closed_) return found;
  }
  if (reading && read_.active) {
    const bool done = read_done;
    if (done || peer_closed_ || read_error_) {
      read_.active = false;
      ++found;
      // The peer's end comes after what it wrote (pull_read looked at all of it): a read that has its
      // minimum completes first.
      const std::error_code ec = done ? std::error_code{} : read_error_ ? read_error_ : std::error_code(asio::error::eof);
      if (!alive_.expired()) events_->on_read(peer_, ec, read_.got);
    } else if (read_.got != before && record_.left > 0 && record_.kind == shm::RecordKind::reference) {
      ++found;  // a reference being read: more to copy at once, no reason to look at the kernel
    }
  }
  return found;
}

std::optional<std::uint32_t> ShmStream::ms_since_data(bool received) const {
  // While writes are lent, what moves on the way out is the receiver reading them (it reads the ring in
  // order: nothing after a reference moves before it), not this side's later writes into the ring.
  const auto last = received ? last_received_ : !lent_.empty() ? last_lent_read_ : last_sent_;
  const auto since = std::chrono::duration_cast<std::chrono::milliseconds>(CoarseClock::now() - last).count();
  return static_cast<std::uint32_t>(std::max<std::int64_t>(since, 0));
}

bool ShmStream::arm() {
  awake_ = false;
  const bool data = in_.arm();
  const bool room = write_.active && out_.arm_wait();
  // Lent writes wait for the reader's word like a write waits for room (the same writer_waiting flag).
  const bool released = !lent_.empty() && out_.arm_wait_referenced(lent_.front());
  // A reference half read needs no word from the peer to go on.
  const bool referenced = record_.left > 0 && record_.kind == shm::RecordKind::reference && read_.got < read_.min;
  // (A posted progress is the loop's own queue: it does not sleep past it.)
  return (read_.active && (data || referenced)) || room || released;
}

void ShmStream::disarm() {
  awake_ = true;
  in_.disarm();
  out_.disarm_wait();
}

void ShmStream::write_blocking(const void* data, std::size_t size) {
  // One inline record, put whole or not at all (the goodbye frame: 48 bytes): a reader never sees half.
  if (size == 0 || size > UINT32_MAX) return;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (out_.room(shm::record_bytes(0, size)) < shm::record_bytes(0, size)) {
    if (peer_closed_ || std::chrono::steady_clock::now() >= until) return;
    std::this_thread::yield();
  }
  out_.put_header({shm::RecordKind::inline_bytes, 0, static_cast<std::uint32_t>(size)});
  out_.put_fitting(data, size);
  out_.end_record();
  if (out_.publish()) wake_peer();
}

void ShmStream::shutdown_send() {
  if (!closed_) ::shutdown(socket_, SHUT_WR);
}

void ShmStream::close() {
  if (closed_) return;
  closed_ = true;
  lent_.clear();  // the transport ends them (StreamEvents::on_lent): after the shutdown below, nothing reads them
  if (socket_watch_) hub_->loop().unwatch(std::exchange(socket_watch_, 0));
  ::shutdown(socket_, SHUT_RDWR);
  // What is in flight ends with an error, reported from the loop (never inline).
  const bool reading = std::exchange(read_.active, false);
  const bool writing = std::exchange(write_.active, false);
  // A write wholly in the ring is done: the peer reads the ring up to its end, close or not.
  const bool written = writing && write_.piece == 3;
  if (!reading && !writing) return;
  hub_->loop().post([events = events_, peer = peer_, alive = alive_, reading, writing, written] {
    if (alive.expired()) return;
    if (writing) events->on_written(peer, written ? std::error_code{} : asio::error::operation_aborted);
    if (reading) events->on_read(peer, asio::error::operation_aborted, 0);
  });
}

}  // namespace weft
