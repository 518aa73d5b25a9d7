// Decode: a few new query rows against a long KV cache shard (split-KV, "flash-decoding").
//
// A decode step attends T new tokens (often 1) of every query head to the n filled rows of
// one rank's cache shard and leaves a normalised partial (out, lse); the ranks' partials
// are then merged (burst_decode_combine, the same kernel that merges this kernel's splits).
// Per (batch, KV head) there are only R = T * group query rows against n cache rows, so
// the work is a long, thin product: every cache row is read once and used R times, about
// R / sizeof(T) FMAs per byte loaded. Up to R = 16 (one block's rows) that stays near or
// below what SIMT fp32 math sustains against HBM (~8-10 FMAs/byte on an H100), hence:
//   * SIMT fp32 math for every dtype (no tensor cores: a 16-row mma tile would be mostly
//     padding at R = 1..8, and the loads, not the math, set the time);
//   * parallelism over cache chunks ("splits") as well as over (batch, KV head) and row
//     groups, since B * kv_heads alone rarely fills the GPU at decode batch sizes;
//   * all the query heads of a KV head (GQA/MQA) and all T tokens in one block, so each
//     K/V row is read once per (batch, KV head, row group of ROWS rows), not once per head;
//   * K and V tiles streamed into shared memory with 16-byte cp.async copies, double
//     buffered: tile i+1 is in flight during all of tile i's math, which is what keeps
//     enough bytes in flight per SM (the tile sizes aim at ~16 KiB of K+V per tile and
//     blocks small enough for several to share an SM). Views whose rows are not 16-byte
//     aligned take a plain-load path (correct, slower); the host picks it per launch.
//   * no tile skipping: cache rows sit in any order (a windowed cache reuses its slots as
//     a ring buffer), so a tile's positions do not bound anything; every element is
//     tested (two integer compares). A decode cache holds essentially only rows its
//     queries see (at most T - 1 rows are invisible to some of them), so there is little
//     to skip anyway.
//
// burst_decode<T, D, DV, ROWS, BN>
//   grid  (B * kv_heads * row_groups, splits), row_groups = ceil(T * group / ROWS);
//         blockIdx.x = row group + row_groups * (b * kv_heads + hk), so the blocks that
//         share a (batch, KV head, split) run next to each other and share K/V in L2.
//   block 128 threads. Query row r of a (batch, KV head) is token r / group, head
//         r % group of the group; a block owns rows r0 .. r0 + ROWS - 1 (fewer in the last
//         group) and cache rows [split * chunk, min(n, (split + 1) * chunk)), in tiles of
//         BN rows. Three thread mappings, one per phase of a tile:
//     scores   thread (key kj = tid % BN, part kp = tid / BN) computes the scores of key kj
//              for rows kp, kp + 128/BN, ...: its K row from shared memory (rows padded by
//              16 bytes, so the 8 threads of a 16-byte access phase hit distinct banks), the
//              query rows as broadcasts. Masked scores are -inf.
//     softmax  128 / ROWS consecutive threads per row: max, exponentials and sum of the row's
//              BN scores with xor shuffles inside the group; the online-softmax state (m, l)
//              of the row lives in those threads' registers (identical in each).
//     P V      thread (column chunk cg = tid % CG, row group rg = tid / CG) owns CW output
//              columns of rows rg, rg + RG, ...: per key one vector load of V, reused for
//              each of its rows. P is read from shared memory, 4 keys per 16-byte load.
//   Shared memory (dynamic, bytes from burstmpi/_gpu/kernels.py, decode_smem_bytes):
//     K tiles  2 x BN x (D + 16 B)   } double buffered: tile i+1 loads while tile i computes
//     V tiles  2 x BN x (DV + 16 B)  }
//     Q        ROWS x (D + 4) fp32, pre-multiplied by scale * log2(e), loaded once
//     S/P      ROWS x (BN + 8) fp32: scores, then probabilities (the +8 keeps the softmax
//              groups' 4 rows per warp on distinct banks)
//     rows     ROWS fp32: each row's rescale factor for the tile, at the end 1 / l
//   Reads   q, k, v (T), kpos (int32, the global position of each cache row, any order).
//           Query row r (token t) sits at position qpos0 + t and sees cache row j iff
//             kpos[j] <= qpos0 + t  and  (left < 0 or kpos[j] >= qpos0 + t - left).
//   Writes  out (fp32, DV per row) = sum_j p_j v_j / sum_j p_j over the split's visible rows,
//           lse (fp32, natural log) = log sum_j exp(scale q.k_j); a row that sees none of the
//           split's rows gets out 0 and lse -inf (never NaN). Split s writes at offsets
//           s * o_ssplit, s * l_ssplit: into a workspace, or into the caller's arrays when
//           there is a single split (strides 0).
//
// burst_decode_combine<T, DV>
//   grid ceil(rows / 4), block 128: one warp per row, lanes over the DV columns.
//   Reads P partials (parts_out, fp32, DV per row; parts_lse, fp32 natural log, -inf for a
//   partial that saw nothing) at part stride po_sp / pl_sp and row stride po_sr / pl_sr.
//   Writes out (T) and lse (fp32) with the log-sum-exp identity, in the fixed order
//   p = 0 .. P-1: m = max_p lse_p, w_p = exp(lse_p - m), L = sum_p w_p,
//   out = sum_p w_p out_p / L, lse = m + log L; rows whose partials all saw nothing get
//   out 0 and lse -inf. No atomics: each output element is one thread's fixed-order sum,
//   so the same inputs give the same bits. Row r is addressed as (batch, token, KV head,
//   head in group) = decomposition of r = ((b * kv_heads + hk) * tokens + t) * group + gi,
//   which lets the same kernel merge decode splits straight into the caller's strided
//   (B, kv_heads, T, group, DV) view and merge plain contiguous (rows, DV) arrays
//   (kv_heads = group = 1, tokens = rows).
//
// Strides are in elements; query-side tensors (q, out, lse) take four, as in attn_fwd.cu
// (batch, token, KV head, head in group), the cache takes three (batch, row, KV head). The
// feature axis is contiguous everywhere.
#include "tile.cuh"
#include "mask.cuh"

// Vector loads as plain aligned structs (NVRTC's built-in vector types do not exist in the
// emulator, and these are all the kernels need): one ld.v4 / ld.v2 each.
struct __align__(16) burst_vec16 { unsigned w[4]; };
struct __align__(8) burst_vec8 { unsigned w[2]; };

// N consecutive elements at p (N * sizeof(T) = 8 or 16 bytes, that aligned) as floats.
template <class T, int N>
__device__ __forceinline__ void load_floats(float (&f)[N], const T* p) {
    constexpr int BYTES = N * (int)sizeof(T);
    static_assert(BYTES == 8 || BYTES == 16, "vector loads are 8 or 16 bytes");
    unsigned w[BYTES / 4];
    if constexpr (BYTES == 16) {
        const burst_vec16 x = *reinterpret_cast<const burst_vec16*>(p);
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = x.w[i];
    } else {
        const burst_vec8 x = *reinterpret_cast<const burst_vec8*>(p);
        w[0] = x.w[0];
        w[1] = x.w[1];
    }
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < N; ++i) f[i] = __uint_as_float(w[i]);
    } else {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            f[2 * i] = to_float(T{(unsigned short)(w[i] & 0xffffu)});
            f[2 * i + 1] = to_float(T{(unsigned short)(w[i] >> 16)});
        }
    }
}

// Rows of a K or V tile into shared memory: 16-byte cp.async copies when the caller's rows
// are 16-byte aligned (`vec`, block-uniform), else plain element loads (rows of any
// alignment). Rows >= rows_valid become zeros either way.
template <class T, int COLS>
__device__ __forceinline__ void load_cache_rows(T* dst, const T* src, long long stride, int rows,
                                                int rows_valid, bool vec) {
    if (vec) {
        load_rows_async<T, COLS>(dst, src, stride, rows, rows_valid);
        return;
    }
    constexpr int LD = smem_tile<T, COLS>::ld;
    for (int i = threadIdx.x; i < rows * COLS; i += blockDim.x) {
        const int r = i / COLS, c = i % COLS;
        dst[r * LD + c] = r < rows_valid ? src[r * stride + c] : T{};
    }
}

// Max and sum over LANES consecutive lanes (a power of two up to 32); every lane of the
// group gets the same bits (the xor butterfly adds the same pairs in every lane).
template <int LANES>
__device__ __forceinline__ float group_max(float v) {
#pragma unroll
    for (int w = 1; w < LANES; w <<= 1) v = fmax2(v, shfl_xor(v, w));
    return v;
}
template <int LANES>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int w = 1; w < LANES; w <<= 1) v += shfl_xor(v, w);
    return v;
}

// The layout constants of burst_decode, shared with nothing else: kernels.py mirrors the
// shared-memory size.
template <class T, int D, int DV, int ROWS, int BN>
struct decode_layout {
    static constexpr int THREADS = 128;
    static constexpr int VEC = 16 / (int)sizeof(T);   // elements per 16 bytes
    static constexpr int KSPLIT = THREADS / BN;       // score phase: threads per key
    static constexpr int SR = ROWS / KSPLIT;          // ... and rows per thread
    static constexpr int LPR = THREADS / ROWS;        // softmax: lanes per row
    static constexpr int SPL = BN / LPR;              // ... and scores per lane
    // P V: CW columns per thread (one 16-byte load of V; 8 bytes where DV is too narrow to
    // give every thread 16), CG column chunks, RG row groups of RPT rows each.
    static constexpr int CW = VEC < ROWS * DV / THREADS ? VEC : ROWS * DV / THREADS;
    static constexpr int CG = DV / CW;
    static constexpr int RG = THREADS / CG;
    static constexpr int RPT = (ROWS + RG - 1) / RG;
    static constexpr int QLD = D + 4, SLD = BN + 8;
    using KT = smem_tile<T, D>;
    using VT = smem_tile<T, DV>;
    static constexpr int K_OFF = 0;
    static constexpr int V_OFF = 2 * BN * KT::ld * (int)sizeof(T);
    static constexpr int Q_OFF = V_OFF + 2 * BN * VT::ld * (int)sizeof(T);
    static constexpr int S_OFF = Q_OFF + ROWS * QLD * 4;
    static constexpr int R_OFF = S_OFF + ROWS * SLD * 4;
    static constexpr int BYTES = R_OFF + ROWS * 4;
    static_assert(THREADS % BN == 0 && ROWS % KSPLIT == 0, "score phase: BN must divide 128, 128/BN divide ROWS");
    static_assert(THREADS % ROWS == 0 && LPR <= 32 && BN % LPR == 0, "softmax phase: 128/ROWS lanes per row");
    static_assert(BN % 4 == 0 && DV % CW == 0 && CG <= THREADS, "P V phase");
    static_assert(D % VEC == 0, "K rows are read in 16-byte chunks");
};

// At least 3 blocks per SM: the memory-bound case lives on bytes in flight, i.e. on
// resident blocks (shared memory allows 3-4 of them). Stating it also keeps sm_90's ptxas
// from squeezing the fp32 instantiations into 72 registers with a spill.
template <class T, int D, int DV, int ROWS, int BN>
__global__ void __launch_bounds__(128, 3)
burst_decode(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
             const int* __restrict__ kpos, float* __restrict__ out, float* __restrict__ lse,
             long long q_sb, long long q_st, long long q_skv, long long q_sg,
             long long k_sb, long long k_st, long long k_sh,
             long long v_sb, long long v_st, long long v_sh,
             long long o_sb, long long o_st, long long o_skv, long long o_sg, long long o_ssplit,
             long long l_sb, long long l_st, long long l_skv, long long l_sg, long long l_ssplit,
             int kv_heads, int tokens, int group, int n, int chunk, int qpos0, int left,
             float scale, int vec) {
    using L = decode_layout<T, D, DV, ROWS, BN>;
    using KT = typename L::KT;
    using VT = typename L::VT;
    constexpr int VEC = L::VEC, KSPLIT = L::KSPLIT, SR = L::SR, LPR = L::LPR, SPL = L::SPL;
    constexpr int CW = L::CW, CG = L::CG, RG = L::RG, RPT = L::RPT, QLD = L::QLD, SLD = L::SLD;
    extern __shared__ __align__(16) unsigned char smem[];
    T* Ks = reinterpret_cast<T*>(smem + L::K_OFF);
    T* Vs = reinterpret_cast<T*>(smem + L::V_OFF);
    float* Qs = reinterpret_cast<float*>(smem + L::Q_OFF);
    float* Ss = reinterpret_cast<float*>(smem + L::S_OFF);
    float* rowscale = reinterpret_cast<float*>(smem + L::R_OFF);

    const int tid = threadIdx.x;
    const int rows_total = tokens * group;
    const int row_groups = (rows_total + ROWS - 1) / ROWS;
    const int bh = blockIdx.x / row_groups, r0 = (blockIdx.x % row_groups) * ROWS;
    const int b = bh / kv_heads, hk = bh % kv_heads;
    const int nrows = imin(ROWS, rows_total - r0);
    // This split's cache rows [c_begin, c_end); chunk is a multiple of BN.
    const long long split_begin = (long long)blockIdx.y * chunk;
    const int c_begin = split_begin < n ? (int)split_begin : n;
    const int c_end = split_begin + chunk < n ? (int)(split_begin + chunk) : n;
    const int ntiles = (c_end - c_begin + BN - 1) / BN;
    const bool vloads = vec != 0;
    const T* kb = k + b * k_sb + hk * k_sh;
    const T* vb = v + b * v_sb + hk * v_sh;

    // Start the first tile's copies, then stage Q while they fly.
    if (ntiles > 0) {
        load_cache_rows<T, D>(Ks, kb + c_begin * k_st, k_st, BN, imin(BN, c_end - c_begin), vloads);
        load_cache_rows<T, DV>(Vs, vb + c_begin * v_st, v_st, BN, imin(BN, c_end - c_begin), vloads);
    }
    cp_async_commit();
    const float qscale = scale * BURST_LOG2E;  // scores come out in log2 units: one ex2 each
    for (int i = tid; i < ROWS * D; i += L::THREADS) {
        const int r = i / D, c = i % D;
        float x = 0.f;
        if (r < nrows) {
            const int row = r0 + r;
            x = to_float(q[b * q_sb + (row / group) * q_st + hk * q_skv + (row % group) * q_sg + c]) * qscale;
        }
        Qs[r * QLD + c] = x;
    }

    // Score phase: this thread's key and rows, and each row's visible interval of positions.
    const int kj = tid % BN, kp = tid / BN;
    int qf[SR], ql[SR];
#pragma unroll
    for (int i = 0; i < SR; ++i) {
        const int t = imin((r0 + kp + KSPLIT * i) / group, tokens - 1);  // rows past the end: unused
        ql[i] = qpos0 + t;
        const long long lo = (long long)qpos0 + t - left;
        qf[i] = left < 0 || lo < -2147483647LL ? -2147483647 - 1 : (int)lo;
    }
    int kpos_cur = ntiles > 0 && kj < c_end - c_begin ? kpos[c_begin + kj] : 0;

    // Softmax phase: this thread's row and the row's running state (log2 units).
    const int sr = tid / LPR, sub = tid % LPR;
    const bool warp_has_rows = (tid / 32) * (32 / LPR) < nrows;  // warp-uniform
    float mrow = neg_inf(), lrow = 0.f;

    // P V phase: this thread's output columns and rows.
    const int cg = tid % CG, rg = tid / CG;
    bool mine[RPT];
#pragma unroll
    for (int i = 0; i < RPT; ++i) mine[i] = rg < RG && rg + RG * i < nrows;
    float o[RPT][CW];
#pragma unroll
    for (int i = 0; i < RPT; ++i)
#pragma unroll
        for (int c = 0; c < CW; ++c) o[i][c] = 0.f;

    for (int it = 0; it < ntiles; ++it) {
        const int c0 = c_begin + it * BN, kn = imin(BN, c_end - c0), buf = it & 1;
        __syncthreads();  // every thread is done with tile it-1: its buffers, S/P, the row scales
        int kpos_next = 0;
        if (it + 1 < ntiles) {
            const int c1 = c0 + BN, kn1 = imin(BN, c_end - c1);
            load_cache_rows<T, D>(Ks + (buf ^ 1) * BN * KT::ld, kb + c1 * k_st, k_st, BN, kn1, vloads);
            load_cache_rows<T, DV>(Vs + (buf ^ 1) * BN * VT::ld, vb + c1 * v_st, v_st, BN, kn1, vloads);
            kpos_next = kj < kn1 ? kpos[c1 + kj] : 0;
        }
        cp_async_commit();   // (possibly empty: keeps the group count uniform)
        cp_async_wait<1>();  // tile it is here, tile it+1 may still be in flight ...
        __syncthreads();     // ... for every thread's copies (and Q, on the first tile)

        {   // scores, in log2 units, -inf where masked
            const T* krow = Ks + buf * BN * KT::ld + kj * KT::ld;
            float s[SR];
#pragma unroll
            for (int i = 0; i < SR; ++i) s[i] = 0.f;
#pragma unroll 4
            for (int c = 0; c < D; c += VEC) {
                float kf[VEC];
                load_floats<T, VEC>(kf, krow + c);
#pragma unroll
                for (int i = 0; i < SR; ++i) {
                    if (kp + KSPLIT * i >= nrows) continue;
                    const float* qrow = Qs + (kp + KSPLIT * i) * QLD + c;
#pragma unroll
                    for (int e = 0; e < VEC; e += 4) {
                        float qv[4];
                        load_floats<float, 4>(qv, qrow + e);
                        s[i] += qv[0] * kf[e] + qv[1] * kf[e + 1] + qv[2] * kf[e + 2] + qv[3] * kf[e + 3];
                    }
                }
            }
            const bool key_ok = kj < kn;
#pragma unroll
            for (int i = 0; i < SR; ++i) {
                const int r = kp + KSPLIT * i;
                if (r < nrows)
                    Ss[r * SLD + kj] = key_ok && in_interval(qf[i], ql[i], kpos_cur) ? s[i] : neg_inf();
            }
        }
        __syncthreads();  // S is complete

        if (warp_has_rows) {  // online softmax, as in attn_fwd.cu: m' = max(m, max_j s_j),
            // l' = l 2^(m - m') + sum_j 2^(s_j - m'), acc' = acc 2^(m - m') + sum_j 2^(s_j - m') v_j.
            // A row that has seen nothing keeps m = -inf and is shifted by 0, not by m', so
            // every exponential is 0 rather than NaN.
            const bool ok = sr < nrows;
            float x[SPL], mx = neg_inf();
#pragma unroll
            for (int e = 0; e < SPL; ++e) {
                x[e] = ok ? Ss[sr * SLD + sub + LPR * e] : neg_inf();
                mx = fmax2(mx, x[e]);
            }
            const float m_new = fmax2(mrow, group_max<LPR>(mx));
            const float shift = m_new == neg_inf() ? 0.f : m_new;
            float sum = 0.f;
#pragma unroll
            for (int e = 0; e < SPL; ++e) {
                x[e] = fast_exp2(x[e] - shift);
                sum += x[e];
                if (ok) Ss[sr * SLD + sub + LPR * e] = x[e];
            }
            const float alpha = fast_exp2(mrow - shift);
            lrow = lrow * alpha + group_sum<LPR>(sum);
            mrow = m_new;
            if (ok && sub == 0) rowscale[sr] = alpha;
        }
        __syncthreads();  // P and the row scales are complete

        {   // o = o * alpha + P V
            const T* vcol = Vs + buf * BN * VT::ld + cg * CW;
#pragma unroll
            for (int i = 0; i < RPT; ++i) {
                if (!mine[i]) continue;
                const float a = rowscale[rg + RG * i];
#pragma unroll
                for (int c = 0; c < CW; ++c) o[i][c] *= a;
            }
#pragma unroll 2
            for (int j = 0; j < BN; j += 4) {
                float p[RPT][4];
#pragma unroll
                for (int i = 0; i < RPT; ++i)
                    if (mine[i]) load_floats<float, 4>(p[i], Ss + (rg + RG * i) * SLD + j);
#pragma unroll
                for (int jj = 0; jj < 4; ++jj) {
                    float vf[CW];
                    load_floats<T, CW>(vf, vcol + (j + jj) * VT::ld);
#pragma unroll
                    for (int i = 0; i < RPT; ++i) {
                        if (!mine[i]) continue;
#pragma unroll
                        for (int c = 0; c < CW; ++c) o[i][c] += p[i][jj] * vf[c];
                    }
                }
            }
        }
        kpos_cur = kpos_next;
    }
    cp_async_wait<0>();  // no copy may still target shared memory when the block ends
    __syncthreads();     // every thread is done reading the last tile's row scales

    if (sr < nrows && sub == 0) {
        const int row = r0 + sr, t = row / group, gi = row % group;
        const bool seen = lrow != 0.f;  // NaN too (a NaN in q, k or v reaches the row)
        rowscale[sr] = seen ? 1.f / lrow : 0.f;
        lse[b * l_sb + t * l_st + hk * l_skv + gi * l_sg + blockIdx.y * l_ssplit] =
            seen ? mrow * BURST_LN2 + logf(lrow) : neg_inf();
    }
    __syncthreads();  // 1 / l of every row is published
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
        if (!mine[i]) continue;
        const int r = rg + RG * i, row = r0 + r, t = row / group, gi = row % group;
        const float inv = rowscale[r];
        float* dst = out + b * o_sb + t * o_st + hk * o_skv + gi * o_sg + blockIdx.y * o_ssplit + cg * CW;
#pragma unroll
        for (int c = 0; c < CW; ++c) dst[c] = o[i][c] * inv;
    }
}

template <class T, int DV>
__global__ void __launch_bounds__(128)
burst_decode_combine(T* __restrict__ out, float* __restrict__ lse,
                     const float* __restrict__ parts_out, const float* __restrict__ parts_lse,
                     long long o_sb, long long o_st, long long o_skv, long long o_sg,
                     long long l_sb, long long l_st, long long l_skv, long long l_sg,
                     long long po_sp, long long po_sr, long long pl_sp, long long pl_sr,
                     int rows, int kv_heads, int tokens, int group, int parts) {
    static_assert(DV % 32 == 0, "lanes take every 32nd column");
    constexpr int PER_LANE = DV / 32;
    const long long rid = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (rid >= rows) return;  // warp-uniform; no barrier or collective follows
    const int lane = threadIdx.x & 31;
    const int gi = (int)(rid % group), t = (int)(rid / group % tokens);
    const long long bh = rid / ((long long)group * tokens);
    const int hk = (int)(bh % kv_heads), b = (int)(bh / kv_heads);

    float m = neg_inf();
    bool any = false;  // some partial saw a key, or is NaN (which must reach the row)
    for (int p = 0; p < parts; ++p) {
        const float lp = parts_lse[p * pl_sp + rid * pl_sr];
        m = fmax2(m, lp);
        any |= lp != neg_inf();
    }
    float acc[PER_LANE], total = 0.f;
#pragma unroll
    for (int c = 0; c < PER_LANE; ++c) acc[c] = 0.f;
    if (any) {
        for (int p = 0; p < parts; ++p) {
            const float lp = parts_lse[p * pl_sp + rid * pl_sr];
            if (lp == neg_inf()) continue;  // saw nothing: weight 0, and its out is not read
            // Natural-log units throughout (lse as the kernels and the caller keep it); expf,
            // not ex2.approx: the weights are few and their error would show in every column.
            const float w = expf(lp - m);
            total += w;
            const float* src = parts_out + p * po_sp + rid * po_sr;
#pragma unroll
            for (int c = 0; c < PER_LANE; ++c) acc[c] += w * src[lane + 32 * c];
        }
    }
    const bool seen = total != 0.f;  // total >= 1 whenever some partial saw a key; NaN carries a NaN
    const float inv = seen ? 1.f / total : 0.f;
    T* dst = out + b * o_sb + t * o_st + hk * o_skv + gi * o_sg;
#pragma unroll
    for (int c = 0; c < PER_LANE; ++c) dst[lane + 32 * c] = from_float<T>(acc[c] * inv);
    if (lane == 0) lse[b * l_sb + t * l_st + hk * l_skv + gi * l_sg] = seen ? m + logf(total) : neg_inf();
}
