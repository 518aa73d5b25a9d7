"""The watchdog: every wait on other ranks ends within its deadline, with one line naming
who it waited for, and the job ends with exit code 75 (``burstmpi._transport.watchdog``).

The multi-rank cases run ``mpiexec`` in a subprocess (``test_mpi.mpiexec``: a hard timeout
kills the whole process group, so a watchdog that fails to fire fails the test instead of
stalling CI); the in-process ones check the pieces with the abort replaced.
"""

import textwrap
import threading
import time

import pytest
from mpi4py import MPI

from burstmpi._transport import watchdog
from test_mpi import ended_with, mpiexec, pytestmark as under_mpiexec, segments_left  # noqa: F401  (skips alike)

pytestmark = under_mpiexec

TIMEOUT = 4  # seconds: each job below must end within TIMEOUT + a margin for start-up

# A tiny causal call every rank can make; ``call(i)`` on the ranks of ``who``.
PRELUDE = textwrap.dedent(f"""
    import sys, time
    import numpy as np
    from mpi4py import MPI
    import burstmpi
    rank = MPI.COMM_WORLD.Get_rank()
    q = np.random.default_rng(0).standard_normal((1, 64, 2, 16), dtype=np.float32)
    def call():
        return burstmpi.attention(q, q, q, causal=True, layout="contiguous", timeout={TIMEOUT})
""")


def _watchdog_lines(out):
    return [line for line in out.splitlines() if line.startswith(watchdog.PREFIX)]


def _ends_by_watchdog(script, n=3, via_mpi4py=False, code=watchdog.EXIT_TIMEOUT, most=TIMEOUT + 30):
    """Run ``script`` at ``n`` ranks; it must end with the watchdog's line, exit ``code``,
    within ``most`` seconds, and leave no MPICH node segment in /dev/shm (the watchdog
    unlinks it as the job ends, also where no burstmpi call ran yet)."""
    since = time.time()
    rc, out, secs = mpiexec(n, ["-c", PRELUDE + textwrap.dedent(script)], timeout=120, via_mpi4py=via_mpi4py)
    rc = ended_with(rc, out)
    assert rc == code, f"expected exit {code}, got {rc}:\n{out[-3000:]}"
    assert not segments_left(since), f"the job left {segments_left(since)} in /dev/shm"
    lines = _watchdog_lines(out)
    assert lines, f"no '{watchdog.PREFIX}' line:\n{out[-3000:]}"
    assert secs < most, f"the job took {secs:.0f} s to end (deadline {TIMEOUT} s)"
    return lines, out


def test_a_rank_that_does_not_make_the_call_is_named():
    """Only rank 0 makes the second call: it names ranks 1 and 2 (with their host) and the
    job ends with the watchdog's exit code; the others had finished their programs."""
    lines, _ = _ends_by_watchdog("""
        call()
        if rank == 0:
            call()
    """)
    host = MPI.Get_processor_name()
    assert any(f"ranks [1, 2] ({host}) did not call BurstAttention.forward within" in line for line in lines), lines


def test_a_first_call_on_one_rank_only_ends_the_job():
    """The first call on a communicator duplicates it (collective, no names to give yet):
    the line says what did not complete and why that may be."""
    lines, _ = _ends_by_watchdog("""
        if rank == 0:
            call()
    """)
    assert any("MPI_Comm_idup" in line and "did not make its first burstmpi call" in line for line in lines), lines


def test_a_rank_stuck_inside_the_ring_is_named_by_its_neighbour():
    """Rank 1 stops answering in the middle of the forward (its tiles never return): its
    neighbour names it, with the ring's transfer it waited for."""
    lines, _ = _ends_by_watchdog("""
        from burstmpi._backends import CpuBackend
        call()
        if rank == 1:
            CpuBackend.fwd_block = lambda *a, **k: time.sleep(600)
        call()
    """)
    assert any("in BurstAttention.forward" in line and "the ring's packet" in line and "rank 1 (" in line
               for line in lines), lines


def test_a_rank_stuck_in_the_balancing_exchange_is_named():
    """Contiguous shards re-sharded to zigzag (``balance``): rank 1 never sends its rows in
    the second call's all-to-all, and a rank that waits for them names it and the exchange."""
    lines, _ = _ends_by_watchdog(f"""
        from burstmpi._transport.alltoall import TokenExchange
        def call():
            return burstmpi.attention(q, q, q, causal=True, layout="contiguous", balance="zigzag", timeout={TIMEOUT})
        call()
        if rank == 1:
            TokenExchange.forth = lambda *a, **k: time.sleep(600)
        call()
    """)
    assert any("in BurstAttention.forward" in line and "the all-to-all of the causal balancing" in line
               and "rank 1 (" in line for line in lines), lines


def test_an_uncaught_exception_on_one_rank_ends_the_job_without_mpi4py_runner():
    """A script run without ``-m mpi4py`` whose rank 1 raises: that rank's traceback, the
    watchdog's line, and the job ends at once with exit 1 (no deadline to wait for)."""
    lines, out = _ends_by_watchdog("""
        call()
        if rank == 1:
            raise ValueError("only rank 1 fails")
        call()
    """, code=watchdog.EXIT_EXCEPTION, most=TIMEOUT + 10)
    assert "ValueError: only rank 1 fails" in out
    assert any("rank 1 (" in line and "uncaught ValueError" in line for line in lines), lines


def test_the_bench_keeps_its_deadline_on_its_own_collectives():
    """``guarded``: a pickled allreduce (built from nonblocking collectives) one rank never
    joins ends the job by the deadline, on a communicator split from the guarded one too
    (mpi4py's own would hold the GIL, and no thread could end it)."""
    lines, _ = _ends_by_watchdog(f"""
        from burstmpi._transport.watchdog import guarded
        comm = guarded(MPI.COMM_WORLD, {TIMEOUT}, who="test")
        assert isinstance(comm, MPI.Intracomm) and comm.Dup()._timeout == {TIMEOUT}  # a plan's private copy
        half = comm.Split(0, rank)  # made from it: the same deadline and name
        assert type(half) is type(comm) and (half._timeout, half._who) == ({TIMEOUT}, "test")
        if rank != 2:
            half.allreduce(1)
        time.sleep(60)
    """, most=TIMEOUT + 20)
    assert any("test: allreduce did not complete within" in line for line in lines), lines


GUARDED_AS_MPI4PY = """
    import numpy as np
    from burstmpi._transport.watchdog import GuardedComm, guarded
    world = MPI.COMM_WORLD
    comm = guarded(world, 7.0, who="test")
    P = world.Get_size()
    objs = [{"rank": rank, "list": list(range(rank))}, rank + 0.5]
    for obj in objs:
        assert comm.allgather(obj) == world.allgather(obj)
        assert comm.gather(obj, root=1) == world.gather(obj, root=1)
        assert comm.bcast(obj, root=2) == world.bcast(obj, root=2)
    for op in (MPI.SUM, MPI.MAX, MPI.PROD):
        x = rank + 2
        assert comm.allreduce(x, op=op) == world.allreduce(x, op=op)
        assert comm.reduce(x, op=op, root=1) == world.reduce(x, op=op, root=1)
        assert comm.scan(x, op=op) == world.scan(x, op=op)
        assert comm.exscan(x, op=op) == world.exscan(x, op=op)
    every = [(rank, r) for r in range(P)]
    assert comm.alltoall(every) == world.alltoall(every)
    assert comm.scatter([r * 10 for r in range(P)] if rank == 0 else None, root=0) == rank * 10
    comm.Barrier(), comm.barrier()
    buf = np.array([rank], np.int64)
    comm.Allreduce(MPI.IN_PLACE, buf)  # under the deadline's guard
    assert buf[0] == P * (P - 1) // 2
    group = comm.Get_group()
    idup, request = comm.Idup()
    request.Wait()  # before the next collective: Open MPI 5's Split waits for it otherwise (MPICH's does not)
    made = {"Dup": comm.Dup(), "Dup_with_info": comm.Dup_with_info(MPI.INFO_NULL), "Clone": comm.Clone(),
            "Idup": idup, "Split": comm.Split(rank % 2, rank),
            "Split_type": comm.Split_type(MPI.COMM_TYPE_SHARED), "Create": comm.Create(group),
            "Create_group": comm.Create_group(group)}
    for name, sub in made.items():
        assert type(sub) is GuardedComm and (sub._timeout, sub._who) == (7.0, "test"), name
    assert comm.Split(MPI.UNDEFINED if rank else 0, 0) == MPI.COMM_NULL or rank == 0
    assert isinstance(comm.Create_cart([P]), MPI.Cartcomm)
    if rank == 0:
        print("GuardedComm as mpi4py: same results", flush=True)
"""


def test_a_guarded_communicator_answers_as_mpi4py_and_makes_guarded_ones():
    """Every pickled collective of a ``GuardedComm`` gives what mpi4py's gives (3 ranks),
    and every communicator made from it is one with the same deadline and name."""
    rc, out, _ = mpiexec(3, ["-c", textwrap.dedent("""
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
    """) + textwrap.dedent(GUARDED_AS_MPI4PY)], timeout=120)
    assert rc == 0 and "GuardedComm as mpi4py: same results" in out, out[-3000:]


# -- in-process pieces -----------------------------------------------------------------------

class Expired(Exception):
    pass


@pytest.fixture
def no_abort(monkeypatch):
    """``abort`` raises instead of ending the test process; the lines printed are kept."""
    calls = []

    def fake(code, comm=None):
        calls.append(code)
        raise Expired(code)

    # On the module that owns it: the others look it up there (``watchdog.expiry.abort``).
    monkeypatch.setattr(watchdog.expiry, "abort", fake)
    return calls


def test_complete_returns_at_once_when_done_and_expires_with_the_pending_peers(no_abort, capsys):
    comm = MPI.COMM_SELF
    buf = bytearray(8)
    done = comm.Isend([buf, MPI.BYTE], dest=0, tag=1)
    got = comm.Irecv([bytearray(8), MPI.BYTE], source=0, tag=1)
    watchdog.complete([done, got], timeout=1.0)
    never = comm.Irecv([bytearray(8), MPI.BYTE], source=0, tag=2)  # nobody sends it
    t0 = time.monotonic()
    with pytest.raises(Expired):
        watchdog.complete([never], idle=True, timeout=0.2,
                          expired=watchdog.peers_expired(comm, [("receive the test's packet from", 0)], "a test"))
    assert 0.2 <= time.monotonic() - t0 < 5
    line = capsys.readouterr().err.strip()
    assert line.startswith(watchdog.PREFIX) and "a test: waited 0 s to receive the test's packet from rank 0" in line
    assert line.endswith(f"exit {watchdog.EXIT_TIMEOUT})") and no_abort == [watchdog.EXIT_TIMEOUT]
    never.Cancel()
    never.Wait()


def test_guard_fires_from_its_thread_and_not_when_the_body_ends_in_time(monkeypatch):
    """The expiry runs on the watchdog's monitor thread (the caller's is blocked in the
    guarded call): ``expire`` records the thread it was called on."""
    fired = []
    monkeypatch.setattr(watchdog.expiry, "expire", lambda text, code=watchdog.EXIT_TIMEOUT, wait=0.0:
                        fired.append((text, threading.current_thread())))
    with watchdog.guard("a quick call", 0.5):
        pass
    with watchdog.guard("a slow call", 0.2):
        deadline = time.monotonic() + 5
        while not fired and time.monotonic() < deadline:
            time.sleep(0.01)
    time.sleep(0.7)  # past the quick call's deadline: it was disarmed
    assert len(fired) >= 1 and all(f.startswith("a slow call did not complete within") for f, _ in fired), fired
    threads = {t for _, t in fired}
    assert threads == {watchdog.monitor._monitor.thread}, threads
    assert all(t.name == "burstmpi-watchdog" and t is not threading.main_thread() for t in threads)


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "30", True])
def test_timeout_must_be_positive_seconds(bad):
    with pytest.raises(ValueError, match=r"^f: timeout: expected a finite number of seconds > 0"):
        watchdog.check_timeout("f", bad)


def test_the_environment_sets_the_default_and_the_old_name_warns(monkeypatch):
    from burstmpi._config import settings

    monkeypatch.delenv("BURSTMPI_TIMEOUT", raising=False)
    monkeypatch.delenv("BURSTMPI_NCCL_TIMEOUT", raising=False)
    assert settings().timeout == watchdog.DEFAULT_TIMEOUT
    monkeypatch.setenv("BURSTMPI_TIMEOUT", "12.5")
    assert settings().timeout == 12.5
    monkeypatch.delenv("BURSTMPI_TIMEOUT")
    monkeypatch.setenv("BURSTMPI_NCCL_TIMEOUT", "40")
    with pytest.warns(FutureWarning, match="BURSTMPI_TIMEOUT"):
        assert settings().timeout == 40.0
    monkeypatch.setenv("BURSTMPI_TIMEOUT", "0")
    with pytest.raises(ValueError, match="BURSTMPI_TIMEOUT"):
        settings()


def test_who_names_world_ranks_and_their_hosts(monkeypatch):
    monkeypatch.setattr(watchdog.hosts, "_hosts", {})  # what it learns goes with the test
    watchdog.learn_hosts(MPI.COMM_SELF, ["node-a"])
    me = MPI.COMM_WORLD.Get_rank()
    assert watchdog.who(MPI.COMM_SELF, [0]) == f"rank {me} (node-a)"


def test_mpich_node_segments_are_unlinked_once_mapped(tmp_path, monkeypatch):
    """MPI_Abort leaves MPICH's node segment in /dev/shm; burstmpi unlinks the names this
    process maps (and only MPICH's: another program's shared memory is not its business)."""
    from burstmpi._transport import segments

    monkeypatch.setattr(segments, "SHM_DIR", str(tmp_path))
    ours, theirs = tmp_path / "mpich_shm_1a2b_0", tmp_path / "torch_123"
    ours.write_bytes(b"x"), theirs.write_bytes(b"x")
    maps = tmp_path / "maps"
    maps.write_text(f"7f00-7f01 rw-s 00000000 00:1a 1 {ours}\n7f02-7f03 rw-s 00000000 00:1a 2 {theirs}\n"
                    f"7f04-7f05 rw-s 00000000 00:1a 3 {tmp_path}/mpich_shm_gone_0 (deleted)\n")
    segments.unlink_node_segments(str(maps))
    assert not ours.exists() and theirs.exists()
    segments.unlink_node_segments(str(maps))  # again (another rank was first): nothing to do, no error


@pytest.mark.parametrize("ending,attached", [(False, False), (False, True), (True, False)])
def test_which_node_segments_go_when(tmp_path, monkeypatch, ending, attached):
    """MPICH's names go as soon as every rank mapped them; Open MPI's (whose ranks attach
    each other's at first contact) once every rank of the host has attached every other's
    (or as the job ends), and burstmpi's own (another thread may be making one) only as
    the job ends."""
    from burstmpi._transport import segments

    monkeypatch.setattr(segments, "SHM_DIR", str(tmp_path))
    names = {"mpich": "mpich_shm_1a2b_0", "openmpi": "sm_segment.vm.0.2610000.0", "ours": "burstmpi_12_ab",
             "other": "torch_123"}
    maps = tmp_path / "maps"
    maps.write_text("".join(f"7f{i}0-7f{i}1 rw-s 00000000 00:1a {i} {tmp_path / n}\n"
                            for i, n in enumerate(names.values())))
    for n in names.values():
        (tmp_path / n).write_bytes(b"x")
    segments.unlink_node_segments(str(maps), ending=ending, attached=attached)
    gone = {k for k, n in names.items() if not (tmp_path / n).exists()}
    assert gone == {"mpich"} | ({"openmpi", "ours"} if ending else set()) | ({"openmpi"} if attached else set())
