// Masks as per-row intervals of global token positions (burstmpi/masks/_intervals.py, on the GPU).
//
// Every mask burstmpi supports (causal, sliding windows, packed documents, and any mix of
// them) gives each row of a block one interval of visible positions on the other side:
// query row i sees the keys at positions [first(i), last(i)], key row j is seen by the
// queries at [first(j), last(j)]. The host computes the bounds (masks._intervals.Mask.query_block /
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
// The most bitmap cells a tile's classification reads (BlockBits::classify).
enum { BLOCK_SCAN = 16 };

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

// Block-sparse masks (burstmpi.masks.BlockSparse) as a bitmap on top of the intervals.
//
// A bitmap is one byte per (query block, key block) of a head group's plane: a query at
// position i sees a key at j (inside its interval) only if plane[(i / bs) * ld + j / bs].
// The host hands every row its block index (pos / bs, as int32 arrays next to the
// positions), so the kernels never divide, and views the plane from the side the kernel
// walks: `rs` is the plane stride of a row's block, `cs` that of a column's (ld and 1 when
// the rows are queries, 1 and ld when they are keys). `bits == nullptr`: no bitmap.
struct BlockBits {
    const unsigned char* bits;
    const int* rblk;  // block index of each of the kernel's rows
    const int* cblk;  // block index of each column (the side the tile loop walks)
    int rs, cs;       // the host checks that the plane has fewer than 2^31 cells

    __device__ __forceinline__ bool on() const { return bits != nullptr; }

    // The plane offset of row r's block row (0 without a bitmap).
    __device__ __forceinline__ int row(int r) const { return on() ? rblk[r] * rs : 0; }

    // Does the row at plane offset `roff` see column c's block? (true without a bitmap)
    __device__ __forceinline__ bool sees(int roff, int c) const {
        return !on() || bits[roff + cblk[c] * cs] != 0;
    }

    // EMPTY, FULL or PARTIAL for the tile of rows r0..r1 and columns c0..c1, from the
    // block ranges their ends span (positions increase along both, so every cell of the
    // tile lies inside): FULL when every cell of the range is set, EMPTY when none is.
    // Both are sound even where positions jump inside a tile (a zigzag seam): the range
    // then covers more cells than the tile, never fewer. Ranges of more than
    // BLOCK_SCAN cells are PARTIAL, which is always safe.
    __device__ __forceinline__ int classify(int r0, int r1, int c0, int c1) const {
        if (!on()) return TILE_FULL;
        const int b0 = rblk[r0], b1 = rblk[r1], e0 = cblk[c0], e1 = cblk[c1];
        if ((b1 - b0 + 1) * (e1 - e0 + 1) > BLOCK_SCAN) return TILE_PARTIAL;
        int set = 0;
        for (int x = b0; x <= b1; ++x)
            for (int y = e0; y <= e1; ++y) set += bits[x * rs + y * cs] != 0;
        return set == 0 ? TILE_EMPTY : (set == (b1 - b0 + 1) * (e1 - e0 + 1) ? TILE_FULL : TILE_PARTIAL);
    }
};

// The class of a tile under both the intervals and the bitmap.
__device__ __forceinline__ int combine_tiles(int by_interval, int by_bits) {
    if (by_interval == TILE_EMPTY || by_bits == TILE_EMPTY) return TILE_EMPTY;
    return by_interval == TILE_FULL && by_bits == TILE_FULL ? TILE_FULL : TILE_PARTIAL;
}
