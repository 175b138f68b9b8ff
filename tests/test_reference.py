"""The float64 reference: analytic gradients against central finite differences,
and a few closed-form answers."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.special import softmax

import flashcupy as fc
from flashcupy.reference import attention_reference_backward

OPTION_SETS = [
    {},
    {"causal": True},
    {"causal": "top_left", "softcap": 1.5},
    {"window": (2, 1), "alibi_slopes": np.array([0.3, 0.1, 0.7, 0.2])},
    {"mask": np.random.default_rng(3).random((5, 6)) < 0.6, "bias": np.random.default_rng(4).standard_normal((4, 1, 6))},
    {"dropout_p": 0.4, "seed": 12345, "scale": 0.7},
    {"q_lengths": np.array([3, 5]), "kv_lengths": np.array([6, 2]), "causal": True},
    {"block_mask": np.array([[True, False], [True, True]]), "block_size": 3},
]


def _loss(q, k, v, dout, **options) -> float:
    return float(np.sum(dout * fc.attention_reference(q, k, v, **options)))


def _numeric_grad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        orig = x[idx]
        x[idx] = orig + eps
        hi = f()
        x[idx] = orig - eps
        lo = f()
        x[idx] = orig
        g[idx] = (hi - lo) / (2 * eps)
    return g


@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: "-".join(o) or "plain")
def test_analytic_gradients_match_finite_differences(options) -> None:
    rs = np.random.default_rng(0)
    q = rs.standard_normal((2, 4, 5, 3))
    k = rs.standard_normal((2, 2, 6, 3))  # GQA: two query heads per key head
    v = rs.standard_normal((2, 2, 6, 2))
    dout = rs.standard_normal((2, 4, 5, 2))
    options = {n: (x.copy() if isinstance(x, np.ndarray) else x) for n, x in options.items()}
    dq, dk, dv, dbias = attention_reference_backward(dout, q, k, v, **options)
    f = lambda: _loss(q, k, v, dout, **options)  # noqa: E731
    for name, x, g in (("dq", q, dq), ("dk", k, dk), ("dv", v, dv)):
        np.testing.assert_allclose(g, _numeric_grad(f, x), rtol=1e-6, atol=1e-8, err_msg=name)
    if "bias" in options:
        np.testing.assert_allclose(dbias, _numeric_grad(f, options["bias"]), rtol=1e-6, atol=1e-8)
    else:
        assert dbias is None


def test_plain_attention_closed_form() -> None:
    rs = np.random.default_rng(1)
    q, k, v = rs.standard_normal((7, 4)), rs.standard_normal((9, 4)), rs.standard_normal((9, 5))
    out, lse = fc.attention_reference(q, k, v, return_lse=True)
    s = q @ k.T / 2.0
    np.testing.assert_allclose(out, softmax(s, axis=-1) @ v, rtol=1e-13)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-13)


def test_fully_masked_row_in_the_reference() -> None:
    q, k, v = np.ones((2, 3)), np.ones((4, 3)), np.ones((4, 2))
    mask = np.array([[False] * 4, [True] * 4])
    out, lse = fc.attention_reference(q, k, v, mask=mask, return_lse=True)
    np.testing.assert_array_equal(out[0], [0, 0])
    np.testing.assert_allclose(out[1], [1, 1], rtol=1e-15)
    assert lse[0] == -np.inf and np.isfinite(lse[1])
    dq, dk, dv, _ = attention_reference_backward(np.ones((2, 2)), q, k, v, mask=mask)
    assert not np.isnan(dq).any() and np.all(dq[0] == 0)


def test_huge_finite_bias_averages_the_values() -> None:
    """Scores all near -1e308 (a bias of finfo.min / 2, as additive masks use) still give the
    softmax's mean of v: exp(s - lse) had given their sum, lse = m + log(n) rounding to m."""
    rs = np.random.default_rng(8)
    q, k, v = (rs.standard_normal((2, 3, 4)) for _ in range(3))
    bias = np.full((3, 3), np.finfo(np.float64).min / 2)
    out = fc.attention_reference(q, k, v, bias=bias)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=1, keepdims=True), out.shape), rtol=1e-12)
    out, lse = fc.attention_reference(q, k, v, bias=bias, sinks=np.finfo(np.float64).min / 2, return_lse=True)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=1, keepdims=True) * 3 / 4, out.shape), rtol=1e-12)
