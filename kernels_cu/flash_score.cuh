// The score pipeline of design.md section 2, shared by every attention kernel:
//   s = scale * q.k -> softcap -> + bias + ALiBi -> -inf where any mask says no,
// plus the per-tile tests that let a kernel skip key tiles no score survives in.
//
// Scores are kept in the log2 domain (multiplied by log2(e)) so that the softmax
// can use exp2; -inf is exact in both domains.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "flash_params.cuh"

namespace flash {

constexpr double kLog2e = 1.4426950408889634073599246810018921;
// -infinity, the score of a masked (row, key): exp2(-inf) is exactly 0 and max() keeps it.
template <typename Acc> __device__ __forceinline__ Acc neg_inf();
template <> __device__ __forceinline__ float neg_inf<float>() { return __int_as_float(0xff800000u); }
template <> __device__ __forceinline__ double neg_inf<double>() { return __longlong_as_double(0xfff0000000000000ull); }

// A value in its accumulator type: float16 and bfloat16 widen to float, float and double stay.
__device__ __forceinline__ float widen(__half x) { return __half2float(x); }
__device__ __forceinline__ float widen(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float widen(float x) { return x; }
__device__ __forceinline__ double widen(double x) { return x; }

template <typename Acc> __device__ __forceinline__ Acc load_as(const void* p, i64 index, i32 dtype) {
    switch (dtype) {
        case kF16: return static_cast<Acc>(__half2float(static_cast<const __half*>(p)[index]));
        case kBF16: return static_cast<Acc>(__bfloat162float(static_cast<const __nv_bfloat16*>(p)[index]));
        case kF32: return static_cast<Acc>(static_cast<const float*>(p)[index]);
        default: return static_cast<Acc>(static_cast<const double*>(p)[index]);
    }
}

// exp2 of a score already reduced by its row's maximum or log-sum-exp (x <= 0 up to
// rounding): one MUFU.EX2 (ex2.approx.ftz, ~2 ulp) instead of exp2f's denormal handling
// (a compare and two predicated multiplies around it). Results below 2^-126 flush to 0, far
// under any tolerance on a probability, and exp2(-inf) = 0.
__device__ __forceinline__ float softmax_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ double softmax_exp2(double x) { return exp2(x); }
__device__ __forceinline__ float tanh_acc(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_acc(double x) { return tanh(x); }
__device__ __forceinline__ float log_acc(float x) { return logf(x); }
__device__ __forceinline__ double log_acc(double x) { return log(x); }

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
// option (uniform branches) split the unrolled tile loops into blocks ptxas could not
// interleave, and the backward's diagonal tile took 2.6 times a full tile (H100 per-block
// trace, bench/NOTES.md). Bounds an option does not set are the int range's ends; sums are
// formed in 64 bits and clamped.
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

// Does some score of tile [i0, i1) x [j0, j1) survive block_mask and mask? Called by every
// thread of the block (it ends in a barrier); the caller then skips the tile entirely.
__device__ __forceinline__ bool tile_live(const Params& p, const HeadView& hv, int i0, int i1, int j0, int j1) {
    bool live = true;
    if (p.block_mask != nullptr) {
        const int bs = p.block_size;
        const int bi0 = i0 / bs, bi1 = (i1 - 1) / bs, bj0 = j0 / bs, bj1 = (j1 - 1) / bs;
        const int nbj = bj1 - bj0 + 1;
        const int count = (bi1 - bi0 + 1) * nbj;
        const bool* base = p.block_mask + hv.b * p.bm_sb + hv.h * p.bm_sh;
        bool any = false;
        for (int t = threadIdx.x; t < count; t += blockDim.x) {
            const int bi = bi0 + t / nbj, bj = bj0 + t % nbj;
            any |= base[bi * p.bm_si + bj * p.bm_sj];
        }
        live = __syncthreads_or(any) != 0;
    }
    if (live && p.mask != nullptr) {
        const int cols = j1 - j0;
        const int count = (i1 - i0) * cols;
        const bool* base = p.mask + hv.b * p.mask_sb + hv.h * p.mask_sh;
        bool any = false;
        for (int t = threadIdx.x; t < count && !any; t += blockDim.x) {
            const int i = i0 + t / cols, j = j0 + t % cols;
            any |= base[i * p.mask_si + j * p.mask_sj];
        }
        live = __syncthreads_or(any) != 0;
    }
    return live;
}

// f(x, y..., i, j) on each element of one or more (16 MI, 8 NP) accumulator tiles in
// flash_mma.cuh's layout: x, y... the tiles' elements at row i = r0 + 16 mi + 8 (e >> 1)
// and column j = jt0 + 8 n + 2 t + (e & 1).
template <typename Acc, int MI, int NP, typename F, typename... More>
__device__ __forceinline__ void each_element(Acc (&s)[MI][NP][4], int r0, int jt0, int t, F f, More&... more) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int n = 0; n < NP; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                f(s[mi][n][e], more[mi][n][e]..., r0 + 16 * mi + 8 * (e >> 1), jt0 + 8 * n + 2 * t + (e & 1));
}

// Everything a thread needs to turn raw products q.k into log2-domain scores.
template <typename Acc>
struct ScoreOp {
    Acc scale_log2;      // scale * log2(e) (no softcap)
    Acc scale;           // scale (softcap)
    Acc softcap, inv_softcap;
    Acc slope_log2;      // ALiBi slope * log2(e), 0 without ALiBi
    const void* bias;    // this head's bias, or nullptr
    const bool* mask;    // this head's mask, or nullptr
    const bool* block_mask;

    __device__ __forceinline__ ScoreOp(const Params& p, const HeadView& hv) {
        scale = static_cast<Acc>(p.scale);
        scale_log2 = static_cast<Acc>(p.scale * kLog2e);
        softcap = static_cast<Acc>(p.softcap);
        inv_softcap = p.has_softcap ? static_cast<Acc>(1.0 / p.softcap) : Acc(0);
        slope_log2 = p.alibi != nullptr
            ? static_cast<Acc>(p.alibi[hv.b * p.alibi_sb + hv.h * p.alibi_sh] * kLog2e) : Acc(0);
        bias = p.bias != nullptr
            ? static_cast<const void*>(static_cast<const char*>(p.bias)
                                       + (hv.b * p.bias_sb + hv.h * p.bias_sh) * elem_size(p.bias_dtype))
            : nullptr;
        mask = p.mask != nullptr ? p.mask + hv.b * p.mask_sb + hv.h * p.mask_sh : nullptr;
        block_mask = p.block_mask != nullptr ? p.block_mask + hv.b * p.bm_sb + hv.h * p.bm_sh : nullptr;
    }

    static __device__ __forceinline__ i64 elem_size(i32 dtype) {
        return dtype == kF64 ? 8 : dtype == kF32 ? 4 : 2;
    }

    // The log2-domain score of row i < q_len, key j < kv_len (positions inside the sequence)
    // from raw = q.k. check_band: the tile crosses a causal/window edge, compare per element.
    __device__ __forceinline__ Acc operator()(const Params& p, const HeadView& hv, Acc raw, int i, int j,
                                              bool check_band) const {
        Acc s;
        if (p.has_softcap) {
            s = softcap * tanh_acc(raw * scale * inv_softcap) * static_cast<Acc>(kLog2e);  // s = c tanh(s / c)
        } else {
            s = raw * scale_log2;
        }
        if (bias != nullptr) s += load_as<Acc>(bias, i * p.bias_si + j * p.bias_sj, p.bias_dtype) * static_cast<Acc>(kLog2e);
        if (p.alibi != nullptr) {
            const int dist = abs(i + hv.diagonal - j);  // s -= slope * |i + Lk - Lq - j|
            s -= slope_log2 * static_cast<Acc>(dist);
        }
        bool keep = !check_band | Band(p, hv)(i, j);
        if (mask != nullptr) keep &= mask[i * p.mask_si + j * p.mask_sj];
        if (block_mask != nullptr) keep &= block_mask[(i / p.block_size) * p.bm_si + (j / p.block_size) * p.bm_sj];
        return keep ? s : neg_inf<Acc>();
    }

    // tile's bias pass for a bias of element type B: s += bias * log2(e) inside (q_len, j_end).
    template <typename B, int MI, int NP>
    __device__ __forceinline__ void add_bias(const Params& p, const HeadView& hv, Acc (&s)[MI][NP][4], int r0, int jt0,
                                             int t, int j_end) const {
        const B* b = static_cast<const B*>(bias);
        each_element(s, r0, jt0, t, [&](Acc& x, int i, int j) {
            x += i < hv.q_len && j < j_end ? static_cast<Acc>(widen(b[i * p.bias_si + j * p.bias_sj])) * static_cast<Acc>(kLog2e)
                                           : Acc(0);
        });
    }

    // operator() on a whole (16 MI, 8 NP) accumulator tile of S = Q K^T (flash_mma.cuh's
    // layout: rows r0 + 8 x for x = 2 mi + (e >> 1), keys jt0 + 8 n + 2 t + (e & 1)), rows
    // from q_len and keys from j_end masked. One pass over the tile per option present, with
    // the option's test outside the pass: element by element, the tests and their branches
    // made these tiles about ten times slower than the plain ones (H100, bench/NOTES.md).
    // Bias and mask are read only inside (q_len, j_end).
    template <int MI, int NP>
    __device__ __forceinline__ void tile(const Params& p, const HeadView& hv, Acc (&s)[MI][NP][4], int r0, int jt0,
                                         int t, int j_end, bool check_band) const {
        const Acc log2e = static_cast<Acc>(kLog2e);
        auto inside = [&](int i, int j) { return (i < hv.q_len) & (j < j_end); };
        const Band in_band(p, hv);
        if (p.has_softcap) {
            each_element(s, r0, jt0, t, [&](Acc& x, int, int) { x = softcap * tanh_acc(x * scale * inv_softcap) * log2e; });
        } else {
            each_element(s, r0, jt0, t, [&](Acc& x, int, int) { x *= scale_log2; });
        }
        if (bias != nullptr) {
            // float64: one pass reading through load_as (four copies of the pass spill there).
            if constexpr (sizeof(Acc) == 8) {
                each_element(s, r0, jt0, t, [&](Acc& x, int i, int j) {
                    x += inside(i, j) ? load_as<Acc>(bias, i * p.bias_si + j * p.bias_sj, p.bias_dtype) * log2e : Acc(0);
                });
            } else {
                switch (p.bias_dtype) {
                    case kF16: add_bias<__half>(p, hv, s, r0, jt0, t, j_end); break;
                    case kBF16: add_bias<__nv_bfloat16>(p, hv, s, r0, jt0, t, j_end); break;
                    case kF32: add_bias<float>(p, hv, s, r0, jt0, t, j_end); break;
                    default: add_bias<double>(p, hv, s, r0, jt0, t, j_end); break;
                }
            }
        }
        if (p.alibi != nullptr) {  // s -= slope * |i + Lk - Lq - j|
            each_element(s, r0, jt0, t, [&](Acc& x, int i, int j) { x -= slope_log2 * static_cast<Acc>(abs(i + hv.diagonal - j)); });
        }
        if (mask != nullptr || block_mask != nullptr) {
            each_element(s, r0, jt0, t, [&](Acc& x, int i, int j) {
                bool keep = inside(i, j) & (!check_band | in_band(i, j));
                if (mask != nullptr) keep = keep && mask[i * p.mask_si + j * p.mask_sj];
                if (block_mask != nullptr)
                    keep = keep && block_mask[(i / p.block_size) * p.bm_si + (j / p.block_size) * p.bm_sj];
                x = keep ? x : neg_inf<Acc>();
            });
        } else if (check_band) {
            each_element(s, r0, jt0, t, [&](Acc& x, int i, int j) { x = inside(i, j) & in_band(i, j) ? x : neg_inf<Acc>(); });
        } else {
            each_element(s, r0, jt0, t, [&](Acc& x, int i, int j) { x = inside(i, j) ? x : neg_inf<Acc>(); });
        }
    }
};

}  // namespace flash
