"""Array kinds in and out: NumPy, CuPy, DLPack and ``__cuda_array_interface__`` arrays.

The backends compute on NumPy arrays (CPU) or CuPy arrays (CUDA). This module
turns whatever the caller passed into those and turns results back into the
caller's kind: NumPy in, NumPy out; CuPy in, CuPy out; a PyTorch or JAX array
in (through DLPack), the same kind out.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import numpy as np

_DLPACK_CPU = 1  # DLDeviceType kDLCPU


def _is_cupy(x: Any) -> bool:
    return _is_cupy_type(type(x))


@functools.cache
def _is_cupy_type(kind: type) -> bool:
    """True for classes of the cupy package (checked once per class)."""
    return kind.__module__.split(".")[0] == "cupy"


def _on_cpu_dlpack(x: Any) -> bool:
    try:
        return x.__dlpack_device__()[0] == _DLPACK_CPU
    except (AttributeError, TypeError, RuntimeError):
        return False


def _has(x: Any, attr: str) -> bool:
    """hasattr that survives properties raising anything (torch's __cuda_array_interface__
    raises for tensors requiring grad, and for dtypes it cannot describe)."""
    try:
        return hasattr(x, attr)
    except Exception:  # a property that raises: treat as absent
        return False


def _gpu_dlpack(x: Any) -> bool:
    return _has(x, "__dlpack__") and _has(x, "__dlpack_device__") and not _on_cpu_dlpack(x)


def _cupy():
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            "a GPU array was passed but CuPy is not installed: pip install 'flashcupy[cuda12]' "
            "or 'flashcupy[cuda13]'"
        ) from exc
    return cupy


def array_module(x: Any):
    """CuPy for a CuPy array, NumPy for anything else (the backends' own arrays)."""
    return _cupy() if _is_cupy(x) else np


def to_numpy(x: Any) -> np.ndarray:
    """A host NumPy array with ``x``'s data (no copy where NumPy can share it)."""
    if isinstance(x, np.ndarray):
        return x
    if _is_cupy(x):
        return x.get()
    if hasattr(x, "__dlpack__") and _on_cpu_dlpack(x):
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError) as exc:
            # NumPy's DLPack takes no bfloat16 and torch exports no tensor that requires grad
            hint = "; flashcupy.torch takes torch tensors of every dtype, with gradients" \
                if type(x).__module__.startswith("torch") else ""
            raise TypeError(
                f"cannot read a {type(x).__name__} of dtype {getattr(x, 'dtype', '?')} through DLPack: {exc}{hint}"
            ) from exc
    if _has(x, "__cuda_array_interface__") or _has(x, "__dlpack__"):
        return to_device(x).get()
    return np.asarray(x)


def is_gpu_array(x: Any) -> bool:
    """True for CuPy arrays and any array whose data lives on a CUDA device."""
    return _is_cupy(x) or _gpu_dlpack(x) or _has(x, "__cuda_array_interface__")


def to_device(x: Any):
    """A CuPy array with ``x``'s data: zero copy for CuPy, CUDA-interface and GPU DLPack arrays,
    a host-to-device copy for host arrays (on CuPy's current device). DLPack comes first:
    it carries bfloat16 (the CUDA array interface describes it only as raw bytes)."""
    cupy = _cupy()
    if _is_cupy(x):
        return x
    if _gpu_dlpack(x):
        return cupy.from_dlpack(x)
    if _has(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    return cupy.asarray(to_numpy(x))


def _namespace(x: Any):
    """The module whose ``from_dlpack`` builds arrays of ``x``'s kind."""
    if hasattr(x, "__array_namespace__"):
        return x.__array_namespace__()
    return sys.modules[type(x).__module__.split(".")[0]]


def _device_of(x: Any) -> int:
    """The CUDA device index of a GPU array."""
    if _is_cupy(x):
        return x.device.id
    if _gpu_dlpack(x):
        return int(x.__dlpack_device__()[1])
    return _cupy().asarray(x).device.id  # a __cuda_array_interface__ array: CuPy knows its device


def restorer(x: Any) -> Callable[[Any], Any]:
    """A function turning a NumPy or CuPy result back into ``x``'s array kind and place.

    CuPy results are used as they are (they live on x's device already); host results of
    a GPU caller are copied to x's own device, not CuPy's current one."""
    if isinstance(x, np.ndarray) or not (_has(x, "__dlpack__") or _has(x, "__cuda_array_interface__")):
        return to_numpy
    if _is_cupy(x):
        return _to_cupy_on(x.device.id)
    if not is_gpu_array(x):
        ns = _namespace(x)
        return lambda a: ns.from_dlpack(to_numpy(a))
    on_device = _to_cupy_on(_device_of(x))
    ns = _namespace(x)
    return lambda a: ns.from_dlpack(on_device(a))


@functools.cache
def _to_cupy_on(device: int) -> Callable[[Any], Any]:
    """A function returning CuPy results as they are and copying host results to ``device``."""
    cupy = _cupy()

    def on_device(a):
        if isinstance(a, cupy.ndarray):
            return a
        with cupy.cuda.Device(device):
            return cupy.asarray(a)

    return on_device


@functools.lru_cache(maxsize=1)
def gpu_usable() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU here"
        return False
