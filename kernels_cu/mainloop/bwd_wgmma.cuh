// The dK/dV mainloop on Hopper's warpgroup products (sm_90a, float16/bfloat16, any score
// option set, dQ fused): each warpgroup owns 64 keys and multiplies them at once from swizzled tiles:
// S^T and dP^T with K and V as A operands from shared memory (P^T taken while dP^T is still
// on the tensor cores), dV and dK with P'^T and dS^T as A operands from registers; dS^T goes
// to shared memory, and warpgroup w computes the dQ tile's columns [w NQW, (w + 1) NQW) over
// all the block's keys (with 128-query tiles: warpgroup w the rows [64 w, 64 w + 64)).
// With one stage, the next tile's copies run during the dQ product.
#pragma once

#include "bwd_common.cuh"

namespace flash {

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <typename T, int HD, int CH, int BLOCK_R, int BLOCK_C, int DQ, int STAGES>
struct BwdWgmma {
    using Policy = MmaWgmma<T>;
    using Element = T;
    using Acc = float;
    static constexpr int WARPS = BLOCK_R / 16;
    static constexpr int kThreads = 32 * WARPS;
    using Block = BwdKeyBlock<BLOCK_R, BLOCK_C>;
    static constexpr bool kSwizzled = true;
    static_assert(STAGES == 1 || STAGES == 2, "one or two stages");
    static_assert(DQ != kDqOwnKernel && CH % 64 == 0 && BLOCK_R % 64 == 0 && BLOCK_C % 64 == 0
                      && (BLOCK_R / 64) % (BLOCK_C / 64) == 0,
                  "warpgroups of 64 keys, whole slabs, dQ fused in 64-query blocks shared by the warpgroups");

    using KTile = Sw128Tile<T, BLOCK_R, HD>;
    using QTile = Sw128Tile<T, BLOCK_C, HD>;
    // dS^T (BLOCK_R, BLOCK_C), swizzled
    using SharedStorage = DkdvStorage<T, T, Acc, KTile::ELEMS, QTile::ELEMS, STAGES, 0, BLOCK_R * BLOCK_C, BLOCK_C, 0>;

    // Two element passes (OptionElements) for options but softcap (kTwoPassElements); beside
    // gradient chunks wider than 64 columns not with a bias or dropout, whose per-score loads
    // and Philox calls in the first pass spill there (the host gives a bias at D = 128, softcap
    // absent, two 64-column chunks instead).
    template <typename Set>
    static constexpr bool kTwoPass = kTwoPassElements<Set> && (CH <= 64 || (Set::kMods & (kModBias | kModDropout)) == 0);
    // The query tiles' bias and mask windows (BLOCK_C, BLOCK_R) staged with Q by the two-pass
    // sets at D <= 128 (at D = 128 in 64-column chunks with a bias or beyond what 128-wide
    // dK and dV leave registers for). At D = 256 the copy's addresses and the reads spill:
    // the two passes read them per score from global memory. Copied element by element in a
    // rolled loop where a view's rows are not aligned. flashcupy/cuda/spec.py's
    // BackwardSpec.stages_scores mirrors this.
    template <typename Set>
    static constexpr bool kStages = kTwoPass<Set> && HD <= 128;
    template <typename Set>
    using Staged = typename StagedOr<kStages<Set>, ScoreTiles<Set, BLOCK_C, BLOCK_R, STAGES, true>>::type;
    // Whole tiles inside the band take the fast element passes beside a staged mask too (the
    // passes read it there), up to 64-column chunks: with 128 the second copy of the mask's
    // pass spills.
    template <typename Set>
    static constexpr bool kMaskFast = Staged<Set>::kMask && CH <= 64;

    template <typename ScoreSet, typename Storage>
    static __device__ __forceinline__ void run(Storage& storage, Block& blk) {
        constexpr bool FULL = ScoreSet::kFull;  // options: OptionElements, or full_elements
        constexpr bool TWO_PASS = kTwoPass<ScoreSet>;
        using Tiles = Staged<ScoreSet>;
        constexpr int NT = BLOCK_C / 8, NC = CH / 8;
        const BwdParams& bp = blk.bp;
        const Params& p = blk.p;
        const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        if (!blk.template start<CH, KTile, kThreads>(storage)) return;
        const T* sK = storage.k();
        const T* sV = storage.v();
        T* sdS = storage.ds();

        const int r0 = blk.j0 + 16 * warp + g;  // this thread's keys: r0 and r0 + 8
        Acc dv[1][NC][4], dk[1][NC][4];
        zero_acc(dk);
        zero_acc(dv);

        const Acc dropout_scale = static_cast<Acc>(p.dropout_scale);
        auto nothing = [] {};
        blk.template walk<Acc, ScoreSet, STAGES, true, QTile, kThreads, Tiles>(storage, nothing, nothing, [&](
            const HeadView& hv, const Scores<Acc, ScoreSet>& scores, BwdQueryTile& tile, int st, int next_hq, int next_i0) {
            const int i0 = tile.i0;
            const T* sQt = storage.q(st);
            const T* sdOt = storage.dout(st);

            Acc s_t[1][NT][4], dp_t[1][NT][4];
            zero_acc(s_t);
            zero_acc(dp_t);
            Policy::template qk_issue<BLOCK_R, HD, BLOCK_C>(sK, sQt, s_t);    // S^T = K Q^T
            Policy::template qk_issue<BLOCK_R, HD, BLOCK_C>(sV, sdOt, dp_t);  // dP^T = V dO^T
            // Dropout's bits of the tile, drawn while S^T and dP^T run.
            const KeepBits<1, NT> keep = scores.template keep_tile<1, NT, true>(i0 + 2 * t, r0);
            tile.template classify<kMaskFast<ScoreSet>, FULL && !TWO_PASS>(blk, hv, scores);
            if constexpr (TWO_PASS) {
                const OptionElements<Acc, ScoreSet, BLOCK_R, BLOCK_C, Tiles> el(
                    blk, hv, scores, tile, r0, t, Tiles::transposed(storage.extra(), st, t, r0 - blk.j0),
                    storage.lse(st), storage.delta(st));
                wgmma_wait<1>();  // S^T has landed; dP^T may still run
                fence_regs(s_t[0]);
                by_tile(tile.fast, [&](const bool FAST) { el.probabilities(FAST, s_t); });
                wgmma_wait<0>();
                fence_regs(dp_t[0]);
                by_tile(tile.fast, [&](const bool FAST) { el.gradients(FAST, dropout_scale, keep, s_t, dp_t); });
            } else if constexpr (FULL) {
                // One element pass over S^T and dP^T together, once both have landed.
                wgmma_wait<0>();
                fence_regs(s_t[0]);
                fence_regs(dp_t[0]);
                full_elements(blk, hv, scores, tile, r0, t, storage.lse(st), storage.delta(st), dropout_scale, keep,
                              s_t, dp_t);
            } else {
                const BwdElements<Acc, false> el{TileBand<false>(p, hv, tile.band), scores.op.scale_log2,
                                                 storage.lse(st), storage.delta(st), i0, tile.i1,
                                                 blk.j0 + blk.keys_valid};
                // P in a first pass while dP^T is still on the tensor cores, dS in a second.
                wgmma_wait<1>();  // S^T has landed; dP^T may still run
                fence_regs(s_t[0]);
                each_element(s_t, r0, 0, t, [&](Acc& s, int, int c) { el.exponentiate(s, c); });
                wgmma_wait<0>();
                fence_regs(dp_t[0]);
                by_tile(tile.fast, [&](const bool FAST) {
                    each_element(s_t, r0, 0, t, [&](Acc& s, Acc& dp, int j, int c) {
                        el.differentiate(FAST, s, dp, c, j);
                    }, dp_t);
                });
            }
            typename Policy::template PFrag<BLOCK_C> pf, dsf;
            Policy::template pack_p<BLOCK_C>(s_t, pf);
            Policy::template pack_p<BLOCK_C>(dp_t, dsf);
            Policy::template pv_issue<BLOCK_C, CH>(pf, sdOt + QTile::column(blk.c0), dv);  // dV += P'^T dO
            Policy::template pv_issue<BLOCK_C, CH>(dsf, sQt + QTile::column(blk.c0), dk);  // dK += dS^T Q
            Policy::template store_p_swizzled<BLOCK_R, BLOCK_C>(dsf, sdS);
            // One stage: dV and dK have to be done with its Q and dO before the next tile's
            // copies. (After fence.proxy.async instead, this wait crashes NVRTC 12.9's ptxas.)
            if constexpr (STAGES == 1) wgmma_wait<0>();
            fence_proxy_async();
            __syncthreads();  // dS^T of every key of the block is in sdS (one stage: free for the next tile)
            if (STAGES == 1 && next_hq < blk.group)  // copied during dQ
                blk.template load_queries<QTile, kThreads, Tiles>(storage, next_hq, next_i0, 0);
            // The dQ tile (BLOCK_C, CH): warpgroup w takes query block qb = w % QB (64 rows, the
            // qb-th slab of dS^T) and NQW columns from col0.
            constexpr int QB = BLOCK_C / 64, NQW = CH * QB / (WARPS / 4);
            const int qb = (warp / 4) % QB, col0 = blk.c0 + (warp / 4) / QB * NQW;
            Acc dq[1][NQW / 8][4];
            zero_acc(dq);
            Policy::template mn_issue<BLOCK_R, NQW>(sdS + qb * BLOCK_R * 64, sK, col0, dq);  // dQ_tile = dS K
            wgmma_wait<0>();
            fence_regs(dv[0]);
            fence_regs(dk[0]);
            fence_regs(dq[0]);
            fence_regs(pf[0]);
            fence_regs(dsf[0]);
            add_dq_tile<kScaleAtomics<DQ>>(blk.template dq_rows<Acc>(hv), bp.dqa_sr, dq, i0 + 64 * qb + 16 * (warp % 4),
                                       tile.i1, col0, bp.d_true, p.scale);
        });
        store_dkdv<T>(blk, r0, t, static_cast<Acc>(p.scale), min(CH, bp.d_true - blk.c0), min(CH, p.dv - blk.c0), dk,
                      dv);
    }
};

#endif  // sm_90a

}  // namespace flash
