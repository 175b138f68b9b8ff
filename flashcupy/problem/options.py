"""Option normalisation: every keyword option of the public functions checked and turned
into the one form the backends read (causal as 'bottom_right'/'top_left'/None, windows
clamped to the frame, masks and bias as broadcast views of the score shape, lengths and
slopes as host arrays, dropout as (p, seed, offset))."""

from __future__ import annotations

import functools
import math
from typing import Any

import ml_dtypes
import numpy as np

from .. import rng
from .model import Layout, dtype_name
from .validate import as_float, broadcast_view, check_array, check_float_dtype, host_array, host_int_array, is_int, is_real

#: Options that carry arrays (converted to the backend's array module before validation).
ARRAY_OPTIONS = (
    "mask", "bias", "alibi_slopes", "sinks", "q_lengths", "kv_lengths", "block_mask", "cu_seqlens_q", "cu_seqlens_k",
    "rng_state",
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
    "sinks": None,
    "softcap": None,
    "q_lengths": None,
    "kv_lengths": None,
    "block_mask": None,
    "block_size": None,
    "dropout_p": 0.0,
    "seed": None,
    "dropout_offset": 0,
    "rng_state": None,
    "cu_seqlens_q": None,
    "cu_seqlens_k": None,
    "return_lse": False,
    "allow_tf32": False,
    "backend": "auto",
}


def with_defaults(options: dict[str, Any]) -> dict[str, Any]:
    """Every option, the given ones over the defaults; unknown names raise TypeError."""
    unknown = sorted(set(options) - set(OPTION_DEFAULTS))
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {', '.join(unknown)}; "
            f"expected some of {', '.join(OPTION_DEFAULTS)}"
        )
    return {**OPTION_DEFAULTS, **options}


def check_backend(backend: Any) -> str:
    """'auto', 'cpu' or 'cuda', else a ValueError."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, received {backend!r}")
    return backend


def check_causal(causal: Any) -> str | None:
    """'bottom_right' (True), 'top_left', or None (False)."""
    if isinstance(causal, (bool, np.bool_)):
        return "bottom_right" if causal else None
    if isinstance(causal, str) and causal in CAUSAL_MODES:
        return CAUSAL_MODES[causal]
    raise ValueError(
        f"causal: expected True, False, 'bottom_right' or 'top_left', received {causal!r}"
    )


def check_window(window: Any, frame_q: int, frame_k: int) -> tuple[int | None, int | None] | None:
    """(left, right) or None. left is clamped to Lk and right to Lq (``frame_k``, ``frame_q``),
    where each side no longer restricts any score, so that the kernels' band sums (query +
    diagonal +- side) stay within +-(Lq + Lk)."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window: expected a pair (left, right) of ints >= 0 or None, received {window!r}")
    for side, w in zip(("left", "right"), window):
        if w is not None and not is_int(w):
            raise TypeError(f"window: expected {side} to be an int >= 0 or None, received {w!r}")
        if w is not None and w < 0:
            raise ValueError(f"window: expected {side} to be >= 0 or None, received {w}")
    left, right = (None if w is None else min(int(w), limit) for w, limit in zip(window, (frame_k, frame_q)))
    return None if left is None and right is None else (left, right)


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
    if not is_real(dropout_p):
        raise TypeError(f"dropout_p: expected a float in [0, 1), received {dropout_p!r}")
    p = as_float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1), received {dropout_p!r}")
    rng.dropout_threshold(p)
    if seed is not None:
        if not is_int(seed):
            raise TypeError(f"seed: expected an int in [0, 2**64) or None, received {seed!r}")
        if not 0 <= seed < 2**64:
            raise ValueError(f"seed: expected an int in [0, 2**64), received {seed}")
        seed = int(seed)
    if not is_int(offset):
        raise TypeError(f"dropout_offset: expected an int in [0, 2**32), received {offset!r}")
    if not 0 <= offset < 2**32:
        raise ValueError(f"dropout_offset: expected an int in [0, 2**32), received {offset}")
    return p, seed, int(offset)


_checked_dropout = functools.lru_cache(maxsize=256, typed=True)(_check_dropout)


def _rng_state(state: Any, seed: int | None, offset: int) -> Any:
    """The ``rng_state`` option as given (None, or a contiguous (2,) array of 8-byte ints:
    dropout's seed and offset, read when the computation runs), with errors naming it; it
    replaces ``seed`` and ``dropout_offset``, which must be left out beside it."""
    if state is None:
        return None
    check_array("rng_state", state)
    dtype = np.dtype(state.dtype)
    if dtype.kind not in "iu" or dtype.itemsize != 8:
        raise TypeError(f"rng_state: expected int64 or uint64 values (seed, offset), received dtype {dtype_name(dtype)}")
    if tuple(state.shape) != (2,) or tuple(state.strides) != (8,):
        raise ValueError(f"rng_state: expected a contiguous array of shape (2,) (seed, offset), received shape "
                         f"{tuple(state.shape)} with strides {tuple(state.strides)}")
    if seed is not None or offset != 0:
        raise ValueError(f"rng_state: expected seed=None and dropout_offset=0 beside it (it holds both), received "
                         f"seed={seed!r}, dropout_offset={offset!r}")
    return state


def _scale(scale: Any, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if not is_real(scale):
        raise TypeError(f"scale: expected a finite real number or None, received {scale!r}")
    if not math.isfinite(as_float(scale)):
        raise ValueError(f"scale: expected a finite real number or None, received {scale!r}")
    return float(scale)


def _softcap(softcap: Any) -> float | None:
    if softcap is None:
        return None
    if not is_real(softcap):
        raise TypeError(f"softcap: expected a positive float or None, received {softcap!r}")
    if not (math.isfinite(as_float(softcap)) and softcap > 0):
        raise ValueError(f"softcap: expected a positive finite float or None, received {softcap!r}")
    return as_float(softcap)


def _bool_array(name: str, x: Any, what: str) -> None:
    check_array(name, x)
    if x.dtype != np.bool_:
        raise TypeError(f"{name}: expected dtype bool{what}, received {dtype_name(x.dtype)}")


def _check_real(name: str, x: Any) -> None:
    if x.dtype.kind not in "iuf" and x.dtype != ml_dtypes.bfloat16:
        raise TypeError(f"{name}: expected real numbers, received dtype {dtype_name(x.dtype)}")


def _slopes(slopes: Any, target: tuple[int, ...], xp: Any) -> Any:
    """ALiBi slopes broadcast to (*batch, Hq): host float64, all finite; or, slopes given on
    the GPU of a device problem (``xp`` CuPy), a device view whose values are not read, as
    the sinks' (no copy back and no wait for the GPU; NaN and inf reach the rows of their
    head)."""
    if slopes is None:
        return None
    if xp is not np and type(slopes) is xp.ndarray:
        _check_real("alibi_slopes", slopes)
        return broadcast_view("alibi_slopes", slopes, target, xp)
    host = host_array("alibi_slopes", slopes)
    _check_real("alibi_slopes", host)
    slopes = np.array(broadcast_view("alibi_slopes", host, target, np), dtype=np.float64)
    if not np.isfinite(slopes).all():
        raise ValueError(f"alibi_slopes: expected finite values, received {slopes[~np.isfinite(slopes)][0]}")
    return slopes


def _sinks(sinks: Any, target: tuple[int, ...], xp: Any) -> tuple[Any, tuple[int, ...] | None]:
    """(attention sinks broadcast to (*batch, Hq) as a view in ``xp``, their own shape), or
    (None, None). Their values are not read: GPU sinks cost no copy or wait, and any value
    has a meaning (-inf: no sink; NaN and +inf reach the rows of their head)."""
    if sinks is None:
        return None, None
    check_array("sinks", sinks)
    _check_real("sinks", sinks)
    return broadcast_view("sinks", sinks, target, xp), tuple(sinks.shape)


def _block_mask(block_mask: Any, block_size: Any, lay: Layout, xp: Any) -> tuple[Any, int | None]:
    """(block mask broadcast to (*batch, Hq, ceil(Lq/bs), ceil(Lk/bs)), block size), or (None, None)."""
    if block_mask is not None:
        _bool_array("block_mask", block_mask, "")
        if block_size is None:
            raise ValueError("block_size: expected a positive int with block_mask, received None")
    if block_size is None:
        return None, None
    if block_mask is None:
        raise ValueError("block_size: expected None without block_mask, received " + repr(block_size))
    if not is_int(block_size):
        raise TypeError(f"block_size: expected a positive int, received {block_size!r}")
    if block_size < 1:
        raise ValueError(f"block_size: expected a positive int, received {block_size}")
    # A block at least as long as both frames is one block either way; clamping keeps
    # the backends' index arithmetic in int64.
    frame_q, frame_k = lay.seqlen_q, lay.seqlen_k
    block_size = min(int(block_size), max(frame_q, frame_k, 1))
    blocks = lay.batch + (lay.num_heads_q, -(-frame_q // block_size), -(-frame_k // block_size))
    return broadcast_view("block_mask", block_mask, blocks, xp), block_size


def check_options(o: dict[str, Any], lay: Layout, xp: Any) -> dict[str, Any]:
    """The :class:`~flashcupy.problem.Problem` fields of every option in ``o`` for the
    layout ``lay``; array options are broadcast with ``xp`` (NumPy or CuPy)."""
    fields: dict[str, Any] = {
        "scale": _scale(o["scale"], lay.head_dim),
        "softcap": _softcap(o["softcap"]),
        "causal": check_causal(o["causal"]),
        "window": check_window(o["window"], lay.seqlen_q, lay.seqlen_k),
    }
    scores_shape = lay.batch + (lay.num_heads_q, lay.seqlen_q, lay.seqlen_k)

    mask = o["mask"]
    if mask is not None:
        _bool_array("mask", mask, " (True = attend)")
        mask = broadcast_view("mask", mask, scores_shape, xp)

    bias, bias_shape = o["bias"], None
    if bias is not None:
        check_array("bias", bias)
        check_float_dtype("bias", bias)
        bias_shape = tuple(bias.shape)
        bias = broadcast_view("bias", bias, scores_shape, xp)
    heads = lay.batch + (lay.num_heads_q,)
    sinks, sinks_shape = _sinks(o["sinks"], heads, xp)
    fields.update(mask=mask, bias=bias, bias_shape=bias_shape, alibi_slopes=_slopes(o["alibi_slopes"], heads, xp),
                  sinks=sinks, sinks_shape=sinks_shape)

    for name, limit in (("q_lengths", lay.seqlen_q), ("kv_lengths", lay.seqlen_k)):
        fields[name] = None if o[name] is None else host_int_array(name, o[name], lay.batch, 0, limit)

    fields["block_mask"], fields["block_size"] = _block_mask(o["block_mask"], o["block_size"], lay, xp)
    fields["dropout_p"], fields["seed"], fields["dropout_offset"] = check_dropout(
        o["dropout_p"], o["seed"], o["dropout_offset"])
    fields["rng_state"] = _rng_state(o["rng_state"], fields["seed"], fields["dropout_offset"])

    for name in ("return_lse", "allow_tf32"):
        if not isinstance(o[name], (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, received {o[name]!r}")
        fields[name] = bool(o[name])
    return fields
