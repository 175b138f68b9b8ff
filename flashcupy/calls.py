"""Repeated GPU calls without their host work: plans kept by a call's key.

A model calls attention with the same shapes and options over and over. The first call of a
layout takes the full path (validation, kernel choice, a packed parameter block); the CUDA
backend then hands back that layout's plans (:class:`flashcupy.cuda.CallPlan`: the buffers
to allocate and the launches over a kept parameter block), kept here under the call's key.
A later call with the same key allocates its results, fills in its addresses and launches:
nothing is validated or chosen again, because the key holds everything the full path read
of the call but the arrays' contents and addresses: each operand's shape, strides, dtype and
device and whether its address is 16-byte aligned, the options' signature
(:func:`flashcupy.problem.option_signature`: names, types and values), and what the caller
adds (the deterministic flag). A key is only kept after its call passed validation, so an
invalid call never finds one and raises on the full path as before.

A second table holds 4-D calls by a key without their lengths and strides
(:class:`flashcupy.cuda.LengthPlan`, forward only): a call that differs from a planned one
only there runs the same kernel with its own lengths, strides and grid, after a check of its
strides. Generation loops, whose keys grow by one every call, plan once.

Not planned, so always on the full path: array options (masks, bias, ALiBi slopes,
lengths, sinks, block masks, packed sequences, ``rng_state``) in any form, dropout (a call
without a seed draws a new one), the CPU backend, layouts whose row copies are not plain
contiguous copies (rows padded to 16 bytes), and torch's negative views.

One :class:`Kind` per array kind says how its arrays are keyed, allocated and launched on:
:data:`CUPY` here, the torch tensors' kind in :mod:`flashcupy.torch`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable

import numpy as np

from . import cuda
from .problem import option_signature


#: The scratch block's element type.
_BYTE = np.dtype(np.uint8)
#: A key no table holds.
_UNKNOWN = object()


class Kind:
    """How one array kind is keyed, allocated and launched on (subclasses: CuPy, torch)."""

    def layout(self, x: Any) -> tuple | None:
        """What a key holds of an operand (shape, strides, dtype, device, 16-byte aligned
        address), or None where the kind's plans do not take it (another kind, the host)."""
        raise NotImplementedError

    def current_device(self) -> int:
        """The kind's current device, where plans launch."""
        raise NotImplementedError

    def stream(self, device: int) -> int:
        """The CUDA stream handle the kind's work on ``device`` goes to now."""
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: Any, poisoned: bool, device: int) -> Any:
        """A new contiguous array of a NumPy ``dtype`` on ``device``, NaN where ``poisoned``."""
        raise NotImplementedError

    def address(self, x: Any) -> int:
        raise NotImplementedError

    def shape(self, x: Any) -> tuple[int, ...]:
        raise NotImplementedError

    def strides(self, x: Any) -> tuple[int, ...]:
        """``x``'s strides in elements."""
        raise NotImplementedError

    def copy(self, x: Any) -> Any:
        """A C-contiguous copy of ``x`` in a new allocation (aligned as the allocator's blocks),
        even where ``x`` is contiguous: a plan copies operands whose address is misaligned too."""
        raise NotImplementedError

    def temporaries(self) -> contextlib.AbstractContextManager:
        """Where a call's copies and scratch are allocated (its results never are): the kind's
        allocator, unless its own is not safe for a CUDA graph being captured."""
        return contextlib.nullcontext()


class Planned:
    """A validated call layout's forward plan and its backward plans by the layouts of
    (dout, out, lse); ``context`` is the caller's (what its full path needs again)."""

    def __init__(self, kind: Kind, device: int, forward: cuda.CallPlan, context: Any = None) -> None:
        self.kind, self.device, self.forward_plan, self.context = kind, device, forward, context
        self._backward: dict[tuple, cuda.CallPlan | None] = {}

    def _run(self, plan: cuda.CallPlan, operands: tuple) -> list:
        """Allocate the plan's results and scratch and queue its launches; returns the results."""
        kind, device = self.kind, self.device
        poison = cuda.poison_outputs
        results = [kind.empty(shape, dtype, poison and poisoned, device) for shape, dtype, poisoned in plan.results]
        if not (plan.scratch_bytes or True in plan.copies):
            plan.run(kind.stream(device), [kind.address(x) for x in (*operands, *results)])
            return results
        with kind.temporaries():
            if True in plan.copies:
                operands = tuple(kind.copy(x) if c else x for x, c in zip(operands, plan.copies))
            pointers = [kind.address(x) for x in (*operands, *results)]
            if plan.scratch_bytes:
                scratch = kind.empty((plan.scratch_bytes,), _BYTE, False, device)
                base = kind.address(scratch)
                pointers += [base + offset for offset in plan.scratch_offsets]
        plan.run(kind.stream(device), pointers)
        return results  # copies and scratch may go now: their memory serves only work queued after

    def forward(self, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        """(out, lse) of q, k, v laid out as the key says."""
        out, lse = self._run(self.forward_plan, (q, k, v))
        return out, lse

    def backward_key(self, dout: Any, out: Any, lse: Any, *extra: Any) -> tuple | None:
        """The key of a backward in this entry: the layouts of dout, out, lse and ``extra``
        (what else its plan depends on); None where the kind's plans do not take them."""
        layouts = (self.kind.layout(dout), self.kind.layout(out), self.kind.layout(lse))
        return None if None in layouts else (*layouts, *extra)

    def backward(self, key: tuple | None, dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any) -> tuple | None:
        """(dq, dk, dv) of the forward's q, k, v, out, lse and ``dout``, or None where no
        backward of this ``key`` (:meth:`backward_key`) is planned (:meth:`learn_backward`)."""
        plan = self._backward.get(key) if key is not None else None
        if plan is None:
            return None
        dq, dk, dv = self._run(plan, (q, k, v, dout, out, lse))
        return dq, dk, dv

    def knows_backward(self, key: tuple | None) -> bool:
        return key is None or key in self._backward

    def learn_backward(self, key: tuple | None, plan: Callable[[], cuda.CallPlan | None]) -> None:
        """Keep ``plan()`` (None: this layout stays on the full path) for ``key``, after a
        full-path backward of that key ran: its block is kept by the CUDA backend."""
        if key is not None and key not in self._backward:
            if len(self._backward) >= 8:  # a model has one or two dout layouts a call site
                self._backward.clear()
            self._backward[key] = plan()


class LengthPlanned:
    """A plain 4-D forward's :class:`flashcupy.cuda.LengthPlan`, for calls whose operands
    differ from the planned call's only in their lengths and strides (a generation loop's
    growing keys, batches of another length). Backwards are not planned here: they take the
    full path (the exact key's entry plans them)."""

    def __init__(self, kind: Kind, device: int, plan: cuda.LengthPlan, context: Any = None) -> None:
        self.kind, self.device, self.plan, self.context = kind, device, plan, context

    def takes(self, q: Any, k: Any, v: Any) -> bool:
        kind = self.kind
        return self.plan.takes(kind.shape(q), kind.shape(k), kind.shape(v), kind.strides(q), kind.strides(k),
                               kind.strides(v))

    def forward(self, q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        """(out, lse) of q, k, v that :meth:`takes`."""
        kind, plan, device = self.kind, self.plan, self.device
        shape = kind.shape(q)
        poison = cuda.poison_outputs
        out = kind.empty((*shape[:3], plan.head_dim_v), plan.dtype, poison, device)
        lse = kind.empty(tuple(shape[:3]), plan.lse_dtype, poison, device)
        address = kind.address
        plan.run(kind.stream(device), (address(q), address(k), address(v), address(out), address(lse)), shape[2],
                 kind.shape(k)[2], kind.strides(q), kind.strides(k), kind.strides(v))
        return out, lse

    def backward_key(self, *arrays: Any) -> None:
        return None

    def backward(self, key: None, *arrays: Any) -> None:
        return None

    def knows_backward(self, key: None) -> bool:
        return True

    def learn_backward(self, key: None, plan: Callable) -> None:
        """Nothing: see the class."""


class Calls:
    """Entries by call key (:class:`Planned`) and by length-free key (:class:`LengthPlanned`),
    None for a key left to the full path; at most ``size`` of each, the oldest going first."""

    def __init__(self, kind: Kind, size: int = 256) -> None:
        self.kind = kind
        self._size = size
        self._entries: dict[tuple, Planned | None] = {}
        self._lengths: dict[tuple, LengthPlanned | None] = {}
        self._lock = threading.Lock()  # writers only: a lookup is one atomic dict.get

    def find(self, q: Any, k: Any, v: Any, options: dict[str, Any],
             *extra: Any) -> tuple[tuple | None, Planned | LengthPlanned | None]:
        """(the call's keys for :meth:`learn`, or None for calls never planned (see the module);
        the entry that runs it now, or None). The length-free key holds each operand's layout
        but its length and strides, for 4-D operands of calls without a window (a window is
        clamped to the lengths when checked)."""
        signed = option_signature(options)
        if signed is None or options.get("dropout_p"):  # plain data first: an array's truth is an error
            return None, None
        kind = self.kind
        layouts = (kind.layout(q), kind.layout(k), kind.layout(v))
        if None in layouts:
            return None, None
        key = (*layouts, signed, *extra)
        found: Any = self._entries.get(key, _UNKNOWN)
        lengths = None
        if found is _UNKNOWN:  # a key that is kept, as None too, decides without the length table
            found = None
            if options.get("window") is None and all(len(x[0]) == 4 for x in layouts):
                lengths = (*((x[0][0], x[0][1], x[0][3], *x[2:]) for x in layouts), signed, *extra)
                found = self._lengths.get(lengths)
                if found is not None and not found.takes(q, k, v):
                    found = None
        if found is not None and found.device != kind.current_device():
            found = None
        return (key, lengths), found

    def learn(self, keys: tuple | None, device: int, problem: Callable[[], Any], context: Any = None) -> None:
        """After a full-path call with ``keys`` (from :meth:`find`) ran, keep the entries the
        CUDA backend plans for it: ``problem()`` is its validated problem on device arrays, or
        None where another backend ran it."""
        if keys is None:
            return
        key, lengths = keys
        need_key, need_lengths = key not in self._entries, lengths is not None and lengths not in self._lengths
        if not (need_key or need_lengths):
            return
        pb = problem()
        plan = cuda.forward_plan(pb) if pb is not None and need_key else None
        length_plan = cuda.length_plan(pb) if pb is not None and need_lengths else None
        with self._lock:
            if need_key:
                self._keep(self._entries, key, plan and Planned(self.kind, device, plan, context))
            if need_lengths:
                self._keep(self._lengths, lengths, length_plan and LengthPlanned(self.kind, device, length_plan,
                                                                                   context))

    def _keep(self, table: dict, key: tuple, entry: Any) -> None:
        if len(table) >= self._size:
            del table[next(iter(table))]
        table[key] = entry


class _CupyKind(Kind):
    """CuPy arrays: CuPy's memory pool, its current device and stream."""

    def __init__(self) -> None:
        self._cupy: Any = None
        self._ndarray: Any = None

    def _module(self) -> Any:
        if self._cupy is None:
            import cupy

            self._cupy = cupy
        return self._cupy

    def layout(self, x: Any) -> tuple | None:
        ndarray = self._ndarray
        if ndarray is None:  # no import: a CuPy array's caller has imported CuPy
            ndarray = self._ndarray = getattr(sys.modules.get("cupy"), "ndarray", None)
        if ndarray is None or type(x) is not ndarray:
            return None
        memory = x.data
        return x.shape, x.strides, x.dtype, memory.device_id, memory.ptr % 16 == 0

    def current_device(self) -> int:
        return self._module().cuda.runtime.getDevice()

    def stream(self, device: int) -> int:
        return self._module().cuda.get_current_stream().ptr

    def empty(self, shape: tuple[int, ...], dtype: Any, poisoned: bool, device: int) -> Any:
        cupy = self._module()
        return cupy.full(shape, float("nan"), dtype) if poisoned else cupy.empty(shape, dtype)

    def address(self, x: Any) -> int:
        return x.data.ptr

    def shape(self, x: Any) -> tuple[int, ...]:
        return x.shape

    def strides(self, x: Any) -> tuple[int, ...]:
        size = x.itemsize
        return tuple(s // size if s % size == 0 else -1 for s in x.strides)  # -1: no plan takes it

    def copy(self, x: Any) -> Any:
        return x.copy(order="C")

    def temporaries(self) -> contextlib.AbstractContextManager:
        """The capture's own memory while CuPy's current stream is being captured into a CUDA
        graph (CuPy's pool would hand it to later work: :func:`flashcupy.cuda.temporaries`)."""
        return cuda.temporaries()


#: Calls on CuPy arrays (flashcupy.api).
CUPY = Calls(_CupyKind())
