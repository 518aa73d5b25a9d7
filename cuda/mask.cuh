// Masks as per-row intervals of global token positions (burstmpi/masks/intervals.py, on the GPU).
//
// Every mask burstmpi supports (causal, sliding windows, packed documents, and any mix of
// them) gives each row of a block one interval of visible positions on the other side:
// query row i sees the keys at positions [first(i), last(i)], key row j is seen by the
// queries at [first(j), last(j)]. The host computes the bounds (masks.intervals.Mask.query_block /
// key_block) and the kernels receive them as int32 arrays, one entry per local row, next
// to the other side's positions. Two facts make this cheap:
//   * the per-element test is two integer compares against bounds held in registers, the
//     same for a window and for a document boundary;
//   * along a block's rows positions increase and both bounds are non-decreasing (true of
//     every burstmpi layout), so a row tile's first and last valid rows bound the whole
//     tile: FULL is exact, and tiles inside one document and inside the window run with
//     no per-element mask at all.
#pragma once
#include "types.cuh"

enum { TILE_EMPTY = 0, TILE_FULL = 1, TILE_PARTIAL = 2 };

// Column position p is visible from a row whose interval is [first, last].
__device__ __forceinline__ bool in_interval(int first, int last, int p) {
    return p >= first && p <= last;
}

// A row tile is given by the intervals of its first row, [first0, last0], and of its last
// valid row, [first1, last1]; a column tile by its extreme positions [cmin, cmax].
// EMPTY: every column lies before the first row's first or after the last row's last, so
// no row sees any (sound; a tile that falls between two documents' intervals is only
// PARTIAL, which is always safe). FULL: the last row's first and the first row's last
// enclose every column, so by monotonicity every row sees every column (exact).
__device__ __forceinline__ bool tile_empty(int first0, int last1, int cmin, int cmax) {
    return cmax < first0 || cmin > last1;
}

__device__ __forceinline__ int classify_tile(int first0, int last0, int first1, int last1,
                                             int cmin, int cmax) {
    if (tile_empty(first0, last1, cmin, cmax)) return TILE_EMPTY;
    if (cmin >= first1 && cmax <= last0) return TILE_FULL;
    return TILE_PARTIAL;
}

// The first tile of `tile` columns at positions pos[], starting at c0 and stepping by
// `tile`, that is not EMPTY for the row tile whose first row starts at first0 and whose
// last row ends at last1; n if there is none.
__device__ __forceinline__ int next_visible_tile(const int* pos, int c0, int n, int tile,
                                                 int first0, int last1) {
    for (; c0 < n; c0 += tile)
        if (!tile_empty(first0, last1, pos[c0], pos[imin(c0 + tile, n) - 1])) return c0;
    return n;
}
