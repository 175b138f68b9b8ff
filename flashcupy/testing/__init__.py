"""Test any attention implementation against flashcupy's float64 reference.

    from flashcupy.testing import assert_attention_close, attention_problems, check_attention_impl

    assert_attention_close(out, q, k, v, causal=True)       # one result, a readable report
    check_attention_impl(my_attention, dtypes=("float16",), options=("causal", "mask"))  # fuzz it

The rule (docs/semantics.md#accuracy, as FlashAttention's tests): max |ours - ref| <= 2 x
max |naive - ref| + a rounding floor, with ``ref`` the float64 reference and
``naive`` plain attention computed in the input dtype. The assertions and the rule
need only NumPy; :func:`attention_problems` and :func:`check_attention_impl` need
Hypothesis (``pip install 'flashcupy[testing]'``) and raise ImportError naming that
extra when it is missing. The option names they accept are :data:`OPTIONS`.
"""

from .assertions import (
    assert_attention_close,
    assert_gradients_close,
    attention_close,
    gradients_close,
    reference_results,
)
from .check import ARRAY_KINDS, AttentionCheckFailure, check_attention_impl
from .problems import DTYPES, HEAD_DIMS, OPTIONS, AttentionProblem, attention_problems
from .rule import ROUNDING_FLOOR, Comparison, cancelling_terms, compare, floor_dtype, tolerance

__all__ = [
    "ARRAY_KINDS",
    "DTYPES",
    "HEAD_DIMS",
    "OPTIONS",
    "ROUNDING_FLOOR",
    "AttentionCheckFailure",
    "AttentionProblem",
    "Comparison",
    "assert_attention_close",
    "assert_gradients_close",
    "attention_close",
    "attention_problems",
    "cancelling_terms",
    "check_attention_impl",
    "compare",
    "floor_dtype",
    "gradients_close",
    "reference_results",
    "tolerance",
]
