// Philox4x32-10 (Salmon et al. 2011; cuRAND's Philox4_32_10), the generator of the dropout keep
// bits (score/dropout.cuh).
//
// The bits are the contract of docs/semantics.md#dropout-bits, shared with flashcupy/rng.py:
//   key = (seed mod 2^32, seed >> 32), counter = (j >> 3, i, bh, offset),
//   keep(i, j) = 16-bit half (j & 1) of word ((j >> 1) & 3) of Philox(counter, key) >= threshold.
#pragma once

#include "params.cuh"


namespace flash {

struct Philox4 {
    u32 x, y, z, w;
};

__device__ __forceinline__ Philox4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3,
                                                 u32 k0, u32 k1) {
    constexpr u32 M0 = 0xD2511F53u, M1 = 0xCD9E8D57u;  // round multipliers
    constexpr u32 W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;  // Weyl key increments
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const u32 hi0 = __umulhi(M0, c0), lo0 = M0 * c0;
        const u32 hi1 = __umulhi(M1, c2), lo1 = M1 * c2;
        const u32 n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += W0;
        k1 += W1;
    }
    return {c0, c1, c2, c3};
}

}  // namespace flash
