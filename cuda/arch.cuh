// Every architecture-specific instruction the kernels use, and nothing else.
//
// The kernels are plain CUDA C++ over these functions. Two implementations exist:
//   - this file, inline PTX for sm_80 and newer (Ampere, Ada, Hopper);
//   - tests/emulator/burst_emu_arch.h, the same functions on the CPU, selected when the
//     emulator defines BURST_EMULATED. It models each warp-wide instruction as a
//     rendezvous of the 32 lanes with the PTX ISA's per-lane fragment layouts.
// Keep the two in step: a function added here needs its emulated twin.
//
//   to_float / from_float<T> / pack2<T>   element conversions (round to nearest even)
//   ldsm_x4 / ldsm_x4_trans               ldmatrix.sync.aligned.m8n8.x4[.trans].b16
//   mma_16816<T>                          mma.sync.aligned.m16n8k16.row.col.f32.T.T.f32
//   cp_async_16 / _commit / _wait<N>      cp.async.cg 16-byte copies, zero-filling
//   shfl_xor                              __shfl_xor_sync over the full warp
//   fast_exp2                             ex2.approx.ftz.f32
//   global_ns                             %globaltimer (nanoseconds; the stream-delay probe)
#pragma once
#include "types.cuh"

#ifdef BURST_EMULATED
#include <burst_emu_arch.h>
#else

// ---- conversions ------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}
__device__ __forceinline__ float to_float(bf16_t x) {
    return __uint_as_float(static_cast<unsigned>(x.bits) << 16);
}

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ half_t from_float<half_t>(float x) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
    bf16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(x));
    return h;
}

// Two floats as one .b32 fragment register, `lo` in the low 16 bits (the PTX order of
// fragment elements). cvt.*x2 puts its first source operand in the upper half.
template <class T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<half_t>(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ unsigned pack2<bf16_t>(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// ---- tensor cores -------------------------------------------------------------------
__device__ __forceinline__ unsigned smem_u32(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8x8 b16 matrices; lane l gives the address of row l%8 of matrix l/8 (16-byte
// aligned), and receives in r[j] row l/4, columns 2(l%4) and 2(l%4)+1 of matrix j.
__device__ __forceinline__ void ldsm_x4(unsigned r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(row)));
}
// The same with each matrix transposed: r[j] holds rows 2(l%4), 2(l%4)+1 of column l/4.
__device__ __forceinline__ void ldsm_x4_trans(unsigned r[4], const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(row)));
}

// c (16x8 fp32) += a (16x16, row) * b (16x8, col), fragments as in the PTX ISA.
template <class T>
__device__ __forceinline__ void mma_16816(float c[4], const unsigned a[4], const unsigned b[2]);
template <>
__device__ __forceinline__ void mma_16816<half_t>(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma_16816<bf16_t>(float c[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- asynchronous copies ----------------------------------------------------------
// 16 bytes global -> shared, or 16 zero bytes when !valid (the source is then not read).
// The data is only guaranteed to be in shared memory after cp_async_wait and, for other
// threads, a barrier.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                 :: "r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// ---- warp exchange and math -----------------------------------------------------------
__device__ __forceinline__ float shfl_xor(float v, int lane_mask) {
    return __shfl_xor_sync(0xffffffffu, v, lane_mask);
}
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ---- time ------------------------------------------------------------------------------------
__device__ __forceinline__ long long global_ns() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

#endif  // BURST_EMULATED
