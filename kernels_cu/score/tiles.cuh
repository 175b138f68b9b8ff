// The score modifiers' operands in shared memory: for each key tile a forward block computes,
// the (ROWS, COLS) windows of the bias and of the boolean mask that its scores read, copied
// into the same stage as the tile's K and in the same cp.async group, so they land a whole
// tile of compute before they are read; likewise for each query tile a backward dK/dV block
// visits, with its Q (rows queries, columns the block's keys, read transposed).
//
// Read from global memory per score, in the accumulator layout (8 rows of 4 column pairs a
// warp instruction, two bytes a lane), a bias or mask load stalls the softmax for a global
// round trip on every tile and takes a register per score until it lands; staged, each score
// costs a shared-memory read of its pair, and the copy moves whole 16-byte chunks.
//
// The host passes the bias and the mask as strided views with contiguous keys and 16-byte
// aligned rows (broadcast axes by zero strides; flashcupy/cuda's _score_operand copies other
// views once), and the copy is cp.async in 16-byte chunks, partial chunks at the keys' end.
// Where that does not hold (one key a row, 8-key tiles of the mask) each element is loaded
// and stored by the copying thread.
#pragma once

#include "../copy.cuh"
#include "modifiers.cuh"

namespace flash {

// Extra bytes in a kernel's shared memory: BYTES of them, 16-byte aligned, or none.
template <int BYTES> struct ExtraBytes {
    alignas(16) unsigned char bytes[BYTES];
};
template <> struct ExtraBytes<0> {};

// A mainloop's SharedStorage followed by another part's bytes (the staged score operands): the
// mainloop's tiles first, where tiles_base puts them; an empty part adds nothing (an empty base).
template <typename Base, int BYTES>
struct StorageWith : Base, ExtraBytes<BYTES> {
    __device__ __forceinline__ unsigned char* extra() {
        if constexpr (BYTES > 0) {
            return ExtraBytes<BYTES>::bytes;
        } else {
            return nullptr;
        }
    }
};

template <typename B> struct StagedBias { using type = B; };
template <> struct StagedBias<void> { using type = unsigned char; };

// The two elements at p (p even-aligned) widened to the accumulator type.
template <typename Acc, typename B>
__device__ __forceinline__ void load_pair(const B* p, Acc& a, Acc& b) {
    struct alignas(2 * sizeof(B)) Two {
        B x, y;
    };
    const Two two = *reinterpret_cast<const Two*>(p);
    a = static_cast<Acc>(widen(two.x));
    b = static_cast<Acc>(widen(two.y));
}

// A thread's view of one staged score tile of the backward's transposed accumulators (S^T:
// rows keys, columns queries): its first element (query 2 t, key g of its warp's 16 keys)
// in the bias tile (row pitch LDB elements) and the mask tile (LDM bytes).
template <typename B, int LDB, int LDM>
struct TransposedOperands {
    const B* bias;
    const unsigned char* mask;

    // The bias at (query 2 t + dc, key g + dj), widened.
    template <typename Acc>
    __device__ __forceinline__ Acc bias_at(int dc, int dj) const {
        return static_cast<Acc>(widen(bias[dc * LDB + dj]));
    }
    // Does the mask keep (query 2 t + dc, key g + dj)?
    __device__ __forceinline__ bool kept_at(int dc, int dj) const { return mask[dc * LDM + dj] != 0; }
};

// A thread's view of one staged score tile: its first element (row r0, key jt0 + 2 t of the
// accumulator layout) in the bias tile (row pitch LDB elements) and the mask tile (LDM bytes).
template <typename B, int LDB, int LDM>
struct TileOperands {
    const B* bias;
    const unsigned char* mask;

    // The bias at (row r0 + dr, keys jt0 + 2 t + dc and the next), widened.
    template <typename Acc>
    __device__ __forceinline__ void bias_pair(int dr, int dc, Acc& a, Acc& b) const {
        load_pair(bias + dr * LDB + dc, a, b);
    }
    // Bit c: the mask keeps (row r0 + dr, key jt0 + 2 t + dc + c), for c = 0, 1.
    __device__ __forceinline__ unsigned mask_pair(int dr, int dc) const {
        const unsigned two = *reinterpret_cast<const unsigned short*>(mask + dr * LDM + dc);
        return unsigned((two & 0xffu) != 0) | unsigned((two >> 8) != 0) << 1;
    }
};

// The staged operands of option set Set for (ROWS, COLS) score tiles, STAGES stages (the key
// tiles' stages). Each stage holds the bias tile (ROWS, LDB) then the mask tile (ROWS, LDM),
// rows padded by 16 bytes so that a warp's 8 rows of pairs fall on distinct banks. ROLLED:
// the element-by-element copy in a rolled loop, for kernels at the register limit (float64:
// four loads in flight spill them), else four at a time.
template <typename Set, int ROWS, int COLS, int STAGES, bool ROLLED>
struct ScoreTiles {
    static constexpr bool kBias = (Set::kMods & kModBias) != 0;
    static constexpr bool kMask = (Set::kMods & kModMask) != 0;
    static constexpr bool kAny = kBias || kMask;
    using B = typename StagedBias<typename Set::Bias>::type;
    static constexpr int LDB = COLS + 16 / static_cast<int>(sizeof(B));  // bias row pitch (elements)
    static constexpr int LDM = (COLS + 15) / 16 * 16 + 16;              // mask row pitch (bytes)
    static constexpr int kBiasBytes = kBias ? ROWS * LDB * static_cast<int>(sizeof(B)) : 0;
    static constexpr int kMaskBytes = kMask ? ROWS * LDM : 0;
    static constexpr int kStageBytes = kBiasBytes + kMaskBytes;
    static constexpr int kBytes = STAGES * kStageBytes;  // flashcupy/cuda/spec.py's score_tile_bytes
    static_assert(kBiasBytes % 16 == 0 && kMaskBytes % 16 == 0, "16-byte aligned tiles");

    unsigned char* smem;     // the stages
    const B* gB;             // bias at (row i0, key 0) of this head
    const bool* gM;          // mask at (row i0, key 0) of this head
    int valid_rows;          // rows of the tile inside q_len
    bool bias_vec, mask_vec; // cp.async in 16-byte chunks (else element by element)

    __device__ __forceinline__ ScoreTiles(const Params& p, const HeadView& hv, unsigned char* smem_, int i0,
                                          int rows_valid)
        : smem(smem_), gB(nullptr), gM(nullptr), valid_rows(rows_valid), bias_vec(false), mask_vec(false) {
        if constexpr (kBias) {
            gB = static_cast<const B*>(p.bias) + (hv.b * p.bias_sb + hv.h * p.bias_sh + i0 * p.bias_si);
            bias_vec = aligned_rows(gB, p.bias_si, p.bias_sj);
        }
        if constexpr (kMask) {
            gM = p.mask + (hv.b * p.mask_sb + hv.h * p.mask_sh + i0 * p.mask_si);
            mask_vec = COLS % 16 == 0 && aligned_rows(gM, p.mask_si, p.mask_sj);
        }
    }

    template <typename E>
    static __device__ __forceinline__ bool aligned_rows(const E* g, i64 si, i64 sj) {
        return sj == 1 && (si * static_cast<i64>(sizeof(E))) % 16 == 0 && (reinterpret_cast<u64>(g) & 15) == 0;
    }

    using Operands = TileOperands<B, LDB, LDM>;

    // Stage `stage` as seen by the thread whose first element is at row `row` of the tile
    // (counted from i0) and key 2 t.
    __device__ __forceinline__ Operands operands(int stage, int row, int t) const {
        const unsigned char* s = smem + stage * kStageBytes;
        return Operands{reinterpret_cast<const B*>(s) + row * LDB + 2 * t, s + kBiasBytes + row * LDM + 2 * t};
    }

    // Stage `stage` of `smem` as the thread of the transposed layout whose first element is at
    // query (row) 2 t and key `key` (counted from the tile's first) sees it.
    static __device__ __forceinline__ TransposedOperands<B, LDB, LDM> transposed(const unsigned char* smem, int stage,
                                                                                int t, int key) {
        if constexpr (!kAny) return {nullptr, nullptr};  // nothing staged: no stage to point into
        const unsigned char* s = smem + stage * kStageBytes;
        return {reinterpret_cast<const B*>(s) + 2 * t * LDB + key, s + kBiasBytes + 2 * t * LDM + key};
    }

    // Copies the operands of key tile j (keys [j, j + COLS), those from `keys` zero) into stage
    // `stage`, by THREADS threads; rows from valid_rows are zero. Nothing without operands; no
    // mask without `mask` (a tile the mask keeps whole: its stage's mask is not read).
    template <int THREADS>
    __device__ __forceinline__ void load(const Params& p, int stage, int j, int keys, bool mask = true,
                                         u32 tid = threadIdx.x) const {
        if constexpr (kAny) {
            unsigned char* s = smem + stage * kStageBytes;
            if constexpr (kBias) {
                copy<THREADS, B, LDB>(reinterpret_cast<B*>(s), gB + j * p.bias_sj, p.bias_si, p.bias_sj, keys,
                                      bias_vec, tid);
            }
            if constexpr (kMask) {
                if (mask) {
                    copy<THREADS, bool, LDM>(reinterpret_cast<bool*>(s + kBiasBytes), gM + j * p.mask_sj, p.mask_si,
                                             p.mask_sj, keys, mask_vec, tid);
                }
            }
        }
    }

  private:
    // (ROWS, COLS) of g (strides si, sj) into s (pitch LD), zero outside (valid_rows, keys).
    template <int THREADS, typename E, int LD>
    __device__ __forceinline__ void copy(E* s, const E* g, i64 si, i64 sj, int keys, bool vec, u32 tid) const {
        constexpr int VEC = 16 / sizeof(E);
        constexpr int CHUNKS = (COLS + VEC - 1) / VEC;  // per row
        const int cols = min(keys, COLS);
        if (vec) {
#pragma unroll 4
            for (int k = tid; k < ROWS * CHUNKS; k += THREADS) {
                const int r = k / CHUNKS, c = k % CHUNKS;
                // Bytes of the chunk inside the tile's keys: a partial chunk is zero-filled past them.
                const int bytes = r < valid_rows ? max(0, min(VEC, cols - c * VEC)) * static_cast<int>(sizeof(E)) : 0;
                cp_async_16_partial(s + r * LD + c * VEC, bytes > 0 ? g + r * si + c * VEC : g, bytes);
            }
        } else {
#pragma unroll (ROLLED ? 1 : 4)
            for (int k = tid; k < ROWS * COLS; k += THREADS) {
                const int r = k / COLS, c = k % COLS;
                s[r * LD + c] = r < valid_rows && c < cols ? g[r * si + c * sj] : E(0);
            }
        }
    }
};

// No staged operands (kAny false, no bytes): the mainloops and option sets that stage none.
using NoScoreTiles = ScoreTiles<PlainScores, 16, 16, 1, false>;

// Tiles where STAGE, else NoScoreTiles.
template <bool STAGE, typename Tiles> struct StagedOr { using type = NoScoreTiles; };
template <typename Tiles> struct StagedOr<true, Tiles> { using type = Tiles; };

}  // namespace flash
