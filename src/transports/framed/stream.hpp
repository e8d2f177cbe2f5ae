#pragma once
// The byte stream under the framed transport: one connection to one peer, with at most one write and
// one read in flight. Two backends move the bytes: Asio's reactor (asio_stream.hpp) and io_uring
// (transports/uring). The framing, matching and failure handling above them are the same, so ranks on
// either backend talk to each other.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <system_error>

namespace weft {

struct ConstBytes {
  const void* data = nullptr;
  std::size_t size = 0;
};

/// What a stream reports back to (the transport). Called on the loop's thread, never inline from
/// Stream::write/read.
class StreamEvents {
 public:
  virtual void on_written(int peer, const std::error_code& ec) = 0;
  virtual void on_read(int peer, const std::error_code& ec, std::size_t bytes) = 0;

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
  /// Reads at least `min` and at most `cap` bytes into `dst`; on_read with the count. One read at a
  /// time. End of stream before `min` bytes is an error (asio::error::eof).
  virtual void read(void* dst, std::size_t min, std::size_t cap) = 0;
  /// Memory of `bytes` for the transport's read-ahead buffer, owned by the stream and valid for its
  /// life, that this backend reads into more cheaply (io_uring: a registered buffer). Null: none, the
  /// transport brings its own. Asked once, before the first read.
  virtual std::byte* staging(std::size_t /*bytes*/) { return nullptr; }
  /// Writes `data` now, blocking (the goodbye frame at shutdown: 48 bytes fit any socket buffer).
  virtual void write_blocking(const void* data, std::size_t size) = 0;
  virtual void shutdown_send() = 0;
  /// Closes the connection; a read or write in flight ends with an error (its event still comes).
  virtual void close() = 0;
};

}  // namespace weft
