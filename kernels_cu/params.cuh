// The parameter block of the attention kernels, passed by value.
//
// flashcupy/cuda/params.py builds the same layout as a NumPy structured scalar
// (fields sorted by size, so no padding is ever inserted); FLASH_PARAMS_SIZE,
// defined by the compiler options, is that scalar's size and is checked below.
#pragma once


namespace flash {

// Fixed-width integers without <cstdint>, which NVRTC does not ship.
using i32 = int;
using u32 = unsigned int;
using i64 = long long;
using u64 = unsigned long long;
static_assert(sizeof(i32) == 4 && sizeof(i64) == 8, "fixed-width aliases");

// Causal modes.
enum Causal : i32 { kNoCausal = 0, kBottomRight = 1, kTopLeft = 2 };

struct Params {
    // ---- 8-byte fields
    const void* q;             // (B, Hq, Lq, D) or packed (Hq, total_q, D); last axis contiguous
    const void* k;             // (B, Hk, Lk, D) or (Hk, total_k, D)
    const void* v;             // (B, Hk, Lk, Dv) or (Hk, total_k, Dv)
    void* o;                   // like q with Dv, contiguous
    void* lse;                 // (B, Hq, Lq) or (Hq, total_q), float32 (float64 for float64 inputs)
    const bool* mask;          // strided view broadcast to (B, Hq, Lq, Lk); nullptr if none
    const void* bias;          // strided view broadcast to (B, Hq, Lq, Lk), of the kernel's ScoreMods::Bias; nullptr if none
    const double* alibi;       // (B, Hq) slopes, strided; nullptr if none
    const double* sinks;       // (B, Hq) sink logits, strided, read by the forward's epilogue; nullptr if none
    const bool* block_mask;    // strided view broadcast to (B, Hq, nbq, nbk); nullptr if none
    const i32* cu_seqlens_q;  // (B + 1) packed offsets; nullptr when padded
    const i32* cu_seqlens_k;
    const i32* seqlens_q;  // (B) valid lengths of a padded batch; nullptr = all Lq
    const i32* seqlens_k;
    i32* tiles;    // query-major tile map of the launch's tiles (score/tile_map.cuh); nullptr without masks
    i32* tiles_t;  // key-major tile map of the dK/dV kernel's tiles; nullptr without masks or in the forward
    const u64* rng_state;  // (2) dropout's seed and offset (low 32 bits), read when the kernel runs; nullptr: seed, dropout_offset
    i64 q_sb, q_sh, q_sr;  // strides in elements: batch, head, row
    i64 k_sb, k_sh, k_sr;
    i64 v_sb, v_sh, v_sr;
    i64 o_sb, o_sh, o_sr;
    i64 lse_sb, lse_sh;
    i64 mask_sb, mask_sh, mask_si, mask_sj;
    i64 bias_sb, bias_sh, bias_si, bias_sj;
    i64 bm_sb, bm_sh, bm_si, bm_sj;
    i64 alibi_sb, alibi_sh;
    i64 sinks_sb, sinks_sh;
    i64 tiles_sb, tiles_sh, tiles_so;  // the maps' plane (0 where every mask broadcasts) and outer-tile strides
    i64 tt_sb, tt_sh, tt_so;
    u64 seed;             // Philox key = (seed mod 2^32, seed >> 32)
    double scale;              // softmax scale
    double softcap;            // the softcap (read where the kernel's ScoreMods has kModSoftcap)
    double dropout_scale;      // 1 / (1 - dropout_p)
    // ---- 4-byte fields
    i32 batch, hq, hk;     // hq % hk == 0
    i32 lq, lk;            // frame lengths (longest sequence when packed)
    i32 d, dv;             // d: q and k's stored head dim (16-byte padded); dv: out's head dim
    i32 causal;            // Causal
    i32 window_left, window_right;  // < 0: unbounded
    i32 block_size;        // block_mask granularity
    u32 dropout_threshold;  // keep iff a 16-bit Philox half >= threshold (read where ScoreMods has kModDropout)
    u32 dropout_offset;
    i32 dv_stored;         // v's last-axis length in memory (dv padded to 16 bytes)
    i32 row_blocks;        // the forward's row blocks per Dv chunk: grid x = row_blocks x chunks, rows
                           // fastest (flashcupy/cuda decides it with the launch; the kernel reads it)
};

#ifdef FLASH_PARAMS_SIZE
static_assert(sizeof(Params) == FLASH_PARAMS_SIZE, "Params layout differs from flashcupy/cuda/params.py");
#endif

}  // namespace flash
