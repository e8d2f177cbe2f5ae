"""weft: collectives whose operations are awaitable from asyncio.

    import asyncio, numpy as np, weft

    async def main():
        g = weft.Group.create()                 # rank, size and store from weft-run's environment
        x = np.full(4, g.rank, dtype=np.float32)
        total = await g.all_reduce(x)          # or g.all_reduce(x).wait() from plain code
        print(g.rank, total)

    asyncio.run(main())

Every operation starts at once and returns a Work: ``await`` it in a coroutine (completion reaches the
asyncio loop through a file descriptor it watches, not a thread per call), or call ``wait()`` (the GIL is
released while waiting), ``done()``, ``cancel()``. Its result is the output array (None for barrier and
send). Cancelling a task that awaits a Work cancels the collective on every rank, as weft's
``Future.cancel`` does. Errors are ``weft.Error`` (a RuntimeError) carrying weft's message, with ``errc``,
``rank``, ``peer``, ``op`` and ``seq``; bad arguments raise before anything is sent.

Collectives must be called in the same order on every rank, as in C++ (they are matched by sequence
number); several may be in flight at once.
"""

import asyncio
import atexit
import collections
import functools
import operator
import threading
import weakref

import numpy as np

from . import _weft
from ._weft import Error

__version__ = _weft.version  # the library's (weft::version()), which this module was built with

__all__ = ["Group", "Work", "Error", "DeviceArray", "to_device", "gpu", "cpu", "transpose_transfer", "Step", "plan", "plan_builders", "blocks_of", "from_dlpack", "device_backend", "available_algorithms",
           "await_spin_us"]

# How long an await polls for its operation (the GIL released) before it hands the wait to the asyncio
# loop: small collectives complete within it and skip the loop's selector round trip (bench/RESULTS.md,
# "Python"). 0: never poll. The asyncio loop runs nothing else meanwhile, so keep it short.
await_spin_us = float(__import__("os").environ.get("WEFT_PY_AWAIT_SPIN_US", "50"))


DeviceArray = _weft.DeviceArray


def _array(x, name="x"):
    if isinstance(x, (np.ndarray, DeviceArray)):
        return x
    x = np.asarray(x)
    if x.dtype == object:
        raise _invalid(f"{name} is an array of Python objects; weft moves numbers")
    return x


def _empty(shape, dtype, like):
    """A new array of `shape` where `like` lives: numpy, or device memory of like's device."""
    if isinstance(like, DeviceArray):
        return DeviceArray.empty([shape] if isinstance(shape, int) else list(shape), dtype, like.device)
    return np.empty(shape, dtype=dtype)


def _contiguous(x):
    return x if isinstance(x, DeviceArray) else np.ascontiguousarray(x)


def _flat(x):
    """x as one dimension (the variable-size collectives count elements)."""
    x = _array(x)
    if isinstance(x, DeviceArray):
        if x.ndim != 1:
            raise _invalid("the variable-size collectives take one-dimensional device arrays")
        return x
    return np.ascontiguousarray(x).reshape(-1)


def _axis(axis, ndim, name="axis"):
    axis = _integer(axis, name)
    if not -ndim <= axis < ndim:
        raise _invalid(f"{name} {axis} is out of range for {ndim} dimensions")
    return axis % ndim


def _invalid(message):
    e = Error(message)
    e.errc = "invalid_argument"
    return e


# Arguments checked here before they reach the binding, whose own refusal of a value it cannot convert
# (a negative count, a tag past 32 bits, a float rank) lists C++ signatures instead of naming the value.
_REDUCE_OPS = "sum, prod, min, max, avg, land, lor, band, bor, bxor"


def _integer(value, name):
    if isinstance(value, (bool, np.bool_)):
        raise _invalid(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise _invalid(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None


def _rank_arg(value, name, size):
    """A rank as the binding takes it (a C int); one outside [0, size) within that range is refused by
    weft itself, which numbers the call."""
    v = _integer(value, name)
    if not -2**31 <= v < 2**31:
        raise _invalid(f"{name} {v} is not a rank of this group of {size}")
    return v


def _int32(value, name):
    v = _integer(value, name)
    if not -2**31 <= v < 2**31:
        raise _invalid(f"{name} {v} does not fit in 32 bits")
    return v


def _tag(value):
    v = _integer(value, "tag")
    if not 0 <= v < 2**32:
        raise _invalid(f"tag {v} is out of range: a tag is from 0 to 2**32 - 1")
    return v


def _reduce_op(op):
    if not isinstance(op, str):
        raise _invalid(f"op must be a reduce op's name ({_REDUCE_OPS}), got {type(op).__name__} {op!r}")
    return op


# The collectives Group.transpose knows (weft/transpose.hpp's, the variable-size ones with their counts).
_TRANSPOSED = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "permute", "broadcast", "reduce", "gather",
               "scatter", "all_gatherv", "reduce_scatterv", "all_to_allv", "gatherv", "scatterv")


def _collective_name(name):
    """A collective's name as weft's C++ side spells it (Python's ppermute is its permute)."""
    if not isinstance(name, str):
        raise _invalid(f"a collective is named by a string (\"all_reduce\", ...), not {type(name).__name__} {name!r}")
    return "permute" if name == "ppermute" else name


def _count(value, name):
    v = _integer(value, name)
    if not 0 <= v < 2**63:
        raise _invalid(f"{name} is {v}: a number of bytes is from 0 to 2**63 - 1")
    return v


def _counts(values, name):
    """A list of element counts (or displacements): integers from 0."""
    if values is None:
        return []
    try:
        items = list(values)
    except TypeError:
        raise _invalid(f"{name} must be a sequence of integers, got {type(values).__name__}") from None
    out = []
    for i, value in enumerate(items):
        v = _integer(value, f"{name}[{i}]")
        if not 0 <= v < 2**63:
            raise _invalid(f"{name}[{i}] is {v}: {name} are element counts, from 0")
        out.append(v)
    return out


def _create_options(options):
    """Group.create's options, checked where the binding's casts would fail without naming them (and
    where its -1 for "unset" would take a negative rank for a missing one)."""
    checked = {}
    for key, value in options.items():
        if value is None:
            continue
        where = f"weft: Group.create: {key}="
        if key in ("rank", "world_size"):
            v = _integer(value, where[:-1])
            lowest = 0 if key == "rank" else 1
            if not lowest <= v < 2**31:
                raise _invalid(f"{where}{v}: a {'rank' if key == 'rank' else 'world size'} is from {lowest} to 2**31 - 1")
            value = v
        elif key in ("store", "transport", "algorithms", "tuning_file"):
            if not isinstance(value, str):
                raise _invalid(f"{where}{value!r} is not a string")
        elif key == "secret":
            if not isinstance(value, (str, bytes)):
                raise _invalid(f"weft: Group.create: secret: the secret is a string or bytes, not {type(value).__name__}")
        elif key == "timeout":
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise _invalid(f"{where}{value!r} is not a number of seconds")
        checked[key] = value
    return checked


def _on_loop_soon(loop, call):
    """Runs call() on asyncio loop `loop`: now if this thread runs it, else from its next turn (an asyncio
    loop is not thread-safe: another thread may only hand it work with call_soon_threadsafe)."""
    if loop.is_closed():
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        call()
    else:
        try:
            loop.call_soon_threadsafe(call)
        except RuntimeError:  # closed in the meantime
            pass


def _resolve_soon(waiter):
    """Wakes a task awaiting an operation that completed, from any thread."""
    def resolve():
        if not waiter.done():
            waiter.set_result(None)
    _on_loop_soon(waiter.get_loop(), resolve)


_NATIVE = object()  # Work's "no value of its own": the operation's result is given


class Work:
    """One operation in flight: awaitable, waitable, pollable, cancellable."""

    __slots__ = ("_work", "_group", "_value")

    def __init__(self, work, group, value=_NATIVE):
        self._work = work
        self._group = group
        self._value = value  # the result to give instead of the operation's own (send's input, a transpose's zeros)

    def _give(self, result):
        return result if self._value is _NATIVE else self._value

    def done(self):
        """True once the operation completed (successfully or not). Never blocks."""
        return self._work.done()

    def wait(self, timeout=None):
        """Blocks until the operation completes (the GIL released) and returns its result, or raises
        weft.Error. With a timeout (seconds), raises TimeoutError if it has not completed by then."""
        if timeout is not None and not timeout >= 0:  # NaN fails this too (it timed out "within nan s")
            raise _invalid(f"wait: timeout is {timeout!r}: it must be a number of seconds, 0 or more, or None")
        if timeout is not None and timeout > 1e9:  # infinity (or 31 years): no limit; the clock would overflow
            timeout = None
        if timeout is not None and not self._work.wait_for(timeout):
            raise TimeoutError(f"the operation did not complete within {timeout} s")
        return self._give(self._work.wait())

    def result(self):
        """The result of a completed operation (weft.Error if it failed)."""
        return self._give(self._work.result())

    def cancel(self):
        """Cancels the operation on every rank (a collective) or withdraws it (a receive)."""
        self._work.cancel()

    def __await__(self):
        if not self._work.spin(await_spin_us):
            waiter = self._group._waiter_for(self._work)
            try:
                yield from waiter.__await__()
            except asyncio.CancelledError:
                self._work.cancel()
                raise
        return self._give(self._work.result())


class Group:
    """A set of ranks that communicate. ``Group.create()`` reads rank, world size and store from the
    environment (weft-run's, torchrun's, Open MPI's or Slurm's), as C++'s ``Group::create`` does."""

    _live = weakref.WeakSet()

    def __init__(self, native):
        self._g = native
        self._waiters = {}   # work id -> (native work, [asyncio futures awaiting it])
        self._loops = set()  # asyncio loops whose reader watches our fd
        self._lock = threading.Lock()  # guards both, for loops on several threads
        Group._live.add(self)

    @classmethod
    def create(cls, **options):
        """Bootstraps the group (blocks until every rank arrived). Options: rank, world_size, store
        ("host:port"), transport ("auto", the default: shared memory with the ranks of this host, tcp
        with the others; "tcp", "uring", "shm"), timeout (seconds), secret, algorithms (choices over the
        built-in table in WEFT_ALGO's syntax, e.g. "all_reduce:ring"; the ranks must agree, which the
        bootstrap checks), tuning_file (a file `weft-bench --tune` wrote; WEFT_TUNING)."""
        return cls(_weft.Group.create(_create_options(options)))

    @property
    def rank(self):
        return self._g.rank

    @property
    def size(self):
        return self._g.size

    @property
    def transport(self):
        return self._g.transport

    @property
    def has_shared_arena(self):
        """Whether the collectives can run in a group arena: every rank on this host, over shared memory
        (the "shm" algorithms of available_algorithms)."""
        return self._g.has_shared_arena

    def close(self):
        """Shuts the group down (operations still running are aborted on every rank first)."""
        with self._lock:
            loops, self._loops = self._loops, set()
        for loop in loops:
            _on_loop_soon(loop, lambda loop=loop: loop.remove_reader(self._g.fd))
        self._g.close()
        # Every operation is complete now (aborted if it was running), but with the readers gone no
        # completion wakes its awaiting tasks: resolve them here (each then raises its operation's error).
        with self._lock:
            waiting, self._waiters = self._waiters, {}
        for _, waiters in waiting.values():
            for waiter in waiters:
                _resolve_soon(waiter)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def split(self, color, key=0):
        """Ranks with the same color form a new group ordered by (key, rank); a negative color: None."""
        native = self._g.split(_int32(color, "color"), _int32(key, "key"))
        return None if native.closed else Group(native)

    def shrink(self):
        """After a failure (or at any time): the members this rank still reaches form a new group of them,
        in this group's order (blocks until they agree). Every surviving member calls it; it works on a
        failed group. Returns the new Group, whose rank and size may differ; this one stays as it is."""
        return Group(self._g.shrink())

    def with_timeout(self, seconds):
        """A view of this group whose operations have `seconds` as their deadline instead of the group's
        (0: none); everything else is shared: ``await g.with_timeout(5).all_reduce(x)``. A collective past
        its deadline fails on every member naming the ranks that had not joined it; a receive past its
        deadline is withdrawn (errc "timeout") and the group stays usable; a send past it aborts the
        group. Closing the view leaves the group open once the view's operations completed (with some
        still in flight it aborts the group, as close() does)."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float, np.integer, np.floating)):
            raise _invalid(f"with_timeout: {seconds!r} is not a number of seconds")
        return Group(self._g.with_timeout(seconds))

    def without_deadline(self):
        """A view whose operations have no deadline (a server's wait for its next request); they still
        end on a lost peer, an abort or a cancel."""
        return self.with_timeout(0)

    def transport_to(self, peer):
        """How this rank's bytes move to rank `peer`: "shm", "tcp" or "uring"; "self" for this rank."""
        return self._g.transport_to(_rank_arg(peer, "peer", self.size))

    def abort(self, reason=""):
        """Fails every operation in flight on this group, here and on every other rank."""
        self._g.abort(reason)

    def override_algorithms(self, spec):
        """Replaces this rank's algorithm choices for the collectives `spec` names (WEFT_ALGO's syntax,
        e.g. "all_reduce:recursive_doubling@0-16K,ring"). Every rank must make the same change before
        its next collective: a collective that ranks run with different algorithms fails on every rank
        (errc "mismatch") naming both."""
        if not isinstance(spec, str):
            raise _invalid(f"the algorithm choices are a string in WEFT_ALGO's syntax, not {type(spec).__name__}")
        self._g.override_algorithms(spec)

    def algorithm_for(self, collective, nbytes):
        """The algorithm this group runs `collective` ("all_reduce", ...) with on `nbytes` bytes per rank;
        "" for one without a choice (ppermute)."""
        return self._g.algorithm_for(_collective_name(collective), _count(nbytes, "nbytes"))

    def _refusal(self, op, e):
        """Error `e`, raised without a rank, again with this rank and `op` in its words and fields."""
        try:
            rank = self._g.rank
        except Error:  # a closed group has no rank to ask for: the words then name none
            rank = -1
        detail = str(e)
        for prefix in ("weft: ", op + ": "):
            if detail.startswith(prefix):
                detail = detail[len(prefix):]
        named = Error(f"weft: rank {rank}: {op}: {detail}" if rank >= 0 else f"weft: {op}: {detail}")
        named.errc = getattr(e, "errc", "invalid_argument")
        named.rank = rank
        named.peer = getattr(e, "peer", -1)
        named.op = op
        named.seq = getattr(e, "seq", -1)
        return named

    # ---- asyncio: completions arrive on the group's eventfd

    def _start(self, work):
        return Work(work, self)

    def _one_per_rank(self, values, name):
        if len(values) != self.size:
            raise _invalid(f"{name} has {len(values)} entries; it needs one per rank of this group of {self.size}")

    def _pairs(self, pairs):
        """ppermute's (src, dst) pairs as the binding takes them."""
        try:
            items = [tuple(p) for p in pairs]
        except TypeError:
            raise _invalid("pairs must be a sequence of (source, destination) pairs") from None
        for i, p in enumerate(items):
            if len(p) != 2:
                raise _invalid(f"pairs[{i}] is {p!r}: each pair is (source, destination)")
        return [(_rank_arg(a, f"pairs[{i}] source", self.size), _rank_arg(b, f"pairs[{i}] destination", self.size))
                for i, (a, b) in enumerate(items)]

    # Several asyncio loops (one per thread) may await one group's operations: each watches the eventfd,
    # the first to wake resolves every completed operation's waiters, each on its own loop's thread, and
    # the table they share is changed under a lock.

    def _waiter_for(self, work):
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        with self._lock:
            if loop not in self._loops:
                self._g.arm()
                loop.add_reader(self._g.fd, self._on_completions)
                self._loops.add(loop)
            self._waiters.setdefault(work.id, (work, []))[1].append(waiter)
        # Completed between the check and now (before its completion could wake the loop): resolve it here.
        if work.done():
            self._resolve(work.id)
        return waiter

    def _resolve(self, id_):
        with self._lock:
            _, waiters = self._waiters.pop(id_, (None, ()))
        for waiter in waiters:
            _resolve_soon(waiter)

    def _on_completions(self):
        # The eventfd says that some operation completed: resolve every waiter whose operation is done.
        self._g.clear_wakeup()
        with self._lock:
            entries = list(self._waiters.items())
        for id_, (work, _) in entries:
            if work.done():
                self._resolve(id_)

    # ---- collectives over n-d arrays (any strides)

    def all_reduce(self, x, op="sum", out=None):
        """The reduction of every rank's x (same shape and dtype everywhere) into out (a new array by
        default; out=x reduces in place)."""
        x = _array(x)
        out = _empty(x.shape, x.dtype, x) if out is None else out
        return self._start(self._g.all_reduce(x, out, _reduce_op(op)))

    def broadcast(self, x, root=0, out=None):
        """Root's x into every rank's out (a copy of x by default; out=x works in place)."""
        x = _array(x)
        root = _rank_arg(root, "root", self.size)
        if out is None:
            out = x.copy() if isinstance(x, DeviceArray) else np.array(x, copy=True)
        elif out is not x:
            if isinstance(x, DeviceArray) or isinstance(out, DeviceArray):
                raise _invalid("broadcast: out= must be x itself for device arrays")
            np.copyto(out, x)
        return self._start(self._g.broadcast(out, root))

    distributed_broadcast = broadcast

    def all_gather(self, x, axis=0, tiled=False, out=None, extents=None):
        """Every rank's x along `axis`: untiled, stacked on a new axis of size `size` at `axis`; tiled,
        concatenated along `axis` (uneven shards: `extents`, every rank's extent along it)."""
        x = _array(x)
        axis = _integer(axis, "axis")
        extents = _counts(extents, "extents")
        if out is None:
            if tiled and extents:
                shape = list(x.shape)
                shape[_axis(axis, x.ndim)] = sum(extents)
            else:
                shape = _weft.all_gather_shape(list(x.shape), axis, self.size, tiled)
            out = _empty(shape, x.dtype, x)
        return self._start(self._g.all_gather(x, out, axis, tiled, extents))

    def reduce_scatter(self, x, axis=0, op="sum", tiled=False, out=None, extents=None):
        """The reduction of every rank's x, cut along `axis`: untiled, x.shape[axis] == size and this
        rank keeps slice rank; tiled, the axis cut in size blocks (or `extents`) and this rank keeps
        its block."""
        x = _array(x)
        axis, op, extents = _integer(axis, "axis"), _reduce_op(op), _counts(extents, "extents")
        if out is None:
            if tiled and extents:
                self._one_per_rank(extents, "extents")
                shape = list(x.shape)
                shape[_axis(axis, x.ndim)] = extents[self.rank]
            else:
                shape = _weft.reduce_scatter_shape(list(x.shape), axis, self.size, tiled)
            out = _empty(shape, x.dtype, x)
        return self._start(self._g.reduce_scatter(x, out, axis, op, tiled, extents))

    def all_to_all(self, x, split_axis, concat_axis, tiled=False, out=None):
        """The distributed transpose: x cut along split_axis, part j to rank j, the parts received
        joined along concat_axis in rank order (untiled: x.shape[split_axis] == size, stacked on a new
        axis)."""
        x = _array(x)
        split_axis, concat_axis = _integer(split_axis, "split_axis"), _integer(concat_axis, "concat_axis")
        if out is None:
            out = _empty(_weft.all_to_all_shape(list(x.shape), split_axis, concat_axis, self.size, tiled), x.dtype, x)
        return self._start(self._g.all_to_all(x, out, split_axis, concat_axis, tiled))

    def ppermute(self, x, pairs, out=None):
        """For each (src, dst): src's x lands in dst's out; a rank that receives from nobody gets zeros."""
        x = _array(x)
        out = _empty(x.shape, x.dtype, x) if out is None else out
        return self._start(self._g.ppermute(x, out, self._pairs(pairs)))

    permute = ppermute

    # ---- rooted and point-to-point (C-contiguous arrays)

    def reduce(self, x, root=0, op="sum", out=None):
        """The reduction of every rank's x at root (its result); None elsewhere."""
        x = _contiguous(_array(x))
        root, op = _rank_arg(root, "root", self.size), _reduce_op(op)
        if self.rank == root and out is None:
            out = _empty(x.shape, x.dtype, x)
        return self._start(self._g.reduce(x, out if self.rank == root else None, root, op))

    def gather(self, x, root=0, out=None):
        """Every rank's x stacked at root (shape (size,) + x.shape); None elsewhere."""
        x = _contiguous(_array(x))
        root = _rank_arg(root, "root", self.size)
        if self.rank == root and out is None:
            out = _empty((self.size,) + tuple(x.shape), x.dtype, x)
        return self._start(self._g.gather(x, out if self.rank == root else None, root))

    def scatter(self, x, root=0, out=None, shape=None, dtype=None):
        """Root's x (shape (size,) + block) cut in size blocks, block i to rank i. Elsewhere x may be
        None: give `out`, or `shape` and `dtype` of a block."""
        root = _rank_arg(root, "root", self.size)
        if self.rank == root:
            x = _contiguous(_array(x))
            if out is None:
                if x.ndim == 0 or x.shape[0] != self.size:
                    raise _invalid(f"scatter: the root's x has shape {list(x.shape)}; it needs ({self.size},) + a block's shape "
                                   f"(one block per rank), or give out")
                out = _empty(tuple(x.shape)[1:], x.dtype, x)
        elif out is None:
            if shape is None or dtype is None:
                raise _invalid("scatter: a rank other than the root needs out, or shape and dtype")
            out = np.empty(shape, dtype=dtype)
        return self._start(self._g.scatter(x if self.rank == root else None, out, root))

    def barrier(self):
        return self._start(self._g.barrier())

    def send(self, x, dst, tag=0):
        """Sends x to dst; the Work's result is x once it is sent (MLX's send: x, usable after the send)."""
        x = _array(x)
        work = self._start(self._g.send(_contiguous(x), _rank_arg(dst, "destination", self.size), _tag(tag)))
        return Work(work._work, self, x)

    def recv(self, out, src, tag=0, shape=None, dtype=None):
        """Receives exactly out.nbytes bytes from src into out (which it returns); out=None with `shape`
        and `dtype` receives into a new array of those. A message of another dtype fails with errc
        "mismatch" (uint8 is raw bytes and agrees with every dtype), one of another size with
        "size_mismatch"; the group stays usable."""
        if out is None:
            if shape is None or dtype is None:
                raise _invalid("recv: give out, or shape and dtype of a new array to receive into")
            out = np.empty(shape, dtype=dtype)
        return self._start(self._g.recv(out, _rank_arg(src, "source", self.size), _tag(tag)))

    # ---- variable-size (flat, 1-d arrays; counts in elements, one per rank)

    def all_gatherv(self, x, counts, displs=None, out=None):
        x = _flat(x)
        counts, displs = _counts(counts, "counts"), _counts(displs, "displs")
        if out is None:
            out = _empty(_extent(counts, displs), x.dtype, x)
        return self._start(self._g.all_gatherv(x, out, counts, displs))

    def gatherv(self, x, counts, root=0, displs=None, out=None):
        x = _flat(x)
        counts, displs = _counts(counts, "counts"), _counts(displs, "displs")
        root = _rank_arg(root, "root", self.size)
        if self.rank == root and out is None:
            out = _empty(_extent(counts, displs), x.dtype, x)
        return self._start(self._g.gatherv(x, out if self.rank == root else None, counts, root, displs))

    def scatterv(self, x, counts, root=0, displs=None, out=None, dtype=None):
        counts, displs = _counts(counts, "counts"), _counts(displs, "displs")
        root = _rank_arg(root, "root", self.size)
        if self.rank == root:
            x = _flat(x)
            dtype = x.dtype
        if out is None:
            if dtype is None:
                raise _invalid("scatterv: a rank other than the root needs out, or dtype")
            self._one_per_rank(counts, "counts")
            out = np.empty(counts[self.rank], dtype=dtype)
        return self._start(self._g.scatterv(x if self.rank == root else None, out, counts, root, displs))

    def all_to_allv(self, x, send_counts, recv_counts, send_displs=None, recv_displs=None, out=None):
        x = _flat(x)
        send_counts, recv_counts = _counts(send_counts, "send_counts"), _counts(recv_counts, "recv_counts")
        send_displs, recv_displs = _counts(send_displs, "send_displs"), _counts(recv_displs, "recv_displs")
        if out is None:
            out = _empty(_extent(recv_counts, recv_displs), x.dtype, x)
        return self._start(self._g.all_to_allv(x, out, send_counts, recv_counts, send_displs, recv_displs))

    def reduce_scatterv(self, x, counts, op="sum", out=None):
        x = _flat(x)
        counts, op = _counts(counts, "counts"), _reduce_op(op)
        if out is None:
            self._one_per_rank(counts, "counts")
            out = _empty(counts[self.rank], x.dtype, x)
        return self._start(self._g.reduce_scatterv(x, out, list(counts), op))

    # ---- plans (weft/algorithms.hpp): a collective of the caller's own, as plain data

    def run_plan(self, plan, x, out=None, op="sum", name="plan"):
        """Runs `plan`, this rank's list of weft.Step (weft.plan(...)'s, or the caller's own), as one
        collective of this group: it takes the next collective number, so every rank calls it in the
        same order as the other collectives, each with its own rank's plan (MPI's rule). Plain sends read
        x; receives (and forwarding sends) use out, which is x itself when None (in place; reducing steps
        then reduce into what x holds). Host arrays, C-contiguous, of one dtype; every range (in elements)
        must lie inside its array, and a step must name ranks of this group: refused otherwise, before
        anything is sent. The Work's result is out. Errors while it runs name the rank, `name` and the
        peer, as a collective's do."""
        x = _array(x)
        out = x if out is None else _array(out, "out")
        if isinstance(x, DeviceArray) or isinstance(out, DeviceArray):
            raise _invalid("run_plan takes host arrays (a plan reads and writes its buffers directly): copy with weft.cpu")
        if not isinstance(name, str) or not name:
            raise _invalid(f"run_plan: name must be a non-empty str, got {name!r}")
        steps = []
        for i, step in enumerate(plan):
            try:
                kind, send_to, recv_from, send, recv = step
                if not isinstance(kind, str):
                    raise TypeError(f"its kind is {kind!r}, not a str")
                steps.append((kind, _rank_arg(send_to, "send_to", self.size), _rank_arg(recv_from, "recv_from", self.size),
                              (_count(send[0], "send offset"), _count(send[1], "send count")),
                              (_count(recv[0], "recv offset"), _count(recv[1], "recv count"))))
            except (TypeError, ValueError, IndexError, Error) as e:
                raise _invalid(f"run_plan: step {i} is {step!r}, not a weft.Step(kind, send_to, recv_from, send=(offset, count), "
                               f"recv=(offset, count)): {e}") from None
        return self._start(self._g.run_plan(steps, np.ascontiguousarray(x), out, _reduce_op(op), name))

    # ---- transposes (reverse-mode automatic differentiation)

    def transpose(self, collective, cotangent, like=None, **called):
        """The vector-Jacobian product of a linear collective: runs the collective that computes the
        transpose of `collective` as it was called with the keyword arguments `called` (axis, tiled,
        extents, root, split_axis, concat_axis, pairs, op) on this rank's cotangent (shaped like the
        collective's output here) and returns, as a Work, this rank's gradient (shaped like its input
        here). As weft/transpose.hpp: all_reduce -> all_reduce; all_gather <-> reduce_scatter (sum);
        broadcast(root) -> reduce(root, sum), zeros elsewhere; reduce(root) -> broadcast(root);
        scatter(root) <-> gather(root); all_to_all -> all_to_all with the axes swapped; ppermute(pairs)
        -> ppermute(the pairs reversed); all_gatherv(counts) <-> reduce_scatterv(counts); gatherv <->
        scatterv; all_to_allv(send_counts, recv_counts) -> all_to_allv(recv_counts, send_counts) (the
        variable-size ones with the displacements they were called with, if any: what lies between the
        blocks gets a zero gradient; scatterv's root and all_to_allv take the input's length from `like`,
        else from the end of the last block). Every rank calls it, as the collective.
        Where this rank's output was None (reduce's, gather's and gatherv's other ranks) the cotangent is
        None too, and `like`, an array shaped like this rank's input, says the gradient's shape;
        scatter's and scatterv's other ranks get None. Only sum reductions are linear: another op is
        refused, and so are barrier, send and recv."""
        name = _collective_name(collective)
        if name not in _TRANSPOSED:
            raise _invalid(f"transpose: {name} has no transpose here (barrier, send and recv carry no linear map of "
                           f"one collective)")
        op = _reduce_op(called.pop("op", "sum"))
        if name in ("all_reduce", "reduce_scatter", "reduce", "reduce_scatterv") and op != "sum":
            raise _invalid(f"transpose: {name} with op {op} is not linear: only sum has a transpose")
        root = called.pop("root", 0)
        axis = called.pop("axis", 0)
        tiled = called.pop("tiled", False)
        extents = called.pop("extents", None)
        split_axis, concat_axis = called.pop("split_axis", None), called.pop("concat_axis", None)
        pairs = called.pop("pairs", None)
        counts = called.pop("counts", None)
        send_counts, recv_counts = called.pop("send_counts", None), called.pop("recv_counts", None)
        displs = _counts(called.pop("displs", None), "displs") if name in ("all_gatherv", "gatherv", "scatterv") else []
        send_displs = _counts(called.pop("send_displs", None), "send_displs") if name == "all_to_allv" else []
        recv_displs = _counts(called.pop("recv_displs", None), "recv_displs") if name == "all_to_allv" else []
        if called:
            raise _invalid(f"transpose: {name} takes no {', '.join(sorted(called))} here")
        root = _rank_arg(root, "root", self.size)
        here = self.rank == root
        if cotangent is None and not (name in ("reduce", "gather", "gatherv") and not here):
            raise _invalid(f"transpose: {name} needs this rank's cotangent (shaped like its output here), not None")
        if name == "all_reduce":
            return self.all_reduce(cotangent, op="sum")
        if name == "all_gather":
            # Untiled, both count a negative axis from the end of the larger array (the gathered one).
            return self.reduce_scatter(cotangent, axis=axis, op="sum", tiled=tiled, extents=extents)
        if name == "reduce_scatter":
            return self.all_gather(cotangent, axis=axis, tiled=tiled, extents=extents)
        if name in ("all_gatherv", "gatherv", "scatterv", "reduce_scatterv") and counts is None:
            raise _invalid(f"transpose: {name} needs the counts it was called with")
        if name == "all_gatherv":
            # Placed at displacements, the gathered blocks are packed first: what lies between them
            # came from nobody and carries no gradient.
            if displs:
                cotangent = _packed(cotangent, _counts(counts, "counts"), displs)
            return self.reduce_scatterv(cotangent, counts, op="sum")
        if name == "reduce_scatterv":
            return self.all_gatherv(cotangent, counts)
        if name == "all_to_allv":
            if send_counts is None or recv_counts is None:
                raise _invalid("transpose: all_to_allv needs the send_counts and recv_counts it was called with")
            if not send_displs and not recv_displs:
                return self.all_to_allv(cotangent, recv_counts, send_counts)
            # The gradient lands where the input's blocks were taken from; the rest of the input (not
            # sent) gets zeros. Its length: like's, else the end of the last block sent.
            send_counts = _counts(send_counts, "send_counts")
            out = _zeros(_array(like).size if like is not None else _extent(send_counts, send_displs), cotangent)
            return self.all_to_allv(cotangent, recv_counts, send_counts, recv_displs, send_displs, out=out)
        if name == "all_to_all":
            if split_axis is None or concat_axis is None:
                raise _invalid("transpose: all_to_all needs split_axis and concat_axis as it was called with")
            return self.all_to_all(cotangent, split_axis=concat_axis, concat_axis=split_axis, tiled=tiled)
        if name == "permute":
            if pairs is None:
                raise _invalid("transpose: ppermute needs the pairs it was called with")
            return self.ppermute(cotangent, [(dst, src) for src, dst in self._pairs(pairs)])
        if name == "broadcast":
            work = self.reduce(cotangent, root=root, op="sum")
            if here:
                return work
            zeros = np.zeros(np.shape(cotangent), dtype=_array(cotangent).dtype)
            return Work(work._work, self, to_device(zeros, cotangent.device) if isinstance(cotangent, DeviceArray) else zeros)
        if name in ("reduce", "gather", "gatherv") and not here and like is None:
            raise _invalid(f"transpose: {name}'s other ranks give like=, an array shaped like their input")
        if name == "reduce":
            buffer = cotangent if here else np.zeros(np.shape(like), dtype=_array(like).dtype)
            return self.broadcast(buffer, root=root)
        if name == "gather":
            if here:
                return self.scatter(cotangent, root=root)
            like = _array(like)
            return self.scatter(None, root=root, shape=like.shape, dtype=like.dtype)
        if name == "scatter":
            return self.gather(cotangent, root=root)
        if name == "gatherv":
            return self.scatterv(cotangent if here else None, counts, root=root, displs=displs or None,
                                 dtype=None if here else _array(like).dtype)
        # scatterv, the last of _TRANSPOSED: at the root, the gradient has the input's length (like's, else
        # the end of the last block), zeros where no block was taken.
        out = None
        if here and displs:
            out = _zeros(_array(like).size if like is not None else _extent(_counts(counts, "counts"), displs), cotangent)
        return self.gatherv(cotangent, counts, root=root, displs=displs or None, out=out)


def _extent(counts, displs):
    """The elements a variable-size collective's blocks span: counts[i] at displs[i] (up to where the last
    ends), or one after another without displacements."""
    return max((d + c for d, c in zip(displs, counts)), default=0) if displs else sum(counts)


def _zeros(n, like):
    """n zeros of like's dtype where like lives (numpy, or like's device)."""
    zeros = np.zeros(n, dtype=_array(like).dtype)
    return to_device(zeros, like.device) if isinstance(like, DeviceArray) else zeros


def _packed(x, counts, displs):
    """The blocks of x (counts[i] elements at displs[i]) one after another, where x lives."""
    host = cpu(x).reshape(-1)
    if len(displs) != len(counts) or _extent(counts, displs) > host.size:
        raise _invalid(f"transpose: displs {list(displs)} with counts {list(counts)} do not fit a cotangent of {host.size} elements")
    packed = np.concatenate([host[d:d + c] for d, c in zip(displs, counts)]) if counts else host[:0]
    return to_device(packed, x.device) if isinstance(x, DeviceArray) else packed


def _naming_the_rank(op, method):
    """`method` whose refusals raised in Python (shapes, axes, missing arguments: no rank known there) name
    the rank and the operation, as weft's own errors do: "weft: rank 1: scatter: ..."."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except Error as e:
            if getattr(e, "rank", -1) not in (-1, None):
                raise
            raise self._refusal(op, e) from None

    return call


# permute's errors name it as weft's do ("permute"); the aliases take the wrapped methods.
for _name, _op in [("all_reduce", "all_reduce"), ("broadcast", "broadcast"), ("all_gather", "all_gather"),
                   ("reduce_scatter", "reduce_scatter"), ("all_to_all", "all_to_all"), ("ppermute", "permute"),
                   ("reduce", "reduce"), ("gather", "gather"), ("scatter", "scatter"), ("barrier", "barrier"),
                   ("send", "send"), ("recv", "recv"), ("all_gatherv", "all_gatherv"), ("gatherv", "gatherv"),
                   ("scatterv", "scatterv"), ("all_to_allv", "all_to_allv"), ("reduce_scatterv", "reduce_scatterv"),
                   ("split", "split"), ("shrink", "shrink"), ("with_timeout", "with_timeout"),
                   ("transport_to", "transport_to"), ("transpose", "transpose"),
                   ("override_algorithms", "override_algorithms"), ("run_plan", "run_plan"),
                   ("algorithm_for", "algorithm_for")]:
    setattr(Group, _name, _naming_the_rank(_op, getattr(Group, _name)))
Group.distributed_broadcast = Group.broadcast
Group.permute = Group.ppermute
del _name, _op


def to_device(x, device=0):
    """A copy of x in device memory (weft.gpu: CUDA where a device answers, else the simulated device;
    WEFT_GPU=auto|cuda|sim) as a weft.DeviceArray, which every collective takes and returns in kind.
    device=None or "cpu": x as a numpy array. A DeviceArray already on `device` is returned as is."""
    if device is None or device == "cpu":
        return cpu(x)
    if isinstance(x, DeviceArray):
        return x if x.device == device else DeviceArray.from_host(x.to_host(), device)
    return DeviceArray.from_host(np.ascontiguousarray(_array(x)), device)


def gpu(x, device=0):
    """x in device memory (to_device with a device index): the sharding API's gpu(x)."""
    return to_device(x, device)


def cpu(x):
    """x on the host: a numpy array (a DeviceArray is copied back)."""
    if isinstance(x, DeviceArray):
        return x.to_host()
    return np.asarray(x)


Step = collections.namedtuple("Step", ["kind", "send_to", "recv_from", "send", "recv"], defaults=[-1, -1, (0, 0), (0, 0)])
Step.__doc__ = """One step of a plan (weft/algorithms.hpp): `kind` is one of send, recv, recv_reduce,
recv_reduce_send, recv_copy_send, send_recv, send_recv_reduce; `send_to` and `recv_from` are group ranks;
`send` and `recv` are (offset, count) ranges in elements of the send and receive arrays."""

plan_builders = tuple(_weft.plan_builders)


def plan(name, size, rank, count=0, root=0):
    """This rank's plan from one of weft's builders (weft.plan_builders: ring_all_reduce,
    recursive_doubling_all_reduce, binomial_broadcast, ...), for rank `rank` of `size` over `count`
    elements (root where the plan has one): a list of weft.Step, to run with Group.run_plan, change or
    combine. The all_reduce plans work in place (out holds this rank's contribution), the ring
    reduce-scatter and all-gather over blocks_of(count, size) with block r at rank r."""
    size = _integer(size, "size")
    if not 1 <= size <= 2**20:
        raise _invalid(f"plan: size {size} must be from 1 to 2**20 (a plan of that many ranks has up to as many steps)")
    rank, root = _rank_arg(rank, "plan: rank", size), _rank_arg(root, "plan: root", size)
    steps = _weft.plan(str(name), size, rank, _count(count, "count"), root)
    return [Step(kind, send_to, recv_from, tuple(send), tuple(recv)) for kind, send_to, recv_from, send, recv in steps]


def blocks_of(count, parts):
    """The (offset, count) of each of `parts` nearly equal blocks of `count` elements (the first count %
    parts get one more): how weft's plans cut a buffer (the ring's block r is rank r's)."""
    parts = _integer(parts, "parts")
    if not 1 <= parts <= 2**20:
        raise _invalid(f"blocks_of: parts {parts} must be from 1 to 2**20")
    return [tuple(b) for b in _weft.blocks_of(_count(count, "count"), parts)]


def transpose_transfer(cotangent, like):
    """The vector-Jacobian product of a transfer (to_device, gpu, cpu: the sharding API's differentiable
    copies): the cotangent, shaped like the transfer's output, back where the transfer's input lived,
    `like` (that input, or an array in its place): a numpy array when like is one, else a DeviceArray on
    like's device. A transfer copies, so its transpose is the copy back; the shape and dtype must be
    like's (a cotangent of another shape or dtype belongs to another computation, and is refused)."""
    ct, src = _array(cotangent, "cotangent"), _array(like, "like")
    if tuple(ct.shape) != tuple(src.shape) or np.dtype(ct.dtype) != np.dtype(src.dtype):
        raise _invalid(f"transpose_transfer: the cotangent is {np.dtype(ct.dtype).name} {tuple(ct.shape)} and the "
                       f"transfer's input {np.dtype(src.dtype).name} {tuple(src.shape)}: they must be alike")
    return to_device(ct, src.device) if isinstance(src, DeviceArray) else cpu(ct)


def from_dlpack(x):
    """Another library's tensor without a copy, through DLPack: a host tensor as a numpy array, a CUDA
    tensor (contiguous) as a weft.DeviceArray over its memory (weft's cuda backend only). A
    DeviceArray gives its memory the other way (``torch.from_dlpack(a)``) under the cuda backend; the
    simulated device's memory cannot be shared and says so (BufferError)."""
    if isinstance(x, (np.ndarray, DeviceArray)):
        return x
    device_type, _ = x.__dlpack_device__()
    if device_type == 1:
        return np.from_dlpack(x)
    if device_type == 2:
        return DeviceArray._from_dlpack(x.__dlpack__())
    raise _invalid(f"from_dlpack: DLPack device type {device_type} is neither the host (1) nor CUDA (2)")


def available_algorithms(collective):
    """The algorithms this build implements for `collective` ("all_reduce", ...): the names that
    WEFT_ALGO, Group.create(algorithms=...) and Group.override_algorithms take."""
    return _weft.available_algorithms(_collective_name(collective))


def device_backend():
    """"cuda" or "sim": what device arrays are made of in this process."""
    return _weft.device_backend()


@atexit.register
def _shutdown():
    # Groups before the loop they run on: a C++ Group must be destroyed before its Loop.
    for g in list(Group._live):
        try:
            g.close()
        except Exception:
            pass
    _weft._shutdown()
