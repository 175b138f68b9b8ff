"""Assertions that an attention result matches the float64 reference under the tolerance rule.

NumPy only (no Hypothesis): results and inputs may be NumPy, CuPy, PyTorch or any
DLPack array; they are read back to the host and compared there.
"""

from __future__ import annotations

from typing import Any, Sequence

import ml_dtypes
import numpy as np

from .. import interop, reference
from ..problem import make_host_problem
from .rule import Comparison, cancelling_terms, compare, floor_dtype

#: Names of the trailing axes of each result, for messages (leading axes are batch axes).
AXES = {
    "out": ("head", "row", "column"),
    "lse": ("head", "row"),
    "dq": ("head", "row", "column"),
    "dk": ("kv head", "key", "column"),
    "dv": ("kv head", "key", "column"),
    "dbias": ("head", "row", "key"),
    "dsinks": ("head",),
}
GRADIENTS = ("dq", "dk", "dv", "dbias", "dsinks")


def to_host(x: Any) -> np.ndarray:
    """A NumPy array with ``x``'s values and dtype (bfloat16 as ``ml_dtypes.bfloat16``):
    NumPy as it is, CuPy and GPU arrays copied to the host, PyTorch tensors detached."""
    if type(x).__module__.split(".")[0] == "torch":
        import torch

        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:  # NumPy has no bfloat16 of its own; float32 holds it exactly
            return x.float().numpy().astype(ml_dtypes.bfloat16)
        return x.numpy()
    return interop.to_numpy(x)


def host_options(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with every array (of any kind) replaced by its NumPy copy."""
    return {n: (to_host(x) if hasattr(x, "shape") else x) for n, x in options.items()}


def reference_results(q: Any, k: Any, v: Any, options: dict[str, Any],
                      dout: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ref, naive): out and lse, and with ``dout`` dq, dk, dv, dbias and dsinks (None without
    a bias, sinks),
    as float64 NumPy arrays: ``ref`` from the float64 reference, ``naive`` from plain attention
    computed in q's dtype (the rule's comparison point). Arrays of any kind; options as
    :func:`flashcupy.flash_attention` takes them."""
    q, k, v = (to_host(x) for x in (q, k, v))
    options = host_options(options)
    if options.get("dropout_p", 0.0) and options.get("seed") is None and options.get("rng_state") is None:
        raise ValueError("seed: expected an int (or an rng_state) when dropout_p > 0 (the reference needs the same "
                         "dropout bits), received None")
    pb = make_host_problem(q, k, v, options)
    if dout is not None:
        dout = to_host(dout)
        dout = dout[None] if pb.squeeze_head else dout
    results = []
    for compute in (np.float64, q.dtype):
        out, lse = reference.forward(pb, compute)
        r: dict[str, Any] = {"out": out, "lse": lse}
        if dout is not None:
            r.update(zip(GRADIENTS, reference.backward(pb, dout, compute)))
        if pb.squeeze_head:
            r = {n: (a[0] if n not in ("dbias", "dsinks") and a is not None else a) for n, a in r.items()}
        results.append(r)
    return results[0], results[1]


def _value(x: Any) -> str:
    """A short description of an option's value: small arrays in full, others by dtype and shape."""
    if isinstance(x, np.ndarray):
        if x.size <= 8:
            return " ".join(np.array2string(x, separator=", ", precision=4).split())
        return f"{x.dtype.name}{x.shape}"
    return repr(x)


def describe(q: Any, k: Any, v: Any, options: dict[str, Any]) -> str:
    """'float16 q (2, 3, 17, 40), k (2, 1, 97, 40), v (2, 1, 97, 40); causal=True, mask=bool(2, 1, 17, 97)'."""
    arrays = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        strided = isinstance(x, np.ndarray) and not x.flags.c_contiguous and x.size > 1
        arrays.append(f"{name} {tuple(x.shape)}{' strided' if strided else ''}")
    opts = ", ".join(f"{n}={_value(x)}" for n, x in host_options(options).items())
    return f"{_dtype_name(q)} {', '.join(arrays)}; {opts or 'no options'}"


def _dtype_name(x: Any) -> str:
    """'bfloat16' for NumPy (ml_dtypes), CuPy and torch bfloat16 arrays alike."""
    return str(x.dtype).removeprefix("torch.")


def attention_close(out: Any, q: Any, k: Any, v: Any, **options: Any) -> Comparison:
    """``out`` of attention(q, k, v, **options) under the tolerance rule, without raising.

    Returns (error, bound, message): max |out - reference| over the reference's
    finite entries, the largest error allowed (2 x the error of plain attention in
    q's dtype + a rounding floor), and '' or a few lines on what fails. Any array
    kind; options as :func:`flashcupy.flash_attention` takes them (with dropout,
    the keep mask is :func:`flashcupy.dropout_mask` of seed and dropout_offset).
    """
    q, k, v = (to_host(x) for x in (q, k, v))
    ref, naive = reference_results(q, k, v, options)
    return compare(to_host(out), ref["out"], naive["out"], q.dtype, name="out", axes=AXES["out"])


def _failure(what: str, comparisons: Sequence[Comparison], q: Any, k: Any, v: Any,
             options: dict[str, Any]) -> str:
    lines = [f"{what} does not match the float64 reference (max |ours - ref| <= 2 x naive error + floor):"]
    lines += [f"  {c.message}" for c in comparisons if not c.ok]
    lines.append(f"  problem: {describe(q, k, v, options)}")
    return "\n".join(lines)


def assert_attention_close(out: Any, q: Any, k: Any, v: Any, **options: Any) -> None:
    """Raise AssertionError unless ``out`` matches the float64 reference of
    attention(q, k, v, **options) under the tolerance rule (:func:`attention_close`).

    The message names the worst element (batch, head, row, column), its value and the
    reference's, the error against the one allowed, and the problem's shapes and options.
    """
    result = attention_close(out, q, k, v, **options)
    if not result.ok:
        raise AssertionError(_failure("out", [result], q, k, v, options))


def gradients_close(grads: Sequence[Any], dout: Any, q: Any, k: Any, v: Any,
                    **options: Any) -> dict[str, Comparison]:
    """``grads`` = (dq, dk, dv), or as ``flash_attention_backward`` returns them, (dq, dk, dv)
    then dbias with a bias and dsinks with sinks, of <attention(q, k, v, **options), dout>
    under the tolerance rule, without raising: a Comparison per gradient.

    Gradients have the shapes of q, k, v (and of the bias, the sinks). The rule's floor
    grows with the terms that cancel in dS = P (dP - D) (:func:`cancelling_terms`); dbias
    takes the coarser floor of q's and the bias's dtypes.
    """
    grads = tuple(grads)
    bias, sinks = options.get("bias"), options.get("sinks")
    names = ("dq", "dk", "dv") + (("dbias",) if bias is not None else ()) + (("dsinks",) if sinks is not None else ())
    if len(grads) not in (3, len(names)):
        expected = f"(dq, dk, dv) or ({', '.join(names)})" if len(names) > 3 else "(dq, dk, dv) (no bias or sinks given)"
        raise ValueError(f"grads: expected {expected}, received {len(grads)} arrays")
    q, k, v, dout = (to_host(x) for x in (q, k, v, dout))
    ref, naive = reference_results(q, k, v, options, dout)
    dtype = q.dtype
    terms = cancelling_terms(q, k, dout, ref["out"], options.get("scale"), None if bias is None else np.shape(bias),
                             options.get("cu_seqlens_q"))
    results = {}
    for name, g in zip(names, grads):
        dt = floor_dtype(dtype, to_host(bias).dtype) if name == "dbias" else dtype
        results[name] = compare(to_host(g), ref[name], naive[name], dt, terms[name], name=name, axes=AXES[name])
    return results


def assert_gradients_close(grads: Sequence[Any], dout: Any, q: Any, k: Any, v: Any, **options: Any) -> None:
    """Raise AssertionError unless every gradient passes :func:`gradients_close`."""
    results = gradients_close(grads, dout, q, k, v, **options)
    if not all(c.ok for c in results.values()):
        raise AssertionError(_failure("gradients", list(results.values()), q, k, v, options))
