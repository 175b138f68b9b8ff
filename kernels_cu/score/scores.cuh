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
//   per-score form    value(raw, i, j) (no selection) and operator()(raw, i, j, band) (the
//                     backward's element pass);
//   derivative        derivative(bp, ds, raw, i, j, owner): the bias gradient's accumulation
//                     (dbias += dS) and dS through softcap's d(c tanh(x / c)) / dx;
//   dropout on P      keep8(i, j): the keep bits of a thread's elements of two accumulator
//                     tiles side by side; keep8_transposed(j, i) of transposed ones (S^T).
#pragma once

#include "../bwd_params.cuh"
#include "../philox.cuh"
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

    __device__ __forceinline__ Scores(const Params& p_, const HeadView& hv_) : p(p_), hv(hv_), op(p_, hv_) {}

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
    // `mask` (the tile is not kept whole), -inf wherever the mask says no (its staged tile is
    // zero past the tile's rows and keys), and
    // with `select`, rows from q_len and keys from jt1 masked and -inf wherever the band (where
    // the tile `crosses` a causal or window edge) or the block mask says no. Without it (a
    // fast tile: whole, inside the band, no block mask) nothing else is selected and rows past
    // q_len are computed to be discarded; PlainScores always select (their fast tiles take the
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

    // The log2-domain value of score (i, j) from raw = q.k, no selection (i < q_len).
    __device__ __forceinline__ Acc value(Acc raw, int i, int j) const { return op.value(p, hv, raw, i, j); }

    // The log2-domain score of row i < q_len, key j < kv_len from raw = q.k, tested against the
    // band's bounds `band` (Band(p, hv)) and the masks.
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
        if constexpr ((kMods & kModBias) != 0) {
            if (owner && bp.dbias != nullptr && ds != Acc(0)) {
                atomicAdd(static_cast<Acc*>(bp.dbias) + hv.b * bp.db_sb + hv.h * bp.db_sh + i * bp.db_si
                              + j * bp.db_sj,
                          ds);
            }
        }
        if constexpr ((kMods & kModSoftcap) != 0) {
            const Acc th = op.cap_tanh(raw * op.scale * op.inv_softcap);
            ds *= Acc(1) - th * th;
        }
    }

    // Bit k of the result: key 8 group + k of query row `row` survives dropout, k in [0, 8):
    // the eight 16-bit halves of one Philox call, low half of word 0 first, against the
    // threshold (docs/semantics.md#dropout-bits).
    __device__ __forceinline__ unsigned keep_byte(u32 group, u32 row) const {
        const Philox4 r = philox4x32_10(group, row, hv.bh, p.dropout_offset, static_cast<u32>(p.seed),
                                        static_cast<u32>(p.seed >> 32));
        const u32 th = p.dropout_threshold, words[4] = {r.x, r.y, r.z, r.w};
        unsigned bits = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w)
            bits |= unsigned((words[w] & 0xffffu) >= th) << (2 * w) | unsigned((words[w] >> 16) >= th) << (2 * w + 1);
        return bits;
    }

    // One step of an 8-bit matrix transpose across lanes (row: lane, column: bit): the lane
    // and its partner `lanes` away swap their off-diagonal blocks of `width` bits. `upper`:
    // this lane is the pair's second; `low` masks the first block of every pair of blocks.
    static __device__ __forceinline__ unsigned swap_blocks(unsigned bits, bool upper, int lanes, int width,
                                                           unsigned low) {
        const unsigned got = __shfl_xor_sync(0xffffffffu, upper ? bits & low : (bits >> width) & low, lanes);
        return upper ? (bits & ~low & 0xffu) | got : (bits & low) | got << width;
    }

    // Bits 4 u + e of the result: element e of a thread's accumulator quads of key tiles n + u,
    // u in {0, 1}: rows i and i + 8, keys j + 8 u and j + 8 u + 1 (j = a multiple of 8 plus
    // 2 t, t = lane % 4). The four calls they need (rows i, i + 8 x tiles n, n + 1) are made
    // once in the quad, lane c making call c (row i + 8 (c & 1), tile n + (c >> 1)), and their
    // 2-bit key pairs transposed across the quad in two shuffles: lane t takes pair t of each
    // call, one call per eight scores a lane. Every lane of the warp calls it.
    __device__ __forceinline__ unsigned keep8(int i, int j) const {
        unsigned keep = 0xffu;
        if constexpr (kDropout) {
            const unsigned c = threadIdx.x & 3u;
            keep = keep_byte((static_cast<u32>(j) >> 3) + (c >> 1), static_cast<u32>(i) + 8u * (c & 1u));
            keep = swap_blocks(keep, c & 2u, 2, 4, 0x0fu);  // pairs 2, 3 of calls 0, 1 <-> pairs 0, 1 of calls 2, 3
            keep = swap_blocks(keep, c & 1u, 1, 2, 0x33u);  // pair 1 of call 0 <-> pair 0 of call 1, and so on
        }
        return keep;
    }

    // Bits 4 u + e of the result: element e of a thread's quads of a transposed accumulator
    // tile (S^T) at query columns 8 (n + u), u in {0, 1}: rows keys j and j + 8 (j = a multiple
    // of 16 plus the lane's group g = lane / 4), columns queries i + 8 u and i + 8 u + 1 (i
    // even). The eight lanes of column pair t need the same eight calls (queries i, i + 1,
    // i + 8, i + 9 x key groups j >> 3 and the next): lane g makes call c = g (element
    // c & 3 of tile n + (c >> 2)), and the 8 x 8 bit matrix (row: call, column: key) is
    // transposed across them in three shuffles, lane g taking key g of every call: one call
    // per eight scores a lane. Every lane of the warp calls it.
    __device__ __forceinline__ unsigned keep8_transposed(int j, int i) const {
        unsigned keep = 0xffu;
        if constexpr (kDropout) {
            const unsigned c = (threadIdx.x >> 2) & 7u;
            keep = keep_byte((static_cast<u32>(j) >> 3) + ((c >> 1) & 1u), static_cast<u32>(i) + (c & 1u) + 8u * (c >> 2));
            keep = swap_blocks(keep, c & 4u, 16, 4, 0x0fu);
            keep = swap_blocks(keep, c & 2u, 8, 2, 0x33u);
            keep = swap_blocks(keep, c & 1u, 4, 1, 0x55u);
        }
        return keep;
    }
};

}  // namespace flash
