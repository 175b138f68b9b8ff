// The score options of docs/semantics.md, shared by every attention kernel:
//   s = scale * q.k -> softcap -> + bias + ALiBi -> -inf where any mask says no
// (which tiles the masks leave nothing in: score/tile_map.cuh).
//
// A kernel is compiled for the exact set of options its call uses (ScoreMods: a bit per
// option and the bias' element type), so each option costs its arithmetic and nothing else:
// no per-score branch on an option that is absent, and the passes of the options present
// interleave freely (a uniform run-time branch per option and score splits the unrolled
// tile loops into blocks ptxas schedules one after another).
#pragma once

#include "../mma/common.cuh"
#include "band.cuh"

namespace flash {

// The options a kernel is compiled with, one bit each (flashcupy/cuda/spec.py names them).
enum ScoreMod : unsigned {
    kModSoftcap = 1u,    // s = c tanh(s / c)
    kModBias = 2u,       // s += bias
    kModAlibi = 4u,      // s -= slope |i + Lk - Lq - j|
    kModMask = 8u,       // boolean mask, one byte per score
    kModBlockMask = 16u, // boolean block mask, one byte per (block_size, block_size) block
    kModDropout = 32u,   // dropout on P
};
constexpr unsigned kModValues = kModSoftcap | kModBias | kModAlibi;  // options that change a score's value
constexpr unsigned kModMasks = kModMask | kModBlockMask;             // options that mask scores beyond the band

template <typename T> constexpr bool kIsVoid = false;
template <> constexpr bool kIsVoid<void> = true;

// A kernel's score option set: MODS (ScoreMod bits) and B, the bias' element type (void
// without a bias). The host passes exactly the options of the call: a bit set means the
// option is present (its pointer non-null, dropout_p > 0: its threshold may still be 0, a p
// at or below 2^-17 dropping nothing), so no kernel tests for it again.
template <unsigned MODS, typename B = void>
struct ScoreMods {
    static constexpr unsigned kMods = MODS;
    using Bias = B;
    static constexpr bool kFull = MODS != 0;
    static constexpr bool kMasks = (MODS & kModMasks) != 0;    // masks beyond the band: a tile map is walked
    static constexpr bool kBlockMask = (MODS & kModBlockMask) != 0;
    static constexpr bool kPlain = (MODS & kModValues) == 0;   // S = scale log2(e) q.k wherever kept
    static constexpr bool kDropout = (MODS & kModDropout) != 0;
    static constexpr bool kApproxTanh = false;  // softcap's tanh in one instruction (ForElement)
    static_assert(((MODS & kModBias) != 0) == !kIsVoid<B>, "a bias type exactly when the bias bit is set");
};
using PlainScores = ScoreMods<0>;

// The option set a kernel of input element type T runs: Set itself, or, with softcap on
// 16-bit inputs, Set with kApproxTanh: tanh.approx's error is an ulp of the inputs' float16,
// where float32 and float64 inputs keep tanhf's and tanh's precision. Each entry applies it
// to the set the host names; sets without softcap stay the host's type.
template <typename Set, typename T, bool APPROX = (Set::kMods & kModSoftcap) != 0 && sizeof(T) == 2>
struct ForElement {
    using type = Set;
};
template <typename Set, typename T>
struct ForElement<Set, T, true> {
    struct type : Set {
        static constexpr bool kApproxTanh = true;
    };
};

// Everything a thread needs to turn raw products q.k into log2-domain scores under the
// option set Set (a ScoreMods).
template <typename Acc, typename Set>
struct ScoreOp {
    static constexpr unsigned M = Set::kMods;
    using B = typename Set::Bias;
    Acc scale_log2;      // scale * log2(e) (no softcap)
    Acc scale;           // scale
    Acc cap_in;          // scale / softcap: tanh's argument per raw product (softcap)
    Acc cap_log2;        // softcap * log2(e): a capped score in the log2 domain (softcap)
    Acc slope_log2;      // ALiBi slope * log2(e)
    const B* bias;       // this head's bias
    const bool* mask;    // this head's mask
    const bool* block_mask;

    __device__ __forceinline__ ScoreOp(const Params& p, const HeadView& hv) {
        scale = static_cast<Acc>(p.scale);
        scale_log2 = static_cast<Acc>(p.scale * kLog2e);
        // Products of the host's doubles: a score takes one multiply before its tanh and one
        // after, where (q.k * scale) / c and c * tanh * log2(e) took two each.
        cap_in = static_cast<Acc>((M & kModSoftcap) != 0 ? p.scale / p.softcap : 0.0);
        cap_log2 = static_cast<Acc>(p.softcap * kLog2e);
        slope_log2 = (M & kModAlibi) != 0 ? static_cast<Acc>(p.alibi[hv.b * p.alibi_sb + hv.h * p.alibi_sh] * kLog2e)
                                          : Acc(0);
        if constexpr ((M & kModBias) != 0) {
            bias = static_cast<const B*>(p.bias) + (hv.b * p.bias_sb + hv.h * p.bias_sh);
        } else {
            bias = nullptr;
        }
        mask = (M & kModMask) != 0 ? p.mask + hv.b * p.mask_sb + hv.h * p.mask_sh : nullptr;
        block_mask = (M & kModBlockMask) != 0 ? p.block_mask + hv.b * p.bm_sb + hv.h * p.bm_sh : nullptr;
    }

    // softcap's tanh: one instruction on 16-bit inputs (ForElement), the library's otherwise.
    static __device__ __forceinline__ Acc cap_tanh(Acc x) {
        if constexpr (Set::kApproxTanh) {
            return tanh_approx(x);
        } else {
            return tanh_acc(x);
        }
    }

    // bias[i, j] * log2(e).
    __device__ __forceinline__ Acc bias_log2(const Params& p, int i, int j) const {
        if constexpr ((M & kModBias) != 0) {
            return static_cast<Acc>(widen(bias[i * p.bias_si + j * p.bias_sj])) * static_cast<Acc>(kLog2e);
        } else {
            return Acc(0);
        }
    }

    // softcap's tanh(scale q.k / c) of raw = q.k; raw itself without softcap. The per-score
    // forms below take it (x), so the backward's element passes compute it once a score for
    // the value and for softcap's derivative.
    __device__ __forceinline__ Acc capped(Acc raw) const {
        if constexpr ((M & kModSoftcap) != 0) {
            return cap_tanh(raw * cap_in);
        } else {
            return raw;
        }
    }

    // The log2-domain value of score (i, j) from x = capped(q.k), before any mask: scale
    // and softcap, then bias (read from global memory at row min(i, q_len - 1): rows past
    // q_len are discarded, and must not read past the bias), then ALiBi. The per-score form,
    // for the backward's element passes; the forward's tiles take values() and staged operands.
    __device__ __forceinline__ Acc value(const Params& p, const HeadView& hv, Acc x, int i, int j) const {
        return value_at(x, bias_log2(p, min(i, hv.q_len - 1), j), alibi_base(hv, i, j));
    }

    // value() from x = capped(q.k), the bias term b_log2 = bias[i, j] * log2(e) (ignored
    // without a bias) and ALiBi's offset d = i + Lk - Lq - j as a float. A tile's callers form
    // d as one converted base plus the element's compile-time offset (alibi_base): an integer
    // conversion runs at a sixteenth of the float rate, as exp2 does, and one a score doubled
    // the forward's special-function work. Exact while |d| < 2^24.
    __device__ __forceinline__ Acc value_at(Acc x, Acc b_log2, Acc d) const {
        Acc s;
        if constexpr ((M & kModSoftcap) != 0) {
            s = cap_log2 * x;  // s = c tanh(s / c)
        } else {
            s = x * scale_log2;
        }
        if constexpr ((M & kModBias) != 0) s += b_log2;
        if constexpr ((M & kModAlibi) != 0) s -= slope_log2 * fabs(d);
        return s;
    }

    // ALiBi's offset i + Lk - Lq - j at row i and key j, converted once: the base the elements
    // of a tile add their compile-time offsets to (value_at).
    static __device__ __forceinline__ Acc alibi_base(const HeadView& hv, int i, int j) {
        return static_cast<Acc>(i + hv.diagonal - j);
    }

    // Does score (i, j) survive block_mask?
    __device__ __forceinline__ bool block_unmasked(const Params& p, int i, int j) const {
        return block_mask[(i / p.block_size) * p.bm_si + (j / p.block_size) * p.bm_sj];
    }

    // Does score (i, j) survive mask and block_mask?
    __device__ __forceinline__ bool unmasked(const Params& p, int i, int j) const {
        bool keep = true;
        if constexpr ((M & kModMask) != 0) keep &= mask[i * p.mask_si + j * p.mask_sj];
        if constexpr ((M & kModBlockMask) != 0) keep &= block_unmasked(p, i, j);
        return keep;
    }

    // The log2-domain score of row i < q_len, key j < kv_len (positions inside the sequence)
    // from x = capped(q.k). check_band: the tile crosses a causal/window edge, compare per
    // element with the band's bounds `band` (Band(p, hv), built by the caller: per score, the
    // compiler hoists what it can).
    __device__ __forceinline__ Acc operator()(const Params& p, const HeadView& hv, Acc x, int i, int j,
                                              bool check_band, const Band& band) const {
        const bool keep = (!check_band | band(i, j)) && unmasked(p, i, j);
        return keep ? value(p, hv, x, i, j) : neg_inf<Acc>();
    }

    // value() on a whole (16 MI, 8 NP) accumulator tile of S = Q K^T (mma/common.cuh's
    // layout: rows r0 + 8 x for x = 2 mi + (e >> 1), keys jt0 + 8 n + 2 t + (e & 1)), one
    // pass per option present. The bias comes from the tile's staged operands `ops`
    // (score/tiles.cuh's TileOperands, at the thread's first element), zero past the tile's
    // keys and rows.
    template <int MI, int NP, typename Ops>
    __device__ __forceinline__ void values(const HeadView& hv, Acc (&s)[MI][NP][4], int r0, int jt0, int t,
                                           const Ops& ops) const {
        if constexpr ((M & kModSoftcap) != 0) {
            each_element(s, r0, jt0, t, [&](Acc& x, int, int) { x = cap_log2 * capped(x); });
        } else {
            each_element(s, r0, jt0, t, [&](Acc& x, int, int) { x *= scale_log2; });
        }
        if constexpr ((M & kModBias) != 0) {
            const Acc log2e = static_cast<Acc>(kLog2e);
            each_pair(s, [&](Acc& x, Acc& y, int dr, int dc) {
                Acc b0, b1;
                ops.bias_pair(dr, dc, b0, b1);
                x += b0 * log2e;
                y += b1 * log2e;
            });
        }
        if constexpr ((M & kModAlibi) != 0) {  // s -= slope * |i + Lk - Lq - j|, from one conversion (value_at)
            const Acc d0 = alibi_base(hv, r0, jt0 + 2 * t);
            each_pair(s, [&](Acc& x, Acc& y, int dr, int dc) {
                const Acc d = d0 + static_cast<Acc>(dr - dc);  // (row r0 + dr, key jt0 + 2 t + dc)
                x -= slope_log2 * fabs(d);
                y -= slope_log2 * fabs(d - Acc(1));  // the next key
            });
        }
    }

    // values(), with `mask` (the masks do not keep the tile whole) -inf wherever the mask
    // (from `ops`) says no, then, with `select`, -inf outside (q_len, j_end), outside the band
    // where the tile crosses its edge (check_band), and, with `mask` too, wherever the block
    // mask says no (read only inside (q_len, j_end)).
    template <int MI, int NP, typename Ops>
    __device__ __forceinline__ void tile(const Params& p, const HeadView& hv, Acc (&s)[MI][NP][4], int r0, int jt0,
                                         int t, int j_end, bool check_band, bool select, bool mask,
                                         const Ops& ops) const {
        values(hv, s, r0, jt0, t, ops);
        if ((M & kModMask) != 0 && mask) {
            each_pair(s, [&](Acc& x, Acc& y, int dr, int dc) {
                const unsigned kept = ops.mask_pair(dr, dc);
                x = kept & 1u ? x : neg_inf<Acc>();
                y = kept & 2u ? y : neg_inf<Acc>();
            });
        }
        if (!select) return;
        auto inside = [&](int i, int j) { return (i < hv.q_len) & (j < j_end); };
        const Band in_band(p, hv);
        if ((M & kModBlockMask) != 0 && mask) {
            each_element(s, r0, jt0, t, [&](Acc& x, int i, int j) {
                x = inside(i, j) && block_unmasked(p, i, j) ? x : neg_inf<Acc>();
            });
        }
        if (check_band) {
            each_element(s, r0, jt0, t, [&](Acc& x, int i, int j) { x = inside(i, j) & in_band(i, j) ? x : neg_inf<Acc>(); });
        } else {
            each_element(s, r0, jt0, t, [&](Acc& x, int i, int j) { x = inside(i, j) ? x : neg_inf<Acc>(); });
        }
    }
};

}  // namespace flash
