// FlashAttention forward: one thread block per (BLOCK_M query rows, batch x head, Dv chunk).
//
// The block stages its Q tile in shared memory once, then walks the key tiles its rows
// may attend (causal and window bound the range; tiles that block_mask or mask rule out
// entirely are skipped before any load). Per key tile: K and V are copied asynchronously,
// S = Q K^T is formed by the warp policy (each warp owns 16 rows), the score pipeline
// (flash_score.cuh) scales, caps, biases and masks it, and the online softmax folds it
// into a running row max m, a running sum l and an unnormalised O kept in registers.
// Normalisation happens once at the end, where the log-sum-exp is written out too.
//
// Template parameters: T the element type, Policy the warp product (flash_mma.cuh),
// HD the padded QK head dim, DV the width of the Dv chunk this block computes, BLOCK_N
// keys per tile, NUM_WARPS warps (BLOCK_M = 16 NUM_WARPS rows).
#include "flash_copy.cuh"
#include "flash_mma.cuh"
#include "flash_params.cuh"
#include "flash_score.cuh"
#include "philox.cuh"

namespace flash {

template <typename Acc> __device__ __forceinline__ Acc max_acc(Acc a, Acc b) { return a > b ? a : b; }

template <typename T, typename Policy, int HD, int DV, int BLOCK_N, int NUM_WARPS>
__global__ void __launch_bounds__(NUM_WARPS * 32) flash_fwd(const Params p) {
    using Acc = typename Policy::Acc;
    constexpr int THREADS = NUM_WARPS * 32;
    constexpr int BLOCK_M = 16 * NUM_WARPS;
    constexpr int PAD = 16 / sizeof(T);  // one 16-byte chunk per row: ldmatrix rows hit distinct banks
    constexpr int LDQ = HD + PAD, LDK = HD + PAD, LDV = DV + PAD;
    constexpr int NT = BLOCK_N / 8;      // accumulator tiles of S per warp
    constexpr int NO = DV / 8;           // accumulator tiles of O per warp

    extern __shared__ __align__(16) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);  // (BLOCK_M, HD)
    T* sK = sQ + BLOCK_M * LDQ;          // (BLOCK_N, HD)
    T* sV = sK + BLOCK_N * LDK;          // (BLOCK_N, DV)

    // Grid: x = (Dv chunk, row block) with row blocks fastest, so consecutive blocks share
    // K and V in L2; batch x heads is split over y and z (gridDim.y is at most 65535).
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m_blocks = (p.lq + BLOCK_M - 1) / BLOCK_M;
    const int chunk = blockIdx.x / m_blocks;
    const int i0 = (blockIdx.x - chunk * m_blocks) * BLOCK_M;
    const int dv0 = chunk * DV;  // first output column of this block
    const int bh = blockIdx.y + gridDim.y * blockIdx.z;
    if (bh >= p.batch * p.hq) return;
    const HeadView hv = head_view(p, bh);
    const bool packed = p.cu_seqlens_q != nullptr;
    const int frame_rows = packed ? hv.q_len : p.lq;  // rows this head owns in out and lse
    if (i0 >= frame_rows) return;
    const int hk = hv.h / (p.hq / p.hk);  // GQA: query head h reads key/value head h / group

    // 64-bit element offsets of this head's rows.
    const i64 q_off = (packed ? hv.q_start * p.q_sr : hv.b * p.q_sb) + hv.h * p.q_sh;
    const i64 k_off = (packed ? hv.k_start * p.k_sr : hv.b * p.k_sb) + hk * p.k_sh;
    const i64 v_off = (packed ? hv.k_start * p.v_sr : hv.b * p.v_sb) + hk * p.v_sh + dv0;
    const i64 o_off = (packed ? hv.q_start * p.o_sr : hv.b * p.o_sb) + hv.h * p.o_sh + dv0;
    const i64 lse_off = (packed ? hv.q_start : hv.b * p.lse_sb) + hv.h * p.lse_sh;
    const T* gQ = static_cast<const T*>(p.q) + q_off;
    const T* gK = static_cast<const T*>(p.k) + k_off;
    const T* gV = static_cast<const T*>(p.v) + v_off;
    T* gO = static_cast<T*>(p.o) + o_off;
    Acc* gLse = static_cast<Acc*>(p.lse) + lse_off;
    const int dv_valid = min(DV, p.dv - dv0);

    const int rows_valid = max(0, min(BLOCK_M, hv.q_len - i0));  // rows of this tile inside q_len
    int lo = 0, hi = 0;
    if (rows_valid > 0) key_range(p, hv, i0, i0 + rows_valid, lo, hi);

    const bool aligned = p.aligned != 0;
    load_tile<T, BLOCK_M, HD, LDQ, THREADS>(sQ, gQ + i0 * p.q_sr, p.q_sr, rows_valid, p.d, aligned);
    cp_async_commit();

    const ScoreOp<Acc> score(p, hv);
    const int r0 = i0 + 16 * warp + g;  // this thread's rows: r0 and r0 + 8
    Acc m[2] = {neg_inf<Acc>(), neg_inf<Acc>()};   // running row max (log2 domain)
    Acc l[2] = {Acc(0), Acc(0)};         // this thread's share of the running row sum
    Acc o[NO][4];
#pragma unroll
    for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = Acc(0);
    const bool dropout = p.dropout_threshold != 0;

    for (int j0 = lo; j0 < hi; j0 += BLOCK_N) {
        const int j1 = min(j0 + BLOCK_N, hi);
        if (!tile_live(p, hv, i0, i0 + rows_valid, j0, j1)) continue;  // uniform: every thread agrees
        __syncthreads();  // the previous tile's readers are done with sK and sV
        load_tile<T, BLOCK_N, HD, LDK, THREADS>(sK, gK + j0 * p.k_sr, p.k_sr, j1 - j0, p.d, aligned);
        cp_async_commit();
        load_tile<T, BLOCK_N, DV, LDV, THREADS>(sV, gV + j0 * p.v_sr, p.v_sr, j1 - j0, dv_valid, aligned);
        cp_async_commit();
        cp_async_wait<1>();  // Q and K have landed; V may still be in flight
        __syncthreads();

        Acc s[NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = Acc(0);
        Policy::template qk<HD, BLOCK_N, LDQ, LDK>(sQ + 16 * warp * LDQ, sK, s);  // S = Q K^T

        const bool band = !tile_inside_band(p, hv, i0, i0 + rows_valid, j0, j1);
        Acc row_max[2] = {neg_inf<Acc>(), neg_inf<Acc>()};
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = r0 + 8 * (e >> 1), j = j0 + 8 * n + 2 * t + (e & 1);
                // Keys past j1 are zero-filled padding of the tile: masked like any other.
                s[n][e] = j < j1 ? score(p, hv, s[n][e], i, j, band) : neg_inf<Acc>();
                row_max[e >> 1] = max_acc(row_max[e >> 1], s[n][e]);
            }
        }
        Acc alpha[2], m_safe[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {  // the four lanes of a quad share rows: reduce across them
            row_max[r] = max_acc(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 1));
            row_max[r] = max_acc(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 2));
            const Acc m_new = max_acc(m[r], row_max[r]);
            // A row with every score so far masked has m = -inf; subtracting 0 instead keeps
            // exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
            m_safe[r] = m_new == neg_inf<Acc>() ? Acc(0) : m_new;
            alpha[r] = fast_exp2(m[r] - m_safe[r]);  // rescales the old sum and accumulator
            m[r] = m_new;
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            bool keep[4] = {true, true, true, true};
            if (dropout) {
                const int j = j0 + 8 * n + 2 * t;
                dropout_keep_pair(p.seed, p.dropout_offset, hv.bh, r0, j, p.dropout_threshold, keep[0], keep[1]);
                dropout_keep_pair(p.seed, p.dropout_offset, hv.bh, r0 + 8, j, p.dropout_threshold, keep[2], keep[3]);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const Acc pe = fast_exp2(s[n][e] - m_safe[e >> 1]);  // P = exp2(S - m)
                l[e >> 1] += pe;                                      // lse is taken before dropout
                s[n][e] = keep[e] ? pe : Acc(0);  // dropped; 1 / (1 - p) is applied once at the end
            }
        }
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
        cp_async_wait<0>();
        __syncthreads();
        Policy::template pv<BLOCK_N, DV, LDV>(s, sV, o);  // O += P V
    }
    cp_async_wait<0>();  // a block that attended no tile still waits for its Q copy

    // Epilogue: O / l (times 1 / (1 - dropout_p)); rows with l = 0 saw no key: 0 and lse -inf.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const int i = r0 + 8 * r;
        if (i >= frame_rows) continue;
        const bool live = i < hv.q_len && l[r] > Acc(0);
        const Acc inv = live ? static_cast<Acc>(p.dropout_scale) / l[r] : Acc(0);
        T* orow = gO + i * p.o_sr;
#pragma unroll
        for (int n = 0; n < NO; ++n) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int col = 8 * n + 2 * t + c;
                if (col < dv_valid) orow[col] = static_cast<T>(o[n][2 * r + c] * inv);
            }
        }
        if (chunk == 0 && t == 0) {
            // lse = ln(sum exp(s)) = (m + log2 l) ln 2 in the log2 domain: m / log2(e) + ln l.
            gLse[i] = live ? m[r] / static_cast<Acc>(kLog2e) + log_acc(l[r]) : neg_inf<Acc>();
        }
    }
}

}  // namespace flash
