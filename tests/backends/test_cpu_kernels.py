"""The CPU backend's compiled elementwise kernels (numba) against their NumPy versions, the
NumPy fallback, threads, and both paths end to end against float64.

Runs on however many ranks COMM_WORLD has (tests/test_mpi.py runs it at 2, 3 and 4).
"""

import sys

import numpy as np
import pytest

import burstmpi
from burstmpi import reference as ref
from burstmpi._backends.cpu import CpuBackend, numpy_tiles
from burstmpi._backends.cpu.tile_plan import bands as _bands
from burstmpi._backends.cpu.threads import Workers, threads_per_rank
from burstmpi._config import settings
from burstmpi._interop import bfloat16

from conftest import DTYPES, NRANKS, check_against_float64, check_fully_masked_rows

ck = pytest.importorskip("burstmpi._backends.cpu.kernels", reason="numba is not installed")

RNG = np.random.default_rng(7)


def test_exp_is_float32_exact_where_softmax_sees_it():
    """``probs`` with lse = 0 is exp(x): relative error within 4e-7 (a few float32 ulp) on [-87, 0]
    (and just above 0, where rounding can put a score over the row max); below -87 at most
    e^-87 (nothing beside a row sum of at least 1); exactly 0 for a row that sees no key
    (lse = +inf) and outside the visible run. ``fexp`` itself is exactly 0 below -87."""
    x = np.concatenate([np.linspace(-87, 0, 1_000_003), np.linspace(0, 1e-3, 1001)]).astype(np.float32)
    p = x.reshape(1, -1).copy()
    ck.probs(p, np.zeros(1, np.int64), np.full(1, x.size, np.int64), 1, np.zeros(1, np.float32))
    exact = np.exp(x.astype(np.float64))
    rel = np.abs(p[0] - exact) / exact
    assert rel.max() < 4e-7, rel.max()
    tiny = np.array([[-87.5, -100.0, -1e30, 3.0], [1.0, 2.0, 3.0, 4.0]], np.float32)
    ck.probs(tiny, np.zeros(2, np.int64), np.array([3, 4], np.int64), 1, np.array([0, np.inf], np.float32))
    assert (0 <= tiny[0, :3]).all() and (tiny[0, :3] <= 1.7e-38).all(), tiny
    assert tiny[0, 3] == 0 and (tiny[1] == 0).all(), tiny
    assert [ck.fexp(np.float32(v)) for v in (-87.5, -100.0, -1e30, -np.inf)] == [0, 0, 0, 0]


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
    for ops, iv in ((ck, (lo, hi)), (numpy_tiles, (None, None) if whole else (lo, hi))):
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
    numpy_tiles.probs(p_np, lo, hi, g, lse)
    np.testing.assert_allclose(p, p_np, rtol=3e-7, atol=1e-38)
    assert (p[0] == 0).all() and (p[2:4, 5:] == 0).all() and (p_np[2:4, 5:] == 0).all()
    D = RNG.standard_normal(n).astype(np.float32)
    ds0 = RNG.standard_normal((n, tk)).astype(np.float32)
    ds, ds_np = ds0.copy(), ds0.copy()
    ck.dsoftmax(ds, p, D)
    numpy_tiles.dsoftmax(ds_np, p, D)
    np.testing.assert_allclose(ds, ds_np, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("g", [1, 3])
def test_row_loops_match_numpy(g):
    """``cpu.tiles.fwd_row`` / ``bwd_row`` (BLAS called from compiled code, alpha and beta
    doing the scale and the accumulation) against ``cpu.numpy_tiles``': whole and partial key tiles
    of unequal widths, GQA rows, a running state carried in, each side's gradients skipped."""
    ct = pytest.importorskip("burstmpi._backends.cpu.tiles", reason="no sgemm to call from compiled code")
    ntok, d, dv, Ck = 11, 24, 20, 70
    n = ntok * g
    q, do = (RNG.standard_normal((n, x)).astype(np.float32) for x in (d, dv))
    k, v = (RNG.standard_normal((Ck, x)).astype(np.float32) for x in (d, dv))
    c0, c1 = np.array([0, 32, 50], np.int64), np.array([32, 50, 70], np.int64)
    iv = np.array([-1, 0, 1], np.int64)
    runs = [_intervals(ntok, 18), _intervals(ntok, 20)]
    lo, hi = np.stack([a for a, _ in runs]), np.stack([b for _, b in runs])
    tiles, scale = (c0, c1, iv, lo, hi), 0.3
    m0 = np.where(RNG.random(n) < 0.3, -np.inf, RNG.standard_normal(n)).astype(np.float32)
    state0 = (RNG.standard_normal((n, dv)).astype(np.float32) * (m0 > -np.inf)[:, None], m0,
              np.where(m0 == -np.inf, 0, RNG.random(n) + 0.5).astype(np.float32))
    got = {}
    for ops in (ct, numpy_tiles):
        acc, m, l = (x.copy() for x in state0)
        ops.fwd_row(q, k, v, *tiles, g, scale, acc, m, l, np.zeros(n * d, np.float32), np.zeros(n * 32, np.float32),
                    np.zeros(n, np.float32))
        got[ops] = acc, m, l
    for a, b in zip(got[ct], got[numpy_tiles]):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    D = RNG.standard_normal(n).astype(np.float32)
    lse = (got[ct][1] + np.log(np.maximum(got[ct][2], 1e-30))).astype(np.float32)
    lse[2] = np.inf  # a row that sees no key
    for sides in ((True, True), (True, False), (False, True)):
        grads = {}
        for ops in (ct, numpy_tiles):
            dq = np.ones((n, d), np.float32) if sides[0] else None
            dk, dvv = (np.ones((Ck, x), np.float32) for x in (d, dv)) if sides[1] else (None, None)
            ops.bwd_row(q, do, D, lse, k, v, *tiles, g, scale, dq, dk, dvv, np.zeros(n * d, np.float32),
                        np.zeros(n * 32, np.float32), np.zeros(n * 32, np.float32))
            grads[ops] = dq, dk, dvv
        for a, b in zip(grads[ct], grads[numpy_tiles]):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
        if sides[0]:
            assert (grads[ct][0][2] == 1).all()  # row 2: lse +inf, no gradient
    acc_cols = np.zeros((n, 2 * dv), np.float32)[:, ::2]  # an accumulator must have contiguous rows
    with pytest.raises(ValueError, match="acc must be an aligned float32 array with contiguous rows"):
        ct.fwd_row(q, k, v, *tiles, g, scale, acc_cols, *(x.copy() for x in state0[1:]),
                   np.zeros(n * d, np.float32), np.zeros(n * 32, np.float32), np.zeros(n, np.float32))


def _row_strided(x, rng):
    """``x``'s values in a wider, read-only array: rows several elements apart, as a
    (batch, KV head) slab of a (B, C, heads, d) array lies."""
    wide = rng.standard_normal((x.shape[0], x.shape[1] + 5)).astype(x.dtype)
    wide[:, 3:3 + x.shape[1]] = x
    view = wide[:, 3:3 + x.shape[1]]
    view.flags.writeable = False
    return view


@pytest.mark.parametrize("g", [1, 2])
def test_row_loops_take_any_row_stride(g):
    """The compiled loops read operands where they lie: q, k, v, dO (read-only, rows apart)
    and dq, dk, dv accumulators that are slices of wider arrays give bitwise the results of
    contiguous copies; a column-strided input is copied, not misread."""
    ct = pytest.importorskip("burstmpi._backends.cpu.tiles", reason="no sgemm to call from compiled code")
    rng = np.random.default_rng(3)
    ntok, d, dv, Ck = 40, 16, 24, 96
    n = ntok * g
    q, do = (rng.standard_normal((n, x)).astype(np.float32) for x in (d, dv))
    k, v = (rng.standard_normal((Ck, x)).astype(np.float32) for x in (d, dv))
    t = np.arange(ntok)
    tiles = (np.array([0, 48], np.int64), np.array([48, 96], np.int64), np.array([-1, 0], np.int64),
             np.zeros((1, ntok), np.int64), np.minimum(t + 10, 48)[None].astype(np.int64))

    def run(q, k, v, do, wide):
        acc = (np.zeros((n, dv + 8), np.float32)[:, 4:4 + dv]) if wide else np.zeros((n, dv), np.float32)
        m, l = np.full(n, -np.inf, np.float32), np.zeros(n, np.float32)
        ct.fwd_row(q, k, v, *tiles, g, 0.3, acc, m, l, np.zeros(n * d, np.float32), np.zeros(n * 48, np.float32),
                   np.zeros(n, np.float32))
        lse = (m + np.log(l)).astype(np.float32)
        D = (np.asarray(do) * acc).sum(axis=1, dtype=np.float32)
        grads = [np.zeros((r, c + 8), np.float32)[:, 2:2 + c] if wide else np.zeros((r, c), np.float32)
                 for r, c in ((n, d), (Ck, d), (Ck, dv))]
        ct.bwd_row(q, do, D, lse, k, v, *tiles, g, 0.3, *grads, np.zeros(n * d, np.float32),
                   np.zeros(n * 48, np.float32), np.zeros(n * 48, np.float32))
        return [np.array(x) for x in (acc, m, l, *grads)]

    want = run(q, k, v, do, False)
    got = run(*(_row_strided(x, rng) for x in (q, k, v, do)), True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    cols = np.repeat(k, 2, axis=1)[:, ::2]  # k's values, columns 8 bytes apart
    got = run(q, cols, v, do, False)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("g", [1, 3])
def test_row_loops_band_partial_tiles(g):
    """Partly visible tiles of more than one band (128 GEMM rows) run band by band over
    the columns each band sees: a causal diagonal, a window's band, and tokens that see
    nothing of the tile (a whole band skipped); against ``numpy_tiles``, forward and backward."""
    ct = pytest.importorskip("burstmpi._backends.cpu.tiles", reason="no sgemm to call from compiled code")
    ntok, w, d = 300, 300, 16
    n = ntok * g
    t = np.arange(ntok)
    runs = [(np.zeros(ntok), t + 1), (np.maximum(0, t - 40), t + 1),
            (np.where(t < 140, 0, t - 100), np.where(t < 140, 0, t - 60))]
    lo = np.stack([a for a, _ in runs]).astype(np.int64)
    hi = np.stack([b for _, b in runs]).astype(np.int64)
    assert len(ct._bands(lo[0], hi[0], g, w)) > 1 and len(ct._bands(lo[2], hi[2], g, w)) < -(-n // 128)
    q, do = (RNG.standard_normal((n, d)).astype(np.float32) for _ in range(2))
    k, v = (RNG.standard_normal((3 * w, d)).astype(np.float32) for _ in range(2))
    c0 = np.array([0, w, 2 * w], np.int64)
    tiles = (c0, c0 + w, np.arange(3, dtype=np.int64), lo, hi)
    got = {}
    for ops in (ct, numpy_tiles):
        acc, m, l = np.zeros((n, d), np.float32), np.full(n, -np.inf, np.float32), np.zeros(n, np.float32)
        ops.fwd_row(q, k, v, *tiles, g, 0.25, acc, m, l, np.zeros(n * d, np.float32), np.zeros(n * w, np.float32),
                    np.zeros(n, np.float32))
        lse = np.where(l > 0, m + np.log(np.where(l > 0, l, 1)), np.inf).astype(np.float32)
        grads = [np.zeros((n, d), np.float32), np.zeros((3 * w, d), np.float32), np.zeros((3 * w, d), np.float32)]
        ops.bwd_row(q, do, (do * acc).sum(axis=1), lse, k, v, *tiles, g, 0.25, *grads, np.zeros(n * d, np.float32),
                    np.zeros(n * w, np.float32), np.zeros(n * w, np.float32))
        got[ops] = (acc, m, l, *grads)
    for a, b in zip(got[ct], got[numpy_tiles]):
        np.testing.assert_allclose(a, b, rtol=3e-5, atol=3e-5)


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
    check_fully_masked_rows(CpuBackend(tile_q=4, tile_k=3, kernels=kernels, threads=2), dtype, 8)


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


def _forget(monkeypatch, *modules):
    """Make ``burstmpi._backends.cpu``'s ``modules`` import afresh (for this test only)."""
    for mod in modules:
        monkeypatch.delitem(sys.modules, f"burstmpi._backends.cpu.{mod}", raising=False)
        monkeypatch.delattr(sys.modules["burstmpi._backends.cpu"], mod, raising=False)


def test_fallback_without_numba(monkeypatch):
    """Without numba "auto" runs on NumPy and "numba" is a clear error (on every rank:
    the runtime agrees on it before going on)."""
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    _forget(monkeypatch, "kernels", "tiles", "packed", "micro")
    assert CpuBackend(kernels="auto").ops is numpy_tiles
    with pytest.raises(RuntimeError, match="BURSTMPI_CPU_KERNELS=numba: the compiled CPU tile loops are unavailable"):
        CpuBackend(kernels="numba")
    monkeypatch.setenv("BURSTMPI_CPU_KERNELS", "numba")
    q = np.zeros((1, 4, 2, 8), np.float32)
    with pytest.raises(RuntimeError, match="pip install numba, or set BURSTMPI_CPU_KERNELS=numpy"):
        burstmpi.BurstAttention().forward(q, q, q)


def test_fallback_without_sgemm(monkeypatch):
    """No BLAS sgemm to call from compiled code (a BLAS without cblas, say): "auto" runs the
    NumPy loops, "numba" says why it cannot."""
    from burstmpi._backends.cpu import blas as cpu_blas

    monkeypatch.setattr(cpu_blas, "sgemm", None)
    monkeypatch.setattr(cpu_blas, "_why", "no cblas_sgemm found in the loaded BLAS libraries (test)")
    _forget(monkeypatch, "tiles", "packed")
    assert CpuBackend(kernels="auto").ops is numpy_tiles
    with pytest.raises(RuntimeError, match=r"need BLAS's sgemm: no cblas_sgemm found .*\(test\)"):
        CpuBackend(kernels="numba")


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
    seen, polls, used = [], [], set()

    def note(item, scratch):
        seen.append(item)
        used.add(id(scratch))
        scratch.array("x", (4,), np.float32)

    w.run(range(50), note, poll=lambda: polls.append(1))
    assert sorted(seen) == list(range(50)) and polls
    assert used <= {id(s) for s in w.scratch}  # each thread's own Workspace, kept from run to run
    held = [s.nbytes for s in w.scratch]
    assert sum(held) >= 16
    w.run(range(50), note)
    # The same scratch again, nothing new: a thread that ran items keeps its array (one that
    # got none the first time, on a loaded machine, may allocate the same size now).
    after = [s.nbytes for s in w.scratch]
    assert all(a == b for a, b in zip(held, after) if a) and set(after) <= set(held) | {max(held)}

    def boom(item, scratch):
        if item == 7:
            raise ValueError("item 7 failed")

    with pytest.raises(ValueError, match="item 7 failed"):
        w.run(range(20), boom)
    assert Workers(3)._pool is w._pool  # one pool per size and process
    seen.clear()
    one = Workers(1)
    one.run(range(5), note)  # inline, in order
    assert seen == list(range(5)) and one._pool is None


def test_bands_cut_work_evenly_and_in_order():
    plan = [(i, i + 1, (np.zeros(i + 1),)) for i in range(10)]  # causal: row i has i + 1 tiles
    bands = _bands(plan, 4)
    assert [r for band in bands for r in band] == plan and 2 <= len(bands) <= 4
    work = [sum(len(tiles[0]) for _, _, tiles in band) for band in bands]
    assert max(work) <= 2 * sum(work) / len(bands)
    assert _bands(plan, 1) == [plan]


def test_query_tiles_grow_when_the_keys_are_few():
    """A rank's queries against a packet of 4 sinks: one item per 16 query tiles, not a
    tiny GEMM each; a block of a tile's width of keys keeps the usual tiles."""
    from burstmpi.masks._intervals import Block
    be = CpuBackend(tile_q=64, tile_k=64)
    n = 64 * 40
    qb = Block(np.arange(100, 100 + n), np.zeros(n, np.int64), np.full(n, 3), np.zeros(n, np.int64))
    few = Block(np.arange(4), np.full(4, 100), np.full(4, 100 + n - 1), np.zeros(4, np.int64))
    rows = [r1 - r0 for r0, r1, _ in be._plan(1, qb, few)]
    assert sum(rows) == n and max(rows) == 16 * 64 and len(rows) == 3
    wide = Block(np.arange(64), np.full(64, 100), np.full(64, 100 + n - 1), np.zeros(64, np.int64))
    qb64 = qb._replace(last=np.full(n, 63))
    assert {r1 - r0 for r0, r1, _ in be._plan(1, qb64, wide)} == {64}
