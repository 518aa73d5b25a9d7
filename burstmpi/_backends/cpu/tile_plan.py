"""The CPU backend's tile plan: which key tiles each query tile sees, and how.

``tile_plan`` cuts a step's query and key rows into tiles where the mask's structure
changes, classifies every (query tile, key tile) pair as empty, whole or partly visible
(``masks._intervals``, and a block-sparse mask's ``BlockFilter``), and lists per query tile
the key tiles it sees, as the tile loops take them (``numpy_tiles.fwd_row``). ``bands`` cuts
such a plan into bands of about equal work for the backward's work items, ``flatten`` lays
a band's rows end to end for a loop that runs them in one call, and ``runs`` does both. ``TilePlans`` sizes
the tiles for a block pair and keeps its tiling for the next call. Planning costs O(tiles),
never O(pairs).
"""

from collections import OrderedDict

import numpy as np

from ...masks._intervals import EMPTY, PARTIAL, classify_tiles

__all__ = ["TilePlans", "tile_plan", "bands", "flatten", "runs"]


def _tiles(block, size, merge=True):
    """Tiles of at most ``size`` rows, aligned to where the mask's structure changes.

    Rows are cut into pieces where the position spacing jumps (a zigzag rank's two
    chunks, far apart) and where a document (or a chunk, or a block of a block-sparse
    mask: ``Block.start``) starts. A long piece is tiled from its own first row, as if it
    were alone, so the classification finds its FULL and EMPTY tiles instead of tiles
    straddling two documents; pieces shorter than a tile (short documents) share one,
    masked per element, rather than run as many tiny GEMMs, unless ``merge`` is false (a
    block-sparse filter needs every tile inside one block).
    """
    n = len(block.pos)
    if n == 0:
        return []
    cut = np.zeros(n, dtype=bool)
    cut[0] = True
    if n > 2:
        step = np.diff(block.pos)
        cut[1:] |= step != step[0]
    cut[1:] |= np.diff(block.start) != 0
    bounds = np.nonzero(cut)[0].tolist() + [n]
    tiles, open_tile = [], None  # open_tile: a short tile that later short pieces may join
    for a, b in zip(bounds, bounds[1:]):
        if merge and open_tile is not None and b - open_tile[0] <= size:
            open_tile = (open_tile[0], b)
            continue
        if open_tile is not None:
            tiles.append(open_tile)
            open_tile = None
        for s in range(a, b, size):
            if min(s + size, b) - s == size:
                tiles.append((s, s + size))
            else:
                open_tile = (s, b)
    if open_tile is not None:
        tiles.append(open_tile)
    return tiles


def _extremes(pos, tiles):
    starts = np.array([a for a, _ in tiles])
    return np.minimum.reduceat(pos, starts), np.maximum.reduceat(pos, starts)


def tile_plan(qb, kb, tq, tk, blocks=None):
    """Rows of (r0, r1, tiles) without empty pairs: query tile r0..r1-1 and the key tiles
    it sees, as the tile loops take them (``numpy_tiles.fwd_row``): tiles = (c0, c1, iv, lo,
    hi), key tile t being columns c0[t]..c1[t]-1, iv[t] -1 where every row sees it whole,
    else the row of (lo, hi) holding each query token's visible run of its columns.

    ``qb``, ``kb`` are the ``masks._intervals.Block`` of the query and key rows; positions increase
    along both sides, so a tile's first and last rows bound its visible key intervals,
    and what a query token sees of a key tile is one run of its columns. ``blocks`` (a
    ``masks._blocks.BlockFilter``): tiles stay inside blocks (``Block.start`` cuts them
    there) and the pairs of unset blocks are EMPTY."""
    if len(qb.pos) == 0 or len(kb.pos) == 0:
        return []
    kpos = kb.pos
    merge = blocks is None
    qt, kt = _tiles(qb, tq, merge), _tiles(kb, tk, merge)
    r0s, r1s = np.array([a for a, _ in qt]), np.array([b - 1 for _, b in qt])
    kmin, kmax = _extremes(kpos, kt)
    cls = classify_tiles(qb.first[r0s], qb.first[r1s], qb.last[r0s], qb.last[r1s], kmin, kmax)
    if blocks is not None:
        cls[~blocks.tile_visible(qb.pos[r0s], kmin)] = EMPTY
    bounds = np.array(kt, np.int64).reshape(-1, 2)
    tiling = []
    for i, (r0, r1) in enumerate(qt):
        js = np.nonzero(cls[i] != EMPTY)[0]
        if len(js) == 0:
            continue
        c0s, c1s, partial = bounds[js, 0], bounds[js, 1], cls[i, js] == PARTIAL
        if blocks is not None:
            c0s, c1s, partial = _join_full(c0s, c1s, partial, tk)
        iv = np.where(partial, np.cumsum(partial) - 1, -1).astype(np.int64)
        runs = [(np.searchsorted(kpos[c0:c1], qb.first[r0:r1], "left"),
                 np.searchsorted(kpos[c0:c1], qb.last[r0:r1], "right"))
                for c0, c1 in zip(c0s[partial], c1s[partial])]
        lo = np.array([a for a, _ in runs], np.int64).reshape(len(runs), r1 - r0)
        hi = np.array([b for _, b in runs], np.int64).reshape(len(runs), r1 - r0)
        tiling.append((r0, r1, (c0s.copy(), c1s.copy(), iv, lo, hi)))
    return tiling


def _join_full(c0, c1, partial, tk):
    """A row's key tiles with each run of adjacent FULL tiles (set blocks side by side,
    whose tiles a block-sparse mask cut apart) joined into tiles of at most ``tk``
    columns: fewer, wider GEMMs for the same pairs. (c0, c1, partial) of the result."""
    n = len(c0)
    full = ~partial
    join = np.zeros(n, bool)
    join[1:] = full[1:] & full[:-1] & (c0[1:] == c1[:-1])
    if not join.any():
        return c0, c1, partial
    per = max(1, tk // int((c1 - c0).max()))  # tiles a joined one may hold
    idx = np.arange(n)
    since = idx - np.maximum.accumulate(np.where(join, 0, idx))  # place in its run
    starts = np.flatnonzero(~join | (since % per == 0))
    ends = np.r_[starts[1:], n] - 1
    return c0[starts], c1[ends], partial[starts]


def bands(tiling, count):
    """``tiling``'s rows cut into at most ``count`` contiguous bands of about equal work
    (tile pairs), so the backward's items balance when a causal mask makes late rows
    longer."""
    if count <= 1 or len(tiling) <= 1:
        return [tiling]
    work = np.cumsum([len(tiles[0]) for _, _, tiles in tiling])
    cuts = np.searchsorted(work, work[-1] * np.arange(1, count) / count, "left") + 1
    bounds = [0] + sorted(set(int(c) for c in cuts if 0 < c < len(tiling))) + [len(tiling)]
    return [tiling[a:b] for a, b in zip(bounds, bounds[1:])]


def flatten(rows):
    """A run of a plan's rows (in increasing query order) as one call of the tile loops
    takes it (``tiles.bwd_rows``): (t0, t1, arrays), the run's query tokens t0..t1-1 and
    arrays = (span, first, c0, c1, iv, lo, hi): row i is tokens span[i] (from t0) against
    the key tiles first[i]..first[i + 1] - 1 of (c0, c1, iv), whose partly visible ones
    index (lo, hi), each row's runs padded to the run's widest tile."""
    t0, t1 = rows[0][0], rows[-1][1]
    span = np.array([(r0 - t0, r1 - t0) for r0, r1, _ in rows], np.int64).reshape(-1, 2)
    first = np.r_[0, np.cumsum([len(tiles[0]) for _, _, tiles in rows])].astype(np.int64)
    width = int((span[:, 1] - span[:, 0]).max())
    parts = [tiles[3].shape[0] for _, _, tiles in rows]
    lo, hi = np.zeros((sum(parts), width), np.int64), np.zeros((sum(parts), width), np.int64)
    ivs, at = [], 0
    for (r0, r1, (_, _, iv, rlo, rhi)), n in zip(rows, parts):
        lo[at:at + n, :r1 - r0], hi[at:at + n, :r1 - r0] = rlo, rhi
        ivs.append(np.where(iv >= 0, iv + at, -1))
        at += n
    c0, c1 = (np.concatenate([tiles[i] for _, _, tiles in rows]).astype(np.int64) for i in (0, 1))
    return t0, t1, (span, first, c0, c1, np.concatenate(ivs).astype(np.int64), lo, hi)


def runs(tiling, count, kept):
    """``tiling`` cut into ``count`` bands of about equal work (``bands``), each laid out for one
    call of the tile loops (``flatten``); kept in the dict ``kept`` (the plan's ``TilePlans``
    entry) by their count, for the next step and call."""
    out = kept.get(count)
    if out is None:
        out = kept[count] = [flatten(band) for band in bands(tiling, count) if band]
    return out


class TilePlans:
    """A backend's tile plans, sized for each block pair from its tiles of ``tile_q`` query
    rows by ``tile_k`` keys, and kept from call to call (the last ``kept``).

    A plan's ``Geometry`` (``burstmpi._ring.geometry``, cached per call shape) hands out the
    same ``Block`` and ``BlockFilter`` objects for the same block pair every call, so their
    ids key a plan; the entry holds the objects, so the ids stay theirs while it lives.
    Planning a step of a block-sparse mask costs about a millisecond at 16K tokens."""

    def __init__(self, tile_q, tile_k, kept=256):
        self.tile_q, self.tile_k, self.kept = tile_q, tile_k, kept
        self._plans = OrderedDict()

    def clear(self):
        self._plans.clear()

    def get(self, g, qb, kb, blocks=None):
        """(plan, kept) of a block pair: ``tile_plan``'s rows, and the dict in which ``runs``
        keeps the plan's runs."""
        key = (id(qb), id(kb), id(blocks), g)
        hit = self._plans.get(key)
        if hit is None:
            hit = self._plans[key] = (qb, kb, blocks, self._plan(g, qb, kb, blocks), {})
            if len(self._plans) > self.kept:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return hit[3], hit[4]

    def _plan(self, g, qb, kb, blocks):
        tq, tk = max(1, self.tile_q // g), self.tile_k
        # A narrow band of visible keys (a sliding window, or short documents) leaves most
        # of a large tile masked away: shrink the tiles towards half the widest query's
        # visible span. The query tiles only where the band slides along the rows: a few
        # columns every row sees (attention sinks) keep tall tiles (a row of small items
        # costs more in overhead than its GEMMs).
        width = int((qb.last - qb.first).max(initial=0)) + 1
        if width < 2 * tk:
            t = max(64, 1 << int(width // 2).bit_length())
            n = len(qb.first)
            slides = n > 1 and 2 * int(qb.first[-1] - qb.first[0]) >= n - 1
            tq, tk = (min(tq, max(1, t // g)) if slides else tq), min(tk, t)
        # A few keys (the sinks, seen from a rank past the window's reach) would make each
        # query tile a tiny item whose fixed costs outweigh its GEMMs: the query tiles grow
        # as the key side narrows, up to 16 times (the score scratch, rows x keys, stays
        # within a full tile's; the scaled queries' scratch grows with the rows).
        if 0 < len(kb.pos) < self.tile_k:
            tq *= min(16, self.tile_k // len(kb.pos))
        return tile_plan(qb, kb, tq, tk, blocks)
