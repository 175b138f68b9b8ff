"""check_attention_impl: property-test any attention function against the float64 reference."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from .assertions import attention_close, gradients_close, to_host
from .problems import DTYPES, HEAD_DIMS, AttentionProblem, attention_problems, require_hypothesis

#: The array kinds check_attention_impl hands to the function under test.
ARRAY_KINDS = ("numpy", "cupy", "torch")


class AttentionCheckFailure(AssertionError):
    """check_attention_impl's failure: the message holds the shrunk counterexample and what
    differs; ``problem`` holds its arrays (``q, k, v, options = exc.problem``)."""

    def __init__(self, message: str, problem: AttentionProblem):
        super().__init__(message)
        self.problem = problem


def _converter(array: str) -> Callable[[np.ndarray], Any]:
    """A function turning a NumPy array into the ``array`` kind with the same strides; a clear
    error now when that kind cannot be had here."""
    if array == "numpy":
        return lambda x: x
    if array == "cupy":
        try:
            import cupy
        except ImportError as exc:
            raise ImportError("array='cupy' needs CuPy: pip install 'flashcupy[cuda12]' (or cuda13)") from exc
        from .. import interop

        if not interop.gpu_usable():
            raise RuntimeError("array='cupy' needs a usable CUDA GPU; CuPy sees none here")
        return lambda x: _same_layout(x, cupy.asarray, lambda a, axes: a.transpose(axes))
    if array == "torch":
        try:
            import torch
        except ImportError as exc:
            raise ImportError("array='torch' needs PyTorch: pip install torch") from exc
        device = "cuda" if torch.cuda.is_available() else "cpu"

        def make(c: np.ndarray):
            return _torch_tensor(torch, c).to(device)

        return lambda x: _same_layout(x, make, lambda t, axes: t.permute(axes))
    raise ValueError(f"array: expected one of {', '.join(map(repr, ARRAY_KINDS))}, received {array!r}")


def _torch_tensor(torch: Any, x: np.ndarray):
    """A CPU tensor sharing a NumPy array's memory (bfloat16 crosses as its 16 bits: torch
    does not know ml_dtypes' bfloat16)."""
    if x.dtype == DTYPES["bfloat16"]:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


def _same_layout(x: np.ndarray, make: Callable[[np.ndarray], Any], permute: Callable[[Any, tuple], Any]) -> Any:
    """``make`` of a C-contiguous copy of ``x`` in ``x``'s memory order, ``permute``d back to
    ``x``'s axes: a (B, L, H, D) array seen as (B, H, L, D) stays such a view in the new kind.
    A 0-d array stays 0-d (np.ascontiguousarray would make it (1,))."""
    if x.flags.c_contiguous:
        return make(x)
    if x.ndim < 2:
        return make(np.ascontiguousarray(x))
    order = sorted(range(x.ndim), key=lambda a: -x.strides[a])
    back = tuple(int(a) for a in np.argsort(order))
    return permute(make(np.ascontiguousarray(x.transpose(order))), back)


def _arguments(problem: AttentionProblem, convert: Callable[[np.ndarray], Any]):
    """(q, k, v, options) of ``problem`` with every array converted to the requested kind."""
    q, k, v, options = problem
    kind_options = {n: (convert(x) if isinstance(x, np.ndarray) else x) for n, x in options.items()}
    return convert(q), convert(k), convert(v), kind_options


def _run(fn: Callable[..., Any], problem: AttentionProblem, convert: Callable[[np.ndarray], Any],
         grads: bool, name: str) -> None:
    """One example: call ``fn`` and compare; AssertionError (with what ``fn`` raised, if it did)."""
    q, k, v, options = _arguments(problem, convert)
    what = "calling it"
    try:
        result = fn(q, k, v, **options)
        if grads:
            what = "unpacking its result as (out, vjp)"
            out, vjp = result
            what = "calling vjp(dout)"
            gradients = vjp(convert(problem.dout))
        else:
            out = result
    except Exception as exc:  # any error of the function under test is a failure on this problem,
        from hypothesis.errors import UnsatisfiedAssumption  # check_attention_impl runs under Hypothesis

        if isinstance(exc, UnsatisfiedAssumption):  # but for hypothesis.assume: fn skips a problem
            raise
        raise AssertionError(f"{name} raised {type(exc).__name__} on {what}: {exc}") from exc
    failures = []
    what = "its output"
    try:
        forward = attention_close(out, problem.q, problem.k, problem.v, **problem.options)
        failures += [forward.message] if not forward.ok else []
        if grads:
            what = "its gradients"
            per_grad = gradients_close(tuple(gradients), problem.dout, problem.q, problem.k, problem.v,
                                       **problem.options)
            failures += [c.message for c in per_grad.values() if not c.ok]
    except (TypeError, ValueError) as exc:  # a result of the wrong kind or shape: a tuple for out, a gradient short
        raise AssertionError(
            f"{name} gave a result that cannot be compared ({what}): {type(exc).__name__}: {exc}") from exc
    if failures:
        raise AssertionError("\n".join(failures))


def check_attention_impl(fn: Callable[..., Any], dtypes: Sequence[str] = tuple(DTYPES),
                         options: Sequence[str] = ("plain",), *, max_examples: int = 100, max_len: int = 128,
                         min_len: int = 1, head_dims: Sequence[int] = HEAD_DIMS, grads: bool = False,
                         array: str = "numpy", seed: int | None = None) -> None:
    """Property-test ``fn(q, k, v, **options)`` against flashcupy's float64 reference.

    Draws up to ``max_examples`` problems from :func:`attention_problems` (``dtypes``,
    ``options``, ``max_len``, ``min_len`` and ``head_dims`` as there), hands ``fn``
    arrays of the ``array`` kind ("numpy"; "cupy" on the current GPU; "torch", on CUDA
    when PyTorch sees a GPU, else on the CPU) with the array options of that kind too,
    and checks the output with :func:`assert_attention_close`'s rule. With
    ``grads=True``, ``fn`` returns ``(out, vjp)`` and ``vjp(dout)`` returns (dq, dk, dv),
    or (dq, dk, dv) then dbias with a bias and dsinks with sinks to have those checked as
    well; every gradient is checked against the reference backward.

    ``fn`` may call ``hypothesis.assume(condition)`` to pass over problems it does not
    support (an option value, a shape), as in any Hypothesis test. On a failure Hypothesis
    shrinks the problem, and AttentionCheckFailure (an
    AssertionError) is raised: its message holds the shrunk problem and what
    differs on it (worst element, measured against allowed error), its ``problem``
    attribute the arrays. ``seed`` makes the run repeatable. Needs Hypothesis
    (``pip install 'flashcupy[testing]'``).
    """
    require_hypothesis("flashcupy.testing.check_attention_impl")
    strategy = attention_problems(dtypes, options, max_len=max_len, min_len=min_len, head_dims=head_dims)
    if not (isinstance(max_examples, int) and max_examples >= 1):
        raise ValueError(f"max_examples: expected a positive int, received {max_examples!r}")
    convert = _converter(array)
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    name = getattr(fn, "__qualname__", repr(fn))
    tried: list[AttentionProblem] = []

    @settings(max_examples=max_examples, deadline=None, database=None, report_multiple_bugs=False,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def property_test(problem: AttentionProblem) -> None:
        tried.append(problem)
        _run(fn, problem, convert, grads, name)

    if seed is not None:
        property_test = hypothesis_seed(seed)(property_test)
    try:
        property_test()
    except AssertionError as exc:
        problem = tried[-1]  # Hypothesis runs the shrunk counterexample last, then raises its error
        raise AttentionCheckFailure(
            f"{name} does not match the float64 reference (array={array!r}, grads={grads}) on this problem, "
            f"shrunk by Hypothesis after {len(tried)} calls:\n"
            f"  {problem!r}\n"
            + "\n".join(f"  {line}" for line in str(exc).splitlines())
            + "\nThe arrays: q, k, v, options = exc.problem (exc.problem.dout: the output gradient).",
            problem,
        ) from exc.__cause__
