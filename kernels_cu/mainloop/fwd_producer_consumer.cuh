#pragma once

#include "../mma/wgmma_tf32x3.cuh"
#include "fwd_common.cuh"

namespace flash {

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

// The float32 forward on Hopper's TF32 warpgroup products (MmaWgmmaTf32x3, with PlainScores:
// no option touches the scores beyond causal, window and lengths), warp-specialised: one
// consumer warpgroup of 64 rows fed by a producer warpgroup. TF32 wgmma reads its
// shared-memory operands as they are, so the producer splits them into hi and lo tiles once
// each has landed: Q once, and every tile's K (in place) and V (from a staging tile,
// transposed: MmaWgmmaTf32x3::ColSplit). The consumer only issues products and takes the
// softmax, its warps alone on their schedulers but for the producer's; the copies and splits
// run beside its products instead of between them.
// Shared memory (Sw128 tiles): Q hi and lo (64, HD); two stages each of K hi and lo (BLOCK_N,
// HD), V^T hi and lo (DV, BLOCK_N) and V as copied (BLOCK_N, DV). K and V^T have stages and
// barriers of their own: the consumer is done with K_t (S_t = Q K_t^T) an iteration before
// V_t.
// Named barriers (0 is __syncthreads'), of both warpgroups: stage s of K or V^T full (the
// producer arrives once its stores are fenced, the consumer waits before the product) or
// empty (the consumer arrives once the products reading it have landed, the producer waits
// before refilling it).
enum Tf32x3Barrier : int { kFullK = 1, kFullV = 3, kEmptyK = 5, kEmptyV = 7 };

// The shared memory of the producer and consumer warpgroups: SharedStorage, and Tf32x3Smem,
// pointers to its tiles.
template <int HD, int DV, int BLOCK_N, int THREADS>
struct Tf32x3Storage {
    using Policy = MmaWgmmaTf32x3;
    using QSplit = typename Policy::template RowSplit<64, HD, THREADS>;
    using KSplit = typename Policy::template RowSplit<BLOCK_N, HD, THREADS>;
    using VSplit = typename Policy::template ColSplit<BLOCK_N, DV, THREADS>;
    static constexpr int Q_ELEMS = 64 * HD, K_ELEMS = BLOCK_N * HD, V_ELEMS = DV * BLOCK_N;
    struct SharedStorage {
        float qh[Q_ELEMS];                    // (64, HD)
        float ql[Q_ELEMS];
        float kh[2][K_ELEMS];                 // (BLOCK_N, HD) per stage
        float kl[2][K_ELEMS];
        float vh[2][V_ELEMS];                 // (DV, BLOCK_N) per stage
        float vl[2][V_ELEMS];
        float vraw[2][VSplit::RAW_ELEMS];     // (BLOCK_N, DV) per stage, VSplit's staging layout
    };
    float* qh;
    float* ql;
    float* kh;
    float* kl;
    float* vh;
    float* vl;
    float* vraw;
    __device__ __forceinline__ explicit Tf32x3Storage(SharedStorage& s)
        : qh(s.qh), ql(s.ql), kh(s.kh[0]), kl(s.kl[0]), vh(s.vh[0]), vl(s.vl[0]), vraw(s.vraw[0]) {}
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
template <int HD, int DV, int BLOCK_N, int THREADS>
__device__ __forceinline__ void produce_tf32x3(typename Tf32x3Storage<HD, DV, BLOCK_N, THREADS>::SharedStorage& storage,
                                               const Params& p, const float* gQ, int q_rows,
                                               const float* gK, const float* gV, int dv_load, int j0, int hi) {
    using Smem = Tf32x3Storage<HD, DV, BLOCK_N, THREADS>;
    const Smem sm(storage);
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
// and over thousands of keys that error grows past float32's tolerance in O (MmaTf32::pv); a
// sum per key tile added into O rounds to nearest.
template <int HD, int DV, int BLOCK_N, int THREADS, typename Softmax>
__device__ __forceinline__ void consume_tf32x3(typename Tf32x3Storage<HD, DV, BLOCK_N, THREADS>::SharedStorage& storage,
                                               Softmax& softmax, int j0, int hi, float (&o)[1][DV / 8][4]) {
    static_assert(THREADS == 128, "one consumer warpgroup");
    using Smem = Tf32x3Storage<HD, DV, BLOCK_N, THREADS>;
    using Policy = MmaWgmmaTf32x3;
    const Smem sm(storage);
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
    softmax.exponentiate(s, KeyTile{key0(0), false}, min(key0(0) + BLOCK_N, hi), alpha, 0);  // O is still 0: no rescale
    Policy::template split_p<BLOCK_N>(s, ph, pl);
    for (int t = 0; t + 1 < tiles; ++t) {
        issue_s(t + 1, s);
        issue_pv(t);
        wgmma_wait<1>();  // S_{t+1} has landed (K_{t+1}'s stage is free); P_t V_t may still run
        fence_regs(s[0]);
        release(kEmptyK, t + 1);
        const int j = key0(t + 1);
        softmax.exponentiate(s, KeyTile{j, false}, min(j + BLOCK_N, hi), alpha, 0);  // no staged operands or masks
        land_d(t, alpha);
        Policy::template split_p<BLOCK_N>(s, ph, pl);
    }
    issue_pv(tiles - 1);
    const float one[2] = {1.0f, 1.0f};
    land_d(tiles - 1, one);
}

template <int HD, int DV, int BLOCK_N>
struct FwdProducerConsumer {
    using Element = float;
    using Acc = float;
    static constexpr int MI = 1;
    static constexpr int kConsumerThreads = 128;  // one consumer warpgroup
    static constexpr int kBlockM = 64;
    static constexpr int kBlockN = BLOCK_N;
    static constexpr int kStages = 2;
    static constexpr int kDv = DV;
    static constexpr int kThreads = 2 * kConsumerThreads;  // and one producer warpgroup
    static constexpr bool kSwizzled = true;
    static constexpr bool kSequentialMask = false;
    using Storage = Tf32x3Storage<HD, DV, BLOCK_N, kConsumerThreads>;
    using SharedStorage = typename Storage::SharedStorage;

    template <typename Sc, typename Staged, typename Softmax>
    static __device__ __forceinline__ bool run(SharedStorage& storage, const FwdBlock<float>& b, const Sc& scores,
                                               const Staged&, Softmax& softmax, float (&o)[1][DV / 8][4]) {
        static_assert(!Sc::kFull && !Staged::kAny, "the consumer's softmax takes PlainScores only");
        const int j0 = scores.template next_live_tile<kBlockM, BLOCK_N>(b.i0, b.lo - b.lo % BLOCK_N, b.hi).j;
        if (b.warp >= kConsumerThreads / 32) {  // the producer warpgroup
            produce_tf32x3<HD, DV, BLOCK_N, kConsumerThreads>(storage, b.p, b.gQ + b.i0 * b.p.q_sr, b.rows_valid, b.gK,
                                                               b.gV, b.dv_load, j0, b.hi);
            return false;
        }
        consume_tf32x3<HD, DV, BLOCK_N, kConsumerThreads>(storage, softmax, j0, b.hi, o);
        return true;
    }
};

#endif  // sm_90a

}  // namespace flash
