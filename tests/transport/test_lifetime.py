"""What burstmpi keeps for a communicator goes with it (``burstmpi._transport.lifetime``).

A long job makes and frees communicators of its own: its private duplicate, splits, NCCL
communicators, shared windows and cached plans must go when the caller frees one, or MPI
runs out of communicators (MPICH: 2,048 context ids, ~1,000 rounds before this was
built). Runs alone and under mpiexec (tests/test_mpi.py). More rounds than MPICH has
communicators: examples/make_use_free.py (tests/test_examples.py runs it), which counts
the communicators MPI can still make, not only burstmpi's own counts.
"""

import os
import textwrap

import numpy as np
import pytest
from mpi4py import MPI

import burstmpi
from burstmpi import _plan_cache as plan_cache
from burstmpi import reference as ref
from burstmpi._transport import lifetime, shm
from burstmpi._transport.lifetime import CommunicatorFreed

from conftest import COMM, NRANKS, RANK

OPTS = dict(causal=True, layout="zigzag", timeout=60)


def _problem(N=None, H=2, D=16, seed=0):
    N = N or 8 * NRANKS + 3
    q, k, v, do = ref.random_problem(1, N, H, H, D, seed=seed)
    sh = lambda x: burstmpi.shard(x, layout="zigzag")
    return q, k, v, do, (sh(q), sh(k), sh(v), sh(do))


def test_make_use_free_leaves_nothing_behind():
    """Rounds of Dup, calls (the functional API, a plan, a KV cache, head parallelism where
    the ranks allow it), Free: what burstmpi holds is back to where it was after every
    round, and every call's result is right."""
    q, k, v, _, (ql, kl, vl, _) = _problem()
    exact = ref.forward(q, k, v, causal=True)[0]
    burstmpi.unshard(ql, layout="zigzag")  # COMM_WORLD's state, which the checks below use
    before = lifetime.live()
    for _ in range(4):
        c = COMM.Dup()
        out = burstmpi.attention(ql, kl, vl, comm=c, **OPTS)
        plan = burstmpi.BurstAttention(c, **OPTS)
        plan.forward(ql, kl, vl)
        if NRANKS % 2 == 0:
            burstmpi.attention(ql, kl, vl, comm=c, head_parallel=2, **OPTS)
        cache = burstmpi.KVCache(capacity=q.shape[1] + 4, batch=1, kv_heads=2, head_dim=16, comm=c)
        cache.prefill(ql, kl, vl, layout="zigzag")
        assert lifetime.live()["communicators"] > before["communicators"]
        c.Free()
        assert lifetime.live() == before
        full = burstmpi.unshard(out, layout="zigzag")
        np.testing.assert_allclose(full, exact, atol=2e-5, rtol=2e-5)


def test_a_plan_used_after_its_communicator_was_freed_raises_on_every_rank():
    _, _, _, _, (ql, kl, vl, _) = _problem()
    c = COMM.Dup()
    plan = burstmpi.BurstAttention(c, **OPTS)
    plan.forward(ql, kl, vl)
    cache = burstmpi.KVCache(capacity=64 * NRANKS, batch=1, kv_heads=2, head_dim=16, comm=c)
    c.Free()
    with pytest.raises(CommunicatorFreed, match=r"BurstAttention.forward: comm: expected a live communicator, got "
                                                r"one that was freed \(MPI_Comm_free\)"):
        plan.forward(ql, kl, vl)
    with pytest.raises(CommunicatorFreed, match=r"KVCache.prefill: comm: expected a live communicator, got one that "
                                                r"was freed"):
        cache.prefill(ql, kl, vl, layout="zigzag")
    plan.release()  # nothing left to free: no error, no MPI call
    with pytest.raises(ValueError, match=r"comm: expected a live intracommunicator, got MPI.COMM_NULL"):
        burstmpi.BurstAttention(c, **OPTS)
    with pytest.raises(ValueError, match=r"unshard: comm: expected a live intracommunicator, got MPI.COMM_NULL"):
        burstmpi.unshard(ql, comm=c, layout="zigzag")
    with pytest.raises(TypeError, match=r"release_cached: comm: expected an mpi4py intracommunicator, got str"):
        burstmpi.release_cached("world")


def test_twelve_option_sets_in_turn_map_no_window_per_call(monkeypatch):
    """More option sets than the cache keeps (8): plans are evicted and made again, but the
    node's shared window is the communicator's and stays, so after the first calls no call
    allocates one (counted at ``ShmTransport._alloc``)."""
    allocs = []
    real = shm.ShmTransport._alloc
    monkeypatch.setattr(shm.ShmTransport, "_alloc", lambda self, n: allocs.append(n) or real(self, n))
    _, _, _, _, (ql, kl, vl, _) = _problem()
    c = COMM.Dup()
    try:
        scales = [0.1 + 0.05 * i for i in range(12)]
        for rnd in range(3):
            for s in scales:
                burstmpi.attention(ql, kl, vl, comm=c, softmax_scale=s, **OPTS)
            if rnd == 0:
                first = len(allocs)
        st = plan_cache.stats(c)
        assert st.plans == plan_cache.MAX_PLANS and st.evictions > 0
        assert len(allocs) == first, f"windows allocated after the first round: {allocs[first:]}"
        if NRANKS > 1:  # one window, grown at most once or twice by the first calls
            assert 1 <= first <= 2, allocs
    finally:
        c.Free()


def test_release_cached_says_what_it_freed_and_what_it_kept():
    _, _, _, _, (ql, kl, vl, _) = _problem()
    c = COMM.Dup()
    before = lifetime.live()
    burstmpi.attention(ql, kl, vl, comm=c, **OPTS)
    plan = burstmpi.BurstAttention(c, **OPTS)  # the caller's own: it keeps the communicators
    plan.forward(ql, kl, vl)
    got = burstmpi.release_cached(c)
    assert got.plans == 1 and got.communicators == 0
    assert f"{NRANKS} plan(s) made on this communicator are still alive" in got.kept, got
    out = plan.forward(ql, kl, vl)[0]  # still works: its window is mapped again
    assert np.isfinite(out).all()
    del plan
    burstmpi.attention(ql, kl, vl, comm=c, **OPTS)
    got = burstmpi.release_cached(c)
    assert (got.plans, got.communicators, got.kept) == (1, 1, "")
    assert got.windows == (1 if NRANKS > 1 else 0), got  # one rank copies through MPI: no window
    assert lifetime.live() == before
    out = burstmpi.attention(ql, kl, vl, comm=c, **OPTS)  # a fresh state: works again
    assert np.isfinite(out).all()
    c.Free()
    assert lifetime.live() == before


def test_the_teardown_frees_splits_before_their_communicator():
    """Head parallelism splits burstmpi's duplicate; the splits carry states of their own
    (the ring of groups' plans): freeing the caller's communicator frees them all."""
    if NRANKS % 2:
        pytest.skip("head parallelism of 2 needs an even rank count")
    _, _, _, _, (ql, kl, vl, _) = _problem()
    before = lifetime.live()
    c = COMM.Dup()
    burstmpi.attention(ql, kl, vl, comm=c, head_parallel=2, **OPTS)
    assert lifetime.live()["states"] > before["states"] + 1  # the groups' ring made one of its own
    c.Free()
    assert lifetime.live() == before


FINALIZE_SCRIPT = textwrap.dedent("""
    import mpi4py
    mpi4py.rc.finalize = False
    import numpy as np
    from mpi4py import MPI
    import burstmpi
    from burstmpi._transport import lifetime
    comm = MPI.COMM_WORLD
    c = comm.Dup()
    q = burstmpi.shard(np.random.default_rng(0).standard_normal((1, 40, 2, 16), dtype=np.float32))
    burstmpi.attention(q, q, q, comm=c, timeout=20)
    burstmpi.attention(q, q, q, timeout=20)
    assert lifetime.live()["states"] == 2
    MPI.Finalize()  # the program's own, with burstmpi's states alive: local frees, no hang
    assert lifetime.live()["states"] == 0, lifetime.live()
    print("finalized", flush=True)
""")


@pytest.mark.skipif(NRANKS > 1 or os.environ.get("BURSTMPI_UNDER_MPIEXEC") == "1", reason="runs mpiexec itself")
@pytest.mark.parametrize("n", [2, 3])
def test_the_programs_own_finalize_drops_the_states(tmp_path, n):
    from test_mpi import MPIEXEC, mpiexec

    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    script = tmp_path / "finalize.py"
    script.write_text(FINALIZE_SCRIPT)
    rc, out, _ = mpiexec(n, [str(script)], timeout=120, via_mpi4py=False)
    assert rc == 0 and out.count("finalized") == n, out[-3000:]
