#!/usr/bin/env python3
"""What torch offers beside weft-device-set-bench (issue 17): an all_reduce of N tensors on one GPU inside one
process, N = 2, 4, 8, f32 sum, out of place, timed as that bench times weft (--iters calls back to back after
--warmup, CUDA events around them, the average per call):

  chain  out = x0 + x1; out += x2 ...; then out copied into each of the N outputs (what weft's naive path does)
  stack  torch.stack(xs).sum(0), then the N copies

and, with --nccl, whether NCCL accepts two ranks on the same GPU (torch.distributed, 2 processes on cuda:0):
NCCL refuses duplicate GPUs in one communicator, so torch has no in-process peer reduction to set beside
weft's on one GPU; the script prints what NCCL said.

  python3 bench/peers/torch_device_set.py [--entries 2,4,8] [--min 8] [--max 268435456] [--nccl]
"""
import argparse
import os
import sys

import torch


def timed(fn, iters, warmup):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters  # us per call


def iterations_for(nbytes):
    if nbytes <= 1 << 20:
        return 200
    if nbytes <= 32 << 20:
        return 40
    return 10


def nccl_child(rank, port, queue):
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=torch.device("cuda", 0))
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        queue.put((rank, "ran: result %s" % t.tolist()))
        dist.destroy_process_group()
    except Exception as e:  # what NCCL said is the point
        queue.put((rank, "refused: %s" % str(e).splitlines()[0][:300]))


def nccl_same_gpu():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=nccl_child, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    said = []
    while not queue.empty():
        said.append(queue.get())
    print("NCCL, 2 ranks on cuda:0 (torch %s, nccl %s): %s" % (torch.__version__, ".".join(map(str, torch.cuda.nccl.version())),
                                                               said or "no answer within 60 s (hung)"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--entries", default="2,4,8")
    parser.add_argument("--min", type=int, default=8)
    parser.add_argument("--max", type=int, default=256 << 20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nccl", action="store_true")
    args = parser.parse_args()
    sizes = []
    b = max(args.min, 4)
    while b <= args.max:
        sizes.append(b // 4 * 4)
        b *= 4
    if sizes[-1] != args.max // 4 * 4:
        sizes.append(args.max // 4 * 4)
    print("torch %s on %s, f32 sum, out of place" % (torch.__version__, torch.cuda.get_device_name(0)))
    print("%3s %11s %12s %12s %12s" % ("N", "bytes", "chain(us)", "stack(us)", "copy(us)"))
    for n in [int(x) for x in args.entries.split(",")]:
        most = sizes[-1] // 4
        xs = [torch.ones(most, dtype=torch.float32, device="cuda") for _ in range(n)]
        outs = [torch.empty(most, dtype=torch.float32, device="cuda") for _ in range(n)]
        for nbytes in sizes:
            count = nbytes // 4
            ins = [x[:count] for x in xs]
            os_ = [o[:count] for o in outs]

            def chain():
                acc = torch.add(ins[0], ins[1]) if n > 1 else ins[0].clone()
                for x in ins[2:]:
                    acc.add_(x)
                for o in os_:
                    o.copy_(acc)

            def stack():
                acc = torch.stack(ins).sum(0)
                for o in os_:
                    o.copy_(acc)

            def copy():
                os_[0].copy_(ins[0])

            iters = iterations_for(nbytes)
            c = timed(chain, iters, args.warmup)
            if not bool(torch.all(os_[-1] == float(n)).item()):
                print("wrong result at N %d, %d bytes" % (n, nbytes))
                return 1
            s = timed(stack, iters, args.warmup)
            cp = timed(copy, iters, args.warmup)
            print("%3d %11d %12.1f %12.1f %12.1f" % (n, nbytes, c, s, cp))
            sys.stdout.flush()
    if args.nccl:
        nccl_same_gpu()
    return 0


if __name__ == "__main__":
    sys.exit(main())
