// Decoding: a few query rows against a long key/value cache, split over the keys (split-KV),
// then the splits' partial results merged.
//
// Both split kernels: grid (B * Hk, splits). Block (b, hk, split) holds every query row that
// reads KV head hk, the G = Hq / Hk query heads of its group times Lq positions (row
// r = g * Lq + i, G * Lq <= 16), so each K and V tile is read from memory once per group; it
// keeps each row's online softmax (running max m, sum l and an unnormalised O) over its
// split's keys and writes O / l and m + log2(l).
//   decode_split_mma<T, HK, HV, SMEM_BYTES> (float16, bfloat16): each warp walks its own
//     16-key tiles (warp w takes tiles w, w + 4, ...) through its own cp.async stages, with
//     S = Q K^T and O += P V on mma.sync (the 16 rows are one m16 tile) and no block barrier
//     in the loop; the four warps' softmax states are merged once at the end.
//   decode_split<T, HK, HV, ROWS, SMEM_BYTES> (float32, float64): the block walks kKeys-key
//     tiles together on the CUDA cores in the accumulator type (float32 inputs keep float32
//     products; tensor-core TF32 would not).
// The last block of a (sequence, KV head) to finish its split merges the splits' partials
// into the output (decode_merge_splits): lse = log-sum-exp over the splits' and the sink's,
// O = sum over splits of O_s 2^(lse_s - lse), with no second kernel to launch and wait for
// (bench/NOTES.md, 'Decode: the last split merges').
// decode_append<T>: the call's new keys and values written into the caches first.
//
// Scores are kept in the log2 domain (scale * log2(e) folded in once) so the softmax uses exp2.
#include "copy.cuh"
#include "decode_params.cuh"
#include "mma/f16.cuh"
#include "numeric.cuh"
#include "shared_storage.cuh"
#include "tma.cuh"

namespace flash {

template <typename T> struct DecodeAccOf { using type = float; };
template <> struct DecodeAccOf<double> { using type = double; };

// The tile shapes and shared-memory layout of decode_split, decided here once; the host
// (flashcupy/cuda/decode.py) launches with SMEM_BYTES = kBytes, checked at compile time.
template <typename T, int HK, int HV, int ROWS>
struct DecodeShape {
    using Acc = typename DecodeAccOf<T>::type;
    static constexpr int kThreads = 128;
    static constexpr int kWarps = kThreads / 32;
    static constexpr int kStages = 4;
    static constexpr int kVec = 16 / int(sizeof(T));  // elements a 16-byte chunk
    static constexpr int kHead = HK > HV ? HK : HV;
    // Keys a tile: 8 KB of the wider operand (three tiles of K and V in flight a block, two or
    // three blocks an SM: enough bytes in flight for the memory system), at most 128.
    static constexpr int kKeysRaw = 8192 / (kHead * int(sizeof(T)));
    static constexpr int kKeys = kKeysRaw < 128 ? kKeysRaw : 128;
    static constexpr int kChunksK = HK / kVec;  // 16-byte chunks of a K row
    static constexpr int kChunksV = HV / kVec;
    // Threads sharing one key's q . k: all of them, up to one a chunk (a K row narrower than
    // V's leaves the rest idle in that step).
    static constexpr int kSplit = kThreads / kKeys < kChunksK ? kThreads / kKeys : kChunksK;
    static constexpr int kGroups = kThreads / kChunksV;  // key groups in O += P V
    // Row pitches (bytes): kSplit (K) and one (V) chunks of padding, so the 8 lanes of a
    // shared-memory phase (a key's kSplit lanes read adjacent chunks) hit distinct banks.
    static constexpr int kPitchK = (kChunksK + kSplit) * 16;
    static constexpr int kPitchV = (kChunksV + 1) * 16;
    static constexpr int kStageBytes = kKeys * (kPitchK + kPitchV);
    static constexpr int kTilesBytes = kStages * kStageBytes;
    // The key groups' partial O are summed through the (drained) stages, RC rows a pass.
    static constexpr int kRowBytes = kGroups * HV * int(sizeof(Acc));
    static constexpr int kReduceRows = kTilesBytes / kRowBytes < ROWS ? kTilesBytes / kRowBytes : ROWS;
    // Layout: stages | q (ROWS, HK) | scores (ROWS, kKeys) | per row m, l, alpha, slope | lo, hi, pos.
    static constexpr int kQOffset = kTilesBytes;
    static constexpr int kSOffset = kQOffset + ROWS * HK * int(sizeof(Acc));
    static constexpr int kRowOffset = kSOffset + ROWS * kKeys * int(sizeof(Acc));
    static constexpr int kBytes = kRowOffset + ROWS * (4 * int(sizeof(Acc)) + 3 * int(sizeof(int)));

    static_assert(HK % kVec == 0 && HV % kVec == 0, "head dims are whole 16-byte chunks");
    static_assert(kKeys >= 4 && kKeys <= kThreads && kThreads % kKeys == 0, "keys tile the threads");
    static_assert(kSplit <= 32 && kChunksK % kSplit == 0, "a key's threads share a warp and its chunks");
    static_assert(kChunksV <= kThreads && kThreads % kChunksV == 0, "every V chunk has its threads");
    static_assert(kReduceRows >= 1, "a row of partial O fits the stages");
    static_assert(ROWS * kDecodeMaxSplits * int(sizeof(Acc)) <= kTilesBytes, "the merge's weights fit the stages");
    static_assert(kBytes <= 227 * 1024, "shared memory of one block on sm_90");
};

// Row `key` of sequence b's K or V cache for KV head hk: contiguous (B, Hk, Lmax, D) or
// paged through the block table (num_blocks, Hk, page, D).
template <typename T>
__device__ __forceinline__ const T* cache_row(const DecodeParams& p, const T* base, i64 sb, i64 sh, i64 sr,
                                              int b, int hk, int key) {
    if (p.block_table == nullptr) return base + b * sb + hk * sh + key * sr;
    const i64 block = p.block_table[b * p.bt_sb + key / p.page];
    return base + block * sb + hk * sh + (key % p.page) * sr;
}

// Whether every table entry that sequence b's keys [lo, hi) lie in names a block of the paged
// cache (always, contiguous), for the whole thread block: a device table is not read back by
// the host, so the split kernels check the entries they will use once, before their key loop,
// and read nothing for a sequence with a bad one.
__device__ __forceinline__ bool blocks_named(const DecodeParams& p, int b, int lo, int hi) {
    bool ok = true;
    if (p.block_table != nullptr && hi > lo) {
        for (int slot = lo / p.page + threadIdx.x; slot <= (hi - 1) / p.page; slot += blockDim.x) {
            const i64 block = p.block_table[b * p.bt_sb + slot];
            ok &= block >= 0 && block < p.num_blocks;
        }
    }
    return __syncthreads_and(ok);
}

// Where row r (< rows; r = g Lq + i) of block (b, hk) may look: keys [lo, hi), its diagonal
// key pos = i + keys - Lq (bottom-right causal and windows are measured from it) and its
// ALiBi slope * log2(e). Rows past `rows` see no key.
struct DecodeRow {
    int lo, hi, pos;
    double slope;
};

__device__ __forceinline__ DecodeRow decode_row(const DecodeParams& p, int b, int hk, int r, int rows, int keys) {
    i64 lo = 0, hi = 0, pos = 0;
    double slope = 0.0;
    if (r < rows) {
        const int group = p.hq / p.hk, i = r % p.lq, hq = hk * group + r / p.lq;
        pos = i64(i) + keys - p.lq;
        hi = keys;
        if (p.causal == kBottomRight) hi = min(hi, pos + 1);
        if (p.causal == kTopLeft) hi = min(hi, i64(i) + 1);
        if (p.window_right >= 0) hi = min(hi, pos + p.window_right + 1);
        if (p.window_left >= 0) lo = max(lo, pos - p.window_left);
        if (p.alibi != nullptr) slope = p.alibi[i64(b) * p.hq + hq] * kLog2e;
    }
    return DecodeRow{int(min(lo, i64(keys))), int(max(hi, i64(0))), int(pos), slope};
}

// The keys a block reads: its split's [split * split_keys, + split_keys) within the union of
// its rows' ranges (lo >= hi: none). Each row's hi is then cut at the block's (a barrier on
// each side): a tile that starts off the split's grid (at a window's start) runs past the
// split's end into zero-filled keys, which must not score.
__device__ __forceinline__ void decode_block_keys(const DecodeParams& p, const int* sLo, int* sHi, int rows,
                                                  int keys, int& lo, int& hi) {
    lo = keys;
    hi = 0;
    for (int r = 0; r < rows; ++r) {
        if (sLo[r] < sHi[r]) {
            lo = min(lo, sLo[r]);
            hi = max(hi, sHi[r]);
        }
    }
    lo = int(max(i64(lo), i64(blockIdx.y) * p.split_keys));
    hi = int(min(i64(hi), i64(blockIdx.y + 1) * p.split_keys));
    __syncthreads();  // every thread has read the rows' ranges
    for (int r = threadIdx.x; r < rows; r += blockDim.x) sHi[r] = min(sHi[r], hi);
    __syncthreads();
}

// A score in log2 units from q . k times q_mul: softcap, ALiBi, then the row's key range.
template <typename Acc>
__device__ __forceinline__ Acc decode_score(Acc x, bool softcap, Acc cap_log2, Acc slope, int pos, int lo, int hi,
                                            int key) {
    if (softcap) x = cap_log2 * tanh_acc(x);
    x -= slope * Acc(pos > key ? pos - key : key - pos);
    return key >= lo && key < hi ? x : neg_inf<Acc>();
}

// A block's coordinates and the score's scalars, as both split kernels read them: sequence b,
// KV head hk and split; its rows (group * Lq of them) start at out row row0 of total_rows;
// `keys` the sequence attends (none where its length is bad: below 0 or past the capacity).
// S = scale q.k, or softcap tanh(scale q.k / softcap), in log2 units: q_mul = scale * log2(e)
// (or scale / softcap, the tanh's argument), cap_log2 the softcap * log2(e) the tanh is
// multiplied by.
template <typename Acc>
struct DecodeBlock {
    int b, hk, split, group, rows, keys;
    i64 total_rows, row0;
    bool bad, softcap;
    Acc q_mul, cap_log2;

    __device__ __forceinline__ explicit DecodeBlock(const DecodeParams& p)
        : b(blockIdx.x / p.hk), hk(blockIdx.x % p.hk), split(blockIdx.y), group(p.hq / p.hk),
          rows(group * p.lq), keys(p.keys_all), total_rows(i64(p.batch) * p.hq * p.lq),
          row0((i64(b) * p.hq + i64(hk) * group) * p.lq), bad(false), softcap(p.softcap != 0.0),
          q_mul(Acc(softcap ? p.scale / p.softcap : p.scale * kLog2e)), cap_log2(Acc(p.softcap * kLog2e)) {
        if (p.keys != nullptr) {
            const i64 stored = p.keys[b], total = stored + p.keys_add;
            bad = stored < 0 || total > p.capacity;
            keys = bad ? 0 : int(total);
        }
    }
};

// counter += 1 at GPU scope, returning the count before: a release of this thread's earlier
// writes (and, through a barrier before it, its block's) and an acquire of the writes released
// by the additions before it.
__device__ __forceinline__ int count_acq_rel(int* counter) {
    int before;
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;\n" : "=r"(before) : "l"(counter) : "memory");
    return before;
}

// Whether this block is the last of its (sequence, KV head)'s splits to finish, called by
// every thread after storing its share of the block's partials. The barrier orders the
// block's stores before thread 0's count, which releases them (cumulatively) and acquires
// the earlier splits': the last block to count sees every split's partials, and its barrier
// passes them on to its threads (who read them through L2, decode_merge_splits). It zeroes
// the count for the next launch.
__device__ __forceinline__ bool decode_last_split(const DecodeParams& p) {
    __shared__ int sLast;
    __syncthreads();  // one split: the block's own partials, stored by all its threads, seen by all
    if (p.splits == 1) return true;
    if (threadIdx.x == 0) {
        sLast = count_acq_rel(p.counters + blockIdx.x) == p.splits - 1;
        if (sLast) p.counters[blockIdx.x] = 0;
    }
    __syncthreads();
    return sLast;
}

template <typename Acc> struct Acc16;  // 16 bytes of Acc, as ld.global.cg loads them
template <> struct Acc16<float> { using type = float4; };
template <> struct Acc16<double> { using type = double2; };

// A 16-byte chunk's elements (by value: taking the chunk's address would put it on the stack).
__device__ __forceinline__ void unpack(const float4& x, float (&v)[4]) {
    v[0] = x.x;
    v[1] = x.y;
    v[2] = x.z;
    v[3] = x.w;
}
__device__ __forceinline__ void unpack(const double2& x, double (&v)[2]) {
    v[0] = x.x;
    v[1] = x.y;
}

// The splits' partial rows row0 .. row0 + rows - 1 (rows <= ROWS) merged with their sinks into
// the output: lse2 = log2(2^sink + sum_s 2^lse2_s), then O = sum_s O_s w_s with the weights
// w_s = 2^(lse2_s - lse2) kept in sW (ROWS, kDecodeMaxSplits) (the block's drained stages), a
// warp a row for those and a thread a 16-byte chunk of O, eight splits' loads in flight. A
// split without keys has lse2_s = -inf and weight 0; a row no split and no sink reaches gets
// O = 0, lse = -inf; a row any split marked NaN (a bad length or block table entry) gets NaN.
// Other blocks wrote the partials during this launch: they are read through L2
// (ld.global.cg), never a stale L1 line.
template <typename T, typename Acc, int ROWS, int EARLY>
__device__ void decode_merge_splits(const DecodeParams& p, i64 row0, int rows, Acc* sW) {
    constexpr int VEC = 16 / int(sizeof(Acc));
    using Chunk = typename Acc16<Acc>::type;
    __shared__ Acc sLse2[ROWS];
    const i64 total_rows = i64(p.batch) * p.hq * p.lq;
    const Acc* gLse = static_cast<const Acc*>(p.lse_part) + row0;
    const Acc* gO = static_cast<const Acc*>(p.o_part) + row0 * p.dv;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, splits = p.splits;
    const int chunks = p.dv / VEC;  // Dv is whole 16-byte chunks of T, so of Acc
    // The first chunk of O a thread merges: its first EARLY splits' loads go out now, so they
    // wait beside the lse loads below rather than after them (the CUDA-core kernels pass 0:
    // ptxas spilled their registers for it).
    Chunk early[EARLY > 0 ? EARLY : 1];
    if (EARLY > 0 && threadIdx.x < rows * chunks) {
        const int r = threadIdx.x / chunks, c = (threadIdx.x % chunks) * VEC;
#pragma unroll
        for (int s = 0; s < EARLY; ++s)
            if (s < splits) early[s] = __ldcg(reinterpret_cast<const Chunk*>(gO + (s * total_rows + r) * p.dv + c));
    }
    for (int r = warp; r < rows; r += blockDim.x / 32) {
        Acc* w = sW + r * kDecodeMaxSplits;
        Acc mx = neg_inf<Acc>();
        bool bad = false;
        for (int s = lane; s < splits; s += 32) {
            const Acc x = __ldcg(gLse + s * total_rows + r);
            w[s] = x;
            bad |= x != x;
            mx = max(mx, x);
        }
#pragma unroll
        for (int off = 16; off > 0; off /= 2) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        bad = __any_sync(0xffffffffu, bad);
        const Acc sink = p.sinks != nullptr ? Acc(p.sinks[(row0 + r) / p.lq] * kLog2e) : neg_inf<Acc>();
        bad |= sink != sink;  // a NaN sink reaches its rows (max() would drop it), as with one split
        mx = max(mx, sink);
        const Acc base = mx == neg_inf<Acc>() ? Acc(0) : mx;
        Acc sum = lane == 0 ? softmax_exp2(sink - base) : Acc(0);
        for (int s = lane; s < splits; s += 32) sum += softmax_exp2(w[s] - base);
#pragma unroll
        for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        const Acc lse2 = bad ? quiet_nan<Acc>() : sum > Acc(0) ? base + log2_acc(sum) : neg_inf<Acc>();
        // w_s; 0 for every split of a row without keys (and NaN, unread, for a bad row)
        for (int s = lane; s < splits; s += 32) w[s] = lse2 > neg_inf<Acc>() ? softmax_exp2(w[s] - lse2) : Acc(0);
        if (lane == 0) sLse2[r] = lse2;
    }
    __syncthreads();
    T* out = static_cast<T*>(p.o) + row0 * p.dv;
    for (int e = threadIdx.x; e < rows * chunks; e += blockDim.x) {
        const int r = e / chunks, c = (e % chunks) * VEC;
        const Acc* w = sW + r * kDecodeMaxSplits;
        Acc o[VEC] = {};
        auto add = [&](Chunk x, int s) {
            Acc xv[VEC];
            unpack(x, xv);
#pragma unroll
            for (int v = 0; v < VEC; ++v) o[v] += w[s] * xv[v];
        };
        int s = 0;
        if (EARLY > 0 && e == threadIdx.x) {  // the chunk loaded early
#pragma unroll
            for (int j = 0; j < EARLY; ++j)
                if (j < splits) add(early[j], j);
            s = EARLY;
        }
#pragma unroll 8
        for (; s < splits; ++s) add(__ldcg(reinterpret_cast<const Chunk*>(gO + (s * total_rows + r) * p.dv + c)), s);
        const bool bad = sLse2[r] != sLse2[r];
#pragma unroll
        for (int v = 0; v < VEC; ++v) out[i64(r) * p.dv + c + v] = static_cast<T>(bad ? quiet_nan<Acc>() : o[v]);
    }
    Acc* lse = static_cast<Acc*>(p.lse) + row0;
    for (int r = threadIdx.x; r < rows; r += blockDim.x) {
        const Acc lse2 = sLse2[r];
        lse[r] = lse2 > neg_inf<Acc>() ? lse2 / Acc(kLog2e) : lse2;  // NaN and -inf stay
    }
}

template <typename T, int HK, int HV, int ROWS, int SMEM_BYTES>
__global__ void __launch_bounds__(128) decode_split(const DecodeParams p) {
    using Shape = DecodeShape<T, HK, HV, ROWS>;
    using Acc = typename Shape::Acc;
    constexpr int THREADS = Shape::kThreads, KEYS = Shape::kKeys, VEC = Shape::kVec, STAGES = Shape::kStages;
    constexpr int SPLIT = Shape::kSplit, GROUPS = Shape::kGroups;
    constexpr int CK = Shape::kChunksK, CV = Shape::kChunksV, RC = Shape::kReduceRows;
    static_assert(SMEM_BYTES == Shape::kBytes, "the host launches with the kernel's shared memory");
    struct alignas(16) Raw { T v[VEC]; };      // one 16-byte chunk of K or V
    struct alignas(16) Chunk { Acc v[VEC]; };  // one chunk widened (q, partial O)

    extern __shared__ __align__(16) unsigned char smem[];
    Acc* sQ = reinterpret_cast<Acc*>(smem + Shape::kQOffset);      // (ROWS, HK) q * scale * log2(e)
    Acc* sS = reinterpret_cast<Acc*>(smem + Shape::kSOffset);      // (ROWS, KEYS) scores, then P
    Acc* sM = reinterpret_cast<Acc*>(smem + Shape::kRowOffset);    // (ROWS) running max, log2 domain
    Acc* sL = sM + ROWS;                                           // running sum of P
    Acc* sAlpha = sL + ROWS;                                       // this tile's rescale of O and l
    Acc* sSlope = sAlpha + ROWS;                                   // ALiBi slope * log2(e)
    int* sLo = reinterpret_cast<int*>(sSlope + ROWS);              // keys [lo, hi) a row may see
    int* sHi = sLo + ROWS;
    int* sPos = sHi + ROWS;                                        // i + keys - Lq: the row's diagonal key

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const DecodeBlock<Acc> blk(p);
    const int b = blk.b, hk = blk.hk, split = blk.split, group = blk.group, rows = blk.rows, keys = blk.keys;
    const i64 total_rows = blk.total_rows, row0 = blk.row0;
    const bool softcap = blk.softcap;
    const Acc q_mul = blk.q_mul, cap_log2 = blk.cap_log2;
    const T* gQ = static_cast<const T*>(p.q);
    const T* gK = static_cast<const T*>(p.k);
    const T* gV = static_cast<const T*>(p.v);

    for (int r = tid; r < ROWS; r += THREADS) {
        const DecodeRow row = decode_row(p, b, hk, r, rows, keys);
        sLo[r] = row.lo;
        sHi[r] = row.hi;
        sPos[r] = row.pos;
        sSlope[r] = Acc(row.slope);
        sM[r] = neg_inf<Acc>();
        sL[r] = Acc(0);
    }
    // q * scale * log2(e) (ROWS, HK) to shared memory, up to 8 loads of a thread out before
    // their stores (as decode_split_mma's Q: a store between two loads holds the next back).
    constexpr int Q_EACH = (ROWS * HK + THREADS - 1) / THREADS, Q_BATCH = Q_EACH < 8 ? Q_EACH : 8;
    for (int j0 = 0; j0 < Q_EACH; j0 += Q_BATCH) {
        Acc x[Q_BATCH];
#pragma unroll
        for (int j = 0; j < Q_BATCH; ++j) {
            const int e = tid + (j0 + j) * THREADS, r = e / HK, c = e % HK;
            x[j] = 0;
            if (r < rows && c < p.d) {
                const int i = r % p.lq, hq = hk * group + r / p.lq;
                x[j] = widen(gQ[i64(b) * p.q_sb + i64(hq) * p.q_sh + i64(i) * p.q_sr + c]) * q_mul;
            }
        }
#pragma unroll
        for (int j = 0; j < Q_BATCH; ++j)
            if (tid + (j0 + j) * THREADS < ROWS * HK) sQ[tid + (j0 + j) * THREADS] = x[j];
    }
    __syncthreads();

    int lo, hi;
    decode_block_keys(p, sLo, sHi, rows, keys, lo, hi);
    const bool bad = blk.bad || !blocks_named(p, b, lo, hi);  // a bad length or table entry: no key read
    if (bad) hi = lo;
    const int tiles = hi > lo ? (hi - lo + KEYS - 1) / KEYS : 0;

    // Tile t's keys [lo + t KEYS, ...) into stage s: rows past hi and columns past d (dv) zero.
    auto load_tile = [&](int t, int s) {
        unsigned char* sK = smem + s * Shape::kStageBytes;
        unsigned char* sV = sK + KEYS * Shape::kPitchK;
        const int k0 = lo + t * KEYS;
#pragma unroll
        for (int c = tid; c < KEYS * CK; c += THREADS) {
            const int kk = c / CK, ch = c % CK, key = k0 + kk;
            const bool valid = key < hi && ch * VEC < p.d;
            const T* src = valid ? cache_row(p, gK, p.k_sb, p.k_sh, p.k_sr, b, hk, key) + ch * VEC : gK;
            cp_async_16(sK + kk * Shape::kPitchK + ch * 16, src, valid);
        }
#pragma unroll
        for (int c = tid; c < KEYS * CV; c += THREADS) {
            const int kk = c / CV, ch = c % CV, key = k0 + kk;
            const bool valid = key < hi && ch * VEC < p.dv;
            const T* src = valid ? cache_row(p, gV, p.v_sb, p.v_sh, p.v_sr, b, hk, key) + ch * VEC : gV;
            cp_async_16(sV + kk * Shape::kPitchV + ch * 16, src, valid);
        }
    };

#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < tiles) load_tile(t, t);
        cp_async_commit();
    }

    const int v_chunk = tid % CV, v_group = tid / CV;  // O += P V: this thread's V chunk and keys
    Acc rO[ROWS][VEC];                                  // (ROWS, VEC) its share of O, unnormalised
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int e = 0; e < VEC; ++e) rO[r][e] = Acc(0);

    for (int t = 0; t < tiles; ++t) {
        cp_async_wait<STAGES - 2>();
        __syncthreads();  // tile t landed; every thread is done with tile t - 1's stage and P
        if (t + STAGES - 1 < tiles) load_tile(t + STAGES - 1, (t + STAGES - 1) % STAGES);
        cp_async_commit();
        const unsigned char* sK = smem + (t % STAGES) * Shape::kStageBytes;
        const unsigned char* sV = sK + KEYS * Shape::kPitchK;
        const int k0 = lo + t * KEYS;

        {  // S = q . k: SPLIT threads a key, each every SPLIT-th chunk, summed by a butterfly
            const bool owner = tid / SPLIT < KEYS;  // threads past the tile's keys compute key 0's again
            const int kk = owner ? tid / SPLIT : 0, part = tid % SPLIT;
            Acc rS[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) rS[r] = Acc(0);
#pragma unroll
            for (int n = 0; n < CK / SPLIT; ++n) {
                const int ch = part + n * SPLIT;
                const Raw rK = *reinterpret_cast<const Raw*>(sK + kk * Shape::kPitchK + ch * 16);
                Acc k_e[VEC];
#pragma unroll
                for (int e = 0; e < VEC; ++e) k_e[e] = widen(rK.v[e]);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    const Chunk q = *reinterpret_cast<const Chunk*>(sQ + r * HK + ch * VEC);
#pragma unroll
                    for (int e = 0; e < VEC; ++e) rS[r] += q.v[e] * k_e[e];
                }
            }
#pragma unroll
            for (int off = 1; off < SPLIT; off *= 2)
#pragma unroll
                for (int r = 0; r < ROWS; ++r) rS[r] += __shfl_xor_sync(0xffffffffu, rS[r], off);
            const int key = k0 + kk;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                if (!owner || r % SPLIT != part) continue;
                sS[r * KEYS + kk] = decode_score(rS[r], softcap, cap_log2, sSlope[r], sPos[r], sLo[r], sHi[r], key);
            }
        }
        __syncthreads();

        // Online softmax, a warp a row: m' = max(m, max_j S), P = exp2(S - m'), alpha = exp2(m - m'),
        // l' = alpha l + sum_j P. A row with no key yet keeps m = -inf and takes exp2(x - 0) = 0.
        for (int r = warp; r < ROWS; r += Shape::kWarps) {
            Acc mx = neg_inf<Acc>();
            for (int j = lane; j < KEYS; j += 32) mx = max(mx, sS[r * KEYS + j]);
#pragma unroll
            for (int off = 16; off > 0; off /= 2) mx = max(mx, __shfl_xor_sync(0xffffffffu, mx, off));
            const Acc m_old = sM[r], m_new = max(m_old, mx);
            const Acc base = m_new == neg_inf<Acc>() ? Acc(0) : m_new;
            Acc sum = 0;
            for (int j = lane; j < KEYS; j += 32) {
                const Acc pj = softmax_exp2(sS[r * KEYS + j] - base);
                sS[r * KEYS + j] = pj;
                sum += pj;
            }
#pragma unroll
            for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
            __syncwarp();
            if (lane == 0) {
                const Acc alpha = softmax_exp2(m_old - base);
                sAlpha[r] = alpha;
                sL[r] = sL[r] * alpha + sum;
                sM[r] = m_new;
            }
        }
        __syncthreads();

        // O = alpha O + P V over this thread's keys of the tile (every GROUPS-th).
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const Acc alpha = sAlpha[r];
#pragma unroll
            for (int e = 0; e < VEC; ++e) rO[r][e] *= alpha;
        }
        for (int j = v_group; j < KEYS; j += GROUPS) {
            const Raw rV = *reinterpret_cast<const Raw*>(sV + j * Shape::kPitchV + v_chunk * 16);
            Acc v_e[VEC];
#pragma unroll
            for (int e = 0; e < VEC; ++e) v_e[e] = widen(rV.v[e]);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                const Acc pj = sS[r * KEYS + j];
#pragma unroll
                for (int e = 0; e < VEC; ++e) rO[r][e] += pj * v_e[e];
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();

    // The key groups' shares of O added in a fixed order (the result does not depend on
    // scheduling), RC rows a pass through the drained stages: (GROUPS, RC, HV).
    Acc* sRed = reinterpret_cast<Acc*>(smem);
    Acc* gO = static_cast<Acc*>(p.o_part) + (i64(split) * total_rows + row0) * p.dv;
#pragma unroll
    for (int r0 = 0; r0 < ROWS; r0 += RC) {
#pragma unroll
        for (int rr = 0; rr < RC; ++rr) {
            if (r0 + rr < ROWS) {
                Chunk c;
#pragma unroll
                for (int e = 0; e < VEC; ++e) c.v[e] = rO[r0 + rr][e];
                *reinterpret_cast<Chunk*>(sRed + (v_group * RC + rr) * HV + v_chunk * VEC) = c;
            }
        }
        __syncthreads();
        for (int e = tid; e < RC * HV; e += THREADS) {
            const int rr = e / HV, c = e % HV, r = r0 + rr;
            if (r < rows && c < p.dv) {
                Acc o = 0;
                for (int g = 0; g < GROUPS; ++g) o += sRed[(g * RC + rr) * HV + c];
                const Acc l = sL[r];
                gO[i64(r) * p.dv + c] = bad ? quiet_nan<Acc>() : l > Acc(0) ? o / l : Acc(0);
            }
        }
        __syncthreads();
    }
    Acc* gLse = static_cast<Acc*>(p.lse_part) + i64(split) * total_rows + row0;
    for (int r = tid; r < rows; r += THREADS) {
        const Acc l = sL[r];
        gLse[r] = bad ? quiet_nan<Acc>() : l > Acc(0) ? sM[r] + log2_acc(l) : neg_inf<Acc>();
    }
    if (decode_last_split(p)) decode_merge_splits<T, Acc, ROWS, 0>(p, row0, rows, reinterpret_cast<Acc*>(smem));
}

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800  // mma.sync m16n8k16 and ldmatrix: sm_80+

// The tile shapes and shared-memory layout of decode_split_mma (16-bit inputs), decided here
// once; the host (flashcupy/cuda/decode.py) launches with SMEM_BYTES = kBytes. TMA: K and V
// tiles come by tensor copies (sm_90+, head dims of whole 64-column boxes) as Sw128Tile slabs
// (a copy's box each), each warp's stages completing on its own mbarriers; otherwise by
// cp.async into PaddedTile rows.
template <typename T, int HK, int HV, bool TMA>
struct DecodeMmaShape {
    static constexpr int kWarps = 4;
    static constexpr int kThreads = 32 * kWarps;
    static constexpr int kRows = 16;  // one m16 row tile holds the block's G * Lq rows
    static constexpr int kKeys = 16;  // keys a warp's tile
    static constexpr int kVec = 16 / int(sizeof(T));
    using KTile = typename TileKind<TMA>::template type<T, kKeys, HK>;  // (kKeys, HK)
    using VTile = typename TileKind<TMA>::template type<T, kKeys, HV>;  // (kKeys, HV)
    static constexpr int kKBytes = KTile::ELEMS * int(sizeof(T)), kVBytes = VTile::ELEMS * int(sizeof(T));
    static constexpr int kStageBytes = kKBytes + kVBytes;
    // Stages a warp: two tiles in flight behind the one in use, two at D 256 (the block's
    // shared memory stays under one SM's).
    static constexpr int kStages = HK + HV > 256 ? 2 : 3;
    static constexpr int kWarpBytes = kStages * kStageBytes;
    static constexpr int kTilesBytes = kWarps * kWarpBytes;
    // After the loop: each warp's O (kRows, HV) at a pitch of kOPitch floats, m and l (kRows)
    // in float, over the stages. The pitch is 8 floats (a half-warp's 16 float2 stores: rows
    // g = 0..3, columns t2) past a multiple of 32 banks, so those stores fall in 32 banks.
    static constexpr int kOPitch = HV + 8;
    static constexpr int kMergeBytes = kWarps * kRows * (kOPitch + 2) * 4;
    static constexpr int kQOffset = kTilesBytes > kMergeBytes ? kTilesBytes : kMergeBytes;
    static constexpr int kLdQ = HK + kVec;  // Q's pitch in elements (padded as PaddedTile)
    static constexpr int kRowOffset = kQOffset + kRows * kLdQ * int(sizeof(T));
    // Per row: ALiBi slope (float), lo, hi, pos (int); then, TMA, a barrier a warp's stage.
    static constexpr int kBarOffset = kRowOffset + kRows * 4 * 4;
    static constexpr int kBytes = smem_bytes<TMA>(kBarOffset + (TMA ? kWarps * kStages * 8 : 0));

    static_assert(sizeof(T) == 2, "mma.sync m16n8k16 takes 16-bit inputs");
    static_assert(kRows * kDecodeMaxSplits * 4 <= kTilesBytes, "the merge's weights fit the stages");
    static_assert(HK % 16 == 0 && HV % 16 == 0, "m16n8k16 tiles");
    static_assert(kStageBytes % (TMA ? 1024 : 16) == 0 && kBarOffset % 8 == 0, "stages keep the tiles' alignment");
    static_assert(kBytes <= 227 * 1024, "shared memory of one block on sm_90");
};

// The K and V tensor maps of a TMA decode kernel (a __grid_constant__ parameter; zero and
// unread otherwise): 4-d (D, rows, Hk, B) over a contiguous cache or (D, page, Hk, num_blocks)
// over a paged one, boxes of (64, 16, 1, 1) with the 128-byte swizzle.
struct DecodeMaps {
    TensorMap k, v;
};

// Where a warp's tile of keys k0 .. k0 + KEYS - 1 starts in the cache: the sequence (or, paged,
// the physical block) and row of key k0, and whether the tile's rows are one run of memory
// (always when contiguous; paged, unless the tile crosses a block boundary). One block-table
// read a tile serves K and V.
struct TileStart {
    i64 block;
    int row;
    bool run;
};

template <int KEYS>
__device__ __forceinline__ TileStart tile_start(const DecodeParams& p, int b, int k0) {
    if (p.block_table == nullptr) return TileStart{b, k0, true};
    const int row = k0 % p.page;
    return TileStart{p.block_table[b * p.bt_sb + k0 / p.page], row, row + KEYS <= p.page};
}

// Rows k0 .. k0 + KEYS - 1 (those below hi; the rest zero) of a K or V cache, H columns (those
// below cols; the rest zero), into a Tile at dst by one warp through cp.async: each copy
// instruction covers whole rows (32 / chunks-a-row of them), so L2 sees full 128-byte lines
// rather than a sector of each of 16 rows.
template <typename T, int H, int KEYS, typename Tile>
__device__ __forceinline__ void copy_rows(const DecodeParams& p, unsigned char* dst, const T* base, i64 sb, i64 sh,
                                          i64 sr, int cols, int b, int hk, int k0, int hi, TileStart start) {
    constexpr int VEC = 16 / int(sizeof(T)), CPR = H / VEC, RPI = 32 / CPR;  // chunks a row, rows an instruction
    static_assert(CPR <= 32 && KEYS % RPI == 0, "whole rows an instruction");
    const int lane = threadIdx.x % 32, ch = lane % CPR, r0 = lane / CPR;
    const T* first = base + start.block * sb + hk * sh + i64(start.row) * sr + ch * VEC;
    if (start.run && k0 + KEYS <= hi && ch * VEC < cols) {
        // The steady state: one run of rows, all in range. A fixed step between this lane's
        // copies, no per-row test or 64-bit product (they had cost more instructions than
        // the rest of a tile's work).
        const T* src = first + r0 * sr;
        const i64 step = RPI * sr;
#pragma unroll
        for (int i = 0; i < KEYS / RPI; ++i, src += step) cp_async_16(dst + Tile::chunk_offset(r0 + i * RPI, ch), src, true);
        return;
    }
#pragma unroll
    for (int i = 0; i < KEYS / RPI; ++i) {
        const int r = r0 + i * RPI, key = k0 + r;
        const bool ok = key < hi && ch * VEC < cols;
        const T* src = !ok ? base : start.run ? first + r * sr : cache_row(p, base, sb, sh, sr, b, hk, key) + ch * VEC;
        cp_async_16(dst + Tile::chunk_offset(r, ch), src, ok);
    }
}

template <typename T, int HK, int HV, bool TMA, int SMEM_BYTES>
__global__ void __launch_bounds__(128) decode_split_mma(const DecodeParams p, const __grid_constant__ DecodeMaps maps) {
    using Shape = DecodeMmaShape<T, HK, HV, TMA>;
    using KTile = typename Shape::KTile;
    using VTile = typename Shape::VTile;
    constexpr int WARPS = Shape::kWarps, KEYS = Shape::kKeys, STAGES = Shape::kStages;
    constexpr int ROWS = Shape::kRows, LDQ = Shape::kLdQ;
    static_assert(SMEM_BYTES == Shape::kBytes, "the host launches with the kernel's shared memory");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
    static_assert(!TMA, "tensor copies need sm_90");
#endif

    extern __shared__ __align__(16) unsigned char smem_raw[];
    // TMA: tiles from the first 1024-byte boundary (as tiles_base; written out here because
    // ptxas allocated the kernel 168 registers and 20 bytes of spills through that call).
    unsigned char* smem = smem_raw + (TMA ? (1024 - shared_u32(smem_raw) % 1024) % 1024 : 0);
    T* sQ = reinterpret_cast<T*>(smem + Shape::kQOffset);            // (ROWS, LDQ) q, zero past rows and d
    float* sSlope = reinterpret_cast<float*>(smem + Shape::kRowOffset);
    int* sLo = reinterpret_cast<int*>(sSlope + ROWS);
    int* sHi = sLo + ROWS;
    int* sPos = sHi + ROWS;

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (TMA) {
        if (tid == 0) {
            prefetch_tensor_map(&maps.k);
            prefetch_tensor_map(&maps.v);
        }
    }
#endif
    const DecodeBlock<float> blk(p);
    const int b = blk.b, hk = blk.hk, split = blk.split, group = blk.group, rows = blk.rows, keys = blk.keys;
    const i64 total_rows = blk.total_rows, row0 = blk.row0;
    const bool softcap = blk.softcap;
    const float q_mul = blk.q_mul, cap_log2 = blk.cap_log2;
    const T* gQ = static_cast<const T*>(p.q);
    const T* gK = static_cast<const T*>(p.k);
    const T* gV = static_cast<const T*>(p.v);
    // This warp's stage barriers (TMA): stage s of the warp's n-th tile is n % STAGES, its
    // phase parity (n / STAGES) & 1.
    const u32 bars = shared_u32(smem + Shape::kBarOffset) + 8 * STAGES * warp;

    if (tid < ROWS) {
        const DecodeRow row = decode_row(p, b, hk, tid, rows, keys);
        sLo[tid] = row.lo;
        sHi[tid] = row.hi;
        sPos[tid] = row.pos;
        sSlope[tid] = float(row.slope);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if constexpr (TMA) {
        if (lane < STAGES) mbarrier_init(bars + 8 * lane, 1);
        mbarrier_init_fence();
    }
#endif
    __syncthreads();
    int lo, hi;
    decode_block_keys(p, sLo, sHi, rows, keys, lo, hi);
    // Keys every row sees, within the block's: a tile inside them, without softcap and ALiBi,
    // takes S = scale q.k (no key of it is masked or past the split).
    int all_lo = 0, all_hi = hi;
    for (int r = 0; r < rows; ++r) {
        all_lo = max(all_lo, sLo[r]);
        all_hi = min(all_hi, sHi[r]);
    }
    const bool plain_block = !softcap && p.alibi == nullptr;
    const bool bad = blk.bad || !blocks_named(p, b, lo, hi);  // a bad length or table entry: no key read
    if (bad) hi = lo;
    const int tiles = hi > lo ? (hi - lo + KEYS - 1) / KEYS : 0;
    const int mine = tiles > warp ? (tiles - warp + WARPS - 1) / WARPS : 0;  // tiles warp, warp + WARPS, ...

    // This warp's n-th tile of K and V into stage s. TMA: a tile of whole rows inside the
    // sequence and one run of memory is two tensor copies' boxes per 64 columns, by lane 0; a
    // tail tile (rows past hi, which must read as zeros, not as whatever the cache holds
    // there) or one crossing a page goes through cp.async, every lane's copies arriving on
    // the stage's barrier when they land.
    unsigned char* sWarp = smem + warp * Shape::kWarpBytes;
    auto load_tile = [&](int n, int s) {
        unsigned char* sK = sWarp + s * Shape::kStageBytes;
        unsigned char* sV = sK + Shape::kKBytes;
        const int k0 = lo + (warp + n * WARPS) * KEYS;
        const TileStart start = tile_start<KEYS>(p, b, k0);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if constexpr (TMA) {
            const u32 bar = bars + 8 * s;
            if (start.run && k0 + KEYS <= hi) {
                if (lane == 0) {
                    fence_proxy_async_shared();  // the stage's earlier reads and cp.async writes come first
                    mbarrier_arrive_expect(bar, Shape::kStageBytes);
#pragma unroll
                    for (int c = 0; c < HK; c += KTile::SLAB_COLS)  // a box a slab
                        tma_load_4d(shared_u32(sK + 2 * KTile::column(c)), &maps.k, c, start.row, hk, int(start.block),
                                    bar);
#pragma unroll
                    for (int c = 0; c < HV; c += VTile::SLAB_COLS)
                        tma_load_4d(shared_u32(sV + 2 * VTile::column(c)), &maps.v, c, start.row, hk, int(start.block),
                                    bar);
                }
                return;
            }
        }
#endif
        copy_rows<T, HK, KEYS, KTile>(p, sK, gK, p.k_sb, p.k_sh, p.k_sr, p.d, b, hk, k0, hi, start);
        copy_rows<T, HV, KEYS, VTile>(p, sV, gV, p.v_sb, p.v_sh, p.v_sr, p.dv, b, hk, k0, hi, start);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if constexpr (TMA) {
            cp_async_mbarrier_arrive(bars + 8 * s);
            __syncwarp();  // every lane's tracked arrival is counted before lane 0's own
            if (lane == 0) mbarrier_arrive(bars + 8 * s);
        }
#endif
    };
    // Waits for this warp's n-th tile (stage n % STAGES).
    auto wait_tile = [&](int n) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        if constexpr (TMA) {
            mbarrier_wait(bars + 8 * (n % STAGES), (n / STAGES) & 1);
            return;
        }
#endif
        cp_async_wait<STAGES - 2>();
    };
    auto commit = [&] {
        if constexpr (!TMA) cp_async_commit();
    };
#pragma unroll
    for (int n = 0; n < STAGES - 1; ++n) {
        if (n < mine) load_tile(n, n);
        commit();
    }
    // Q (ROWS, LDQ) to shared memory while the first tiles are in flight: the two waits
    // overlap. Every load goes out before any store, so the loads wait together: a store to
    // sQ between two of them held the next one back (the compiler cannot tell sQ from gQ),
    // one memory round trip each.
    constexpr int Q_EACH = (ROWS * LDQ + Shape::kThreads - 1) / Shape::kThreads;
    T rQin[Q_EACH];
#pragma unroll
    for (int j = 0; j < Q_EACH; ++j) {
        const int e = tid + j * Shape::kThreads, r = e / LDQ, c = e % LDQ;
        rQin[j] = T(0.0f);
        if (r < rows && c < p.d) {
            const int i = r % p.lq, hq = hk * group + r / p.lq;
            rQin[j] = gQ[i64(b) * p.q_sb + i64(hq) * p.q_sh + i64(i) * p.q_sr + c];
        }
    }
#pragma unroll
    for (int j = 0; j < Q_EACH; ++j)
        if (tid + j * Shape::kThreads < ROWS * LDQ) sQ[tid + j * Shape::kThreads] = rQin[j];
    __syncthreads();

    // Accumulator fragments: lane holds rows g = lane / 4 and g + 8, columns 2 (lane % 4) (+1)
    // of each 8-wide tile: S (16, 16), O (16, HV).
    const int g = lane / 4, t2 = 2 * (lane % 4);
    float rO[1][HV / 8][4];
    zero_acc(rO);
    float m[2] = {neg_inf<float>(), neg_inf<float>()}, l[2] = {0.0f, 0.0f};
    // Q's A fragments, loaded once where registers allow (HK <= 128: up to 32 of them, beside
    // an O of at most 128 - HK columns' worth: at HK 128 with HV 256 they spilled 8 bytes),
    // else read from shared memory each tile.
    constexpr bool kQInRegisters = HK <= 128 && HK + HV <= 256;
    auto q_frag = [&](u32 (&a)[4], int kk) { ldmatrix_x4(a, sQ + (lane & 15) * LDQ + 16 * kk + (lane >> 4) * 8); };
    u32 rQ[kQInRegisters ? HK / 16 : 1][4];
    if constexpr (kQInRegisters) {
#pragma unroll
        for (int kk = 0; kk < HK / 16; ++kk) q_frag(rQ[kk], kk);
    }
    const float slope[2] = {sSlope[g], sSlope[g + 8]};
    const int pos[2] = {sPos[g], sPos[g + 8]}, rlo[2] = {sLo[g], sLo[g + 8]}, rhi[2] = {sHi[g], sHi[g + 8]};

    for (int n = 0; n < mine; ++n) {
        wait_tile(n);
        __syncwarp();  // the tile's rows, copied by every lane, seen by all; the stage refilled below is free
        if (n + STAGES - 1 < mine) load_tile(n + STAGES - 1, (n + STAGES - 1) % STAGES);
        commit();
        const unsigned char* sK = sWarp + (n % STAGES) * Shape::kStageBytes;
        const unsigned char* sV = sK + Shape::kKBytes;
        const int k0 = lo + (warp + n * WARPS) * KEYS;

        float rS[1][KEYS / 8][4];  // S = Q K^T (16, 16)
        zero_acc(rS);
#pragma unroll
        for (int kk = 0; kk < HK / 16; ++kk) {
            u32 rK[4];  // K rows 0-15: matrices (keys 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15)
            ldmatrix_x4(rK, sK + KTile::chunk_offset((lane & 7) + (lane >> 4) * 8, 2 * kk + ((lane >> 3) & 1)));
            u32 rQk[4];
            if constexpr (!kQInRegisters) q_frag(rQk, kk);
            const u32(&a)[4] = kQInRegisters ? rQ[kQInRegisters ? kk : 0] : rQk;
            MmaF16Types<T>::mma(rS[0][0], a, rK[0], rK[1]);
            MmaF16Types<T>::mma(rS[0][1], a, rK[2], rK[3]);
        }
        float mx[2] = {neg_inf<float>(), neg_inf<float>()};
        const bool plain = plain_block && k0 >= all_lo && k0 + KEYS <= all_hi;  // no score needs more than the scale
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int h = e / 2, key = k0 + 8 * j + t2 + e % 2;
                rS[0][j][e] = plain ? rS[0][j][e] * q_mul
                                    : decode_score(rS[0][j][e] * q_mul, softcap, cap_log2, slope[h], pos[h], rlo[h],
                                                   rhi[h], key);
                mx[h] = max(mx[h], rS[0][j][e]);
            }
        // m' = max(m, the row's max over the quad's lanes); P = exp2(S - m'); alpha = exp2(m - m').
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = max(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = max(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float m_new = max(m[h], mx[h]);
            const float base = m_new == neg_inf<float>() ? 0.0f : m_new;
            alpha[h] = softmax_exp2(m[h] - base);
            m[h] = m_new;
            mx[h] = base;
        }
        float sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int j = 0; j < KEYS / 8; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                rS[0][j][e] = softmax_exp2(rS[0][j][e] - mx[e / 2]);
                sum[e / 2] += rS[0][j][e];
            }
#pragma unroll
        for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + sum[h];  // this lane's columns; the quad sums at the end
        if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {  // a row's max moved
#pragma unroll
            for (int j = 0; j < HV / 8; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) rO[0][j][e] *= alpha[e / 2];
        }
        // O += P V: P (16, 16) in T as an A fragment; V^T through ldmatrix.trans, matrices
        // (keys 0-7, d 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15) of each 16 columns.
        typename MmaF16<T, 1>::template PFrag<KEYS> rP;
        MmaF16<T, 1>::template pack_p<KEYS>(rS, rP);
#pragma unroll
        for (int np = 0; np < HV / 16; ++np) {
            u32 rV[4];
            ldmatrix_x4_trans(rV, sV + VTile::chunk_offset((lane & 7) + ((lane >> 3) & 1) * 8, 2 * np + (lane >> 4)));
            MmaF16Types<T>::mma(rO[0][2 * np], rP[0][0], rV[0], rV[1]);
            MmaF16Types<T>::mma(rO[0][2 * np + 1], rP[0][0], rV[2], rV[3]);
        }
    }
    if constexpr (!TMA) cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
    __syncthreads();  // every warp is done with its stages: they hold the merge now

    // Each warp's (m, l, O) to shared memory, then per row: M = max_w m_w, weights 2^(m_w - M),
    // O = sum_w O_w 2^(m_w - M) / L with L = sum_w l_w 2^(m_w - M), in a fixed order.
    constexpr int OP = Shape::kOPitch;
    float* sO = reinterpret_cast<float*>(smem);   // (WARPS, ROWS, OP)
    float* sM = sO + WARPS * ROWS * OP;           // (WARPS, ROWS)
    float* sL = sM + WARPS * ROWS;
#pragma unroll
    for (int j = 0; j < HV / 8; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            *reinterpret_cast<float2*>(sO + (warp * ROWS + g + 8 * h) * OP + 8 * j + t2) =
                make_float2(rO[0][j][2 * h], rO[0][j][2 * h + 1]);
    if (lane % 4 == 0) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            sM[warp * ROWS + g + 8 * h] = m[h];
            sL[warp * ROWS + g + 8 * h] = l[h];
        }
    }
    __syncthreads();
    // Row r's merge weights of the warps, 2^(m_w - M) with M the row's max (0 where every m_w
    // is -inf); returns L = sum_w l_w 2^(m_w - M) and sets `base` to M.
    auto weights = [&](int r, float (&wgt)[WARPS], float& base) {
        float mr = neg_inf<float>();
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mr = max(mr, sM[w * ROWS + r]);
        base = mr == neg_inf<float>() ? 0.0f : mr;
        float lr = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            wgt[w] = softmax_exp2(sM[w * ROWS + r] - base);
            lr += wgt[w] * sL[w * ROWS + r];
        }
        return lr;
    };
    // Row r's lse2 over the block's keys, log2(L) + M (-inf without keys; NaN for a bad block).
    auto own_lse2 = [&](int r, float lr, float base) {
        return bad ? quiet_nan<float>() : lr > 0.0f ? base + log2_acc(lr) : neg_inf<float>();
    };
    // One split: the block's rows are the result, the row's sink folded in as the merge would
    // (lse2' = log2(2^sink + 2^lse2), O scaled by 2^(lse2 - lse2')), with no partials between.
    const bool whole = p.splits == 1;
    auto with_sink = [&](int r, float lse2) {
        if (p.sinks == nullptr || lse2 != lse2) return lse2;
        const float sink = float(p.sinks[(row0 + r) / p.lq] * kLog2e), top = max(sink, lse2);
        return top == neg_inf<float>() ? top : top + log2_acc(softmax_exp2(sink - top) + softmax_exp2(lse2 - top));
    };
    T* gOut = static_cast<T*>(p.o) + row0 * p.dv;
    float* gO = static_cast<float*>(p.o_part) + (i64(split) * total_rows + row0) * p.dv;
    for (int e = tid; e < ROWS * HV; e += Shape::kThreads) {
        const int r = e / HV, c = e % HV;
        if (r >= rows || c >= p.dv) continue;
        float wgt[WARPS], base;
        const float lr = weights(r, wgt, base);
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) o += wgt[w] * sO[(w * ROWS + r) * OP + c];
        o = bad ? quiet_nan<float>() : lr > 0.0f ? o / lr : 0.0f;
        if (whole) {
            const float lse2 = own_lse2(r, lr, base);
            const float scale = lr > 0.0f ? softmax_exp2(lse2 - with_sink(r, lse2)) : 0.0f;
            gOut[i64(r) * p.dv + c] = static_cast<T>(bad ? o : o * scale);
        } else {
            gO[i64(r) * p.dv + c] = o;
        }
    }
    float* gLse = whole ? static_cast<float*>(p.lse) + row0
                        : static_cast<float*>(p.lse_part) + i64(split) * total_rows + row0;
    for (int r = tid; r < rows; r += Shape::kThreads) {
        float wgt[WARPS], base;
        const float lr = weights(r, wgt, base);
        const float lse2 = own_lse2(r, lr, base);
        if (whole) {
            const float merged = with_sink(r, lse2);
            gLse[r] = merged > neg_inf<float>() ? merged / float(kLog2e) : merged;  // NaN and -inf stay
        } else {
            gLse[r] = lse2;
        }
    }
    if (!whole && decode_last_split(p))
        decode_merge_splits<T, float, ROWS, 8>(p, row0, rows, reinterpret_cast<float*>(smem));
}

#endif  // sm_80+

// New keys and values appended to the caches: k_new (B, Hk, Lnew, D) and v_new (.., Dv) into
// positions stored .. stored + Lnew - 1 of sequence b, stored its length before the call
// (keys[b], or keys_all - Lnew), through the block table when paged. Grid (B * Hk, up to 65535
// new rows a block's y stride). A sequence whose length is bad, or whose new positions fall
// in a slot naming no block, is not written at all (decode_split gives it NaN).
template <typename T>
__global__ void __launch_bounds__(128) decode_append(const DecodeParams p) {
    const int b = blockIdx.x / p.hk, hk = blockIdx.x % p.hk, added = p.keys_add;
    const i64 stored = p.keys != nullptr ? i64(p.keys[b]) : i64(p.keys_all) - added;
    if (added <= 0 || stored < 0 || stored + added > p.capacity) return;
    if (p.block_table != nullptr) {
        for (i64 slot = stored / p.page; slot <= (stored + added - 1) / p.page; ++slot) {
            const i64 block = p.block_table[b * p.bt_sb + slot];
            if (block < 0 || block >= p.num_blocks) return;
        }
    }
    T* gK = static_cast<T*>(const_cast<void*>(p.k));  // the caches, read-only to the split kernels
    T* gV = static_cast<T*>(const_cast<void*>(p.v));
    const T* gKn = static_cast<const T*>(p.k_new);
    const T* gVn = static_cast<const T*>(p.v_new);
    for (int j = blockIdx.y; j < added; j += gridDim.y) {
        const int key = int(stored + j);
        T* k_row = const_cast<T*>(cache_row<T>(p, gK, p.k_sb, p.k_sh, p.k_sr, b, hk, key));
        T* v_row = const_cast<T*>(cache_row<T>(p, gV, p.v_sb, p.v_sh, p.v_sr, b, hk, key));
        const T* k_src = gKn + b * p.kn_sb + hk * p.kn_sh + j * p.kn_sr;
        const T* v_src = gVn + b * p.vn_sb + hk * p.vn_sh + j * p.vn_sr;
        for (int c = threadIdx.x; c < p.d; c += blockDim.x) k_row[c] = k_src[c];
        for (int c = threadIdx.x; c < p.dv; c += blockDim.x) v_row[c] = v_src[c];
    }
}

}  // namespace flash
