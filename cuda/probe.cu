// Probes for burstmpi-gpucheck: the fragment layouts of cuda/tile.cuh's GEMMs on known
// matrices, and a kernel that holds a stream back (stream_delay, at the end).
//
// gemm_probe<T>: grid 1, block 32, dynamic shared memory >= 16 KiB.
//   Reads  a (16 x 32), b (16 x 32), z (16 x 16), row-major, T.
//   Writes c1 = a b^T and c2 = round_T(c1) z, both 16 x 16 fp32, row-major.
// Run first on a new GPU or toolkit (burstmpi-gpucheck does): if ldmatrix, mma.sync or the
// C-to-A fragment reuse disagreed with the PTX ISA as tests/emulator reads it, this small,
// obvious product is where it would show, before any attention result is looked at.
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

// stream_delay: one warp that returns after about `ns` nanoseconds. burstmpi-gpucheck
// queues it on a stream (NCCLTransport.delay) to hold that stream's later work back: a
// missing wait between two streams then shows as different bits, on silicon.
extern "C" __global__ void stream_delay(long long ns) {
    const long long start = global_ns();
    while (global_ns() - start < ns) {
    }
}
