#pragma once
// The byte stream under the framed transport: one connection to one peer, with at most one write and
// one read in flight. Three backends move the bytes: Asio's reactor (asio_stream.hpp), io_uring
// (transports/uring) and shared memory for peers on this host (transports/shm). The framing, matching and failure handling above them are the same, so ranks on
// either backend talk to each other.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>
#include <system_error>

#include "transports/framed/wire.hpp"

namespace weft {

class TransportOp;

struct ConstBytes {
  const void* data = nullptr;
  std::size_t size = 0;
};

/// What a stream reports back to (the transport). Called on the loop's thread, never inline from
/// Stream::write/read.
class StreamEvents {
 public:
  virtual void on_written(int peer, const std::error_code& ec) = 0;
  /// The write is done as far as the stream goes (the next may start), but its buffers are lent: the
  /// peer still reads them from this process's memory (shared memory's single copy). They stay the
  /// caller's to keep alive until on_released; or, if the connection fails first, until close().
  virtual void on_lent(int peer) = 0;
  /// The oldest `writes` lent writes (in the order they were lent) are read: their buffers are free.
  virtual void on_released(int peer, std::size_t writes) = 0;
  virtual void on_read(int peer, const std::error_code& ec, std::size_t bytes) = 0;
  /// The stream's next bytes are one whole record of `size` bytes at `data`, readable until this returns
  /// (a hostile peer may still write them: what decides is copied first). A transport between frames,
  /// with nothing read ahead and its read posted for the next header, may take the record here as one
  /// whole data frame for a receive already posted for it: it copies the payload into that receive's
  /// buffer and returns the receive, which the stream completes through complete_taken once it has
  /// dropped the record. Null: not taken, nothing changed; the stream reads the record as any other
  /// bytes. Asked only by a stream whose bytes come in records (shm), which spares a small message the
  /// copy through the read-ahead buffer and the framing's steps (bench/RESULTS.md). Default: null.
  virtual TransportOp* take_frame(int /*peer*/, const std::byte* /*data*/, std::size_t /*size*/) { return nullptr; }
  /// As take_frame, for a data frame the stream carried in a form of its own (a short header, wire.hpp):
  /// `header` as that form says, and its payload (header.bytes of them) at `payload`, readable until this
  /// returns. Default: null.
  virtual TransportOp* take_data_frame(int /*peer*/, const wire::Header& /*header*/, const std::byte* /*payload*/) { return nullptr; }
  /// Completes a receive take_frame returned (its completion may run the user's code, and end the
  /// transport and the stream: the stream touches nothing of either after it).
  virtual void complete_taken(int /*peer*/, TransportOp& /*op*/) {}

 protected:
  ~StreamEvents() = default;
};

class Stream {
 public:
  virtual ~Stream() = default;
  /// "tcp" (Asio) or "uring".
  virtual std::string_view backend() const noexcept = 0;
  /// The socket's descriptor (for TCP_INFO: the transport's liveness check), or -1 once closed.
  virtual int native_handle() const noexcept = 0;
  /// Writes all of `first`, `second`, then `third` (any may be empty); on_written when done or failed.
  /// One write at a time.
  virtual void write(ConstBytes first, ConstBytes second, ConstBytes third) = 0;
  /// As write, except where the stream can take all of it at once without waiting: then it does, and
  /// returns true, and no on_written follows (the caller completes what it wrote itself, sparing the
  /// loop turn a reported write costs). False: exactly write(), on_written to come. Default: write().
  virtual bool write_now(ConstBytes first, ConstBytes second, ConstBytes third) {
    write(first, second, third);
    return false;
  }
  /// Writes all of `first`, `second` and `third` now and returns true when the stream can take every byte
  /// at once without waiting; otherwise does nothing at all and returns false (no on_written either way).
  /// Only a stream that knows beforehand (shared memory: the room in the ring) says yes. Default: false.
  virtual bool write_whole_now(ConstBytes /*first*/, ConstBytes /*second*/, ConstBytes /*third*/) { return false; }
  /// As write_whole_now(long form of `header`, `payload`) for a data frame (frames not sealed: the long
  /// form is the whole header). A stream may carry the header in a shorter form of its own, so long as its
  /// reader hands on exactly the long form's bytes (or the header, through StreamEvents::take_data_frame);
  /// the long form is encoded only by a stream that sends it (a small message's short form skips ~40
  /// instructions of encoding). Asked only where writes_whole_now() says yes: such a stream overrides
  /// it. Default: false (nothing written).
  virtual bool write_frame_now(const wire::Header& /*header*/, ConstBytes /*payload*/) { return false; }
  /// Whether write_whole_now can ever say yes (asked first, so that a socket costs no header built twice).
  virtual bool writes_whole_now() const noexcept { return false; }
  /// Whether write_whole_now would take pieces of `first` and `second` bytes now (nothing is written).
  virtual bool takes_whole_now(std::size_t /*first*/, std::size_t /*second*/) const noexcept { return false; }
  /// Writes what the stream takes of `first`, `second`, `third` now, without waiting, and returns how
  /// many bytes that was (0 on a full socket buffer, and on a failure, which the write of the rest then
  /// meets and reports through on_written). No on_written follows. Only a stream whose
  /// writes_some_now() says so: a socket, whose buffer may take part of a frame.
  virtual std::size_t write_some_now(ConstBytes /*first*/, ConstBytes /*second*/, ConstBytes /*third*/) { return 0; }
  virtual bool writes_some_now() const noexcept { return false; }
  /// Reads at least `min` and at most `cap` bytes into `dst`; on_read with the count. One read at a
  /// time. End of stream before `min` bytes is an error (asio::error::eof).
  virtual void read(void* dst, std::size_t min, std::size_t cap) = 0;
  /// One whole data frame in a stream's own short form, offered by take_next_data_frames: its header
  /// as the long form would say it, and its payload (header.bytes of them).
  struct OfferedFrame {
    wire::Header header;
    const std::byte* payload = nullptr;
  };
  /// The most frames take_next_data_frames offers at once.
  static constexpr std::size_t most_offered_frames = 8;
  /// Offers the stream's next records, at most `most` (up to most_offered_frames) and only while each is
  /// one whole data frame in the stream's own short form (as StreamEvents::take_data_frame), to
  /// `take(context, frames, n)`, when the stream is between records with its read posted. `take`
  /// returns how many of the n, from the first, it took (it copied their payloads out: readable until
  /// it returns); those are dropped from the stream, and this returns that number. Anything else
  /// (nothing there yet, another kind of record first, the middle of one) offers none: 0. A receive made
  /// after its message arrived takes it here, without an operation posted, matched and completed
  /// (FramedTransport::recv_now). Loop thread. Default: 0.
  using TakeDataFrames = std::size_t (*)(void* context, const OfferedFrame* frames, std::size_t n);
  virtual std::size_t take_next_data_frames(TakeDataFrames /*take*/, void* /*context*/, std::size_t /*most*/) { return 0; }
  /// Memory of `bytes` for the transport's read-ahead buffer, owned by the stream and valid for its
  /// life, that this backend reads into more cheaply (io_uring: a registered buffer). Null: none, the
  /// transport brings its own. Asked once, before the first read.
  virtual std::byte* staging(std::size_t /*bytes*/) { return nullptr; }
  /// The most a header read should take. A read that is a system call saves one by taking a whole small
  /// frame with its header (the default: all the transport's read-ahead buffer offers); a read that is a
  /// memory copy (shm) saves nothing, and every byte taken ahead is copied twice.
  virtual std::size_t read_ahead_limit() const { return SIZE_MAX; }
  /// Writes `data` now, blocking (the goodbye frame at shutdown: 48 bytes fit any socket buffer).
  virtual void write_blocking(const void* data, std::size_t size) = 0;
  virtual void shutdown_send() = 0;
  /// Milliseconds since a byte was last received (`received`) or sent on this connection, as far as the
  /// backend knows; nullopt when it cannot tell. The transport closes a connection stuck in the middle of
  /// a frame of a failed operation when this grows (a stopped peer), so only frames in flight need count:
  /// a backend may leave its clock alone for frames it takes or writes whole (shm). Default: the kernel's
  /// TCP_INFO of native_handle().
  virtual std::optional<std::uint32_t> ms_since_data(bool received) const {
    const int fd = native_handle();
    tcp_info info{};
    socklen_t length = sizeof info;
    if (fd < 0 || ::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &length) != 0) return std::nullopt;
    return received ? info.tcpi_last_data_recv : info.tcpi_last_data_sent;
  }
  /// Closes the connection; a read or write in flight ends with an error (its event still comes). Once it
  /// returns, the peer can no longer read lent buffers (it checks the connection after every read of
  /// them), so the caller may end the lent writes with the failure.
  virtual void close() = 0;
};

}  // namespace weft
