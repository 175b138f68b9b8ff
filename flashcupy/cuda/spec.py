"""Kernel choice and tile sizes for the CUDA backend: the only place they are decided.

Kernel choice is two ordered rule tables, :data:`FORWARD_RULES` and :data:`BACKWARD_RULES`.
A rule has a name, a condition on the call (:class:`Call`: dtype, padded head dim, compute
capability, options, determinism), the pipeline it builds (product policy, mainloop, chunks)
and its tile candidates in order of preference. The first rule whose condition holds is
tried: its first candidate that fits the GPU's shared memory wins; a rule marked
``fallback`` hands a call none of its candidates fits to the rules after it. Every choice
compiles without register spills with no score option and, for tensor-core kernels, with any
single option; tests/test_kernels_compile.py checks each architecture with none and with
every option at once, and bench/option_spills.py every option set (some multi-option sets
spill: bench/NOTES.md, 'Open: score options'); each rule's ``why`` says what it is for,
and bench/NOTES.md holds the figures behind the choices. :func:`explain_forward` and
:func:`explain_backward` say which rule fired and which candidates did not fit
(``python -m flashcupy explain``).

A :class:`KernelSpec` names one instantiation of ``flash::flash_fwd``
(``kernels_cu/flash_fwd.cu``): mainloop, score modifiers, shared memory and threads, which
the kernel checks at compile time against its own. A :class:`BackwardSpec` names the
backward's three launches (``kernels_cu/flash_bwd.cu``). :func:`all_forward_specs` and
:func:`all_backward_specs` list every spec the tables can return for an architecture, which
CI compiles.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np

#: Padded head-dim buckets: the kernels' HD template argument.
HEAD_DIM_BUCKETS = (32, 64, 96, 128, 256, 512)

#: C++ element type per dtype name.
CXX_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}

#: The C++ product policy (kernels_cu/mma/) of each policy name, for an element type and
#: 16-row groups per warp.
POLICIES: dict[str, Callable[[str, int], str]] = {
    "mma16": lambda t, mi: f"flash::MmaF16<{t}, {mi}>",
    "wgmma": lambda t, mi: f"flash::MmaWgmma<{t}>",
    "tf32": lambda t, mi: f"flash::MmaTf32<false, {mi}>",
    "tf32x3": lambda t, mi: f"flash::MmaTf32<true, {mi}>",
    "dmma": lambda t, mi: "flash::MmaF64",
    "wgmma_tf32x3": lambda t, mi: "flash::MmaWgmmaTf32x3",
    "simt": lambda t, mi: f"flash::Simt<{t}, {'double' if t == 'double' else 'float'}>",
}

#: Warps per block beside the computing ones: the producer-consumer mainloop's producer
#: warpgroup loads and splits the operands.
PRODUCER_WARPS = {"wgmma_tf32x3": 4}

#: Environment variable forcing the portable (SIMT) kernels, as on GPUs before sm_80.
FORCE_PORTABLE_ENV = "FLASHCUPY_FORCE_PORTABLE"

#: Padded head dims the wgmma forward and backward take (whole 64-column slabs of 128-byte
#: swizzled rows), and those of the 3xTF32 wgmma forward (its producer's thread layout needs
#: 128 threads to divide the copied rows' chunks: 96 keeps mma.sync).
WGMMA_HEAD_DIMS = (64, 128, 256)
WGMMA_BACKWARD_HEAD_DIMS = (64, 128, 256)
WGMMA_TF32_HEAD_DIMS = (128,)

#: Opt-in shared memory per block (bytes) of each architecture CI compiles for.
ARCH_SMEM = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}

#: Threads and query rows per block of the backward's row passes (flash_bwd_delta,
#: flash_bwd_dq_convert), 8 lanes a row (flash_bwd.cu's ROW_LANES checks the pair).
ROW_PASS_THREADS = 128
ROW_PASS_ROWS = 16

#: Threads per block of flash::tile_map (kernels_cu/score/tile_map.cuh; its THREADS).
TILE_MAP_THREADS = 256


#: The score options a kernel is compiled for, in flash::ScoreMod's order
#: (kernels_cu/score/modifiers.cuh), each named there as kMod + its CamelCase name.
SCORE_MODS = ("softcap", "bias", "alibi", "mask", "block_mask", "dropout")


@dataclass(frozen=True)
class ScoreSet:
    """The options a kernel is compiled for (flash::ScoreMods): some of :data:`SCORE_MODS`, in
    that order, and the bias' dtype name (exactly when "bias" is one of them). Causal, window
    and lengths are run-time parameters of every kernel; the plain set (no mods) is
    flash::PlainScores."""

    mods: tuple[str, ...] = ()
    bias_dtype: str | None = None

    def __post_init__(self) -> None:
        if tuple(m for m in SCORE_MODS if m in self.mods) != self.mods:
            raise ValueError(f"mods: expected some of {SCORE_MODS} in that order, received {self.mods!r}")
        if ("bias" in self.mods) != (self.bias_dtype is not None) or (
                self.bias_dtype is not None and self.bias_dtype not in CXX_TYPE):
            raise ValueError(f"bias_dtype: expected one of {tuple(CXX_TYPE)} exactly with a bias, received "
                             f"{self.bias_dtype!r} with mods {self.mods!r}")

    @classmethod
    @functools.lru_cache(maxsize=None)  # every call builds its set: one lookup, not a validation
    def of(cls, *, bias_dtype: str | None = None, mask: bool = False, block_mask: bool = False,
           alibi: bool = False, softcap: bool = False, dropout: bool = False) -> "ScoreSet":
        """The set of a call's options (bias_dtype: the bias' dtype name, None without one)."""
        present = {"softcap": softcap, "bias": bias_dtype is not None, "alibi": alibi, "mask": mask,
                   "block_mask": block_mask, "dropout": dropout}
        return cls(tuple(m for m in SCORE_MODS if present[m]), bias_dtype)

    @property
    def full(self) -> bool:
        """Some option beyond causal, window and lengths (the rules' smaller tiles)."""
        return bool(self.mods)

    @property
    def masks(self) -> bool:
        """A mask or block mask (flash::ScoreMods::kMasks): the kernels walk a tile map."""
        return "mask" in self.mods or "block_mask" in self.mods

    @property
    def cxx(self) -> str:
        """The C++ type: flash::ScoreMods<bits, bias type>, or flash::PlainScores."""
        if not self.mods:
            return "flash::PlainScores"
        bits = " | ".join("flash::kMod" + "".join(w.title() for w in m.split("_")) for m in self.mods)
        return f"flash::ScoreMods<{bits}{', ' + CXX_TYPE[self.bias_dtype] if self.bias_dtype else ''}>"

    def __str__(self) -> str:
        if not self.mods:
            return "PlainScores"
        return "ScoreMods: " + ", ".join(f"bias ({self.bias_dtype})" if m == "bias" else m for m in self.mods)


class TileMap(NamedTuple):
    """One ``flash::tile_map`` launch (kernels_cu/score/tile_map.cuh) a kernel with masks needs
    before it: for tiles of ``rows`` queries and ``cols`` keys, query-major (the forward's and
    the dQ kernel's row blocks walking key tiles) or ``key_major`` (the dK/dV kernel's key
    blocks walking query tiles). The tiles are the kernel's own, from its spec; ``backward``:
    launched with the backward's parameter block (flash::BwdParams)."""

    rows: int
    cols: int
    key_major: bool
    scores: ScoreSet
    backward: bool

    @property
    def family(self) -> str:
        """The source family it is compiled and launched with: its kernels'."""
        return "backward" if self.backward else "forward"

    @property
    def name(self) -> str:
        """The name expression of the map kernel."""
        flag = lambda b: "true" if b else "false"  # noqa: E731
        return (f"flash::tile_map<{self.rows}, {self.cols}, {flag(self.key_major)}, "
                f"{flag('mask' in self.scores.mods)}, {flag('block_mask' in self.scores.mods)}, {TILE_MAP_THREADS}, "
                f"flash::{'BwdParams' if self.backward else 'Params'}>")

    def outer_tiles(self, lq: int, lk: int) -> int:
        """Outer tiles (grid x) of an (lq, lk) frame: row tiles, or key tiles when key-major."""
        return -(-lk // self.cols) if self.key_major else -(-lq // self.rows)

    def inner_tiles(self, lq: int, lk: int) -> int:
        """Map entries per outer tile: key tiles, or query tiles when key-major."""
        return -(-lq // self.rows) if self.key_major else -(-lk // self.cols)


def score_tile_bytes(scores: ScoreSet, rows: int, cols: int) -> int:
    """Shared memory of one stage of a kernel's staged score operands
    (kernels_cu/score/tiles.cuh's ScoreTiles::kStageBytes): the (rows, cols) bias tile in its
    own dtype and the mask tile in bytes, rows padded by 16 bytes (the mask's keys first
    rounded up to 16). The forward's tiles are (block_m, block_n), the wgmma backward's
    (block_c, block_r)."""
    size = 0
    if "bias" in scores.mods:
        item = np.dtype(scores.bias_dtype if scores.bias_dtype != "bfloat16" else "float16").itemsize
        size += rows * (cols + 16 // item) * item
    if "mask" in scores.mods:
        size += rows * ((cols + 15) // 16 * 16 + 16)
    return size


#: The plain set, and every option at once (a float32 bias): the two sets compile checks cover.
PLAIN = ScoreSet()
EVERY_OPTION = ScoreSet(SCORE_MODS, "float32")


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
    scores: ScoreSet = PLAIN  # the score options compiled in
    stages: int = 1    # shared-memory stages of K and V
    mi: int = 1        # 16-row groups per warp

    @property
    def full(self) -> bool:
        """Compiled with some option beyond causal, window and lengths."""
        return self.scores.full

    @property
    def rows_per_warp(self) -> int:
        return 16 * self.mi

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

    @property
    def mainloop(self) -> str:
        """The forward mainloop (kernels_cu/mainloop/fwd_*.cuh): the producer-consumer pipeline
        for wgmma_tf32x3, the overlapped one for wgmma (but beside score options at
        head dims above 128, where its second score buffer spills), else the serial one."""
        if self.policy == "wgmma_tf32x3":
            return "FwdProducerConsumer"
        if self.policy == "wgmma" and not (self.full and self.head_dim > 128):
            return "FwdOverlap"
        return "FwdSerial"

    @functools.cached_property
    def name_expression(self) -> str:
        t = CXX_TYPE[self.dtype]
        tiles = f"{self.head_dim}, {self.dv_tile}, {self.block_n}"
        if self.mainloop == "FwdProducerConsumer":
            mainloop = f"flash::FwdProducerConsumer<{tiles}>"
        elif self.mainloop == "FwdOverlap":
            mainloop = f"flash::FwdOverlap<{t}, {tiles}, {self.num_warps}>"
        else:
            policy = POLICIES[self.policy](t, self.mi)
            mainloop = f"flash::FwdSerial<{t}, {policy}, {tiles}, {self.num_warps}, {self.stages}>"
        return f"flash::flash_fwd<{mainloop}, {self.scores.cxx}, {self.smem_bytes}, {self.threads}>"

    @property
    def tile_maps(self) -> tuple[TileMap, ...]:
        """The tile map the kernel walks where masks are compiled in (launched before it)."""
        return (TileMap(self.block_m, self.block_n, False, self.scores, False),) if self.scores.masks else ()

    @functools.cached_property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: Q (BLOCK_M, HD) and ``stages`` of K (BLOCK_N, HD) and V
        (BLOCK_N, DV); rows padded by 16 bytes, or (wgmma) swizzled without padding and
        1024 bytes of slack to align the tiles; ``stages`` of the staged bias and mask tiles
        (:func:`score_tile_bytes`). wgmma_tf32x3 (flash_fwd.cu's Tf32x3Smem): Q,
        and per stage K and V^T, as hi and lo tiles, and per stage V as copied."""
        if self.policy == "wgmma_tf32x3":
            kv = self.stages * self.block_n * (2 * self.head_dim + 3 * self.dv_tile)
            return (2 * self.block_m * self.head_dim + kv) * self.itemsize + 1024
        pad, slack = (0, 1024) if self.policy == "wgmma" else (16 // self.itemsize, 0)
        kv = self.stages * self.block_n
        elems = (self.block_m + kv) * (self.head_dim + pad) + kv * (self.dv_tile + pad)
        return elems * self.itemsize + slack + self.stages * score_tile_bytes(self.scores, self.block_m, self.block_n)


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
    scores: ScoreSet = PLAIN  # the score options compiled into the dK/dV and dQ kernels
    mi: int = 1        # 16-key row groups per warp of the dK/dV kernel (2: float16/bfloat16 only)
    roles: int = 1     # warps per 16-key group of the dK/dV kernel (2: one for dV, one for dK)

    @property
    def full(self) -> bool:
        """Compiled with some option beyond causal, window and lengths."""
        return self.scores.full

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

    @property
    def dq_accum(self) -> int:
        """What dQ's accumulator holds (kernels_cu/mainloop/bwd_common.cuh's DqAccum): 0 no
        accumulator (dQ has its own kernel), 1 dQ / scale (the converter scales it), 2 dQ itself."""
        return 0 if not self.fused_dq else 2 if self.dq_accum_scaled else 1

    @property
    def dq_accum_scaled(self) -> bool:
        """Whether the fused dQ's accumulator holds dQ itself, not dQ / scale: float64 and
        float32 up to a head dim of 64 (the atomics multiply by the scale; above 64 that costs
        float32 more than the conversion pass), and split roles, whose dS carries the scale."""
        return self.dtype == "float64" or (self.dtype == "float32" and self.head_dim <= 64) or self.roles == 2

    @property
    def mainloop(self) -> str:
        """The dK/dV mainloop (kernels_cu/mainloop/bwd_*.cuh)."""
        if self.policy == "wgmma":
            return "BwdWgmma"
        return "BwdSplitRoles" if self.roles == 2 else "BwdWarp"

    def _policy(self, mi: int = 1) -> str:
        return POLICIES[self.policy](CXX_TYPE[self.dtype], mi)

    def _row_pass(self, name: str, *extra: str) -> str:
        t = CXX_TYPE[self.dtype]
        acc = "double" if t == "double" else "float"
        return f"flash::{name}<{', '.join((t, acc, *extra, str(ROW_PASS_THREADS), str(ROW_PASS_ROWS)))}>"

    @property
    def delta_name(self) -> str:
        return self._row_pass("flash_bwd_delta")

    @property
    def dq_name(self) -> str:
        """The kernel that writes dQ: the converter when fused, else the query-major kernel."""
        if self.fused_dq:
            return self._row_pass("flash_bwd_dq_convert", "true" if self.dq_accum_scaled else "false")
        t = CXX_TYPE[self.dtype]
        return (f"flash::flash_bwd_dq<{t}, {self._policy()}, {self.scores.cxx}, {self.head_dim}, {self.dq_chunk}, "
                f"{self.block_r}, "
                f"{self.block_c}, {self.dq_smem_bytes}, {self.dq_threads}>")

    @property
    def dkdv_name(self) -> str:
        t = CXX_TYPE[self.dtype]
        if self.mainloop == "BwdWgmma":
            mainloop = (f"flash::BwdWgmma<{t}, {self.head_dim}, {self.kv_chunk}, {self.block_r}, {self.block_c}, "
                        f"{self.dq_accum}, {self.stages}>")
        elif self.mainloop == "BwdSplitRoles":
            mainloop = (f"flash::BwdSplitRoles<{t}, {self._policy()}, {self.head_dim}, {self.block_r}, "
                        f"{self.block_c}, {self.stages}>")
        else:
            mainloop = (f"flash::BwdWarp<{t}, {self._policy(self.mi)}, {self.head_dim}, {self.kv_chunk}, "
                        f"{self.block_r}, {self.block_c}, {self.dq_accum}, {self.stages}>")
        return f"flash::flash_bwd_dkdv<{mainloop}, {self.scores.cxx}, {self.dkdv_smem_bytes}, {self.threads}>"

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
        lo). wgmma: the tiles swizzled without padding (dS^T in T) and 1024 bytes of slack
        to align them. Either: per stage the staged bias and mask tiles (``stages_scores``)."""
        stats = self.stages * 2 * self.block_c * self.acc_itemsize
        if self.policy == "wgmma":
            elems = (2 * self.block_r + 2 * self.stages * self.block_c) * self.head_dim + self.block_r * self.block_c
            staged = self.stages * score_tile_bytes(self.scores, self.block_c, self.block_r) if self.stages_scores else 0
            return elems * self.itemsize + stats + 1024 + staged
        pelem = self.itemsize if self.policy == "mma16" else self.acc_itemsize
        ds = self.block_r * (self.block_c * pelem + 16) if self.fused_dq else 0
        handoff = self.block_r * self.block_c * self.acc_itemsize if self.roles == 2 else 0
        tiles = (2 * self.block_r + 2 * self.stages * self.block_c) * self._row_bytes() * (2 if self.presplit else 1)
        staged = self.stages * score_tile_bytes(self.scores, self.block_c, self.block_r) if self.stages_scores else 0
        return tiles + stats + ds + handoff + staged

    @property
    def stages_scores(self) -> bool:
        """Whether the dK/dV kernel copies each query tile's bias and mask windows into shared
        memory with its Q (the mainloops' Staged): sets with options but softcap, on wgmma
        (kernels_cu/mainloop/bwd_wgmma.cuh) up to a padded head dim of 128 in its two element
        passes (gradient chunks of 64 columns, or no bias and no dropout), on the one-role warp
        kernels (bwd_warp.cuh) of mma16, tf32, tf32x3 (not with a bias and a mask together) and
        dmma with a bias or a mask, but not a bias, a mask and dropout together (they spill);
        the rest read them per score."""
        mods = set(self.scores.mods)
        if not self.scores.full or "softcap" in mods:
            return False
        if self.policy == "wgmma":
            return self.head_dim <= 128 and (self.kv_chunk <= 64 or not mods & {"bias", "dropout"})
        return (not {"bias", "mask", "dropout"} <= mods and self.mainloop == "BwdWarp"
                and self.policy in ("mma16", "tf32", "tf32x3", "dmma") and bool(mods & {"bias", "mask"})
                and not (self.policy == "tf32x3" and {"bias", "mask"} <= mods))

    @property
    def smem_bytes(self) -> int:
        return max(self.dq_smem_bytes, self.dkdv_smem_bytes)

    @property
    def tile_maps(self) -> tuple[TileMap, ...]:
        """The tile maps the kernels walk where masks are compiled in (launched before them):
        the dK/dV kernel's key-major one (block_r keys a block, query tiles of block_c) and,
        unfused, the dQ kernel's query-major one (block_r queries, key tiles of block_c)."""
        if not self.scores.masks:
            return ()
        dkdv = TileMap(self.block_c, self.block_r, True, self.scores, True)
        return (dkdv,) if self.fused_dq else (dkdv, TileMap(self.block_r, self.block_c, False, self.scores, True))

    @functools.cached_property
    def kernels(self) -> tuple[tuple[str, int], ...]:
        """(name expression, dynamic shared memory) of the three launches, in launch order."""
        return ((self.delta_name, 0), (self.dkdv_name, self.dkdv_smem_bytes), (self.dq_name, self.dq_smem_bytes))


def head_dim_bucket(dim: int) -> int:
    """The smallest bucket >= dim."""
    for bucket in HEAD_DIM_BUCKETS:
        if dim <= bucket:
            return bucket
    raise ValueError(f"head dim {dim} exceeds the largest kernel bucket {HEAD_DIM_BUCKETS[-1]}")


def arch_flag(arch: int) -> str:
    """NVRTC's -arch value for sm_``arch``: sm_90a on 9.0, for wgmma (a superset of sm_90)."""
    return f"sm_{arch}a" if arch == 90 else f"sm_{arch}"


def force_portable() -> bool:
    """True when FLASHCUPY_FORCE_PORTABLE is set to 1 (tests use it to run the sm_60-75 path)."""
    return os.environ.get(FORCE_PORTABLE_ENV, "0") == "1"


@dataclass(frozen=True)
class Call:
    """What kernel choice depends on: the dtype, the padded head dim ``hd`` (the bucket of
    max(D, Dv)), the compute capability (e.g. 90) and its opt-in shared memory per block,
    and the options."""

    dtype: str
    hd: int
    arch: int
    smem_limit: int
    allow_tf32: bool = False
    portable: bool = False    # FLASHCUPY_FORCE_PORTABLE: the SIMT kernels whatever the GPU
    scores: ScoreSet = PLAIN  # the options beyond causal, window and lengths
    deterministic: bool = False

    @property
    def full(self) -> bool:
        """Some option beyond causal, window and lengths: the smaller tiles their registers need."""
        return self.scores.full

    @property
    def simt(self) -> bool:
        """No tensor-core kernel: forced, or a GPU before sm_80."""
        return self.portable or self.arch < 80

    @property
    def f16(self) -> bool:
        return self.dtype in ("float16", "bfloat16") and not self.simt

    @property
    def f64(self) -> bool:
        return self.dtype == "float64" and not self.simt

    @property
    def x3(self) -> bool:
        """float32 at float32 accuracy: three TF32 products per product (3xTF32)."""
        return self.dtype == "float32" and not self.allow_tf32 and not self.simt

    @property
    def tf32(self) -> bool:
        """float32 with allow_tf32: one TF32 product per product."""
        return self.dtype == "float32" and self.allow_tf32 and not self.simt

    @property
    def hopper(self) -> bool:
        """sm_90a's warpgroup products (compute capability 9.0 only)."""
        return self.arch == 90 and not self.simt


# ----------------------------------------------------------------------------- forward rules


@dataclass(frozen=True)
class ForwardRule:
    """Forward kernels for the calls ``when`` accepts: the product ``policy`` with ``mi_plain``
    16-row groups per warp with PlainScores (options' registers leave room for one), a Dv
    chunk of at most ``dv_cap`` columns, and (BLOCK_N, NUM_WARPS) ``tiles`` (a tuple or a
    function of the call) in order of preference, with ``stages`` shared-memory stages of K
    and V (0: two up to a padded head dim of 64, one above; wgmma: always two)."""

    name: str
    when: Callable[[Call], bool]
    policy: str
    tiles: tuple[tuple[int, int], ...] | Callable[[Call], tuple[tuple[int, int], ...]]
    why: str
    mi_plain: int = 1
    dv_cap: int = 128
    stages: int = 0
    fallback: bool = False

    def candidates(self, call: Call) -> list[KernelSpec]:
        dv_tile = min(call.hd, self.dv_cap)
        out = []
        for block_n, warps in self.tiles(call) if callable(self.tiles) else self.tiles:
            # The wgmma mainloops take two stages (a candidate they do not fit is passed over).
            stages = 2 if self.policy == "wgmma" else self.stages or (2 if call.hd <= 64 else 1)
            mi = 1 if call.full else self.mi_plain
            out.append(KernelSpec(call.dtype, self.policy, call.hd, dv_tile, block_n, warps, call.scores, stages, mi))
        return out


_F16_NARROW = ((64, 4), (32, 4), (32, 2), (16, 2), (16, 1))
_SMALL = ((32, 4), (32, 2), (16, 2), (16, 1), (8, 1))

#: The forward's rules, in order (see the module docstring).
FORWARD_RULES: tuple[ForwardRule, ...] = (
    ForwardRule("portable", lambda c: c.simt, "simt", _SMALL, dv_cap=64,
                why="no tensor cores (before sm_80, or FLASHCUPY_FORCE_PORTABLE=1): FMA products on any GPU"),
    ForwardRule("3xtf32-producer-consumer",
                lambda c: c.x3 and c.hopper and c.hd in WGMMA_TF32_HEAD_DIMS and not c.full,
                "wgmma_tf32x3", ((32, 4),), stages=2, fallback=True,
                why="float32 on Hopper's TF32 warpgroup products, a producer warpgroup splitting the operands "
                    "into hi and lo tiles for one consumer warpgroup (bench/NOTES.md, 'Forward float32: "
                    "TF32 wgmma with a producer warpgroup')"),
    ForwardRule("wgmma16-overlap", lambda c: c.f16 and c.hopper and c.hd in (64, 128) and not c.full,
                "wgmma", ((64, 4), (128, 8)), dv_cap=256,
                why="Hopper's warpgroup products with the softmax overlapped; one warpgroup and 64-key tiles, "
                    "so two or three blocks share an SM (bench/NOTES.md, 'Forward 16-bit: one warpgroup and "
                    "64-key tiles up to D = 128')"),
    ForwardRule("wgmma16-256", lambda c: c.f16 and c.hopper and c.hd == 256 and not c.full, "wgmma",
                ((64, 8), (64, 4)), dv_cap=256,
                why="Hopper's warpgroup products at D = 256: two warpgroups a block and a 256-wide O, so Q K^T "
                    "is not taken twice (bench/NOTES.md, 'Forward 16-bit: one 256-wide O at D = 256')"),
    ForwardRule("wgmma16-full", lambda c: c.f16 and c.hopper and c.hd in WGMMA_HEAD_DIMS, "wgmma",
                lambda c: ((64, 4), (64, 8)) if c.hd <= 128 else ((64, 8), (64, 4)),
                why="Hopper's warpgroup products with score options: a 128-wide O chunk (a wider one spills "
                    "beside the options' passes); one warpgroup a block up to D = 128, as the plain kernels"),
    ForwardRule("mma16-narrow", lambda c: c.f16 and (c.hd <= 64 or (c.full and c.hd <= 128)), "mma16", _F16_NARROW,
                mi_plain=2, why="mma.sync; two row groups per warp in plain kernels, so each K and V fragment feeds two products "
                    "(bench/NOTES.md, 'Forward mma.sync: row groups, key tiles and stages')"),
    ForwardRule("mma16", lambda c: c.f16 and (c.hd <= 96 or c.full or (c.hd <= 128 and c.arch >= 90)), "mma16",
                ((32, 4), (16, 4), (16, 2), (16, 1)), mi_plain=2,
                why="mma.sync with narrower key tiles: O (32, D) and S (32, BLOCK_N) share the register file "
                    "(32 keys at D = 128 fit sm_90's allocation, not sm_8x's)"),
    ForwardRule("mma16-wide", lambda c: c.f16, "mma16", ((16, 4), (16, 2), (16, 1)), mi_plain=2,
                why="mma.sync at wide heads: 16-key tiles keep O in registers"),
    ForwardRule("tf32", lambda c: c.tf32, "tf32", _SMALL,
                why="allow_tf32: one TF32 product per product, one row group per warp"),
    ForwardRule("3xtf32-64-keys", lambda c: c.x3 and c.hd <= 64 and not c.full, "tf32x3", ((64, 4),) + _SMALL,
                why="3xTF32 on mma.sync; 64-key tiles where they fit (bench/NOTES.md, 'Forward float32: 3xTF32 "
                    "on mma.sync')"),
    ForwardRule("3xtf32", lambda c: c.x3, "tf32x3", _SMALL,
                why="3xTF32 on mma.sync: one row group per warp, as two spill beside the split fragments"),
    ForwardRule("dmma-32-keys", lambda c: c.f64 and c.hd <= 64 and not c.full, "dmma",
                ((32, 4), (16, 4), (16, 2), (16, 1), (8, 1)),
                why="float64 DMMA; the plain kernel at D <= 64 affords 32-key tiles"),
    ForwardRule("dmma-8-warps", lambda c: c.f64 and c.hd <= 128, "dmma", ((16, 8), (16, 4), (16, 2), (16, 1), (8, 1)),
                why="float64 DMMA, 16-key tiles so a 128-wide O stays in registers; 8 warps a block halve the K "
                    "and V each product reads from L2 (bench/NOTES.md, 'Forward float64: DMMA shapes and 8 warps')"),
    ForwardRule("dmma-wide", lambda c: c.f64, "dmma", ((16, 4), (16, 2), (16, 1), (8, 1)),
                why="float64 DMMA at wide heads"),
)


# ----------------------------------------------------------------------------- backward rules

#: A backward tile: (block_r, block_c, 16-key groups per warp of the dK/dV kernel), or with a
#: fourth element True where the tile is taken only with two stages of the streamed tiles.
BwdTile = tuple


@dataclass(frozen=True)
class BackwardRule:
    """Backward kernels for the calls ``when`` accepts: the product ``policy``, ``roles``
    warps per 16 keys of the dK/dV kernel, gradient columns in chunks of at most ``chunk``
    (a number or a function of the call), and ``tiles`` (a tuple or a function of the call)
    in order of preference. The dQ is fused into the dK/dV kernel unless the call asks for
    determinism or a tile streams fewer than 16 rows. A tile takes two stages of the streamed
    tiles while as many blocks fit on an SM as its registers allow (these kernels take up to
    255 registers a thread: 256 threads fill the file), and never beside 3xTF32's pre-split
    tiles."""

    name: str
    when: Callable[[Call], bool]
    policy: str
    tiles: tuple[BwdTile, ...] | Callable[[Call], tuple[BwdTile, ...]]
    chunk: int | Callable[[Call], int]
    why: str
    roles: int = 1
    fallback: bool = False

    def candidates(self, call: Call) -> list[BackwardSpec]:
        tiles = self.tiles(call) if callable(self.tiles) else self.tiles
        chunk = min(call.hd, self.chunk(call) if callable(self.chunk) else self.chunk)
        dq_chunk = min(call.hd, 128) if self.policy == "mma16" else chunk
        out = []
        for block_r, block_c, mi, *two_stages_only in tiles:
            spec = BackwardSpec(call.dtype, self.policy, call.hd, dq_chunk, chunk, block_r, block_c,
                                not call.deterministic and block_c % 16 == 0, 2, call.scores, mi, self.roles)
            if spec.presplit or max(1, 256 // spec.threads) * spec.smem_bytes > call.smem_limit:
                if two_stages_only:
                    continue
                spec = dataclasses.replace(spec, stages=1)
            out.append(spec)
        return out


@dataclass(frozen=True)
class _WgmmaBackwardRule(BackwardRule):
    """The warpgroup dK/dV kernel: two warpgroups of 64 keys; up to D = 128 the whole head
    in one chunk, D = 256 in two (S^T and dP^T recomputed per chunk), and D = 128 in two of 64
    columns too with a bias but no softcap (128-wide dK and dV leave a bias no registers for
    the two element passes and its staged tiles: one pass reading it per score ran at 3.5x the
    plain backward; softcap keeps one pass either way) and with the option sets 128-wide dK
    and dV spill beside (:func:`wgmma_backward_takes`); 128-query tiles at D <= 64 without
    score options, 64 otherwise; two stages where they fit."""

    def candidates(self, call: Call) -> list[BackwardSpec]:
        mods = call.scores.mods
        narrow = ("bias" in mods and "softcap" not in mods) or not _wgmma_backward_takes_wide(call.hd, call.scores)
        chunk = 64 if call.hd == 128 and narrow else min(call.hd, 128)
        spec = BackwardSpec(call.dtype, "wgmma", call.hd, call.hd, chunk, 128,
                            128 if call.hd <= 64 and not call.full else 64, True, 2, call.scores, 1)
        return [spec if spec.smem_bytes <= call.smem_limit else dataclasses.replace(spec, stages=1)]


def wgmma_backward_takes(hd: int, scores: ScoreSet) -> bool:
    """Whether the warpgroup dK/dV kernel takes calls of padded head dim ``hd`` with the
    options ``scores`` (ptxas, sm_90, no spill; 64-query tiles with options): at D = 64 every
    set but softcap with dropout and a mask or block mask (4 bytes spill beside the one
    element pass); at D = 256 the sets of :func:`_wgmma_backward_takes_wide`; at D = 128
    those, and in 64-column chunks every set without softcap or a block mask (with them the
    chunks, each recomputing S^T and dP^T, ran slower than mma.sync: bench/NOTES.md,
    'Backward: score options'). The others take mma.sync. tests/test_kernels_compile.py
    compiles every set this admits."""
    mods = set(scores.mods)
    if hd <= 64:
        return not ({"softcap", "dropout"} <= mods and mods & {"mask", "block_mask"})
    return _wgmma_backward_takes_wide(hd, scores) or (hd <= 128 and not mods & {"softcap", "block_mask"})


def _wgmma_backward_takes_wide(hd: int, scores: ScoreSet) -> bool:
    """The option sets 128-column dK and dV leave registers for (ptxas, sm_90): at most two
    options, dropout only alone or beside a bias, not a mask beside a block mask (12 bytes
    spill; more options spill), and softcap beside a mask at padded D = 128 only (24 bytes
    spill at D = 256). That pair ran 1.09-1.54x faster than on mma.sync, and than in 64-column
    chunks recomputing its one element pass (bench/NOTES.md, 'Backward: score options')."""
    mods = set(scores.mods)
    if "dropout" in mods:
        return mods <= {"dropout", "bias"}
    return len(mods) <= 2 and mods != {"mask", "block_mask"} and (hd <= 128 or mods != {"softcap", "mask"})


_BWD_BASE = ((64, 32, 1), (64, 16, 1), (32, 16, 1), (16, 16, 1))   # one role, 32 or 16 streamed rows
_BWD_16 = ((64, 16, 1), (32, 16, 1), (16, 16, 1))                  # 16 streamed rows


def _mma16_chunk(c: Call) -> int:
    """dK and dV of a 128-wide chunk take 128 registers a thread; beside score options that
    spills at D > 128, and on sm_80 to sm_89 at D = 128 as well (sm_90's allocation fits)."""
    return 64 if c.full and (c.hd > 128 or (c.hd > 64 and c.arch < 90)) else 128


def _mma16_tiles(c: Call) -> tuple[BwdTile, ...]:
    """128 keys a block share each streamed tile (fewer dQ atomics per key); 64 queries per
    tile, or two key groups per warp (D <= 32), only where S and dP of that size fit beside
    dK and dV without a spill."""
    return ((128, 32, 2),) * (c.hd <= 32) + ((128, 64, 1),) * (c.hd <= 64 and not c.full) + ((128, 32, 1),) + _BWD_BASE


def _split_roles(c: Call) -> bool:
    """Split roles: plain, not deterministic, on sm_90 (smaller shared memories would shrink
    the key tiles), at padded head dims 96 and 128."""
    return c.hopper and 64 < c.hd <= 128 and not (c.full or c.deterministic)


#: The backward's rules, in order (see the module docstring).
BACKWARD_RULES: tuple[BackwardRule, ...] = (
    _WgmmaBackwardRule("wgmma16", lambda c: c.f16 and c.hopper and c.hd in WGMMA_BACKWARD_HEAD_DIMS
                       and not c.deterministic and wgmma_backward_takes(c.hd, c.scores), "wgmma", (), 128,
                       fallback=True,
                       why="Hopper's warpgroup dK/dV kernel, dQ fused (bench/NOTES.md, 'Backward 16-bit: "
                           "wgmma on Hopper')"),
    BackwardRule("portable-f64", lambda c: c.simt and c.dtype == "float64", "simt", _BWD_16 + ((16, 8, 1),), 32,
                 why="no tensor cores: FMA products; float64's 32-column chunks keep dK and dV in registers"),
    BackwardRule("portable", lambda c: c.simt, "simt", _BWD_BASE + ((16, 8, 1),), 64,
                 why="no tensor cores: FMA products"),
    BackwardRule("mma16-deterministic", lambda c: c.f16 and c.deterministic, "mma16", _BWD_BASE, _mma16_chunk,
                 why="mma.sync, dQ by its own kernel in a fixed order"),
    BackwardRule("mma16", lambda c: c.f16, "mma16", _mma16_tiles, _mma16_chunk,
                 why="mma.sync, dQ fused (bench/NOTES.md, 'Backward 16-bit: mma.sync tiles')"),
    BackwardRule("tf32", lambda c: c.tf32, "tf32", _BWD_16 + ((16, 8, 1),), 64,
                 why="allow_tf32: one TF32 product per product; 32 streamed rows spill beside its fragments"),
    BackwardRule("3xtf32-split-roles", lambda c: c.x3 and _split_roles(c), "tf32x3",
                 lambda c: ((64, 48 if c.hd <= 96 else 32, 1), (32, 16, 1), (16, 16, 1)), 128, roles=2,
                 why="3xTF32, two warps per 16 keys (one for dV, one for dK), each holding one gradient of the "
                     "whole head, operands split once in shared memory (bench/NOTES.md, 'Backward: split "
                     "roles', 'Backward float32: operands split once')"),
    BackwardRule("3xtf32-128-keys", lambda c: c.x3 and c.hd <= 64 and not (c.full or c.deterministic), "tf32x3",
                 ((128, 64, 1, True),) + _BWD_BASE + ((16, 8, 1),), 128,
                 why="3xTF32 at D <= 64: 128 keys x 64 queries with two stages where they fit (bench/NOTES.md, "
                     "'Backward float32: 3xTF32 tiles and chunks')"),
    BackwardRule("3xtf32-whole-head", lambda c: c.x3 and c.hd <= 128 and not (c.full or c.deterministic),
                 "tf32x3", ((32, 16, 1), (16, 16, 1), (16, 8, 1)), 128,
                 why="3xTF32 with the whole head in one chunk, so S and dP are not recomputed per chunk; 32 keys "
                     "a block, as 64 spill"),
    BackwardRule("3xtf32", lambda c: c.x3 and c.hd <= 64, "tf32x3", _BWD_BASE + ((16, 8, 1),), 64,
                 why="3xTF32 with score options or determinism"),
    BackwardRule("3xtf32-wide", lambda c: c.x3, "tf32x3", _BWD_16 + ((16, 8, 1),), 64,
                 why="3xTF32 above D = 64: 16 streamed rows (32 spill beside the split fragments)"),
    BackwardRule("dmma-split-roles", lambda c: c.f64 and _split_roles(c), "dmma", _BWD_16, 128, roles=2,
                 why="float64 DMMA, two warps per 16 keys, the whole head in one chunk and 8 warps in the one "
                     "block shared memory admits per SM (bench/NOTES.md, 'Backward: split roles')"),
    BackwardRule("dmma", lambda c: c.f64, "dmma", _BWD_16 + ((16, 8, 1),), lambda c: 32 if c.hd > 128 else 64,
                 why="float64 DMMA, 64-wide chunks up to D = 128 (32 above)"),
)


# ----------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class Choice:
    """The spec a rule table chose for a call, the rule that chose it, and the candidates
    tried before it that did not fit the shared memory (with the rules they came from)."""

    spec: KernelSpec | BackwardSpec
    rule: ForwardRule | BackwardRule
    rejected: tuple[tuple[str, KernelSpec | BackwardSpec], ...]


def _choose(rules: tuple, call: Call, what: str) -> Choice:
    rejected = []
    for rule in rules:
        if not rule.when(call):
            continue
        for spec in rule.candidates(call):
            if spec.smem_bytes <= call.smem_limit:
                return Choice(spec, rule, tuple(rejected))
            rejected.append((rule.name, spec))
        if not rule.fallback:
            break
    need = min((s.smem_bytes for _, s in rejected), default=0)
    raise NoKernelError(
        f"no {call.dtype} {what} kernel for padded head dim {call.hd} fits this GPU's {call.smem_limit // 1024} KiB "
        f"of shared memory per block (the smallest candidate needs {need // 1024} KiB); use backend='cpu'"
    )


def _call(dtype: str, d: int, dv: int, arch: int, smem_limit: int, allow_tf32: bool, portable: bool | None,
          scores: ScoreSet, deterministic: bool = False) -> Call:
    return Call(dtype, head_dim_bucket(max(d, dv)), arch, smem_limit, allow_tf32,
                force_portable() if portable is None else portable, scores, deterministic)


@functools.lru_cache(maxsize=4096)
def choose_forward(call: Call) -> Choice:
    """The forward's :class:`Choice` for a call (computed once per distinct call)."""
    return _choose(FORWARD_RULES, call, "forward")


@functools.lru_cache(maxsize=4096)
def choose_backward(call: Call) -> Choice:
    """The backward's :class:`Choice` for a call (computed once per distinct call)."""
    return _choose(BACKWARD_RULES, call, "backward")


def select_forward(dtype: str, d: int, dv: int, arch: int, smem_limit: int, allow_tf32: bool = False,
                   portable: bool | None = None, scores: ScoreSet = PLAIN) -> KernelSpec:
    """The forward kernel for this problem on a GPU of compute capability ``arch`` (e.g. 90).

    ``smem_limit`` is the device's opt-in shared memory per block in bytes; ``scores``: the
    options beyond causal, window and lengths in use (:class:`ScoreSet`). Raises
    NoKernelError when no tile shape fits (float64 with D > 256 on 99 KB GPUs).
    """
    return _select_forward(dtype, d, dv, arch, smem_limit, allow_tf32,
                           force_portable() if portable is None else portable, scores)


@functools.lru_cache(maxsize=4096)
def _select_forward(dtype: str, d: int, dv: int, arch: int, smem_limit: int, allow_tf32: bool, portable: bool,
                    scores: ScoreSet) -> KernelSpec:
    """:func:`select_forward` keyed on its arguments, so that a repeated call costs one lookup."""
    return choose_forward(_call(dtype, d, dv, arch, smem_limit, allow_tf32, portable, scores)).spec


def select_backward(dtype: str, d: int, dv: int, arch: int, smem_limit: int, allow_tf32: bool = False,
                    portable: bool | None = None, deterministic: bool = False,
                    scores: ScoreSet = PLAIN) -> BackwardSpec:
    """The backward kernels for this problem on a GPU of compute capability ``arch``.

    ``deterministic`` takes the unfused, order-fixed dQ kernel; ``scores`` as for
    :func:`select_forward`. Raises NoKernelError when no tile fits.
    """
    return _select_backward(dtype, d, dv, arch, smem_limit, allow_tf32,
                            force_portable() if portable is None else portable, deterministic, scores)


@functools.lru_cache(maxsize=4096)
def _select_backward(dtype: str, d: int, dv: int, arch: int, smem_limit: int, allow_tf32: bool, portable: bool,
                     deterministic: bool, scores: ScoreSet) -> BackwardSpec:
    """:func:`select_backward` keyed on its arguments, so that a repeated call costs one lookup."""
    return choose_backward(_call(dtype, d, dv, arch, smem_limit, allow_tf32, portable, scores, deterministic)).spec


def backward_key_block_major(spec: BackwardSpec, causal: bool) -> bool:
    """Whether flash_bwd_dkdv takes its blocks key block by key block over all the heads
    (heavy first: under a causal mask a head's first key blocks see every query) instead of
    head by head: causal float32 and float64. Not 16-bit, whose faster kernels then stream
    the queries of every head through L2 at once (bench/NOTES.md, 'Backward: block order')."""
    return causal and spec.dtype in ("float32", "float64")


def _every_call(arch: int):
    """Every distinct call kind on ``arch``: dtypes, head-dim buckets, flags; the plain score
    set and every option at once (EVERY_OPTION: each option's code compiled; the kernels of
    smaller sets compile the same code with less of it)."""
    for dtype in CXX_TYPE:
        for hd in HEAD_DIM_BUCKETS:
            for allow_tf32 in (False, True):
                for portable in (False, True):
                    for scores in (PLAIN, EVERY_OPTION):
                        for deterministic in (False, True):
                            yield Call(dtype, hd, arch, ARCH_SMEM[arch], allow_tf32, portable, scores, deterministic)


def _all_specs(choose, arch: int) -> set:
    specs = set()
    for call in _every_call(arch):
        try:
            specs.add(choose(call).spec)
        except NoKernelError:
            pass
    return specs


def all_forward_specs(arch: int) -> list[KernelSpec]:
    """Every spec :func:`select_forward` can return on ``arch``, for ahead-of-time compile checks."""
    return sorted(_all_specs(choose_forward, arch), key=lambda s: (s.dtype, s.policy, s.head_dim, s.block_n,
                                                                   s.num_warps, s.full, s.dv_tile, s.scores.mods))


def all_backward_specs(arch: int) -> list[BackwardSpec]:
    """Every spec :func:`select_backward` can return on ``arch``."""
    return sorted(_all_specs(choose_backward, arch), key=lambda s: (s.dtype, s.policy, s.head_dim, s.block_r,
                                                                    s.block_c, s.fused_dq, s.full, s.mi, s.scores.mods))


def all_kernels(arch: int) -> list[tuple[str, str, int]]:
    """(source family, name expression, dynamic shared memory) of every kernel the dispatcher
    can launch on ``arch``, forward and backward, each once."""
    kernels = {}
    for s in all_forward_specs(arch):
        kernels[s.name_expression] = ("forward", s.name_expression, s.smem_bytes)
        kernels.update({(m.family, m.name): (m.family, m.name, 0) for m in s.tile_maps})
    for s in all_backward_specs(arch):
        for name, smem in s.kernels:
            kernels[name] = ("backward", name, smem)
        kernels.update({(m.family, m.name): (m.family, m.name, 0) for m in s.tile_maps})
    return sorted(kernels.values())
