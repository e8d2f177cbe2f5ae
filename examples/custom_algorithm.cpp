// A user-written algorithm from public headers only: a ring all_reduce that visits the ranks in an order
// the user gives (for instance the order of the machines in a rack, so that each hop stays short). The
// steps are listed here, one by one, not taken from weft's plan builders; Group::run_plan runs them as
// one collective of the group. The result is checked against group.all_reduce and the exact sum.
//
// Run: weft-run -n 4 -- example-custom-algorithm [COUNT] [ORDER]
//   ORDER: the ring as a comma-separated list of ranks, e.g. 0,2,3,1 (default: even ranks, then odd ones)
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include <weft/weft.hpp>

namespace algo = weft::algorithms;

// This rank's script of an all_reduce over the ring `order` (order[i + 1] follows order[i]), in place
// over `count` elements cut into p blocks:
//   reduce-scatter, p - 1 steps: at step s, send block (i - s) to the next rank and receive block
//     (i - s - 1) from the previous one, adding it to ours. After it, this rank holds block (i + 1)
//     summed over every rank.
//   all-gather, p - 1 steps: at step s, pass block (i + 1 - s) on and receive block (i - s).
// Every transfer's sender and receiver name the same block, so both sides agree on its size.
algo::Plan ordered_ring_all_reduce(const std::vector<int>& order, int rank, std::size_t count) {
  const int p = static_cast<int>(order.size());
  int i = 0;
  while (order[static_cast<std::size_t>(i)] != rank) ++i;
  const int next = order[static_cast<std::size_t>((i + 1) % p)];
  const int prev = order[static_cast<std::size_t>((i + p - 1) % p)];
  const auto blocks = algo::blocks_of(count, p);
  auto block = [&](int k) { return blocks[static_cast<std::size_t>(((k % p) + p) % p)]; };

  algo::Plan plan;
  for (int s = 0; s < p - 1; ++s) {
    plan.push_back(algo::Step{algo::StepKind::send_recv_reduce, next, prev, block(i - s), block(i - s - 1)});
  }
  for (int s = 0; s < p - 1; ++s) {
    plan.push_back(algo::Step{algo::StepKind::send_recv, next, prev, block(i + 1 - s), block(i - s)});
  }
  return plan;
}

std::vector<int> parse_order(const std::string& text, int p) {
  std::vector<int> order;
  if (text.empty()) {
    for (int r = 0; r < p; r += 2) order.push_back(r);
    for (int r = 1; r < p; r += 2) order.push_back(r);
    return order;
  }
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) order.push_back(std::atoi(item.c_str()));
  return order;
}

// A permutation of 0..p-1?
bool is_ring(const std::vector<int>& order, int p) {
  if (static_cast<int>(order.size()) != p) return false;
  std::vector<bool> seen(static_cast<std::size_t>(p));
  for (int r : order) {
    if (r < 0 || r >= p || seen[static_cast<std::size_t>(r)]) return false;
    seen[static_cast<std::size_t>(r)] = true;
  }
  return true;
}

weft::Task<std::size_t> run(weft::Group& group, std::size_t count, const std::vector<int>& order) {
  // Integer-valued doubles: any summation order gives the exact sum, so the results compare bit for bit.
  std::vector<double> mine(count), theirs(count);
  for (std::size_t k = 0; k < count; ++k) mine[k] = theirs[k] = static_cast<double>((group.rank() + 1) * static_cast<int>(k % 1013));
  auto* bytes = reinterpret_cast<std::byte*>(mine.data());
  co_await group.run_plan(ordered_ring_all_reduce(order, group.rank(), count),
                          algo::PlanBuffers{bytes, bytes, weft::DType::f64, weft::ReduceOp::sum}, "ordered_ring_all_reduce");
  co_await group.all_reduce(theirs);
  const double ranks = group.size() * (group.size() + 1) / 2.0;
  std::size_t wrong = 0;
  for (std::size_t k = 0; k < count; ++k) {
    wrong += mine[k] != theirs[k] || mine[k] != ranks * static_cast<double>(k % 1013);
  }
  co_return wrong;
}

int main(int argc, char** argv) {
  const std::size_t count = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 100003;
  weft::Loop loop;
  weft::Group group = weft::Group::create(loop).get();
  const auto order = parse_order(argc > 2 ? argv[2] : "", group.size());
  if (!is_ring(order, group.size())) {
    std::fprintf(stderr, "the order must list every rank of %d once\n", group.size());
    return 2;
  }
  const std::size_t wrong = weft::sync_wait(loop, run(group, count, order));
  std::string ring;
  for (int r : order) ring += (ring.empty() ? "" : "->") + std::to_string(r);
  std::printf("rank %d: ring %s, %zu elements: %zu differ from all_reduce or the exact sum\n", group.rank(), ring.c_str(),
              count, wrong);
  return wrong == 0 ? 0 : 1;
}
