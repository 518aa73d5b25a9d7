// The CUDA execution model on the CPU, force-included (g++ -include) before the kernels.
//
// Test infrastructure, not a product path: it lets CI run the exact text of cuda/*.cu on a
// machine without a GPU and check it against the NumPy backend. Each CUDA thread is a fiber;
// blocks run one after another; a fiber runs until it reaches a synchronisation point
// (__syncthreads, a warp collective, exit). See runtime.h for the scheduler and what it
// detects, burst_emu_arch.h for the emulated instructions.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#define BURST_EMULATED 1
// Bytes of emulated shared memory: the largest opt-in block size of sm_90 (227 KiB).
#define EMU_SMEM_CAP 232448

// Qualifiers: host code on the CPU. Shared memory is thread_local, which makes a
// function-scope __shared__ array implicitly static: one instance for all fibers, which
// run on one OS thread, i.e. one per block as blocks run one at a time.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ thread_local
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)

struct uint3 { unsigned x, y, z; };
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3() = default;
    dim3(unsigned x_, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Variables, not macros (CUDA's own headers use these names as parameters); the scheduler
// updates threadIdx at every fiber switch.
extern uint3 threadIdx;
extern uint3 blockIdx;
extern dim3 blockDim;
extern dim3 gridDim;

void __syncthreads();
void __syncwarp(unsigned mask = 0xffffffffu);

inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }


// ---- what the emulated instructions (burst_emu_arch.h) get from the scheduler --------------
namespace emu {

// One lane's operands or results of a warp collective.
struct Slot {
    uint32_t w[12];
    const void* ptr;
};
// Runs once per collective, when the 32nd lane arrives: in[l] -> out[l] for every lane.
using CollectiveFn = void (*)(const Slot* in, Slot* out);

// Deposit this lane's `in`, wait until all 32 lanes of the warp have arrived at a collective
// with the same `name` (different names in one warp are reported as divergence), then return
// this lane's result.
Slot collective(const char* name, CollectiveFn fn, const Slot& in);

// Asynchronous copies, per thread: issued copies land in shared memory only at cp_wait.
void cp_async(void* dst, const void* src, bool valid);
void cp_commit();
void cp_wait(int allowed_in_flight);

// Fail the launch unless [p, p + bytes) lies in the block's dynamic shared memory and p is
// aligned to `align` bytes.
void check_smem(const void* p, int bytes, int align, const char* what);

[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace emu
