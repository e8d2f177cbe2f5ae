// Membership: split() and shrink() make new groups from this one. Both derive their child through
// child_of (the loop, the transport, the options and the algorithm selection inherited alike) and a
// context id from derive_context.
#include "weft/group.hpp"

#include <algorithm>
#include <cstring>
#include <deque>
#include <memory>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/log.hpp"
#include "group/checks.hpp"
#include "group/staging.hpp"
#include "group/state.hpp"

namespace weft {
namespace {

using namespace detail;

std::uint32_t derive_context(std::uint32_t parent, std::uint64_t seq, int color) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::uint64_t v : {static_cast<std::uint64_t>(parent), seq, static_cast<std::uint64_t>(static_cast<std::uint32_t>(color))}) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  }
  auto c = static_cast<std::uint32_t>(h ^ (h >> 32));
  return c < 2 ? c + 2 : c;  // 0 is unused, 1 is the world
}

// A group made from `parent` (split, shrink) inherits everything but its members and context: the loop,
// the transport and its connections, the options, and the algorithm selection (the built-in table with
// WEFT_TUNING, WEFT_ALGO, Options::algorithms and override_algorithms applied).
std::shared_ptr<GroupState> child_of(const GroupState& parent) {
  auto child = std::make_shared<GroupState>();
  child->watch_loop_end(parent.loop);
  child->transport = parent.transport;
  child->options = parent.options;
  child->selection = parent.selection;
  child->on_my_host = parent.on_my_host;
  return child;
}

Task<Group> split_task(std::shared_ptr<GroupState> g, std::uint64_t seq, int color, int key) {
  // Everybody learns everybody's (color, key) through an all-gather on this group.
  std::vector<std::int32_t> mine{color, key};
  std::vector<std::int32_t> all(static_cast<std::size_t>(2 * g->size));
  copy_bytes(all.data() + 2 * g->rank, mine.data(), 2 * sizeof(std::int32_t));
  const auto blocks = algo::blocks_of(2 * static_cast<std::size_t>(g->size), g->size);
  const auto plan = algo::ring_all_gather(g->size, g->rank, blocks, -1);
  auto* bytes = reinterpret_cast<std::byte*>(all.data());
  co_await g->run(plan, seq, Collective::split, algo::PlanBuffers{bytes, bytes, DType::i32, ReduceOp::sum}, {});
  if (color < 0) co_return Group();
  std::vector<std::pair<std::pair<int, int>, int>> chosen;  // ((key, parent rank), parent rank)
  for (int r = 0; r < g->size; ++r) {
    if (all[static_cast<std::size_t>(2 * r)] == color) chosen.push_back({{all[static_cast<std::size_t>(2 * r + 1)], r}, r});
  }
  std::sort(chosen.begin(), chosen.end());
  auto child = child_of(*g);
  child->context = derive_context(g->context, seq, color);
  child->set_size(static_cast<int>(chosen.size()));
  for (int i = 0; i < child->size; ++i) {
    const int parent_rank = chosen[static_cast<std::size_t>(i)].second;
    if (parent_rank == g->rank) child->rank = i;
    child->members.push_back(g->members[static_cast<std::size_t>(parent_rank)]);
  }
  child->place();
  child->transport->open_context(child->context, child->members);
  co_return Group(std::move(child));
}

// ---------------------------------------------------------------- shrink

// The survivors agree on who they are, in rounds: each rank sends the set of members it still reaches
// (its view) to every member of that view and receives theirs; a member that fails, does not answer within
// `patience` (its connection is then closed) or leaves this rank out is dropped, and the view becomes the
// intersection of the views received. When a round changes nothing for anybody, every rank of the view
// holds the same view (failures during the shrink itself aside: docs/RELIABILITY.md), and it becomes the
// new group, ordered as in this one, with a context derived from the view.
Task<Group> shrink_task(std::shared_ptr<GroupState> g, std::uint64_t index) {
  const int p = g->size;
  const auto me = static_cast<std::size_t>(g->rank);
  const std::uint32_t exchange = derive_context(g->context, (std::uint64_t{1} << 62) | index, -2);
  const auto patience = std::clamp<std::chrono::milliseconds>(
      g->options.timeout.count() > 0 ? g->options.timeout : std::chrono::milliseconds(30'000), std::chrono::milliseconds(100),
      std::chrono::milliseconds(30'000));
  std::vector<std::uint8_t> view(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) view[static_cast<std::size_t>(r)] = g->transport->connected(g->members[static_cast<std::size_t>(r)]) ? 1 : 0;

  struct Peer {
    int rank = -1;
    TransportOp send;
    TransportOp recv;
    std::vector<std::uint8_t> theirs;
  };
  struct Round {
    std::deque<Peer> peers;  // a deque: the TransportOps must not move
    std::vector<std::uint8_t> view;
  };
  for (std::uint64_t round = 0;; ++round) {
    auto state = std::make_shared<Round>();
    state->view = view;
    for (int r = 0; r < p; ++r) {
      if (r == g->rank || !view[static_cast<std::size_t>(r)]) continue;
      Peer& x = state->peers.emplace_back();
      x.rank = r;
      x.theirs.assign(static_cast<std::size_t>(p), 0);
      const MessageKey key{exchange, 0, round};
      const int peer = g->members[static_cast<std::size_t>(r)];
      g->transport->start_send(peer, key, state->view.data(), state->view.size(), x.send);
      g->transport->start_recv(peer, key, x.theirs.data(), x.theirs.size(), x.recv);
    }
    // A member may still be in the previous round, waiting out its own patience for a member that this
    // rank already dropped (it saw that member's connection close first): round r waits r + 1 patiences,
    // so that a live member one round behind is not taken for a silent one. (With a single patience a
    // rank in round 1 gave up on a peer ~0.1 ms before that peer's round-1 view came.)
    const auto round_patience = patience * static_cast<long>(round + 1);
    const auto timer = g->loop->call_after(round_patience, [g, state, round_patience](bool fired) {
      if (!fired) return;
      for (Peer& x : state->peers) {
        if (x.recv.done()) continue;
        g->transport->disconnect(g->members[static_cast<std::size_t>(x.rank)],
                                 fmt::format("left out by shrink on rank {}: no answer within {} ms", g->rank, round_patience.count()));
      }
    });
    for (Peer& x : state->peers) {
      co_await x.recv.wait();
      co_await x.send.wait();
    }
    g->loop->cancel_timer(timer);

    std::vector<std::uint8_t> next = view;
    bool everybody_agrees = true;
    for (Peer& x : state->peers) {
      const auto r = static_cast<std::size_t>(x.rank);
      if (x.recv.error() || x.send.error() || !x.theirs[me]) {
        next[r] = 0;
        everybody_agrees = false;
      }
    }
    for (Peer& x : state->peers) {
      if (!next[static_cast<std::size_t>(x.rank)]) continue;
      everybody_agrees = everybody_agrees && x.theirs == view;
      for (std::size_t i = 0; i < next.size(); ++i) next[i] = next[i] && x.theirs[i];
    }
    next[me] = 1;
    if (everybody_agrees && next == view) break;
    view = std::move(next);
  }

  auto child = child_of(*g);
  std::uint64_t fingerprint = 0;
  for (int r = 0; r < p; ++r) {
    if (!view[static_cast<std::size_t>(r)]) continue;
    if (r == g->rank) child->rank = static_cast<int>(child->members.size());
    child->members.push_back(g->members[static_cast<std::size_t>(r)]);
    fingerprint = fingerprint * 1099511628211ull + static_cast<std::uint64_t>(r) + 1;
  }
  child->set_size(static_cast<int>(child->members.size()));
  child->context = derive_context(exchange, fingerprint, child->size);
  child->place();
  child->transport->open_context(child->context, child->members);
  log().info("rank {}: shrink: a group of {} from {} (this rank is {} there)", g->rank, child->size, p, child->rank);
  co_return Group(std::move(child));
}

}  // namespace

Future<Group> Group::shrink() {
  auto& g = live("shrink");
  return spawn(*g.loop, shrink_task(state_, g.shrinks.fetch_add(1)));
}

Future<Group> Group::split(int color, int key) {
  auto& g = live("split");
  check_usable(g, "split");
  return spawn(*g.loop, split_task(state_, take_seq(g, timeout_), color, key));
}

}  // namespace weft
