// Where a (row, key) may attend: each head's lengths and offsets (HeadView), the causal and
// window band (key_range for whole blocks, tile_inside_band for tiles, Band and TileBand for
// single scores) of docs/semantics.md.
#pragma once

#include "../numeric.cuh"

namespace flash {

// Per-(batch, head) view of a problem: lengths, offsets and the diagonal.
struct HeadView {
    i32 b, h, bh;            // bh: flat (batch, query head) index, Philox counter word 2
    i32 q_len, kv_len;       // valid rows and keys of this batch element
    i32 q_start, k_start;    // first packed row/key (0 when padded)
    i32 diagonal;            // kv_len - q_len: column i + diagonal aligns with row i
};

__device__ __forceinline__ HeadView head_view(const Params& p, i32 bh) {
    HeadView hv;
    hv.bh = bh;
    hv.b = bh / p.hq;
    hv.h = bh - hv.b * p.hq;
    if (p.cu_seqlens_q != nullptr) {
        hv.q_start = p.cu_seqlens_q[hv.b];
        hv.k_start = p.cu_seqlens_k[hv.b];
        hv.q_len = p.cu_seqlens_q[hv.b + 1] - hv.q_start;
        hv.kv_len = p.cu_seqlens_k[hv.b + 1] - hv.k_start;
    } else {
        hv.q_start = hv.k_start = 0;
        hv.q_len = p.seqlens_q != nullptr ? p.seqlens_q[hv.b] : p.lq;
        hv.kv_len = p.seqlens_k != nullptr ? p.seqlens_k[hv.b] : p.lk;
    }
    hv.diagonal = hv.kv_len - hv.q_len;
    return hv;
}

// Keys [lo, hi) that some row of [i0, i1) may attend under causal and window.
__device__ __forceinline__ void key_range(const Params& p, const HeadView& hv, int i0, int i1, int& lo, int& hi) {
    lo = 0;
    hi = hv.kv_len;
    if (p.causal != kNoCausal) hi = min(hi, i1 + (p.causal == kTopLeft ? 0 : hv.diagonal));
    if (p.window_left >= 0) lo = max(lo, i0 + hv.diagonal - p.window_left);
    if (p.window_right >= 0) hi = min(hi, i1 + hv.diagonal + p.window_right);
    hi = max(hi, 0);
    lo = min(max(lo, 0), hi);
}

// True when every score of tile [i0, i1) x [j0, j1) passes causal and window, so the
// kernel can skip the per-element comparisons.
__device__ __forceinline__ bool tile_inside_band(const Params& p, const HeadView& hv, int i0, int i1, int j0, int j1) {
    if (p.causal != kNoCausal && j1 - 1 > i0 + (p.causal == kTopLeft ? 0 : hv.diagonal)) return false;
    if (p.window_left >= 0 && j0 < i1 - 1 + hv.diagonal - p.window_left) return false;
    if (p.window_right >= 0 && j1 - 1 > i0 + hv.diagonal + p.window_right) return false;
    return true;
}

// Does (i, j) pass causal and window? The band test written with a uniform branch per
// option and element (32-bit sums: exact for Lq + Lk < 2^31, the window sides clamped to
// Lk and Lq as problem.py clamps them): slow on masked tiles (ptxas cannot interleave the
// elements) but light on registers, for the kernels that have none to spare (TileBand<true>).
__device__ __forceinline__ bool in_band_sequential(const Params& p, const HeadView& hv, int i, int j) {
    bool keep = true;
    if (p.causal != kNoCausal) keep &= j <= i + (p.causal == kTopLeft ? 0 : hv.diagonal);
    if (p.window_left >= 0) keep &= j >= i + hv.diagonal - p.window_left;
    if (p.window_right >= 0) keep &= j <= i + hv.diagonal + p.window_right;
    return keep;
}

// The causal and window band as bounds on the key-query offset: score (query i, key j)
// passes when lo <= j - i <= hi (causal: j - i <= 0 top-left or <= diagonal bottom-right;
// window (left, right): diagonal - left <= j - i <= diagonal + right). Built outside the
// element loops (once per tile; ScoreOp's per-score operator relies on the compiler to
// hoist it), so a score costs two comparisons and no branch: a per-element test of each
// option (uniform branches) splits the unrolled tile loops into blocks ptxas cannot
// interleave, and a masked tile then costs more than two full ones (bench/NOTES.md, 'Masked
// tiles: the band without branches'). Bounds an option does not set are the int range's
// ends; sums are formed in 64 bits and clamped.
struct Band {
    i32 lo, hi;
    __device__ __forceinline__ Band(const Params& p, const HeadView& hv) {
        constexpr i64 kMax = 2147483647LL, kMin = -kMax - 1;
        const i64 causal_hi = p.causal == kNoCausal ? kMax : p.causal == kTopLeft ? 0 : hv.diagonal;
        const i64 right_hi = p.window_right < 0 ? kMax : static_cast<i64>(hv.diagonal) + p.window_right;
        const i64 left_lo = p.window_left < 0 ? kMin : static_cast<i64>(hv.diagonal) - p.window_left;
        hi = static_cast<i32>(min(min(causal_hi, right_hi), kMax));
        lo = static_cast<i32>(max(left_lo, kMin));
    }
    // Does (i, j) pass causal and window? (j - i cannot overflow: both are in [0, 2^31).)
    __device__ __forceinline__ bool operator()(int i, int j) const {
        const int d = j - i;
        return (d >= lo) & (d <= hi);
    }
};

// A masked tile's per-score test in the plain kernels: inside the lengths and the band.
// Band's branch-free form by default; SEQUENTIAL, for the kernels without registers to spare
// for the interleaving it allows (flash_fwd.cu and flash_bwd.cu name them, kSequentialMask),
// in_band_sequential behind `&&`, skipped where the tile crosses no band edge (`crosses`).
template <bool SEQUENTIAL>
struct TileBand {
    const Params& p;
    const HeadView& hv;
    bool crosses;
    Band band;
    __device__ __forceinline__ TileBand(const Params& p_, const HeadView& hv_, bool crosses_)
        : p(p_), hv(hv_), crosses(crosses_), band(p_, hv_) {}
    // Does score (i, j) survive, given whether it lies inside the lengths?
    __device__ __forceinline__ bool operator()(bool inside, int i, int j) const {
        if constexpr (SEQUENTIAL)
            return inside && (!crosses || in_band_sequential(p, hv, i, j));
        else
            return inside & band(i, j);
    }
};

}  // namespace flash
