// The forward's epilogue: O normalised once by its row sums and written out, with the
// log-sum-exp of every row.
#pragma once

#include "copy.cuh"
#include "numeric.cuh"
#include "score/band.cuh"

namespace flash {

// O / l (times 1 / (1 - dropout_p)) for this thread's rows r0 + 8 x (those below frame_rows,
// the rows this head owns in out and lse) into gO (row stride o_sr, dv_valid columns from this
// block's chunk), and each row's lse into gLse where `lse` (the first Dv chunk; column pair t
// of 0). Rows with l = 0 saw no key: 0 and lse -inf.
template <typename T, typename Acc, int MI, int NO>
__device__ __forceinline__ void forward_epilogue(const Params& p, const HeadView& hv, int frame_rows, int r0, int t,
                                                 bool lse, T* gO, Acc* gLse, int dv_valid, Acc (&m)[2 * MI],
                                                 Acc (&l)[2 * MI], Acc (&o)[MI][NO][4]) {
#pragma unroll
    for (int r = 0; r < 2 * MI; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const int i = r0 + 8 * r;
        if (i >= frame_rows) continue;
        // l = 0: every key of the row was masked. A NaN l (NaN inputs) stays live and NaN.
        const bool live = i < hv.q_len && !(l[r] == Acc(0));
        const Acc inv = live ? static_cast<Acc>(p.dropout_scale) / l[r] : Acc(0);
        T* orow = gO + i * p.o_sr;
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            // A select, not a product: 0 * NaN from masked NaN values must not reach a dead row.
            const Acc* on = &o[r >> 1][n][2 * (r & 1)];
            // out is the backend's own allocation (256-byte aligned) and dv0 even, so an even row
            // stride keeps every pair aligned; the test reads the parameter block, no register.
            store_pair(orow, 8 * n + 2 * t, dv_valid, live ? on[0] * inv : Acc(0), live ? on[1] * inv : Acc(0),
                       p.o_sr % 2 == 0);
        }
        if (lse && t == 0) {
            // lse = ln(sum exp(s)) = (m + log2 l) ln 2 in the log2 domain: m / log2(e) + ln l.
            gLse[i] = live ? m[r] / static_cast<Acc>(kLog2e) + log_acc(l[r]) : neg_inf<Acc>();
        }
    }
}

}  // namespace flash
