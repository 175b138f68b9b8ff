// float64 on FP64 tensor cores: mma.sync m16n8k8 and m16n8k16 (sm_90; as m8n8k4 on sm_80 to sm_89).
#pragma once

#include "common.cuh"

namespace flash {

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800

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
// one instruction on sm_90, two m16n8k8 halves before sm_90.
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

// float64 through mma.sync m16n8k8 (sm_90; four m8n8k4 on sm_80 to sm_89), and m16n8k16 in pv. A
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
