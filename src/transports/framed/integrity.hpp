#pragma once
// Frame integrity (Options::integrity, WEFT_INTEGRITY): a trailer after every frame's payload that lets
// the receiver tell that the frame's bytes are the bytes that were sent.
//   crc32c: 4 bytes, CRC-32C (Castagnoli) of header and payload: catches corruption (a flipped bit, a
//           memory or NIC fault that TCP's 16-bit checksum let through), not an attacker.
//   hmac:   16 bytes, HMAC-SHA256 truncated, keyed per connection and direction from the shared secret
//           and both greetings' nonces, over a frame counter, the header and the payload: catches
//           corruption, forged bytes and replayed or dropped frames. Needs a shared secret.
// docs/PROTOCOL.md, "Integrity".
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>

#include "core/frame_keys.hpp"
#include "weft/options.hpp"

namespace weft {

/// CRC-32C of `size` bytes, continuing from `crc` (0 to start). SSE4.2's crc32 instruction where the CPU
/// has it, else a table.
std::uint32_t crc32c(std::uint32_t crc, const void* data, std::size_t size) noexcept;
/// The table version (tests compare the two).
std::uint32_t crc32c_portable(std::uint32_t crc, const void* data, std::size_t size) noexcept;


/// The trailer of one direction of one connection: begin() a frame, update() with its bytes in order,
/// then seal() (sending) or check() (receiving). Frames are counted, so that with hmac a frame replayed,
/// dropped or reordered fails too.
class FrameSeal {
 public:
  static constexpr std::size_t max_trailer = 16;
  FrameSeal();  // off
  /// Errors: std::runtime_error when OpenSSL cannot make an HMAC.
  FrameSeal(Integrity mode, const std::array<std::byte, 32>& key);
  ~FrameSeal();
  FrameSeal(FrameSeal&&) noexcept;
  FrameSeal& operator=(FrameSeal&&) noexcept;

  bool on() const noexcept { return mode_ != Integrity::off; }
  Integrity mode() const noexcept { return mode_; }
  /// Bytes the trailer takes: 0, 4 or 16.
  std::size_t trailer_size() const noexcept;
  void begin();
  void update(const void* data, std::size_t size);
  /// Writes the trailer of the frame begun (trailer_size() bytes).
  void seal(std::byte* out);
  /// Whether `trailer` is the trailer of the frame begun (compared in constant time).
  bool check(const std::byte* trailer);
  /// Frames sealed or checked so far.
  std::uint64_t frames() const noexcept { return frames_; }

 private:
  void finish(std::byte* out);
  Integrity mode_ = Integrity::off;
  std::uint32_t crc_ = 0;
  std::uint64_t frames_ = 0;
  struct Mac;
  std::unique_ptr<Mac> mac_;
};

}  // namespace weft
