// float32 on Hopper's TF32 warpgroup products, three per product (3xTF32).
#pragma once

#include "tf32.cuh"
#include "wgmma.cuh"

namespace flash {

#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)

// float32 on Hopper (sm_90a) as three TF32 warpgroup products per product (3xTF32 with
// Tf32Frag's split, float32 accuracy), for the plain forward (flash_fwd.cu's
// produce_tf32x3 and forward_wgmma_tf32x3; one consumer warpgroup, 64 rows). TF32 operands
// in shared memory must be K-major: Q and K are (the head dim contiguous), V is not, so each
// V tile is rewritten as V^T (DV, keys). A producer warpgroup splits every shared-memory
// operand once per tile into hi and lo tiles (RowSplit, ColSplit), instead of every warp per
// fragment as mma.sync's MmaTf32 does; P is split in
// registers into m16n8k8 A fragments per warp, its keys permuted inside each 8-key step
// (column t is key 2t, column t + 4 key 2t + 1: no shuffle), and V^T stores its keys in
// that order.
struct MmaWgmmaTf32x3 {
    static constexpr bool WARPGROUP = true;
    using Acc = float;
    static constexpr int MI = 1;
    template <int KEYS> using PSplit = u32[KEYS / 8][4];  // P's hi or lo A fragments, one per 8 keys

    // Rows [0, ROWS) of a (rows, cols) global float matrix (row stride `stride` elements),
    // zero outside (valid_rows, valid_cols), split into hi and lo Sw128 tiles by the producer
    // warpgroup's THREADS threads: `copy` lands the rows as they are in the hi tile
    // (Sw128Tile::load's cp.async, one group per call site), `split` (once they have landed)
    // rewrites them in place as hi and writes lo (tf32_split_chunks: thread `tid` splits the
    // chunks it copied, so it waits for its own copies only).
    template <int ROWS, int COLS, int THREADS>
    struct RowSplit {
        using Tile = Sw128Tile<float, ROWS, COLS>;

        static __device__ __forceinline__ void copy(float* sHi, const float* g, i64 stride, int valid_rows,
                                                    int valid_cols, int tid) {
            Tile::template load<THREADS>(sHi, g, stride, valid_rows, valid_cols, tid);
        }
        static __device__ __forceinline__ void split(float* sHi, float* sLo, int tid) {
            tf32_split_chunks<ROWS, COLS / 4, THREADS>(sHi, sLo, [](int r, int c) { return Tile::chunk_offset(r, c); },
                                                       tid);
        }
    };

    // V (KEYS, DV) of a global float matrix (row stride `stride`), zero outside (valid_rows,
    // valid_cols), as V^T (DV, KEYS) split into hi and lo Sw128 tiles, each 8-key step in P's
    // column order: 16-byte chunk q of row d holds keys key(q, m) = 8 (q / 2) + q % 2 + 2 m,
    // m = 0..3. `copy` lands V as it is in a staging tile (RAW_ELEMS, cp.async), `transpose`
    // (once it has landed) writes V^T. Thread `tid` owns chunk q = tid % QC of the rows d
    // in 4-column blocks b = tid / QC + BLOCKS u: it copies the 16-byte chunks b of its 4 keys,
    // and writes the 4 transposed chunks. A warp's copies read 64 contiguous bytes of 8 key
    // rows; the staging tile stores chunk c of key row j at chunk c ^ f(j), with f(j) =
    // (j / 8) % 4 + 4 (j % 2), distinct for the 8 keys key(0..7, m), so that a quarter warp's
    // copies and reads hit distinct banks, as do its V^T stores (8 chunks of one row d).
    template <int KEYS, int DV, int THREADS>
    struct ColSplit {
        static constexpr int QC = KEYS / 4, BLOCKS = THREADS / QC, UNITS = DV / 4 / BLOCKS;
        static constexpr int RAW_ELEMS = KEYS * DV;
        static_assert(THREADS % QC == 0 && (DV / 4) % BLOCKS == 0 && KEYS <= 32, "whole column blocks for every thread");

        static __device__ __forceinline__ int key(int q, int m) { return 8 * (q >> 1) + (q & 1) + 2 * m; }
        static __device__ __forceinline__ int raw_offset(int j, int c) {  // bytes
            return j * (DV * 4) + ((c ^ (((j >> 3) & 3) | (j & 1) << 2)) << 4);
        }

        static __device__ __forceinline__ void copy(float* sRaw, const float* g, i64 stride, int valid_rows,
                                                    int valid_cols, int tid) {
            unsigned char* raw = reinterpret_cast<unsigned char*>(sRaw);
            const int q = tid % QC, b = tid / QC;
            const float* src = g + key(q, 0) * stride + 4 * b;
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const bool row_valid = key(q, m) < valid_rows;
#pragma unroll
                for (int u = 0; u < UNITS; ++u) {
                    const int c = b + BLOCKS * u;
                    const bool valid = row_valid && 4 * c < valid_cols;
                    cp_async_16(raw + raw_offset(key(q, m), c), valid ? src + 4 * BLOCKS * u : g, valid);
                }
                src += 2 * stride;
            }
        }
        static __device__ __forceinline__ void transpose(const float* sRaw, float* sHi, float* sLo, int tid) {
            const unsigned char* raw = reinterpret_cast<const unsigned char*>(sRaw);
            unsigned char* hi = reinterpret_cast<unsigned char*>(sHi);
            unsigned char* lo = reinterpret_cast<unsigned char*>(sLo);
            const int q = tid % QC, b = tid / QC;
            float4 x[UNITS][4];  // columns 4 c .. 4 c + 3 of key(q, m); every read before the stores
#pragma unroll
            for (int u = 0; u < UNITS; ++u)
#pragma unroll
                for (int m = 0; m < 4; ++m)
                    x[u][m] = *reinterpret_cast<const float4*>(raw + raw_offset(key(q, m), b + BLOCKS * u));
#pragma unroll
            for (int u = 0; u < UNITS; ++u) {
                const int c = b + BLOCKS * u;
#pragma unroll
                for (int i = 0; i < 4; ++i) {  // row d = 4 c + i of V^T
                    auto col = [&](int m) { return reinterpret_cast<const float*>(&x[u][m])[i]; };
                    const int at = Sw128Tile<float, DV, KEYS>::chunk_offset(4 * c + i, q);
                    tf32_split_store(hi + at, lo + at, col(0), col(1), col(2), col(3));
                }
            }
        }
    };

    // S (16 per warp, N) = Q K^T for the block's one warpgroup: Q (64, HD) and K (N, HD) as
    // hi and lo Sw128 tiles. Per 8-wide k-step the small cross terms first, as MmaTf32; the
    // first product overwrites S, which needs no zeroing.
    template <int HD, int N>
    static __device__ __forceinline__ void qk_issue(const float* sQh, const float* sQl, const float* sKh,
                                                    const float* sKl, float (&s)[1][N / 8][4]) {
        const Sw128Desc qh(smem_addr(sQh)), ql(smem_addr(sQl)), kh(smem_addr(sKh)), kl(smem_addr(sKl));
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < HD / 8; ++kk) {  // slab kk / 4, 32 bytes per k-step inside it
            const u32 q_off = (kk / 4) * (64 * 128) + (kk % 4) * 32, k_off = (kk / 4) * (N * 128) + (kk % 4) * 32;
            if (kk == 0) {
                WgmmaTf32<N>::template ss<false>(s[0], ql.at(q_off), kh.at(k_off));
            } else {
                WgmmaTf32<N>::template ss<true>(s[0], ql.at(q_off), kh.at(k_off));
            }
            WgmmaTf32<N>::template ss<true>(s[0], qh.at(q_off), kl.at(k_off));
            WgmmaTf32<N>::template ss<true>(s[0], qh.at(q_off), kh.at(k_off));
        }
        wgmma_commit();
    }

    // P (16 per warp, KEYS) in the accumulator layout -> its hi and lo A fragments.
    template <int KEYS>
    static __device__ __forceinline__ void split_p(const float (&s)[1][KEYS / 8][4], PSplit<KEYS>& ph, PSplit<KEYS>& pl) {
#pragma unroll
        for (int kk = 0; kk < KEYS / 8; ++kk)
#pragma unroll
            for (int e = 0; e < 4; ++e)  // A (g, t), (g + 8, t), (g, t + 4), (g + 8, t + 4): keys 2t and 2t + 1
                tf32_split(s[0][kk][(e >> 1) | (e & 1) << 1], ph[kk][e], pl[kk][e]);
    }

    // D (16 per warp, DV) = P V with P as hi and lo fragments and V^T (DV, KEYS) as hi and lo
    // Sw128 tiles; the first product overwrites D (a per-tile sum, see forward_wgmma_tf32x3).
    template <int KEYS, int DV>
    static __device__ __forceinline__ void pv_issue(const PSplit<KEYS>& ph, const PSplit<KEYS>& pl, const float* sVh,
                                                    const float* sVl, float (&d)[1][DV / 8][4]) {
        const Sw128Desc vh(smem_addr(sVh)), vl(smem_addr(sVl));
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KEYS / 8; ++kk) {
            const u32 off = (kk / 4) * (DV * 128) + (kk % 4) * 32;
            if (kk == 0) {
                WgmmaTf32<DV>::template rs<false>(d[0], pl[kk], vh.at(off));
            } else {
                WgmmaTf32<DV>::template rs<true>(d[0], pl[kk], vh.at(off));
            }
            WgmmaTf32<DV>::template rs<true>(d[0], ph[kk], vl.at(off));
            WgmmaTf32<DV>::template rs<true>(d[0], ph[kk], vh.at(off));
        }
        wgmma_commit();
    }
};

#endif  // sm_90a

}  // namespace flash
