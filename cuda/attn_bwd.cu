// Backward local attention of one ring step (FlashAttention-2's backward, split in two).
//
// The ring's backward moves Q, dO, D and lse (burst mode) or K and V (ring mode), never O:
// these kernels rebuild P = exp(s - lse) from the forward's lse and use D = rowsum(dO * O),
// computed once per rank by burst_bwd_preprocess.
//
// dQ and dK/dV are two kernels, each with exclusive ownership of what it writes, instead of
// one kernel that adds dQ with atomics. That costs recomputing S and dP once more (7 tile
// GEMMs instead of 5) and buys results that are bitwise reproducible and free of races
// between blocks by construction (races an emulator could not see; tests/emulator).
//
// burst_bwd_preprocess<T, DV>
//   grid ceil(rows / 4), block 128, one warp per (batch, token, head) row.
//   Reads dout, out (T); writes D = rowsum(dout * out) in fp32.
//
// burst_bwd_dq<T, D, DV, WARPS, BN>
//   grid (ceil(Cq / BM), heads, batch), BM = 16 * WARPS query rows; warp w owns rows
//   16w .. 16w+15. Shared memory: Q (BM x D) and dO (BM x DV) once; K (BN x D) and V
//   (BN x DV) per key tile; the float path's P scratch, WARPS x 16 x (BN + 4) fp32.
//   Reads q, k, v, dout (T), lse, Dsum (fp32) and the mask as in burst_fwd: qfirst, qlast
//   (int32, per query row the positions of the first and last key it sees) and kpos (per
//   key row its position), and a block-sparse bitmap or null (bits, qblk, kblk, bits_rs,
//   bits_cs: mask.cuh's BlockBits, rows = queries). Adds dS K to dq (fp32, in place, WITHOUT the softmax scale:
//   the ring applies it once, at home).
//
// burst_bwd_dkdv<T, D, DV, WARPS, BN, PART>
//   grid (ceil(Ck / BM), kv_heads, batch), BM = 16 * WARPS key rows; warp w owns key rows
//   16w .. 16w+15 and loops over every query head of its KV head's group (GQA) and over
//   the query tiles of BN rows. PART 0 computes dK and dV; for head dims whose two
//   accumulators (D/2 + DV/2 registers a thread) cannot share the register file, two
//   launches split the work, PART 1 (dV only) and PART 2 (dK only, recomputing P). Shared memory: K (BM x D), V (BM x DV) once; Q (BN x D),
//   dO (BN x DV), lse and D (BN fp32 each) per query tile; the float path's P scratch.
//   Reads the same tensors as burst_bwd_dq, and the mask from the keys' side: qpos (int32,
//   per query row its position) and kfirst, klast (per key row the positions of the
//   first and last query that sees it; cuda/mask.cuh), and the bitmap with rows = keys
//   (bits, kblk, qblk, bits_rs, bits_cs). Adds to dk (scaled) and dv (fp32, in place).
//
// Both tiled kernels skip the column tiles no row of the block sees and run the tiles
// every row sees entirely without per-element masks, as the forward does.
//
// lse = -inf (a row that saw no key) is read as +inf, so that exp(s - lse) is 0 there.
// Strides as in attn_fwd.cu: four for query-side tensors, three for key-side ones.
#include "tile.cuh"
#include "mask.cuh"

__device__ __forceinline__ float lse_log2(float lse) {
    return lse == neg_inf() ? pos_inf() : lse * BURST_LOG2E;
}

template <class T, int DV>
__global__ void __launch_bounds__(128)
burst_bwd_preprocess(float* __restrict__ Dsum, const T* __restrict__ dout, const T* __restrict__ out,
                     long long r_sb, long long r_st, long long r_skv, long long r_sg,
                     long long do_sb, long long do_st, long long do_skv, long long do_sg,
                     long long o_sb, long long o_st, long long o_skv, long long o_sg,
                     int batch, int C, int heads, int kv_heads) {
    const long long rid = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (rid >= (long long)batch * C * heads) return;  // warp-uniform; no barrier follows
    const int lane = threadIdx.x & 31;
    const int h = (int)(rid % heads), tok = (int)((rid / heads) % C), b = (int)(rid / ((long long)heads * C));
    const int hk = h / (heads / kv_heads), gi = h % (heads / kv_heads);
    const T* x = dout + b * do_sb + tok * do_st + hk * do_skv + gi * do_sg;
    const T* y = out + b * o_sb + tok * o_st + hk * o_skv + gi * o_sg;
    float sum = 0.f;
    for (int c = lane; c < DV; c += 32) sum += to_float(x[c]) * to_float(y[c]);
#pragma unroll
    for (int w = 16; w > 0; w >>= 1) sum += shfl_xor(sum, w);
    if (lane == 0) Dsum[b * r_sb + tok * r_st + hk * r_skv + gi * r_sg] = sum;
}

template <class T, int D, int DV, int WARPS, int BN>
__global__ void __launch_bounds__(WARPS * 32, 1)
burst_bwd_dq(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
             const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ Dsum,
             float* __restrict__ dq, const int* __restrict__ qfirst, const int* __restrict__ qlast,
             const int* __restrict__ kpos, const unsigned char* __restrict__ bits,
             const int* __restrict__ qblk, const int* __restrict__ kblk, int bits_rs, int bits_cs,
             long long q_sb, long long q_st, long long q_skv, long long q_sg,
             long long k_sb, long long k_st, long long k_sh,
             long long v_sb, long long v_st, long long v_sh,
             long long do_sb, long long do_st, long long do_skv, long long do_sg,
             long long r_sb, long long r_st, long long r_skv, long long r_sg,
             long long ds_sb, long long ds_st, long long ds_skv, long long ds_sg,
             long long dq_sb, long long dq_st, long long dq_skv, long long dq_sg,
             int Cq, int Ck, int heads, int kv_heads, float scale) {
    const BlockBits mb{bits, qblk, kblk, bits_rs, bits_cs};
    constexpr int BM = 16 * WARPS, NT = BN / 8, NQ = D / 8;
    using QK = smem_tile<T, D>;
    using VV = smem_tile<T, DV>;
    extern __shared__ __align__(16) unsigned char smem[];
    T* Qs = reinterpret_cast<T*>(smem);
    T* dOs = reinterpret_cast<T*>(smem + QK::bytes(BM));
    T* Ks = reinterpret_cast<T*>(smem + QK::bytes(BM) + VV::bytes(BM));
    T* Vs = reinterpret_cast<T*>(smem + QK::bytes(BM + BN) + VV::bytes(BM));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float* scratch = reinterpret_cast<float*>(smem + QK::bytes(BM + BN) + VV::bytes(BM + BN)) + warp * 16 * (BN + 4);

    const int q0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z;
    const int group = heads / kv_heads, hk = h / group, gi = h % group;
    const int rows_valid = imin(BM, Cq - q0);
    const T* kb = k + b * k_sb + hk * k_sh;
    const T* vb = v + b * v_sb + hk * v_sh;
    load_rows_async<T, D>(Qs, q + b * q_sb + hk * q_skv + gi * q_sg + q0 * q_st, q_st, BM, rows_valid);
    load_rows_async<T, DV>(dOs, dout + b * do_sb + hk * do_skv + gi * do_sg + q0 * do_st, do_st, BM, rows_valid);
    cp_async_commit();

    int row[2], qf[2], ql[2], brow[2];
    float lse2[2], Drow[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        row[i] = q0 + warp * 16 + g + 8 * i;
        const bool ok = row[i] < Cq;
        const long long r = b * r_sb + row[i] * r_st + hk * r_skv + gi * r_sg;
        const long long rd = b * ds_sb + row[i] * ds_st + hk * ds_skv + gi * ds_sg;
        qf[i] = ok ? qfirst[row[i]] : 0;
        ql[i] = ok ? qlast[row[i]] : -1;  // rows past the end see nothing
        brow[i] = ok ? mb.row(row[i]) : 0;
        lse2[i] = ok ? lse_log2(lse[r]) : pos_inf();
        Drow[i] = ok ? Dsum[rd] : 0.f;
    }
    float acc[NQ][4];
#pragma unroll
    for (int j = 0; j < NQ; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

    // The block's first and last valid rows bound every row's interval (mask.cuh).
    const int r1 = q0 + rows_valid - 1;
    const int first0 = qfirst[q0], last0 = qlast[q0], first1 = qfirst[r1], last1 = qlast[r1];
    const float scale_log2 = scale * BURST_LOG2E;
    for (int c0 = 0; c0 < Ck; c0 += BN) {
        const int kn = imin(BN, Ck - c0);
        const int cls = combine_tiles(classify_tile(first0, last0, first1, last1, kpos[c0], kpos[c0 + kn - 1]),
                                      mb.classify(q0, r1, c0, c0 + kn - 1));
        if (cls == TILE_EMPTY) continue;  // block-uniform
        __syncthreads();  // every warp is done with the previous K and V tiles
        load_rows_async<T, D>(Ks, kb + c0 * k_st, k_st, BN, kn);
        load_rows_async<T, DV>(Vs, vb + c0 * v_st, v_st, BN, kn);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        float p[NT][4], dp[NT][4];
        warp_gemm_abt<T, NT, D>(p, Qs + warp * 16 * QK::ld, QK::ld, Ks, QK::ld);
        warp_gemm_abt<T, NT, DV>(dp, dOs + warp * 16 * VV::ld, VV::ld, Vs, VV::ld);
        const bool masked = cls == TILE_PARTIAL || kn < BN;
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = e >> 1, col = 8 * j + 2 * t + (e & 1);
                const bool off = masked && (col >= kn || !in_interval(qf[i], ql[i], kpos[c0 + col])
                                            || !mb.sees(brow[i], c0 + col));
                const float pv = off ? 0.f : fast_exp2(p[j][e] * scale_log2 - lse2[i]);
                p[j][e] = pv * (dp[j][e] - Drow[i]);  // dS = P * (dP - D)
            }
        warp_gemm_pv<T, NQ, NT>(acc, p, Ks, QK::ld, scratch);
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (row[i] >= Cq) continue;
        float* out = dq + b * dq_sb + row[i] * dq_st + hk * dq_skv + gi * dq_sg;
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            out[8 * j + 2 * t] += acc[j][2 * i];
            out[8 * j + 2 * t + 1] += acc[j][2 * i + 1];
        }
    }
}

template <class T, int D, int DV, int WARPS, int BN, int PART>
__global__ void __launch_bounds__(WARPS * 32, 1)
burst_bwd_dkdv(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
               const T* __restrict__ dout, const float* __restrict__ lse, const float* __restrict__ Dsum,
               float* __restrict__ dk, float* __restrict__ dv,
               const int* __restrict__ qpos, const int* __restrict__ kfirst,
               const int* __restrict__ klast, const unsigned char* __restrict__ bits,
               const int* __restrict__ kblk, const int* __restrict__ qblk, int bits_rs, int bits_cs,
               long long q_sb, long long q_st, long long q_skv, long long q_sg,
               long long k_sb, long long k_st, long long k_sh,
               long long v_sb, long long v_st, long long v_sh,
               long long do_sb, long long do_st, long long do_skv, long long do_sg,
               long long r_sb, long long r_st, long long r_skv, long long r_sg,
               long long ds_sb, long long ds_st, long long ds_skv, long long ds_sg,
               long long dk_sb, long long dk_st, long long dk_sh,
               long long dv_sb, long long dv_st, long long dv_sh,
               int Cq, int Ck, int heads, int kv_heads, float scale) {
    const BlockBits mb{bits, kblk, qblk, bits_rs, bits_cs};
    constexpr int BM = 16 * WARPS, NT = BN / 8, NK = D / 8, NV = DV / 8;
    constexpr bool WANT_DK = PART != 1, WANT_DV = PART != 2;
    using QK = smem_tile<T, D>;
    using VV = smem_tile<T, DV>;
    extern __shared__ __align__(16) unsigned char smem[];
    T* Ks = reinterpret_cast<T*>(smem);
    T* Vs = reinterpret_cast<T*>(smem + QK::bytes(BM));
    T* Qs = reinterpret_cast<T*>(smem + QK::bytes(BM) + VV::bytes(BM));
    T* dOs = reinterpret_cast<T*>(smem + QK::bytes(BM + BN) + VV::bytes(BM));
    float* lse_s = reinterpret_cast<float*>(smem + QK::bytes(BM + BN) + VV::bytes(BM + BN));
    float* D_s = lse_s + BN;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float* scratch = D_s + BN + warp * 16 * (BN + 4);

    const int k0 = blockIdx.x * BM, hk = blockIdx.y, b = blockIdx.z;
    const int group = heads / kv_heads;
    const int keys_valid = imin(BM, Ck - k0);
    load_rows_async<T, D>(Ks, k + b * k_sb + hk * k_sh + k0 * k_st, k_st, BM, keys_valid);
    load_rows_async<T, DV>(Vs, v + b * v_sb + hk * v_sh + k0 * v_st, v_st, BM, keys_valid);
    cp_async_commit();

    // This thread's two key rows and the interval of queries that see each.
    int kf[2], kl[2], brow[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int key = k0 + warp * 16 + g + 8 * i;
        kf[i] = key < Ck ? kfirst[key] : 0;
        kl[i] = key < Ck ? klast[key] : -1;  // rows past the end are seen by no query
        brow[i] = key < Ck ? mb.row(key) : 0;
    }
    float dk_acc[WANT_DK ? NK : 1][4], dv_acc[WANT_DV ? NV : 1][4];
#pragma unroll
    for (int j = 0; j < (WANT_DK ? NK : 1); ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[j][e] = 0.f;
#pragma unroll
    for (int j = 0; j < (WANT_DV ? NV : 1); ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) dv_acc[j][e] = 0.f;

    // The block's first and last valid key rows bound every row's interval (mask.cuh).
    const int k1 = k0 + keys_valid - 1;
    const int first0 = kfirst[k0], last0 = klast[k0], first1 = kfirst[k1], last1 = klast[k1];
    const float scale_log2 = scale * BURST_LOG2E;
    for (int gi = 0; gi < group; ++gi) {
        const T* qb = q + b * q_sb + hk * q_skv + gi * q_sg;
        const T* dob = dout + b * do_sb + hk * do_skv + gi * do_sg;
        for (int c0 = 0; c0 < Cq; c0 += BN) {
            const int qn = imin(BN, Cq - c0);
            const int cls = combine_tiles(classify_tile(first0, last0, first1, last1, qpos[c0], qpos[c0 + qn - 1]),
                                          mb.classify(k0, k1, c0, c0 + qn - 1));
            if (cls == TILE_EMPTY) continue;  // block-uniform
            __syncthreads();  // every warp is done with the previous query tile
            load_rows_async<T, D>(Qs, qb + c0 * q_st, q_st, BN, qn);
            load_rows_async<T, DV>(dOs, dob + c0 * do_st, do_st, BN, qn);
            cp_async_commit();
            for (int i = threadIdx.x; i < BN; i += blockDim.x) {
                const long long r = b * r_sb + (c0 + i) * r_st + hk * r_skv + gi * r_sg;
                const long long rd = b * ds_sb + (c0 + i) * ds_st + hk * ds_skv + gi * ds_sg;
                lse_s[i] = i < qn ? lse_log2(lse[r]) : pos_inf();
                D_s[i] = i < qn ? Dsum[rd] : 0.f;
            }
            cp_async_wait<0>();
            __syncthreads();

            // Transposed scores: rows are this warp's keys, columns the tile's queries.
            float p[NT][4], dp[NT][4];
            warp_gemm_abt<T, NT, D>(p, Ks + warp * 16 * QK::ld, QK::ld, Qs, QK::ld);
            const bool masked = cls == TILE_PARTIAL || qn < BN;
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = 8 * j + 2 * t + (e & 1);
                    const bool off = masked && (col >= qn || !in_interval(kf[e >> 1], kl[e >> 1], qpos[c0 + col])
                                                || !mb.sees(brow[e >> 1], c0 + col));
                    p[j][e] = off ? 0.f : fast_exp2(p[j][e] * scale_log2 - lse_s[col]);
                }
            if constexpr (WANT_DV) warp_gemm_pv<T, NV, NT>(dv_acc, p, dOs, VV::ld, scratch);  // dV += P^T dO
            if constexpr (WANT_DK) {
                warp_gemm_abt<T, NT, DV>(dp, Vs + warp * 16 * VV::ld, VV::ld, dOs, VV::ld);
#pragma unroll
                for (int j = 0; j < NT; ++j)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int col = 8 * j + 2 * t + (e & 1);
                        p[j][e] *= dp[j][e] - D_s[col];  // dS^T = P^T * (dP^T - D)
                    }
                warp_gemm_pv<T, NK, NT>(dk_acc, p, Qs, QK::ld, scratch);  // dK += dS^T Q
            }
        }
    }
    cp_async_wait<0>();

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int key = k0 + warp * 16 + g + 8 * i;
        if (key >= Ck) continue;
        float* a = dk + b * dk_sb + key * dk_st + hk * dk_sh;
        float* c = dv + b * dv_sb + key * dv_st + hk * dv_sh;
        if constexpr (WANT_DK) {
#pragma unroll
            for (int j = 0; j < NK; ++j) {
                a[8 * j + 2 * t] += dk_acc[j][2 * i] * scale;
                a[8 * j + 2 * t + 1] += dk_acc[j][2 * i + 1] * scale;
            }
        }
        if constexpr (WANT_DV) {
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                c[8 * j + 2 * t] += dv_acc[j][2 * i];
                c[8 * j + 2 * t + 1] += dv_acc[j][2 * i + 1];
            }
        }
    }
}
