// The parameter block of the backward kernels: the forward's Params plus the gradient
// arrays. flashcupy/cuda/params.py mirrors it (BWD_PARAMS_DTYPE); its size is checked.
#pragma once

#include "params.cuh"

namespace flash {

struct BwdParams {
    Params f;                  // the forward problem (q, k, v, lse, options)
    const void* dout;          // like out: (B, Hq, Lq, Dv) or (Hq, total_q, Dv), 16-byte aligned rows
    const void* out;
    void* delta;               // rowsum(dO * O), laid out like lse (accumulator dtype)
    void* dq;                  // like q (contiguous), q's dtype
    void* dk;                  // like k
    void* dv;                  // like v
    void* dbias;               // accumulator-dtype buffer, strided by db_* (0 on reduced dims); or nullptr
    void* dq_accum;            // accumulator-dtype dQ, or dQ / scale (flash_bwd.cu's kDqAccumScaled), zeroed by
                               // flash_bwd_delta, strided by dqa_* (packed: dqa_sb unused);
                               // nullptr when dQ has its own kernel (deterministic)
    void* lse2;                // lse * log2(e), 0 where lse = -inf: written by flash_bwd_delta, laid out like lse
    i64 do_sb, do_sh, do_sr;
    i64 out_sb, out_sh, out_sr;
    i64 dq_sb, dq_sh, dq_sr;
    i64 dk_sb, dk_sh, dk_sr;
    i64 dv_sb, dv_sh, dv_sr;
    i64 db_sb, db_sh, db_si, db_sj;
    i64 dqa_sb, dqa_sh, dqa_sr;
    i32 d_true;                // q's (and dq's) head dim: the columns dq and dk have
    i32 key_block_major;       // flash_bwd_dkdv's block order: 1 key block by key block over the heads, 0 head by head
    i32 key_blocks;            // flash_bwd_dkdv's key blocks per gradient chunk, and flash_bwd_dq's row
    i32 dq_row_blocks;         // blocks per dQ chunk (flashcupy/cuda decides them with the launches)
};

#ifdef FLASH_BWD_PARAMS_SIZE
static_assert(sizeof(BwdParams) == FLASH_BWD_PARAMS_SIZE, "BwdParams layout differs from flashcupy/cuda/params.py");
#endif

}  // namespace flash
