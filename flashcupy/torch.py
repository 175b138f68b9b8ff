"""PyTorch autograd for flashcupy: ``flashcupy.torch.flash_attention(q, k, v, **options)``.

A ``torch.autograd.Function`` over flashcupy's forward and backward, for torch
tensors on a CUDA device or on the CPU::

    import flashcupy.torch as fct

    out = fct.flash_attention(q, k, v, causal=True)          # q (B, Hq, Lq, D) torch tensors
    out.sum().backward()                                       # q.grad, k.grad, v.grad (and bias.grad)

PyTorch stays an optional dependency: ``import flashcupy`` never imports torch;
this module does (and raises ImportError "flashcupy.torch needs PyTorch: pip
install torch" without it).

Data path:

- CUDA tensors go to CuPy through DLPack with no copy, and the results come back
  to torch the same way. Every kernel runs on torch's current stream of the
  tensors' device (``torch.cuda.current_stream(q.device)`` at forward time; the
  backward runs on the stream autograd gives it, which is the forward's), so the
  call orders with the surrounding torch work like any torch operator.
- CPU tensors are viewed as NumPy arrays (no copy; bfloat16 through an int16
  view, as ``ml_dtypes.bfloat16``) and take the path NumPy arrays take in
  ``flashcupy.flash_attention``: with ``backend="auto"`` that is the GPU when one
  is usable, else the CPU backend; ``backend="cpu"`` forces the CPU. Results
  come back as CPU tensors.

The CuPy side allocates from CuPy's memory pool, not torch's caching allocator.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("flashcupy.torch needs PyTorch: pip install torch") from exc

from . import api as _api
from . import rng as _rng
from .problem import check_dropout as _check_dropout

__all__ = ["flash_attention", "flash_attention_varlen"]

#: Positions of the tensors autograd tracks in ``_FlashAttention.apply``.
_GRAD_INPUTS = ("q", "k", "v", "bias")


# --------------------------------------------------------------------------- conversion


def _bf16_numpy():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _to_array(x: Any) -> Any:
    """A torch tensor as the array flashcupy computes on, sharing its memory: CuPy for CUDA
    tensors (DLPack), NumPy for CPU tensors (bfloat16 as ``ml_dtypes.bfloat16``). Anything
    else passes through unchanged."""
    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach()  # DLPack and .numpy() refuse tensors that require grad
    if x.device.type == "cuda":
        import cupy

        return cupy.from_dlpack(x)
    if x.device.type != "cpu":
        raise TypeError(f"flashcupy.torch: expected tensors on a CUDA device or the CPU, received one on {x.device}")
    if x.is_conj() or x.is_neg():
        x = x.resolve_conj().resolve_neg()
    if x.dtype == torch.bfloat16:
        # NumPy has no bfloat16: view the bits as int16, then as ml_dtypes.bfloat16 (no copy).
        return x.view(torch.int16).numpy().view(_bf16_numpy())
    return x.numpy()


def _to_tensor(a: Any) -> torch.Tensor:
    """A NumPy or CuPy result as a torch tensor sharing its memory."""
    if isinstance(a, np.ndarray):
        if a.dtype == _bf16_numpy():
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    return torch.from_dlpack(a)


def _arrays(options: dict[str, Any]) -> dict[str, Any]:
    return {name: _to_array(value) for name, value in options.items()}


# --------------------------------------------------------------------------- streams


def _external_stream(device: torch.device):
    """torch's current stream on ``device`` as a CuPy stream (not owned by CuPy)."""
    import cupy

    stream = torch.cuda.current_stream(device)
    if hasattr(cupy.cuda.Stream, "from_external") and hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.Stream.from_external(stream)
    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; older CuPy has only it
        warnings.filterwarnings("ignore", message="ExternalStream is deprecated", category=DeprecationWarning)
        return cupy.cuda.ExternalStream(stream.cuda_stream, device.index)


@contextlib.contextmanager
def _on_device(device: torch.device):
    """For a CUDA device: make it CuPy's current device and torch's current stream there
    CuPy's current stream. Nothing for the CPU (CuPy is not imported)."""
    if device.type != "cuda":
        yield
        return
    import cupy

    with cupy.cuda.Device(device.index), _external_stream(device):
        yield


# --------------------------------------------------------------------------- autograd


def _check_tensors(q: Any, k: Any, v: Any, bias: Any) -> None:
    """q, k, v torch tensors; k, v and a tensor bias on q's device (their grads go there)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, received {type(x).__name__}")
    named = [("q", q), ("k", k), ("v", v)] + ([("bias", bias)] if isinstance(bias, torch.Tensor) else [])
    for name, x in named[1:]:
        if x.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} like q, received one on {x.device}")


class _FlashAttention(torch.autograd.Function):
    """out, lse = flashcupy forward; grads of q, k, v, bias and sinks from flashcupy's backward."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, options, deterministic):
        with _on_device(q.device):
            out, lse = _api.flash_attention_forward(
                _to_array(q), _to_array(k), _to_array(v), bias=_to_array(bias), sinks=_to_array(sinks),
                **_arrays(options)
            )
            out, lse = _to_tensor(out), _to_tensor(lse)
        tensor_bias = bias if isinstance(bias, torch.Tensor) else None
        tensor_sinks = sinks if isinstance(sinks, torch.Tensor) else None
        ctx.save_for_backward(q, k, v, tensor_bias, tensor_sinks, out, lse)
        ctx.bias = None if tensor_bias is not None else bias
        ctx.sinks = None if tensor_sinks is not None else sinks
        ctx.options = options
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, tensor_bias, tensor_sinks, out, lse = ctx.saved_tensors
        bias = tensor_bias if tensor_bias is not None else ctx.bias
        sinks = tensor_sinks if tensor_sinks is not None else ctx.sinks
        bias_grad = bool(ctx.needs_input_grad[3])
        with _on_device(q.device):
            grads = _api.flash_attention_backward(
                _to_array(dout), _to_array(q), _to_array(k), _to_array(v), _to_array(out), _to_array(lse),
                bias=_to_array(bias), bias_grad=bias_grad, sinks=_to_array(sinks), deterministic=ctx.deterministic,
                **_arrays(ctx.options),
            )
            grads = [_to_tensor(g) for g in grads]
        # (dq, dk, dv), then dbias with bias_grad, then dsinks with sinks (float64 on the arrays' device)
        dbias = grads[3] if bias_grad else None
        dsinks = grads[-1] if sinks is not None else None
        if dsinks is not None and tensor_sinks is not None:
            dsinks = dsinks.to(dtype=tensor_sinks.dtype, device=tensor_sinks.device)
        grads = [g if needed else None for g, needed in zip((*grads[:3], dbias, dsinks), ctx.needs_input_grad)]
        return (*grads, None, None)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: Any = None, sinks: Any = None,
                    deterministic: bool | None = None, **options: Any):
    """Exact attention of torch tensors, differentiable with respect to q, k, v, bias and sinks.

    Takes the keyword options of :func:`flashcupy.flash_attention` with the same
    meaning (see its docstring and docs/semantics.md): ``causal`` (True /
    'bottom_right' or 'top_left', which is PyTorch's ``is_causal``), ``scale``,
    ``window``, ``mask`` (bool, True = attend, as SDPA's bool ``attn_mask``),
    ``bias`` (float, added to the scores, as SDPA's float ``attn_mask``),
    ``alibi_slopes``, ``softcap``, ``q_lengths``, ``kv_lengths``, ``block_mask``,
    ``block_size``, ``dropout_p``, ``seed``, ``dropout_offset``, ``cu_seqlens_q``,
    ``cu_seqlens_k``, ``return_lse``, ``allow_tf32`` and ``backend``.

    Args:
        q: (..., Hq, Lq, D); k: (..., Hk, Lk, D); v: (..., Hk, Lk, Dv), torch
            tensors of one dtype (float16, bfloat16, float32, float64) on one
            device, any strides. Hq % Hk == 0 (GQA/MQA), like SDPA's
            ``enable_gqa=True``.
        bias: broadcastable to (..., Hq, Lq, Lk). When it is a tensor that
            requires grad, ``bias.grad`` gets dbias in the bias's own shape.
        sinks: attention sinks, logits broadcastable to (..., Hq) joining each
            row's softmax denominator (see :func:`flashcupy.flash_attention`). When
            it is a tensor that requires grad, ``sinks.grad`` gets their gradient
            in their own shape, dtype and device.
        deterministic: bitwise-repeatable gradients; None (default) follows
            ``torch.are_deterministic_algorithms_enabled()``.
        **options: as above. Array options (mask, lengths, slopes, block_mask,
            cu_seqlens) may be torch tensors, NumPy or CuPy arrays; they get no
            gradient. With ``dropout_p > 0`` and no ``seed``, one is drawn at the
            forward (``flashcupy.rng.new_seed``) and reused by the backward.

    Returns:
        out (..., Hq, Lq, Dv), a tensor of q's dtype on q's device; with
        ``return_lse=True``, ``(out, lse)`` where lse (..., Hq, Lq) is float32
        (float64 for float64 inputs) and carries no gradient.

    Double backward is not supported. bfloat16 CPU tensors are supported
    (through ``ml_dtypes.bfloat16``, no change of dtype).
    """
    _check_tensors(q, k, v, bias)
    return_lse = options.pop("return_lse", False)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, received {return_lse!r}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    elif not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool or None, received {deterministic!r}")
    p, seed, _ = _check_dropout(options.get("dropout_p", 0.0), options.get("seed"), options.get("dropout_offset", 0))
    if p > 0 and seed is None:
        options["seed"] = _rng.new_seed()  # drawn once here, reused by the backward
    out, lse = _FlashAttention.apply(q, k, v, bias, sinks, options, deterministic)
    return (out, lse) if return_lse else out


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Any, cu_seqlens_k: Any,
                           **options: Any):
    """Attention over packed variable-length sequences (see :func:`flashcupy.flash_attention_varlen`),
    differentiable like :func:`flash_attention`: q (Hq, total_q, D), k (Hk, total_k, D),
    v (Hk, total_k, Dv), cu_seqlens int32 of length batch + 1."""
    return flash_attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **options)
