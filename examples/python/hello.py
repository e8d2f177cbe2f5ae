import asyncio, numpy as np, weft

async def main():
    g = weft.Group.create()  # rank, size and store from weft-run's environment
    x = np.full(4, g.rank + 1.0, dtype=np.float32)
    y = np.arange(6.0).reshape(2, 3) * (g.rank + 1)
    total, rows = await asyncio.gather(g.all_reduce(x), g.all_gather(y, axis=0, tiled=True))
    print(f"rank {g.rank} of {g.size}: sum {total}, gathered rows {rows.shape}")
    g.close()

asyncio.run(main())
