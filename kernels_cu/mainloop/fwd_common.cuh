// What the forward's mainloops share: the block's rows, keys and operands (FwdBlock), which
// the kernel entry (flash_fwd.cu) works out and every mainloop reads, the key tiles a block
// walks (KeyTiles), and products issued and waited for at once.
//
// A forward mainloop is a type with
//   Element, Acc, MI (16-row groups per warp), kBlockM, kBlockN (keys per tile), kStages (of
//   K in shared memory), kDv, kThreads (every thread of the block, producer warps included),
//   kSwizzled (its tiles start 1024-byte aligned), kSequentialMask (OnlineSoftmax's band
//   test) and SharedStorage (the entry adds the staged operands' bytes and checks the sum);
//   run(storage, block, scores, staged, softmax, o): O and the softmax's m and l over every
//   key tile the block attends, false for threads that hold no output rows (producer warps);
//   `staged` (score/tiles.cuh) holds kStages stages of the score operands a tile reads: a
//   mainloop copies a tile's with its K (KeyTiles::load_k) into K's stage, and hands that
//   stage to the softmax.
// Adding a pipeline is adding such a type (one header) and the rule that picks it
// (flashcupy/cuda/spec.py).
#pragma once

#include "../mma/wgmma.cuh"
#include "../softmax.cuh"

namespace flash {

// One forward block's share of the problem: rows [i0, i1) of head hv (rows_valid = i1 - i0
// of them inside q_len), keys [lo, hi) that causal and window leave them, and the first
// element of this head's Q rows, K and V rows (from column dv0 of this block's Dv chunk;
// dv_load of them stored).
template <typename T>
struct FwdBlock {
    const Params& p;
    const HeadView& hv;
    int warp;
    int i0, i1, rows_valid;
    int lo, hi;
    const T* gQ;
    const T* gK;
    const T* gV;
    int dv_load;
};

// The key tiles of a block: starts at multiples of BLOCK_N (keys before lo are masked by the
// band test: dropout's quads (score/dropout.cuh) need tiles at multiples of 8, and 16-byte tile copies
// stay aligned), skipping tiles the score modifiers rule out, and their copies into shared
// memory: K with the tile's staged score operands (Staged, score/tiles.cuh), and V.
template <typename KTile, typename VTile, int BLOCK_M, int BLOCK_N, int THREADS, typename T, typename Sc,
          typename Staged>
struct KeyTiles {
    const Params& p;  // strides and head dims read where used: fewer registers held across the loop
    const Sc& scores;
    const Staged& staged;
    int i0, lo, hi;
    const T* gK;
    const T* gV;
    int dv_load;

    __device__ __forceinline__ KeyTiles(const FwdBlock<T>& b, const Sc& scores_, const Staged& staged_)
        : p(b.p), scores(scores_), staged(staged_), i0(b.i0), lo(b.lo), hi(b.hi), gK(b.gK), gV(b.gV),
          dv_load(b.dv_load) {}

    __device__ __forceinline__ KeyTile first() const {
        return scores.template next_live_tile<BLOCK_M, BLOCK_N>(i0, lo - lo % BLOCK_N, hi);
    }
    // The live key tile after tile k, or {hi, false} when there is none (k.j >= hi included).
    __device__ __forceinline__ KeyTile next(const KeyTile& k) const {
        return k.j < hi ? scores.template next_live_tile<BLOCK_M, BLOCK_N>(i0, k.j + BLOCK_N, hi) : KeyTile{hi, false};
    }
    // Copies of key tile k of K, or j of V, into the tile at s (keys past hi zero-filled,
    // nothing past hi); with K, the tile's score operands into stage `stage` (no mask where the
    // mask keeps the tile whole: OnlineSoftmax then reads none).
    __device__ __forceinline__ void load_k(T* s, const KeyTile& k, int stage) const {
        if (k.j < hi) {
            KTile::template load<THREADS>(s, gK + k.j * p.k_sr, p.k_sr, hi - k.j, p.d);
            staged.template load<THREADS>(p, stage, k.j, hi - k.j, !k.whole);
        }
    }
    __device__ __forceinline__ void load_v(T* s, int j) const {
        if (j < hi) VTile::template load<THREADS>(s, gV + j * p.v_sr, p.v_sr, hi - j, dv_load);
    }
};

// Copies the block's Q rows into sQ (QTile's layout; the caller commits the cp.async group)
// and returns the block's key tiles.
template <typename QTile, typename KTile, typename VTile, int BLOCK_M, int BLOCK_N, int THREADS, typename T,
          typename Sc, typename Staged>
__device__ __forceinline__ KeyTiles<KTile, VTile, BLOCK_M, BLOCK_N, THREADS, T, Sc, Staged> start_tiles(
    T* sQ, const FwdBlock<T>& b, const Sc& scores, const Staged& staged) {
    QTile::template load<THREADS>(sQ, b.gQ + b.i0 * b.p.q_sr, b.p.q_sr, b.rows_valid, b.p.d);
    return KeyTiles<KTile, VTile, BLOCK_M, BLOCK_N, THREADS, T, Sc, Staged>(b, scores, staged);
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

}  // namespace flash
