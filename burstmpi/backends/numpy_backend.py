"""The NumPy backend: FlashAttention-2 style tiled local attention on the CPU.

Array layouts (row-major, chosen so that a tile of Q rows for one KV head is one
contiguous matrix and a GEMM covers the whole query-head group at once):

    query side  q, do, dq, acc : (B, Zkv, C, g, d)     g = Z // Zkv query heads per KV head
    row scalars D, lse, m, l   : (B, Zkv, C, g)
    key side    k, v, dk, dv   : (B, Zkv, C, d)

A tile is ``Tq`` tokens of the query side (``Tq * g`` GEMM rows, about ``tile_q``)
against ``Tk`` tokens of the key side. No array larger than a tile is ever created
beyond the O(C * heads * d) operands, so memory is linear in the local length.

Computation runs in the accumulation dtype (float32, or float64 for float64 inputs):
tiles of float16/bfloat16 operands are converted on the fly, since NumPy has no fast
half-precision GEMM. The running softmax state (acc, m, l) is unnormalised and lives
across ring steps, so each step's block merges into it inside the tile loop exactly as
FlashAttention-2 merges one K tile into the next.
"""

import numpy as np

from ..masks import EMPTY, PARTIAL, classify_tiles, tile_mask
from . import numpy_decode
from .tile_ops import online_update

__all__ = ["NumpyBackend"]


def _tiles(block, size):
    """Tiles of at most ``size`` rows, aligned to where the mask's structure changes.

    Rows are cut into pieces where the position spacing jumps (a zigzag rank's two
    chunks, far apart) and where a document starts. A long piece is tiled from its own
    first row, as if it were alone, so the classification finds its FULL and EMPTY tiles
    instead of tiles straddling two documents; pieces shorter than a tile (short
    documents) share one, masked per element, rather than run as many tiny GEMMs.
    """
    n = len(block.pos)
    if n == 0:
        return []
    cut = np.zeros(n, dtype=bool)
    cut[0] = True
    if n > 2:
        step = np.diff(block.pos)
        cut[1:] |= step != step[0]
    cut[1:] |= np.diff(block.start) != 0
    bounds = np.nonzero(cut)[0].tolist() + [n]
    tiles, open_tile = [], None  # open_tile: a short tile that later short pieces may join
    for a, b in zip(bounds, bounds[1:]):
        if open_tile is not None and b - open_tile[0] <= size:
            open_tile = (open_tile[0], b)
            continue
        if open_tile is not None:
            tiles.append(open_tile)
            open_tile = None
        for s in range(a, b, size):
            if min(s + size, b) - s == size:
                tiles.append((s, s + size))
            else:
                open_tile = (s, b)
    if open_tile is not None:
        tiles.append(open_tile)
    return tiles


def _extremes(pos, tiles):
    starts = np.array([a for a, _ in tiles])
    return np.minimum.reduceat(pos, starts), np.maximum.reduceat(pos, starts)


def _tile_plan(qb, kb, tq, tk):
    """Rows of (q tile, [(k tile, bias)]) without empty pairs; bias (0/-inf) if partial.

    ``qb``, ``kb`` are the ``masks.Block`` of the query and key rows; positions increase
    along both sides, so a tile's first and last rows bound its visible key intervals."""
    if len(qb.pos) == 0 or len(kb.pos) == 0:
        return []
    kpos = kb.pos
    qt, kt = _tiles(qb, tq), _tiles(kb, tk)
    r0s, r1s = np.array([a for a, _ in qt]), np.array([b - 1 for _, b in qt])
    kmin, kmax = _extremes(kpos, kt)
    cls = classify_tiles(qb.first[r0s], qb.first[r1s], qb.last[r0s], qb.last[r1s], kmin, kmax)
    plan = []
    for i, (r0, r1) in enumerate(qt):
        row = []
        for j in np.nonzero(cls[i] != EMPTY)[0]:
            c0, c1 = kt[j]
            bias = None
            if cls[i, j] == PARTIAL:
                bias = np.where(tile_mask(qb.first[r0:r1], qb.last[r0:r1], kpos[c0:c1]), 0.0, -np.inf)
            row.append((c0, c1, bias))
        if row:
            plan.append((r0, r1, row))
    return plan


class NumpyBackend:
    """Local attention kernels on host memory."""

    name = "numpy"
    xp = np

    def __init__(self, tile_q=256, tile_k=512):
        self.tile_q, self.tile_k = tile_q, tile_k

    @staticmethod
    def alloc(nbytes):
        return np.empty(nbytes, dtype=np.uint8)

    @staticmethod
    def acc_dtype(dtype):
        return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)

    def _plan(self, g, qb, kb):
        tq, tk = max(1, self.tile_q // g), self.tile_k
        # A narrow band of visible keys (a sliding window, or short documents) leaves most
        # of a large tile masked away: shrink the tiles towards half the widest query's
        # visible span.
        width = int((qb.last - qb.first).max(initial=0)) + 1
        if width < 2 * tk:
            t = max(64, 1 << int(width // 2).bit_length())
            tq, tk = min(tq, max(1, t // g)), min(tk, t)
        return _tile_plan(qb, kb, tq, tk)

    # -- forward ----------------------------------------------------------------------

    def fwd_state(self, B, Zkv, C, g, dv, acc):
        """Zeroed running state (acc, m, l) for C query tokens."""
        return (np.zeros((B, Zkv, C, g, dv), acc),
                np.full((B, Zkv, C, g), -np.inf, acc),
                np.zeros((B, Zkv, C, g), acc))

    def fwd_block(self, q, k, v, state, qb, kb, scale, poll=None):
        """Merge attention of queries ``q`` over the block (k, v) into ``state``.

        ``qb``, ``kb``: the ``masks.Block`` of the query and key rows."""
        acc, m, l = state
        B, Zkv, C, g, d = q.shape
        dv = v.shape[-1]
        cd = acc.dtype
        for r0, r1, row in self._plan(g, qb, kb):
            n = (r1 - r0) * g
            qt = q[:, :, r0:r1].reshape(B, Zkv, n, d).astype(cd) * cd.type(scale)
            acc_t = acc[:, :, r0:r1].reshape(B, Zkv, n, dv)
            m_t = m[:, :, r0:r1].reshape(B, Zkv, n)
            l_t = l[:, :, r0:r1].reshape(B, Zkv, n)
            for c0, c1, bias in row:
                s = qt @ k[:, :, c0:c1].astype(cd, copy=False).swapaxes(-1, -2)
                if bias is not None:
                    s.reshape(B, Zkv, r1 - r0, g, c1 - c0)[...] += bias[:, None, :].astype(cd)
                online_update(s, v[:, :, c0:c1].astype(cd, copy=False), acc_t, m_t, l_t)
                if poll is not None:
                    poll()

    # -- decode (burstmpi.cache) --------------------------------------------------------

    def decode(self, q, k, v, kpos, n, qpos0, left, scale, out, lse):
        """T new queries over the first ``n`` rows of a cache shard: a normalised partial
        written into ``out`` and ``lse`` (``burstmpi.backends.numpy_decode``)."""
        numpy_decode.decode(q, k, v, kpos, n, qpos0, left, scale, out, lse, rows=self.tile_q)

    @staticmethod
    def combine(parts_out, parts_lse, out, lse):
        """Merge normalised partials in a fixed order (``numpy_decode.combine``)."""
        numpy_decode.combine(parts_out, parts_lse, out, lse)

    @staticmethod
    def fwd_finalize(state, dtype):
        """Return (out, lse) from the running state, normalising ``acc`` in place.

        Rows that saw no key give 0 and -inf. ``out`` stays in the accumulation dtype
        (the ring converts it to ``dtype`` as it copies it into the caller's layout).
        """
        acc, m, l = state
        seen = l > 0
        l_safe = np.where(seen, l, 1)
        acc /= l_safe[..., None]  # in place: the accumulator becomes the output
        lse = np.where(seen, m + np.log(l_safe), -np.inf)
        return acc, lse

    # -- backward ---------------------------------------------------------------------

    @staticmethod
    def bwd_preprocess(dout, out, Zkv, acc):
        """D = rowsum(dout * out) as (B, Zkv, C, g), from (B, C, Z, dv) arrays."""
        B, C, Z, _ = dout.shape
        D = (dout.astype(acc, copy=False) * out.astype(acc, copy=False)).sum(axis=-1)
        return D.reshape(B, C, Zkv, Z // Zkv).transpose(0, 2, 1, 3)

    def bwd_block(self, q, do, D, lse, k, v, dq, dk, dv, qb, kb, scale, poll=None):
        """Accumulate the gradients of one (query block, key block) pair.

        ``lse`` must hold +inf (not -inf) for rows that see no key, so that
        exp(s - lse) is 0 there. ``dq`` accumulates dS @ K without the softmax scale
        (the owner applies it once); ``dk`` and ``dv`` are complete. ``dq=None`` or
        ``dk=dv=None`` computes only the other side's gradients (the two-way ring).
        """
        B, Zkv, C, g, d = q.shape
        dvd = v.shape[-1]
        cd = (dq if dq is not None else dk).dtype
        sc = cd.type(scale)
        for r0, r1, row in self._plan(g, qb, kb):
            n = (r1 - r0) * g
            qt = q[:, :, r0:r1].reshape(B, Zkv, n, d).astype(cd) * sc
            dot = do[:, :, r0:r1].reshape(B, Zkv, n, dvd).astype(cd, copy=False)
            Dt = D[:, :, r0:r1].reshape(B, Zkv, n, 1)
            lt = lse[:, :, r0:r1].reshape(B, Zkv, n, 1)
            dq_t = None if dq is None else dq[:, :, r0:r1].reshape(B, Zkv, n, d)
            for c0, c1, bias in row:
                kt = k[:, :, c0:c1].astype(cd, copy=False)
                vt = v[:, :, c0:c1].astype(cd, copy=False)
                p = qt @ kt.swapaxes(-1, -2)
                if bias is not None:
                    p.reshape(B, Zkv, r1 - r0, g, c1 - c0)[...] += bias[:, None, :].astype(cd)
                p -= lt
                np.exp(p, out=p)
                if dv is not None:
                    dv[:, :, c0:c1] += p.swapaxes(-1, -2) @ dot
                ds = dot @ vt.swapaxes(-1, -2)
                ds -= Dt
                ds *= p
                if dq_t is not None:
                    dq_t += ds @ kt
                if dk is not None:
                    dk[:, :, c0:c1] += ds.swapaxes(-1, -2) @ qt
                if poll is not None:
                    poll()
