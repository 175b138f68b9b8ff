"""The CPU backend on several threads: results bitwise the same for every thread count,
the thread-count settings, and BLAS held at one thread while tasks run."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from unittest import mock

import numpy as np
import pytest
from hypothesis import example, given

import flashcupy as fc
from flashcupy import cpu, cpu_kernels, cpu_parallel

from support import F32, F64, FLOOR, Case, assert_rule, cancelling_terms, cases, cpu_tiles, gradient_names

JIT = [False] + ([True] if cpu_kernels.numba_kernels() is not None else [])
try:
    import threadpoolctl
except ImportError:  # the backend then runs tasks on the calling thread
    threadpoolctl = None


@contextlib.contextmanager
def kernels(jit: bool):
    """Run the CPU backend with the compiled (``jit``) or the NumPy tile kernels."""
    with mock.patch.dict(os.environ, {"FLASHCUPY_CPU_JIT": "1" if jit else "0"}):
        yield


def run(case: Case, threads: int) -> dict[str, np.ndarray]:
    """out, lse and every gradient of ``case`` on the CPU backend with ``threads`` threads, by name."""
    bias_grad = case.options.get("bias") is not None
    with fc.cpu_threads(threads), cpu_tiles(case.tiles):
        out, lse = fc.flash_attention_forward(case.q, case.k, case.v, backend="cpu", **case.options)
        grads = fc.flash_attention_backward(
            case.dout, case.q, case.k, case.v, out, lse, bias_grad=bias_grad, backend="cpu", **case.options
        )
    return dict(zip(("out", "lse") + gradient_names(case.options), (out, lse, *grads), strict=True))


def assert_bitwise_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for name, x in a.items():
        y = b[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        same = np.array_equal(np.atleast_1d(x).view(np.uint8), np.atleast_1d(y).view(np.uint8))
        assert same, f"{name} differs between thread counts"


def _many_tasks(seed: int, dtype: np.dtype, causal: bool, gqa: int) -> Case:
    """A problem with a few dozen forward and backward tasks at small tiles."""
    rs = np.random.default_rng(seed)
    q = rs.standard_normal((2, 2 * gqa, 45, 24)).astype(dtype)
    k = rs.standard_normal((2, 2, 38, 24)).astype(dtype)
    v = rs.standard_normal((2, 2, 38, 16)).astype(dtype)
    dout = rs.standard_normal((2, 2 * gqa, 45, 16)).astype(dtype)
    return Case(q, k, v, dout, {"causal": causal}, (8, 16))


@pytest.mark.parametrize("jit", JIT)
@given(case=cases(head_dims=(3, 16, 40)))
@example(case=_many_tasks(0, F32, False, 1))
@example(case=_many_tasks(1, F64, True, 3))
def test_results_bitwise_equal_across_thread_counts(jit, case):
    with kernels(jit):
        one = run(case, 1)
        for threads in (2, 3):
            assert_bitwise_equal(one, run(case, threads))


def _lengths_apart() -> Case:
    """Batch entries of different key lengths under a bias broadcast over batch, heads and
    rows: key ranges cut per entry's own length overlapped across entries, and two tasks
    added into the same dbias columns in whichever order the threads ran them."""
    rs = np.random.default_rng(3)
    q = rs.standard_normal((2, 2, 1, 1, 40)).astype(F32)
    k = rs.standard_normal((2, 2, 1, 43, 40)).astype(F32)
    v = rs.standard_normal((2, 2, 1, 43, 40)).astype(F32)
    dout = rs.standard_normal((2, 2, 1, 1, 40)).astype(F32)
    options = {"bias": rs.standard_normal((1, 43)).astype(F32), "kv_lengths": np.array([[25, 40], [34, 3]]),
               "scale": 0.0}
    return Case(q, k, v, dout, options, (16, 16))


@pytest.mark.parametrize("jit", JIT)
@pytest.mark.parametrize("splits", [2, 3])
@given(case=cases(dtypes=(F32, F64)))
@example(case=_many_tasks(2, F32, True, 2))
@example(case=_lengths_apart())
def test_backward_with_key_ranges_matches_reference(jit, splits, case):
    """Groups cut into key ranges (few heads on many cores) sum dQ correctly, bitwise alike
    on every thread count."""
    with kernels(jit), mock.patch.object(cpu, "backward_splits", lambda pb, groups: splits):
        results = run(case, 1)
        assert_bitwise_equal(results, run(case, 2))
    ref, naive = case.references()
    magnitude = cancelling_terms(case, ref)
    for name, ours in results.items():
        dtype = case.dtype
        if name == "dbias":  # rounded to the bias's dtype: the wider of the two floors
            dtype = max(case.dtype, case.options["bias"].dtype, key=lambda d: FLOOR[d])
        assert_rule(name, ours, ref[name], naive[name], dtype, magnitude.get(name, 0.0))


def test_backward_splits_depend_on_the_machine_not_the_thread_count():
    x = np.zeros((1, 4096, 8), np.float32)
    pb = fc.problem.make_host_problem(x, x, x, {})
    with mock.patch.object(cpu, "MACHINE_CORES", 64):
        many = cpu.backward_splits(pb, 1)
        with fc.cpu_threads(1):
            assert cpu.backward_splits(pb, 1) == many
    assert 1 < many <= 8
    with mock.patch.object(cpu, "MACHINE_CORES", 4):
        assert cpu.backward_splits(pb, 4) == 1


def test_a_shared_dbias_still_gives_every_core_a_task(monkeypatch):
    """A bias broadcast over batch and heads puts every group's units that add into one dbias
    slice in one task: the keys are split so the cores still get tasks (it had run serially),
    and the gradients stay bitwise alike on every thread count and match the reference."""
    counts = []
    run_tasks = cpu_parallel.run_tasks
    monkeypatch.setattr(cpu_parallel, "run_tasks",
                        lambda tasks, *a, **kw: counts.append(len(tasks)) or run_tasks(tasks, *a, **kw))
    monkeypatch.setattr(cpu, "MACHINE_CORES", 2)
    rs = np.random.default_rng(6)
    q, k, v, dout = (rs.standard_normal((2, 4, 1500, 16)).astype(np.float32) for _ in range(4))
    bias = rs.standard_normal((1500, 1500)).astype(np.float32)  # keys over two of the backward's key tiles
    grads = []
    for threads in (1, 2):
        with fc.cpu_threads(threads):
            _, vjp = fc.flash_attention_vjp(q, k, v, bias=bias, backend="cpu")
            counts.clear()
            grads.append(vjp(dout))
            assert counts and counts[-1] >= 2
    for a, b in zip(*grads, strict=True):
        np.testing.assert_array_equal(a, b)
    for got, ref in zip(grads[0], fc.reference.attention_reference_backward(dout, q, k, v, bias=bias), strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-3, rtol=1e-3)


# --------------------------------------------------------------------------- settings


def test_default_is_the_available_cores(monkeypatch):
    for name in cpu_parallel.THREAD_LIMIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    fc.set_cpu_threads(None)
    assert fc.get_cpu_threads() == cpu_parallel.available_cores()
    if hasattr(os, "sched_getaffinity"):
        assert cpu_parallel.available_cores() == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    "env, cap",
    [
        ({"OMP_NUM_THREADS": "1"}, 1),
        ({"OMP_NUM_THREADS": "1,4"}, 1),  # OpenMP's nested list: the outer level
        ({"OMP_NUM_THREADS": "junk", "OPENBLAS_NUM_THREADS": "1"}, 1),
        ({"OMP_NUM_THREADS": "0", "MKL_NUM_THREADS": "1"}, 1),
        ({"OMP_NUM_THREADS": "100000"}, None),  # never above the available cores
        ({}, None),
    ],
)
def test_environment_caps_the_default(monkeypatch, env, cap):
    for name in cpu_parallel.THREAD_LIMIT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cores = cpu_parallel.available_cores()
    assert fc.get_cpu_threads() == (cores if cap is None else min(cap, cores))


def test_set_and_context_override_and_restore():
    default = fc.get_cpu_threads()
    try:
        fc.set_cpu_threads(5)
        assert fc.get_cpu_threads() == 5
        with fc.cpu_threads(2):
            assert fc.get_cpu_threads() == 2
            with fc.cpu_threads(None):  # None inside a block: the process setting
                assert fc.get_cpu_threads() == 5
            seen = []
            other = threading.Thread(target=lambda: seen.append(fc.get_cpu_threads()))
            other.start()
            other.join()
            assert seen == [5], "a cpu_threads block applies to its own thread only"
        assert fc.get_cpu_threads() == 5
    finally:
        fc.set_cpu_threads(None)
    assert fc.get_cpu_threads() == default


@pytest.mark.parametrize("bad, error", [(0, ValueError), (-2, ValueError), (1.5, TypeError), (True, TypeError),
                                        ("2", TypeError)])
def test_bad_thread_counts_name_the_argument(bad, error):
    with pytest.raises(error, match="threads: expected a positive int or None"):
        fc.set_cpu_threads(bad)
    with pytest.raises(error, match="threads: expected a positive int or None"):
        with fc.cpu_threads(bad):
            pass


# --------------------------------------------------------------------------- the task runner


@pytest.mark.skipif(threadpoolctl is None, reason="threadpoolctl is not installed")
def test_tasks_run_on_the_requested_threads_with_single_threaded_blas():
    seen: dict[int, set] = {}
    blas_threads = []

    def task(index, state):
        seen.setdefault(index, set()).add(threading.get_ident())
        blas_threads.extend(info["num_threads"] for info in threadpoolctl.threadpool_info()
                            if info["user_api"] == "blas")
        time.sleep(0.01)

    before = [info["num_threads"] for info in threadpoolctl.threadpool_info() if info["user_api"] == "blas"]
    cpu_parallel.run_tasks(list(range(12)), task, dict, threads=3)
    idents = set().union(*seen.values())
    assert sorted(seen) == list(range(12)) and all(len(s) == 1 for s in seen.values())
    assert len(idents) == 3
    assert set(blas_threads) == {1}
    after = [info["num_threads"] for info in threadpoolctl.threadpool_info() if info["user_api"] == "blas"]
    assert after == before


def test_task_error_propagates_and_stops_the_rest():
    done = []

    def task(index, state):
        if index == 3:
            raise KeyError("task 3")
        done.append(index)

    with pytest.raises(KeyError, match="task 3"):
        cpu_parallel.run_tasks(list(range(200)), task, dict, threads=2)
    assert len(done) < 199


def test_scratch_is_made_once_per_thread():
    made = []
    cpu_parallel.run_tasks(list(range(50)), lambda i, state: state.append(i), lambda: made.append([]) or made[-1],
                           threads=2)
    assert 1 <= len(made) <= 2 and sorted(sum(made, [])) == list(range(50))


@pytest.mark.parametrize("q_shape, k_shape, kv_heads", [
    ((1, 8, 2, 64), (1, 2, 9000, 64), 1),  # GQA 4: a KV head a task, several 4096-key tiles
    ((1, 8, 1, 32), (1, 4, 3000, 32), 2),  # GQA 2: two KV heads a task
    ((2, 6, 1, 64), (2, 6, 3000, 64), 6),  # MHA: a sequence's six heads a task
    ((1, 8, 1, 64), (1, 1, 3000, 64), 1),  # MQA, fewer groups than cores: still, one query a head
    ((1, 8, 8, 64), (1, 1, 3000, 64), 0),  # ... but not with 8 queries a head: one head a task
])
@pytest.mark.parametrize("padding", [None, "bias", "mask", "alibi"])
def test_decoding_stacks_kv_heads_alike_on_every_thread_count(monkeypatch, q_shape, k_shape, kv_heads, padding):
    """A few queries a head (decoding) run several heads as one task, their rows stacked, when
    there are at least as many (batch, kv head) groups as the machine's cores (set to 2 here)
    or at most DECODE_ROWS queries a head: bitwise the same on 1, 2 and 3 threads, and the
    reference's result."""
    from flashcupy import cpu

    taken = []
    stacked = cpu._stacked
    monkeypatch.setattr(cpu, "_stacked", lambda pb, block_m: taken.append(stacked(pb, block_m)) or taken[-1])
    monkeypatch.setattr(cpu, "MACHINE_CORES", 2)
    rs = np.random.default_rng(3)
    q = rs.standard_normal(q_shape).astype(np.float32)
    k, v = (rs.standard_normal(k_shape).astype(np.float32) for _ in range(2))
    options = {"causal": True, "window": (k_shape[2] - 900, 0), "softcap": 20.0,
               "kv_lengths": rs.integers(k_shape[2] - 300, k_shape[2] + 1, q_shape[0]), "return_lse": True}
    if padding == "bias":  # a key-padding bias, the same in every head (B, 1, 1, Lk)
        options["bias"] = np.where(rs.random((q_shape[0], 1, 1, k_shape[2])) < 0.1, -1e4, 0.0).astype(np.float32)
    elif padding == "mask":  # a mask the same in every head (B, 1, Lq, Lk)
        options["mask"] = rs.random((q_shape[0], 1, q_shape[2], k_shape[2])) < 0.9
    elif padding == "alibi":  # a slope a head
        options["alibi_slopes"] = rs.uniform(0, 0.01, q_shape[1])
    results = []
    for threads in (1, 2, 3):
        with fc.cpu_threads(threads):
            results.append(fc.flash_attention(q, k, v, backend="cpu", **options))
    assert taken and all(t == kv_heads for t in taken)
    for out, lse in results[1:]:
        np.testing.assert_array_equal(out, results[0][0])
        np.testing.assert_array_equal(lse, results[0][1])
    ref, ref_lse = fc.attention_reference(q, k, v, **options)
    np.testing.assert_allclose(results[0][0], ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(results[0][1], ref_lse, atol=2e-5, rtol=1e-5)


def test_a_bias_that_differs_between_heads_keeps_one_head_a_task(monkeypatch):
    """A per-head bias changes the scores head by head: no stacking, the reference's results."""
    from flashcupy import cpu

    taken = []
    stacked = cpu._stacked
    monkeypatch.setattr(cpu, "_stacked", lambda pb, block_m: taken.append(stacked(pb, block_m)) or taken[-1])
    monkeypatch.setattr(cpu, "MACHINE_CORES", 1)
    rs = np.random.default_rng(4)
    q = rs.standard_normal((2, 8, 1, 32)).astype(np.float32)
    k, v = (rs.standard_normal((2, 2, 500, 32)).astype(np.float32) for _ in range(2))
    for option in ({"bias": rs.standard_normal((2, 8, 1, 500)).astype(np.float32)},
                   {"mask": rs.random((2, 8, 1, 500)) < 0.8}):
        taken.clear()
        out = fc.flash_attention(q, k, v, backend="cpu", **option)
        assert taken and not any(taken)
        np.testing.assert_allclose(out, fc.attention_reference(q, k, v, **option), atol=2e-5, rtol=1e-4)
