"""The CPU backend's tile plan: which key tiles each query tile sees, and how.

``tile_plan`` cuts a step's query and key rows into tiles where the mask's structure
changes, classifies every (query tile, key tile) pair as empty, whole or partly visible
(``masks.intervals``, and a block-sparse mask's ``BlockFilter``), and lists per query tile
the key tiles it sees, as the tile loops take them (``tile_ops.fwd_row``). ``bands`` cuts
such a plan into bands of about equal work for the backward's work items. Planning costs
O(tiles), never O(pairs).
"""

import numpy as np

from ..masks.intervals import EMPTY, PARTIAL, classify_tiles

__all__ = ["tile_plan", "bands"]


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
    it sees, as the tile loops take them (``tile_ops.fwd_row``): tiles = (c0, c1, iv, lo,
    hi), key tile t being columns c0[t]..c1[t]-1, iv[t] -1 where every row sees it whole,
    else the row of (lo, hi) holding each query token's visible run of its columns.

    ``qb``, ``kb`` are the ``masks.intervals.Block`` of the query and key rows; positions increase
    along both sides, so a tile's first and last rows bound its visible key intervals,
    and what a query token sees of a key tile is one run of its columns. ``blocks`` (a
    ``masks.blocks.BlockFilter``): tiles stay inside blocks (``Block.start`` cuts them
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
    plan = []
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
        plan.append((r0, r1, (c0s.copy(), c1s.copy(), iv, lo, hi)))
    return plan


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


def bands(plan, count):
    """``plan``'s rows cut into at most ``count`` contiguous bands of about equal work
    (tile pairs), so the backward's items balance when a causal mask makes late rows
    longer."""
    if count <= 1 or len(plan) <= 1:
        return [plan]
    work = np.cumsum([len(tiles[0]) for _, _, tiles in plan])
    cuts = np.searchsorted(work, work[-1] * np.arange(1, count) / count, "left") + 1
    bounds = [0] + sorted(set(int(c) for c in cuts if 0 < c < len(plan))) + [len(plan)]
    return [plan[a:b] for a, b in zip(bounds, bounds[1:])]
