// FlashAttention forward: one thread block per (BLOCK_M query rows, batch x head, Dv chunk).
//
// The entry composes three parts:
//   a mainloop (mainloop/fwd_*.cuh): the pipeline that walks the key tiles the block's rows
//     may attend (causal and window bound the range; tiles that block_mask or mask rule out
//     entirely are skipped before any load), computes S = Q K^T with its product policy and
//     folds each tile into the online softmax (softmax.cuh): a running row max m, a running
//     sum l and an unnormalised O kept in registers;
//   score modifiers (score/scores.cuh): PlainScores or the call's ScoreMods, what turns
//     products into scores and which tiles to skip, with the bias and mask tiles they read
//     staged in shared memory beside the mainloop's tiles (score/tiles.cuh);
//   the epilogue (epilogue.cuh): O normalised once, with the log-sum-exp.
// Template arguments: Mainloop, ScoreSet (a ScoreMods), and the shared memory
// and threads the host launches with, checked against the mainloop's and the staged
// operands' at compile time.
#include "epilogue.cuh"
#include "mainloop/fwd_overlap.cuh"
#include "mainloop/fwd_producer_consumer.cuh"
#include "mainloop/fwd_serial.cuh"

namespace flash {

template <typename Mainloop, typename HostScoreSet, int SMEM_BYTES, int THREADS>
__global__ void __launch_bounds__(THREADS, 1) flash_fwd(const Params p) {
    static_assert(THREADS == Mainloop::kThreads, "the host launches the mainloop's threads");
    using T = typename Mainloop::Element;
    using ScoreSet = typename ForElement<HostScoreSet, T>::type;
    using Acc = typename Mainloop::Acc;
    constexpr int MI = Mainloop::MI;       // 16-row groups per warp
    constexpr int WARP_M = 16 * MI;
    constexpr int BLOCK_M = Mainloop::kBlockM;
    constexpr int DV = Mainloop::kDv;
    constexpr int NO = DV / 8;             // accumulator tiles of O per warp
    using Staged = ScoreTiles<ScoreSet, BLOCK_M, Mainloop::kBlockN, Mainloop::kStages, sizeof(T) == 8>;
    using Storage = StorageWith<typename Mainloop::SharedStorage, Staged::kBytes>;
    static_assert(SMEM_BYTES == smem_bytes<Mainloop::kSwizzled>(sizeof(Storage)),
                  "the host launches with the mainloop's shared memory and the staged score operands'");

    extern __shared__ __align__(16) unsigned char smem[];
    auto& storage = *reinterpret_cast<Storage*>(tiles_base<Mainloop::kSwizzled>(smem));

    // Grid: x = (Dv chunk, row block) with row blocks fastest, so consecutive blocks share
    // K and V in L2; batch x heads is split over y and z (gridDim.y is at most 65535).
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int m_blocks = p.row_blocks;
    const int chunk = blockIdx.x / m_blocks;
    // Last row blocks first: under causal masking they attend the most keys, so the
    // longest blocks start earliest and the tail of the launch is short.
    const int i0 = (m_blocks - 1 - blockIdx.x % m_blocks) * BLOCK_M;
    const int dv0 = chunk * DV;  // first output column of this block
    const int bh = blockIdx.y + gridDim.y * blockIdx.z;
    if (bh >= p.batch * p.hq) return;
    const HeadView hv = head_view(p, bh);
    const bool packed = p.cu_seqlens_q != nullptr;
    const int frame_rows = packed ? hv.q_len : p.lq;  // rows this head owns in out and lse
    if (i0 >= frame_rows) return;
    const int hk = hv.h / (p.hq / p.hk);  // GQA: query head h reads key/value head h / group

    // 64-bit element offsets of this head's rows.
    const i64 q_off = (packed ? hv.q_start * p.q_sr : hv.b * p.q_sb) + hv.h * p.q_sh;
    const i64 k_off = (packed ? hv.k_start * p.k_sr : hv.b * p.k_sb) + hk * p.k_sh;
    const i64 v_off = (packed ? hv.k_start * p.v_sr : hv.b * p.v_sb) + hk * p.v_sh + dv0;
    const i64 o_off = (packed ? hv.q_start * p.o_sr : hv.b * p.o_sb) + hv.h * p.o_sh + dv0;
    const i64 lse_off = (packed ? hv.q_start : hv.b * p.lse_sb) + hv.h * p.lse_sh;
    const T* gQ = static_cast<const T*>(p.q) + q_off;
    const T* gK = static_cast<const T*>(p.k) + k_off;
    const T* gV = static_cast<const T*>(p.v) + v_off;
    T* gO = static_cast<T*>(p.o) + o_off;
    Acc* gLse = static_cast<Acc*>(p.lse) + lse_off;
    const int dv_valid = min(DV, p.dv - dv0);         // output columns this block writes
    const int dv_load = min(DV, p.dv_stored - dv0);   // stored columns of v it reads

    const int rows_valid = max(0, min(BLOCK_M, hv.q_len - i0));  // rows of this tile inside q_len
    int lo = 0, hi = 0;
    if (rows_valid > 0) key_range(p, hv, i0, i0 + rows_valid, lo, hi);

    const Scores<Acc, ScoreSet> scores(p, hv);
    const Staged staged(p, hv, storage.extra(), i0, rows_valid);
    const int i1 = i0 + rows_valid;
    // This thread's rows: row(x) = r0 + 8 x for x = 2 mi + (e >> 1), x in [0, 2 MI).
    const int r0 = i0 + WARP_M * warp + g;
    Acc m[2 * MI], l[2 * MI];  // running row max (log2 domain); this thread's share of the row sum
    OnlineSoftmax<Acc, MI, ScoreSet, Mainloop::kSequentialMask, Staged> softmax{p, hv, scores, staged, i0, i1, r0,
                                                                                t, m, l};
    Acc o[MI][NO][4];
#pragma unroll
    for (int x = 0; x < 2 * MI; ++x) {
        m[x] = neg_inf<Acc>();
        l[x] = Acc(0);
    }
    zero_acc(o);

    const FwdBlock<T> block{p, hv, warp, i0, i1, rows_valid, lo, hi, gQ, gK, gV, dv_load};
    if (!Mainloop::run(storage, block, scores, staged, softmax, o)) return;  // a producer warp
    // A block that attended no tile still waits for its Q copy (a producer-consumer mainloop's
    // consumer has none: its producer copies Q).
    cp_async_wait<0>();
    forward_epilogue(p, hv, frame_rows, r0, t, chunk == 0, gO, gLse, dv_valid, m, l, o);
}

}  // namespace flash
