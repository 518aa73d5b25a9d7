"""The shared-memory transport: packets read in place by the ranks of one node.

Under mpiexec every rank here is on one node, so "auto" picks it; each case also runs on
plain MPI (copies) and must give the same bits: the transports differ only in where a
packet is read, never in what is computed or in which order.
"""

import numpy as np
import pytest

import burstmpi
from burstmpi import reference as ref
from burstmpi._transport.lifetime import private_comm
from burstmpi._transport.mpi import MPITransport
from burstmpi.masks import Chunked, Sinks, Window
from burstmpi._transport.shm import ShmChannel, ShmTransport, transport_for

from conftest import COMM, NRANKS, check_against_float64, needs_ranks


def _run(transport, *, N, Z=4, Zkv=2, d=16, dtype="float32", layout="zigzag", seed=0, **opts):
    """Forward and backward of one problem on ``transport``: (plan, out, lse, dq, dk, dv)."""
    q, k, v, do = (burstmpi.shard(x, layout=layout)
                   for x in ref.random_problem(1, N, Z, Zkv, d, dtype=np.dtype(dtype), seed=seed))
    plan = burstmpi.BurstAttention(layout=layout, transport=transport, **opts)
    out, lse = plan.forward(q, k, v)
    grads = plan.backward(do, q, k, v, out, lse)
    return (plan, out, lse, *grads)


CASES = [dict(causal=True), dict(causal=False, bwd_comm="ring"), dict(causal=True, layout="contiguous"),
         dict(window=(5, 3), layout="striped"), dict(causal=True, bwd_comm="two-way"),
         dict(causal=False, Zkv=1, dtype="float16"),
         # Packets that shrink on the way (sinks ride further than the window's rows), and
         # packets that cross ranks needing none of them, sent on as soon as they arrive.
         dict(causal=True, layout="contiguous", mask=Sinks(3) | Window(4, 0), bwd_comm="burst"),
         dict(causal=True, mask=Chunked(12), bwd_comm="ring")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k != "mask")
                         + ("-mask" if "mask" in c else ""))
def test_same_bits_as_mpi(case):
    """Forward and backward on "shm" (auto, one node) and on "mpi": identical results."""
    N = 23 * NRANKS + 3
    shm, mpi = (_run(t, N=N, **case) for t in ("auto", "mpi"))
    expect = "shm" if NRANKS > 1 else "mpi"
    assert shm[0].last_stats.transport == expect and mpi[0].last_stats.transport == "mpi"
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), shm[1:], mpi[1:]):
        assert np.array_equal(a, b, equal_nan=True), f"{name} differs between the transports"
    # The same ring: the same packets handed on, whether copied or read in place.
    for phase in ("forward", "backward"):
        s, m = (getattr(p[0].last_stats, phase) for p in (shm, mpi))
        assert (s.bytes_sent, s.steps_computed) == (m.bytes_sent, m.steps_computed)


@pytest.mark.parametrize("mode", ["burst", "ring"])
def test_against_float64(mode):
    """The transport built by a test (as a plan's own), against the float64 reference."""
    plan, _ = check_against_float64(C=19, causal=True, layout="zigzag", bwd_comm=mode,
                                    transport=transport_for, tag="shm ")
    assert plan.transport.name == "shm"


def test_arena_regrows_and_release_frees_the_window():
    """A longer call after a shorter one (a new, larger window), the shorter one again, and
    calls after release(): each the bits of a fresh plan's."""
    plan = burstmpi.BurstAttention(causal=True, layout="zigzag")
    fresh = {}
    for n in (8, 40, 8):
        N = n * NRANKS + 1
        q, k, v = (burstmpi.shard(x, layout="zigzag")
                   for x in ref.random_problem(1, N, 2, 2, 8, dtype=np.float32, seed=n)[:3])
        got = plan.forward(q, k, v)
        if n not in fresh:
            fresh[n] = burstmpi.BurstAttention(causal=True, layout="zigzag").forward(q, k, v)
        for a, b in zip(got, fresh[n]):
            assert np.array_equal(a, b)
        held = plan.buffer_bytes
        plan.release()  # collective: every rank calls it
        assert plan.buffer_bytes == 0 and (held > 0) == (NRANKS > 1)
        for a, b in zip(plan.forward(q, k, v), fresh[n]):
            assert np.array_equal(a, b)


def test_plans_on_one_communicator_share_one_window():
    """Plans made per call allocate no window each: the communicator's one serves them all,
    grown by the largest; a plan whose channels viewed the old window builds new ones."""
    small, large = (2 * NRANKS + 1, 30 * NRANKS + 1)
    first = _run("auto", N=small, causal=True)
    if NRANKS > 1:
        window = transport_for(private_comm(COMM))
        assert first[0].transport is window
        before = window.arena(0)
        _run("auto", N=small, causal=True, seed=1)
        assert window.arena(0) is before, "a second plan of the same size allocated a window"
    _run("auto", N=large, causal=True)  # grows the shared window
    again = _run("auto", N=small, causal=True)
    plan = first[0]
    q, k, v, do = (burstmpi.shard(x, layout="zigzag")
                   for x in ref.random_problem(1, small, 4, 2, 16, dtype=np.float32, seed=0))
    out, lse = plan.forward(q, k, v)  # the first plan again, on the grown window
    for a, b in zip((out, lse, *plan.backward(do, q, k, v, out, lse)), again[1:]):
        assert np.array_equal(a, b)


@needs_ranks(2)
def test_peers_packets_are_read_only_views_of_their_memory():
    """What a rank holds at step t is a view of the owner's packet, not a copy, and it
    cannot write there; a token names the owner."""
    tr = ShmTransport(COMM)
    P, r = COMM.Get_size(), COMM.Get_rank()
    fields = [("k", (1, 1, 4, 3), np.float32)]
    arena = tr.arena(64)
    tr.begin()
    chan = ShmChannel(tr, fields, send_to=(r + 1) % P, recv_from=(r - 1) % P, tag=7,
                      alloc=lambda n: arena[:n])
    chan.current["k"][...] = r
    for step in range(1, P):
        chan.post(send=True, recv=True)
        with pytest.raises(RuntimeError, match="ShmChannel.post: the previous transfer"):
            chan.post(send=True, recv=True)
        chan.wait()
        owner = (r - step) % P
        view = chan.current["k"]
        assert (view == owner).all() and not view.flags.writeable
        assert view.ctypes.data == tr.peer(owner, arena[:view.nbytes]).ctypes.data
    with pytest.raises(RuntimeError, match="ShmChannel.wait: nothing was posted"):
        chan.wait()
    chan.begin()
    assert (chan.current["k"] == r).all() and chan.current["k"].flags.writeable
    tr.finish()
    tr.free()


def test_options():
    with pytest.raises(ValueError, match=r"transport: 'shm' shares host buffers; backend='cuda' needs"):
        burstmpi.BurstAttention(transport="shm", backend="cuda")
    with pytest.raises(ValueError, match=r"transport: expected 'auto', 'nccl', 'mpi' or 'shm', got 'tcp'"):
        burstmpi.BurstAttention(transport="tcp")
    plan = _run("shm", N=2 * NRANKS + 1, causal=True)[0]
    assert plan.last_stats.transport == ("shm" if NRANKS > 1 else "mpi")  # one rank: nothing travels
    assert isinstance(plan.transport, MPITransport)


def _falls_back_to_mpi(seed, refused):
    """On a fresh communicator (its window yet to be made): "auto" copies through MPI, with
    MPI's bits; "shm" raises ``NoRoom`` on every rank, its message matching ``refused``."""
    import burstmpi._transport.shm as shm

    comm = COMM.Dup()
    try:
        N = 9 * NRANKS + 2
        q, k, v = (burstmpi.shard(x, layout="zigzag")
                   for x in ref.random_problem(1, N, 2, 2, 8, dtype=np.float32, seed=seed)[:3])
        plan = burstmpi.BurstAttention(comm, causal=True, layout="zigzag")
        got = plan.forward(q, k, v)
        assert plan.last_stats.transport == "mpi"
        want = burstmpi.BurstAttention(comm, causal=True, layout="zigzag", transport="mpi").forward(q, k, v)
        for a, b in zip(got, want):
            assert np.array_equal(a, b)
        strict = burstmpi.BurstAttention(comm, causal=True, layout="zigzag", transport="shm")
        with pytest.raises(shm.NoRoom, match=refused):
            strict.forward(q, k, v)
    finally:
        comm.Free()


@needs_ranks(2)
def test_no_room_in_shared_memory(monkeypatch):
    """Where the node's /dev/shm cannot hold the window (Docker's 64 MB): "auto" copies
    through MPI instead, with the same bits; "shm" raises on every rank, saying why."""
    import burstmpi._transport.shm as shm

    monkeypatch.setattr(shm, "free_shared_bytes", lambda: 64)
    _falls_back_to_mpi(3, r"transport 'shm': the ring's buffers need .* MB free; enlarge it")


@needs_ranks(2)
def test_ranks_whose_shared_memory_is_not_shared(monkeypatch, tmp_path):
    """Ranks MPI puts on one node whose /dev/shm differ (a container each): the node's
    memory cannot be mapped; "auto" copies through MPI, with the same bits; "shm" raises on
    every rank, naming the ranks and the file."""
    import burstmpi._transport.node_memory as node_memory

    real = node_memory._map

    def private(path, size, create):  # rank 0's file is not in the others' directory
        if not create and COMM.Get_rank() != 0:
            raise FileNotFoundError(2, "No such file or directory", path)
        return real(path, size, create)

    monkeypatch.setattr(node_memory, "_map", private)
    monkeypatch.setattr(node_memory, "SHM_DIR", str(tmp_path))
    _falls_back_to_mpi(4, r"transport 'shm': rank\(s\) 1 \(.*No such file.*\).* could not open "
                          r".*/burstmpi_.*their .* is not rank 0's")
    assert not list(tmp_path.glob("burstmpi_*")), "a node memory file was left behind"


@needs_ranks(2)
def test_the_node_memory_has_no_name_once_mapped():
    """The ring buffers' memory is a file every rank of the node maps, unlinked once they
    all have: nothing is left in /dev/shm whatever ends the job, and each rank's part
    starts on a page of its own."""
    import glob
    import mmap
    import os

    from burstmpi._transport.node_memory import map_node_memory
    from burstmpi._transport.segments import OWN_PREFIX, SHM_DIR, mapped_bytes

    before = mapped_bytes()
    arenas = map_node_memory(COMM, 100, 30.0)
    assert [a.nbytes for a in arenas] == [100] * NRANKS
    assert all(a.ctypes.data % mmap.PAGESIZE == 0 for a in arenas)
    assert mapped_bytes() - before >= NRANKS * mmap.PAGESIZE
    mine = [p for p in glob.glob(f"{SHM_DIR}/{OWN_PREFIX}{os.getpid()}_*")]
    assert not mine, mine
    arenas[COMM.Get_rank()][:] = COMM.Get_rank() + 1
    COMM.Barrier()  # an MPI message after the writes, before the reads
    assert [int(a[0]) for a in arenas] == list(range(1, NRANKS + 1))
    COMM.Barrier()
