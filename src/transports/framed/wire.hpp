#pragma once
// The frame header of weft's wire protocol (docs/PROTOCOL.md). 48 bytes, little-endian, fixed layout.
#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>

#include "core/bytes.hpp"

namespace weft::wire {

inline constexpr std::uint32_t magic = 0x54464557;  // "WEFT" read as little-endian bytes
inline constexpr std::uint16_t version = 2;  // 2: data frames carry the operation's signature
inline constexpr std::size_t header_size = 48;
/// Upper bound on the payload of control frames (every kind but data); a larger one is a protocol error.
inline constexpr std::uint64_t max_control_payload = 64 * 1024;

enum class FrameKind : std::uint8_t {
  data = 0,       // a message: payload is the user's bytes
  abort = 1,      // a context is aborted: payload is the reason (UTF-8)
  // 2 and 3 were the hello and its answer of protocol 1 (the greeting, src/group/greeting.hpp, opens
  // connections now): refused as unknown kinds.
  heartbeat = 4,  // reserved for failure detection
  goodbye = 5,    // the sender is leaving normally: nothing more follows on this connection
  query = 6,      // how far are you in `context`? (seq: the operation asked about; no payload)
  progress = 7,   // the answer: `seq` as asked, `tag` the latest operation the sender started there,
                  // `call` and `count` its signature of `seq`, `flags` the plan it runs `seq` with
  cancel = 8,     // operation (context, seq) is cancelled: payload is the reason (UTF-8)
};

struct Header {
  FrameKind kind = FrameKind::data;
  std::uint8_t flags = 0;  // data frames and progress answers: the signature's plan (OpSignature::plan)
  std::uint32_t context = 0;
  std::uint64_t seq = 0;
  std::uint64_t tag = 0;
  std::uint64_t bytes = 0;  // payload length; may exceed 4 GiB
  // The signature of the operation a data frame belongs to (OpSignature; 0 elsewhere).
  std::uint32_t call = 0;
  std::uint64_t count = 0;
};

using HeaderBytes = std::array<std::byte, header_size>;

void encode(const Header& header, HeaderBytes& out) noexcept;
/// Returns the header, or nullopt with `error` set when magic or version are wrong.
std::optional<Header> decode(const HeaderBytes& in, std::string& error);

// The short form of a data frame's header (docs/PROTOCOL.md, "Short frames"): 24 bytes, for a stream that
// carries each frame in a record of its own and so knows the payload's length without the header (shared
// memory). Half the long form: on a ring a message of up to 32 bytes then takes one cache line with its
// headers, where the long form put 16-32 bytes on two.
// Layout: 0 flags u8 | 1 zero u8 | 2 zero u16 | 4 context u32 | 8 call u32 | 12 count u32 | 16 seq u32 | 20 tag u32
inline constexpr std::size_t short_header_size = 24;
using ShortHeaderBytes = std::array<std::byte, short_header_size>;
/// Whether `header` has a short form: a data frame whose seq, tag and count fit 32 bits. (Inline, with
/// encode_short: both lie on every small shared-memory send's path.)
inline bool has_short_form(const Header& h) noexcept {
  return h.kind == FrameKind::data && h.seq <= UINT32_MAX && h.tag <= UINT32_MAX && h.count <= UINT32_MAX;
}
/// The short form of a header has_short_form accepted, into the short_header_size bytes at `out` (a
/// shared-memory ring's record, written in place).
inline void encode_short(const Header& h, std::byte* out) noexcept {
  le::put_u32(out + 0, h.flags);
  le::put_u32(out + 4, h.context);
  le::put_u32(out + 8, h.call);
  le::put_u32(out + 12, static_cast<std::uint32_t>(h.count));
  le::put_u32(out + 16, static_cast<std::uint32_t>(h.seq));
  le::put_u32(out + 20, static_cast<std::uint32_t>(h.tag));
}
inline void encode_short(const Header& h, ShortHeaderBytes& out) noexcept { encode_short(h, out.data()); }
/// Whether a short form's zero bytes are zero (else the stream names the failure: shm's
/// RingError::bad_short_header).
inline bool short_form_well_formed(const ShortHeaderBytes& in) noexcept { return le::get_u32(in.data()) <= 0xff; }
/// The data frame's header a well-formed short form and its payload's length (`bytes`) say. Inline: it
/// lies on every small shared-memory message's path between its arrival and its receive (and returned
/// by value, it is made in place: shm's offered frames, shm_stream.cpp).
inline Header decode_well_formed_short(const ShortHeaderBytes& in, std::uint64_t bytes) noexcept {
  const std::byte* p = in.data();
  Header h;
  h.kind = FrameKind::data;
  h.flags = static_cast<std::uint8_t>(p[0]);
  h.context = le::get_u32(p + 4);
  h.call = le::get_u32(p + 8);
  h.count = le::get_u32(p + 12);
  h.seq = le::get_u32(p + 16);
  h.tag = le::get_u32(p + 20);
  h.bytes = bytes;
  return h;
}
/// The same, or nullopt when the short form is not well formed.
inline std::optional<Header> decode_short(const ShortHeaderBytes& in, std::uint64_t bytes) noexcept {
  if (!short_form_well_formed(in)) return std::nullopt;
  return decode_well_formed_short(in, bytes);
}

}  // namespace weft::wire
