"""One rank of a pytest scenario: `python3 ranks.py SCENARIO` with weft's environment set (by weft-run or
by test_weft.py's launcher). Prints "ok <scenario>" and exits 0 when every check held; a failed check
raises (exit 1) with what differed."""

import asyncio
import os
import signal
import sys
import threading
import time

import numpy as np

import weft


def expect(ok, what):
    if not ok:
        raise AssertionError(what)


def expect_error(fn, errc, *words):
    try:
        fn()
    except weft.Error as e:
        expect(e.errc == errc, f"expected {errc}, got {e.errc}: {e}")
        for w in words:
            expect(w in str(e), f"'{w}' not in: {e}")
        return e
    raise AssertionError(f"no weft.Error ({errc}) was raised")


def inputs(rank, shape, dtype, salt=0):
    """Rank r's input: small integers, exact in every dtype and in every sum of a few of them."""
    n = int(np.prod(shape)) if shape else 1
    values = (np.arange(n) * 3 + rank * 7 + salt) % 11
    if np.dtype(dtype).kind in "iuf" and np.dtype(dtype).kind != "u":
        values = values - 5
    return values.astype(dtype).reshape(shape)


DTYPES = [np.float32, np.float64, np.int32, np.int64, np.uint8, np.float16]


# ---- every collective against numpy


def collectives(g):
    p, r = g.size, g.rank
    for dtype in DTYPES:
        everyone = [inputs(i, (3, 4, 5), dtype) for i in range(p)]
        x = everyone[r]
        # all_reduce: sum, max, min, and prod on a small range; in place through out=x too
        for op, ref in [("sum", np.sum), ("max", np.max), ("min", np.min)]:
            got = g.all_reduce(x, op=op).wait()
            want = ref(np.stack(everyone), axis=0).astype(dtype)
            expect(np.array_equal(got, want), f"all_reduce {op} {np.dtype(dtype).name}: {got.ravel()[:6]} vs {want.ravel()[:6]}")
        y = x.copy()
        g.all_reduce(y, out=y).wait()
        expect(np.array_equal(y, np.sum(np.stack(everyone), axis=0).astype(dtype)), "all_reduce in place")
        # a strided (non-contiguous) input and output
        t = np.ascontiguousarray(x.transpose(2, 0, 1)).transpose(1, 2, 0)
        out = np.empty((5, 3, 4), dtype=dtype).transpose(1, 2, 0)
        g.all_reduce(t, out=out).wait()
        expect(np.array_equal(out, np.sum(np.stack(everyone), axis=0).astype(dtype)), "all_reduce strided")
        # broadcast
        root = p - 1
        got = g.broadcast(x, root=root).wait()
        expect(np.array_equal(got, everyone[root]), f"broadcast {np.dtype(dtype).name}")
        for axis in range(3):
            # all_gather, untiled (stacked) and tiled (concatenated), with negative axes too
            got = g.all_gather(x, axis=axis).wait()
            expect(np.array_equal(got, np.stack(everyone, axis=axis)), f"all_gather untiled axis {axis}")
            got = g.all_gather(x, axis=axis - 3, tiled=True).wait()
            expect(np.array_equal(got, np.concatenate(everyone, axis=axis)), f"all_gather tiled axis {axis}")
            # uneven shards: rank i holds i % 2 + 1 along the axis
            extents = [i % 2 + 1 for i in range(p)]
            shards = [np.take(everyone[i], range(extents[i]), axis=axis) for i in range(p)]
            got = g.all_gather(shards[r], axis=axis, tiled=True, extents=extents).wait()
            expect(np.array_equal(got, np.concatenate(shards, axis=axis)), f"all_gather uneven axis {axis}")
            # reduce_scatter: tiled over an axis p x 2 long, untiled over one p long
            shape = [3, 4, 5]
            shape[axis] = 2 * p
            big = [inputs(i, tuple(shape), dtype, 1) for i in range(p)]
            got = g.reduce_scatter(big[r], axis=axis, tiled=True).wait()
            total = np.sum(np.stack(big), axis=0).astype(dtype)
            expect(np.array_equal(got, np.take(total, range(2 * r, 2 * r + 2), axis=axis)), f"reduce_scatter tiled axis {axis}")
            shape[axis] = p
            small = [inputs(i, tuple(shape), dtype, 2) for i in range(p)]
            got = g.reduce_scatter(small[r], axis=axis).wait()
            total = np.sum(np.stack(small), axis=0).astype(dtype)
            expect(np.array_equal(got, np.take(total, r, axis=axis)), f"reduce_scatter untiled axis {axis}")
            # all_to_all, tiled and untiled, to every concat axis
            for concat in range(3):
                shape = [3, 4, 5]
                shape[axis] = 2 * p
                a2a = [inputs(i, tuple(shape), dtype, 3) for i in range(p)]
                got = g.all_to_all(a2a[r], split_axis=axis, concat_axis=concat, tiled=True).wait()
                parts = [np.split(a2a[i], p, axis=axis)[r] for i in range(p)]
                expect(np.array_equal(got, np.concatenate(parts, axis=concat)), f"all_to_all tiled {axis}->{concat}")
                shape[axis] = p
                a2a = [inputs(i, tuple(shape), dtype, 4) for i in range(p)]
                got = g.all_to_all(a2a[r], split_axis=axis, concat_axis=concat).wait()
                parts = [np.take(a2a[i], r, axis=axis) for i in range(p)]
                expect(np.array_equal(got, np.stack(parts, axis=concat)), f"all_to_all untiled {axis}->{concat}")
        # ppermute: a shift by one; with p > 2, rank 0 receives from nobody (zeros)
        pairs = [(i, i + 1) for i in range(p - 1)] if p > 2 else [(i, (i + 1) % p) for i in range(p)]
        got = g.ppermute(x, pairs).wait()
        sources = {dst: src for src, dst in pairs}
        want = everyone[sources[r]] if r in sources else np.zeros_like(x)
        expect(np.array_equal(got, want), "ppermute")
        # rooted: reduce, gather, scatter
        got = g.reduce(x, root=0).wait()
        if r == 0:
            expect(np.array_equal(got, np.sum(np.stack(everyone), axis=0).astype(dtype)), "reduce")
        else:
            expect(got is None, "reduce returns None off the root")
        got = g.gather(x, root=0).wait()
        if r == 0:
            expect(np.array_equal(got, np.stack(everyone)), "gather")
        got = g.scatter(np.stack(everyone) if r == 0 else None, root=0, shape=x.shape, dtype=dtype).wait()
        expect(np.array_equal(got, everyone[r]), "scatter")
        # variable-size: uneven counts, zeros among them
        counts = [(i * 5 + 2) % 4 for i in range(p)]
        flat = [inputs(i, (counts[i],), dtype, 5) for i in range(p)]
        got = g.all_gatherv(flat[r], counts).wait()
        expect(np.array_equal(got, np.concatenate(flat)), "all_gatherv")
        displs = list(reversed(np.cumsum([0] + counts[::-1])[:-1].tolist()))  # blocks in reverse order
        got = g.gatherv(flat[r], counts, root=0, displs=displs).wait()
        if r == 0:
            expect(all(np.array_equal(got[displs[i]:displs[i] + counts[i]], flat[i]) for i in range(p)), "gatherv")
        got = g.scatterv(np.concatenate(flat) if r == 0 else None, counts, root=0, dtype=dtype).wait()
        expect(np.array_equal(got, flat[r]), "scatterv")
        sends = [[(i + 2 * j) % 3 for j in range(p)] for i in range(p)]
        blocks = [[inputs(i, (sends[i][j],), dtype, 10 * j) for j in range(p)] for i in range(p)]
        got = g.all_to_allv(np.concatenate(blocks[r]), sends[r], [sends[i][r] for i in range(p)]).wait()
        expect(np.array_equal(got, np.concatenate([blocks[i][r] for i in range(p)])), "all_to_allv")
        whole = [inputs(i, (sum(counts),), dtype, 6) for i in range(p)]
        got = g.reduce_scatterv(whole[r], counts).wait()
        start = sum(counts[:r])
        expect(np.array_equal(got, np.sum(np.stack(whole), axis=0).astype(dtype)[start:start + counts[r]]), "reduce_scatterv")
    # point to point and barrier
    if p > 1:
        if r == 0:
            g.send(np.arange(10, dtype=np.int16), 1, tag=7).wait()
        elif r == 1:
            got = g.recv(np.empty(10, dtype=np.int16), 0, tag=7).wait()
            expect(np.array_equal(got, np.arange(10, dtype=np.int16)), "send/recv")
    expect(g.barrier().wait() is None, "barrier returns None")
    # split: the even and the odd ranks, each a group of its own; a negative color leaves a rank out
    sub = g.split(r % 2, key=-r)
    expect(sub.size == (p + 1 - r % 2) // 2, f"split: a group of {sub.size}")
    expect(sub.rank == (sub.size - 1 - r // 2), f"split: ordered by key (rank {sub.rank})")
    got = sub.all_reduce(np.array([r], dtype=np.int64)).wait()
    expect(int(got[0]) == sum(i for i in range(p) if i % 2 == r % 2), "all_reduce on a split group")
    sub.close()
    left_out = g.split(-1 if r == 0 else 0)
    expect((left_out is None) == (r == 0), "split with a negative color gives None")
    if left_out is not None:
        left_out.close()


# ---- asyncio


async def overlap(g):
    """Two collectives in flight at once with other coroutines running meanwhile."""
    ticks = 0
    running = True

    async def ticker():
        nonlocal ticks
        while running:
            ticks += 1
            await asyncio.sleep(0)

    t = asyncio.create_task(ticker())
    a = np.full(1 << 22, g.rank + 1, dtype=np.float32)
    b = np.arange(1 << 20, dtype=np.float64)
    # The other ranks join 0.3 s late (sleeping the asyncio way): rank 0's two collectives cannot complete
    # before they do, however fast the machine or slow the scheduler, so its ticker must run meanwhile.
    if g.rank != 0:
        await asyncio.sleep(0.3)
    first = g.all_reduce(a)
    second = g.all_gather(b, axis=0, tiled=True)
    x, y = await asyncio.gather(first, second)
    running = False
    await t
    expect(np.all(x == g.size * (g.size + 1) / 2), "all_reduce under asyncio")
    expect(np.array_equal(y, np.tile(b, g.size)), "all_gather under asyncio")
    if g.rank == 0 and g.size > 1:
        expect(ticks > 2, f"the other coroutine ran only {ticks} times while the collectives were in flight")
    # One Work awaited by two coroutines at once: both get its result.
    twice = g.all_reduce(np.full(1 << 20, 1.0, dtype=np.float32))
    r1, r2 = await asyncio.gather(_await(twice), _await(twice))
    expect(r1 is r2 and np.all(r1 == g.size), "a Work awaited twice")
    # Many small ones, awaited in one gather, in order of completion
    results = await asyncio.gather(*[g.all_reduce(np.array([i], dtype=np.int64)) for i in range(50)])
    expect([int(v[0]) for v in results] == [i * g.size for i in range(50)], "50 small all_reduces")
    print(f"rank {g.rank}: {ticks} ticks during the collectives")


async def _await(work):
    return await work


def mark(name):
    """Tells the other ranks (processes of one host) that `name` happened: a file beside TEST_READY_FILE."""
    open(os.environ["TEST_READY_FILE"] + "." + name, "w").close()


def all_marked(name, limit=60):
    """Marks `name` for this rank and waits (blocking) until every rank of the group has: a rendezvous
    outside weft, for scenarios whose group is about to fail."""
    rank, size = int(os.environ["WEFT_RANK"]), int(os.environ["WEFT_WORLD_SIZE"])
    mark(f"{name}.{rank}")
    deadline = time.monotonic() + limit
    while not all(os.path.exists(os.environ["TEST_READY_FILE"] + f".{name}.{r}") for r in range(size)):
        expect(time.monotonic() < deadline, f"not every rank marked '{name}' within {limit} s")
        time.sleep(0.01)


async def until_marked(name, limit=120):
    """Waits (the asyncio way) until another rank marked `name`."""
    path = os.environ["TEST_READY_FILE"] + "." + name
    deadline = time.monotonic() + limit
    while not os.path.exists(path):
        expect(time.monotonic() < deadline, f"no rank marked '{name}' within {limit} s")
        await asyncio.sleep(0.02)


async def cancel(g):
    """Rank 0 cancels the task awaiting a collective that the others call only after that (they wait for
    rank 0's mark): every rank's call fails with errc cancelled, and the group goes on."""
    x = np.ones(16, dtype=np.float32)
    if g.rank == 0:
        task = asyncio.ensure_future(g.all_reduce(x))  # a Work is an awaitable
        await asyncio.sleep(0.3)
        task.cancel()
        try:
            await task
            raise AssertionError("the cancelled task completed")
        except asyncio.CancelledError:
            pass
        mark("cancelled")
    else:
        await until_marked("cancelled")
        try:
            await g.all_reduce(x)
            raise AssertionError("a collective cancelled by rank 0 completed on rank %d" % g.rank)
        except weft.Error as e:
            expect(e.errc == "cancelled", f"expected cancelled, got {e.errc}: {e}")
            expect("rank 0 cancelled" in str(e), f"'rank 0 cancelled' not in: {e}")
    # The group goes on.
    got = await g.all_reduce(x)
    expect(np.all(got == g.size), "the collective after the cancelled one")


async def dead_peer(g):
    """The last rank leaves mid-collective (exits without calling it); every other rank's coroutine
    raises weft.Error naming it."""
    x = np.ones(1024, dtype=np.float32)
    await g.all_reduce(x)
    if g.rank == g.size - 1:
        time.sleep(0.5)
        os._exit(0)
    try:
        await g.all_reduce(x)
        raise AssertionError("a collective with a dead peer completed")
    except weft.Error as e:
        expect(e.errc in ("peer_failure", "aborted"), f"expected peer_failure, got {e.errc}: {e}")
        expect(f"rank {g.size - 1}" in str(e), f"the dead rank is not named: {e}")
        print(f"rank {g.rank}: {e}")


def bad_arguments(g):
    """Wrong dtypes and shapes raise before anything is sent: the next collective still works."""
    x = np.ones((4, 6), dtype=np.float32)
    expect_error(lambda: g.all_reduce(x, out=np.empty((4, 5), dtype=np.float32)), "invalid_argument", "all_reduce", "shape")
    expect_error(lambda: g.all_reduce(x, out=np.empty((4, 6), dtype=np.float64)), "invalid_argument", "f32", "f64")
    expect_error(lambda: g.all_reduce(x, op="bxor"), "invalid_argument", "bxor", "f32")
    expect_error(lambda: g.all_reduce(x, op="median"), "invalid_argument", "unknown reduce op 'median'")
    expect_error(lambda: g.all_reduce(np.array(["a", "b"])), "invalid_argument", "numpy dtype")
    # The other byte order was reduced as if native (ones summed to 4.25e37).
    expect_error(lambda: g.all_reduce(np.ones(4, dtype=">f4")), "invalid_argument", "'>f4'", "byte order")
    # Refused before the bootstrap (NaN seconds was cast to milliseconds: undefined behaviour).
    for t in (float("nan"), -1.0, 1e300):
        expect_error(lambda: weft.Group.create(timeout=t), "invalid_argument", "timeout=")
    # Refused by name (the binding's casts said "Unable to cast Python instance to C++ type", and its -1
    # for an unset rank called rank=-1 missing).
    expect_error(lambda: weft.Group.create(rank="0"), "invalid_argument", "weft: Group.create: rank must be an integer")
    expect_error(lambda: weft.Group.create(rank=-1, world_size=2), "invalid_argument", "Group.create: rank=-1")
    expect_error(lambda: weft.Group.create(world_size=0), "invalid_argument", "Group.create: world_size=0")
    expect_error(lambda: weft.Group.create(secret=5), "invalid_argument", "Group.create: secret: the secret is a string or bytes")
    expect_error(lambda: g.send(np.ones(4, dtype=">i8"), 0), "invalid_argument", "byte order")
    expect(g.all_reduce(np.ones(4, dtype=">u1")).wait()[0] == g.size, "one-byte types have no byte order")
    # Refused in Python (shapes, axes, missing arguments), named as weft's own refusals are: the rank and the call.
    me = f"weft: rank {g.rank}: "
    e = expect_error(lambda: g.reduce_scatter(np.ones((g.size + 1, 2), dtype=np.float32), axis=0), "invalid_argument",
                     me + "reduce_scatter: axis 0")
    expect(e.rank == g.rank and e.op == "reduce_scatter", f"rank {e.rank}, op {e.op!r}: {e}")
    expect_error(lambda: g.scatter(np.ones(g.size + 1, dtype=np.float32), root=g.rank), "invalid_argument", me + "scatter: the root's x has shape")
    expect_error(lambda: g.scatter(None, root=(g.rank + 1) % g.size) if g.size > 1 else g.scatter(np.ones(3), root=0),
                 "invalid_argument", me + "scatter")
    expect_error(lambda: g.ppermute(np.array([object()]), [(0, 0)]), "invalid_argument", me + "permute: weft has no element type for numpy dtype object")
    expect_error(lambda: g.all_gather(x, axis=5), "invalid_argument", "axis 5")
    expect_error(lambda: g.all_to_all(x, 0, 1, tiled=True) if 4 % g.size else g.all_to_all(x, 0, 1), "invalid_argument", "all_to_all")
    expect_error(lambda: g.broadcast(x, root=g.size), "invalid_argument", "root")
    expect_error(lambda: g.all_gatherv(np.ones(3, dtype=np.float32), [1] * (g.size + 1)), "invalid_argument", "counts")
    # Values the binding cannot convert (it raised TypeError listing its C++ signatures, or numpy's
    # "Maximum allowed dimension exceeded" for a count past 64 bits) are named as the others are.
    peer = (g.rank + 1) % g.size
    expect_error(lambda: g.send(np.ones(2, dtype=np.float32), peer, tag=-1), "invalid_argument", me + "send: tag -1 is out of range")
    expect_error(lambda: g.recv(np.ones(2, dtype=np.float32), peer, tag=2**32), "invalid_argument", me + "recv: tag 4294967296")
    expect_error(lambda: g.broadcast(x, root=2**40), "invalid_argument", me + "broadcast: root 1099511627776 is not a rank")
    expect_error(lambda: g.reduce(x, root=1.0), "invalid_argument", me + "reduce: root must be an integer, got float")
    expect_error(lambda: g.send(x, dst="1"), "invalid_argument", me + "send: destination must be an integer")
    expect_error(lambda: g.all_reduce(x, op=1), "invalid_argument", me + "all_reduce: op must be a reduce op's name")
    expect_error(lambda: g.all_gatherv(np.ones(1, dtype=np.float32), [-1] + [1] * (g.size - 1)), "invalid_argument",
                 me + "all_gatherv: counts[0] is -1")
    expect_error(lambda: g.all_gatherv(np.ones(1, dtype=np.float32), [2**70] * g.size), "invalid_argument", me + "all_gatherv: counts[0] is")
    expect_error(lambda: g.reduce_scatterv(np.ones(1, dtype=np.float32), [1.0] * g.size), "invalid_argument",
                 me + "reduce_scatterv: counts[0] must be an integer")
    expect_error(lambda: g.ppermute(x, [(0, 2**40)]), "invalid_argument", me + "permute: pairs[0] destination")
    expect_error(lambda: g.all_gather(x, axis=0.5), "invalid_argument", me + "all_gather: axis must be an integer")
    expect_error(lambda: g.split(2**40), "invalid_argument", me + "split: color 1099511627776 does not fit in 32 bits")
    read_only = np.ones(4, dtype=np.float32)
    read_only.flags.writeable = False
    expect_error(lambda: g.all_reduce(np.ones(4, dtype=np.float32), out=read_only), "invalid_argument", "read-only")
    got = g.all_reduce(np.ones(3, dtype=np.int32)).wait()
    expect(np.all(got == g.size), "the collective after refused calls")
    work = g.barrier()
    for bad in (float("nan"), -1, -0.5):
        expect_error(lambda: work.wait(timeout=bad), "invalid_argument", "timeout is", "0 or more")
    work.wait(timeout=float("inf"))  # no limit (it timed out at once: the clock overflowed)
    g.barrier().wait(timeout=1e300)


def algorithms(g):
    """Algorithm choices from Python: listed, asked for, overridden on every rank (the collective then
    runs the chosen one and is still right), refused by name when malformed, and a choice only some
    ranks made fails the collective on every rank naming both algorithms."""
    me = f"weft: rank {g.rank}: "
    expect(len(weft.__version__.split(".")) == 3, f"weft.__version__ {weft.__version__!r}")
    names = weft.available_algorithms("all_reduce")
    expect("ring" in names and "recursive_doubling" in names, f"all_reduce's algorithms: {names}")
    expect(weft.available_algorithms("ppermute") == weft.available_algorithms("permute"), "ppermute is permute")
    expect_error(lambda: weft.available_algorithms("all_reduse"), "invalid_argument", "'all_reduse' is not a collective")
    expect_error(lambda: weft.available_algorithms(3), "invalid_argument", "not int 3")
    chosen = g.algorithm_for("all_reduce", 8)
    expect(chosen in names or (chosen == "shm" and "shm" in names), f"algorithm_for all_reduce 8 B: {chosen!r}")
    expect(g.algorithm_for("ppermute", 8) == "", "ppermute has no choice")
    expect_error(lambda: g.algorithm_for("all_reduse", 8), "invalid_argument", me + "algorithm_for: 'all_reduse' is not a collective")
    expect_error(lambda: g.algorithm_for("all_reduce", -1), "invalid_argument", me + "algorithm_for: nbytes is -1")
    expect_error(lambda: g.override_algorithms("all_reduce:bogus"), "invalid_argument", me + "override_algorithms", "bogus")
    expect_error(lambda: g.override_algorithms(None), "invalid_argument", me + "override_algorithms: the algorithm choices are a string")
    expect(g.algorithm_for("all_reduce", 8) == chosen, "a refused override changes nothing")
    everyone = [inputs(i, (1000,), np.float32) for i in range(g.size)]
    want = np.sum(np.stack(everyone), axis=0)
    for algorithm in ("ring", "recursive_doubling"):
        g.override_algorithms(f"all_reduce:{algorithm}")
        expect(g.algorithm_for("all_reduce", 8) == algorithm and g.algorithm_for("all_reduce", 1 << 20) == algorithm,
               f"after override_algorithms('all_reduce:{algorithm}'): {g.algorithm_for('all_reduce', 8)}")
        got = g.all_reduce(everyone[g.rank]).wait()
        expect(np.array_equal(got, want), f"all_reduce with {algorithm}")
    if g.size == 1:
        return
    # Rank 0 alone changes its choice: the next all_reduce fails everywhere, naming both algorithms. Every
    # rank first sees all others done with the all_reduce before (marks, not a collective): the abort
    # that the mismatch causes also fails what is still in flight on a rank that lags behind.
    all_marked("agreed")
    if g.rank == 0:
        g.override_algorithms("all_reduce:ring")
    try:
        g.all_reduce(everyone[g.rank]).wait()
        raise AssertionError("an all_reduce run as ring on rank 0 and recursive_doubling elsewhere completed")
    except weft.Error as e:
        # The rank that finds the mismatch fails with it and aborts the group; the others fail aborted,
        # with its words.
        expect(e.errc in ("mismatch", "aborted"), f"expected mismatch, got {e.errc}: {e}")
        for words in ("all_reduce #3", "as ring", "as recursive_doubling"):
            expect(words in str(e), f"'{words}' not in: {e}")
    # Every rank keeps its group until all have seen the failure: one that closed at once could take its
    # connections down before its abort frame left, and the others would see a lost peer instead.
    all_marked("failed")


def deadlines(g):
    """Per-view deadlines: a receive with a short one that nothing matches fails with errc timeout and the
    group goes on; a view without a deadline and the group's own calls still work; bad values are refused."""
    me = f"weft: rank {g.rank}: "
    peer = (g.rank + 1) % g.size
    expect(g.transport_to(g.rank) == "self", f"transport_to itself: {g.transport_to(g.rank)}")
    # An arena where every peer is reached through shared memory (weft-run's ranks share this host).
    over_shm = g.size > 1 and all(g.transport_to(i) == "shm" for i in range(g.size) if i != g.rank)
    expect(g.has_shared_arena == over_shm, f"has_shared_arena {g.has_shared_arena} over {g.transport}")
    expect(g.size == 1 or g.transport_to(peer) in ("shm", "tcp", "uring"), f"transport_to {peer}: {g.transport_to(peer)}")
    expect_error(lambda: g.transport_to(g.size), "invalid_argument", me + "transport_to")
    for bad in (-1, float("nan"), 1e300):
        expect_error(lambda: g.with_timeout(bad), "invalid_argument", "with_timeout", "is not a number of seconds")
    expect_error(lambda: g.with_timeout("5"), "invalid_argument", me + "with_timeout: '5' is not a number of seconds")
    buf = np.zeros(4, dtype=np.float32)
    started = time.monotonic()
    # 0.3 ms: under a millisecond is still a deadline (it was cast to 0, none).
    for seconds in (0.3, 0.0003):
        e = expect_error(lambda: g.with_timeout(seconds).recv(buf, peer, tag=7).wait(), "timeout", "recv")
        expect(e.peer == peer, f"the timed-out receive names peer {peer}: {e}")
    took = time.monotonic() - started
    expect(took < 30, f"two receives with deadlines of 0.3 s and 0.3 ms took {took:.1f} s")
    view = g.without_deadline()
    got = view.all_reduce(np.ones(3, dtype=np.int32)).wait()
    expect(np.all(got == g.size), "a collective through a view without a deadline")
    view.close()
    got = g.all_reduce(np.ones(3, dtype=np.int32)).wait()
    expect(np.all(got == g.size), "the group after its receives timed out and a view was closed")


def shrink(g):
    """The last rank dies; the others' collective fails naming it, and shrink() makes a group of the
    survivors that works."""
    x = np.ones(16, dtype=np.float32)
    g.all_reduce(x).wait()
    if g.rank == g.size - 1:
        time.sleep(0.3)
        os._exit(0)
    try:
        g.all_reduce(x).wait()
        raise AssertionError("a collective with a dead peer completed")
    except weft.Error as e:
        expect(f"rank {g.size - 1}" in str(e), f"the dead rank is not named: {e}")
    e = expect_error(lambda: g.all_reduce(x).wait(), "group_failed", f"weft: rank {g.rank}: all_reduce", "an earlier operation failed")
    expect(str(e).count("weft: ") == 1, f"the earlier failure quoted with its own 'weft: ': {e}")
    h = g.shrink()
    expect(h.size == g.size - 1 and h.rank == g.rank, f"shrunk to rank {h.rank} of {h.size}")
    got = h.all_reduce(np.full(5, h.rank + 1.0, dtype=np.float32)).wait()
    expect(np.all(got == h.size * (h.size + 1) / 2), f"the shrunk group's all_reduce: {got}")
    h.close()


def transposes(g):
    """Every linear collective's transpose passes the adjoint (dot-product) test: summed over the ranks,
    <cotangent, f(x)> equals <x, transpose(cotangent)>, exactly (small integers in float64), and the
    gradient has the input's shape."""
    p, r = g.size, g.rank
    rng = np.random.default_rng(1000 + r)

    def rand(shape):
        return rng.integers(-4, 5, size=shape).astype(np.float64)

    def dot(a, b):
        return 0.0 if a is None or b is None else float(np.sum(np.asarray(a) * np.asarray(b)))

    def adjoint(name, x, y, like=None, **called):
        ct = None if y is None else rand(np.shape(y))
        grad = g.transpose(name, ct, like=like, **called).wait()
        sums = g.all_reduce(np.array([dot(ct, y), dot(x, grad)])).wait()
        expect(sums[0] == sums[1], f"{name} {called}: <ct, f(x)> = {sums[0]} but <x, f^T(ct)> = {sums[1]}")
        expect((grad is None) == (x is None) and (x is None or np.shape(grad) == np.shape(x)),
               f"{name} {called}: gradient {None if grad is None else np.shape(grad)} for input {None if x is None else np.shape(x)}")

    x = rand((3, 4))
    adjoint("all_reduce", x, g.all_reduce(x).wait())
    for axis in (0, 1, 2, -1, -2, -3):
        adjoint("all_gather", x, g.all_gather(x, axis=axis).wait(), axis=axis)
    for axis in (0, 1, -1):
        adjoint("all_gather", x, g.all_gather(x, axis=axis, tiled=True).wait(), axis=axis, tiled=True)
        cut = axis  # where reduce_scatter's size-p axis lies
        xr = np.moveaxis(rand((p, 3, 2)), 0, cut)
        adjoint("reduce_scatter", xr, g.reduce_scatter(xr, axis=cut).wait(), axis=cut)
        xt = np.moveaxis(rand((2 * p, 3, 2)), 0, cut)
        adjoint("reduce_scatter", xt, g.reduce_scatter(xt, axis=cut, tiled=True).wait(), axis=cut, tiled=True)
    # Uneven shards: rank i holds i % 2 + 1 rows.
    extents = [i % 2 + 1 for i in range(p)]
    xe = rand((extents[r], 3))
    adjoint("all_gather", xe, g.all_gather(xe, tiled=True, extents=extents).wait(), tiled=True, extents=extents)
    xs = rand((sum(extents), 3))
    adjoint("reduce_scatter", xs, g.reduce_scatter(xs, tiled=True, extents=extents).wait(), tiled=True, extents=extents)
    for split, concat in ((0, 0), (0, 1), (0, 2), (0, -1), (2, 0), (-1, 1)):
        xa = np.moveaxis(rand((p, 3, 2)), 0, split)
        adjoint("all_to_all", xa, g.all_to_all(xa, split, concat).wait(), split_axis=split, concat_axis=concat)
    xa = rand((2 * p, 3))
    adjoint("all_to_all", xa, g.all_to_all(xa, 0, 1, tiled=True).wait(), split_axis=0, concat_axis=1, tiled=True)
    for pairs in ([(i, (i + 1) % p) for i in range(p)], [(0, p - 1)]):
        adjoint("ppermute", x, g.ppermute(x, pairs).wait(), pairs=pairs)
    root = p - 1
    adjoint("broadcast", x, g.broadcast(x, root=root).wait(), root=root)
    adjoint("reduce", x, g.reduce(x, root=0).wait(), like=x, root=0)
    adjoint("gather", x, g.gather(x, root=root).wait(), like=x, root=root)
    xs = rand((p, 5)) if r == 0 else None
    adjoint("scatter", xs, g.scatter(xs, root=0, shape=(5,), dtype=np.float64).wait(), root=0)
    # The variable-size ones: rank i contributes i % 3 + 1 elements (none on the last of 4).
    counts = [0 if (i == 3) else i % 3 + 1 for i in range(p)]
    xv = rand(counts[r])
    adjoint("all_gatherv", xv, g.all_gatherv(xv, counts).wait(), counts=counts)
    xw = rand(sum(counts))
    adjoint("reduce_scatterv", xw, g.reduce_scatterv(xw, counts).wait(), counts=counts)
    adjoint("gatherv", xv, g.gatherv(xv, counts, root=root).wait(), like=xv, counts=counts, root=root)
    xsv = rand(sum(counts)) if r == 0 else None
    adjoint("scatterv", xsv, g.scatterv(xsv, counts, root=0, dtype=np.float64).wait(), counts=counts, root=0)
    send_counts = [(r + 2 * j) % 3 for j in range(p)]  # rank r sends (r + 2j) % 3 to rank j
    recv_counts = [(j + 2 * r) % 3 for j in range(p)]  # and receives (j + 2r) % 3 from rank j
    xa = rand(sum(send_counts))
    adjoint("all_to_allv", xa, g.all_to_allv(xa, send_counts, recv_counts).wait(), send_counts=send_counts, recv_counts=recv_counts)
    # With displacements: blocks in reverse rank order, a gap of one element after each and a tail of
    # two (gaps in an output start as zeros, so that <ct, f(x)> counts the blocks only; gaps in an input
    # are never sent, and their gradient must be zero).
    def spread(counts_):
        displs, at = [0] * len(counts_), 0
        for i in reversed(range(len(counts_))):
            displs[i], at = at, at + counts_[i] + 1
        return displs, at + 2

    displs, length = spread(counts)
    adjoint("all_gatherv", xv, g.all_gatherv(xv, counts, displs=displs, out=np.zeros(length)).wait(), counts=counts, displs=displs)
    root_out = np.zeros(length) if r == root else None
    adjoint("gatherv", xv, g.gatherv(xv, counts, root=root, displs=displs, out=root_out).wait(), like=xv, counts=counts,
            root=root, displs=displs)
    xsv = rand(length) if r == 0 else None
    adjoint("scatterv", xsv, g.scatterv(xsv, counts, root=0, displs=displs, dtype=np.float64).wait(), like=xsv, counts=counts,
            root=0, displs=displs)
    send_displs, send_length = spread(send_counts)
    recv_displs, recv_length = spread(recv_counts)
    xa = rand(send_length)
    adjoint("all_to_allv", xa, g.all_to_allv(xa, send_counts, recv_counts, send_displs, recv_displs, out=np.zeros(recv_length)).wait(),
            like=xa, send_counts=send_counts, recv_counts=recv_counts, send_displs=send_displs, recv_displs=recv_displs)
    # Displacements on the receiving side only, no like: the gradient's length is the packed input's.
    xa = rand(sum(send_counts))
    adjoint("all_to_allv", xa, g.all_to_allv(xa, send_counts, recv_counts, recv_displs=recv_displs, out=np.zeros(recv_length)).wait(),
            send_counts=send_counts, recv_counts=recv_counts, recv_displs=recv_displs)
    # Refused alike on every rank, before anything is sent.
    me = f"weft: rank {r}: transpose: "
    expect_error(lambda: g.transpose("all_reduce", x, op="max"), "invalid_argument", me + "all_reduce with op max is not linear")
    expect_error(lambda: g.transpose("barrier", None), "invalid_argument", me + "barrier has no transpose")
    expect_error(lambda: g.transpose("all_gatherv", x), "invalid_argument", me + "all_gatherv needs the counts")
    expect_error(lambda: g.transpose("reduce_scatterv", x, counts=counts, op="max"), "invalid_argument",
                 me + "reduce_scatterv with op max is not linear")
    expect_error(lambda: g.transpose("reduce", None, root=r), "invalid_argument", me + "reduce needs this rank's cotangent")
    expect_error(lambda: g.transpose("all_gather", x, axes=1), "invalid_argument", me + "all_gather takes no axes")
    expect_error(lambda: g.transpose("reduce_scatterv", xw, counts=counts, displs=displs), "invalid_argument",
                 me + "reduce_scatterv takes no displs")
    expect_error(lambda: g.transpose("all_gatherv", np.zeros(0), counts=counts, displs=displs), "invalid_argument",
                 me + "displs", "do not fit a cotangent of 0 elements")
    expect(weft.gpu is not None and weft.cpu(weft.gpu(x)).tolist() == x.tolist(), "gpu(x) and back")
    # The transfers (gpu, to_device, cpu) are linear too: their transpose moves the cotangent back where
    # the input lived, alike in shape and dtype; the adjoint test here is per rank.
    xd = weft.gpu(x)
    for f, src in ((weft.gpu, x), (lambda a: weft.to_device(a, 0), x), (weft.cpu, xd)):
        y = f(src)
        ct = rand(y.shape)
        ct = weft.to_device(ct, y.device) if isinstance(y, weft.DeviceArray) else ct
        grad = weft.transpose_transfer(ct, src)
        expect(type(grad) is type(src) and grad.shape == src.shape and grad.dtype == src.dtype,
               f"transpose_transfer: {type(grad).__name__} {grad.shape} for {type(src).__name__} {src.shape}")
        expect(not isinstance(src, weft.DeviceArray) or grad.device == src.device, "transpose_transfer: its device")
        expect(dot(weft.cpu(ct), weft.cpu(y)) == dot(weft.cpu(src), weft.cpu(grad)), "transpose_transfer: the adjoint test")
    expect_error(lambda: weft.transpose_transfer(rand((4, 3)), xd), "invalid_argument",
                 "transpose_transfer: the cotangent is float64 (4, 3) and the transfer's input float64 (3, 4)")
    expect_error(lambda: weft.transpose_transfer(x.astype(np.float32), x), "invalid_argument",
                 "transpose_transfer: the cotangent is float32 (3, 4)")


def plans(g):
    """Plans as plain data from Python: weft's builders run with run_plan give the collective's result,
    a plan written by hand runs, and a plan that does not fit its arrays or its group is refused before
    anything is sent (the next collective then still agrees on every rank)."""
    p, r = g.size, g.rank
    for name in ("ring_all_reduce", "bidirectional_ring_all_reduce", "recursive_doubling_all_reduce",
                 "rabenseifner_all_reduce", "tree_all_reduce"):
        for count in (0, 1, 7, 1001):
            x = inputs(r, (count,), np.float32)
            want = sum(inputs(i, (count,), np.float32) for i in range(p))
            got = g.run_plan(weft.plan(name, p, r, count), x.copy(), name=name).wait()
            expect(np.array_equal(got, want), f"{name} of {count}: {got[:4]} against {want[:4]}")
    root = p - 1
    for name in ("binomial_broadcast", "chain_broadcast"):
        x = inputs(r, (13,), np.int64)
        got = g.run_plan(weft.plan(name, p, r, 13, root=root), x, name=name).wait()
        expect(got is x and np.array_equal(x, inputs(root, (13,), np.int64)), f"{name} from {root}")
    # The ring's halves, composed: reduce-scatter then all-gather is an all_reduce.
    x = inputs(r, (10,), np.float64)
    g.run_plan(weft.plan("ring_reduce_scatter", p, r, 10), x).wait()
    g.run_plan(weft.plan("ring_all_gather", p, r, 10), x).wait()
    expect(np.array_equal(x, sum(inputs(i, (10,), np.float64) for i in range(p))), "ring reduce-scatter + all-gather")
    g.run_plan(weft.plan("dissemination_barrier", p, r), np.empty(0, np.uint8)).wait()
    expect(weft.blocks_of(10, 3) == [(0, 4), (4, 3), (7, 3)] and weft.blocks_of(0, 2) == [(0, 0), (0, 0)],
           f"blocks_of: {weft.blocks_of(10, 3)}")
    expect_error(lambda: weft.blocks_of(10, 0), "invalid_argument", "blocks_of: parts 0 must be from 1")
    if p > 1:
        # By hand: every rank passes its 4 elements to the next one.
        x = inputs(r, (4,), np.int32)
        step = weft.Step("send_recv", send_to=(r + 1) % p, recv_from=(r - 1) % p, send=(0, 4), recv=(0, 4))
        got = g.run_plan([step], x, out=np.zeros(4, np.int32), name="rotate").wait()
        expect(np.array_equal(got, inputs((r - 1) % p, (4,), np.int32)), f"rotate: {got}")
    me = f"weft: rank {r}: "
    x = np.zeros(4, np.float32)
    expect_error(lambda: g.run_plan([weft.Step("recv", recv_from=0, recv=(2, 3))], x), "invalid_argument",
                 me + "run_plan: step 0 (recv): its recv range [2, +3) reaches past out (4 elements)")
    expect_error(lambda: g.run_plan([weft.Step("send", send_to=0, send=(0, 5))], x, out=np.zeros(9, np.float32)),
                 "invalid_argument", "its send range [0, +5) reaches past x (4 elements)")
    expect_error(lambda: g.run_plan([weft.Step("recv_copy_send", send_to=0, recv_from=0, send=(3, 2), recv=(0, 1))], x),
                 "invalid_argument", "its send range [3, +2) reaches past out (forwarded from it)")
    expect_error(lambda: g.run_plan([weft.Step("sendrecv", send_to=0)], x), "invalid_argument",
                 "step 0 has kind 'sendrecv' (known: send, recv,")
    expect_error(lambda: g.run_plan([weft.Step("send", send_to=p, send=(0, 1))], x), "invalid_argument", me + "plan", f"send_to {p}")
    expect_error(lambda: g.run_plan([("send", 0)], x), "invalid_argument", "run_plan: step 0 is ('send', 0), not a weft.Step")
    expect_error(lambda: g.run_plan([weft.Step("send", send_to=0, send=(-1, 1))], x), "invalid_argument", "send offset is -1")
    expect_error(lambda: g.run_plan([], x, out=np.zeros(4, np.int32)), "invalid_argument", "x is f32 and out i32")
    expect_error(lambda: weft.plan("ring", p, r, 4), "invalid_argument", "plan: no builder named 'ring' (known: ring_reduce_scatter")
    expect_error(lambda: weft.plan("ring_all_reduce", p, p, 4), "invalid_argument", f"plan: rank {p} is not in [0, {p})")
    y = np.ones(3, np.float32)
    expect(g.all_reduce(y).wait()[0] == p, "a collective after the refused plans")


def p2p_results(g):
    """MLX's send gives its input back once sent; a receive may make its own array."""
    p, r = g.size, g.rank
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    if p > 1:
        if r == 0:
            expect(g.send(x, 1, tag=3).wait() is x, "send's result is its input")
        elif r == 1:
            got = g.recv(None, 0, tag=3, shape=(3, 4), dtype=np.float64).wait()
            expect(got.shape == (3, 4) and got.dtype == np.float64 and np.array_equal(got, x), f"recv into a new array: {got}")
        # A receive into another dtype of the same size fails (the bytes are not reinterpreted); uint8 is
        # raw bytes and agrees with every dtype.
        if r == 0:
            g.send(x, 1, tag=4).wait()
            g.send(x, 1, tag=5).wait()
        elif r == 1:
            expect_error(lambda: g.recv(None, 0, tag=4, shape=(3, 4), dtype=np.int64).wait(), "mismatch",
                         "recv #2 (peer 0) [tag 4]", "rank 0 sent f64 data where rank 1 receives i64")
            raw = g.recv(None, 0, tag=5, shape=(96,), dtype=np.uint8).wait()
            expect(np.array_equal(raw.view(np.float64).reshape(3, 4), x), "f64 received as uint8 arrives intact")
        expect_error(lambda: g.recv(None, 0), "invalid_argument", f"weft: rank {r}: recv: give out, or shape and dtype")


def _square(v):
    return v * v


def fork(g):
    """A child forked after Group.create (os.fork, multiprocessing's fork workers): it reads the group's
    rank and size, is refused the parent's group by name, may make a group of its own, and leaves through
    sys.exit without hanging (it waited in atexit for the parent's loop thread) and without disturbing
    the parent's group."""
    import multiprocessing
    x = np.ones(4, dtype=np.float32)
    g.all_reduce(x).wait()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            expect(g.rank >= 0 and g.size >= 1, "the child reads rank and size")
            expect_error(lambda: g.all_reduce(x), "invalid_argument", "all_reduce", "is a child forked from it")
            own = weft.Group.create(rank=0, world_size=1, store="127.0.0.1:0")
            expect(np.all(own.all_reduce(np.ones(2)).wait() == 1), "the child's own group")
            own.close()
            code = 0
        finally:
            sys.stdout.flush()
            sys.exit(code)  # atexit runs: weft's shutdown must leave the parent's loop alone
    deadline = time.monotonic() + 60
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("a forked child that left through sys.exit hung")
        time.sleep(0.02)
    expect(os.waitstatus_to_exitcode(status) == 0, f"the forked child failed: status {status}")
    with multiprocessing.get_context("fork").Pool(2) as pool:
        expect(pool.map(_square, range(5)) == [0, 1, 4, 9, 16], "fork workers")
    got = g.all_reduce(x).wait()
    expect(np.all(got == g.size), "the parent's group after its children left")


def gil(g):
    """wait() releases the GIL: another Python thread runs while this one waits for a late peer."""
    counter = 0
    stop = False

    def spin():
        nonlocal counter
        while not stop:
            counter += 1

    t = threading.Thread(target=spin)
    t.start()
    if g.rank == 1:
        time.sleep(0.5)
    before = counter
    g.all_reduce(np.ones(8, dtype=np.float32)).wait()
    during = counter - before
    stop = True
    t.join()
    if g.rank == 0:
        expect(during > 1000, f"the other thread advanced only {during} while wait() blocked")


def device(g):
    """Device arrays (weft.to_device; the simulated device where no GPU answers) through the collectives
    that need no packing, back with weft.cpu, against the same numpy references."""
    p, r = g.size, g.rank
    dev = r % weft._weft.device_count()
    everyone = [inputs(i, (4, 3), np.float32) for i in range(p)]
    x = weft.to_device(everyone[r], dev)
    expect(isinstance(x, weft.DeviceArray) and x.shape == (4, 3) and x.device == dev, f"to_device: {x!r}")
    expect(np.array_equal(weft.cpu(x), everyone[r]), "cpu(to_device(x)) == x")
    got = g.all_reduce(x).wait()
    expect(isinstance(got, weft.DeviceArray), "all_reduce of a device array returns a device array")
    expect(np.array_equal(weft.cpu(got), np.sum(np.stack(everyone), axis=0)), "all_reduce on the device")
    got = g.all_gather(x, axis=0, tiled=True).wait()
    expect(np.array_equal(weft.cpu(got), np.concatenate(everyone, axis=0)), "all_gather on the device")
    got = g.all_gather(x, axis=0).wait()
    expect(np.array_equal(weft.cpu(got), np.stack(everyone)), "all_gather untiled on the device")
    big = [inputs(i, (2 * p, 3), np.float32, 1) for i in range(p)]
    got = g.reduce_scatter(weft.to_device(big[r], dev), axis=0, tiled=True).wait()
    expect(np.array_equal(weft.cpu(got), np.sum(np.stack(big), axis=0)[2 * r:2 * r + 2]), "reduce_scatter on the device")
    got = g.broadcast(x, root=p - 1).wait()
    expect(np.array_equal(weft.cpu(got), everyone[p - 1]), "broadcast on the device")
    counts = [i + 1 for i in range(p)]
    flat = [inputs(i, (counts[i],), np.float32, 2) for i in range(p)]
    got = g.all_gatherv(weft.to_device(flat[r], dev), counts).wait()
    expect(np.array_equal(weft.cpu(got), np.concatenate(flat)), "all_gatherv on the device")
    # A layout that would need packing on the host is refused, naming why.
    if p > 1:
        expect_error(lambda: g.all_gather(x, axis=1, tiled=True), "invalid_argument", "device tensor", "packing")
    expect(np.array_equal(weft.cpu(g.all_reduce(x).wait()), np.sum(np.stack(everyone), axis=0)), "the group works after")


def interrupt(g):
    """Ctrl-C (SIGINT, sent by the test to rank 0 once it waits) interrupts a wait() for a collective that
    rank 1 calls only after rank 0 cancelled it; both ranks go on."""
    x = np.ones(4, dtype=np.float32)
    if g.rank == 0:
        work = g.all_reduce(x)
        open(os.environ["TEST_READY_FILE"], "w").close()  # the test sends SIGINT once this exists
        started = time.monotonic()
        try:
            work.wait()
            raise AssertionError("the wait returned though rank 1 had not called the collective")
        except KeyboardInterrupt:
            print(f"interrupted after {time.monotonic() - started:.2f} s", flush=True)
        # A wait with a long timeout too (it held Ctrl-C until the timeout or the operation's end).
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        started = time.monotonic()
        try:
            work.wait(timeout=600)
            raise AssertionError("the wait returned though rank 1 had not called the collective")
        except KeyboardInterrupt:
            took = time.monotonic() - started
            expect(took < 30, f"a wait(timeout=600) interrupted after {took:.2f} s")
            print(f"timed wait interrupted after {took:.2f} s", flush=True)
        work.cancel()
        expect_error(work.wait, "cancelled", "rank 0 cancelled")
        mark("cancelled")
    else:
        asyncio.run(until_marked("cancelled"))  # rank 1 calls the collective only once rank 0 cancelled it
        expect_error(lambda: g.all_reduce(x).wait(), "cancelled", "rank 0 cancelled")
    got = g.all_reduce(x).wait()
    expect(np.all(got == g.size), "the collective after the interrupted one")


async def close_awaited(g):
    """Rank 0 closes its group while a task awaits one of its collectives (the others call it only
    later): the task raises the abort at once instead of waiting forever, and the others fail too."""
    x = np.ones(16, dtype=np.float32)
    if g.rank == 0:
        task = asyncio.ensure_future(g.all_reduce(x))
        await asyncio.sleep(0.3)
        g.close()
        try:
            await asyncio.wait_for(task, 30)
            raise AssertionError("a collective of a closed group completed")
        except asyncio.TimeoutError:
            raise AssertionError("the task awaiting a collective of a closed group was never woken")
        except weft.Error as e:
            expect(e.errc == "aborted", f"expected aborted, got {e.errc}: {e}")
        mark("closed")
    else:
        await until_marked("closed")
        try:
            await g.all_reduce(x)
            raise AssertionError("a collective completed after rank 0 closed the group")
        except weft.Error as e:
            expect("rank 0" in str(e), f"the error does not name rank 0: {e}")


def loops_on_threads(g):
    """Three threads, each running its own asyncio loop, await point-to-point messages of one group (a
    tag each): every loop's tasks are woken, whichever loop saw the completion first."""
    failures = []

    def side(tag):
        async def go():
            buf = np.zeros(4, dtype=np.int32)
            for i in range(200):
                if g.rank == 0:
                    await asyncio.wait_for(g.send(np.full(4, i, dtype=np.int32), 1, tag), 30)
                    await asyncio.wait_for(g.recv(buf, 1, tag), 30)
                else:
                    await asyncio.wait_for(g.recv(buf, 0, tag), 30)
                    await asyncio.wait_for(g.send(buf, 0, tag), 30)
                if buf[0] != i:
                    failures.append(f"tag {tag}: message {i} read {buf[0]}")
        try:
            asyncio.run(go())
        except BaseException as e:  # a TimeoutError here is a task nobody woke
            failures.append(f"tag {tag}: {type(e).__name__} {e}")

    threads = [threading.Thread(target=side, args=(tag,)) for tag in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expect(not failures, "; ".join(failures))


SCENARIOS = {
    "interrupt": interrupt,
    "device": device,
    "collectives": collectives,
    "overlap": overlap,
    "cancel": cancel,
    "close_awaited": close_awaited,
    "loops_on_threads": loops_on_threads,
    "dead_peer": dead_peer,
    "bad_arguments": bad_arguments,
    "gil": gil,
    "algorithms": algorithms,
    "deadlines": deadlines,
    "shrink": shrink,
    "transposes": transposes,
    "plans": plans,
    "p2p_results": p2p_results,
    "fork": fork,
}


def main():
    name = sys.argv[1]
    if name == "interrupt_create":
        # Group.create waiting for ranks that never come (world_size 2, one process): Ctrl-C raises
        # KeyboardInterrupt within moments (it was held until the bootstrap's timeout).
        open(os.environ["TEST_READY_FILE"], "w").close()
        started = time.monotonic()
        try:
            weft.Group.create(world_size=2, timeout=600)
            raise AssertionError("Group.create returned with one rank of 2")
        except KeyboardInterrupt:
            took = time.monotonic() - started
            expect(took < 30, f"Group.create interrupted after {took:.2f} s")
            print(f"ok interrupt_create rank 0 after {took:.2f} s", flush=True)
        return
    g = weft.Group.create(timeout=float(os.environ.get("TEST_TIMEOUT", "60")))
    run = SCENARIOS[name]
    rank, size = g.rank, g.size  # a scenario may close the group
    if asyncio.iscoroutinefunction(run):
        asyncio.run(run(g))
    else:
        run(g)
    print(f"ok {name} rank {rank} of {size}", flush=True)
    g.close()


if __name__ == "__main__":
    main()
