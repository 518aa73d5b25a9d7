"""The public masks: which keys a query sees, described once in global positions.

Pieces (key j, query i, both global positions; a document is a ``cu_seqlens`` range, the
whole sequence without it):

==========================  ==============================================================
``Causal()``                j <= i
``Window(left, right)``     i - left <= j <= i + right (flash-attn's convention; -1: unbounded)
``Sinks(n)``                j is among the first n tokens of its document
``Chunked(size)``           i and j in the same ``size``-token chunk, chunks counted from the
                            start of their document
``BlockSparse(blocks, bs)`` ``blocks[h, i // bs, j // bs]`` for query head h (blocks of shape
                            (nq, nk) for every head, or (heads, nq, nk); nq = nk = ceil(N / bs))
``PerHead([m0, m1, ...])``  query head h uses mask m_h
==========================  ==============================================================

``a & b`` and ``a | b`` combine them. The attention functions take one as ``mask=``, ANDed
with ``causal=``, ``window=`` and the same-document rule, so ``Causal() & Window(l, 0)``
is ``causal=True, window=(l, 0)`` and prefix-LM is ``Sinks(p) | Causal()`` (in each
document the first p tokens see each other; later tokens see the prefix and their past).

``visible`` evaluates a mask from these definitions as a dense boolean matrix (quadratic:
for tests and small checks). The runtime never does: it lowers a mask to disjoint monotone
intervals (``burstmpi.masks._terms``) and plans per ring step and per tile.
"""

import hashlib
import math
import numbers

import numpy as np

from . import _terms as T
from ._intervals import Docs

__all__ = ["Mask", "Causal", "Window", "Sinks", "Chunked", "BlockSparse", "PerHead"]


def _int(cls, name, value, least):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{cls}: {name}: expected an integer >= {least}, got {value!r}")
    return int(value)


def _doc_start(pos, seqlen, cu_seqlens):
    return Docs(seqlen, cu_seqlens).range(np.asarray(pos, dtype=np.int64))[0]


class Mask:
    """A mask over global positions; combine with ``&`` and ``|``.

    ``heads`` is the number of query heads a per-head mask is made for (None: the same
    mask for every head)."""

    heads = None

    def __and__(self, other):
        return And(self, _operand(other, "&"))

    def __or__(self, other):
        return Or(self, _operand(other, "|"))

    def visible(self, qpos, kpos, seqlen, cu_seqlens=None, head=0):
        """Boolean (len(qpos), len(kpos)) matrix of the pairs this mask lets through for
        query head ``head``, from the definitions (no document rule: the attention
        functions add it). Quadratic: tests only."""
        return self._visible(np.asarray(qpos, np.int64)[:, None], np.asarray(kpos, np.int64)[None, :],
                             int(seqlen), cu_seqlens, head)

    def spec(self):
        """A hashable description: equal specs, equal masks (the ranks compare digests)."""
        raise NotImplementedError

    def digest(self):
        """A short fingerprint of ``spec()`` for the ranks' agreement check."""
        return hashlib.sha256(repr(self.spec()).encode()).hexdigest()[:16]

    def check(self, fn, seqlen, heads):
        """Raise ValueError naming ``mask`` where this mask does not fit a call of ``seqlen``
        tokens and ``heads`` query heads."""
        if self.heads is not None and self.heads != heads:
            raise ValueError(f"{fn}: mask: a per-head mask for {self.heads} query heads, got q with {heads} heads")

    def terms(self, head):
        """The disjoint monotone terms of this mask for query head ``head`` (``terms``)."""
        raise NotImplementedError

    def __eq__(self, other):
        return isinstance(other, Mask) and self.spec() == other.spec()

    def __hash__(self):
        return hash(self.spec())


def _operand(other, op):
    if not isinstance(other, Mask):
        raise TypeError(f"mask {op}: expected a burstmpi.masks mask (Causal(), Window(...), Sinks(...), "
                        f"Chunked(...), BlockSparse(...), PerHead(...)), got {type(other).__name__}")
    return other


class Causal(Mask):
    """Key j is visible from query i iff j <= i."""

    def _visible(self, i, j, seqlen, cu, head):
        return np.broadcast_to(j <= i, (i.shape[0], j.shape[1]))

    def spec(self):
        return ("causal",)

    def terms(self, head):
        return [(T.Win(T.BIG, 0),)]

    def __repr__(self):
        return "Causal()"


class Window(Mask):
    """Keys ``i - left <= j <= i + right``; -1 leaves that side unbounded."""

    def __init__(self, left, right):
        self.left = _int("Window", "left", left, -1)
        self.right = _int("Window", "right", right, -1)

    def _visible(self, i, j, seqlen, cu, head):
        ok = np.ones((i.shape[0], j.shape[1]), bool)
        if self.left >= 0:
            ok &= j >= i - self.left
        if self.right >= 0:
            ok &= j <= i + self.right
        return ok

    def spec(self):
        return ("window", self.left, self.right)

    def terms(self, head):
        if self.left < 0 and self.right < 0:
            return [()]
        return [(T.Win(T.BIG if self.left < 0 else self.left, T.BIG if self.right < 0 else self.right),)]

    def __repr__(self):
        return f"Window({self.left}, {self.right})"


class Sinks(Mask):
    """Key j is visible iff it is among the first ``n`` tokens of its document."""

    def __init__(self, n):
        self.n = _int("Sinks", "n", n, 0)

    def _visible(self, i, j, seqlen, cu, head):
        jj = j[0]
        return np.broadcast_to((jj - _doc_start(jj, seqlen, cu) < self.n)[None, :], (i.shape[0], j.shape[1]))

    def spec(self):
        return ("sinks", self.n)

    def terms(self, head):
        return [(T.Sink(self.n),)] if self.n > 0 else []

    def __repr__(self):
        return f"Sinks({self.n})"


class Chunked(Mask):
    """Query i and key j see each other iff they are in the same ``size``-token chunk,
    chunks counted from the start of their document."""

    def __init__(self, size):
        self.size = _int("Chunked", "size", size, 1)

    def _visible(self, i, j, seqlen, cu, head):
        ii, jj = i[:, 0], j[0]
        si, sj = _doc_start(ii, seqlen, cu), _doc_start(jj, seqlen, cu)
        ci, cj = si + (ii - si) // self.size * self.size, sj + (jj - sj) // self.size * self.size
        return ci[:, None] == cj[None, :]

    def spec(self):
        return ("chunked", self.size)

    def terms(self, head):
        return [(T.Chunk(self.size),)]

    def __repr__(self):
        return f"Chunked({self.size})"


class BlockSparse(Mask):
    """Query i sees key j of head h only if ``blocks[h, i // block_size, j // block_size]``.

    ``blocks``: a boolean array of shape (nq, nk) (every head) or (heads, nq, nk), with
    nq = nk = ceil(N / block_size) for a call of global length N. The array is copied."""

    def __init__(self, blocks, block_size):
        self.block_size = _int("BlockSparse", "block_size", block_size, 1)
        b = np.asarray(blocks)
        if b.ndim not in (2, 3) or b.dtype != np.bool_:
            raise ValueError(f"BlockSparse: blocks: expected a boolean array of shape (nq, nk) or (heads, nq, nk), "
                             f"got {b.dtype} of shape {b.shape}")
        if b.ndim == 3 and b.shape[0] < 1:
            raise ValueError(f"BlockSparse: blocks: expected at least one head, got shape {b.shape}")
        self.blocks = np.array(b, dtype=bool, copy=True)
        self.blocks.setflags(write=False)
        self.heads = b.shape[0] if b.ndim == 3 else None
        self._digest = hashlib.sha256(np.packbits(self.blocks).tobytes()).hexdigest()[:16]
        self._terms = {}

    def _plane(self, head):
        return self.blocks[head] if self.blocks.ndim == 3 else self.blocks

    def check(self, fn, seqlen, heads):
        super().check(fn, seqlen, heads)
        nb = math.ceil(seqlen / self.block_size)
        if self.blocks.shape[-2:] != (nb, nb):
            want = (nb, nb) if self.heads is None else (self.heads, nb, nb)
            raise ValueError(f"{fn}: mask: BlockSparse blocks: expected shape {want} (ceil({seqlen} / "
                             f"{self.block_size}) blocks a side), got {self.blocks.shape}")

    def _visible(self, i, j, seqlen, cu, head):
        bs = self.block_size
        return self._plane(head)[i // bs, j // bs]

    def spec(self):
        return ("blocks", self.block_size, self.blocks.shape, self._digest)

    def terms(self, head):
        """One term: the whole line, filtered by the head's bitmap (``terms.Filter``)."""
        plane_key = head if self.heads is not None else 0
        out = self._terms.get(plane_key)
        if out is None:
            out = self._terms[plane_key] = [(T.Filter(self.block_size, self._plane(head)),)]
        return out

    def __repr__(self):
        return f"BlockSparse(<{'x'.join(map(str, self.blocks.shape))} blocks, {int(self.blocks.sum())} set>, {self.block_size})"


class PerHead(Mask):
    """Query head h uses ``masks[h]`` (GQA/MQA: heads sharing a KV head may differ)."""

    def __init__(self, masks):
        if isinstance(masks, Mask) or not hasattr(masks, "__len__"):
            raise TypeError(f"PerHead: masks: expected a list of masks, one per query head, got {type(masks).__name__}")
        masks = list(masks)
        if not masks:
            raise ValueError("PerHead: masks: expected one mask per query head, got an empty list")
        for h, m in enumerate(masks):
            if not isinstance(m, Mask):
                raise TypeError(f"PerHead: masks[{h}]: expected a burstmpi.masks mask, got {type(m).__name__}")
            if m.heads is not None:
                raise ValueError(f"PerHead: masks[{h}]: expected a mask for one head, got a per-head mask {m!r}")
        self.masks, self.heads = masks, len(masks)

    def check(self, fn, seqlen, heads):
        super().check(fn, seqlen, heads)
        for m in self.masks:
            m.check(fn, seqlen, heads)

    def _visible(self, i, j, seqlen, cu, head):
        return self.masks[head]._visible(i, j, seqlen, cu, 0)

    def spec(self):
        return ("per-head",) + tuple(m.spec() for m in self.masks)

    def terms(self, head):
        return self.masks[head].terms(head)

    def __repr__(self):
        return f"PerHead({self.masks!r})"


def _grids(mask, head):
    """(block size, grid) of every BlockSparse piece of ``mask`` that query head ``head`` uses."""
    if isinstance(mask, BlockSparse):
        return {(mask.block_size, mask.blocks.shape[-2:])}
    if isinstance(mask, PerHead):
        return _grids(mask.masks[head], 0)
    if isinstance(mask, _Combined):
        return _grids(mask.a, head) | _grids(mask.b, head)
    return set()


class _Combined(Mask):
    def __init__(self, a, b):
        if a.heads is not None and b.heads is not None and a.heads != b.heads:
            raise ValueError(f"mask {self.OP}: expected per-head masks for the same number of heads, got "
                             f"{a.heads} and {b.heads}")
        grids = set()
        for h in range(a.heads or b.heads or 1):  # the pieces one head combines
            if len(grids) <= 1:
                grids = _grids(a, h) | _grids(b, h)
        if len(grids) > 1:
            raise ValueError(f"mask {self.OP}: BlockSparse pieces: expected one block size and grid, got "
                             + ", ".join(f"block_size {bs} ({g[0]}x{g[1]} blocks)" for bs, g in sorted(grids)))
        self.a, self.b = a, b
        self.heads = a.heads if a.heads is not None else b.heads

    def check(self, fn, seqlen, heads):
        self.a.check(fn, seqlen, heads)
        self.b.check(fn, seqlen, heads)

    def spec(self):
        return (self.OP, self.a.spec(), self.b.spec())

    def __repr__(self):
        return f"({self.a!r} {self.OP} {self.b!r})"


class And(_Combined):
    OP = "&"

    def _visible(self, i, j, seqlen, cu, head):
        return self.a._visible(i, j, seqlen, cu, head) & self.b._visible(i, j, seqlen, cu, head)

    def terms(self, head):
        return T.conj(self.a.terms(head), self.b.terms(head))


class Or(_Combined):
    OP = "|"

    def _visible(self, i, j, seqlen, cu, head):
        return self.a._visible(i, j, seqlen, cu, head) | self.b._visible(i, j, seqlen, cu, head)

    def terms(self, head):
        a, b = self.a, self.b
        if isinstance(a, BlockSparse) and isinstance(b, BlockSparse) and a.block_size == b.block_size \
                and a.blocks.shape[-2:] == b.blocks.shape[-2:]:
            # Two bitmaps of one grid: their union is one bitmap, one term.
            return [(T.Filter(a.block_size, a._plane(head) | b._plane(head)),)]
        return T.disj(a.terms(head), b.terms(head))


class HeadSlice(Mask):
    """Query heads start .. start + count - 1 of a per-head mask, as heads 0 .. count - 1:
    what one member of a head-parallel group computes (``burstmpi._heads``)."""

    def __init__(self, mask, start, count):
        self.mask, self.start, self.heads = mask, int(start), int(count)

    def check(self, fn, seqlen, heads):
        super().check(fn, seqlen, heads)
        self.mask.check(fn, seqlen, self.mask.heads)

    def _visible(self, i, j, seqlen, cu, head):
        return self.mask._visible(i, j, seqlen, cu, head + self.start)

    def spec(self):
        return ("heads", self.start, self.heads, self.mask.spec())

    def terms(self, head):
        return self.mask.terms(head + self.start)

    def __repr__(self):
        return f"{self.mask!r}[heads {self.start}:{self.start + self.heads}]"


def head_slice(mask, start, count):
    """``mask`` for query heads start .. start + count - 1 only (a mask that is the same for
    every head is returned as it is)."""
    return mask if mask.heads is None else HeadSlice(mask, start, count)
