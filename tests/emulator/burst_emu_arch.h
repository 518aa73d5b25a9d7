// cuda/arch.cuh on the CPU: the same functions, emulated for tests/emulator.
//
// Warp-wide instructions (ldmatrix, mma, shuffles) are rendezvous through
// emu::collective: each lane deposits its operands, and the function here computes all 32
// lanes' results at once from the PTX ISA's definition of the per-lane layouts:
//
//   mma.m16n8k16 .f16/.bf16, lane = 4*groupID + threadID_in_group (g, t):
//     A (16x16, row): a_i at row g + 8*((i/2)%2), column 2t + (i%2) + 8*(i/4);
//                     registers hold the pairs (a0,a1) (a2,a3) (a4,a5) (a6,a7), low half first
//     B (16x8, col):  b_i at row 2t + (i%2) + 8*(i/2), column g
//     C, D (16x8):    c_i at row g + 8*(i/2), column 2t + (i%2)
//   ldmatrix .x4: lanes 8j..8j+7 give the row addresses of matrix j; lane l receives, in
//     register j, row l/4 and columns 2(l%4), 2(l%4)+1 of matrix j (.trans: of its transpose).
//
// These formulas are written here independently of the kernels' use of them (cuda/tile.cuh),
// so a kernel that indexes a fragment wrongly disagrees with the NumPy backend.
// Included by cuda/arch.cuh, after cuda/types.cuh.
#pragma once
#include <chrono>
#include <type_traits>

// ---- conversions (round to nearest even, like cvt.rn) ----------------------------------
namespace emu {

inline uint16_t float_to_half_bits(float f) {
    const uint32_t x = __float_as_uint(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);              // NaN
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);             // rounds to inf
    if (ax < 0x38800000u) {                                                // half subnormal
        const float scaled = std::fabs(f) * 16777216.0f;                   // units of 2^-24, exact
        return (uint16_t)(sign | (uint32_t)std::nearbyint(scaled));        // ties to even
    }
    uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax & 0x7fffffu) >> 13);
    const uint32_t rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;             // carries into the exponent
    return (uint16_t)(sign | h);
}

inline float half_bits_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) return (sign ? -1.f : 1.f) * (float)m * (1.0f / 16777216.0f);
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

inline uint16_t float_to_bf16_bits(float f) {
    uint32_t x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet NaN
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

}  // namespace emu

inline float to_float(float x) { return x; }
inline float to_float(half_t x) { return emu::half_bits_to_float(x.bits); }
inline float to_float(bf16_t x) { return __uint_as_float((uint32_t)x.bits << 16); }

template <class T> T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline half_t from_float<half_t>(float x) { return half_t{emu::float_to_half_bits(x)}; }
template <> inline bf16_t from_float<bf16_t>(float x) { return bf16_t{emu::float_to_bf16_bits(x)}; }

template <class T> unsigned pack2(float lo, float hi) {
    return (unsigned)from_float<T>(lo).bits | ((unsigned)from_float<T>(hi).bits << 16);
}

// ---- ldmatrix ----------------------------------------------------------------------------
namespace emu {

inline uint16_t b16_at(const void* row, int col) {
    uint16_t v;
    std::memcpy(&v, static_cast<const unsigned char*>(row) + 2 * col, 2);
    return v;
}

template <bool TRANS>
void ldsm_x4_fn(const Slot* in, Slot* out) {
    for (int l = 0; l < 32; ++l) {
        const int r = l / 4, c = 2 * (l % 4);
        for (int j = 0; j < 4; ++j) {
            uint16_t lo, hi;
            if (TRANS) {
                lo = b16_at(in[8 * j + c].ptr, r);
                hi = b16_at(in[8 * j + c + 1].ptr, r);
            } else {
                lo = b16_at(in[8 * j + r].ptr, c);
                hi = b16_at(in[8 * j + r].ptr, c + 1);
            }
            out[l].w[j] = (uint32_t)lo | ((uint32_t)hi << 16);
        }
    }
}

template <bool TRANS>
void ldsm(unsigned r[4], const void* row) {
    check_smem(row, 16, 16, TRANS ? "ldmatrix.trans row" : "ldmatrix row");
    Slot s{};
    s.ptr = row;
    const Slot o = collective(TRANS ? "ldmatrix.x4.trans" : "ldmatrix.x4", ldsm_x4_fn<TRANS>, s);
    for (int j = 0; j < 4; ++j) r[j] = o.w[j];
}

}  // namespace emu

inline void ldsm_x4(unsigned r[4], const void* row) { emu::ldsm<false>(r, row); }
inline void ldsm_x4_trans(unsigned r[4], const void* row) { emu::ldsm<true>(r, row); }

// ---- mma.sync.m16n8k16 -------------------------------------------------------------------
namespace emu {

template <class T>
float b16_value(uint32_t reg, int half) {
    return to_float(T{(uint16_t)(half ? reg >> 16 : reg & 0xffffu)});
}

template <class T>
void mma_fn(const Slot* in, Slot* out) {
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        const uint32_t* a = in[l].w;      // 4 registers: a0..a7
        const uint32_t* b = in[l].w + 4;  // 2 registers: b0..b3
        const float* c = reinterpret_cast<const float*>(in[l].w + 6);
        for (int i = 0; i < 8; ++i)
            A[g + 8 * ((i / 2) % 2)][2 * t + (i % 2) + 8 * (i / 4)] = b16_value<T>(a[i / 2], i % 2);
        for (int i = 0; i < 4; ++i) B[2 * t + (i % 2) + 8 * (i / 2)][g] = b16_value<T>(b[i / 2], i % 2);
        for (int i = 0; i < 4; ++i) C[g + 8 * (i / 2)][2 * t + (i % 2)] = c[i];
    }
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, t = l & 3;
        float* d = reinterpret_cast<float*>(out[l].w);
        for (int i = 0; i < 4; ++i) {
            const int row = g + 8 * (i / 2), col = 2 * t + (i % 2);
            float s = C[row][col];
            for (int k = 0; k < 16; ++k) s += A[row][k] * B[k][col];
            d[i] = s;
        }
    }
}

}  // namespace emu

template <class T> void mma_16816(float c[4], const unsigned a[4], const unsigned b[2]) {
    emu::Slot s{};
    for (int i = 0; i < 4; ++i) s.w[i] = a[i];
    s.w[4] = b[0];
    s.w[5] = b[1];
    std::memcpy(s.w + 6, c, 16);
    const char* name = std::is_same<T, half_t>::value ? "mma.m16n8k16.f16" : "mma.m16n8k16.bf16";
    const emu::Slot o = emu::collective(name, emu::mma_fn<T>, s);
    std::memcpy(c, o.w, 16);
}

// ---- cp.async ----------------------------------------------------------------------------
inline void cp_async_16(void* dst, const void* src, bool valid) { emu::cp_async(dst, src, valid); }
inline void cp_async_commit() { emu::cp_commit(); }
template <int N> void cp_async_wait() { emu::cp_wait(N); }

// ---- shuffles and math ---------------------------------------------------------------------
namespace emu {
inline void shfl_xor_fn(const Slot* in, Slot* out) {
    for (int l = 0; l < 32; ++l) out[l].w[0] = in[l ^ (int)in[l].w[1]].w[0];
}
}  // namespace emu

inline float shfl_xor(float v, int lane_mask) {
    emu::Slot s{};
    s.w[0] = __float_as_uint(v);
    s.w[1] = (uint32_t)lane_mask;
    return __uint_as_float(emu::collective("shfl.xor", emu::shfl_xor_fn, s).w[0]);
}

inline float fast_exp2(float x) { return std::exp2(x); }

// ---- time ------------------------------------------------------------------------------------
inline long long global_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
}
