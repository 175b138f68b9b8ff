"""The host image of ``flash::Params`` (kernels_cu/flash_params.cuh).

The struct is passed to the kernel by value as its bytes (compile.launch): those of a
structured NumPy scalar from :func:`pack`, or of a :class:`Template` (one per layout,
reused by every call of that layout with its own pointers). Fields are listed here in the struct's
order; 8-byte fields come first, so neither side inserts padding, and the kernels
check ``sizeof(Params)`` against :data:`PARAMS_DTYPE`'s size at compile time
(FLASH_PARAMS_SIZE).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

_POINTERS = ("q", "k", "v", "o", "lse", "mask", "bias", "alibi", "sinks", "block_mask",
             "cu_seqlens_q", "cu_seqlens_k", "seqlens_q", "seqlens_k", "tiles", "tiles_t", "rng_state")
_STRIDES = ("q_sb", "q_sh", "q_sr", "k_sb", "k_sh", "k_sr", "v_sb", "v_sh", "v_sr", "o_sb", "o_sh", "o_sr",
            "lse_sb", "lse_sh", "mask_sb", "mask_sh", "mask_si", "mask_sj", "bias_sb", "bias_sh", "bias_si",
            "bias_sj", "bm_sb", "bm_sh", "bm_si", "bm_sj", "alibi_sb", "alibi_sh", "sinks_sb", "sinks_sh",
            "tiles_sb", "tiles_sh", "tiles_so", "tt_sb", "tt_sh", "tt_so")
_INT32 = ("batch", "hq", "hk", "lq", "lk", "d", "dv", "causal", "window_left", "window_right", "block_size")
_UINT32 = ("dropout_threshold", "dropout_offset")
_TAIL = ("dv_stored", "row_blocks")

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
    + [(n, np.int32) for n in ("d_true", "key_block_major", "key_blocks", "dq_row_blocks")],
    align=True,
)

#: flash::DecodeParams (kernels_cu/decode_params.cuh): the split-KV decode kernels' block.
DECODE_PARAMS_DTYPE = np.dtype(
    [(n, np.uint64) for n in ("q", "k", "v", "keys", "block_table", "alibi", "sinks", "o_part", "lse_part", "o",
                              "lse", "k_new", "v_new", "counters")]
    + [(n, np.int64) for n in ("q_sb", "q_sh", "q_sr", "k_sb", "k_sh", "k_sr", "v_sb", "v_sh", "v_sr", "bt_sb",
                               "kn_sb", "kn_sh", "kn_sr", "vn_sb", "vn_sh", "vn_sr")]
    + [("scale", np.float64), ("softcap", np.float64)]
    + [(n, np.int32) for n in ("batch", "hq", "hk", "lq", "d", "dv", "causal", "window_left", "window_right",
                               "page", "splits", "split_keys", "keys_all", "keys_add", "capacity", "num_blocks")],
    align=True,
)

#: Splits of a decode launch at most (kDecodeMaxSplits, a compiler option): the last split's
#: merge keeps a weight a (row, split) in shared memory.
DECODE_MAX_SPLITS = 256

#: flash::Causal.
CAUSAL_CODE = {None: 0, "bottom_right": 1, "top_left": 2}


#: struct format codes (native byte order, as the dtypes) of the scalar field types the blocks use.
_STRUCT_CODES = {"u8": "Q", "i8": "q", "f8": "d", "u4": "I", "i4": "i"}


@functools.cache
def _layout(dtype: np.dtype) -> tuple[struct.Struct, dict[str, int], tuple[Any, ...], tuple[str, ...]]:
    """(struct packing every field of ``dtype`` in its offset order, the position of each
    field's value in that struct's arguments, every field's zero, the nested blocks' names).
    A nested block (BwdParams' ``f``) is one bytes value; gaps and the tail are zero padding."""
    fmt, index, zeros, nested, end = ["="], {}, [], [], 0
    for name in sorted(dtype.names, key=lambda n: dtype.fields[n][1]):
        field, offset = dtype.fields[name][:2]
        fmt.append("x" * (offset - end))
        if field.names is None:
            fmt.append(_STRUCT_CODES[field.str[1:]])
            zeros.append(0.0 if field.kind == "f" else 0)
        else:
            fmt.append(f"{field.itemsize}s")
            zeros.append(b"")
            nested.append(name)
        index[name] = len(zeros) - 1
        end = offset + field.itemsize
    fmt.append("x" * (dtype.itemsize - end))
    return struct.Struct("".join(fmt)), index, tuple(zeros), tuple(nested)


def pack(dtype: np.dtype = PARAMS_DTYPE, **fields: Any) -> np.void:
    """A Params (or BwdParams) scalar; fields not given are 0 (null pointers, zero strides).

    A nested block (BwdParams' ``f``) is given as the scalar :func:`pack` returned for it.
    """
    packer, index, zeros, nested = _layout(dtype)
    values = list(zeros)
    try:
        for name, value in fields.items():
            values[index[name]] = value
    except KeyError:
        raise KeyError(f"not fields of the parameter block: {sorted(fields.keys() - index.keys())}") from None
    for name in nested:
        if name in fields:
            values[index[name]] = fields[name].tobytes()
    return np.frombuffer(bytearray(packer.pack(*values)), dtype=dtype)[0]


def _field(dtype: np.dtype, name: str) -> tuple[int, np.dtype]:
    """(byte offset, dtype) of a field in a block; ``"f.q"`` names field ``q`` of the nested block ``f``."""
    offset = 0
    for part in name.split("."):
        dtype, inner = dtype.fields[part][:2]
        offset += inner
    return offset, dtype


class Template:
    """A packed block whose named fields are rewritten for each launch, the rest kept.

    For calls whose every other field is the same (same shapes, strides and options),
    :meth:`fill_into` a kept :meth:`buffer` costs one ``struct.pack_into`` per run of adjacent
    fields instead of packing every field again.
    """

    def __init__(self, record: np.void, names: Sequence[str]) -> None:
        """``record``: a block from :func:`pack`; ``names``: the scalar fields (pointers,
        counts) that :meth:`fill_into` takes, in its argument order (``"f.q"`` for a field of
        the nested block)."""
        self.record = record
        self._bytes = record.tobytes()
        #: (byte offset, struct, argument positions) of each run of adjacent fields.
        self._runs: list[tuple[int, struct.Struct, list[int]]] = []
        fields = sorted((*_field(record.dtype, name), i) for i, name in enumerate(names))
        start = 0
        for n, (offset, field, _) in enumerate(fields):
            if n + 1 == len(fields) or fields[n + 1][0] != offset + field.itemsize:
                run = fields[start:n + 1]
                fmt = "=" + "".join(_STRUCT_CODES[f.str[1:]] for _, f, _ in run)
                self._runs.append((run[0][0], struct.Struct(fmt), [i for _, _, i in run]))
                start = n + 1

    def fill_into(self, buf: Any, *values: Any) -> None:
        """Set the named fields of ``buf``, a writable buffer holding this block (its other
        fields as :meth:`buffer` made them), to ``values`` (in the constructor's order)."""
        for offset, packer, order in self._runs:
            packer.pack_into(buf, offset, *[values[i] for i in order])

    def buffer(self) -> Any:
        """A ctypes char array holding the block, for :meth:`fill_into` and the driver."""
        import ctypes

        return (ctypes.c_char * len(self._bytes)).from_buffer_copy(self._bytes)
