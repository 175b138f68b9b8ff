"""The host image of ``flash::Params`` (kernels_cu/flash_params.cuh).

The struct is passed to the kernel by value as a NumPy structured scalar. Fields
are listed here in the struct's order; 8-byte fields come first, so neither side
inserts padding, and the kernels check ``sizeof(Params)`` against
:data:`PARAMS_DTYPE`'s size at compile time (FLASH_PARAMS_SIZE).
"""

from __future__ import annotations

from typing import Any

import numpy as np

_POINTERS = ("q", "k", "v", "o", "lse", "mask", "bias", "alibi", "block_mask",
             "cu_seqlens_q", "cu_seqlens_k", "seqlens_q", "seqlens_k")
_STRIDES = ("q_sb", "q_sh", "q_sr", "k_sb", "k_sh", "k_sr", "v_sb", "v_sh", "v_sr", "o_sb", "o_sh", "o_sr",
            "lse_sb", "lse_sh", "mask_sb", "mask_sh", "mask_si", "mask_sj", "bias_sb", "bias_sh", "bias_si",
            "bias_sj", "bm_sb", "bm_sh", "bm_si", "bm_sj", "alibi_sb", "alibi_sh")
_INT32 = ("batch", "hq", "hk", "lq", "lk", "d", "dv", "causal", "window_left", "window_right", "block_size",
          "bias_dtype")
_UINT32 = ("dropout_threshold", "dropout_offset")
_TAIL = ("has_softcap", "dv_stored")

PARAMS_DTYPE = np.dtype(
    [(n, np.uint64) for n in _POINTERS]
    + [(n, np.int64) for n in _STRIDES]
    + [("seed", np.uint64), ("scale", np.float64), ("softcap", np.float64), ("dropout_scale", np.float64)]
    + [(n, np.int32) for n in _INT32]
    + [(n, np.uint32) for n in _UINT32]
    + [(n, np.int32) for n in _TAIL],
    align=True,
)

#: flash::BwdParams (kernels_cu/flash_bwd_params.cuh): the forward's block plus gradients.
BWD_PARAMS_DTYPE = np.dtype(
    [("f", PARAMS_DTYPE)]
    + [(n, np.uint64) for n in ("dout", "out", "delta", "dq", "dk", "dv", "dbias", "dq_accum", "lse2")]
    + [(n, np.int64) for n in ("do_sb", "do_sh", "do_sr", "out_sb", "out_sh", "out_sr", "dq_sb", "dq_sh", "dq_sr",
                               "dk_sb", "dk_sh", "dk_sr", "dv_sb", "dv_sh", "dv_sr", "db_sb", "db_sh", "db_si",
                               "db_sj", "dqa_sb", "dqa_sh", "dqa_sr")]
    + [("d_true", np.int32)],
    align=True,
)

#: Kernel dtype codes (flash::DtypeCode).
DTYPE_CODE = {"float16": 0, "bfloat16": 1, "float32": 2, "float64": 3}
#: flash::Causal.
CAUSAL_CODE = {None: 0, "bottom_right": 1, "top_left": 2}


def pack(dtype: np.dtype = PARAMS_DTYPE, **fields: Any) -> np.void:
    """A Params (or BwdParams) scalar; fields not given are 0 (null pointers, zero strides)."""
    unknown = set(fields) - set(dtype.names)
    if unknown:
        raise KeyError(f"not fields of the parameter block: {sorted(unknown)}")
    record = np.zeros((), dtype=dtype)
    for name, value in fields.items():
        record[name] = value
    return record[()]
