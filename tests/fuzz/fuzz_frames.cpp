// libFuzzer harness: the peer protocol's frame reader. The input is what "rank 1" sends: a FramedTransport of
// rank 0 reads it through an in-memory Stream, in chunks of varying size, with a few receives posted (their
// keys, sizes and signatures from the input's first bytes). Whatever the bytes, nothing may crash, every
// allocation stays bounded (early messages: 1 MiB here), and once the stream ends every receive must have
// completed (nothing hangs). Sealed frames (WEFT_INTEGRITY) are read too: the header check and trailer
// paths must hold the same promises.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "core/log.hpp"
#include "transports/framed/framed_transport.hpp"
#include "weft/loop.hpp"

using namespace weft;

namespace {

class MemoryStream final : public Stream {
 public:
  MemoryStream(asio::io_context& io, StreamEvents* events, int peer, std::weak_ptr<bool> alive, const std::uint8_t* data,
               std::size_t size, std::size_t chunk)
      : io_(io), events_(events), peer_(peer), alive_(std::move(alive)), data_(data), size_(size), chunk_(chunk) {}
  std::string_view backend() const noexcept override { return "memory"; }
  int native_handle() const noexcept override { return -1; }
  void write(ConstBytes, ConstBytes, ConstBytes) override { deliver([](StreamEvents* e, int peer) { e->on_written(peer, {}); }); }
  void read(void* dst, std::size_t min, std::size_t cap) override {
    if (closed_) {
      deliver([](StreamEvents* e, int peer) { e->on_read(peer, asio::error::operation_aborted, 0); });
      return;
    }
    const std::size_t left = size_ - offset_;
    std::size_t n = std::min({cap, left, std::max(min, chunk_)});
    std::memcpy(dst, data_ + offset_, n);
    offset_ += n;
    const std::error_code ec = n < min ? std::error_code(asio::error::eof) : std::error_code();
    deliver([ec, n](StreamEvents* e, int peer) { e->on_read(peer, ec, n); });
  }
  void write_blocking(const void*, std::size_t) override {}
  void shutdown_send() override {}
  void close() override { closed_ = true; }

 private:
  template <class Fn>
  void deliver(Fn fn) {
    asio::post(io_, [events = events_, peer = peer_, alive = alive_, fn] {
      if (!alive.expired()) fn(events, peer);
    });
  }
  asio::io_context& io_;
  StreamEvents* events_;
  int peer_;
  std::weak_ptr<bool> alive_;
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t offset_ = 0;
  std::size_t chunk_;
  bool closed_ = false;
};

void drain(asio::io_context& io) {
  while (io.poll() > 0) {
  }
  io.restart();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static asio::io_context io;
  static Loop loop(io);
  // Every refused stream is logged as a warning: at thousands of runs a second that is most of the time.
  static const bool quiet = [] {
    log().set_level(spdlog::level::off);
    return true;
  }();
  (void)quiet;
  if (size < 2) return 0;
  // Byte 0: how many receives (bits 0-1), frame integrity (bits 2-3: off, crc32c, hmac with a zero key,
  // off) and the read chunk (bits 4-7); then 6 bytes per receive; the rest is the stream.
  const int receives = data[0] % 4;
  const auto integrity = std::array{Integrity::off, Integrity::crc32c, Integrity::hmac, Integrity::off}[(data[0] >> 2) & 3];
  const std::size_t chunk = std::size_t{1} << (data[0] >> 4);  // 1 byte to 32 KiB per read
  struct Receive {
    std::size_t bytes;
    MessageKey key;
    OpSignature signature;
  };
  std::vector<Receive> wanted;
  std::size_t at = 1;
  for (int i = 0; i < receives && at + 6 <= size; ++i, at += 6) {
    const std::size_t bytes = (static_cast<std::size_t>(data[at]) | (static_cast<std::size_t>(data[at + 1]) << 8)) % 4096;
    wanted.push_back(Receive{bytes, MessageKey{1, data[at + 2], data[at + 3]},
                             OpSignature{.call = static_cast<std::uint32_t>(data[at + 4]) << 27, .count = data[at + 5]}});
  }
  const std::uint8_t* stream_data = data + at;
  const std::size_t stream_size = size - at;

  std::vector<asio::ip::tcp::socket> sockets;
  sockets.emplace_back(io);
  sockets.emplace_back(io);
  auto transport = std::make_unique<FramedTransport>(
      loop, 0, 2, std::move(sockets), "memory",
      [&](asio::ip::tcp::socket, StreamEvents* events, int peer, std::weak_ptr<bool> alive) {
        return std::make_shared<MemoryStream>(io, events, peer, std::move(alive), stream_data, stream_size, chunk);
      });
  transport->set_early_limit(std::size_t{1} << 20);
  transport->seal_frames(integrity, {FrameKeys{}, FrameKeys{}});
  transport->open_context(1, {0, 1});
  struct Posted {
    TransportOp op;
    std::vector<std::byte> buffer;
  };
  std::vector<std::unique_ptr<Posted>> posted;
  for (const Receive& r : wanted) {
    auto p = std::make_unique<Posted>();
    p->buffer.resize(r.bytes);
    p->op.signature = r.signature;
    transport->start_recv(1, r.key, p->buffer.data(), r.bytes, p->op);
    posted.push_back(std::move(p));
  }
  drain(io);
  for (const auto& p : posted) {
    if (!p->op.done()) __builtin_trap();  // the stream ended: every receive must have completed
  }
  transport.reset();
  drain(io);
  return 0;
}
