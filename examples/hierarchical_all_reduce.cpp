// A collective weft does not ship, built only from public pieces: a hierarchical all_reduce.
//   1. reduce-scatter inside each node (a ring plan on the node's sub-group),
//   2. all_reduce of this rank's block across nodes (a ring plan on the cross-node sub-group),
//   3. all-gather inside each node (a ring plan again).
// Run: weft-run -n 4 -- example-hierarchical-all-reduce 2      (2 "nodes" of 2 ranks)
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <weft/weft.hpp>

namespace algo = weft::algorithms;

weft::Task<void> hierarchical_all_reduce(weft::Group& node, weft::Group& across, std::vector<double>& data) {
  const std::size_t count = data.size();
  auto* bytes = reinterpret_cast<std::byte*>(data.data());
  const std::vector<algo::Range> blocks = algo::blocks_of(count, node.size());
  const algo::PlanBuffers in_place{bytes, bytes, weft::DType::f64, weft::ReduceOp::sum};

  // 1. Inside the node: after it, this rank holds block node.rank() summed over the node.
  co_await node.run_plan(algo::ring_reduce_scatter(node.size(), node.rank(), blocks, -1), in_place, "node_reduce_scatter");

  // 2. Across nodes: sum that block over the ranks that hold the same block on the other nodes.
  const algo::Range mine = blocks[static_cast<std::size_t>(node.rank())];
  std::byte* block = bytes + mine.offset * sizeof(double);
  co_await across.run_plan(algo::ring_all_reduce(across.size(), across.rank(), mine.count),
                           algo::PlanBuffers{block, block, weft::DType::f64, weft::ReduceOp::sum}, "cross_all_reduce");

  // 3. Inside the node again: everybody gets every block.
  co_await node.run_plan(algo::ring_all_gather(node.size(), node.rank(), blocks, -1), in_place, "node_all_gather");
}

int main(int argc, char** argv) {
  const int per_node = argc > 1 ? std::atoi(argv[1]) : 2;
  const std::size_t count = argc > 2 ? static_cast<std::size_t>(std::atol(argv[2])) : 100003;
  weft::Loop loop;
  weft::Group world = weft::Group::create(loop).get();
  if (per_node < 1 || world.size() % per_node != 0) {
    std::fprintf(stderr, "world size %d is not a multiple of %d ranks per node\n", world.size(), per_node);
    return 2;
  }
  weft::Group node = world.split(world.rank() / per_node, world.rank()).get();
  weft::Group across = world.split(world.rank() % per_node, world.rank()).get();

  std::vector<double> data(count);
  for (std::size_t i = 0; i < count; ++i) data[i] = static_cast<double>(world.rank() + 1) * static_cast<double>(i % 97);
  weft::sync_wait(loop, hierarchical_all_reduce(node, across, data));

  const double ranks_sum = world.size() * (world.size() + 1) / 2.0;
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < count; ++i) wrong += data[i] != ranks_sum * static_cast<double>(i % 97);
  std::printf("rank %d (node %d, local rank %d): %zu of %zu elements wrong\n", world.rank(), world.rank() / per_node,
              node.rank(), wrong, count);
  return wrong == 0 ? 0 : 1;
}
