// Kernels that test the emulator itself (tests/test_emulator.py), not burstmpi.
//
// gemm_probe runs one warp of cuda/tile.cuh's fragment GEMMs on known matrices; the others
// are deliberately broken, each in one way the emulator must report.
#include "tile.cuh"

// C1 = A B^T (A: 16 x 32, B: 16 x 32) and C2 = A2 Z (A2 = C1 rounded to T, Z: 16 x 16), one warp.
template <class T>
__global__ void gemm_probe(const T* a, const T* b, const T* z, float* c1, float* c2) {
    extern __shared__ __align__(16) unsigned char smem[];
    using S = smem_tile<T, 32>;
    using Zs = smem_tile<T, 16>;
    T* As = reinterpret_cast<T*>(smem);
    T* Bs = As + 16 * S::ld;
    T* Ss = Bs + 16 * S::ld;
    float* scratch = reinterpret_cast<float*>(Ss + 16 * Zs::ld);
    load_rows_async<T, 32>(As, a, 32, 16, 16);
    load_rows_async<T, 32>(Bs, b, 32, 16, 16);
    load_rows_async<T, 16>(Ss, z, 16, 16, 16);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    float c[2][4], o[2][4] = {};
    warp_gemm_abt<T, 2, 32>(c, As, S::ld, Bs, S::ld);
    warp_gemm_pv<T, 2, 2>(o, c, Ss, Zs::ld, scratch);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int j = 0; j < 2; ++j)
        for (int e = 0; e < 4; ++e) {
            const int row = g + 8 * (e >> 1), col = 8 * j + 2 * t + (e & 1);
            c1[row * 16 + col] = c[j][e];
            c2[row * 16 + col] = o[j][e];
        }
}

// Warp 0 fills shared memory, the others read it: correct only with the barrier.
__global__ void broadcast(float* out, int with_barrier) {
    extern __shared__ __align__(16) unsigned char smem[];
    float* s = reinterpret_cast<float*>(smem);
    if (threadIdx.x < 32) s[threadIdx.x] = (float)threadIdx.x;
    if (with_barrier) __syncthreads();
    out[threadIdx.x] = s[threadIdx.x % 32];
}

__global__ void exit_before_barrier(float*, int) {
    if (threadIdx.x == 5) return;
    __syncthreads();
}

__global__ void divergent_collective(float* out, int) {
    if ((threadIdx.x & 31) < 16) out[0] = shfl_xor(1.f, 1);
    else __syncwarp();
}

__global__ void lane_exits_in_collective(float* out, int) {
    if ((threadIdx.x & 31) == 7) return;
    out[threadIdx.x] = shfl_xor(1.f, 1);
}

__global__ void smem_overflow(float*, int bytes) {
    extern __shared__ __align__(16) unsigned char smem[];
    if (threadIdx.x == 0) smem[bytes] = 1;
}
