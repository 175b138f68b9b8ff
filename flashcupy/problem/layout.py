"""Layout: the shapes of q, k and v, what they say about batch, heads, lengths and head
dims, and the packed (varlen) frame that ``cu_seqlens`` describe. Strides are the caller's:
nothing here copies."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .model import MAX_HEAD_DIM, Layout, dtype_name
from .validate import check_array, check_float_dtype, describe, host_array


def check_cu_seqlens(name: str, x: Any, total: int) -> np.ndarray:
    """A packed call's offsets: int32 (lists of ints are converted), 0 first, non-decreasing,
    ``total`` last; returned as int64."""
    arr = host_array(name, x)
    if isinstance(x, (list, tuple)) and (arr.dtype.kind in "iu" or arr.size == 0):
        info = np.iinfo(np.int32)
        if arr.size and (int(arr.min()) < info.min or int(arr.max()) > info.max):
            raise ValueError(
                f"{name}: expected int32 values, received values in [{int(arr.min())}, {int(arr.max())}]"
            )
        arr = arr.astype(np.int32)
    if arr.dtype != np.int32:
        raise TypeError(f"{name}: expected an int32 vector, received dtype {dtype_name(arr.dtype)}")
    if arr.ndim != 1 or arr.shape[0] < 1:
        raise ValueError(f"{name}: expected a 1-D vector of length batch + 1, received shape {arr.shape}")
    if arr[0] != 0:
        raise ValueError(f"{name}: expected the first value to be 0, received {arr[0]}")
    if np.any(np.diff(arr.astype(np.int64)) < 0):
        raise ValueError(f"{name}: expected non-decreasing values, received {arr.tolist()}")
    if arr[-1] != total:
        raise ValueError(
            f"{name}: expected the last value to equal the packed length {total}, received {arr[-1]}"
        )
    return arr.astype(np.int64)


def check_layout(q: Any, k: Any, v: Any, o: dict[str, Any]) -> Layout:
    """The :class:`Layout` of q, k, v under the options ``o`` (every option present: the
    packed call's ``cu_seqlens_*`` and the padded call's ``*_lengths`` decide the frame)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x)
        check_float_dtype(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            "q, k, v: expected one dtype, received "
            f"{dtype_name(q.dtype)}, {dtype_name(k.dtype)}, {dtype_name(v.dtype)}"
        )

    varlen = o["cu_seqlens_q"] is not None or o["cu_seqlens_k"] is not None
    if varlen:
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            if o[name] is None:
                raise ValueError(f"{name}: expected an int32 vector with the other cu_seqlens, received None")
        for name in ("q_lengths", "kv_lengths"):
            if o[name] is not None:
                raise ValueError(
                    f"{name}: expected None for packed sequences (cu_seqlens give the lengths), "
                    f"received {describe(o[name])}"
                )
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.ndim != 3:
                raise ValueError(
                    f"{name}: expected a packed array (heads, total, head_dim), received shape {tuple(x.shape)}"
                )
    else:
        for name, x in (("q", q), ("k", k), ("v", v)):
            if x.ndim < 2:
                raise ValueError(f"{name}: expected at least 2 dimensions (..., L, D), received shape {tuple(x.shape)}")
        if not q.ndim == k.ndim == v.ndim:
            raise ValueError(
                f"q, k, v: expected the same number of dimensions, received shapes "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )

    squeeze_head = q.ndim == 2
    if squeeze_head:
        q, k, v = q[None], k[None], v[None]

    batch_q, batch_k, batch_v = q.shape[:-3], k.shape[:-3], v.shape[:-3]
    if not batch_q == batch_k == batch_v:
        raise ValueError(
            f"q, k, v: expected equal batch dimensions, received {batch_q}, {batch_k}, {batch_v}"
        )
    hq, lq, d = q.shape[-3:]
    hk, lk, dk = k.shape[-3:]
    if dk != d:
        raise ValueError(f"k: expected head dim {d} (q's), received {dk}")
    if v.shape[-3:-1] != (hk, lk):
        raise ValueError(
            f"v: expected (heads, length) = {(hk, lk)} like k, received {tuple(v.shape[-3:-1])}"
        )
    dv = v.shape[-1]
    for name, dim in (("q", d), ("v", dv)):
        if not 1 <= dim <= MAX_HEAD_DIM:
            raise ValueError(f"{name}: expected a head dim in 1..{MAX_HEAD_DIM}, received {dim}")
    if math.prod(batch_q) * hq >= 2**31:
        raise ValueError(
            f"q: expected fewer than 2**31 (batch x heads) slices, received {math.prod(batch_q) * hq}"
        )
    if hk == 0 or hq % hk:
        raise ValueError(
            f"k: expected a number of heads dividing q's {hq} (GQA/MQA), received {hk}"
        )

    cu_q = cu_k = None
    if varlen:
        cu_q = check_cu_seqlens("cu_seqlens_q", o["cu_seqlens_q"], lq)
        cu_k = check_cu_seqlens("cu_seqlens_k", o["cu_seqlens_k"], lk)
        if cu_q.shape != cu_k.shape:
            raise ValueError(
                f"cu_seqlens_k: expected length {cu_q.shape[0]} like cu_seqlens_q, received {cu_k.shape[0]}"
            )
        batch = (cu_q.shape[0] - 1,)
        frame_q = int(np.diff(cu_q).max(initial=0))
        frame_k = int(np.diff(cu_k).max(initial=0))
    else:
        batch, frame_q, frame_k = tuple(batch_q), lq, lk

    return Layout(q=q, k=k, v=v, batch=batch, num_heads_q=hq, num_heads_k=hk, seqlen_q=frame_q,
                  seqlen_k=frame_k, head_dim=d, head_dim_v=dv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                  squeeze_head=squeeze_head)
