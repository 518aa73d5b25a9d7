"""The functional API's cached plans (issue 45, item 2; ``burstmpi._plan_cache``).

``burstmpi.attention`` and ``attention_backward`` reuse a plan per communicator and
plan-shaping arguments: the same bits as a fresh ``BurstAttention``, no new plan (and no
node discovery) on a second call, a plan per set of arguments, eviction at the bounds,
``release_cached`` emptying the cache, results that later calls never touch, a freed
communicator's plans dropped. Runs alone and under mpiexec (``tests/test_mpi.py``).
"""

import os
import textwrap

import numpy as np
import pytest
from mpi4py import MPI

import burstmpi
from burstmpi import _plan_cache as plan_cache, _runtime as runtime
from burstmpi._transport import lifetime
from burstmpi import reference as ref
from burstmpi.masks import Sinks

from conftest import COMM, NRANKS, RANK, needs_ranks

pytestmark = pytest.mark.timeout(180)  # a hang fails here instead of stalling the run


@pytest.fixture(autouse=True)
def empty_cache():
    """Every test starts and ends with no cached plan (collective: every rank runs it)."""
    burstmpi.release_cached()
    yield
    burstmpi.release_cached()


def _problem(N=None, seed=0, layout="zigzag", Z=4, Zkv=2, d=16):
    """This rank's q, k, v, dout of a global problem of N tokens."""
    N = 8 * NRANKS + 3 if N is None else N  # not a multiple of the ranks: lengths differ
    return [burstmpi.shard(x, layout=layout) for x in ref.random_problem(1, N, Z, Zkv, d, dtype=np.float32, seed=seed)]


OPTS = dict(causal=True, layout="zigzag")


def test_the_same_bits_as_a_fresh_plan():
    q, k, v, do = _problem()
    plan = burstmpi.BurstAttention(**OPTS)
    want_out, want_lse = plan.forward(q, k, v)
    want = plan.backward(do, q, k, v, want_out, want_lse)
    for _ in range(2):  # the first call makes the plan, the second reuses it
        out, lse = burstmpi.attention(q, k, v, return_lse=True, **OPTS)
        grads = burstmpi.attention_backward(do, q, k, v, out, lse, **OPTS)
        np.testing.assert_array_equal(out, want_out)
        np.testing.assert_array_equal(lse, want_lse)
        for got, exp in zip(grads, want):
            np.testing.assert_array_equal(got, exp)
    plan.release()


def test_a_second_call_makes_no_plan_and_no_node_discovery(monkeypatch):
    found = []
    discover = runtime.nodes

    def counted(*args, **kwargs):
        found.append(1)
        return discover(*args, **kwargs)

    monkeypatch.setattr(runtime, "nodes", counted)
    q, k, v, do = _problem()
    out, lse = burstmpi.attention(q, k, v, return_lse=True, **OPTS)
    s = plan_cache.stats(COMM)
    assert (s.plans, s.misses, s.hits) == (1, 1, 0)
    assert len(found) == 1
    plan, = plan_cache.cached_plans(COMM)
    for i in range(3):
        burstmpi.attention(q, k, v, **OPTS)
        burstmpi.attention_backward(do, q, k, v, out, lse, **OPTS)  # bwd_comm="auto": the same plan
    s = plan_cache.stats(COMM)
    assert (s.plans, s.misses, s.hits) == (1, 1, 6), s
    assert plan_cache.cached_plans(COMM) == [plan]
    assert len(found) == 1, "node discovery ran again after the first call"


def test_each_set_of_arguments_has_its_plan(monkeypatch):
    q, k, v, _ = _problem(layout="striped")
    base = dict(causal=False, layout="striped")
    variants = [dict(), dict(causal=True), dict(window=(3, 2)), dict(softmax_scale=0.5), dict(mask=Sinks(2)),
                dict(timeout=120.0), dict(layout="striped", topology="auto")]
    for extra in variants:
        burstmpi.attention(q, k, v, **{**base, **extra})
    assert plan_cache.stats(COMM).plans == len(variants)
    # The same arguments again, given another way: no new plan.
    burstmpi.attention(q, k, v, **{**base, "window": [3, 2]})
    burstmpi.attention(q, k, v, **{**base, "mask": Sinks(2)})  # an equal mask (its digest), not the same object
    burstmpi.attention(q, k, v, **{**base, "softmax_scale": np.float64(0.5)})
    s = plan_cache.stats(COMM)
    assert (s.plans, s.hits) == (len(variants), 3), s
    # cu_seqlens is per call: the plan of the same arguments.
    N = 8 * NRANKS + 3
    burstmpi.attention(q, k, v, cu_seqlens=[0, 5, N], **base)
    assert plan_cache.stats(COMM).plans == len(variants)
    # A different setting in the environment: a plan made with it.
    monkeypatch.setenv("BURSTMPI_TILE_K", "7")
    out = burstmpi.attention(q, k, v, **base)
    assert plan_cache.stats(COMM).plans == len(variants) + 1
    monkeypatch.delenv("BURSTMPI_TILE_K")
    np.testing.assert_allclose(out, burstmpi.attention(q, k, v, **base), rtol=1e-5, atol=1e-6)


def test_the_least_recently_used_plan_goes_at_the_count_bound(monkeypatch):
    monkeypatch.setattr(plan_cache, "MAX_PLANS", 2)
    q, k, v, _ = _problem()
    call = lambda scale: burstmpi.attention(q, k, v, softmax_scale=scale, **OPTS)  # noqa: E731
    call(0.1)
    a, = plan_cache.cached_plans(COMM)
    call(0.2)
    b = plan_cache.cached_plans(COMM)[-1]
    call(0.1)  # a is the most recent now
    call(0.3)  # so b goes
    plans = plan_cache.cached_plans(COMM)
    s = plan_cache.stats(COMM)
    assert (s.plans, s.evictions) == (2, 1), s
    assert plans[0] is a and b not in plans
    assert b.buffer_bytes == 0 and plan_cache._held(b) == 0  # released
    np.testing.assert_array_equal(call(0.2), burstmpi.BurstAttention(softmax_scale=0.2, **OPTS).forward(q, k, v)[0])


# The host transports: a shared window on this node ("shm", the default here), or MPI with
# each plan's own buffers (fake nodes of one rank each, with links too fast to slow anything).
TRANSPORTS = {"default": {}, "mpi": {"BURSTMPI_RANKS_PER_NODE": "1", "BURSTMPI_INTERNODE_GBPS": "1000"}}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_the_byte_bound_evicts_other_plans_or_frees_their_working_arrays(transport, monkeypatch):
    for name, value in TRANSPORTS[transport].items():
        monkeypatch.setenv(name, value)
    q, k, v, _ = _problem(N=64 * NRANKS, Z=8, Zkv=8, d=64)
    burstmpi.attention(q, k, v, softmax_scale=0.1, **OPTS)
    a, = plan_cache.cached_plans(COMM)
    own = a.buffer_bytes if getattr(a.transport, "arena", None) is None else 0  # not in a shared window
    assert (own > 0) == (NRANKS > 1 and transport == "mpi"), (own, a.transport.name)
    monkeypatch.setattr(plan_cache, "MAX_BYTES", 0)
    burstmpi.attention(q, k, v, softmax_scale=0.2, **OPTS)
    b = plan_cache.cached_plans(COMM)[-1]
    assert b is not a and plan_cache._held(b) > 0  # the plan of the call keeps its memory
    if own:  # evicting a frees its buffers
        assert plan_cache.cached_plans(COMM) == [b] and a.buffer_bytes == 0
    else:  # a's buffers are none, or the window b uses too: a stays, without its working arrays
        assert plan_cache.cached_plans(COMM) == [a, b]
        assert plan_cache._held(a) == 0
    # Within the bound nothing goes.
    monkeypatch.setattr(plan_cache, "MAX_BYTES", 1 << 40)
    before = plan_cache.cached_plans(COMM)
    burstmpi.attention(q, k, v, softmax_scale=0.3, **OPTS)
    assert plan_cache.cached_plans(COMM)[:-1] == before


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_the_ranks_count_the_same_bytes(transport, monkeypatch):
    """Eviction follows ``buffer_bytes``: it must be the same on every rank, lengths that
    differ between ranks included (else the ranks' caches would part)."""
    for name, value in TRANSPORTS[transport].items():
        monkeypatch.setenv(name, value)
    N = 16 * NRANKS + NRANKS - 1
    for layout in ("contiguous", "zigzag", "striped"):
        q, k, v, do = [burstmpi.shard(x, layout=layout) for x in ref.random_problem(1, N, 4, 1, 32, seed=1)]
        for kw in (dict(causal=True), dict(window=(5, 3)), dict(mask=Sinks(3) & burstmpi.masks.Causal())):
            out, lse = burstmpi.attention(q, k, v, layout=layout, return_lse=True, **kw)
            burstmpi.attention_backward(do, q, k, v, out, lse, layout=layout, bwd_comm="ring", **kw)
    mine = [p.buffer_bytes for p in plan_cache.cached_plans(COMM)]
    s = plan_cache.stats(COMM)
    every = COMM.allgather((mine, s.plans, s.hits, s.misses, s.buffer_bytes))
    assert all(e == every[0] for e in every), every


def test_release_cached_empties_the_cache_and_frees_the_buffers():
    q, k, v, _ = _problem()
    burstmpi.attention(q, k, v, **OPTS)
    dup = COMM.Dup()
    try:
        burstmpi.attention(q, k, v, comm=dup, **OPTS)
        world, = plan_cache.cached_plans(COMM)
        mine, = plan_cache.cached_plans(dup)
        assert (world.buffer_bytes > 0) == (NRANKS > 1) and plan_cache._held(world) > 0
        burstmpi.release_cached(dup)  # only dup's
        assert plan_cache.cached_plans(dup) == [] and plan_cache.cached_plans(COMM) == [world]
        assert mine.buffer_bytes == 0 and plan_cache._held(mine) == 0
        burstmpi.release_cached()
        assert plan_cache.stats().plans == 0
        assert world.buffer_bytes == 0 and plan_cache._held(world) == 0
        # The next call makes a plan again, and it is right.
        out = burstmpi.attention(q, k, v, **OPTS)
        assert plan_cache.stats(COMM).plans == 1
        np.testing.assert_array_equal(out, burstmpi.BurstAttention(**OPTS).forward(q, k, v)[0])
        burstmpi.release_cached(dup)  # nothing cached there: nothing to do
    finally:
        burstmpi.release_cached(dup)
        dup.Free()


def test_results_are_the_callers():
    """A cached plan's CPU backend recycles result storage: never storage the caller holds."""
    q, k, v, do = _problem(N=128 * NRANKS, Z=8, Zkv=8, d=64)  # results above the pool's 1 MB floor too
    q2, k2, v2, do2 = _problem(N=128 * NRANKS, Z=8, Zkv=8, d=64, seed=5)
    out, lse = burstmpi.attention(q, k, v, return_lse=True, **OPTS)
    grads = burstmpi.attention_backward(do, q, k, v, out, lse, **OPTS)
    kept = [x.copy() for x in (out, lse, *grads)]
    for _ in range(3):
        out2, lse2 = burstmpi.attention(q2, k2, v2, return_lse=True, **OPTS)
        burstmpi.attention_backward(do2, q2, k2, v2, out2, lse2, **OPTS)
        del out2, lse2
    for x, y in zip((out, lse, *grads), kept):
        np.testing.assert_array_equal(x, y)
    mem = {x.__array_interface__["data"][0] for x in (out, lse, *grads)}
    out3 = burstmpi.attention(q2, k2, v2, **OPTS)
    assert out3.__array_interface__["data"][0] not in mem


def test_bad_arguments_cache_nothing():
    q, k, v, _ = _problem()
    with pytest.raises(TypeError, match="causal"):
        burstmpi.attention(q, k, v, causal="yes", layout="zigzag")
    with pytest.raises(TypeError, match="mask"):
        burstmpi.attention(q, k, v, mask="sinks", layout="zigzag")
    with pytest.raises(ValueError, match="window"):
        burstmpi.attention(q, k, v, window=[1], layout="zigzag")
    # Raised by the call's agreement, on every rank: the plan made for it is not kept.
    with pytest.raises(ValueError):
        burstmpi.attention(q, k[:, :, :1, :3], v, **OPTS)
    assert plan_cache.stats(COMM).plans == 0


@needs_ranks(2)
def test_a_shared_plan_names_each_caller():
    """``attention`` and ``attention_backward`` share a plan; its errors name the caller."""
    q, k, v, do = _problem(layout="contiguous")
    out, lse = burstmpi.attention(q, k, v, return_lse=True)  # no layout: it cannot matter here
    cu = [0, 5, 8 * NRANKS + 3]  # documents: now it does
    with pytest.raises(ValueError, match=r"^rank 0: attention: layout: expected"):
        burstmpi.attention(q, k, v, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"^rank 0: attention_backward: layout: expected"):
        burstmpi.attention_backward(do, q, k, v, out, lse, cu_seqlens=cu)
    s = plan_cache.stats(COMM)
    assert (s.plans, s.misses) == (1, 1), s


def test_a_freed_communicator_takes_its_plans_along():
    q, k, v, _ = _problem()
    dup = COMM.Dup()
    burstmpi.attention(q, k, v, comm=dup, **OPTS)
    assert len(plan_cache.cached_plans(dup)) == 1
    dup.Free()  # MPI's delete callback drops the plans (no MPI call)
    assert dup == MPI.COMM_NULL and plan_cache.cached_plans(dup) == []
    assert plan_cache.stats().plans == 0
    with pytest.raises(Exception):  # as without the cache: a freed communicator
        burstmpi.attention(q, k, v, comm=dup, **OPTS)
    again = COMM.Dup()  # MPI may hand out the freed handle again: no stale plan comes with it
    try:
        out = burstmpi.attention(q, k, v, comm=again, **OPTS)
        s = plan_cache.stats(again)
        assert (s.plans, s.misses, s.hits) == (1, 1, 0)
        np.testing.assert_array_equal(out, burstmpi.BurstAttention(**OPTS).forward(q, k, v)[0])
    finally:
        burstmpi.release_cached(again)
        again.Free()


def test_the_exit_hook_makes_no_collective_call():
    """Rank 0 alone runs the exit hook's teardown (``lifetime._local_teardown``): were it
    collective, rank 0 would wait there."""
    q, k, v, _ = _problem()
    burstmpi.attention(q, k, v, **OPTS)
    if RANK == 0:
        lifetime._local_teardown("a test's exit")
        assert plan_cache.stats().plans == 0
    COMM.Barrier()
    if RANK != 0:
        lifetime._local_teardown("a test's exit")  # every rank's cache alike again
    out = burstmpi.attention(q, k, v, **OPTS)  # a new cache and plan, on every rank
    assert plan_cache.stats(COMM).plans == 1
    np.testing.assert_array_equal(out, burstmpi.BurstAttention(**OPTS).forward(q, k, v)[0])


EXIT_SCRIPT = textwrap.dedent("""
    import sys
    import time
    import numpy as np
    from mpi4py import MPI
    import burstmpi
    comm = MPI.COMM_WORLD
    sub = comm.Split(comm.Get_rank() % 2)
    q = burstmpi.shard(np.random.default_rng(0).standard_normal((1, 40, 2, 16), dtype=np.float32))
    for c in (comm, sub, comm):
        burstmpi.attention(q, q, q, comm=c, causal=True, layout="contiguous", timeout=20)
    if comm.Get_rank() == 0:
        time.sleep(2)  # the other ranks reach their exit first
    open(f"{sys.argv[1]}/done{comm.Get_rank()}", "w").close()
""")


@pytest.mark.skipif(NRANKS > 1 or os.environ.get("BURSTMPI_UNDER_MPIEXEC") == "1", reason="runs mpiexec itself")
def test_a_job_ends_with_plans_cached(tmp_path):
    """Ranks that reach their exit at different times, with plans cached on two
    communicators: the job ends, cleanly, without a hang."""
    from test_mpi import MPIEXEC, mpiexec

    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    rc, out, _ = mpiexec(3, [str(script), str(tmp_path)], timeout=120)
    assert rc == 0, out[-3000:]
    assert sorted(p.name for p in tmp_path.glob("done*")) == ["done0", "done1", "done2"], out[-3000:]


def test_the_bench_of_the_overhead_runs():
    from burstmpi.bench.overhead import measure

    times = measure(COMM, N=16 * NRANKS, H=2, D=16, calls=2, rounds=2, warmup=1)
    assert len(times["api"]) == len(times["plan"]) == 2
    assert all(t > 0 for t in times["api"] + times["plan"])
