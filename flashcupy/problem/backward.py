"""The backward's own arguments: the incoming gradient ``dout`` and the forward's ``out``
and ``lse``, checked against the problem the forward solved."""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import device_array
from .model import Problem, dtype_name, lse_dtype
from .validate import check_array, host_array


def check_backward_arrays(problem: Problem, dout: Any, out: Any, lse: Any) -> tuple[Any, Any, Any]:
    """Validate the incoming gradient and the forward's outputs for ``problem``.

    ``dout`` and ``out`` must have the shape and dtype the forward gives ``out``: q's shape
    with v's head dim, q's dtype; ``lse`` the shape and dtype the forward gives it: q's shape
    without the head dim, float32 (float64 for float64 inputs). Returns (dout, out, lse) in
    the problem's internal layout (a leading head axis added for 2-D inputs).
    """
    out_shape, lse_shape = problem.out_shape, problem.lse_shape
    if problem.squeeze_head:
        out_shape, lse_shape = out_shape[1:], lse_shape[1:]
    out_rule = "the forward's out: q's shape with v's head dim"
    lse_rule = "the forward's lse: q's shape without its head dim"
    expected = (
        ("dout", dout, out_shape, out_rule, problem.dtype),
        ("out", out, out_shape, out_rule, problem.dtype),
        ("lse", lse, lse_shape, lse_rule, lse_dtype(problem.dtype)),
    )
    for name, x, shape, shape_rule, dtype in expected:
        check_array(name, x)
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} ({shape_rule}), received {tuple(x.shape)}")
        if np.dtype(x.dtype) != dtype:
            # the message is built here only: dtype names cost NumPy a Python call each
            rule = "like q" if name != "lse" else f"(the forward's lse for {dtype_name(problem.dtype)} inputs)"
            raise TypeError(f"{name}: expected dtype {dtype_name(dtype)} {rule}, received {dtype_name(x.dtype)}")
    if problem.dropout_p > 0 and problem.seed is None and problem.rng_state is None:
        raise ValueError(
            "seed: expected the forward pass's seed (or its rng_state) when dropout_p > 0 (the backward "
            "regenerates the dropout mask from it), received None"
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
