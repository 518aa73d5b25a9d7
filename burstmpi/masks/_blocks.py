"""A block-sparse bitmap riding on an interval term: counted, planned and applied per tile.

``BlockFilter(bs, plane)``: query i may see key j only if ``plane[i // bs, j // bs]``, on
top of its term's interval (``terms``). It is not an interval, so it is never turned into
one: a diagonal-by-diagonal form costs a term per diagonal, and a vertical stripe (a
global token, a strided head) crosses every diagonal. Instead every question the ring
asks of a term is answered with the bitmap in O(blocks):

* ``row_counts``: how many keys of a sorted set each row sees (pairs, step skipping, the
  travelling rows), by prefix sums over each block row of the bitmap: for block row b,
  ``G_b(x)`` = keys at or before x in set blocks of row b, so a row's count is
  ``G_b(last) - G_b(first - 1)``, two lookups;
* ``tile_visible``: whether a (query tile, key tile) pair of tiles that each lie inside one
  block is set: the CPU tile loops cut their tiles at block boundaries and drop the unset
  pairs, so a set block costs what a dense tile does and an unset one nothing.

The CUDA kernels read the plane itself (cuda/mask.cuh, ``BlockBits``), with the block
index of every row beside its position.
"""

import numpy as np

__all__ = ["BlockFilter"]

_CHUNK = 1 << 22  # elements of prefix sums held at once


class BlockFilter:
    """``plane[i // bs, j // bs]``: may query i see key j (``plane`` global, (nq, nk) bool)."""

    def __init__(self, bs, plane):
        self.bs, self.plane = int(bs), np.asarray(plane, dtype=bool)

    def row_counts(self, block, other=None, transpose=False):
        """For each row of ``block`` (an ``intervals.Block``), how many positions of the
        sorted ``other`` (None: every position of the sequence) lie in its interval and in
        a set block of its block row (the bitmap read transposed when the rows are keys
        and ``other`` queries)."""
        plane = self.plane.T if transpose else self.plane
        bs, n = self.bs, len(block.pos)
        ncol = plane.shape[1]
        out = np.zeros(n, np.int64)
        if n == 0 or (other is not None and len(other) == 0):
            return out
        # Prefix sums in int32 where every count fits (a block row's prefix sums are the
        # bulk of planning's time and memory at a million tokens), counted in blocks when
        # every set block holds bs keys and scaled on lookup (no product array).
        wide = np.int64 if ncol * bs >= 1 << 31 else np.int32
        if other is None:  # every position (intervals end inside the sequence: a full last block is safe)
            per_block, unit = None, bs
        else:
            other = np.asarray(other, np.int64)
            per_block, unit = np.bincount(other // bs, minlength=ncol).astype(wide), 1
        rows_b = block.pos // bs
        ub, inv = np.unique(rows_b, return_inverse=True)
        lo, hi = np.maximum(block.first, 0), np.minimum(block.last, ncol * bs - 1)
        step = max(1, _CHUNK // (ncol + 1))
        for a in range(0, len(ub), step):  # block rows in chunks: prefix sums stay small
            rows = np.nonzero((inv >= a) & (inv < a + step))[0]
            planes = plane[ub[a:a + step]]
            prefix = np.zeros((len(planes), ncol + 1), wide)
            np.cumsum(planes if per_block is None else planes * per_block, axis=1, dtype=wide, out=prefix[:, 1:])
            r = inv[rows] - a

            def G(x):  # positions of ``other`` at or before x in set blocks of each row's block row
                c = np.clip(x // bs, 0, ncol - 1)
                if other is None:
                    inside = x - c * bs + 1
                else:
                    inside = np.searchsorted(other, x, "right") - np.searchsorted(other, c * bs, "left")
                return np.where(x < 0, 0, unit * prefix[r, c].astype(np.int64) + planes[r, c] * np.maximum(inside, 0))

            ok = hi[rows] >= lo[rows]
            out[rows] = np.where(ok, G(hi[rows]) - G(lo[rows] - 1), 0)
        return out

    def count(self, qblock, kpos):
        """Visible pairs of a query block and the keys at sorted ``kpos``."""
        return int(self.row_counts(qblock, kpos).sum())

    def needed(self, block, own, role):
        """Rows of ``block`` (``role`` "q" or "k") that see, or are seen by, a position that
        ``own`` (the rank's sorted positions) does not hold."""
        t = role == "k"
        return self.row_counts(block, None, t) > self.row_counts(block, own, t)

    def tile_visible(self, qpos, kpos):
        """Set bits for tiles whose first rows are at ``qpos`` and first columns at ``kpos``
        (each tile inside one block): a (len(qpos), len(kpos)) bool array."""
        return self.plane[np.asarray(qpos) // self.bs][:, np.asarray(kpos) // self.bs]
