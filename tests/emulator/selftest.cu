// Kernels that test the emulator itself (tests/gpu/test_emulator.py), not burstmpi.
//
// The layout probe of cuda/probe.cu, then kernels that are deliberately broken, each in
// one way the emulator must report.
#include "probe.cu"

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
