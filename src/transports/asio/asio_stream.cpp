#include "transports/asio/asio_stream.hpp"

#include <array>

namespace weft {
namespace {

// Asio's transfer_all caps each system call at 64 KiB; asking for the whole remainder lets one call move
// megabytes (it had cut all_reduce bandwidth at 1-4 MiB by 40%).
struct TransferAtLeast {
  std::size_t min;
  std::size_t cap;
  std::size_t operator()(const std::error_code& ec, std::size_t done) const noexcept {
    return ec || done >= min ? 0 : cap - done;
  }
};

}  // namespace

// Handlers hold the stream (and so the socket) until they run, and report only while the transport
// lives: completions still queued when it goes away find the flag expired.
void AsioStream::write(ConstBytes first, ConstBytes second, ConstBytes third) {
  const std::array<asio::const_buffer, 3> buffers{asio::buffer(first.data, first.size), asio::buffer(second.data, second.size),
                                                  asio::buffer(third.data, third.size)};
  const std::size_t total = first.size + second.size + third.size;
  asio::async_write(socket_, buffers, TransferAtLeast{total, total}, [self = shared_from_this()](const std::error_code& ec, std::size_t) {
    if (self->alive_.expired()) return;
    self->events_->on_written(self->peer_, ec);
  });
}

void AsioStream::read(void* dst, std::size_t min, std::size_t cap) {
  asio::async_read(socket_, asio::buffer(dst, cap), TransferAtLeast{min, cap},
                   [self = shared_from_this()](const std::error_code& ec, std::size_t n) {
                     if (self->alive_.expired()) return;
                     self->events_->on_read(self->peer_, ec, n);
                   });
}

void AsioStream::write_blocking(const void* data, std::size_t size) {
  std::error_code ignored;
  asio::write(socket_, asio::buffer(data, size), ignored);
}

void AsioStream::shutdown_send() {
  std::error_code ignored;
  socket_.shutdown(asio::ip::tcp::socket::shutdown_send, ignored);
}

void AsioStream::close() {
  std::error_code ignored;
  socket_.close(ignored);
}

std::shared_ptr<Stream> make_asio_stream(asio::ip::tcp::socket socket, StreamEvents* events, int peer, std::weak_ptr<bool> alive) {
  return std::make_shared<AsioStream>(std::move(socket), events, peer, std::move(alive));
}

}  // namespace weft
