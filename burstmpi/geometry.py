"""The geometry of one call: where tokens live, what each sees, and what that costs.

Every rank derives the same ``Geometry`` from what the agreement collective told it (the
global length, the layout, the mask and the documents), so the schedule of the ring, the
row blocks handed to the kernels and the pair counts in ``last_stats`` always agree
between ranks. Geometries are cached: a training loop that repeats its shapes (or its
document packing) builds each once.
"""

import functools

import numpy as np

from .layout import layout_of
from .masks import Mask, Window
from .masks import count_visible
from .schedule import interaction_matrix

__all__ = ["Geometry", "geometry"]


class Geometry:
    """Layout, mask and visible pairs of one (layout, ranks, length, window, documents)."""

    def __init__(self, layout_name, nranks, seqlen, lo, hi, cu_seqlens=None):
        self.layout = layout_of(layout_name, nranks, seqlen, cu_seqlens)
        self.mask = Mask(Window.from_bounds(lo, hi), seqlen, cu_seqlens)
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

    def query_block(self, rank):
        """The ``masks.Block`` of rank's rows as queries (cached)."""
        return self._block("q", rank)

    def key_block(self, rank):
        """The ``masks.Block`` of rank's rows as keys (cached)."""
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
    key = None if cu_seqlens is None else np.ascontiguousarray(cu_seqlens, dtype=np.int64).tobytes()
    return _cached(layout_name, nranks, int(seqlen), window.lo, window.hi, key)
