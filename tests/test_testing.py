"""flashcupy.testing: the public strategy, assertions and check_attention_impl.

check_attention_impl must pass correct implementations and catch, with a shrunk
counterexample, the classic attention bugs; the CPU tests run on NumPy arrays,
the ``gpu`` ones on CuPy (flashcupy's CUDA backend) and PyTorch (SDPA).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any, Callable

import numpy as np
import pytest
from hypothesis import assume, given, settings

import flashcupy as fc
from flashcupy import interop, testing
from flashcupy.testing import AttentionCheckFailure, attention_problems, check_attention_impl
from flashcupy.testing.check import _same_layout

F16 = np.dtype(np.float16)
#: Options the NumPy implementations below understand.
NAIVE_OPTIONS = ("causal", "scale", "mask", "bias", "gqa")


def _naive(q, k, v, causal: Any = False, scale: float | None = None, mask=None, bias=None, bug: str = ""):
    """Plain attention in float32 (float64 for float64) with docs/semantics.md's semantics, or with ``bug``."""
    work = np.float64 if q.dtype == np.float64 else np.float32
    group = q.shape[-3] // k.shape[-3]
    if bug == "gqa_modulo":  # query head h reads kv head h % Hk
        k, v = (np.concatenate([x] * group, axis=-3) for x in (k, v))
    else:
        k, v = (np.repeat(x, group, axis=-3) for x in (k, v))
    scale = 1.0 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = (1.0 if bug == "no_scale" else scale) * (q.astype(work) @ np.swapaxes(k.astype(work), -1, -2))
    if bias is not None:
        s = s + bias.astype(work)
    lq, lk = s.shape[-2:]
    keep = np.ones(s.shape, bool)
    if causal:
        diagonal = 0 if causal == "top_left" or bug == "top_left" else lk - lq
        keep &= np.arange(lk) <= np.arange(lq)[:, None] + diagonal
    if mask is not None:
        keep &= mask
    s = np.where(keep, s, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        top = s.max(axis=-1, keepdims=True)
        if bug != "nan_rows":  # a fully masked row: exp(-inf - 0) = 0, then 0 / 1
            top = np.where(np.isfinite(top), top, 0.0)
        p = np.exp(s - top)
        total = p.sum(axis=-1, keepdims=True)
        if bug != "nan_rows":
            total = np.where(total == 0, 1.0, total)
        return ((p / total) @ v.astype(work)).astype(q.dtype)


def _sum_float16(terms: np.ndarray, axis: int) -> np.ndarray:
    """Sum along ``axis`` one term at a time, rounding to float16 after every addition."""
    terms = np.moveaxis(terms, axis, 0)
    acc = np.zeros(terms.shape[1:], F16)
    for t in terms:
        acc = (acc + t).astype(F16)
    return acc


def float16_accumulation(q, k, v):
    """Plain attention whose dot products, softmax sum and P V sum accumulate in float16."""
    s = _sum_float16(q[..., :, None, :] * k[..., None, :, :], axis=-1) * F16.type(1 / np.sqrt(q.shape[-1]))
    p = np.exp(s - s.max(axis=-1, keepdims=True)).astype(F16)
    p = (p / _sum_float16(p, axis=-1)[..., None]).astype(F16)
    return _sum_float16(p[..., :, :, None] * v[..., None, :, :], axis=-2)


def _implementation(bug: str) -> Callable[..., Any]:
    def attention(q, k, v, **options):
        return _naive(q, k, v, bug=bug, **options)

    attention.__qualname__ = f"attention_{bug or 'correct'}"
    return attention


def _flashcupy_cpu(q, k, v, **options):
    return fc.flash_attention(q, k, v, backend="cpu", **options)


def _flashcupy_cpu_vjp(q, k, v, **options):
    return fc.flash_attention_vjp(q, k, v, backend="cpu", **options)


# --------------------------------------------------------------------------- correct implementations pass


def test_flashcupy_cpu_backend_passes_with_every_option() -> None:
    check_attention_impl(_flashcupy_cpu, options=tuple(testing.OPTIONS), max_examples=20, seed=1)


def test_flashcupy_cpu_gradients_pass_with_every_option() -> None:
    check_attention_impl(_flashcupy_cpu_vjp, options=tuple(testing.OPTIONS), max_examples=15, grads=True, seed=2)


def test_a_plain_numpy_implementation_passes() -> None:
    """Not the reference itself: float32 arithmetic, its own masking and GQA."""
    check_attention_impl(_implementation(""), options=NAIVE_OPTIONS, max_examples=25, seed=3)


# --------------------------------------------------------------------------- bugs are caught and shrunk


def _failure(fn: Callable[..., Any], **kwargs: Any) -> AttentionCheckFailure:
    with pytest.raises(AttentionCheckFailure) as info:
        check_attention_impl(fn, **kwargs)
    exc = info.value
    assert isinstance(exc, AssertionError)
    assert repr(exc.problem) in str(exc) and "shrunk by Hypothesis" in str(exc)
    return exc


def test_catches_top_left_causal_where_bottom_right_is_meant() -> None:
    exc = _failure(_implementation("top_left"), options=NAIVE_OPTIONS, max_examples=100, seed=4)
    q, k, _, options = exc.problem
    assert set(options) == {"causal"} and options["causal"] in (True, "bottom_right")
    assert q.shape[-2] != k.shape[-2]
    assert "causal=" in str(exc) and "allowed" in str(exc)


def test_catches_a_missing_scale() -> None:
    exc = _failure(_implementation("no_scale"), options=NAIVE_OPTIONS, max_examples=100, seed=5)
    q, _, _, options = exc.problem
    assert q.shape[-1] > 1 and set(options) <= {"scale"}
    assert "row" in str(exc) and "column" in str(exc)


def test_catches_nan_on_fully_masked_rows() -> None:
    exc = _failure(_implementation("nan_rows"), options=NAIVE_OPTIONS, max_examples=100, seed=6)
    q, k, v, options = exc.problem
    assert set(options) <= {"mask", "causal"} and options
    assert "is nan where the reference is 0.0" in str(exc)
    ref = fc.attention_reference(q, k, v, **options)
    assert not np.isnan(ref).any() and (ref == 0).all(axis=-1).any()


def test_catches_gqa_heads_mapped_modulo() -> None:
    exc = _failure(_implementation("gqa_modulo"), options=NAIVE_OPTIONS, max_examples=100, seed=7)
    q, k, _, options = exc.problem
    assert not options
    assert k.shape[-3] >= 2 and q.shape[-3] > k.shape[-3]


def test_catches_float16_accumulation() -> None:
    exc = _failure(float16_accumulation, dtypes=("float16",), max_examples=100, seed=8)
    assert exc.problem.dtype == F16
    assert "2 x naive float16 error" in str(exc)


def test_reports_what_the_function_raised() -> None:
    def crashes(q, k, v, **options):
        raise RuntimeError("kernel exploded")

    exc = _failure(crashes, max_examples=5, seed=9)
    assert "raised RuntimeError on calling it: kernel exploded" in str(exc)
    assert isinstance(exc.__cause__, RuntimeError)


def test_reports_a_result_that_cannot_be_compared() -> None:
    """An output of the wrong kind (out with its lse) or too few gradients is a failure on the
    shrunk problem, not a bare error from the comparison."""
    def with_lse(q, k, v, **options):
        return fc.flash_attention(q, k, v, return_lse=True, backend="cpu", **options)

    exc = _failure(with_lse, dtypes=("float32",), max_examples=5, seed=0)
    assert "gave a result that cannot be compared (its output)" in str(exc)

    def two_gradients(q, k, v, **options):
        out, vjp = fc.flash_attention_vjp(q, k, v, backend="cpu", **options)
        return out, lambda dout: vjp(dout)[:2]

    exc = _failure(two_gradients, grads=True, max_examples=5, seed=0)
    assert "gave a result that cannot be compared (its gradients)" in str(exc)


def test_catches_wrong_gradients() -> None:
    def dk_doubled(q, k, v, **options):
        out, vjp = fc.flash_attention_vjp(q, k, v, backend="cpu", **options)
        return out, lambda dout: tuple(g * 2 if i == 1 else g for i, g in enumerate(vjp(dout)))

    exc = _failure(dk_doubled, grads=True, max_examples=50, seed=10)
    assert "dk[" in str(exc) and "key" in str(exc)


# --------------------------------------------------------------------------- assertions


def _problem(seed: int = 0, lq: int = 9, lk: int = 12):
    rs = np.random.default_rng(seed)
    return tuple(rs.standard_normal(s).astype(np.float32) for s in ((2, 3, lq, 8), (2, 3, lk, 8), (2, 3, lk, 5)))


def test_assert_attention_close_reports_the_worst_element() -> None:
    q, k, v = _problem()
    out = fc.attention_reference(q, k, v, causal=True).astype(np.float32)
    testing.assert_attention_close(out, q, k, v, causal=True)
    error, bound, message = testing.attention_close(out, q, k, v, causal=True)
    assert error <= bound and message == ""
    out[1, 2, 7, 4] += 0.01
    with pytest.raises(AssertionError) as info:
        testing.assert_attention_close(out, q, k, v, causal=True)
    text = str(info.value)
    assert "out[1, 2, 7, 4] (batch 1, head 2, row 7, column 4)" in text
    assert "error 0.01 > allowed" in text and "float32" in text and "causal=True" in text
    assert len(text.splitlines()) <= 4


def test_assertions_catch_nan_shape_and_infinity() -> None:
    q, k, v = _problem(lq=4)
    mask = np.ones((4, 12), bool)
    mask[2] = False
    out = fc.attention_reference(q, k, v, mask=mask)
    out[0, 0, 1, 0] = np.nan
    nan = testing.attention_close(out, q, k, v, mask=mask)
    assert "out[0, 0, 1, 0] (batch 0, head 0, row 1, column 0) is nan" in nan.message and np.isnan(nan.error)
    shape = testing.attention_close(out[..., :4], q, k, v, mask=mask)
    assert "shape (2, 3, 4, 4), expected (2, 3, 4, 5)" in shape.message
    _, lse = fc.attention_reference(q, k, v, mask=mask, return_lse=True)
    assert lse[0, 0, 2] == -np.inf
    wrong = lse.copy()
    wrong[0, 0, 2] = np.inf
    assert not testing.compare(wrong, lse, lse, np.float64).ok
    assert testing.compare(lse, lse, lse, np.float64).ok


def test_gradients_close_names_the_gradient() -> None:
    q, k, v = _problem(1)
    dout = np.random.default_rng(2).standard_normal((2, 3, 9, 5)).astype(np.float32)
    bias = np.zeros((9, 12), np.float32)
    out, vjp = fc.flash_attention_vjp(q, k, v, bias=bias, backend="cpu")
    grads = list(vjp(dout))
    testing.assert_gradients_close(grads, dout, q, k, v, bias=bias)
    grads[2] = grads[2] + 0.01
    results = testing.gradients_close(grads, dout, q, k, v, bias=bias)
    assert [n for n, c in results.items() if not c.ok] == ["dv"]
    assert "dv[" in results["dv"].message and "kv head" in results["dv"].message
    with pytest.raises(ValueError, match=r"\(no bias or sinks given\), received 4 arrays"):
        testing.gradients_close(grads, dout, q, k, v)


def test_the_rule() -> None:
    ref = np.array([0.0, 2.0, -1.0, np.inf])
    naive = ref + np.array([0.0, 1e-3, 0.0, 0.0])
    assert testing.tolerance(ref, naive, np.float16) == pytest.approx(2e-3 + 2.0**-10 * 2.0)
    assert testing.tolerance(ref, naive, np.float16, magnitude=8.0) == pytest.approx(2e-3 + 2.0**-10 * 8.0)
    assert testing.tolerance(ref, naive, np.float64) == 1e-9  # the float64 limit
    assert testing.floor_dtype(np.float16, np.float32) == F16
    assert testing.floor_dtype("bfloat16", np.float16).name == "bfloat16"


def test_dbias_terms_count_the_rows_a_broadcast_bias_sums() -> None:
    """A bias's gradient adds every row's residual of D over its broadcast axes: a scalar
    bias over (2, 4, 16) rows sums 128 of them, a (4, 1, 50) bias the 2 * 16 of each head,
    a full one a row's own."""
    rs = np.random.default_rng(0)
    q, k, dout, out = (rs.standard_normal(s) for s in ((2, 4, 16, 8), (2, 4, 50, 8), (2, 4, 16, 8), (2, 4, 16, 8)))
    row = testing.cancelling_terms(q, k, dout, out)["dbias"]
    assert row == testing.cancelling_terms(q, k, dout, out, bias_shape=(2, 4, 16, 50))["dbias"] > 0
    assert testing.cancelling_terms(q, k, dout, out, bias_shape=(1, 1))["dbias"] == 128 * row
    assert testing.cancelling_terms(q, k, dout, out, bias_shape=(4, 1, 50))["dbias"] == 32 * row
    # packed (Hq, total) rows of three sequences of 5, 9 and 2 queries: the bias's frame is
    # (3, Hq, 9), so a (1, Hq, 9, Lk) bias sums three sequences' rows into an element
    packed = dout[0].reshape(4, 16, 8)
    row = testing.cancelling_terms(q, k, packed, out[0].reshape(4, 16, 8))["dbias"]
    terms = testing.cancelling_terms(q, k, packed, out[0].reshape(4, 16, 8), bias_shape=(1, 4, 9, 50),
                                     cu_seqlens_q=[0, 5, 14, 16])
    assert terms["dbias"] == 3 * row


# --------------------------------------------------------------------------- the strategy


def test_unknown_names_are_value_errors() -> None:
    with pytest.raises(ValueError, match=r"options: unknown name\(s\) 'temperature'; expected some of 'plain', 'causal'"):
        attention_problems(options=("causal", "temperature"))
    with pytest.raises(ValueError, match=r"dtypes: unknown name\(s\) 'float8'"):
        attention_problems(dtypes=("float8",))
    with pytest.raises(ValueError, match="min_len, max_len"):
        attention_problems(max_len=-1)
    with pytest.raises(ValueError, match="array: expected one of 'numpy', 'cupy', 'torch', received 'jax'"):
        check_attention_impl(_flashcupy_cpu, array="jax")


def test_every_option_is_documented() -> None:
    assert set(testing.OPTIONS) == {"plain", "causal", "window", "mask", "bias", "alibi", "sinks", "softcap", "scale",
                                    "gqa", "lengths", "block_mask", "dropout", "value_dim", "strided", "ranks"}
    assert all(isinstance(text, str) and text for text in testing.OPTIONS.values())


def test_strategy_draws_every_option_and_awkward_shape() -> None:
    seen: set[str] = set()

    @settings(max_examples=200, database=None, deadline=None, derandomize=True)
    @given(attention_problems(options=tuple(testing.OPTIONS), max_len=128))
    def draw(problem) -> None:
        q, k, v, options = problem
        seen.update(options)
        seen.update({f"causal={options.get('causal')!r}", f"L={q.shape[-2]}", f"L={k.shape[-2]}",
                     f"ndim={q.ndim}", problem.dtype.name})
        if q.ndim >= 3:
            seen.add("mqa" if k.shape[-3] == 1 < q.shape[-3] else "gqa" if k.shape[-3] < q.shape[-3] else "mha")
        seen.add("odd D" if q.shape[-1] % 2 else "even D")
        seen.add("Lq != Lk" if q.shape[-2] != k.shape[-2] else "Lq == Lk")
        if not q.flags.c_contiguous and q.size > 1:
            seen.add("strided")
        if v.shape[-1] != q.shape[-1]:
            seen.add("Dv != D")
        if "mask" in options:
            full = np.broadcast_to(options["mask"], q.shape[:-1] + (k.shape[-2],))
            if (~full).all(axis=-1).any():
                seen.add("fully masked row")
        if not options:
            seen.add("plain")

    draw()
    wanted = {"causal=True", "causal='top_left'", "causal='bottom_right'", "window", "mask", "bias", "alibi_slopes", "sinks",
              "softcap", "scale", "q_lengths", "kv_lengths", "block_mask", "dropout_p", "L=1", "L=17", "L=97",
              "ndim=2", "ndim=4", "ndim=5", "mqa", "gqa", "mha", "odd D", "Lq != Lk", "strided", "Dv != D",
              "fully masked row", "plain", "float16", "bfloat16", "float32", "float64"}
    assert wanted <= seen, sorted(wanted - seen)


def test_problem_unpacks_and_prints_briefly() -> None:
    @settings(max_examples=20, database=None)
    @given(attention_problems(dtypes=(np.float32,), options=("mask", "lengths")))
    def draw(problem) -> None:
        q, k, v, options = problem
        assert (q.dtype, k.dtype, v.dtype) == (np.float32,) * 3 and problem.dout.shape == q.shape[:-1] + v.shape[-1:]
        text = repr(problem)
        assert text.startswith("AttentionProblem(float32 q ") and "\n" not in text and len(text) < 400

    draw()


def test_same_layout_keeps_strides() -> None:
    x = np.arange(2 * 5 * 3 * 4, dtype=np.float32).reshape(2, 5, 3, 4).swapaxes(1, 2)
    copy = _same_layout(x, np.array, lambda a, axes: a.transpose(axes))
    assert np.array_equal(copy, x) and copy.strides == x.strides and not np.shares_memory(copy, x)


def test_same_layout_keeps_zero_dims() -> None:
    """A 0-d option (sinks or slopes of a one-head call) became (1,) in the converted kind,
    and its gradient took that shape."""
    for x in (np.array(1.5), np.arange(6.0)[::2]):
        copy = _same_layout(x, np.array, lambda a, axes: a.transpose(axes))
        assert copy.shape == x.shape and np.array_equal(copy, x)


def test_array_kinds_fail_clearly_when_missing(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match="array='torch' needs PyTorch: pip install torch"):
        check_attention_impl(_flashcupy_cpu, array="torch")
    monkeypatch.setattr(interop, "gpu_usable", lambda: False)
    if "cupy" in sys.modules or _importable("cupy"):
        with pytest.raises(RuntimeError, match="array='cupy' needs a usable CUDA GPU"):
            check_attention_impl(_flashcupy_cpu, array="cupy")
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ImportError, match=r"array='cupy' needs CuPy: pip install 'flashcupy\[cuda12\]'"):
        check_attention_impl(_flashcupy_cpu, array="cupy")


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return False
    return True


def test_assertions_work_without_hypothesis() -> None:
    script = """
import sys
sys.modules["hypothesis"] = None  # as if it were not installed
import numpy as np
import flashcupy as fc
from flashcupy.testing import assert_attention_close, attention_problems, check_attention_impl
q = np.ones((1, 2, 3, 4), np.float32)
assert_attention_close(fc.attention_reference(q, q, q), q, q, q)
for call in (lambda: attention_problems(), lambda: check_attention_impl(lambda q, k, v: q)):
    try:
        call()
    except ImportError as exc:
        print(exc)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines == [f"flashcupy.testing.{name} needs Hypothesis, which is not installed: "
                     "pip install 'flashcupy[testing]'" for name in ("attention_problems", "check_attention_impl")]


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_cupy_arrays_through_the_cuda_backend() -> None:
    cupy = pytest.importorskip("cupy")

    def cuda_vjp(q, k, v, **options):
        assert isinstance(q, cupy.ndarray) and all(not isinstance(x, np.ndarray) for x in options.values())
        return fc.flash_attention_vjp(q, k, v, backend="cuda", **options)

    check_attention_impl(cuda_vjp, options=tuple(testing.OPTIONS), max_examples=40, grads=True, array="cupy",
                         max_len=300, seed=11)


def sdpa(q, k, v, causal: Any = False, scale: float | None = None, mask=None, bias=None):
    """PyTorch SDPA in flashcupy's conventions: (out, vjp). GQA by repeating k and v; causal
    with Lq != Lk and fully masked rows (out = 0) through an explicit boolean mask; the bias
    in q's dtype (SDPA's float masks share the query's dtype)."""
    import torch

    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    kk, vv = (x.repeat_interleave(group, dim=-3) for x in (k, v))
    lq, lk = q.shape[-2], k.shape[-2]
    # SDPA's is_causal where both alignments agree (Lq == Lk), else the mask written out
    is_causal = bool(causal) and lq == lk and mask is None and bias is None
    allowed = mask
    if causal and not is_causal:
        diagonal = 0 if causal == "top_left" else lk - lq
        tri = torch.arange(lk, device=q.device) <= torch.arange(lq, device=q.device)[:, None] + diagonal
        allowed = tri if allowed is None else allowed & tri
    live = None
    if allowed is not None:
        allowed = torch.broadcast_to(allowed, q.shape[:-1] + (lk,))
        live = allowed.any(dim=-1, keepdim=True)
        allowed = allowed | ~live  # a row with no key attends every key, and is zeroed below
    attn_mask = allowed
    if bias is not None:  # SDPA's masks need a contiguous last axis: a broadcast bias is written out
        attn_mask = torch.broadcast_to(bias, q.shape[:-1] + (lk,)).to(q.dtype).contiguous()
        if allowed is not None:
            attn_mask = torch.where(allowed, attn_mask, torch.tensor(float("-inf"), dtype=q.dtype, device=q.device))
    out = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=attn_mask, is_causal=is_causal,
                                                           scale=scale)
    if live is not None:
        out = torch.where(live, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out, lambda dout: torch.autograd.grad(out, (q, k, v), dout)


@pytest.mark.gpu
def test_torch_sdpa_passes_for_the_options_it_supports() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device")

    def torch_sdpa(q, k, v, **options):
        assert isinstance(q, torch.Tensor) and q.is_cuda
        assert all(isinstance(x, torch.Tensor) for x in options.values() if hasattr(x, "shape"))
        # SDPA's fused CUDA kernels return NaN for scale = 0.0 (torch 2.11, H100: out and dq of a
        # (1, 1, 1, 1) float16 problem), which it does not support; every other scale is drawn.
        assume(options.get("scale") != 0.0)
        return sdpa(q, k, v, **options)

    check_attention_impl(torch_sdpa, options=("causal", "mask", "bias", "scale", "gqa", "value_dim", "strided"),
                         max_examples=40, grads=True, array="torch", max_len=300, seed=12)


def test_a_function_may_assume_away_problems_it_does_not_support() -> None:
    """hypothesis.assume inside the function under test skips the problem: no failure."""
    from hypothesis import assume as hypothesis_assume

    def no_zero_scale(q, k, v, **options):
        hypothesis_assume(options.get("scale") != 0.0)
        if options.get("scale") == 0.0:
            raise AssertionError("a problem that was assumed away reached the function")
        return fc.flash_attention(q, k, v, backend="cpu", **options)

    check_attention_impl(no_zero_scale, dtypes=("float32",), options=("scale",), max_examples=30, seed=5)
