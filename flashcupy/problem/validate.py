"""Argument checks shared by every part of a call: is it an array, of which dtype, does it
broadcast, are its integers in range. Each raises a TypeError or ValueError that names the
argument, what was expected and what was received."""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from .. import interop
from .model import FLOAT_DTYPES, dtype_name, numpy_dtype


def is_int(x: Any) -> bool:
    """An integer that is not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def is_real(x: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def as_float(x: Any) -> float:
    """A real number as a float; integers too large for a float become +-inf."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def describe(x: Any) -> str:
    """What was received, for an error message: an array's kind, shape and dtype, else a short repr."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{type(x).__name__} of shape {tuple(x.shape)} and dtype {dtype_name(x.dtype)}"
    text = repr(x)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{type(x).__name__} {text}"


def check_array(name: str, x: Any) -> None:
    """A TypeError unless ``x`` is an array of numbers."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "ndim")):
        raise TypeError(f"{name}: expected an array, received {describe(x)}")
    dtype = numpy_dtype(x.dtype)  # None: another library's (a torch tensor's), its conversion says what fails
    if dtype is not None and dtype.kind == "O":
        raise TypeError(f"{name}: expected an array of numbers, received {describe(x)}")


def host_array(name: str, x: Any) -> np.ndarray:
    """``x`` as a host NumPy array, or a TypeError naming ``name`` when it is not array-like.

    Arrays of any kind and (nested) lists of numbers convert; other Python
    objects (None, dicts, strings, ragged lists) are rejected here with their
    own description, rather than as an object or string array later. Arrays in
    the other byte order (big-endian data on a little-endian machine) are copied
    into the native order, which is all the backends compute in.
    """
    try:
        arr = interop.to_numpy(x)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name}: expected an array, received {describe(x)} ({exc})") from exc
    if not hasattr(x, "dtype") and arr.dtype.kind not in "biufc":
        raise TypeError(f"{name}: expected an array, received {describe(x)}")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return arr


def check_float_dtype(name: str, x: Any) -> None:
    """A TypeError unless ``x`` has one of the four float dtypes."""
    if np.dtype(x.dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected a floating dtype (float16, bfloat16, float32 or float64), "
            f"received {dtype_name(x.dtype)}"
        )


def broadcast_view(name: str, x: Any, target: tuple[int, ...], xp: Any) -> Any:
    """``x`` broadcast (as a stride-0 view) to ``target``, or a ValueError."""
    ok = x.ndim <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(x.shape), reversed(target))
    )
    if not ok:
        raise ValueError(
            f"{name}: expected a shape broadcastable to {target}, received {tuple(x.shape)}"
        )
    return xp.broadcast_to(x, target)


def host_int_array(name: str, x: Any, target: tuple[int, ...], low: int, high: int) -> np.ndarray:
    """Lengths as host int64 broadcast to ``target``, each in [low, high]."""
    arr = host_array(name, x)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, received dtype {dtype_name(arr.dtype)}")
    arr = broadcast_view(name, arr, target, np)
    # Compare in the array's own dtype: a cast first would wrap huge unsigned values.
    if arr.size and (int(arr.min()) < low or int(arr.max()) > high):
        raise ValueError(
            f"{name}: expected values in [{low}, {high}], received values in "
            f"[{int(arr.min())}, {int(arr.max())}]"
        )
    return arr.astype(np.int64)

