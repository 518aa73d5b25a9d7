"""Masks lowered to what the ring and every backend already run: disjoint monotone intervals.

The machinery below the API (the ring's schedule, the packets' travelling rows, the CPU
tile loops and the CUDA kernels) takes a mask as one visible interval per row whose ends
never decrease along a block's rows (``intervals``). Every public mask
(``burstmpi.masks``) lowers to a few of those, exactly:

* an **atom** is a monotone interval per query position: a window ``[i - lo, i + hi]``,
  a document's first ``n`` tokens (sinks), the query's chunk, or the part of the line
  before / after another term's interval; a block-sparse mask's bitmap rides on a term
  as a filter (``Filter``, applied per tile: ``blocks``), never as intervals;
* a **term** is the intersection of atoms and the query's document: the largest first
  end and the smallest last end, both still non-decreasing, so a term is one interval
  per row, exactly what a ring step already computes;
* a mask is a **disjoint union of terms** (per head): ``a & b`` intersects every term of
  ``a`` with every term of ``b`` (pairwise disjoint still), ``a | b`` keeps ``a``'s terms
  and adds each term of ``b`` minus ``a``'s (a term minus another is two terms: the part
  before it and the part after it, and a third, inside it where its blocks are unset,
  when it has a filter).

Because the terms are disjoint, attention under the union is the terms' results merged:
the forward's online softmax merges each term's keys into the same running state, and the
backward's gradients (built from the global lse) simply add. So a ring step runs its block
pair once per term that has a visible pair there, and each run is a plain interval mask
(with, for block-sparse pieces, the bitmap on top): no backend needed a new mask form,
and every backend takes every mask.

A row that sees nothing in a term has an empty interval (first > last) placed so that the
ends stay monotone; the tile logic treats it as it treats any row outside a window.

What each key is seen by (the key side of a term, for the dK/dV kernels and the packets)
is an interval too: for monotone ends the queries that see key j are those whose last end
reaches j (a suffix) and whose first end does not pass it (a prefix). Windows, sinks and
chunks say it in closed form; other atoms find it by bisection over query positions:
O(rows log N) per block, done once per geometry and cached.
"""

import hashlib

import numpy as np

from ._blocks import BlockFilter
from ._intervals import Block, Docs

__all__ = ["Win", "Sink", "Chunk", "Before", "After", "Filter", "conj", "disj", "complement",
           "Lowered", "lower", "MAX_TERMS"]

BIG = 1 << 62  # an unbounded side; positions stay far from int64's ends (see Win)


# -- atoms: monotone intervals of key positions, per query position ---------------------
#
# ``bounds(pos, start, end, n)`` gives (first, last) for queries at ``pos`` whose documents
# are [start, end); both non-decreasing in pos. ``dual`` gives the queries that see keys at
# ``pos`` in closed form, or None (then ``_bisect`` finds them). ``seg`` is where a tiled
# backend may align its tiles (a chunk's or a block's start). ``key`` identifies the atom.


class Win:
    """Keys ``i - lo .. i + hi`` (``BIG`` for an unbounded side)."""

    def __init__(self, lo, hi):
        self.lo, self.hi = int(lo), int(hi)
        self.key = ("win", self.lo, self.hi)

    def bounds(self, pos, start, end, n):
        # min(., n): an unbounded side reaches past the sequence without overflowing int64.
        return pos - min(self.lo, n), pos + min(self.hi, n)

    def dual(self, pos, start, end, n):
        return pos - min(self.hi, n), pos + min(self.lo, n)

    def seg(self, pos, start):
        return start


class Sink:
    """The first ``count`` tokens of the query's document."""

    def __init__(self, count):
        self.count = int(count)
        self.key = ("sink", self.count)

    def bounds(self, pos, start, end, n):
        return start, start + self.count - 1

    def dual(self, pos, start, end, n):
        # A sink is seen by its whole document; any other key by no query (an empty
        # interval at the document's end keeps the ends monotone).
        sink = pos - start < self.count
        return np.where(sink, start, end), end - 1

    def seg(self, pos, start):
        return start


class Chunk:
    """The query's ``size``-token chunk, counted from the start of its document."""

    def __init__(self, size):
        self.size = int(size)
        self.key = ("chunk", self.size)

    def _chunk(self, pos, start):
        return start + (pos - start) // self.size * self.size

    def bounds(self, pos, start, end, n):
        cs = self._chunk(pos, start)
        return cs, cs + self.size - 1

    dual = bounds  # symmetric: a key is seen by its own chunk

    def seg(self, pos, start):
        return self._chunk(pos, start)


class Before:
    """Everything before ``term``'s interval (all of the line where it is empty)."""

    def __init__(self, term):
        self.term = term
        self.key = ("before", term_key(term))

    def bounds(self, pos, start, end, n):
        first, _ = term_bounds(self.term, pos, start, end, n)
        return pos - n - 1, first - 1

    dual = None

    def seg(self, pos, start):
        return start


class After:
    """Everything after ``term``'s interval; where it is empty, everything from its first
    end on, so that ``Before`` and ``After`` of a term always split the line between them
    without overlap."""

    def __init__(self, term):
        self.term = term
        self.key = ("after", term_key(term))

    def bounds(self, pos, start, end, n):
        first, last = term_bounds(self.term, pos, start, end, n)
        return np.maximum(last, first - 1) + 1, pos + n + 1

    dual = None

    def seg(self, pos, start):
        return start


class Filter:
    """A block-sparse mask's bitmap: query i may see key j only if ``plane[i // bs, j // bs]``.
    Not an interval: it leaves the bounds alone and rides on its term as a filter that the
    tile loops apply per tile (``blocks.BlockFilter``)."""

    def __init__(self, bs, plane):
        self.bs, self.plane = int(bs), plane
        digest = hashlib.sha256(np.packbits(plane).tobytes() + str(plane.shape).encode()).hexdigest()[:16]
        self.key = ("filter", self.bs, digest)

    def bounds(self, pos, start, end, n):
        return pos - n - 1, pos + n + 1

    dual = bounds

    def seg(self, pos, start):
        return np.maximum(start, pos // self.bs * self.bs)


def term_key(term):
    return tuple(a.key for a in term)


def term_bounds(term, pos, start, end, n):
    """A term's interval for queries at ``pos``: its atoms' intersection, inside documents."""
    first, last = start, end - 1
    for atom in term:
        f, l = atom.bounds(pos, start, end, n)
        first, last = np.maximum(first, f), np.minimum(last, l)
    return first, last


def _first_reaching(fn, target, n):
    """For each target t, the least i in [0, n] with fn(i) >= t (n when none), for ``fn``
    non-decreasing on [0, n): vectorised bisection, ~log2(n) evaluations."""
    lo, hi = np.zeros_like(target), np.full_like(target, n)
    while True:
        open_ = lo < hi
        if not open_.any():
            return lo
        mid = (lo + hi) // 2
        ok = np.zeros_like(open_)
        ok[open_] = fn(mid[open_]) >= target[open_]
        hi = np.where(open_ & ok, mid, hi)
        lo = np.where(open_ & ~ok, mid + 1, lo)


def _bisect(atom, docs, pos, n):
    """The queries that see keys at ``pos`` under ``atom`` alone, by bisection."""
    def side(k):
        def fn(i):
            s, e = docs.range(i)
            return atom.bounds(i, s, e, n)[k]
        return fn
    lo = _first_reaching(side(1), pos, n)            # first query whose last end reaches the key
    hi = _first_reaching(side(0), pos + 1, n) - 1    # last query whose first end is still at or before it
    return lo, hi


def term_dual(term, docs, pos, start, end, n):
    """The queries (global positions) that see keys at ``pos`` under ``term``: an interval
    per key, both ends non-decreasing."""
    first, last = start, end - 1
    for atom in term:
        d = atom.dual(pos, start, end, n) if atom.dual is not None else _bisect(atom, docs, pos, n)
        first, last = np.maximum(first, d[0]), np.minimum(last, d[1])
    return first, last


def term_seg(term, pos, start):
    seg = start
    for atom in term:
        seg = np.maximum(seg, atom.seg(pos, start))
    return seg


def term_filter(term):
    """The ``blocks.BlockFilter`` of a term's block-sparse atoms (their AND), or None."""
    planes = [a for a in term if isinstance(a, Filter)]
    if not planes:
        return None
    bs = planes[0].bs
    if any(p.bs != bs or p.plane.shape != planes[0].plane.shape for p in planes):
        raise ValueError("mask: BlockSparse pieces combined with & or |: expected one block size and grid, got "
                         + ", ".join(f"{p.bs} ({p.plane.shape[0]}x{p.plane.shape[1]} blocks)" for p in planes))
    plane = planes[0].plane
    for p in planes[1:]:
        plane = plane & p.plane
    return BlockFilter(bs, plane)


# -- unions and intersections of terms ------------------------------------------------


MAX_TERMS = 4096  # per head: past this a mask is refused by name, not planned for minutes


def conj(a, b):
    """Terms of the intersection of two disjoint unions: pairwise intersections."""
    return _capped([x + y for x in a for y in b])


def _parts(term):
    """Disjoint terms covering the line outside ``term``: before its interval, after it,
    and (with a filter) inside it where its blocks are unset. A term that is only a
    filter has nothing before or after it inside a document: one part."""
    interval = tuple(a for a in term if not isinstance(a, Filter))
    f = term_filter(term)
    parts = [] if f is not None and not interval else [(Before(interval),), (After(interval),)]
    if f is not None:
        parts.append(interval + (Filter(f.bs, ~f.plane),))
    return parts


def complement(terms):
    """Disjoint terms covering exactly what none of ``terms`` covers: every choice of one
    part outside each term (``_parts``)."""
    pieces = [()]
    for o in terms:
        pieces = _capped([p + q for p in pieces for q in _parts(o)])
    return pieces


def disj(a, b):
    """Terms of the union of two disjoint unions: one side's terms, then each of the
    other's intersected with the first side's complement. The side subtracted is the one
    whose complement has fewer terms."""
    size = lambda x: int(np.prod([len(_parts(t)) for t in x], dtype=np.float64)) if x else 1
    if size(b) * len(a) < size(a) * len(b):
        a, b = b, a
    outside = complement(a)
    return _capped(list(a) + [t + c for t in b for c in outside])


def _capped(terms):
    if len(terms) > MAX_TERMS:
        raise ValueError(f"mask: expected at most {MAX_TERMS} interval terms per head, got {len(terms)} or more; "
                         "combine block-sparse pieces in one BlockSparse (the union or intersection of their "
                         "arrays) instead of with | and &")
    return terms


class Lowered:
    """A mask on one sequence, as disjoint monotone terms per group of heads.

    ``groups`` is a list of (heads, terms): ``heads`` a tuple of query heads (None: every
    head) sharing ``terms``, a list of tuples of atoms (an empty tuple: the whole document;
    no terms: nothing visible). ``query_blocks`` / ``key_blocks`` evaluate every term on a
    block's rows (``intervals.Block`` s, grouped as ``groups``)."""

    def __init__(self, groups, docs, nheads=None):
        self.groups, self.docs, self.nheads = groups, docs, nheads
        # Each term's block filter, built once (an ANDed bitmap is a new array).
        self.filters = [[term_filter(t) for t in terms] for _, terms in groups]
        self.seqlen = docs.seqlen
        self.dense = (docs.cu is None and len(groups) == 1 and groups[0][0] is None
                      and [len(t) for t in groups[0][1]] == [0])

    def _blocks(self, pos, dual):
        pos = np.asarray(pos, dtype=np.int64)
        start, end = self.docs.range(pos)
        n = self.seqlen
        out = []
        for (heads, terms), filters in zip(self.groups, self.filters):
            blocks = []
            for term in terms:
                if dual:
                    first, last = term_dual(term, self.docs, pos, start, end, n)
                else:
                    first, last = term_bounds(term, pos, start, end, n)
                blocks.append(Block(pos, np.asarray(first, np.int64), np.asarray(last, np.int64),
                                    np.asarray(term_seg(term, pos, start), np.int64)))
            out.append((heads, blocks, filters))
        return out

    def query_blocks(self, pos):
        """Per group: (heads, the ``Block`` of query rows at ``pos`` per term (the keys each
        row sees), each term's ``blocks.BlockFilter`` or None)."""
        return self._blocks(pos, False)

    def key_blocks(self, pos):
        """As ``query_blocks`` for key rows at ``pos`` (the queries that see each row)."""
        return self._blocks(pos, True)

    def query_terms(self, pos):
        """(Block, filter) of every term at ``pos``, all groups together (what any head sees)."""
        return [(b, f) for _, blocks, filters in self.query_blocks(pos) for b, f in zip(blocks, filters)]


def lower(mask, lo, hi, docs):
    """``Lowered`` form of ``mask`` (a ``patterns.Mask`` or None) ANDed with the window
    [i - lo, i + hi] (``intervals.UNBOUNDED`` for an open side) on ``docs``. Heads whose
    terms are the same share one group, so a per-head mask with two distinct patterns
    runs as two groups, not one per head."""
    window = [()] if lo >= BIG and hi >= BIG else [(Win(lo, hi),)]
    if mask is None:
        return Lowered([(None, window)], docs)
    if mask.heads is None:
        return Lowered([(None, conj(window, mask.terms(0)))], docs)
    groups = {}
    for h in range(mask.heads):
        terms = conj(window, mask.terms(h))
        groups.setdefault(tuple(term_key(t) for t in terms), ([], terms))[0].append(h)
    if len(groups) == 1:
        return Lowered([(None, next(iter(groups.values()))[1])], docs)
    return Lowered([(tuple(heads), terms) for heads, terms in groups.values()], docs, mask.heads)
