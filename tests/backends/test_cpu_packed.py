"""The forward on the micro-kernel (``burstmpi._backends.cpu.packed``: K and V packed once)
against the NumPy tile loops and, end to end, against float64.

Runs on however many ranks COMM_WORLD has (tests/test_mpi.py runs it at 2, 3 and 4).
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import burstmpi
from burstmpi import masks
from burstmpi import reference as ref
from burstmpi._backends.cpu import numpy_tiles
from burstmpi._interop import bfloat16

from conftest import DTYPES, NRANKS, check_against_float64

cp = pytest.importorskip("burstmpi._backends.cpu.packed", reason="numba is not installed")
if not cp.available():
    pytest.skip("this CPU has neither AVX2 with FMA nor AVX-512", allow_module_level=True)

RNG = np.random.default_rng(11)


def _packed(k, v):
    """K and V packed as the backend packs them (``cpu.packed.pack``)."""
    out = []
    for kind, x in (("k", k), ("v", v)):
        out.append(np.empty(cp.packed_shape(kind, *x.shape), np.float32))
        cp.pack(kind, x, out[-1])
    return out


def test_packing_layout():
    """kp[i, c, x] = k[MR i + x, c] and vp[i, j, x] = v[j, MR i + x], zero past the ends;
    rows may lie any distance apart (a (batch, head) slab of the caller's array)."""
    wide = RNG.standard_normal((17, 3, 13)).astype(np.float32)
    k = wide[:, 1]  # rows 39 floats apart
    kp, vp = _packed(k, k)
    mr = cp.MR
    for j in range(17):
        for c in range(13):
            assert kp[j // mr, c, j % mr] == k[j, c] and vp[c // mr, j, c % mr] == k[j, c]
    assert (kp[-1, :, 17 % mr:] == 0).all() and (vp[-1, :, 13 % mr:] == 0).all()


def _intervals(ntok, tk):
    """Random visible runs per token, with a token that sees nothing of the tile and one that
    sees all of it."""
    lo = RNG.integers(0, tk, ntok)
    hi = np.minimum(tk, lo + RNG.integers(0, tk, ntok))
    lo[0], hi[0] = 0, tk
    lo[1], hi[1] = 5, 5
    return lo.astype(np.int64), hi.astype(np.int64)


def _strided(x):
    """``x``'s values in a read-only view whose rows lie further apart than its width, as a
    (batch, head) slab of the caller's (B, C, heads, d) array lies."""
    wide = RNG.standard_normal((x.shape[0], x.shape[1] + 7)).astype(x.dtype)
    wide[:, 3:3 + x.shape[1]] = x
    view = wide[:, 3:3 + x.shape[1]]
    view.flags.writeable = False
    return view


def _row_problem(g, ntok=23, d=26, dv=20, ck=149):
    """A query tile (not a whole number of query panels) over whole and partial key tiles that
    start off the ``MR`` grid, the last ending at the block's end inside a panel of ``MR``
    keys, head dims that are not multiples of ``MR``, one partial tile that no row of some
    query panels sees, K and V with rows further apart than their width (packed from
    there), and a running state carried in (rows that have seen nothing: m = -inf)."""
    n = ntok * g
    q = RNG.standard_normal((n, d)).astype(np.float32)
    k, v = RNG.standard_normal((ck, d)).astype(np.float32), RNG.standard_normal((ck, dv)).astype(np.float32)
    c0, c1 = np.array([1, 33, 55, 97, 140], np.int64), np.array([33, 55, 97, 140, 149], np.int64)
    iv = np.array([-1, 0, -1, 1, 2], np.int64)
    runs = [_intervals(ntok, 22), _intervals(ntok, 43), (np.zeros(ntok, np.int64), np.zeros(ntok, np.int64))]
    runs[2][1][-1] = 9  # only the last token sees the last tile: one query panel computes it
    lo, hi = np.stack([a for a, _ in runs]), np.stack([b for _, b in runs])
    m0 = np.where(RNG.random(n) < 0.3, -np.inf, RNG.standard_normal(n)).astype(np.float32)
    state = (RNG.standard_normal((n, dv)).astype(np.float32) * (m0 > -np.inf)[:, None], m0,
             np.where(m0 == -np.inf, 0, RNG.random(n) + 0.5).astype(np.float32))
    return q, _strided(k), _strided(v), (c0, c1, iv, lo, hi), state


def _both(q, k, v, tiles, g, state, scale=0.3):
    """(acc, m, l) from the packed row and from ``cpu.numpy_tiles``' NumPy row, on copies of ``state``."""
    n, d = q.shape
    ours, numpy = (tuple(x.copy() for x in state) for _ in range(2))
    cp.fwd_row(q, *_packed(k, v), *tiles, g, scale, *ours)
    widest = int((tiles[1] - tiles[0]).max())
    numpy_tiles.fwd_row(q, k, v, *tiles, g, scale, *numpy, np.zeros(n * d, np.float32),
                     np.zeros(n * widest, np.float32), np.zeros(n, np.float32))
    return ours, numpy


@pytest.mark.parametrize("g", [1, 3])
def test_row_matches_numpy(g):
    """One query tile over its key tiles, merged into a carried state: the same (acc, m, l)
    as the NumPy loop's within float32 rounding; m exactly (the same scores' maxima)."""
    q, k, v, tiles, state = _row_problem(g)
    ours, numpy = _both(q, k, v, tiles, g, state)
    for a, b in zip(ours, numpy):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)
    assert ((ours[1] == -np.inf) == (numpy[1] == -np.inf)).all()


@pytest.mark.parametrize("where", ["whole", "partial"])
def test_row_nan_and_inf_reach_what_numpy_lets_them(where):
    """A NaN in K or V and an inf in a query reach exactly the outputs and lse (and only
    those) that the NumPy loop lets them reach: no silent 0 from the micro-kernel. (The
    running max may skip a NaN score, as the compiled sgemm loops' does; the sum does not.)"""
    q, k, v, tiles, state = _row_problem(2)
    k, v = k.copy(), v.copy()
    if where == "whole":
        k[70, 3] = np.nan  # in the whole tile 55..97: every row
    else:
        k[40, 1] = np.nan  # in the partial tile 33..55: the rows that see key 40 (a NaN in V
        # reaches every row of the tile's GEMM, through 0 * NaN, in both loops)
    q[7, 0] = np.inf
    ours, numpy = _both(q, k, v, tiles, 2, state)
    with np.errstate(invalid="ignore", divide="ignore"):  # what the finalisation makes of them: out, lse
        done = [(acc / l[:, None], m + np.log(l)) for acc, m, l in (ours, numpy)]
    for a, b in zip(*done):
        assert np.array_equal(np.isnan(a), np.isnan(b))
        fine = ~np.isnan(b)
        np.testing.assert_allclose(a[fine], b[fine], rtol=2e-5, atol=2e-5)
    rows = np.isnan(done[0][0]).any(axis=1)
    assert rows.all() if where == "whole" else 1 < rows.sum() < rows.size


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask", ["causal", "window", "blocks", "sinks"])
def test_packed_forward_against_float64(mask, dtype, monkeypatch):
    """BURSTMPI_CPU_GEMM=packed, every forward block on the micro-kernel (the backward on
    sgemm): within flash-attn's rule against float64, with GQA, an odd length, tiles
    smaller than the block (whole, partial and skipped ones) and masks whose tiles start
    off the packing grid."""
    monkeypatch.setenv("BURSTMPI_CPU_GEMM", "packed")
    monkeypatch.setenv("BURSTMPI_TILE_Q", "40")
    monkeypatch.setenv("BURSTMPI_TILE_K", "22")
    N = 61 * NRANKS + 3
    opts = {"causal": dict(causal=True), "window": dict(window=(17, 4)),
            "blocks": dict(causal=True, mask=masks.BlockSparse(np.random.default_rng(2).random((-(-N // 16),) * 2) < 0.4, 16)),
            "sinks": dict(mask=masks.Sinks(5) | masks.Window(20, 0))}[mask]
    plan, _ = check_against_float64(N=N, Z=6, Zkv=2, d=24, dv=20, dtype=dtype, layout="zigzag", bwd_comm="auto",
                                    tag=f"packed {mask} ", **opts)
    assert plan.backend.packed is cp and plan.backend.pack_always


def test_packed_forward_deterministic_and_inputs_unchanged(monkeypatch):
    """Bitwise the same forward twice over and on 1 or 3 threads; inputs intact; the same
    results within float32 rounding as the sgemm tiles (BURSTMPI_CPU_GEMM=blas)."""
    monkeypatch.setenv("BURSTMPI_TILE_Q", "32")
    monkeypatch.setenv("BURSTMPI_TILE_K", "48")
    q, k, v, _ = ref.random_problem(2, 96 * NRANKS, 4, 2, 32, dtype=np.float32, seed=5)
    sh = lambda x: burstmpi.shard(x, layout="zigzag")
    ql, kl, vl = sh(q), sh(k), sh(v)
    before = [x.copy() for x in (ql, kl, vl)]
    runs = {}
    for gemm, threads in (("packed", 3), ("packed", 3), ("packed", 1), ("blas", 1)):
        monkeypatch.setenv("BURSTMPI_CPU_GEMM", gemm)
        monkeypatch.setenv("BURSTMPI_THREADS", str(threads))
        plan = burstmpi.BurstAttention(causal=True, layout="zigzag")
        runs.setdefault(gemm, []).append(plan.forward(ql, kl, vl))
    for out, lse in runs["packed"][1:]:
        assert np.array_equal(out.view(np.uint8), runs["packed"][0][0].view(np.uint8))
        assert np.array_equal(lse.view(np.uint8), runs["packed"][0][1].view(np.uint8))
    for a, b in zip(runs["packed"][0], runs["blas"][0]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    for x, y in zip(before, (ql, kl, vl)):
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


def test_half_precision_blocks_are_widened_then_packed(monkeypatch):
    """bfloat16 K and V go through the widening copy before packing (the micro-kernel reads
    float32): the same forward as the sgemm tiles within float32 rounding."""
    monkeypatch.setenv("BURSTMPI_TILE_Q", "32")
    q, k, v, _ = ref.random_problem(1, 64 * NRANKS, 4, 4, 16, dtype=bfloat16, seed=9)
    sh = lambda x: burstmpi.shard(x, layout="contiguous")
    got = {}
    for gemm in ("packed", "blas"):
        monkeypatch.setenv("BURSTMPI_CPU_GEMM", gemm)
        out, lse = burstmpi.BurstAttention(causal=True, layout="contiguous").forward(sh(q), sh(k), sh(v))
        got[gemm] = np.asarray(out, np.float32), lse
    np.testing.assert_allclose(got["packed"][0], got["blas"][0], rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(got["packed"][1], got["blas"][1], rtol=1e-5, atol=1e-5)


def test_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv("BURSTMPI_CPU_GEMM", "fast")
    with pytest.raises(ValueError, match=r"BURSTMPI_CPU_GEMM: expected one of \['auto', 'blas', 'packed'\], got 'fast'"):
        burstmpi.BurstAttention()


def test_auto_packs_where_the_keys_meet_512_query_rows():
    """BURSTMPI_CPU_GEMM=auto: a block is packed when its keys meet 512 query rows or more on
    average (the plan's pairs over its keys; GQA rows count), else the forward calls sgemm;
    float64 never."""
    from burstmpi._backends.cpu import CpuBackend

    backend = CpuBackend(kernels="numba", gemm="auto")
    ck, d = 96, 16
    k = v = np.zeros((1, 1, ck, d), np.float32)
    tiles = lambda w: (np.array([0]), np.array([w]), np.array([-1]), np.zeros((0, 1)), np.zeros((0, 1)))
    assert backend._pack(k, v, [(0, 256, tiles(ck))], 2, np.dtype(np.float32)) is not None  # 512 rows a key
    assert backend._pack(k, v, [(0, 255, tiles(ck))], 2, np.dtype(np.float32)) is None
    assert backend._pack(k.astype(np.float64), v.astype(np.float64), [(0, 4096, tiles(ck))], 1, np.dtype(np.float64)) is None
    assert CpuBackend(kernels="numba", gemm="blas").packed is None


@pytest.mark.skipif(NRANKS > 1, reason="spawns its own interpreters; once is enough")
@pytest.mark.parametrize("features, lanes", [("+avx,+avx2,+fma,-avx512f", 8), ("+avx,+avx2,+fma,+avx512f", 16),
                                             ("+avx,-avx2,-fma,-avx512f", 0)])
def test_vector_width_follows_numba_cpu_features(features, lanes):
    """The micro-kernel's vector width is that of the CPU numba compiles for: with
    ``NUMBA_CPU_FEATURES`` set (a fresh interpreter: numba reads it once), that, whatever
    the host has; so the AVX2 kernel can run, and be measured, on an AVX-512 machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}  # not a rank
    env.update(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=features)
    out = subprocess.run([sys.executable, "-c", "from burstmpi._backends.cpu import micro; "
                          "print(micro.LANES, micro.NR, micro.available())"],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == [str(lanes), str(2 * max(lanes, 8)), str(lanes > 0)]
