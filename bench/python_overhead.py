"""Per-call cost of the Python layer: an 8-byte all_reduce (2 x f32) called from Python, waited on from
plain code (wait()) and awaited from asyncio, timed over ITERS calls after WARMUP. Rank 0 prints
`python wait US` and `python await US` (microseconds per call). bench/python_overhead.sh runs it beside
weft-bench's C++ figure, interleaved.

    build/tools/weft-run -n 2 -- python3 bench/python_overhead.py [ITERS] [WARMUP]
"""
import asyncio
import sys
import time

import numpy as np
import weft

ITERS = int(sys.argv[1]) if len(sys.argv) > 1 else 5000
WARMUP = int(sys.argv[2]) if len(sys.argv) > 2 else 200


def timed_wait(g, x, y, n):
    g.barrier().wait()
    start = time.perf_counter()
    for _ in range(n):
        g.all_reduce(x, out=y).wait()
    return (time.perf_counter() - start) / n * 1e6


async def timed_await(g, x, y, n):
    await g.barrier()
    start = time.perf_counter()
    for _ in range(n):
        await g.all_reduce(x, out=y)
    return (time.perf_counter() - start) / n * 1e6


def main():
    g = weft.Group.create()
    x = np.ones(2, dtype=np.float32)
    y = np.empty_like(x)
    timed_wait(g, x, y, WARMUP)
    waited = timed_wait(g, x, y, ITERS)
    asyncio.run(timed_await(g, x, y, WARMUP))
    awaited = asyncio.run(timed_await(g, x, y, ITERS))
    assert y[0] == g.size
    if g.rank == 0:
        print(f"python wait {waited:.2f}")
        print(f"python await {awaited:.2f}")
    g.close()


main()
