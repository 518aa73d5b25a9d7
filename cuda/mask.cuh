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
