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
// MmaF16   float16/bfloat16 on tensor cores: mma.sync m16n8k16 fed by ldmatrix (sm_80+)
// MmaTf32  float32 on TF32 tensor cores: mma.sync m16n8k8 (sm_80+), three products per
//          product (3xTF32, float32 accuracy) or, with allow_tf32, one
// MmaF64   float64 on FP64 tensor cores: mma.sync m16n8k8 and m16n8k16 (sm_90; as m8n8k4 before)
// Simt     any dtype with FMA in the accumulator type (every architecture)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "flash_score.cuh"

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

// ------------------------------------------------------------------ SIMT (portable)
template <typename T, typename AccT>
struct Simt : PassP<AccT> {
    using Acc = AccT;
    using One = Simt;
    static constexpr int MI = 1;

    template <int HD, int BN, int LDQ, int LDK, int K_UNROLL = 0>
    static __device__ __forceinline__ void qk(const T* sQw, const T* sK, Acc (&s_)[1][BN / 8][4]) {
        Acc(&s)[BN / 8][4] = s_[0];
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll 4
        for (int k = 0; k < HD; ++k) {
            const Acc q0 = static_cast<Acc>(widen(sQw[g * LDQ + k]));
            const Acc q1 = static_cast<Acc>(widen(sQw[(g + 8) * LDQ + k]));
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                const Acc k0 = static_cast<Acc>(widen(sK[(8 * n + 2 * t) * LDK + k]));
                const Acc k1 = static_cast<Acc>(widen(sK[(8 * n + 2 * t + 1) * LDK + k]));
                s[n][0] += q0 * k0;
                s[n][1] += q0 * k1;
                s[n][2] += q1 * k0;
                s[n][3] += q1 * k1;
            }
        }
    }

    template <int BN, int DV, int LDV>
    static __device__ __forceinline__ void pv(const Acc (&p_)[1][BN / 8][4], const T* sV, Acc (&o_)[1][DV / 8][4]) {
        const Acc(&p)[BN / 8][4] = p_[0];
        Acc(&o)[DV / 8][4] = o_[0];
        const int lane = threadIdx.x & 31, t = lane & 3;
#pragma unroll
        for (int j = 0; j < BN; ++j) {
            const Acc p0 = quad_fetch(p[j / 8], 0, j);  // P[g][j]
            const Acc p1 = quad_fetch(p[j / 8], 1, j);  // P[g + 8][j]
#pragma unroll
            for (int n = 0; n < DV / 8; ++n) {
                const Acc v0 = static_cast<Acc>(widen(sV[j * LDV + 8 * n + 2 * t]));
                const Acc v1 = static_cast<Acc>(widen(sV[j * LDV + 8 * n + 2 * t + 1]));
                o[n][0] += p0 * v0;
                o[n][1] += p0 * v1;
                o[n][2] += p1 * v0;
                o[n][3] += p1 * v1;
            }
        }
    }

};

// Whether a policy is 3xTF32 (MmaTf32<true, MI>, sm_80+): split fragments, the tightest registers.
template <typename Policy> constexpr bool kSplitTf32 = false;

// Declared for every architecture, so that kernels can name it in branches only 3xTF32
// policies take; defined below with them (sm_80+).
template <int ROWS, int CHUNKS, int THREADS, typename Offset>
__device__ __forceinline__ void tf32_split_chunks(float* hi, float* lo, Offset offset, u32 tid = threadIdx.x);

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

// ------------------------------------------------------------------ float16 / bfloat16
template <typename T> struct MmaF16Types;
template <> struct MmaF16Types<__half> {
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        const __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<const u32*>(&h);
    }
    static __device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};
template <> struct MmaF16Types<__nv_bfloat16> {
    static __device__ __forceinline__ u32 pack(float lo, float hi) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<const u32*>(&h);
    }
    static __device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
};

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}

template <typename T, int MI_>
struct MmaF16 {
    using Acc = float;
    static constexpr int MI = MI_;
    static constexpr bool WARPGROUP = false;

    template <int HD, int BN, int LDQ, int LDK, int K_UNROLL = 0>
    static __device__ __forceinline__ void qk(const T* sQw, const T* sK, float (&s)[MI][BN / 8][4]) {
        static_assert(HD % 16 == 0 && BN % 16 == 0, "m16n8k16 tiles");
        const int lane = threadIdx.x & 31;
        // Wide heads: two k-steps per iteration, enough independent MMAs to hide ldmatrix
        // latency without the full unroll's hoisted fragments, which spill beside a 32-row O.
        // K_UNROLL (when not 0) overrides it for callers with other register budgets.
        constexpr int UNROLL = K_UNROLL != 0 ? K_UNROLL : HD <= 64 ? HD / 16 : 2;
#pragma unroll UNROLL
        for (int kk = 0; kk < HD / 16; ++kk) {
            u32 a[MI][4];  // Q (16, 16) per row group: rows lane % 16, columns 16 kk + 8 (lane / 16)
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) ldmatrix_x4(a[mi], sQw + (16 * mi + (lane & 15)) * LDQ + 16 * kk + (lane >> 4) * 8);
#pragma unroll
            for (int np = 0; np < BN / 16; ++np) {
                u32 b[4];  // K rows 16 np .. +16: matrices (keys 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15)
                ldmatrix_x4(b, sK + (16 * np + (lane & 7) + (lane >> 4) * 8) * LDK + 16 * kk + ((lane >> 3) & 1) * 8);
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    MmaF16Types<T>::mma(s[mi][2 * np], a[mi], b[0], b[1]);
                    MmaF16Types<T>::mma(s[mi][2 * np + 1], a[mi], b[2], b[3]);
                }
            }
        }
    }

    // Two accumulator tiles of S are exactly one A fragment of P (16, 16): no shuffles.
    template <int BN> using PFrag = u32[MI][BN / 16][4];
    template <int BN>
    static __device__ __forceinline__ void pack_p(const float (&p)[MI][BN / 8][4], u32 (&a)[MI][BN / 16][4]) {
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                a[mi][kk][0] = MmaF16Types<T>::pack(p[mi][2 * kk][0], p[mi][2 * kk][1]);
                a[mi][kk][1] = MmaF16Types<T>::pack(p[mi][2 * kk][2], p[mi][2 * kk][3]);
                a[mi][kk][2] = MmaF16Types<T>::pack(p[mi][2 * kk + 1][0], p[mi][2 * kk + 1][1]);
                a[mi][kk][3] = MmaF16Types<T>::pack(p[mi][2 * kk + 1][2], p[mi][2 * kk + 1][3]);
            }
    }

    static constexpr int PV_N = 16;  // pv's output width comes in multiples of this

    using One = MmaF16<T, 1>;

    // Storing P (the warp's 16 MI rows) and reloading it: u32 pairs of T, so the reload is exact.
    using PElem = T;
    template <int BN, int LDS>
    static __device__ __forceinline__ void store_p(const u32 (&a)[MI][BN / 16][4], T* sP) {
        static_assert(LDS % 2 == 0, "4-byte aligned pairs");
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi)
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r)  // register r: rows g (+8 if r odd), columns 16 kk (+8 if r >= 2) + 2t
                    *reinterpret_cast<u32*>(sP + (16 * mi + g + 8 * (r & 1)) * LDS + 16 * kk + 8 * (r >> 1) + 2 * t) =
                        a[mi][kk][r];
    }

    // A = M^T (16, K) for M (K, 16) row-major in shared memory, through ldmatrix.trans:
    // matrices (m 0-7, k 0-7), (m 8-15, k 0-7), (m 0-7, k 8-15), (m 8-15, k 8-15).
    template <int K, int LDA>
    static __device__ __forceinline__ void load_pt(const T* sM, u32 (&a)[1][K / 16][4]) {
        static_assert(MI == 1 && K % 16 == 0, "one row group, m16n8k16 tiles");
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int kk = 0; kk < K / 16; ++kk)
            ldmatrix_x4_trans(a[0][kk], sM + (16 * kk + (lane & 7) + ((lane >> 4) & 1) * 8) * LDA + ((lane >> 3) & 1) * 8);
    }

    template <int BN, int DV, int LDV>
    static __device__ __forceinline__ void pv(const u32 (&a)[MI][BN / 16][4], const T* sV, float (&o)[MI][DV / 8][4]) {
        static_assert(DV % 16 == 0 && BN % 16 == 0, "m16n8k16 tiles");
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < DV / 16; ++np) {
                u32 b[4];  // V^T through ldmatrix.trans: (keys 0-7, d 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15)
                ldmatrix_x4_trans(b, sV + (16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8) * LDV + 16 * np + (lane >> 4) * 8);
#pragma unroll
                for (int mi = 0; mi < MI; ++mi) {
                    MmaF16Types<T>::mma(o[mi][2 * np], a[mi][kk], b[0], b[1]);
                    MmaF16Types<T>::mma(o[mi][2 * np + 1], a[mi][kk], b[2], b[3]);
                }
            }
        }
    }
};

// ------------------------------------------------------------------ float32 on TF32 tensor cores
// x rounded to TF32 (allow_tf32's operands): to nearest, ties away from zero.
__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// N float32 operand elements as TF32 products take them (10 explicit mantissa bits).
// SPLIT = false (allow_tf32): x rounded once, relative error up to 2^-11.
// SPLIT = true (3xTF32, float32's default): x = hi + lo and a b = hi_a hi_b + hi_a lo_b + lo_a hi_b.
//   hi: x rounded to TF32 as cvt.rna does (to nearest, ties away), but in two integer
//       instructions: add half a unit of bit 13, clear the 13 bits below TF32's mantissa (a
//       carry into the exponent is the correct rounding up). cvt.rna.tf32.f32 is emulated
//       with several more on sm_80 and sm_90 and cost 15-25% of the forward (bench/NOTES.md).
//   lo: x - hi, exact in float32 and at most 2^-11 |x|, passed as it is: the tensor cores
//       read a TF32 operand's top 19 bits, so lo is truncated, by at most 2^-21 |x|.
// With the missing lo_a lo_b (below 2^-22 |a b|) that is float32's tolerance with room to
// spare (2^-17 of the result's size), at three TF32 products per product. Non-finite x:
// hi of an infinity is that infinity and lo NaN; hi of a NaN may be anything (0x7fffffff
// carries into the sign bit) but lo is NaN. Either way the products read NaN, and a
// non-finite input still gives non-finite results wherever it is read.
// SPLIT = true's step for one element (also the Hopper 3xTF32 kernel's, flash_wgmma.cuh).
__device__ __forceinline__ void tf32_split(float x, u32& hi, u32& lo) {
    hi = (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
    lo = __float_as_uint(x - __uint_as_float(hi));
}

// Four elements split, hi to `hi` and lo to `lo` (16-byte aligned shared memory: one 16-byte
// store each); the hi and lo tiles of the operands split once in shared memory.
__device__ __forceinline__ void tf32_split_store(void* hi, void* lo, float a, float b, float c, float d) {
    uint4 h, l;
    tf32_split(a, h.x, l.x);
    tf32_split(b, h.y, l.y);
    tf32_split(c, h.z, l.z);
    tf32_split(d, h.w, l.w);
    *reinterpret_cast<uint4*>(hi) = h;
    *reinterpret_cast<uint4*>(lo) = l;
}

template <bool SPLIT, int N>
struct Tf32Frag {
    u32 hi[N];
    u32 lo[SPLIT ? N : 1];
    __device__ __forceinline__ void set(int i, float x) {
        if constexpr (SPLIT) {
            tf32_split(x, hi[i], lo[i]);
        } else {
            hi[i] = to_tf32(x);
        }
    }
    // Element i of an operand split in shared memory beforehand (tf32_split_chunks): hi at
    // `at`, lo LO elements further on; otherwise (LO = 0) split here.
    template <int LO>
    __device__ __forceinline__ void set_at(int i, const float* at) {
        if constexpr (LO != 0) {
            static_assert(SPLIT, "pre-split operands are 3xTF32's");
            hi[i] = __float_as_uint(at[0]);
            lo[i] = __float_as_uint(at[LO]);
        } else {
            set(i, *at);
        }
    }
};

// The 16-byte chunks copy_chunks<float, ROWS, CHUNKS, THREADS> copied for thread `tid`
// into the tile at `hi`, chunk c of row r `offset(r, c)` bytes in, rewritten in place as
// their TF32 hi halves, with the lo halves at the same offsets from `lo` (3xTF32 operands
// split once per tile, not by every warp that reads them). Both of copy_chunks' maps give
// thread tid the chunks tid + THREADS k in row-major order, so this thread waits for its own
// copies only. The reads all come before the stores: the compiler cannot move them above
// stores it cannot tell apart from them.
template <int ROWS, int CHUNKS, int THREADS, typename Offset>
__device__ __forceinline__ void tf32_split_chunks(float* hi, float* lo, Offset offset, u32 tid) {
    constexpr int N = (ROWS * CHUNKS + THREADS - 1) / THREADS;
    unsigned char* h = reinterpret_cast<unsigned char*>(hi);
    unsigned char* l = reinterpret_cast<unsigned char*>(lo);
    // Chunk tid + THREADS k: row and column once per thread where THREADS is whole rows
    const int r0 = static_cast<int>(tid / CHUNKS), c0 = static_cast<int>(tid % CHUNKS);
    auto at = [&](int k) {
        if constexpr (THREADS % CHUNKS == 0) return offset(r0 + k * (THREADS / CHUNKS), c0);
        const int i = static_cast<int>(tid) + THREADS * k;
        return offset(i / CHUNKS, i % CHUNKS);
    };
    auto mine = [&](int k) { return N * THREADS == ROWS * CHUNKS || static_cast<int>(tid) + THREADS * k < ROWS * CHUNKS; };
    float4 x[N];
#pragma unroll
    for (int k = 0; k < N; ++k)
        if (mine(k)) x[k] = *reinterpret_cast<const float4*>(h + at(k));
#pragma unroll
    for (int k = 0; k < N; ++k)
        if (mine(k)) tf32_split_store(h + at(k), l + at(k), x[k].x, x[k].y, x[k].z, x[k].w);
}

// C (16, 8) += A (16, 8) B (8, 8), the small cross terms first.
template <bool SPLIT>
__device__ __forceinline__ void mma_tf32(float (&c)[4], const Tf32Frag<SPLIT, 4>& a, const Tf32Frag<SPLIT, 2>& b) {
    if constexpr (SPLIT) {
        mma_m16n8k8_tf32(c, a.lo, b.hi[0], b.hi[1]);
        mma_m16n8k8_tf32(c, a.hi, b.lo[0], b.lo[1]);
    }
    mma_m16n8k8_tf32(c, a.hi, b.hi[0], b.hi[1]);
}

__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], const void* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(smem_addr(p)));
}

// float32 through mma.sync m16n8k8 (sm_80+): one TF32 product per product (SPLIT = false,
// allow_tf32) or three (SPLIT = true). Read as 32-bit elements, ldmatrix's 8x8 b16 matrices
// are 8 rows of 4 floats, lane 4 g + t receiving (row g, float t): exactly the TF32 A and
// B fragments of Q and K. P stays in the accumulator layout, its keys permuted inside each
// 8-key tile (A column t is key 2t, column t + 4 key 2t + 1) so no shuffle is needed; V's
// rows are read in the same order.
template <bool SPLIT, int MI_>
struct MmaTf32 : PassP<float, MI_> {
    using Acc = float;
    using One = MmaTf32<SPLIT, 1>;
    static constexpr int MI = MI_;

    // LO (3xTF32): Q and K are split in shared memory (tf32_split_chunks), lo LO elements after hi.
    template <int HD, int BN, int LDQ, int LDK, int K_UNROLL = 0, int LO = 0>
    static __device__ __forceinline__ void qk(const float* sQw, const float* sK, float (&s)[MI][BN / 8][4]) {
        static_assert(HD % 8 == 0 && BN % 8 == 0, "m16n8k8 tiles");
        static_assert(LO == 0 || SPLIT, "pre-split operands are 3xTF32's");
        const int lane = threadIdx.x & 31;
        constexpr int UNROLL = K_UNROLL != 0 ? K_UNROLL : 2;
#pragma unroll UNROLL
        for (int k8 = 0; k8 < HD / 8; ++k8) {
            Tf32Frag<SPLIT, 4> a[MI];  // Q (16, 8): matrices (rows 0-7, k 0-3), (8-15, 0-3), (0-7, 4-7), (8-15, 4-7)
#pragma unroll
            for (int mi = 0; mi < MI; ++mi) {
                const float* qr = sQw + (16 * mi + (lane & 15)) * LDQ + 8 * k8 + (lane >> 4) * 4;
                if constexpr (LO != 0) {
                    ldmatrix_x4(a[mi].hi, qr);
                    ldmatrix_x4(a[mi].lo, qr + LO);
                } else {
                    u32 r[4];
                    ldmatrix_x4(r, qr);
#pragma unroll
                    for (int e = 0; e < 4; ++e) a[mi].set(e, __uint_as_float(r[e]));
                }
            }
#pragma unroll
            for (int n = 0; n < BN / 8; n += 2) {
                // K (8, 8) per key tile n: matrices (keys 8n + 0-7, k 0-3) -> b0, (8n + 0-7, k 4-7) -> b1,
                // then the same of tile n + 1 where there is one
                Tf32Frag<SPLIT, 2> b[2];
                const float* kr = sK + (8 * n + (lane & 7) + (lane >> 4) * 8) * LDK + 8 * k8 + ((lane >> 3) & 1) * 4;
                if (n + 1 < BN / 8) {
                    u32 r[4];
                    ldmatrix_x4(r, kr);
                    if constexpr (LO != 0) {
                        u32 l[4];
                        ldmatrix_x4(l, kr + LO);
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            b[e >> 1].hi[e & 1] = r[e];
                            b[e >> 1].lo[e & 1] = l[e];
                        }
                    } else {
#pragma unroll
                        for (int e = 0; e < 4; ++e) b[e >> 1].set(e & 1, __uint_as_float(r[e]));
                    }
                } else {
                    u32 r[2];
                    ldmatrix_x2(r, kr);
                    if constexpr (LO != 0) {
                        u32 l[2];
                        ldmatrix_x2(l, kr + LO);
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            b[0].hi[e] = r[e];
                            b[0].lo[e] = l[e];
                        }
                    } else {
#pragma unroll
                        for (int e = 0; e < 2; ++e) b[0].set(e, __uint_as_float(r[e]));
                    }
                }
#pragma unroll
                for (int h = 0; h < 2; ++h)
                    if (n + h < BN / 8)
#pragma unroll
                        for (int mi = 0; mi < MI; ++mi) mma_tf32<SPLIT>(s[mi][n + h], a[mi], b[h]);
            }
        }
    }

    // O += P V, in groups of NG 8-column tiles of O: each group gets this key tile's sum in
    // zeroed accumulators and then one float32 addition. The tensor cores' accumulation is
    // not rounded to nearest (it truncates): added straight into O over thousands of keys,
    // its error grew linearly with the sequence (H200, 3xTF32, L = 16384: up to 8.7x the
    // tolerance of dV). This way it is bounded by one tile of keys, and the additions into
    // O round to nearest. P is split again per group; holding all of its split fragments
    // instead spills. LO (3xTF32): V is split in shared memory, lo LO elements after hi.
    template <int BN, int DV, int LDV, int LO = 0>
    static __device__ __forceinline__ void pv(const float (&p)[MI][BN / 8][4], const float* sV, float (&o)[MI][DV / 8][4]) {
        constexpr int NT = DV / 8, NG = NT % 4 == 0 && NT < 16 ? 4 : NT % 2 == 0 ? 2 : 1;
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int n0 = 0; n0 < NT; n0 += NG) {
            float acc[MI][NG][4];
            zero_acc(acc);
#pragma unroll
            for (int k8 = 0; k8 < BN / 8; ++k8) {
                Tf32Frag<SPLIT, 4> a[MI];  // P (16, 8): (g, key 2t), (g + 8, key 2t), (g, key 2t + 1), (g + 8, key 2t + 1)
#pragma unroll
                for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                    for (int e = 0; e < 4; ++e) a[mi].set(e, p[mi][k8][(e >> 1) | (e & 1) << 1]);
#pragma unroll
                for (int n = 0; n < NG; ++n) {
                    // B (8, 8): (key 2t, d g), (key 2t + 1, d g)
                    const float* vr = sV + (8 * k8 + 2 * t) * LDV + 8 * (n0 + n) + g;
                    Tf32Frag<SPLIT, 2> b;
                    b.template set_at<LO>(0, vr);
                    b.template set_at<LO>(1, vr + LDV);
#pragma unroll
                    for (int mi = 0; mi < MI; ++mi) mma_tf32<SPLIT>(acc[mi][n], a[mi], b);
                }
            }
#pragma unroll
            for (int mi = 0; mi < MI; ++mi)
#pragma unroll
                for (int n = 0; n < NG; ++n)
#pragma unroll
                    for (int e = 0; e < 4; ++e) o[mi][n0 + n][e] += acc[mi][n][e];
        }
    }
};

template <int MI> constexpr bool kSplitTf32<MmaTf32<true, MI>> = true;

// ------------------------------------------------------------------ float64 (DMMA)
__device__ __forceinline__ void mma_m8n8k4_f64(double& c0, double& c1, double a, double b) {
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%0,%1};\n"
                 : "+d"(c0), "+d"(c1) : "d"(a), "d"(b));
}

// C (16, 8) += A (16, 8) B (8, 8) in float64, in m16n8k8's fragments:
//     a[v0 + 2 v1] = A(g + 8 v0, t + 4 v1)   b[v] = B(t + 4 v, g)   c: the accumulator layout.
// sm_90 has the instruction; sm_80 to sm_89 (m8n8k4 only) issue its four 8x8x4 quarters.
__device__ __forceinline__ void mma_m16n8k8_f64(double (&c)[4], const double (&a)[4], const double (&b)[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(b[0]), "d"(b[1]));
#else
    mma_m8n8k4_f64(c[0], c[1], a[0], b[0]);
    mma_m8n8k4_f64(c[2], c[3], a[1], b[0]);
    mma_m8n8k4_f64(c[0], c[1], a[2], b[1]);
    mma_m8n8k4_f64(c[2], c[3], a[3], b[1]);
#endif
}

// The same with k = 16: a[v0 + 2 v1] = A(g + 8 v0, t + 4 v1), b[v] = B(t + 4 v, g), v1, v < 4;
// one instruction on sm_90, two m16n8k8 halves before.
__device__ __forceinline__ void mma_m16n8k16_f64(double (&c)[4], const double (&a)[8], const double (&b)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f64.f64.f64.f64 {%0,%1,%2,%3}, {%4,%5,%6,%7,%8,%9,%10,%11}, "
        "{%12,%13,%14,%15}, {%0,%1,%2,%3};\n"
        : "+d"(c[0]), "+d"(c[1]), "+d"(c[2]), "+d"(c[3])
        : "d"(a[0]), "d"(a[1]), "d"(a[2]), "d"(a[3]), "d"(a[4]), "d"(a[5]), "d"(a[6]), "d"(a[7]),
          "d"(b[0]), "d"(b[1]), "d"(b[2]), "d"(b[3]));
#else
    const double a0[4] = {a[0], a[1], a[2], a[3]}, a1[4] = {a[4], a[5], a[6], a[7]};
    const double b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
    mma_m16n8k8_f64(c, a0, b0);
    mma_m16n8k8_f64(c, a1, b1);
#endif
}

// float64 through mma.sync m16n8k8 (sm_90; four m8n8k4 before), and m16n8k16 in pv. A
// product's k order is free as long as A and B share it:
//   qk takes the head-dim columns of each 16 in the order that gives lane t columns 4t .. 4t + 3
//      (the first 8-step A columns t and t + 4 are 4t and 4t + 1, the second's 4t + 2 and
//      4t + 3), so each row of Q and K is read in 16-byte loads;
//   pv takes the keys where P's accumulator layout holds them (A column t is key 2t, t + 4
//      key 2t + 1, of each 8-key tile), so P needs no shuffle, and V is read at rows 2t, 2t + 1.
// With rows padded by 16 bytes (a pitch of 2 mod 16 doubles) neither has bank conflicts: a
// quarter warp's 16-byte loads cover the 32 banks once, a half warp's 8-byte loads in pv
// 16 distinct bank pairs. m16n8k16 in qk as well spills beside a 128-wide O (sm_90).
struct MmaF64 : PassP<double> {
    using Acc = double;
    using One = MmaF64;
    static constexpr int MI = 1;

    template <int HD, int BN, int LDQ, int LDK, int K_UNROLL = 0>
    static __device__ __forceinline__ void qk(const double* sQw, const double* sK, double (&s)[1][BN / 8][4]) {
        static_assert(HD % 16 == 0 && BN % 8 == 0, "16-column head-dim steps, 8-key tiles");
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
        // Wide heads: one step at a time, or S, Q and K fragments spill beside a 128-wide O
        constexpr int UNROLL = K_UNROLL != 0 ? K_UNROLL : HD <= 64 ? 2 : 1;
#pragma unroll UNROLL
        for (int k8 = 0; k8 < HD / 8; ++k8) {
            // Q (16, 8): a[v0 + 2 v] = (row g + 8 v0, column c + v), c = 16 (k8 / 2) + 4 t + 2 (k8 % 2)
            const int c = 8 * (k8 & ~1) + 4 * t + 2 * (k8 & 1);
            const double2 q0 = *reinterpret_cast<const double2*>(sQw + g * LDQ + c);
            const double2 q1 = *reinterpret_cast<const double2*>(sQw + (g + 8) * LDQ + c);
            const double a[4] = {q0.x, q1.x, q0.y, q1.y};
#pragma unroll
            for (int n = 0; n < BN / 8; ++n) {
                const double2 kv = *reinterpret_cast<const double2*>(sK + (8 * n + g) * LDK + c);  // K^T (8, 8)
                const double b[2] = {kv.x, kv.y};
                mma_m16n8k8_f64(s[0][n], a, b);
            }
        }
    }

    template <int BN, int DV, int LDV>
    static __device__ __forceinline__ void pv(const double (&p_)[1][BN / 8][4], const double* sV,
                                              double (&o)[1][DV / 8][4]) {
        const double(&p)[BN / 8][4] = p_[0];
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int k8 = 0; k8 < BN / 8; k8 += 2) {
            const double* vr = sV + (8 * k8 + 2 * t) * LDV + g;  // V (key 8 k8 + 2t, column g)
            if (k8 + 1 < BN / 8) {  // 16 keys: A column t + 8 is key 8 + 2t, t + 12 key 9 + 2t
                const double a[8] = {p[k8][0], p[k8][2], p[k8][1], p[k8][3],
                                     p[k8 + 1][0], p[k8 + 1][2], p[k8 + 1][1], p[k8 + 1][3]};
#pragma unroll
                for (int n = 0; n < DV / 8; ++n) {
                    const double b[4] = {vr[8 * n], vr[LDV + 8 * n], vr[8 * LDV + 8 * n], vr[9 * LDV + 8 * n]};
                    mma_m16n8k16_f64(o[0][n], a, b);
                }
            } else {  // a last 8-key tile
                const double a[4] = {p[k8][0], p[k8][2], p[k8][1], p[k8][3]};
#pragma unroll
                for (int n = 0; n < DV / 8; ++n) {
                    const double b[2] = {vr[8 * n], vr[LDV + 8 * n]};
                    mma_m16n8k8_f64(o[0][n], a, b);
                }
            }
        }
    }
};

#endif  // sm_80+

}  // namespace flash
