"""The geometry of one call: where tokens live, what each sees, and what that costs.

Every rank derives the same ``Geometry`` from what the agreement collective told it (the
global length, the layout, the window, the mask and the documents), so the schedule of
the ring, the row blocks handed to the kernels and the pair counts in ``last_stats``
always agree between ranks. Geometries are cached: a training loop that repeats its
shapes (or its document packing) builds each once.

The mask arrives lowered (``burstmpi.masks._terms``): per group of query heads, a few
disjoint terms, each one monotone interval per row. A block's rows are therefore a
``BlockSet``: one ``masks._intervals.Block`` per (head group, term). A ring step computes
its block pair once per term that has a visible pair there (``pieces``).
"""

from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from ..masks._intervals import Block, count_visible
from ..masks._layout import cache_key, layout_of
from ..masks._terms import Docs, lower
from .schedule import interaction_matrix

__all__ = ["Geometry", "BlockSet", "geometry"]


class BlockSet(NamedTuple):
    """The rows of one block as every term of the mask sees them.

    ``key`` names the block (role, rank, travelling); ``groups`` is a list of (heads,
    blocks, filters): the query heads of a group (None: all), one ``Block`` per term and
    each term's ``masks._blocks.BlockFilter`` (None for a plain interval)."""
    key: tuple
    groups: list


class Geometry:
    """Layout, mask and visible pairs of one (layout, ranks, length, window, documents, mask)."""

    def __init__(self, layout_name, nranks, seqlen, lo, hi, cu_seqlens=None, mask=None):
        self.layout = layout_of(layout_name, nranks, seqlen, cu_seqlens)
        self.mask = lower(mask, lo, hi, Docs(seqlen, cu_seqlens))
        self._needs = None
        self._pairs, self._blocks, self._pieces = {}, {}, {}

    def pairs(self, qrank, krank):
        """Visible (query token, key token) pairs of qrank's queries and krank's keys,
        averaged over the query heads where a per-head mask makes them differ (exact,
        cached). Each rank asks only for the blocks it computed with."""
        n = self._pairs.get((qrank, krank))
        if n is None:
            if self.mask.dense:
                n = self.layout.count(qrank) * self.layout.count(krank)
            else:
                kpos = self.layout.positions(krank)
                n = 0
                for heads, blocks, filters in self.block("q", qrank).groups:
                    n += sum(_count(b, f, kpos) for b, f in zip(blocks, filters)) * (1 if heads is None else len(heads))
                if self.mask.nheads:
                    n //= self.mask.nheads
            self._pairs[(qrank, krank)] = n
        return n

    def loads(self, rank):
        """(as keys, as queries): the visible pairs ``rank`` computes in a backward whose
        queries travel ("burst": its keys against every rank's queries) and in one whose keys
        travel ("ring", and the forward: its queries against every rank's keys)."""
        P = self.layout.nranks
        return sum(self.pairs(o, rank) for o in range(P)), sum(self.pairs(rank, o) for o in range(P))

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

        A row's visible interval (in any term, for any head) is a range of global
        positions, every one held by some rank as both query and key; the row is needed
        elsewhere iff that range holds a position its own rank does not. A document that
        lies on one rank, or the middle of a block under a narrow window, never leaves home."""
        idx = self._blocks.get(("rows", role, rank))
        if idx is None:
            full = self.block(role, rank)
            if self.mask.dense:
                idx = np.arange(len(self.layout.positions(rank)))
            else:
                own = self.layout.positions(rank)
                need = np.zeros(len(own), dtype=bool)
                for _, blocks, filters in full.groups:
                    for b, f in zip(blocks, filters):
                        if f is not None:  # a block-sparse term: count the set blocks' positions
                            need |= f.needed(b, own, role)
                            continue
                        inside = (np.searchsorted(own, b.last, side="right")
                                  - np.searchsorted(own, b.first, side="left"))
                        need |= (b.last >= b.first) & (inside < b.last - b.first + 1)
                idx = np.nonzero(need)[0]
            self._blocks[("rows", role, rank)] = idx
        return idx

    def _readers(self, role, rank):
        """reads[h, i]: does rank h (another rank) see row i of ``rank``'s block of
        ``role`` (its key seen by h's queries, or its query seeing h's keys)? Over the
        travelling rows only, in their order; rows of the rank itself are False (cached)."""
        key = ("readers", role, rank)
        reads = self._blocks.get(key)
        if reads is None:
            idx, P = self.travelling_rows(role, rank), self.layout.nranks
            reads = np.zeros((P, len(idx)), dtype=bool)
            full = self.block(role, rank, travelling=True)
            for h in range(P):
                other = self.layout.positions(h)
                if h == rank or len(other) == 0 or len(idx) == 0:
                    continue
                if self.mask.dense:
                    reads[h] = True
                    continue
                for _, blocks, filters in full.groups:
                    for b, f in zip(blocks, filters):
                        if f is not None:
                            reads[h] |= f.row_counts(b, other, role == "k") > 0
                        else:
                            reads[h] |= (np.searchsorted(other, b.last, side="right")
                                         > np.searchsorted(other, b.first, side="left"))
            self._blocks[key] = reads
        return reads

    def route(self, role, rank, direction, arc=None):
        """How ``rank``'s packet of ``role`` travels the ring in ``direction`` (+1 or -1),
        serving the readers within ``arc`` hops (default: all of them): (order, held).

        ``order``: the rows that leave home, as positions within the travelling rows, in
        packet order: those read farthest along first, each reach in position order.
        ``held[t]``: how many of them the holder at step t has (``held[0]``: all that
        leave). A row stays aboard until its farthest reader has had it, so a packet
        shrinks as it goes and each hop carries its first ``held[t + 1]`` rows: a sink's
        few rows go on alone once the window's rows have reached their one reader (cached)."""
        P = self.layout.nranks
        arc = P - 1 if arc is None else arc

        def when():
            step = (direction * (np.arange(P) - rank)) % P  # when each rank holds the packet
            return np.where(step <= arc, step, 0)            # the other way serves those past the arc
        return self.route_along(role, rank, (direction, arc), when)

    def route_along(self, role, rank, path, when):
        """``route`` for a packet that reaches the ranks in any order: ``when()`` gives the
        step at which each rank holds it (0: never, or it is the owner), ``path`` names that
        order for the cache (the two-level ring's: ``burstmpi._ring.twolevel``)."""
        key = ("route", role, rank, path)
        out = self._blocks.get(key)
        if out is None:
            P = self.layout.nranks
            reads = self._readers(role, rank)
            reach = (reads * np.asarray(when())[:, None]).max(axis=0) if P > 1 else np.zeros(reads.shape[1], np.int64)
            leave = np.count_nonzero(reach)
            order = np.lexsort((np.arange(len(reach)), -reach))[:leave]
            held = np.array([leave] + [int(np.count_nonzero(reach >= t)) for t in range(1, P)], dtype=np.int64)
            out = self._blocks[key] = (order, held)
        return out

    def carried(self, role, owner, direction, t, arc=None):
        """What the holder at step t computes on from ``owner``'s packet (``route``):
        (a, b, BlockSet) for each run of its rows [a, b) whose positions increase (one run
        per reach, fewer where runs follow on in position) (cached)."""
        arc = self.layout.nranks - 1 if arc is None else arc
        self.route(role, owner, direction, arc)
        return self.carried_along(role, owner, (direction, arc), t)

    def carried_along(self, role, owner, path, t):
        """``carried`` for a packet on ``path``, whose ``route_along`` was made before."""
        key = ("carried", role, owner, path, t)
        out = self._blocks.get(key)
        if out is None:
            order, held = self._blocks[("route", role, owner, path)]
            rows = order[:held[t]]
            cuts = np.flatnonzero(np.diff(rows) < 0) + 1
            full = self.block(role, owner, travelling=True)
            out = []
            for i, (a, b) in enumerate(zip(np.r_[0, cuts], np.r_[cuts, len(rows)])):
                sel = rows[a:b]
                groups = [(heads, [Block(*(x[sel] for x in blk)) for blk in blocks], filters)
                          for heads, blocks, filters in full.groups]
                out.append((int(a), int(b), BlockSet(key + (i,), groups)))
            self._blocks[key] = out
        return out

    def packet_rows(self, role):
        """Rows of a packet of ``role``: the most any rank sends (the same on every rank)."""
        return max(len(self.travelling_rows(role, r)) for r in range(self.layout.nranks))

    def block(self, role, rank, travelling=False):
        """The ``BlockSet`` of ``rank``'s rows as queries (``role`` "q") or keys ("k"):
        all of them, or only those that travel in its packets (cached)."""
        key = (role, rank, bool(travelling))
        b = self._blocks.get(key)
        if b is None:
            if travelling:
                idx, full = self.travelling_rows(role, rank), self.block(role, rank)
                groups = [(heads, [Block(*(x[idx] for x in blk)) for blk in blocks], filters)
                          for heads, blocks, filters in full.groups]
            else:
                pos = self.layout.positions(rank)
                groups = self.mask.query_blocks(pos) if role == "q" else self.mask.key_blocks(pos)
            b = self._blocks[key] = BlockSet(key, groups)
        return b

    def pieces(self, qset, kset):
        """What a block pair computes: (heads, query Block, key Block, block filter or None)
        for every head group and term with a visible pair between the two (cached)."""
        key = (qset.key, kset.key)
        out = self._pieces.get(key)
        if out is None:
            out = []
            for (heads, qbs, fs), (_, kbs, _) in zip(qset.groups, kset.groups):
                for qb, kb, f in zip(qbs, kbs, fs):
                    if len(qb.pos) and len(kb.pos) and (self.mask.dense or _count(qb, f, kb.pos) > 0):
                        out.append((heads, qb, kb, f))
            self._pieces[key] = out
        return out


def _count(qblock, filt, kpos):
    """Visible pairs of a term's query block and the keys at ``kpos``."""
    return count_visible(qblock, kpos) if filt is None else filt.count(qblock, kpos)


_CACHE, _KEPT = OrderedDict(), 32


def geometry(layout_name, nranks, seqlen, window, cu_seqlens=None, mask=None):
    """The (cached) geometry of a call; ``cu_seqlens`` are validated int64 offsets, ``mask``
    a checked ``burstmpi.masks`` mask or None."""
    key = (layout_name, nranks, int(seqlen), window.lo, window.hi, cache_key(cu_seqlens),
           None if mask is None else mask.spec())
    geo = _CACHE.pop(key, None)
    if geo is None:
        geo = Geometry(layout_name, nranks, int(seqlen), window.lo, window.hi, cu_seqlens, mask)
        if len(_CACHE) >= _KEPT:
            _CACHE.popitem(last=False)
    _CACHE[key] = geo
    return geo
