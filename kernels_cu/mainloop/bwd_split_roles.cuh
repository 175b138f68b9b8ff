// The dK/dV mainloop of the warp policies with split roles: two warps share each 16 keys.
// The first (role 0) computes S^T, P and dV, and hands P^T to its partner through shared
// memory (a named barrier of the pair); the partner (role 1) computes dP^T, dS and dK. Each
// warp then holds one (16, HD) gradient instead of two, so a whole head of 128 columns fits
// in one chunk where one role needs two, each recomputing S^T and dP^T. PlainScores only,
// dQ fused (always into dQ itself: role 0 hands over scale P^T, one multiplication per element
// while the partner is still on dP^T, so dS^T, dK and the dQ products carry the scale).
//
// 3xTF32 (kSplitTf32 policies): K and V once per block, and each streamed Q and dO tile once,
// are split into TF32 hi halves (in place) and lo halves (a mirror of those tiles, LO elements
// further on), which the warps then read as they are, instead of every warp splitting each
// fragment it reads. The lo tiles leave room for one stage; the next tile is copied during the
// dQ product instead.
#pragma once

#include "bwd_common.cuh"

namespace flash {

template <typename T, typename Policy, int HD, int BLOCK_R, int BLOCK_C, int STAGES>
struct BwdSplitRoles {
    using Element = T;
    using Acc = typename Policy::Acc;
    using PElem = typename Policy::PElem;
    using One = typename Policy::One;
    static constexpr int CH = HD;  // the whole head in one chunk
    static constexpr int KW = BLOCK_R / 16;  // warps per role: 16 keys each
    static constexpr int WARPS = 2 * KW;
    static constexpr int kThreads = 32 * WARPS;
    using Block = BwdKeyBlock<BLOCK_R, BLOCK_C>;
    static constexpr bool kSwizzled = false;
    static constexpr bool PRESPLIT = kSplitTf32<Policy>;
    static_assert(Policy::MI == 1 && !Policy::WARPGROUP, "warp policies, one row group");
    static_assert(KW <= 15, "a named barrier per pair of warps: ids 1 to 15");
    static_assert(STAGES == 1 || (STAGES == 2 && !PRESPLIT), "pre-split tiles: one stage, copied during the dQ product");

    using KTile = PaddedTile<T, BLOCK_R, HD>;
    using QTile = PaddedTile<T, BLOCK_C, HD>;
    static constexpr int LD = KTile::LD;
    static constexpr int LDS = BLOCK_C + 16 / sizeof(PElem);
    static constexpr int LO = PRESPLIT ? 2 * KTile::ELEMS + 2 * STAGES * QTile::ELEMS : 0;
    using SharedStorage = DkdvStorage<T, PElem, Acc, KTile::ELEMS, QTile::ELEMS, STAGES, LO, BLOCK_R * LDS, BLOCK_C,
                                      BLOCK_R * BLOCK_C>;
    template <typename Set> using Staged = NoScoreTiles;  // bias and mask read per score

    template <typename ScoreSet>
    static __device__ __forceinline__ void run(SharedStorage& storage, Block& blk) {
        static_assert(!ScoreSet::kFull, "split roles take PlainScores");
        constexpr int NT = BLOCK_C / 8;
        const BwdParams& bp = blk.bp;
        const Params& p = blk.p;
        const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        const int kw = warp % KW, role = warp / KW;  // this warp's keys and role
        if (!blk.template start<CH, KTile, kThreads>(storage)) return;
        T* sK = storage.k();
        T* sV = storage.v();
        PElem* sdS = storage.ds();
        Acc* sP = storage.handoff();  // P^T, each thread's elements in its accumulator order, lane-minor

        const int r0 = blk.j0 + 16 * kw + g;  // this thread's keys: r0 and r0 + 8
        Acc dkv[1][CH / 8][4];  // dV (role 0) or dK (role 1)
        zero_acc(dkv);

        // Byte offset of chunk c of row r in a padded tile (tf32_split_chunks)
        auto padded_chunk = [](int r, int c) { return static_cast<int>(sizeof(T)) * (r * LD + 4 * c); };
        // PRESPLIT: each thread splits the chunks it copied: K and V before the first tile, then each
        // tile's Q and dO before the block's wait (every warp is done with sdS, and with one stage
        // with Q and dO).
        auto split_keys = [&] {
            if constexpr (PRESPLIT) {
                cp_async_wait<0>();
                tf32_split_chunks<BLOCK_R, HD / 4, kThreads>(sK, sK + LO, padded_chunk);
                tf32_split_chunks<BLOCK_R, HD / 4, kThreads>(sV, sV + LO, padded_chunk);
            }
        };
        auto split_queries = [&] {
            if constexpr (PRESPLIT) {
                cp_async_wait<0>();
                tf32_split_chunks<BLOCK_C, HD / 4, kThreads>(storage.q(), storage.q() + LO, padded_chunk);
                tf32_split_chunks<BLOCK_C, HD / 4, kThreads>(storage.dout(), storage.dout() + LO, padded_chunk);
            }
        };
        blk.template walk<Acc, PlainScores, STAGES, false, QTile, kThreads>(storage, split_keys, split_queries, [&](
            const HeadView& hv, const Scores<Acc, PlainScores>& scores, BwdQueryTile& tile, int st, int next_hq, int next_i0) {
            const int i0 = tile.i0;
            const T* sQt = storage.q(st);
            const T* sdOt = storage.dout(st);

            Acc s_t[1][NT][4];
            zero_acc(s_t);
            // Role 0: S^T = K Q^T; role 1: dP^T = V dO^T, both into s_t (one copy of the product)
            const T* sA = (role == 0 ? sK : sV) + 16 * kw * LD;
            if constexpr (PRESPLIT)
                Policy::template qk<HD, BLOCK_C, LD, LD, 0, LO>(sA, role == 0 ? sQt : sdOt, s_t);
            else
                Policy::template qk<HD, BLOCK_C, LD, LD>(sA, role == 0 ? sQt : sdOt, s_t);
            tile.classify(blk, hv, scores);
            // TileBand's branch-free test, but for 3xTF32 above HD = 64, as BwdWarp.
            constexpr bool kSequentialMask = kSplitTf32<Policy> && HD > 64;
            const BwdElements<Acc, kSequentialMask> el{TileBand<kSequentialMask>(p, hv, tile.band),
                                                       scores.op.scale_log2, storage.lse(st), storage.delta(st), i0,
                                                       tile.i1, blk.j0 + blk.keys_valid};
            // The pair's named barrier (1 + kw; 0 is __syncthreads'): role 0 arrives once scale
            // P^T is in sP, role 1 waits for it. sP is rewritten only after the next block-wide
            // barrier, which follows role 1's reads.
            Acc* sPw = sP + kw * (NT * 4 * 32) + lane;  // this thread's elements, 32 apart
            if (role == 0) {
                // P^T, with the scores outside the lengths and the band selected to 0
                by_tile(tile.fast, [&](const bool FAST) {
                    each_element(s_t, r0, 0, t, [&](Acc& s, int j, int c) {
                        el.exponentiate(s, c);
                        s = el.keep(FAST, c, j) ? s : Acc(0);
                    });
                });
#pragma unroll
                for (int x = 0; x < NT * 4; ++x) sPw[32 * x] = (&s_t[0][0][0])[x] * scores.op.scale;
                named_barrier_arrive(1 + kw, 64);
            } else {
                named_barrier_sync(1 + kw, 64);
                Acc pt[1][NT][4];  // scale P^T from the partner, already 0 outside the lengths and the band
#pragma unroll
                for (int x = 0; x < NT * 4; ++x) (&pt[0][0][0])[x] = sPw[32 * x];
                // scale dS^T = (scale P^T) (dP^T - D) into s_t, which holds dP^T, selected outside
                // as with one role
                by_tile(tile.fast, [&](const bool FAST) {
                    each_element(pt, r0, 0, t, [&](Acc& pe, Acc& dp, int j, int c) { el.differentiate(FAST, pe, dp, c, j); },
                                 s_t);
                });
            }
            typename Policy::template PFrag<BLOCK_C> pf;
            Policy::template pack_p<BLOCK_C>(s_t, pf);
            // Role 0: dV += P^T dO; role 1: dK += dS^T Q (s_t holds P^T or dS^T)
            if constexpr (PRESPLIT)
                Policy::template pv<BLOCK_C, CH, LD, LO>(pf, (role == 0 ? sdOt : sQt) + blk.c0, dkv);
            else
                Policy::template pv<BLOCK_C, CH, LD>(pf, (role == 0 ? sdOt : sQt) + blk.c0, dkv);
            if (role == 1) Policy::template store_p<BLOCK_C, LDS>(pf, sdS + 16 * kw * LDS);
            __syncthreads();  // dS^T of every key of the block is in sdS
            if (PRESPLIT && next_hq < blk.group)  // copied during dQ
                blk.template load_queries<QTile, kThreads>(storage, next_hq, next_i0, 0);
            warp_dq<One, false, WARPS, HD, CH, BLOCK_R, BLOCK_C, LD, LDS, LO>(
                bp, sdS, sK, blk.c0, warp, blk.template dq_rows<Acc>(hv), i0, tile.i1);
            if (!PRESPLIT && STAGES == 1 && next_hq < blk.group) {
                __syncthreads();  // every warp is done with the stage
                blk.template load_queries<QTile, kThreads>(storage, next_hq, next_i0, 0);
            }
        });
        // Each warp writes its own gradient only; dK needs no scale (dS^T carries it).
        store_dkdv<T>(blk, r0, t, Acc(1), role == 1 ? min(CH, bp.d_true - blk.c0) : 0,
                      role == 0 ? min(CH, p.dv - blk.c0) : 0, dkv, dkv);
    }
};

}  // namespace flash
