"""The CPU backend's float32 forward on operands packed once, on our own micro-kernel.

BLAS's ``sgemm`` repacks both of its operands on every call. For a 512 x 512 tile that is
a small share of the work, but a block-sparse mask's tiles are 128 x 128 (its blocks), and
there the copies come to four per visible pair (Q, K, P, V) against 1.75 for a 512 x 512
tile, and sgemm ran those tiles 15 % slower a pair. Here every operand
is laid out once, in the order ``micro``'s micro-kernel reads it:

- K and V once per block (``pack_k``: panels of ``MR`` keys, ``kp[i, c, x] = k[MR * i + x,
  c]``; ``pack_v``: panels of ``MR`` value columns, ``vp[i, j, x] = v[j, MR * i + x]``),
  zero past the ends, on the workers before the tiles start;
- a query tile's rows once per row of tiles, scaled, in panels of ``NR`` queries
  (``qp[i, c, y] = scale * q[NR * i + y, c]``);
- and the scores come out of the micro-kernel laid out as the second GEMM reads them. It
  computes S^T = K Q^T: keys down, a panel's ``NR`` queries across. So the softmax runs
  across queries, one vector lane per query, and P^T is the right-hand operand of O^T =
  V^T P^T as it lies. The output accumulates transposed (value columns down, queries
  across) and goes back to the caller's (n, dv) rows once per row of tiles.

A tile's pairs then pay no copy: two GEMMs in the micro-kernel, the first of which also
folds each query's running max in, and one exponential sweep. Packing costs a copy of
each key's K and V row per block, so the backend packs where a block's keys meet enough
query rows (``CpuBackend._pack``). K and V read in place by the same kernel ran 12-15 %
slower than packed, so they are packed; the backward on the same kernel (P^T and dS^T
transposed once for dK and dV) was no faster than sgemm's and was not kept (commit f380212
has it).

``fwd_rows`` runs several query tiles in one call (``tile_plan.flatten``), as
``tiles.bwd_rows`` does and for the same reason: the Python around each call.

Keys need not start at a multiple of ``MR``: a tile from column c0 starts at the panel
holding c0 and ignores the rows before it (``c0 % MR``) and past its end. Per query panel
only the key panels some query of it sees are computed (a causal diagonal tile costs
about half of a whole one), and only the rows of a partly visible tile (``iv >= 0``) that
some query of the panel does not see are masked (-inf, a vectorised select) before the one
exponential sweep; all with ``kernels``' arithmetic: the same exp, the same rules for rows
that see nothing (m stays -inf, alpha 1) and for NaN (it reaches the row's output and
lse). Results are bitwise reproducible; they differ from ``tiles``' in rounding only
(another summation order).
"""

import sys
import threading
import time

import numpy as np
from numba import njit, types

from .. import jit_cache
from . import kernels, micro
from .kernels import _FM, _fmax, fexp, wide_vectors
from .micro import LANES, MR, NR, available, exp_sweep as _exp_sweep, micro_add as _micro_add, micro_set as _micro_set

__all__ = ["LANES", "MR", "NR", "available", "packed_shape", "pack", "pack_k", "pack_v", "fwd_row", "fwd_rows", "warm", "describe"]

_F = np.float32
_ZERO, _NEG = _F(0.0), _F(-np.inf)
_ROWS = 32  # rows of V per pass of pack_v


@njit(inline="always", cache=True)
def _addr(x, i):
    """Address of element ``i`` of the contiguous float32 array ``x``."""
    return x.ctypes.data + 4 * i


@njit(nogil=True, cache=True)
def pack_k(k, kp):
    """K (Ck, d), any row stride, into panels of ``MR`` keys: ``kp`` (ceil(Ck / MR), d, MR),
    the rows past Ck zero."""
    ck, d = k.shape
    for i in range(kp.shape[0]):
        panel = kp[i]
        if (i + 1) * MR <= ck:  # a whole panel: six rows side by side, no test per element
            r0, r1, r2, r3, r4, r5 = k[i * MR], k[i * MR + 1], k[i * MR + 2], k[i * MR + 3], k[i * MR + 4], k[i * MR + 5]
            for c in range(d):
                dst = panel[c]
                dst[0], dst[1], dst[2], dst[3], dst[4], dst[5] = r0[c], r1[c], r2[c], r3[c], r4[c], r5[c]
        else:
            for c in range(d):
                for x in range(MR):
                    j = i * MR + x
                    panel[c, x] = k[j, c] if j < ck else _ZERO


@njit(nogil=True, cache=True)
def pack_v(v, vp):
    """V (Ck, dv), any row stride, into panels of ``MR`` value columns: ``vp`` (ceil(dv /
    MR), Ck, MR), the columns past dv zero. ``_ROWS`` rows at a time, panel by panel: those
    rows stay in L1 while every panel takes its ``MR`` columns of them, and each panel is
    written in order (two to three times as fast as row by row through array views)."""
    ck, dv = v.shape
    flat = vp.reshape(-1)
    whole = dv // MR
    for j0 in range(0, ck, _ROWS):
        j1 = min(ck, j0 + _ROWS)
        for i in range(vp.shape[0]):
            c0, o = i * MR, (i * ck + j0) * MR
            for j in range(j0, j1):
                row = v[j]
                if i < whole:
                    for x in range(MR):
                        flat[o + x] = row[c0 + x]
                else:  # the last panel, past dv
                    for x in range(MR):
                        flat[o + x] = row[c0 + x] if c0 + x < dv else _ZERO
                o += MR


@njit(inline="always", cache=True)
def _lanes(x, scale, out, n):
    """``out[i, c, y] = scale * x[NR * i + y, c]``: rows of ``x`` as query panels (columns
    down, ``NR`` rows across), zero past row n."""
    for i in range(out.shape[0]):
        for y in range(NR):
            r = i * NR + y
            if r < n:
                src = x[r]
                for c in range(x.shape[1]):
                    out[i, c, y] = src[c] * scale
            else:
                for c in range(x.shape[1]):
                    out[i, c, y] = _ZERO


@njit(inline="always", fastmath=_FM, cache=True)
def _hide(pt, a, b, jlo, jhi, mx):
    """Rows a..b-1 of ``pt``: -inf where query y does not see the row (jlo[y] <= row <
    jhi[y]), so that the exponential sweep makes them 0, and the rest folded into the
    maxima ``mx``. A select per element, no branch, so the loop over a row's ``NR`` queries
    vectorises."""
    for j in range(a, b):
        row = pt[j]
        for y in range(NR):
            x = row[y] if (jlo[y] <= j) & (j < jhi[y]) else _NEG
            row[y] = x
            mx[y] = _fmax(mx[y], x)


@njit(inline="always", fastmath=_FM, cache=True)
def _softmax(pt, a, b, wa, wb, jlo, jhi, m, l, alpha, mx, sh, tot):
    """One query panel's running softmax over rows a..b-1 of ``pt`` (keys down, ``NR``
    queries across): ``pt`` becomes P^T there, and m, l, alpha become what
    ``kernels.softmax_update`` makes of them. Every query sees rows wa..wb-1 (``mx``
    already holds their maxima: ``micro_set`` folded them in); outside them query y sees
    rows jlo[y]..jhi[y]-1 only (``_hide`` masks the rest). One exponential sweep then runs
    over all of a..b-1."""
    _hide(pt, a, min(wa, b), jlo, jhi, mx)
    _hide(pt, max(wb, wa, a), b, jlo, jhi, mx)
    for y in range(NR):
        mx[y] = max(m[y], mx[y])  # m_new
        sh[y] = _ZERO if mx[y] == -np.inf else mx[y]  # a row that has seen no key shifts by 0
        tot[y] = _ZERO
    if b > a:
        _exp_sweep(_addr(pt, a * NR), b - a, sh.ctypes.data, tot.ctypes.data)
    for y in range(NR):
        al = fexp(m[y] - sh[y])
        l[y] = l[y] * al + tot[y]
        m[y] = mx[y]
        alpha[y] = al


@njit(nogil=True, fastmath=_FM, cache=True)
def _fwd_row(q, kp, vp, c0, c1, iv, lo, hi, g, scale, acc, m, l):
    wide_vectors()
    _fwd_tiles(q, kp, vp, c0, c1, iv, lo, hi, g, scale, acc, m, l)


@njit(nogil=True, fastmath=_FM, cache=True)
def _fwd_rows(q, kp, vp, rows, first, c0, c1, iv, lo, hi, g, scale, acc, m, l):
    wide_vectors()
    for i in range(rows.shape[0]):
        a, b = rows[i, 0] * g, rows[i, 1] * g  # the tile's rows
        t0, t1 = first[i], first[i + 1]
        ntok = rows[i, 1] - rows[i, 0]
        _fwd_tiles(q[a:b], kp, vp, c0[t0:t1], c1[t0:t1], iv[t0:t1], lo[:, :ntok], hi[:, :ntok], g, scale, acc[a:b],
                   m[a:b], l[a:b])


@njit(inline="always", fastmath=_FM, cache=True)
def _fwd_tiles(q, kp, vp, c0, c1, iv, lo, hi, g, scale, acc, m, l):
    """One query tile over its key tiles (``fwd_row``)."""
    n, d = q.shape
    dv = acc.shape[1]
    ck = vp.shape[1]
    panels = (n + NR - 1) // NR
    dvp = vp.shape[0] * MR
    widest = 0
    for t in range(c0.size):
        widest = max(widest, c1[t] - c0[t])
    qp = np.empty((panels, d, NR), np.float32)
    ot = np.empty((panels, dvp, NR), np.float32)
    pt = np.empty((widest + 2 * MR, NR), np.float32)
    ms, ls = np.empty((panels, NR), np.float32), np.empty((panels, NR), np.float32)
    lanes = np.empty((4, NR), np.float32)
    alpha, mx, sh, tot = lanes[0], lanes[1], lanes[2], lanes[3]
    jlo, jhi = np.zeros(NR, np.int64), np.zeros(NR, np.int64)
    # The tile's rows, scaled, and the running state, transposed into query panels (rows
    # past n: zero queries that see nothing, never written back).
    _lanes(q, scale, qp, n)
    for i in range(panels):
        for y in range(NR):
            r = i * NR + y
            for c in range(dvp):
                ot[i, c, y] = acc[r, c] if r < n and c < dv else _ZERO
            ms[i, y], ls[i, y] = (m[r], l[r]) if r < n else (-np.inf, _ZERO)
    for t in range(c0.size):
        col, w = c0[t], c1[t] - c0[t]
        first = col // MR
        off = col - first * MR  # row j of pt is key col - off + j
        whole = iv[t] < 0
        for i in range(panels):
            if whole:
                a, b = off, off + w
                wa, wb = a, b
            else:  # a, b: the rows some query sees; wa, wb: the rows every query sees
                a, b, wa, wb = off + w, off, off, off + w
                for y in range(NR):
                    r = i * NR + y
                    if r < n:
                        x = r // g
                        jlo[y], jhi[y] = lo[iv[t], x] + off, hi[iv[t], x] + off
                        if jhi[y] > jlo[y]:
                            a, b = min(a, jlo[y]), max(b, jhi[y])
                        wa, wb = max(wa, jlo[y]), min(wb, jhi[y])
                    else:  # a padded query: whatever it sees is never written back
                        jlo[y], jhi[y] = off, off + w
                if b <= a:  # no query of this panel sees the tile
                    continue
            for y in range(NR):
                mx[y] = -np.inf
            for kb in range(a // MR, (b + MR - 1) // MR):  # S^T = K Q^T, folding the maxima of rows wa..wb-1
                _micro_set(_addr(kp, (first + kb) * d * MR), _addr(qp, i * d * NR), d, _addr(pt, kb * MR * NR), NR,
                           mx.ctypes.data, wa - kb * MR, wb - kb * MR)
            _softmax(pt, a, b, wa, wb, jlo, jhi, ms[i], ls[i], alpha, mx, sh, tot)
            for vb in range(dvp // MR):  # O^T = alpha O^T + V^T P^T (alpha: the max moved)
                _micro_add(_addr(vp, (vb * ck + col - off + a) * MR), _addr(pt, a * NR), b - a,
                           _addr(ot, (i * dvp + vb * MR) * NR), NR, alpha.ctypes.data)
    for i in range(panels):
        for y in range(NR):
            r = i * NR + y
            if r < n:
                row = acc[r]
                for c in range(dv):
                    row[c] = ot[i, c, y]
                m[r], l[r] = ms[i, y], ls[i, y]


def fwd_row(q, kp, vp, c0, c1, iv, lo, hi, g, scale, acc, m, l):
    """``tiles.fwd_row`` on K and V packed (``pack_k``, ``pack_v`` of the block): one query
    tile over its key tiles, merged into (acc, m, l) in place. ``q`` needs contiguous rows,
    at any row stride; ``acc``, ``m``, ``l`` as ``tiles`` takes them."""
    _fwd_row(q, kp, vp, c0, c1, iv, lo, hi, g, _F(scale), acc, m, l)


def fwd_rows(q, kp, vp, rows, g, scale, acc, m, l):
    """``fwd_row`` for a run of query tiles in one call (``tile_plan.flatten``'s ``rows``):
    ``q``, ``acc``, ``m`` and ``l`` hold the run's rows, from its first tile's."""
    _fwd_rows(q, kp, vp, *rows, g, _F(scale), acc, m, l)


def packed_shape(kind, rows, cols):
    """The shape ``pack(kind, x, out)`` packs a (rows, cols) ``x`` into."""
    return (-(-rows // MR), cols, MR) if kind == "k" else (-(-cols // MR), rows, MR)


def pack(kind, x, out):
    """``pack_k`` (``kind`` "k") or ``pack_v`` ("v") of ``x`` into ``out``."""
    (pack_k if kind == "k" else pack_v)(x, out)


def _array(dtype, ndim, layout="A", readonly=False):
    return types.Array(dtype, ndim, layout, readonly=readonly)


# One compiled version of each function, as ``tiles`` does (any row stride, read-only
# inputs), so every caller shares the machine code and the disk cache entry.
_IN2, _OUT1, _OUT2 = _array(types.float32, 2, readonly=True), _array(types.float32, 1), _array(types.float32, 2)
_PACKED, _PACKED_IN = _array(types.float32, 3, "C"), _array(types.float32, 3, "C", readonly=True)
_TILES = (_array(types.int64, 1, readonly=True),) * 3 + (_array(types.int64, 2, readonly=True),) * 2 + (types.int64,)
_RUN = (_array(types.int64, 2, readonly=True), _array(types.int64, 1, readonly=True))  # span, first
_SIGNATURES = {
    pack_k: (_IN2, _PACKED),
    pack_v: (_IN2, _PACKED),
    _fwd_row: (_IN2, _PACKED_IN, _PACKED_IN) + _TILES + (types.float32, _OUT2, _OUT1, _OUT1),
    _fwd_rows: (_IN2, _PACKED_IN, _PACKED_IN) + _RUN + _TILES + (types.float32, _OUT2, _OUT1, _OUT1),
}
# The micro-kernel's IR (micro) and kernels' exp are compiled in: cached code
# older than any of the three files is flushed (``jit_cache``).
jit_cache.guard(sys.modules[__name__], (kernels, micro))
_warm = None
# Threads of one process (a framework's, at MPI_THREAD_MULTIPLE) may make their first call at
# once: one compiles, the others wait (a second compile after disable_compile() would fail).
_warm_lock = threading.Lock()


def warm():
    """Compile (or load from the disk cache) the packed path, once per process; return the
    seconds the first call took."""
    global _warm
    with _warm_lock:
        if _warm is None:
            t0 = time.perf_counter()
            for fn, signature in _SIGNATURES.items():
                fn.compile(signature)
                fn.disable_compile()
            _warm = time.perf_counter() - t0
    return _warm


def describe():
    """A phrase for the bench's preamble: the micro-kernel's shape and what its first use cost."""
    seconds = warm()
    return (f"burstmpi's packed micro-kernel ({MR} x {NR} floats, {NR // 2}-float vectors; cpu.packed) where a "
            f"block's keys meet 512 query rows or more (BURSTMPI_CPU_GEMM), ready in {seconds:.2f} s")
