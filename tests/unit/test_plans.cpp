// Plans checked without any I/O: every rank's script runs in a simulator with one FIFO mailbox per
// (sender, receiver) pair, as the executor's per-peer message order promises, and the result is compared
// with a reference. World sizes 1..16 and awkward counts (0, 1, p-1, p+1, primes).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <map>

#include <fmt/format.h>
#include <weft/weft.hpp>

#include "kernels/cpu/reduce.hpp"
#include "algorithms/messages.hpp"
#include "algorithms/registry.hpp"
#include "algorithms/selection.hpp"
#include "core/signature.hpp"

using namespace weft;
using namespace weft::algorithms;

namespace {

using Value = std::int64_t;

struct RankState {
  Plan plan;
  std::vector<Value> send;  // the send buffer
  std::vector<Value> recv;  // the receive buffer
  const Value* local = nullptr;  // PlanBuffers::local, if the plan reads its contribution from elsewhere
  bool send_is_recv = false;     // the send buffer is the receive buffer (sends see what arrived before)
  std::size_t next = 0;     // next step
  bool sent = false;        // the next step's own send went out already (it sends before it receives)
};

// Runs every rank's plan to the end; fails (returns a message) on a deadlock or a size disagreement.
std::string simulate(std::vector<RankState>& ranks) {
  const int p = static_cast<int>(ranks.size());
  std::map<std::pair<int, int>, std::deque<std::vector<Value>>> mailbox;
  auto reduce = kernels::find_reduce(DType::i64, ReduceOp::sum);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < p; ++r) {
      auto& st = ranks[static_cast<std::size_t>(r)];
      while (st.next < st.plan.size()) {
        const Step& s = st.plan[st.next];
        const bool receives = s.kind != StepKind::send;
        const bool sends_first = s.kind == StepKind::send || s.kind == StepKind::send_recv || s.kind == StepKind::send_recv_reduce;
        if (sends_first && !st.sent) {
          const auto& from = st.send_is_recv ? st.recv : st.send;
          mailbox[{r, s.send_to}].emplace_back(from.begin() + static_cast<std::ptrdiff_t>(s.send.offset),
                                               from.begin() + static_cast<std::ptrdiff_t>(s.send.offset + s.send.count));
          st.sent = true;
          progress = true;
        }
        if (receives) {
          auto& box = mailbox[{s.recv_from, r}];
          if (box.empty()) break;  // blocked: try the other ranks
        }
        if (receives) {
          auto& box = mailbox[{s.recv_from, r}];
          std::vector<Value> msg = std::move(box.front());
          box.pop_front();
          if (msg.size() != s.recv.count) {
            return fmt::format("rank {} step {} ({}) expected {} elements from rank {}, got {}", r, st.next,
                               to_string(s.kind), s.recv.count, s.recv_from, msg.size());
          }
          Value* dst = st.recv.data() + s.recv.offset;
          const bool reducing = s.kind == StepKind::recv_reduce || s.kind == StepKind::recv_reduce_send ||
                                s.kind == StepKind::send_recv_reduce;
          if (reducing) {
            const Value* mine = st.local ? st.local + s.recv.offset : dst;
            if (!msg.empty()) reduce(dst, mine, msg.data(), msg.size());
          } else if (!msg.empty()) {
            std::memcpy(dst, msg.data(), msg.size() * sizeof(Value));
          }
          if (s.kind == StepKind::recv_reduce_send || s.kind == StepKind::recv_copy_send) {
            mailbox[{r, s.send_to}].emplace_back(dst, dst + s.recv.count);
          }
        }
        ++st.next;
        st.sent = false;
        progress = true;
      }
    }
  }
  for (int r = 0; r < p; ++r) {
    const auto& st = ranks[static_cast<std::size_t>(r)];
    if (st.next < st.plan.size()) {
      return fmt::format("deadlock: rank {} stuck at step {} of {} ({} from rank {})", r, st.next, st.plan.size(),
                         to_string(st.plan[st.next].kind), st.plan[st.next].recv_from);
    }
  }
  for (const auto& [key, box] : mailbox) {
    if (!box.empty()) return fmt::format("{} message(s) from rank {} to rank {} were never received", box.size(), key.first, key.second);
  }
  return {};
}

Value input(int r, std::size_t i) { return static_cast<Value>(r) * 1000003 + static_cast<Value>(i) * 7 + 1; }
Value sum_over(int p, std::size_t i) {
  Value s = 0;
  for (int r = 0; r < p; ++r) s += input(r, i);
  return s;
}

std::vector<std::size_t> awkward_counts(int p) {
  return {0, 1, static_cast<std::size_t>(p > 1 ? p - 1 : 2), static_cast<std::size_t>(p + 1), 13, 97};
}

std::vector<Range> equal(int p, std::size_t count) {
  std::vector<Range> b;
  for (int i = 0; i < p; ++i) b.push_back(Range{static_cast<std::size_t>(i) * count, count});
  return b;
}

}  // namespace

TEST_CASE("ring and bidirectional ring all_reduce plans reduce every element on every rank", "[plans]") {
  for (auto build : {&ring_all_reduce, &bidirectional_ring_all_reduce}) {
    for (int p = 1; p <= 16; ++p) {
      for (std::size_t n : awkward_counts(p)) {
        for (bool out_of_place : {false, true}) {
          std::vector<std::vector<Value>> inputs(static_cast<std::size_t>(p));
          std::vector<RankState> ranks(static_cast<std::size_t>(p));
          for (int r = 0; r < p; ++r) {
            auto& in = inputs[static_cast<std::size_t>(r)];
            for (std::size_t i = 0; i < n; ++i) in.push_back(input(r, i));
            auto& st = ranks[static_cast<std::size_t>(r)];
            st.plan = build(p, r, n);
            st.send = in;
            // Out of place, the output starts as garbage and the plan reads the input through `local`.
            st.recv = out_of_place && p > 1 ? std::vector<Value>(n, -77) : in;
            if (out_of_place && p > 1) st.local = in.data();
          }
          INFO("p=" << p << " count=" << n << (out_of_place ? " out of place" : " in place"));
          REQUIRE(simulate(ranks) == "");
          for (int r = 0; r < p; ++r) {
            for (std::size_t i = 0; i < n; ++i) REQUIRE(ranks[static_cast<std::size_t>(r)].recv[i] == sum_over(p, i));
          }
        }
      }
    }
  }
}

TEST_CASE("recursive doubling, Rabenseifner and tree all_reduce plans reduce every element on every rank", "[plans]") {
  using Builder = Plan (*)(int, int, std::size_t);
  const std::pair<const char*, Builder> builders[] = {{"recursive_doubling", &recursive_doubling_all_reduce},
                                                      {"rabenseifner", &rabenseifner_all_reduce},
                                                      {"tree", &tree_all_reduce}};
  for (auto [name, build] : builders) {
    for (int p = 1; p <= 16; ++p) {
      for (std::size_t n : awkward_counts(p)) {
        INFO(name << " p=" << p << " count=" << n);
        std::vector<RankState> ranks(static_cast<std::size_t>(p));
        for (int r = 0; r < p; ++r) {
          auto& st = ranks[static_cast<std::size_t>(r)];
          st.plan = build(p, r, n);
          st.send_is_recv = true;  // these run in place
          for (std::size_t i = 0; i < n; ++i) st.recv.push_back(input(r, i));
        }
        REQUIRE(simulate(ranks) == "");
        for (int r = 0; r < p; ++r) {
          for (std::size_t i = 0; i < n; ++i) REQUIRE(ranks[static_cast<std::size_t>(r)].recv[i] == sum_over(p, i));
        }
      }
    }
  }
}

TEST_CASE("ring reduce_scatter and all_gather plans put every block where it belongs", "[plans]") {
  for (int p = 1; p <= 16; ++p) {
    for (std::size_t n : awkward_counts(p)) {
      INFO("p=" << p << " block=" << n);
      std::vector<RankState> rs(static_cast<std::size_t>(p));
      std::vector<std::vector<Value>> inputs(static_cast<std::size_t>(p));
      for (int r = 0; r < p; ++r) {
        auto& in = inputs[static_cast<std::size_t>(r)];
        for (std::size_t i = 0; i < n * static_cast<std::size_t>(p); ++i) in.push_back(input(r, i));
        auto& st = rs[static_cast<std::size_t>(r)];
        st.plan = ring_reduce_scatter(p, r, equal(p, n), -1);
        st.send = in;
        st.recv = p > 1 ? std::vector<Value>(in.size(), -5) : in;
        if (p > 1) st.local = in.data();
      }
      REQUIRE(simulate(rs) == "");
      for (int r = 0; r < p; ++r) {
        for (std::size_t i = 0; i < n; ++i) {
          const std::size_t at = static_cast<std::size_t>(r) * n + i;
          REQUIRE(rs[static_cast<std::size_t>(r)].recv[at] == sum_over(p, at));
        }
      }
      std::vector<RankState> ag(static_cast<std::size_t>(p));
      for (int r = 0; r < p; ++r) {
        auto& st = ag[static_cast<std::size_t>(r)];
        st.plan = ring_all_gather(p, r, equal(p, n), -1);
        st.recv.assign(n * static_cast<std::size_t>(p), -9);
        for (std::size_t i = 0; i < n; ++i) st.recv[static_cast<std::size_t>(r) * n + i] = input(r, i);
        st.send_is_recv = true;  // all_gather sends from the buffer it gathers into
      }
      REQUIRE(simulate(ag) == "");
      for (int r = 0; r < p; ++r) {
        for (int b = 0; b < p; ++b) {
          for (std::size_t i = 0; i < n; ++i) REQUIRE(ag[static_cast<std::size_t>(r)].recv[static_cast<std::size_t>(b) * n + i] == input(b, i));
        }
      }
    }
  }
}

using RootedBuilder = Plan (*)(int, int, int, std::size_t);

// A rooted broadcast plan run in place (the Group passes one buffer as send and receive buffer).
void check_broadcast(RootedBuilder build, int p, int root, std::size_t n) {
  std::vector<RankState> ranks(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& st = ranks[static_cast<std::size_t>(r)];
    st.plan = build(p, r, root, n);
    st.send_is_recv = true;
    for (std::size_t i = 0; i < n; ++i) st.recv.push_back(r == root ? input(root, i) : -1);
  }
  REQUIRE(simulate(ranks) == "");
  for (int r = 0; r < p; ++r) {
    for (std::size_t i = 0; i < n; ++i) REQUIRE(ranks[static_cast<std::size_t>(r)].recv[i] == input(root, i));
  }
}

// A rooted reduce plan run in place on every rank's accumulator.
void check_reduce(RootedBuilder build, int p, int root, std::size_t n) {
  std::vector<RankState> ranks(static_cast<std::size_t>(p));
  for (int r = 0; r < p; ++r) {
    auto& st = ranks[static_cast<std::size_t>(r)];
    st.plan = build(p, r, root, n);
    st.send_is_recv = true;
    for (std::size_t i = 0; i < n; ++i) st.recv.push_back(input(r, i));
  }
  REQUIRE(simulate(ranks) == "");
  for (std::size_t i = 0; i < n; ++i) REQUIRE(ranks[static_cast<std::size_t>(root)].recv[i] == sum_over(p, i));
}

TEST_CASE("binomial broadcast and reduce plans reach every rank from every root", "[plans]") {
  for (int p = 1; p <= 16; ++p) {
    for (int root = 0; root < p; ++root) {
      for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{13}}) {
        INFO("p=" << p << " root=" << root << " count=" << n);
        check_broadcast(&binomial_broadcast, p, root, n);
        check_broadcast(&chain_broadcast, p, root, n);
        check_reduce(&binomial_reduce, p, root, n);
      }
    }
  }
}

TEST_CASE("gather, scatter, all_to_all and barrier plans are symmetric", "[plans]") {
  for (int p = 1; p <= 16; ++p) {
    const std::size_t n = 3;
    for (int root = 0; root < p; root += (p > 4 ? 3 : 1)) {
      INFO("p=" << p << " root=" << root);
      std::vector<RankState> ga(static_cast<std::size_t>(p));
      for (int r = 0; r < p; ++r) {
        auto& st = ga[static_cast<std::size_t>(r)];
        st.plan = direct_gather(p, r, root, n);
        for (std::size_t i = 0; i < n; ++i) st.send.push_back(input(r, i));
        st.recv.assign(r == root ? n * static_cast<std::size_t>(p) : 0, -1);
      }
      REQUIRE(simulate(ga) == "");
      for (int b = 0; b < p; ++b) {
        if (b == root) continue;
        for (std::size_t i = 0; i < n; ++i) REQUIRE(ga[static_cast<std::size_t>(root)].recv[static_cast<std::size_t>(b) * n + i] == input(b, i));
      }
      std::vector<RankState> sc(static_cast<std::size_t>(p));
      for (int r = 0; r < p; ++r) {
        auto& st = sc[static_cast<std::size_t>(r)];
        st.plan = direct_scatter(p, r, root, n);
        if (r == root) {
          for (std::size_t i = 0; i < n * static_cast<std::size_t>(p); ++i) st.send.push_back(input(root, i));
        }
        st.recv.assign(n, -1);
      }
      REQUIRE(simulate(sc) == "");
      for (int r = 0; r < p; ++r) {
        if (r == root) continue;
        for (std::size_t i = 0; i < n; ++i) REQUIRE(sc[static_cast<std::size_t>(r)].recv[i] == input(root, static_cast<std::size_t>(r) * n + i));
      }
    }
    std::vector<RankState> a2a(static_cast<std::size_t>(p));
    for (int r = 0; r < p; ++r) {
      auto& st = a2a[static_cast<std::size_t>(r)];
      st.plan = pairwise_all_to_all(p, r, n);
      for (std::size_t i = 0; i < n * static_cast<std::size_t>(p); ++i) st.send.push_back(input(r, i));
      st.recv.assign(n * static_cast<std::size_t>(p), -1);
    }
    REQUIRE(simulate(a2a) == "");
    for (int r = 0; r < p; ++r) {
      for (int j = 0; j < p; ++j) {
        if (j == r) continue;
        for (std::size_t i = 0; i < n; ++i) {
          REQUIRE(a2a[static_cast<std::size_t>(r)].recv[static_cast<std::size_t>(j) * n + i] == input(j, static_cast<std::size_t>(r) * n + i));
        }
      }
    }
    std::vector<RankState> bar(static_cast<std::size_t>(p));
    for (int r = 0; r < p; ++r) bar[static_cast<std::size_t>(r)].plan = dissemination_barrier(p, r);
    REQUIRE(simulate(bar) == "");
  }
}

TEST_CASE("Bruck all_gather, scatter+all-gather broadcast and reduce-scatter+gather reduce plans", "[plans]") {
  for (int p = 1; p <= 16; ++p) {
    for (std::size_t n : awkward_counts(p)) {
      INFO("p=" << p << " count=" << n);
      // Bruck: slot i of rank r ends holding block (r + i) mod p.
      std::vector<RankState> bruck(static_cast<std::size_t>(p));
      for (int r = 0; r < p; ++r) {
        auto& st = bruck[static_cast<std::size_t>(r)];
        st.plan = bruck_all_gather(p, r, n);
        st.send_is_recv = true;
        st.recv.assign(n * static_cast<std::size_t>(p), -3);
        for (std::size_t i = 0; i < n; ++i) st.recv[i] = input(r, i);
      }
      REQUIRE(simulate(bruck) == "");
      for (int r = 0; r < p; ++r) {
        for (int slot = 0; slot < p; ++slot) {
          const int owner = (r + slot) % p;
          for (std::size_t i = 0; i < n; ++i) {
            REQUIRE(bruck[static_cast<std::size_t>(r)].recv[static_cast<std::size_t>(slot) * n + i] == input(owner, i));
          }
        }
      }
      for (int root : {0, p - 1, p / 2}) {
        check_broadcast(&scatter_all_gather_broadcast, p, root, n);
        check_reduce(&reduce_scatter_gather_reduce, p, root, n);
      }
    }
  }
}

TEST_CASE("Bruck all_to_all and recursive-halving reduce_scatter plans", "[plans]") {
  for (int p = 1; p <= 16; ++p) {
    for (std::size_t n : awkward_counts(p)) {
      INFO("p=" << p << " block=" << n);
      // Bruck: rank r's slot i starts as its block for rank r+i; after the plan, slot i holds what rank
      // r-i sent to r.
      std::vector<RankState> a2a(static_cast<std::size_t>(p));
      auto payload = [&](int from, int to, std::size_t i) { return input(from, static_cast<std::size_t>(to) * 100000 + i); };
      for (int r = 0; r < p; ++r) {
        auto& st = a2a[static_cast<std::size_t>(r)];
        st.plan = bruck_all_to_all(p, r, n);
        st.send_is_recv = true;
        for (int slot = 0; slot < p; ++slot) {
          for (std::size_t i = 0; i < n; ++i) st.recv.push_back(payload(r, (r + slot) % p, i));
        }
      }
      REQUIRE(simulate(a2a) == "");
      for (int r = 0; r < p; ++r) {
        for (int slot = 0; slot < p; ++slot) {
          const int from = ((r - slot) % p + p) % p;
          for (std::size_t i = 0; i < n; ++i) {
            REQUIRE(a2a[static_cast<std::size_t>(r)].recv[static_cast<std::size_t>(slot) * n + i] == payload(from, r, i));
          }
        }
      }
      if ((p & (p - 1)) != 0) continue;
      std::vector<RankState> rs(static_cast<std::size_t>(p));
      for (int r = 0; r < p; ++r) {
        auto& st = rs[static_cast<std::size_t>(r)];
        st.plan = recursive_halving_reduce_scatter(p, r, n);
        st.send_is_recv = true;
        for (std::size_t i = 0; i < n * static_cast<std::size_t>(p); ++i) st.recv.push_back(input(r, i));
      }
      REQUIRE(simulate(rs) == "");
      for (int r = 0; r < p; ++r) {
        for (std::size_t i = 0; i < n; ++i) {
          const std::size_t at = static_cast<std::size_t>(r) * n + i;
          REQUIRE(rs[static_cast<std::size_t>(r)].recv[at] == sum_over(p, at));
        }
      }
    }
  }
}

TEST_CASE("the bidirectional ring sends both ways round the ring", "[plans]") {
  for (int p = 3; p <= 16; ++p) {
    for (int r = 0; r < p; ++r) {
      bool to_next = false;
      bool to_prev = false;
      for (const Step& s : bidirectional_ring_all_reduce(p, r, 97)) {
        to_next = to_next || s.send_to == (r + 1) % p;
        to_prev = to_prev || s.send_to == (r + p - 1) % p;
      }
      INFO("p=" << p << " r=" << r);
      REQUIRE((to_next && to_prev));
    }
  }
}

TEST_CASE("recursive doubling all_gather plans gather every block on powers of two", "[plans]") {
  for (int p : {1, 2, 4, 8, 16}) {
    for (std::size_t n : awkward_counts(p)) {
      INFO("p=" << p << " count=" << n);
      std::vector<RankState> ranks(static_cast<std::size_t>(p));
      for (int r = 0; r < p; ++r) {
        auto& st = ranks[static_cast<std::size_t>(r)];
        st.plan = recursive_doubling_all_gather(p, r, n);
        st.send_is_recv = true;
        st.recv.assign(n * static_cast<std::size_t>(p), -3);
        for (std::size_t i = 0; i < n; ++i) st.recv[static_cast<std::size_t>(r) * n + i] = input(r, i);
      }
      REQUIRE(simulate(ranks) == "");
      for (int r = 0; r < p; ++r) {
        for (int b = 0; b < p; ++b) {
          for (std::size_t i = 0; i < n; ++i) REQUIRE(ranks[static_cast<std::size_t>(r)].recv[static_cast<std::size_t>(b) * n + i] == input(b, i));
        }
      }
    }
  }
  REQUIRE(recursive_doubling_all_gather(3, 0, 5).empty());
}

TEST_CASE("binomial gather and scatter plans move every block through the tree", "[plans]") {
  for (int p = 1; p <= 16; ++p) {
    for (std::size_t n : awkward_counts(p)) {
      for (int root : {0, p - 1, p / 2}) {
        INFO("p=" << p << " root=" << root << " count=" << n);
        const auto total = n * static_cast<std::size_t>(p);
        // Gather: slot 0 holds the rank's own block; the root ends with slot i = rank root + i.
        std::vector<RankState> ga(static_cast<std::size_t>(p));
        for (int r = 0; r < p; ++r) {
          auto& st = ga[static_cast<std::size_t>(r)];
          st.plan = binomial_gather(p, r, root, n);
          st.send_is_recv = true;
          st.recv.assign(total, -5);
          for (std::size_t i = 0; i < n; ++i) st.recv[i] = input(r, i);
          if (r != root) REQUIRE(st.plan.back().kind == StepKind::send);
        }
        REQUIRE(simulate(ga) == "");
        for (int slot = 0; slot < p; ++slot) {
          for (std::size_t i = 0; i < n; ++i) {
            REQUIRE(ga[static_cast<std::size_t>(root)].recv[static_cast<std::size_t>(slot) * n + i] == input((root + slot) % p, i));
          }
        }
        // Scatter: the root's slot i holds the block for rank root + i; every rank ends with its own.
        std::vector<RankState> sc(static_cast<std::size_t>(p));
        for (int r = 0; r < p; ++r) {
          auto& st = sc[static_cast<std::size_t>(r)];
          st.plan = binomial_scatter(p, r, root, n);
          st.send_is_recv = true;
          st.recv.assign(total, -5);
          if (r == root) {
            for (int slot = 0; slot < p; ++slot) {
              for (std::size_t i = 0; i < n; ++i) st.recv[static_cast<std::size_t>(slot) * n + i] = input((root + slot) % p, i);
            }
          }
        }
        REQUIRE(simulate(sc) == "");
        for (int r = 0; r < p; ++r) {
          for (std::size_t i = 0; i < n; ++i) REQUIRE(sc[static_cast<std::size_t>(r)].recv[i] == input(r, i));
        }
      }
    }
  }
}

TEST_CASE("the registry: every built-in choice is a registered algorithm of its collective, every name is found", "[plans][registry]") {
  // Issue 14: a collective had four vocabularies (strings compared in if-chains, magic numbers, a name
  // table, an enum); a misspelt name in the built-in table would have run an empty plan. Now the table
  // returns registry entries, and this walks the whole of it.
  for (Collective c : all_collectives) {
    const auto& names = names_for(c);
    for (int ranks = 1; ranks <= 17; ++ranks) {
      for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{8} << 10, std::size_t{16} << 10, std::size_t{64} << 10,
                                std::size_t{256} << 10, std::size_t{512} << 10, std::size_t{4} << 20, std::size_t{8} << 20,
                                std::size_t{1} << 30}) {
        const Algorithm* chosen = Selection::built_in(c, bytes, ranks);
        if (names.empty()) {
          CHECK(chosen == nullptr);  // permute, split: one plan, no choice
          continue;
        }
        REQUIRE(chosen != nullptr);
        CHECK(chosen->collective == c);
        CHECK(find(c, chosen->name) == chosen);
      }
    }
    for (std::string_view name : names) {
      const Algorithm* a = find(c, name);
      REQUIRE(a != nullptr);
      CHECK(&entry(c, a->kind) == a);
    }
    CHECK(collective_named(to_string(c)) == c);
  }
  CHECK(find(Collective::all_reduce, "rign") == nullptr);
  CHECK_THROWS_AS(entry(Collective::broadcast, Kind::ring), std::logic_error);
  CHECK_FALSE(collective_named("all_reduse"));
  // Across hosts the bandwidth-bound sizes spread the data over the links (issue 18, bench/hosts.sh).
  const Placement across{.shared_arena = false, .across_hosts = true};
  CHECK(Selection::built_in(Collective::broadcast, std::size_t{1} << 20, 4)->kind == Kind::binomial);
  CHECK(Selection::built_in(Collective::broadcast, std::size_t{1} << 20, 4, across)->kind == Kind::scatter_all_gather);
  CHECK(Selection::built_in(Collective::broadcast, std::size_t{256} << 10, 4, across)->kind == Kind::binomial);
  CHECK(Selection::built_in(Collective::broadcast, std::size_t{1} << 20, 2, across)->kind == Kind::binomial);
  // reduce_scatter on a power of two: recursive halving below 512 KiB on one host, 64 KiB across hosts.
  CHECK(Selection::built_in(Collective::reduce_scatter, std::size_t{256} << 10, 4)->kind == Kind::recursive_halving);
  CHECK(Selection::built_in(Collective::reduce_scatter, std::size_t{1} << 20, 4)->kind == Kind::ring);
  CHECK(Selection::built_in(Collective::reduce_scatter, std::size_t{256} << 10, 4, across)->kind == Kind::ring);
  CHECK(Selection::built_in(Collective::reduce_scatter, std::size_t{16} << 10, 4, across)->kind == Kind::recursive_halving);
  CHECK(Selection::built_in(Collective::reduce_scatter, 64, 3)->kind == Kind::ring);
  // On one host, back-to-back small broadcasts on 3 and 4 ranks take the chain (one send per rank).
  CHECK(Selection::built_in(Collective::broadcast, 64, 3)->kind == Kind::chain);
  CHECK(Selection::built_in(Collective::broadcast, std::size_t{16} << 10, 3)->kind == Kind::chain);
  CHECK(Selection::built_in(Collective::broadcast, 1024, 4)->kind == Kind::chain);
  CHECK(Selection::built_in(Collective::broadcast, std::size_t{16} << 10, 4)->kind == Kind::binomial);
  CHECK(Selection::built_in(Collective::broadcast, 64, 8)->kind == Kind::binomial);
  CHECK(Selection::built_in(Collective::broadcast, 64, 4, across)->kind == Kind::binomial);
  // all_gather: Bruck up to 128 KiB on one host, up to 16 KiB across hosts; never on 2 ranks.
  CHECK(Selection::built_in(Collective::all_gather, std::size_t{64} << 10, 4)->kind == Kind::bruck);
  CHECK(Selection::built_in(Collective::all_gather, std::size_t{128} << 10, 4)->kind == Kind::ring);
  CHECK(Selection::built_in(Collective::all_gather, std::size_t{64} << 10, 4, across)->kind == Kind::ring);
  CHECK(Selection::built_in(Collective::all_gather, std::size_t{8} << 10, 4, across)->kind == Kind::bruck);
  CHECK(Selection::built_in(Collective::all_gather, std::size_t{8} << 10, 2)->kind == Kind::ring);
  // all_gatherv: padded Bruck below 256 KiB on more than 2 ranks.
  CHECK(Selection::built_in(Collective::all_gatherv, std::size_t{128} << 10, 3)->kind == Kind::bruck);
  CHECK(Selection::built_in(Collective::all_gatherv, std::size_t{256} << 10, 3)->kind == Kind::ring);
  CHECK(Selection::built_in(Collective::all_gatherv, 64, 2)->kind == Kind::ring);
  CHECK(Selection::built_in(Collective::all_reduce, std::size_t{1} << 20, 8)->kind == Kind::rabenseifner);
  CHECK(Selection::built_in(Collective::all_reduce, std::size_t{1} << 20, 8, across)->kind == Kind::ring);
  CHECK(Selection::built_in(Collective::all_reduce, std::size_t{64} << 10, 8, across)->kind == Kind::rabenseifner);
  CHECK(Selection::built_in(Collective::all_reduce, std::size_t{1} << 20, 2, across)->kind == Kind::bidirectional_ring);
  // On an arena the direct shm algorithms below 128 KiB, further up where measured (arena_below in
  // selection.cpp; bench/RESULTS.md, "The arena on a crowded host", "Copies into shared memory", "The
  // arena past 4 MiB"): on 2 ranks all_reduce below 256 KiB, all_gather below 4 MiB, all_to_all through 8 MiB, reduce_scatter and
  // broadcast at every size, and every collective with a script at every size where 3 ranks or more
  // outnumber the cores.
  const Placement arena{.shared_arena = true};
  const Placement crowded{.shared_arena = true, .crowded = true};
  const std::size_t kib = 1024, mib = kib * kib;
  const Collective scripted[] = {Collective::all_reduce, Collective::all_gather, Collective::reduce_scatter, Collective::broadcast,
                                 Collective::all_to_all};
  for (Collective c : scripted) {
    for (int ranks : {2, 3, 4, 8, 17}) {
      CHECK(Selection::built_in(c, 127 * kib, ranks, arena)->kind == Kind::shm);
      CHECK(Selection::built_in(c, 127 * kib, ranks, crowded)->kind == Kind::shm);
      if (ranks > 2) {
        CHECK(Selection::built_in(c, 128 * kib, ranks, arena)->kind != Kind::shm);  // a core per rank: not measured
        CHECK(Selection::built_in(c, 4 * mib, ranks, crowded)->kind == Kind::shm);
        CHECK(Selection::built_in(c, 256 * mib + 3, ranks, crowded)->kind == Kind::shm);
        CHECK(Selection::built_in(c, 4 * mib + 1, ranks, arena)->kind != Kind::shm);
      }
    }
    // Without an arena, never.
    CHECK(Selection::built_in(c, 64, 2)->kind != Kind::shm);
  }
  CHECK(Selection::built_in(Collective::all_reduce, 256 * kib - 1, 2, arena)->kind == Kind::shm);
  CHECK(Selection::built_in(Collective::all_reduce, 256 * kib, 2, arena)->kind == Kind::recursive_doubling);
  CHECK(Selection::built_in(Collective::all_reduce, 128 * kib, 2, crowded)->kind != Kind::shm);
  CHECK(Selection::built_in(Collective::all_gather, 4 * mib - 1, 2, arena)->kind == Kind::shm);
  CHECK(Selection::built_in(Collective::all_gather, 4 * mib, 2, arena)->kind == Kind::ring);
  CHECK(Selection::built_in(Collective::reduce_scatter, 4 * mib, 2, arena)->kind == Kind::shm);
  CHECK(Selection::built_in(Collective::reduce_scatter, 64 * mib + 1, 2, arena)->kind == Kind::shm);
  CHECK(Selection::built_in(Collective::broadcast, 4 * mib, 2, arena)->kind == Kind::shm);
  CHECK(Selection::built_in(Collective::broadcast, 64 * mib + 1, 2, arena)->kind == Kind::shm);
  CHECK(Selection::built_in(Collective::all_reduce, 4 * mib + 1, 2, arena)->kind == Kind::bidirectional_ring);
  CHECK(Selection::built_in(Collective::all_to_all, 8 * mib, 2, arena)->kind == Kind::shm);
  CHECK(Selection::built_in(Collective::all_to_all, 8 * mib + 1, 2, arena)->kind != Kind::shm);
  // Two ranks that read each other's buffers: all_gather and all_to_all on the arena at every size, which
  // reads directly from its sizes (shm_collectives.cpp); all_reduce keeps the rings (measured on two
  // machines that disagree: the EPYC's rings beat the direct all_reduce 1.7-2.3x at 2-8 MiB).
  const Placement direct{.shared_arena = true, .direct_reads = true};
  CHECK(Selection::built_in(Collective::all_gather, 64 * mib + 1, 2, direct)->kind == Kind::shm);
  CHECK(Selection::built_in(Collective::all_to_all, 64 * mib + 1, 2, direct)->kind == Kind::shm);
  for (std::size_t bytes : {256 * kib, 2 * mib, 8 * mib, 64 * mib}) {
    CHECK(Selection::built_in(Collective::all_reduce, bytes, 2, direct)->kind != Kind::shm);
  }
  CHECK(Selection::built_in(Collective::all_reduce, 256 * kib - 1, 2, direct)->kind == Kind::shm);
  // Two ranks on one core (crowded) were not measured: the plain bound.
  CHECK(Selection::built_in(Collective::all_gather, 128 * kib, 2, crowded)->kind != Kind::shm);
  CHECK(Selection::built_in(Collective::barrier, 8 * mib, 4, arena)->kind == Kind::shm);
  // WEFT_ALGO is parsed against the registry.
  Selection s;
  s.override_with("all_gather:recursive_doubling@0-1K,ring", "WEFT_ALGO");
  CHECK(s.choose(Collective::all_gather, 100, 4)->kind == Kind::recursive_doubling);
  CHECK(s.choose(Collective::all_gather, 4096, 4)->kind == Kind::ring);
  CHECK_THROWS_WITH(s.override_with("all_gather:rabenseifner", "WEFT_ALGO"),
                    Catch::Contains("'rabenseifner' is not an algorithm of all_gather (valid: ring, bruck, recursive_doubling, shm)"));
  CHECK_THROWS_WITH(s.override_with("permute:ring", "WEFT_ALGO"), Catch::Contains("unknown collective 'permute'"));
}

TEST_CASE("signatures pack the Collective's value + 1: the wire codes of protocol 2 stay", "[plans][registry]") {
  // Kind codes on the wire: 1 all_reduce ... 11 split, 31 a user's plan (docs/PROTOCOL.md). Append-only.
  const std::pair<Collective, std::uint32_t> codes[] = {
      {Collective::all_reduce, 1}, {Collective::all_gather, 2}, {Collective::reduce_scatter, 3}, {Collective::broadcast, 4},
      {Collective::reduce, 5},     {Collective::gather, 6},     {Collective::scatter, 7},        {Collective::all_to_all, 8},
      {Collective::barrier, 9},    {Collective::permute, 10},   {Collective::split, 11},         {Collective::all_gatherv, 12},
      {Collective::gatherv, 13},   {Collective::scatterv, 14},  {Collective::all_to_allv, 15},   {Collective::reduce_scatterv, 16}};
  for (auto [c, code] : codes) {
    CHECK(signature::of(c, DType::f32, ReduceOp::max, 8, -1).call >> 27 == code);
    const std::uint32_t op_bits = (signature::of(c, DType::f32, ReduceOp::max, 8, -1).call >> 18) & 15;
    CHECK((op_bits != 0) == reduces(c));  // the op is part of the signature of the reducing ones only
  }
  CHECK(signature::of_plan(DType::f32, ReduceOp::sum, 0).call >> 27 == 31);
  CHECK(signature::describe(signature::of(Collective::broadcast, DType::u8, ReduceOp::sum, 16, 2), 7) == "broadcast #7 (u8 x 16, root 2)");
  // The variable-size ones sign a digest of their per-rank counts: any change of any count changes it.
  const std::vector<std::size_t> counts{3, 0, 5}, moved{3, 5, 0}, longer{3, 0, 5, 0};
  const auto digest = signature::counts_digest(counts);
  CHECK(digest != signature::counts_digest(moved));
  CHECK(digest != signature::counts_digest(longer));
  CHECK(digest == signature::counts_digest(std::vector<std::size_t>{3, 0, 5}));
  CHECK(signature::describe(signature::of(Collective::all_gatherv, DType::f32, ReduceOp::sum, 0x1234, -1), 4) ==
        "all_gatherv #4 (f32, counts digest 0000000000001234)");
}

TEST_CASE("plans over blocks of any size: the ring, direct gather and scatter, the pairwise exchange", "[plans]") {
  // The variable-size collectives run the equal-block plans over ranges of their own (uneven, empty,
  // displaced in reverse order with gaps): every block must still land where its range says.
  for (int p = 1; p <= 9; ++p) {
    for (int pattern = 0; pattern < 3; ++pattern) {
      INFO("p=" << p << " pattern=" << pattern);
      std::vector<Range> blocks(static_cast<std::size_t>(p));
      std::size_t at = 0, total = 0;
      for (int i = p - 1; i >= 0; --i) {  // reverse order, gaps of 2
        const std::size_t count = pattern == 0 ? 0 : pattern == 1 ? static_cast<std::size_t>(i % 2) : static_cast<std::size_t>((i * 5 + 3) % 7);
        at += 2;
        blocks[static_cast<std::size_t>(i)] = Range{at, count};
        at += count;
        total += count;
      }
      const std::size_t reach = at;
      // all_gatherv: block i of rank i, at blocks[i] everywhere.
      std::vector<RankState> ag(static_cast<std::size_t>(p));
      for (int r = 0; r < p; ++r) {
        auto& st = ag[static_cast<std::size_t>(r)];
        st.plan = ring_all_gather(p, r, blocks, -1);
        st.recv.assign(reach, -9);
        const Range mine = blocks[static_cast<std::size_t>(r)];
        for (std::size_t i = 0; i < mine.count; ++i) st.recv[mine.offset + i] = input(r, i);
        st.send_is_recv = true;
      }
      REQUIRE(simulate(ag) == "");
      for (int r = 0; r < p; ++r) {
        for (int b = 0; b < p; ++b) {
          const Range range = blocks[static_cast<std::size_t>(b)];
          for (std::size_t i = 0; i < range.count; ++i) REQUIRE(ag[static_cast<std::size_t>(r)].recv[range.offset + i] == input(b, i));
        }
        REQUIRE(std::count(ag[static_cast<std::size_t>(r)].recv.begin(), ag[static_cast<std::size_t>(r)].recv.end(), -9) ==
                static_cast<std::ptrdiff_t>(reach - total));  // the gaps stay untouched
      }
      // reduce_scatterv: packed blocks of the same counts.
      std::vector<Range> packed(static_cast<std::size_t>(p));
      std::size_t off = 0;
      for (int i = 0; i < p; ++i) {
        packed[static_cast<std::size_t>(i)] = Range{off, blocks[static_cast<std::size_t>(i)].count};
        off += blocks[static_cast<std::size_t>(i)].count;
      }
      std::vector<RankState> rs(static_cast<std::size_t>(p));
      std::vector<std::vector<Value>> inputs(static_cast<std::size_t>(p));
      for (int r = 0; r < p; ++r) {
        auto& in = inputs[static_cast<std::size_t>(r)];
        for (std::size_t i = 0; i < total; ++i) in.push_back(input(r, i));
        auto& st = rs[static_cast<std::size_t>(r)];
        st.plan = ring_reduce_scatter(p, r, packed, -1);
        st.send = in;
        st.recv = p > 1 ? std::vector<Value>(total, -5) : in;
        if (p > 1) st.local = in.data();
      }
      REQUIRE(simulate(rs) == "");
      for (int r = 0; r < p; ++r) {
        const Range mine = packed[static_cast<std::size_t>(r)];
        for (std::size_t i = 0; i < mine.count; ++i) REQUIRE(rs[static_cast<std::size_t>(r)].recv[mine.offset + i] == sum_over(p, mine.offset + i));
      }
      for (int root = 0; root < p; ++root) {
        // gatherv: rank i's [0, count) lands at blocks[i] of the root's buffer.
        std::vector<RankState> ga(static_cast<std::size_t>(p));
        for (int r = 0; r < p; ++r) {
          auto& st = ga[static_cast<std::size_t>(r)];
          st.plan = direct_gather(p, r, root, blocks);
          for (std::size_t i = 0; i < blocks[static_cast<std::size_t>(r)].count; ++i) st.send.push_back(input(r, i));
          st.recv.assign(r == root ? reach : 0, -1);
        }
        REQUIRE(simulate(ga) == "");
        for (int b = 0; b < p; ++b) {
          if (b == root) continue;
          const Range range = blocks[static_cast<std::size_t>(b)];
          for (std::size_t i = 0; i < range.count; ++i) REQUIRE(ga[static_cast<std::size_t>(root)].recv[range.offset + i] == input(b, i));
        }
        // scatterv: blocks[i] of the root's buffer lands in rank i's [0, count).
        std::vector<RankState> sc(static_cast<std::size_t>(p));
        for (int r = 0; r < p; ++r) {
          auto& st = sc[static_cast<std::size_t>(r)];
          st.plan = direct_scatter(p, r, root, blocks);
          if (r == root) {
            for (std::size_t i = 0; i < reach; ++i) st.send.push_back(input(root, i));
          }
          st.recv.assign(blocks[static_cast<std::size_t>(r)].count, -1);
        }
        REQUIRE(simulate(sc) == "");
        for (int r = 0; r < p; ++r) {
          if (r == root) continue;
          const Range range = blocks[static_cast<std::size_t>(r)];
          for (std::size_t i = 0; i < range.count; ++i) REQUIRE(sc[static_cast<std::size_t>(r)].recv[i] == input(root, range.offset + i));
        }
      }
      // all_to_allv: rank r sends (r + 2j + pattern) % 4 elements to rank j, packed on the way out and
      // in reverse order on the way in.
      auto pair_count = [&](int from, int to) { return static_cast<std::size_t>((from + 2 * to + pattern) % 4); };
      std::vector<RankState> a2a(static_cast<std::size_t>(p));
      std::vector<std::vector<Range>> sends(static_cast<std::size_t>(p)), recvs(static_cast<std::size_t>(p));
      for (int r = 0; r < p; ++r) {
        auto& st = a2a[static_cast<std::size_t>(r)];
        std::size_t out = 0;
        for (int j = 0; j < p; ++j) {
          sends[static_cast<std::size_t>(r)].push_back(Range{out, pair_count(r, j)});
          out += pair_count(r, j);
        }
        recvs[static_cast<std::size_t>(r)].resize(static_cast<std::size_t>(p));
        std::size_t in = 0;
        for (int i = p - 1; i >= 0; --i) {
          recvs[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)] = Range{in, pair_count(i, r)};
          in += pair_count(i, r);
        }
        st.plan = pairwise_all_to_all(p, r, sends[static_cast<std::size_t>(r)], recvs[static_cast<std::size_t>(r)]);
        for (std::size_t i = 0; i < out; ++i) st.send.push_back(input(r, i));
        st.recv.assign(in, -1);
      }
      REQUIRE(simulate(a2a) == "");
      for (int r = 0; r < p; ++r) {
        for (int i = 0; i < p; ++i) {
          if (i == r) continue;
          const Range got = recvs[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)];
          const Range sent = sends[static_cast<std::size_t>(i)][static_cast<std::size_t>(r)];
          for (std::size_t e = 0; e < got.count; ++e) REQUIRE(a2a[static_cast<std::size_t>(r)].recv[got.offset + e] == input(i, sent.offset + e));
        }
      }
    }
  }
  // The equal-block builders are the ranged ones over equal blocks.
  for (int p = 1; p <= 6; ++p) {
    for (int r = 0; r < p; ++r) {
      CHECK(direct_gather(p, r, 0, 5) == direct_gather(p, r, 0, equal(p, 5)));
      CHECK(direct_scatter(p, r, p - 1, 5) == direct_scatter(p, r, p - 1, equal(p, 5)));
      CHECK(pairwise_all_to_all(p, r, 5) == pairwise_all_to_all(p, r, equal(p, 5), equal(p, 5)));
    }
  }
}

// ---- MessagePlan (algorithms/messages.hpp): plans of whole messages run from completions ----

namespace {

// Every rank's transport in one thread: a send is delivered to its receiver's posted receive (or kept as
// unexpected) and completes at once; completions run inline (a send the stream took whole, a receive that
// found its message) or, with `deferred`, from a queue the test pumps in a scrambled order, sends
// delivered (their data read) from that queue too.
struct Switchboard;

class BoardTransport final : public Transport {
 public:
  BoardTransport(Switchboard& board, int rank) : board_(board), rank_(rank) {}
  std::string_view name() const noexcept override { return "board"; }
  int rank() const noexcept override { return rank_; }
  int size() const noexcept override;
  void start_send(int peer, const MessageKey& key, const void* data, std::size_t bytes, TransportOp& op) override;
  void start_recv(int peer, const MessageKey& key, void* data, std::size_t bytes, TransportOp& op) override;
  void deliver(int peer, const MessageKey& key, const void* data, std::size_t bytes, TransportOp& op);
  // send_now: taken at once by every peer not in `busy`; after `take_now` messages (a context that
  // failed on the way) no more. Each message taken is delivered at once and noted in `sent_now`.
  bool can_send_now(int peer, std::size_t) const override { return std::find(busy.begin(), busy.end(), peer) == busy.end(); }
  bool send_now(int peer, const MessageKey& key, const void* data, std::size_t bytes, const OpSignature& signature) override;
  bool cancel_recv(TransportOp&) override { return false; }
  void open_context(std::uint32_t, std::vector<int>) override {}
  void close_context(std::uint32_t) override {}
  void abort_context(std::uint32_t, Errc code, const std::string& reason) override;
  void cancel_operation(std::uint32_t, std::uint64_t seq, const std::string& reason) override;
  bool context_failed(std::uint32_t, std::error_code*, std::string*) const override { return false; }
  std::vector<int> waiting_on(std::uint32_t, std::uint64_t) const override { return {}; }
  OpSignature signature_of(std::uint32_t, std::uint64_t) const override { return {}; }
  void ask_progress(std::uint32_t, std::uint64_t, std::chrono::milliseconds, std::function<void(std::vector<Progress>)>) override {}
  bool connected(int) const override { return true; }
  void disconnect(int, const std::string&) override {}
  void shutdown() override {}

  struct Posted {
    int from;
    MessageKey key;
    void* data;
    std::size_t bytes;
    TransportOp* op;
  };
  struct Arrived {
    int from;
    MessageKey key;
    std::vector<std::byte> payload;
  };
  std::vector<Posted> posted;
  std::vector<Arrived> unexpected;
  int aborts = 0;
  int fail_sends_to = -1;  // a send to this rank fails with peer_failure
  std::vector<int> busy;
  int take_now = 1 << 30;
  struct SentNow {
    int to;
    MessageKey key;
    OpSignature signature;
  };
  std::vector<SentNow> sent_now;

 private:
  Switchboard& board_;
  int rank_;
};

struct Switchboard {
  std::vector<std::unique_ptr<BoardTransport>> ranks;
  bool deferred = false;
  std::deque<std::function<void()>> completions;
  explicit Switchboard(int p, bool defer) : deferred(defer) {
    for (int r = 0; r < p; ++r) ranks.push_back(std::make_unique<BoardTransport>(*this, r));
  }
  void complete(TransportOp& op, std::error_code error = {}, int failed_peer = -1, std::string reason = {}) {
    if (!deferred) {
      op.complete(error, failed_peer, std::move(reason));
      return;
    }
    completions.push_back([&op, error, failed_peer, reason] { op.complete(error, failed_peer, reason); });
  }
  // Runs the queued completions, taking from the back every third time (completions of different ops
  // need not come in the order they were queued).
  void pump() {
    for (std::size_t turn = 0; !completions.empty(); ++turn) {
      std::function<void()> next;
      if (turn % 3 == 2) {
        next = std::move(completions.back());
        completions.pop_back();
      } else {
        next = std::move(completions.front());
        completions.pop_front();
      }
      next();
    }
  }
};

int BoardTransport::size() const noexcept { return static_cast<int>(board_.ranks.size()); }

void BoardTransport::start_send(int peer, const MessageKey& key, const void* data, std::size_t bytes, TransportOp& op) {
  op.peer = peer;
  if (peer == fail_sends_to) {
    board_.complete(op, make_error_code(Errc::peer_failure), peer, fmt::format("rank {} is gone", peer));
    return;
  }
  // Deferred, a send reads its data only when it is delivered, as a real transport may read it at any
  // time before the send completes: a plan that writes into a range a send still reads sends the wrong
  // bytes here.
  if (board_.deferred) {
    board_.completions.push_back([this, peer, key, data, bytes, &op] { deliver(peer, key, data, bytes, op); });
  } else {
    deliver(peer, key, data, bytes, op);
  }
}

void BoardTransport::deliver(int peer, const MessageKey& key, const void* data, std::size_t bytes, TransportOp& op) {
  BoardTransport& to = *board_.ranks[static_cast<std::size_t>(peer)];
  const auto* bytes_at = static_cast<const std::byte*>(data);
  auto match = std::find_if(to.posted.begin(), to.posted.end(), [&](const Posted& p) { return p.from == rank_ && p.key == key; });
  if (match != to.posted.end()) {
    const Posted found = *match;
    to.posted.erase(match);
    if (found.bytes != bytes) {
      board_.complete(*found.op, make_error_code(Errc::size_mismatch), rank_, "size");
    } else {
      if (bytes) std::memcpy(found.data, data, bytes);
      board_.complete(*found.op);
    }
  } else {
    to.unexpected.push_back(Arrived{rank_, key, std::vector<std::byte>(bytes_at, bytes_at + bytes)});
  }
  board_.complete(op);
}

bool BoardTransport::send_now(int peer, const MessageKey& key, const void* data, std::size_t bytes, const OpSignature& signature) {
  if (!can_send_now(peer, bytes) || static_cast<int>(sent_now.size()) >= take_now) return false;
  sent_now.push_back(SentNow{peer, key, signature});
  TransportOp done;  // delivered now, not deferred: nothing of it outlives this call
  const bool deferred = std::exchange(board_.deferred, false);
  deliver(peer, key, data, bytes, done);
  board_.deferred = deferred;
  return true;
}

void BoardTransport::start_recv(int peer, const MessageKey& key, void* data, std::size_t bytes, TransportOp& op) {
  op.peer = peer;
  auto match = std::find_if(unexpected.begin(), unexpected.end(), [&](const Arrived& a) { return a.from == peer && a.key == key; });
  if (match == unexpected.end()) {
    posted.push_back(Posted{peer, key, data, bytes, &op});
    return;
  }
  const std::vector<std::byte> payload = std::move(match->payload);
  unexpected.erase(match);
  if (payload.size() != bytes) {
    board_.complete(op, make_error_code(Errc::size_mismatch), peer, "size");
    return;
  }
  if (bytes) std::memcpy(data, payload.data(), bytes);
  board_.complete(op);
}

void BoardTransport::abort_context(std::uint32_t, Errc code, const std::string& reason) {
  ++aborts;
  const auto pending = std::exchange(posted, {});
  for (const Posted& p : pending) board_.complete(*p.op, make_error_code(code), -1, reason);
}

void BoardTransport::cancel_operation(std::uint32_t, std::uint64_t seq, const std::string& reason) {
  std::vector<Posted> keep;
  std::vector<Posted> cancelled;
  for (const Posted& p : posted) (p.key.seq == seq ? cancelled : keep).push_back(p);
  posted = keep;
  for (const Posted& p : cancelled) board_.complete(*p.op, make_error_code(Errc::cancelled), -1, reason);
}

struct Outcome {
  bool done = false;
  static void mark(void* context) noexcept { static_cast<Outcome*>(context)->done = true; }
};

Channel board_channel(Switchboard& board, const std::vector<int>& members, int r, std::uint64_t seq) {
  Channel ch{nullptr, board.ranks[static_cast<std::size_t>(r)].get(), 1, seq, r, members, "broadcast", 0};
  ch.signature = OpSignature{.call = 7, .count = 1};
  return ch;
}

// Rank `r`'s part of a binomial broadcast from rank 0 over `buf`, on the switchboard. (Returned by
// guaranteed elision: a MessagePlan neither copies nor moves.)
MessagePlan broadcast_run(Switchboard& board, const std::vector<int>& members, int r, std::uint64_t seq, std::vector<Value>& buf,
                          Outcome& outcome) {
  auto* bytes = reinterpret_cast<std::byte*>(buf.data());
  return MessagePlan(board_channel(board, members, r, seq), binomial_broadcast(static_cast<int>(members.size()), r, 0, buf.size()),
                     PlanBuffers{bytes, bytes, DType::i64, ReduceOp::sum}, &Outcome::mark, &outcome);
}

}  // namespace

TEST_CASE("a plan of whole messages runs from completions: broadcast and barrier on 1-9 ranks, inline or deferred", "[plans][messages]") {
  for (bool deferred : {false, true}) {
    for (int p = 1; p <= 9; ++p) {
      std::vector<int> members(static_cast<std::size_t>(p));
      for (int r = 0; r < p; ++r) members[static_cast<std::size_t>(r)] = r;
      for (int root = 0; root < p; ++root) {
        for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{13}}) {
          for (auto make : {&binomial_broadcast, &chain_broadcast}) {
            INFO("deferred=" << deferred << " p=" << p << " root=" << root << " count=" << n);
            Switchboard board(p, deferred);
            std::vector<std::vector<Value>> data(static_cast<std::size_t>(p));
            std::vector<Outcome> outcome(static_cast<std::size_t>(p));
            std::vector<std::unique_ptr<MessagePlan>> runs;
            for (int r = 0; r < p; ++r) {
              auto& buf = data[static_cast<std::size_t>(r)];
              buf.assign(n, -1);
              if (r == root) {
                for (std::size_t i = 0; i < n; ++i) buf[i] = input(root, i);
              }
              auto* bytes = reinterpret_cast<std::byte*>(buf.data());
              const PlanBuffers buffers{bytes, bytes, DType::i64, ReduceOp::sum};
              Plan plan = make(p, r, root, n);
              REQUIRE(MessagePlan::fits(plan, buffers, ExecOptions{}));
              runs.push_back(std::make_unique<MessagePlan>(board_channel(board, members, r, 5), std::move(plan), buffers,
                                                           &Outcome::mark, &outcome[static_cast<std::size_t>(r)]));
            }
            // Receivers before their senders and after them: every rank starts in reverse order.
            for (int r = p - 1; r >= 0; --r) runs[static_cast<std::size_t>(r)]->start();
            board.pump();
            for (int r = 0; r < p; ++r) {
              REQUIRE(outcome[static_cast<std::size_t>(r)].done);
              REQUIRE(runs[static_cast<std::size_t>(r)]->failure() == nullptr);
              for (std::size_t i = 0; i < n; ++i) REQUIRE(data[static_cast<std::size_t>(r)][i] == input(root, i));
              REQUIRE(board.ranks[static_cast<std::size_t>(r)]->unexpected.empty());  // tags matched pairwise
            }
          }
        }
      }
      Switchboard board(p, deferred);
      std::vector<Outcome> outcome(static_cast<std::size_t>(p));
      std::vector<std::unique_ptr<MessagePlan>> runs;
      for (int r = 0; r < p; ++r) {
        Plan plan = dissemination_barrier(p, r);
        REQUIRE(MessagePlan::fits(plan, PlanBuffers{}, ExecOptions{}));
        runs.push_back(std::make_unique<MessagePlan>(board_channel(board, members, r, 9), std::move(plan), PlanBuffers{},
                                                     &Outcome::mark, &outcome[static_cast<std::size_t>(r)]));
      }
      // The last rank enters late: nobody may finish before it did.
      for (int r = 0; r + 1 < p; ++r) runs[static_cast<std::size_t>(r)]->start();
      board.pump();
      for (int r = 0; r + 1 < p; ++r) REQUIRE(!outcome[static_cast<std::size_t>(r)].done);
      runs.back()->start();
      board.pump();
      for (int r = 0; r < p; ++r) REQUIRE(outcome[static_cast<std::size_t>(r)].done);
    }
  }
}

TEST_CASE("a plan of whole messages reduces: every all_reduce plan on 1-9 ranks, in and out of place, inline or deferred", "[plans][messages]") {
  struct Made {
    const char* name;
    Plan (*build)(int, int, std::size_t);
    bool ring;  // reads this rank's contribution from `local` when out of place
  };
  const Made all_reduces[] = {{"recursive doubling", &recursive_doubling_all_reduce, false},
                              {"rabenseifner", &rabenseifner_all_reduce, false},
                              {"tree", &tree_all_reduce, false},
                              {"ring", &ring_all_reduce, true},
                              {"bidirectional ring", &bidirectional_ring_all_reduce, true}};
  for (bool deferred : {false, true}) {
    for (int p = 1; p <= 9; ++p) {
      std::vector<int> members(static_cast<std::size_t>(p));
      for (int r = 0; r < p; ++r) members[static_cast<std::size_t>(r)] = r;
      for (const Made& made : all_reduces) {
        for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{100}}) {
          for (bool out_of_place : {false, true}) {
            // The others copy the input into place first (as does a ring on one rank: an empty plan).
            if (out_of_place && (!made.ring || p == 1)) continue;
            INFO(made.name << " deferred=" << deferred << " p=" << p << " count=" << n << " out_of_place=" << out_of_place);
            Switchboard board(p, deferred);
            std::vector<std::vector<Value>> in(static_cast<std::size_t>(p)), out(static_cast<std::size_t>(p));
            std::vector<Outcome> outcome(static_cast<std::size_t>(p));
            std::vector<std::unique_ptr<MessagePlan>> runs;
            std::size_t fitted = 0;
            for (int r = 0; r < p; ++r) {
              auto& src = in[static_cast<std::size_t>(r)];
              auto& dst = out[static_cast<std::size_t>(r)];
              src.resize(n);
              for (std::size_t i = 0; i < n; ++i) src[i] = input(r, i);
              dst = out_of_place ? std::vector<Value>(n, -1) : src;
              auto* at = reinterpret_cast<std::byte*>(dst.data());
              PlanBuffers buffers{at, at, DType::i64, ReduceOp::sum};
              if (out_of_place) {
                buffers.send = reinterpret_cast<const std::byte*>(src.data());
                buffers.local = buffers.send;
              }
              Plan plan = made.build(p, r, n);
              if (!MessagePlan::fits(plan, buffers, ExecOptions{})) break;  // more than 8 messages: not here
              ++fitted;
              runs.push_back(std::make_unique<MessagePlan>(board_channel(board, members, r, 6), std::move(plan), buffers,
                                                           &Outcome::mark, &outcome[static_cast<std::size_t>(r)]));
            }
            if (fitted < static_cast<std::size_t>(p)) continue;
            for (int r = p - 1; r >= 0; --r) runs[static_cast<std::size_t>(r)]->start();
            board.pump();
            for (int r = 0; r < p; ++r) {
              REQUIRE(outcome[static_cast<std::size_t>(r)].done);
              REQUIRE(runs[static_cast<std::size_t>(r)]->failure() == nullptr);
              for (std::size_t i = 0; i < n; ++i) {
                Value sum = 0;
                for (int q = 0; q < p; ++q) sum += input(q, i);
                REQUIRE(out[static_cast<std::size_t>(r)][i] == sum);
              }
              REQUIRE(board.ranks[static_cast<std::size_t>(r)]->unexpected.empty());
            }
          }
        }
      }
    }
  }
  // Plans that fit on every rank, counted, so that the loop above cannot pass by fitting nothing.
  auto fits_everywhere = [](Plan (*build)(int, int, std::size_t), int p, std::size_t n) {
    std::vector<Value> buf(n);
    auto* at = reinterpret_cast<std::byte*>(buf.data());
    for (int r = 0; r < p; ++r) {
      if (!MessagePlan::fits(build(p, r, n), PlanBuffers{at, at, DType::i64, ReduceOp::sum}, ExecOptions{})) return false;
    }
    return true;
  };
  REQUIRE(fits_everywhere(&recursive_doubling_all_reduce, 2, 13));
  REQUIRE(fits_everywhere(&recursive_doubling_all_reduce, 8, 13));  // 3 exchanges
  REQUIRE(!fits_everywhere(&recursive_doubling_all_reduce, 7, 13));  // a folded rank receives where it sent
  REQUIRE(fits_everywhere(&ring_all_reduce, 3, 100));  // 8 messages
  REQUIRE(!fits_everywhere(&ring_all_reduce, 4, 100));  // 12
  REQUIRE(!fits_everywhere(&tree_all_reduce, 2, 1));  // a leaf receives the result where it sent its part
}

TEST_CASE("a plan of whole messages fails with the first failure, naming the peer, and drains; a cancel aborts nothing", "[plans][messages]") {
  const std::vector<int> members{0, 1, 2, 3};
  for (bool deferred : {false, true}) {
    INFO("deferred=" << deferred);
    // Rank 0 of 4 is the root; its first send (to rank 2, the binomial tree's far half) fails.
    Switchboard board(4, deferred);
    board.ranks[0]->fail_sends_to = 2;
    std::vector<Value> buf(5, 3);
    Outcome outcome;
    MessagePlan run = broadcast_run(board, members, 0, 11, buf, outcome);
    run.start();
    board.pump();
    REQUIRE(outcome.done);
    REQUIRE(board.ranks[0]->aborts == 1);
    REQUIRE(run.failure() != nullptr);
    try {
      std::rethrow_exception(run.failure());
    } catch (const Error& e) {
      REQUIRE(e.errc() == Errc::peer_failure);
      REQUIRE(e.context().rank == 0);
      REQUIRE(e.context().peer == 2);
      REQUIRE(e.context().op == "broadcast");
      REQUIRE(e.context().seq == 11);
    }
  }
  for (bool deferred : {false, true}) {
    INFO("deferred=" << deferred);
    // A receiver whose root never comes, cancelled: it ends with the cancellation and aborts nothing.
    Switchboard board(2, deferred);
    const std::vector<int> pair{0, 1};
    std::vector<Value> buf(3, 0);
    Outcome outcome;
    MessagePlan run = broadcast_run(board, pair, 1, 12, buf, outcome);
    run.start();
    board.pump();
    REQUIRE(!outcome.done);
    run.cancel();
    board.pump();
    REQUIRE(outcome.done);
    REQUIRE(board.ranks[1]->aborts == 0);
    REQUIRE_THROWS_MATCHES(std::rethrow_exception(run.failure()), Error, Catch::Predicate<Error>([](const Error& e) {
                             return e.errc() == Errc::cancelled && e.context().peer == 0 && e.context().seq == 12;
                           }));
  }
}

TEST_CASE("a plan that only sends goes at once where every peer takes it now, none of it where one does not", "[plans][messages]") {
  // MessagePlan::send_now: a broadcast's root on 4 ranks (binomial: to ranks 2 and 1), the readers' runs
  // completing from what it sent.
  const std::vector<int> members{0, 1, 2, 3};
  const auto readers_get = [&](Switchboard& board, std::uint64_t seq) {
    std::vector<std::vector<Value>> bufs(4, std::vector<Value>(5, 0));
    std::vector<Outcome> outcomes(4);
    std::vector<std::unique_ptr<MessagePlan>> runs;
    for (int r = 1; r < 4; ++r) {
      auto* bytes = reinterpret_cast<std::byte*>(bufs[static_cast<std::size_t>(r)].data());
      runs.push_back(std::make_unique<MessagePlan>(board_channel(board, members, r, seq), binomial_broadcast(4, r, 0, 5),
                                                   PlanBuffers{bytes, bytes, DType::i64, ReduceOp::sum}, &Outcome::mark,
                                                   &outcomes[static_cast<std::size_t>(r)]));
      runs.back()->start();
    }
    board.pump();
    for (int r = 1; r < 4; ++r) {
      CHECK(outcomes[static_cast<std::size_t>(r)].done);
      CHECK(bufs[static_cast<std::size_t>(r)] == std::vector<Value>(5, 3));
    }
    for (const auto& rank : board.ranks) CHECK(rank->unexpected.empty());  // nothing sent twice
  };
  std::vector<Value> buf(5, 3);
  auto* bytes = reinterpret_cast<std::byte*>(buf.data());
  const PlanBuffers buffers{bytes, bytes, DType::i64, ReduceOp::sum};
  const Plan root = binomial_broadcast(4, 0, 0, buf.size());
  REQUIRE(root.size() == 2);
  {
    // Every peer takes it now: both go, with the call's signature and the first tag, and nothing else.
    Switchboard board(4, false);
    REQUIRE(MessagePlan::send_now(board_channel(board, members, 0, 21), root, buffers) == 2);
    const auto& sent = board.ranks[0]->sent_now;
    REQUIRE(sent.size() == 2);
    CHECK(sent[0].to != sent[1].to);
    for (const auto& m : sent) {
      CHECK(m.key == MessageKey{1, 21, 0});
      CHECK(m.signature.call == 7);
      CHECK(m.signature.count == 1);
    }
    readers_get(board, 21);
  }
  {
    // One peer cannot take it now: none goes (the run then sends them all).
    Switchboard board(4, false);
    board.ranks[0]->busy = {1};
    REQUIRE(MessagePlan::send_now(board_channel(board, members, 0, 22), root, buffers) == 0);
    CHECK(board.ranks[0]->sent_now.empty());
  }
  {
    // A plan with a receive, and two sends to one peer: not taken.
    Switchboard board(4, false);
    CHECK(MessagePlan::send_now(board_channel(board, members, 2, 23), binomial_broadcast(4, 2, 0, 5), buffers) == 0);
    Plan twice = root;
    twice[1].send_to = twice[0].send_to;
    CHECK(MessagePlan::send_now(board_channel(board, members, 0, 23), twice, buffers) == 0);
    CHECK(board.ranks[0]->sent_now.empty());
    CHECK(board.ranks[2]->sent_now.empty());
  }
  for (bool deferred : {false, true}) {
    // The context fails after the first message went: send_now says 1, and a run started after it sends
    // the rest, not the first again.
    Switchboard board(4, deferred);
    board.ranks[0]->take_now = 1;
    const Channel ch = board_channel(board, members, 0, 24);
    REQUIRE(MessagePlan::send_now(ch, root, buffers) == 1);
    Outcome outcome;
    MessagePlan rest(ch, root, buffers, &Outcome::mark, &outcome);
    rest.start(1);
    readers_get(board, 24);
    CHECK(outcome.done);
    CHECK(rest.failure() == nullptr);
  }
}

TEST_CASE("which plans run as whole messages", "[plans][messages]") {
  std::vector<Value> buf(1 << 16, 0);
  auto* bytes = reinterpret_cast<std::byte*>(buf.data());
  const PlanBuffers buffers{bytes, bytes, DType::i64, ReduceOp::sum};
  ExecOptions small;
  small.segment_bytes = 64;  // 8 elements of i64
  REQUIRE(MessagePlan::fits(binomial_broadcast(8, 3, 0, 8), buffers, small));
  REQUIRE(!MessagePlan::fits(binomial_broadcast(8, 3, 0, 9), buffers, small));  // two segments
  REQUIRE(MessagePlan::fits(binomial_broadcast(256, 0, 0, 1), buffers, small));  // 8 sends
  REQUIRE(!MessagePlan::fits(binomial_broadcast(512, 0, 0, 1), buffers, small));  // 9
  REQUIRE(MessagePlan::fits(ring_all_reduce(2, 0, 16), buffers, small));  // reduces, a block of 8 each way
  REQUIRE(!MessagePlan::fits(ring_all_reduce(2, 0, 17), buffers, small));  // a block of 9: two segments
  REQUIRE(MessagePlan::fits(chain_broadcast(4, 1, 0, 8), buffers, small));  // receives and forwards
  REQUIRE(MessagePlan::fits(dissemination_barrier(16, 5), PlanBuffers{}, small));
  PlanBuffers staged = buffers;
  struct NoStaging final : StagedBuffers {
    bool ready(const std::byte*, const std::byte*) override { return true; }
    Task<void> until_ready(const std::byte*, const std::byte*) override { co_return; }
    void finished(std::byte*, std::byte*) override {}
  } staging;
  staged.staged = &staging;
  REQUIRE(!MessagePlan::fits(binomial_broadcast(2, 1, 0, 4), staged, small));
  // A receive into a range an earlier send reads (its send may still be going): not here.
  const Plan overlapping{Step{StepKind::send, 1, -1, Range{0, 4}, {}}, Step{StepKind::recv, -1, 1, {}, Range{2, 4}}};
  REQUIRE(!MessagePlan::fits(overlapping, buffers, small));
  const Plan apart{Step{StepKind::send, 1, -1, Range{0, 4}, {}}, Step{StepKind::recv, -1, 1, {}, Range{4, 4}}};
  REQUIRE(MessagePlan::fits(apart, buffers, small));
  const Plan forwarded_then_overwritten{Step{StepKind::recv_copy_send, 2, 1, Range{0, 4}, Range{0, 4}},
                                        Step{StepKind::recv, -1, 1, {}, Range{3, 1}}};
  REQUIRE(!MessagePlan::fits(forwarded_then_overwritten, buffers, small));
}
