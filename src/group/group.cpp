// Group's public face: the handle, its views (with_timeout), abort, and what it answers about itself.
// The operations live in their rooms: create.cpp, p2p.cpp, collectives.cpp, membership.cpp; the state
// they share in state.hpp, its deadlines in watchdog.cpp.
#include "weft/group.hpp"

#include <algorithm>
#include <thread>

#include <fmt/format.h>

#include "algorithms/registry.hpp"
#include "core/loop_users.hpp"
#include "group/checks.hpp"
#include "group/state.hpp"
#include "transports/shm/arena.hpp"

namespace weft {

algo::Placement detail::GroupState::placement() const {
  // Read once: glibc asks /sys for the count, three system calls, on a path every new call shape takes.
  static const unsigned cores = std::thread::hardware_concurrency();
  return algo::Placement{arena != nullptr, across_hosts, arena != nullptr && cores > 0 && static_cast<unsigned>(size) > cores,
                         arena != nullptr && arena->direct_from() != 0};
}

namespace {
void hold(detail::GroupState& g) {
  detail::loop_user_added(*g.loop);
  g.handles.fetch_add(1, std::memory_order_relaxed);
}
// The last handle gone: what waits in the background on the group arena for this group stops waiting
// (state.hpp, `unheld`), looked at on the loop.
void release(const std::shared_ptr<detail::GroupState>& g) {
  detail::loop_user_removed(*g->loop);
  if (g->handles.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  g->unheld.store(true, std::memory_order_release);
  if (g->arena) {
    g->loop->post([weak = std::weak_ptr<detail::GroupState>(g)] {
      if (auto state = weak.lock(); state && state->arena) state->arena->poll();
    });
  }
}
}  // namespace

// Handles count as users of their loop (core/loop_users.hpp) and of their group; a move hands its
// counts over.
Group::Group(std::shared_ptr<detail::GroupState> state) : state_(std::move(state)) {
  if (state_) hold(*state_);
}
Group::Group(const Group& other) : state_(other.state_), timeout_(other.timeout_), stream_(other.stream_) {
  if (state_) hold(*state_);
}
Group& Group::operator=(const Group& other) {
  if (this != &other) *this = Group(other);
  return *this;
}
Group& Group::operator=(Group&& other) noexcept {
  if (this != &other) {
    if (state_) release(state_);
    state_ = std::move(other.state_);
    timeout_ = other.timeout_;
    stream_ = other.stream_;
  }
  return *this;
}
Group::~Group() {
  if (state_) release(state_);
}

detail::GroupState& Group::live(const char* op) const {
  if (!state_) {
    throw Error(Errc::invalid_argument, ErrorContext{.op = op},
                "this Group is empty (default-constructed, moved from, or what split() gave a rank with a negative "
                "color): it has no ranks to talk to");
  }
  return *state_;
}

void Group::override_algorithms(std::string_view spec) { live("override_algorithms").selection.override_with(spec, "override_algorithms"); }

std::string Group::algorithm_for(std::string_view collective, std::size_t bytes) const {
  const auto& g = live("algorithm_for");
  const auto known = collective_named(collective);
  if (!known) {
    throw Error(Errc::invalid_argument, ErrorContext{.rank = g.rank, .op = "algorithm_for"},
                fmt::format("'{}' is not a collective", collective));
  }
  const algo::Algorithm* chosen = g.selection.choose(*known, bytes, g.size, g.placement());
  return chosen ? std::string(chosen->name) : std::string();
}

int Group::rank() const noexcept { return state_ ? state_->rank : -1; }
int Group::size() const noexcept { return state_ ? state_->size : 0; }
std::string_view Group::transport_name() const noexcept { return state_ ? state_->transport->name() : std::string_view(); }
std::string_view Group::transport_to(int peer) const {
  const auto& g = live("transport_to");
  detail::check_rank(g, "transport_to", "peer", peer);
  return g.transport->backend_to(g.members[static_cast<std::size_t>(peer)]);
}
bool Group::has_shared_arena() const noexcept { return state_ && state_->arena != nullptr; }
Loop& Group::loop() const { return *live("loop").loop; }

Group Group::with_timeout(std::chrono::milliseconds timeout) const {
  detail::GroupState& g = live("with_timeout");
  // As Options::timeout: a negative one meant "none" (clamped to 0) and one past a year wrapped the
  // nanosecond deadline, both without a word.
  if (timeout.count() < 0 || timeout > max_duration) {
    throw Error(Errc::invalid_argument, ErrorContext{.rank = g.rank, .op = "with_timeout"},
                fmt::format("the timeout is {} ms: it must be 0 (no deadline) to {} ms (a year)", timeout.count(),
                            max_duration.count()));
  }
  Group view(state_);
  view.timeout_ = timeout;
  view.stream_ = stream_;
  return view;
}

Group Group::on(gpu::Stream& stream) const {
  live("on");
  Group view(state_);
  view.timeout_ = timeout_;
  view.stream_ = &stream;
  return view;
}

void Group::abort(const std::string& reason) {
  auto& g = live("abort");
  const std::string text = reason.empty() ? fmt::format("rank {} called abort()", g.rank)
                                          : fmt::format("rank {} called abort(): {}", g.rank, reason);
  g.mark_failed(text);
  g.loop->post([state = state_, text] { state->transport->abort_context(state->context, Errc::aborted, text); });
}

}  // namespace weft
