#pragma once
// The io_uring backend of Stream: the operations (writes, reads, the multishot receive) of one
// connection, run on a UringRing (uring_ring.hpp). Small frames arrive through one multishot receive per
// connection into a ring of provided buffers; large payloads are received straight into the caller's
// memory.
#include <cstdint>
#include <deque>
#include <memory>
#include <string_view>

#include <asio.hpp>

#include "transports/framed/stream.hpp"
#include "transports/uring/uring_ring.hpp"

namespace weft {

class UringStream final : public Stream, public std::enable_shared_from_this<UringStream> {
 public:
  /// Takes over `socket`'s descriptor.
  UringStream(asio::ip::tcp::socket socket, std::shared_ptr<UringRing> ring, StreamEvents* events, int peer,
              std::weak_ptr<bool> alive);
  ~UringStream() override;

  std::string_view backend() const noexcept override { return "uring"; }
  int native_handle() const noexcept override { return fd_; }
  std::byte* staging(std::size_t bytes) override;
  void write(ConstBytes first, ConstBytes second, ConstBytes third) override;
  void read(void* dst, std::size_t min, std::size_t cap) override;
  void write_blocking(const void* data, std::size_t size) override;
  void shutdown_send() override;
  void close() override;

 private:
  struct Writer final : UringRequest {
    UringStream* stream = nullptr;
    iovec iov[3]{};
    msghdr msg{};
    std::size_t left = 0;
    // Zero-copy: every SENDMSG_ZC that reports bytes sent also reports, later, a notification when the
    // kernel is done with the pages. The write is done (and its buffer reusable) only after both.
    bool zero_copy = false;
    int notifications_due = 0;
    bool sent_all = false;
    std::error_code failure;
    void finish_if_done();
    std::shared_ptr<UringStream> keep;  // the stream lives while its request is in the kernel
    void complete(int result, std::uint32_t flags) override;
    void submit();
  };
  // The read asked for (one at a time), served from landed bytes first, then by a direct receive.
  struct Reader final : UringRequest {
    UringStream* stream = nullptr;
    bool wanted = false;     // a read is asked for and not answered yet
    // A direct receive is under way, until its completion has run. (in_kernel says when the kernel is
    // done, which is earlier: other completions of the same batch may run in between.)
    bool receiving = false;
    std::byte* dst = nullptr;
    std::size_t got = 0;
    std::size_t min = 0;
    std::size_t cap = 0;
    std::shared_ptr<UringStream> keep;
    void complete(int result, std::uint32_t flags) override;
    void submit();
  };
  // The multishot receive: while armed, every arrival lands in a provided buffer of the ring.
  struct Multishot final : UringRequest {
    UringStream* stream = nullptr;
    bool armed = false;  // until its last completion has run (see Reader::receiving)
    bool cancelling = false;
    bool seen_data = false;  // an EINVAL after data is an error, not a missing feature
    std::shared_ptr<UringStream> keep;
    void complete(int result, std::uint32_t flags) override;
  };
  struct Landed {  // received bytes not taken yet, in a provided buffer
    std::uint16_t buffer;
    std::uint32_t offset;
    std::uint32_t size;
  };
  // A read whose remainder is at least this big is received directly into its destination (the
  // multishot receive is stopped first, so that the bytes keep their order); smaller ones are served
  // from the provided buffers.
  static constexpr std::size_t direct_bytes = 16 << 10;
  // Moves the read along: landed bytes, then the multishot or a direct receive. `from_completion`: may
  // answer at once (else through the loop's queue: read() must not answer inline).
  void serve(bool from_completion);
  static constexpr int direct_after_large = 16;
  int direct_reads_left_ = 0;
  void take_landed();      // copies landed bytes into the read
  void arm_multishot();
  void answer_read(const std::error_code& ec);  // answers the read from the loop's queue
  void finish_read(const std::error_code& ec);  // answers it now (from a completion)
  void report_written(const std::error_code& ec);
  void report_read(const std::error_code& ec, std::size_t n);

  int fd_ = -1;
  bool closed_ = false;
  bool loopback_peer_ = false;
  std::shared_ptr<UringRing> ring_;
  StreamEvents* events_;
  int peer_;
  std::weak_ptr<bool> alive_;
  Writer writer_;
  Reader reader_;
  Multishot multishot_;
  std::deque<Landed> landed_;
  std::byte* staging_ = nullptr;  // a slot of the ring's registered staging, while this stream has one
  std::error_code receive_end_;  // how the connection's receiving side ended (end of stream, an error)
  bool out_of_buffers_ = false;  // the multishot receive ran out of buffers: this read goes direct
};

}  // namespace weft
