"""Which CUDA kernels a call would run, and why: ``flashcupy.explain`` and ``python -m
flashcupy explain``.

The call is validated as flash_attention validates it, then the rule tables of
:mod:`flashcupy.cuda.spec` choose the forward kernel and the backward's three launches for a
GPU of the given compute capability, with or without that GPU: the result names the rule that
fired (and why it exists), the kernels' template instantiations, tiles, threads, shared
memory and grid, the candidates that did not fit, and, where NVRTC is installed and asked
for, each kernel's registers and spills from ptxas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import interop
from .cuda import Launch, backward_launches, forward_launches, score_set
from .cuda import spec as S
from .problem import ARRAY_OPTIONS, Problem, make_host_problem

#: Array options whose values or layout matter to validation (lengths, slopes, rng_state:
#: two contiguous values); the others (masks, bias) are stood in for by zero-stride views of
#: their shape and dtype.
_VALUE_OPTIONS = ("alibi_slopes", "q_lengths", "kv_lengths", "cu_seqlens_q", "cu_seqlens_k", "rng_state")


def _stand_in(x: Any) -> Any:
    """A zero-stride NumPy view with x's shape and dtype: validation reads no element of it."""
    if x is None or not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return x
    empty = x[tuple(slice(0, 0) for _ in x.shape)]  # a view of no element: its dtype as NumPy sees it
    return np.broadcast_to(np.zeros((), dtype=interop.to_numpy(empty).dtype), tuple(x.shape))


def _option_stand_in(name: str, value: Any) -> Any:
    """An option as validation needs it: the values of lengths and slopes on the host, masks
    and bias as stand-ins."""
    if name in _VALUE_OPTIONS:
        return interop.to_numpy(value) if hasattr(value, "shape") else value
    return _stand_in(value) if name in ARRAY_OPTIONS else value


def _caller_mask_planes(pb: Problem, options: dict[str, Any]) -> tuple[int, int]:
    """The tile maps' (batch, head) planes of a call with these options, from the caller's
    mask and block mask (the problem holds zero-stride stand-ins): an axis before the last two
    counts where it is longer than 1 and, for arrays with byte strides, not of stride 0."""
    per_batch = per_head = False
    for name in ("mask", "block_mask"):
        x = options.get(name)
        if x is None or not hasattr(x, "shape"):
            continue
        shape = tuple(x.shape)
        strides = getattr(x, "strides", None)  # NumPy and CuPy; torch tensors: by shape alone
        for axis, n in enumerate(shape[:-2]):
            if n > 1 and (strides is None or strides[axis] != 0):
                if len(shape) - axis == 3:
                    per_head = True
                else:
                    per_batch = True
    return (math.prod(pb.batch) if per_batch else 1), (pb.num_heads_q if per_head else 1)


def parse_arch(arch: Any) -> int:
    """90 from 90, '90', 'sm_90' or 'sm_90a'; ValueError naming the argument otherwise."""
    text = str(arch).strip().lower().removeprefix("sm_").removesuffix("a")
    if not text.isdigit() or int(text) < 50:
        raise ValueError(f"arch: expected a compute capability such as 90 or 'sm_90', received {arch!r}")
    return int(text)


def _device(arch: int | None) -> tuple[int, int, str]:
    """(compute capability, opt-in shared memory per block, where they come from)."""
    if arch is None:
        if not interop.gpu_usable():
            raise ValueError("arch: no usable CUDA GPU here, so name the architecture to explain for (arch=90)")
        from .cuda import device_limits

        import cupy

        device = cupy.cuda.Device().id
        cc, smem = device_limits(device)
        props = cupy.cuda.runtime.getDeviceProperties(device)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return cc, smem, f"GPU {device} ({name})"
    if arch not in S.ARCH_SMEM:
        known = ", ".join(f"sm_{a}" for a in S.ARCH_SMEM)
        raise ValueError(f"arch: expected one of {known} without a GPU of that architecture, received sm_{arch}")
    return arch, S.ARCH_SMEM[arch], f"sm_{arch}'s shared memory limit"


@dataclass
class KernelLaunch:
    """One launch as flashcupy.cuda makes it (its :class:`~flashcupy.cuda.Launch`'s role,
    family, name, grid, threads and smem_bytes read through), and ptxas' registers and spill
    bytes where compiled."""

    launch: Launch
    registers: int | None = None
    spill_bytes: int | None = None

    def __getattr__(self, name: str) -> Any:
        if name == "launch":  # not set yet (copy, pickle): no recursion through it
            raise AttributeError(name)
        return getattr(self.launch, name)


@dataclass
class Explanation:
    """What :func:`explain` found; ``str()`` gives the report ``python -m flashcupy explain`` prints."""

    call: str
    device: str
    arch: int
    forward: S.Choice
    backward: S.Choice | None
    launches: list[KernelLaunch] = field(default_factory=list)
    note: str = ""

    def __str__(self) -> str:
        lines = [f"call:     {self.call}", f"device:   sm_{self.arch} ({self.device})"]
        for direction, choice in (("forward", self.forward), ("backward", self.backward)):
            if choice is None:
                continue
            lines.append(f"{direction + ':':9} rule '{choice.rule.name}': {choice.rule.why}")
            lines.append(f"          {_tiles(choice.spec)}")
            for rule, rejected in choice.rejected:
                lines.append(f"          not taken (rule '{rule}', {rejected.smem_bytes} bytes of shared memory): "
                             f"{_tiles(rejected)}")
            for launch in self.launches:
                if launch.family == direction:
                    regs = "" if launch.registers is None else (
                        f", {launch.registers} registers, {launch.spill_bytes} bytes spilled")
                    lines.append(f"  {launch.role:20} {launch.name}")
                    lines.append(f"  {'':20} {launch.threads} threads, {launch.smem_bytes} bytes of shared memory, "
                                 f"grid {launch.grid}{regs}")
        if all(launch.registers is None for launch in self.launches):
            lines.append("registers: not compiled (registers=True, or --registers, compiles each kernel with NVRTC)")
        if self.note:
            lines.append(self.note)
        return "\n".join(lines)


def _tiles(spec: S.KernelSpec | S.BackwardSpec) -> str:
    if isinstance(spec, S.KernelSpec):
        return (f"{spec.mainloop}, {spec.policy}: {spec.block_m} query rows x {spec.block_n} keys a tile, "
                f"{spec.num_warps} warps, Dv chunk {spec.dv_tile}, {spec.stages} stage(s), "
                f"{spec.scores}")
    dq = {0: "dQ by its own kernel", 1: "dQ fused (accumulator dQ / scale)", 2: "dQ fused (into dQ itself)"}
    return (f"{spec.mainloop}, {spec.policy}: {spec.block_r} keys a block x {spec.block_c} queries a tile, "
            f"{spec.roles} role(s), chunks of {spec.kv_chunk} columns, {spec.stages} stage(s), "
            f"{dq[spec.dq_accum]}, {spec.scores}")


def _compile_registers(launches: list[KernelLaunch], arch: int) -> None:
    """Registers and spill bytes of each launch from ptxas' report (NVRTC, no GPU needed; one
    program per kernel, so each report has one entry)."""
    import re

    from .cuda.compile import compile_for_arch

    for launch in launches:
        log = compile_for_arch(launch.family, [launch.name], arch).replace("\0", "")
        regs = re.search(r"Used (\d+) registers", log)
        spill = re.search(r"(\d+) bytes spill stores", log)
        if regs and spill:
            launch.registers, launch.spill_bytes = int(regs.group(1)), int(spill.group(1))


def _describe_call(pb: Problem, options: dict[str, Any], deterministic: bool) -> str:
    shapes = f"q {tuple(pb.q.shape)}, k {tuple(pb.k.shape)}, v {tuple(pb.v.shape)}"
    used = [name for name, value in options.items() if value is not None and value is not False
            and not (name == "dropout_p" and value == 0) and name not in ("backend", "return_lse", "seed")]
    flags = (["deterministic"] if deterministic else []) + used
    return f"{np.dtype(pb.dtype).name} {shapes}" + (f"; {', '.join(flags)}" if flags else "")


def explain(q: Any, k: Any, v: Any, *, arch: Any = None, backward: bool = True, deterministic: bool = False,
            registers: bool = False, **options: Any) -> Explanation:
    """Which CUDA kernels ``flash_attention(q, k, v, **options)`` (and its backward) would
    run on a GPU of compute capability ``arch``, and which rule of the kernel tables chose them.

    q, k, v: arrays of any kind, or anything with ``shape`` and ``dtype`` (no element is read,
    nothing is copied to or from a GPU). ``options``: flash_attention's keyword options.
    ``arch``: 90, 'sm_90' and the like (the current GPU's when None; required without a GPU).
    ``backward``: explain the backward too, with ``deterministic`` as flash_attention_backward
    takes it. ``registers``: compile each kernel with NVRTC (seconds each, no GPU needed) for
    ptxas' register and spill figures. Returns an :class:`Explanation`; print it for a report.
    """
    cc, smem_limit, where = _device(None if arch is None else parse_arch(arch))
    stand_ins = {name: _option_stand_in(name, value) for name, value in options.items()}
    pb = make_host_problem(_stand_in(q), _stand_in(k), _stand_in(v), {**stand_ins, "backend": "cpu"})
    call = S.Call(np.dtype(pb.dtype).name, S.head_dim_bucket(max(pb.head_dim, pb.head_dim_v)), cc, smem_limit,
                  pb.allow_tf32, S.force_portable(), score_set(pb), deterministic)
    fwd = S.choose_forward(call)
    bwd = S.choose_backward(call) if backward else None
    planes = _caller_mask_planes(pb, options)
    launches = forward_launches(pb, fwd.spec, planes) + (backward_launches(pb, bwd.spec, planes) if bwd else [])
    result = Explanation(_describe_call(pb, options, deterministic), where, cc, fwd, bwd,
                         [KernelLaunch(launch) for launch in launches])
    notes = []
    if pb.sinks is not None:
        notes.append("sinks: no kernel of their own: the forward's epilogue adds them to each row's sum, their "
                     "gradient comes from the backward's D (flashcupy/sinks.py)")
    if S.force_portable():
        notes.append(f"note: {S.FORCE_PORTABLE_ENV}=1 forces the portable (SIMT) kernels")
    result.note = "\n".join(notes)
    if registers:
        _compile_registers(result.launches, cc)
    return result
