"""Inf and NaN inputs on the CPU backend: no NumPy RuntimeWarning escapes, and the
results keep docs/semantics.md's special values."""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import numpy as np
import pytest

import flashcupy as fc
from flashcupy import cpu_kernels, reference
from flashcupy.problem import make_host_problem

JIT = [False] + ([True] if cpu_kernels.numba_kernels() is not None else [])

#: (name, dtype, array, index, value): one input element replaced by a special value.
SPECIAL = [
    ("q +inf", np.float32, "q", (0, 3, 1), np.inf),
    ("q -inf", np.float32, "q", (0, 3, 1), -np.inf),
    ("q nan", np.float32, "q", (1, 2, 0), np.nan),
    ("k +inf", np.float64, "k", (0, 5, 2), np.inf),
    ("k nan", np.float32, "k", (1, 4, 1), np.nan),
    ("v +inf", np.float32, "v", (0, 6, 3), np.inf),
    ("v nan", np.float64, "v", (1, 0, 0), np.nan),
    ("dout +inf", np.float32, "dout", (0, 3, 1), np.inf),
    ("dout nan", np.float16, "dout", (1, 3, 1), np.nan),
    ("bias +inf", np.float32, "bias", (0, 3, 2), np.inf),
    ("bias -inf row", np.float32, "bias", (0, 3), -np.inf),
    ("bias nan", np.float32, "bias", (1, 1, 1), np.nan),
    ("q overflows float16 products", np.float16, "q", (0, 3), 60000.0),
    ("v overflows float16 output", np.float16, "v", (0,), 60000.0),
]


@contextlib.contextmanager
def kernels(jit: bool):
    with mock.patch.dict(os.environ, {"FLASHCUPY_CPU_JIT": "1" if jit else "0"}):
        yield


def _inputs(dtype, array: str, index, value) -> tuple[dict, dict]:
    rs = np.random.default_rng(7)
    x = {n: rs.standard_normal((2, 9, 8)).astype(dtype) for n in ("q", "k", "v", "dout")}
    options = {"bias": np.zeros((2, 9, 9), dtype)}
    target = options["bias"] if array == "bias" else x[array]
    target[index] = value
    return x, options


def _cpu(x: dict, options: dict) -> list[np.ndarray]:
    out, lse = fc.flash_attention_forward(x["q"], x["k"], x["v"], backend="cpu", **options)
    grads = fc.flash_attention_backward(x["dout"], x["q"], x["k"], x["v"], out, lse, bias_grad=True,
                                        backend="cpu", **options)
    return [out, lse, *grads]


def _reference(x: dict, options: dict) -> list[np.ndarray]:
    with np.errstate(all="ignore"):  # the dense reference may warn; it is not under test here
        pb = make_host_problem(x["q"], x["k"], x["v"], options)
        out, lse = reference.forward(pb)
        return [out, lse, *reference.backward(pb, x["dout"])]


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("jit", JIT)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name, dtype, array, index, value", SPECIAL, ids=[s[0] for s in SPECIAL])
def test_special_values_raise_no_warning(jit, threads, name, dtype, array, index, value):
    x, options = _inputs(dtype, array, index, value)
    with kernels(jit), fc.cpu_threads(threads):
        ours = _cpu(x, options)
    ref = _reference(x, options)
    # out and lse: finite exactly where the reference is, and close there. A +inf score makes
    # its row's lse NaN here (inf - inf inside the softmax) where SciPy's logsumexp says +inf.
    for name_, a, b in zip(("out", "lse"), ours, ref):
        a64 = np.asarray(a, np.float64)
        assert np.array_equal(np.isfinite(a64), np.isfinite(b)), name_
        finite = np.isfinite(b)
        np.testing.assert_allclose(a64[finite], b[finite], rtol=2e-2, atol=2e-2, err_msg=name_)
    # Gradients: what is finite here is finite in the reference and agrees with it (a special
    # value spreads through the recomputed softmax at least as far as through the dense one).
    for name_, a, b in zip(("dq", "dk", "dv", "dbias"), ours[2:], ref[2:]):
        a64 = np.asarray(a, np.float64)
        finite = np.isfinite(a64)
        assert np.all(np.isfinite(b[finite])), name_
        np.testing.assert_allclose(a64[finite], b[finite], rtol=2e-2, atol=2e-2, err_msg=name_)


@pytest.mark.filterwarnings("error")
@pytest.mark.skipif(len(JIT) < 2, reason="Numba is not installed")
@pytest.mark.parametrize("name, dtype, array, index, value", SPECIAL, ids=[s[0] for s in SPECIAL])
def test_compiled_and_numpy_kernels_agree_on_special_values(name, dtype, array, index, value):
    x, options = _inputs(dtype, array, index, value)
    results = []
    for jit in (False, True):
        with kernels(jit):
            results.append(_cpu(x, options))
    for a, b in zip(*results):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(np.isinf(a), np.isinf(b))
        finite = np.isfinite(a)  # scores of 1e4 (q near float16's maximum) make out ill-conditioned
        np.testing.assert_allclose(a[finite], b[finite], rtol=5e-2, atol=5e-2)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("jit", JIT)
def test_fully_masked_row_stays_zero_beside_infinite_values(jit):
    """A row masked everywhere, in a tile other rows attend, gives out 0 and lse -inf even
    where v holds inf (0 * inf would be NaN)."""
    rs = np.random.default_rng(3)
    q, k, v = (rs.standard_normal((12, 8)).astype(np.float32) for _ in range(3))
    v[4] = np.inf
    mask = np.ones((12, 12), bool)
    mask[2] = False
    with kernels(jit):
        out, lse = fc.flash_attention(q, k, v, mask=mask, return_lse=True, backend="cpu")
    assert np.all(out[2] == 0) and lse[2] == -np.inf
    assert np.all(np.isnan(out[np.arange(12) != 2]).any(axis=-1) | np.isinf(out[np.arange(12) != 2]).any(axis=-1))


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("jit", JIT)
@pytest.mark.parametrize("scale", [3e38, -1e30, 1e-38])
def test_extreme_scales_raise_no_warning(jit, scale):
    rs = np.random.default_rng(4)
    q, k, v, dout = (rs.standard_normal((2, 16, 8)).astype(np.float32) for _ in range(4))
    with kernels(jit):
        out, vjp = fc.flash_attention_vjp(q, k, v, scale=scale, backend="cpu")
        grads = vjp(dout)
    assert out.shape == q.shape and all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))
