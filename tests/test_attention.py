"""The CPU backend against the float64 reference: forward, backward, every option."""

from __future__ import annotations

import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import flashcupy as fc
from flashcupy import rng
from support import (
    BF16, DTYPES, F16, F32, F64, FLOOR, Case, assert_rule, cancelling_terms, cases, cpu_tiles, cu_seqlens,
    padded_to_packed,
)


def _grads(case: Case):
    bias_grad = case.options.get("bias") is not None
    out, lse = fc.flash_attention_forward(case.q, case.k, case.v, backend="cpu", **case.options)
    grads = fc.flash_attention_backward(
        case.dout, case.q, case.k, case.v, out, lse, bias_grad=bias_grad, backend="cpu", **case.options
    )
    return out, lse, dict(zip(("dq", "dk", "dv", "dbias"), grads))


def _case(shape_q, shape_k, dv=None, dtype=F64, data_seed=0, tiles=None, **options) -> Case:
    rs = np.random.default_rng(data_seed)
    dv = shape_k[-1] if dv is None else dv
    q = rs.standard_normal(shape_q).astype(dtype)
    k = rs.standard_normal(shape_k).astype(dtype)
    v = rs.standard_normal(shape_k[:-1] + (dv,)).astype(dtype)
    dout = rs.standard_normal(shape_q[:-1] + (dv,)).astype(dtype)
    return Case(q, k, v, dout, options, tiles)


@given(cases())
@example(_case((2, 4, 1025, 40), (2, 2, 97, 40), tiles=(256, 64), causal=True))  # L = 1025 > one tile
@example(_case((1, 17, 512), (1, 1, 512), dtype=F16))  # D = 512, Lk = 1
@example(_case((3, 97, 256), (3, 97, 256), dtype=BF16, window=(3, 0), softcap=5.0))
@example(_case((2, 33, 8), (2, 17, 8), dtype=F32, tiles=(7, 13), causal="top_left"))  # Lq > Lk, rows fully masked
def test_forward_matches_reference(case: Case) -> None:
    with cpu_tiles(case.tiles):
        out, lse = fc.flash_attention(case.q, case.k, case.v, return_lse=True, backend="cpu", **case.options)
    ref, naive = case.references(with_backward=False)
    assert out.dtype == case.dtype and type(out) is np.ndarray
    assert lse.dtype == (F64 if case.dtype == F64 else F32)
    assert_rule("out", out, ref["out"], naive["out"], case.dtype)
    assert_rule("lse", lse, ref["lse"], naive["lse"], case.dtype)


@given(cases())
@example(_case((2, 3, 70, 16), (2, 1, 65, 16), tiles=(16, 16), causal=True, softcap=2.0,
               bias=np.ones((1, 65)), dropout_p=0.5, seed=2**63 + 1))  # GQA (MQA) with every grad
@example(_case((2, 1025, 59), (2, 1025, 59), dtype=F32, tiles=(256, 256),
               bias=np.zeros((2, 1, 1025), np.float32)))
def test_backward_matches_reference(case: Case) -> None:
    with cpu_tiles(case.tiles):
        _, _, grads = _grads(case)
    ref, naive = case.references()
    terms = cancelling_terms(case, ref)
    for name, x in (("dq", case.q), ("dk", case.k), ("dv", case.v)):
        assert grads[name].dtype == case.dtype and grads[name].shape == x.shape, name
        assert_rule(name, grads[name], ref[name], naive[name], case.dtype, terms[name])
    if "bias" in case.options:
        bias = case.options["bias"]
        assert grads["dbias"].shape == bias.shape and grads["dbias"].dtype == bias.dtype
        # dbias is accumulated in float32 but D rounds like q's dtype: the wider of the two floors.
        floor_dtype = max(case.dtype, bias.dtype, key=lambda d: FLOOR[d])
        assert_rule("dbias", grads["dbias"], ref["dbias"], naive["dbias"], floor_dtype, terms["dbias"])
