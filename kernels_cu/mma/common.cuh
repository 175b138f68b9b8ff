// Warp-level products for the attention kernels, one policy per number format.
//
// Every policy computes a warp's 16 MI query rows (MI row groups of 16) against a tile of
// keys and leaves the result in the same register layout, the accumulator layout of
// mma.sync m16n8: lane = 4 g + t holds, for row group mi and each 8-column tile n,
//     acc[mi][n][0] = (row 16 mi + g,     col 8n + 2t)   acc[mi][n][1] = (row 16 mi + g,     col 8n + 2t + 1)
//     acc[mi][n][2] = (row 16 mi + g + 8, col 8n + 2t)   acc[mi][n][3] = (row 16 mi + g + 8, col 8n + 2t + 1)
// so masking, the online softmax and the epilogue are written once for all of them.
// Two row groups per warp (MI = 2) let every K and V fragment read from shared memory
// feed two products instead of one.
//
//   qk: S (16 MI, BN) += Q_w (16 MI, HD) K^T,  Q_w and K (BN, HD) row-major in shared memory
//       (K_UNROLL: k-steps unrolled, where the policy's loop has a choice; 0 its default)
//   pack_p: P (the softmax numerators, in the layout above) -> the policy's A operand PFrag
//   store_p / load_pt: a PFrag to shared memory (PElem), and an A operand read transposed
//                      from there (the backward's dQ = dS K with dS stored key-major)
//   pv: O (16 MI, DV) += P (16 MI, BN) V,      P as PFrag, V (BN, DV) in shared memory
// Packing happens before the block's barrier, so only the (narrower) PFrag stays live.
//
// Each number format's policy lives in its own header (simt.cuh, f16.cuh, tf32.cuh, f64.cuh,
// and Hopper's warpgroup products in wgmma.cuh and wgmma_tf32x3.cuh); warp.cuh includes the
// warp policies. This header holds what they share.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "../numeric.cuh"

namespace flash {

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// The value of (row g [+8], col c) of P held by another lane of the quad, as the
// layout above stores it: column c of tile n lives in lane 4 g + (c % 8) / 2.
template <typename Acc>
__device__ __forceinline__ Acc quad_fetch(const Acc (&tile)[4], int upper, int col_in_tile) {
    const int lane = threadIdx.x & 31;
    const int src = (lane & ~3) | ((col_in_tile & 7) >> 1);
    const Acc even = __shfl_sync(0xffffffffu, tile[2 * upper], src);
    const Acc odd = __shfl_sync(0xffffffffu, tile[2 * upper + 1], src);
    return (col_in_tile & 1) ? odd : even;
}

// Zeroes MI row groups of N (16, 8) accumulator tiles.
template <typename Acc, int MI, int N>
__device__ __forceinline__ void zero_acc(Acc (&acc)[MI][N][4]) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int n = 0; n < N; ++n) acc[mi][n][0] = acc[mi][n][1] = acc[mi][n][2] = acc[mi][n][3] = Acc(0);
}

// Policies whose second product reads P in the accumulator layout itself, for MI row groups
// (store_p and load_pt, used with one).
template <typename Acc, int MI = 1>
struct PassP {
    static constexpr bool WARPGROUP = false;  // products per warp (see flash_wgmma.cuh)
    static constexpr int PV_N = 8;  // pv's output width comes in multiples of this
    using PElem = Acc;  // element of a P fragment parked in shared memory
    template <int BN> using PFrag = Acc[MI][BN / 8][4];
    template <int BN>
    static __device__ __forceinline__ void pack_p(const Acc (&s)[MI][BN / 8][4], Acc (&pf)[MI][BN / 8][4]) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int n = 0; n < BN / 8; ++n)
#pragma unroll
                for (int e = 0; e < 4; ++e) pf[mi][n][e] = s[mi][n][e];
    }

    // The warp's fragment (16, BN) to shared memory, row-major with row pitch LDS.
    template <int BN, int LDS>
    static __device__ __forceinline__ void store_p(const Acc (&pf)[1][BN / 8][4], Acc* sP) {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int n = 0; n < BN / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) sP[(g + 8 * (e >> 1)) * LDS + 8 * n + 2 * t + (e & 1)] = pf[0][n][e];
    }

    // The A fragment (16, K) of A = M^T, where M (K, 16) is row-major in shared memory with
    // row pitch LDA: a product's left operand stored transposed.
    template <int K, int LDA>
    static __device__ __forceinline__ void load_pt(const Acc* sM, Acc (&pf)[1][K / 8][4]) {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int n = 0; n < K / 8; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) pf[0][n][e] = sM[(8 * n + 2 * t + (e & 1)) * LDA + g + 8 * (e >> 1)];
    }
};

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

// f(x, y, dr, dc) on each pair of neighbouring elements of one or more (16 MI, 8 NP)
// accumulator tiles: x and y are elements 2 h and 2 h + 1 of tile (mi, n), the thread's row
// r0 + dr and keys jt0 + dc + 2 t and the next (dr = 16 mi + 8 h, dc = 8 n, both constants
// once unrolled), for reads of pairs beside them.
template <typename Acc, int MI, int NP, typename F>
__device__ __forceinline__ void each_pair(Acc (&s)[MI][NP][4], F f) {
#pragma unroll
    for (int mi = 0; mi < MI; ++mi)
#pragma unroll
        for (int n = 0; n < NP; ++n)
#pragma unroll
            for (int h = 0; h < 2; ++h) f(s[mi][n][2 * h], s[mi][n][2 * h + 1], 16 * mi + 8 * h, 8 * n);
}

// Whether a policy is 3xTF32 (MmaTf32<true, MI>, sm_80+): split fragments, the tightest registers.
template <typename Policy> constexpr bool kSplitTf32 = false;

// Whether a policy is SIMT (Simt<T, Acc>: the portable kernels, with or without cp.async).
template <typename Policy> constexpr bool kSimt = false;

}  // namespace flash
