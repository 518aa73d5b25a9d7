// Warp-level tile operations shared by the attention kernels: plain CUDA C++ over arch.cuh.
//
// A warp owns 16 rows of a tile. Scores and accumulators live in registers in the
// m16n8 "C fragment" layout of mma.sync: for lane = 4g + t, element e of n-tile j is
//     row g + 8*(e/2), column 8j + 2t + (e%2).
// The 4 lanes of a quad (same g) therefore hold a whole row between them, which is why
// row reductions are two shuffles. The float path keeps the same register layout and
// computes it with SIMT FMAs, so the kernels' softmax code is one code for every dtype.
//
// Shared-memory tiles are row-major with a row stride of COLS + 16 bytes: the padding
// moves consecutive rows to different banks, which ldmatrix needs to run conflict-free.
#pragma once
#include "arch.cuh"

template <class T, int COLS>
struct smem_tile {
    static constexpr int ld = COLS + 16 / (int)sizeof(T);  // elements per row
    __device__ static constexpr int bytes(int rows) { return rows * ld * (int)sizeof(T); }
};

// Copy `rows` rows of COLS elements from global memory (row stride `stride` elements,
// rows 16-byte aligned) to shared memory, asynchronously; rows >= rows_valid become zeros,
// so a partial tile never feeds garbage (or NaN) into a product. Every thread of the block
// takes part; the caller commits the group and waits for it.
template <class T, int COLS>
__device__ __forceinline__ void load_rows_async(T* dst, const T* src, long long stride,
                                                int rows, int rows_valid) {
    constexpr int V = 16 / (int)sizeof(T);  // elements per 16-byte chunk
    constexpr int CHUNKS = COLS / V;
    constexpr int LD = smem_tile<T, COLS>::ld;
    for (int i = threadIdx.x; i < rows * CHUNKS; i += blockDim.x) {
        const int r = i / CHUNKS, c = (i % CHUNKS) * V;
        const bool ok = r < rows_valid;
        cp_async_16(dst + r * LD + c, ok ? src + r * stride + c : src, ok);
    }
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmax2(v, shfl_xor(v, 1));
    return fmax2(v, shfl_xor(v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
    v += shfl_xor(v, 1);
    return v + shfl_xor(v, 2);
}

// c = A B^T for the warp's 16 rows of A (16 x K, row stride lda) and NT*8 rows of
// B (NT*8 x K, row stride ldb), both in shared memory.
template <class T, int NT, int K>
__device__ __forceinline__ void warp_gemm_abt(float (&c)[NT][4], const T* A, int lda,
                                              const T* B, int ldb) {
    static_assert(K % 16 == 0, "the reduction dimension must be a multiple of 16");
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int j = 0; j < NT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) c[j][e] = 0.f;
    if constexpr (elem_traits<T>::tensor_core) {
        static_assert(NT % 2 == 0, "tensor-core tiles come in pairs of n8 tiles");
#pragma unroll
        for (int kk = 0; kk < K; kk += 16) {
            // A as four 8x8 matrices: rows 0-7|8-15 x columns kk..+7 | kk+8..+15.
            unsigned a[4];
            ldsm_x4(a, A + (lane & 15) * lda + kk + (lane >> 4) * 8);
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                // Rows of B are the n index: matrices (n 0-7, k lo), (n 0-7, k hi),
                // (n 8-15, k lo), (n 8-15, k hi) give the b fragments of n-tiles j, j+1.
                unsigned b[4];
                ldsm_x4(b, B + (j * 8 + (lane >> 4) * 8 + (lane & 7)) * ldb + kk + ((lane >> 3) & 1) * 8);
                mma_16816<T>(c[j], a, b);
                mma_16816<T>(c[j + 1], a, b + 2);
            }
        }
    } else {
        const int g = lane >> 2, t = lane & 3;
        for (int k = 0; k < K; ++k) {
            const float a0 = to_float(A[g * lda + k]), a1 = to_float(A[(g + 8) * lda + k]);
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const float b0 = to_float(B[(8 * j + 2 * t) * ldb + k]);
                const float b1 = to_float(B[(8 * j + 2 * t + 1) * ldb + k]);
                c[j][0] += a0 * b0;
                c[j][1] += a0 * b1;
                c[j][2] += a1 * b0;
                c[j][3] += a1 * b1;
            }
        }
    }
}

// o += P Z for the warp's 16 rows: P (16 x KT*8) in C-fragment registers, Z (KT*8 x NO*8,
// row stride ldz) in shared memory. Tensor cores take P straight from registers: the C
// fragments of n-tiles 2i and 2i+1 are, element for element, the A fragment of k-block i.
// The float path has no such identity, so it passes P through `scratch`, this warp's own
// 16 x (KT*8 + 4) floats of shared memory.
template <class T, int NO, int KT>
__device__ __forceinline__ void warp_gemm_pv(float (&o)[NO][4], const float (&p)[KT][4],
                                             const T* Z, int ldz, float* scratch) {
    const int lane = threadIdx.x & 31;
    if constexpr (elem_traits<T>::tensor_core) {
        static_assert(NO % 2 == 0 && KT % 2 == 0, "tensor-core tiles come in pairs of n8 tiles");
#pragma unroll
        for (int i = 0; i < KT / 2; ++i) {
            const unsigned a[4] = {pack2<T>(p[2 * i][0], p[2 * i][1]),
                                   pack2<T>(p[2 * i][2], p[2 * i][3]),
                                   pack2<T>(p[2 * i + 1][0], p[2 * i + 1][1]),
                                   pack2<T>(p[2 * i + 1][2], p[2 * i + 1][3])};
#pragma unroll
            for (int j = 0; j < NO; j += 2) {
                // Z rows are the k index: transposed matrices (k lo, n 0-7), (k hi, n 0-7),
                // (k lo, n 8-15), (k hi, n 8-15) give the b fragments of n-tiles j, j+1.
                unsigned b[4];
                ldsm_x4_trans(b, Z + (16 * i + ((lane >> 3) & 1) * 8 + (lane & 7)) * ldz + j * 8 + (lane >> 4) * 8);
                mma_16816<T>(o[j], a, b);
                mma_16816<T>(o[j + 1], a, b + 2);
            }
        }
    } else {
        constexpr int LDP = KT * 8 + 4;
        const int g = lane >> 2, t = lane & 3;
        __syncwarp();  // every lane is done reading the previous contents
#pragma unroll
        for (int j = 0; j < KT; ++j) {
            scratch[g * LDP + 8 * j + 2 * t] = p[j][0];
            scratch[g * LDP + 8 * j + 2 * t + 1] = p[j][1];
            scratch[(g + 8) * LDP + 8 * j + 2 * t] = p[j][2];
            scratch[(g + 8) * LDP + 8 * j + 2 * t + 1] = p[j][3];
        }
        __syncwarp();
        for (int k = 0; k < KT * 8; ++k) {
            const float p0 = scratch[g * LDP + k], p1 = scratch[(g + 8) * LDP + k];
#pragma unroll
            for (int j = 0; j < NO; ++j) {
                const float z0 = to_float(Z[k * ldz + 8 * j + 2 * t]);
                const float z1 = to_float(Z[k * ldz + 8 * j + 2 * t + 1]);
                o[j][0] += p0 * z0;
                o[j][1] += p0 * z1;
                o[j][2] += p1 * z0;
                o[j][3] += p1 * z1;
            }
        }
    }
}

// Bytes of the float path's P scratch for a block of WARPS warps and KT n-tiles (0 for
// the tensor-core types, which keep P in registers).
template <class T, int WARPS, int KT>
struct pv_scratch {
    static constexpr int bytes = elem_traits<T>::tensor_core ? 0 : WARPS * 16 * (KT * 8 + 4) * 4;
};
