"""The Hypothesis strategy behind :func:`flashcupy.testing.attention_problems` (needs Hypothesis)."""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

from .problems import AttentionProblem

#: Sequence lengths tried first: one, tile edges and their neighbours (clipped to the bounds).
LENGTH_SAMPLES = (1, 2, 16, 17, 33, 64, 65, 97, 128, 129, 255, 256, 257, 1025)
#: Options about shapes and layout are on in one problem of two, the others in one of three.
SHAPE_OPTIONS = frozenset({"gqa", "value_dim", "strided", "ranks"})
F32 = np.dtype(np.float32)


def _lengths(min_len: int, max_len: int) -> st.SearchStrategy[int]:
    samples = [n for n in LENGTH_SAMPLES if min_len <= n <= max_len]
    anything = st.integers(min_len, max_len)
    return st.sampled_from(samples) | anything if samples else anything


def _sub_shape(draw, full: tuple[int, ...]) -> tuple[int, ...]:
    """A shape broadcastable to ``full``: some leading dims dropped, some dims set to 1."""
    drop = draw(st.integers(0, max(0, len(full) - 2)))
    return tuple(draw(st.sampled_from([n, 1])) for n in full[drop:])


def _array(rs: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, strided: bool = False) -> np.ndarray:
    """Standard normal values rounded to ``dtype``; with ``strided`` a (..., L, H, d) array seen as (..., H, L, d)."""
    if strided and len(shape) >= 3:
        memory = shape[:-3] + (shape[-2], shape[-3], shape[-1])
        return rs.standard_normal(memory).astype(dtype).swapaxes(-2, -3)
    return rs.standard_normal(shape).astype(dtype)


@st.composite
def problems(draw, dtypes: tuple[np.dtype, ...], options: frozenset[str], min_len: int, max_len: int,
             head_dims: tuple[int, ...]) -> AttentionProblem:
    """An attention problem over awkward shapes with a combination of the named ``options``."""

    def on(name: str) -> bool:  # shrinks to off
        one_in = 2 if name in SHAPE_OPTIONS else 3
        return name in options and draw(st.integers(0, one_in - 1)) == one_in - 1

    dtype = draw(st.sampled_from(dtypes))
    batch: tuple[int, ...] = (draw(st.integers(1, 2)),)
    two_d = False
    if on("ranks"):
        two_d = draw(st.integers(0, 3)) == 3
        batch = () if two_d else tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    hk = 1 if two_d else draw(st.integers(1, 2))
    hq = hk * (draw(st.integers(2, 4)) if not two_d and on("gqa") else 1)
    lengths = _lengths(min_len, max_len)
    lq, lk = draw(lengths), draw(lengths)
    d = draw(st.sampled_from(sorted(set(head_dims))))
    dv = draw(st.sampled_from([1, 24])) if on("value_dim") else d
    strided = on("strided")
    rs = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    heads = () if two_d else (hq,)
    kv_heads = () if two_d else (hk,)
    q = _array(rs, batch + heads + (lq, d), dtype, strided)
    k = _array(rs, batch + kv_heads + (lk, d), dtype, strided)
    v = _array(rs, batch + kv_heads + (lk, dv), dtype, strided)
    dout = _array(rs, batch + heads + (lq, dv), dtype)

    opts: dict[str, Any] = {}
    scores = batch + heads + (lq, lk)
    if on("causal"):
        opts["causal"] = draw(st.sampled_from([True, "top_left", "bottom_right"]))
    if on("window"):
        side = st.none() | st.integers(0, 20)
        opts["window"] = (draw(side), draw(side))
    if on("scale"):
        opts["scale"] = draw(st.floats(-1.5, 1.5, allow_nan=False))
    if on("softcap"):
        opts["softcap"] = draw(st.floats(0.5, 30.0))
    if on("mask"):
        mask = rs.random(_sub_shape(draw, scores)) < draw(st.sampled_from([0.5, 0.9, 0.1]))
        if draw(st.booleans()):  # besides those that happen: whole rows masked on purpose
            mask[rs.random(mask.shape[:-1]) < 0.3] = False
        opts["mask"] = mask
    if on("bias"):
        opts["bias"] = rs.standard_normal(_sub_shape(draw, scores)).astype(draw(st.sampled_from([dtype, F32])))
    if on("alibi"):
        opts["alibi_slopes"] = rs.uniform(0, 0.5, _sub_shape(draw, batch + heads) if heads else ())
    if on("sinks"):
        opts["sinks"] = rs.normal(0.0, 2.0, _sub_shape(draw, batch + heads) if heads else ())
    if batch and on("lengths"):
        which = draw(st.sampled_from(["both", "q", "kv"]))
        if which != "kv":
            opts["q_lengths"] = rs.integers(0, lq + 1, _sub_shape(draw, batch))
        if which != "q":
            opts["kv_lengths"] = rs.integers(0, lk + 1, batch)
    if on("block_mask"):
        bs = draw(st.integers(1, 24))
        blocks = batch + heads + (-(-lq // bs), -(-lk // bs))
        opts["block_size"] = bs
        opts["block_mask"] = rs.random(_sub_shape(draw, blocks)) < draw(st.sampled_from([0.8, 0.3]))
    if on("dropout"):
        opts["dropout_p"] = draw(st.sampled_from([0.17, 0.5, 0.9]))
        opts["seed"] = draw(st.integers(0, 2**64 - 1))
        opts["dropout_offset"] = draw(st.sampled_from([0, 7, 2**32 - 1]))
    return AttentionProblem(q, k, v, dout, opts)
