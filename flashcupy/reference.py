"""Dense float64 reference of docs/semantics.md, forward and analytic backward.

This is the oracle every backend is tested against, so it is written for
clarity, not memory: it materialises the full (*batch, Hq, Lq, Lk) score
matrix. It shares only argument validation (:mod:`flashcupy.problem`) and the
dropout bits (:mod:`flashcupy.rng`) with the backends; the maths is its own.

``compute_dtype`` gives the "naive attention in the input dtype" that the
tolerance rule (docs/semantics.md#accuracy, :mod:`flashcupy.testing.rule`) compares
against: arithmetic in float32 (float64 for float64), as PyTorch computes float16 and
bfloat16 products, and every intermediate (scores, probabilities, products) rounded to the
dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.special import logsumexp

from . import interop, rng
from .sinks import sum_to_shape
from .problem import Problem, check_backward_arrays, lse_dtype, make_host_problem


@dataclass
class _Forward:
    """Everything the backward needs from a dense forward, all in the padded frame."""

    q: np.ndarray   # (*batch, Hq, Lq, D), zero outside the lengths
    k: np.ndarray   # (*batch, Hq, Lk, D), k repeated over each GQA group
    v: np.ndarray   # (*batch, Hq, Lk, Dv)
    tanh: np.ndarray | None  # tanh(s_raw / softcap), (*batch, Hq, Lq, Lk)
    p: np.ndarray   # softmax probabilities before dropout
    pd: np.ndarray  # after dropout: p * keep / (1 - dropout_p)
    zd: np.ndarray | None  # keep / (1 - dropout_p), or None without dropout
    out: np.ndarray  # (*batch, Hq, Lq, Dv)
    lse: np.ndarray  # (*batch, Hq, Lq)
    p_sink: np.ndarray | None  # exp(sink - lse), each row's sink probability, (*batch, Hq, Lq)


def _precision(compute_dtype: Any):
    """(working dtype, rounding function) for a compute dtype."""
    dt = np.dtype(compute_dtype)
    if dt == np.float64:
        return np.dtype(np.float64), lambda x: x
    work = np.dtype(np.float32)
    return work, lambda x: np.asarray(x).astype(dt).astype(work)


def _frame_lengths(pb: Problem) -> tuple[np.ndarray, np.ndarray]:
    """Per-batch (q_len, kv_len) as int64 arrays of shape batch."""
    if pb.varlen:
        return np.diff(pb.cu_seqlens_q), np.diff(pb.cu_seqlens_k)
    ql = np.full(pb.batch, pb.seqlen_q) if pb.q_lengths is None else pb.q_lengths
    kl = np.full(pb.batch, pb.seqlen_k) if pb.kv_lengths is None else pb.kv_lengths
    return np.asarray(ql, dtype=np.int64), np.asarray(kl, dtype=np.int64)


def _to_frame(x: np.ndarray, cu: np.ndarray | None, frame: int, work: np.dtype) -> np.ndarray:
    """(H, total, d) packed -> (B, H, frame, d) padded with zeros; padded input as is; in ``work``."""
    x = np.asarray(x, dtype=work)
    if cu is None:
        return x
    out = np.zeros((len(cu) - 1, x.shape[0], frame) + x.shape[2:], dtype=work)
    for b in range(len(cu) - 1):
        out[b, :, : cu[b + 1] - cu[b]] = x[:, cu[b] : cu[b + 1]]
    return out


def _from_frame(x: np.ndarray, cu: np.ndarray | None) -> np.ndarray:
    """Inverse of :func:`_to_frame`: (B, H, frame, ...) -> (H, total, ...)."""
    if cu is None:
        return x
    parts = [x[b, :, : cu[b + 1] - cu[b]] for b in range(len(cu) - 1)]
    if not parts:
        return np.zeros((x.shape[1], 0) + x.shape[3:])
    return np.concatenate(parts, axis=1)


def _allowed(pb: Problem, q_len: np.ndarray, kv_len: np.ndarray) -> np.ndarray:
    """Boolean (*batch, Hq, Lq, Lk): True where score (i, j) survives every mask."""
    lq, lk = pb.seqlen_q, pb.seqlen_k
    i = np.arange(lq)[:, None]
    j = np.arange(lk)[None, :]
    ql = q_len[..., None, None, None]
    kl = kv_len[..., None, None, None]
    diag = kl - ql
    allowed = (i < ql) & (j < kl) & np.ones((pb.num_heads_q, 1, 1), dtype=bool)
    if pb.causal == "bottom_right":
        allowed = allowed & (j <= i + diag)
    elif pb.causal == "top_left":
        allowed = allowed & (j <= i)
    if pb.window is not None:
        left, right = pb.window
        if left is not None:
            allowed = allowed & (j >= i + diag - left)
        if right is not None:
            allowed = allowed & (j <= i + diag + right)
    if pb.mask is not None:
        allowed = allowed & np.asarray(pb.mask)
    if pb.block_mask is not None:
        bs = pb.block_size
        bm = np.asarray(pb.block_mask)
        allowed = allowed & bm[..., np.arange(lq) // bs, :][..., np.arange(lk) // bs]
    return np.broadcast_to(allowed, pb.batch + (pb.num_heads_q, lq, lk))


def _forward(pb: Problem, compute_dtype: Any = np.float64) -> _Forward:
    work, rnd = _precision(compute_dtype)
    q_len, kv_len = _frame_lengths(pb)
    q = _to_frame(pb.q, pb.cu_seqlens_q, pb.seqlen_q, work)
    k = _to_frame(pb.k, pb.cu_seqlens_k, pb.seqlen_k, work)
    v = _to_frame(pb.v, pb.cu_seqlens_k, pb.seqlen_k, work)
    # Padding beyond the lengths is never read: zero it so NaN there cannot leak through 0 * NaN.
    q = np.where(np.arange(pb.seqlen_q)[:, None] < q_len[..., None, None, None], q, 0.0)
    kv_valid = np.arange(pb.seqlen_k)[:, None] < kv_len[..., None, None, None]
    k = np.repeat(np.where(kv_valid, k, 0.0), pb.group_size, axis=-3)
    v = np.repeat(np.where(kv_valid, v, 0.0), pb.group_size, axis=-3)

    s = rnd(pb.scale * np.einsum("...id,...jd->...ij", q, k))
    tanh = None
    if pb.softcap is not None:
        tanh = np.tanh(s / pb.softcap)
        s = rnd(pb.softcap * tanh)
    if pb.bias is not None:
        s = rnd(s + np.asarray(pb.bias, dtype=work))
    if pb.alibi_slopes is not None:
        i = np.arange(pb.seqlen_q)[:, None]
        j = np.arange(pb.seqlen_k)[None, :]
        dist = np.abs(i + (kv_len - q_len)[..., None, None, None] - j)
        s = rnd(s - (pb.alibi_slopes[..., None, None] * dist).astype(work))
    s = np.where(_allowed(pb, q_len, kv_len), s, -np.inf)

    with np.errstate(divide="ignore", invalid="ignore"):
        lse = logsumexp(s, axis=-1)
    sink = p_sink = None
    if pb.sinks is not None:
        # The sink joins the denominator of every row inside q_len (padded rows take none).
        rows = np.arange(pb.seqlen_q) < q_len[..., None, None]
        sink = np.where(rows, np.asarray(pb.sinks, np.float64)[..., None], -np.inf)
        with np.errstate(invalid="ignore"):  # a NaN sink gives its rows NaN
            lse = np.logaddexp(lse, sink)
    # A fully masked row has lse = -inf; subtracting 0 instead gives exp(-inf) = 0, never NaN.
    lse_safe = np.where(lse == -np.inf, 0.0, lse)
    p = np.exp(s - lse_safe[..., None])
    # Rows with a finite maximum m: p = e / sum(e) with e = exp(s - m) instead. exp(s - lse) loses
    # the row's size where |m| dwarfs log(n) (lse = m + log(n) rounds to m: a bias of
    # finfo.min everywhere would give p = 1 per key, not 1 / n).
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        m = np.max(s, axis=-1) if s.shape[-1] else np.full(s.shape[:-1], -np.inf)
        if sink is not None:
            m = np.maximum(m, sink)
        finite = np.isfinite(m)
        e = np.exp(s - np.where(finite, m, 0.0)[..., None])
        e_sink = None if sink is None else np.exp(sink - np.where(finite, m, 0.0))
        den = e.sum(axis=-1) + (0.0 if e_sink is None else e_sink)
        p = np.where(finite[..., None], e / np.where(finite, den, 1.0)[..., None], p)
        if sink is not None:
            p_sink = np.where(rows & finite, e_sink / np.where(finite, den, 1.0), 0.0)
    # A row with no live score takes no value, whatever its sink (a NaN sink made p NaN there).
    p = np.where(np.all(s == -np.inf, axis=-1, keepdims=True), 0.0, p)
    p = rnd(p)
    zd = None
    pd = p
    if pb.dropout_p > 0:
        keep = rng.dropout_mask(s.shape, pb.dropout_p, *pb.dropout_key())
        zd = (keep / (1.0 - pb.dropout_p)).astype(work)
        pd = rnd(p * zd)
    out = rnd(pd @ v)
    return _Forward(q=q, k=k, v=v, tanh=tanh, p=p, pd=pd, zd=zd, out=out, lse=lse, p_sink=p_sink)


def _group_sum(x: np.ndarray, pb: Problem) -> np.ndarray:
    """(*batch, Hq, L, d) -> (*batch, Hk, L, d), summing each GQA group."""
    shape = x.shape[:-3] + (pb.num_heads_k, pb.group_size) + x.shape[-2:]
    return x.reshape(shape).sum(axis=-3)


def _backward(pb: Problem, fw: _Forward, dout: np.ndarray, compute_dtype: Any = np.float64):
    """Analytic gradients (dq, dk, dv, dbias, dsinks) in the padded frame from a dense forward;
    the sink, a score with no value, has dS = P_sink (0 - D)."""
    _, rnd = _precision(compute_dtype)
    q_len, _ = _frame_lengths(pb)
    dout = np.where(np.arange(pb.seqlen_q)[:, None] < q_len[..., None, None, None], dout, 0.0)
    dv = rnd(_group_sum(np.swapaxes(fw.pd, -1, -2) @ dout, pb))
    dp = rnd(dout @ np.swapaxes(fw.v, -1, -2))
    if fw.zd is not None:
        dp = dp * fw.zd
    delta = np.sum(dout * fw.out, axis=-1, keepdims=True)
    ds = rnd(fw.p * (dp - delta))
    dbias = None if pb.bias is None else sum_to_shape(ds, pb.bias_shape)
    dsinks = None if fw.p_sink is None else sum_to_shape(-(fw.p_sink * delta[..., 0]).sum(axis=-1), pb.sinks_shape)
    if fw.tanh is not None:
        ds = ds * (1.0 - fw.tanh**2)  # d softcap*tanh(s/softcap) / ds = 1 - tanh^2
    dq = rnd(pb.scale * (ds @ fw.k))
    dk = rnd(_group_sum(pb.scale * (np.swapaxes(ds, -1, -2) @ fw.q), pb))
    return dq, dk, dv, dbias, dsinks


def forward(pb: Problem, compute_dtype: Any = np.float64) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) of a validated problem in its own layout, float64 NumPy arrays."""
    fw = _forward(pb, compute_dtype)
    out = _from_frame(fw.out, pb.cu_seqlens_q).astype(np.float64)
    return out, _from_frame(fw.lse[..., None], pb.cu_seqlens_q)[..., 0].astype(np.float64)


def backward(pb: Problem, dout: Any, compute_dtype: Any = np.float64):
    """(dq, dk, dv, dbias, dsinks) of a validated problem; dbias is None without a bias,
    dsinks None without sinks."""
    fw = _forward(pb, compute_dtype)
    dout = _to_frame(interop.to_numpy(dout), pb.cu_seqlens_q, pb.seqlen_q, _precision(compute_dtype)[0])
    dq, dk, dv, dbias, dsinks = _backward(pb, fw, dout, compute_dtype)
    f64 = np.float64
    return (
        _from_frame(dq, pb.cu_seqlens_q).astype(f64),
        _from_frame(dk, pb.cu_seqlens_k).astype(f64),
        _from_frame(dv, pb.cu_seqlens_k).astype(f64),
        None if dbias is None else dbias.astype(f64),
        None if dsinks is None else dsinks.astype(f64),
    )


def _host_problem(q: Any, k: Any, v: Any, options: dict[str, Any]) -> Problem:
    pb = make_host_problem(q, k, v, options)
    if pb.dropout_p > 0 and pb.seed is None and pb.rng_state is None:
        raise ValueError("seed: expected an int (or an rng_state) when dropout_p > 0 (the reference needs the bits), "
                         "received None")
    return pb


def _squeeze(pb: Problem, *arrays: np.ndarray | None):
    return tuple(a[0] if (pb.squeeze_head and a is not None) else a for a in arrays)


def attention_reference(q: Any, k: Any, v: Any, **options: Any):
    """Dense float64 attention with exactly the semantics of :func:`flashcupy.flash_attention`.

    Takes the same arguments (any array kind) and returns float64 NumPy arrays:
    ``out`` of shape (..., Hq, Lq, Dv), and ``(out, lse)`` with ``return_lse=True``,
    lse of shape (..., Hq, Lq). ``seed`` is required when ``dropout_p > 0``.
    Memory is O(Lq * Lk) per head: this is the oracle, not a fast path.
    """
    pb = _host_problem(q, k, v, options)
    out, lse = _squeeze(pb, *forward(pb))
    return (out, lse) if pb.return_lse else out


def attention_reference_backward(dout: Any, q: Any, k: Any, v: Any, **options: Any):
    """Dense float64 gradients (dq, dk, dv, dbias) of :func:`attention_reference`, and dsinks
    (the sinks' own shape) after them when sinks are given.

    dbias has the bias's own shape and is None without a bias. Shapes as the
    inputs; every result is a float64 NumPy array.
    """
    pb = _host_problem(q, k, v, options)
    dout = interop.to_numpy(dout)
    dout, _, _ = check_backward_arrays(
        pb, dout.astype(pb.dtype), np.zeros(dout.shape, pb.dtype), np.zeros(dout.shape[:-1], lse_dtype(pb.dtype))
    )
    dq, dk, dv, dbias, dsinks = backward(pb, dout)
    return _squeeze(pb, dq, dk, dv) + (dbias,) + (() if dsinks is None else (dsinks,))
