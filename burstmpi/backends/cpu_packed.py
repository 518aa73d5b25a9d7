"""The CPU backend's float32 tiles on operands packed once, on our own micro-kernel.

BLAS's ``sgemm`` repacks both of its operands on every call. For a 512 x 512 tile that is
a small share of the work, but a block-sparse mask's tiles are 128 x 128 (its blocks), and
there the forward's copies come to four per visible pair (Q, K, P, V) against 1.75 for a
512 x 512 tile: 7.1-8.3 ns a pair against 6.3-6.9 on one AVX2 core (2026-12-03). Here
every operand is laid out once, in the order ``cpu_micro``'s micro-kernel reads it:

- K and V once per block: ``pack_k`` in panels of ``MR`` rows (``kp[i, c, x] = k[MR * i +
  x, c]``), ``pack_v`` in panels of ``MR`` columns (``vp[i, j, x] = v[j, MR * i + x]``);
- a query tile's rows once per row of tiles, in panels of ``NR`` queries (``qp[i, c, y] =
  scale * q[NR * i + y, c]``);
- and the scores come out of the micro-kernel laid out as the next GEMM reads them. The
  kernel computes S^T = K Q^T: keys down, a panel's ``NR`` queries across. So the softmax
  runs across queries, one vector lane per query, and P^T is the right-hand operand of
  O^T = V^T P^T as it lies. The output accumulates transposed (value columns down,
  queries across) and goes back to the caller's (n, dv) rows once per row of tiles.

The forward's tiles then pay no copy per pair: two GEMMs in the micro-kernel, whose first
also folds each query's running max in, and one exponential sweep. The backward computes
S^T and dP^T = V dO^T the same way, dQ^T += K^T dS^T with K packed by columns, and dV =
P^T dO, dK = dS^T Q per key tile over the whole row of queries, from P^T and dS^T
transposed once (the one copy a pair it keeps) into key panels.

Keys need not start at a multiple of ``MR``: a tile from column c0 starts at the panel
holding c0 and ignores the rows before it (``c0 % MR``) and past its end; K, V and the
query rows are zero-padded to whole panels. Per query panel only the key panels some
query of it sees are computed (a causal diagonal tile costs about half of a whole one),
and elements are tested only in tiles that are partly visible (``iv >= 0``), with
``cpu_kernels``' arithmetic: the same exp (exactly 0 below -87), the same rules for rows
that see nothing (m stays -inf, alpha 1; an lse of +inf gives P = 0) and for NaN (it
reaches the row's output and lse). Results are bitwise reproducible; they differ from
``cpu_tiles``' in rounding only (another summation order).
"""

import time

import numpy as np
from numba import njit, types

from .cpu_kernels import _FM, _exp_reduced, _fmax, fexp, wide_vectors
from .cpu_micro import (LANES, MR, NR, available, exp_sweep as _exp_sweep, micro_add as _micro_add, micro_add_rows,
                        micro_set as _micro_set, micro_set_rows)

__all__ = ["LANES", "MR", "NR", "available", "fwd_row", "bwd_row", "warm", "describe"]


_F = np.float32
_ZERO, _ONE = _F(0.0), _F(1.0)
_LO, _HI = _F(-87.0), _F(88.0)


@njit(inline="always", fastmath=_FM, cache=True)
def _exp(x):
    """e^x as ``cpu_micro.exp_sweep`` computes it, for one element: exactly 0 below -87 (and
    for -inf), NaN for NaN (``cpu_kernels.fexp`` gives 0 there: a NaN score must reach
    its row)."""
    return _ZERO if x < _LO else _exp_reduced(min(x, _HI))


@njit(inline="always", cache=True)
def _addr(x, i):
    """Address of element ``i`` of the contiguous float32 array ``x``."""
    return x.ctypes.data + 4 * i


@njit(inline="always", cache=True)
def _at(x, row, col):
    """Address of x[row, col] (float32, contiguous rows, any row stride)."""
    return x.ctypes.data + row * x.strides[0] + 4 * col


@njit(inline="always", cache=True)
def _rows_of(x):
    """Floats from one row of ``x`` to the next."""
    return x.strides[0] // 4


@njit(inline="always", cache=True)
def _set(rows, a, sx, sp, b, kc, c, ldc, mx, rlo, rhi):
    """``micro_set``, or its variant for the last ``rows`` < MR rows of a matrix."""
    if rows >= MR:
        _micro_set(a, sx, sp, b, kc, c, ldc, mx, rlo, rhi)
    else:
        micro_set_rows(rows, a, sx, sp, b, kc, c, ldc, mx, rlo, rhi)


@njit(inline="always", cache=True)
def _add(rows, a, sx, sp, b, kc, c, ldc):
    """``micro_add``, or its variant for the last ``rows`` < MR rows of a matrix."""
    if rows >= MR:
        _micro_add(a, sx, sp, b, kc, c, ldc)
    else:
        micro_add_rows(rows, a, sx, sp, b, kc, c, ldc)


@njit(inline="always", fastmath=_FM, cache=True)
def _softmax(pt, a, b, whole, jlo, jhi, m, l, alpha, mx, sh, tot):
    """One query panel's running softmax over rows a..b-1 of ``pt`` (keys down, ``NR``
    queries across): ``pt`` becomes P^T there, and m, l, alpha become what
    ``cpu_kernels.softmax_update`` makes of them. ``whole``: every query sees every row,
    and ``mx`` already holds their maxima (``_micro_set`` folded them in); else query y
    sees rows jlo[y]..jhi[y]-1 only, and the others become 0."""
    if not whole:
        for y in range(NR):
            mx[y] = -np.inf
        for j in range(a, b):
            row = pt[j]
            for y in range(NR):
                if jlo[y] <= j and j < jhi[y]:
                    mx[y] = _fmax(mx[y], row[y])
    for y in range(NR):
        mx[y] = max(m[y], mx[y])  # m_new
        sh[y] = _ZERO if mx[y] == -np.inf else mx[y]  # a row that has seen no key shifts by 0
    if whole:
        _exp_sweep(_addr(pt, a * NR), b - a, sh.ctypes.data, tot.ctypes.data)
    else:
        for y in range(NR):
            tot[y] = _ZERO
        for j in range(a, b):
            row = pt[j]
            for y in range(NR):
                e = _exp(row[y] - sh[y]) if jlo[y] <= j and j < jhi[y] else _ZERO
                row[y] = e
                tot[y] += e
    for y in range(NR):
        al = fexp(m[y] - sh[y])
        l[y] = l[y] * al + tot[y]
        m[y] = mx[y]
        alpha[y] = al


@njit(nogil=True, fastmath=_FM, cache=True)
def _fwd_row(q, k, v, c0, c1, iv, lo, hi, g, scale, acc, m, l):
    wide_vectors()
    n, d = q.shape
    dv = acc.shape[1]
    ck, sk, sv = k.shape[0], _rows_of(k), _rows_of(v)
    panels = (n + NR - 1) // NR
    dvp = (dv + MR - 1) // MR * MR
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
    for i in range(panels):
        for y in range(NR):
            r = i * NR + y
            if r < n:
                src = q[r]
                for c in range(d):
                    qp[i, c, y] = src[c] * scale
                row = acc[r]
                for c in range(dv):
                    ot[i, c, y] = row[c]
                ms[i, y], ls[i, y] = m[r], l[r]
            else:
                for c in range(d):
                    qp[i, c, y] = _ZERO
                for c in range(dv):
                    ot[i, c, y] = _ZERO
                ms[i, y], ls[i, y] = -np.inf, _ZERO
            for c in range(dv, dvp):
                ot[i, c, y] = _ZERO
    for t in range(c0.size):
        col, w = c0[t], c1[t] - c0[t]
        first = col // MR
        off = col - first * MR  # row j of pt is key col - off + j
        whole = iv[t] < 0
        for i in range(panels):
            if whole:
                a, b = off, off + w
            else:
                a, b = off + w, off
                for y in range(NR):
                    r = i * NR + y
                    if r < n:
                        x = r // g
                        jlo[y], jhi[y] = lo[iv[t], x] + off, hi[iv[t], x] + off
                        if jhi[y] > jlo[y]:
                            a, b = min(a, jlo[y]), max(b, jhi[y])
                    else:
                        jlo[y], jhi[y] = 0, 0
                if b <= a:  # no query of this panel sees the tile
                    continue
            for y in range(NR):
                mx[y] = -np.inf
            for kb in range(a // MR, (b + MR - 1) // MR):  # S^T = K Q^T, and (whole tiles) each query's max
                rlo, rhi = (a - kb * MR, b - kb * MR) if whole else (0, 0)
                key = col - off + kb * MR
                _set(ck - key, _at(k, key, 0), sk, 1, _addr(qp, i * d * NR), d, _addr(pt, kb * MR * NR), NR,
                     mx.ctypes.data, rlo, rhi)
            _softmax(pt, a, b, whole, jlo, jhi, ms[i], ls[i], alpha, mx, sh, tot)
            rescale = False
            for y in range(NR):
                rescale |= alpha[y] != _ONE
            if rescale:  # the panel's max moved: O^T *= alpha, column by column
                for c in range(dv):
                    orow = ot[i, c]
                    for y in range(NR):
                        orow[y] *= alpha[y]
            for vb in range(dvp // MR):  # O^T += V^T P^T
                _add(dv - vb * MR, _at(v, col - off + a, vb * MR), 1, sv, _addr(pt, a * NR), b - a,
                     _addr(ot, (i * dvp + vb * MR) * NR), NR)
    for i in range(panels):
        for y in range(NR):
            r = i * NR + y
            if r < n:
                row = acc[r]
                for c in range(dv):
                    row[c] = ot[i, c, y]
                m[r], l[r] = ms[i, y], ls[i, y]


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


@njit(inline="always", cache=True)
def _chunks(x, scale, out, n):
    """``out[i, r, c] = scale * x[r, NR * i + c]``: rows of ``x`` cut into ``NR``-column chunks
    (a GEMM's right-hand operand when the rows are its sum's index), zero past row n and
    past x's columns."""
    cols = x.shape[1]
    for r in range(out.shape[1]):
        for i in range(out.shape[0]):
            dst = out[i, r]
            for c in range(NR):
                j = i * NR + c
                dst[c] = x[r, j] * scale if r < n and j < cols else _ZERO


@njit(inline="always", fastmath=_FM, cache=True)
def _probs(pt, a, b, whole, jlo, jhi, lse, scratch):
    """Rows a..b-1 of ``pt`` (S^T of one query panel) become P^T = exp(S^T - lse), 0 where
    query y does not see the row (rows jlo[y]..jhi[y]-1 unless ``whole``), 0 for an lse of
    +inf."""
    if whole:
        _exp_sweep(_addr(pt, a * NR), b - a, lse.ctypes.data, scratch.ctypes.data)
        return
    for j in range(a, b):
        row = pt[j]
        for y in range(NR):
            row[y] = _exp(row[y] - lse[y]) if jlo[y] <= j and j < jhi[y] else _ZERO


@njit(inline="always", fastmath=_FM, cache=True)
def _transpose(src, a, b, r0, r1, out, i):
    """Query panel ``i``'s rows (keys) r0..r1-1 (whole panels) of ``src`` (keys down, queries
    across) into ``out[k, NR * i + y, x] = src[MR * k + x, y]``, 0 outside a..b-1: the
    left-hand operand of dV = P^T dO and dK = dS^T Q, summed over the queries."""
    for kb in range(r0 // MR, r1 // MR):
        panel = out[kb]
        for y in range(NR):
            dst = panel[i * NR + y]
            for x in range(MR):
                j = kb * MR + x
                dst[x] = src[j, y] if a <= j and j < b else _ZERO


@njit(nogil=True, fastmath=_FM, cache=True)
def _bwd_row(q, do, D, lse, k, v, c0, c1, iv, lo, hi, g, scale, dq, dk, dv):
    wide_vectors()
    n, d = q.shape
    dvd = do.shape[1]
    ck, sk, sv = k.shape[0], _rows_of(k), _rows_of(v)
    panels = (n + NR - 1) // NR
    npad = panels * NR
    dpad = (d + MR - 1) // MR * MR
    dq_on, dkv_on = dq.size > 0, dk.size > 0
    widest = 0
    for t in range(c0.size):
        widest = max(widest, c1[t] - c0[t])
    wpad = (widest + 2 * MR - 1) // MR * MR
    d16, dv16 = (d + NR - 1) // NR, (dvd + NR - 1) // NR
    qp, dop = np.empty((panels, d, NR), np.float32), np.empty((panels, dvd, NR), np.float32)
    _lanes(q, scale, qp, n)
    _lanes(do, _ONE, dop, n)
    if dkv_on:  # the right-hand operands of dK = dS^T Q and dV = P^T dO
        qc, doc = np.empty((d16, npad, NR), np.float32), np.empty((dv16, npad, NR), np.float32)
        _chunks(q, scale, qc, n)
        _chunks(do, _ONE, doc, n)
        ptp, dsp = np.zeros((wpad // MR, npad, MR), np.float32), np.zeros((wpad // MR, npad, MR), np.float32)
        dkt, dvt = np.empty((wpad, d16 * NR), np.float32), np.empty((wpad, dv16 * NR), np.float32)
    dqt = np.zeros((panels, dpad, NR), np.float32)
    lses, Ds = np.empty((panels, NR), np.float32), np.zeros((panels, NR), np.float32)
    for i in range(panels):
        for y in range(NR):
            r = i * NR + y
            lses[i, y] = lse[r] if r < n else np.inf
            if r < n:
                Ds[i, y] = D[r]
    pt, dpt = np.empty((wpad, NR), np.float32), np.empty((wpad, NR), np.float32)
    scratch = np.empty(NR, np.float32)
    jlo, jhi = np.zeros(NR, np.int64), np.zeros(NR, np.int64)
    span = np.zeros(2, np.int64)
    for t in range(c0.size):
        col, w = c0[t], c1[t] - c0[t]
        first = col // MR
        off = col - first * MR  # row j of pt is key col - off + j
        whole = iv[t] < 0
        span[0], span[1] = wpad, 0  # the panel rows any query of the row sees
        for i in range(panels):
            if whole:
                a, b = off, off + w
            else:
                a, b = off + w, off
                for y in range(NR):
                    r = i * NR + y
                    if r < n:
                        x = r // g
                        jlo[y], jhi[y] = lo[iv[t], x] + off, hi[iv[t], x] + off
                        if jhi[y] > jlo[y]:
                            a, b = min(a, jlo[y]), max(b, jhi[y])
                    else:
                        jlo[y], jhi[y] = 0, 0
            if b <= a:  # no query of this panel sees the tile
                continue
            r0, r1 = a // MR * MR, (b + MR - 1) // MR * MR
            for kb in range(r0 // MR, r1 // MR):  # S^T = K Q^T and dP^T = V dO^T
                key = col - off + kb * MR
                _set(ck - key, _at(k, key, 0), sk, 1, _addr(qp, i * d * NR), d, _addr(pt, kb * MR * NR), NR,
                     scratch.ctypes.data, 0, 0)
                _set(ck - key, _at(v, key, 0), sv, 1, _addr(dop, i * dvd * NR), dvd, _addr(dpt, kb * MR * NR), NR,
                     scratch.ctypes.data, 0, 0)
            _probs(pt, a, b, whole, jlo, jhi, lses[i], scratch)
            for j in range(a, b):  # dS^T = P^T (dP^T - D)
                prow, drow = pt[j], dpt[j]
                for y in range(NR):
                    drow[y] = prow[y] * (drow[y] - Ds[i, y])
            if dq_on:  # dQ^T += K^T dS^T
                for vb in range(dpad // MR):
                    _add(d - vb * MR, _at(k, col - off + a, vb * MR), 1, sk, _addr(dpt, a * NR), b - a,
                         _addr(dqt, (i * dpad + vb * MR) * NR), NR)
            if dkv_on:  # this panel's queries in the transposed operands (other panels' stay 0)
                span[0], span[1] = min(span[0], r0), max(span[1], r1)
                _transpose(pt, a, b, r0, r1, ptp, i)
                _transpose(dpt, a, b, r0, r1, dsp, i)
        if dkv_on and span[1] > span[0]:
            for kb in range(span[0] // MR, span[1] // MR):  # the tile's dV = P^T dO and dK = dS^T Q
                for jb in range(dv16):
                    _micro_set(_addr(ptp, kb * npad * MR), 1, MR, _addr(doc, jb * npad * NR), npad,
                               _addr(dvt, kb * MR * dv16 * NR + jb * NR), dv16 * NR, scratch.ctypes.data, 0, 0)
                for jb in range(d16):
                    _micro_set(_addr(dsp, kb * npad * MR), 1, MR, _addr(qc, jb * npad * NR), npad,
                               _addr(dkt, kb * MR * d16 * NR + jb * NR), d16 * NR, scratch.ctypes.data, 0, 0)
            for j in range(max(span[0], off), min(span[1], off + w)):
                krow, vrow, key = dkt[j], dvt[j], col - off + j
                for c in range(d):
                    dk[key, c] += krow[c]
                for c in range(dvd):
                    dv[key, c] += vrow[c]
            for i in range(panels):  # leave the transposed operands zero for the next tile
                for kb in range(span[0] // MR, span[1] // MR):
                    for y in range(NR):
                        for x in range(MR):
                            ptp[kb, i * NR + y, x] = _ZERO
                            dsp[kb, i * NR + y, x] = _ZERO
    if dq_on:
        for i in range(panels):
            for y in range(NR):
                r = i * NR + y
                if r < n:
                    row = dq[r]
                    for c in range(d):
                        row[c] += dqt[i, c, y]


def bwd_row(q, do, D, lse, k, v, c0, c1, iv, lo, hi, g, scale, dq, dk, dv):
    """``cpu_tiles.bwd_row`` on the micro-kernel: one query tile's gradients over its key
    tiles, added into dq, dk, dv (None: that side skipped). Matrices need contiguous rows,
    at any row stride."""
    empty = np.empty((0, 0), np.float32)
    dq, dk, dv = (empty if x is None else x for x in (dq, dk, dv))
    _bwd_row(q, do, D, lse, k, v, c0, c1, iv, lo, hi, g, _F(scale), dq, dk, dv)


def fwd_row(q, k, v, c0, c1, iv, lo, hi, g, scale, acc, m, l):
    """``cpu_tiles.fwd_row`` on the micro-kernel: one query tile over its key tiles, merged
    into (acc, m, l) in place. Matrices need contiguous rows, at any row stride."""
    _fwd_row(q, k, v, c0, c1, iv, lo, hi, g, _F(scale), acc, m, l)


def _array(dtype, ndim, layout="A", readonly=False):
    return types.Array(dtype, ndim, layout, readonly=readonly)


# One compiled version of each function, as ``cpu_tiles`` does (any row stride, read-only
# inputs), so every caller shares the machine code and the disk cache entry.
_IN2, _OUT1, _OUT2 = _array(types.float32, 2, readonly=True), _array(types.float32, 1), _array(types.float32, 2)
_IN1 = _array(types.float32, 1, readonly=True)
_TILES = (_array(types.int64, 1, readonly=True),) * 3 + (_array(types.int64, 2, readonly=True),) * 2 + (types.int64,)
_SIGNATURES = {
    _fwd_row: (_IN2, _IN2, _IN2) + _TILES + (types.float32, _OUT2, _OUT1, _OUT1),
    _bwd_row: (_IN2, _IN2, _IN1, _IN1, _IN2, _IN2) + _TILES + (types.float32, _OUT2, _OUT2, _OUT2),
}
_warm = None


def warm():
    """Compile (or load from the disk cache) the packed path, once per process; return the
    seconds the first call took."""
    global _warm
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
    return (f"burstmpi's packed micro-kernel ({MR} x {NR} floats, {NR // 2}-float vectors; cpu_packed) where a "
            f"block's keys meet 64 query rows or more (BURSTMPI_CPU_GEMM), ready in {seconds:.2f} s")
