// FlashAttention backward: gradients recomputed tile by tile from Q, K, V, dO and the
// forward's log-sum-exp; no attention matrix is ever stored.
//
//   flash_bwd_delta  D_i = sum_d dO_id O_id, 8 lanes per row; zeroes dQ's accumulator.
//   flash_bwd_dq     query-major, like the forward: per key tile S = Q K^T, P = exp(S - lse),
//                    dP = dO V^T, dS = P (dP z - D), dQ += dS K, with z = keep / (1 - p).
//   flash_bwd_dkdv   key-major: warps own key rows, so S^T = K Q^T and dP^T = V dO^T come out
//                    in the accumulator layout the warp products consume; dV += (P z)^T dO and
//                    dK += dS^T Q. The query heads of a GQA group are looped inside the block,
//                    and dbias (dS before softcap's chain rule) is added here.
// No atomics touch dQ, dK or dV, so they are bitwise repeatable; dbias uses atomics (into a
// buffer with one element per score when the caller asks for determinism). Gradient columns
// come in CH-wide chunks (grid x), each chunk recomputing S and dP.
//
// Template parameters: T the element type, Policy (flash_mma.cuh; one 16-row group per warp),
// HD the padded head dim shared by q, k, v and dO in shared memory, CH gradient columns per
// block, BLOCK_R rows of the block's own operand (16 per warp: queries for dq, keys for dkdv,
// where two warps may share them: ROLES) and BLOCK_C rows of the operand streamed through it
// per tile.
#include "flash_bwd_params.cuh"
#include "flash_copy.cuh"
#include "flash_mma.cuh"
#include "flash_score.cuh"
#include "flash_wgmma.cuh"
#include "philox.cuh"

namespace flash {

// lse in the log2 domain; a fully masked row (lse = -inf) subtracts 0, so that its
// scores, all -inf, give exp2(-inf) = 0 rather than NaN.
template <typename Acc> __device__ __forceinline__ Acc lse_log2(Acc lse) {
    return lse == neg_inf<Acc>() ? Acc(0) : lse * static_cast<Acc>(kLog2e);
}

template <typename Acc> __device__ __forceinline__ void acc_atomic_add(Acc* address, Acc value) {
    atomicAdd(address, value);
}

// address[0] += a, address[1] += b (address 8-byte aligned for float): one vector
// reduction on sm_90, which fills the 32-byte sectors the scalar pair would half-use.
__device__ __forceinline__ void acc_atomic_add2(float* address, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(address), "f"(a), "f"(b));
#else
    atomicAdd(address, a);
    atomicAdd(address + 1, b);
#endif
}
__device__ __forceinline__ void acc_atomic_add2(double* address, double a, double b) {
    atomicAdd(address, a);
    atomicAdd(address + 1, b);
}

// pass(FAST) with FAST a constant: two inlined copies of a tile's element pass, the fast
// tiles' without any selection.
template <typename F> __device__ __forceinline__ void by_tile(bool fast, F pass) {
    if (fast)
        pass(true);
    else
        pass(false);
}

// The most column slices, at most `most`, that split `width` into multiples of `align`.
__host__ __device__ constexpr int dq_slices(int most, int width, int align) {
    return most <= 1 || width % (most * align) == 0 ? (most < 1 ? 1 : most) : dq_slices(most - 1, width, align);
}

// What dQ's accumulator (FUSED_DQ) holds with one role: dQ itself for float64 and for
// float32 up to HD = 64, the atomics multiplying by the scale (the backend then points it
// at dQ wherever the layouts agree, even head dims, and no conversion pass runs), else
// dQ / scale, which flash_bwd_dq_convert scales once (the 16-bit dS K sums stay as
// FlashAttention-2 rounds them). float32 above 64: the factor, multiplied in double at the
// atomics (below), cost the D = 128 backward 6-8% on the H100. With split roles the
// accumulator holds dQ itself whatever the dtype (flash_bwd_dkdv's kScaledDs).
template <typename T, typename Acc, int HD>
constexpr bool kDqAccumScaled = sizeof(T) == sizeof(Acc) && (sizeof(T) == 8 || HD <= 64);

// A dQ tile's share of this thread, rows row0 + g and row0 + g + 8 (those below i1) and
// the accumulator layout's column pairs (2t, 2t + 1) of N tiles from column col, added
// into gdQa (row stride sr) by atomics, times `scale` where SCALED (a double from the
// parameter block, multiplied in double: a float copy stays live in a register, and at
// D = 96 that spilled 3xTF32's kernel on sm_80). d_true is even or the pair's second column
// is padding of the accumulator (its row stride is the padded width, even).
template <bool SCALED, typename Acc, int N>
__device__ __forceinline__ void add_dq_tile(Acc* gdQa, i64 sr, const Acc (&dq)[1][N][4], int row0, int i1, int col,
                                            int d_true, const double& scale) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int x = 0; x < 2; ++x) {
        const int i = row0 + g + 8 * x;
        if (i >= i1) continue;
        Acc* row = gdQa + i * sr + col + 2 * t;
#pragma unroll
        for (int n = 0; n < N; ++n) {
            if (col + 8 * n + 2 * t >= d_true) continue;
            const Acc a = dq[0][n][2 * x], b = dq[0][n][2 * x + 1];
            acc_atomic_add2(row + 8 * n, SCALED ? static_cast<Acc>(a * scale) : a,
                            SCALED ? static_cast<Acc>(b * scale) : b);
        }
    }
}

// Offset of row `row` of head h of batch b in a (batch, head, row) operand with element
// strides sb, sh, sr. Packed operands have no batch stride: their rows count from the first
// sequence, so `row` already includes the sequence's start.
__device__ __forceinline__ i64 row_offset(bool packed, i64 b, i64 h, i64 row, i64 sb, i64 sh, i64 sr) {
    return (packed ? 0 : b * sb) + h * sh + row * sr;
}

// The row passes (flash_bwd_delta, flash_bwd_dq_convert): ROW_LANES lanes per query row,
// ROW_PASS_ROWS rows per 128-thread block (the backend's grid counts the same). Each lane
// takes the 16-byte chunks ROW_LANES apart along the row, so a row's lanes read whole
// 128-byte lines: one warp per row with an element per lane read 2 of every 16 bytes per
// load at D = 64 (fp16), and left three quarters of the warp idle.
constexpr int ROW_LANES = 8, ROW_PASS_ROWS = 128 / ROW_LANES;

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

// One 16-byte store (a Chunk<T, VEC> or a uint4 of converted elements went out in 4-byte
// or smaller pieces: NVRTC splits the aggregate before choosing the instruction).
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
__device__ __forceinline__ bool row_task(const Params& p, RowTask& rt) {
    const int bh = blockIdx.y + gridDim.y * blockIdx.z;
    if (bh >= p.batch * p.hq) return false;
    rt.hv = head_view(p, bh);
    rt.packed = p.cu_seqlens_q != nullptr;
    rt.i = blockIdx.x * ROW_PASS_ROWS + threadIdx.x / ROW_LANES;
    rt.lane = threadIdx.x % ROW_LANES;
    rt.row = rt.packed ? rt.hv.q_start + rt.i : rt.i;
    return rt.i < (rt.packed ? rt.hv.q_len : p.lq);
}

// ------------------------------------------------------------------ D = rowsum(dO * O)
// Also lse2 = lse log2(e), and (fused dQ) the row of dQ's accumulator zeroed, which the
// dK/dV kernel then adds into.
template <typename T, typename Acc>
__global__ void __launch_bounds__(128) flash_bwd_delta(const BwdParams bp) {
    constexpr int VEC = 16 / sizeof(T), VACC = 16 / sizeof(Acc);
    const Params& p = bp.f;
    RowTask rt;
    if (!row_task(p, rt)) return;
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
template <typename T, typename Policy, int HD, int CH, int BLOCK_R, int BLOCK_C>
__global__ void __launch_bounds__(BLOCK_R * 2, 1) flash_bwd_dq(const BwdParams bp) {
    using Acc = typename Policy::Acc;
    static_assert(Policy::MI == 1, "one 16-row group per warp");
    constexpr int THREADS = BLOCK_R * 2;  // 16 rows per warp
    constexpr int LD = PaddedTile<T, 1, HD>::LD;  // rows padded as the forward's tiles
    constexpr int NT = BLOCK_C / 8, NC = CH / 8;
    const Params& p = bp.f;

    extern __shared__ __align__(16) unsigned char smem[];
    T* sQ = reinterpret_cast<T*>(smem);  // (BLOCK_R, HD)
    T* sdO = sQ + BLOCK_R * LD;          // (BLOCK_R, HD): dO, zero beyond dv
    T* sK = sdO + BLOCK_R * LD;          // (BLOCK_C, HD)
    T* sV = sK + BLOCK_C * LD;           // (BLOCK_C, HD)

    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m_blocks = (p.lq + BLOCK_R - 1) / BLOCK_R;
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

    const ScoreOp<Acc> score(p, hv);
    const bool plain = !p.has_softcap && score.bias == nullptr && p.alibi == nullptr && score.mask == nullptr
                       && score.block_mask == nullptr;
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

    for (int j0 = lo - lo % BLOCK_C; j0 < hi; j0 += BLOCK_C) {
        const int j1 = min(j0 + BLOCK_C, hi);
        if (!tile_live(p, hv, i0, i0 + rows_valid, j0, j1)) continue;  // uniform
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
        // No option touches the scores of a full tile inside the band: S = scale * log2(e) * s.
        const bool fast = plain && j0 + BLOCK_C <= hi && tile_inside_band(p, hv, i0, i0 + rows_valid, j0, j1);
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            bool keep[4] = {true, true, true, true};
            if (p.dropout_threshold != 0) {
                const int j = j0 + 8 * n + 2 * t;  // even: j0 is a multiple of BLOCK_C
                dropout_keep_pair(p.seed, p.dropout_offset, hv.bh, r0, j, p.dropout_threshold, keep[0], keep[1]);
                dropout_keep_pair(p.seed, p.dropout_offset, hv.bh, r0 + 8, j, p.dropout_threshold, keep[2], keep[3]);
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int x = e >> 1, i = r0 + 8 * x, j = j0 + 8 * n + 2 * t + (e & 1);
                const Acc raw = s[0][n][e];
                const Acc sc = fast ? raw * score.scale_log2
                                    : (j < j1 && i < hv.q_len) ? score(p, hv, raw, i, j, true) : neg_inf<Acc>();
                const Acc pe = softmax_exp2(sc - lse2[x]);                          // P = exp(S - lse)
                const Acc z = p.dropout_threshold != 0 ? (keep[e] ? dropout_scale : Acc(0)) : Acc(1);
                Acc ds = pe * (dp[0][n][e] * z - delta[x]);                          // dS = P (dP z - D)
                if (p.has_softcap) {
                    const Acc th = tanh_acc(raw * score.scale * score.inv_softcap);
                    ds *= Acc(1) - th * th;  // d(c tanh(x / c)) / dx = 1 - tanh^2
                }
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
// FULL compiles bias (and dbias), ALiBi, softcap, masks, block mask and dropout, as in the
// forward; without it only causal, window and lengths remain.
// FUSED_DQ: dQ += dS K for this block's keys goes through shared memory and atomics into
// bp.dq_accum (the fast path; flash_bwd_dq_convert converts it afterwards, where needed).
// Otherwise flash_bwd_dq computes dQ on its own, in a fixed order. STAGES (1 or 2): shared-
// memory stages of the streamed Q, dO and statistics; with two, the next tile's copies run
// during the current tile's products.
// Warpgroup policies (Hopper's wgmma, flash_wgmma.cuh): each warpgroup owns 64 keys and
// multiplies them at once from swizzled tiles: S^T and dP^T with K and V as A operands
// from shared memory, dV and dK with P'^T and dS^T as A operands from registers; dS^T goes
// to shared memory, and warpgroup w computes the dQ tile's columns [w NQW, (w + 1) NQW) over
// all the block's keys (with 128-query tiles: warpgroup w the rows [64 w, 64 w + 64)).
// With one stage, the next tile's copies run during the dQ product.
// ROLES (warp policies, no score options): 1, each warp computes S^T, dP^T, dV and dK of its
// keys; or 2, two warps share 16 keys: the first computes S^T, P and dV, hands P to its
// partner through shared memory (a named barrier of the pair), and the partner computes dP^T,
// dS and dK. Each warp then holds one (16, CH) gradient instead of two, so a whole head of
// 128 columns fits in one chunk where ROLES = 1 needs two, each recomputing S^T and dP^T
// (float64 at D = 128: 1.4x the products, and 4 warps an SM where shared memory holds one block).
template <typename T, typename Policy, int HD, int CH, int BLOCK_R, int BLOCK_C, bool FUSED_DQ, int STAGES, bool FULL,
          int ROLES>
__global__ void __launch_bounds__(ROLES * BLOCK_R * 2 / Policy::MI, 1) flash_bwd_dkdv(const BwdParams bp) {
    using Acc = typename Policy::Acc;
    using PElem = typename Policy::PElem;
    using One = typename Policy::One;  // the policy with one row group: the dQ product's
    constexpr int MI = Policy::MI;     // 16-key groups per warp
    constexpr bool WG = Policy::WARPGROUP;
    static_assert(STAGES == 1 || STAGES == 2, "one or two stages");
    static_assert(ROLES == 1 || (ROLES == 2 && !FULL && !WG), "split roles: warp policies without score options");
    constexpr int KW = BLOCK_R / (16 * MI);  // warps per role: 16 MI keys each
    static_assert(ROLES == 1 || KW <= 15, "a named barrier per pair of warps: ids 1 to 15");
    constexpr int WARPS = ROLES * KW, THREADS = 32 * WARPS;
    static_assert(!WG || (FUSED_DQ && CH % 64 == 0 && BLOCK_R % 64 == 0 && BLOCK_C % 64 == 0
                          && (BLOCK_R / 64) % (BLOCK_C / 64) == 0),
                  "warpgroups of 64 keys, whole slabs, dQ fused in 64-query blocks shared by the warpgroups");
    using KTile = typename TileKind<WG>::template type<T, BLOCK_R, HD>;
    using QTile = typename TileKind<WG>::template type<T, BLOCK_C, HD>;
    constexpr int LD = PaddedTile<T, 1, HD>::LD;  // rows padded as the forward's tiles
    constexpr int LDS = BLOCK_C + 16 / sizeof(PElem);  // dS^T row pitch: conflict-free ldmatrix rows
    // 3xTF32 with split roles: K and V once per block, and each streamed Q and dO tile once,
    // are split into TF32 hi halves (in place) and lo halves (a mirror of those tiles, LO
    // elements further on), which the warps then read as they are. Split per fragment, each
    // element of Q and dO was split by all 8 warps and each of K by 3: the splits took about
    // a fifth of the kernel's time at D = 128 (H100: bench/NOTES.md). The lo tiles leave
    // room for one stage; the next tile is copied during the dQ product instead.
    constexpr bool PRESPLIT = ROLES == 2 && kSplitTf32<Policy>;
    // Split roles: role 0 hands its partner scale P^T (one multiplication per element, while
    // the partner is still on dP^T), so dS^T, and with it dK and the dQ products, carry the
    // scale: the atomics add dQ itself and dK is stored as it is. float32 at D = 128 then
    // needs no accumulator beside dQ and no conversion pass. Otherwise the atomics multiply
    // where the accumulator holds dQ (add_dq_tile's SCALED), and dK is scaled at the end.
    constexpr bool kScaledDs = ROLES == 2;
    constexpr bool kScaleAtomics = kDqAccumScaled<T, Acc, HD> && !kScaledDs;
    static_assert(!PRESPLIT || (STAGES == 1 && FUSED_DQ), "pre-split tiles: one stage, copied during the fused dQ");
    constexpr int LO = PRESPLIT ? 2 * KTile::ELEMS + 2 * STAGES * QTile::ELEMS : 0;
    // dS^T (BLOCK_R, BLOCK_C) for the fused dQ: swizzled, or rows padded to LDS
    constexpr int DS_ELEMS = !FUSED_DQ ? 0 : WG ? BLOCK_R * BLOCK_C : BLOCK_R * LDS;
    constexpr int NT = BLOCK_C / 8, NC = CH / 8;
    // The dQ tile (BLOCK_C, CH) of one key tile: RG groups of 16 query rows, each split into
    // WPR column slices of NQ (a multiple of the policy's product width), one (group, slice)
    // per warp and pass.
    constexpr int RG = BLOCK_C / 16 > 0 ? BLOCK_C / 16 : 1;
    constexpr int WPR = dq_slices(WARPS >= RG ? WARPS / RG : 1, CH, One::PV_N);
    constexpr int NQ = CH / WPR;
    static_assert(!FUSED_DQ || BLOCK_C % 16 == 0, "dQ row groups of 16 queries");
    const Params& p = bp.f;

    extern __shared__ __align__(16) unsigned char smem[];
    T* sK = reinterpret_cast<T*>(tiles_base<WG>(smem));  // (BLOCK_R, HD) this block's keys
    T* sV = sK + KTile::ELEMS;                           // (BLOCK_R, HD)
    T* sQ = sV + KTile::ELEMS;                           // STAGES x (BLOCK_C, HD) streamed queries
    T* sdO = sQ + STAGES * QTile::ELEMS;                 // STAGES x (BLOCK_C, HD)
    // PRESPLIT: the lo halves of the four tiles above, at the same offsets from sK + LO
    PElem* sdS = reinterpret_cast<PElem*>(sdO + STAGES * QTile::ELEMS + LO);  // (BLOCK_R, BLOCK_C): dS^T, FUSED_DQ
    Acc* sLse = reinterpret_cast<Acc*>(sdS + DS_ELEMS);                  // STAGES x (BLOCK_C) lse2
    Acc* sDelta = sLse + STAGES * BLOCK_C;                               // STAGES x (BLOCK_C) D
    // ROLES = 2: P^T (BLOCK_R, BLOCK_C) handed to the partner warp, each thread's elements in
    // its accumulator order, lane-minor (whole 32-lane rows: no bank conflict)
    Acc* sP = sDelta + STAGES * BLOCK_C;

    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int kw = ROLES == 1 ? warp : warp % KW, role = ROLES == 1 ? 0 : warp / KW;  // this warp's keys and role
    // Block order: the grid's blocks in order (x fastest) are either each (batch, key head)
    // pair's key blocks in turn (bp.key_block_major = 0), or, with key_block_major, each key
    // block (and chunk) in turn over all the pairs. Causal masks make a head's first key
    // blocks the heaviest (they see every query): in the first order the last heads' heavy
    // blocks start last and run alone at the end; in the second every heavy block starts
    // first and the light ones fill the tail (float32 and float64 causal, H100: 3-11%
    // faster; bench/NOTES.md). The host takes it there only (backward_key_block_major):
    // the 16-bit kernels, fast enough to need L2, then stream the queries of every head
    // through it at once and run 6-7% slower at L = 16384.
    const int n_blocks = (p.lk + BLOCK_R - 1) / BLOCK_R;
    const int heads = p.batch * p.hk, grid_head = blockIdx.y + gridDim.y * blockIdx.z;
    if (grid_head >= heads) return;  // beyond the last head (heads split over y and z)
    const i64 linear = blockIdx.x + i64(gridDim.x) * grid_head;
    const bool key_major = bp.key_block_major != 0;
    const int bx = key_major ? static_cast<int>(linear / heads) : blockIdx.x;           // key block and chunk
    const int bhk = key_major ? static_cast<int>(linear - i64(bx) * heads) : grid_head;  // (batch, key head)
    const int chunk = bx / n_blocks;
    const int j0 = (bx - chunk * n_blocks) * BLOCK_R;
    const int c0 = chunk * CH;
    const int b = bhk / p.hk, hk = bhk - b * p.hk, group = p.hq / p.hk;
    const HeadView hv0 = head_view(p, b * p.hq + hk * group);  // lengths and offsets of batch b
    const bool packed = p.cu_seqlens_q != nullptr;
    const int frame_keys = packed ? hv0.kv_len : p.lk;
    if (j0 >= frame_keys) return;
    const int keys_valid = max(0, min(BLOCK_R, hv0.kv_len - j0));

    const i64 k_row0 = packed ? hv0.k_start + j0 : j0;
    const T* gK = static_cast<const T*>(p.k) + row_offset(packed, b, hk, k_row0, p.k_sb, p.k_sh, p.k_sr);
    const T* gV = static_cast<const T*>(p.v) + row_offset(packed, b, hk, k_row0, p.v_sb, p.v_sh, p.v_sr);
    KTile::template load<THREADS>(sK, gK, p.k_sr, keys_valid, p.d);
    KTile::template load<THREADS>(sV, gV, p.v_sr, keys_valid, p.dv_stored);
    cp_async_commit();

    // Queries [i_lo, i_hi) that may attend some key of [j0, j0 + keys_valid): key_range inverted.
    int i_lo = 0, i_hi = keys_valid > 0 ? hv0.q_len : 0;
    const int j_last = j0 + keys_valid - 1;
    if (p.causal != kNoCausal) i_lo = max(i_lo, j0 - (p.causal == kTopLeft ? 0 : hv0.diagonal));
    if (p.window_right >= 0) i_lo = max(i_lo, j0 - hv0.diagonal - p.window_right);
    if (p.window_left >= 0) i_hi = min(i_hi, j_last - hv0.diagonal + p.window_left + 1);
    const int i_first = i_lo - i_lo % BLOCK_C;

    // The query tiles are the pairs (query head of the group hq, first row i0), in order;
    // advance moves (hq, i0) to the next one with a live score (hq == group: none left).
    auto advance = [&](int& hq, int& i0) {
        while (hq < group) {
            if (i0 < i_hi) {
                if constexpr (!FULL) return;  // no mask or block mask: every tile in range is live
                const HeadView hv = head_view(p, b * p.hq + hk * group + hq);
                if (tile_live(p, hv, i0, min(i0 + BLOCK_C, i_hi), j0, j0 + max(keys_valid, 1))) return;  // uniform
                i0 += BLOCK_C;
            } else {
                ++hq;
                i0 = i_first;
            }
        }
    };
    // Copies of query tile (hq, i0) into stage st: Q, dO, lse and D (zero beyond i_hi).
    auto load_queries = [&](int hq, int i0, int st) {
        const HeadView hv = head_view(p, b * p.hq + hk * group + hq);
        const int rows = min(i0 + BLOCK_C, i_hi) - i0;
        const i64 q_row0 = packed ? hv.q_start + i0 : i0;
        const T* gQ = static_cast<const T*>(p.q) + row_offset(packed, hv.b, hv.h, q_row0, p.q_sb, p.q_sh, p.q_sr);
        const T* gdO = static_cast<const T*>(bp.dout)
                       + row_offset(packed, hv.b, hv.h, q_row0, bp.do_sb, bp.do_sh, bp.do_sr);
        QTile::template load<THREADS>(sQ + st * QTile::ELEMS, gQ, p.q_sr, rows, p.d);
        QTile::template load<THREADS>(sdO + st * QTile::ELEMS, gdO, bp.do_sr, rows, p.dv_stored);
        const i64 stat = row_offset(packed, hv.b, hv.h, q_row0, p.lse_sb, p.lse_sh, 1);
        for (int c = threadIdx.x; c < BLOCK_C; c += THREADS) {
            const bool valid = c < rows;
            cp_async_elem(sLse + st * BLOCK_C + c, static_cast<const Acc*>(bp.lse2) + stat + (valid ? c : 0), valid);
            cp_async_elem(sDelta + st * BLOCK_C + c, static_cast<const Acc*>(bp.delta) + stat + (valid ? c : 0), valid);
        }
        cp_async_commit();
    };

    const int r0 = j0 + 16 * MI * kw + g;  // this thread's keys: r0 + 16 mi and r0 + 16 mi + 8
    // dV and dK; with split roles one gradient, dV (role 0) or dK (role 1), under both names
    Acc dkv[3 - ROLES][MI][NC][4];
    Acc(&dv)[MI][NC][4] = dkv[0];
    Acc(&dk)[MI][NC][4] = dkv[2 - ROLES];
    zero_acc(dk);
    zero_acc(dv);
    const Acc dropout_scale = static_cast<Acc>(p.dropout_scale);

    int hq = 0, i0 = i_first, st = 0;
    advance(hq, i0);
    if (hq < group) load_queries(hq, i0, 0);
    // Byte offset of chunk c of row r in a padded tile (PRESPLIT's tf32_split_chunks)
    auto padded_chunk = [](int r, int c) { return static_cast<int>(sizeof(T)) * (r * LD + 4 * c); };
    if constexpr (PRESPLIT) {  // each thread splits the chunks it copied (before the loop's first barrier)
        cp_async_wait<0>();
        tf32_split_chunks<BLOCK_R, HD / 4, THREADS>(sK, sK + LO, padded_chunk);
        tf32_split_chunks<BLOCK_R, HD / 4, THREADS>(sV, sV + LO, padded_chunk);
    }
    while (hq < group) {
        int next_hq = hq, next_i0 = i0 + BLOCK_C;
        advance(next_hq, next_i0);
        if constexpr (PRESPLIT) {  // as K and V; every warp is done with sdS (and, one stage, Q and dO)
            cp_async_wait<0>();
            tf32_split_chunks<BLOCK_C, HD / 4, THREADS>(sQ, sQ + LO, padded_chunk);
            tf32_split_chunks<BLOCK_C, HD / 4, THREADS>(sdO, sdO + LO, padded_chunk);
        }
        wait_tiles<0, WG>();  // tile (hq, i0) has landed; every warp is done with the other stage and sdS
        if (STAGES == 2 && next_hq < group) load_queries(next_hq, next_i0, st ^ 1);

        const HeadView hv = head_view(p, b * p.hq + hk * group + hq);
        const ScoreOp<Acc> score(p, hv);
        const bool plain = !FULL || (!p.has_softcap && score.bias == nullptr && p.alibi == nullptr
                                     && score.mask == nullptr && score.block_mask == nullptr);
        const int i1 = min(i0 + BLOCK_C, i_hi);
        const T* sQt = sQ + st * QTile::ELEMS;
        const T* sdOt = sdO + st * QTile::ELEMS;
        const Acc* sLset = sLse + st * BLOCK_C;
        const Acc* sDeltat = sDelta + st * BLOCK_C;

        Acc s_t[MI][NT][4], dp_t[MI][NT][4];
        zero_acc(s_t);
        zero_acc(dp_t);
        if constexpr (WG) {  // issued here, waited for below
            Policy::template qk_issue<BLOCK_R, HD, BLOCK_C>(sK, sQt, s_t);    // S^T = K Q^T
            Policy::template qk_issue<BLOCK_R, HD, BLOCK_C>(sV, sdOt, dp_t);  // dP^T = V dO^T
        } else if constexpr (ROLES == 2) {
            // Role 0: S^T = K Q^T; role 1: dP^T = V dO^T, both into s_t (one copy of the product)
            const T* sA = (role == 0 ? sK : sV) + 16 * MI * kw * LD;
            if constexpr (PRESPLIT)
                Policy::template qk<HD, BLOCK_C, LD, LD, 0, LO>(sA, role == 0 ? sQt : sdOt, s_t);
            else
                Policy::template qk<HD, BLOCK_C, LD, LD>(sA, role == 0 ? sQt : sdOt, s_t);
        } else {
            // Two row groups keep dK and dV for 32 keys live: unroll two k-steps, not all.
            constexpr int K_UNROLL = MI == 2 ? 2 : 0;
            Policy::template qk<HD, BLOCK_C, LD, LD, K_UNROLL>(sK + 16 * MI * warp * LD, sQt, s_t);    // S^T = K Q^T
            Policy::template qk<HD, BLOCK_C, LD, LD, K_UNROLL>(sV + 16 * MI * warp * LD, sdOt, dp_t);  // dP^T = V dO^T
        }
        // Full tile: BLOCK_C queries and BLOCK_R keys, tested on the unclamped ends. CUDA 13's
        // NVRTC folded `keys_valid == BLOCK_R` (keys_valid = max(0, min(BLOCK_R, n))) to true
        // with one key: the padding keys then took the fast path, P = exp2(0 - lse2) overflowed
        // where lse < 0 and dQ = dS K came out NaN (tests/test_fuzz.py, fp16 scores of -6e4).
        const bool full_tile = i0 + BLOCK_C <= i_hi && j0 + BLOCK_R <= hv0.kv_len;
        const bool band = !tile_inside_band(p, hv, i0, i1, j0, j0 + max(keys_valid, 1));
        const bool fast = plain && full_tile && !band;
        // P' = P z into s_t and dS^T into dp_t, element by element. FAST (a full tile inside the
        // band, no score option): P = exp2(S * scale * log2(e) - lse2), nothing selected.
        // Otherwise masked scores and padding get P = 0 and dS = 0 by selection, whatever
        // P and dP - D hold there (0 * an overflowed dP would be NaN). The fast tiles, nearly
        // all of them, carry no per-element test (measured: bench/NOTES.md): the selecting
        // loop is inlined twice, with a constant FAST.
        if constexpr (FULL) {  // one pass, one copy: a second spills beside the full pipeline (48 bytes at D = 128)
            // Rows of S^T are keys j, columns queries i0 + c.
            each_element(s_t, r0, 0, t, [&](Acc& s, Acc& dp, int j, int c) {
                const int i = i0 + c;
                const Acc raw = s;
                // The log2-domain score minus lse2 (one FMA on the fast path); -inf where masked.
                const Acc x = fast ? raw * score.scale_log2 - sLset[c]
                                   : (i < i1 && j < j0 + keys_valid ? score(p, hv, raw, i, j, true) : neg_inf<Acc>())
                                         - sLset[c];
                const bool live = fast || x != neg_inf<Acc>();
                const Acc pe = live ? softmax_exp2(x) : Acc(0);  // P^T = exp(S^T - lse)
                Acc z = Acc(1);
                if (p.dropout_threshold != 0)
                    z = dropout_keep_one(p.seed, p.dropout_offset, hv.bh, i, j, p.dropout_threshold) ? dropout_scale
                                                                                                       : Acc(0);
                Acc ds = pe * (dp * z - sDeltat[c]);  // dS^T = P^T (dP^T z - D)
                if (!fast) {
                    if (bp.dbias != nullptr && chunk == 0 && ds != Acc(0)) {
                        acc_atomic_add(static_cast<Acc*>(bp.dbias) + hv.b * bp.db_sb + hv.h * bp.db_sh + i * bp.db_si
                                           + j * bp.db_sj,
                                       ds);
                    }
                    if (p.has_softcap) {
                        const Acc th = tanh_acc(raw * score.scale * score.inv_softcap);
                        ds *= Acc(1) - th * th;  // d(c tanh(x / c)) / dx = 1 - tanh^2
                    }
                }
                s = pe * z;  // P' = P z
                dp = live ? ds : Acc(0);
            }, dp_t);
        } else {
            // Whether score (query i0 + c, key j) survives the lengths and the band: TileBand's
            // branch-free test, but for 3xTF32 above HD = 64, whose fragments leave no
            // registers for the interleaving it allows (4-byte spill at D = 96, sm_80 to
            // sm_90): there the sequential one.
            constexpr bool kSequentialMask = kSplitTf32<Policy> && HD > 64;
            const TileBand<kSequentialMask> in_band(p, hv, band);
            auto kept = [&](int c, int j) { return in_band((i0 + c < i1) & (j < j0 + keys_valid), i0 + c, j); };
            auto keep = [&](const bool FAST, int c, int j) { return FAST || kept(c, j); };
            // P^T = exp2(S^T scale log2(e) - lse2) on every element, masked or not (the same
            // code on every tile): a masked or padding score may overflow to inf here, and
            // differentiate selects it away.
            auto exponentiate = [&](Acc& s, int c) { s = softmax_exp2(s * score.scale_log2 - sLset[c]); };
            // dS^T = P^T (dP^T - D); off the fast path, P and dS of the scores outside the
            // lengths and the band are then 0 by selection, whatever inf or NaN they hold.
            auto differentiate = [&](const bool FAST, Acc& s, Acc& dp, int c, int j) {
                const Acc ds = s * (dp - sDeltat[c]);
                const bool live = keep(FAST, c, j);
                s = live ? s : Acc(0);
                dp = live ? ds : Acc(0);
            };
            if constexpr (ROLES == 2) {
                // The pair's named barrier (1 + kw; 0 is __syncthreads'): role 0 arrives once scale
                // P^T (kScaledDs) is in sP, role 1 waits for it. sP is rewritten only after the next
                // block-wide barrier, which follows role 1's reads.
                Acc* sPw = sP + kw * (MI * NT * 4 * 32) + lane;  // this thread's elements, 32 apart
                if (role == 0) {
                    // P^T, with the scores outside the lengths and the band selected to 0
                    by_tile(fast, [&](const bool FAST) {
                        each_element(s_t, r0, 0, t, [&](Acc& s, int j, int c) {
                            exponentiate(s, c);
                            s = keep(FAST, c, j) ? s : Acc(0);
                        });
                    });
#pragma unroll
                    for (int x = 0; x < MI * NT * 4; ++x) sPw[32 * x] = (&s_t[0][0][0])[x] * score.scale;
                    named_barrier_arrive(1 + kw, 64);
                } else {
                    named_barrier_sync(1 + kw, 64);
#pragma unroll
                    for (int x = 0; x < MI * NT * 4; ++x) (&dp_t[0][0][0])[x] = sPw[32 * x];
                    // scale dS^T = (scale P^T) (dP^T - D) into s_t, which holds dP^T; P^T (in dp_t) is already 0
                    // outside, dS^T is selected there as with one role
                    by_tile(fast, [&](const bool FAST) {
                        each_element(dp_t, r0, 0, t, [&](Acc& pe, Acc& dp, int j, int c) { differentiate(FAST, pe, dp, c, j); },
                                     s_t);
                    });
                }
            } else if constexpr (WG) {
                // Hopper: P in a first pass while dP^T is still on the tensor cores, dS in a second.
                wgmma_wait<1>();  // S^T has landed; dP^T may still run
                fence_regs(s_t[0]);
                each_element(s_t, r0, 0, t, [&](Acc& s, int, int c) { exponentiate(s, c); });
                wgmma_wait<0>();
                fence_regs(dp_t[0]);
                by_tile(fast, [&](const bool FAST) {
                    each_element(s_t, r0, 0, t, [&](Acc& s, Acc& dp, int j, int c) { differentiate(FAST, s, dp, c, j); },
                                 dp_t);
                });
            } else {
                // The warp policies: one pass (a second spills 4 bytes beside 3xTF32's fragments
                // at D = 96 on sm_80 to sm_89).
                by_tile(fast, [&](const bool FAST) {
                    each_element(s_t, r0, 0, t, [&](Acc& s, Acc& dp, int j, int c) {
                        exponentiate(s, c);
                        differentiate(FAST, s, dp, c, j);
                    }, dp_t);
                });
            }
        }
        // dQ's accumulator rows of this head (FUSED_DQ)
        Acc* gdQa = FUSED_DQ ? static_cast<Acc*>(bp.dq_accum) + (packed ? hv.q_start * bp.dqa_sr : hv.b * bp.dqa_sb)
                                   + hv.h * bp.dqa_sh
                             : nullptr;
        if constexpr (WG) {
            typename Policy::template PFrag<BLOCK_C> pf, dsf;
            Policy::template pack_p<BLOCK_C>(s_t, pf);
            Policy::template pack_p<BLOCK_C>(dp_t, dsf);
            Policy::template pv_issue<BLOCK_C, CH>(pf, sdOt + QTile::column(c0), dv);  // dV += P'^T dO
            Policy::template pv_issue<BLOCK_C, CH>(dsf, sQt + QTile::column(c0), dk);  // dK += dS^T Q
            Policy::template store_p_swizzled<BLOCK_R, BLOCK_C>(dsf, sdS);
            // One stage: dV and dK have to be done with its Q and dO before the next tile's
            // copies. (Placed after fence.proxy.async instead, this wait crashed NVRTC 12.9's
            // ptxas.)
            if constexpr (STAGES == 1) wgmma_wait<0>();
            fence_proxy_async();
            __syncthreads();  // dS^T of every key of the block is in sdS (one stage: free for the next tile)
            if (STAGES == 1 && next_hq < group) load_queries(next_hq, next_i0, 0);  // copied during dQ
            // The dQ tile (BLOCK_C, CH): warpgroup w takes query block qb = w % QB (64 rows, the
            // qb-th slab of dS^T) and NQW columns from col0.
            constexpr int QB = BLOCK_C / 64, NQW = CH * QB / (WARPS / 4);
            const int qb = (warp / 4) % QB, col0 = c0 + (warp / 4) / QB * NQW;
            Acc dq[1][NQW / 8][4];
            zero_acc(dq);
            Policy::template mn_issue<BLOCK_R, NQW>(sdS + qb * BLOCK_R * 64, sK, col0, dq);  // dQ_tile = dS K
            wgmma_wait<0>();
            fence_regs(dv[0]);
            fence_regs(dk[0]);
            fence_regs(dq[0]);
            fence_regs(pf[0]);
            fence_regs(dsf[0]);
            add_dq_tile<kScaleAtomics>(gdQa, bp.dqa_sr, dq, i0 + 64 * qb + 16 * (warp % 4), i1, col0, bp.d_true,
                                                p.scale);
        } else {
            typename Policy::template PFrag<BLOCK_C> pf;
            Policy::template pack_p<BLOCK_C>(s_t, pf);
            if constexpr (ROLES == 2) {
                // Role 0: dV += P^T dO; role 1: dK += dS^T Q (s_t holds P^T or dS^T)
                if constexpr (PRESPLIT)
                    Policy::template pv<BLOCK_C, CH, LD, LO>(pf, (role == 0 ? sdOt : sQt) + c0, dkv[0]);
                else
                    Policy::template pv<BLOCK_C, CH, LD>(pf, (role == 0 ? sdOt : sQt) + c0, dkv[0]);
            } else {
                Policy::template pv<BLOCK_C, CH, LD>(pf, sdOt + c0, dv);  // dV += P'^T dO
                Policy::template pack_p<BLOCK_C>(dp_t, pf);
                Policy::template pv<BLOCK_C, CH, LD>(pf, sQt + c0, dk);   // dK += dS^T Q
            }
            if constexpr (FUSED_DQ) {
                if (role == ROLES - 1) Policy::template store_p<BLOCK_C, LDS>(pf, sdS + 16 * MI * kw * LDS);
                __syncthreads();  // dS^T of every key of the block is in sdS
                if (PRESPLIT && next_hq < group) load_queries(next_hq, next_i0, 0);  // copied during dQ
                for (int task = warp; task < RG * WPR; task += WARPS) {
                    const int rg = task / WPR, n0 = (task - rg * WPR) * NQ;
                    Acc dq[1][NQ / 8][4];
                    zero_acc(dq);
                    // dQ_tile = dS K, over the block's keys KC at a time (fewer live fragments)
                    constexpr int KC = BLOCK_R % 32 == 0 ? 32 : 16;
#pragma unroll
                    for (int k0 = 0; k0 < BLOCK_R; k0 += KC) {
                        typename One::template PFrag<KC> ds;
                        One::template load_pt<KC, LDS>(sdS + k0 * LDS + 16 * rg, ds);  // dS (16 queries, KC keys)
                        if constexpr (PRESPLIT)
                            One::template pv<KC, NQ, LD, LO>(ds, sK + k0 * LD + c0 + n0, dq);
                        else
                            One::template pv<KC, NQ, LD>(ds, sK + k0 * LD + c0 + n0, dq);
                    }
                    add_dq_tile<kScaleAtomics>(gdQa, bp.dqa_sr, dq, i0 + 16 * rg, i1, c0 + n0, bp.d_true,
                                                        p.scale);
                }
            }
        }
        if (!WG && !PRESPLIT && STAGES == 1 && next_hq < group) {
            __syncthreads();  // every warp is done with the stage
            load_queries(next_hq, next_i0, 0);
        }
        hq = next_hq;
        i0 = next_i0;
        st ^= STAGES - 1;
    }
    cp_async_wait<0>();

    const i64 dk_off = (packed ? hv0.k_start * bp.dk_sr : b * bp.dk_sb) + hk * bp.dk_sh;
    const i64 dv_off = (packed ? hv0.k_start * bp.dv_sr : b * bp.dv_sb) + hk * bp.dv_sh;
    const Acc scale = kScaledDs ? Acc(1) : static_cast<Acc>(p.scale);  // dK's
    // With split roles each warp writes its own gradient only (no columns of the other)
    const int k_cols = ROLES == 1 || role == 1 ? min(CH, bp.d_true - c0) : 0;
    const int v_cols = ROLES == 1 || role == 0 ? min(CH, p.dv - c0) : 0;
#pragma unroll
    for (int x = 0; x < 2 * MI; ++x) {  // keys r0 + 8 x: row group x / 2, upper half x % 2
        const int j = r0 + 8 * x, mi = x >> 1, e0 = 2 * (x & 1);
        if (j >= frame_keys) continue;
        const bool live = j < hv0.kv_len;
        T* krow = static_cast<T*>(bp.dk) + dk_off + j * bp.dk_sr + c0;
        T* vrow = static_cast<T*>(bp.dv) + dv_off + j * bp.dv_sr + c0;
#pragma unroll
        for (int n = 0; n < NC; ++n) {
            if constexpr (sizeof(T) < 8) {
                // dk, dv: the backend's own 256-byte aligned buffers, so an even row stride
                // keeps every pair aligned.
                const Acc* kn = &dk[mi][n][e0];
                const Acc* vn = &dv[mi][n][e0];
                store_pair(krow, 8 * n + 2 * t, k_cols, live ? kn[0] * scale : Acc(0), live ? kn[1] * scale : Acc(0),
                           bp.dk_sr % 2 == 0);
                store_pair(vrow, 8 * n + 2 * t, v_cols, live ? vn[0] : Acc(0), live ? vn[1] : Acc(0), bp.dv_sr % 2 == 0);
            } else {
                // float64: one element at a time; its full-pipeline kernel on sm_86/89 has no
                // register to spare for the pairs.
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int col = 8 * n + 2 * t + c;
                    if (col < k_cols) krow[col] = static_cast<T>(live ? dk[mi][n][e0 + c] * scale : Acc(0));
                    if (col < v_cols) vrow[col] = static_cast<T>(live ? dv[mi][n][e0 + c] : Acc(0));
                }
            }
        }
    }
}

// ------------------------------------------------------------------ dQ from its accumulator
// After a FUSED_DQ flash_bwd_dkdv whose accumulator is not dQ itself (16-bit dQ, and
// float32 above HD = 64: scaled and rounded; otherwise odd head dims: copied without the
// padding column). SCALED: the accumulator holds dQ itself (kDqAccumScaled of the dK/dV
// kernel before it). ROW_LANES lanes per row, like flash_bwd_delta; a lane converts VEC
// columns at a time (one 16-byte store) where dQ's and the accumulator's rows start
// aligned, one column at a time otherwise and on the row's last partial chunk.
template <typename T, typename Acc, bool SCALED>
__global__ void __launch_bounds__(128) flash_bwd_dq_convert(const BwdParams bp) {
    constexpr int VEC = 16 / sizeof(T);
    const Params& p = bp.f;
    RowTask rt;
    if (!row_task(p, rt)) return;
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
