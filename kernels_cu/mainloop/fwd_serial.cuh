// The forward mainloop of any product policy, one key tile after the other: S = Q K^T, its
// softmax, then O += P V, with K and V copied into STAGES shared-memory stages.
//
//   STAGES = 2: while key tile j is computed from one stage, the copies of the next live tile
//   land in the other, and a stage is refilled with the tile after that as soon as every warp
//   is done with it, so each copy hides behind a whole tile of compute; one cp.async group
//   per tile (possibly empty).
//   STAGES = 1 (FlashAttention-2's, for wide heads where a second stage costs occupancy):
//   V_j streams in while S_j = Q K_j^T and its softmax are computed, K_next while O += P_j V_j.
//
// Policy: a warp policy (mma/warp.cuh: each warp owns 16 MI rows of padded tiles) or a
// warpgroup one (mma/wgmma.cuh: 64 rows a warpgroup from swizzled tiles, each product waited
// for at once; fwd_overlap.cuh overlaps them instead, where registers allow).
#pragma once

#include "../mma/warp.cuh"
#include "fwd_common.cuh"

namespace flash {

template <typename T, typename Policy, int HD, int DV, int BLOCK_N, int NUM_WARPS, int STAGES>
struct FwdSerial {
    using Element = T;
    using Acc = typename Policy::Acc;
    static constexpr int MI = Policy::MI;  // 16-row groups per warp
    static constexpr int kBlockM = 16 * MI * NUM_WARPS;
    static constexpr int kBlockN = BLOCK_N;
    static constexpr int kStages = STAGES;
    static constexpr int kDv = DV;
    static constexpr int kThreads = 32 * NUM_WARPS;
    static constexpr bool kSwizzled = Policy::WARPGROUP;
    // Band's branch-free test lets ptxas interleave a masked tile's elements, which takes
    // registers: the wgmma kernel with a 256-wide O has none to spare and keeps the
    // sequential test.
    static constexpr bool kSequentialMask = Policy::WARPGROUP && DV > 128;
    static_assert(STAGES == 1 || STAGES == 2, "one or two shared-memory stages");
    static_assert(!Policy::WARPGROUP || (NUM_WARPS % 4 == 0 && STAGES == 2), "whole warpgroups, two stages");

    using QTile = typename TileKind<kSwizzled>::template type<T, kBlockM, HD>;
    using KTile = typename TileKind<kSwizzled>::template type<T, BLOCK_N, HD>;
    using VTile = typename TileKind<kSwizzled>::template type<T, BLOCK_N, DV>;
    struct SharedStorage {
        T q[QTile::ELEMS];           // (kBlockM, HD)
        T k[STAGES][KTile::ELEMS];   // (BLOCK_N, HD) per stage
        T v[STAGES][VTile::ELEMS];   // (BLOCK_N, DV) per stage
    };

    template <typename Sc, typename Staged, typename Softmax>
    static __device__ __forceinline__ bool run(SharedStorage& storage, const FwdBlock<T>& b, const Sc& scores,
                                               const Staged& staged, Softmax& softmax, Acc (&o)[MI][DV / 8][4]) {
        constexpr int NT = BLOCK_N / 8;  // accumulator tiles of S per warp
        T* sQ = storage.q;
        T* sK = storage.k[0];
        T* sV = storage.v[0];
        const auto tiles = start_tiles<QTile, KTile, VTile, kBlockM, BLOCK_N, kThreads>(sQ, b, scores, staged);
        KeyTile k0 = tiles.first();
        const int hi = b.hi;
        KeyTile k_pre{hi, false};  // STAGES = 2: the tile in flight to the other stage
        if constexpr (STAGES == 2) {
            tiles.load_k(sK, k0, 0);
            tiles.load_v(sV, k0.j);
            cp_async_commit();  // Q and the first tile
            k_pre = tiles.next(k0);
            tiles.load_k(sK + KTile::ELEMS, k_pre, 1);
            tiles.load_v(sV + VTile::ELEMS, k_pre.j);
        } else {
            tiles.load_k(sK, k0, 0);
        }
        cp_async_commit();
        int stage = 0;
        while (k0.j < hi) {
            const int j1 = min(k0.j + BLOCK_N, hi);
            const T* sKs = sK + stage * KTile::ELEMS;
            const T* sVs = sV + stage * VTile::ELEMS;
            if constexpr (STAGES == 2) {
                wait_tiles<1, kSwizzled>();  // every group but the newest has landed: Q and tile j0
            } else {
                wait_tiles<0, kSwizzled>();  // Q and K_j have landed; and every warp is done with V of the last tile
                tiles.load_v(sV, k0.j);
                cp_async_commit();
            }

            Acc s[MI][NT][4];
            zero_acc(s);
            qk<Policy, kBlockM, HD, BLOCK_N, QTile, KTile>(sQ, b.warp, sKs, s);  // S = Q K^T
            softmax.fold(s, k0, j1, o, stage);
            typename Policy::template PFrag<BLOCK_N> pf;  // P as the second product's A operand
            Policy::template pack_p<BLOCK_N>(s, pf);
            if constexpr (STAGES == 1) {  // the copy of V_j into the single stage has to land first
                wait_tiles<0, kSwizzled>();  // ... and every warp be done reading K_j before K_next comes in
                const KeyTile k_next = tiles.next(k0);
                tiles.load_k(sK, k_next, 0);
                cp_async_commit();
                pv<Policy, BLOCK_N, DV, VTile>(pf, sVs, o);  // O += P V
                k0 = k_next;
                continue;
            }
            pv<Policy, BLOCK_N, DV, VTile>(pf, sVs, o);  // O += P V
            __syncthreads();  // every warp is done with this stage: refill it
            const KeyTile k_next = k_pre;
            k_pre = tiles.next(k_pre);
            tiles.load_k(sK + stage * KTile::ELEMS, k_pre, stage);
            tiles.load_v(sV + stage * VTile::ELEMS, k_pre.j);
            cp_async_commit();
            k0 = k_next;
            stage ^= 1;
        }
        return true;
    }
};

}  // namespace flash
