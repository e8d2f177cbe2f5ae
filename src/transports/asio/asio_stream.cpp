#include "transports/asio/asio_stream.hpp"

#include <sys/socket.h>
#include <sys/uio.h>

#include <array>
#include <cerrno>

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

bool would_block(int error) noexcept { return error == EAGAIN || error == EWOULDBLOCK || error == EINTR; }

std::error_code system_error(int error) { return {error, asio::error::get_system_category()}; }

// One sendmsg of the non-empty pieces, without waiting: what it returned (-1 with errno), 0 when all
// are empty.
ssize_t send_pieces(int socket, ConstBytes first, ConstBytes second, ConstBytes third) {
  std::array<iovec, 3> iov{};
  msghdr message{};
  for (const ConstBytes& part : {first, second, third}) {
    if (part.size != 0) iov[message.msg_iovlen++] = iovec{const_cast<void*>(part.data), part.size};
  }
  if (message.msg_iovlen == 0) return 0;
  message.msg_iov = iov.data();
  return ::sendmsg(socket, &message, MSG_DONTWAIT | MSG_NOSIGNAL);
}

}  // namespace

// Handlers hold the stream (and so the socket) until they run, and report only while the transport
// lives: completions still queued when it goes away find the flag expired.
void AsioStream::write(ConstBytes first, ConstBytes second, ConstBytes third) {
  if (write_now(first, second, third)) loop_.post([self = shared_from_this()] { self->report_written({}); });
}

// sendmsg now, and nothing more: what the socket took (the transport keeps the rest, and a failure
// meets that rest's write, which reports it).
std::size_t AsioStream::write_some_now(ConstBytes first, ConstBytes second, ConstBytes third) {
  if (!socket_.is_open()) return 0;
  const ssize_t n = send_pieces(socket_.native_handle(), first, second, third);
  return n > 0 ? static_cast<std::size_t>(n) : 0;
}

// sendmsg now; true when it took everything. Otherwise the stream reports on_written later itself (a
// failure through the ready queue, the rest once the reactor says the socket has room).
bool AsioStream::write_now(ConstBytes first, ConstBytes second, ConstBytes third) {
  std::array<ConstBytes, 3> parts{first, second, third};
  const std::size_t total = first.size + second.size + third.size;
  std::size_t sent = 0;
  std::error_code failed;
  if (socket_.is_open()) {
    const ssize_t n = send_pieces(socket_.native_handle(), first, second, third);
    if (n >= 0) {
      sent = static_cast<std::size_t>(n);
    } else if (!would_block(errno)) {
      failed = system_error(errno);
    }
  } else {
    failed = asio::error::bad_descriptor;
  }
  if (failed) {
    loop_.post([self = shared_from_this(), failed] { self->report_written(failed); });
    return false;
  }
  if (sent == total) return true;
  // The socket's buffer is full: the rest goes when the reactor says it has room.
  std::array<asio::const_buffer, 3> rest;
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const std::size_t skip = std::min(sent, parts[i].size);
    sent -= skip;
    rest[i] = asio::buffer(static_cast<const std::byte*>(parts[i].data) + skip, parts[i].size - skip);
  }
  const std::size_t left = asio::buffer_size(rest);
  asio::async_write(socket_, rest, TransferAtLeast{left, left},
                    [self = shared_from_this()](const std::error_code& ec, std::size_t) { self->report_written(ec); });
  return false;
}

void AsioStream::read(void* dst, std::size_t min, std::size_t cap) {
  read_dst_ = static_cast<std::byte*>(dst);
  read_min_ = min;
  read_cap_ = cap;
  loop_.before_kernel_poll([self = shared_from_this()] { return self->try_read(); });
}

void AsioStream::report_written(const std::error_code& ec) {
  if (alive_.expired()) return;
  events_->on_written(peer_, ec);
}

void AsioStream::report_read(const std::error_code& ec, std::size_t bytes) {
  if (alive_.expired()) return;
  events_->on_read(peer_, ec, bytes);
}

bool AsioStream::try_read() {
  if (alive_.expired()) return false;
  if (!socket_.is_open()) {  // closed before the try: the read ends as Asio's would
    report_read(asio::error::operation_aborted, 0);
    return true;
  }
  const ssize_t n = ::recv(socket_.native_handle(), read_dst_, read_cap_, MSG_DONTWAIT);
  if (n < 0 && !would_block(errno)) {
    report_read(system_error(errno), 0);
    return true;
  }
  if (n == 0 && read_cap_ > 0) {
    report_read(asio::error::eof, 0);
    return true;
  }
  const std::size_t got = n > 0 ? static_cast<std::size_t>(n) : 0;
  if (got >= read_min_) {
    report_read({}, got);
    return true;
  }
  // Nothing (or not enough) yet: the reactor waits for the rest.
  asio::async_read(socket_, asio::buffer(read_dst_ + got, read_cap_ - got), TransferAtLeast{read_min_ - got, read_cap_ - got},
                   [self = shared_from_this(), got](const std::error_code& ec, std::size_t more) { self->report_read(ec, got + more); });
  return false;
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

std::shared_ptr<Stream> make_asio_stream(Loop& loop, asio::ip::tcp::socket socket, StreamEvents* events, int peer,
                                         std::weak_ptr<bool> alive) {
  return std::make_shared<AsioStream>(loop, std::move(socket), events, peer, std::move(alive));
}

}  // namespace weft
