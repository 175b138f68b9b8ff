"""Kernel choice and tile sizes for the CUDA backend: the only place they are decided.

A :class:`KernelSpec` names one template instantiation of ``flash::flash_fwd``
(``kernels_cu/flash_fwd.cu``). :func:`select_forward` picks it from the dtype,
the head dims, the GPU's compute capability and its shared-memory limit;
:func:`all_forward_specs` lists every spec it can return for an architecture,
which CI compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass

import numpy as np

#: Padded head-dim buckets: the kernels' HD template argument.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 256, 512)

#: C++ element type per dtype name.
CXX_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}

#: Per policy: the C++ policy for (element type, 16-row groups per warp), the row groups per
#: warp of the plain kernels (the full pipeline's registers leave room for one), the widest
#: Dv chunk one block keeps in registers (for full pipeline or not), and (BLOCK_N,
#: NUM_WARPS) candidates for (padded head dim, full pipeline, compute capability) in order
#: of preference: the first that fits the GPU's shared memory wins. Every choice compiles
#: without register spills (tests/test_kernels_compile.py checks each architecture).
POLICIES = {
    # Two row groups per warp (plain kernels): O (32, DV) and S (32, BLOCK_N) share the
    # register file, so wide heads take narrow key tiles (32 keys at D=128 fits sm_90's
    # allocation, not sm_8x's).
    "mma16": (lambda t, mi: f"flash::MmaF16<{t}, {mi}>", 2, lambda full: 128,
              lambda hd, full, arch: ((64, 4), (32, 4), (32, 2), (16, 2), (16, 1)) if hd <= 64 or (full and hd <= 128)
              else ((32, 4), (16, 4), (16, 2), (16, 1)) if hd <= 96 or full or (hd <= 128 and arch >= 90)
              else ((16, 4), (16, 2), (16, 1))),
    # Hopper (sm_90a): wgmma per warpgroup, 64 rows each; K and V fragments never enter
    # registers, so S and O of 128 columns each fit beside P and the next tile's S. Plain
    # kernels keep a 256-wide O (no second pass over Q K^T at D = 256); with the full
    # pipeline that spills. Up to D = 128, plain kernels take one warpgroup and 64-key tiles:
    # two or three blocks share an SM and hide each other's prologue, epilogue and softmax
    # (H200, D = 64: 0.88-1.06x FA2 against 0.61-0.97x with 128 keys x 8 warps; bench/NOTES.md).
    "wgmma": (lambda t, mi: f"flash::MmaWgmma<{t}>", 1, lambda full: 128 if full else 256,
              lambda hd, full, arch: ((64, 4), (128, 8)) if hd <= 128 and not full else ((64, 8), (64, 4))),
    # float32: allow_tf32 rounds each operand to TF32 once; by default (float32 accuracy) each
    # product is three TF32 products of the operands' high and low parts (3xTF32). One row
    # group per warp: two spill beside the split fragments; 64-key tiles only where they fit
    # (plain kernels at D <= 64: 1.5x SDPA-efficient against 1.4x with 32 on the H200).
    "tf32": (lambda t, mi: f"flash::MmaTf32<false, {mi}>", 1, lambda full: 128,
             lambda hd, full, arch: ((32, 4), (32, 2), (16, 2), (16, 1), (8, 1))),
    "tf32x3": (lambda t, mi: f"flash::MmaTf32<true, {mi}>", 1, lambda full: 128,
               lambda hd, full, arch: ((64, 4),) * (hd <= 64 and not full) + ((32, 4), (32, 2), (16, 2), (16, 1), (8, 1))),
    # float64: 16-key tiles keep S small enough that a 128-wide O chunk stays in registers;
    # the plain kernel at D <= 64 affords 32. Up to D = 128, 8 warps (128 rows) a block halve
    # the K and V each product reads from L2 (H200, D = 128: 1.6x SDPA-math at L = 4096
    # against 1.45x with 4 warps; bench/NOTES.md).
    "dmma": (lambda t, mi: "flash::MmaF64", 1, lambda full: 128,
             lambda hd, full, arch: ((32, 4), (16, 4), (16, 2), (16, 1), (8, 1)) if hd <= 64 and not full
             else ((16, 8),) * (hd <= 128) + ((16, 4), (16, 2), (16, 1), (8, 1))),
    # Hopper (sm_90a), float32 at float32 accuracy without score options: 3xTF32 on wgmma, one
    # consumer warpgroup of 64 rows (S, P's split fragments, O and a per-tile P V sum: 217
    # registers at D = 128) fed by a producer warpgroup (PRODUCER_WARPS) that copies and
    # splits the operands, 32-key tiles; the split hi and lo tiles fill shared memory, one
    # block an SM. Tried before the plain tf32x3 kernel, at the padded head dims
    # WGMMA_TF32_HEAD_DIMS.
    "wgmma_tf32x3": (lambda t, mi: "flash::MmaWgmmaTf32x3", 1, lambda full: 128, lambda hd, full, arch: ((32, 4),)),
    "simt": (lambda t, mi: f"flash::Simt<{t}, {'double' if t == 'double' else 'float'}>", 1, lambda full: 64,
             lambda hd, full, arch: ((32, 4), (32, 2), (16, 2), (16, 1), (8, 1))),
}

#: Warps per block beside the computing ones: wgmma_tf32x3's producer warpgroup loads and
#: splits the operands (flash_fwd.cu's produce_tf32x3).
PRODUCER_WARPS = {"wgmma_tf32x3": 4}

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
        """Threads per block: num_warps compute, plus the policy's producer warps."""
        return 32 * (self.num_warps + PRODUCER_WARPS.get(self.policy, 0))

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype if self.dtype != "bfloat16" else "float16").itemsize

    @functools.cached_property
    def name_expression(self) -> str:
        t = CXX_TYPE[self.dtype]
        policy = POLICIES[self.policy][0](t, self.rows_per_warp // 16)
        full = "true" if self.full else "false"
        return (f"flash::flash_fwd<{t}, {policy}, {self.head_dim}, {self.dv_tile}, {self.block_n}, "
                f"{self.num_warps}, {full}, {self.stages}>")

    @functools.cached_property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q (BLOCK_M, HD) and ``stages`` of K (BLOCK_N, HD) and V
        (BLOCK_N, DV); rows padded by 16 bytes, or (wgmma) swizzled without padding and
        1024 bytes of slack to align the tiles. wgmma_tf32x3 (flash_fwd.cu's Tf32x3Smem): Q,
        and per stage K and V^T, as hi and lo tiles, and per stage V as copied."""
        if self.policy == "wgmma_tf32x3":
            kv = self.stages * self.block_n * (2 * self.head_dim + 3 * self.dv_tile)
            return (2 * self.block_m * self.head_dim + kv) * self.itemsize + 1024
        pad, slack = (0, 1024) if self.policy == "wgmma" else (16 // self.itemsize, 0)
        kv = self.stages * self.block_n
        elems = (self.block_m + kv) * (self.head_dim + pad) + kv * (self.dv_tile + pad)
        return elems * self.itemsize + slack


def head_dim_bucket(dim: int) -> int:
    """The smallest bucket >= dim."""
    for bucket in HEAD_DIM_BUCKETS:
        if dim <= bucket:
            return bucket
    raise ValueError(f"head dim {dim} exceeds the largest kernel bucket {HEAD_DIM_BUCKETS[-1]}")


def policy_for(dtype: str, arch: int, allow_tf32: bool, portable: bool) -> str:
    """Which warp product: tensor cores on sm_80+ (float32 as three TF32 products per
    product unless one is allowed), else SIMT."""
    if portable or arch < 80:
        return "simt"
    return {"float16": "mma16", "bfloat16": "mma16", "float64": "dmma"}.get(
        dtype, "tf32" if allow_tf32 else "tf32x3"
    )


#: Padded head dims the wgmma forward takes (whole 64-column slabs of 128-byte swizzled
#: rows). Since the products overlap the softmax, 64 is faster on wgmma too (H200, L = 4096:
#: 0.90x FA2 against mma.sync's 0.81x): see bench/NOTES.md.
WGMMA_HEAD_DIMS = (64, 128, 256)


#: Padded head dims the 3xTF32 wgmma forward takes (plain kernels on sm_90; H100: 1.82-1.91x
#: SDPA-efficient at 128, against 1.26-1.30x before its producer warpgroup; bench/NOTES.md).
#: 96 keeps mma.sync: the producer's thread layout needs 128 threads to divide the copied
#: rows' chunks.
WGMMA_TF32_HEAD_DIMS = (128,)


#: Padded head dims the wgmma backward takes (without options, dQ fused): dK, dV, S^T, dP^T
#: and a dQ tile of 128 columns at most stay in registers.
WGMMA_BACKWARD_HEAD_DIMS = (64, 128, 256)


def forward_policy(dtype: str, hd: int, arch: int, allow_tf32: bool, portable: bool) -> str:
    """:func:`policy_for`, with float16/bfloat16 on sm_90 (wgmma needs sm_90a, which
    only compute capability 9.0 has) taking warpgroup products where the head dim allows."""
    policy = policy_for(dtype, arch, allow_tf32, portable)
    return "wgmma" if policy == "mma16" and arch == 90 and hd in WGMMA_HEAD_DIMS else policy


def arch_flag(arch: int) -> str:
    """NVRTC's -arch value for sm_``arch``: sm_90a on 9.0, for wgmma (a superset of sm_90)."""
    return f"sm_{arch}a" if arch == 90 else f"sm_{arch}"


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
    return _select_forward(dtype, d, dv, arch, smem_limit, allow_tf32,
                           force_portable() if portable is None else portable, full)


@functools.lru_cache(maxsize=4096)
def _select_forward(dtype: str, d: int, dv: int, arch: int, smem_limit: int, allow_tf32: bool, portable: bool,
                    full: bool) -> KernelSpec:
    """:func:`select_forward` with ``portable`` decided, computed once per distinct arguments."""
    hd = head_dim_bucket(max(d, dv))
    policy = forward_policy(dtype, hd, arch, allow_tf32, portable)
    if policy == "tf32x3" and arch == 90 and hd in WGMMA_TF32_HEAD_DIMS and not full:
        _, _, dv_cap, candidates = POLICIES["wgmma_tf32x3"]
        for block_n, warps in candidates(hd, full, arch):
            spec = KernelSpec(dtype, "wgmma_tf32x3", hd, min(hd, dv_cap(full)), block_n, warps, False, 2)
            if spec.smem_bytes <= smem_limit:
                return spec
    _, _, dv_cap, candidates = POLICIES[policy]
    dv_tile = min(hd, dv_cap(full))
    for block_n, warps in candidates(hd, full, arch):
        # A second K/V stage hides copies behind a whole tile of compute; wider heads would
        # pay for it in blocks per SM (measured on the H200: see bench/NOTES.md).
        # wgmma, with no register fragments of K and V, affords the second stage wherever it fits.
        spec = KernelSpec(dtype, policy, hd, dv_tile, block_n, warps, full, 2 if hd <= 64 else 1)
        if policy == "wgmma" and dataclasses.replace(spec, stages=2).smem_bytes <= smem_limit:
            spec = dataclasses.replace(spec, stages=2)
        if spec.smem_bytes <= smem_limit:
            return spec
    raise NoKernelError(
        f"no {dtype} kernel for head dims ({d}, {dv}) fits this GPU's {smem_limit // 1024} KiB of shared "
        f"memory per block (it needs {spec.smem_bytes // 1024} KiB); use backend='cpu'"
    )


def needs_full(bias: bool, mask: bool, block_mask: bool, alibi: bool, softcap: bool, dropout: bool) -> bool:
    """Whether a call needs the full score pipeline (anything beyond causal, window, lengths)."""
    return bias or mask or block_mask or alibi or softcap or dropout


#: Query rows per 128-thread block of the backward's row passes (flash_bwd_delta,
#: flash_bwd_dq_convert): flash_bwd.cu's ROW_PASS_ROWS, 8 lanes a row.
ROW_PASS_ROWS = 16


@dataclass(frozen=True)
class BackwardSpec:
    """The backward kernels of one problem (kernels_cu/flash_bwd.cu) and their tiles.

    ``fused_dq``: flash_bwd_dkdv also adds dS K into an accumulator-dtype buffer (zeroed
    by flash_bwd_delta) through atomics, and flash_bwd_dq_convert turns it into dQ, unless
    the buffer is dQ itself (``dq_accum_scaled`` at even head dims); otherwise (deterministic)
    flash_bwd_dq recomputes the scores query-major and writes dQ in a fixed order.
    """

    dtype: str
    policy: str      # key of POLICIES; tensor-core policies with one 16-row group per warp
    head_dim: int    # HD: padded head dim of q, k, v and dO in shared memory
    dq_chunk: int    # CH of the dQ kernel: gradient columns per block (unfused)
    kv_chunk: int    # CH of the dK/dV kernel (and of its dQ columns when fused)
    block_r: int     # rows of the block's own operand (16 per warp, or per pair of warps with two roles)
    block_c: int     # rows of the streamed operand per tile
    fused_dq: bool = False
    stages: int = 1  # shared-memory stages of the dK/dV kernel's streamed tiles
    full: bool = True  # the dK/dV kernel compiled with bias, ALiBi, softcap, masks and dropout
    mi: int = 1        # 16-key row groups per warp of the dK/dV kernel (2: float16/bfloat16 only)
    roles: int = 1     # warps per 16-key group of the dK/dV kernel (2: one for dV, one for dK)

    @property
    def threads(self) -> int:
        """Threads of the dK/dV kernel."""
        return 32 * self.roles * self.block_r // (16 * self.mi)

    @property
    def dq_threads(self) -> int:
        """Threads of the unfused dQ kernel: a warp per 16 queries."""
        return 2 * self.block_r

    @property
    def itemsize(self) -> int:
        return KernelSpec(self.dtype, self.policy, self.head_dim, 16, 16, 1).itemsize

    @property
    def acc_itemsize(self) -> int:
        return 8 if self.dtype == "float64" else 4

    def _kernel(self, name: str, chunk: int, *extra: str, mi: int = 1) -> str:
        t = CXX_TYPE[self.dtype]
        policy = POLICIES[self.policy][0](t, mi)
        return f"flash::{name}<{', '.join((t, policy, str(self.head_dim), str(chunk), str(self.block_r), str(self.block_c)) + extra)}>"

    def _acc_kernel(self, name: str, *extra: str) -> str:
        t = CXX_TYPE[self.dtype]
        return f"flash::{name}<{', '.join((t, 'double' if t == 'double' else 'float', *extra))}>"

    @property
    def dq_accum_scaled(self) -> bool:
        """Whether the fused dQ's accumulator holds dQ itself, not dQ / scale: float64 and
        float32 up to a head dim of 64 (flash_bwd.cu's kDqAccumScaled), and split roles, whose
        dS carries the scale (kScaledDs)."""
        return self.dtype == "float64" or (self.dtype == "float32" and self.head_dim <= 64) or self.roles == 2

    @property
    def delta_name(self) -> str:
        return self._acc_kernel("flash_bwd_delta")

    @property
    def dq_name(self) -> str:
        """The kernel that writes dQ: the converter when fused, else the query-major kernel."""
        if self.fused_dq:
            return self._acc_kernel("flash_bwd_dq_convert", "true" if self.dq_accum_scaled else "false")
        return self._kernel("flash_bwd_dq", self.dq_chunk)

    @property
    def dkdv_name(self) -> str:
        flag = {True: "true", False: "false"}
        return self._kernel("flash_bwd_dkdv", self.kv_chunk, flag[self.fused_dq], str(self.stages), flag[self.full],
                            str(self.roles), mi=self.mi)

    def _row_bytes(self) -> int:
        return (self.head_dim + 16 // self.itemsize) * self.itemsize  # rows padded by 16 bytes

    @property
    def dq_smem_bytes(self) -> int:
        """flash_bwd_dq: Q and dO (block_r, HD), K and V (block_c, HD); the converter none."""
        return 0 if self.fused_dq else 2 * (self.block_r + self.block_c) * self._row_bytes()

    @property
    def presplit(self) -> bool:
        """Whether the dK/dV kernel splits its K, V, Q and dO tiles into TF32 hi and lo tiles in
        shared memory once (flash_bwd_dkdv's PRESPLIT): 3xTF32 with two roles, one stage."""
        return self.policy == "tf32x3" and self.roles == 2

    @property
    def dkdv_smem_bytes(self) -> int:
        """K and V (block_r, HD); per stage Q and dO (block_c, HD), lse and D (block_c); when
        fused, dS^T (block_r, block_c) padded by 16 bytes per row, in T on the float16/bfloat16
        tensor cores and in the accumulator dtype otherwise; with two roles, P^T (block_r,
        block_c) in the accumulator dtype; ``presplit``: the K, V, Q and dO tiles twice (hi and
        lo). wgmma: the tiles swizzled without padding (dS^T in T), and 1024 bytes of slack
        to align them."""
        stats = self.stages * 2 * self.block_c * self.acc_itemsize
        if self.policy == "wgmma":
            elems = (2 * self.block_r + 2 * self.stages * self.block_c) * self.head_dim + self.block_r * self.block_c
            return elems * self.itemsize + stats + 1024
        pelem = self.itemsize if self.policy == "mma16" else self.acc_itemsize
        ds = self.block_r * (self.block_c * pelem + 16) if self.fused_dq else 0
        handoff = self.block_r * self.block_c * self.acc_itemsize if self.roles == 2 else 0
        tiles = (2 * self.block_r + 2 * self.stages * self.block_c) * self._row_bytes() * (2 if self.presplit else 1)
        return tiles + stats + ds + handoff

    @property
    def smem_bytes(self) -> int:
        return max(self.dq_smem_bytes, self.dkdv_smem_bytes)

    @functools.cached_property
    def kernels(self) -> tuple[tuple[str, int], ...]:
        """(name expression, dynamic shared memory) of the three launches, in launch order."""
        return ((self.delta_name, 0), (self.dkdv_name, self.dkdv_smem_bytes), (self.dq_name, self.dq_smem_bytes))


def select_backward(dtype: str, d: int, dv: int, arch: int, smem_limit: int, allow_tf32: bool = False,
                    portable: bool | None = None, deterministic: bool = False, full: bool = True) -> BackwardSpec:
    """The backward kernels for this problem on a GPU of compute capability ``arch``.

    Gradient columns come in chunks (float16/bfloat16 on tensor cores and 3xTF32 without
    options: up to 128; float64 without options on sm_90: the whole head up to 128, its dK
    and dV in two warps; float64 without tensor cores or above D = 128: 32; otherwise 64) so
    that dK and dV (or dQ) stay in registers beside S and dP whatever the head dim.
    ``deterministic`` takes the unfused, order-fixed dQ kernel; ``full`` as for
    :func:`select_forward`. Raises NoKernelError when no tile fits.
    """
    return _select_backward(dtype, d, dv, arch, smem_limit, allow_tf32,
                            force_portable() if portable is None else portable, deterministic, full)


@functools.lru_cache(maxsize=4096)
def _select_backward(dtype: str, d: int, dv: int, arch: int, smem_limit: int, allow_tf32: bool, portable: bool,
                     deterministic: bool, full: bool) -> BackwardSpec:
    """:func:`select_backward` with ``portable`` decided, computed once per distinct arguments."""
    policy = policy_for(dtype, arch, allow_tf32, portable)
    hd = head_dim_bucket(max(d, dv))
    if policy == "mma16" and arch == 90 and hd in WGMMA_BACKWARD_HEAD_DIMS and not (deterministic or full):
        # Hopper (flash_bwd_dkdv's warpgroup branch): two warpgroups of 64 keys; up to D = 128
        # the whole head in one chunk, D = 256 in two (S^T and dP^T recomputed per chunk);
        # 128-query tiles at D <= 64 (every product at least 64 wide: H100, L = 4096, 1.09x
        # FA2 against 0.91x with 64), 64 above; two stages where they fit.
        spec = BackwardSpec(dtype, "wgmma", hd, hd, min(hd, 128), 128, 128 if hd <= 64 else 64, True, 2, False, 1)
        if spec.smem_bytes > smem_limit:
            spec = dataclasses.replace(spec, stages=1)
        if spec.smem_bytes <= smem_limit:
            return spec
    wide = dtype == "float64"
    # (block_r, block_c, 16-key groups per warp of the dK/dV kernel)
    tiles = ((64, 16, 1), (32, 16, 1), (16, 16, 1)) if wide else (
        (64, 32, 1), (64, 16, 1), (32, 16, 1), (16, 16, 1))
    # 3xTF32 at D <= 64 (plain kernels): 128 keys x 64 queries, 8 warps, where two stages fit
    # (H100, L = 1024 / 4096: 1.58-1.59x SDPA-efficient non-causal against 1.45-1.50x with 64
    # x 32; 128 x 32 and 64 x 64 alone were slower: bench/NOTES.md, session 10)
    x3_wide = policy == "tf32x3" and hd <= 64 and not full and not deterministic
    if x3_wide:
        tiles = ((128, 64, 1),) + tiles
    if policy == "mma16" and not deterministic:
        # 128 keys a block share each streamed tile (fewer dQ atomics per key); 64 queries
        # per tile, or two key groups per warp (D <= 32), only where S and dP of that size
        # fit beside dK and dV without a spill (measured: bench/NOTES.md).
        tiles = ((128, 32, 2),) * (hd <= 32) + ((128, 64, 1),) * (hd <= 64 and not full) + ((128, 32, 1),) + tiles
    # dK and dV of a 128-wide chunk take 128 registers a thread; beside the full score
    # pipeline that spills at D > 128 (two chunks or more anyway), and on sm_80..sm_89 at
    # D = 128 as well (ptxas: 16 bytes; sm_90's allocation fits), so those take 64.
    narrow = full and (hd > 128 or (hd > 64 and arch < 90))
    # 3xTF32 (plain kernels) takes the whole head up to D = 128 in one chunk, so S and dP are
    # not recomputed per chunk (1.4x at D = 128 on the H200: bench/NOTES.md); with one role,
    # 32 keys a block, as 64 spill (ptxas, sm_80 and sm_90), as do the full score pipeline and
    # the deterministic dQ's (sm_80 to sm_89) beside it.
    x3_whole = policy == "tf32x3" and hd <= 128 and not full and not deterministic
    if policy == "mma16":
        kv_chunk = 64 if narrow else 128
    elif wide and (policy == "simt" or hd > 128):
        kv_chunk = 32
    else:
        kv_chunk = 128 if x3_whole else 64
    kv_chunk = min(hd, kv_chunk)
    # float64 on tensor cores: up to D = 128, 64-wide chunks (D = 128 in two, not four, so S
    # and dP are recomputed half as often; without options on sm_90 one chunk of split roles,
    # below) fit without a spill, in the plain kernel too since
    # its masked tiles test the band without branches (ptxas, sm_80 to sm_90); the plain
    # kernel is 1.26-1.39x faster (H100, D = 64 and 128: bench/NOTES.md). Deterministic
    # float64 keeps the full one: its plain kernel without fused dQ spills 4 bytes at D = 64
    # on sm_90.
    full = full or (policy == "dmma" and deterministic)
    if policy == "tf32" or (policy == "tf32x3" and hd > 64):
        # 32 streamed rows spill beside the TF32 fragments (ptxas, sm_80 and sm_90); and
        # 3xTF32 at D = 128 runs faster with 16 (H200: bench/NOTES.md)
        tiles = tuple(tile for tile in tiles if tile[1] != 32)
    if x3_whole and hd > 64:
        tiles = tuple(tile for tile in tiles if tile[0] != 64)
    # Split roles (flash_bwd_dkdv's ROLES = 2) for float64 and 3xTF32 plain kernels at D = 96
    # and 128 on sm_90: two warps share each 16 keys, one computing S^T, P and dV, the other
    # dP^T, dS and dK, so each holds one gradient of the whole head. float64 then takes one
    # chunk, not two that each recompute S^T and dP^T, with 8 warps in the one block shared
    # memory admits per SM (4 before): 1.9-2.1x faster. 3xTF32 affords 64 keys a block and
    # 32 or 48 streamed rows without a spill: 1.08-1.17x faster (H100: bench/NOTES.md).
    # Smaller shared memories (sm_80 to sm_89, and sm_100 and later, unmeasured) would shrink
    # the key tiles; those keep one role. Only tiles of fused dQ (16-row streamed tiles).
    roles = 2 if policy in ("dmma", "tf32x3") and 64 < hd <= 128 and not (full or deterministic) and arch == 90 else 1
    if roles == 2:
        kv_chunk = hd
        if policy == "tf32x3":
            tiles = ((64, 48 if hd <= 96 else 32, 1),) + tiles
        tiles = tuple(tile for tile in tiles if tile[1] % 16 == 0)
    if policy != "mma16":  # m16n8k16 consumes 16 streamed rows at a time; the others 8 or 4
        tiles += ((16, 8, 1),)
    dq_chunk = min(hd, 128) if policy == "mma16" else kv_chunk
    fused = not deterministic
    for block_r, block_c, mi in tiles:
        spec = BackwardSpec(dtype, policy, hd, dq_chunk, kv_chunk, block_r, block_c, fused and block_c % 16 == 0,
                            2, full, mi, roles)
        # A second stage of the streamed tiles only while as many blocks fit on an SM as its
        # registers allow (these kernels take up to 255 a thread: 256 threads fill the file),
        # and never beside the pre-split tiles (their kernel copies during the dQ product).
        if spec.presplit or max(1, 256 // spec.threads) * spec.smem_bytes > smem_limit:
            if x3_wide and (block_r, block_c) == (128, 64):
                continue  # its gain was measured with two stages only
            spec = dataclasses.replace(spec, stages=1)
        if spec.smem_bytes <= smem_limit:
            return spec
    raise NoKernelError(
        f"no {dtype} backward kernel for head dims ({d}, {dv}) fits this GPU's {smem_limit // 1024} KiB of "
        f"shared memory per block (it needs {spec.smem_bytes // 1024} KiB); use backend='cpu'"
    )


def backward_key_block_major(spec: BackwardSpec, causal: bool) -> bool:
    """Whether flash_bwd_dkdv takes its blocks key block by key block over all the heads
    (heavy first: under a causal mask a head's first key blocks see every query) instead of
    head by head: causal float32 and float64, 3-11% faster (H100, session 16 in
    bench/NOTES.md). Not 16-bit, whose faster kernels then stream the queries of every head
    through L2 at once: 6-7% slower at L = 16384."""
    return causal and spec.dtype in ("float32", "float64")


def all_backward_specs(arch: int) -> list[BackwardSpec]:
    """Every spec :func:`select_backward` can return on ``arch``."""
    specs = set()
    for dtype in CXX_TYPE:
        for bucket in HEAD_DIM_BUCKETS:
            for allow_tf32 in (False, True):
                for portable in (False, True):
                    for deterministic in (False, True):
                        for full in (False, True):
                            try:
                                specs.add(select_backward(dtype, bucket, bucket, arch, ARCH_SMEM[arch], allow_tf32,
                                                          portable, deterministic, full))
                            except NoKernelError:
                                pass
    return sorted(specs, key=lambda s: (s.dtype, s.policy, s.head_dim, s.block_r, s.block_c, s.fused_dq, s.full, s.mi))


def all_kernels(arch: int) -> list[tuple[str, str, int]]:
    """(source family, name expression, dynamic shared memory) of every kernel the dispatcher
    can launch on ``arch``, forward and backward, each once."""
    kernels = {s.name_expression: ("forward", s.name_expression, s.smem_bytes) for s in all_forward_specs(arch)}
    for s in all_backward_specs(arch):
        for name, smem in s.kernels:
            kernels[name] = ("backward", name, smem)
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
