// The score modifiers a kernel compiles, as one functor per (kernel call, head) with one
// interface for every mainloop, forward and backward:
//
//   PlainScores  causal, window and lengths only (the band and the padding): no option reads
//                memory or changes a score's value, so the mainloops' fast tiles multiply by
//                scale * log2(e) and nothing else, and their registers go to bigger tiles.
//   FullScores   also softcap, bias, ALiBi, mask, block_mask and dropout, each tested once per
//                call (a uniform branch), so any combination composes without a code path of
//                its own.
//
// What a mainloop asks of it:
//   tile predicates   live(i0, i1, j0, j1): some score of the tile survives block_mask and mask
//                     (the tile is skipped otherwise); plain: no option touches a score, so a
//                     whole tile inside the band needs nothing but the scale (the mainloops'
//                     fast tiles: plain, whole, crossing no band edge);
//   forward transform masked_tile(s, ...): raw products -> log2-domain scores, -inf where any
//                     mask says no, for a tile that is not fast;
//   per-score form    operator()(raw, i, j, band): the same for one score (the backward's
//                     element pass);
//   derivative        derivative(bp, ds, raw, i, j, owner): the bias gradient's accumulation
//                     (dbias += dS) and dS through softcap's d(c tanh(x / c)) / dx;
//   dropout on P      keep4(i, j): the keep bits of a thread's four elements of an
//                     accumulator tile, keep(i, j) of one score.
#pragma once

#include "../bwd_params.cuh"
#include "../philox.cuh"
#include "modifiers.cuh"

namespace flash {

struct PlainScores {
    static constexpr bool kFull = false;
};
struct FullScores {
    static constexpr bool kFull = true;
};

template <typename Acc, bool FULL>
struct Scores {
    static constexpr bool kFull = FULL;
    const Params& p;
    const HeadView hv;  // a copy: a reference to the caller's would keep it in memory
    ScoreOp<Acc> op;
    bool plain;    // no option touches the scores: inside the band a score is S * scale * log2(e)
    bool dropout;  // FULL and dropout_p > 0

    __device__ __forceinline__ Scores(const Params& p_, const HeadView& hv_)
        : p(p_), hv(hv_), op(p_, hv_),
          plain(!FULL || (!p_.has_softcap && op.bias == nullptr && p_.alibi == nullptr && op.mask == nullptr
                          && op.block_mask == nullptr)),
          dropout(FULL && p_.dropout_threshold != 0) {}

    // Does some score of tile [i0, i1) x [j0, j1) survive block_mask and mask? Every thread
    // of the block calls it (it ends in a barrier); PlainScores have no such mask.
    __device__ __forceinline__ bool live(int i0, int i1, int j0, int j1) const {
        if constexpr (FULL) return tile_live(p, hv, i0, i1, j0, j1);
        return true;
    }

    // The first key tile at or after j (below hi) that some score of rows [i0, i1) survives in.
    template <int BLOCK_N>
    __device__ __forceinline__ int next_live_tile(int i0, int i1, int j, int hi) const {
        if constexpr (FULL) {
            while (j < hi && !tile_live(p, hv, i0, i1, j, min(j + BLOCK_N, hi))) j += BLOCK_N;
        }
        return j;
    }

    // The log2-domain scores of a (16 MI, 8 NP) accumulator tile of raw products q.k, rows
    // from r0 and keys from jt0 (thread column t), rows from q_len and keys from jt1 masked,
    // -inf wherever a mask says no; `crosses`: the tile crosses a causal or window edge.
    // SEQUENTIAL: PlainScores' band test in TileBand's sequential form, for kernels without
    // registers to spare.
    template <bool SEQUENTIAL, int MI, int NP>
    __device__ __forceinline__ void masked_tile(Acc (&s)[MI][NP][4], int r0, int jt0, int t, int jt1,
                                                bool crosses) const {
        if constexpr (FULL) {
            op.tile(p, hv, s, r0, jt0, t, jt1, crosses);
        } else {
            const TileBand<SEQUENTIAL> kept(p, hv, crosses);
            each_element(s, r0, jt0, t, [&](Acc& x, int i, int j) {
                x = kept((j < jt1) & (i < hv.q_len), i, j) ? x * op.scale_log2 : neg_inf<Acc>();
            });
        }
    }

    // The log2-domain score of row i < q_len, key j < kv_len from raw = q.k, tested against the
    // band's bounds `band` (Band(p, hv)).
    __device__ __forceinline__ Acc operator()(Acc raw, int i, int j, const Band& band) const {
        return op(p, hv, raw, i, j, true, band);
    }

    // The backward through the modifiers at score (i, j) of this head, raw = q.k, ds = dL/dS
    // of the modified score: the bias enters after softcap, so dbias[i, j] += dS as it is
    // (where a bias gradient is asked for and `owner`: the caller is the one block that adds
    // this score's share), then ds *= d(c tanh(x / c)) / dx = 1 - tanh^2 at the scaled
    // score, with softcap. dbias is in the accumulator dtype, strided by bp.db_* (0 on the
    // bias' broadcast axes, so their scores add into one element).
    __device__ __forceinline__ void derivative(const BwdParams& bp, Acc& ds, Acc raw, int i, int j,
                                               bool owner) const {
        if (owner && bp.dbias != nullptr && ds != Acc(0)) {
            atomicAdd(static_cast<Acc*>(bp.dbias) + hv.b * bp.db_sb + hv.h * bp.db_sh + i * bp.db_si + j * bp.db_sj,
                      ds);
        }
        if (p.has_softcap) {
            const Acc th = tanh_acc(raw * op.scale * op.inv_softcap);
            ds *= Acc(1) - th * th;
        }
    }

    // Bit e of the result: element e of a thread's accumulator quad, rows i and i + 8, keys j
    // and j + 1 (j even), survives dropout.
    __device__ __forceinline__ unsigned keep4(int i, int j) const {
        unsigned keep = 0xfu;
        if constexpr (FULL) {
            if (dropout) {
                bool k0, k1, k2, k3;
                dropout_keep_pair(p.seed, p.dropout_offset, hv.bh, i, j, p.dropout_threshold, k0, k1);
                dropout_keep_pair(p.seed, p.dropout_offset, hv.bh, i + 8, j, p.dropout_threshold, k2, k3);
                keep = unsigned(k0) | unsigned(k1) << 1 | unsigned(k2) << 2 | unsigned(k3) << 3;
            }
        }
        return keep;
    }

    // Does score (i, j) survive dropout?
    __device__ __forceinline__ bool keep(int i, int j) const {
        return dropout_keep_one(p.seed, p.dropout_offset, hv.bh, i, j, p.dropout_threshold);
    }
};

}  // namespace flash
