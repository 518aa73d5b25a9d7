"""The CPU backend's compiled elementwise kernels (numba) against their NumPy versions, the
NumPy fallback, threads, and both paths end to end against float64.

Runs on however many ranks COMM_WORLD has (tests/test_mpi.py runs it at 2, 3, 4, 5 and 8).
"""

import sys

import numpy as np
import pytest

import burstmpi
from burstmpi import reference as ref
from burstmpi.backends import tile_ops
from burstmpi.backends.numpy_backend import NumpyBackend, _bands
from burstmpi.backends.threads import Workers, threads_per_rank
from burstmpi.config import settings
from burstmpi.interop import bfloat16

from conftest import DTYPES, NRANKS, check_against_float64, check_fully_masked_rows

ck = pytest.importorskip("burstmpi.backends.cpu_kernels", reason="numba is not installed")

RNG = np.random.default_rng(7)


def test_exp_is_float32_exact_where_softmax_sees_it():
    """``probs`` with lse = 0 is exp(x): relative error within 4e-7 (a few float32 ulp) on [-87, 0]
    (and just above 0, where rounding can put a score over the row max), exactly 0 below
    -87 and for -inf."""
    x = np.concatenate([np.linspace(-87, 0, 1_000_003), np.linspace(0, 1e-3, 1001)]).astype(np.float32)
    p = x.reshape(1, -1).copy()
    ck.probs(p, np.zeros(1, np.int64), np.full(1, x.size, np.int64), 1, np.zeros(1, np.float32))
    exact = np.exp(x.astype(np.float64))
    rel = np.abs(p[0] - exact) / exact
    assert rel.max() < 4e-7, rel.max()
    tiny = np.array([[-87.5, -100.0, -1e30, -np.inf]], np.float32)
    ck.probs(tiny, np.zeros(1, np.int64), np.full(1, 4, np.int64), 1, np.zeros(1, np.float32))
    assert (tiny == 0).all()


def _intervals(ntok, tk):
    """Random visible runs per token, with empty runs (a token that sees nothing of the
    tile) and whole ones."""
    lo = RNG.integers(0, tk, ntok)
    hi = np.minimum(tk, lo + RNG.integers(0, tk, ntok))
    lo[0], hi[0] = 0, tk
    lo[1], hi[1] = 5, 5
    return lo.astype(np.int64), hi.astype(np.int64)


@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("whole", [False, True])
def test_softmax_update_matches_numpy(g, whole):
    ntok, tk = 13, 37
    n = ntok * g
    lo, hi = (np.zeros(ntok, np.int64), np.full(ntok, tk, np.int64)) if whole else _intervals(ntok, tk)
    s0 = (RNG.standard_normal((n, tk)) * 4).astype(np.float32)
    m0 = np.where(RNG.random(n) < 0.3, -np.inf, RNG.standard_normal(n)).astype(np.float32)
    l0 = np.where(m0 == -np.inf, 0, RNG.random(n) + 0.5).astype(np.float32)
    results = []
    for ops, iv in ((ck, (lo, hi)), (tile_ops, (None, None) if whole else (lo, hi))):
        s, m, l, alpha = s0.copy(), m0.copy(), l0.copy(), np.empty(n, np.float32)
        ops.softmax_update(s, *iv, g, m, l, alpha)
        results.append((s, m, l, alpha))
    (s, m, l, a), (s_np, m_np, l_np, a_np) = results
    assert np.array_equal(m, m_np)  # the max is exact
    np.testing.assert_allclose(s, s_np, rtol=3e-7, atol=0)
    np.testing.assert_allclose(l, l_np, rtol=1e-6, atol=0)
    np.testing.assert_allclose(a, a_np, rtol=3e-7, atol=0)
    hidden = np.ones((n, tk), bool)
    for r in range(n):
        hidden[r, lo[r // g]:hi[r // g]] = False
    assert (s[hidden] == 0).all()
    # A row that has seen no key yet and sees none here keeps m = -inf and l = 0.
    never = (m0 == -np.inf) & hidden.all(axis=1)
    assert (m[never] == -np.inf).all() and (l[never] == 0).all() and not np.isnan(a).any()


def test_backward_kernels_match_numpy():
    ntok, g, tk = 11, 2, 29
    n = ntok * g
    lo, hi = _intervals(ntok, tk)
    p0 = RNG.standard_normal((n, tk)).astype(np.float32)
    lse = (RNG.standard_normal(n) + 3).astype(np.float32)
    lse[0] = np.inf  # a row that sees no key: P = 0
    p, p_np = p0.copy(), p0.copy()
    ck.probs(p, lo, hi, g, lse)
    tile_ops.probs(p_np, lo, hi, g, lse)
    np.testing.assert_allclose(p, p_np, rtol=3e-7, atol=1e-38)
    assert (p[0] == 0).all() and (p[2:4, 5:] == 0).all() and (p_np[2:4, 5:] == 0).all()
    D = RNG.standard_normal(n).astype(np.float32)
    ds0 = RNG.standard_normal((n, tk)).astype(np.float32)
    ds, ds_np = ds0.copy(), ds0.copy()
    ck.dsoftmax(ds, p, D)
    tile_ops.dsoftmax(ds_np, p, D)
    np.testing.assert_allclose(ds, ds_np, rtol=1e-6, atol=1e-30)
    acc0, alpha, pv = (RNG.standard_normal(s).astype(np.float32) for s in ((n, 16), n, (n, 16)))
    acc, acc_np = acc0.copy(), acc0.copy()
    ck.rescale_add(acc, alpha, pv)
    tile_ops.rescale_add(acc_np, alpha, pv)
    np.testing.assert_allclose(acc, acc_np, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [np.float16, bfloat16])
def test_widen_every_bit_pattern(dtype):
    """float16/bfloat16 -> float32 by integer operations: every one of the 65536 values
    (subnormals, infinities, NaNs, -0) converts as NumPy converts it."""
    x = np.arange(1 << 16, dtype=np.uint16).view(dtype).reshape(256, 256)
    ours, numpy = ck.widen(x[:, ::-1]), x[:, ::-1].astype(np.float32)  # a strided view too
    assert ours.flags.c_contiguous and ours.dtype == np.float32
    same = (ours.view(np.int32) == numpy.view(np.int32)) | (np.isnan(ours) & np.isnan(numpy))
    assert same.all()


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (5, 3))])
def test_both_paths_against_float64(kernels, threads, dtype, causal, window, monkeypatch):
    """The compiled and the NumPy path, on one thread and on three, within flash-attn's
    rule against float64 (GQA, odd lengths, tiles smaller than the block so that a block
    has whole, partial and skipped tiles)."""
    monkeypatch.setenv("BURSTMPI_CPU_KERNELS", kernels)
    monkeypatch.setenv("BURSTMPI_THREADS", str(threads))
    monkeypatch.setenv("BURSTMPI_TILE_Q", "12")
    monkeypatch.setenv("BURSTMPI_TILE_K", "7")
    plan, _ = check_against_float64(C=29, Z=6, Zkv=2, d=16, dtype=dtype, causal=causal, window=window,
                                    layout="zigzag", bwd_comm="auto")
    assert plan.backend.ops.name == kernels
    assert plan.backend.threads == threads


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_fully_masked_rows_both_paths(kernels, dtype):
    check_fully_masked_rows(NumpyBackend(tile_q=4, tile_k=3, kernels=kernels, threads=2), dtype, 8)


@pytest.mark.parametrize("kernels", ["numba", "numpy"])
def test_deterministic_and_inputs_unchanged(kernels, monkeypatch):
    """Bitwise the same results twice over, on 3 threads; the forward also the same on 1
    thread (an item's tiles run in a fixed order whichever thread runs it); inputs intact."""
    monkeypatch.setenv("BURSTMPI_CPU_KERNELS", kernels)
    monkeypatch.setenv("BURSTMPI_TILE_Q", "8")
    monkeypatch.setenv("BURSTMPI_TILE_K", "16")
    q, k, v, do = ref.random_problem(1, 64 * NRANKS, 4, 2, 16, dtype=bfloat16, seed=3)
    sh = lambda x: burstmpi.shard(x, layout="zigzag")
    ql, kl, vl, dol = sh(q), sh(k), sh(v), sh(do)
    before = [x.copy() for x in (ql, kl, vl, dol)]
    runs = []
    for threads in (3, 3, 1):
        monkeypatch.setenv("BURSTMPI_THREADS", str(threads))
        plan = burstmpi.BurstAttention(causal=True, layout="zigzag")
        out, lse = plan.forward(ql, kl, vl)
        runs.append((out, lse) + tuple(plan.backward(dol, ql, kl, vl, out, lse)))
    bits = lambda xs: [np.asarray(x).view(np.uint8) for x in xs]
    for a, b in zip(bits(runs[0]), bits(runs[1])):
        assert np.array_equal(a, b)
    for a, b in zip(bits(runs[0][:2]), bits(runs[2][:2])):
        assert np.array_equal(a, b)
    for x, y in zip(before, (ql, kl, vl, dol)):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_fallback_without_numba(monkeypatch):
    """Without numba "auto" runs on NumPy and "numba" is a clear error (on every rank:
    the runtime agrees on it before going on)."""
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    monkeypatch.delitem(sys.modules, "burstmpi.backends.cpu_kernels")
    monkeypatch.delattr(sys.modules["burstmpi.backends"], "cpu_kernels", raising=False)
    assert NumpyBackend(kernels="auto").ops is tile_ops
    with pytest.raises(RuntimeError, match="BURSTMPI_CPU_KERNELS=numba: the compiled CPU kernels need numba"):
        NumpyBackend(kernels="numba")
    monkeypatch.setenv("BURSTMPI_CPU_KERNELS", "numba")
    q = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(RuntimeError, match="pip install numba, or set BURSTMPI_CPU_KERNELS=numpy"):
        burstmpi.BurstAttention().forward(q, q, q)


def test_settings_name_the_variable(monkeypatch):
    monkeypatch.setenv("BURSTMPI_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match=r"BURSTMPI_CPU_KERNELS: expected one of \['auto', 'numba', 'numpy'\], "
                                         r"got 'fast'"):
        settings()
    monkeypatch.setenv("BURSTMPI_CPU_KERNELS", "numpy")
    monkeypatch.setenv("BURSTMPI_THREADS", "-2")
    with pytest.raises(ValueError, match="BURSTMPI_THREADS: expected an integer >= 0, got -2"):
        settings()


def test_threads_per_rank():
    """A setting wins; else the cores this process may use over the ranks on its node."""
    import os

    from mpi4py import MPI

    world = MPI.COMM_WORLD
    assert threads_per_rank(world, 5) == 5
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    here = node.Get_size()
    node.Free()
    assert threads_per_rank(world) == max(1, len(os.sched_getaffinity(0)) // here)


def test_workers_run_every_item_once_poll_and_raise():
    w = Workers(3)
    seen, polls = [], []
    w.run(range(50), lambda item, scratch: seen.append(item), dict, poll=lambda: polls.append(1))
    assert sorted(seen) == list(range(50)) and polls

    def boom(item, scratch):
        if item == 7:
            raise ValueError("item 7 failed")

    with pytest.raises(ValueError, match="item 7 failed"):
        w.run(range(20), boom, dict)
    assert Workers(3)._pool is w._pool  # one pool per size and process
    seen.clear()
    one = Workers(1)
    one.run(range(5), lambda item, scratch: seen.append(item), dict)  # inline, in order
    assert seen == list(range(5)) and one._pool is None


def test_bands_cut_work_evenly_and_in_order():
    plan = [(i, i + 1, [None] * (i + 1)) for i in range(10)]  # causal: row i has i + 1 tiles
    bands = _bands(plan, 4)
    assert [r for band in bands for r in band] == plan and 2 <= len(bands) <= 4
    work = [sum(len(row) for _, _, row in band) for band in bands]
    assert max(work) <= 2 * sum(work) / len(bands)
    assert _bands(plan, 1) == [plan]
