#pragma once
// The keys of one connection's frame MACs (Options::integrity = hmac), one per direction. The rendezvous
// derives them while greeting a peer (rendezvous/greeting.cpp); the framed transport seals and checks
// frames with them (transports/framed/integrity.hpp). Plain data in core, so that neither plane
// includes the other.
#include <array>
#include <cstddef>

namespace weft {

struct FrameKeys {
  std::array<std::byte, 32> send{};
  std::array<std::byte, 32> recv{};
};

}  // namespace weft
