"""Which keys each query sees: sliding windows and causality on global positions, inside
packed documents.

The window convention is flash-attn's: a query at global position i sees the keys j with
``i - left <= j <= i + right``; -1 means unbounded on that side, and ``causal=True`` is the
window (left, 0). Internally a window is a pair of non-negative bounds ``(lo, hi)`` with
``UNBOUNDED`` standing in for -1. Documents (``cu_seqlens``, flash-attn's varlen offsets)
cut the sequence further: a query sees a key only inside its own document.

Every mask burstmpi supports is therefore an *interval* per query: query i sees exactly
the keys in ``[first(i), last(i)]`` with

    first(i) = max(i - lo, start of i's document),   last(i) = min(i + hi, end of i's document - 1)

and both ends are non-decreasing in i. Symmetrically key j is seen by the queries in
``[max(j - hi, start), min(j + lo, end - 1)]``. That one fact carries everything below:
the per-element test is two comparisons, and because every block's positions increase
along its rows, a tile's extreme rows bound the whole tile (``classify_tiles``). The
kernels in ``cuda/`` receive the same per-row intervals, so windows and documents are
one mechanism there too.

Three questions are asked, at three granularities:

* ``schedule.pair_matrix``: how many (query, key) pairs of two ranks are visible? Zero
  means a whole ring step (and possibly its transfer) is skipped. Exact.
* ``classify_tiles``: is each (query tile, key tile) pair empty, full or partial? FULL is
  exact; EMPTY is sound ("partial" is always safe, only slower).
* ``tile_mask``: the exact boolean mask of a partial tile.
"""

from typing import NamedTuple

import numpy as np

__all__ = ["UNBOUNDED", "EMPTY", "FULL", "PARTIAL", "Bounds", "Docs", "Mask", "Block",
           "classify_tiles", "tile_mask", "count_visible"]

UNBOUNDED = 1 << 62
EMPTY, FULL, PARTIAL = 0, 1, 2


class Bounds:
    """A window's normalised bounds: key j is visible from query i iff i-lo <= j <= i+hi
    (from the ``causal=`` and ``window=`` arguments; flash-attn's -1 becomes ``UNBOUNDED``)."""

    def __init__(self, causal=False, window=None):
        left, right = (-1, -1) if window is None else window
        if causal:
            if right not in (-1, 0):
                raise ValueError(
                    f"window: with causal=True the right bound must be 0 or -1, got {window!r}")
            right = 0
        self.lo = UNBOUNDED if left < 0 else int(left)
        self.hi = UNBOUNDED if right < 0 else int(right)
        self.dense = self.lo == UNBOUNDED and self.hi == UNBOUNDED

    @classmethod
    def from_bounds(cls, lo, hi):
        """A window from internal bounds (``UNBOUNDED`` for an open side)."""
        win = cls()
        win.lo, win.hi = lo, hi
        win.dense = lo == UNBOUNDED and hi == UNBOUNDED
        return win

    def __repr__(self):
        side = lambda b: -1 if b == UNBOUNDED else b
        return f"Bounds(lo={side(self.lo)}, hi={side(self.hi)})"


class Block(NamedTuple):
    """The rows of one block as the mask sees them (int64 arrays of equal length).

    ``pos`` are the rows' global positions, increasing; ``first``/``last`` bound the
    positions the rows see on the other side: keys for a query block, queries for a
    key block (first > last: none); ``start`` is where each row's document starts (0
    without documents), or its chunk or block where a mask cuts finer (``terms``), so a
    tiled backend can align its tiles to where the mask's structure changes."""
    pos: np.ndarray
    first: np.ndarray
    last: np.ndarray
    start: np.ndarray


class Docs:
    """Where each position's document starts and ends: ``cu_seqlens`` (validated offsets,
    0 .. seqlen) or one document of ``seqlen`` tokens."""

    def __init__(self, seqlen, cu_seqlens=None):
        self.seqlen = int(seqlen)
        self.cu = None if cu_seqlens is None else np.asarray(cu_seqlens, dtype=np.int64)
        if self.cu is not None and np.count_nonzero(np.diff(self.cu)) <= 1:
            self.cu = None  # a pack of one document is no pack

    def range(self, pos):
        """(start, end) of the document holding each position (end exclusive)."""
        if self.cu is None:
            return np.zeros_like(pos), np.full_like(pos, self.seqlen)
        # side="right" skips empty documents (repeated offsets).
        doc = np.searchsorted(self.cu, pos, side="right") - 1
        doc = np.clip(doc, 0, len(self.cu) - 2)
        return self.cu[doc], self.cu[doc + 1]


class Mask:
    """A window on global positions of a sequence of ``seqlen`` tokens, restricted to
    documents when ``cu_seqlens`` (validated offsets, 0 .. seqlen) is given."""

    def __init__(self, window, seqlen, cu_seqlens=None):
        self.window, self.seqlen = window, int(seqlen)
        self.docs = Docs(seqlen, cu_seqlens)
        self.cu_seqlens = self.docs.cu
        self.dense = window.dense and self.cu_seqlens is None

    def _block(self, pos, before, after):
        pos = np.asarray(pos, dtype=np.int64)
        start, end = self.docs.range(pos)
        return Block(pos, np.maximum(pos - min(before, self.seqlen), start),
                     np.minimum(pos + min(after, self.seqlen), end - 1), start)

    def query_block(self, pos):
        """A query block: each row sees the keys in [first, last]."""
        return self._block(pos, self.window.lo, self.window.hi)

    def key_block(self, pos):
        """A key block: each row is seen by the queries in [first, last]."""
        return self._block(pos, self.window.hi, self.window.lo)

    def query_terms(self, pos):
        """The query block at ``pos`` as a list of (term, block filter): one interval, no
        filter; the form ``schedule.interaction_matrix`` takes from any mask."""
        return [(self.query_block(pos), None)]

    def visible(self, qpos, kpos):
        """Boolean (len(qpos), len(kpos)) mask of visible pairs (quadratic: tests only)."""
        qb = self.query_block(qpos)
        return tile_mask(qb.first, qb.last, np.asarray(kpos, dtype=np.int64))


def count_visible(qblock, kpos):
    """Visible pairs between a query block and the keys at sorted positions ``kpos``."""
    if len(qblock.pos) == 0 or len(kpos) == 0:
        return 0
    n = (np.searchsorted(kpos, qblock.last, side="right")
         - np.searchsorted(kpos, qblock.first, side="left"))
    return int(np.maximum(n, 0).sum())


def classify_tiles(first_lo, first_hi, last_lo, last_hi, kmin, kmax):
    """EMPTY, FULL or PARTIAL for every (row tile, column tile) pair.

    Row tiles are given by the interval ends of their first and last rows (``first_lo``
    = first[row0], ``first_hi`` = first[row_last], likewise ``last``), column tiles by
    their extreme positions; all 1-D arrays. Since ``first`` and ``last`` never decrease
    along the rows, a tile is FULL iff its first row's ``last`` and its last row's
    ``first`` contain every column (exact), and EMPTY when every column lies before the
    first row's ``first`` or after the last row's ``last`` (sound). Returns an int8 array
    of shape (row tiles, column tiles).
    """
    first_lo, first_hi = np.asarray(first_lo)[:, None], np.asarray(first_hi)[:, None]
    last_lo, last_hi = np.asarray(last_lo)[:, None], np.asarray(last_hi)[:, None]
    kmin, kmax = np.asarray(kmin)[None, :], np.asarray(kmax)[None, :]
    cls = np.full(np.broadcast_shapes(first_lo.shape, kmin.shape), PARTIAL, dtype=np.int8)
    cls[(kmin >= first_hi) & (kmax <= last_lo)] = FULL
    cls[(kmax < first_lo) | (kmin > last_hi)] = EMPTY
    return cls


def tile_mask(first, last, cols):
    """Boolean (len(first), len(cols)) mask: row i sees column j iff first[i] <= cols[j] <= last[i]."""
    c = np.asarray(cols)[None, :]
    return (c >= np.asarray(first)[:, None]) & (c <= np.asarray(last)[:, None])
