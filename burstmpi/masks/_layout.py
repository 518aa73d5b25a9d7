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
    With documents (``cu_seqlens``) the layout balances work document by document:
    documents short enough to place whole without unbalancing the ranks stay whole (they
    need no transfer at all); the others are zigzagged on their own, cut into 2P chunks
    of which rank r takes r and 2P-1-r, so their causal work is balanced whatever their
    lengths (``Layout._pack_documents`` has the rule). A pack of documents that are short
    next to N / P therefore moves nothing, and one long document is the plain zigzag.
``striped``
    global token t lives on rank t % P. Balanced, and every block pair straddles the
    diagonal by at most one token.

"contiguous" and "striped" ignore documents: their placement depends on N alone. Masks
are always evaluated on global positions, so the attention result is the same whatever
the layout; only the cost per rank changes.

``NAME/u`` (internal: head parallelism, ``burstmpi._heads``) is layout NAME over
``nranks * u`` ranks with each group of u consecutive ranks merged into one: group j holds
the tokens of ranks ju .. ju+u-1, in increasing position.
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
        base, _, merge = name.partition("/")
        if base not in LAYOUTS or (merge and not (merge.isdigit() and int(merge) >= 1)):
            raise ValueError(f"layout: expected one of {LAYOUTS}, got {name!r}")
        self.name, self.nranks, self.seqlen = name, int(nranks), int(seqlen)
        self._merged = bool(merge)  # runs of several ranks interleave (striped): positions sort them
        if merge:  # groups of u ranks of the base layout, merged
            u = int(merge)
            parts = Layout(base, self.nranks * u, seqlen, cu_seqlens)._runs
            self._finish([sorted(run for r in range(j * u, (j + 1) * u) for run in parts[r])
                          for j in range(self.nranks)])
            return
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
            self._runs = self._zigzag_runs([(0, N)])
        else:
            self._runs = self._pack_documents(list(zip(docs[:-1].tolist(), docs[1:].tolist())))
        self._finish(self._runs)

    def _finish(self, runs):
        self._runs = [[run for run in rank_runs if run[2] > 0] for rank_runs in runs]
        self.counts = np.array([sum(n for _, _, n in rank_runs) for rank_runs in self._runs], dtype=np.int64)
        self.max_count = int(self.counts.max())
        self._positions = {}

    def _zigzag_runs(self, documents):
        """Runs of every rank for documents each zigzagged over 2P chunk slots: rank r
        takes slots r and 2P-1-r of every document. Where a length is not a multiple of
        2P the extra tokens go to the slots after those that took the previous document's
        extras (a rotating cursor), so over many documents no slot collects them all."""
        P = self.nranks
        runs = [[] for _ in range(P)]
        cursor = 0  # the slot that takes the next document's first extra token
        for start, end in documents:
            base, extra = divmod(end - start, 2 * P)
            sizes = base + (((np.arange(2 * P) - cursor) % (2 * P)) < extra)
            cursor = (cursor + extra) % (2 * P)
            offsets = start + np.concatenate([[0], np.cumsum(sizes)])
            for slot in range(2 * P):
                r = slot if slot < P else 2 * P - 1 - slot
                runs[r].append((int(offsets[slot]), 1, int(sizes[slot])))
        return runs

    def _pack_documents(self, documents):
        """The zigzag layout of packed documents: whole where that keeps the ranks
        balanced, zigzagged where it would not.

        Work is the sum of squared document lengths (what attention inside a document
        costs, causal or not); a zigzagged document gives every rank 1/P of its tokens
        and work. Longest first, each document goes whole to the least-worked rank that
        stays within the average final load with it (work and tokens, plus 2 % each);
        one that fits nowhere is zigzagged, unless it is small (a tenth of the average
        work, or under 2P tokens, whose zigzag chunks would be single tokens): then it
        goes whole to the rank it overloads least. Last, while some rank is more than 5 %
        above the average work or 10 % above the average tokens, the longest whole
        document of the most overloaded one is zigzagged.

        Documents stay whole where they can because a zigzag cuts a document into 2P
        chunks and short chunks make small, partly masked tiles, and because while
        nothing is zigzagged no rank needs another's block at all: a pack of documents
        that are short next to N / P stays put and moves nothing. Long documents are
        balanced chunk by chunk; mixtures get both.
        """
        P = self.nranks
        docs = sorted(((a, b) for a, b in documents if b > a), key=lambda d: (d[0] - d[1], d[0]))
        # 2 % slack: a pack whose documents almost divide evenly stays whole, at the cost
        # of packets (sized for the largest rank) up to 2 % larger.
        work_cap = sum((b - a) ** 2 for a, b in docs) / P * 1.02
        token_cap = self.seqlen / P * 1.02
        work, tokens = np.zeros(P), np.zeros(P)
        whole = [[] for _ in range(P)]
        zigzag = []

        def spread(n):
            nonlocal work, tokens
            work = work + n * n / P
            tokens = tokens + n / P

        for a, b in docs:  # longest first
            n = b - a
            fits = [i for i in range(P) if work[i] + n * n <= work_cap and tokens[i] + n <= token_cap]
            if fits:
                r = min(fits, key=lambda i: (work[i], tokens[i], i))
            elif n < 2 * P or n * n <= 0.1 * work_cap:
                r = min(range(P), key=lambda i: (max((work[i] + n * n) / work_cap,
                                                     (tokens[i] + n) / token_cap), i))
            else:
                zigzag.append((a, b))
                spread(n)
                continue
            whole[r].append((a, 1, n))
            work[r] += n * n
            tokens[r] += n
        while True:
            over = np.maximum(work / (1.05 * work.mean()), tokens / (1.10 * tokens.mean()))
            r = int(np.argmax(over))
            if over[r] <= 1:
                break
            movable = [run for run in whole[r] if run[2] >= 2 * P]
            if not movable:
                break
            a, _, n = max(movable, key=lambda run: (run[2], -run[0]))
            whole[r].remove((a, 1, n))
            work[r] -= n * n
            tokens[r] -= n
            zigzag.append((a, a + n))
            spread(n)
        runs = self._zigzag_runs(sorted(zigzag))
        # Local rows in increasing global position: the masks and kernels rely on it.
        return [sorted(runs[r] + whole[r]) for r in range(P)]

    def count(self, rank):
        """Tokens held by ``rank``."""
        return int(self.counts[rank])

    def positions(self, rank):
        """Global positions of ``rank``'s local rows (int64, increasing), cached."""
        pos = self._positions.get(rank)
        if pos is None:
            runs = self._runs[rank]
            pos = (np.concatenate([np.arange(s, s + st * n, st, dtype=np.int64) for s, st, n in runs])
                   if runs else np.zeros(0, dtype=np.int64))
            if self._merged:
                pos.sort()
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
    return _layout_of(name, int(nranks), int(seqlen), cache_key(cu_seqlens))


def cache_key(cu_seqlens):
    """Hashable bytes of document offsets (None without documents), for the caches here and
    in ``burstmpi._ring.geometry``."""
    return None if cu_seqlens is None else np.ascontiguousarray(cu_seqlens, dtype=np.int64).tobytes()


@functools.lru_cache(maxsize=32)
def _layout_of(name, nranks, seqlen, cu_key):
    return Layout(name, nranks, seqlen, None if cu_key is None else np.frombuffer(cu_key, dtype=np.int64))
