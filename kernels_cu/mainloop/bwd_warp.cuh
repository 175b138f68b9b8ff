// The dK/dV mainloop of the warp policies (mma/warp.cuh), one role: each warp owns 16 MI of
// the block's keys and computes, per streamed query tile, S^T = K Q^T and dP^T = V dO^T, the
// element pass (P^T and dS^T), dV += P'^T dO and dK += dS^T Q for them; with a fused dQ
// (DQ != kDqOwnKernel) the warps then park dS^T in shared memory and compute the tile's
// dQ = dS K over all the block's keys, added into dQ's accumulator with atomics.
// STAGES (1 or 2): shared-memory stages of the streamed Q, dO and statistics; with two, the
// next tile's copies run during the current tile's products. Any score option set; a bias or
// a mask staged in shared memory with each query tile (Staged) and read by OptionElements'
// two element passes, as on the warpgroup kernel.
#pragma once

#include "bwd_common.cuh"

namespace flash {

template <typename T, typename Policy, int HD, int CH, int BLOCK_R, int BLOCK_C, int DQ, int STAGES>
struct BwdWarp {
    using Element = T;
    using Acc = typename Policy::Acc;
    using PElem = typename Policy::PElem;
    using One = typename Policy::One;  // the policy with one row group: the dQ product's
    static constexpr int MI = Policy::MI;  // 16-key groups per warp
    static constexpr int WARPS = BLOCK_R / (16 * MI);
    static constexpr int kThreads = 32 * WARPS;
    using Block = BwdKeyBlock<BLOCK_R, BLOCK_C>;
    static constexpr bool kSwizzled = false;
    static constexpr bool FUSED_DQ = DQ != kDqOwnKernel;
    static_assert(STAGES == 1 || STAGES == 2, "one or two stages");
    static_assert(!Policy::WARPGROUP, "warp policies");

    using KTile = PaddedTile<T, BLOCK_R, HD>;
    using QTile = PaddedTile<T, BLOCK_C, HD>;
    static constexpr int LD = KTile::LD;  // rows padded as the forward's tiles
    static constexpr int LDS = BLOCK_C + 16 / sizeof(PElem);  // dS^T row pitch: conflict-free ldmatrix rows
    // dS^T (BLOCK_R, BLOCK_C) for the fused dQ, rows padded to LDS
    static constexpr int DS_ELEMS = FUSED_DQ ? BLOCK_R * LDS : 0;
    using SharedStorage = DkdvStorage<T, PElem, Acc, KTile::ELEMS, QTile::ELEMS, STAGES, 0, DS_ELEMS, BLOCK_C, 0>;
    // The query tiles' bias and mask windows (BLOCK_C, BLOCK_R) staged with Q (read per score
    // from global memory, a bias or mask about doubled the float32 and float64 backward's
    // time), for the sets OptionElements takes (no softcap), but a bias, a mask and dropout
    // together (as BwdWgmma), on the tensor cores; not beside 3xTF32's split fragments with a
    // bias and a mask (8 bytes spill at D = 64), nor SIMT. float64 at D = 64 spills 8-24
    // bytes staged and still runs 1.3-1.6x faster than reading per score (bench/NOTES.md,
    // 'Backward: score options'). flashcupy/cuda/spec.py's BackwardSpec.stages_scores mirrors this.
    static constexpr unsigned kStagedMods = kModBias | kModMask;
    template <typename Set>
    static constexpr bool kStages = kTwoPassElements<Set> && (Set::kMods & kStagedMods) != 0
                                    && (Set::kMods & (kStagedMods | kModDropout)) != (kStagedMods | kModDropout)
                                    && !kSimt<Policy>
                                    && !(kSplitTf32<Policy> && (Set::kMods & kStagedMods) == kStagedMods);
    template <typename Set>
    using Staged = typename StagedOr<kStages<Set>, ScoreTiles<Set, BLOCK_C, BLOCK_R, STAGES, true>>::type;

    template <typename ScoreSet, typename Storage>
    static __device__ __forceinline__ void run(Storage& storage, Block& blk) {
        constexpr bool FULL = ScoreSet::kFull;  // options: OptionElements where staged, else full_elements
        using Tiles = Staged<ScoreSet>;
        constexpr int NT = BLOCK_C / 8, NC = CH / 8;
        const BwdParams& bp = blk.bp;
        const Params& p = blk.p;
        const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        if (!blk.template start<CH, KTile, kThreads>(storage)) return;
        const T* sK = storage.k();
        const T* sV = storage.v();
        PElem* sdS = storage.ds();

        const int r0 = blk.j0 + 16 * MI * warp + g;  // this thread's keys: r0 + 16 mi and r0 + 16 mi + 8
        Acc dv[MI][NC][4], dk[MI][NC][4];
        zero_acc(dk);
        zero_acc(dv);
        const Acc dropout_scale = static_cast<Acc>(p.dropout_scale);

        auto nothing = [] {};
        blk.template walk<Acc, ScoreSet, STAGES, false, QTile, kThreads, Tiles>(storage, nothing, nothing, [&](
            const HeadView& hv, const Scores<Acc, ScoreSet>& scores, BwdQueryTile& tile, int st, int next_hq, int next_i0) {
            const int i0 = tile.i0;
            const T* sQt = storage.q(st);
            const T* sdOt = storage.dout(st);

            Acc s_t[MI][NT][4], dp_t[MI][NT][4];
            zero_acc(s_t);
            zero_acc(dp_t);
            // Two row groups keep dK and dV for 32 keys live: unroll two k-steps, not all; float64
            // beside full_elements, or without a fused dQ, has no register for a second k-step's
            // fragments.
            constexpr int K_UNROLL = MI == 2 ? 2 : (FULL || !FUSED_DQ) && sizeof(Acc) == 8 ? 1 : 0;
            Policy::template qk<HD, BLOCK_C, LD, LD, K_UNROLL>(sK + 16 * MI * warp * LD, sQt, s_t);    // S^T = K Q^T
            Policy::template qk<HD, BLOCK_C, LD, LD, K_UNROLL>(sV + 16 * MI * warp * LD, sdOt, dp_t);  // dP^T = V dO^T
            // full_elements here keeps `fast` a constant false beside a boolean mask (a block mask
            // alone: tiles kept whole are fast): a run-time one slowed the mixed tiles
            // (bench/NOTES.md, 'Masks: tiles kept whole read none').
            tile.template classify<Tiles::kMask>(blk, hv, scores);
            // P' = P z into s_t and dS^T into dp_t, element by element. The fast tiles, nearly
            // all of them, carry no per-element test: the selecting loop is inlined twice, with
            // a constant FAST.
            if constexpr (kStages<ScoreSet>) {
                const OptionElements<Acc, ScoreSet, BLOCK_R, BLOCK_C, Tiles> el(
                    blk, hv, scores, tile, r0, t, Tiles::transposed(storage.extra(), st, t, r0 - blk.j0),
                    storage.lse(st), storage.delta(st));
                const KeepBits<MI, NT> keep = scores.template keep_tile<MI, NT, true>(i0 + 2 * t, r0);
                by_tile(tile.fast, [&](const bool FAST) { el.probabilities(FAST, s_t); });
                by_tile(tile.fast, [&](const bool FAST) { el.gradients(FAST, dropout_scale, keep, s_t, dp_t); });
            } else if constexpr (FULL) {
                full_elements(blk, hv, scores, tile, r0, t, storage.lse(st), storage.delta(st), dropout_scale,
                              scores.template keep_tile<MI, NT, true>(i0 + 2 * t, r0), s_t, dp_t);
            } else {
                // TileBand's branch-free test, but for 3xTF32 above HD = 64, whose fragments
                // leave no registers for the interleaving it allows: there the sequential one.
                constexpr bool kSequentialMask = kSplitTf32<Policy> && HD > 64;
                const BwdElements<Acc, kSequentialMask> el{TileBand<kSequentialMask>(p, hv, tile.band),
                                                           scores.op.scale_log2, storage.lse(st), storage.delta(st),
                                                           i0, tile.i1, blk.j0 + blk.keys_valid};
                // One pass (a second spills beside 3xTF32's fragments at D = 96 on sm_80 to sm_89).
                by_tile(tile.fast, [&](const bool FAST) {
                    each_element(s_t, r0, 0, t, [&](Acc& s, Acc& dp, int j, int c) {
                        el.exponentiate(s, c);
                        el.differentiate(FAST, s, dp, c, j);
                    }, dp_t);
                });
            }
            typename Policy::template PFrag<BLOCK_C> pf;
            Policy::template pack_p<BLOCK_C>(s_t, pf);
            Policy::template pv<BLOCK_C, CH, LD>(pf, sdOt + blk.c0, dv);  // dV += P'^T dO
            Policy::template pack_p<BLOCK_C>(dp_t, pf);
            Policy::template pv<BLOCK_C, CH, LD>(pf, sQt + blk.c0, dk);   // dK += dS^T Q
            if constexpr (FUSED_DQ) {
                Policy::template store_p<BLOCK_C, LDS>(pf, sdS + 16 * MI * warp * LDS);
                __syncthreads();  // dS^T of every key of the block is in sdS
                warp_dq<One, kScaleAtomics<DQ>, WARPS, HD, CH, BLOCK_R, BLOCK_C, LD, LDS, 0>(
                    bp, sdS, sK, blk.c0, warp, blk.template dq_rows<Acc>(hv), i0, tile.i1);
            }
            if (STAGES == 1 && next_hq < blk.group) {
                __syncthreads();  // every warp is done with the stage
                blk.template load_queries<QTile, kThreads, Tiles>(storage, next_hq, next_i0, 0);
            }
        });
        store_dkdv<T>(blk, r0, t, static_cast<Acc>(p.scale), min(CH, bp.d_true - blk.c0), min(CH, p.dv - blk.c0), dk,
                      dv);
    }
};

}  // namespace flash
