"""Where each rank's tokens sit in the global sequence: the layouts, for any length.

A layout maps the rows a rank holds to global token positions, always in increasing
order (the masks and the kernels rely on it). Any global length N >= 1 works at any rank
count; when N does not split evenly, chunk sizes differ by at most one token and the
larger chunks come first (``numpy.array_split``'s rule). Ranks may hold no token at all
when N < P (N < 2P for zigzag chunks).

``contiguous``
    the sequence is cut into P chunks; rank r holds chunk r. With a causal mask the late
    ranks do all the work.
``zigzag``
    the sequence is cut into 2P chunks; rank r holds chunks r and 2P-1-r. Every rank gets
    one early and one late chunk, so causal work is balanced.
    With documents (``cu_seqlens``) every document of at least 2P tokens is zigzagged on
    its own: cut into 2P chunks, rank r taking chunks r and 2P-1-r of it, so the causal
    work of each document is balanced whatever the lengths. Where a document's length is
    not a multiple of 2P, its extra tokens go to the chunk slots after those that took the
    previous document's extras (in rotation), so no slot collects every remainder and
    ranks differ by at most two tokens over the zigzagged documents. A document shorter
    than 2P cannot be zigzagged and is kept whole, on the rank holding the fewest tokens
    so far (the lowest such rank): it then needs no transfer at all.
``striped``
    global token t lives on rank t % P. Balanced, and every block pair straddles the
    diagonal by at most one token.

"contiguous" and "striped" ignore documents: their placement depends on N alone. Masks
are always evaluated on global positions, so the attention result is the same whatever
the layout; only the cost per rank changes.
"""

import functools

import numpy as np

__all__ = ["LAYOUTS", "Layout", "layout_of", "split_sizes"]

LAYOUTS = ("contiguous", "zigzag", "striped")


def split_sizes(n, parts):
    """Sizes of ``parts`` chunks of ``n`` tokens: as equal as possible, larger ones first."""
    base, extra = divmod(int(n), parts)
    return np.array([base + (i < extra) for i in range(parts)], dtype=np.int64)


class Layout:
    """Token positions of every rank for one (layout, ranks, global length, documents).

    ``cu_seqlens`` (validated offsets) changes only the zigzag layout. ``counts[r]`` is
    the number of tokens rank r holds; ``positions(r)`` their global positions.
    """

    def __init__(self, name, nranks, seqlen, cu_seqlens=None):
        if name not in LAYOUTS:
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {name!r}")
        self.name, self.nranks, self.seqlen = name, int(nranks), int(seqlen)
        P, N = self.nranks, self.seqlen
        docs = None
        if name == "zigzag" and cu_seqlens is not None:
            cu = np.asarray(cu_seqlens, dtype=np.int64)
            if np.count_nonzero(np.diff(cu)) > 1:  # one document is the plain zigzag
                docs = cu
        if name == "contiguous":
            starts = np.concatenate([[0], np.cumsum(split_sizes(N, P))])
            self._runs = [[(int(starts[r]), 1, int(starts[r + 1] - starts[r]))] for r in range(P)]
        elif name == "striped":
            self._runs = [[(r, P, len(range(r, N, P)))] for r in range(P)]
        elif docs is None:
            self._runs = self._zigzag_runs([(0, N)], keep_short=False)
        else:
            self._runs = self._zigzag_runs(list(zip(docs[:-1].tolist(), docs[1:].tolist())))
        self._runs = [[run for run in runs if run[2] > 0] for runs in self._runs]
        self.counts = np.array([sum(n for _, _, n in runs) for runs in self._runs], dtype=np.int64)
        self.max_count = int(self.counts.max())
        self._positions = {}

    def _zigzag_runs(self, documents, keep_short=True):
        """Runs of every rank: each document of >= 2P tokens zigzagged over 2P chunk slots
        (extras rotating over the slots), shorter ones whole on the emptiest rank (with
        ``keep_short``; the plain layout's one sequence is always cut in 2P chunks)."""
        P = self.nranks
        runs = [[] for _ in range(P)]
        held = np.zeros(P, dtype=np.int64)
        cursor = 0  # the slot that takes the next document's first extra token
        for start, end in documents:
            n = end - start
            if n == 0:
                continue
            if keep_short and n < 2 * P:
                r = int(np.argmin(held))
                runs[r].append((start, 1, n))
                held[r] += n
                continue
            base, extra = divmod(n, 2 * P)
            sizes = base + (((np.arange(2 * P) - cursor) % (2 * P)) < extra)
            cursor = (cursor + extra) % (2 * P)
            offsets = start + np.concatenate([[0], np.cumsum(sizes)])
            for slot in range(2 * P):
                r = slot if slot < P else 2 * P - 1 - slot
                runs[r].append((int(offsets[slot]), 1, int(sizes[slot])))
                held[r] += sizes[slot]
        # Slots were appended in slot order per document: rank r's runs increase already.
        return runs

    def count(self, rank):
        """Tokens held by ``rank``."""
        return int(self.counts[rank])

    def segments(self, rank):
        """The rank's positions as (start, step, count) runs, in local row order."""
        return self._runs[rank]

    def positions(self, rank):
        """Global positions of ``rank``'s local rows (int64, increasing), cached."""
        pos = self._positions.get(rank)
        if pos is None:
            runs = self._runs[rank]
            pos = (np.concatenate([np.arange(s, s + st * n, st, dtype=np.int64) for s, st, n in runs])
                   if runs else np.zeros(0, dtype=np.int64))
            self._positions[rank] = pos
        return pos

    def all_positions(self):
        """The positions of ranks 0..P-1 concatenated: the order of an allgather."""
        return np.concatenate([self.positions(r) for r in range(self.nranks)])

    def describe_counts(self):
        """The local lengths, for error messages (shortened for many ranks)."""
        c = self.counts.tolist()
        return str(c) if len(c) <= 16 else f"[{', '.join(map(str, c[:8]))}, ..., {c[-1]}]"


def layout_of(name, nranks, seqlen, cu_seqlens=None):
    """``Layout(...)``, cached: a training loop repeating its lengths and packings builds
    each layout once (the zigzag of many documents is a loop over them)."""
    key = None if cu_seqlens is None else np.ascontiguousarray(cu_seqlens, dtype=np.int64).tobytes()
    return _layout_of(name, int(nranks), int(seqlen), key)


@functools.lru_cache(maxsize=32)
def _layout_of(name, nranks, seqlen, cu_key):
    return Layout(name, nranks, seqlen, None if cu_key is None else np.frombuffer(cu_key, dtype=np.int64))
