"""One validated, normalised description of an attention call.

Every public function funnels its arguments through :func:`make_problem` (and
:func:`check_backward_arrays` for gradients). This is the single place where bad
input becomes a :class:`TypeError` or :class:`ValueError` that names the
argument, what was expected and what was received; the backends and the
reference trust a :class:`Problem` without checking again.

Per-call cost. A call on NumPy or CuPy arrays whose options are plain values
(no array options) is validated once per signature: the arrays' shapes and
dtypes and each option's name, type and value. Later calls with the same
signature reuse the validated fields with their own arrays; anything else, and
every invalid call, takes the full path.

Frames. A problem is a set of *segments*, one per (batch..., query head). For a
padded call q is ``(*batch, Hq, Lq, D)`` and every segment sees an ``(Lq, D)``
frame of which the first ``q_len`` rows are valid. For a packed (varlen) call q
is ``(Hq, total_q, D)``, batch is ``(B,)`` from ``cu_seqlens`` and a segment's
rows are the slice of its sequence. Masks, bias and block masks are always
indexed in the padded frame ``(*batch, Hq, Lq, Lk)`` with positions inside the
sequence, so a packed call equals the padded call with the same lengths.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any, Iterator

import ml_dtypes
import numpy as np

from . import interop, rng

FLOAT_DTYPES = (
    np.dtype(np.float16),
    np.dtype(ml_dtypes.bfloat16),
    np.dtype(np.float32),
    np.dtype(np.float64),
)
MAX_HEAD_DIM = 512
#: Options that carry arrays (converted to the backend's array module before validation).
ARRAY_OPTIONS = (
    "mask", "bias", "alibi_slopes", "q_lengths", "kv_lengths", "block_mask", "cu_seqlens_q", "cu_seqlens_k",
)
#: Options that may also be Python lists of ints (converted to int32 when they fit).
INT32_LIST_OPTIONS = ("cu_seqlens_q", "cu_seqlens_k")
BACKENDS = ("auto", "cpu", "cuda")
CAUSAL_MODES = {"bottom_right": "bottom_right", "top_left": "top_left"}

#: The keyword options every public attention function accepts, with defaults.
OPTION_DEFAULTS: dict[str, Any] = {
    "causal": False,
    "scale": None,
    "window": None,
    "mask": None,
    "bias": None,
    "alibi_slopes": None,
    "softcap": None,
    "q_lengths": None,
    "kv_lengths": None,
    "block_mask": None,
    "block_size": None,
    "dropout_p": 0.0,
    "seed": None,
    "dropout_offset": 0,
    "cu_seqlens_q": None,
    "cu_seqlens_k": None,
    "return_lse": False,
    "allow_tf32": False,
    "backend": "auto",
}


def dtype_name(dtype: Any) -> str:
    """Human name of a dtype ('bfloat16' for ml_dtypes' bfloat16)."""
    return np.dtype(dtype).name


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
class Problem:
    """A validated attention call. Arrays keep the caller's strides.

    q: (*batch, Hq, Lq, D), k: (*batch, Hk, Lk, D), v: (*batch, Hk, Lk, Dv); for a
    packed call (Hq, total_q, D), (Hk, total_k, D), (Hk, total_k, Dv), with
    ``seqlen_q``/``seqlen_k`` the longest sequences. ``mask``, ``bias`` and
    ``block_mask`` are broadcast views of shape (*batch, Hq, Lq, Lk) and
    (*batch, Hq, ceil(Lq/bs), ceil(Lk/bs)); ``bias_shape`` is the bias's own shape.
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
    dtype: np.dtype
    scale: float
    softcap: float | None
    causal: str | None
    window: tuple[int | None, int | None] | None
    mask: Any
    bias: Any
    bias_shape: tuple[int, ...] | None
    alibi_slopes: np.ndarray | None
    q_lengths: np.ndarray | None
    kv_lengths: np.ndarray | None
    block_mask: Any
    block_size: int | None
    cu_seqlens_q: np.ndarray | None
    cu_seqlens_k: np.ndarray | None
    dropout_p: float
    seed: int | None
    dropout_offset: int
    return_lse: bool
    allow_tf32: bool
    backend: str
    squeeze_head: bool

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

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


# --------------------------------------------------------------------------- helpers


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _as_float(x: Any) -> float:
    """A real number as a float; integers too large for a float become +-inf."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _describe(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{type(x).__name__} of shape {tuple(x.shape)} and dtype {dtype_name(x.dtype)}"
    text = repr(x)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(x).__name__} {text}"


def _check_array(name: str, x: Any) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")):
        raise TypeError(f"{name}: expected an array, received {_describe(x)}")
    if np.dtype(x.dtype).kind == "O":
        raise TypeError(f"{name}: expected an array of numbers, received {_describe(x)}")


def _host_array(name: str, x: Any) -> np.ndarray:
    """``x`` as a host NumPy array, or a TypeError naming ``name`` when it is not array-like.

    Arrays of any kind and (nested) lists of numbers convert; other Python
    objects (None, dicts, strings, ragged lists) are rejected here with their
    own description, rather than as an object or string array later.
    """
    try:
        arr = interop.to_numpy(x)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected an array, received {_describe(x)} ({exc})") from exc
    if not hasattr(x, "dtype") and arr.dtype.kind not in "biufc":
        raise TypeError(f"{name}: expected an array, received {_describe(x)}")
    return arr


def _check_float_dtype(name: str, x: Any) -> None:
    if np.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected a floating dtype (float16, bfloat16, float32 or float64), "
            f"received {dtype_name(x.dtype)}"
        )


def _broadcast_view(name: str, x: Any, target: tuple[int, ...], xp: Any) -> Any:
    """``x`` broadcast (as a stride-0 view) to ``target``, or a ValueError."""
    ok = x.ndim <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(x.shape), reversed(target))
    )
    if not ok:
        raise ValueError(
            f"{name}: expected a shape broadcastable to {target}, received {tuple(x.shape)}"
        )
    return xp.broadcast_to(x, target)


def _host_int_array(name: str, x: Any, target: tuple[int, ...], low: int, high: int) -> np.ndarray:
    """Lengths as host int64 broadcast to ``target``, each in [low, high]."""
    arr = _host_array(name, x)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, received dtype {dtype_name(arr.dtype)}")
    arr = _broadcast_view(name, arr, target, np)
    # Compare in the array's own dtype: a cast first would wrap huge unsigned values.
    if arr.size and (int(arr.min()) < low or int(arr.max()) > high):
        raise ValueError(
            f"{name}: expected values in [{low}, {high}], received values in "
            f"[{int(arr.min())}, {int(arr.max())}]"
        )
    return arr.astype(np.int64)


def _check_cu_seqlens(name: str, x: Any, total: int) -> np.ndarray:
    arr = _host_array(name, x)
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


def _check_window(window: Any, frame_q: int, frame_k: int) -> tuple[int | None, int | None] | None:
    """(left, right) or None. left is clamped to Lk and right to Lq (``frame_k``, ``frame_q``),
    where each side no longer restricts any score, so that the kernels' band sums (query +
    diagonal +- side) stay within +-(Lq + Lk)."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window: expected a pair (left, right) of ints >= 0 or None, received {window!r}")
    for side, w in zip(("left", "right"), window):
        if w is not None and not _is_int(w):
            raise TypeError(f"window: expected {side} to be an int >= 0 or None, received {w!r}")
        if w is not None and w < 0:
            raise ValueError(f"window: expected {side} to be >= 0 or None, received {w}")
    left, right = (None if w is None else min(int(w), limit) for w, limit in zip(window, (frame_k, frame_q)))
    return None if left is None and right is None else (left, right)


def _check_causal(causal: Any) -> str | None:
    if isinstance(causal, (bool, np.bool_)):
        return "bottom_right" if causal else None
    if isinstance(causal, str) and causal in CAUSAL_MODES:
        return CAUSAL_MODES[causal]
    raise ValueError(
        f"causal: expected True, False, 'bottom_right' or 'top_left', received {causal!r}"
    )


def check_dropout(dropout_p: Any, seed: Any, offset: Any) -> tuple[float, int | None, int]:
    """Validated (dropout_p, seed, offset); the seed may still be None.

    Checked once per distinct arguments (of distinct types: 1 and True differ); unhashable
    arguments are checked every time.
    """
    try:
        return _checked_dropout(dropout_p, seed, offset)
    except TypeError:  # unhashable, or a wrong type: the uncached check raises the caller's error
        return _check_dropout(dropout_p, seed, offset)


def _check_dropout(dropout_p: Any, seed: Any, offset: Any) -> tuple[float, int | None, int]:
    """The checks of :func:`check_dropout`, uncached."""
    if not _is_real(dropout_p):
        raise TypeError(f"dropout_p: expected a float in [0, 1), received {dropout_p!r}")
    p = _as_float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), received {dropout_p!r}")
    rng.dropout_threshold(p)
    if seed is not None:
        if not _is_int(seed):
            raise TypeError(f"seed: expected an int in [0, 2**64) or None, received {seed!r}")
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed: expected an int in [0, 2**64), received {seed}")
        seed = int(seed)
    if not _is_int(offset):
        raise TypeError(f"dropout_offset: expected an int in [0, 2**32), received {offset!r}")
    if not 0 <= offset < 2**32:
        raise ValueError(f"dropout_offset: expected an int in [0, 2**32), received {offset}")
    return p, seed, int(offset)


_checked_dropout = functools.lru_cache(maxsize=256, typed=True)(_check_dropout)


# --------------------------------------------------------------------------- the pass


def make_problem(q: Any, k: Any, v: Any, options: dict[str, Any], xp: Any = np) -> Problem:
    """Validate ``q``, ``k``, ``v`` and the keyword ``options`` once.

    ``xp`` is the array module of q, k, v (NumPy or CuPy): array options are
    broadcast with it. Unknown option names raise TypeError.
    """
    unknown = sorted(set(options) - set(OPTION_DEFAULTS))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(unknown)}; "
            f"expected some of {', '.join(OPTION_DEFAULTS)}"
        )
    o = {**OPTION_DEFAULTS, **options}

    backend = o["backend"]
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, received {backend!r}")

    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x)
        _check_float_dtype(name, x)
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
                    f"received {_describe(o[name])}"
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
        cu_q = _check_cu_seqlens("cu_seqlens_q", o["cu_seqlens_q"], lq)
        cu_k = _check_cu_seqlens("cu_seqlens_k", o["cu_seqlens_k"], lk)
        if cu_q.shape != cu_k.shape:
            raise ValueError(
                f"cu_seqlens_k: expected length {cu_q.shape[0]} like cu_seqlens_q, received {cu_k.shape[0]}"
            )
        batch = (cu_q.shape[0] - 1,)
        frame_q = int(np.diff(cu_q).max(initial=0))
        frame_k = int(np.diff(cu_k).max(initial=0))
    else:
        batch, frame_q, frame_k = tuple(batch_q), lq, lk

    scale = o["scale"]
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif not _is_real(scale):
        raise TypeError(f"scale: expected a finite real number or None, received {scale!r}")
    elif not math.isfinite(_as_float(scale)):
        raise ValueError(f"scale: expected a finite real number or None, received {scale!r}")

    softcap = o["softcap"]
    if softcap is not None:
        if not _is_real(softcap):
            raise TypeError(f"softcap: expected a positive float or None, received {softcap!r}")
        if not (math.isfinite(_as_float(softcap)) and softcap > 0):
            raise ValueError(f"softcap: expected a positive finite float or None, received {softcap!r}")
        softcap = _as_float(softcap)

    causal = _check_causal(o["causal"])
    window = _check_window(o["window"], frame_q, frame_k)
    scores_shape = batch + (hq, frame_q, frame_k)

    mask = o["mask"]
    if mask is not None:
        _check_array("mask", mask)
        if mask.dtype != np.bool_:
            raise TypeError(f"mask: expected dtype bool (True = attend), received {dtype_name(mask.dtype)}")
        mask = _broadcast_view("mask", mask, scores_shape, xp)

    bias, bias_shape = o["bias"], None
    if bias is not None:
        _check_array("bias", bias)
        if np.dtype(bias.dtype) not in FLOAT_DTYPES:
            raise TypeError(
                f"bias: expected a floating dtype (float16, bfloat16, float32 or float64), "
                f"received {dtype_name(bias.dtype)}"
            )
        bias_shape = tuple(bias.shape)
        bias = _broadcast_view("bias", bias, scores_shape, xp)

    slopes = o["alibi_slopes"]
    if slopes is not None:
        host = _host_array("alibi_slopes", slopes)
        if host.dtype.kind not in "iuf" and host.dtype != ml_dtypes.bfloat16:
            raise TypeError(f"alibi_slopes: expected real numbers, received dtype {dtype_name(host.dtype)}")
        slopes = np.array(_broadcast_view("alibi_slopes", host, batch + (hq,), np), dtype=np.float64)
        if not np.isfinite(slopes).all():
            raise ValueError(
                f"alibi_slopes: expected finite values, received {slopes[~np.isfinite(slopes)][0]}"
            )

    q_lengths = kv_lengths = None
    if o["q_lengths"] is not None:
        q_lengths = _host_int_array("q_lengths", o["q_lengths"], batch, 0, lq)
    if o["kv_lengths"] is not None:
        kv_lengths = _host_int_array("kv_lengths", o["kv_lengths"], batch, 0, lk)

    block_mask, block_size = o["block_mask"], o["block_size"]
    if block_mask is not None:
        _check_array("block_mask", block_mask)
        if block_mask.dtype != np.bool_:
            raise TypeError(f"block_mask: expected dtype bool, received {dtype_name(block_mask.dtype)}")
        if block_size is None:
            raise ValueError("block_size: expected a positive int with block_mask, received None")
    if block_size is not None:
        if block_mask is None:
            raise ValueError("block_size: expected None without block_mask, received " + repr(block_size))
        if not _is_int(block_size):
            raise TypeError(f"block_size: expected a positive int, received {block_size!r}")
        if block_size < 1:
            raise ValueError(f"block_size: expected a positive int, received {block_size}")
        # A block at least as long as both frames is one block either way; clamping keeps
        # the backends' index arithmetic in int64.
        block_size = min(int(block_size), max(frame_q, frame_k, 1))
        blocks = batch + (hq, -(-frame_q // block_size), -(-frame_k // block_size))
        block_mask = _broadcast_view("block_mask", block_mask, blocks, xp)

    dropout_p, seed, offset = check_dropout(o["dropout_p"], o["seed"], o["dropout_offset"])

    for name in ("return_lse", "allow_tf32"):
        if not isinstance(o[name], (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, received {o[name]!r}")

    return Problem(
        q=q, k=k, v=v, batch=batch, num_heads_q=hq, num_heads_k=hk,
        seqlen_q=frame_q, seqlen_k=frame_k, head_dim=d, head_dim_v=dv,
        dtype=np.dtype(q.dtype), scale=float(scale), softcap=softcap, causal=causal,
        window=window, mask=mask, bias=bias, bias_shape=bias_shape, alibi_slopes=slopes,
        q_lengths=q_lengths, kv_lengths=kv_lengths, block_mask=block_mask,
        block_size=block_size, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
        dropout_p=dropout_p, seed=seed, dropout_offset=offset,
        return_lse=bool(o["return_lse"]), allow_tf32=bool(o["allow_tf32"]),
        backend=backend, squeeze_head=squeeze_head,
    )


#: Problem fields that a signature determines: all but the arrays q, k, v.
_SIGNED_FIELDS = tuple(f.name for f in dataclasses.fields(Problem) if f.name not in ("q", "k", "v"))
#: Option value types whose equal values of one type always validate alike.
_PLAIN_TYPES = frozenset({type(None), bool, int, float, str})
_ARRAY_OPTION_NAMES = frozenset(ARRAY_OPTIONS)
_NOT_AN_OPTION = object()


def _signature(q: Any, k: Any, v: Any, options: dict[str, Any]) -> tuple | None:
    """Everything :func:`make_problem` reads of NumPy or CuPy arrays ``q``, ``k``, ``v`` and
    ``options``: the arrays' shapes and dtypes, each option's name, value and type (a float's
    sign too, as -0.0 == 0.0; a tuple's element types), or its bare name when it is None
    (nothing when it is the very object of its default). None when an option is not plain
    data (an array option given, a list, a NumPy scalar): such calls are validated in full."""
    key: list[Any] = [q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype]
    for name, value in options.items():
        if value is None:  # most options of most calls: the bare name
            key.append(name)
            continue
        if value is OPTION_DEFAULTS.get(name, _NOT_AN_OPTION):  # validates as if left out
            continue
        kind = type(value)
        if kind is float:
            key.append((name, value, kind, math.copysign(1.0, value)))
        elif kind in _PLAIN_TYPES and name not in _ARRAY_OPTION_NAMES:
            key.append((name, value, kind))
        elif kind is tuple and all(type(x) in _PLAIN_TYPES for x in value):
            key.append((name, value, kind, tuple(type(x) for x in value)))
        else:
            return None
    return tuple(key)


@functools.lru_cache(maxsize=256)
def _validated(signature: tuple) -> dict[str, Any]:
    """The fields (all but q, k, v) of :func:`make_problem`'s problem for a :func:`_signature`,
    found once: by validating stand-in host arrays of its shapes and dtypes (zero-stride
    views: make_problem reads nothing else of q, k, v) and its options."""
    standins = [np.broadcast_to(np.zeros((), dtype), shape) for shape, dtype in zip(signature[0:6:2], signature[1:6:2])]
    options = dict((item, None) if type(item) is str else item[:2] for item in signature[6:])
    problem = make_problem(*standins, options)
    return {name: getattr(problem, name) for name in _SIGNED_FIELDS}


def _known_problem(q: Any, k: Any, v: Any, options: dict[str, Any]) -> Problem | None:
    """The problem of NumPy or CuPy arrays ``q``, ``k``, ``v`` (on one device) and plain
    ``options``, validated once per signature; None when the options are not plain data or
    the call is invalid, for the full path to validate (and raise the caller's error)."""
    signature = _signature(q, k, v, options)
    if signature is None:
        return None
    try:
        fields = _validated(signature)
    except Exception:  # noqa: BLE001 - invalid: the full path raises the error naming the caller's arrays
        return None
    if fields["squeeze_head"]:
        q, k, v = q[None], k[None], v[None]
    # As Problem(q=q, k=k, v=v, **fields), which would set its 32 frozen fields one by one
    # through object.__setattr__: several times the cost of the rest of a cached call.
    problem = object.__new__(Problem)
    problem.__dict__.update(q=q, k=k, v=v, **fields)
    return problem


def make_host_problem(q: Any, k: Any, v: Any, options: dict[str, Any]) -> Problem:
    """:func:`make_problem` on host NumPy copies (or views) of every array argument."""
    if type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray:
        known = _known_problem(q, k, v, options)
        if known is not None:
            return known
    host = {
        n: _host_array(n, options[n])
        for n in ARRAY_OPTIONS
        if options.get(n) is not None
        and not (n in INT32_LIST_OPTIONS and isinstance(options[n], (list, tuple)))
    }
    return make_problem(_host_array("q", q), _host_array("k", k), _host_array("v", v), {**options, **host})


#: Array options the kernels read on the device; the others are small and stay on the host.
DEVICE_ARRAY_OPTIONS = ("mask", "bias", "block_mask")


def _device_array(name: str, x: Any, device: int):
    """``x`` as a CuPy array on ``device``: zero copy for GPU arrays, else a host-to-device copy."""
    import cupy

    if type(x) is cupy.ndarray:  # the common case, without interop's conversion checks
        arr = x
    elif interop.is_gpu_array(x):
        arr = interop.to_device(x)
    else:
        host = _host_array(name, x)
        with cupy.cuda.Device(device):
            return cupy.asarray(host)
    if arr.device.id != device:
        raise ValueError(f"{name}: expected an array on CUDA device {device} like q, received one on device {arr.device.id}")
    return arr


def make_device_problem(q: Any, k: Any, v: Any, options: dict[str, Any]) -> Problem:
    """:func:`make_problem` on CuPy arrays on q's device (CuPy's current device for host q).

    q, k, v, mask, bias and block_mask move to the device (zero copy when already
    there); lengths, slopes and cu_seqlens are validated on the host.
    """
    import cupy

    if (type(q) is cupy.ndarray and type(k) is cupy.ndarray and type(v) is cupy.ndarray
            and k.device.id == q.device.id == v.device.id):
        known = _known_problem(q, k, v, options)
        if known is not None:
            return known
    device = interop.to_device(q).device.id if interop.is_gpu_array(q) else cupy.cuda.Device().id
    arrays = {name: _device_array(name, x, device) for name, x in (("q", q), ("k", k), ("v", v))}
    device_options = {n: _device_array(n, options[n], device) for n in DEVICE_ARRAY_OPTIONS if options.get(n) is not None}
    host = {
        n: _host_array(n, options[n])
        for n in ARRAY_OPTIONS
        if n not in DEVICE_ARRAY_OPTIONS and options.get(n) is not None
        and not (n in INT32_LIST_OPTIONS and isinstance(options[n], (list, tuple)))
    }
    return make_problem(arrays["q"], arrays["k"], arrays["v"], {**options, **host, **device_options}, xp=cupy)


def check_backward_arrays(problem: Problem, dout: Any, out: Any, lse: Any) -> tuple[Any, Any, Any]:
    """Validate the forward's outputs and the incoming gradient for ``problem``.

    Returns (dout, out, lse) in the problem's internal layout (a leading head
    axis added for 2-D inputs).
    """
    out_shape, lse_shape = problem.out_shape, problem.lse_shape
    if problem.squeeze_head:
        out_shape, lse_shape = out_shape[1:], lse_shape[1:]
    for name, x, shape in (("dout", dout, out_shape), ("out", out, out_shape)):
        _check_array(name, x)
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, received {tuple(x.shape)}")
        if x.dtype != problem.dtype:
            raise TypeError(
                f"{name}: expected dtype {dtype_name(problem.dtype)} like q, received {dtype_name(x.dtype)}"
            )
    _check_array("lse", lse)
    if tuple(lse.shape) != lse_shape:
        raise ValueError(f"lse: expected shape {lse_shape}, received {tuple(lse.shape)}")
    if np.dtype(lse.dtype) not in FLOAT_DTYPES:
        raise TypeError(f"lse: expected a floating dtype, received {dtype_name(lse.dtype)}")
    if problem.dropout_p > 0 and problem.seed is None:
        raise ValueError(
            "seed: expected the forward pass's seed when dropout_p > 0 (the backward regenerates "
            "the dropout mask from it), received None"
        )
    if problem.squeeze_head:
        dout, out, lse = dout[None], out[None], lse[None]
    return dout, out, lse


def check_device_backward_arrays(problem: Problem, dout: Any, out: Any, lse: Any) -> tuple[Any, Any, Any]:
    """:func:`check_backward_arrays` on CuPy arrays on the problem's device (zero copy when there)."""
    device = problem.q.device.id
    return check_backward_arrays(
        problem, _device_array("dout", dout, device), _device_array("out", out, device), _device_array("lse", lse, device)
    )


def check_host_backward_arrays(problem: Problem, dout: Any, out: Any, lse: Any) -> tuple[Any, Any, Any]:
    """:func:`check_backward_arrays` on host NumPy copies (or views) of ``dout``, ``out``, ``lse``.

    Anything that is not array-like (None, a dict, a ragged list) is a TypeError
    naming the argument, not an error from inside NumPy's conversion.
    """
    return check_backward_arrays(problem, _host_array("dout", dout), _host_array("out", out), _host_array("lse", lse))
