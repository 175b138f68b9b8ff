// The forward's epilogue: O normalised once by its row sums and written out, with the
// log-sum-exp of every row; attention sinks join the row sums here.
#pragma once

#include "copy.cuh"
#include "numeric.cuh"
#include "score/band.cuh"

namespace flash {

// The head's sink (log2 domain) folded into a row's running max m and sum l (l relative to
// 2^m; `saw`: the row saw a key): l' = l 2^(m - top) + 2^(sink - top) relative to
// top = max(m, sink), so neither term overflows whichever is larger, and O / l becomes
// O 2^(m - top) / l'. Returns 2^(m - top), 0 for a row that saw no key (its l' is 1 and its
// lse the sink; a sink of -inf leaves l' = 0 and lse -inf).
template <typename Acc>
__device__ __forceinline__ Acc fold_sink(Acc sink, bool saw, Acc& m, Acc& l) {
    const bool none = sink == neg_inf<Acc>();
    if (!saw) {  // l' = 2^(sink - sink) = 1
        l = none ? Acc(0) : Acc(1);
        m = none ? Acc(0) : sink;
        return Acc(0);
    }
    // A row's max at or above the sink keeps m, l' = l + 2^(sink - m), and O's factor exactly
    // 1 (a sink of -inf changes no bit); a NaN m takes the other side and stays NaN.
    const bool above = m >= sink;
    const Acc kept = above ? Acc(1) : softmax_exp2(m - sink);
    l = above ? l + softmax_exp2(sink - m) : l * kept + Acc(1);
    m = above ? m : sink;
    return kept;
}

// O / l (times 1 / (1 - dropout_p)) for this thread's rows r0 + 8 x (those below frame_rows,
// the rows this head owns in out and lse) into gO (row stride o_sr, dv_valid columns from this
// block's chunk), and each row's lse into gLse where `lse` (the first Dv chunk; column pair t
// of 0). Rows with l = 0 saw no key: 0 and lse -inf. With sinks (p.sinks) the head's sink
// joins each row's sum (fold_sink; lse is the sink's for a row that saw no key); rows past
// q_len take none. Every Dv chunk's block folds the same sink into the same m and l.
template <typename T, typename Acc, int MI, int NO>
__device__ __forceinline__ void forward_epilogue(const Params& p, const HeadView& hv, int frame_rows, int r0, int t,
                                                 bool lse, T* gO, Acc* gLse, int dv_valid, Acc (&m)[2 * MI],
                                                 Acc (&l)[2 * MI], Acc (&o)[MI][NO][4]) {
    const bool sunk = p.sinks != nullptr;  // uniform: without sinks nothing below changes
    const Acc sink = sunk ? static_cast<Acc>(p.sinks[hv.b * p.sinks_sb + hv.h * p.sinks_sh] * kLog2e) : Acc(0);
#pragma unroll
    for (int r = 0; r < 2 * MI; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const int i = r0 + 8 * r;
        if (i >= frame_rows) continue;
        // l = 0: every key of the row was masked. A NaN l (NaN inputs) stays live and NaN.
        const bool row = i < hv.q_len;
        const bool saw = row && !(l[r] == Acc(0));
        Acc kept = Acc(1);
        if (sunk && row) kept = fold_sink(sink, saw, m[r], l[r]);
        const bool has_lse = saw || (sunk && row);  // a row that saw no key still has its sink
        const Acc inv = saw ? static_cast<Acc>(p.dropout_scale) * kept / l[r] : Acc(0);
        T* orow = gO + i * p.o_sr;
#pragma unroll
        for (int n = 0; n < NO; ++n) {
            // A select, not a product: 0 * NaN from masked NaN values must not reach a dead row.
            const Acc* on = &o[r >> 1][n][2 * (r & 1)];
            // out is the backend's own allocation (256-byte aligned) and dv0 even, so an even row
            // stride keeps every pair aligned; the test reads the parameter block, no register.
            store_pair(orow, 8 * n + 2 * t, dv_valid, saw ? on[0] * inv : Acc(0), saw ? on[1] * inv : Acc(0),
                       p.o_sr % 2 == 0);
        }
        if (lse && t == 0) {
            // lse = ln(sum exp(s)) = (m + log2 l) ln 2 in the log2 domain: m / log2(e) + ln l.
            gLse[i] = has_lse ? m[r] / static_cast<Acc>(kLog2e) + log_acc(l[r]) : neg_inf<Acc>();
        }
    }
}

}  // namespace flash
