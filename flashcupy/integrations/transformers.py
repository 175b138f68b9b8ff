"""flashcupy as an attention implementation of Hugging Face transformers.

    import flashcupy.integrations.transformers as flashcupy_hf

    flashcupy_hf.register()                  # adds "fc_attention" to transformers' attention registry
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fc_attention")
    # or: model.set_attn_implementation("fc_attention")

Forward, backward and ``generate()`` then run through :func:`flashcupy.torch.flash_attention`
(GQA natively, no repeated key heads). The model's masks come from transformers' SDPA mask
function: boolean (True = attend) where padding, a sliding window or a custom pattern needs one,
and none where the causal triangle alone is meant, which flashcupy runs as ``causal="top_left"``
(transformers' alignment). Gemma-2's ``softcap``, GPT-OSS's sinks (``s_aux``), T5's and MPT's
``position_bias`` and training-time dropout pass through. A query that may attend no key (a
padding token's row) gives 0, where SDPA and eager give an average of values; such rows' outputs
are padding and should carry no loss. The
name must not contain "flash": transformers reserves those for its FlashAttention family.
transformers stays an optional dependency; this module imports it.
"""

from __future__ import annotations

from typing import Any

try:
    import torch
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError("flashcupy.integrations.transformers needs PyTorch and transformers: "
                      "pip install torch transformers") from exc

from .. import torch as _flashcupy_torch

__all__ = ["DEFAULT_NAME", "attention_forward", "register"]

DEFAULT_NAME = "fc_attention"  # "flashcupy" has "flash" in it


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, softcap: float | None = None,
                      position_bias: torch.Tensor | None = None, s_aux: torch.Tensor | None = None,
                      **_: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query (B, Hq, Lq, D), key (B, Hk, Lk, D),
    value (B, Hk, Lk, Dv), the model's mask ((B, 1, Lq, Lk) boolean True = attend, or additive
    float, or None), a learned additive ``position_bias`` (T5, MPT) and attention sinks
    ``s_aux`` (GPT-OSS: one logit per head). Returns (out as (B, Lq, Hq, Dv), None): no
    attention weights."""
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options: dict[str, Any] = {"scale": scaling}
    bias = position_bias
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        options["mask"] = attention_mask
    elif attention_mask is not None:
        bias = attention_mask if bias is None else bias + attention_mask
    elif is_causal and query.shape[2] > 1:
        options["causal"] = "top_left"  # transformers' causal masks align the first query with the first key
    if bias is not None:
        options["bias"] = bias
    if s_aux is not None:
        options["sinks"] = s_aux
    if softcap is not None:
        options["softcap"] = softcap
    if dropout > 0:
        options["dropout_p"] = dropout
    out = _flashcupy_torch.flash_attention(query, key, value, **options)
    return out.transpose(1, 2).contiguous(), None


def register(name: str = DEFAULT_NAME) -> str:
    """Add flashcupy to transformers' attention and mask registries under ``name`` (SDPA's mask
    function), for ``attn_implementation=name``. Returns the name."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name: expected a non-empty str, received {name!r}")
    if "flash" in name.lower():
        raise ValueError(f"name: expected a name without 'flash' (transformers reserves those for its "
                         f"FlashAttention family), received {name!r}")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
