#!/usr/bin/env python3
"""Drives examples/http_server.cpp with real HTTP clients on loopback (a bounded number of requests, each
with a timeout), as its users would:
  - /ping answers; /threads says the process has one thread (no thread of weft's);
  - /sum on every rank returns the sum over the ranks, for rounds of concurrent requests;
  - /ping keeps answering while a /sum waits for the other ranks, and while large /sum all_reduces run;
  - /sum requests that reach a rank out of order (seq=K) still pair up;
  - /quit on every rank ends every server, exit status 0.
usage: http_server_test.py WEFT_RUN SERVER [RANKS] [--measure]
  --measure: also prints /ping latency while large all_reduces run (bench/RESULTS.md)."""
import http.client
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

weft_run, server = sys.argv[1], sys.argv[2]
ranks = int(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3].isdigit() else 2
measure = "--measure" in sys.argv


def free_base_port(count):
    """A base port with `count` free ports after it (bound and released)."""
    for _ in range(50):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
        s.close()
        if base + count >= 65535:
            continue
        ok = True
        for p in range(base, base + count):
            t = socket.socket()
            try:
                t.bind(("127.0.0.1", p))
            except OSError:
                ok = False
            t.close()
        if ok:
            return base
    raise RuntimeError("no free ports")


def get(rank, path, timeout=20):
    conn = http.client.HTTPConnection("127.0.0.1", base + rank, timeout=timeout)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        return reply.status, reply.read().decode().strip()
    finally:
        conn.close()


def fail(why):
    print("FAIL:", why)
    proc.kill()
    print(proc.stdout.read() if proc.stdout else "")
    sys.exit(1)


def expect(rank, path, body, timeout=20):
    status, text = get(rank, path, timeout)
    if status != 200 or text != body:
        fail(f"rank {rank} {path}: {status} {text!r}, expected 200 {body!r}")


def concurrently(calls):
    """Runs get() for each (rank, path) at once; returns the (status, body) in order."""
    results = [None] * len(calls)

    def one(i, rank, path):
        try:
            results[i] = get(rank, path)
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = (0, repr(e))

    threads = [threading.Thread(target=one, args=(i, r, p)) for i, (r, p) in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


base = free_base_port(ranks)
proc = subprocess.Popen([weft_run, "-n", str(ranks), "--timeout", "120", "--", server, str(base)],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
listening = 0
deadline = time.time() + 60
while listening < ranks:
    line = proc.stdout.readline()
    if not line:
        fail("the servers ended before listening")
    print(line, end="")
    listening += "listening on" in line
    if time.time() > deadline:
        fail("the servers did not start within 60 s")
# The rest of the output is read by a thread, so that the servers never block on a full pipe.
output = []
reader = threading.Thread(target=lambda: output.extend(proc.stdout), daemon=True)
reader.start()

for r in range(ranks):
    expect(r, "/ping", "pong")
    expect(r, "/threads", "1")
total = ranks * (ranks + 1) // 2
# Rounds of /sum, every rank asked at once.
for k in range(1, 6):
    results = concurrently([(r, f"/sum?x={(r + 1) * k}") for r in range(ranks)])
    for r, (status, text) in enumerate(results):
        if status != 200 or text != f"sum={total * k}":
            fail(f"round {k}, rank {r}: {status} {text!r}, expected sum={total * k}")
print("ok: 5 rounds of /sum on every rank")

# A /sum that waits for the other ranks does not hold /ping up.
pending = []
waiting = threading.Thread(target=lambda: pending.append(get(0, "/sum?x=100")))
waiting.start()
time.sleep(0.3)
for _ in range(5):
    start = time.time()
    expect(0, "/ping", "pong", timeout=5)
    if time.time() - start > 2:
        fail("/ping took over 2 s while a /sum was in flight")
if not waiting.is_alive():
    fail(f"the /sum on rank 0 finished before the other ranks asked: {pending}")
rest = concurrently([(r, "/sum?x=100") for r in range(1, ranks)])
waiting.join(30)
for status, text in pending + rest:
    if status != 200 or text != f"sum={100 * ranks}":
        fail(f"pending /sum: {status} {text!r}")
print("ok: /ping answered while a /sum waited for the other ranks")

# Requests that reach a rank out of order pair up by their sequence number (this rank has had 6 /sum).
calls = [(0, "/sum?x=2&seq=7"), (0, "/sum?x=1&seq=6")] + [(r, f"/sum?x={k - 5}&seq={k}") for r in range(1, ranks) for k in (6, 7)]
results = concurrently(calls)
for (rank, path), (status, text) in zip(calls, results):
    k = int(path.rsplit("=", 1)[1])
    if status != 200 or text != f"sum={(k - 5) * ranks}":
        fail(f"rank {rank} {path}: {status} {text!r}, expected sum={(k - 5) * ranks}")
print("ok: out-of-order /sum requests paired by seq")

# /ping while large all_reduces (4 Mi elements of int64, 32 MiB) run on every rank.
latencies = []
busy = threading.Event()


def big_sums(count, start_seq):
    for k in range(count):
        results = concurrently([(r, f"/sum?x=1&n=4194304&seq={start_seq + k}") for r in range(ranks)])
        for status, text in results:
            if status != 200 or text != f"sum={ranks}":
                latencies.append(None)
    busy.set()


rounds = 20 if measure else 4
worker = threading.Thread(target=big_sums, args=(rounds, 8))
worker.start()
while not busy.is_set():
    start = time.time()
    expect(0, "/ping", "pong", timeout=10)
    latencies.append(time.time() - start)
    time.sleep(0.002)
worker.join(120)
if None in latencies:
    fail("a large /sum gave a wrong answer")
if not latencies:
    fail("no /ping was measured")
lat_ms = sorted(x * 1000 for x in latencies)
print(f"ok: {len(lat_ms)} /ping during {rounds} large /sum rounds: median {statistics.median(lat_ms):.2f} ms, "
      f"p90 {lat_ms[int(len(lat_ms) * 0.9)]:.2f} ms, max {lat_ms[-1]:.2f} ms")
if measure:
    idle = []
    for _ in range(200):
        start = time.time()
        expect(0, "/ping", "pong")
        idle.append((time.time() - start) * 1000)
    idle.sort()
    print(f"idle /ping: median {statistics.median(idle):.2f} ms, p90 {idle[int(len(idle) * 0.9)]:.2f} ms, max {idle[-1]:.2f} ms")

for r in range(ranks):
    expect(r, "/threads", "1")
results = concurrently([(r, "/quit") for r in range(ranks)])
for r, (status, text) in enumerate(results):
    if status != 200 or text != "bye":
        fail(f"rank {r} /quit: {status} {text!r}")
try:
    rc = proc.wait(30)
except subprocess.TimeoutExpired:
    fail("the servers did not end within 30 s of /quit")
reader.join(5)
print("".join(output), end="")
if rc != 0:
    fail(f"weft-run exited {rc}")
if sum("server ended" in line for line in output) != ranks:
    fail("not every server said it ended")
print(f"ok: {ranks} servers ended after /quit")
