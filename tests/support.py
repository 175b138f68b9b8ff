"""Shared test machinery: the tolerance rule of docs/semantics.md#accuracy and a
Hypothesis strategy that draws attention problems with every option.

Backend-agnostic: a case holds NumPy inputs; tests pass them to any backend.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from flashcupy import cpu, reference
from flashcupy.problem import make_host_problem

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
DTYPES = (F16, BF16, F32, F64)

FLOOR = reference.ROUNDING_FLOOR


def assert_rule(
    name: str, ours: Any, ref: np.ndarray, naive: np.ndarray, dtype: np.dtype, magnitude: float = 0.0
) -> None:
    """max |ours - ref| <= 2 max |naive - ref| + floor, and the same non-finite pattern.

    ``naive`` is plain attention computed in the input dtype; ``ref`` is float64.
    The bound is :func:`flashcupy.reference.tolerance`; ``magnitude`` is the size
    of terms that cancel in the result (see :func:`cancelling_terms`).
    """
    ours = np.asarray(ours, dtype=np.float64)
    assert ours.shape == ref.shape, f"{name}: shape {ours.shape} != reference {ref.shape}"
    finite = np.isfinite(ref)
    assert np.array_equal(np.isfinite(ours), finite), (
        f"{name}: non-finite pattern differs ({np.count_nonzero(~np.isfinite(ours))} non-finite "
        f"in ours, {np.count_nonzero(~finite)} in the reference)"
    )
    assert np.array_equal(ours[~finite], ref[~finite]) or np.isnan(ref[~finite]).any(), (
        f"{name}: infinities differ"
    )
    if not finite.any():
        return
    err = np.max(np.abs(ours[finite] - ref[finite]))
    bound = reference.tolerance(ref, naive, dtype, magnitude)
    assert err <= bound, f"{name}: max error {err:.3g} > bound {bound:.3g}"
    if np.dtype(dtype) == F64:
        assert err <= 1e-9, f"{name}: float64 error {err:.3g} > 1e-9"


def cancelling_terms(case: "Case", ref: dict[str, np.ndarray]) -> dict[str, float]:
    """:func:`flashcupy.reference.cancelling_terms` for a drawn case."""
    return reference.cancelling_terms(case.q, case.k, case.dout, ref["out"], case.options.get("scale"))


@contextlib.contextmanager
def cpu_tiles(tiles: tuple[int, int] | None):
    """Force the CPU backend's (BLOCK_M, BLOCK_N) so small problems span many tiles."""
    if tiles is None:
        yield
        return
    with mock.patch.object(cpu, "tile_sizes", lambda pb: tiles):
        yield


@dataclass
class Case:
    """One drawn problem: inputs (NumPy, in ``dtype``) and keyword options."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    options: dict[str, Any] = field(default_factory=dict)
    tiles: tuple[int, int] | None = None

    @property
    def dtype(self) -> np.dtype:
        return self.q.dtype

    def references(self, with_backward: bool = True):
        """(ref, naive): dicts of float64 out, lse[, dq, dk, dv, dbias] per the tolerance rule."""
        pb = make_host_problem(self.q, self.k, self.v, self.options)
        result = []
        for dt in (F64, self.dtype):
            out, lse = reference.forward(pb, dt)
            r = {"out": out, "lse": lse}
            if with_backward:
                dout = self.dout[None] if pb.squeeze_head else self.dout
                r.update(zip(("dq", "dk", "dv", "dbias"), reference.backward(pb, dout, dt)))
            if pb.squeeze_head:
                r = {n: (a[0] if n != "dbias" and a is not None else a) for n, a in r.items()}
            result.append(r)
        return tuple(result)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}={getattr(self, n).shape}" for n in ("q", "k", "v"))
        opts = {n: (getattr(a, "shape", a)) for n, a in self.options.items()}
        return f"Case({self.dtype.name}, {shapes}, tiles={self.tiles}, options={opts})"

    def _repr_pretty_(self, printer, cycle) -> None:  # Hypothesis prints falsifying cases with this
        printer.text(repr(self))


def _sub_shape(draw, full: tuple[int, ...]) -> tuple[int, ...]:
    """A shape broadcastable to ``full``: some leading dims dropped, some dims set to 1."""
    drop = draw(st.integers(0, max(0, len(full) - 2)))
    return tuple(draw(st.sampled_from([n, 1])) for n in full[drop:])


def _array(rs: np.random.Generator, shape, dtype, layout_blhd: bool = False) -> np.ndarray:
    """Standard normal values rounded to ``dtype``; optionally a (..., L, H, d) array seen as (..., H, L, d)."""
    if layout_blhd and len(shape) >= 3:
        perm = shape[:-3] + (shape[-2], shape[-3], shape[-1])
        return rs.standard_normal(perm).astype(dtype).swapaxes(-2, -3)
    return rs.standard_normal(shape).astype(dtype)


LENGTHS = st.sampled_from([1, 2, 17, 33, 64]) | st.integers(0, 70)
HEAD_DIMS = st.sampled_from([1, 3, 8, 16, 40, 59, 80, 96, 111])
TILES = st.sampled_from([None, (16, 16), (7, 13), (32, 8), (5, 64)])


@st.composite
def cases(draw, dtypes=DTYPES, lengths=LENGTHS, head_dims=HEAD_DIMS, options: bool = True) -> Case:
    """An attention problem over awkward shapes with a random combination of options."""
    dtype = draw(st.sampled_from(dtypes))
    two_d = draw(st.integers(0, 5)) == 0
    batch = () if two_d else tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    hk = 1 if two_d else draw(st.integers(1, 2))
    hq = hk * (1 if two_d else draw(st.integers(1, 3)))
    lq, lk = draw(lengths), draw(lengths)
    d = draw(head_dims)
    dv = draw(st.sampled_from([d, 1, 24]))
    blhd = draw(st.booleans())
    rs = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    heads = () if two_d else (hq,)
    kv_heads = () if two_d else (hk,)
    q = _array(rs, batch + heads + (lq, d), dtype, blhd)
    k = _array(rs, batch + kv_heads + (lk, d), dtype, blhd)
    v = _array(rs, batch + kv_heads + (lk, dv), dtype, blhd)
    dout = _array(rs, batch + heads + (lq, dv), dtype)
    opts: dict[str, Any] = {}
    if options:
        scores = batch + heads + (lq, lk)
        causal = draw(st.sampled_from([False, True, "top_left", "bottom_right"]))
        if causal:
            opts["causal"] = causal
        if draw(st.integers(0, 3)) == 0:
            side = st.none() | st.integers(0, 20)
            opts["window"] = (draw(side), draw(side))
        if draw(st.integers(0, 4)) == 0:
            opts["scale"] = draw(st.floats(-1.5, 1.5, allow_nan=False))
        if draw(st.integers(0, 3)) == 0:
            opts["softcap"] = draw(st.floats(0.5, 30.0))
        if draw(st.integers(0, 2)) == 0:
            density = draw(st.sampled_from([0.1, 0.5, 0.9]))
            opts["mask"] = rs.random(_sub_shape(draw, scores)) < density
        if draw(st.integers(0, 2)) == 0:
            bias_dtype = draw(st.sampled_from([dtype, F32]))
            opts["bias"] = rs.standard_normal(_sub_shape(draw, scores)).astype(bias_dtype)
        if draw(st.integers(0, 3)) == 0:
            opts["alibi_slopes"] = rs.uniform(0, 0.5, _sub_shape(draw, batch + (hq,)) if not two_d else ())
        if batch and draw(st.integers(0, 2)) == 0:
            opts["q_lengths"] = rs.integers(0, lq + 1, _sub_shape(draw, batch))
        if batch and draw(st.integers(0, 2)) == 0:
            opts["kv_lengths"] = rs.integers(0, lk + 1, batch)
        if draw(st.integers(0, 3)) == 0:
            bs = draw(st.integers(1, 24))
            blocks = batch + heads + (-(-lq // bs), -(-lk // bs))
            opts["block_size"] = bs
            opts["block_mask"] = rs.random(_sub_shape(draw, blocks)) < draw(st.sampled_from([0.3, 0.8]))
        if draw(st.integers(0, 3)) == 0:
            opts["dropout_p"] = draw(st.sampled_from([0.17, 0.5, 0.9]))
            opts["seed"] = draw(st.integers(0, 2**64 - 1))
            opts["dropout_offset"] = draw(st.sampled_from([0, 7, 2**32 - 1]))
    return Case(q, k, v, dout, opts, draw(TILES))


def padded_to_packed(x: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(B, H, L, d) padded -> (H, sum(lengths), d) packed."""
    return np.concatenate([x[b, :, : lengths[b]] for b in range(x.shape[0])], axis=1)


def cu_seqlens(lengths: np.ndarray) -> np.ndarray:
    """int32 cumulative lengths starting at 0."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
