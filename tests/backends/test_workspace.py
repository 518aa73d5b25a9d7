"""The CPU backend's memory kept from call to call (``burstmpi._backends.cpu.workspace``): working
arrays reused without changing results, and results that stay the caller's own.

Runs on however many ranks COMM_WORLD has (tests/test_mpi.py runs 2, 3 and 4)."""

import gc

import numpy as np
import pytest

import burstmpi
from burstmpi import reference as ref
from burstmpi._backends.cpu import CpuBackend
from burstmpi._backends.cpu.workspace import ALIGN, OutputPool, Workspace
from burstmpi._interop import bfloat16

from conftest import NRANKS


def test_workspace_slots_are_reused_grown_and_cleared():
    ws = Workspace()
    a = ws.array("acc", (3, 5), np.float32, 0)
    assert a.flags.c_contiguous and a.ctypes.data % ALIGN == 0 and (a == 0).all()
    a[:] = 7
    b = ws.array("acc", (5, 3), np.float32)  # the same slot: the same memory
    assert b.ctypes.data == a.ctypes.data and (b == 7).all()
    c = ws.array("acc", (4, 4), np.float64, -np.inf)  # more bytes: new storage, filled
    assert c.nbytes == 128 and (c == -np.inf).all() and ws.nbytes >= 128
    assert ws.array("other", (2,), np.float32).ctypes.data != c.ctypes.data
    ws.clear()
    assert ws.nbytes == 0


def test_output_pool_recycles_only_what_no_array_uses():
    pool = OutputPool(keep=2, smallest=64)
    a = pool.empty((8, 16), np.float32)
    assert a.flags.writeable and a.flags.c_contiguous and a.ctypes.data % ALIGN == 0
    addr, view = a.ctypes.data, a[2:4]
    del a
    gc.collect()
    assert pool.nbytes == 0  # ``view`` still uses the storage
    fresh = pool.empty((8, 16), np.float32)
    assert fresh.ctypes.data != addr
    del view
    gc.collect()
    assert pool.nbytes == 512
    other = pool.empty((4, 4), np.float64)  # only a result of its size takes it
    again = pool.empty((16, 8), np.float32)  # the same size: the freed storage
    assert other.ctypes.data != addr and again.ctypes.data == addr and pool.nbytes == 0
    del fresh, again, other
    small = pool.empty((4,), np.float32)  # under ``smallest``: NumPy's own
    assert small.base is None
    pool.clear()
    assert pool.nbytes == 0


def test_output_pool_holds_at_most_keep_blocks_of_any_sizes():
    pool = OutputPool(keep=3, smallest=64)
    sizes = [64 * (i + 1) for i in range(20)]
    for n in sizes:  # results of ever new sizes (a sweep, varying batches), each dropped
        pool.empty((n,), np.uint8)
    gc.collect()
    assert pool.nbytes == sum(sizes[-3:])  # the latest three
    kept = [pool.empty((n,), np.uint8) for n in sizes[-3:]]
    assert pool.nbytes == 0
    many = [pool.empty((100,), np.uint8) for _ in range(10)]
    del many  # all dropped before the next call: still bounded
    gc.collect()
    assert pool.nbytes == 300
    del kept
    gc.collect()
    assert pool.nbytes == sum(sizes[-3:])


def _problem(seed, Zkv):
    return [burstmpi.shard(x) for x in ref.random_problem(1, 48 * NRANKS, 4, Zkv, 32, seed=seed)]


@pytest.mark.parametrize("Zkv", [1, 4])  # one KV head: the working layout is the caller's
@pytest.mark.parametrize("causal", [False, True])
def test_results_stay_the_callers_and_reuse_changes_nothing(Zkv, causal):
    plan = burstmpi.BurstAttention(causal=causal, layout="contiguous")
    a, b = _problem(1, Zkv), _problem(2, Zkv)
    plan.forward(*a[:3])
    plan.backend.outputs.smallest = 0  # every result from the pool, however small

    def run(p, x):
        out, lse = p.forward(*x[:3])
        return (out, lse) + tuple(p.backward(x[3], *x[:3], out, lse))

    first = run(plan, a)
    kept = [x.copy() for x in first]
    second = run(plan, b)
    for x, y in zip(first, kept):
        assert np.array_equal(x, y), "a later call changed an earlier call's result"
    # The second call reused working arrays that held the first's values: the same bits
    # as a plan of its own.
    for x, y in zip(second, run(burstmpi.BurstAttention(causal=causal, layout="contiguous"), b)):
        assert np.array_equal(x, y), "reused working arrays changed a result"
    addrs = {x.ctypes.data for x in first if x.nbytes}
    del first, x
    gc.collect()
    assert plan.backend.outputs.nbytes > 0
    third = run(plan, a)
    assert {x.ctypes.data for x in third if x.nbytes} & addrs, "dropped results' storage was not reused"
    for x, y in zip(third, kept):
        assert np.array_equal(x, y)
    assert plan.backend.held_bytes > 0
    plan.release()
    assert plan.backend.held_bytes == 0
    for x, y in zip(third, kept):  # still the caller's after release()
        assert np.array_equal(x, y)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_reuse_across_shapes_dtypes_and_threads(dtype, monkeypatch):
    """Four threads, one KV head (the backward's dK/dV then split into band partials), a
    long call, a shorter one and the long one again on one plan: every result the bits of a
    fresh plan's, whatever the workspace held from before."""
    monkeypatch.setenv("BURSTMPI_THREADS", "4")

    def problem(n, seed):
        return [burstmpi.shard(x) for x in ref.random_problem(1, n, 4, 1, 32, dtype=dtype, seed=seed)]

    def run(p, x):
        out, lse = p.forward(*x[:3])
        return (out, lse) + tuple(p.backward(x[3], *x[:3], out, lse))

    plan = burstmpi.BurstAttention(causal=True, layout="contiguous")
    runs = [(x, run(plan, x)) for x in (problem(1536, 1), problem(600, 2), problem(1536, 3))]
    assert plan.backend.threads == 4
    for x, got in runs:
        for a, b in zip(got, run(burstmpi.BurstAttention(causal=True, layout="contiguous"), x)):
            assert a.shape == b.shape and np.array_equal(a, b, equal_nan=False), "a reused plan's result differs"


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, bfloat16, np.float64])
@pytest.mark.parametrize("C", [1237, 0])
def test_store_and_zeros_match_numpy_in_one_pass(threads, dtype, C):
    """``store`` writes an accumulator into a strided view of the caller's layout, a range
    of tokens per worker item (a ragged last range here): the bits of scaling, dividing or
    copying in the accumulation dtype and rounding once, as NumPy does; ``fwd_finalize``
    writes its normalised rows that way and refuses an ``out`` it would not fill exactly.
    ``_zeros`` clears a reused slot. A rank may hold no token (C = 0)."""
    be = CpuBackend(threads=threads)
    B, Zkv, g, d = 2, 3, 2, 40
    acc = np.float64 if dtype == np.float64 else np.float32
    rng = np.random.default_rng(0)
    src = rng.standard_normal((B, Zkv, C, g, d)).astype(acc)
    div = rng.random((B, Zkv, C, g)).astype(acc) + 0.5
    for how, want in (({"scale": 0.37}, src * acc(0.37)), ({"divisor": div}, src / div[..., None]), ({}, src)):
        out = np.full((B, C, Zkv, g, d), np.nan, dtype)
        be.store(out.transpose(0, 2, 1, 3, 4), src, **how)
        expect = want.astype(dtype).transpose(0, 2, 1, 3, 4)
        assert np.array_equal(out.view(np.uint8), np.ascontiguousarray(expect).view(np.uint8)), how
    state = (src.copy(), np.zeros((B, Zkv, C, g), acc), div.copy())
    out = np.full((B, C, Zkv, g, d), np.nan, dtype)
    got, lse = be.fwd_finalize(state, dtype, out=out.transpose(0, 2, 1, 3, 4))
    assert (C == 0 or np.shares_memory(got, out)) and np.array_equal(state[0], src), \
        "fwd_finalize(out=) must write out and leave the accumulator alone"
    expect = (src / div[..., None]).astype(dtype).transpose(0, 2, 1, 3, 4)
    assert np.array_equal(out.view(np.uint8), np.ascontiguousarray(expect).view(np.uint8))
    assert np.array_equal(lse, np.log(div))
    with pytest.raises(ValueError, match=r"fwd_finalize: out: expected shape .* got shape"):
        be.fwd_finalize(state, dtype, out=out)  # the caller's layout itself, not the view
    be.workspace.array("k_acc", (B, Zkv, C, d), acc).fill(np.nan)
    zeros = be.bwd_state(B, Zkv, C, g, d, d, acc)
    assert all((x == 0).all() for x in zeros.values())
