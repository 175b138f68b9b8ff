"""The backward's own arguments: the incoming gradient ``dout`` and the forward's ``out``
and ``lse``, checked against the problem the forward solved."""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import device_array
from .model import FLOAT_DTYPES, Problem, dtype_name
from .validate import check_array, host_array


def check_backward_arrays(problem: Problem, dout: Any, out: Any, lse: Any) -> tuple[Any, Any, Any]:
    """Validate the forward's outputs and the incoming gradient for ``problem``.

    Returns (dout, out, lse) in the problem's internal layout (a leading head
    axis added for 2-D inputs).
    """
    out_shape, lse_shape = problem.out_shape, problem.lse_shape
    if problem.squeeze_head:
        out_shape, lse_shape = out_shape[1:], lse_shape[1:]
    for name, x, shape in (("dout", dout, out_shape), ("out", out, out_shape)):
        check_array(name, x)
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape}, received {tuple(x.shape)}")
        if x.dtype != problem.dtype:
            raise TypeError(
                f"{name}: expected dtype {dtype_name(problem.dtype)} like q, received {dtype_name(x.dtype)}"
            )
    check_array("lse", lse)
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
        problem, device_array("dout", dout, device), device_array("out", out, device), device_array("lse", lse, device)
    )


def check_host_backward_arrays(problem: Problem, dout: Any, out: Any, lse: Any) -> tuple[Any, Any, Any]:
    """:func:`check_backward_arrays` on host NumPy copies (or views) of ``dout``, ``out``, ``lse``.

    Anything that is not array-like (None, a dict, a ragged list) is a TypeError
    naming the argument, not an error from inside NumPy's conversion.
    """
    return check_backward_arrays(problem, host_array("dout", dout), host_array("out", out), host_array("lse", lse))
