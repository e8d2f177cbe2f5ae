"""A hierarchical all_reduce composed from weft's plans, as examples/hierarchical_all_reduce.cpp: the
ranks of a "node" (consecutive ranks, PER_NODE of them) reduce-scatter among themselves, the ranks that
hold the same block on every node all_reduce it, and each node all-gathers the blocks again.

    build/tools/weft-run -n 4 -- python3 examples/python/hierarchical_all_reduce.py 2
"""
import sys

import numpy as np
import weft


def hierarchical_all_reduce(node, across, data):
    """data (float64, 1-d) summed over every rank of node x across, in place."""
    count = data.size
    # 1. Inside the node: afterwards this rank holds its block, summed over the node.
    node.run_plan(weft.plan("ring_reduce_scatter", node.size, node.rank, count), data, name="node_reduce_scatter").wait()
    # 2. Across the nodes: that block summed over the ranks that hold it elsewhere (a view of it, in place).
    offset, n = weft.blocks_of(count, node.size)[node.rank]
    block = data[offset:offset + n]
    across.run_plan(weft.plan("ring_all_reduce", across.size, across.rank, n), block, name="cross_all_reduce").wait()
    # 3. Inside the node again: every block to every rank.
    node.run_plan(weft.plan("ring_all_gather", node.size, node.rank, count), data, name="node_all_gather").wait()


def main():
    per_node = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 100003
    world = weft.Group.create()
    if per_node < 1 or world.size % per_node:
        sys.exit(f"world size {world.size} is not a multiple of {per_node} ranks per node")
    node = world.split(world.rank // per_node, world.rank)
    across = world.split(world.rank % per_node, world.rank)
    pattern = np.arange(count) % 97.0
    data = (world.rank + 1) * pattern
    hierarchical_all_reduce(node, across, data)
    wrong = int(np.count_nonzero(data != world.size * (world.size + 1) / 2 * pattern))
    print(f"rank {world.rank} (node {world.rank // per_node}, local rank {node.rank}): {wrong} of {count} elements wrong")
    for g in (across, node, world):
        g.close()
    sys.exit(1 if wrong else 0)


main()
