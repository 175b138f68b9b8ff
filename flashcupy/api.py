"""The public functions: normalise arguments, pick a backend, convert arrays back.

Shapes follow NumPy/PyTorch SDPA: q (..., Hq, Lq, D), k (..., Hk, Lk, D),
v (..., Hk, Lk, Dv), out (..., Hq, Lq, Dv), lse (..., Hq, Lq). See
``flash_attention`` for every option; the other functions take the same
keyword options.
"""

from __future__ import annotations

import contextlib
import dataclasses

from typing import Any, Callable

from . import calls, cpu, cuda, interop, rng, sinks
from .cuda.spec import NoKernelError
from .problem import (
    BACKENDS, OPTION_DEFAULTS, Problem, check_device_backward_arrays, check_dropout, check_host_backward_arrays,
    make_device_problem, make_host_problem,
)


def _backend(name: Any, q: Any = None) -> str:
    """The backend that will run: 'cpu' or 'cuda'.

    'auto' picks CUDA for GPU arrays, and for host arrays when a GPU is usable.
    """
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, received {name!r}")
    if name == "cpu":
        return "cpu"
    if name == "cuda" and not interop.gpu_usable():
        raise RuntimeError(
            "backend='cuda': no usable CUDA GPU (CuPy must be installed, e.g. pip install "
            "'flashcupy[cuda12]', and see a device); use backend='cpu' or 'auto'"
        )
    if name == "cuda" or interop.is_gpu_array(q) or interop.gpu_usable():
        return "cuda"
    return "cpu"


def _prepare(q: Any, k: Any, v: Any, options: dict[str, Any], backend: str | None = None):
    """Validate a call once; returns the problem (host or device arrays), the converter
    back to the caller's kind, and the backend that runs it."""
    backend = backend or _backend(options.get("backend", OPTION_DEFAULTS["backend"]), q)
    restore = interop.restorer(q)
    if backend == "cpu":
        return make_host_problem(q, k, v, options), restore, backend
    return make_device_problem(q, k, v, options), restore, backend


def _compute(q: Any, k: Any, v: Any, options: dict[str, Any], run: Callable, prepared: tuple | None = None):
    """(pb, restore, backend, run(pb, backend)) on the backend _prepare picks (or on an
    already ``prepared`` (pb, restore, backend)); with backend='auto', on the CPU instead
    when no CUDA kernel fits this GPU (huge head dims in float64 on small-shared-memory GPUs)."""
    pb, restore, backend = prepared or _prepare(q, k, v, options)
    try:
        return pb, restore, backend, run(pb, backend)
    except NoKernelError:
        if options.get("backend", OPTION_DEFAULTS["backend"]) != "auto":
            raise
    pb, restore, backend = _prepare(q, k, v, options, "cpu")
    return pb, restore, backend, run(pb, backend)


def _squeeze(pb: Problem, x):
    """Drop the head axis added for 2-D inputs."""
    return x[0] if pb.squeeze_head else x


def _run_forward(pb: Problem, backend: str):
    """(out, lse) in the problem's internal layout, from the backend that holds its arrays,
    with the sinks folded in (by the CUDA kernels' epilogue; after the CPU backend, by
    flashcupy/sinks.py)."""
    if backend == "cuda":
        return cuda.forward(pb)
    out, lse = cpu.forward(pb)
    if pb.sinks is not None:
        lse = sinks.apply(pb, out, lse, interop.array_module(out))
    return out, lse


def _forward(q: Any, k: Any, v: Any, options: dict[str, Any], prepared: tuple | None = None,
             keys: tuple | None = None):
    """(pb, out, lse) with out and lse in the caller's kind and layout; ``prepared`` as in
    :func:`_compute` (a problem validated before the call); the forward's plans kept for
    ``keys`` (:mod:`flashcupy.calls`) when it ran on the GPU."""
    pb, restore, backend, (out, lse) = _compute(q, k, v, options, _run_forward, prepared)
    _learn_forward(keys, pb, backend)
    return pb, restore(_squeeze(pb, out)), restore(_squeeze(pb, lse))


def _learn_forward(keys: tuple | None, pb: Problem, backend: str) -> None:
    """Keep the plans of a forward that the full path ran (on the GPU) for CuPy calls of ``keys``;
    not while CuPy's stream is being captured into a CUDA graph, where planning may run the
    call's copies (or the backward) again outside its temporaries (a later call plans)."""
    if backend == "cuda" and not cuda.capturing():
        calls.CUPY.learn(keys, pb.q.device.id, lambda: pb)


def _backward_planned(dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, options: dict[str, Any],
                      deterministic: bool) -> tuple[Any, tuple | None, tuple | None]:
    """(the planned entry of a CuPy call's options, the backward's key in it, (dq, dk, dv)
    where that backward is planned, else None)."""
    _, planned = calls.CUPY.find(q, k, v, options)
    if planned is None:
        return None, None, None
    key = planned.backward_key(dout, out, lse, deterministic)
    return planned, key, planned.backward(key, dout, q, k, v, out, lse)


def _learn_backward(planned: Any, key: tuple | None, pb: Problem, backend: str, dout: Any, out: Any,
                    lse: Any, deterministic: bool) -> None:
    """Keep the plan of a backward (no dbias) that the full path ran on the GPU in ``planned``
    (not while a CUDA graph is captured: see :func:`_learn_forward`)."""
    if planned is not None and backend == "cuda" and not cuda.capturing():
        planned.learn_backward(key, lambda: cuda.backward_plan(pb, *check_device_backward_arrays(pb, dout, out, lse),
                                                                deterministic))


def _run_backward(pb: Problem, backend: str, dout: Any, out: Any, lse: Any, bias_grad: bool, deterministic: bool):
    """(dq, dk, dv, dbias, dsinks) in the problem's internal layout from the backend that holds
    its arrays; dbias None unless ``bias_grad``, dsinks (the sinks' shape) None without sinks.

    dout, out, lse are validated here (as the caller's arrays, in the caller's layout).
    """
    if backend == "cuda":
        dout, out, lse = check_device_backward_arrays(pb, dout, out, lse)
        *grads, delta = cuda.backward(pb, dout, out, lse, bias_grad, deterministic)
    else:
        dout, out, lse = check_host_backward_arrays(pb, dout, out, lse)
        grads, delta = cpu.backward(pb, dout, out, lse, bias_grad), None
    dsinks = None
    if pb.sinks is not None:
        with cuda.temporaries() if backend == "cuda" else contextlib.nullcontext():
            dsinks = sinks.grad(pb, dout, out, lse, interop.array_module(out), delta)
        if backend == "cuda":
            dsinks = dsinks.copy()  # a result: out of a captured graph's own memory
    return (*grads, dsinks)


def _with_seed(options: dict[str, Any], required: bool = False) -> dict[str, Any]:
    """Options with a fresh seed drawn when dropout is on and neither a seed nor an
    rng_state was given.

    With ``required``, a missing seed under dropout is an error instead.
    """
    p, seed, _ = check_dropout(
        options.get("dropout_p", 0.0), options.get("seed"), options.get("dropout_offset", 0)
    )
    if p > 0 and seed is None and options.get("rng_state") is None:
        if required:
            raise ValueError("seed: expected an int (or an rng_state) when dropout_p > 0 (the backward needs it), "
                             "received None")
        return {**options, "seed": rng.new_seed()}
    return options


def flash_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool | str = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    mask: Any = None,
    bias: Any = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    softcap: float | None = None,
    q_lengths: Any = None,
    kv_lengths: Any = None,
    block_mask: Any = None,
    block_size: int | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    dropout_offset: int = 0,
    rng_state: Any = None,
    cu_seqlens_q: Any = None,
    cu_seqlens_k: Any = None,
    return_lse: bool = False,
    allow_tf32: bool = False,
    backend: str = "auto",
):
    """Exact attention softmax(scale * q k^T + bias, masked) v, computed tile by tile.

    Args:
        q: (..., Hq, Lq, D) queries; a 2-D (Lq, D) array is one head.
        k: (..., Hk, Lk, D) keys, batch dims equal to q's, Hq % Hk == 0 (GQA/MQA:
            query head h uses key head h // (Hq // Hk)).
        v: (..., Hk, Lk, Dv) values. q, k, v share one dtype: float16, bfloat16
            (``ml_dtypes.bfloat16``), float32 or float64. Any strides.
        causal: True or 'bottom_right' keeps j <= i + Lk - Lq (FlashAttention >= 2.1);
            'top_left' keeps j <= i (PyTorch ``is_causal``); with lengths, Lq and Lk
            are the per-batch lengths.
        scale: multiplies q k^T; default 1 / sqrt(D).
        window: (left, right), ints >= 0 or None for unbounded: keeps
            i + Lk - Lq - left <= j <= i + Lk - Lq + right.
        mask: bool, broadcastable to (..., Hq, Lq, Lk); True = attend.
        bias: float, broadcastable to (..., Hq, Lq, Lk); added to the scores.
        alibi_slopes: broadcastable to (..., Hq); adds -slope * |i + Lk - Lq - j|.
            Host slopes must be finite; slopes on the GPU of a GPU call stay there, their
            values not checked (no copy back, no wait for the GPU; NaN or inf give NaN
            rows, and a fallback to the CPU checks them).
        sinks: attention sinks, real logits broadcastable to (..., Hq): each row of
            head (..., h) gets exp(sink) added to its softmax denominator, lse =
            log(exp(sink) + sum_j exp(s_ij)), and the sink takes no value (a row
            whose scores are all masked gives out 0 and lse = sink; -inf is no
            sink). GPU sinks stay on the GPU: their values are not checked.
        softcap: s -> softcap * tanh(s / softcap), before bias and masks.
        q_lengths, kv_lengths: ints broadcastable to the batch dims (...): rows
            >= q_len give 0 (lse -inf), keys >= kv_len are masked.
        block_mask, block_size: bool broadcastable to (..., Hq, ceil(Lq/bs),
            ceil(Lk/bs)); score (i, j) kept only if block_mask[i//bs, j//bs].
            Tiles it rules out are skipped.
        dropout_p, seed, dropout_offset: dropout on the normalised probabilities
            with Philox4x32-10 bits (see ``dropout_mask``); seed None draws one.
        rng_state: instead of seed and dropout_offset, a contiguous (2,) int64 or
            uint64 array (seed, offset) read when the computation runs: on the GPU
            the kernels read it from device memory, so a captured CUDA graph replays
            with the values the caller has written since (offset mod 2**32).
            ``flash_attention_backward`` reads it when it runs (advance it after the
            backward); ``flash_attention_vjp`` keeps a copy from its forward.
        cu_seqlens_q, cu_seqlens_k: packed sequences (see ``flash_attention_varlen``).
        return_lse: also return the natural-log log-sum-exp, (..., Hq, Lq),
            float32 (float64 for float64 inputs).
        allow_tf32: let float32 use TF32 tensor cores on the GPU (less accurate).
        backend: 'auto', 'cpu' or 'cuda'.

    Returns:
        out (..., Hq, Lq, Dv), q's dtype and array kind; ``(out, lse)`` with
        ``return_lse``. A row whose scores are all masked gives out 0 and lse -inf
        (the sink's logit with sinks), never NaN.
    """
    options = dict(locals())
    del options["q"], options["k"], options["v"]
    keys, planned = calls.CUPY.find(q, k, v, options)
    if planned is not None:
        out, lse = planned.forward(q, k, v)
        return (out, lse) if return_lse else out
    pb, out, lse = _forward(q, k, v, _with_seed(options), keys=keys)
    return (out, lse) if pb.return_lse else out


def flash_attention_forward(q: Any, k: Any, v: Any, **options: Any):
    """Forward pass returning ``(out, lse)`` for a later ``flash_attention_backward``.

    Takes the keyword options of ``flash_attention``; ``seed`` (or ``rng_state``) is
    required when ``dropout_p > 0`` so that the backward can regenerate the mask.
    """
    keys, planned = calls.CUPY.find(q, k, v, options)
    if planned is not None:
        return planned.forward(q, k, v)
    _, out, lse = _forward(q, k, v, _with_seed(options, required=True), keys=keys)
    return out, lse


def flash_attention_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    *,
    bias_grad: bool = False,
    deterministic: bool = False,
    **options: Any,
):
    """Gradients of ``flash_attention`` with respect to q, k, v (and bias).

    The options must be the ones the forward ran with (the same causal, scale, masks,
    bias, lengths, dropout_p, seed and offset): the backward recomputes the
    probabilities from them and the saved lse, and cannot tell that they changed, so
    different options give wrong gradients without an error. ``flash_attention_vjp``
    keeps the forward's options (and seed) for its ``vjp`` and cannot get this wrong.

    Args:
        dout: (..., Hq, Lq, Dv), the gradient of ``out``, q's dtype.
        q, k, v: the forward's inputs.
        out: the forward's out, (..., Hq, Lq, Dv) in q's dtype.
        lse: the forward's lse, (..., Hq, Lq), float32 (float64 for float64 inputs);
            another shape or dtype is an error.
        bias_grad: also return dbias, reduced to the bias's own shape. With ``sinks``
            the sinks' gradient is always returned (last), in their own shape, float64.
        deterministic: bitwise-repeatable gradients (the CPU backend always is).
        **options: the forward's keyword options, the same seed included.

    Returns:
        ``(dq, dk, dv)`` with the shapes and dtype of q, k, v, plus ``dbias``
        with ``bias_grad=True``, plus ``dsinks`` when sinks were given. Fully masked
        rows contribute zero, never NaN.
    """
    for name, flag in (("bias_grad", bias_grad), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, received {flag!r}")
    if bias_grad and options.get("bias") is None:
        raise ValueError("bias_grad: expected a bias to differentiate, received bias=None")
    planned, key, grads = (None, None, None) if bias_grad else _backward_planned(dout, q, k, v, out, lse, options,
                                                                                  deterministic)
    if grads is not None:
        return grads
    pb, restore, backend, (dq, dk, dv, dbias, dsinks) = _compute(
        q, k, v, options, lambda pb, backend: _run_backward(pb, backend, dout, out, lse, bias_grad, deterministic)
    )
    _learn_backward(planned, key, pb, backend, dout, out, lse, deterministic)
    return _gradients(pb, restore, dq, dk, dv, dbias if bias_grad else None, dsinks)


def _gradients(pb: Problem, restore: Callable, dq: Any, dk: Any, dv: Any, dbias: Any, dsinks: Any) -> tuple:
    """(dq, dk, dv), then dbias and dsinks where given, in the caller's kind and layout."""
    grads = tuple(restore(_squeeze(pb, g)) for g in (dq, dk, dv))
    return grads + tuple(restore(g) for g in (dbias, dsinks) if g is not None)


def flash_attention_vjp(q: Any, k: Any, v: Any, **options: Any):
    """Forward pass and its vector-Jacobian product: ``out, vjp = ...; vjp(dout)``.

    ``vjp(dout)`` returns ``(dq, dk, dv)``, plus ``dbias`` when a bias was given, plus
    ``dsinks`` when sinks were given.
    With dropout and no seed, a seed is drawn here and kept for the backward; an
    ``rng_state`` is copied after the forward and the copy read by ``vjp``.
    ``return_lse=True`` makes the first result ``(out, lse)``.
    """
    keys, planned = calls.CUPY.find(q, k, v, options)
    if isinstance(planned, calls.Planned):  # not a LengthPlanned: the full path plans the backward
        return _planned_vjp(planned, q, k, v, options)
    options = _with_seed(options)
    pb, restore, backend, (out, lse) = _compute(q, k, v, options, _run_forward)
    _learn_forward(keys, pb, backend)
    if pb.rng_state is not None:
        # the forward's (seed, offset) for the vjp, whatever the caller writes into the array
        # after: on the GPU a device copy, queued (and captured in a CUDA graph) after the kernels
        pb = dataclasses.replace(pb, rng_state=pb.rng_state.copy())

    def vjp(dout: Any):
        """(dq, dk, dv[, dbias][, dsinks]) for the gradient ``dout`` of out, (..., Hq, Lq, Dv)."""
        out_c, lse_c = _squeeze(pb, out), _squeeze(pb, lse)
        planned, bkey, grads = _backward_planned(dout, q, k, v, out_c, lse_c, options, False)
        if grads is not None:
            return grads
        _, _, _, (dq, dk, dv, dbias, dsinks) = _compute(
            q, k, v, options,
            lambda pbb, be: _run_backward(pbb, be, dout, out_c, lse_c, pb.bias is not None, False),
            prepared=(pb, restore, backend),  # the forward's validated problem: no second pass or copy
        )
        if pb.bias is None:
            _learn_backward(planned, bkey, pb, backend, dout, out_c, lse_c, False)
        return _gradients(pb, restore, dq, dk, dv, dbias, dsinks)

    result = (restore(_squeeze(pb, out)), restore(_squeeze(pb, lse))) if pb.return_lse else restore(_squeeze(pb, out))
    return result, vjp


def _planned_vjp(planned: calls.Planned, q: Any, k: Any, v: Any, options: dict[str, Any]):
    """:func:`flash_attention_vjp` of a planned CuPy call (no bias, sinks or dropout)."""
    out, lse = planned.forward(q, k, v)

    def vjp(dout: Any):
        """(dq, dk, dv) for the gradient ``dout`` of out, (..., Hq, Lq, Dv)."""
        key = planned.backward_key(dout, out, lse, False)
        here = planned.device == planned.kind.current_device()  # else the full path, on q's device
        grads = planned.backward(key, dout, q, k, v, out, lse) if here else None
        return grads if grads is not None else flash_attention_backward(dout, q, k, v, out, lse, **options)

    return ((out, lse) if options.get("return_lse", False) else out), vjp


def flash_attention_varlen(q: Any, k: Any, v: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, **options: Any):
    """Attention over packed variable-length sequences.

    q (Hq, total_q, D), k (Hk, total_k, D), v (Hk, total_k, Dv); sequence b holds
    rows cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and keys cu_seqlens_k[b]:cu_seqlens_k[b+1].
    cu_seqlens are non-decreasing int32 vectors of length batch + 1 starting at 0
    and ending at the packed length. Positions (causal, window, ALiBi, dropout)
    are inside each sequence, and mask, bias and block_mask are indexed in the
    padded frame (batch, Hq, max_len_q, max_len_k), so this equals the padded
    call with ``q_lengths``/``kv_lengths``. Returns out (Hq, total_q, Dv), and
    lse (Hq, total_q) with ``return_lse``. Other options as ``flash_attention``.
    """
    return flash_attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **options)


def dropout_mask(shape: tuple[int, ...], p: float, seed: int, offset: int = 0):
    """The exact keep mask (bool, True = kept) the kernels use for ``shape`` = (..., Hq, Lq, Lk).

    Element (bh, i, j), bh the flat index over the leading dims, comes from
    Philox4x32-10 with key (seed mod 2^32, seed >> 32) and counter
    (j >> 3, i, bh, offset): kept when 16-bit half j & 7 of the output (low half
    of word 0 first) is >= round(p * 2^16). docs/semantics.md#dropout-bits.
    """
    return rng.dropout_mask(shape, p, seed, offset)
