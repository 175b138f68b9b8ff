"""Attention sinks: the reference against finite differences and closed forms, the backends
against the reference on the cases the Hypothesis suites reach rarely, and the CUDA path."""

from __future__ import annotations

import numpy as np
import pytest

import flashcupy as fc
from flashcupy.reference import attention_reference_backward

from support import (BF16, F16, F32, F64, Case, assert_rule, cancelling_terms, cu_seqlens, gradient_names,
                     padded_to_packed)


def _qkv(rs, shape_q, shape_k, dtype=F64):
    q = rs.standard_normal(shape_q).astype(dtype)
    k = rs.standard_normal(shape_k).astype(dtype)
    v = rs.standard_normal(shape_k).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("shape", [(), (3,), (2, 1), (2, 3)])
@pytest.mark.parametrize("options", [{}, {"causal": True, "q_lengths": np.array([4, 2])},
                                     {"mask": np.random.default_rng(5).random((2, 3, 4, 6)) < 0.4},
                                     {"dropout_p": 0.3, "seed": 17, "bias": np.ones((4, 6))}])
def test_reference_dsinks_match_finite_differences(shape, options):
    rs = np.random.default_rng(len(shape))
    q, k, v = _qkv(rs, (2, 3, 4, 5), (2, 3, 6, 5))
    sinks = np.asarray(rs.standard_normal(shape) * 2)
    dout = rs.standard_normal((2, 3, 4, 5))
    *_, dsinks = attention_reference_backward(dout, q, k, v, sinks=sinks, **options)
    assert dsinks.shape == shape and dsinks.dtype == F64
    eps, numeric = 1e-6, np.zeros(shape)
    for idx in np.ndindex(shape):
        hi, lo = sinks.copy(), sinks.copy()
        hi[idx] += eps
        lo[idx] -= eps
        numeric[idx] = np.sum(dout * (fc.attention_reference(q, k, v, sinks=hi, **options)
                                      - fc.attention_reference(q, k, v, sinks=lo, **options))) / (2 * eps)
    np.testing.assert_allclose(dsinks, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_masked_rows_take_the_sink_and_padded_rows_none(backend):
    rs = np.random.default_rng(1)
    q, k, v = _qkv(rs, (2, 2, 5, 8), (2, 2, 7, 8), F32)
    mask = np.ones((5, 7), bool)
    mask[1] = False  # row 1 attends nothing
    sinks = np.array([0.25, -3.0])
    out, lse = fc.flash_attention(q, k, v, mask=mask, sinks=sinks, q_lengths=[5, 3], return_lse=True,
                                  backend=backend)
    out, lse = fc.interop.to_numpy(out), fc.interop.to_numpy(lse)
    assert np.all(out[:, :, 1] == 0) and np.array_equal(lse[:, :, 1], np.broadcast_to(sinks, (2, 2)))
    assert np.all(out[1, :, 3:] == 0) and np.all(lse[1, :, 3:] == -np.inf)  # rows past q_len
    # the probabilities of a row sum to 1 - exp(sink - lse)
    ref_out, ref_lse = fc.attention_reference(q, k, v, mask=mask, sinks=sinks, q_lengths=[5, 3], return_lse=True)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nan_sink_on_a_row_with_no_key_gives_out_zero(backend):
    """A row whose scores are all masked takes no value whatever its sink: a NaN sink gives
    lse NaN and out 0 (the reference had given out NaN there)."""
    rs = np.random.default_rng(9)
    q, k, v = _qkv(rs, (1, 2, 4, 8), (1, 2, 6, 8), F32)
    mask = np.ones((4, 6), bool)
    mask[1] = False
    sinks = np.array([np.nan, 0.5])
    if backend == "reference":
        out, lse = fc.attention_reference(q, k, v, mask=mask, sinks=sinks, return_lse=True)
    else:
        out, lse = fc.flash_attention(q, k, v, mask=mask, sinks=sinks, return_lse=True, backend=backend)
    out, lse = fc.interop.to_numpy(out), fc.interop.to_numpy(lse)
    assert np.all(out[0, :, 1] == 0) and np.isnan(lse[0, 0, 1]) and lse[0, 1, 1] == 0.5
    assert np.all(np.isnan(out[0, 0, [0, 2, 3]])) and np.all(np.isfinite(out[0, 1]))


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_huge_sink_leaves_nothing_and_tiny_sink_changes_nothing(backend):
    rs = np.random.default_rng(2)
    q, k, v = _qkv(rs, (1, 2, 6, 4), (1, 2, 9, 4))
    plain, plain_lse = fc.flash_attention(q, k, v, return_lse=True, backend=backend)
    out, lse = fc.flash_attention(q, k, v, sinks=[-200.0, 200.0], return_lse=True, backend=backend)
    out, lse, plain, plain_lse = (fc.interop.to_numpy(x) for x in (out, lse, plain, plain_lse))
    np.testing.assert_array_equal(out[0, 0], plain[0, 0])  # exp(-200) vanishes beside the scores
    np.testing.assert_array_equal(lse[0, 0], plain_lse[0, 0])
    assert np.all(np.abs(out[0, 1]) < 1e-80) and np.allclose(lse[0, 1], 200.0)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_minus_infinity_is_no_sink(backend):
    rs = np.random.default_rng(6)
    q, k, v = _qkv(rs, (2, 2, 9, 8), (2, 2, 9, 8), F32)
    dout = rs.standard_normal((2, 2, 9, 8)).astype(F32)
    sinks = np.array([-np.inf, 1.0])
    out, lse = fc.flash_attention_forward(q, k, v, sinks=sinks, q_lengths=[9, 4], backend=backend)
    plain, plain_lse = fc.flash_attention_forward(q, k, v, q_lengths=[9, 4], backend=backend)
    out, lse, plain, plain_lse = (fc.interop.to_numpy(x) for x in (out, lse, plain, plain_lse))
    np.testing.assert_array_equal(out[:, 0], plain[:, 0])
    np.testing.assert_array_equal(lse[:, 0], plain_lse[:, 0])
    *_, dsinks = fc.flash_attention_backward(dout, q, k, v, out, lse, sinks=sinks, q_lengths=[9, 4], backend=backend)
    dsinks = fc.interop.to_numpy(dsinks)
    assert dsinks[0] == 0 and np.isfinite(dsinks[1]) and dsinks[1] != 0


def test_reference_2d_bias_gradient_keeps_the_bias_shape():
    """A 2-D call (one head) returned dbias with its first axis dropped, like q's head axis."""
    rs = np.random.default_rng(3)
    q, k, v = _qkv(rs, (5, 8), (7, 8))
    dq, dk, dv, dbias = attention_reference_backward(np.ones((5, 8)), q, k, v, bias=rs.standard_normal((5, 7)))
    assert dq.shape == (5, 8) and dbias.shape == (5, 7)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64])
def test_cuda_sinks_match_the_reference(dtype):
    import cupy

    rs = np.random.default_rng(4)
    case = Case(*_qkv(rs, (2, 4, 300, 64), (2, 2, 257, 64), dtype), rs.standard_normal((2, 4, 300, 64)).astype(dtype),
                {"causal": True, "sinks": rs.standard_normal((2, 4)) * 3})
    q, k, v, dout = (cupy.asarray(x) for x in (case.q, case.k, case.v, case.dout))
    sinks = cupy.asarray(case.options["sinks"])
    out, lse = fc.flash_attention_forward(q, k, v, causal=True, sinks=sinks)
    grads = fc.flash_attention_backward(dout, q, k, v, out, lse, causal=True, sinks=sinks)
    ref, naive = case.references()
    terms = cancelling_terms(case, ref)
    assert_rule("out", out.get(), ref["out"], naive["out"], dtype)
    assert_rule("lse", lse.get(), ref["lse"], naive["lse"], dtype)
    for name, g in zip(gradient_names(case.options), grads, strict=True):
        assert isinstance(g, cupy.ndarray)
        assert_rule(name, g.get(), ref[name], naive[name], dtype, terms[name])


@pytest.mark.gpu
def test_cuda_sinks_in_value_chunks_and_packed_sequences():
    """The CUDA forward's epilogue folds the sink: every Dv chunk's block the same one (float32,
    Dv = 200 in two chunks), and packed sequences their own sequence's (B, Hq) sinks, as the
    padded call with lengths does."""
    import cupy

    rs = np.random.default_rng(8)
    case = Case(*_qkv(rs, (2, 2, 70, 64), (2, 2, 90, 64), F32), None, {"sinks": rs.standard_normal((2, 2)) * 3})
    v = rs.standard_normal((2, 2, 90, 200)).astype(F32)
    case = Case(case.q, case.k, v, rs.standard_normal((2, 2, 70, 200)).astype(F32), case.options)
    q, k, v = (cupy.asarray(x) for x in (case.q, case.k, case.v))
    out, lse = fc.flash_attention(q, k, v, sinks=cupy.asarray(case.options["sinks"]), return_lse=True)
    ref, naive = case.references()
    assert_rule("out", out.get(), ref["out"], naive["out"], F32)
    assert_rule("lse", lse.get(), ref["lse"], naive["lse"], F32)

    ql, kl = np.array([70, 33]), np.array([41, 90])
    opts = {"sinks": case.options["sinks"], "causal": True}
    padded, padded_lse = fc.flash_attention(q, k, v, q_lengths=ql, kv_lengths=kl, return_lse=True, **opts)
    packed = [cupy.asarray(padded_to_packed(x, n)) for x, n in ((case.q, ql), (case.k, kl), (case.v, kl))]
    out, lse = fc.flash_attention_varlen(*packed, cu_seqlens(ql), cu_seqlens(kl), return_lse=True, **opts)
    np.testing.assert_allclose(out.get(), padded_to_packed(padded.get(), ql), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse.get(), padded_to_packed(padded_lse.get()[..., None], ql)[..., 0], rtol=1e-6)
