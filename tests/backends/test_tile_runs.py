"""Several query tiles in one call of the tile loops (``bwd_rows``, ``cpu.packed.fwd_rows``,
laid out by ``tile_plan.flatten``) give the bits of one call per tile, and the CPU backend
keeps its tile plans from call to call.

Runs on however many ranks COMM_WORLD has (tests/test_mpi.py runs it at 2, 3 and 4).
"""

import numpy as np
import pytest

import burstmpi
from burstmpi._backends.cpu import numpy_tiles, tile_plan as tile_plan_module
from burstmpi._backends.cpu.tile_plan import flatten, tile_plan
from burstmpi.masks import BlockSparse

from conftest import NRANKS

RNG = np.random.default_rng(29)


def _row(ntok, ck):
    """The key tiles of one query tile of ``ntok`` tokens over ``ck`` keys: tiles of unequal
    widths, every other one partly visible, each token's visible run random (some empty)."""
    cuts = np.unique(np.r_[0, RNG.choice(np.arange(1, ck), 4, replace=False), ck])
    keep = np.sort(RNG.choice(len(cuts) - 1, 3, replace=False))
    c0, c1 = cuts[keep].astype(np.int64), cuts[keep + 1].astype(np.int64)
    partial = np.arange(3) % 2 == 1
    iv = np.where(partial, np.cumsum(partial) - 1, -1).astype(np.int64)
    lo = np.stack([RNG.integers(0, w, ntok) for w in (c1 - c0)[partial]]).astype(np.int64)
    hi = np.minimum((c1 - c0)[partial][:, None], lo + RNG.integers(0, 20, lo.shape)).astype(np.int64)
    return c0, c1, iv, lo, hi


def _plan(ck):
    """Three query tiles of 5, 4 and 3 tokens, with a gap of 3 tokens no tile covers."""
    return [(r0, r1, _row(r1 - r0, ck)) for r0, r1 in ((0, 5), (5, 9), (12, 15))]


def _problem(g, d=24, dv=20, ck=70):
    n = 15 * g
    q, do = (RNG.standard_normal((n, x)).astype(np.float32) for x in (d, dv))
    k, v = (RNG.standard_normal((ck, x)).astype(np.float32) for x in (d, dv))
    return q, do, k, v, _plan(ck)


@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("loops", ["numba", "numpy"])
def test_backward_run_is_its_rows(g, loops):
    """``bwd_rows`` over a run (rows of unequal heights, a gap between two of them) adds what
    ``bwd_row`` adds tile by tile, bit for bit; each side's gradients can be skipped."""
    ops = pytest.importorskip("burstmpi._backends.cpu.tiles", reason="no sgemm") if loops == "numba" else numpy_tiles
    q, do, k, v, plan = _problem(g)
    n, d, dv, ck = q.shape[0], q.shape[1], do.shape[1], k.shape[0]
    D, lse = RNG.standard_normal(n).astype(np.float32), (RNG.random(n) + 2).astype(np.float32)
    lse[4] = np.inf  # a row that sees no key

    def scratch():
        return [np.zeros(5 * g * x, np.float32) for x in (d, ck, ck)]

    for sides in ((True, True), (True, False), (False, True)):
        got, want = ([np.ones((n, d), np.float32) if sides[0] else None]
                     + ([np.ones((ck, x), np.float32) for x in (d, dv)] if sides[1] else [None, None]) for _ in "ab")
        for r0, r1, tiles in plan:
            a, b = r0 * g, r1 * g
            ops.bwd_row(q[a:b], do[a:b], D[a:b], lse[a:b], k, v, *tiles, g, 0.3,
                        None if want[0] is None else want[0][a:b], want[1], want[2], *scratch())
        t0, t1, rows = flatten(plan)
        assert (t0, t1) == (0, 15)
        ops.bwd_rows(q, do, D, lse, k, v, rows, g, 0.3, *got, *scratch())
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("g", [1, 2])
def test_forward_run_is_its_rows(g):
    """``cpu.packed.fwd_rows`` over a run merges what ``fwd_row`` merges tile by tile, bit for
    bit, into a carried state (rows that have seen nothing: m = -inf)."""
    cp = pytest.importorskip("burstmpi._backends.cpu.packed", reason="numba is not installed")
    if not cp.available():
        pytest.skip("this CPU has neither AVX2 with FMA nor AVX-512")
    q, _, k, v, plan = _problem(g)
    n, dv = q.shape[0], v.shape[1]
    kp, vp = (np.empty(cp.packed_shape(kind, *x.shape), np.float32) for kind, x in (("k", k), ("v", v)))
    cp.pack("k", k, kp)
    cp.pack("v", v, vp)
    m0 = np.where(RNG.random(n) < 0.3, -np.inf, RNG.standard_normal(n)).astype(np.float32)
    state = (RNG.standard_normal((n, dv)).astype(np.float32) * (m0 > -np.inf)[:, None], m0,
             np.where(m0 == -np.inf, 0, RNG.random(n) + 0.5).astype(np.float32))
    got, want = ([x.copy() for x in state] for _ in "ab")
    for r0, r1, tiles in plan:
        cp.fwd_row(q[r0 * g:r1 * g], kp, vp, *tiles, g, 0.3, *(x[r0 * g:r1 * g] for x in want))
    cp.fwd_rows(q, kp, vp, flatten(plan)[2], g, 0.3, *got)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_tile_plans_are_kept_across_calls(monkeypatch):
    """A second call with the same mask and lengths plans no tile again (``TilePlans``), and
    gives the same bits."""
    N, heads = 64 * NRANKS + 40, 2
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((1, N, heads, 32)).astype(np.float32) for _ in range(4))
    nb = -(-N // 16)
    mask = BlockSparse(np.random.default_rng(1).random((nb, nb)) < 0.5, 16)
    plan = burstmpi.BurstAttention(layout="zigzag", causal=True, mask=mask)
    local = [burstmpi.shard(x, layout="zigzag") for x in (q, k, v, do)]
    planned = []
    monkeypatch.setattr(tile_plan_module, "tile_plan", lambda *a: planned.append(a) or tile_plan(*a))

    def call():
        out, lse = plan.forward(*local[:3])
        return (out, lse) + tuple(plan.backward(local[3], *local[:3], out, lse))

    first = call()
    made = len(planned)
    assert made
    again = call()
    assert len(planned) == made
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
