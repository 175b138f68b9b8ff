"""Kernel choice and tile sizes for the CUDA backend: the only place they are decided.

A :class:`KernelSpec` names one template instantiation of ``flash::flash_fwd``
(``kernels_cu/flash_fwd.cu``). :func:`select_forward` picks it from the dtype,
the head dims, the GPU's compute capability and its shared-memory limit;
:func:`all_forward_specs` lists every spec it can return for an architecture,
which CI compiles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

#: Padded head-dim buckets: the kernels' HD template argument.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 256, 512)

#: C++ element type per dtype name.
CXX_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}

#: Per policy: the C++ policy for an element type, 16-row groups per warp (the policy's MI),
#: the widest Dv chunk one block keeps in registers, and (BLOCK_N, NUM_WARPS) candidates for
#: (padded head dim, full pipeline, compute capability) in order of preference: the first
#: that fits the GPU's shared memory wins. Every choice compiles without register spills
#: (tests/test_kernels_compile.py checks each architecture).
POLICIES = {
    # Two row groups per warp (plain kernels): O (32, DV) and S (32, BLOCK_N) share the
    # register file, so wide heads take narrow key tiles (32 keys at D=128 fits sm_90's
    # allocation, not sm_8x's). The full pipeline keeps one row group.
    "mma16": (lambda t: f"flash::MmaF16<{t}, 2>", 2, 128,
              lambda hd, full, arch: ((64, 4), (32, 4), (32, 2), (16, 2), (16, 1)) if hd <= 64 or (full and hd <= 128)
              else ((32, 4), (16, 4), (16, 2), (16, 1)) if hd <= 96 or full or (hd <= 128 and arch >= 90)
              else ((16, 4), (16, 2), (16, 1))),
    "tf32": (lambda t: "flash::MmaTf32", 1, 128, lambda hd, full, arch: ((32, 4), (32, 2), (16, 2), (16, 1), (8, 1))),
    # float64: 16-key tiles keep S small enough that a 128-wide O chunk stays in registers;
    # the plain kernel at D <= 64 affords 32.
    "dmma": (lambda t: "flash::MmaF64", 1, 128,
             lambda hd, full, arch: ((32, 4), (16, 4), (16, 2), (16, 1), (8, 1)) if hd <= 64 and not full
             else ((16, 4), (16, 2), (16, 1), (8, 1))),
    "simt": (lambda t: f"flash::Simt<{t}, {'double' if t == 'double' else 'float'}>", 1, 64,
             lambda hd, full, arch: ((32, 4), (32, 2), (16, 2), (16, 1), (8, 1))),
}

#: Environment variable forcing the portable (SIMT) kernels, as on GPUs before sm_80.
FORCE_PORTABLE_ENV = "FLASHCUPY_FORCE_PORTABLE"


class NoKernelError(RuntimeError):
    """No tile shape of the needed kernel fits this GPU (``backend='auto'`` then uses the CPU)."""


@dataclass(frozen=True)
class KernelSpec:
    """One forward kernel instantiation and its launch shape."""

    dtype: str       # 'float16', 'bfloat16', 'float32' or 'float64'
    policy: str      # key of POLICIES
    head_dim: int    # HD: padded QK head dim
    dv_tile: int     # DV: output columns per block
    block_n: int     # keys per tile
    num_warps: int   # warps per block; BLOCK_M = 16 * MI * num_warps
    full: bool = True  # compiled with bias, ALiBi, softcap, masks and dropout
    stages: int = 1    # shared-memory stages of K and V

    @property
    def rows_per_warp(self) -> int:
        """16 * MI; the full pipeline's registers leave room for one row group only."""
        return 16 * (1 if self.full else POLICIES[self.policy][1])

    @property
    def block_m(self) -> int:
        return self.rows_per_warp * self.num_warps

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype if self.dtype != "bfloat16" else "float16").itemsize

    @property
    def name_expression(self) -> str:
        t = CXX_TYPE[self.dtype]
        policy = POLICIES[self.policy][0](t).replace(", 2>", f", {self.rows_per_warp // 16}>")
        full = "true" if self.full else "false"
        return (f"flash::flash_fwd<{t}, {policy}, {self.head_dim}, {self.dv_tile}, {self.block_n}, "
                f"{self.num_warps}, {full}, {self.stages}>")

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q (BLOCK_M, HD) and ``stages`` of K (BLOCK_N, HD) and V
        (BLOCK_N, DV), rows padded by 16 bytes."""
        pad = 16 // self.itemsize
        kv = self.stages * self.block_n
        elems = (self.block_m + kv) * (self.head_dim + pad) + kv * (self.dv_tile + pad)
        return elems * self.itemsize


def head_dim_bucket(dim: int) -> int:
    """The smallest bucket >= dim."""
    for bucket in HEAD_DIM_BUCKETS:
        if dim <= bucket:
            return bucket
    raise ValueError(f"head dim {dim} exceeds the largest kernel bucket {HEAD_DIM_BUCKETS[-1]}")


def policy_for(dtype: str, arch: int, allow_tf32: bool, portable: bool) -> str:
    """Which warp product: tensor cores on sm_80+ (TF32 only when allowed), else SIMT."""
    if portable or arch < 80:
        return "simt"
    return {"float16": "mma16", "bfloat16": "mma16", "float64": "dmma"}.get(
        dtype, "tf32" if allow_tf32 else "simt"
    )


def force_portable() -> bool:
    """True when FLASHCUPY_FORCE_PORTABLE is set to 1 (tests use it to run the sm_60-75 path)."""
    return os.environ.get(FORCE_PORTABLE_ENV, "0") == "1"


def select_forward(dtype: str, d: int, dv: int, arch: int, smem_limit: int, allow_tf32: bool = False,
                   portable: bool | None = None, full: bool = True) -> KernelSpec:
    """The forward kernel for this problem on a GPU of compute capability ``arch`` (e.g. 90).

    ``smem_limit`` is the device's opt-in shared memory per block in bytes; ``full``:
    some option beyond causal, window and lengths is in use (see :func:`needs_full`). Raises
    RuntimeError when no tile shape fits (float64 with D > 256 on 99 KB GPUs).
    """
    portable = force_portable() if portable is None else portable
    policy = policy_for(dtype, arch, allow_tf32, portable)
    _, _, dv_cap, candidates = POLICIES[policy]
    hd = head_dim_bucket(max(d, dv))
    dv_tile = min(hd, dv_cap)
    for block_n, warps in candidates(hd, full, arch):
        # A second K/V stage hides copies behind a whole tile of compute; wider heads would
        # pay for it in blocks per SM (measured on the H200: see bench/NOTES.md).
        spec = KernelSpec(dtype, policy, hd, dv_tile, block_n, warps, full, 2 if hd <= 64 else 1)
        if spec.smem_bytes <= smem_limit:
            return spec
    raise NoKernelError(
        f"no {dtype} kernel for head dims ({d}, {dv}) fits this GPU's {smem_limit // 1024} KiB of shared "
        f"memory per block (it needs {spec.smem_bytes // 1024} KiB); use backend='cpu'"
    )


def needs_full(bias: bool, mask: bool, block_mask: bool, alibi: bool, softcap: bool, dropout: bool) -> bool:
    """Whether a call needs the full score pipeline (anything beyond causal, window, lengths)."""
    return bias or mask or block_mask or alibi or softcap or dropout


@dataclass(frozen=True)
class BackwardSpec:
    """The three backward kernels of one problem (kernels_cu/flash_bwd.cu) and their tiles."""

    dtype: str
    policy: str      # key of POLICIES; tensor-core policies with one 16-row group per warp
    head_dim: int    # HD: padded head dim of q, k, v and dO in shared memory
    dq_chunk: int    # CH of the dQ kernel: gradient columns per block
    kv_chunk: int    # CH of the dK/dV kernel
    block_r: int     # rows of the block's own operand (16 per warp)
    block_c: int     # rows of the streamed operand per tile

    @property
    def threads(self) -> int:
        return 2 * self.block_r

    @property
    def itemsize(self) -> int:
        return KernelSpec(self.dtype, self.policy, self.head_dim, 16, 16, 1).itemsize

    def _kernel(self, name: str, chunk: int) -> str:
        t = CXX_TYPE[self.dtype]
        policy = POLICIES[self.policy][0](t).replace(", 2>", ", 1>")
        return f"flash::{name}<{t}, {policy}, {self.head_dim}, {chunk}, {self.block_r}, {self.block_c}>"

    @property
    def delta_name(self) -> str:
        t = CXX_TYPE[self.dtype]
        return f"flash::flash_bwd_delta<{t}, {'double' if t == 'double' else 'float'}>"

    @property
    def dq_name(self) -> str:
        return self._kernel("flash_bwd_dq", self.dq_chunk)

    @property
    def dkdv_name(self) -> str:
        return self._kernel("flash_bwd_dkdv", self.kv_chunk)

    @property
    def smem_bytes(self) -> int:
        """Two (block_r, HD) and two (block_c, HD) tiles padded by 16 bytes, plus lse and D per streamed row."""
        pad = 16 // self.itemsize
        acc = 8 if self.dtype == "float64" else 4
        return 2 * (self.block_r + self.block_c) * (self.head_dim + pad) * self.itemsize + 2 * self.block_c * acc


def select_backward(dtype: str, d: int, dv: int, arch: int, smem_limit: int, allow_tf32: bool = False,
                    portable: bool | None = None) -> BackwardSpec:
    """The backward kernels for this problem on a GPU of compute capability ``arch``.

    Gradient columns come in chunks (64, 32 for float64; dQ on the float16/bfloat16 tensor
    cores: 128) so that dK and dV (or dQ) stay in registers beside S and dP whatever the
    head dim. Raises NoKernelError when no tile fits.
    """
    portable = force_portable() if portable is None else portable
    policy = policy_for(dtype, arch, allow_tf32, portable)
    hd = head_dim_bucket(max(d, dv))
    wide = dtype == "float64"
    tiles = ((64, 16), (32, 16), (16, 16)) if wide else ((64, 32), (64, 16), (32, 16), (16, 16))
    if policy != "mma16":  # m16n8k16 consumes 16 streamed rows at a time; the others 8 or 4
        tiles += ((16, 8),)
    for block_r, block_c in tiles:
        kv_chunk = min(hd, 32 if wide else 64)
        spec = BackwardSpec(dtype, policy, hd, min(hd, 128) if policy == "mma16" else kv_chunk, kv_chunk, block_r,
                            block_c)
        if spec.smem_bytes <= smem_limit:
            return spec
    raise NoKernelError(
        f"no {dtype} backward kernel for head dims ({d}, {dv}) fits this GPU's {smem_limit // 1024} KiB of "
        f"shared memory per block (it needs {spec.smem_bytes // 1024} KiB); use backend='cpu'"
    )


def all_backward_specs(arch: int) -> list[BackwardSpec]:
    """Every spec :func:`select_backward` can return on ``arch``."""
    specs = set()
    for dtype in CXX_TYPE:
        for bucket in HEAD_DIM_BUCKETS:
            for allow_tf32 in (False, True):
                for portable in (False, True):
                    try:
                        specs.add(select_backward(dtype, bucket, bucket, arch, ARCH_SMEM[arch], allow_tf32, portable))
                    except NoKernelError:
                        pass
    return sorted(specs, key=lambda s: (s.dtype, s.policy, s.head_dim, s.block_r, s.block_c))


def all_kernels(arch: int) -> list[tuple[str, str, int]]:
    """(source family, name expression, dynamic shared memory) of every kernel the dispatcher
    can launch on ``arch``, forward and backward, each once."""
    kernels = {s.name_expression: ("forward", s.name_expression, s.smem_bytes) for s in all_forward_specs(arch)}
    for s in all_backward_specs(arch):
        kernels[s.delta_name] = ("backward", s.delta_name, 0)
        for name in (s.dq_name, s.dkdv_name):
            kernels[name] = ("backward", name, s.smem_bytes)
    return sorted(kernels.values())


#: Opt-in shared memory per block (bytes) of each architecture CI compiles for.
ARCH_SMEM = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


def all_forward_specs(arch: int) -> list[KernelSpec]:
    """Every spec :func:`select_forward` can return on ``arch``, for ahead-of-time compile checks."""
    specs = set()
    for dtype in CXX_TYPE:
        for bucket in HEAD_DIM_BUCKETS:
            for dv in {bucket, 1}:
                for allow_tf32 in (False, True):
                    for portable in (False, True):
                        for full in (False, True):
                            try:
                                specs.add(select_forward(dtype, bucket, dv, arch, ARCH_SMEM[arch], allow_tf32,
                                                         portable, full))
                            except NoKernelError:
                                pass
    return sorted(specs, key=lambda s: (s.dtype, s.policy, s.head_dim, s.block_n, s.num_warps))
