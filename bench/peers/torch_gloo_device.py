#!/usr/bin/env python3
"""torch.distributed with the gloo backend on CUDA tensors: the peer that issue 16's device all_reduce is held
against. Two processes (ranks) share GPU 0, as weft-bench --device does under weft-run -n 2; each all_reduces a
float32 CUDA tensor of --bytes, torch.cuda.synchronize() after each call, the median of --iters after --warmup.

  python3 bench/peers/torch_gloo_device.py [--bytes 67108864] [--iters 20] [--warmup 3] [--world 2]

Prints one line per size: bytes, median time in us, algbw and busbw in GB/s (nccl-tests' all_reduce factor
2(n-1)/n), and whether the result was checked right.
"""
import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, world, sizes, iters, warmup, port, results):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.cuda.set_device(0)
    for nbytes in sizes:
        count = max(1, nbytes // 4)
        t = torch.full((count,), float(rank + 1), dtype=torch.float32, device="cuda")
        times = []
        for i in range(warmup + iters):
            t.fill_(float(rank + 1))
            torch.cuda.synchronize()
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(t)
            torch.cuda.synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        expected = world * (world + 1) / 2
        ok = bool(torch.all(t == expected).item())
        if rank == 0:
            us = statistics.median(times) * 1e6
            algbw = count * 4 / (us * 1e-6) / 1e9
            results.append((count * 4, us, algbw, algbw * 2 * (world - 1) / world, ok))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bytes", type=int, nargs="+", default=[64 << 20])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--port", type=int, default=29533)
    a = parser.parse_args()
    manager = mp.Manager()
    results = manager.list()
    mp.spawn(run, args=(a.world, a.bytes, a.iters, a.warmup, a.port, results), nprocs=a.world, join=True)
    print(f"torch {torch.__version__} gloo, {a.world} processes on cuda:0, float32 sum")
    print(f"{'bytes':>12} {'time_us':>12} {'algbw_GBps':>11} {'busbw_GBps':>11} check")
    for nbytes, us, algbw, busbw, ok in results:
        print(f"{nbytes:>12} {us:>12.1f} {algbw:>11.2f} {busbw:>11.2f} {'ok' if ok else 'WRONG'}")


if __name__ == "__main__":
    main()
