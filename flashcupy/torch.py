"""PyTorch operators for flashcupy: ``flashcupy.torch.flash_attention(q, k, v, **options)``.

flashcupy's forward and backward as torch operators (``torch.library.custom_op``:
``flashcupy::attention`` and ``flashcupy::attention_backward``, with fake functions
for tracing and the backward registered as the forward's autograd), for torch
tensors on a CUDA device or on the CPU; ``torch.compile(fullgraph=True)`` traces
a model that calls them without a graph break. Eager calls run the same
implementations through an ``autograd.Function`` instead of the dispatcher, whose
Python side costs more than a small problem's kernels::

    import flashcupy.torch as fct

    out = fct.flash_attention(q, k, v, causal=True)          # q (B, Hq, Lq, D) torch tensors
    out.sum().backward()                                       # q.grad, k.grad, v.grad (and bias.grad)

PyTorch stays an optional dependency: ``import flashcupy`` never imports torch;
this module does (and raises ImportError "flashcupy.torch needs PyTorch: pip
install torch" without it).

Data path:

- CUDA tensors are viewed as CuPy arrays with no copy. Every array the call
  allocates (outputs and temporaries) comes from torch's caching allocator, and
  the results come back as torch tensors over that memory, so CuPy's memory pool
  is not used on this path. Every kernel runs on torch's current stream of the
  tensors' device (at forward time; the backward runs on the stream autograd
  gives it, which is the forward's), so the call orders with the surrounding
  torch work like any torch operator.
- A CUDA call laid out like an earlier one, without bias, sinks, other array options or
  dropout, runs the plan kept after that call (flashcupy.calls): its results from torch's
  allocator and its launches, with no validation and no CuPy view.
- CPU tensors are viewed as NumPy arrays (no copy; bfloat16 through an int16
  view, as ``ml_dtypes.bfloat16``) and take the path NumPy arrays take in
  ``flashcupy.flash_attention``: with ``backend="auto"`` that is the GPU when one
  is usable, else the CPU backend; ``backend="cpu"`` forces the CPU. Results
  come back as CPU tensors.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("flashcupy.torch needs PyTorch: pip install torch") from exc

from . import api as _api
from . import calls as _calls
from . import cuda as _cuda
from . import rng as _rng
from .problem import ARRAY_OPTIONS as _ARRAY_OPTIONS
from .problem import INT32_LIST_OPTIONS as _INT32_LISTS
from .problem import check_causal as _check_causal
from .problem import check_device_backward_arrays as _check_device_backward_arrays
from .problem import check_window as _check_window
from .problem import make_device_problem as _make_device_problem
from .problem.options import _check_dropout  # uncached: torch.compile traces it
from .problem.options import _scale as _check_scale
from .problem.options import _softcap as _check_softcap
from .problem.options import check_backend as _check_backend
from .problem.options import with_defaults as _with_defaults
from .problem.validate import is_int as _is_int

__all__ = ["flash_attention", "flash_attention_varlen"]


# --------------------------------------------------------------------------- conversion


def _bf16_numpy():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


#: NumPy element types of the torch dtypes a CUDA tensor is viewed as directly (_cuda_view).
_VIEW_DTYPES = {torch.float16: np.dtype(np.float16), torch.float32: np.dtype(np.float32),
                torch.float64: np.dtype(np.float64), torch.bool: np.dtype(np.bool_), torch.int32: np.dtype(np.int32),
                torch.int64: np.dtype(np.int64), torch.uint8: np.dtype(np.uint8)}


#: _VIEW_DTYPES the other way, for results going back to torch.
_TORCH_DTYPES = {np_dtype: torch_dtype for torch_dtype, np_dtype in _VIEW_DTYPES.items()}


def _torch_dtype(dtype: np.dtype) -> torch.dtype | None:
    """The torch dtype of a NumPy element type _cuda_view takes (bfloat16 as ml_dtypes'), else None."""
    found = _TORCH_DTYPES.get(dtype)
    if found is None and dtype == _bf16_numpy():
        return torch.bfloat16
    return found


def _cuda_view(x: torch.Tensor) -> Any:
    """A CuPy view of a CUDA tensor's memory, no copy, built from its pointer, shape and
    strides, or None where that does not apply (no elements, an element type not listed).
    Not DLPack: torch's ``__dlpack__`` looks up the current stream and device in Python, tens
    of microseconds a tensor, to order the exchange across streams, and flashcupy runs on
    torch's current stream already (_on_device). The view keeps the tensor alive."""
    import cupy

    dtype = _VIEW_DTYPES.get(x.dtype) or (_bf16_numpy() if x.dtype == torch.bfloat16 else None)
    if dtype is None or not x.numel():
        return None
    shape, strides, itemsize = tuple(x.shape), x.stride(), dtype.itemsize
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))  # elements from the first to the last
    memory = cupy.cuda.UnownedMemory(x.data_ptr(), extent * itemsize, x, x.get_device())
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0), tuple(s * itemsize for s in strides))


def _to_array(x: Any) -> Any:
    """A torch tensor as the array flashcupy computes on, sharing its memory: CuPy for CUDA
    tensors (a direct view, else DLPack), NumPy for CPU tensors (bfloat16 as
    ``ml_dtypes.bfloat16``). Anything else passes through unchanged."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.is_cuda:
        if x.is_conj() or x.is_neg():
            x = x.resolve_conj().resolve_neg()
        view = _cuda_view(x)
        if view is not None:
            return view
        import cupy

        return cupy.from_dlpack(x.detach())  # DLPack refuses tensors that require grad
    x = x.detach()  # .numpy() refuses tensors that require grad
    if x.device.type != "cpu":
        raise TypeError(f"flashcupy.torch: expected tensors on a CUDA device or the CPU, received one on {x.device}")
    if x.is_conj() or x.is_neg():
        x = x.resolve_conj().resolve_neg()
    if x.dtype == torch.bfloat16:
        # NumPy has no bfloat16: view the bits as int16, then as ml_dtypes.bfloat16 (no copy).
        return x.view(torch.int16).numpy().view(_bf16_numpy())
    return x.numpy()


def _to_tensor(a: Any, allocations: weakref.WeakValueDictionary | None = None) -> torch.Tensor:
    """A NumPy or CuPy result as a torch tensor sharing its memory: a CuPy array that starts
    an allocation of ``allocations`` (_TorchMemory's, by address) as a view of that torch
    tensor, any other through DLPack."""
    if isinstance(a, np.ndarray):
        if a.dtype == _bf16_numpy():
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    block = allocations.get(a.data.ptr) if allocations and a.size else None
    dtype = _torch_dtype(a.dtype) if block is not None else None
    if dtype is None or any(s % a.itemsize or s < 0 for s in a.strides):
        return torch.from_dlpack(a)
    return block.view(dtype).as_strided(a.shape, tuple(s // a.itemsize for s in a.strides))


# --------------------------------------------------------------------------- streams


#: torch's current stream per (device index, raw stream): a CuPy stream object over the same
#: CUDA stream, built once (building one each call cost a call's microseconds).
_CUPY_STREAMS: dict[tuple[int, int], Any] = {}


def _current_raw_stream(index: int) -> int:
    """The CUDA stream handle of torch's current stream on device ``index``."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # no Stream object: the public call builds one
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


def _external_stream(device: torch.device) -> Any:
    """torch's current stream on ``device`` as a CuPy stream (not owned by CuPy)."""
    key = (device.index, _current_raw_stream(device.index))
    found = _CUPY_STREAMS.get(key)
    if found is None:
        import cupy

        current = torch.cuda.current_stream(device)
        if hasattr(cupy.cuda.Stream, "from_external") and hasattr(current, "__cuda_stream__"):
            stream = cupy.cuda.Stream.from_external(current)
        else:
            with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; older CuPy has only it
                warnings.filterwarnings("ignore", message="ExternalStream is deprecated", category=DeprecationWarning)
                stream = cupy.cuda.ExternalStream(key[1], device.index)
        found = _CUPY_STREAMS[key] = stream
    return found


class _TorchMemory:
    """CuPy's allocator for one call: each allocation a torch uint8 tensor from torch's caching
    allocator (on torch's current stream), found by address in ``allocations`` while alive so
    results can go back to torch as views of it (_to_tensor). The CuPy memory holds the tensor
    alive; ``allocations`` does not (weakly), so what the call frees goes back to torch's
    allocator at once."""

    #: Safe while a CUDA graph is captured: torch gives the graph a private pool of its own
    #: (flashcupy.cuda.temporaries keeps this allocator then).
    graph_safe = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.allocations: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()

    def __call__(self, nbytes: int) -> Any:
        import cupy

        block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        address = block.data_ptr()
        self.allocations[address] = block
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(address, nbytes, block, self.device.index), 0)


@contextlib.contextmanager
def _on_device(device: torch.device):
    """For a CUDA device: make it CuPy's current device, torch's current stream there CuPy's
    current stream, and torch's caching allocator CuPy's; yields the _TorchMemory's
    allocations (by address). Nothing for the CPU (CuPy is not imported): yields None."""
    if device.type != "cuda":
        yield None
        return
    import cupy

    stream = _external_stream(device)
    memory = _TorchMemory(device)
    # A Device per call: its context keeps its stack on the object, not per thread.
    with cupy.cuda.Device(device.index), stream, cupy.cuda.using_allocator(memory):
        yield memory.allocations


# --------------------------------------------------------------------------- planned calls


class _TorchKind(_calls.Kind):
    """CUDA torch tensors (flashcupy.calls): torch's caching allocator, current device and
    stream; the results are torch tensors."""

    def __init__(self) -> None:
        self._devices: dict[int, torch.device] = {}

    def layout(self, x: Any) -> tuple | None:
        if type(x) is not torch.Tensor and type(x) is not torch.nn.Parameter:  # not subclasses (fake, distributed)
            return None
        device = x.get_device()
        if device < 0 or x.dtype not in _PLANNED_DTYPES or x.is_neg():  # a negative view: resolved by a copy
            return None
        return x.shape, x.stride(), x.dtype, device, x.data_ptr() % 16 == 0

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def stream(self, device: int) -> int:
        return _current_raw_stream(device)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype, poisoned: bool, device: int) -> torch.Tensor:
        where = self._devices.get(device)
        if where is None:
            where = self._devices[device] = torch.device("cuda", device)
        if poisoned:
            return torch.full(shape, float("nan"), dtype=_torch_dtype(dtype), device=where)
        return torch.empty(shape, dtype=_torch_dtype(dtype), device=where)

    def address(self, x: torch.Tensor) -> int:
        return x.data_ptr()

    def shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return x.shape

    def strides(self, x: torch.Tensor) -> tuple[int, ...]:
        return x.stride()

    def copy(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone(memory_format=torch.contiguous_format)


#: The tensor dtypes of planned calls (the kernels' four).
_PLANNED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
#: Calls on CUDA tensors without bias, sinks or dropout, planned after their first (flashcupy.calls).
_CALLS = _calls.Calls(_TorchKind())


def _views(*tensors: torch.Tensor) -> list[Any]:
    return [_to_array(x) for x in tensors]


def _forward_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: dict[str, Any]) -> Any:
    """The validated problem on CuPy views of a forward that the full path ran on the GPU with
    flashcupy's ``options`` (for flashcupy.calls to plan, under :func:`_on_device`), or None
    where another backend ran it."""
    arrays = _views(q, k, v)
    if _api._backend(options.get("backend", "auto"), arrays[0]) != "cuda":
        return None
    return _make_device_problem(*arrays, options)


def _backward_plan(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, options: dict[str, Any], deterministic: bool) -> Any:
    """The CUDA backend's plan of the backward (no dbias) of these tensors, which the full
    path just ran with flashcupy's ``options`` (planning may run it again)."""
    with _on_device(q.device):
        pb = _forward_problem(q, k, v, options)
        if pb is None:
            return None
        return _cuda.backward_plan(pb, *_check_device_backward_arrays(pb, *_views(dout, out, lse)), deterministic)


class _PlannedAttention(torch.autograd.Function):
    """A planned call (flashcupy.calls) under autograd, returning out: its forward plan, then
    its backward plan for dout's layout (the full path the first time a layout comes, which
    plans it). lse is kept on the context, not returned: a second output would cost the
    engine a zero gradient for it at every backward."""

    @staticmethod
    def forward(ctx, q, k, v, planned):
        out, lse = planned.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out)
        ctx.lse, ctx.planned = lse, planned  # lse is no input or output: no reference cycle
        return out

    @staticmethod
    def backward(ctx, dout):
        return (*_planned_gradients(ctx, dout), None)


class _PlannedAttentionLse(torch.autograd.Function):
    """:class:`_PlannedAttention` returning (out, lse), lse without a gradient."""

    @staticmethod
    def forward(ctx, q, k, v, planned):
        out, lse = planned.forward(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)  # the caller holds lse: changed in place, the backward says so
        ctx.planned = planned
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero gradient made for lse
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return None, None, None, None
        return (*_planned_gradients(ctx, dout), None)


def _planned_gradients(ctx, dout: torch.Tensor) -> tuple:
    """(dq, dk, dv) of a planned forward's context (lse saved with the tensors, or kept on it)."""
    q, k, v, out, *saved_lse = ctx.saved_tensors
    lse, planned = saved_lse[0] if saved_lse else ctx.lse, ctx.planned
    key = planned.backward_key(dout, out, lse)
    grads = planned.backward(key, dout, q, k, v, out, lse)
    if grads is None:
        tensors, scalars, deterministic = planned.context
        grads = _backward_impl(dout, q, k, v, out, lse, tensors, scalars, False, deterministic)[:3]
        planned.learn_backward(key, lambda: _backward_plan(dout, q, k, v, out, lse, _decode(tensors, scalars),
                                                           deterministic))
    return grads


def _planned_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, deterministic: Any,
                  options: dict[str, Any]) -> tuple[tuple | None, Any]:
    """(the call's keys in _CALLS or None, its result where it is planned, else None)."""
    if torch.compiler.is_compiling() or not (deterministic is None or type(deterministic) is bool):
        return None, None
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    keys, planned = _CALLS.find(q, k, v, options, deterministic)
    if planned is None:  # q, k, v may be no tensors at all: the full path says so
        return keys, None
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if grad and isinstance(planned, _calls.LengthPlanned):  # the full path plans the backward
        return keys, None
    return_lse = options.get("return_lse", False)
    if grad:
        return keys, (_PlannedAttentionLse if return_lse else _PlannedAttention).apply(q, k, v, planned)
    out, lse = planned.forward(q, k, v)
    return keys, ((out, lse) if return_lse else out)


# --------------------------------------------------------------------------- custom ops

#: The array options an op takes as tensors: flashcupy's, each an Optional[Tensor] argument of
#: the ops in this order (tests/test_torch.py checks the schemas).
_TENSOR_OPTIONS = _ARRAY_OPTIONS
#: causal as an int in the schema.
_CAUSAL = {None: 0, "bottom_right": 1, "top_left": 2}
_CAUSAL_BACK = {0: False, 1: "bottom_right", 2: "top_left"}


def _check_tensors(q: Any, k: Any, v: Any, bias: Any) -> None:
    """q, k, v torch tensors; k, v and a tensor bias on q's device (their grads go there)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, received {type(x).__name__}")
    named = [("q", q), ("k", k), ("v", v)] + ([("bias", bias)] if isinstance(bias, torch.Tensor) else [])
    for name, x in named[1:]:
        if x.device != q.device:
            raise ValueError(f"{name}: expected a tensor on {q.device} like q, received one on {x.device}")


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    """An array option as a tensor: torch tensors as they are, CuPy arrays sharing their memory,
    NumPy arrays too where torch can view them (else a native-order contiguous copy), lists and
    numbers through NumPy; cu_seqlens lists as int32, as flashcupy takes them."""
    if isinstance(value, torch.Tensor):
        return value
    if type(value).__module__.split(".")[0] == "cupy":
        return _to_tensor(value)
    if not isinstance(value, np.ndarray):
        value = np.asarray(value)
        if name in _INT32_LISTS and value.dtype.kind in "iu" and value.size and (
                value.min() >= -2**31 and value.max() < 2**31):
            value = value.astype(np.int32)
    if not value.dtype.isnative:
        value = value.astype(value.dtype.newbyteorder("="))
    if any(s < 0 for s in value.strides) or value.dtype.kind not in "biuf" and value.dtype != _bf16_numpy():
        value = np.ascontiguousarray(value)  # torch.from_numpy refuses negative strides
    return _to_tensor(value)


def _encode(options: dict[str, Any], q: torch.Tensor, k: torch.Tensor) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the array options as tensors, the others as the ops' scalar arguments), after the checks
    an encoding needs (option names, causal, window: flashcupy's own, with its messages); the
    op checks everything again. Encoded: causal as an int, window as two ints with -1 for None,
    the 64-bit seed as two 32-bit halves."""
    o = _with_defaults(options)
    tensors = {name: None if o[name] is None else _as_tensor(name, o[name]) for name in _TENSOR_OPTIONS}
    causal = _check_causal(o["causal"])
    window = o["window"]
    if window is not None:
        _check_window(window, q.shape[-2], k.shape[-2])
    left, right = (None, None) if window is None else window
    dropout_p, seed, offset = _check_dropout(o["dropout_p"], o["seed"], o["dropout_offset"])
    if o["scale"] is not None:
        _check_scale(o["scale"], q.shape[-1])
    block_size = o["block_size"]
    if block_size is not None and not _is_int(block_size):
        raise TypeError(f"block_size: expected a positive int, received {block_size!r}")
    for name in ("allow_tf32",):
        if not isinstance(o[name], (bool, np.bool_)):
            raise TypeError(f"{name}: expected a bool, received {o[name]!r}")
    scalars = {
        "causal": _CAUSAL[causal],
        "has_window": window is not None,
        "window_left": -1 if left is None else int(left),
        "window_right": -1 if right is None else int(right),
        "scale": None if o["scale"] is None else float(o["scale"]),
        "softcap": _check_softcap(o["softcap"]),
        "block_size": None if block_size is None else int(block_size),
        "dropout_p": dropout_p,
        "seed_hi": -1 if seed is None else seed >> 32,
        "seed_lo": -1 if seed is None else seed & 0xFFFFFFFF,
        "dropout_offset": offset,
        "allow_tf32": bool(o["allow_tf32"]),
        "backend": _check_backend(o["backend"]),
    }
    return tensors, scalars


def _decode(tensors: dict[str, Any], scalars: dict[str, Any]) -> dict[str, Any]:
    """The keyword options of flashcupy's functions from an op's arguments."""
    options = {name: _to_array(t) for name, t in tensors.items() if t is not None}
    options["causal"] = _CAUSAL_BACK[scalars["causal"]]
    if scalars["has_window"]:
        options["window"] = tuple(None if x < 0 else x for x in (scalars["window_left"], scalars["window_right"]))
    for name in ("scale", "softcap", "block_size", "dropout_p", "dropout_offset", "allow_tf32", "backend"):
        if scalars[name] is not None:
            options[name] = scalars[name]
    if scalars["seed_hi"] >= 0:
        options["seed"] = scalars["seed_hi"] << 32 | scalars["seed_lo"]
    return options


@torch.library.custom_op("flashcupy::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  bias: torch.Tensor | None, alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
                  q_lengths: torch.Tensor | None, kv_lengths: torch.Tensor | None, block_mask: torch.Tensor | None,
                  cu_seqlens_q: torch.Tensor | None, cu_seqlens_k: torch.Tensor | None,
                  rng_state: torch.Tensor | None, causal: int, has_window: bool,
                  window_left: int, window_right: int, scale: float | None, softcap: float | None,
                  block_size: int | None, dropout_p: float, seed_hi: int, seed_lo: int, dropout_offset: int,
                  allow_tf32: bool, backend: str, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """flashcupy's forward as a torch operator: (out, lse); ``deterministic`` is for its backward."""
    args = locals()
    return _forward_impl(q, k, v, {name: args[name] for name in _TENSOR_OPTIONS},
                         {name: args[name] for name in _SCALARS})


def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensors: dict[str, Any],
                  scalars: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the forward op's arguments: its array options by name, its scalars by name."""
    options = _decode(tensors, scalars)
    with _on_device(q.device) as allocations:
        out, lse = _api.flash_attention_forward(_to_array(q), _to_array(k), _to_array(v), **options)
        return _to_tensor(out, allocations), _to_tensor(lse, allocations)


#: The ops' scalar arguments, in schema order.
_SCALARS = ("causal", "has_window", "window_left", "window_right", "scale", "softcap", "block_size", "dropout_p",
            "seed_hi", "seed_lo", "dropout_offset", "allow_tf32", "backend")


@_attention_op.register_fake
def _attention_fake(q, k, v, *rest):
    """out (q's shape with v's head dim, q's dtype) and lse (q's shape without the head dim,
    float32; float64 for float64 inputs), as every flashcupy forward gives them."""
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(q.shape[:-1], dtype=lse_dtype)


@torch.library.custom_op("flashcupy::attention_backward", mutates_args=())
def _attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           lse: torch.Tensor, mask: torch.Tensor | None, bias: torch.Tensor | None,
                           alibi_slopes: torch.Tensor | None, sinks: torch.Tensor | None,
                           q_lengths: torch.Tensor | None, kv_lengths: torch.Tensor | None,
                           block_mask: torch.Tensor | None, cu_seqlens_q: torch.Tensor | None,
                           cu_seqlens_k: torch.Tensor | None, rng_state: torch.Tensor | None, causal: int,
                           has_window: bool, window_left: int,
                           window_right: int, scale: float | None, softcap: float | None, block_size: int | None,
                           dropout_p: float, seed_hi: int, seed_lo: int, dropout_offset: int, allow_tf32: bool,
                           backend: str, bias_grad: bool, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                                                         torch.Tensor, torch.Tensor,
                                                                                         torch.Tensor]:
    """flashcupy's backward as a torch operator: (dq, dk, dv, dbias, dsinks); dbias and dsinks
    are empty (0 elements) where not asked for or not given. dsinks has the sinks' dtype."""
    args = locals()
    return _backward_impl(dout, q, k, v, out, lse, {name: args[name] for name in _TENSOR_OPTIONS},
                          {name: args[name] for name in _SCALARS}, bias_grad, deterministic)


def _backward_impl(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, tensors: dict[str, Any], scalars: dict[str, Any], bias_grad: bool,
                   deterministic: bool) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv, dbias, dsinks) of the backward op's arguments (see the op)."""
    sinks = tensors["sinks"]
    options = _decode(tensors, scalars)
    with _on_device(q.device) as allocations:
        grads = _api.flash_attention_backward(
            _to_array(dout), _to_array(q), _to_array(k), _to_array(v), _to_array(out), _to_array(lse),
            bias_grad=bias_grad, deterministic=deterministic, **options)
        grads = [_to_tensor(g, allocations) for g in grads]
    dbias = grads[3] if bias_grad else q.new_empty(0)
    dsinks = grads[-1].to(dtype=sinks.dtype, device=sinks.device) if sinks is not None else q.new_empty(0)
    return grads[0], grads[1], grads[2], dbias, dsinks


@_attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, mask, bias, alibi_slopes, sinks, *rest):
    """Gradients as the real op returns them: new contiguous tensors in q's, k's, v's (the
    bias's, the sinks') shapes and dtypes, whatever the inputs' strides."""
    bias_grad = rest[-2]
    dbias = bias.new_empty(bias.shape) if bias_grad and bias is not None else q.new_empty(0)
    dsinks = sinks.new_empty(sinks.shape) if sinks is not None else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias, dsinks


def _save(ctx, q, k, v, out, lse, tensors: dict[str, Any], scalars: dict[str, Any], deterministic: bool) -> None:
    """What a forward keeps for its backward: the tensors, the scalar options, the flag."""
    ctx.save_for_backward(q, k, v, out, lse, *tensors.values())
    ctx.scalars = scalars
    ctx.deterministic = deterministic
    ctx.mark_non_differentiable(lse)


def _setup_context(ctx, inputs, output):
    names = ("q", "k", "v", *_TENSOR_OPTIONS, *_SCALARS, "deterministic")
    args = dict(zip(names, inputs))
    _save(ctx, args["q"], args["k"], args["v"], *output, {name: args[name] for name in _TENSOR_OPTIONS},
          {name: args[name] for name in _SCALARS}, args["deterministic"])


def _gradients(ctx, dout, backward) -> tuple:
    """dq, dk, dv and the array options' gradients (bias and sinks; None for the others) from
    a forward's saved tensors, through ``backward`` (the backward op, or its implementation)."""
    q, k, v, out, lse, *tensors = ctx.saved_tensors
    options = dict(zip(_TENSOR_OPTIONS, tensors))
    bias_grad = bool(ctx.needs_input_grad[3 + _TENSOR_OPTIONS.index("bias")])
    dq, dk, dv, dbias, dsinks = backward(dout, q, k, v, out, lse, options, bias_grad)
    grads = {"bias": dbias if bias_grad else None,
             "sinks": dsinks if options["sinks"] is not None else None}
    return (dq, dk, dv, *(grads.get(name) for name in _TENSOR_OPTIONS))


def _backward(ctx, dout, _dlse):
    def through_op(dout, q, k, v, out, lse, options, bias_grad):
        return _attention_backward_op(dout, q, k, v, out, lse, *options.values(), **ctx.scalars,
                                      bias_grad=bias_grad, deterministic=ctx.deterministic)

    return (*_gradients(ctx, dout, through_op), *(None for _ in _SCALARS), None)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """The ops' autograd formula without the dispatcher, for eager calls: torch.library's
    Python machinery (schema defaults, redispatch) costs hundreds of microseconds a call at
    these ops' 26 arguments, more than the kernels of a small problem. The same
    implementations run; ``torch.compile`` traces the ops instead."""

    @staticmethod
    def forward(ctx, q, k, v, *args):
        *tensors, scalars, deterministic = args
        tensors = dict(zip(_TENSOR_OPTIONS, tensors))
        out, lse = _forward_impl(q, k, v, tensors, scalars)
        _save(ctx, q, k, v, out, lse, tensors, scalars, deterministic)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        def direct(dout, q, k, v, out, lse, options, bias_grad):
            return _backward_impl(dout, q, k, v, out, lse, options, ctx.scalars, bias_grad, ctx.deterministic)

        return (*_gradients(ctx, dout, direct), None, None)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, bias: Any = None, sinks: Any = None,
                    deterministic: bool | None = None, **options: Any):
    """Exact attention of torch tensors, differentiable with respect to q, k, v, bias and sinks.

    Takes the keyword options of :func:`flashcupy.flash_attention` with the same
    meaning (see its docstring and docs/semantics.md): ``causal`` (True /
    'bottom_right' or 'top_left', which is PyTorch's ``is_causal``), ``scale``,
    ``window``, ``mask`` (bool, True = attend, as SDPA's bool ``attn_mask``),
    ``bias`` (float, added to the scores, as SDPA's float ``attn_mask``),
    ``alibi_slopes``, ``softcap``, ``q_lengths``, ``kv_lengths``, ``block_mask``,
    ``block_size``, ``dropout_p``, ``seed``, ``dropout_offset``, ``rng_state``, ``cu_seqlens_q``,
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
            forward (``flashcupy.rng.new_seed``) and reused by the backward; under
            ``torch.compile`` pass the seed (a traced draw would be a constant).
            ``rng_state``, a (2,) int64 tensor (seed, offset) in place of ``seed``
            and ``dropout_offset``, is read by the kernels when they run (a
            captured CUDA graph draws new bits once the caller writes new values);
            the forward copies it for its backward.

    Returns:
        out (..., Hq, Lq, Dv), a tensor of q's dtype on q's device; with
        ``return_lse=True``, ``(out, lse)`` where lse (..., Hq, Lq) is float32
        (float64 for float64 inputs) and carries no gradient.

    Double backward is not supported. bfloat16 CPU tensors are supported
    (through ``ml_dtypes.bfloat16``, no change of dtype). The forward and the
    backward are the torch operators ``flashcupy::attention`` and
    ``flashcupy::attention_backward`` (``torch.library.custom_op``, with fake
    functions), so ``torch.compile(fullgraph=True)`` traces through them.
    """
    keys = None
    if bias is None and sinks is None:
        keys, result = _planned_call(q, k, v, deterministic, options)
        if result is not None:
            return result
    _check_tensors(q, k, v, bias)
    return_lse = options.pop("return_lse", False)
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"return_lse: expected a bool, received {return_lse!r}")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    elif not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool or None, received {deterministic!r}")
    p, seed, _ = _check_dropout(options.get("dropout_p", 0.0), options.get("seed"), options.get("dropout_offset", 0))
    if p > 0 and seed is None and options.get("rng_state") is None:
        options["seed"] = _rng.new_seed()  # drawn once here, reused by the backward
    tensors, scalars = _encode({**options, "bias": bias, "sinks": sinks}, q, k)
    if tensors["rng_state"] is not None:  # the forward's values for its backward, whatever the caller writes after
        tensors["rng_state"] = tensors["rng_state"].clone()
    if torch.compiler.is_compiling():
        out, lse = _attention_op(q, k, v, **tensors, **scalars, deterministic=deterministic)
    else:
        out, lse = _EagerAttention.apply(q, k, v, *(tensors[name] for name in _TENSOR_OPTIONS), scalars,
                                         deterministic)
        if keys is not None:
            with _on_device(q.device):  # planning may pack a block again: torch's allocator and stream
                _CALLS.learn(keys, q.get_device(), lambda: _forward_problem(q, k, v, _decode(tensors, scalars)),
                             (tensors, scalars, deterministic))
    return (out, lse) if return_lse else out


def flash_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: Any, cu_seqlens_k: Any,
                           **options: Any):
    """Attention over packed variable-length sequences (see :func:`flashcupy.flash_attention_varlen`),
    differentiable like :func:`flash_attention`: q (Hq, total_q, D), k (Hk, total_k, D),
    v (Hk, total_k, Dv), cu_seqlens int32 of length batch + 1."""
    return flash_attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, **options)
