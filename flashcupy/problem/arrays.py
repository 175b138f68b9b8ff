"""Where a problem's arrays live: :func:`make_host_problem` validates host NumPy copies (or
views) for the CPU backend, :func:`make_device_problem` CuPy arrays on q's device for the
CUDA backend (zero copy when they are there already)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import interop
from .build import known_problem, make_problem
from .model import Problem
from .options import ARRAY_OPTIONS, INT32_LIST_OPTIONS
from .validate import host_array


def _host_options(options: dict[str, Any], skip: tuple[str, ...]) -> dict[str, Any]:
    """Host NumPy arrays of the array options given, but those in ``skip`` and the
    cu_seqlens given as lists (validated as lists)."""
    return {
        n: host_array(n, options[n])
        for n in ARRAY_OPTIONS
        if n not in skip and options.get(n) is not None
        and not (n in INT32_LIST_OPTIONS and isinstance(options[n], (list, tuple)))
    }


def make_host_problem(q: Any, k: Any, v: Any, options: dict[str, Any]) -> Problem:
    """:func:`make_problem` on host NumPy copies (or views) of every array argument."""
    if type(q) is np.ndarray and type(k) is np.ndarray and type(v) is np.ndarray:
        known = known_problem(q, k, v, options)
        if known is not None:
            return known
    host = _host_options(options, ())
    return make_problem(host_array("q", q), host_array("k", k), host_array("v", v), {**options, **host})


#: Array options read on the device (by the kernels, or the sinks by flashcupy/sinks.py;
#: rng_state when the kernels run, so a captured CUDA graph sees its updates); the others are
#: small and stay on the host.
DEVICE_ARRAY_OPTIONS = ("mask", "bias", "block_mask", "sinks", "rng_state")


def device_array(name: str, x: Any, device: int):
    """``x`` as a CuPy array on ``device``: zero copy for GPU arrays, else a host-to-device copy."""
    import cupy

    if type(x) is cupy.ndarray:  # the common case, without interop's conversion checks
        arr = x
    elif interop.is_gpu_array(x):
        arr = interop.to_device(x)
    else:
        host = host_array(name, x)
        with cupy.cuda.Device(device):
            return cupy.asarray(host)
    if arr.data.device_id != device:  # the pointer's device: no Device object made
        raise ValueError(f"{name}: expected an array on CUDA device {device} like q, received one on device "
                         f"{arr.data.device_id}")
    return arr


def make_device_problem(q: Any, k: Any, v: Any, options: dict[str, Any]) -> Problem:
    """:func:`make_problem` on CuPy arrays on q's device (CuPy's current device for host q).

    q, k, v, mask, bias, block_mask and sinks move to the device (zero copy when already
    there), and ALiBi slopes already on q's device stay there; lengths, other slopes and
    cu_seqlens are validated on the host.
    """
    import cupy

    if (type(q) is cupy.ndarray and type(k) is cupy.ndarray and type(v) is cupy.ndarray
            and k.device.id == q.device.id == v.device.id):
        known = known_problem(q, k, v, options)
        if known is not None:
            return known
    device = interop.to_device(q).device.id if interop.is_gpu_array(q) else cupy.cuda.Device().id
    arrays = {name: device_array(name, x, device) for name, x in (("q", q), ("k", k), ("v", v))}
    device_options = {n: device_array(n, options[n], device) for n in DEVICE_ARRAY_OPTIONS if options.get(n) is not None}
    if interop.is_gpu_array(options.get("alibi_slopes")):
        slopes = interop.to_device(options["alibi_slopes"])  # zero copy
        if slopes.data.device_id == device:  # read on the device as given: no copy back
            device_options["alibi_slopes"] = slopes
    host = _host_options(options, DEVICE_ARRAY_OPTIONS + tuple(device_options))
    return make_problem(arrays["q"], arrays["k"], arrays["v"], {**options, **host, **device_options}, xp=cupy)

