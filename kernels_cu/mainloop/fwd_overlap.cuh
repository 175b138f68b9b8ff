// The forward mainloop on Hopper's warpgroup products with the softmax overlapped
// (FlashAttention-3's overlap inside a warpgroup): S_next = Q K_next^T is issued before
// O += P V of the current tile, and S_next's softmax runs on the CUDA cores while the tensor
// cores compute P V; O is rescaled for S_next's maxima once P V has landed. It costs a
// second score buffer, S_next live beside P and O (and dropout's keep bits of S_next, drawn
// while both products run): with score options at HD = 256
// that spills, and those kernels take FwdSerial (the rule table's choice).
//
// Tile i's K and V sit in stage i % 2, but K runs a tile ahead of V: iteration i reads
// K_{i+1} and V_i, then refills their stages with K_{i+3} and V_{i+2}, so every copy has a
// whole iteration to land. One cp.async group per refill. A tile's staged score operands
// travel with its K.
#pragma once

#include "fwd_common.cuh"

namespace flash {

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

template <typename T, int HD, int DV, int BLOCK_N, int NUM_WARPS>
struct FwdOverlap {
    using Policy = MmaWgmma<T>;
    using Element = T;
    using Acc = float;
    static constexpr int MI = 1;
    static constexpr int kBlockM = 16 * NUM_WARPS;
    static constexpr int kBlockN = BLOCK_N;
    static constexpr int kStages = 2;
    static constexpr int kDv = DV;
    static constexpr int kThreads = 32 * NUM_WARPS;
    static constexpr bool kSwizzled = true;
    static constexpr bool kSequentialMask = DV > 128;  // as FwdSerial's
    static_assert(NUM_WARPS % 4 == 0, "whole warpgroups");

    using QTile = Sw128Tile<T, kBlockM, HD>;
    using KTile = Sw128Tile<T, BLOCK_N, HD>;
    using VTile = Sw128Tile<T, BLOCK_N, DV>;
    struct SharedStorage {
        T q[QTile::ELEMS];      // (kBlockM, HD)
        T k[2][KTile::ELEMS];   // (BLOCK_N, HD) per stage
        T v[2][VTile::ELEMS];   // (BLOCK_N, DV) per stage
    };

    template <typename Sc, typename Staged, typename Softmax>
    static __device__ __forceinline__ bool run(SharedStorage& storage, const FwdBlock<T>& b, const Sc& scores,
                                               const Staged& staged, Softmax& softmax, float (&o)[1][DV / 8][4]) {
        constexpr int NT = BLOCK_N / 8;  // accumulator tiles of S per warp
        T* sQ = storage.q;
        T* sK = storage.k[0];
        T* sV = storage.v[0];
        const auto tiles = start_tiles<QTile, KTile, VTile, kBlockM, BLOCK_N, kThreads>(sQ, b, scores, staged);
        const KeyTile k0 = tiles.first();
        const int hi = b.hi;
        const KeyTile k1 = tiles.next(k0);
        tiles.load_k(sK, k0, 0);
        cp_async_commit();  // Q and K_0
        tiles.load_k(sK + KTile::ELEMS, k1, 1);
        tiles.load_v(sV, k0.j);
        cp_async_commit();  // K_1 and V_0
        typename Policy::template PFrag<BLOCK_N> pf;  // P of the current tile, O += P V's A operand
        float s[1][NT][4], alpha[2];
        if (k0.j < hi) {
            wait_tiles<1, true>();  // Q and K_0
            zero_acc(s);
            qk<Policy, kBlockM, HD, BLOCK_N, QTile, KTile>(sQ, b.warp, sK, s);  // S = Q K^T
            softmax.exponentiate(s, k0, min(k0.j + BLOCK_N, hi), alpha, 0);    // O is still 0: no rescale
            Policy::template pack_p<BLOCK_N>(s, pf);
            __syncthreads();  // every warp is done with K_0: its stage takes K_2
            KeyTile k_next = k1, k_after = tiles.next(k1);
            tiles.load_k(sK, k_after, 0);
            tiles.load_v(sV + VTile::ELEMS, k1.j);
            cp_async_commit();
            int stage = 0;  // of the current tile
            while (k_next.j < hi) {
                wait_tiles<1, true>();  // K_next and V of the current tile have landed
                zero_acc(s);
                Policy::template qk_issue<kBlockM, HD, BLOCK_N>(sQ, sK + (stage ^ 1) * KTile::ELEMS, s);
                Policy::template pv_issue<BLOCK_N, DV>(pf, sV + stage * VTile::ELEMS, o);  // O += P V
                const auto keep = softmax.template keep_bits<NT>(k_next);  // dropout's Philox beside both products
                wgmma_wait<1>();  // S_next has landed; P V may still run
                fence_regs(s[0]);
                softmax.exponentiate(s, k_next, min(k_next.j + BLOCK_N, hi), alpha, stage ^ 1, keep);
                wgmma_wait<0>();
                fence_regs(o[0]);
                fence_regs(pf[0]);
                softmax.rescale(o, alpha);
                Policy::template pack_p<BLOCK_N>(s, pf);
                __syncthreads();  // every warp is done with K_next and this V: refill both stages
                const KeyTile k3 = tiles.next(k_after);
                tiles.load_k(sK + (stage ^ 1) * KTile::ELEMS, k3, stage ^ 1);
                tiles.load_v(sV + stage * VTile::ELEMS, k_after.j);
                cp_async_commit();
                k_next = k_after;
                k_after = k3;
                stage ^= 1;
            }
            wait_tiles<0, true>();  // V of the last tile
            pv<Policy, BLOCK_N, DV, VTile>(pf, sV + stage * VTile::ELEMS, o);
        }
        return true;
    }
};

#endif  // sm_90a

}  // namespace flash
