// What the backward's key-major mainloops (the dK/dV kernel, flash_bwd.cu) share: the block's
// keys and the query tiles it visits (BwdKeyBlock), the element passes that turn S^T and dP^T
// into P^T and dS^T (BwdElements: the plain tiles' selections; OptionElements: options in two
// passes; full_elements: any options in one), dQ's fused tile (warp_dq, add_dq_tile) and the
// epilogue that stores dK and dV.
//
// A dK/dV mainloop is a type with Element, Acc, kThreads, kSwizzled, SharedStorage,
// Staged<ScoreSet> (the score operands it stages in shared memory after SharedStorage under a
// set: a ScoreTiles, score/tiles.cuh, or NoScoreTiles) and run<ScoreSet>(storage, block): the
// block's dK and dV over every query tile under the score option set ScoreSet (a ScoreMods),
// stored. Adding a pipeline is adding such a type (one header) and the rule that picks it
// (flashcupy/cuda/spec.py).
#pragma once

#include "../bwd_params.cuh"
#include "../mma/warp.cuh"
#include "../mma/wgmma.cuh"
#include "../score/scores.cuh"
#include "../score/tiles.cuh"

namespace flash {

// What dQ's accumulator holds, decided by the host (BackwardSpec.dq_accum): nothing (dQ has a
// kernel of its own, flash_bwd_dq), dQ / scale (flash_bwd_dq_convert scales and converts it)
// or dQ itself (the atomics, or a dS that carries the scale, multiply by it; the backend
// points the accumulator at dQ wherever the layouts agree).
enum DqAccum : int { kDqOwnKernel = 0, kDqOverScale = 1, kDqItself = 2 };

// Whether the dQ atomics multiply by the scale: where the accumulator holds dQ itself and dS
// does not carry the scale already.
template <int DQ> constexpr bool kScaleAtomics = DQ == kDqItself;

// lse in the log2 domain; a fully masked row (lse = -inf) subtracts 0, so that its
// scores, all -inf, give exp2(-inf) = 0 rather than NaN.
template <typename Acc> __device__ __forceinline__ Acc lse_log2(Acc lse) {
    return lse == neg_inf<Acc>() ? Acc(0) : lse * static_cast<Acc>(kLog2e);
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

// A dQ tile's share of this thread, rows row0 + g and row0 + g + 8 (those below i1) and
// the accumulator layout's column pairs (2t, 2t + 1) of N tiles from column col, added
// into gdQa (row stride sr) by atomics, times `scale` where SCALED (a double from the
// parameter block, multiplied in double: a float copy would stay live in a register, which
// spills 3xTF32's D = 96 kernel on sm_80). d_true is even or the pair's second column
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

// The shared memory of a dK/dV block, region after region (byte offsets): its keys' K and V
// (K_ELEMS each), per stage the streamed Q and dO (Q_ELEMS each), LO elements of 3xTF32's
// lo halves of those tiles (their hi halves' offsets from K plus LO), dS^T for the fused dQ
// (DS_ELEMS of PElem), per stage the streamed rows' lse2 and D (BLOCK_C each), and P^T handed
// between the two roles (HANDOFF accumulators).
template <typename T, typename PElem, typename Acc, int K_ELEMS, int Q_ELEMS, int STAGES, int LO, int DS_ELEMS,
          int BLOCK_C, int HANDOFF>
struct DkdvStorage {
    using Accumulator = Acc;
    static constexpr int K = 0;
    static constexpr int V = K + K_ELEMS * int(sizeof(T));
    static constexpr int Q = V + K_ELEMS * int(sizeof(T));
    static constexpr int DO = Q + STAGES * Q_ELEMS * int(sizeof(T));
    static constexpr int DS = DO + (STAGES * Q_ELEMS + LO) * int(sizeof(T));
    static constexpr int LSE = DS + DS_ELEMS * int(sizeof(PElem));
    static constexpr int DELTA = LSE + STAGES * BLOCK_C * int(sizeof(Acc));
    static constexpr int P = DELTA + STAGES * BLOCK_C * int(sizeof(Acc));
    static constexpr int BYTES = P + HANDOFF * int(sizeof(Acc));
    alignas(16) unsigned char bytes[BYTES];

    __device__ __forceinline__ T* k() { return reinterpret_cast<T*>(bytes + K); }        // (BLOCK_R, HD)
    __device__ __forceinline__ T* v() { return reinterpret_cast<T*>(bytes + V); }        // (BLOCK_R, HD)
    __device__ __forceinline__ PElem* ds() { return reinterpret_cast<PElem*>(bytes + DS); }  // (BLOCK_R, BLOCK_C)
    __device__ __forceinline__ Acc* handoff() { return reinterpret_cast<Acc*>(bytes + P); }   // (BLOCK_R, BLOCK_C)
    // Stage st of the streamed Q and dO (BLOCK_C, HD), lse2 and D (BLOCK_C)
    __device__ __forceinline__ T* q(int st = 0) { return reinterpret_cast<T*>(bytes + Q) + st * Q_ELEMS; }
    __device__ __forceinline__ T* dout(int st = 0) { return reinterpret_cast<T*>(bytes + DO) + st * Q_ELEMS; }
    __device__ __forceinline__ Acc* lse(int st = 0) { return reinterpret_cast<Acc*>(bytes + LSE) + st * BLOCK_C; }
    __device__ __forceinline__ Acc* delta(int st = 0) { return reinterpret_cast<Acc*>(bytes + DELTA) + st * BLOCK_C; }
};

template <int BLOCK_R, int BLOCK_C>
struct BwdKeyBlock;

// One query tile of a dK/dV block: rows [i0, i1), `whole` where the call's tile map says the
// masks keep every score of it with the block's keys; once its products are issued,
// classify() works out whether the block's keys see it whole and inside the band (`fast`: no
// element needs a selection, but for the mask's own where MASK_STAGED: a mainloop whose fast
// element pass reads the mask from its staged tile; ONE_PASS: its element pass is one copy,
// full_elements). The tile's head view and score modifiers are the caller's locals (a
// struct holding both, one referring to the other, keeps the compiler from placing them in
// registers).
struct BwdQueryTile {
    int i0, i1;
    bool whole;
    bool band;  // the tile crosses a causal or window edge
    bool fast;

    template <int BLOCK_R, int BLOCK_C>
    __device__ __forceinline__ BwdQueryTile(const BwdKeyBlock<BLOCK_R, BLOCK_C>& blk, int i0_, bool whole_ = false)
        : i0(i0_), i1(min(i0_ + BLOCK_C, blk.i_hi)), whole(whole_) {}

    template <bool MASK_STAGED = false, bool ONE_PASS = false, int BLOCK_R, int BLOCK_C, typename Sc>
    __device__ __forceinline__ void classify(const BwdKeyBlock<BLOCK_R, BLOCK_C>& blk, const HeadView& hv,
                                             const Sc& scores) {
        // Full tile: BLOCK_C queries and BLOCK_R keys, tested on the unclamped ends. CUDA 13's
        // NVRTC folded `keys_valid == BLOCK_R` (keys_valid = max(0, min(BLOCK_R, n))) to true
        // with one key: the padding keys then took the fast path, P = exp2(0 - lse2) overflowed
        // where lse < 0 and dQ = dS K came out NaN (tests/test_fuzz.py, fp16 scores of -6e4).
        const bool full_tile = i0 + BLOCK_C <= blk.i_hi && blk.j0 + BLOCK_R <= blk.hv0.kv_len;
        band = !tile_inside_band(blk.p, hv, i0, i1, blk.j0, blk.j0 + max(blk.keys_valid, 1));
        // Beside the masks, a fast tile is one the masks keep whole, or, with a mask the fast
        // pass reads from its staged tile (MASK_STAGED), one without a block mask. Where the
        // element pass is inlined twice (by_tile), a mask neither staged nor ONE_PASS (the
        // pass is one copy, full_elements) makes no tile fast: the fast copy would spill.
        constexpr bool kMask = (Sc::kMods & kModMask) != 0;
        const bool masks_fast = !Sc::kMasks || (MASK_STAGED && !Sc::kBlockMask)
                                || (whole && (MASK_STAGED || ONE_PASS || !kMask));
        fast = masks_fast && full_tile && !band;
    }
};

// One dK/dV block: BLOCK_R keys from j0 (keys_valid of them inside kv_len) of key head hk of
// batch entry b, gradient columns from c0 (chunk), and the query tiles it visits: the pairs
// (query head hq of the group, first row i0) with i0 in [i_first, i_hi) in steps of BLOCK_C.
template <int BLOCK_R, int BLOCK_C>
struct BwdKeyBlock {
    const BwdParams& bp;
    const Params& p;
    int chunk, j0, c0;
    int b, hk, group;
    HeadView hv0;  // lengths and offsets of batch b
    bool packed;
    int frame_keys, keys_valid;
    int i_lo, i_hi, i_first;  // queries that may attend some of the block's keys

    __device__ __forceinline__ explicit BwdKeyBlock(const BwdParams& bp_) : bp(bp_), p(bp_.f) {}

    // Works out this block's keys from blockIdx; false for blocks with none (past the last
    // head, or past the frame's keys).
    //
    // Block order: the grid's blocks in order (x fastest) are either each (batch, key head)
    // pair's key blocks in turn (bp.key_block_major = 0), or, with key_block_major, each key
    // block (and chunk) in turn over all the pairs. Causal masks make a head's first key
    // blocks the heaviest (they see every query): in the first order the last heads' heavy
    // blocks start last and run alone at the end; in the second every heavy block starts
    // first and the light ones fill the tail. The host chooses (backward_key_block_major, see
    // bench/NOTES.md, 'Backward: block order').
    template <int CH>
    __device__ __forceinline__ bool locate() {
        const int n_blocks = bp.key_blocks;
        const int heads = p.batch * p.hk, grid_head = blockIdx.y + gridDim.y * blockIdx.z;
        if (grid_head >= heads) return false;  // beyond the last head (heads split over y and z)
        const i64 linear = blockIdx.x + i64(gridDim.x) * grid_head;
        const bool key_major = bp.key_block_major != 0;
        const int bx = key_major ? static_cast<int>(linear / heads) : blockIdx.x;           // key block and chunk
        const int bhk = key_major ? static_cast<int>(linear - i64(bx) * heads) : grid_head;  // (batch, key head)
        chunk = bx / n_blocks;
        j0 = (bx - chunk * n_blocks) * BLOCK_R;
        c0 = chunk * CH;
        b = bhk / p.hk;
        hk = bhk - b * p.hk;
        group = p.hq / p.hk;
        hv0 = head_view(p, b * p.hq + hk * group);
        packed = p.cu_seqlens_q != nullptr;
        frame_keys = packed ? hv0.kv_len : p.lk;
        if (j0 >= frame_keys) return false;
        keys_valid = max(0, min(BLOCK_R, hv0.kv_len - j0));
        return true;
    }

    // Locates the block (false: it has no keys), copies its K and V rows into the storage's
    // K and V tiles (one cp.async group) and works out which queries see them.
    template <int CH, typename KTile, int THREADS, typename Storage>
    __device__ __forceinline__ bool start(Storage& storage) {
        using T = typename KTile::Element;
        if (!locate<CH>()) return false;
        KTile::template load<THREADS>(storage.k(), key_rows<T>(p.k, p.k_sb, p.k_sh, p.k_sr), p.k_sr, keys_valid, p.d);
        KTile::template load<THREADS>(storage.v(), key_rows<T>(p.v, p.v_sb, p.v_sh, p.v_sr), p.v_sr, keys_valid,
                                      p.dv_stored);
        cp_async_commit();
        query_range();
        return true;
    }

    // The walk over the block's query tiles, the skeleton every dK/dV mainloop shares. Each
    // tile (query head hq, rows from i0) is copied into a stage of the storage (QTile layout,
    // THREADS threads; with it the tile's score operands Staged, after the mainloop's tiles);
    // after_first() runs once the first tile's copies are issued; per tile,
    // before_wait() runs before the block waits for the tile's copies (and for every warp to
    // be done with the other stage and with dS^T), the next tile's copies go to the other
    // stage (STAGES = 2), and body(hv, scores, tile, st, next_hq, next_i0) computes the tile
    // from stage st, with the query head's view, its score modifiers and its rows; with one
    // stage, the body copies the next tile (next_hq < group) into it where the stage is free.
    template <typename Acc, typename Set, int STAGES, bool WARPGROUP, typename QTile, int THREADS,
              typename Staged = NoScoreTiles, typename Storage, typename AfterFirst, typename BeforeWait, typename Body>
    __device__ __forceinline__ void walk(Storage& storage, AfterFirst after_first, BeforeWait before_wait,
                                         Body body) const {
        int hq = 0, i0 = i_first, st = 0;
        bool whole;
        advance<Set>(hq, i0, whole);
        if (hq < group) load_queries<QTile, THREADS, Staged>(storage, hq, i0, 0);
        after_first();
        while (hq < group) {
            int next_hq = hq, next_i0 = i0 + BLOCK_C;
            bool next_whole;
            advance<Set>(next_hq, next_i0, next_whole);
            before_wait();
            wait_tiles<0, WARPGROUP>();  // tile (hq, i0) has landed; every warp is done with the other stage and dS^T
            if (STAGES == 2 && next_hq < group) load_queries<QTile, THREADS, Staged>(storage, next_hq, next_i0, st ^ 1);
            const HeadView hv = query_head(hq);
            const Scores<Acc, Set> scores(p, hv);
            BwdQueryTile tile(*this, i0, whole);
            body(hv, scores, tile, st, next_hq, next_i0);
            hq = next_hq;
            i0 = next_i0;
            whole = next_whole;
            st ^= STAGES - 1;
        }
        cp_async_wait<0>();
    }

    // This block's K or V rows (row strides sr of an operand laid out like k).
    template <typename T>
    __device__ __forceinline__ const T* key_rows(const void* base, i64 sb, i64 sh, i64 sr) const {
        const i64 k_row0 = packed ? hv0.k_start + j0 : j0;
        return static_cast<const T*>(base) + row_offset(packed, b, hk, k_row0, sb, sh, sr);
    }

    // Queries [i_lo, i_hi) that may attend some key of [j0, j0 + keys_valid): key_range inverted.
    __device__ __forceinline__ void query_range() {
        i_lo = 0;
        i_hi = keys_valid > 0 ? hv0.q_len : 0;
        const int j_last = j0 + keys_valid - 1;
        if (p.causal != kNoCausal) i_lo = max(i_lo, j0 - (p.causal == kTopLeft ? 0 : hv0.diagonal));
        if (p.window_right >= 0) i_lo = max(i_lo, j0 - hv0.diagonal - p.window_right);
        if (p.window_left >= 0) i_hi = min(i_hi, j_last - hv0.diagonal + p.window_left + 1);
        i_first = i_lo - i_lo % BLOCK_C;
    }

    __device__ __forceinline__ HeadView query_head(int hq) const { return head_view(p, b * p.hq + hk * group + hq); }

    // Moves (hq, i0) to the next query tile with a live score (hq == group: none left), and
    // whether the masks keep that tile whole. Only masks rule out whole tiles, as the call's
    // key-major tile map says (score/tile_map.cuh).
    template <typename Set>
    __device__ __forceinline__ void advance(int& hq, int& i0, bool& whole) const {
        whole = false;
        while (hq < group) {
            if constexpr (Set::kMasks)
                i0 = next_live_query_tile<BLOCK_C, BLOCK_R>(p, query_head(hq), j0, i0, i_hi, whole);
            if (i0 < i_hi) return;
            ++hq;
            i0 = i_first;
        }
    }

    // Copies of query tile (hq, i0) into stage st of the storage: Q, dO, lse2 and D, zero
    // beyond i_hi, and the tile's staged score operands (Staged) where the set has any. One
    // cp.async group.
    template <typename QTile, int THREADS, typename Staged = NoScoreTiles, typename Storage>
    __device__ __forceinline__ void load_queries(Storage& storage, int hq, int i0, int st) const {
        using T = typename QTile::Element;
        using Acc = typename Storage::Accumulator;
        T* sQ = storage.q(st);
        T* sdO = storage.dout(st);
        Acc* sLse = storage.lse(st);
        Acc* sDelta = storage.delta(st);
        const HeadView hv = query_head(hq);
        const int rows = min(i0 + BLOCK_C, i_hi) - i0;
        const i64 q_row0 = packed ? hv.q_start + i0 : i0;
        const T* gQ = static_cast<const T*>(p.q) + row_offset(packed, hv.b, hv.h, q_row0, p.q_sb, p.q_sh, p.q_sr);
        const T* gdO = static_cast<const T*>(bp.dout)
                       + row_offset(packed, hv.b, hv.h, q_row0, bp.do_sb, bp.do_sh, bp.do_sr);
        QTile::template load<THREADS>(sQ, gQ, p.q_sr, rows, p.d);
        QTile::template load<THREADS>(sdO, gdO, bp.do_sr, rows, p.dv_stored);
        const i64 stat = row_offset(packed, hv.b, hv.h, q_row0, p.lse_sb, p.lse_sh, 1);
        for (int c = threadIdx.x; c < BLOCK_C; c += THREADS) {
            const bool valid = c < rows;
            cp_async_elem(sLse + c, static_cast<const Acc*>(bp.lse2) + stat + (valid ? c : 0), valid);
            cp_async_elem(sDelta + c, static_cast<const Acc*>(bp.delta) + stat + (valid ? c : 0), valid);
        }
        if constexpr (Staged::kAny) Staged(p, hv, storage.extra(), i0, rows).template load<THREADS>(p, st, j0, keys_valid);
        cp_async_commit();
    }

    // dQ's accumulator rows of query head hv.
    template <typename Acc>
    __device__ __forceinline__ Acc* dq_rows(const HeadView& hv) const {
        return static_cast<Acc*>(bp.dq_accum) + (packed ? hv.q_start * bp.dqa_sr : hv.b * bp.dqa_sb) + hv.h * bp.dqa_sh;
    }
};

// The element pass of PlainScores' tiles: P^T and dS^T from S^T and dP^T (rows keys j,
// columns queries i0 + c), the scores outside the lengths and the band selected to 0.
// SEQUENTIAL: TileBand's sequential test, for kernels whose fragments leave no registers for
// the interleaving the branch-free one allows.
template <typename Acc, bool SEQUENTIAL>
struct BwdElements {
    const TileBand<SEQUENTIAL> in_band;
    const Acc scale_log2;
    const Acc* sLse;    // the tile's lse2, (BLOCK_C)
    const Acc* sDelta;  // its D, (BLOCK_C)
    int i0, i1, key_end;

    // Whether score (query i0 + c, key j) survives the lengths and the band.
    __device__ __forceinline__ bool kept(int c, int j) const {
        return in_band((i0 + c < i1) & (j < key_end), i0 + c, j);
    }
    __device__ __forceinline__ bool keep(const bool FAST, int c, int j) const { return FAST || kept(c, j); }
    // P^T = exp2(S^T scale log2(e) - lse2) on every element, masked or not (the same code on
    // every tile): a masked or padding score may overflow to inf here, and differentiate
    // selects it away.
    __device__ __forceinline__ void exponentiate(Acc& s, int c) const { s = softmax_exp2(s * scale_log2 - sLse[c]); }
    // dS^T = P^T (dP^T - D); off the fast path, P and dS of the scores outside the lengths
    // and the band are then 0 by selection, whatever inf or NaN they hold.
    __device__ __forceinline__ void differentiate(const bool FAST, Acc& s, Acc& dp, int c, int j) const {
        const Acc ds = s * (dp - sDelta[c]);
        const bool live = keep(FAST, c, j);
        s = live ? s : Acc(0);
        dp = live ? ds : Acc(0);
    }
};

// The element pass of tiles with options (a ScoreMods other than PlainScores) in the warp
// mainloops, and in the wgmma one where OptionElements does not apply (softcap) or spills
// (BwdWgmma::kTwoPass), once both products have landed: one pass and one copy (a second
// spills beside it): P'^T = P^T z into s_t and dS^T into dp_t, with z =
// keep / (1 - p) of dropout (keep: the tile's bits, Scores::keep_tile; dropout_scale =
// 1 / (1 - p)), and dS through the modifiers' derivative (dbias += dS, added by the block's
// first gradient chunk alone; softcap's chain rule). A fast tile (whole, inside the band, the
// masks absent or keeping it whole) selects nothing: P = exp2(value(S) - lse2). Otherwise
// masked scores and padding get P = 0 and dS = 0 by selection, whatever P and dP - D hold
// there (0 * an overflowed dP would be NaN), before the derivative sees dS.
template <typename Acc, typename Set, int MI, int NT, int BLOCK_R, int BLOCK_C>
__device__ __forceinline__ void full_elements(const BwdKeyBlock<BLOCK_R, BLOCK_C>& blk, const HeadView& hv,
                                              const Scores<Acc, Set>& score, const BwdQueryTile& tile, int r0, int t,
                                              const Acc* sLset, const Acc* sDeltat, Acc dropout_scale,
                                              const KeepBits<MI, NT>& keep, Acc (&s_t)[MI][NT][4],
                                              Acc (&dp_t)[MI][NT][4]) {
    using Sc = Scores<Acc, Set>;
    const BwdParams& bp = blk.bp;
    const Params& p = blk.p;
    const bool fast = tile.fast;
    const bool owner = blk.chunk == 0;
    const int i0 = tile.i0, i1 = tile.i1, key_end = blk.j0 + blk.keys_valid;
    // Rows of S^T are keys j, columns queries i0 + c (each_element's layout).
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int j = r0 + 16 * mi + 8 * (e >> 1), c = 8 * n + 2 * t + (e & 1), i = i0 + c;
                const Acc raw = s_t[mi][n][e];
                const Acc capped = score.capped(raw);  // softcap's tanh, once: the value's and the derivative's
                // The log2-domain score minus lse2; -inf where masked.
                const Acc x = (fast ? (Sc::kPlain ? raw * score.op.scale_log2 : score.value(capped, i, j))
                                    : (i < i1 && j < key_end ? score(capped, i, j, Band(p, hv)) : neg_inf<Acc>()))
                              - sLset[c];
                const bool live = fast || x != neg_inf<Acc>();
                const Acc pe = live ? softmax_exp2(x) : Acc(0);  // P^T = exp(S^T - lse)
                const Acc z = Sc::kDropout ? (keep.kept(mi, n, e) ? dropout_scale : Acc(0)) : Acc(1);
                Acc ds = live ? pe * (dp_t[mi][n][e] * z - sDeltat[c]) : Acc(0);  // dS^T = P^T (dP^T z - D)
                score.derivative(bp, ds, capped, i, j, owner);  // dbias += dS; softcap's chain rule
                s_t[mi][n][e] = pe * z;  // P' = P z
                dp_t[mi][n][e] = ds;
            }
        }
    }
}

// Whether a set's element pass splits in two (OptionElements): every option's derivative is
// dS itself or a bias gradient taking dS, none needs the score once P has replaced it in
// S^T's registers (softcap's chain rule needs its tanh: its sets keep full_elements' one pass).
template <typename Set> constexpr bool kTwoPassElements = Set::kFull && (Set::kMods & kModSoftcap) == 0;

// The element pass of tiles with options in two passes, as BwdElements' for PlainScores: P^T
// from S^T as soon as S^T has landed (while dP^T is still on the tensor cores), then dS^T from
// P^T and dP^T. Each pass is inlined twice (by_tile): a fast tile (whole, inside the band, no
// mask present or only a staged one) takes P = exp2(value(S) - lse2), 0 where the staged mask
// says no, and dS = P (dP z - D), selected to 0 where P is (a staged mask's) alone;
// elsewhere masked and padding scores get P = 0, and dS = 0 by selection on P (an overflowed
// dP times P = 0 would be NaN; a kept score whose P underflows to 0 gets dS = 0 too, where the
// one-pass form would carry an inf or NaN dP into it). z = keep / (1 - p) of dropout; the bias
// gradient adds dS.
// Staged (a ScoreTiles of the set, or NoScoreTiles): the bias and mask come from the tile's
// copies in shared memory (`ops`), else from global memory per score.
template <typename Acc, typename Set, int BLOCK_R, int BLOCK_C, typename Staged>
struct OptionElements {
    using Sc = Scores<Acc, Set>;
    using Ops = TransposedOperands<typename Staged::B, Staged::LDB, Staged::LDM>;
    static_assert(kTwoPassElements<Set>, "softcap's derivative needs its tanh once P replaced S^T: full_elements");
    static_assert(!Staged::kAny || (Staged::kBias == ((Set::kMods & kModBias) != 0)
                                    && Staged::kMask == ((Set::kMods & kModMask) != 0)),
                  "the set's bias and mask staged, or neither");
    const BwdKeyBlock<BLOCK_R, BLOCK_C>& blk;
    const HeadView& hv;
    const Sc& score;
    const Band band;
    const Ops ops;      // the thread's view of the staged tile (query 2 t, key r0 - j0)
    const Acc* sLse;    // the tile's lse2, (BLOCK_C)
    const Acc* sDelta;  // its D, (BLOCK_C)
    int i0, i1, key_end, r0, t;

    __device__ __forceinline__ OptionElements(const BwdKeyBlock<BLOCK_R, BLOCK_C>& blk_, const HeadView& hv_,
                                              const Sc& score_, const BwdQueryTile& tile, int r0_, int t_,
                                              const Ops& ops_, const Acc* sLse_, const Acc* sDelta_)
        : blk(blk_), hv(hv_), score(score_), band(blk_.p, hv_), ops(ops_), sLse(sLse_), sDelta(sDelta_),
          i0(tile.i0), i1(tile.i1), key_end(blk_.j0 + blk_.keys_valid), r0(r0_), t(t_) {}

    // S^T -> P^T = exp2(S^T - lse2) in place (rows keys j, columns queries i0 + c).
    template <int MI, int NT>
    __device__ __forceinline__ void probabilities(const bool FAST, Acc (&s_t)[MI][NT][4]) const {
        const Acc log2e = static_cast<Acc>(kLog2e);
        // ALiBi's offset at (i0 + 2 t, r0), converted once (ScoreOp::value_at); beside a staged
        // mask, at the register limit, each score converts its own (d0 spills there).
        constexpr bool kOneConversion = !Staged::kMask;
        const Acc d0 = ScoreOp<Acc, Set>::alibi_base(hv, i0 + 2 * t, r0);
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int dc = 8 * n + (e & 1), dj = 16 * mi + 8 * (e >> 1);  // from (2 t, r0)
                    const int j = r0 + dj, c = 2 * t + dc, i = i0 + c;
                    const Acc d = kOneConversion ? d0 + static_cast<Acc>(dc - dj)   // ALiBi's i + Lk - Lq - j
                                                 : ScoreOp<Acc, Set>::alibi_base(hv, i, j);
                    Acc& s = s_t[mi][n][e];
                    if constexpr (Staged::kAny) {
                        Acc b = Acc(0);
                        if constexpr (Staged::kBias) b = ops.template bias_at<Acc>(dc, dj) * log2e;
                        // The staged mask is zero past the tile's rows and keys: it tests the lengths too.
                        bool kept = FAST || ((Staged::kMask || (i < i1 && j < key_end)) && band(i, j));
                        if constexpr (Staged::kMask) kept = kept && ops.kept_at(dc, dj);
                        if constexpr ((Set::kMods & kModBlockMask) != 0) {
                            // Read only where kept (&&): rows past the tile's may lie past the
                            // block mask's; not on fast tiles, which the block mask keeps whole.
                            kept = kept && (FAST || score.op.block_unmasked(blk.p, i, j));
                        }
                        const Acc x = score.op.value_at(score.capped(s), b, d) - sLse[c];
                        s = kept ? softmax_exp2(x) : Acc(0);
                    } else if (FAST) {
                        const Acc b = score.op.bias_log2(blk.p, min(i, hv.q_len - 1), j);  // 0 without a bias
                        s = softmax_exp2(score.op.value_at(score.capped(s), b, d) - sLse[c]);
                    } else {
                        const Acc x = i < i1 && j < key_end ? score(score.capped(s), i, j, band) : neg_inf<Acc>();  // -inf: masked
                        s = x == neg_inf<Acc>() ? Acc(0) : softmax_exp2(x - sLse[c]);
                    }
                }
            }
        }
    }

    // P^T and dP^T -> P'^T = P^T z and dS^T = P^T (dP^T z - D) in place.
    template <int MI, int NT>
    __device__ __forceinline__ void gradients(const bool FAST, Acc dropout_scale, const KeepBits<MI, NT>& keep,
                                              Acc (&s_t)[MI][NT][4], Acc (&dp_t)[MI][NT][4]) const {
        const bool owner = blk.chunk == 0;
#pragma unroll
        for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
            for (int n = 0; n < NT; ++n) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = r0 + 16 * mi + 8 * (e >> 1), c = 8 * n + 2 * t + (e & 1);
                    const Acc pe = s_t[mi][n][e];
                    const Acc z = Sc::kDropout ? (keep.kept(mi, n, e) ? dropout_scale : Acc(0)) : Acc(1);
                    Acc ds = pe * (dp_t[mi][n][e] * z - sDelta[c]);
                    // P = 0 gives dS = 0 even where dP overflowed (0 * inf): off the fast path, and
                    // on fast tiles with a staged mask, whose masked scores have P = 0 there.
                    if (!FAST || Staged::kMask) ds = pe != Acc(0) ? ds : Acc(0);
                    score.derivative(blk.bp, ds, Acc(0), i0 + c, j, owner);  // dbias += dS (no softcap here)
                    s_t[mi][n][e] = pe * z;
                    dp_t[mi][n][e] = ds;
                }
            }
        }
    }
};

// dQ_tile (BLOCK_C, CH) = dS K for this block's keys, by the warp policies: dS^T (BLOCK_R,
// BLOCK_C) is in sdS (row pitch LDS; every warp's share stored, the caller's barrier passed),
// K (BLOCK_R, HD) in sK (row pitch LD; with LO, 3xTF32's pre-split lo halves LO elements on).
// RG groups of 16 query rows, each split into WPR column slices of NQ (a multiple of the
// policy's product width), one (group, slice) per warp and pass, each added into the
// accumulator rows gdQa by add_dq_tile (times the scale where SCALED).
template <typename One, bool SCALED, int WARPS, int HD, int CH, int BLOCK_R, int BLOCK_C, int LD, int LDS, int LO,
          typename T, typename PElem, typename Acc>
__device__ __forceinline__ void warp_dq(const BwdParams& bp, const PElem* sdS, const T* sK, int c0, int warp,
                                        Acc* gdQa, int i0, int i1) {
    constexpr int RG = BLOCK_C / 16 > 0 ? BLOCK_C / 16 : 1;
    constexpr int WPR = dq_slices(WARPS >= RG ? WARPS / RG : 1, CH, One::PV_N);
    constexpr int NQ = CH / WPR;
    static_assert(BLOCK_C % 16 == 0, "dQ row groups of 16 queries");
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
            if constexpr (LO != 0)
                One::template pv<KC, NQ, LD, LO>(ds, sK + k0 * LD + c0 + n0, dq);
            else
                One::template pv<KC, NQ, LD>(ds, sK + k0 * LD + c0 + n0, dq);
        }
        add_dq_tile<SCALED>(gdQa, bp.dqa_sr, dq, i0 + 16 * rg, i1, c0 + n0, bp.d_true, bp.f.scale);
    }
}

// The epilogue: this thread's keys r0 + 8 x (row group x / 2, upper half x % 2) of dK (times
// dk_scale) and dV, k_cols and v_cols columns of them from c0; keys past kv_len inside the
// frame get 0.
template <typename T, typename Acc, int MI, int NC, int BLOCK_R, int BLOCK_C>
__device__ __forceinline__ void store_dkdv(const BwdKeyBlock<BLOCK_R, BLOCK_C>& blk, int r0, int t, Acc dk_scale,
                                           int k_cols, int v_cols, const Acc (&dk)[MI][NC][4],
                                           const Acc (&dv)[MI][NC][4]) {
    const BwdParams& bp = blk.bp;
    const i64 dk_off = (blk.packed ? blk.hv0.k_start * bp.dk_sr : blk.b * bp.dk_sb) + blk.hk * bp.dk_sh;
    const i64 dv_off = (blk.packed ? blk.hv0.k_start * bp.dv_sr : blk.b * bp.dv_sb) + blk.hk * bp.dv_sh;
#pragma unroll
    for (int x = 0; x < 2 * MI; ++x) {
        const int j = r0 + 8 * x, mi = x >> 1, e0 = 2 * (x & 1);
        if (j >= blk.frame_keys) continue;
        const bool live = j < blk.hv0.kv_len;
        T* krow = static_cast<T*>(bp.dk) + dk_off + j * bp.dk_sr + blk.c0;
        T* vrow = static_cast<T*>(bp.dv) + dv_off + j * bp.dv_sr + blk.c0;
#pragma unroll
        for (int n = 0; n < NC; ++n) {
            if constexpr (sizeof(T) < 8) {
                // dk, dv: the backend's own 256-byte aligned buffers, so an even row stride
                // keeps every pair aligned.
                const Acc* kn = &dk[mi][n][e0];
                const Acc* vn = &dv[mi][n][e0];
                store_pair(krow, 8 * n + 2 * t, k_cols, live ? kn[0] * dk_scale : Acc(0),
                           live ? kn[1] * dk_scale : Acc(0), bp.dk_sr % 2 == 0);
                store_pair(vrow, 8 * n + 2 * t, v_cols, live ? vn[0] : Acc(0), live ? vn[1] : Acc(0),
                           bp.dv_sr % 2 == 0);
            } else {
                // float64: one element at a time; its full-pipeline kernel on sm_86/89 has no
                // register to spare for the pairs.
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int col = 8 * n + 2 * t + c;
                    if (col < k_cols) krow[col] = static_cast<T>(live ? dk[mi][n][e0 + c] * dk_scale : Acc(0));
                    if (col < v_cols) vrow[col] = static_cast<T>(live ? dv[mi][n][e0 + c] : Acc(0));
                }
            }
        }
    }
}

}  // namespace flash
