"""Where each rank's tokens sit in the global sequence, and ``shard`` / ``unshard``.

A layout maps the ``seqlen_local`` rows a rank holds to global token positions:

``contiguous``
    rank r holds chunk r of P equal chunks. Simple; with a causal mask the late ranks
    do all the work.
``zigzag``
    the sequence is cut into 2P chunks and rank r holds chunks r and 2P-1-r, in that
    order. Every rank gets one early and one late chunk, so causal work is balanced.
``striped``
    global token t lives on rank t % P. Balanced, and every block pair straddles the
    diagonal by at most one token.

Masks are always evaluated on global positions, so the attention result is the same
whatever the layout; only the cost per rank changes.
"""

import numpy as np

__all__ = ["LAYOUTS", "Layout", "layout_for"]

LAYOUTS = ("contiguous", "zigzag", "striped")


class Layout:
    """Token positions of every rank for one (layout, ranks, seqlen_local)."""

    def __init__(self, name, nranks, seqlen_local):
        if name not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {name!r}")
        if name == "zigzag" and seqlen_local % 2:
            raise ValueError(
                f"layout='zigzag': seqlen_local must be even (two chunks per rank), got {seqlen_local}")
        self.name = name
        self.nranks = nranks
        self.seqlen_local = seqlen_local
        self.seqlen = nranks * seqlen_local

    def segments(self, rank):
        """Return the rank's positions as (start, step, count) runs, in local row order."""
        P, C = self.nranks, self.seqlen_local
        if self.name == "contiguous":
            return [(rank * C, 1, C)]
        if self.name == "zigzag":
            h = C // 2
            return [(rank * h, 1, h), ((2 * P - 1 - rank) * h, 1, h)]
        return [(rank, P, C)]

    def positions(self, rank):
        """Return the global position of each local row of ``rank`` (int64, length C)."""
        return np.concatenate([np.arange(s, s + st * n, st, dtype=np.int64)
                               for s, st, n in self.segments(rank)])

    def all_positions(self):
        """Return the positions of ranks 0..P-1 concatenated: the order of an allgather."""
        return np.concatenate([self.positions(r) for r in range(self.nranks)])


def layout_for(name, nranks, seqlen, *, argname="seqlen"):
    """Build the layout for a global length, refusing lengths that do not split evenly."""
    if name not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {name!r}")
    parts = 2 * nranks if name == "zigzag" else nranks
    if seqlen % parts:
        raise ValueError(
            f"{argname}: a global length of {seqlen} does not split into {parts} equal "
            f"chunks (layout={name!r}, {nranks} ranks); pad the sequence to a multiple of {parts}")
    return Layout(name, nranks, seqlen // nranks)
