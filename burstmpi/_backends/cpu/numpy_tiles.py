"""The elementwise work of a CPU tile in NumPy: the fallback and the tests' reference.

``kernels`` has ``softmax_update``, ``probs``, ``dsoftmax`` and
``widen`` compiled with numba (one fused sweep each instead of NumPy's several passes),
with these signatures: 2-D tiles of ``n`` rows, the rows of token ``r // g`` seeing the
columns ``jlo[r // g] .. jhi[r // g] - 1`` (here ``jlo``/``jhi`` may be None for a tile
every row sees whole). ``rescale_add`` has no compiled twin: the compiled loop scales the
accumulator itself and lets sgemm add P @ V. ``CpuBackend`` runs these loops or the
compiled ones (``BURSTMPI_CPU_KERNELS`` in ``burstmpi._config``).

``fwd_row`` and ``bwd_row`` are a query tile's loop over its key tiles, with
``np.matmul`` for the GEMMs, and ``bwd_rows`` a run of query tiles; ``tiles`` has them
compiled, with the same signatures (documented there). Any float dtype: float64 inputs, the reference precision, always run
here.

``online_update`` (scores already masked with -inf) is the decode's merge
(``decode``), whose cache rows may be in any order.
"""

import numpy as np

__all__ = ["fwd_row", "bwd_row", "bwd_rows", "online_update", "softmax_update", "rescale_add", "probs", "dsoftmax", "widen"]

name = "numpy"  # what the bench and the stats call this set of operations


def _hide(s, jlo, jhi, g, value=-np.inf):
    """Set the columns outside each row's visible interval to ``value``."""
    if jlo is None:
        return
    j = np.arange(s.shape[1])
    lo, hi = np.repeat(jlo, g)[:, None], np.repeat(jhi, g)[:, None]
    s[(j < lo) | (j >= hi)] = value


def online_update(s, vt, acc, m, l):
    """Merge one tile of scores ``s`` (rows x keys, masked entries -inf; overwritten) and
    its values ``vt`` into the unnormalised running state ``acc``, ``m``, ``l`` (in place),
    as FlashAttention-2 merges one K tile into the next."""
    alpha = np.empty_like(m)
    _update(s, acc.dtype, m, l, alpha)
    acc *= alpha[..., None]
    acc += s @ vt


def _update(s, cd, m, l, alpha):
    m_new = np.maximum(m, s.max(axis=-1))
    # A row with no visible key so far keeps m = -inf; shift it by 0 instead,
    # so exp() sees -inf - 0 = -inf (giving 0) rather than -inf - -inf = NaN.
    m_safe = np.where(m_new == -np.inf, 0, m_new).astype(cd, copy=False)
    alpha[...] = np.exp(m - m_safe)
    s -= m_safe[..., None]
    np.exp(s, out=s)
    l *= alpha
    l += s.sum(axis=-1)
    m[...] = m_new


def softmax_update(s, jlo, jhi, g, m, l, alpha):
    """Scores ``s`` (n x keys) become exp(s - m_new) (0 where masked); m, l updated and
    ``alpha`` = exp(m_old - m_new), the factor the caller rescales its accumulator by."""
    _hide(s, jlo, jhi, g)
    _update(s, s.dtype, m, l, alpha)


def rescale_add(acc, alpha, pv):
    """acc = acc * alpha[:, None] + pv."""
    acc *= alpha[:, None]
    acc += pv


def probs(p, jlo, jhi, g, lse):
    """p = exp(p - lse[:, None]) on the visible columns, 0 elsewhere (lse = +inf: 0; a NaN
    lse makes the visible columns NaN and leaves the others 0: it reaches only the keys
    the row sees)."""
    p -= lse[:, None]
    with np.errstate(over="ignore"):  # masked columns may overflow: they are zeroed next
        np.exp(p, out=p)
    _hide(p, jlo, jhi, g, 0.0)


def dsoftmax(ds, p, D):
    """ds = p * (ds - D[:, None]), in place."""
    ds -= D[:, None]
    ds *= p


def widen(x, out=None):
    """``x`` (float16 or bfloat16) as float32."""
    if out is None:
        return np.ascontiguousarray(x, dtype=np.float32)
    out[...] = x
    return out


def _runs(t, iv, lo, hi):
    return (None, None) if iv[t] < 0 else (lo[iv[t]], hi[iv[t]])


def _scaled(q, scale, buf, cd):
    """``q * scale`` in the scratch ``buf``."""
    qs = buf[:q.size].reshape(q.shape)
    np.multiply(q, cd.type(scale), out=qs)
    return qs


def fwd_row(q, k, v, c0, c1, iv, lo, hi, g, scale, acc, m, l, qbuf, s, alpha):
    """One query tile over its key tiles, merged into (acc, m, l) in place."""
    n, cd = q.shape[0], acc.dtype
    qs = _scaled(q, scale, qbuf, cd)
    for t in range(len(c0)):
        a, b = c0[t], c1[t]
        st = s[:n * (b - a)].reshape(n, b - a)
        np.matmul(qs, k[a:b].T, out=st)
        softmax_update(st, *_runs(t, iv, lo, hi), g, m, l, alpha)
        rescale_add(acc, alpha, st @ v[a:b])


def bwd_row(q, do, D, lse, k, v, c0, c1, iv, lo, hi, g, scale, dq, dk, dv, qbuf, p, ds):
    """One query tile's gradients over its key tiles, added into dq, dk, dv (None: skipped)."""
    n = q.shape[0]
    qs = _scaled(q, scale, qbuf, p.dtype)
    for t in range(len(c0)):
        a, b = c0[t], c1[t]
        pt, dst = p[:n * (b - a)].reshape(n, b - a), ds[:n * (b - a)].reshape(n, b - a)
        np.matmul(qs, k[a:b].T, out=pt)
        probs(pt, *_runs(t, iv, lo, hi), g, lse)
        np.matmul(do, v[a:b].T, out=dst)
        if dv is not None:
            dv[a:b] += pt.T @ do
        dsoftmax(dst, pt, D)
        if dq is not None:
            dq += dst @ k[a:b]
        if dk is not None:
            dk[a:b] += dst.T @ qs


def bwd_rows(q, do, D, lse, k, v, rows, g, scale, dq, dk, dv, qbuf, p, ds):
    """``bwd_row`` over a run of query tiles (``tile_plan.flatten``): ``q``, ``do``, ``D``,
    ``lse`` and ``dq`` hold the run's rows, from its first tile's."""
    span, first, c0, c1, iv, lo, hi = rows
    for i, (a, b) in enumerate(span):
        rs, ts = slice(a * g, b * g), slice(first[i], first[i + 1])
        bwd_row(q[rs], do[rs], D[rs], lse[rs], k, v, c0[ts], c1[ts], iv[ts], lo[:, :b - a], hi[:, :b - a], g, scale,
                None if dq is None else dq[rs], dk, dv, qbuf, p, ds)
