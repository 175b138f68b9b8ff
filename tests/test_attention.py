"""The CPU backend against the float64 reference: forward, backward, every option."""

from __future__ import annotations

import tracemalloc
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import flashcupy as fc
from flashcupy import rng
from support import (
    BF16, DTYPES, F16, F32, F64, FLOOR, Case, assert_rule, cancelling_terms, cases, cpu_tiles, cu_seqlens,
    gradient_names, padded_to_packed,
)


def _grads(case: Case):
    bias_grad = case.options.get("bias") is not None
    out, lse = fc.flash_attention_forward(case.q, case.k, case.v, backend="cpu", **case.options)
    grads = fc.flash_attention_backward(
        case.dout, case.q, case.k, case.v, out, lse, bias_grad=bias_grad, backend="cpu", **case.options
    )
    return out, lse, dict(zip(gradient_names(case.options), grads, strict=True))


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
@example(_case((2, 4, 16, 40), (2, 2, 50, 40), dv=1, dtype=F16, data_seed=4, scale=-0.97, bias=np.full((1, 1), -0.18),
               alibi_slopes=np.array([[0.44], [0.33]]), dropout_p=0.5, seed=524))  # dbias sums 128 rows' residuals
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
    if "sinks" in case.options:
        assert grads["dsinks"].shape == np.shape(case.options["sinks"]) and grads["dsinks"].dtype == F64
        assert_rule("dsinks", grads["dsinks"], ref["dsinks"], naive["dsinks"], case.dtype, terms["dsinks"])


# --------------------------------------------------------------------------- behaviour


def test_fully_masked_rows_give_zero_out_minus_inf_lse_and_zero_grads() -> None:
    case = _case((2, 3, 20, 8), (2, 3, 30, 8), tiles=(8, 8))
    mask = np.ones((20, 30), bool)
    mask[[0, 7, 19]] = False  # three rows see no key
    opts = {"mask": mask, "bias": np.zeros((20, 30))}
    out, lse = fc.flash_attention_forward(case.q, case.k, case.v, backend="cpu", **opts)
    dq, dk, dv, dbias = fc.flash_attention_backward(
        case.dout, case.q, case.k, case.v, out, lse, bias_grad=True, backend="cpu", **opts
    )
    for x in (out, lse, dq, dk, dv, dbias):
        assert not np.isnan(x).any()
    assert np.all(out[..., [0, 7, 19], :] == 0) and np.all(lse[..., [0, 7, 19]] == -np.inf)
    assert np.all(dq[..., [0, 7, 19], :] == 0) and np.all(dbias[[0, 7, 19]] == 0)
    assert np.isfinite(lse[..., 1]).all()


@pytest.mark.parametrize("lq, lk", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(lq: int, lk: int) -> None:
    case = _case((2, lq, 4), (2, lk, 4), dv=3)
    out, lse = fc.flash_attention_forward(case.q, case.k, case.v, backend="cpu")
    assert out.shape == (2, lq, 3) and lse.shape == (2, lq)
    assert np.all(out == 0) and np.all(lse == -np.inf)
    dq, dk, dv = fc.flash_attention_backward(case.dout, case.q, case.k, case.v, out, lse, backend="cpu")
    assert dq.shape == case.q.shape and dk.shape == case.k.shape and dv.shape == case.v.shape
    assert not (dq.any() or dk.any() or dv.any())


def test_nan_in_a_query_row_stays_in_that_row() -> None:
    case = _case((3, 40, 16), (3, 50, 16), dtype=F32, tiles=(16, 16))
    q = case.q.copy()
    q[1, 5, 3] = np.nan
    out = fc.flash_attention(q, case.k, case.v, backend="cpu", causal=True)
    bad = np.isnan(out).any(axis=-1)
    expected = np.zeros_like(bad)
    expected[1, 5] = True
    np.testing.assert_array_equal(bad, expected)
    np.testing.assert_array_equal(np.delete(out[1], 5, axis=0), np.delete(
        fc.flash_attention(case.q, case.k, case.v, backend="cpu", causal=True)[1], 5, axis=0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_blhd_views_equal_contiguous(dtype) -> None:
    rs = np.random.default_rng(1)
    q, k, v = (rs.standard_normal((2, 37, 4, 24)).astype(dtype) for _ in range(3))  # (B, L, H, D)
    views = [x.transpose(0, 2, 1, 3) for x in (q, k, v)]  # (B, H, L, D), no copy
    assert not views[0].flags.c_contiguous
    out_view = fc.flash_attention(*views, backend="cpu", causal=True)
    out_copy = fc.flash_attention(*(np.ascontiguousarray(x) for x in views), backend="cpu", causal=True)
    assert out_view.dtype == dtype
    np.testing.assert_array_equal(out_view, out_copy)


def test_dropout_is_deterministic_for_a_seed_and_fresh_without_one() -> None:
    case = _case((2, 2, 33, 8), (2, 2, 41, 8), dtype=F32)
    run = lambda **o: fc.flash_attention(case.q, case.k, case.v, dropout_p=0.3, backend="cpu", **o)  # noqa: E731
    np.testing.assert_array_equal(run(seed=5), run(seed=5))
    assert not np.array_equal(run(seed=5), run(seed=6))
    assert not np.array_equal(run(seed=5), run(seed=5, dropout_offset=1))
    assert not np.array_equal(run(), run())  # seed=None draws a fresh seed each call


def test_dropout_forward_and_backward_use_the_same_mask() -> None:
    """With v = I, out is exactly the dropped-out probabilities; dv exposes P'^T dO."""
    lq, lk, p, seed = 9, 16, 0.4, 77
    q = np.random.default_rng(0).standard_normal((1, lq, 4))
    k = np.random.default_rng(1).standard_normal((1, lk, 4))
    v = np.eye(lk)[None]
    out, lse = fc.flash_attention_forward(q, k, v, dropout_p=p, seed=seed, backend="cpu")
    keep = fc.dropout_mask((1, lq, lk), p, seed)
    np.testing.assert_array_equal(out != 0, keep)
    dout = np.eye(lq, lk)[None]
    _, _, dv = fc.flash_attention_backward(dout, q, k, v, out, lse, dropout_p=p, seed=seed, backend="cpu")
    np.testing.assert_allclose(dv[0], out[0].T @ dout[0], rtol=1e-12, atol=1e-15)


def test_vjp_equals_forward_and_backward() -> None:
    case = _case((2, 4, 30, 16), (2, 2, 30, 16), dtype=F32, causal=True, bias=np.ones((30, 30), np.float32))
    out, vjp = fc.flash_attention_vjp(case.q, case.k, case.v, backend="cpu", **case.options)
    out2, lse = fc.flash_attention_forward(case.q, case.k, case.v, backend="cpu", **case.options)
    np.testing.assert_array_equal(out, out2)
    expected = fc.flash_attention_backward(
        case.dout, case.q, case.k, case.v, out2, lse, bias_grad=True, backend="cpu", **case.options
    )
    for got, want in zip(vjp(case.dout), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_vjp_keeps_its_drawn_seed() -> None:
    case = _case((1, 20, 8), (1, 20, 8))
    with mock.patch.object(rng, "new_seed", lambda: 2**50 + 3):
        out, vjp = fc.flash_attention_vjp(case.q, case.k, case.v, dropout_p=0.5, backend="cpu")
    opts = {"dropout_p": 0.5, "seed": 2**50 + 3, "backend": "cpu"}
    out2, lse = fc.flash_attention_forward(case.q, case.k, case.v, **opts)
    np.testing.assert_array_equal(out, out2)
    for got, want in zip(vjp(case.dout), fc.flash_attention_backward(case.dout, case.q, case.k, case.v, out2, lse, **opts)):
        np.testing.assert_array_equal(got, want)


@given(st.data())
def test_varlen_equals_padded(data) -> None:
    """Packed sequences give what the padded batch with lengths gives, options included."""
    batch, hk, lq, lk = (data.draw(st.integers(lo, hi)) for lo, hi in ((1, 3), (1, 2), (1, 40), (1, 40)))
    hq = hk * data.draw(st.integers(1, 2))
    d, dv = data.draw(st.sampled_from([1, 8, 59])), data.draw(st.sampled_from([3, 16]))
    case = _case((batch, hq, lq, d), (batch, hk, lk, d), dv=dv, dtype=data.draw(st.sampled_from([F64, F16])),
                 data_seed=data.draw(st.integers(0, 99)), tiles=data.draw(st.sampled_from([None, (8, 8)])))
    rs = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    ql, kl = rs.integers(0, lq + 1, batch), rs.integers(0, lk + 1, batch)
    ql[rs.integers(batch)], kl[rs.integers(batch)] = lq, lk  # the longest sequences set the frame
    opts = {
        "causal": data.draw(st.sampled_from([False, True, "top_left"])),
        "window": data.draw(st.sampled_from([None, (4, 2)])),
        "alibi_slopes": rs.uniform(0, 1, (batch, hq)),
        "bias": rs.standard_normal((1, hq, lq, lk)),
        "sinks": rs.standard_normal((batch, hq)),
        "dropout_p": data.draw(st.sampled_from([0.0, 0.3])),
        "seed": 99,
        "backend": "cpu",
    }
    packed = [padded_to_packed(x, n) for x, n in ((case.q, ql), (case.k, kl), (case.v, kl))]
    cu = {"cu_seqlens_q": cu_seqlens(ql), "cu_seqlens_k": cu_seqlens(kl)}
    with cpu_tiles(case.tiles):
        padded_out, padded_lse = fc.flash_attention(
            case.q, case.k, case.v, q_lengths=ql, kv_lengths=kl, return_lse=True, **opts
        )
        out, lse = fc.flash_attention_varlen(*packed, *cu.values(), return_lse=True, **opts)
        _, vjp = fc.flash_attention_vjp(*packed, **cu, **opts)
        _, padded_vjp = fc.flash_attention_vjp(case.q, case.k, case.v, q_lengths=ql, kv_lengths=kl, **opts)
        grads = vjp(padded_to_packed(case.dout, ql))
        padded_grads = padded_vjp(case.dout)
    np.testing.assert_array_equal(out, padded_to_packed(padded_out, ql))
    np.testing.assert_array_equal(lse, padded_to_packed(padded_lse[..., None], ql)[..., 0])
    for got, want, n in zip(grads[:3], padded_grads[:3], (ql, kl, kl)):
        np.testing.assert_array_equal(got, padded_to_packed(want, n))
    np.testing.assert_array_equal(grads[3], padded_grads[3])  # dbias, in the padded frame for both
    # dsinks: per sequence from a running sum over the packed rows, per row block when padded
    np.testing.assert_allclose(grads[4], padded_grads[4], rtol=1e-9, atol=1e-9)


def test_packed_equals_padded_in_a_longer_frame_with_wide_key_tiles() -> None:
    """A padded frame longer than its longest sequence tiles as the packed call does: the CPU
    forward's key tiles follow the longest valid length, not the frame (few rows a task take
    wider key tiles), so the two agree bitwise past 1024 keys."""
    rs = np.random.default_rng(21)
    ql, kl = np.array([100, 60]), np.array([3000, 2500])
    q = rs.standard_normal((2, 2, 300, 64)).astype(F32)
    k, v = (rs.standard_normal((2, 2, 3000, 64)).astype(F32) for _ in range(2))
    padded_out, padded_lse = fc.flash_attention(q, k, v, q_lengths=ql, kv_lengths=kl, return_lse=True,
                                                backend="cpu")
    packed = [padded_to_packed(x, n) for x, n in ((q, ql), (k, kl), (v, kl))]
    out, lse = fc.flash_attention_varlen(*packed, cu_seqlens(ql), cu_seqlens(kl), return_lse=True, backend="cpu")
    np.testing.assert_array_equal(out, padded_to_packed(padded_out, ql))
    np.testing.assert_array_equal(lse, padded_to_packed(padded_lse[..., None], ql)[..., 0])


def test_gqa_equals_repeated_heads() -> None:
    case = _case((2, 6, 25, 8), (2, 2, 31, 8), tiles=(8, 8), causal=True)
    out, vjp = fc.flash_attention_vjp(case.q, case.k, case.v, backend="cpu", causal=True)
    rep = [np.repeat(x, 3, axis=1) for x in (case.k, case.v)]
    out_rep, vjp_rep = fc.flash_attention_vjp(case.q, *rep, backend="cpu", causal=True)
    np.testing.assert_allclose(out, out_rep, rtol=1e-13, atol=1e-14)
    dq, dk, dv = vjp(case.dout)
    dq_r, dk_r, dv_r = vjp_rep(case.dout)
    np.testing.assert_allclose(dq, dq_r, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dk, dk_r.reshape(2, 2, 3, 31, 8).sum(2), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dv, dv_r.reshape(2, 2, 3, 31, 8).sum(2), rtol=1e-12, atol=1e-13)


def test_causal_alignments_agree_on_square_and_differ_otherwise() -> None:
    sq = _case((2, 19, 8), (2, 19, 8))
    run = lambda c, a: fc.flash_attention(c.q, c.k, c.v, causal=a, backend="cpu")  # noqa: E731
    np.testing.assert_array_equal(run(sq, "top_left"), run(sq, True))
    rect = _case((2, 7, 8), (2, 19, 8))
    assert not np.allclose(run(rect, "top_left"), run(rect, "bottom_right"))


def test_bfloat16_numpy_in_bfloat16_numpy_out() -> None:
    case = _case((2, 3, 17, 8), (2, 3, 17, 8), dtype=BF16)
    out, lse = fc.flash_attention(case.q, case.k, case.v, return_lse=True, backend="cpu")
    assert type(out) is np.ndarray and out.dtype == ml_dtypes.bfloat16 and lse.dtype == np.float32
    grads = fc.flash_attention_backward(case.dout, case.q, case.k, case.v, out, lse, backend="cpu")
    assert all(g.dtype == ml_dtypes.bfloat16 for g in grads)


def test_causal_8k_forward_stays_within_64_mib_of_host_memory() -> None:
    """A dense 8192 x 8192 float32 score matrix alone would be 256 MiB."""
    rs = np.random.default_rng(0)
    q, k, v = (rs.standard_normal((8192, 32), dtype=np.float32) for _ in range(3))
    tracemalloc.start()
    try:
        out = fc.flash_attention(q, k, v, causal=True, backend="cpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.shape == (8192, 32) and np.isfinite(out).all()
    assert peak < 64 * 2**20, f"peak traced memory {peak / 2**20:.1f} MiB"


def test_block_mask_skips_whole_tiles() -> None:
    """Ruled-out tiles are never computed: NaN keys inside them cannot reach the output."""
    case = _case((1, 64, 8), (1, 64, 8), tiles=(16, 16))
    k = case.k.copy()
    v = case.v.copy()
    k[0, 16:32] = np.nan
    v[0, 16:32] = np.nan
    block_mask = np.ones((4, 4), bool)
    block_mask[:, 1] = False  # key block 1 (keys 16..31) is ruled out for every query block
    with cpu_tiles(case.tiles):
        out = fc.flash_attention(case.q, k, v, block_mask=block_mask, block_size=16, backend="cpu")
    assert np.isfinite(out).all()
    ref = fc.attention_reference(case.q, np.delete(k, range(16, 32), 1), np.delete(v, range(16, 32), 1))
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-13)


def test_nan_row_has_nan_lse_and_fully_masked_row_ignores_nan_values() -> None:
    case = _case((1, 8, 16), (1, 8, 16), dtype=F32)
    q, v = case.q.copy(), case.v.copy()
    q[0, 3, 0] = np.nan
    v[0, 5] = np.nan
    mask = np.ones((8, 8), bool)
    mask[6] = False
    mask[6, 5] = False
    out, lse = fc.flash_attention(q, case.k, v, mask=mask, return_lse=True, backend="cpu")
    assert np.isnan(lse[0, 3]) and lse[0, 6] == -np.inf and np.all(out[0, 6] == 0)


def test_backward_of_an_empty_batch() -> None:
    """No (batch, head) group at all: the backward's key-range split divided by zero."""
    q = np.zeros((0, 2, 5, 8), F32)
    out, vjp = fc.flash_attention_vjp(q, q, q, backend="cpu")
    assert [g.shape for g in vjp(np.zeros_like(out))] == [q.shape] * 3
    packed = np.zeros((2, 0, 8), F32)
    _, vjp = fc.flash_attention_vjp(packed, packed, packed, cu_seqlens_q=[0], cu_seqlens_k=[0], backend="cpu")
    assert [g.shape for g in vjp(np.zeros((2, 0, 8), F32))] == [packed.shape] * 3
