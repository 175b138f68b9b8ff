"""Shared test machinery: the tolerance rule of docs/semantics.md#accuracy and the attention
problems the tests draw, both from :mod:`flashcupy.testing` (one source for the project's
tests and its users').

Backend-agnostic: a case holds NumPy inputs; tests pass them to any backend.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from unittest import mock

import ml_dtypes
import numpy as np
from hypothesis import strategies as st

from flashcupy import cpu, testing
from flashcupy.testing import AttentionProblem

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
DTYPES = (F16, BF16, F32, F64)

FLOOR = testing.ROUNDING_FLOOR

#: The repository root (the benchmark scripts' home).
ROOT = Path(__file__).resolve().parents[1]


def bench_script(name: str) -> Any:
    """bench/<name>.py imported as a module (the scripts are not a package)."""
    import importlib.util

    found = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(found)
    sys.modules[name] = module  # where dataclasses look a class's module up
    found.loader.exec_module(module)
    return module


def bench_plan(suite: str, *args: str) -> list[str]:
    """The lines ``python -m flashcupy bench --suite <suite> --dry-run [args]`` prints: the
    suite's plan, run through the CLI from the repository root."""
    out = subprocess.run([sys.executable, "-m", "flashcupy", "bench", "--suite", suite, "--dry-run", *args],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    return out.splitlines()


def assert_rule(
    name: str, ours: Any, ref: np.ndarray, naive: np.ndarray, dtype: np.dtype, magnitude: float = 0.0
) -> None:
    """:func:`flashcupy.testing.compare` as an assertion: the reference's shape and non-finite
    entries, and max |ours - ref| <= 2 max |naive - ref| + floor (float64: also <= 1e-9).

    ``naive`` is plain attention computed in the input dtype; ``ref`` is float64;
    ``magnitude`` is the size of terms that cancel in the result (see :func:`cancelling_terms`).
    """
    result = testing.compare(np.asarray(ours), ref, naive, dtype, magnitude, name=name)
    assert result.ok, result.message


def gradient_names(options: dict[str, Any]) -> tuple[str, ...]:
    """The names of ``flash_attention_backward``'s results under ``options`` (with
    ``bias_grad=True`` when there is a bias): dq, dk, dv, then dbias and dsinks where given."""
    return (("dq", "dk", "dv") + (("dbias",) if options.get("bias") is not None else ())
            + (("dsinks",) if options.get("sinks") is not None else ()))


def cancelling_terms(case: AttentionProblem, ref: dict[str, np.ndarray]) -> dict[str, float]:
    """:func:`flashcupy.testing.cancelling_terms` for a drawn case."""
    bias = case.options.get("bias")
    return testing.cancelling_terms(case.q, case.k, case.dout, ref["out"], case.options.get("scale"),
                                    None if bias is None else np.shape(bias), case.options.get("cu_seqlens_q"))


@contextlib.contextmanager
def cpu_tiles(tiles: tuple[int, int] | None):
    """Force the CPU backend's (BLOCK_M, BLOCK_N) so small problems span many tiles."""
    if tiles is None:
        yield
        return
    with mock.patch.object(cpu, "tile_sizes", lambda pb: tiles):
        yield


@dataclass(repr=False, eq=False)
class Case(AttentionProblem):
    """A drawn problem (:class:`flashcupy.testing.AttentionProblem`: q, k, v, dout, options)
    and the CPU backend's tiles to force, if any."""

    tiles: tuple[int, int] | None = None

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, tiles={self.tiles})"


#: Every option of the public strategy: the project's tests draw all of them.
ALL_OPTIONS = tuple(testing.OPTIONS)
#: Shapes and layouts only (GQA, Dv != D, strided views, 2 to 5 dims), no attention option.
LAYOUTS = ("gqa", "value_dim", "strided", "ranks")
HEAD_DIMS = (1, 3, 8, 16, 40, 59, 80, 96, 111)
MAX_LEN = 70
TILES = st.sampled_from([None, (16, 16), (7, 13), (32, 8), (5, 64)])


def cases(dtypes=DTYPES, max_len: int = MAX_LEN, head_dims=HEAD_DIMS, options: bool = True):
    """:func:`flashcupy.testing.attention_problems` over awkward shapes (empty sequences
    included) with every option in combination (``options=False``: layouts only), as
    :class:`Case` with CPU tiles drawn too."""
    problems = testing.attention_problems(dtypes, ALL_OPTIONS if options else LAYOUTS, max_len=max_len,
                                          min_len=0, head_dims=head_dims)
    return st.builds(lambda p, tiles: Case(p.q, p.k, p.v, p.dout, p.options, tiles), problems, TILES)


def padded_to_packed(x: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(B, H, L, d) padded -> (H, sum(lengths), d) packed."""
    return np.concatenate([x[b, :, : lengths[b]] for b in range(x.shape[0])], axis=1)


def cu_seqlens(lengths: np.ndarray) -> np.ndarray:
    """int32 cumulative lengths starting at 0."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def captured_replays(call: Callable[[Any], tuple], queries: list, held: int = 3) -> list[tuple[list, list]]:
    """(results, the same call's results made alone) pairs, on the host, of ``call`` (a query ->
    a tuple of CuPy arrays) captured in a CUDA graph on a copy of queries[0] and replayed with
    queries 1, 2 and 1 written into that copy, on the capturing stream: around each replay,
    ``held`` eager calls on the next query, made after the capture and read only after the
    replay, and one eager call on the replayed query after it. A graph that wrote memory CuPy's
    pool had handed out since the capture would show in the held results."""
    import cupy

    alone = [[a.get() for a in call(x)] for x in queries]
    q = queries[0].copy()  # the captured call's input buffer
    pairs = []
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        call(q)  # compiled and planned before the capture
        stream.begin_capture()
        captured = call(q)
        graph = stream.end_capture()
        for n in (1, 2, 1):
            other = (n + 1) % 3
            q[...] = queries[n]
            eager = [call(queries[other]) for _ in range(held)]
            graph.launch(stream)
            after = call(queries[n])
            for got, want in [(e, alone[other]) for e in eager] + [(captured, alone[n]), (after, alone[n])]:
                pairs.append(([a.get() for a in got], want))  # before the next replay writes `captured`
    return pairs
