#pragma once
// The loop holds a memory source (a ShmHub, a group Arena, an io_uring ring) through this adapter, by a
// weak reference, so that the source goes with its owner (the transport, the group), not with the loop.
#include <cstddef>
#include <memory>

#include "weft/loop.hpp"

namespace weft::detail {

template <class Source>
struct WeakPoller final : Loop::Poller {
  std::weak_ptr<Source> source;
  explicit WeakPoller(std::weak_ptr<Source> s) : source(std::move(s)) {}
  std::size_t poll() override {
    auto s = source.lock();
    return s ? s->poll() : 0;
  }
  bool arm() override {
    auto s = source.lock();
    return s && s->arm();
  }
  void disarm() override {
    if (auto s = source.lock()) s->disarm();
  }
};

}  // namespace weft::detail
