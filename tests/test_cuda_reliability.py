"""CUDA backend reliability: 64-bit indexing past 2**31 elements, concurrent compilation and
launches from several threads and streams, a second GPU. Run on a GPU:
``pytest -m gpu tests/test_cuda_reliability.py``.

The large tests allocate 10-30 GiB and skip (with the reason) when less is free. Their
references are computed on row slices only: with no causal alignment, window or ALiBi, a row of
out, lse, dq or dbias depends only on its own rows of q, dout and bias (and all of k, v), so
the float64 reference on a slice of rows is exact for those rows. dk and dv (sums over every
row) are checked against a dense float64 computation on the GPU, chunked over rows.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from support import BF16, F16, F32, F64, Case, assert_rule, cancelling_terms

import flashcupy as fc

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
from flashcupy import cuda
from flashcupy.cuda import compile as kernels

GIB = 2**30


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """Outputs are NaN before each launch, so an element no kernel writes shows."""
    cuda.poison_outputs = True
    yield
    cuda.poison_outputs = False


def _release() -> None:
    gc.collect()
    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()


@pytest.fixture
def gpu_memory():
    """need(gib): skip unless that much device memory is free (after emptying CuPy's pool)."""

    def need(gib: float) -> None:
        _release()
        free, _ = cupy.cuda.runtime.memGetInfo()
        if free < gib * GIB:
            pytest.skip(f"needs {gib} GiB of free GPU memory, {free / GIB:.1f} GiB free")

    yield need
    _release()


def _random(shape, dtype, seed: int):
    """Standard normal values rounded to ``dtype``, generated on the device in chunks of rows
    (no full-size float32 temporary)."""
    x = cupy.empty(shape, dtype=dtype)
    rows = x.reshape(-1, shape[-1])
    step = max(1, 2**26 // shape[-1])
    rs = cupy.random.RandomState(seed)
    for start in range(0, rows.shape[0], step):
        stop = min(start + step, rows.shape[0])
        rows[start:stop] = rs.standard_normal((stop - start, shape[-1]), dtype=cupy.float32).astype(dtype)
    return x


def _dense_kv_grads(q, k, v, dout, bias=None, rows_per_chunk: int = 2**20):
    """float64 (dk, dv) of plain attention (one head: q (L, D), k (Lk, D), v (Lk, Dv), bias
    (L, Lk) or None) on the GPU, summed over chunks of rows."""
    k64, v64 = k.astype(cupy.float64), v.astype(cupy.float64)
    scale = 1.0 / np.sqrt(q.shape[-1])
    dk, dv = cupy.zeros_like(k64), cupy.zeros_like(v64)
    for start in range(0, q.shape[0], rows_per_chunk):
        stop = min(start + rows_per_chunk, q.shape[0])
        qc, doc = q[start:stop].astype(cupy.float64), dout[start:stop].astype(cupy.float64)
        s = scale * (qc @ k64.T)
        if bias is not None:
            s += bias[start:stop].astype(cupy.float64)
        p = cupy.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        dv += p.T @ doc
        ds = p * (doc @ v64.T - cupy.sum(doc * (p @ v64), axis=1, keepdims=True))
        dk += scale * (ds.T @ qc)
        del qc, doc, s, p, ds
    return dk.get(), dv.get()


def _assert_close_to_sum(name: str, ours, ref: np.ndarray, rtol: float = 1e-2) -> None:
    """A gradient summed over millions of rows in float32 and stored in float16: within
    ``rtol`` of the largest reference element (an indexing error is off by O(1) of it)."""
    ours = np.asarray(ours, dtype=np.float64)
    assert np.isfinite(ours).all(), f"{name}: non-finite values"
    err, big = float(np.max(np.abs(ours - ref))), float(np.max(np.abs(ref)))
    assert err <= rtol * big, f"{name}: max error {err:.3g} > {rtol} * max |ref| = {rtol * big:.3g}"


def _check_rows(rows: slice, out, lse, q, k, v, dout=None, grads=None, bias=None) -> None:
    """Rows ``rows`` of out, lse (and dq, dbias) against the reference on those rows only."""
    options = {} if bias is None else {"bias": bias[..., rows, :].get()}
    dout_rows = dout[..., rows, :].get() if dout is not None else np.zeros(out[..., rows, :].shape, out.dtype)
    case = Case(q[..., rows, :].get(), k.get(), v.get(), dout_rows, options)
    ref, naive = case.references(with_backward=grads is not None)
    where = f"rows {rows.start}:{rows.stop}"
    assert_rule(f"out {where}", out[..., rows, :].get(), ref["out"], naive["out"], case.dtype)
    assert_rule(f"lse {where}", lse[..., rows].get(), ref["lse"], naive["lse"], case.dtype)
    if grads is not None:
        terms = cancelling_terms(case, ref)
        assert_rule(f"dq {where}", grads[0][..., rows, :].get(), ref["dq"], naive["dq"], case.dtype, terms["dq"])
        if bias is not None:
            assert_rule(f"dbias {where}", grads[3][..., rows, :].get(), ref["dbias"], naive["dbias"], case.dtype,
                        terms["dbias"])


def _all_written(x) -> None:
    """No poison (NaN) left: every element was written (counted in chunks of rows)."""
    rows = x.reshape(-1, x.shape[-1])
    step = max(1, 2**28 // x.shape[-1])
    bad = sum(int(cupy.count_nonzero(cupy.isnan(rows[s:s + step]))) for s in range(0, rows.shape[0], step))
    assert bad == 0, f"{bad} elements never written (still NaN)"


# --------------------------------------------------------------------------- 64-bit indexing

LONG_Q = 2**31 // 64 + 256  # rows of a (1, 1, LONG_Q, 64) q: 2**31 + 16384 elements
LONG_Q_ROWS = [slice(0, 128), slice(2**25 - 64, 2**25 + 64), slice(LONG_Q - 128, LONG_Q)]  # row 2**25: element 2**31


def test_forward_with_q_of_more_than_2_31_elements(gpu_memory) -> None:
    gpu_memory(24)
    q = _random((1, 1, LONG_Q, 64), cupy.float16, 1)
    k, v = _random((1, 1, 16, 64), cupy.float16, 2), _random((1, 1, 16, 64), cupy.float16, 3)
    assert q.size > 2**31
    out, lse = fc.flash_attention(q, k, v, return_lse=True, backend="cuda")
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    _all_written(out)
    for rows in LONG_Q_ROWS:
        _check_rows(rows, out, lse, q, k, v)


def test_backward_with_q_of_more_than_2_31_elements(gpu_memory) -> None:
    """2048 heads of 16400 rows: the last heads of q, dout, dq (and their statistics) start
    past element 2**31; whole heads' dq, dk, dv against the float64 reference. (One head of
    2**25 rows would test float32 summation of 2**25 terms in dk rather than indexing.)"""
    gpu_memory(32)
    heads, rows = 2048, 16400
    q = _random((1, heads, rows, 64), cupy.float16, 4)
    assert q.size > 2**31
    k, v = _random((1, heads, 16, 64), cupy.float16, 5), _random((1, heads, 16, 64), cupy.float16, 6)
    dout = _random((1, heads, rows, 64), cupy.float16, 7)
    out, lse = fc.flash_attention_forward(q, k, v, backend="cuda")
    grads = fc.flash_attention_backward(dout, q, k, v, out, lse, backend="cuda")
    _all_written(grads[0])
    for h in (0, heads // 2, heads - 1):
        head = (slice(0, 1), slice(h, h + 1))
        ref = fc.reference.attention_reference_backward(*(x[head].get() for x in (dout, q, k, v)))
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
            err = np.abs(got[head].get().astype(np.float64) - want).max()
            assert err <= 2e-2 * max(1.0, np.abs(want).max()), f"{name} of head {h}: max error {err:.3g}"


LONG_BIAS_Q, LONG_BIAS_K = 2**16 + 3, 2**15 + 7  # a (1, 1, Lq, Lk) bias: 2**31 + 557077 elements
# rows i with i * Lk >= 2**31 start at 65523: the last block holds them
LONG_BIAS_ROWS = [slice(0, 64), slice(LONG_BIAS_Q // 2, LONG_BIAS_Q // 2 + 64), slice(LONG_BIAS_Q - 64, LONG_BIAS_Q)]


def test_bias_of_more_than_2_31_elements_forward_and_backward(gpu_memory) -> None:
    gpu_memory(40)
    q = _random((1, 1, LONG_BIAS_Q, 16), cupy.float16, 8)
    k, v = _random((1, 1, LONG_BIAS_K, 16), cupy.float16, 9), _random((1, 1, LONG_BIAS_K, 16), cupy.float16, 10)
    bias = _random((1, 1, LONG_BIAS_Q, LONG_BIAS_K), cupy.float16, 11)
    dout = _random((1, 1, LONG_BIAS_Q, 16), cupy.float16, 12)
    assert bias.size > 2**31
    out, lse = fc.flash_attention_forward(q, k, v, bias=bias, backend="cuda")
    for rows in LONG_BIAS_ROWS:
        _check_rows(rows, out, lse, q, k, v, bias=bias)
    grads = fc.flash_attention_backward(dout, q, k, v, out, lse, bias=bias, bias_grad=True, backend="cuda")
    assert grads[3].shape == bias.shape and grads[3].dtype == bias.dtype
    _all_written(grads[3])
    for rows in LONG_BIAS_ROWS:
        _check_rows(rows, out, lse, q, k, v, dout, grads, bias=bias)
    del out, lse
    dk, dv = _dense_kv_grads(q[0, 0], k[0, 0], v[0, 0], dout[0, 0], bias[0, 0], rows_per_chunk=2**12)
    _assert_close_to_sum("dk", grads[1][0, 0].get(), dk)
    _assert_close_to_sum("dv", grads[2][0, 0].get(), dv)


# --------------------------------------------------------------------------- threads and streams


def _host(shape, dtype, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


#: (dtype, D, Dv, options): eight different specialisations (dtype, head-dim bucket, policy, full pipeline).
THREAD_CONFIGS = [
    (F16, 64, 64, {"causal": True}),
    (BF16, 40, 40, {"dropout_p": 0.2, "seed": 7}),
    (F32, 80, 80, {}),
    (F32, 96, 96, {"allow_tf32": True, "window": (5, 5)}),
    (F64, 32, 32, {"causal": "top_left"}),
    (F16, 200, 200, {"softcap": 10.0}),
    (BF16, 128, 64, {"bias": "full"}),
    (F16, 300, 300, {"mask": "random"}),
]


def _inputs(index: int, dtype, d: int, dv: int, options: dict, shape=(2, 2, 97, 113)):
    """Device (q, k, v, dout, options) of one configuration; array options built here."""
    b, h, lq, lk = shape
    q, k, v, dout = (cupy.asarray(_host(s, dtype, 10 * index + n)) for n, s in
                     enumerate(((b, h, lq, d), (b, h, lk, d), (b, h, lk, dv), (b, h, lq, dv))))
    options = dict(options)
    if options.get("bias") == "full":
        options["bias"] = cupy.asarray(_host((b, h, lq, lk), dtype, 10 * index + 5))
    if options.get("mask") == "random":
        options["mask"] = cupy.asarray(np.random.default_rng(index).random((lq, lk)) < 0.6)
    return q, k, v, dout, options


def _run(inputs, stream=None) -> list[np.ndarray]:
    """Forward and backward of one configuration on ``stream`` (None: the current one); host copies."""
    q, k, v, dout, options = inputs
    bias = options.get("bias") is not None
    with stream if stream is not None else contextlib.nullcontext():
        out, lse = fc.flash_attention_forward(q, k, v, backend="cuda", **options)
        # deterministic: bitwise comparisons need the order-fixed dQ (the default adds it up with atomics)
        grads = fc.flash_attention_backward(dout, q, k, v, out, lse, bias_grad=bias, deterministic=True,
                                            backend="cuda", **options)
    (stream or cupy.cuda.get_current_stream()).synchronize()
    return [x.get() for x in (out, lse, *grads)]


def _assert_bitwise_equal(a: list[np.ndarray], b: list[np.ndarray], what: str) -> None:
    assert len(a) == len(b), what
    for n, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape and x.dtype == y.dtype, f"{what}: result {n}"
        assert np.array_equal(np.ascontiguousarray(x).view(np.uint8), np.ascontiguousarray(y).view(np.uint8)), (
            f"{what}: result {n} differs bitwise")


def test_eight_threads_on_their_own_streams_equal_a_sequential_run(monkeypatch) -> None:
    """Eight configurations at once, each thread on its own non-blocking stream, compiling
    from an empty in-process cache (so compiles of different specialisations overlap)."""
    monkeypatch.setattr(kernels, "_functions", {})
    monkeypatch.setattr(kernels, "_locks", {})
    inputs = [_inputs(i, *cfg) for i, cfg in enumerate(THREAD_CONFIGS)]
    cupy.cuda.Device().synchronize()  # non-blocking streams do not wait for the null stream
    barrier = threading.Barrier(len(inputs))

    def job(x):
        stream = cupy.cuda.Stream(non_blocking=True)
        barrier.wait()
        return _run(x, stream)

    with ThreadPoolExecutor(max_workers=len(inputs)) as pool:
        concurrent = list(pool.map(job, inputs))
    sequential = [_run(x) for x in inputs]
    for n, (a, b) in enumerate(zip(concurrent, sequential)):
        _assert_bitwise_equal(a, b, f"configuration {n} {THREAD_CONFIGS[n][0]}")


def test_each_specialisation_compiles_once_under_concurrent_callers(monkeypatch) -> None:
    calls: collections.Counter = collections.Counter()
    guard = threading.Lock()
    real = cupy.RawModule

    def counting_raw_module(*args, **kwargs):
        with guard:
            calls[tuple(kwargs.get("name_expressions") or ())] += 1
        time.sleep(0.2)  # hold the compile open so that racing callers would start their own
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "_functions", {})
    monkeypatch.setattr(kernels, "_locks", {})
    monkeypatch.setattr(cupy, "RawModule", counting_raw_module)  # compile.py looks it up at call time
    inputs = _inputs(0, F16, 48, 48, {"softcap": 7.0})
    cupy.cuda.Device().synchronize()
    barrier = threading.Barrier(8)

    def job(_):
        barrier.wait()
        return _run(inputs, cupy.cuda.Stream(non_blocking=True))

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(job, range(8)))
    assert len(calls) >= 2, calls  # the forward kernel and the backward ones
    assert all(n == 1 for n in calls.values()), f"compiled more than once: {dict(calls)}"
    for other in results[1:]:
        _assert_bitwise_equal(results[0], other, "threads")


def test_four_streams_from_one_thread_without_synchronizing_between() -> None:
    configs = [(F16, 64, 64, {"causal": True}), (BF16, 128, 128, {}), (F32, 64, 32, {"dropout_p": 0.1, "seed": 3}),
               (F64, 64, 64, {"bias": "full"})]
    inputs = [_inputs(20 + i, *cfg, shape=(2, 4, 777, 1031)) for i, cfg in enumerate(configs)]
    expected = [_run(x) for x in inputs]  # sequential, on the null stream
    cupy.cuda.Device().synchronize()
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in inputs]
    forwards = []
    for (q, k, v, _, options), stream in zip(inputs, streams):
        with stream:
            forwards.append(fc.flash_attention_forward(q, k, v, backend="cuda", **options))
    results = []
    for (q, k, v, dout, options), (out, lse), stream in zip(inputs, forwards, streams):
        bias = options.get("bias") is not None
        with stream:  # deterministic: the default backward adds dQ up with atomics, in no fixed order
            grads = fc.flash_attention_backward(dout, q, k, v, out, lse, bias_grad=bias, deterministic=True,
                                                backend="cuda", **options)
        results.append((out, lse, *grads))
    for stream in streams:
        stream.synchronize()
    for n, (got, want) in enumerate(zip(results, expected)):
        _assert_bitwise_equal([x.get() for x in got], want, f"stream {n}")


# --------------------------------------------------------------------------- second GPU


def test_arrays_on_a_second_gpu() -> None:
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("one GPU on this machine")
    rs = np.random.default_rng(30)
    host = [rs.standard_normal(s).astype(F16) for s in ((2, 2, 77, 64), (2, 2, 90, 64), (2, 2, 90, 64), (2, 2, 77, 64))]
    bias = rs.standard_normal((77, 90)).astype(F32)
    with cupy.cuda.Device(1):
        q, k, v, dout = (cupy.asarray(x) for x in host)
        bias_dev = cupy.asarray(bias)
    with cupy.cuda.Device(0):  # called with device 0 current: the arrays' device must be used
        out, lse = fc.flash_attention_forward(q, k, v, causal=True, bias=bias_dev, backend="cuda")
        grads = fc.flash_attention_backward(dout, q, k, v, out, lse, causal=True, bias=bias_dev, bias_grad=True,
                                            backend="cuda")
        cupy.cuda.Device(1).synchronize()
    for x in (out, lse, *grads):
        assert x.device.id == 1
    case = Case(*host, {"causal": True, "bias": bias})
    ref, naive = case.references()
    terms = cancelling_terms(case, ref)
    assert_rule("out", out.get(), ref["out"], naive["out"], F16)
    assert_rule("lse", lse.get(), ref["lse"], naive["lse"], F16)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert_rule(name, g.get(), ref[name], naive[name], F16, terms[name])
    assert_rule("dbias", grads[3].get(), ref["dbias"], naive["dbias"], F16, terms["dbias"])  # floor of the coarser of q (f16), bias (f32)
    with cupy.cuda.Device(1):  # and from device 1 itself: the same bits
        again = fc.flash_attention_forward(q, k, v, causal=True, bias=bias_dev, backend="cuda")
        _assert_bitwise_equal([again[0].get(), again[1].get()], [out.get(), lse.get()], "device 1 current")
