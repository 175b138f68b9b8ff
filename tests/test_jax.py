"""JAX arrays in, JAX arrays out (eager), through DLPack. Skipped where JAX is not installed."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")

import flashcupy as fc  # noqa: E402


def _inputs(device, dtype=np.float32):
    rs = np.random.default_rng(0)
    host = [rs.standard_normal((2, 4, 70, 32)).astype(dtype) for _ in range(3)]
    return host, [jax.device_put(jnp.asarray(x), device) for x in host]


def _check(device) -> None:
    host, arrays = _inputs(device)
    out, lse = fc.flash_attention(*arrays, causal=True, return_lse=True)
    assert isinstance(out, jax.Array) and isinstance(lse, jax.Array)
    assert out.dtype == jnp.float32 and list(out.devices())[0].platform == device.platform
    ref, ref_lse = fc.attention_reference(*host, causal=True, return_lse=True)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=2e-6)
    out, vjp = fc.flash_attention_vjp(*arrays, causal=True)
    grads = vjp(jnp.ones_like(out))
    assert all(isinstance(g, jax.Array) for g in grads)
    ref_grads = fc.reference.attention_reference_backward(np.ones(out.shape), *host, causal=True)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(np.asarray(g), r, rtol=1e-4, atol=1e-5)


def test_jax_cpu_arrays() -> None:
    _check(jax.devices("cpu")[0])


@pytest.mark.gpu
def test_jax_gpu_arrays() -> None:
    try:
        device = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("JAX has no GPU backend here")
    _check(device)
