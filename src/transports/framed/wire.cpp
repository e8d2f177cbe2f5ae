#include "transports/framed/wire.hpp"

#include <fmt/format.h>

#include "core/bytes.hpp"

namespace weft::wire {

using le::get_u32;
using le::get_u64;
using le::put_u32;
using le::put_u64;

// Layout: 0 magic u32 | 4 version u16 | 6 kind u8 | 7 flags u8 | 8 context u32 | 12 call u32 |
//         16 seq u64 | 24 tag u64 | 32 bytes u64 | 40 count u64
void encode(const Header& h, HeaderBytes& out) noexcept {
  std::byte* p = out.data();
  put_u32(p + 0, magic);
  p[4] = static_cast<std::byte>(version & 0xff);
  p[5] = static_cast<std::byte>(version >> 8);
  p[6] = static_cast<std::byte>(h.kind);
  p[7] = static_cast<std::byte>(h.flags);
  put_u32(p + 8, h.context);
  put_u32(p + 12, h.call);
  put_u64(p + 16, h.seq);
  put_u64(p + 24, h.tag);
  put_u64(p + 32, h.bytes);
  put_u64(p + 40, h.count);
}

std::optional<Header> decode(const HeaderBytes& in, std::string& error) {
  const std::byte* p = in.data();
  if (get_u32(p) != magic) {
    error = fmt::format("bad magic 0x{:08x} (expected 0x{:08x})", get_u32(p), magic);
    return std::nullopt;
  }
  const auto v = static_cast<std::uint16_t>(static_cast<unsigned>(p[4]) | (static_cast<unsigned>(p[5]) << 8));
  if (v != version) {
    error = fmt::format("protocol version {} (this build speaks {})", v, version);
    return std::nullopt;
  }
  const auto kind = static_cast<std::uint8_t>(p[6]);
  if (kind > static_cast<std::uint8_t>(FrameKind::cancel) || kind == 2 || kind == 3) {
    error = fmt::format("unknown frame kind {}", kind);
    return std::nullopt;
  }
  Header h;
  h.kind = static_cast<FrameKind>(kind);
  h.flags = static_cast<std::uint8_t>(p[7]);
  h.context = get_u32(p + 8);
  h.seq = get_u64(p + 16);
  h.tag = get_u64(p + 24);
  h.bytes = get_u64(p + 32);
  h.call = get_u32(p + 12);
  h.count = get_u64(p + 40);
  if (h.kind != FrameKind::data && h.bytes > max_control_payload) {
    error = fmt::format("control frame of {} bytes (limit {})", h.bytes, max_control_payload);
    return std::nullopt;
  }
  return h;
}

}  // namespace weft::wire
