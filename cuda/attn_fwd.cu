// Forward local attention of one ring step, merged into the running softmax state.
//
// burst_fwd<T, D, DV, WARPS, BN>
//   grid  (ceil(Cq / BM), heads, batch) with BM = 16 * WARPS query rows per block;
//   block WARPS * 32 threads; warp w owns query rows 16w .. 16w+15 of the block's tile.
//   Query head h reads KV head h / (heads / kv_heads): GQA by index, never by copying.
//   Shared memory (dynamic, bytes from burstmpi/_gpu/kernels.py):
//     Q tile  BM x D    loaded once
//     K tile  BN x D    } reloaded for every key tile that is not masked away entirely;
//     V tile  BN x DV   } K(i+1) loads during P V of tile i, V(i) during Q K^T of tile i
//     float-only P scratch, WARPS x 16 x (BN + 4) fp32 (see tile.cuh)
//   Reads   q (T), k, v (T); the mask (cuda/mask.cuh) as int32 arrays: qfirst, qlast
//           (per query row, the global positions of the first and last key it sees) and
//           kpos (per key row, its global position); a block-sparse bitmap, or null
//           (bits, qblk, kblk, bits_rs, bits_cs: mask.cuh's BlockBits, rows = queries);
//           and the running state acc (fp32,
//           unnormalised output), m (fp32 running max of the scaled scores, natural-log
//           units), l (fp32 running sum of exp(s - m)).
//           Key tiles no row of the block sees are skipped (neither loaded nor computed);
//           tiles every row sees entirely run without per-element masks.
//   Writes  acc, m, l in place: the ring merge (GAO) happens inside the tile loop, exactly
//           as FlashAttention-2 merges one key tile into the next. A fresh state is
//           acc = 0, m = -inf, l = 0.
//
// burst_fwd_finalize<T, DV>
//   grid ceil(rows / 4), block 128: one warp per (batch, token, head) row.
//   Reads acc, m, l; writes out = acc / l (T) and lse = m + log(l) (fp32). A row that saw
//   no key gets out 0 and lse -inf; a NaN sum (a NaN or Inf among the row's q, k, v) gives NaN.
//
// Strides are in elements. Query-side tensors (q, dout, out, acc, m, l, lse, D, dq) take
// four: batch, token, KV head, and head within the KV head's group, so query head
// h = hk * group + gi may live in the user's (B, C, heads, d) layout or in the ring's
// packets, grouped (B, kv_heads, C, group, d), alike. Key-side tensors (k, v, dk, dv) take
// three: batch, token, KV head. The last (feature) axis is contiguous, and the rows of q,
// k, v, dout start 16-byte aligned for cp.async (burstmpi/_gpu/kernels.py checks that when it
// builds a launch).
#include "tile.cuh"
#include "mask.cuh"

template <class T, int D, int DV, int WARPS, int BN>
__global__ void __launch_bounds__(WARPS * 32, 1)
burst_fwd(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
          float* __restrict__ acc, float* __restrict__ m, float* __restrict__ l,
          const int* __restrict__ qfirst, const int* __restrict__ qlast,
          const int* __restrict__ kpos, const unsigned char* __restrict__ bits,
          const int* __restrict__ qblk, const int* __restrict__ kblk, int bits_rs, int bits_cs,
          long long q_sb, long long q_st, long long q_skv, long long q_sg,
          long long k_sb, long long k_st, long long k_sh,
          long long v_sb, long long v_st, long long v_sh,
          long long a_sb, long long a_st, long long a_skv, long long a_sg,
          long long r_sb, long long r_st, long long r_skv, long long r_sg,
          int Cq, int Ck, int heads, int kv_heads, float scale) {
    const BlockBits mb{bits, qblk, kblk, bits_rs, bits_cs};
    constexpr int BM = 16 * WARPS, NT = BN / 8, NO = DV / 8;
    using QK = smem_tile<T, D>;
    using VV = smem_tile<T, DV>;
    extern __shared__ __align__(16) unsigned char smem[];
    T* Qs = reinterpret_cast<T*>(smem);
    T* Ks = reinterpret_cast<T*>(smem + QK::bytes(BM));
    T* Vs = reinterpret_cast<T*>(smem + QK::bytes(BM + BN));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float* scratch = reinterpret_cast<float*>(smem + QK::bytes(BM + BN) + VV::bytes(BN)) + warp * 16 * (BN + 4);

    const int q0 = blockIdx.x * BM, h = blockIdx.y, b = blockIdx.z;
    const int group = heads / kv_heads, hk = h / group, gi = h % group;
    const int rows_valid = imin(BM, Cq - q0);
    const T* kb = k + b * k_sb + hk * k_sh;
    const T* vb = v + b * v_sb + hk * v_sh;
    load_rows_async<T, D>(Qs, q + b * q_sb + hk * q_skv + gi * q_sg + q0 * q_st, q_st, BM, rows_valid);
    cp_async_commit();

    // This thread's two rows (g and g+8 of its warp's 16), their state and visible key
    // intervals. Inside the kernel m is kept in log2 units so that every exponential is
    // one ex2.
    int row[2], qf[2], ql[2], brow[2];
    float mrow[2], lrow[2], o[NO][4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        row[i] = q0 + warp * 16 + g + 8 * i;
        const bool ok = row[i] < Cq;
        const long long r = b * r_sb + row[i] * r_st + hk * r_skv + gi * r_sg;
        const float* a = acc + b * a_sb + row[i] * a_st + hk * a_skv + gi * a_sg;
        qf[i] = ok ? qfirst[row[i]] : 0;
        ql[i] = ok ? qlast[row[i]] : -1;  // rows past the end see nothing
        brow[i] = ok ? mb.row(row[i]) : 0;
        mrow[i] = ok ? m[r] * BURST_LOG2E : neg_inf();
        lrow[i] = ok ? l[r] : 0.f;
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            o[j][2 * i] = ok ? a[8 * j + 2 * t] : 0.f;
            o[j][2 * i + 1] = ok ? a[8 * j + 2 * t + 1] : 0.f;
        }
    }

    // The block's first and last valid rows bound every row's interval (mask.cuh).
    const int r1 = q0 + rows_valid - 1;
    const int first0 = qfirst[q0], last0 = qlast[q0], first1 = qfirst[r1], last1 = qlast[r1];
    const float scale_log2 = scale * BURST_LOG2E;
    // Key tiles that no query of this block can see are skipped (block-uniform, so no
    // barrier is ever skipped by some threads only). The loads are pipelined as in
    // FlashAttention-2: K of the next tile streams in during this tile's P V product, V of
    // this tile during its Q K^T.
    auto tile_class = [&](int c) {
        const int c1 = imin(c + BN, Ck) - 1;
        return combine_tiles(classify_tile(first0, last0, first1, last1, kpos[c], kpos[c1]),
                             mb.classify(q0, r1, c, c1));
    };
    auto next_tile = [&](int c) {
        if (!mb.on()) return next_visible_tile(kpos, c, Ck, BN, first0, last1);
        for (; c < Ck; c += BN)
            if (tile_class(c) != TILE_EMPTY) return c;
        return Ck;
    };
    int c0 = next_tile(0);
    if (c0 < Ck) {
        load_rows_async<T, D>(Ks, kb + c0 * k_st, k_st, BN, imin(BN, Ck - c0));
        cp_async_commit();
    }
    while (c0 < Ck) {
        const int kn = imin(BN, Ck - c0);
        const int cls = tile_class(c0);
        __syncthreads();  // every warp is done with the previous V tile
        load_rows_async<T, DV>(Vs, vb + c0 * v_st, v_st, BN, kn);
        cp_async_commit();
        cp_async_wait<1>();  // Q and K are here (V may still be in flight) ...
        __syncthreads();     // ... for every thread's copies, not just this one's

        float s[NT][4];
        warp_gemm_abt<T, NT, D>(s, Qs + warp * 16 * QK::ld, QK::ld, Ks, QK::ld);
        const bool masked = cls == TILE_PARTIAL || kn < BN;
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = 8 * j + 2 * t + (e & 1);
                const bool off = masked && (col >= kn || !in_interval(qf[e >> 1], ql[e >> 1], kpos[c0 + col])
                                            || !mb.sees(brow[e >> 1], c0 + col));
                s[j][e] = off ? neg_inf() : s[j][e] * scale_log2;
            }

        // Online softmax (the merge identity): with m' = max(m, max_j s_j),
        //   l' = l 2^(m - m') + sum_j 2^(s_j - m'),   acc' = acc 2^(m - m') + sum_j 2^(s_j - m') v_j.
        // A row that has seen no key yet keeps m = -inf; it is shifted by 0 instead of
        // m', so the exponentials give 0 rather than NaN from (-inf) - (-inf).
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx = neg_inf();
#pragma unroll
            for (int j = 0; j < NT; ++j) mx = fmax2(mx, fmax2(s[j][2 * i], s[j][2 * i + 1]));
            const float m_new = fmax2(mrow[i], quad_max(mx));
            const float shift = m_new == neg_inf() ? 0.f : m_new;
            const float alpha = fast_exp2(mrow[i] - shift);
            float sum = 0.f;
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                s[j][2 * i] = fast_exp2(s[j][2 * i] - shift);
                s[j][2 * i + 1] = fast_exp2(s[j][2 * i + 1] - shift);
                sum += s[j][2 * i] + s[j][2 * i + 1];
            }
            lrow[i] = lrow[i] * alpha + quad_sum(sum);
            mrow[i] = m_new;
#pragma unroll
            for (int j = 0; j < NO; ++j) {
                o[j][2 * i] *= alpha;
                o[j][2 * i + 1] *= alpha;
            }
        }

        cp_async_wait<0>();
        __syncthreads();  // V is here for every thread, and every warp is done with K
        const int next = next_tile(c0 + BN);
        if (next < Ck) {
            load_rows_async<T, D>(Ks, kb + next * k_st, k_st, BN, imin(BN, Ck - next));
            cp_async_commit();
        }
        warp_gemm_pv<T, NO, NT>(o, s, Vs, VV::ld, scratch);
        c0 = next;
    }
    cp_async_wait<0>();  // no copy may still target shared memory when the block ends

#pragma unroll
    for (int i = 0; i < 2; ++i) {
        if (row[i] >= Cq) continue;
        const long long r = b * r_sb + row[i] * r_st + hk * r_skv + gi * r_sg;
        float* a = acc + b * a_sb + row[i] * a_st + hk * a_skv + gi * a_sg;
        m[r] = mrow[i] * BURST_LN2;
        l[r] = lrow[i];
#pragma unroll
        for (int j = 0; j < NO; ++j) {
            a[8 * j + 2 * t] = o[j][2 * i];
            a[8 * j + 2 * t + 1] = o[j][2 * i + 1];
        }
    }
}

template <class T, int DV>
__global__ void __launch_bounds__(128)
burst_fwd_finalize(T* __restrict__ out, float* __restrict__ lse, const float* __restrict__ acc,
                   const float* __restrict__ m, const float* __restrict__ l,
                   long long o_sb, long long o_st, long long o_skv, long long o_sg,
                   long long lse_sb, long long lse_st, long long lse_skv, long long lse_sg,
                   long long a_sb, long long a_st, long long a_skv, long long a_sg,
                   long long r_sb, long long r_st, long long r_skv, long long r_sg,
                   int batch, int C, int heads, int kv_heads) {
    const long long rid = (long long)blockIdx.x * 4 + (threadIdx.x >> 5);
    if (rid >= (long long)batch * C * heads) return;  // warp-uniform; no barrier follows
    const int lane = threadIdx.x & 31;
    const int h = (int)(rid % heads), tok = (int)((rid / heads) % C), b = (int)(rid / ((long long)heads * C));
    const int hk = h / (heads / kv_heads), gi = h % (heads / kv_heads);
    const long long r = b * r_sb + tok * r_st + hk * r_skv + gi * r_sg;
    const float lv = l[r];
    const bool seen = lv != 0.f;  // NaN too: a NaN in q, k or v reaches out and lse, never a silent 0
    const float inv = seen ? 1.f / lv : 0.f;
    const float* a = acc + b * a_sb + tok * a_st + hk * a_skv + gi * a_sg;
    T* o = out + b * o_sb + tok * o_st + hk * o_skv + gi * o_sg;
    for (int c = lane; c < DV; c += 32) o[c] = from_float<T>(a[c] * inv);
    if (lane == 0) lse[b * lse_sb + tok * lse_st + hk * lse_skv + gi * lse_sg] = seen ? m[r] + logf(lv) : neg_inf();
}
