// The score modifiers a kernel compiles, as one functor per (kernel call, head) with one
// interface for every mainloop, forward and backward, specialised on the call's option set
// (ScoreMods, score/modifiers.cuh):
//
//   PlainScores  causal, window and lengths only (the band and the padding): no option reads
//                memory or changes a score's value, so the mainloops' fast tiles multiply by
//                scale * log2(e) and nothing else, and their registers go to bigger tiles.
//   ScoreMods<M> also softcap, bias, ALiBi, mask, block_mask and dropout, those of M, each
//                compiled in only where present, so any combination composes without a code
//                path of its own.
//
// What a mainloop asks of it:
//   tile walk         next_live_tile(i0, j, hi): the next key tile some score survives the
//                     masks in (the tiles between are skipped), and whether the mask keeps it
//                     whole (no mask read for it); a whole tile crossing no band
//                     edge and without a block mask is a fast one: values() and, with a mask,
//                     the mask's own selection from its staged tile, nothing else;
//   forward transform masked_tile(s, ..., select, mask, ops): raw products -> log2-domain
//                     scores, with `mask` (a tile the mask does not keep whole) -inf where the
//                     mask says no, and with `select` where the lengths, the
//                     band or the block mask say no (every tile but the fast ones), the bias
//                     and mask read from the tile's operands staged in shared memory
//                     (score/tiles.cuh);
//   per-score form    value(x, i, j) (no selection) and operator()(x, i, j, band) (the
//                     backward's element pass), of x = capped(q.k): softcap's tanh, taken
//                     once a score;
//   derivative        derivative(bp, ds, x, i, j, owner): the bias gradient's accumulation
//                     (dbias += dS) and dS through softcap's d(c tanh(s / c)) / ds = 1 - x^2;
//   dropout on P      keep_tile(i, j): the keep bits of a thread's elements of an
//                     accumulator tile (KeepBits), or of a transposed one (S^T), drawn where
//                     the mainloop has the time: before the tile's products land.
#pragma once

#include "../bwd_params.cuh"
#include "dropout.cuh"
#include "modifiers.cuh"
#include "tile_map.cuh"

namespace flash {

template <typename Acc, typename Set>
struct Scores {
    static constexpr unsigned kMods = Set::kMods;
    static constexpr bool kFull = Set::kFull, kMasks = Set::kMasks, kBlockMask = Set::kBlockMask, kPlain = Set::kPlain;
    static constexpr bool kDropout = Set::kDropout;
    const Params& p;
    const HeadView hv;  // a copy: a reference to the caller's would keep it in memory
    ScoreOp<Acc, Set> op;
    DropoutKey key;  // dropout's seed and offset, read once (zero without dropout)

    __device__ __forceinline__ Scores(const Params& p_, const HeadView& hv_)
        : p(p_), hv(hv_), op(p_, hv_), key(kDropout ? DropoutKey::of(p_) : DropoutKey{0, 0}) {}

    // The first key tile at or after j (a multiple of BLOCK_N) below hi that some score of
    // the query tile from i0 (a multiple of BLOCK_M) survives the masks in ({hi, false} if
    // none), and whether the mask keeps it whole: the call's tile map (score/tile_map.cuh)
    // where masks are compiled in, else {j, false}.
    template <int BLOCK_M, int BLOCK_N>
    __device__ __forceinline__ KeyTile next_live_tile(int i0, int j, int hi) const {
        if constexpr (kMasks) return next_live_key_tile<BLOCK_M, BLOCK_N>(p, hv, i0, j, hi);
        return {j, false};
    }

    // The log2-domain scores of a (16 MI, 8 NP) accumulator tile of raw products q.k, rows
    // from r0 and keys from jt0 (thread column t), keys from jt1 zero-filled padding; with
    // `mask` (the masks do not keep the tile whole), -inf wherever the mask says no (its
    // staged tile is zero past the tile's rows and keys), and with `select`, rows from q_len
    // and keys from jt1 masked and -inf wherever the band (where the tile `crosses` a causal
    // or window edge) or (with `mask`) the block mask says no. Without it (a fast tile: whole,
    // inside the band, no block mask) nothing else is selected and rows past q_len are
    // computed to be discarded; PlainScores always select (their fast tiles take the
    // softmax's fused scale-and-max loop instead). SEQUENTIAL: PlainScores' band test in
    // TileBand's sequential form, for kernels without registers to spare.
    // The bias and mask come from the tile's staged operands `ops` (score/tiles.cuh).
    template <bool SEQUENTIAL, int MI, int NP, typename Ops>
    __device__ __forceinline__ void masked_tile(Acc (&s)[MI][NP][4], int r0, int jt0, int t, int jt1,
                                                bool crosses, bool select, bool mask, const Ops& ops) const {
        if constexpr (kFull) {
            op.tile(p, hv, s, r0, jt0, t, jt1, crosses, select, mask, ops);
        } else {
            const TileBand<SEQUENTIAL> kept(p, hv, crosses);
            each_element(s, r0, jt0, t, [&](Acc& x, int i, int j) {
                x = kept((j < jt1) & (i < hv.q_len), i, j) ? x * op.scale_log2 : neg_inf<Acc>();
            });
        }
    }

    // softcap's tanh(scale q.k / c) of raw = q.k (raw itself without softcap): what the
    // per-score forms below and derivative() take, computed once a score.
    __device__ __forceinline__ Acc capped(Acc raw) const { return op.capped(raw); }

    // The log2-domain value of score (i, j) from x = capped(q.k), no selection (i < q_len).
    __device__ __forceinline__ Acc value(Acc x, int i, int j) const { return op.value(p, hv, x, i, j); }

    // The log2-domain score of row i < q_len, key j < kv_len from x = capped(q.k), tested
    // against the band's bounds `band` (Band(p, hv)) and the masks.
    __device__ __forceinline__ Acc operator()(Acc x, int i, int j, const Band& band) const {
        return op(p, hv, x, i, j, true, band);
    }

    // The backward through the modifiers at score (i, j) of this head, x = capped(q.k),
    // ds = dL/dS of the modified score: the bias enters after softcap, so dbias[i, j] += dS as
    // it is (where a bias gradient is asked for and `owner`: the caller is the one block that
    // adds this score's share), then ds *= d(c tanh(s / c)) / ds = 1 - tanh^2 = 1 - x^2, with
    // softcap. dbias is in the accumulator dtype, strided by bp.db_* (0 on the bias' broadcast
    // axes, so their scores add into one element).
    __device__ __forceinline__ void derivative(const BwdParams& bp, Acc& ds, Acc x, int i, int j,
                                               bool owner) const {
        if constexpr ((kMods & kModBias) != 0) {
            if (owner && bp.dbias != nullptr && ds != Acc(0)) {
                atomicAdd(static_cast<Acc*>(bp.dbias) + hv.b * bp.db_sb + hv.h * bp.db_sh + i * bp.db_si
                              + j * bp.db_sj,
                          ds);
            }
        }
        if constexpr ((kMods & kModSoftcap) != 0) ds *= Acc(1) - x * x;
    }

    // The keep bits of a thread's (16 MI, 8 NT) tile: rows i + 16 mi and keys j + 8 n
    // (TRANSPOSED: keys j + 16 mi and queries i + 8 n); all kept without dropout. Every lane
    // of the warp calls it.
    template <int MI, int NT, bool TRANSPOSED = false>
    __device__ __forceinline__ KeepBits<MI, NT> keep_tile(int i, int j) const {
        if constexpr (kDropout) return DropoutBits{p, static_cast<u32>(hv.bh), key}.template tile<MI, NT, TRANSPOSED>(i, j);
        return KeepBits<MI, NT>::all();
    }
};

}  // namespace flash
