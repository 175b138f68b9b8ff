// SIMT products: any dtype with FMA in the accumulator type, every architecture (the portable
// kernels before sm_80, and on any GPU with FLASHCUPY_FORCE_PORTABLE=1).
#pragma once

#include "common.cuh"

namespace flash {
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

template <typename T, typename AccT> constexpr bool kSimt<Simt<T, AccT>> = true;

}  // namespace flash
