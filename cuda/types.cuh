// Element types and small helpers shared by every kernel.
//
// Plain CUDA C++ with no includes: NVRTC has no C++ standard library, and the CPU
// emulator (tests/emulator) compiles the same text with g++. The 16-bit element types are
// bare storage; every conversion to and from float goes through arch.cuh, so that the GPU
// uses the hardware conversion instructions and the emulator a bit-exact software one.
#pragma once

struct half_t { unsigned short bits; };  // IEEE binary16
struct bf16_t { unsigned short bits; };  // bfloat16

// Which local-attention math a dtype takes: tensor cores for the 16-bit types, SIMT fp32
// for float (a correct path, not a fast one: fp32 attention is a reference mode).
template <class T> struct elem_traits;
template <> struct elem_traits<half_t> { static constexpr bool tensor_core = true; };
template <> struct elem_traits<bf16_t> { static constexpr bool tensor_core = true; };
template <> struct elem_traits<float>  { static constexpr bool tensor_core = false; };

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ float fmax2(float a, float b) { return a > b ? a : b; }

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

#define BURST_LOG2E 1.4426950408889634f
#define BURST_LN2 0.6931471805599453f
