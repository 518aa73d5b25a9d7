"""Causal and sliding-window masks on global positions.

The convention is flash-attn's: a query at global position i sees the keys j with
``i - left <= j <= i + right``; -1 means unbounded on that side, and ``causal=True``
is the window (left, 0). Internally a window is a pair of non-negative bounds
``(lo, hi)`` with ``UNBOUNDED`` standing in for -1.

Three questions are asked of positions, at three granularities:

* ``ranks_interact``: does any query of one rank see any key of another? Decides
  whether a whole ring step (and possibly its transfer) can be skipped. Exact.
* ``classify_tiles``: is each (query tile, key tile) pair empty, full or partial? A sound
  answer from the tiles' extreme positions; "partial" is always safe.
* ``tile_mask``: the exact boolean mask of a partial tile.
"""

import numpy as np

__all__ = ["UNBOUNDED", "EMPTY", "FULL", "PARTIAL", "Window",
           "ranks_interact", "classify_tiles", "tile_mask"]

UNBOUNDED = 1 << 62
EMPTY, FULL, PARTIAL = 0, 1, 2


class Window:
    """Normalised mask bounds: key j is visible from query i iff i-lo <= j <= i+hi."""

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


def _runs_interact(qrun, krun, win):
    (qs, qstep, qn), (ks, kstep, kn) = qrun, krun
    qlast, klast = qs + qstep * (qn - 1), ks + kstep * (kn - 1)
    # Hull test first: disjoint hulls never interact.
    if klast < qs - win.lo or ks > qlast + win.hi:
        return False
    if qstep == 1:
        # The union of the query windows is the contiguous range [qs-lo, qlast+hi],
        # so the runs interact iff some key falls inside it.
        a, b = qs - win.lo, qlast + win.hi
        first = max(0, -(-(a - ks) // kstep))  # first key index with position >= a
        return first < kn and ks + kstep * first <= b
    q = np.arange(qs, qlast + 1, qstep, dtype=np.int64)
    k = np.arange(ks, klast + 1, kstep, dtype=np.int64)
    lo_idx = np.searchsorted(k, q - min(win.lo, 1 << 40), side="left")
    hi_idx = np.searchsorted(k, q + min(win.hi, 1 << 40), side="right")
    return bool(np.any(hi_idx > lo_idx))


def ranks_interact(layout, qrank, krank, win):
    """True iff some query of ``qrank`` sees some key of ``krank`` under ``win``."""
    if win.dense:
        return True
    return any(_runs_interact(qr, kr, win)
               for qr in layout.segments(qrank) for kr in layout.segments(krank))


def classify_tiles(qmin, qmax, kmin, kmax, win):
    """EMPTY, FULL or PARTIAL for every (query tile, key tile) pair (sound).

    Takes each tile's extreme positions (1-D arrays) and returns an int array of shape
    (query tiles, key tiles). Disjoint hulls are EMPTY; a pair whose farthest keys are
    all inside every query's window is FULL; anything else is PARTIAL.
    """
    qmin, qmax = np.asarray(qmin)[:, None], np.asarray(qmax)[:, None]
    kmin, kmax = np.asarray(kmin)[None, :], np.asarray(kmax)[None, :]
    cls = np.full(np.broadcast_shapes(qmin.shape, kmin.shape), PARTIAL, dtype=np.int8)
    cls[(kmin >= qmax - win.lo) & (kmax <= qmin + win.hi)] = FULL
    cls[(kmin > qmax + win.hi) | (kmax < qmin - win.lo)] = EMPTY
    return cls


def tile_mask(qpos, kpos, win):
    """Boolean (len(qpos), len(kpos)) mask of visible pairs."""
    d = kpos[None, :] - qpos[:, None]
    return (d >= -win.lo) & (d <= win.hi)
