"""Decode on the CPU: a few new queries over a long cache shard, and the merge of partials.

``decode`` is flash-decoding's local half with NumPy: the T new tokens' g query heads per
KV head form the rows of one batched GEMM against a chunk of the cache, merged chunk by
chunk into an online-softmax state, so nothing proportional to the cache is allocated (a
chunk's scores, and its keys and values converted from a half dtype, are at most about
2**20 elements whatever the cache length). The cache's
rows may be in any order (a windowed cache reuses its slots as a ring buffer): the mask
compares each row's global position with each query's visible interval.

``combine`` merges normalised partials (out, lse) in a fixed order, so that every rank,
merging the same gathered partials, gets the same bits.
"""

import numpy as np

from .numpy_tiles import online_update

__all__ = ["decode", "combine", "visible"]

_CHUNK_ELEMS = 1 << 20  # scores per chunk (B x Zkv x rows x keys)
_MAX_CHUNK = 1 << 15


def visible(kpos, qpos0, T, left):
    """(T, n) bool: may query token t (at global position qpos0 + t) see each cache row?"""
    qpos = qpos0 + np.arange(T, dtype=np.int64)[:, None]
    vis = kpos[None, :] <= qpos
    if left >= 0:
        vis &= kpos[None, :] >= qpos - left
    return vis


def decode(q, k, v, kpos, n, qpos0, left, scale, out, lse, rows=256):
    """Write the attention of queries ``q`` (B, Zkv, T, g, d) over cache rows ``0..n-1``
    of ``k`` (B, Zkv, S, d), ``v`` (B, Zkv, S, dv) into ``out`` (B, Zkv, T, g, dv) and
    ``lse`` (B, Zkv, T, g) (accumulation dtype; 0 and -inf where no key is visible).

    Query t sits at global position ``qpos0 + t`` and sees the rows whose position
    ``kpos[j]`` lies in ``[qpos0 + t - left, qpos0 + t]`` (``left < 0``: no lower bound).
    ``rows`` bounds the GEMM rows (tokens x g) of one query tile.
    """
    B, Zkv, T, g, d = q.shape
    dv = v.shape[-1]
    cd = out.dtype
    tq = max(1, rows // g)
    for t0 in range(0, T, tq):
        t1 = min(T, t0 + tq)
        nr = (t1 - t0) * g
        qt = q[:, :, t0:t1].reshape(B, Zkv, nr, d).astype(cd) * cd.type(scale)
        acc = np.zeros((B, Zkv, nr, dv), cd)
        m = np.full((B, Zkv, nr), -np.inf, cd)
        l = np.zeros((B, Zkv, nr), cd)
        # A chunk's scores, and its keys and values when they are converted from a half
        # dtype, stay within about 2**20 elements (4 MiB): bounded whatever the cache, and
        # small enough that the converted chunk is still in cache when the GEMMs read it
        # (2.4x faster for bfloat16 than 32K-key chunks, measured).
        per_key = B * Zkv * (nr + (d + dv if k.dtype != cd else 0))
        chunk = int(min(_MAX_CHUNK, max(256, _CHUNK_ELEMS // per_key)))
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            vis = visible(kpos[c0:c1], qpos0 + t0, t1 - t0, left)
            if not vis.any():
                continue
            s = qt @ k[:, :, c0:c1].astype(cd, copy=False).swapaxes(-1, -2)
            if not vis.all():
                s.reshape(B, Zkv, t1 - t0, g, c1 - c0)[...] += np.where(vis, 0, -np.inf).astype(cd)[:, None, :]
            online_update(s, v[:, :, c0:c1].astype(cd, copy=False), acc, m, l)
        seen = l != 0  # NaN too: it reaches the row, never a silent 0
        l_safe = np.where(seen, l, 1)
        out[:, :, t0:t1] = (acc / l_safe[..., None]).reshape(B, Zkv, t1 - t0, g, dv)
        lse[:, :, t0:t1] = np.where(seen, m + np.log(l_safe), -np.inf).reshape(B, Zkv, t1 - t0, g)


def combine(parts_out, parts_lse, out, lse):
    """Merge P normalised partials of R rows, ``parts_out`` (P, R, dv) and ``parts_lse``
    (P, R) (natural log; -inf for a partial that saw nothing), into ``out`` (R, dv, any
    float dtype) and ``lse`` (R,), adding the partials in the order p = 0, 1, ..., P-1.
    Rows no partial saw give 0 and -inf."""
    cd = parts_out.dtype
    m = parts_lse.max(axis=0)
    m_safe = np.where(m == -np.inf, 0, m)
    total = np.zeros(m.shape, cd)
    acc = np.zeros(parts_out.shape[1:], cd)
    for p in range(parts_out.shape[0]):
        w = np.exp(parts_lse[p] - m_safe)
        total += w
        acc += w[:, None] * parts_out[p]
    seen = total != 0  # NaN too
    safe = np.where(seen, total, 1)
    out[...] = (acc / safe[:, None]).astype(out.dtype, copy=False)
    lse[...] = np.where(seen, m_safe + np.log(safe), -np.inf)
