"""A matrix multiply sharded across ranks: C = A @ B with the inner dimension K split among them.

Each rank multiplies its slices (its share of every element of C), reduce_scatter sums the shares and
leaves each rank its rows of C (uneven when the ranks do not divide M), and all_gather joins the rows.

    build/tools/weft-run -n 3 -- python3 examples/python/sharded_matmul.py
"""
import asyncio

import numpy as np
import weft

M, K, N = 10, 12, 7


async def main():
    g = weft.Group.create()
    p, r = g.size, g.rank
    rng = np.random.default_rng(0)  # the same A and B on every rank, so that each can check C
    A = rng.integers(-3, 4, (M, K)).astype(np.float64)
    B = rng.integers(-3, 4, (K, N)).astype(np.float64)
    k = np.array_split(np.arange(K), p)[r]                  # this rank's slice of the inner dimension
    partial = A[:, k] @ B[k, :]                              # (M, N): this rank's share of every element
    rows = [len(s) for s in np.array_split(np.arange(M), p)]  # rows of C per rank
    mine = await g.reduce_scatter(partial, axis=0, tiled=True, extents=rows)  # my rows of C, summed
    C = await g.all_gather(mine, axis=0, tiled=True, extents=rows)            # every row, on every rank
    assert np.array_equal(C, A @ B), "C differs from A @ B"
    first = sum(rows[:r])
    print(f"rank {r} of {p}: reduced rows {first}..{first + rows[r] - 1} of C; the gathered C matches A @ B")
    g.close()


asyncio.run(main())
