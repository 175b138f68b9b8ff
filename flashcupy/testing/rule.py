"""The tolerance rule of docs/semantics.md#accuracy, in one place.

A result ``ours`` of attention in dtype ``dtype`` passes against the float64
reference ``ref`` when it has the reference's shape and non-finite entries
(the same infinities; NaN where the reference has NaN) and, over the
reference's finite entries,

    max |ours - ref| <= 2 * max |naive - ref| + ROUNDING_FLOOR[dtype] * max(1, max |ref|, magnitude)

with ``naive`` plain attention computed in the input dtype
(:func:`flashcupy.reference.forward` with ``compute_dtype``), as FlashAttention's
own tests do; float64 results must also be within 1e-9. The tests, the
``check`` and ``demo`` commands, the benchmark and :mod:`flashcupy.testing`'s
assertions all call :func:`tolerance` and :func:`compare` from here.

NumPy only: no Hypothesis, no GPU.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import ml_dtypes
import numpy as np

#: Rounding floor of the tolerance rule, relative to max(1, max |ref|): about one
#: unit in the last place for float16 and bfloat16 outputs. float32 gets 2^-17:
#: a FlashAttention backward recomputes P = exp(S - lse) from a float32
#: log-sum-exp, whose absolute error |lse| * 2^-24 becomes relative error in P
#: (2^-19 for logits near 32), which plain softmax does not pay. float64: far
#: below the 1e-9 acceptance bound, far above its accumulation error.
ROUNDING_FLOOR = {
    np.dtype(np.float16): 2.0**-10,
    np.dtype(ml_dtypes.bfloat16): 2.0**-7,
    np.dtype(np.float32): 2.0**-17,
    np.dtype(np.float64): 2.0**-40,
}

#: Absolute bound on any float64 result, whatever the rule allows.
FLOAT64_LIMIT = 1e-9


def _dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt not in ROUNDING_FLOOR:
        names = ", ".join(d.name for d in ROUNDING_FLOOR)
        raise ValueError(f"dtype: expected one of {names}, received {dt.name}")
    return dt


def floor_dtype(*dtypes: Any) -> np.dtype:
    """The dtype of ``dtypes`` with the widest rounding floor.

    dbias is accumulated in float32 but rounded like both q's dtype and the
    bias's own: its rule takes the coarser of the two floors.
    """
    return max((_dtype(d) for d in dtypes), key=ROUNDING_FLOOR.__getitem__)


def _terms(ref: np.ndarray, naive: Any, dtype: Any, magnitude: float) -> tuple[float, float]:
    """(max |naive - ref|, rounding floor) over ref's finite entries; (0, 0) when there are none."""
    finite = np.isfinite(ref)
    if not finite.any():
        return 0.0, 0.0
    with np.errstate(invalid="ignore"):
        diff = np.abs(np.asarray(naive, np.float64) - ref)
    naive_err = float(np.nan_to_num(diff, nan=0.0)[finite].max())
    scale = max(1.0, float(np.abs(ref[finite]).max()), magnitude)
    return naive_err, ROUNDING_FLOOR[_dtype(dtype)] * scale


def tolerance(ref: np.ndarray, naive: Any, dtype: Any, magnitude: float = 0.0) -> float:
    """The largest max |ours - ref| the rule allows, over ``ref``'s finite entries.

    2 * max |naive - ref| + ROUNDING_FLOOR[dtype] * max(1, max |ref|, magnitude),
    and at most FLOAT64_LIMIT for float64. ``ref`` is the float64 reference,
    ``naive`` the same result of plain attention in the input dtype (same shape),
    ``magnitude`` the size of terms that cancel in the result where that exceeds
    the result itself (:func:`cancelling_terms`).
    """
    ref = np.asarray(ref, np.float64)
    naive_err, floor = _terms(ref, naive, dtype, magnitude)
    bound = 2 * naive_err + floor
    return min(bound, FLOAT64_LIMIT) if _dtype(dtype) == np.float64 else bound


class Comparison(NamedTuple):
    """One result under the rule: ``error`` max |ours - ref| over the reference's finite
    entries (NaN when the shapes or non-finite entries differ), the ``bound`` allowed,
    and ``message``: a few lines saying where and by how much it fails, '' when it passes."""

    error: float
    bound: float
    message: str

    @property
    def ok(self) -> bool:
        return not self.message


def _where(index: tuple[int, ...], axes: Sequence[str]) -> str:
    """'[1, 0, 16, 3] (batch 1, head 0, row 16, column 3)' for an index and its trailing axes' names."""
    names = list(axes)[-len(index):] if index else []
    lead = len(index) - len(names)
    parts = []
    if lead:
        batch = index[:lead]
        parts.append(f"batch {batch[0] if lead == 1 else batch}")
    parts += [f"{name} {i}" for name, i in zip(names, index[lead:])]
    where = f"[{', '.join(map(str, index))}]"
    return f"{where} ({', '.join(parts)})" if parts else where


def compare(ours: Any, ref: np.ndarray, naive: Any, dtype: Any, magnitude: float = 0.0, *,
            name: str = "out", axes: Sequence[str] = ()) -> Comparison:
    """``ours`` (a NumPy array of any float dtype) against the float64 ``ref`` under the rule.

    ``naive``, ``dtype`` and ``magnitude`` as :func:`tolerance`. ``name`` and ``axes``
    (names of the trailing axes, e.g. ("head", "row", "column"); leading ones are
    called batch) only label the message.
    """
    ref = np.asarray(ref, np.float64)
    ours = np.asarray(ours)
    if ours.shape != ref.shape:
        return Comparison(float("nan"), 0.0, f"{name}: shape {ours.shape}, expected {ref.shape}")
    ours = ours.astype(np.float64)
    finite = np.isfinite(ref)
    with np.errstate(invalid="ignore"):
        wrong = (np.isfinite(ours) != finite) | (np.isinf(ref) & (ours != ref))
    if wrong.any():
        first = tuple(int(i) for i in np.argwhere(wrong)[0])
        count = int(np.count_nonzero(wrong))
        return Comparison(float("nan"), 0.0, (
            f"{name}{_where(first, axes)} is {float(ours[first])!r} where the reference is {float(ref[first])!r} "
            f"({count} non-finite entr{'y' if count == 1 else 'ies'} unlike the reference's)"
        ))
    bound = tolerance(ref, naive, dtype, magnitude)
    if not finite.any():
        return Comparison(0.0, bound, "")
    diff = np.where(finite, np.abs(ours - np.where(finite, ref, 0.0)), -1.0)
    worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(diff)), diff.shape))
    error = float(diff[worst])
    if error <= bound:
        return Comparison(error, bound, "")
    naive_err, floor = _terms(ref, naive, dtype, magnitude)
    dt = _dtype(dtype)
    how = f"2 x naive {dt.name} error {naive_err:.3g} + rounding floor {floor:.3g}"
    if dt == np.float64 and bound == FLOAT64_LIMIT:
        how = f"float64: at most {FLOAT64_LIMIT:g}"
    return Comparison(error, bound, (
        f"{name}{_where(worst, axes)} = {ours[worst]:.6g}, reference {ref[worst]:.6g}: "
        f"error {error:.3g} > allowed {bound:.3g} ({how})"
    ))


def cancelling_terms(q: Any, k: Any, dout: Any, out_ref: np.ndarray, scale: float | None = None,
                     bias_shape: tuple[int, ...] | None = None, cu_seqlens_q: Any = None) -> dict[str, float]:
    """Magnitudes of the terms that cancel in dS = P (dP - D), per gradient: the
    ``magnitude`` argument of :func:`tolerance` for dq, dk, dv, dbias and dsinks.

    FlashAttention's backward takes D = rowsum(dO * O) from O rounded to the output
    dtype, so where dP - D cancels (a row attending one key has dS = 0 exactly) the
    gradient keeps a residual of |dO| |O| ulp: an error of the algorithm, relative to
    these terms rather than to the (near-zero) result. ``out_ref`` is the float64 out;
    ``bias_shape``: the bias's shape, whose gradient sums the residuals of every score row
    its broadcast (batch, head and query) axes reduce into one element; ``cu_seqlens_q``:
    packed sequences' offsets, whose bias is laid out over the padded rows (B, Hq, max Lq).
    """
    o = np.abs(np.asarray(out_ref, np.float64))
    t = float(np.max(np.sum(np.abs(np.asarray(dout, np.float64)) * o, axis=-1), initial=0.0))
    scale = abs(scale or 1.0 / np.sqrt(np.shape(q)[-1]))
    big = lambda x: float(np.max(np.abs(np.asarray(x, np.float64)), initial=0.0))  # noqa: E731
    rows = tuple(np.shape(dout)[:-1])  # (..., Hq, Lq)
    if cu_seqlens_q is not None:  # packed (Hq, total): the bias's frame is (B, Hq, longest)
        lengths = np.diff(np.asarray(cu_seqlens_q))
        rows = (len(lengths), rows[0], int(np.max(lengths, initial=0)))
    reduced = 1
    if bias_shape is not None:
        # a dbias element adds P_ij D_i over the rows its broadcast axes reduce; sum_j P_ij <= 1
        bias_rows = ((1,) * (len(rows) + 1) + tuple(bias_shape))[-len(rows) - 1:-1]
        reduced = math.prod(n for n, b in zip(rows, bias_rows) if b == 1)
    # dsinks = -sum_i P_sink,i D_i adds one D per row of a head: up to Lq of them.
    return {"dq": scale * t * big(k), "dk": scale * t * big(q), "dv": 0.0, "dbias": t * reduced,
            "dsinks": t * np.shape(dout)[-2]}
