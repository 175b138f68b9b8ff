"""flashcupy: exact, IO-aware attention (FlashAttention) for NumPy, CuPy and DLPack arrays."""

from .api import (
    dropout_mask,
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    flash_attention_varlen,
    flash_attention_vjp,
)
from .cpu_parallel import cpu_threads, get_cpu_threads, set_cpu_threads
from .explain import explain
from .kvcache import flash_attention_with_kvcache, merge_attention_states
from .precompile import precompile
from .reference import attention_reference

__version__ = "0.1.0"

__all__ = [
    "attention_reference",
    "cpu_threads",
    "dropout_mask",
    "explain",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_forward",
    "flash_attention_varlen",
    "flash_attention_vjp",
    "flash_attention_with_kvcache",
    "get_cpu_threads",
    "merge_attention_states",
    "precompile",
    "set_cpu_threads",
]
