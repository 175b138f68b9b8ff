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
// keys per tile, NUM_WARPS warps of 16 Policy::MI rows each (BLOCK_M = 16 MI NUM_WARPS),
// STAGES shared-memory stages of K and V (see the pipeline below). Policies with
// WARPGROUP (Hopper's wgmma, flash_wgmma.cuh) multiply a warpgroup's 64 rows at once from
// swizzled tiles; the others a warp's rows from tiles with padded rows.
// FULL compiles the whole score pipeline (bias, ALiBi, softcap, masks, block mask) and
// dropout; without it only causal, window and lengths remain, which frees the registers
// that let a warp own two row groups.
#include "flash_copy.cuh"
#include "flash_mma.cuh"
#include "flash_params.cuh"
#include "flash_score.cuh"
#include "flash_wgmma.cuh"
#include "philox.cuh"

namespace flash {

// The larger of a and b. float: fmaxf, one FMNMX, NaN only if both are; a NaN score still
// reaches its row's output (it skips the row max, but P = exp2(NaN - m) is NaN, and so are
// l and O). double: a compare and select (NaN when b is), since fmax costs the float64
// kernels registers they do not have (spills on sm_80 to sm_90).
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return a > b ? a : b; }

// The first key tile at or after j (below hi) that some score of rows [i0, i1) survives in.
template <int BLOCK_N, bool FULL>
__device__ __forceinline__ int next_live_tile(const Params& p, const HeadView& hv, int i0, int i1, int j, int hi) {
    if constexpr (FULL) {
        while (j < hi && !tile_live(p, hv, i0, i1, j, min(j + BLOCK_N, hi))) j += BLOCK_N;
    }
    return j;
}

// S = Q K^T for the calling warp's rows with the policy's own product, ready to read: a
// warpgroup product is issued and waited for at once (the overlapped Hopper loop in
// flash_fwd issues and waits for its products itself).
template <typename Policy, int BLOCK_M, int HD, int BLOCK_N, typename QTile, typename KTile, typename T, typename Acc,
          int MI>
__device__ __forceinline__ void qk(const T* sQ, int warp, const T* sK, Acc (&s)[MI][BLOCK_N / 8][4]) {
    if constexpr (Policy::WARPGROUP) {
        static_assert(MI == 1, "a warp owns 16 rows of its warpgroup's 64");
        Policy::template qk_issue<BLOCK_M, HD, BLOCK_N>(sQ, sK, s);
        wgmma_wait<0>();
        fence_regs(s[0]);
    } else {
        Policy::template qk<HD, BLOCK_N, QTile::LD, KTile::LD>(sQ + 16 * MI * warp * QTile::LD, sK, s);
    }
}

// O += P V with the policy's own product (a warpgroup product waited for, as in qk).
template <typename Policy, int BLOCK_N, int DV, typename VTile, typename PFrag, typename T, typename Acc, int MI>
__device__ __forceinline__ void pv(PFrag& pf, const T* sV, Acc (&o)[MI][DV / 8][4]) {
    if constexpr (Policy::WARPGROUP) {
        Policy::template pv_issue<BLOCK_N, DV>(pf, sV, o);
        wgmma_wait<0>();
        fence_regs(o[0]);
        fence_regs(pf[0]);
    } else {
        Policy::template pv<BLOCK_N, DV, VTile::LD>(pf, sV, o);
    }
}

// The online softmax of one thread's rows: running max m (log2 domain) and this thread's
// share of the running sum l, and the score pipeline that feeds them. SEQUENTIAL_MASK: the
// plain kernel's masked tiles take TileBand's sequential test (see kSequentialMask).
template <typename Acc, int MI, bool FULL, bool SEQUENTIAL_MASK>
struct OnlineSoftmax {
    const Params& p;
    const HeadView& hv;
    const ScoreOp<Acc>& score;
    int i0, i1;    // the block's valid rows
    int r0, t;     // this thread's first row and its column pair in each 8-column tile
    bool plain;    // no option touches the scores: interior tiles only need S * scale * log2(e)
    bool dropout;
    Acc (&m)[2 * MI];  // rows r0 + 8 x, x in [0, 2 MI)
    Acc (&l)[2 * MI];

    // Scores of keys [jt0, jt0 + 8 NP) (valid below jt1) from raw products sp, turned into
    // P = exp2(S - m) in place (dropped elements 0) and folded into m and l; alpha =
    // exp2(m_old - m_new) per row is what O has to be rescaled by (rescale).
    template <int NP>
    __device__ __forceinline__ void exponentiate(Acc (&sp)[MI][NP][4], const int jt0, const int jt1,
                                                 Acc (&alpha)[2 * MI]) {
        Acc row_max[2 * MI];
#pragma unroll
        for (int x = 0; x < 2 * MI; ++x) row_max[x] = neg_inf<Acc>();
        // Walked with row 0 and column 0 at the thread's first element, each_element's row
        // i = 16 mi + 8 (e >> 1) is 8 x for the thread's row x (a constant once unrolled).
        auto fold_max = [&](Acc& s, int i, int) { row_max[i / 8] = max_acc(row_max[i / 8], s); };
        const bool crosses = !tile_inside_band(p, hv, i0, i1, jt0, jt1);
        if (plain && jt1 - jt0 == 8 * NP && !crosses) {
            each_element(sp, 0, 0, 0, [&](Acc& s, int i, int j) {
                s *= score.scale_log2;  // S = scale * log2(e) * Q K^T
                fold_max(s, i, j);
            });
        } else {
            // Keys past jt1 are zero-filled padding of the tile and rows past q_len are
            // discarded: both masked, the latter before any mask or bias read.
            if constexpr (FULL) {
                score.tile(p, hv, sp, r0, jt0, t, jt1, crosses);
            } else {
                const TileBand<SEQUENTIAL_MASK> kept(p, hv, crosses);
                each_element(sp, r0, jt0, t, [&](Acc& s, int i, int j) {
                    s = kept((j < jt1) & (i < hv.q_len), i, j) ? s * score.scale_log2 : neg_inf<Acc>();
                });
            }
            each_element(sp, 0, 0, 0, fold_max);
        }
        Acc m_safe[2 * MI];
#pragma unroll
        for (int r = 0; r < 2 * MI; ++r) {  // the four lanes of a quad share rows: reduce across them
            row_max[r] = max_acc(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 1));
            row_max[r] = max_acc(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 2));
            const Acc m_new = max_acc(m[r], row_max[r]);
            // A row with every score so far masked has m = -inf; subtracting 0 instead keeps
            // exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
            m_safe[r] = m_new == neg_inf<Acc>() ? Acc(0) : m_new;
            alpha[r] = softmax_exp2(m[r] - m_safe[r]);  // rescales the old sum and accumulator
            m[r] = m_new;
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
            for (int n = 0; n < NP; ++n) {
                unsigned keep = 0xfu;  // bit e: element e survives dropout
                if constexpr (FULL) {
                    if (dropout) {
                        const int i = r0 + 16 * mi, j = jt0 + 8 * n + 2 * t;
                        bool k0, k1, k2, k3;
                        dropout_keep_pair(p.seed, p.dropout_offset, hv.bh, i, j, p.dropout_threshold, k0, k1);
                        dropout_keep_pair(p.seed, p.dropout_offset, hv.bh, i + 8, j, p.dropout_threshold, k2, k3);
                        keep = unsigned(k0) | unsigned(k1) << 1 | unsigned(k2) << 2 | unsigned(k3) << 3;
                    }
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int x = 2 * mi + (e >> 1);
                    const Acc pe = softmax_exp2(sp[mi][n][e] - m_safe[x]);  // P = exp2(S - m)
                    l[x] += pe;                                           // lse is taken before dropout
                    sp[mi][n][e] = (keep >> e) & 1u ? pe : Acc(0);  // dropped; 1 / (1 - p) is applied once at the end
                }
            }
        }
    }

    // O *= alpha, row by row.
    template <int NO>
    static __device__ __forceinline__ void rescale(Acc (&o)[MI][NO][4], const Acc (&alpha)[2 * MI]) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                o[mi][n][0] *= alpha[2 * mi];
                o[mi][n][1] *= alpha[2 * mi];
                o[mi][n][2] *= alpha[2 * mi + 1];
                o[mi][n][3] *= alpha[2 * mi + 1];
            }
    }

    // exponentiate, then rescale O for the new maxima.
    template <int NP, int NO>
    __device__ __forceinline__ void fold(Acc (&sp)[MI][NP][4], const int jt0, const int jt1, Acc (&o)[MI][NO][4]) {
        Acc alpha[2 * MI];
        exponentiate(sp, jt0, jt1, alpha);
        rescale(o, alpha);
    }
};

// The float32 forward on Hopper's TF32 warpgroup products (MmaWgmmaTf32x3, plain kernels: no
// option touches the scores beyond causal, window and lengths), for one consumer warpgroup of
// 64 rows fed by a producer warpgroup. TF32 wgmma reads its shared-memory operands as they
// are, so the producer splits them into hi and lo tiles once each has landed: Q once, and
// every tile's K (in place) and V (from a staging tile, transposed: MmaWgmmaTf32x3::ColSplit).
// The consumer only issues products and takes the softmax, its warps alone on their
// schedulers but for the producer's; the copies and splits run beside its products instead
// of between them.
// Shared memory (Sw128 tiles): Q hi and lo (64, HD); two stages each of K hi and lo (BLOCK_N,
// HD), V^T hi and lo (DV, BLOCK_N) and V as copied (BLOCK_N, DV). K and V^T have stages and
// barriers of their own: the consumer is done with K_t (S_t = Q K_t^T) an iteration before
// V_t.
// Named barriers (0 is __syncthreads'), of both warpgroups: stage s of K or V^T full (the
// producer arrives once its stores are fenced, the consumer waits before the product) or
// empty (the consumer arrives once the products reading it have landed, the producer waits
// before refilling it).
enum Tf32x3Barrier : int { kFullK = 1, kFullV = 3, kEmptyK = 5, kEmptyV = 7 };

template <typename Policy, int HD, int DV, int BLOCK_N, int THREADS>
struct Tf32x3Smem {
    using QSplit = typename Policy::template RowSplit<64, HD, THREADS>;
    using KSplit = typename Policy::template RowSplit<BLOCK_N, HD, THREADS>;
    using VSplit = typename Policy::template ColSplit<BLOCK_N, DV, THREADS>;
    static constexpr int Q_ELEMS = 64 * HD, K_ELEMS = BLOCK_N * HD, V_ELEMS = DV * BLOCK_N;
    float* qh;    // (64, HD)
    float* ql;
    float* kh;    // 2 x (BLOCK_N, HD)
    float* kl;
    float* vh;    // 2 x (DV, BLOCK_N)
    float* vl;
    float* vraw;  // 2 x (BLOCK_N, DV), VSplit's staging layout
    __device__ __forceinline__ explicit Tf32x3Smem(float* base)
        : qh(base), ql(qh + Q_ELEMS), kh(ql + Q_ELEMS), kl(kh + 2 * K_ELEMS), vh(kl + 2 * K_ELEMS),
          vl(vh + 2 * V_ELEMS), vraw(vl + 2 * V_ELEMS) {}
};

__device__ __forceinline__ int tf32x3_tiles(int j0, int hi, int block_n) {
    return j0 < hi ? (hi - j0 + block_n - 1) / block_n : 0;
}

// The producer warpgroup (threads THREADS .. 2 THREADS - 1): Q (q_rows valid rows of gQ),
// then for every key tile t from j0 (keys past hi zero-filled) K_t and V_t into stage t % 2,
// in cp.async groups of their own (K_t's stage is the consumer's until S_{t-2} has landed,
// V_t's staging tile the producer's once it has transposed V_{t-2}). Iteration t transposes
// V_t, copies V_{t+2}, splits K_{t+1} and copies K_{t+2} once S_t has landed: every copy has
// an iteration of the consumer or more to land, and the consumer is the one that waits.
template <typename Policy, int HD, int DV, int BLOCK_N, int THREADS>
__device__ __forceinline__ void produce_tf32x3(float* smem, const Params& p, const float* gQ, int q_rows,
                                               const float* gK, const float* gV, int dv_load, int j0, int hi) {
    using Smem = Tf32x3Smem<Policy, HD, DV, BLOCK_N, THREADS>;
    const Smem sm(smem);
    const int tid = threadIdx.x - THREADS;
    const int tiles = tf32x3_tiles(j0, hi, BLOCK_N);
    if (tiles == 0) return;
    // Copies of tile t into stage t % 2, one cp.async group each (empty past the last tile);
    // each thread splits the chunks it copied, so it waits for its own copies only.
    auto copy_k = [&](int t) {
        if (t < tiles) {
            const int j = j0 + t * BLOCK_N;
            Smem::KSplit::copy(sm.kh + (t & 1) * Smem::K_ELEMS, gK + j * p.k_sr, p.k_sr, hi - j, p.d, tid);
        }
        cp_async_commit();
    };
    auto copy_v = [&](int t) {
        if (t < tiles) {
            const int j = j0 + t * BLOCK_N;
            Smem::VSplit::copy(sm.vraw + (t & 1) * Smem::VSplit::RAW_ELEMS, gV + j * p.v_sr, p.v_sr, hi - j, dv_load, tid);
        }
        cp_async_commit();
    };
    auto split_k = [&](int t) {  // K_t split in place and handed over
        const int s = t & 1;
        Smem::KSplit::split(sm.kh + s * Smem::K_ELEMS, sm.kl + s * Smem::K_ELEMS, tid);
        fence_proxy_async();
        named_barrier_arrive(kFullK + s, 2 * THREADS);
    };
    // Groups, oldest first: Q and K_0, V_0, K_1, V_1; then per iteration t, V_{t+2} and K_{t+2}.
    // fence.proxy.async also waits for the thread's copies in flight, so each copy is issued
    // after a fence where it can.
    Smem::QSplit::copy(sm.qh, gQ, p.q_sr, q_rows, p.d, tid);
    copy_k(0);  // with Q
    copy_v(0);
    copy_k(1);
    copy_v(1);
    cp_async_wait<3>();  // Q and K_0
    Smem::QSplit::split(sm.qh, sm.ql, tid);
    split_k(0);
    for (int t = 0; t < tiles; ++t) {
        const int s = t & 1;
        cp_async_wait<2>();  // V_t: only tile t + 1's two groups may be in flight
        if (t >= 2) named_barrier_sync(kEmptyV + s, 2 * THREADS);  // P_{t-2} V_{t-2} has landed
        Smem::VSplit::transpose(sm.vraw + s * Smem::VSplit::RAW_ELEMS, sm.vh + s * Smem::V_ELEMS,
                                sm.vl + s * Smem::V_ELEMS, tid);
        fence_proxy_async();
        named_barrier_arrive(kFullV + s, 2 * THREADS);
        if (t + 1 < tiles) {
            cp_async_wait<0>();  // K_{t+1}, the newest group
            split_k(t + 1);
        }
        // After split_k's fence, which would wait for the copy too: V_t's staging tile is this
        // thread's to refill (its reads above have returned).
        copy_v(t + 2);
        if (t + 2 < tiles) named_barrier_sync(kEmptyK + s, 2 * THREADS);  // S_t has landed
        copy_k(t + 2);
    }
}

// The consumer warpgroup (threads 0 .. THREADS - 1). Iteration t issues S_{t+1} = Q K_{t+1}^T
// and D = P_t V_t; the tensor cores run them in that order while the warps wait for S_{t+1},
// then take its softmax during P_t V_t. O = (O + D) alpha_{t+1} follows once D has landed.
// P_t V_t goes into D, not O: the tensor cores' accumulation truncates rather than rounds,
// and over thousands of keys that error grew past float32's tolerance in O (MmaTf32::pv); a
// sum per key tile added into O rounds to nearest.
template <typename Policy, int HD, int DV, int BLOCK_N, int THREADS, typename Softmax>
__device__ __forceinline__ void forward_wgmma_tf32x3(float* smem, Softmax& softmax, int j0, int hi,
                                                     float (&o)[1][DV / 8][4]) {
    static_assert(THREADS == 128, "one consumer warpgroup");
    using Smem = Tf32x3Smem<Policy, HD, DV, BLOCK_N, THREADS>;
    const Smem sm(smem);
    const int tiles = tf32x3_tiles(j0, hi, BLOCK_N);
    if (tiles == 0) return;
    auto key0 = [&](int t) { return j0 + t * BLOCK_N; };
    auto issue_s = [&](int t, float (&s)[1][BLOCK_N / 8][4]) {  // S_t = Q K_t^T
        named_barrier_sync(kFullK + (t & 1), 2 * THREADS);
        Policy::template qk_issue<HD, BLOCK_N>(sm.qh, sm.ql, sm.kh + (t & 1) * Smem::K_ELEMS, sm.kl + (t & 1) * Smem::K_ELEMS, s);
    };
    typename Policy::template PSplit<BLOCK_N> ph, pl;  // P_t as hi and lo A fragments
    float s[1][BLOCK_N / 8][4], d[1][DV / 8][4], alpha[2];
    auto issue_pv = [&](int t) {  // D = P_t V_t
        named_barrier_sync(kFullV + (t & 1), 2 * THREADS);
        Policy::template pv_issue<BLOCK_N, DV>(ph, pl, sm.vh + (t & 1) * Smem::V_ELEMS, sm.vl + (t & 1) * Smem::V_ELEMS, d);
    };
    // Tile t's stage of K or V is free: the producer waits for it unless no tile is left to
    // refill it with (a barrier arrived at is always waited for).
    auto release = [&](int barrier, int t) {
        if (t + 2 < tiles) named_barrier_arrive(barrier + (t & 1), 2 * THREADS);
    };
    // O = (O + D) alpha once D = P_t V_t has landed (its P fragments and V_t's stage are free
    // again then).
    auto land_d = [&](int t, const float (&scale)[2]) {
        wgmma_wait<0>();
        fence_regs(d[0]);
        fence_regs(ph);
        fence_regs(pl);
        release(kEmptyV, t);
#pragma unroll
        for (int n = 0; n < DV / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[0][n][e] = (o[0][n][e] + d[0][n][e]) * scale[e >> 1];
    };

    issue_s(0, s);
    wgmma_wait<0>();
    fence_regs(s[0]);
    release(kEmptyK, 0);
    softmax.exponentiate(s, key0(0), min(key0(0) + BLOCK_N, hi), alpha);  // O is still 0: no rescale
    Policy::template split_p<BLOCK_N>(s, ph, pl);
    for (int t = 0; t + 1 < tiles; ++t) {
        issue_s(t + 1, s);
        issue_pv(t);
        wgmma_wait<1>();  // S_{t+1} has landed (K_{t+1}'s stage is free); P_t V_t may still run
        fence_regs(s[0]);
        release(kEmptyK, t + 1);
        const int j = key0(t + 1);
        softmax.exponentiate(s, j, min(j + BLOCK_N, hi), alpha);
        land_d(t, alpha);
        Policy::template split_p<BLOCK_N>(s, ph, pl);
    }
    issue_pv(tiles - 1);
    const float one[2] = {1.0f, 1.0f};
    land_d(tiles - 1, one);
}

template <typename T, typename Policy, int HD, int DV, int BLOCK_N, int NUM_WARPS, bool FULL, int STAGES>
__global__ void __launch_bounds__((NUM_WARPS + kProducerWarps<Policy>) * 32, 1) flash_fwd(const Params p) {
    using Acc = typename Policy::Acc;
    constexpr int THREADS = NUM_WARPS * 32;
    constexpr int MI = Policy::MI;          // 16-row groups per warp
    constexpr int WARP_M = 16 * MI;
    constexpr int BLOCK_M = WARP_M * NUM_WARPS;
    constexpr bool WG = Policy::WARPGROUP;
    using QTile = typename TileKind<WG>::template type<T, BLOCK_M, HD>;
    using KTile = typename TileKind<WG>::template type<T, BLOCK_N, HD>;
    using VTile = typename TileKind<WG>::template type<T, BLOCK_N, DV>;
    constexpr int NT = BLOCK_N / 8;      // accumulator tiles of S per warp
    constexpr int NO = DV / 8;           // accumulator tiles of O per warp
    static_assert(!WG || (NUM_WARPS % 4 == 0 && STAGES == 2), "whole warpgroups, two stages");

    extern __shared__ __align__(16) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(tiles_base<WG>(smem));  // (BLOCK_M, HD)
    static_assert(STAGES == 1 || STAGES == 2, "one or two shared-memory stages");
    T* sK = sQ + QTile::ELEMS;               // STAGES x (BLOCK_N, HD)
    T* sV = sK + STAGES * KTile::ELEMS;      // STAGES x (BLOCK_N, DV)

    // Grid: x = (Dv chunk, row block) with row blocks fastest, so consecutive blocks share
    // K and V in L2; batch x heads is split over y and z (gridDim.y is at most 65535).
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m_blocks = (p.lq + BLOCK_M - 1) / BLOCK_M;
    const int chunk = blockIdx.x / m_blocks;
    // Last row blocks first: under causal masking they attend the most keys, so the
    // longest blocks start earliest and the tail of the launch is short.
    const int i0 = (m_blocks - 1 - (blockIdx.x - chunk * m_blocks)) * BLOCK_M;
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
    const int dv_valid = min(DV, p.dv - dv0);         // output columns this block writes
    const int dv_load = min(DV, p.dv_stored - dv0);   // stored columns of v it reads

    const int rows_valid = max(0, min(BLOCK_M, hv.q_len - i0));  // rows of this tile inside q_len
    int lo = 0, hi = 0;
    if (rows_valid > 0) key_range(p, hv, i0, i0 + rows_valid, lo, hi);

    const ScoreOp<Acc> score(p, hv);
    // No option touches the scores: interior tiles only need S * scale * log2(e).
    const bool plain = !FULL || (!p.has_softcap && score.bias == nullptr && p.alibi == nullptr
                                 && score.mask == nullptr && score.block_mask == nullptr);
    const int i1 = i0 + rows_valid;
    // This thread's rows: row(x) = r0 + 8 x for x = 2 mi + (e >> 1), x in [0, 2 MI).
    const int r0 = i0 + WARP_M * warp + g;
    Acc m[2 * MI], l[2 * MI];  // running row max (log2 domain); this thread's share of the row sum
    // Band's branch-free test lets ptxas interleave a masked tile's elements, which takes
    // registers: the plain wgmma kernel with a 256-wide O has none to spare (20-byte spill,
    // sm_90) and keeps the sequential test.
    constexpr bool kSequentialMask = Policy::WARPGROUP && DV > 128;
    OnlineSoftmax<Acc, MI, FULL, kSequentialMask> softmax{p, hv, score, i0, i1, r0, t, plain,
                                                          FULL && p.dropout_threshold != 0, m, l};
    Acc o[MI][NO][4];
#pragma unroll
    for (int x = 0; x < 2 * MI; ++x) {
        m[x] = neg_inf<Acc>();
        l[x] = Acc(0);
    }
    zero_acc(o);

    // Pipeline, STAGES = 2: while key tile j is computed from one shared-memory stage, the
    // copies of the next live tile land in the other, and a stage is refilled with the tile
    // after that as soon as every warp is done with it, so each copy hides behind a whole
    // tile of compute; one cp.async group per tile (possibly empty).
    // STAGES = 1 (FA2's, for wide heads where a second stage costs occupancy): V_j streams
    // in while S_j = Q K_j^T and its softmax are computed, K_next while O += P_j V_j.
    if constexpr (!kWgmmaTf32x3<Policy>) QTile::template load<THREADS>(sQ, gQ + i0 * p.q_sr, p.q_sr, rows_valid, p.d);
    // Key tiles start at multiples of BLOCK_N (keys before lo are masked by the band test):
    // dropout_keep_pair needs even columns, and 16-byte tile copies stay aligned.
    int j0 = next_live_tile<BLOCK_N, FULL>(p, hv, i0, i1, lo - lo % BLOCK_N, hi);
    // The live key tile after tile j, or hi when there is none (j >= hi included).
    auto next_tile = [&](int j) { return j < hi ? next_live_tile<BLOCK_N, FULL>(p, hv, i0, i1, j + BLOCK_N, hi) : hi; };
    // Copies of key tile j of K or V into the tile at s (keys past hi zero-filled, nothing
    // when j >= hi).
    auto load_k = [&](T* s, int j) {
        if (j < hi) KTile::template load<THREADS>(s, gK + j * p.k_sr, p.k_sr, hi - j, p.d);
    };
    auto load_v = [&](T* s, int j) {
        if (j < hi) VTile::template load<THREADS>(s, gV + j * p.v_sr, p.v_sr, hi - j, dv_load);
    };
    // Hopper (FA3's overlap inside a warpgroup): S_next = Q K_next is issued before
    // O += P V of the current tile, and S_next's softmax runs on the CUDA cores while the
    // tensor cores compute P V; O is rescaled for S_next's maxima once P V has landed.
    // It costs a second score buffer, S_next live beside P and O: with the full score
    // pipeline at HD = 256 that spills, and those kernels take the loop below.
    constexpr bool OVERLAP = WG && !(FULL && HD > 128);
    if constexpr (kWgmmaTf32x3<Policy>) {
        static_assert(!FULL && MI == 1 && NUM_WARPS == 4, "plain kernels of one warpgroup");
        if (warp >= NUM_WARPS) {  // the producer warpgroup
            produce_tf32x3<Policy, HD, DV, BLOCK_N, THREADS>(sQ, p, gQ + i0 * p.q_sr, rows_valid, gK, gV, dv_load, j0, hi);
            return;
        }
        forward_wgmma_tf32x3<Policy, HD, DV, BLOCK_N, THREADS>(sQ, softmax, j0, hi, o);
    } else if constexpr (OVERLAP) {
        // Tile i's K and V sit in stage i % 2, but K runs a tile ahead of V: iteration i
        // reads K_{i+1} and V_i, then refills their stages with K_{i+3} and V_{i+2}, so
        // every copy has a whole iteration to land. One cp.async group per refill.
        const int j1 = next_tile(j0);
        load_k(sK, j0);
        cp_async_commit();  // Q and K_0
        load_k(sK + KTile::ELEMS, j1);
        load_v(sV, j0);
        cp_async_commit();  // K_1 and V_0
        typename Policy::template PFrag<BLOCK_N> pf;  // P of the current tile, O += P V's A operand
        Acc s[MI][NT][4], alpha[2 * MI];
        if (j0 < hi) {
            wait_tiles<1, WG>();  // Q and K_0
            zero_acc(s);
            qk<Policy, BLOCK_M, HD, BLOCK_N, QTile, KTile>(sQ, warp, sK, s);  // S = Q K^T
            softmax.exponentiate(s, j0, min(j0 + BLOCK_N, hi), alpha);        // O is still 0: no rescale
            Policy::template pack_p<BLOCK_N>(s, pf);
            __syncthreads();  // every warp is done with K_0: its stage takes K_2
            int j_next = j1, j_after = next_tile(j1);
            load_k(sK, j_after);
            load_v(sV + VTile::ELEMS, j1);
            cp_async_commit();
            int stage = 0;  // of the current tile
            while (j_next < hi) {
                wait_tiles<1, WG>();  // K_next and V of the current tile have landed
                zero_acc(s);
                Policy::template qk_issue<BLOCK_M, HD, BLOCK_N>(sQ, sK + (stage ^ 1) * KTile::ELEMS, s);
                Policy::template pv_issue<BLOCK_N, DV>(pf, sV + stage * VTile::ELEMS, o);  // O += P V
                wgmma_wait<1>();  // S_next has landed; P V may still run
                fence_regs(s[0]);
                softmax.exponentiate(s, j_next, min(j_next + BLOCK_N, hi), alpha);
                wgmma_wait<0>();
                fence_regs(o[0]);
                fence_regs(pf[0]);
                softmax.rescale(o, alpha);
                Policy::template pack_p<BLOCK_N>(s, pf);
                __syncthreads();  // every warp is done with K_next and this V: refill both stages
                const int j3 = next_tile(j_after);
                load_k(sK + (stage ^ 1) * KTile::ELEMS, j3);
                load_v(sV + stage * VTile::ELEMS, j_after);
                cp_async_commit();
                j_next = j_after;
                j_after = j3;
                stage ^= 1;
            }
            wait_tiles<0, WG>();  // V of the last tile
            pv<Policy, BLOCK_N, DV, VTile>(pf, sV + stage * VTile::ELEMS, o);
        }
    } else {
        int j_pre = hi;  // STAGES = 2: the tile in flight to the other stage
        if constexpr (STAGES == 2) {
            load_k(sK, j0);
            load_v(sV, j0);
            cp_async_commit();  // Q and the first tile
            j_pre = next_tile(j0);
            load_k(sK + KTile::ELEMS, j_pre);
            load_v(sV + VTile::ELEMS, j_pre);
        } else {
            load_k(sK, j0);
        }
        cp_async_commit();
        int stage = 0;
        while (j0 < hi) {
            const int j1 = min(j0 + BLOCK_N, hi);
            const T* sKs = sK + stage * KTile::ELEMS;
            const T* sVs = sV + stage * VTile::ELEMS;
            if constexpr (STAGES == 2) {
                wait_tiles<1, WG>();  // every group but the newest has landed: Q and tile j0
            } else {
                wait_tiles<0, WG>();  // Q and K_j have landed; and every warp is done with V of the last tile
                load_v(sV, j0);
                cp_async_commit();
            }

            Acc s[MI][NT][4];
            zero_acc(s);
            qk<Policy, BLOCK_M, HD, BLOCK_N, QTile, KTile>(sQ, warp, sKs, s);  // S = Q K^T
            softmax.fold(s, j0, j1, o);
            typename Policy::template PFrag<BLOCK_N> pf;  // P as the second product's A operand
            Policy::template pack_p<BLOCK_N>(s, pf);
            if constexpr (STAGES == 1) {  // the copy of V_j into the single stage has to land first
                wait_tiles<0, WG>();      // ... and every warp be done reading K_j before K_next comes in
                const int j_next = next_tile(j0);
                load_k(sK, j_next);
                cp_async_commit();
                pv<Policy, BLOCK_N, DV, VTile>(pf, sVs, o);  // O += P V
                j0 = j_next;
                continue;
            }
            pv<Policy, BLOCK_N, DV, VTile>(pf, sVs, o);  // O += P V
            __syncthreads();  // every warp is done with this stage: refill it
            const int j_next = j_pre;
            j_pre = next_tile(j_pre);
            load_k(sK + stage * KTile::ELEMS, j_pre);
            load_v(sV + stage * VTile::ELEMS, j_pre);
            cp_async_commit();
            j0 = j_next;
            stage ^= 1;
        }
    }
    // A block that attended no tile still waits for its Q copy (the TF32 wgmma consumer has
    // none: its producer copies Q).
    cp_async_wait<0>();

    // Epilogue: O / l (times 1 / (1 - dropout_p)); rows with l = 0 saw no key: 0 and lse -inf.
#pragma unroll
    for (int r = 0; r < 2 * MI; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const int i = r0 + 8 * r;
        if (i >= frame_rows) continue;
        // l = 0: every key of the row was masked. A NaN l (NaN inputs) stays live and NaN.
        const bool live = i < hv.q_len && !(l[r] == Acc(0));
        const Acc inv = live ? static_cast<Acc>(p.dropout_scale) / l[r] : Acc(0);
        T* orow = gO + i * p.o_sr;
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            // A select, not a product: 0 * NaN from masked NaN values must not reach a dead row.
            const Acc* on = &o[r >> 1][n][2 * (r & 1)];
            // out is the backend's own allocation (256-byte aligned) and dv0 even, so an even row
            // stride keeps every pair aligned; the test reads the parameter block, no register.
            store_pair(orow, 8 * n + 2 * t, dv_valid, live ? on[0] * inv : Acc(0), live ? on[1] * inv : Acc(0),
                       p.o_sr % 2 == 0);
        }
        if (chunk == 0 && t == 0) {
            // lse = ln(sum exp(s)) = (m + log2 l) ln 2 in the log2 domain: m / log2(e) + ln l.
            gLse[i] = live ? m[r] / static_cast<Acc>(kLog2e) + log_acc(l[r]) : neg_inf<Acc>();
        }
    }
}

}  // namespace flash
