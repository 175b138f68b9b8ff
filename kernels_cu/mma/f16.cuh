// float16/bfloat16 on tensor cores: mma.sync m16n8k16 fed by ldmatrix (sm_80+).
#pragma once

#include "common.cuh"

namespace flash {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

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

#endif  // sm_80+

}  // namespace flash
