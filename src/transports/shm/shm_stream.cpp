#include "transports/shm/shm_stream.hpp"
#include "transports/shm/weak_poller.hpp"

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <thread>
#include <utility>

#include <asio/error.hpp>

namespace weft {

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
  hub->poller_ = loop.add_poller(std::make_shared<shm::WeakPoller<ShmHub>>(hub));
  return hub;
}

ShmHub::~ShmHub() {
  loop_.remove_poller(poller_);
  loop_.unwatch(watch_);
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
      in_(static_cast<shm::RingControl*>(link_.inbound.data())),
      out_(static_cast<shm::RingControl*>(link_.outbound.data())),
      events_(events),
      peer_(peer),
      alive_(std::move(alive)),
      socket_(link_.socket) {}

ShmStream::~ShmStream() {
  if (socket_watch_) hub_->loop().unwatch(socket_watch_);
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
  write_ = Write{true, {first, second, third}, 0, 0};
  post_progress();  // completions never come inline from write()
}

void ShmStream::read(void* dst, std::size_t min, std::size_t cap) {
  read_ = Read{true, static_cast<std::byte*>(dst), min, cap, 0};
  post_progress();
}

bool ShmStream::push_write() {
  for (;;) {
    if (push_some()) return true;
    // A loop that does not spin now (asleep, or a borrowed io_context that weft never arms) must be
    // woken when room comes: say so, then look once more (the reader may have made room meanwhile).
    if (awake_ || !out_.arm_wait()) return false;
  }
}

bool ShmStream::push_some() {
  bool moved = false;
  while (write_.piece < 3) {
    const ConstBytes& piece = write_.pieces[write_.piece];
    if (write_.offset < piece.size) {
      const std::size_t n = out_.put(static_cast<const std::byte*>(piece.data) + write_.offset, piece.size - write_.offset);
      write_.offset += n;
      moved = moved || n > 0;
      if (write_.offset < piece.size) break;  // the ring is full
    }
    ++write_.piece;
    write_.offset = 0;
  }
  if (moved) {
    last_sent_ = std::chrono::steady_clock::now();
    if (out_.publish()) wake_peer();
  }
  return write_.piece == 3;
}

bool ShmStream::pull_read() {
  const std::size_t n = in_.take(read_.dst + read_.got, read_.cap - read_.got);
  read_.got += n;
  if (n > 0) last_received_ = std::chrono::steady_clock::now();
  // The peer may sleep waiting for room to write: wake it.
  if (n > 0 && in_.release()) wake_peer();
  return read_.got >= read_.min;
}

std::size_t ShmStream::progress() {
  if (closed_) return 0;
  std::size_t found = 0;
  if (write_.active) {
    std::error_code failed;
    bool done = false;
    if (peer_closed_) {
      failed = std::make_error_code(std::errc::broken_pipe);
    } else {
      done = push_write();
    }
    if (done || failed) {
      write_.active = false;
      out_.disarm_wait();
      ++found;
      if (!alive_.expired()) events_->on_written(peer_, failed);
      if (closed_) return found;
    }
  }
  if (read_.active) {
    const bool done = pull_read();
    if (done || peer_closed_) {
      read_.active = false;
      ++found;
      // The peer's end comes after what it wrote: a read that has its minimum completes first.
      const std::error_code ec = done ? std::error_code{} : std::error_code(asio::error::eof);
      if (!alive_.expired()) events_->on_read(peer_, ec, read_.got);
    }
  }
  return found;
}

std::optional<std::uint32_t> ShmStream::ms_since_data(bool received) const {
  const auto since = std::chrono::steady_clock::now() - (received ? last_received_ : last_sent_);
  return static_cast<std::uint32_t>(std::chrono::duration_cast<std::chrono::milliseconds>(since).count());
}

bool ShmStream::arm() {
  awake_ = false;
  const bool data = in_.arm();
  const bool room = write_.active && out_.arm_wait();
  // (A posted progress is the loop's own queue: it does not sleep past it.)
  return (read_.active && data) || room;
}

void ShmStream::disarm() {
  awake_ = true;
  in_.disarm();
  out_.disarm_wait();
}

void ShmStream::write_blocking(const void* data, std::size_t size) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  std::size_t done = 0;
  while (done < size && !peer_closed_ && std::chrono::steady_clock::now() < until) {
    const std::size_t n = out_.put(static_cast<const std::byte*>(data) + done, size - done);
    done += n;
    if (n == 0) std::this_thread::yield();
  }
  if (done > 0 && out_.publish()) wake_peer();
}

void ShmStream::shutdown_send() {
  if (!closed_) ::shutdown(socket_, SHUT_WR);
}

void ShmStream::close() {
  if (closed_) return;
  closed_ = true;
  if (socket_watch_) hub_->loop().unwatch(std::exchange(socket_watch_, 0));
  ::shutdown(socket_, SHUT_RDWR);
  // What is in flight ends with an error, reported from the loop (never inline).
  const bool reading = std::exchange(read_.active, false);
  const bool writing = std::exchange(write_.active, false);
  if (!reading && !writing) return;
  hub_->loop().post([events = events_, peer = peer_, alive = alive_, reading, writing] {
    if (alive.expired()) return;
    if (writing) events->on_written(peer, asio::error::operation_aborted);
    if (reading) events->on_read(peer, asio::error::operation_aborted, 0);
  });
}

}  // namespace weft
