#pragma once
// The Asio backend of Stream: a tcp::socket on the loop's io_context (epoll), with the system calls of
// the common case made by hand. A write goes out at once (sendmsg) and reports through the loop's ready
// queue; a read first tries recv when the loop next asks the kernel, and only what that try leaves
// (nothing there yet, or part of it) waits in Asio's reactor. Why (docs/DESIGN.md, "The per-operation
// floor"): Asio reports even a write that finished at once through its own queue, behind an epoll_wait,
// and tries every read at once, where a read that follows a frame finds nothing (EAGAIN) and the next
// frame is waited for by epoll anyway: two system calls in every small collective that do nothing.
#include <memory>

#include <asio.hpp>

#include "weft/loop.hpp"
#include "transports/framed/stream.hpp"

namespace weft {

class AsioStream final : public Stream, public std::enable_shared_from_this<AsioStream> {
 public:
  /// Events go to `events` for `peer` while `alive` lives (the transport's lifetime flag). `loop` runs
  /// the socket's io_context and outlives the stream's operations.
  AsioStream(Loop& loop, asio::ip::tcp::socket socket, StreamEvents* events, int peer, std::weak_ptr<bool> alive)
      : loop_(loop), loop_alive_(loop.alive_word()), socket_(std::move(socket)), events_(events), peer_(peer), alive_(std::move(alive)) {
    loop_.count_kernel_sources(1);  // its reads are reported by epoll: the loop asks the kernel often
  }
  // A handler of a borrowed io_context may free the stream after its Loop ended (Loop::alive_word).
  ~AsioStream() override {
    if (loop_alive_->load(std::memory_order_acquire)) loop_.count_kernel_sources(-1);
  }
  AsioStream(const AsioStream&) = delete;
  AsioStream& operator=(const AsioStream&) = delete;

  std::string_view backend() const noexcept override { return "tcp"; }
  int native_handle() const noexcept override {
    return socket_.is_open() ? const_cast<asio::ip::tcp::socket&>(socket_).native_handle() : -1;
  }
  void write(ConstBytes first, ConstBytes second, ConstBytes third) override;
  bool write_now(ConstBytes first, ConstBytes second, ConstBytes third) override;
  std::size_t write_some_now(ConstBytes first, ConstBytes second, ConstBytes third) override;
  bool writes_some_now() const noexcept override { return true; }
  void read(void* dst, std::size_t min, std::size_t cap) override;
  void write_blocking(const void* data, std::size_t size) override;
  void shutdown_send() override;
  void close() override;

 private:
  // The read's first try (from the loop, before a kernel poll): true when it reported the read.
  bool try_read();
  // Both report to the transport only while it lives (completions still queued when it goes away).
  void report_written(const std::error_code& ec);
  void report_read(const std::error_code& ec, std::size_t bytes);

  Loop& loop_;
  const std::atomic<bool>* loop_alive_;
  asio::ip::tcp::socket socket_;
  StreamEvents* events_;
  int peer_;
  std::weak_ptr<bool> alive_;
  // The read in flight (one at a time): what read() asked for.
  std::byte* read_dst_ = nullptr;
  std::size_t read_min_ = 0;
  std::size_t read_cap_ = 0;
};

/// A stream factory for FramedTransport (its StreamFactory, with `loop` bound): Asio streams over the
/// handshaken sockets.
std::shared_ptr<Stream> make_asio_stream(Loop& loop, asio::ip::tcp::socket socket, StreamEvents* events, int peer,
                                         std::weak_ptr<bool> alive);

}  // namespace weft
