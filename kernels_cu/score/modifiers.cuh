// The score options of docs/semantics.md, shared by every attention kernel:
//   s = scale * q.k -> softcap -> + bias + ALiBi -> -inf where any mask says no,
// plus the per-tile test that lets a kernel skip key tiles no score survives in.
#pragma once

#include "../mma/common.cuh"
#include "band.cuh"

namespace flash {

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
    // from raw = q.k. check_band: the tile crosses a causal/window edge, compare per element
    // with the band's bounds `band` (Band(p, hv), built by the caller: per score, the
    // compiler hoists what it can).
    __device__ __forceinline__ Acc operator()(const Params& p, const HeadView& hv, Acc raw, int i, int j,
                                              bool check_band, const Band& band) const {
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
        bool keep = !check_band | band(i, j);
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

    // operator() on a whole (16 MI, 8 NP) accumulator tile of S = Q K^T (mma/common.cuh's
    // layout: rows r0 + 8 x for x = 2 mi + (e >> 1), keys jt0 + 8 n + 2 t + (e & 1)), rows
    // from q_len and keys from j_end masked. One pass over the tile per option present, with
    // the option's test outside the pass: tested element by element, the options' branches
    // cost far more than their arithmetic (bench/NOTES.md, 'Forward: score options one pass
    // each').
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
