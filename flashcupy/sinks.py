"""Attention sinks: per-head logits that join each row's softmax denominator and take no value.

A sink s_h changes no score, only the denominator of its head's rows:

    lse'_i = log(exp(s_h) + sum_j exp(S_ij)),   P'_ij = exp(S_ij - lse'_i),   out'_i = sum_j P'_ij V_j.

Given the backends' (out, lse) of the scores alone, then,

    lse' = logaddexp(lse, s),   out' = out * exp(lse - lse'),

and a backward handed lse' and out' recomputes the sink-aware P' and D = rowsum(dO * out')
by itself, so its dq, dk, dv (and dbias) are exact without knowing of the sink. The sink's own
gradient is the extra column's dS with no value behind it:

    dL/ds_h = sum over the head's rows of P'_sink,i (0 - D_i) = -sum_i exp(s_h - lse'_i) D_i,

summed over the axes the sinks were broadcast along. Every pipeline therefore runs unchanged
(dropout included: it scales P' after normalisation), and sinks cost lse-sized work and,
on the CPU, one pass over out forward. Rows past ``q_lengths`` stay out 0, lse -inf;
a row whose scores are all masked gets lse' = s_h and out' = 0; a sink of -inf is no sink.

The CUDA forward folds the sinks into each row's sum in its epilogue instead (the same
lse', with out' normalised once, from the float32 or float64 accumulator); :func:`apply`
serves the CPU backend, :func:`grad` both.

Both functions take NumPy or CuPy arrays in a problem's internal layout (``xp`` their module).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .problem import Problem


def _row_sinks(pb: Problem, xp: Any, dtype: Any) -> Any:
    """The sink of each row, shaped like lse in the internal layout ((*batch, Hq, Lq) or
    packed (Hq, total_q)); -inf on padded rows (past q_lengths), which take no sink."""
    sinks = xp.asarray(pb.sinks, dtype=dtype)  # (*batch, Hq)
    if pb.varlen:
        cu = np.asarray(pb.cu_seqlens_q)
        counts = np.diff(cu)
        # (B, Hq) -> (Hq, total_q): sequence b's rows take row b
        return xp.repeat(sinks.T, counts.tolist(), axis=1)
    rows = xp.broadcast_to(sinks[..., None], pb.lse_shape)
    if pb.q_lengths is None:
        return rows
    valid = np.arange(pb.seqlen_q) < np.asarray(pb.q_lengths)[..., None, None]  # (*batch, 1, Lq)
    return xp.where(xp.asarray(valid), rows, -np.inf)


def apply(pb: Problem, out: Any, lse: Any, xp: Any) -> Any:
    """Fold the problem's sinks into a forward's results: scales ``out`` (internal layout,
    owned by the caller) in place by exp(lse - lse') and returns lse' = logaddexp(lse, sink)."""
    sink = _row_sinks(pb, xp, lse.dtype)
    with np.errstate(invalid="ignore"):  # a NaN sink gives its rows NaN, as documented
        new_lse = xp.logaddexp(lse, sink)
    # exp(lse - lse') in (0, 1]; where lse = -inf (no score survives, or a padded row) out
    # is 0 and the scale exp(-inf - 0) = 0 keeps it so. The product is taken in lse's dtype.
    scale = xp.exp(lse - xp.where(lse != -np.inf, new_lse, 0))
    if out.flags.c_contiguous:  # the backends' own arrays: rows of Dv, a one-axis broadcast
        rows = out.reshape(-1, out.shape[-1])
        xp.multiply(rows, scale.reshape(-1, 1), out=rows, casting="same_kind")
    else:
        xp.multiply(out, scale[..., None], out=out, casting="same_kind")
    return new_lse


def grad(pb: Problem, dout: Any, out: Any, lse: Any, xp: Any, delta: Any = None) -> Any:
    """dL/dsinks in the sinks' own shape, float64 (float64 throughout: the sum runs over
    every row of a head), from the forward's sink-aware ``out`` and ``lse`` and ``dout``,
    all in the internal layout; ``delta`` = rowsum(dout * out) where a backend has it
    already (shaped like lse), else it is computed here."""
    f64 = np.float64
    if delta is None:  # products in the accumulator dtype, as the kernels take D; sums in float64
        acc = lse.dtype
        delta = (dout.astype(acc) * out.astype(acc)).sum(axis=-1, dtype=f64)
    sink = _row_sinks(pb, xp, f64)
    live = lse != -np.inf
    # P'_sink = exp(s - lse'); padded rows (lse' = -inf, no sink) take exp(-inf - inf) = 0,
    # and their D, which nothing else reads, is not read here either (it may be NaN).
    p_sink = xp.exp(sink - xp.where(live, lse.astype(f64), np.inf))
    per_row = xp.where(live, -p_sink * delta, 0.0)
    if pb.varlen:  # (Hq, total_q) -> (B, Hq): each sequence's rows
        cu = xp.asarray(np.asarray(pb.cu_seqlens_q))
        csum = xp.concatenate([xp.zeros((per_row.shape[0], 1), f64), xp.cumsum(per_row, axis=1)], axis=1)
        per_head = (csum[:, cu[1:]] - csum[:, cu[:-1]]).T
    else:
        per_head = per_row.sum(axis=-1)  # (*batch, Hq)
    return sum_to_shape(per_head, pb.sinks_shape)


def sum_to_shape(x: Any, shape: tuple[int, ...]) -> Any:
    """Sum ``x`` over the axes that ``shape`` broadcasts to x's shape (broadcasting undone)."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead)))
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return x.sum(axis=axes, keepdims=True).reshape(shape)
