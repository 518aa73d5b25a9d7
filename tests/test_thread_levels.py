"""Below MPI_THREAD_MULTIPLE no thread but the caller's calls MPI (``burstmpi._transport.watchdog``).

At ``MPI_THREAD_FUNNELED`` only the main thread may call MPI, at ``SERIALIZED`` one thread
at a time (Cray MPICH's default), so the watchdog's monitor and the bench's signal thread
hand the abort to the caller's thread (``watchdog.on_callers_thread``) and name this rank
from what was read beforehand (``watchdog.identity``). The multi-rank runs start their own
``mpiexec`` at each level (``MPI4PY_RC_THREAD_LEVEL``), with a hard timeout; the bench's
signals at these levels are ``tests/bench/test_interrupt.py``'s. In-process, the hand-over
itself, with the level read as FUNNELED.
"""

import re
import textwrap
import threading
import time

import pytest
from mpi4py import MPI

from burstmpi._transport import watchdog
from burstmpi._transport.watchdog import expiry, identity
from test_mpi import ended_with, mpiexec, pytestmark as under_mpiexec, segments_left  # noqa: F401  (skips alike)

pytestmark = under_mpiexec

TIMEOUT = 2  # seconds: the deadline of the calls below
LEVELS = {"funneled": MPI.THREAD_FUNNELED, "serialized": MPI.THREAD_SERIALIZED}

RING = textwrap.dedent(f"""
    import sys, time
    import numpy as np
    from mpi4py import MPI
    import burstmpi
    from burstmpi import reference as ref
    level = sys.argv[1]
    assert MPI.Query_thread() == {{"funneled": MPI.THREAD_FUNNELED, "serialized": MPI.THREAD_SERIALIZED}}[level]
    rank, P = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    q, k, v, do = ref.random_problem(1, 16 * P, 2, 2, 16, dtype=np.float64, seed=0)
    plan = burstmpi.BurstAttention(causal=True, layout="zigzag", timeout={TIMEOUT})
    sh = lambda x: burstmpi.shard(x, layout="zigzag")
    un = lambda x: burstmpi.unshard(x, layout="zigzag")
    out, lse = plan.forward(sh(q), sh(k), sh(v))
    grads = plan.backward(sh(do), sh(q), sh(k), sh(v), out, lse)
    exact = [ref.forward(q, k, v, causal=True)[0], *ref.backward(do, q, k, v, causal=True)]
    err = max(float(abs(un(ours) - e).max()) for ours, e in zip([out, *grads], exact))
    if rank == 0:
        print(f"ring at {{level}}: largest error against float64 {{err:.1e}}", flush=True)
    if rank == 0:  # rank 1 does not make the second call
        plan.forward(sh(q), sh(k), sh(v))
    time.sleep(60)
""")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("level", sorted(LEVELS))
def test_the_ring_and_its_deadline_below_thread_multiple(level):
    """The ring's forward and backward against float64, then a call rank 1 does not make:
    rank 0 names it and aborts from its main thread (``complete``'s loop), so mpiexec
    returns 75, as at the default level."""
    rc, out, secs = mpiexec(2, ["-c", RING, level], timeout=120, MPI4PY_RC_THREAD_LEVEL=level)
    rc = ended_with(rc, out)
    m = re.search(r"largest error against float64 (\S+)", out)
    assert m and float(m.group(1)) < 1e-12, out[-3000:]
    assert rc == watchdog.EXIT_TIMEOUT, f"expected exit 75, got {rc}:\n{out[-3000:]}"
    lines = [line for line in out.splitlines() if line.startswith(watchdog.PREFIX)]
    assert len(lines) == 1 and "rank 0 (" in lines[0] and "rank 1 (" in lines[0], out[-3000:]
    assert "did not call BurstAttention.forward within 2 s" in lines[0] and lines[0].endswith("exit 75)"), lines
    assert secs < 60, f"the job took {secs:.0f} s to end (deadline {TIMEOUT} s)"


GUARDED = textwrap.dedent(f"""
    import time
    from mpi4py import MPI
    from burstmpi._transport.watchdog import guard
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:  # rank 1 never duplicates: rank 0 blocks inside MPI_Comm_dup
        with guard("a duplicate rank 1 never makes", {TIMEOUT}):
            comm.Dup()
    time.sleep(60)
""")


@pytest.mark.timeout(180)
def test_a_blocking_call_past_its_deadline_at_funneled_ends_the_process():
    """The monitor thread may not call MPI_Abort at FUNNELED, and the main thread stays
    inside MPI_Comm_dup: the line, then ``os._exit(75)``; hydra ends the other rank and
    returns 75, or 9 (the other's SIGKILL) after its BAD TERMINATION banner (measured:
    ``watchdog.expiry``'s notes)."""
    since = time.time()
    rc, out, secs = mpiexec(2, ["-c", GUARDED], timeout=120, MPI4PY_RC_THREAD_LEVEL="funneled")
    assert not segments_left(since), f"the job left {segments_left(since)} in /dev/shm"  # unlinked by the line
    lines = [line for line in out.splitlines() if line.startswith(watchdog.PREFIX)]
    assert len(lines) == 1 and lines[0].startswith(f"{watchdog.PREFIX}rank 0 (") and \
        "a duplicate rank 1 never makes did not complete within 2 s" in lines[0], out[-3000:]
    assert rc in (watchdog.EXIT_TIMEOUT, 9), f"expected exit 75 (or hydra's 9), got {rc}:\n{out[-3000:]}"
    if rc == 9:
        assert "BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES" in out, out[-3000:]
    assert secs < 60, f"the job took {secs:.0f} s to end (deadline {TIMEOUT} s)"


# -- in-process: the hand-over, with the level read as FUNNELED -------------------------------

@pytest.fixture
def funneled(monkeypatch):
    """The level read as FUNNELED and this rank's host as ``node-x``; ``abort`` records the
    thread it ran on instead of ending the test process, and so does ``os._exit``."""
    rank = MPI.COMM_WORLD.Get_rank()
    monkeypatch.setattr(identity, "_known", (rank, "node-x", MPI.THREAD_FUNNELED))
    monkeypatch.setattr(watchdog.hosts, "_hosts", {})  # no host learned by another test
    ended = []
    ran = lambda how: lambda code, comm=None: ended.append((how, code, threading.current_thread()))
    monkeypatch.setattr(expiry, "abort", ran("abort"))
    monkeypatch.setattr(expiry.os, "_exit", ran("_exit"))
    return ended


def _helper_thread(target):
    thread = identity.helper(threading.Thread(target=target, daemon=True))
    thread.start()
    return thread


def test_a_helper_hands_the_abort_to_the_callers_thread(funneled, capsys):
    """A deadline that passes on a helper thread: its line names this rank from what was
    read beforehand, and the abort runs on the main thread at its next ``checkpoint``."""
    assert not _run_in(_helper_thread, identity.may_call_mpi) and identity.may_call_mpi()
    thread = _helper_thread(lambda: expiry.expire("a test's call did not complete within 2 s"))
    deadline = time.monotonic() + 10
    while not funneled and time.monotonic() < deadline:
        watchdog.checkpoint()  # what ``complete`` does on every poll
        time.sleep(0.01)
    thread.join(10)
    assert funneled == [("abort", watchdog.EXIT_TIMEOUT, threading.main_thread())], funneled
    line = capsys.readouterr().err.strip()
    assert line == (f"{watchdog.PREFIX}rank {MPI.COMM_WORLD.Get_rank()} (node-x): a test's call did not complete "
                    "within 2 s; aborting the job (MPI_Abort, exit 75)"), line


def test_a_helper_whose_caller_never_comes_ends_the_process_without_mpi(funneled, capsys):
    """No ``checkpoint`` within ``CALLER_GRACE_S`` (the main thread inside a blocking call):
    the hand-over is withdrawn and the helper ends the process itself, ``os._exit``."""
    t0 = time.monotonic()
    _helper_thread(lambda: expiry.end_job(watchdog.EXIT_TIMEOUT)).join(10)
    assert funneled and funneled[0][:2] == ("_exit", watchdog.EXIT_TIMEOUT) and funneled[0][2].daemon, funneled
    assert expiry.CALLER_GRACE_S <= time.monotonic() - t0 < 10
    watchdog.checkpoint()  # withdrawn: nothing left for the main thread to run
    assert len(funneled) == 1, funneled


def _run_in(start, fn):
    got = []
    start(lambda: got.append(fn())).join(10)
    return got[0]
