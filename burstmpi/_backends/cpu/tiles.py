"""The CPU backend's tile loops, compiled: a row of tiles runs without returning to Python.

``fwd_row`` merges one query tile's attention over every key tile it sees into the running
state, ``bwd_row`` accumulates one query tile's gradients, and ``bwd_rows`` runs a run of
query tiles in one call (``tile_plan.flatten`` lays it out): the Python around a call, its
views, checks and numba's dispatch, cost a few per cent of a block-sparse backward paid
tile by tile. ``numpy_tiles`` has the same
loops in NumPy (the fallback and the float64 path), with the same signatures:

    q (n, d), do (n, dv)       a query tile's rows (token r // g owns row r), unscaled
    D, lse (n,)                the backward's row scalars (lse +inf: the row sees no key)
    k (Ck, d), v (Ck, dv)      the key block of this (batch, KV head)
    c0, c1, iv (T,)            key tile t is columns c0[t]..c1[t]-1; iv[t] < 0: every row
                               sees it whole, else token x sees its columns
    lo, hi (P, n // g)         lo[iv[t], x]..hi[iv[t], x]-1 (relative to c0[t])
    acc (n, dv), m, l (n,)     the forward's running state, updated in place
    dq (n, d), dk, dv          the backward's accumulators (dk, dv: (Ck, d), (Ck, dv)), added
                               to in place; an empty array skips that side (the two-way ring)
    qs                         scratch for the scaled queries: at least n * d elements
    s, alpha / p, ds           scratch: at least n * max(c1 - c0) and n elements

Matrices need contiguous rows, not contiguous storage: every GEMM is given each operand's
row stride (BLAS's leading dimension), and inputs may be read-only. So a tile's queries are
read where they lie in the caller's (B, C, heads, d) array (rows ``heads * d`` apart; they
are read once, into ``qs``), and a packet's rows are used as received. The backend still
copies the caller's own K and V once per block, where rows 4 KB apart measured slower in
the GEMMs than a copy (``backend``). One compiled version of each loop takes all of
these (``_SIGNATURES``).

Every GEMM is BLAS's ``sgemm`` called from the compiled code (``blas``), and ``beta =
1`` adds P @ V, P^T dO, dS K and dS^T Q into their accumulators directly, so no tile needs
a temporary or an extra sweep. Q is scaled once per row, into the scratch ``qs``, as
``numpy_tiles`` does:
putting the scale in the GEMM's ``alpha`` instead rounds S differently, and on one
ill-conditioned dq element of the test suite (5 ranks, scale 0.37) that tripled the error
(9.7e-6 against 3.0e-6, where the rule allows 9.3e-6). Between the GEMMs run
``kernels``' fused elementwise sweeps. A row holds the GIL only to enter:
the backend's threads run rows side by side (``threads``), each with one-threaded BLAS.
"""

import sys
import threading
import time

import numba
import numpy as np
from numba import njit, types

from .. import jit_cache
from . import blas, kernels
from .kernels import _FM, dsoftmax, probs, softmax_update, wide_vectors, widen  # noqa: F401 (widen: the ops interface)

if blas.sgemm is None:  # the backend falls back to numpy_tiles (BURSTMPI_CPU_KERNELS=auto)
    raise ImportError(f"the compiled tile loops need BLAS's sgemm: {blas.available()}")

__all__ = ["fwd_row", "bwd_row", "bwd_rows", "widen", "warm", "describe", "name"]

name = kernels.name
_sgemm = blas.sgemm
_R, _N, _T = blas.ROW_MAJOR, blas.NO_TRANS, blas.TRANS
_ONE, _ZERO = np.float32(1.0), np.float32(0.0)


@njit(inline="always", cache=True)
def _at(x, row):
    """Address of row ``row`` of the float32 matrix ``x`` (rows contiguous, any row stride)."""
    return x.ctypes.data + row * x.strides[0]


@njit(inline="always", cache=True)
def _ld(x):
    """BLAS's leading dimension of the float32 matrix ``x``: elements from one row to the next
    (a single row's stride is whatever NumPy made it, and BLAS only checks it)."""
    return x.strides[0] // 4 if x.shape[0] > 1 else max(x.shape[1], 1)


@njit(inline="always", fastmath=_FM, cache=True)
def _scaled(q, scale, buf):
    """``q * scale`` as a C-contiguous matrix in the scratch ``buf``."""
    n, d = q.shape
    qs = buf[:n * d].reshape((n, d))
    for r in range(n):
        src, dst = q[r], qs[r]
        for j in range(d):
            dst[j] = src[j] * scale
    return qs


# A partly visible tile (the diagonal of a causal mask, a window's edge) is cut into
# bands of _BAND GEMM rows, each computed over only the columns its rows see, when that
# saves at least a quarter of the tile's area: a causal diagonal 512 x 512 tile then costs
# 5/8 of its GEMM work.
_BAND = 128


@njit(cache=True)
def _bands(jlo, jhi, g, w):
    """Token bounds and column runs [ca, cb) of ``jlo``/``jhi``'s bands worth computing
    apart (rows of one band that see nothing are skipped), or a single band of the whole
    tile when banding saves less than a quarter of its area."""
    ntok = jlo.size
    per = max(1, _BAND // g)
    nb = (ntok + per - 1) // per
    out = np.empty((nb, 4), np.int64)  # t0, t1, ca, cb
    area, k = 0, 0
    for b in range(nb):
        t0, t1 = b * per, min(ntok, (b + 1) * per)
        ca, cb = w, 0
        for t in range(t0, t1):
            if jhi[t] > jlo[t]:
                ca, cb = min(ca, jlo[t]), max(cb, jhi[t])
        if cb > ca:
            out[k, 0], out[k, 1], out[k, 2], out[k, 3] = t0, t1, ca, cb
            area += (t1 - t0) * (cb - ca)
            k += 1
    if 4 * area > 3 * ntok * w:
        out[0, 0], out[0, 1], out[0, 2], out[0, 3] = 0, ntok, 0, w
        return out[:1]
    return out[:k]


@njit(cache=True)
def _pieces(t, c0, c1, iv, lo, hi, g, ntok):
    """What key tile ``t`` is computed as: rectangles (r0, r1, col, w) of GEMM rows r0..r1-1
    against key columns col..col+w-1, and per rectangle its tokens' visible runs relative
    to ``col``: the whole tile when every row sees it whole, else ``_bands``."""
    w = c1[t] - c0[t]
    if iv[t] < 0:
        rects = np.empty((1, 4), np.int64)
        rects[0, 0], rects[0, 1], rects[0, 2], rects[0, 3] = 0, ntok * g, c0[t], w
        return rects, np.zeros((1, ntok), np.int64), np.full((1, ntok), w, np.int64)
    jlo, jhi = lo[iv[t]], hi[iv[t]]
    bands = _bands(jlo, jhi, g, w)
    nb = bands.shape[0]
    rects, rlo, rhi = np.empty((nb, 4), np.int64), np.zeros((nb, ntok), np.int64), np.zeros((nb, ntok), np.int64)
    for b in range(nb):
        t0, t1, ca, cb = bands[b, 0], bands[b, 1], bands[b, 2], bands[b, 3]
        rects[b, 0], rects[b, 1], rects[b, 2], rects[b, 3] = t0 * g, t1 * g, c0[t] + ca, cb - ca
        for x in range(t0, t1):  # clipped to the band's columns (empty runs stay empty)
            a = min(max(jlo[x] - ca, 0), cb - ca)
            rlo[b, x - t0], rhi[b, x - t0] = a, max(min(jhi[x] - ca, cb - ca), a)
    return rects, rlo, rhi


@njit(inline="always", fastmath=_FM, cache=True)
def _fwd_tile(qs, k, v, col, w, jlo, jhi, g, acc, m, l, s, alpha):
    """Rows ``qs`` against key columns col..col+w-1: one tile, or one band of one."""
    n, d = qs.shape
    dv = v.shape[1]
    st = s[:n * w].reshape((n, w))
    _sgemm(_R, _N, _T, n, w, d, _ONE, qs.ctypes.data, d, _at(k, col), _ld(k), _ZERO, st.ctypes.data, w)
    softmax_update(st, jlo, jhi, g, m, l, alpha)
    for r in range(n):  # acc *= alpha, then acc += P @ V inside the GEMM
        a = alpha[r]
        if a != _ONE:  # the row's max did not move (most tiles after the first few)
            row = acc[r]
            for j in range(dv):
                row[j] *= a
    _sgemm(_R, _N, _N, n, dv, w, _ONE, st.ctypes.data, w, _at(v, col), _ld(v), _ONE, acc.ctypes.data, _ld(acc))


@njit(inline="always", fastmath=_FM, cache=True)
def _bwd_tile(qs, do, D, lse, k, v, col, w, jlo, jhi, g, dq, dk, dv, p, ds):
    """The gradients of rows ``qs`` against key columns col..col+w-1."""
    n, d = qs.shape
    dvd = do.shape[1]
    pt, dst = p[:n * w].reshape((n, w)), ds[:n * w].reshape((n, w))
    _sgemm(_R, _N, _T, n, w, d, _ONE, qs.ctypes.data, d, _at(k, col), _ld(k), _ZERO, pt.ctypes.data, w)
    probs(pt, jlo, jhi, g, lse)  # P = exp(S - lse)
    _sgemm(_R, _N, _T, n, w, dvd, _ONE, do.ctypes.data, _ld(do), _at(v, col), _ld(v), _ZERO, dst.ctypes.data, w)  # dP
    if dv.size:  # dV += P^T dO
        _sgemm(_R, _T, _N, w, dvd, n, _ONE, pt.ctypes.data, w, do.ctypes.data, _ld(do), _ONE, _at(dv, col), _ld(dv))
    dsoftmax(dst, pt, D)  # dS = P (dP - D)
    if dq.size:  # dQ += dS K (the owner applies the scale)
        _sgemm(_R, _N, _N, n, d, w, _ONE, dst.ctypes.data, w, _at(k, col), _ld(k), _ONE, dq.ctypes.data, _ld(dq))
    if dk.size:  # dK += dS^T (scale Q)
        _sgemm(_R, _T, _N, w, d, n, _ONE, dst.ctypes.data, w, qs.ctypes.data, d, _ONE, _at(dk, col), _ld(dk))


@njit(nogil=True, fastmath=_FM, cache=True)
def _fwd_row(q, k, v, c0, c1, iv, lo, hi, g, scale, acc, m, l, qbuf, s, alpha):
    wide_vectors()
    qs = _scaled(q, scale, qbuf)
    for t in range(c0.size):
        rects, rlo, rhi = _pieces(t, c0, c1, iv, lo, hi, g, q.shape[0] // g)
        for b in range(rects.shape[0]):
            r0, r1, col, w = rects[b, 0], rects[b, 1], rects[b, 2], rects[b, 3]
            _fwd_tile(qs[r0:r1], k, v, col, w, rlo[b], rhi[b], g, acc[r0:r1], m[r0:r1], l[r0:r1], s, alpha[r0:r1])


@njit(inline="always", fastmath=_FM, cache=True)
def _bwd_tiles(q, do, D, lse, k, v, c0, c1, iv, lo, hi, g, scale, dq, dk, dv, qbuf, p, ds):
    """One query tile's gradients over its key tiles (``bwd_row``)."""
    qs = _scaled(q, scale, qbuf)
    for t in range(c0.size):
        rects, rlo, rhi = _pieces(t, c0, c1, iv, lo, hi, g, q.shape[0] // g)
        for b in range(rects.shape[0]):
            r0, r1, col, w = rects[b, 0], rects[b, 1], rects[b, 2], rects[b, 3]
            _bwd_tile(qs[r0:r1], do[r0:r1], D[r0:r1], lse[r0:r1], k, v, col, w, rlo[b], rhi[b], g,
                      dq[r0:r1] if dq.size else dq, dk, dv, p, ds)


@njit(nogil=True, fastmath=_FM, cache=True)
def _bwd_row(q, do, D, lse, k, v, c0, c1, iv, lo, hi, g, scale, dq, dk, dv, qbuf, p, ds):
    wide_vectors()
    _bwd_tiles(q, do, D, lse, k, v, c0, c1, iv, lo, hi, g, scale, dq, dk, dv, qbuf, p, ds)


@njit(nogil=True, fastmath=_FM, cache=True)
def _bwd_rows(q, do, D, lse, k, v, rows, first, c0, c1, iv, lo, hi, g, scale, dq, dk, dv, qbuf, p, ds):
    wide_vectors()
    for i in range(rows.shape[0]):
        a, b = rows[i, 0] * g, rows[i, 1] * g  # the tile's GEMM rows
        t0, t1 = first[i], first[i + 1]
        ntok = rows[i, 1] - rows[i, 0]
        _bwd_tiles(q[a:b], do[a:b], D[a:b], lse[a:b], k, v, c0[t0:t1], c1[t0:t1], iv[t0:t1], lo[:, :ntok],
                   hi[:, :ntok], g, scale, dq[a:b] if dq.size else dq, dk, dv, qbuf, p, ds)


def _matrix(x):
    """Is ``x`` a matrix the compiled loops can hand to sgemm: aligned float32, contiguous
    rows, rows at a row stride BLAS accepts?"""
    n, w = x.shape
    return (x.dtype == np.float32 and x.flags.aligned and (x.strides[1] == 4 or w <= 1)
            and (n <= 1 or x.strides[0] >= 4 * max(w, 1)))


def _operands(names, arrays, inputs):
    """``arrays`` as the compiled loops take them: inputs whose rows are not contiguous float32
    are copied; accumulators must already be (they are updated in place)."""
    fixed = []
    for what, x in zip(names, arrays):
        good = x.dtype == np.float32 and x.flags.aligned if x.ndim == 1 else _matrix(x)
        if not good:
            if what not in inputs:
                raise ValueError(f"cpu.tiles: {what} must be an aligned float32 array with contiguous rows "
                                 f"(it is updated in place), got {x.dtype} with shape {x.shape} and strides {x.strides}")
            x = np.ascontiguousarray(x, dtype=np.float32)
        fixed.append(x)
    return fixed


def fwd_row(q, k, v, c0, c1, iv, lo, hi, g, scale, acc, m, l, qs, s, alpha):
    """One query tile over its key tiles, merged into (acc, m, l) in place."""
    q, k, v, acc, m, l = _operands("q k v acc m l".split(), (q, k, v, acc, m, l), ("q", "k", "v"))
    _fwd_row(q, k, v, c0, c1, iv, lo, hi, g, np.float32(scale), acc, m, l, qs, s, alpha)


def _bwd_operands(q, do, D, lse, k, v, dq, dk, dv):
    """The backward's operands as the compiled loops take them; a skipped side's gradients
    (None) as empty arrays."""
    empty = np.empty((0, 0), np.float32)
    dq, dk, dv = (empty if x is None else x for x in (dq, dk, dv))
    return _operands("q do D lse k v dq dk dv".split(), (q, do, D, lse, k, v, dq, dk, dv),
                     ("q", "do", "D", "lse", "k", "v"))


def bwd_row(q, do, D, lse, k, v, c0, c1, iv, lo, hi, g, scale, dq, dk, dv, qs, p, ds):
    """One query tile's gradients over its key tiles, added into dq, dk, dv (None: skipped)."""
    q, do, D, lse, k, v, dq, dk, dv = _bwd_operands(q, do, D, lse, k, v, dq, dk, dv)
    _bwd_row(q, do, D, lse, k, v, c0, c1, iv, lo, hi, g, np.float32(scale), dq, dk, dv, qs, p, ds)


def bwd_rows(q, do, D, lse, k, v, rows, g, scale, dq, dk, dv, qs, p, ds):
    """``bwd_row`` for a run of query tiles in one call (``tile_plan.flatten``'s ``rows``):
    ``q``, ``do``, ``D``, ``lse`` and ``dq`` hold the run's rows, from its first tile's."""
    q, do, D, lse, k, v, dq, dk, dv = _bwd_operands(q, do, D, lse, k, v, dq, dk, dv)
    _bwd_rows(q, do, D, lse, k, v, *rows, g, np.float32(scale), dq, dk, dv, qs, p, ds)


# One compiled version of each loop, for operands with any row stride (numba's layout "A")
# and read-only inputs: C-contiguous or writable arrays convert to it, so the same machine
# code (and disk cache entry) serves home blocks, packets and copies alike.
def _array(dtype, ndim, layout="A", readonly=False):
    return types.Array(dtype, ndim, layout, readonly=readonly)


_IN1, _IN2 = _array(types.float32, 1, readonly=True), _array(types.float32, 2, readonly=True)
_OUT1, _OUT2 = _array(types.float32, 1), _array(types.float32, 2)
_SCRATCH = _array(types.float32, 1, "C")
_TILES = (_array(types.int64, 1, readonly=True),) * 3 + (_array(types.int64, 2, readonly=True),) * 2 + (types.int64,)
_RUN = (_array(types.int64, 2, readonly=True), _array(types.int64, 1, readonly=True))  # span, first
_SIGNATURES = {
    _fwd_row: (_IN2, _IN2, _IN2) + _TILES + (types.float32, _OUT2, _OUT1, _OUT1) + (_SCRATCH,) * 3,
    _bwd_row: (_IN2, _IN2, _IN1, _IN1, _IN2, _IN2) + _TILES + (types.float32, _OUT2, _OUT2, _OUT2) + (_SCRATCH,) * 3,
    _bwd_rows: ((_IN2, _IN2, _IN1, _IN1, _IN2, _IN2) + _RUN + _TILES
                + (types.float32, _OUT2, _OUT2, _OUT2) + (_SCRATCH,) * 3),
}


# The loops compile in kernels' sweeps and blas's binding: cached code older than
# any of the three files is flushed (``jit_cache``).
jit_cache.guard(sys.modules[__name__], (kernels, blas))
_warm = None  # (seconds, loaded from the disk cache) of the first warm()
# Threads of one process (a framework's, at MPI_THREAD_MULTIPLE) may make their first call at
# once: one compiles, the others wait (a second compile after disable_compile() would fail).
_warm_lock = threading.Lock()


def warm():
    """Compile (or load from the disk cache) the kernels and both loops, once per process;
    return the seconds the first call took."""
    global _warm
    with _warm_lock:
        if _warm is None:
            t0 = time.perf_counter()
            kernels.warm()
            for loop, signature in _SIGNATURES.items():
                loop.compile(signature)
                loop.disable_compile()  # every call converts to that signature
            cached = kernels.cached() and all(sum(x.stats.cache_hits.values()) > 0 for x in _SIGNATURES)
            _warm = (time.perf_counter() - t0, cached)
    return _warm[0]


def describe():
    """One line for the bench's preamble: numba's version and how the first call went."""
    seconds = warm()
    how = "loaded from the disk cache" if _warm[1] else "compiled (now cached on disk)"
    where = getattr(getattr(_fwd_row, "_cache", None), "_cache_path", None)
    return (f"numba {numba.__version__} kernels and tile loops over {blas.describe()}, {how} in "
            f"{seconds:.2f} s on first use" + (f" ({where})" if where else ""))
