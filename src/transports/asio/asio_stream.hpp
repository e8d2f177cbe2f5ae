#pragma once
// The Asio backend of Stream: a tcp::socket driven by the loop's io_context (epoll).
#include <memory>

#include <asio.hpp>

#include "transports/framed/stream.hpp"

namespace weft {

class AsioStream final : public Stream, public std::enable_shared_from_this<AsioStream> {
 public:
  /// Events go to `events` for `peer` while `alive` lives (the transport's lifetime flag).
  AsioStream(asio::ip::tcp::socket socket, StreamEvents* events, int peer, std::weak_ptr<bool> alive)
      : socket_(std::move(socket)), events_(events), peer_(peer), alive_(std::move(alive)) {}

  std::string_view backend() const noexcept override { return "tcp"; }
  int native_handle() const noexcept override {
    return socket_.is_open() ? const_cast<asio::ip::tcp::socket&>(socket_).native_handle() : -1;
  }
  void write(ConstBytes first, ConstBytes second, ConstBytes third) override;
  void read(void* dst, std::size_t min, std::size_t cap) override;
  void write_blocking(const void* data, std::size_t size) override;
  void shutdown_send() override;
  void close() override;

 private:
  asio::ip::tcp::socket socket_;
  StreamEvents* events_;
  int peer_;
  std::weak_ptr<bool> alive_;
};

/// A stream factory for FramedTransport (its StreamFactory): Asio streams over the handshaken sockets.
std::shared_ptr<Stream> make_asio_stream(asio::ip::tcp::socket socket, StreamEvents* events, int peer, std::weak_ptr<bool> alive);

}  // namespace weft
