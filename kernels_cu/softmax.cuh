// The forward's online softmax: scores folded tile by tile into a running row maximum, a
// running sum and an unnormalised O, which the epilogue (epilogue.cuh) normalises once.
#pragma once

#include "mma/common.cuh"
#include "score/scores.cuh"
#include "score/tiles.cuh"

namespace flash {

// The larger of a and b. float: fmaxf, one FMNMX, NaN only if both are; a NaN score still
// reaches its row's output (it skips the row max, but P = exp2(NaN - m) is NaN, and so are
// l and O). double: a compare and select (NaN when b is), since fmax costs the float64
// kernels registers they do not have (spills on sm_80 to sm_90).
__device__ __forceinline__ float max_acc(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double max_acc(double a, double b) { return a > b ? a : b; }

// The online softmax of one thread's rows: running max m (log2 domain) and this thread's
// share of the running sum l, fed by the kernel's score modifiers (score/scores.cuh) for the
// option set Set.
// SEQUENTIAL_MASK: PlainScores' masked tiles take TileBand's sequential test (a mainloop's
// kSequentialMask). Staged: the block's score operands in shared memory (ScoreTiles).
template <typename Acc, int MI, typename Set, bool SEQUENTIAL_MASK, typename Staged>
struct OnlineSoftmax {
    using Sc = Scores<Acc, Set>;
    const Params& p;
    const HeadView& hv;
    const Sc& scores;
    const Staged& staged;
    int i0, i1;    // the block's valid rows
    int r0, t;     // this thread's first row and its column pair in each 8-column tile
    Acc (&m)[2 * MI];  // rows r0 + 8 x, x in [0, 2 MI)
    Acc (&l)[2 * MI];

    // Scores of key tile k, keys [jt0, jt0 + 8 NP) from jt0 = k.j (valid below jt1), from raw
    // products sp, turned into P = exp2(S - m) in place (dropped elements 0) and folded into m
    // and l; alpha = exp2(m_old - m_new) per row is what O has to be rescaled by (rescale).
    // The tile's operands are in stage `stage` of `staged` (no mask where k.whole), its dropout
    // bits in `keep` (keep_bits).
    template <int NP>
    __device__ __forceinline__ void exponentiate(Acc (&sp)[MI][NP][4], const KeyTile& k, const int jt1,
                                                 Acc (&alpha)[2 * MI], int stage, const KeepBits<MI, NP>& keep) {
        const int jt0 = k.j;
        Acc row_max[2 * MI];
#pragma unroll
        for (int x = 0; x < 2 * MI; ++x) row_max[x] = neg_inf<Acc>();
        // Walked with row 0 and column 0 at the thread's first element, each_element's row
        // i = 16 mi + 8 (e >> 1) is 8 x for the thread's row x (a constant once unrolled).
        auto fold_max = [&](Acc& s, int i, int) { row_max[i / 8] = max_acc(row_max[i / 8], s); };
        const bool crosses = !tile_inside_band(p, hv, i0, i1, jt0, jt1);
        // A fast tile (whole, crossing no band edge, no block mask present) selects nothing
        // but what the mask, read from its staged tile, says: nothing either where the masks
        // keep the tile whole (the tile map's word; its mask was not copied). Other tiles the
        // masks keep whole read no block mask either (`mask` false).
        const bool fast = !Sc::kBlockMask && jt1 - jt0 == 8 * NP && !crosses;
        if constexpr (Sc::kFull) {
            // One copy of the options' passes for every tile, the selection skipped on fast ones
            // (a second copy for fast tiles spills the D = 128 bias kernel).
            scores.template masked_tile<SEQUENTIAL_MASK>(sp, r0, jt0, t, jt1, crosses, !fast, !k.whole,
                                                         staged.operands(stage, r0 - i0, t));
            each_element(sp, 0, 0, 0, fold_max);
        } else if (fast) {
            each_element(sp, 0, 0, 0, [&](Acc& s, int i, int j) {
                s *= scores.op.scale_log2;  // S = scale * log2(e) * Q K^T
                fold_max(s, i, j);
            });
        } else {
            // Keys past jt1 are zero-filled padding of the tile and rows past q_len are
            // discarded: both masked, the latter before any mask or bias read.
            scores.template masked_tile<SEQUENTIAL_MASK>(sp, r0, jt0, t, jt1, crosses, true, false,
                                                         staged.operands(stage, r0 - i0, t));
            each_element(sp, 0, 0, 0, fold_max);
        }
        Acc m_safe[2 * MI];
#pragma unroll
        for (int r = 0; r < 2 * MI; ++r) {  // the four lanes of a quad share rows: reduce across them
            row_max[r] = max_acc(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 1));
            row_max[r] = max_acc(row_max[r], __shfl_xor_sync(0xffffffffu, row_max[r], 2));
            const Acc m_new = max_acc(m[r], row_max[r]);
            // A row with every score so far masked has m = -inf; subtracting 0 instead keeps
            // exp2(-inf - 0) = 0 rather than exp2(-inf + inf) = NaN.
            m_safe[r] = m_new == neg_inf<Acc>() ? Acc(0) : m_new;
            alpha[r] = softmax_exp2(m[r] - m_safe[r]);  // rescales the old sum and accumulator
            m[r] = m_new;
            l[r] *= alpha[r];
        }
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
            for (int n = 0; n < NP; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int x = 2 * mi + (e >> 1);
                    const Acc pe = softmax_exp2(sp[mi][n][e] - m_safe[x]);  // P = exp2(S - m)
                    l[x] += pe;                                           // lse is taken before dropout
                    // Dropped: 0; 1 / (1 - p) is applied once at the end.
                    sp[mi][n][e] = keep.kept(mi, n, e) ? pe : Acc(0);
                }
            }
        }
    }

    // The dropout bits of key tile k for exponentiate: every lane of the warp calls it.
    template <int NP>
    __device__ __forceinline__ KeepBits<MI, NP> keep_bits(const KeyTile& k) const {
        return scores.template keep_tile<MI, NP>(r0, k.j + 2 * t);
    }

    // exponentiate with the tile's dropout bits drawn here, for mainloops with no earlier
    // place to draw them.
    template <int NP>
    __device__ __forceinline__ void exponentiate(Acc (&sp)[MI][NP][4], const KeyTile& k, const int jt1,
                                                 Acc (&alpha)[2 * MI], int stage) {
        exponentiate(sp, k, jt1, alpha, stage, keep_bits<NP>(k));
    }

    // O *= alpha, row by row.
    template <int NO>
    static __device__ __forceinline__ void rescale(Acc (&o)[MI][NO][4], const Acc (&alpha)[2 * MI]) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int n = 0; n < NO; ++n) {
                o[mi][n][0] *= alpha[2 * mi];
                o[mi][n][1] *= alpha[2 * mi];
                o[mi][n][2] *= alpha[2 * mi + 1];
                o[mi][n][3] *= alpha[2 * mi + 1];
            }
    }

    // exponentiate, then rescale O for the new maxima.
    template <int NP, int NO>
    __device__ __forceinline__ void fold(Acc (&sp)[MI][NP][4], const KeyTile& k, const int jt1, Acc (&o)[MI][NO][4],
                                         int stage) {
        Acc alpha[2 * MI];
        exponentiate(sp, k, jt1, alpha, stage);
        rescale(o, alpha);
    }
};

}  // namespace flash
