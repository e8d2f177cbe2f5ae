#include "transports/uring/uring_stream.hpp"

#include <fcntl.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <utility>

#include <fmt/format.h>

#include "core/log.hpp"
#include "weft/error.hpp"

namespace weft {

// ---------------------------------------------------------------- a stream

namespace {
// The kernel ties an io_uring request to the thread that submitted it, and cancels what is still in
// flight when that thread ends. Under caller-driven progress any thread that waits on an operation
// submits (a user's short-lived thread that waited on one collective, then returned), so a receive
// posted for the next message came back ECANCELED and the connection was read as lost. A request this
// stream did not cancel (it cancels only when it closes, and the multishot receive when a read goes
// direct) is submitted again, from the thread that runs the loop now.
bool submitter_ended(int result, bool closed) noexcept { return result == -ECANCELED && !closed; }
}  // namespace

UringStream::UringStream(asio::ip::tcp::socket socket, std::shared_ptr<UringRing> ring, StreamEvents* events, int peer,
                         std::weak_ptr<bool> alive)
    : ring_(std::move(ring)), events_(events), peer_(peer), alive_(std::move(alive)) {
  std::error_code ec;
  const auto remote = socket.remote_endpoint(ec);
  loopback_peer_ = !ec && remote.address().is_loopback();
  fd_ = socket.release();
  // Asio left the descriptor non-blocking; io_uring waits for readiness itself, and the goodbye at
  // shutdown wants a blocking write.
  const int flags = ::fcntl(fd_, F_GETFL);
  if (flags >= 0) ::fcntl(fd_, F_SETFL, flags & ~O_NONBLOCK);
  writer_.stream = this;
  reader_.stream = this;
  multishot_.stream = this;
}

UringStream::~UringStream() {
  if (fd_ >= 0) ::close(fd_);
  if (staging_) ring_->give_back_staging(staging_);
}

std::byte* UringStream::staging(std::size_t bytes) {
  if (!staging_ && bytes <= UringRing::staging_bytes) staging_ = ring_->take_staging();
  return staging_;
}

void UringStream::write(ConstBytes first, ConstBytes second, ConstBytes third) {
  std::size_t parts = 0;
  for (const ConstBytes& part : {first, second, third}) {
    if (part.size) writer_.iov[parts++] = iovec{const_cast<void*>(part.data), part.size};
  }
  writer_.msg = msghdr{};
  writer_.msg.msg_iov = writer_.iov;
  writer_.msg.msg_iovlen = parts;
  writer_.left = first.size + second.size + third.size;
  const std::size_t zc = ring_->zero_copy_bytes(loopback_peer_);
  writer_.zero_copy = zc > 0 && second.size >= zc;
  writer_.notifications_due = 0;
  writer_.sent_all = false;
  writer_.failure = {};
  writer_.keep = shared_from_this();
  writer_.submit();
}

// A closed stream still answers through the ring (a no-op), so that the event comes from the loop's
// queue as a completion would, never inline.
void UringStream::Writer::submit() {
  io_uring_sqe* sqe = stream->ring_->prepare(this);
  if (stream->closed_) {
    io_uring_prep_nop(sqe);
  } else if (zero_copy) {
    io_uring_prep_sendmsg_zc(sqe, stream->fd_, &msg, MSG_NOSIGNAL);
  } else {
    io_uring_prep_sendmsg(sqe, stream->fd_, &msg, MSG_NOSIGNAL);
  }
}

void UringStream::Writer::finish_if_done() {
  if (!sent_all || notifications_due > 0) return;
  auto self = std::move(keep);
  stream->report_written(failure);
}

void UringStream::Writer::complete(int result, std::uint32_t flags) {
  if (flags & IORING_CQE_F_NOTIF) {  // the kernel let go of the pages of an earlier zero-copy send
    --notifications_due;
    finish_if_done();
    return;
  }
  // A zero-copy send that reports F_MORE still holds the pages: its notification comes later.
  if (flags & IORING_CQE_F_MORE) ++notifications_due;
  if (submitter_ended(result, stream->closed_)) {
    submit();
    return;
  }
  if (stream->closed_ || result < 0) {
    failure = stream->closed_ ? std::error_code(asio::error::operation_aborted) : std::error_code(-result, std::system_category());
    sent_all = true;
    finish_if_done();
    return;
  }
  auto sent = static_cast<std::size_t>(result);
  left -= sent;
  if (left == 0) {
    sent_all = true;
    finish_if_done();
    return;
  }
  // A short send: skip what went and send the rest.
  while (sent > 0 && msg.msg_iovlen > 0) {
    iovec& front = msg.msg_iov[0];
    const std::size_t step = std::min(sent, front.iov_len);
    front.iov_base = static_cast<std::byte*>(front.iov_base) + step;
    front.iov_len -= step;
    sent -= step;
    if (front.iov_len == 0) {
      ++msg.msg_iov;
      --msg.msg_iovlen;
    }
  }
  submit();
}

void UringStream::read(void* dst, std::size_t min, std::size_t cap) {
  reader_.wanted = true;
  reader_.dst = static_cast<std::byte*>(dst);
  reader_.got = 0;
  reader_.min = min;
  reader_.cap = cap;
  serve(false);
}

// Moves the read along; runs when a read is asked for and whenever the multishot receive reports. Bytes
// that landed come first; a small remainder waits for the multishot receive, a large one is received
// directly once the multishot receive has stopped (both at once could take each other's bytes).
void UringStream::serve(bool from_completion) {
  if (!reader_.wanted || reader_.receiving) return;  // a direct receive is under way
  auto answer = [&](const std::error_code& ec) {
    if (from_completion) {
      finish_read(ec);
    } else {
      answer_read(ec);
    }
  };
  if (closed_) {
    answer(asio::error::operation_aborted);
    return;
  }
  take_landed();
  if (reader_.got >= reader_.min) {
    answer({});
    return;
  }
  if (landed_.empty() && receive_end_) {
    answer(receive_end_);
    return;
  }
  // After a large read the next few go direct too: a multishot receive armed for the next header would
  // soak the following payloads up into the shared buffers (and stop, out of them) before the header is
  // even seen, costing a copy of each and a cancellation (bench/RESULTS.md).
  if (reader_.min - reader_.got >= direct_bytes) {
    direct_reads_left_ = direct_after_large;
  }
  const bool direct = !ring_->provided_buffers() || out_of_buffers_ || direct_reads_left_ > 0;
  if (!direct) {
    if (!multishot_.armed) arm_multishot();
    return;
  }
  if (multishot_.armed) {
    if (!multishot_.cancelling) {
      multishot_.cancelling = true;
      ring_->cancel(&multishot_);
    }
    return;  // its last completion serves the read again
  }
  if (direct_reads_left_ > 0) --direct_reads_left_;
  reader_.keep = shared_from_this();
  reader_.receiving = true;
  reader_.submit();
}

void UringStream::take_landed() {
  while (!landed_.empty() && reader_.got < reader_.cap) {
    Landed& l = landed_.front();
    const std::size_t n = std::min<std::size_t>(l.size, reader_.cap - reader_.got);
    std::memcpy(reader_.dst + reader_.got, ring_->buffer(l.buffer) + l.offset, n);
    reader_.got += n;
    l.offset += static_cast<std::uint32_t>(n);
    l.size -= static_cast<std::uint32_t>(n);
    if (l.size == 0) {
      ring_->recycle(l.buffer);
      landed_.pop_front();
    }
  }
}

void UringStream::arm_multishot() {
  io_uring_sqe* sqe = ring_->prepare(&multishot_);
  io_uring_prep_recv_multishot(sqe, fd_, nullptr, 0, 0);
  sqe->flags |= IOSQE_BUFFER_SELECT;
  sqe->buf_group = UringRing::buffer_group;
  multishot_.cancelling = false;
  multishot_.armed = true;
  multishot_.keep = shared_from_this();
}

void UringStream::Multishot::complete(int result, std::uint32_t flags) {
  UringStream& s = *stream;
  if (result > 0) {
    const auto id = static_cast<std::uint16_t>(flags >> IORING_CQE_BUFFER_SHIFT);
    if (s.closed_) {
      s.ring_->recycle(id);
    } else {
      s.landed_.push_back(Landed{id, 0, static_cast<std::uint32_t>(result)});
      seen_data = true;
    }
  }
  if (flags & IORING_CQE_F_MORE) {
    s.serve(true);
    return;
  }
  // Its last completion: the receive stopped (cancelled, out of buffers, end of stream, an error).
  auto self = std::move(keep);
  armed = false;
  cancelling = false;
  if (result == 0) {
    s.receive_end_ = asio::error::eof;
  } else if (result == -ENOBUFS) {
    s.out_of_buffers_ = true;  // this read is received directly; the next one tries the buffers again
  } else if (result == -EINVAL && !seen_data) {
    s.ring_->multishot_unsupported();
  } else if (result < 0 && result != -ECANCELED && !s.closed_) {  // cancelled: by close, by serve(), or submitter_ended
    s.receive_end_ = std::error_code(-result, std::system_category());
  }
  s.serve(true);
}

// A closed stream still answers through the ring (a no-op), so that the event comes from the loop's
// queue as a completion would, never inline.
void UringStream::Reader::submit() {
  io_uring_sqe* sqe = stream->ring_->prepare(this, UringRing::Flush::when_polled);
  if (stream->closed_) {
    io_uring_prep_nop(sqe);
  } else {
    // An SQE's length is 32 bits (and the kernel refuses more than INT_MAX): large payloads take turns.
    constexpr std::size_t most = std::size_t{1} << 30;
    const std::size_t size = std::min(cap - got, most);
    if (const int index = stream->ring_->fixed_index(dst + got, size); index >= 0) {
      // A socket reads like a receive without flags; its offset must be 0.
      io_uring_prep_read_fixed(sqe, stream->fd_, dst + got, static_cast<unsigned>(size), 0, index);
    } else {
      io_uring_prep_recv(sqe, stream->fd_, dst + got, size, 0);
    }
  }
}

void UringStream::Reader::complete(int result, std::uint32_t) {
  if (submitter_ended(result, stream->closed_)) {
    submit();
    return;
  }
  auto self = std::move(keep);
  receiving = false;
  if (stream->closed_) {
    stream->finish_read(asio::error::operation_aborted);
  } else if (result < 0) {
    stream->finish_read(std::error_code(-result, std::system_category()));
  } else if (result == 0) {
    stream->finish_read(asio::error::eof);
  } else {
    got += static_cast<std::size_t>(result);
    if (got >= min) {
      stream->finish_read({});
    } else {
      keep = std::move(self);
      receiving = true;
      submit();
    }
  }
}

void UringStream::finish_read(const std::error_code& ec) {
  reader_.wanted = false;
  out_of_buffers_ = false;
  report_read(ec, reader_.got);
}

// serve() may run inside read(): the answer goes through the loop's queue, as the Stream contract wants.
void UringStream::answer_read(const std::error_code& ec) {
  reader_.wanted = false;
  out_of_buffers_ = false;
  ring_->loop().post([weak = weak_from_this(), ec, n = reader_.got] {
    if (auto self = weak.lock()) self->report_read(ec, n);
  });
}

void UringStream::report_written(const std::error_code& ec) {
  if (alive_.expired()) return;
  events_->on_written(peer_, ec);
}

void UringStream::report_read(const std::error_code& ec, std::size_t n) {
  if (alive_.expired()) return;
  events_->on_read(peer_, ec, n);
}

void UringStream::write_blocking(const void* data, std::size_t size) {
  const auto* p = static_cast<const std::byte*>(data);
  while (size > 0 && !closed_) {
    const ssize_t n = ::send(fd_, p, size, MSG_NOSIGNAL);
    if (n <= 0) {
      if (n < 0 && errno == EINTR) continue;
      return;
    }
    p += n;
    size -= static_cast<std::size_t>(n);
  }
}

void UringStream::shutdown_send() {
  if (!closed_) ::shutdown(fd_, SHUT_WR);
}

// Requests in the kernel hold the socket open; shutting it down makes them finish (a receive sees the
// end, a send fails), and settling them makes sure the kernel no longer writes into a receive buffer
// that the caller may free as soon as this returns. Their completions report the close later.
void UringStream::close() {
  if (closed_) return;
  closed_ = true;
  ::shutdown(fd_, SHUT_RDWR);
  ring_->settle({&reader_, &writer_, &multishot_});
  for (const Landed& l : landed_) ring_->recycle(l.buffer);  // the ring's buffers serve its other streams
  landed_.clear();
  serve(false);  // a read waiting on the multishot receive hears of the close
}

}  // namespace weft
