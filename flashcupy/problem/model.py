"""What a validated call is: :class:`Problem`, its :class:`Segment` slices, and the dtypes.

Frames. A problem is a set of *segments*, one per (batch..., query head). For a
padded call q is ``(*batch, Hq, Lq, D)`` and every segment sees an ``(Lq, D)``
frame of which the first ``q_len`` rows are valid. For a packed (varlen) call q
is ``(Hq, total_q, D)``, batch is ``(B,)`` from ``cu_seqlens`` and a segment's
rows are the slice of its sequence. Masks, bias and block masks are always
indexed in the padded frame ``(*batch, Hq, Lq, Lk)`` with positions inside the
sequence, so a packed call equals the padded call with the same lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import ml_dtypes
import numpy as np

FLOAT_DTYPES = (
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float32),
    np.dtype(np.float64),
)
MAX_HEAD_DIM = 512


def numpy_dtype(dtype: Any) -> np.dtype | None:
    """``dtype`` as NumPy's, or None for another library's that NumPy does not read
    (torch.bfloat16)."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return None


def dtype_name(dtype: Any) -> str:
    """Human name of a dtype ('bfloat16' for ml_dtypes' bfloat16), with its byte order when
    it is not the machine's ('float32 (big-endian)'); another library's dtype that NumPy does
    not read (torch.bfloat16) by its own name."""
    found = numpy_dtype(dtype)
    if found is None:
        return str(dtype)
    dtype = found
    if dtype.isnative:
        return dtype.name
    return f"{dtype.name} ({'big' if dtype.byteorder == '>' else 'little'}-endian)"


def accumulator_dtype(dtype: np.dtype) -> np.dtype:
    """float64 accumulates in float64; every narrower float in float32."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def lse_dtype(dtype: np.dtype) -> np.dtype:
    """The log-sum-exp is float32, float64 for float64 inputs."""
    return accumulator_dtype(dtype)


@dataclass(frozen=True)
class Segment:
    """One (batch..., query head) slice of a problem.

    ``q_index`` indexes q, out, dout and dq to an ``(rows, D)`` frame whose
    first ``q_len`` rows are valid; ``k_index`` indexes k, v, dk and dv to an
    ``(keys, D)`` frame whose first ``kv_len`` rows are valid; ``lse_index``
    indexes lse to ``(rows,)``; ``head`` indexes the padded-frame views (mask,
    bias, block mask: ``(Lq, Lk)``-like; slopes: a scalar); ``bh`` is the C-order
    flat index over ``(*batch, Hq)``, the Philox counter's third word.
    """

    bh: int
    head: tuple
    q_index: tuple
    lse_index: tuple
    k_index: tuple
    q_len: int
    kv_len: int

    @property
    def diagonal(self) -> int:
        """Offset of the bottom-right diagonal: column i + diagonal aligns with row i."""
        return self.kv_len - self.q_len


@dataclass(frozen=True)
class Layout:
    """q, k, v and their dimensions (a head axis added for 2-D inputs: ``squeeze_head``).

    Arrays keep the caller's strides. q: (*batch, Hq, Lq, D), k: (*batch, Hk, Lk, D),
    v: (*batch, Hk, Lk, Dv); for a packed call (Hq, total_q, D), (Hk, total_k, D),
    (Hk, total_k, Dv), with ``seqlen_q``/``seqlen_k`` the longest sequences and
    ``cu_seqlens_*`` the offsets as int64.
    """

    q: Any
    k: Any
    v: Any
    batch: tuple[int, ...]
    num_heads_q: int
    num_heads_k: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    head_dim_v: int
    cu_seqlens_q: np.ndarray | None
    cu_seqlens_k: np.ndarray | None
    squeeze_head: bool


@dataclass(frozen=True)
class Problem(Layout):
    """A validated attention call: its :class:`Layout` and every option normalised.

    ``mask``, ``bias`` and ``block_mask`` are broadcast views of shape (*batch, Hq, Lq, Lk)
    and (*batch, Hq, ceil(Lq/bs), ceil(Lk/bs)); ``bias_shape`` is the bias's own shape.
    ``alibi_slopes`` are host float64 (*batch, Hq), or a broadcast view (*batch, Hq) on the
    device where they were given there; ``sinks`` a broadcast view (*batch, Hq) beside q
    (host or device), ``sinks_shape`` the sinks' own shape. ``rng_state``, where
    given, is a (2,) 8-byte integer array beside q holding dropout's seed and offset in place
    of ``seed`` and ``dropout_offset`` (:meth:`dropout_key` reads it).
    """

    dtype: np.dtype
    scale: float
    softcap: float | None
    causal: str | None
    window: tuple[int | None, int | None] | None
    mask: Any
    bias: Any
    bias_shape: tuple[int, ...] | None
    alibi_slopes: Any
    sinks: Any
    sinks_shape: tuple[int, ...] | None
    q_lengths: np.ndarray | None
    kv_lengths: np.ndarray | None
    block_mask: Any
    block_size: int | None
    dropout_p: float
    seed: int | None
    dropout_offset: int
    rng_state: Any
    return_lse: bool
    allow_tf32: bool
    backend: str

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def dropout_key(self) -> tuple[int, int]:
        """(seed, offset) of the keep bits: ``seed`` (0 where None) and ``dropout_offset``, or
        rng_state's two values (seed mod 2**64, offset mod 2**32) read now (from the device,
        a sync, for a device array)."""
        if self.rng_state is None:
            return self.seed or 0, self.dropout_offset
        values = self.rng_state.get() if hasattr(self.rng_state, "get") else np.asarray(self.rng_state)
        seed, offset = (int(x) for x in values.astype(np.uint64))
        return seed, offset % 2**32

    @property
    def group_size(self) -> int:
        """Query heads per key/value head (GQA/MQA)."""
        return self.num_heads_q // self.num_heads_k

    @property
    def out_shape(self) -> tuple[int, ...]:
        """Shape of ``out`` as the caller sees it."""
        return self.q.shape[:-1] + (self.head_dim_v,)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return self.q.shape[:-1]

    def segments(self) -> Iterator[Segment]:
        """Every (batch..., query head) segment, in C order of ``bh``."""
        g = self.group_size
        if self.varlen:
            cq, ck = self.cu_seqlens_q, self.cu_seqlens_k
            for b in range(self.batch[0]):
                rows = slice(int(cq[b]), int(cq[b + 1]))
                keys = slice(int(ck[b]), int(ck[b + 1]))
                for h in range(self.num_heads_q):
                    yield Segment(
                        bh=b * self.num_heads_q + h,
                        head=(b, h),
                        q_index=(h, rows),
                        lse_index=(h, rows),
                        k_index=(h // g, keys),
                        q_len=rows.stop - rows.start,
                        kv_len=keys.stop - keys.start,
                    )
            return
        bh = 0
        for b in np.ndindex(*self.batch):
            q_len = self.seqlen_q if self.q_lengths is None else int(self.q_lengths[b])
            kv_len = self.seqlen_k if self.kv_lengths is None else int(self.kv_lengths[b])
            for h in range(self.num_heads_q):
                yield Segment(
                    bh=bh,
                    head=b + (h,),
                    q_index=b + (h,),
                    lse_index=b + (h,),
                    k_index=b + (h // g,),
                    q_len=q_len,
                    kv_len=kv_len,
                )
                bh += 1

