"""Counter-based random numbers: vectorised Philox4x32-10 and the dropout mask.

Philox4x32-10 (Salmon, Moraes, Dror & Shaw, "Parallel random numbers: as easy
as 1, 2, 3", SC 2011) is the generator Random123 calls ``philox4x32`` with 10
rounds and cuRAND calls ``Philox4_32_10``.  It maps a 128-bit counter (four
uint32 words) and a 64-bit key (two uint32 words) to four uint32 output words.
Each round multiplies words 0 and 2 by 0xD2511F53 and 0xCD9E8D57 (64-bit
product split into high and low halves) and mixes in the key; between rounds
the key words are bumped by the Weyl constants 0x9E3779B9 and 0xBB67AE85.
All arithmetic wraps modulo 2**32.

Dropout layout (shared bit for bit with the CUDA kernels)
--------------------------------------------------------
For an attention-score tensor of shape ``(..., Hq, Lq, Lk)`` the element at
``(bh, i, j)`` -- ``bh`` the C-order flat index over the leading dimensions,
``i`` the query row, ``j`` the key column -- is decided by one 16-bit half of
a Philox output::

    key     = (seed mod 2**32, seed >> 32)            # seed in [0, 2**64)
    counter = (j >> 3, i, bh, offset)                  # offset in [0, 2**32)
    x       = 16-bit half (j & 1) of output word (j >> 1) & 3 (half 0 the low one)
    keep    = x >= t,  t = min(round(p * 2**16), 2**16 - 1)

so one Philox call serves eight consecutive columns.  ``True`` means kept; a
kept element is scaled by ``1 / (1 - p)`` by the caller.  p is thus drawn at
a resolution of 2**-16: the keep probability is 1 - t / 2**16, within 2**-17
of 1 - p up to p = 1 - 2**-17 (above, t's clamp keeps 2**-16 of the
elements); p at or below 2**-17 drops nothing.
"""

from __future__ import annotations

import math
import numbers
import secrets
from typing import Sequence

import numpy as np

__all__ = [
    "philox4x32_10",
    "dropout_threshold",
    "dropout_keep",
    "dropout_mask",
    "new_seed",
]

PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
PHILOX_ROUNDS = 10

# Columns one Philox call decides: four 32-bit words of two 16-bit halves each.
_GROUP = 8

_U16_LIMIT = 1 << 16
_U32_LIMIT = 1 << 32
_U64_LIMIT = 1 << 64
_M0 = np.uint64(PHILOX_M0)
_M1 = np.uint64(PHILOX_M1)
_W0 = np.uint32(PHILOX_W0)
_W1 = np.uint32(PHILOX_W1)

# Target number of output elements per chunk in dropout_mask (bounds the
# Philox temporaries to a few tens of MiB regardless of the output size).
_CHUNK_ELEMS = 1 << 21


def _mulhilo(a: np.ndarray, m: np.uint64) -> tuple[np.ndarray, np.ndarray]:
    """(high, low) uint32 halves of the 64-bit product ``a * m``, elementwise."""
    prod = a.astype(np.uint64)
    prod *= m
    lo = prod.astype(np.uint32)
    prod >>= np.uint64(32)
    hi = prod.astype(np.uint32)
    return hi, lo


def _philox_u32(
    c0: np.ndarray,
    c1: np.ndarray,
    c2: np.ndarray,
    c3: np.ndarray,
    k0: np.ndarray,
    k1: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32-10 on already-validated uint32 arrays (broadcastable).

    Returns the four output words; their shapes are broadcastable to the
    common shape of the inputs but are not necessarily equal to it.
    """
    with np.errstate(over="ignore"):
        for rnd in range(PHILOX_ROUNDS):
            if rnd:
                k0 = k0 + _W0
                k1 = k1 + _W1
            hi0, lo0 = _mulhilo(c0, _M0)
            hi1, lo1 = _mulhilo(c2, _M1)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def _halves(
    words: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
) -> np.ndarray:
    """The eight 16-bit halves of Philox's four words, in column order, on a new last axis.

    Column c of a group is half (c & 1) of word c >> 1, the low half first:
    the uint16 view of little-endian uint32 words in word order.
    """
    shape = np.broadcast_shapes(*(w.shape for w in words))
    stacked = np.empty(shape + (4,), dtype="<u4")
    for n, w in enumerate(words):
        stacked[..., n] = w
    return stacked.view("<u2")


def _as_u32(value: object, name: str) -> np.ndarray:
    """Convert an integer array-like with values in [0, 2**32) to uint32."""
    arr = np.asarray(value)
    if arr.dtype == np.uint32:
        return arr
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must be integer (uint32-compatible) values, "
            f"received dtype {arr.dtype}"
        )
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= _U32_LIMIT):
        raise ValueError(
            f"{name} values must be in [0, 2**32), received range "
            f"[{int(arr.min())}, {int(arr.max())}]"
        )
    return arr.astype(np.uint32)


def philox4x32_10(
    counter: Sequence[object], key: Sequence[object]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Philox4x32-10 applied elementwise.

    Args:
        counter: four uint32-compatible arrays (or scalars), broadcastable to
            each other and to the key words.
        key: two uint32-compatible arrays (or scalars).

    Returns:
        The four output words as uint32 arrays of the common broadcast shape.
    """
    counter = tuple(counter)
    key = tuple(key)
    if len(counter) != 4:
        raise ValueError(f"counter must have 4 words, received {len(counter)}")
    if len(key) != 2:
        raise ValueError(f"key must have 2 words, received {len(key)}")
    words = [_as_u32(c, f"counter[{n}]") for n, c in enumerate(counter)]
    keys = [_as_u32(k, f"key[{n}]") for n, k in enumerate(key)]
    shape = np.broadcast_shapes(*(a.shape for a in words + keys))
    w0, w1, w2, w3 = (
        np.array(np.broadcast_to(w, shape), dtype=np.uint32)
        if np.shape(w) != shape
        else np.asarray(w)
        for w in _philox_u32(*words, *keys)
    )
    return w0, w1, w2, w3


def _is_int(value: object) -> bool:
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )


def _check_int(value: object, name: str, limit: int) -> int:
    """Validate an int in [0, limit) and return it as a Python int."""
    if not _is_int(value):
        raise TypeError(f"{name} must be an int, received {type(value).__name__}")
    value = int(value)  # type: ignore[arg-type]
    if not 0 <= value < limit:
        raise ValueError(
            f"{name} must be in [0, 2**{limit.bit_length() - 1}), received {value}"
        )
    return value


def dropout_threshold(p: float) -> int:
    """16-bit threshold t = min(round(p * 2**16), 2**16 - 1); keep iff x >= t.

    Raises:
        TypeError: ``p`` is not a real number.
        ValueError: ``p`` is not in [0, 1).
    """
    if isinstance(p, (bool, np.bool_)) or not isinstance(
        p, (numbers.Real, np.floating, np.integer)
    ):
        raise TypeError(
            f"dropout_p must be a float in [0, 1), received {type(p).__name__}"
        )
    try:
        p = float(p)
    except OverflowError:  # an int beyond float's range
        raise ValueError(f"dropout_p must be in [0, 1), received an int of {len(str(p))} digits") from None
    if not (0.0 <= p < 1.0):
        raise ValueError(f"dropout_p must be in [0, 1), received {p!r}")
    return min(round(p * _U16_LIMIT), _U16_LIMIT - 1)


def _index_array(value: object, name: str, limit: int) -> np.ndarray:
    """Integer index array with values in [0, limit), as int64."""
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu":
        raise TypeError(
            f"{name} must be an integer array, received dtype {arr.dtype}"
        )
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= limit:
            raise ValueError(
                f"{name} values must be in [0, {limit}), received range [{lo}, {hi}]"
            )
    return arr.astype(np.int64, copy=False)


def _contiguous_start(j: np.ndarray, rest_shape: tuple[int, ...]) -> int | None:
    """First column if ``j`` is a consecutive range along the last output axis.

    Only then can Philox be evaluated once per group of eight columns and the
    halves interleaved; ``rest_shape`` (the broadcast shape of bh and i) must
    not vary along that axis.  Returns None when the fast path does not apply.
    """
    if j.ndim == 0 or j.size != j.shape[-1] or j.size == 0:
        return None
    if rest_shape and rest_shape[-1] != 1:
        return None
    flat = j.reshape(-1)
    if flat.size > 1 and not np.all(np.diff(flat) == 1):
        return None
    return int(flat[0])


def dropout_keep(
    seed: int, offset: int, bh: object, i: object, j: object, p: float
) -> np.ndarray:
    """Keep decisions for elements ``(bh, i, j)``; see the module docstring.

    Args:
        seed: int in [0, 2**64); key = (seed mod 2**32, seed >> 32).
        offset: int in [0, 2**32); counter word 3.
        bh, i, j: integer arrays (broadcastable), bh and i in [0, 2**32),
            j in [0, 2**35).  Typical tile use: bh scalar, i shape (Lq, 1),
            j shape (1, Lk).
        p: dropout probability in [0, 1).

    Returns:
        bool array of the broadcast shape of bh, i, j; True = kept.
    """
    seed = _check_int(seed, "seed", _U64_LIMIT)
    offset = _check_int(offset, "offset", _U32_LIMIT)
    t = dropout_threshold(p)
    bh_a = _index_array(bh, "bh", _U32_LIMIT)
    i_a = _index_array(i, "i", _U32_LIMIT)
    j_a = _index_array(j, "j", _GROUP * _U32_LIMIT)
    out_shape = np.broadcast_shapes(bh_a.shape, i_a.shape, j_a.shape)
    if math.prod(out_shape) == 0:
        return np.zeros(out_shape, dtype=bool)

    k0 = np.uint32(seed & 0xFFFFFFFF)
    k1 = np.uint32(seed >> 32)
    c1 = i_a.astype(np.uint32)
    c2 = bh_a.astype(np.uint32)
    c3 = np.uint32(offset)
    thr = np.uint16(t)

    rest_shape = np.broadcast_shapes(bh_a.shape, i_a.shape)
    j0 = _contiguous_start(j_a, rest_shape)
    if j0 is not None:
        n = j_a.size
        g0 = j0 // _GROUP
        ng = (j0 + n - 1) // _GROUP - g0 + 1
        groups = np.arange(g0, g0 + ng, dtype=np.uint32).reshape(
            (1,) * (j_a.ndim - 1) + (ng,)
        )
        halves = _halves(_philox_u32(groups, c1, c2, c3, k0, k1))
        keep = halves.reshape(halves.shape[:-2] + (_GROUP * ng,)) >= thr
        start = j0 - _GROUP * g0
        keep = keep[..., start : start + n]
        return np.ascontiguousarray(np.broadcast_to(keep, out_shape))

    groups = (j_a // _GROUP).astype(np.uint32)
    halves = _halves(_philox_u32(groups, c1, c2, c3, k0, k1))
    which = (j_a % _GROUP)[..., None]
    keep = np.take_along_axis(halves, np.broadcast_to(which, halves.shape[:-1] + (1,)), axis=-1)[..., 0] >= thr
    return np.ascontiguousarray(np.broadcast_to(keep, out_shape))


def _check_shape(shape: object) -> tuple[int, ...]:
    try:
        dims = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            "shape must be a sequence of non-negative ints, received "
            f"{type(shape).__name__}"
        ) from None
    if len(dims) < 2:
        raise ValueError(
            f"shape must have at least 2 dimensions (..., Lq, Lk), received {dims!r}"
        )
    for d in dims:
        if not _is_int(d):
            raise TypeError(
                f"shape entries must be ints, received {type(d).__name__} in {dims!r}"
            )
        if d < 0:
            raise ValueError(f"shape entries must be non-negative, received {dims!r}")
    dims = tuple(int(d) for d in dims)
    too_big = (
        math.prod(dims[:-2]) > _U32_LIMIT
        or dims[-2] > _U32_LIMIT
        or dims[-1] > _GROUP * _U32_LIMIT
    )
    if too_big:
        raise ValueError(f"shape is too large for the Philox counter layout: {dims!r}")
    return dims


def dropout_mask(
    shape: Sequence[int], p: float, seed: int, offset: int = 0
) -> np.ndarray:
    """The exact dropout keep mask the kernels use.

    Args:
        shape: ``(..., Hq, Lq, Lk)`` with at least 2 entries; bh is the C-order
            flat index over ``shape[:-2]`` (0 when there are only 2 entries).
        p: dropout probability in [0, 1).
        seed: int in [0, 2**64).
        offset: int in [0, 2**32).

    Returns:
        bool array of ``shape``; True = kept.
    """
    dims = _check_shape(shape)
    dropout_threshold(p)
    seed = _check_int(seed, "seed", _U64_LIMIT)
    offset = _check_int(offset, "offset", _U32_LIMIT)

    out = np.empty(dims, dtype=bool)
    n_bh = math.prod(dims[:-2])
    lq, lk = dims[-2], dims[-1]
    if out.size == 0:
        return out
    flat = out.reshape(n_bh, lq, lk)
    cols = np.arange(lk, dtype=np.int64).reshape(1, 1, lk)
    rows_per = max(1, _CHUNK_ELEMS // lk)
    if rows_per >= lq:
        bh_per, rows_per = max(1, _CHUNK_ELEMS // (lq * lk)), lq
    else:
        bh_per = 1
    for b0 in range(0, n_bh, bh_per):
        b1 = min(b0 + bh_per, n_bh)
        bh = np.arange(b0, b1, dtype=np.int64).reshape(-1, 1, 1)
        for r0 in range(0, lq, rows_per):
            r1 = min(r0 + rows_per, lq)
            rows = np.arange(r0, r1, dtype=np.int64).reshape(1, -1, 1)
            flat[b0:b1, r0:r1] = dropout_keep(seed, offset, bh, rows, cols, p)
    return out


def new_seed() -> int:
    """A fresh random seed in [0, 2**64), for callers passing ``seed=None``."""
    return secrets.randbits(64)
