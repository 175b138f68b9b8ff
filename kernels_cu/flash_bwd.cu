// FlashAttention backward: gradients recomputed tile by tile from Q, K, V, dO and the
// forward's log-sum-exp; no attention matrix is ever stored.
//
//   flash_bwd_delta  D_i = sum_d dO_id O_id, 8 lanes per row; zeroes dQ's accumulator.
//   flash_bwd_dq     query-major, like the forward: per key tile S = Q K^T, P = exp(S - lse),
//                    dP = dO V^T, dS = P (dP z - D), dQ += dS K, with z = keep / (1 - p).
//   flash_bwd_dkdv   key-major: warps own key rows, so S^T = K Q^T and dP^T = V dO^T come out
//                    in the accumulator layout the warp products consume; dV += (P z)^T dO and
//                    dK += dS^T Q. The query heads of a GQA group are looped inside the block,
//                    and dbias (dS before softcap's chain rule) is added here. Its entry
//                    composes a mainloop (mainloop/bwd_*.cuh), which may also add dQ's share
//                    of the block into an accumulator (fused dQ), the score modifiers and the
//                    bias and mask tiles the mainloop stages after its storage (Staged).
//   flash_bwd_dq_convert  dQ from that accumulator, where it is not dQ itself.
// No atomics touch dQ, dK or dV without a fused dQ, so they are bitwise repeatable; dbias
// uses atomics (into a buffer with one element per score when the caller asks for
// determinism). Gradient columns come in CH-wide chunks (grid x), each chunk recomputing S
// and dP.
//
// Template parameters: T the element type, Policy (mma/; one 16-row group per warp), HD the
// padded head dim shared by q, k, v and dO in shared memory, CH gradient columns per block,
// BLOCK_R rows of the block's own operand (16 per warp: queries for dq, keys for dkdv, where
// two warps may share them) and BLOCK_C rows of the operand streamed through it per tile; the
// shared memory and threads the host launches with, checked at compile time.
#include "mainloop/bwd_split_roles.cuh"
#include "mainloop/bwd_warp.cuh"
#include "mainloop/bwd_wgmma.cuh"

namespace flash {


// The row passes (flash_bwd_delta, flash_bwd_dq_convert): ROW_LANES lanes per query row,
// ROWS rows per block of THREADS = ROWS ROW_LANES threads (the host's grid and launch, checked
// at compile time). Each lane takes the 16-byte chunks ROW_LANES apart along the row, so a
// row's lanes read whole 128-byte lines, where a warp per row with an element per lane would
// read 2 of every 16 bytes per load at D = 64 (fp16) and leave three quarters of the warp
// idle (bench/NOTES.md, 'Backward: row passes').
constexpr int ROW_LANES = 8;

// Sum of `x` over the ROW_LANES lanes of this thread's row (lanes of one row exit together).
template <typename Acc> __device__ __forceinline__ Acc row_sum(Acc x) {
    const unsigned lanes = ((1u << ROW_LANES) - 1) << (threadIdx.x & 31 & ~(ROW_LANES - 1));
#pragma unroll
    for (int m = ROW_LANES / 2; m > 0; m >>= 1) x += __shfl_xor_sync(lanes, x, m);
    return x;
}

// N elements of E starting 16-byte aligned, loaded as whole 16-byte words.
template <typename E, int N> struct alignas(16) Chunk {
    static_assert(N * sizeof(E) % 16 == 0, "whole 16-byte words");
    E v[N];
};

// Whether every row of an array of E with element strides sb, sh, sr starts 16-byte aligned
// (its base is: the backend's allocations and row operands are).
template <typename E> __device__ __forceinline__ bool rows_aligned16(i64 sb, i64 sh, i64 sr) {
    return (sb | sh | sr) % static_cast<i64>(16 / sizeof(E)) == 0;
}

// One 16-byte store (NVRTC splits a Chunk<T, VEC> or uint4 store into 4-byte or smaller
// pieces before choosing the instruction).
__device__ __forceinline__ void store_16(void* dst, uint4 w) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(dst), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w)
                 : "memory");
}

// Query row task of a row pass: its head view, position i inside the sequence, stored row
// (packed: offset by q_start) and this thread's lane within the row.
struct RowTask {
    HeadView hv;
    bool packed;
    int i, lane;
    i64 row;
    __device__ __forceinline__ i64 offset(i64 sb, i64 sh, i64 sr) const {  // of this row: row_offset
        return row_offset(packed, hv.b, hv.h, row, sb, sh, sr);
    }
};
template <int ROWS>
__device__ __forceinline__ bool row_task(const Params& p, RowTask& rt) {
    const int bh = blockIdx.y + gridDim.y * blockIdx.z;
    if (bh >= p.batch * p.hq) return false;
    rt.hv = head_view(p, bh);
    rt.packed = p.cu_seqlens_q != nullptr;
    rt.i = blockIdx.x * ROWS + threadIdx.x / ROW_LANES;
    rt.lane = threadIdx.x % ROW_LANES;
    rt.row = rt.packed ? rt.hv.q_start + rt.i : rt.i;
    return rt.i < (rt.packed ? rt.hv.q_len : p.lq);
}

// ------------------------------------------------------------------ D = rowsum(dO * O)
// Also lse2 = lse log2(e), and (fused dQ) the row of dQ's accumulator zeroed, which the
// dK/dV kernel then adds into.
template <typename T, typename Acc, int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS) flash_bwd_delta(const BwdParams bp) {
    static_assert(THREADS == ROWS * ROW_LANES, "ROW_LANES threads a row");
    constexpr int VEC = 16 / sizeof(T), VACC = 16 / sizeof(Acc);
    const Params& p = bp.f;
    RowTask rt;
    if (!row_task<ROWS>(p, rt)) return;
    const bool live = rt.i < rt.hv.q_len;  // rows past q_len (inside the padded frame) get 0
    // dO and O rows: 16-byte aligned, dv_stored long (padding columns hold zeros; skipped anyway)
    const T* gdo = static_cast<const T*>(bp.dout) + rt.offset(bp.do_sb, bp.do_sh, bp.do_sr);
    const T* go = static_cast<const T*>(bp.out) + rt.offset(bp.out_sb, bp.out_sh, bp.out_sr);
    Acc sum = Acc(0);
    for (int d0 = VEC * rt.lane; d0 < p.dv; d0 += VEC * ROW_LANES) {
        const Chunk<T, VEC> a = *reinterpret_cast<const Chunk<T, VEC>*>(gdo + d0);
        const Chunk<T, VEC> b = *reinterpret_cast<const Chunk<T, VEC>*>(go + d0);
#pragma unroll
        for (int e = 0; e < VEC; ++e)
            if (d0 + e < p.dv) sum += widen(a.v[e]) * widen(b.v[e]);
    }
    sum = row_sum(sum);
    if (rt.lane == 0) {
        const i64 stat = rt.offset(p.lse_sb, p.lse_sh, 1);
        static_cast<Acc*>(bp.delta)[stat] = live ? sum : Acc(0);
        static_cast<Acc*>(bp.lse2)[stat] = live ? lse_log2(static_cast<const Acc*>(p.lse)[stat]) : Acc(0);
    }
    if (bp.dq_accum != nullptr) {  // its columns: d_true rounded up to even (the atomics add pairs)
        Acc* acc = static_cast<Acc*>(bp.dq_accum) + rt.offset(bp.dqa_sb, bp.dqa_sh, bp.dqa_sr);
        const int cols = bp.d_true + (bp.d_true & 1);
        const bool words = rows_aligned16<Acc>(bp.dqa_sb, bp.dqa_sh, bp.dqa_sr);
        for (int c = VACC * rt.lane; c < cols; c += VACC * ROW_LANES) {
            if (words && c + VACC <= cols) {
                *reinterpret_cast<Chunk<Acc, VACC>*>(acc + c) = Chunk<Acc, VACC>{};
            } else {
                for (int e = c; e < min(c + VACC, cols); ++e) acc[e] = Acc(0);
            }
        }
    }
}

// ------------------------------------------------------------------ dQ
// The deterministic dQ, query-major, under the call's score option set; one 16-row group per warp.
template <typename T, typename Policy, int HD, int BLOCK_R, int BLOCK_C>
struct DqStorage {
    using QTile = PaddedTile<T, BLOCK_R, HD>;  // rows padded as the forward's tiles
    using KTile = PaddedTile<T, BLOCK_C, HD>;
    T q[QTile::ELEMS];     // (BLOCK_R, HD)
    T dout[QTile::ELEMS];  // (BLOCK_R, HD): dO, zero beyond dv
    T k[KTile::ELEMS];     // (BLOCK_C, HD)
    T v[KTile::ELEMS];     // (BLOCK_C, HD)
};

template <typename T, typename Policy, typename HostScoreSet, int HD, int CH, int BLOCK_R, int BLOCK_C, int SMEM_BYTES,
          int THREADS>
__global__ void __launch_bounds__(THREADS, 1) flash_bwd_dq(const BwdParams bp) {
    using ScoreSet = typename ForElement<HostScoreSet, T>::type;
    using Acc = typename Policy::Acc;
    using Storage = DqStorage<T, Policy, HD, BLOCK_R, BLOCK_C>;
    static_assert(Policy::MI == 1 && !Policy::WARPGROUP, "one 16-row group per warp");
    static_assert(THREADS == BLOCK_R * 2, "16 rows per warp");
    static_assert(SMEM_BYTES == sizeof(Storage), "the host launches with the kernel's shared memory");
    constexpr int LD = Storage::QTile::LD;
    constexpr int NT = BLOCK_C / 8, NC = CH / 8;
    const Params& p = bp.f;

    extern __shared__ __align__(16) unsigned char smem[];
    Storage& storage = *reinterpret_cast<Storage*>(smem);
    T* sQ = storage.q;
    T* sdO = storage.dout;
    T* sK = storage.k;
    T* sV = storage.v;

    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m_blocks = bp.dq_row_blocks;
    const int chunk = blockIdx.x / m_blocks;
    const int i0 = (blockIdx.x - chunk * m_blocks) * BLOCK_R;
    const int c0 = chunk * CH;
    const int bh = blockIdx.y + gridDim.y * blockIdx.z;
    if (bh >= p.batch * p.hq) return;
    const HeadView hv = head_view(p, bh);
    const bool packed = p.cu_seqlens_q != nullptr;
    const int frame_rows = packed ? hv.q_len : p.lq;
    if (i0 >= frame_rows) return;
    const int hk = hv.h / (p.hq / p.hk);
    const int rows_valid = max(0, min(BLOCK_R, hv.q_len - i0));
    int lo = 0, hi = 0;
    if (rows_valid > 0) key_range(p, hv, i0, i0 + rows_valid, lo, hi);

    const i64 q_row0 = packed ? hv.q_start + i0 : i0;
    const T* gQ = static_cast<const T*>(p.q) + row_offset(packed, hv.b, hv.h, q_row0, p.q_sb, p.q_sh, p.q_sr);
    const T* gdO = static_cast<const T*>(bp.dout)
                   + row_offset(packed, hv.b, hv.h, q_row0, bp.do_sb, bp.do_sh, bp.do_sr);
    const T* gK = static_cast<const T*>(p.k) + (packed ? hv.k_start * p.k_sr : hv.b * p.k_sb) + hk * p.k_sh;
    const T* gV = static_cast<const T*>(p.v) + (packed ? hv.k_start * p.v_sr : hv.b * p.v_sb) + hk * p.v_sh;
    const i64 stat = (packed ? hv.q_start : hv.b * p.lse_sb) + hv.h * p.lse_sh;  // lse and delta offset
    load_tile<T, BLOCK_R, HD, LD, THREADS>(sQ, gQ, p.q_sr, rows_valid, p.d);
    load_tile<T, BLOCK_R, HD, LD, THREADS>(sdO, gdO, bp.do_sr, rows_valid, p.dv_stored);
    cp_async_commit();

    using Sc = Scores<Acc, ScoreSet>;
    const Sc score(p, hv);
    const int r0 = i0 + 16 * warp + g;  // rows r0 and r0 + 8
    Acc lse2[2], delta[2];
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        const int i = r0 + 8 * x;
        lse2[x] = i < hv.q_len ? static_cast<const Acc*>(bp.lse2)[stat + i] : Acc(0);
        delta[x] = i < hv.q_len ? static_cast<const Acc*>(bp.delta)[stat + i] : Acc(0);
    }
    Acc dq[1][NC][4];
#pragma unroll
    for (int n = 0; n < NC; ++n) dq[0][n][0] = dq[0][n][1] = dq[0][n][2] = dq[0][n][3] = Acc(0);
    const Acc dropout_scale = static_cast<Acc>(p.dropout_scale);

    // Key tiles the masks leave some score in (every tile in range without masks).
    for (int j0 = score.template next_live_tile<BLOCK_R, BLOCK_C>(i0, lo - lo % BLOCK_C, hi).j; j0 < hi;
         j0 = score.template next_live_tile<BLOCK_R, BLOCK_C>(i0, j0 + BLOCK_C, hi).j) {
        const int j1 = min(j0 + BLOCK_C, hi);
        __syncthreads();  // every warp is done with the previous K and V
        load_tile<T, BLOCK_C, HD, LD, THREADS>(sK, gK + j0 * p.k_sr, p.k_sr, j1 - j0, p.d);
        load_tile<T, BLOCK_C, HD, LD, THREADS>(sV, gV + j0 * p.v_sr, p.v_sr, j1 - j0, p.dv_stored);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();

        Acc s[1][NT][4], dp[1][NT][4];
#pragma unroll
        for (int n = 0; n < NT; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[0][n][e] = dp[0][n][e] = Acc(0);
        Policy::template qk<HD, BLOCK_C, LD, LD>(sQ + 16 * warp * LD, sK, s);    // S = Q K^T
        Policy::template qk<HD, BLOCK_C, LD, LD>(sdO + 16 * warp * LD, sV, dp);  // dP = dO V^T
        // A full tile inside the band without masks selects nothing.
        const bool fast = !Sc::kMasks && j0 + BLOCK_C <= hi && tile_inside_band(p, hv, i0, i0 + rows_valid, j0, j1);
        const KeepBits<1, NT> keep = score.template keep_tile<1, NT>(r0, j0 + 2 * t);  // j0: a multiple of BLOCK_C
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int x = e >> 1, i = r0 + 8 * x, j = j0 + 8 * n + 2 * t + (e & 1);
                const Acc raw = s[0][n][e];
                const Acc capped = score.capped(raw);  // softcap's tanh, once: the value's and the derivative's
                // Rows past q_len (fast tiles compute them) are never stored.
                const Acc sc = fast ? (Sc::kPlain ? raw * score.op.scale_log2 : score.value(capped, i, j))
                                    : (j < j1 && i < hv.q_len) ? score(capped, i, j, Band(p, hv)) : neg_inf<Acc>();
                const Acc pe = softmax_exp2(sc - lse2[x]);                          // P = exp(S - lse)
                const Acc z = Sc::kDropout ? (keep.kept(0, n, e) ? dropout_scale : Acc(0)) : Acc(1);
                Acc ds = pe * (dp[0][n][e] * z - delta[x]);                          // dS = P (dP z - D)
                score.derivative(bp, ds, capped, i, j, false);  // softcap's chain rule (dK/dV adds dbias)
                s[0][n][e] = ds;
            }
        }
        typename Policy::template PFrag<BLOCK_C> pf;
        Policy::template pack_p<BLOCK_C>(s, pf);
        Policy::template pv<BLOCK_C, CH, LD>(pf, sK + c0, dq);  // dQ += dS K
    }
    cp_async_wait<0>();

    T* gdQ = static_cast<T*>(bp.dq) + (packed ? hv.q_start * bp.dq_sr : hv.b * bp.dq_sb) + hv.h * bp.dq_sh;
    const Acc scale = static_cast<Acc>(p.scale);
    const int cols = min(CH, bp.d_true - c0);
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        const int i = r0 + 8 * x;
        if (i >= frame_rows) continue;
        T* row = gdQ + i * bp.dq_sr + c0;
        const bool live = i < hv.q_len;
#pragma unroll
        for (int n = 0; n < NC; ++n)
            store_pair(row, 8 * n + 2 * t, cols, live ? dq[0][n][2 * x] * scale : Acc(0),
                       live ? dq[0][n][2 * x + 1] * scale : Acc(0), bp.dq_sr % 2 == 0);
    }
}

// ------------------------------------------------------------------ dK, dV (and dbias, dQ)
template <typename Mainloop, typename HostScoreSet, int SMEM_BYTES, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) flash_bwd_dkdv(const BwdParams bp) {
    static_assert(THREADS == Mainloop::kThreads, "the host launches the mainloop's threads");
    using ScoreSet = typename ForElement<HostScoreSet, typename Mainloop::Element>::type;
    using Storage = StorageWith<typename Mainloop::SharedStorage, Mainloop::template Staged<ScoreSet>::kBytes>;
    static_assert(SMEM_BYTES == smem_bytes<Mainloop::kSwizzled>(sizeof(Storage)),
                  "the host launches with the mainloop's shared memory and the staged score operands'");
    extern __shared__ __align__(16) unsigned char smem[];
    auto& storage = *reinterpret_cast<Storage*>(tiles_base<Mainloop::kSwizzled>(smem));
    typename Mainloop::Block block(bp);
    Mainloop::template run<ScoreSet>(storage, block);
}

// ------------------------------------------------------------------ dQ from its accumulator
// After a dK/dV kernel with a fused dQ whose accumulator is not dQ itself (kDqOverScale:
// scaled and rounded; kDqItself at odd head dims: copied without the padding column).
// SCALED: the accumulator holds dQ itself (kDqItself). ROW_LANES lanes per row, like flash_bwd_delta; a lane converts VEC
// columns at a time (one 16-byte store) where dQ's and the accumulator's rows start
// aligned, one column at a time otherwise and on the row's last partial chunk.
template <typename T, typename Acc, bool SCALED, int THREADS, int ROWS>
__global__ void __launch_bounds__(THREADS) flash_bwd_dq_convert(const BwdParams bp) {
    static_assert(THREADS == ROWS * ROW_LANES, "ROW_LANES threads a row");
    constexpr int VEC = 16 / sizeof(T);
    const Params& p = bp.f;
    RowTask rt;
    if (!row_task<ROWS>(p, rt)) return;
    const bool live = rt.i < rt.hv.q_len;
    const Acc* acc = static_cast<const Acc*>(bp.dq_accum) + rt.offset(bp.dqa_sb, bp.dqa_sh, bp.dqa_sr);
    T* dq = static_cast<T*>(bp.dq) + rt.offset(bp.dq_sb, bp.dq_sh, bp.dq_sr);
    const Acc scale = SCALED ? Acc(1) : static_cast<Acc>(p.scale);
    // VEC accumulators are 16 bytes or a multiple of them
    const bool words = rows_aligned16<T>(bp.dq_sb, bp.dq_sh, bp.dq_sr)
                       && rows_aligned16<Acc>(bp.dqa_sb, bp.dqa_sh, bp.dqa_sr);
    for (int c = VEC * rt.lane; c < bp.d_true; c += VEC * ROW_LANES) {
        if (words && c + VEC <= bp.d_true) {
            const Chunk<Acc, VEC> a = *reinterpret_cast<const Chunk<Acc, VEC>*>(acc + c);
            union {
                T v[VEC];
                uint4 word;
            } out;
#pragma unroll
            for (int e = 0; e < VEC; ++e) out.v[e] = static_cast<T>(live ? a.v[e] * scale : Acc(0));
            store_16(dq + c, out.word);
        } else {
            for (int e = c; e < min(c + VEC, bp.d_true); ++e) dq[e] = static_cast<T>(live ? acc[e] * scale : Acc(0));
        }
    }
}

}  // namespace flash
