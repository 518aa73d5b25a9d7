// Causal and sliding-window masks on global token positions (burstmpi/masks.py, on the GPU).
//
// Key position kp is visible from query position qp iff  qp - lo <= kp <= qp + hi;  an
// open side has a bound of 2^62 (burstmpi.masks.UNBOUNDED). Positions come as int32 arrays,
// one entry per local token, strictly increasing along the local sequence (true of every
// burstmpi layout: contiguous, zigzag, striped), so a tile's extreme positions are those
// of its first and last valid row.
#pragma once
#include "types.cuh"

enum { TILE_EMPTY = 0, TILE_FULL = 1, TILE_PARTIAL = 2 };

__device__ __forceinline__ bool key_visible(int qp, int kp, long long lo, long long hi) {
    const long long d = (long long)kp - (long long)qp;
    return d >= -lo && d <= hi;
}

// EMPTY: no query of [qmin, qmax] sees any key of [kmin, kmax]; FULL: every one sees every
// one; PARTIAL: anything else (always safe, only slower).
__device__ __forceinline__ int classify_tile(int qmin, int qmax, int kmin, int kmax,
                                             long long lo, long long hi) {
    if ((long long)kmin > (long long)qmax + hi || (long long)kmax < (long long)qmin - lo)
        return TILE_EMPTY;
    if ((long long)kmin >= (long long)qmax - lo && (long long)kmax <= (long long)qmin + hi)
        return TILE_FULL;
    return TILE_PARTIAL;
}

// The first tile of `tile` positions, starting at c0 and stepping by `tile`, that holds a
// key some query in [qmin, qmax] can see; n if there is none.
__device__ __forceinline__ int next_visible_tile(const int* pos, int c0, int n, int tile, int qmin,
                                                 int qmax, long long lo, long long hi) {
    for (; c0 < n; c0 += tile)
        if (classify_tile(qmin, qmax, pos[c0], pos[imin(c0 + tile, n) - 1], lo, hi) != TILE_EMPTY)
            return c0;
    return n;
}
