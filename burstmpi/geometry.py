"""The geometry of one call: where tokens live, what each sees, and what that costs.

Every rank derives the same ``Geometry`` from what the agreement collective told it (the
global length, the layout, the mask and the documents), so the schedule of the ring, the
row blocks handed to the kernels and the pair counts in ``last_stats`` always agree
between ranks. Geometries are cached: a training loop that repeats its shapes (or its
document packing) builds each once.
"""

import functools

import numpy as np

from .layout import cache_key, layout_of
from .masks.intervals import Block, Bounds, Mask, count_visible
from .schedule import interaction_matrix

__all__ = ["Geometry", "geometry"]


class Geometry:
    """Layout, mask and visible pairs of one (layout, ranks, length, window, documents)."""

    def __init__(self, layout_name, nranks, seqlen, lo, hi, cu_seqlens=None):
        self.layout = layout_of(layout_name, nranks, seqlen, cu_seqlens)
        self.mask = Mask(Bounds.from_bounds(lo, hi), seqlen, cu_seqlens)
        self._needs = None
        self._pairs = {}
        self._blocks = {}

    def pairs(self, qrank, krank):
        """Visible (query token, key token) pairs of qrank's queries and krank's keys
        (exact, cached). Each rank asks only for the blocks it computed with."""
        n = self._pairs.get((qrank, krank))
        if n is None:
            if self.mask.dense:
                n = self.layout.count(qrank) * self.layout.count(krank)
            else:
                n = count_visible(self.query_block(qrank), self.layout.positions(krank))
            self._pairs[(qrank, krank)] = n
        return n

    def needs(self, mode):
        """needs[holder, owner]: does the holder compute with the owner's packet?

        The forward and "ring" bring keys to the holder's queries; "burst" brings
        queries to the holder's keys, so it reads the interaction matrix transposed.
        """
        if self._needs is None:
            self._needs = interaction_matrix(self.layout, self.mask)
        return self._needs.T if mode == "burst" else self._needs

    def travelling_rows(self, role, rank):
        """The local rows of ``rank``'s block that some other rank sees: only these travel
        in its packets. ``role`` "k": its keys (seen by other ranks' queries); "q": its
        queries (seeing other ranks' keys). An int64 index array, increasing, cached.

        A row's visible interval is a range of global positions, every one held by some
        rank as both query and key; the row is needed elsewhere iff that range holds a
        position its own rank does not. A document that lies on one rank, or the middle
        of a block under a narrow window, never leaves home."""
        idx = self._blocks.get(("rows", role, rank))
        if idx is None:
            block = self._block(role, rank)
            if self.mask.dense:
                idx = np.arange(len(block.pos))
            else:
                own = self.layout.positions(rank)
                inside = (np.searchsorted(own, block.last, side="right")
                          - np.searchsorted(own, block.first, side="left"))
                idx = np.nonzero(inside < block.last - block.first + 1)[0]
            self._blocks[("rows", role, rank)] = idx
        return idx

    def travelling_block(self, role, rank):
        """The ``masks.intervals.Block`` of ``rank``'s travelling rows (``travelling_rows``)."""
        b = self._blocks.get(("travelling", role, rank))
        if b is None:
            idx, full = self.travelling_rows(role, rank), self._block(role, rank)
            b = self._blocks[("travelling", role, rank)] = Block(*(x[idx] for x in full))
        return b

    def packet_rows(self, role):
        """Rows of a packet of ``role``: the most any rank sends (the same on every rank)."""
        return max(len(self.travelling_rows(role, r)) for r in range(self.layout.nranks))

    def query_block(self, rank):
        """The ``masks.intervals.Block`` of rank's rows as queries (cached)."""
        return self._block("q", rank)

    def key_block(self, rank):
        """The ``masks.intervals.Block`` of rank's rows as keys (cached)."""
        return self._block("k", rank)

    def _block(self, role, rank):
        b = self._blocks.get((role, rank))
        if b is None:
            pos = self.layout.positions(rank)
            b = self._blocks[(role, rank)] = (self.mask.query_block(pos) if role == "q"
                                              else self.mask.key_block(pos))
        return b


@functools.lru_cache(maxsize=32)
def _cached(layout_name, nranks, seqlen, lo, hi, cu_key):
    cu = None if cu_key is None else np.frombuffer(cu_key, dtype=np.int64)
    return Geometry(layout_name, nranks, seqlen, lo, hi, cu)


def geometry(layout_name, nranks, seqlen, window, cu_seqlens=None):
    """The (cached) geometry of a call; ``cu_seqlens`` are validated int64 offsets."""
    return _cached(layout_name, nranks, int(seqlen), window.lo, window.hi, cache_key(cu_seqlens))
