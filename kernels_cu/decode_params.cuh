// The parameter block of the decode kernels (flash_decode.cu), passed by value.
//
// flashcupy/cuda/params.py builds the same layout as DECODE_PARAMS_DTYPE (8-byte fields
// first, so no padding is inserted); FLASH_DECODE_PARAMS_SIZE, defined by the compiler
// options, is that scalar's size and is checked below.
#pragma once

#include "params.cuh"

namespace flash {

struct DecodeParams {
    // ---- 8-byte fields
    const void* q;             // (B, Hq, Lq, D), last axis contiguous
    const void* k;             // contiguous (B, Hk, Lmax, D) or paged (num_blocks, Hk, page, D)
    const void* v;             // likewise with Dv
    const i32* keys;           // (B): each sequence's keys before keys_add; nullptr: keys_all
    const i32* block_table;    // (B, max_blocks) physical block of each logical one; nullptr: contiguous
    const double* alibi;       // (B, Hq) contiguous slopes; nullptr if none
    const double* sinks;       // (B, Hq) contiguous sink logits; nullptr if none
    void* o_part;              // (splits, B * Hq * Lq, Dv) Acc: each split's normalised output
    void* lse_part;            // (splits, B * Hq * Lq) Acc: each split's log2-sum-exp2
    void* o;                   // (B, Hq, Lq, Dv) contiguous, the inputs' dtype
    void* lse;                 // (B, Hq, Lq) contiguous, float32 (float64 for float64 inputs)
    const void* k_new;         // (B, Hk, keys_add, D), last axis contiguous: decode_append writes it
    const void* v_new;         // (B, Hk, keys_add, Dv) into k and v (the caches) before the split
    i32* counters;             // (B * Hk) splits finished a (sequence, KV head), zero before and
                               // after a launch (its last block resets it); nullptr if splits == 1
    i64 q_sb, q_sh, q_sr;      // strides in elements
    i64 k_sb, k_sh, k_sr;      // k_sb: a sequence's stride (contiguous) or a block's (paged)
    i64 v_sb, v_sh, v_sr;
    i64 bt_sb;                 // block_table's row stride
    i64 kn_sb, kn_sh, kn_sr;   // k_new's strides in elements
    i64 vn_sb, vn_sh, vn_sr;
    double scale;              // softmax scale
    double softcap;            // 0: none
    // ---- 4-byte fields
    i32 batch, hq, hk, lq;     // hq % hk == 0; (hq / hk) * lq rows a block
    i32 d, dv;                 // head dims (multiples of a 16-byte chunk)
    i32 causal;                // Causal
    i32 window_left, window_right;  // < 0: unbounded
    i32 page;                  // keys a block of the paged cache (0: contiguous)
    i32 splits;                // blocks over each sequence's keys (grid y), at most kDecodeMaxSplits
    i32 split_keys;            // keys a split, a multiple of the tile's keys
    i32 keys_all;              // every sequence's keys where `keys` is nullptr
    i32 keys_add;              // keys appended this call: sequence b attends keys[b] + keys_add
    i32 capacity;              // keys a sequence's cache holds: more (or keys[b] < 0) is a bad length
    i32 num_blocks;            // blocks of the paged cache: a table entry outside [0, num_blocks) is bad
};
// `keys` and `block_table` may be the caller's device arrays, which the host does not read
// back: a sequence with a bad length or a bad block in its slots in use reads nothing outside
// the cache and gets NaN outputs and lse (its splits mark their partials, the merge spreads it).

// Splits a launch has at most (grid y): the last split's merge keeps a weight a (row, split)
// in shared memory. flashcupy/cuda/params.py's DECODE_MAX_SPLITS, a compiler option.
constexpr int kDecodeMaxSplits = FLASH_DECODE_MAX_SPLITS;

#ifdef FLASH_DECODE_PARAMS_SIZE
static_assert(sizeof(DecodeParams) == FLASH_DECODE_PARAMS_SIZE,
              "DecodeParams layout differs from flashcupy/cuda/params.py");
#endif

}  // namespace flash
