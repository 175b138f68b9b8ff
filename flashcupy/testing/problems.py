"""Attention problems: the drawn inputs, the option names, and the Hypothesis strategy's front door.

This module imports without Hypothesis; :func:`attention_problems` needs it
and says so (ImportError naming the ``testing`` extra) when it is missing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import ml_dtypes
import numpy as np

from .assertions import describe, reference_results

#: Every option name :func:`attention_problems` accepts, with what it adds to the drawn
#: problems. Each named option is on in some problems and off in others, in every
#: combination; "plain" (no option) is always among them.
OPTIONS: dict[str, str] = {
    "plain": "no option at all; always included, naming it changes nothing",
    "causal": "causal=True, 'bottom_right' (keep j <= i + Lk - Lq) or 'top_left' (keep j <= i)",
    "window": "window=(left, right), each None (unbounded) or 0..20, around the bottom-right diagonal",
    "mask": "mask: bool, True = attend, broadcastable to (..., Hq, Lq, Lk); some rows fully masked",
    "bias": "bias: float (q's dtype or float32), broadcastable to (..., Hq, Lq, Lk), added to the scores",
    "alibi": "alibi_slopes broadcastable to (..., Hq): adds -slope * |i + Lk - Lq - j| to the scores",
    "sinks": "sinks: logits broadcastable to (..., Hq), mean 0, sd 2, joining each row's softmax denominator",
    "softcap": "softcap in [0.5, 30]: scores become softcap * tanh(score / softcap)",
    "scale": "scale in [-1.5, 1.5] (zero and negative included) instead of 1 / sqrt(D)",
    "gqa": "Hq a multiple (2 to 4) of Hk: query head h reads kv head h // (Hq // Hk); Hk = 1 is MQA",
    "lengths": "q_lengths, kv_lengths per batch entry (0 included): rows >= q_len give 0, keys >= kv_len are masked",
    "block_mask": "block_mask (bool, broadcastable to (..., Hq, ceil(Lq / bs), ceil(Lk / bs))) with block_size 1..24",
    "dropout": "dropout_p in {0.17, 0.5, 0.9} with seed and dropout_offset: the keep mask is "
               "flashcupy.dropout_mask((..., Hq, Lq, Lk), dropout_p, seed, dropout_offset)",
    "value_dim": "v's head dim Dv differs from D (1 or 24)",
    "strided": "q, k, v are (B, L, H, D) memory seen as (B, H, L, D): not C-contiguous",
    "ranks": "inputs of 2 dims (L, D: one head, no batch) up to 5 (two batch axes) instead of (B, H, L, D)",
}

#: The dtype names :func:`attention_problems` draws from.
DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}

#: Head dims drawn by default: odd, small and the common ones up to 256.
HEAD_DIMS = (1, 3, 8, 16, 40, 59, 64, 80, 96, 111, 128, 256)

EXTRA = "pip install 'flashcupy[testing]'"


@dataclass(repr=False, eq=False)
class AttentionProblem:
    """One drawn problem: q (..., Hq, Lq, D), k (..., Hk, Lk, D), v (..., Hk, Lk, Dv) and an
    output gradient dout (..., Hq, Lq, Dv), NumPy arrays of one dtype, and the keyword
    ``options`` of :func:`flashcupy.flash_attention` (array options as NumPy arrays).

    Unpacks as the arguments of the function under test: ``q, k, v, options = problem``.
    """

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    dout: np.ndarray
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def dtype(self) -> np.dtype:
        return self.q.dtype

    def __iter__(self) -> Iterator[Any]:
        return iter((self.q, self.k, self.v, self.options))

    def references(self, with_backward: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
        """(ref, naive): float64 out, lse (and dq, dk, dv, dbias) of the float64 reference and of
        plain attention in the problem's dtype (:func:`flashcupy.testing.assertions.reference_results`)."""
        return reference_results(self.q, self.k, self.v, self.options, self.dout if with_backward else None)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({describe(self.q, self.k, self.v, self.options)})"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis prints counterexamples with this
        printer.text(repr(self))


def check_names(names: Sequence[str], known: Sequence[str], what: str) -> tuple[str, ...]:
    """``names`` as a tuple, or ValueError naming the unknown ones and the accepted ones."""
    if isinstance(names, str):
        names = (names,)
    names = tuple(names)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"{what}: unknown name(s) {', '.join(map(repr, unknown))}; "
                         f"expected some of {', '.join(map(repr, known))}")
    return names


def require_hypothesis(what: str) -> None:
    """ImportError naming the extra when Hypothesis is missing."""
    try:
        import hypothesis  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"{what} needs Hypothesis, which is not installed: {EXTRA}") from exc


def attention_problems(dtypes: Sequence[str] = tuple(DTYPES), options: Sequence[str] = ("plain",), *,
                       max_len: int = 128, min_len: int = 1, head_dims: Sequence[int] = HEAD_DIMS):
    """A Hypothesis strategy drawing :class:`AttentionProblem` instances (q, k, v, options).

    - ``dtypes``: names from :data:`DTYPES` (float16, bfloat16, float32, float64) or the
      dtypes themselves.
    - ``options``: names from :data:`OPTIONS`; each is on in some problems and off in
      others, in every combination, and the plain problem is always among them.
    - ``max_len``, ``min_len``: bounds of Lq and Lk, drawn apart (Lq != Lk) from awkward
      values (1, 2, 16, 17, 33, 64, 65, 97, 128, 129, 255, 256, 257, 1025 within the bounds)
      and anything between.
    - ``head_dims``: the D values drawn (default: odd and usual ones from 1 to 256).

    Shapes are (B, H, L, D) with B and H in 1..2 unless "gqa" or "ranks" say otherwise;
    values are standard normal, rounded to the dtype. Shrinking goes towards fewer
    options, shorter sequences and smaller head dims. Needs Hypothesis (ImportError
    naming ``pip install 'flashcupy[testing]'`` otherwise).
    """
    if isinstance(dtypes, str):
        dtypes = (dtypes,)
    dtypes = check_names([d if isinstance(d, str) else np.dtype(d).name for d in dtypes], tuple(DTYPES), "dtypes")
    options = check_names(options, tuple(OPTIONS), "options")
    if not dtypes:
        raise ValueError("dtypes: expected at least one dtype name, received none")
    if not (isinstance(min_len, int) and isinstance(max_len, int) and 0 <= min_len <= max_len):
        raise ValueError(f"min_len, max_len: expected ints with 0 <= min_len <= max_len, "
                         f"received {min_len!r}, {max_len!r}")
    head_dims = tuple(head_dims)
    if not head_dims or not all(isinstance(d, int) and d >= 1 for d in head_dims):
        raise ValueError(f"head_dims: expected positive ints, received {head_dims!r}")
    require_hypothesis("flashcupy.testing.attention_problems")
    from ._strategies import problems

    return problems(tuple(DTYPES[n] for n in dtypes), frozenset(options), min_len, max_len, head_dims)
