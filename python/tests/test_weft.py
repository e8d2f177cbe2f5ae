"""The Python module from the outside, as users run it: ranks are processes (started here with weft's
environment, or by weft-run), each running one scenario of ranks.py against numpy references."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON = sys.executable
WEFT_RUN = os.environ.get("WEFT_RUN", os.path.join(HERE, "..", "..", "build", "tools", "weft-run"))
TRANSPORT = os.environ.get("WEFT_TRANSPORT", "tcp")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(n, scenario, timeout=240, interrupt_when=None, **env):
    """Starts n ranks of ranks.py SCENARIO; returns [(returncode, output)] in rank order. With
    interrupt_when (a file's path), rank 0 gets SIGINT (Ctrl-C) half a second after the file appears."""
    port = free_port()
    procs = []
    for r in range(n):
        e = dict(os.environ, WEFT_RANK=str(r), WEFT_WORLD_SIZE=str(n), WEFT_STORE=f"127.0.0.1:{port}",
                 WEFT_LOCAL_RANK=str(r), WEFT_LOCAL_WORLD_SIZE=str(n), WEFT_TRANSPORT=TRANSPORT, **env)
        procs.append(subprocess.Popen([PYTHON, os.path.join(HERE, "ranks.py"), scenario], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    if interrupt_when is not None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(interrupt_when) and procs[0].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # into the wait
        procs[0].send_signal(signal.SIGINT)
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, _ = p.communicate()
            out += "\n(killed: the scenario hung)"
        results.append((p.returncode, out))
    return results


def expect_ok(results, scenario, ranks=None):
    for r, (rc, out) in enumerate(results):
        if ranks is not None and r not in ranks:
            continue
        assert rc == 0 and f"ok {scenario} rank {r}" in out, f"rank {r} (exit {rc}):\n{out}"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_matches_numpy(n):
    expect_ok(run_ranks(n, "collectives"), "collectives")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_asyncio_overlaps_two_collectives_with_other_coroutines(n):
    expect_ok(run_ranks(n, "overlap"), "overlap")


def test_cancelling_an_awaiting_task_cancels_the_collective_everywhere(tmp_path):
    expect_ok(run_ranks(3, "cancel", TEST_READY_FILE=str(tmp_path / "marks")), "cancel")


def test_closing_a_group_wakes_the_tasks_awaiting_it(tmp_path):
    expect_ok(run_ranks(3, "close_awaited", TEST_READY_FILE=str(tmp_path / "marks")), "close_awaited")


def test_asyncio_loops_on_several_threads_await_one_group():
    expect_ok(run_ranks(2, "loops_on_threads"), "loops_on_threads")


def test_a_dead_peer_raises_in_every_other_ranks_coroutine():
    results = run_ranks(3, "dead_peer", TEST_TIMEOUT="30")
    expect_ok(results, "dead_peer", ranks={0, 1})
    for rc, out in results[:2]:
        assert "rank 2" in out


@pytest.mark.parametrize("n", [1, 2])
def test_wrong_dtypes_and_shapes_raise_before_anything_is_sent(n):
    expect_ok(run_ranks(n, "bad_arguments"), "bad_arguments")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_algorithm_choices_listed_asked_and_overridden(n, tmp_path):
    expect_ok(run_ranks(n, "algorithms", TEST_READY_FILE=str(tmp_path / "marks")), "algorithms")


@pytest.mark.parametrize("n", [1, 2])
def test_views_with_deadlines_and_transports(n):
    expect_ok(run_ranks(n, "deadlines"), "deadlines")


@pytest.mark.parametrize("n", [2, 3])
def test_survivors_shrink_to_a_working_group(n):
    results = run_ranks(n, "shrink", TEST_TIMEOUT="30")
    expect_ok(results, "shrink", ranks=set(range(n - 1)))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_transposes_pass_the_adjoint_test(n):
    expect_ok(run_ranks(n, "transposes", WEFT_GPU="sim"), "transposes")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_plans_run_as_data_and_misfits_are_refused(n):
    expect_ok(run_ranks(n, "plans"), "plans")


def test_send_gives_its_input_back_and_recv_makes_its_array():
    expect_ok(run_ranks(3, "p2p_results"), "p2p_results")


@pytest.mark.parametrize("n", [1, 2])
def test_a_forked_child_leaves_the_parents_group_alone(n):
    expect_ok(run_ranks(n, "fork"), "fork")


def test_wait_releases_the_gil():
    expect_ok(run_ranks(2, "gil"), "gil")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_device_arrays_through_the_collectives(n):
    # The simulated device unless WEFT_GPU says otherwise (tools/gpu_check.sh runs this with cuda).
    expect_ok(run_ranks(n, "device", WEFT_GPU=os.environ.get("WEFT_GPU", "sim"), WEFT_SIM_DEVICES="2"), "device")


def test_ctrl_c_interrupts_a_wait_and_the_group_goes_on(tmp_path):
    ready = str(tmp_path / "waiting")
    results = run_ranks(2, "interrupt", interrupt_when=ready, TEST_READY_FILE=ready)
    expect_ok(results, "interrupt")
    assert "interrupted after" in results[0][1]


def test_ctrl_c_interrupts_a_group_create_waiting_for_ranks(tmp_path):
    ready = str(tmp_path / "creating")
    (rc, out), = run_ranks(1, "interrupt_create", timeout=120, interrupt_when=ready, TEST_READY_FILE=ready)
    assert rc == 0 and "ok interrupt_create rank 0 after" in out, f"exit {rc}:\n{out}"


def test_weft_run_starts_python_ranks():
    if not os.access(WEFT_RUN, os.X_OK):
        pytest.skip(f"no weft-run at {WEFT_RUN}")
    out = subprocess.run([WEFT_RUN, "-n", "4", "--timeout", "240", "--", PYTHON, os.path.join(HERE, "ranks.py"), "collectives"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert out.returncode == 0, out.stdout
    for r in range(4):
        assert f"ok collectives rank {r} of 4" in out.stdout, out.stdout


def test_dlpack_on_this_machine():
    """DLPack: host tensors come in as numpy without a copy; the simulated device's memory is refused both
    ways with BufferError / weft.Error saying why (the CUDA path runs in tools/gpu_check.sh)."""
    code = """
import numpy as np, weft
a = np.arange(6, dtype=np.float32)
b = weft.from_dlpack(a)
assert b is a
class Host:
    def __init__(self, arr): self.arr = arr
    def __dlpack__(self, stream=None): return self.arr.__dlpack__()
    def __dlpack_device__(self): return self.arr.__dlpack_device__()
c = weft.from_dlpack(Host(a))
assert isinstance(c, np.ndarray) and np.shares_memory(c, a)
if weft.device_backend() == "sim":
    d = weft.to_device(a)
    try:
        d.__dlpack__()
        raise SystemExit("the simulated device's memory was handed out")
    except BufferError as e:
        assert "simulated device" in str(e), e
    class FakeCuda(Host):
        def __dlpack_device__(self): return (2, 0)
    try:
        weft.from_dlpack(FakeCuda(a))
        raise SystemExit("a CUDA tensor was taken under the sim backend")
    except weft.Error as e:
        assert "not in CUDA memory" in str(e) or "cuda backend" in str(e), e
else:
    # The cuda backend: weft's own capsule taken back through the DLPack path, without a copy.
    d = weft.to_device(a)
    assert d.__dlpack_device__() == (2, d.device)
    e = weft.DeviceArray._from_dlpack(d.__dlpack__())
    assert e.shape == d.shape and np.array_equal(weft.cpu(e), a)
print("ok dlpack")
"""
    out = subprocess.run([PYTHON, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120,
                         env=dict(os.environ, WEFT_GPU=os.environ.get("WEFT_GPU", "sim")))
    assert out.returncode == 0 and "ok dlpack" in out.stdout, out.stdout
