// float32 on TF32 tensor cores: mma.sync m16n8k8 (sm_80+), three products per product
// (3xTF32, float32 accuracy) or, with allow_tf32, one; and the operand splits that Hopper's
// 3xTF32 warpgroup products (wgmma_tf32x3.cuh) share.
#pragma once

#include "common.cuh"

namespace flash {
// Declared for every architecture, so that kernels can name it in branches only 3xTF32
// policies take; defined below with them (sm_80+).
template <int ROWS, int CHUNKS, int THREADS, typename Offset>
__device__ __forceinline__ void tf32_split_chunks(float* hi, float* lo, Offset offset, u32 tid = threadIdx.x);

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

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
//       with several more instructions on sm_80 and sm_90 (bench/NOTES.md, 'Forward float32:
//       3xTF32 on mma.sync').
//   lo: x - hi, exact in float32 and at most 2^-11 |x|, passed as it is: the tensor cores
//       read a TF32 operand's top 19 bits, so lo is truncated, by at most 2^-21 |x|.
// With the missing lo_a lo_b (below 2^-22 |a b|) that is float32's tolerance with room to
// spare (2^-17 of the result's size), at three TF32 products per product. Non-finite x:
// hi of an infinity is that infinity and lo NaN; hi of a NaN may be anything (0x7fffffff
// carries into the sign bit) but lo is NaN. Either way the products read NaN, and a
// non-finite input still gives non-finite results wherever it is read.
// SPLIT = true's step for one element (also the Hopper 3xTF32 kernel's, wgmma_tf32x3.cuh).
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
    // not rounded to nearest (it truncates): added straight into O, its error grows linearly
    // with the number of keys and passes float32's tolerance at long sequences (bench/NOTES.md,
    // 'Forward float32: 3xTF32 on mma.sync'). This way it is bounded by one tile of keys, and the additions into
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

#endif  // sm_80+

}  // namespace flash
