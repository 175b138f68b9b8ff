"""The CUDA backend: kernel choice, NVRTC compilation and launches on CuPy arrays.

Nothing here knows about NumPy callers or other array kinds: :mod:`flashcupy.api`
hands over a :class:`~flashcupy.problem.Problem` whose arrays are CuPy arrays on
one device, and gets CuPy arrays back. Kernels run on that device and on CuPy's
current stream.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Any, NamedTuple

import numpy as np

from .. import interop, rng
from ..problem import Problem, accumulator_dtype
from . import params as P
from .compile import ThreadBlocks, bind_context, get_function, launch_ptr
from .compile import launch as launch_block
from .spec import (
    ROW_PASS_ROWS, ROW_PASS_THREADS, TILE_MAP_THREADS, BackwardSpec, KernelSpec, NoKernelError, ScoreSet, TileMap,
    backward_key_block_major, select_backward, select_forward,
)

#: Fill outputs with NaN before each launch (tests set it) so unwritten elements show.
poison_outputs = False


@functools.lru_cache(maxsize=None)
def device_limits(device_id: int) -> tuple[int, int]:
    """(compute capability as an int like 90, opt-in shared memory per block in bytes)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    return 10 * props["major"] + props["minor"], int(props["sharedMemPerBlockOptin"])


@functools.cache
def _graph_allocations(device_id: int) -> bool:
    """Whether the driver allocates stream-ordered memory on ``device_id`` (cudaMallocAsync,
    which a capture records as a node of the graph)."""
    import cupy

    runtime = cupy.cuda.runtime
    try:
        return bool(runtime.deviceGetAttribute(runtime.cudaDevAttrMemoryPoolsSupported, device_id))
    except runtime.CUDARuntimeError:
        return False


class _GraphMemory:
    """CuPy's allocator under :func:`temporaries`: stream-ordered allocations on a stream
    being captured, each freed on it when its last reference goes."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def __call__(self, nbytes: int) -> Any:
        import cupy

        return cupy.cuda.MemoryPointer(cupy.cuda.MemoryAsync(nbytes, self.stream), 0)


def temporaries(stream: Any = None, capturing: bool | None = None) -> contextlib.AbstractContextManager:
    """A context for a launch's temporaries (never its results) on CuPy's current device.
    While ``stream`` (default: CuPy's current) is being captured into a CUDA graph
    (``capturing``, default ``stream.is_capturing()``), CuPy allocates from the graph: each
    allocation and its free, made as the memory's last reference goes inside the capture,
    become nodes of the graph, so every replay writes memory of its own. Memory from CuPy's
    pool would go back to the pool when the capture ends and to later work, which replays
    would then overwrite. Outside a capture, and under an allocator that is safe in one
    already (``graph_safe``: flashcupy.torch's, from torch's caching allocator, which gives a
    graph a private pool), nothing changes; where the driver has no stream-ordered
    allocations, a RuntimeWarning says so once and nothing changes either. A result
    allocated inside would stay allocated after the capture, and CUDA refuses to launch such
    a graph a second time."""
    import cupy

    if stream is None:
        stream = cupy.cuda.get_current_stream()
    if capturing is None:
        capturing = stream.is_capturing()
    if not capturing or getattr(cupy.cuda.get_allocator(), "graph_safe", False):
        return _NO_CONTEXT
    if not _graph_allocations(cupy.cuda.runtime.getDevice()):
        _warn_pool_temporaries()
        return _NO_CONTEXT
    return cupy.cuda.using_allocator(_GraphMemory(stream))


@functools.cache
def _warn_pool_temporaries() -> None:
    """Warns once that captured calls' temporaries come from CuPy's pool (no stream-ordered
    allocations on this device)."""
    import warnings

    warnings.warn("flashcupy: this GPU's driver has no stream-ordered allocations, so a captured call's temporaries "
                  "come from CuPy's memory pool; keep later allocations from reusing them (for example, capture "
                  "with a pool of its own) or replays will overwrite them", RuntimeWarning, stacklevel=3)


#: temporaries() outside a capture (a nullcontext can be entered again and again).
_NO_CONTEXT = contextlib.nullcontext()


def capturing() -> bool:
    """Whether CuPy's current stream is being captured into a CUDA graph."""
    import cupy

    return cupy.cuda.get_current_stream().is_capturing()


@functools.cache
def _dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, which NumPy works out in Python at every access."""
    return dtype.name


def _elem_strides(x) -> tuple[int, ...]:
    return tuple(s // x.itemsize for s in x.strides)


def _merge_batch(x, batch: tuple[int, ...], xp):
    """(*batch, ...) -> (B, ...): a view where strides allow, else a copy."""
    return xp.reshape(x, (math.prod(batch),) + tuple(x.shape[len(batch):]))


def _last_axis_contiguous(x, xp):
    return x if x.shape[-1] <= 1 or x.strides[-1] == x.itemsize else xp.ascontiguousarray(x)


def _aligned(x) -> bool:
    """16-byte aligned base pointer, strides and row length: tiles use 16-byte copies."""
    if x.data.ptr % 16 or (x.shape[-1] * x.itemsize) % 16:
        return False
    return not any(s % 16 for n, s in zip(x.shape[:-1], x.strides[:-1]) if n > 1)


def _aligned_rows(x, xp):
    """``x`` itself when aligned, else one copy with the last axis zero-padded to 16 bytes."""
    if _aligned(x):
        return x
    vec = 16 // x.itemsize
    padded = xp.zeros(x.shape[:-1] + (-(-x.shape[-1] // vec) * vec,), dtype=x.dtype)
    padded[..., : x.shape[-1]] = x
    return padded


def _address(x) -> int:
    """The address of x's first element (a CuPy array, or a NumPy one in tests)."""
    return x.__array_interface__["data"][0] if isinstance(x, np.ndarray) else x.data.ptr


def _score_operand(x, xp):
    """A bias or mask view (broadcast by zero strides to the scores' shape) as the forward's
    staged copies (kernels_cu/score/tiles.cuh) read it in 16-byte chunks: keys contiguous and
    every row 16-byte aligned. ``x`` itself when it is; else one copy of its distinct
    elements (broadcast axes kept at one, keys materialised where broadcast, rows zero-padded
    to 16 bytes) broadcast back to x's shape. Odd key counts, transposed views and
    odd row strides would otherwise be copied element by element into every tile."""
    keys = x.shape[-1]
    strides = x.strides
    if x.size == 0 or (
        (keys <= 1 or strides[-1] == x.itemsize) and _address(x) % 16 == 0
        and all(s % 16 == 0 for n, s in zip(x.shape[:-1], strides[:-1]) if n > 1)
    ):
        return x
    distinct = x[tuple(slice(0, 1) if s == 0 else slice(None) for s in strides[:-1])]
    vec = 16 // x.itemsize
    padded = xp.zeros(distinct.shape[:-1] + (-(-keys // vec) * vec,), dtype=x.dtype)
    padded[..., :keys] = distinct
    return xp.broadcast_to(padded[..., :keys], x.shape)


def _empty(shape, dtype, xp):
    return xp.full(shape, np.nan, dtype=dtype) if poison_outputs else xp.empty(shape, dtype=dtype)


def _rows(pb: Problem, x, xp):
    """A row operand as the kernels read it: contiguous last axis, 16-byte aligned rows (one
    padded copy if not) and, for padded problems, the batch dims merged into one (a copy
    where strides do not allow a view). Pointer and strides must both come from this array."""
    x = _aligned_rows(_last_axis_contiguous(x, xp), xp)
    return x if pb.varlen else _merge_batch(x, pb.batch, xp)


def _rows_fields(pb: Problem, arrays: dict[str, Any]) -> dict[str, int]:
    """Strides (elements) of operands prepared by :func:`_rows` (or allocated contiguous and
    merged), named by their Params prefix: batch, head, row (packed problems: head, row)."""
    fields = {}
    for name, x in arrays.items():
        if pb.varlen:
            fields[f"{name}_sh"], fields[f"{name}_sr"] = _elem_strides(x)[:2]
        else:
            fields[f"{name}_sb"], fields[f"{name}_sh"], fields[f"{name}_sr"] = _elem_strides(x)[:3]
    return fields


def _merged(pb: Problem, x, xp):
    """An output allocated contiguous, seen with merged batch dims (always a view)."""
    return x if pb.varlen else _merge_batch(x, pb.batch, xp)


def _grid(blocks: int, heads: int) -> tuple[int, int, int]:
    """x: blocks per head; heads split over y and z (gridDim.y is at most 65535)."""
    grid_y = min(heads, 65535)
    return blocks, grid_y, -(-heads // grid_y)


class Launch(NamedTuple):
    """One kernel launch of a call: what it does (``role``), its source family and name
    expression, grid, threads per block and dynamic shared memory."""

    role: str
    family: str
    name: str
    grid: tuple[int, int, int]
    threads: int
    smem_bytes: int


def _mask_planes(pb: Problem) -> tuple[int, int]:
    """(batch planes, head planes) of a problem's tile maps: one on an axis every mask (mask,
    block_mask: views of shape (*batch, Hq, ...)) broadcasts over."""
    masks = [x for x in (pb.mask, pb.block_mask) if x is not None]
    nb = len(pb.batch)
    per_batch = any(n > 1 and s != 0 for x in masks for n, s in zip(x.shape[:nb], x.strides[:nb]))
    per_head = any(x.shape[nb] > 1 and x.strides[nb] != 0 for x in masks)
    return (math.prod(pb.batch) if per_batch else 1), (pb.num_heads_q if per_head else 1)


def _map_launch(pb: Problem, tile_map: TileMap, planes: tuple[int, int] | None) -> Launch:
    planes_b, planes_h = _mask_planes(pb) if planes is None else planes
    return Launch(f"{tile_map.family} tile map", tile_map.family, tile_map.name,
                  _grid(tile_map.outer_tiles(pb.seqlen_q, pb.seqlen_k), planes_b * planes_h), TILE_MAP_THREADS, 0)


def _tile_map_fields(pb: Problem, maps: tuple[TileMap, ...], xp) -> tuple[dict[str, int], list]:
    """Params fields of the tile maps a call's kernels walk (score/tile_map.cuh: ``tiles`` for
    the query-major one, ``tiles_t`` for the key-major one), and the maps' device arrays,
    uninitialised: their launches fill them first."""
    planes_b, planes_h = _mask_planes(pb)
    fields, arrays = {}, []
    for m in maps:
        inner = m.inner_tiles(pb.seqlen_q, pb.seqlen_k)
        outer = m.outer_tiles(pb.seqlen_q, pb.seqlen_k)
        arrays.append(xp.empty((planes_b, planes_h, outer, inner), dtype=xp.int32))
        name, prefix = ("tiles_t", "tt") if m.key_major else ("tiles", "tiles")
        fields[name] = arrays[-1].data.ptr
        fields[f"{prefix}_sb"] = planes_h * outer * inner if planes_b > 1 else 0
        fields[f"{prefix}_sh"] = outer * inner if planes_h > 1 else 0
        fields[f"{prefix}_so"] = inner
    return fields, arrays


def forward_row_blocks(pb: Problem, spec: KernelSpec) -> int:
    """The forward's row blocks per Dv chunk: grid x is row blocks (fastest) x chunks, and the
    kernel reads this count from Params.row_blocks."""
    return -(-pb.seqlen_q // spec.block_m)


def _forward_blocks(seqlen_q: int, head_dim_v: int, spec: KernelSpec) -> int:
    """The forward's grid x: row blocks (fastest) x Dv chunks."""
    return -(-seqlen_q // spec.block_m) * -(-head_dim_v // spec.dv_tile)


def forward_launches(pb: Problem, spec: KernelSpec, planes: tuple[int, int] | None = None) -> list[Launch]:
    """The forward's launches for a problem (none when it has no row or head): the tile map
    where masks are given, then the kernel: row blocks fastest in grid x, then Dv chunks;
    (batch, head) pairs over y and z. ``planes``: the tile map's (batch, head) planes where the
    problem's masks do not tell (explain's stand-ins), else from them."""
    heads = math.prod(pb.batch) * pb.num_heads_q
    blocks = _forward_blocks(pb.seqlen_q, pb.head_dim_v, spec)
    if not (heads and blocks):
        return []
    return [*(_map_launch(pb, m, planes) for m in spec.tile_maps if pb.seqlen_k),
            Launch("forward", "forward", spec.name_expression, _grid(blocks, heads), spec.threads, spec.smem_bytes)]


def dq_is_accumulator(pb: Problem, spec: BackwardSpec) -> bool:
    """Whether the fused dQ's accumulator is dQ itself (its dtype, an even head dim and a spec
    whose accumulator holds dQ, not dQ / scale): then no conversion pass runs."""
    return spec.fused_dq and spec.dq_accum_scaled and pb.head_dim % 2 == 0


def backward_blocks(pb: Problem, spec: BackwardSpec) -> tuple[int, int]:
    """(key blocks per dK/dV chunk, row blocks per dQ chunk): each kernel's grid x is its
    blocks (fastest) x chunks, and the kernels read these counts from BwdParams."""
    return -(-pb.seqlen_k // spec.block_r), -(-pb.seqlen_q // spec.block_r)


def backward_launches(pb: Problem, spec: BackwardSpec, planes: tuple[int, int] | None = None) -> list[Launch]:
    """The backward's launches for a problem, in order: the tile maps where masks are given
    (``planes`` as in :func:`forward_launches`), D = rowsum(dO * O) (row blocks of
    ROW_PASS_ROWS), the dK/dV kernel (key blocks, then gradient chunks, per (batch, key
    head)), and dQ (the converter over the row blocks, or the query-major kernel), each left
    out where it has nothing to do."""
    batch = math.prod(pb.batch)
    heads, kv_heads = batch * pb.num_heads_q, batch * pb.num_heads_k
    rows = _grid(-(-pb.seqlen_q // ROW_PASS_ROWS), heads)
    key_blocks, dq_row_blocks = backward_blocks(pb, spec)
    (delta_name, _), (dkdv_name, dkdv_smem), (dq_name, dq_smem) = spec.kernels
    out = [_map_launch(pb, m, planes) for m in spec.tile_maps] if heads and pb.seqlen_q and pb.seqlen_k else []
    if heads and pb.seqlen_q:
        out.append(Launch("backward delta", "backward", delta_name, rows, ROW_PASS_THREADS, 0))
    if kv_heads and pb.seqlen_k:  # with no query the blocks attend nothing and write zeros
        chunks = -(-max(pb.head_dim, pb.head_dim_v) // spec.kv_chunk)
        out.append(Launch("backward dK/dV", "backward", dkdv_name, _grid(key_blocks * chunks,
                                                                        kv_heads), spec.threads, dkdv_smem))
    if heads and pb.seqlen_q and not dq_is_accumulator(pb, spec):
        if spec.fused_dq:
            out.append(Launch("backward dQ convert", "backward", dq_name, rows, ROW_PASS_THREADS, dq_smem))
        else:
            grid = _grid(dq_row_blocks * -(-pb.head_dim // spec.dq_chunk), heads)
            out.append(Launch("backward dQ", "backward", dq_name, grid, spec.dq_threads, dq_smem))
    return out


def _run(launch: Launch, device_id: int, block: bytearray) -> None:
    """One launch of a call with its parameter block's bytes."""
    launch_block(get_function(launch.family, launch.name, device_id, launch.smem_bytes), launch.grid,
                 launch.threads, block, launch.smem_bytes)


def per_head(x: Any, heads: tuple[int, int], xp) -> Any:
    """A per-head option (ALiBi slopes, sinks: a host or device (*batch, Hq) view) as the
    kernels read it: a contiguous float64 array of ``heads`` = (B, Hq) in ``xp``, laid out
    where the values are and then moved."""
    src = interop.array_module(x)
    return xp.asarray(src.ascontiguousarray(src.broadcast_to(src.asarray(x, dtype=np.float64).reshape(-1, heads[1]),
                                                             heads)))


def _problem_params(pb: Problem, q, k, v, out, lse, xp, row_blocks: int = 0,
                    maps: tuple[TileMap, ...] = ()) -> tuple[np.void, list]:
    """The Params block of a problem whose operands (from :func:`_rows`) and output (merged)
    are given, and the device arrays it points into that must outlive the launch;
    ``row_blocks``: the forward's (:func:`forward_row_blocks`), 0 for the backward (which
    reads no sinks: its lse and out have them already); ``maps``: the tile maps its kernels
    walk (the spec's ``tile_maps``)."""
    fields: dict[str, Any] = _rows_fields(pb, {"q": q, "k": k, "v": v, "o": out})
    map_fields, keep_alive = _tile_map_fields(pb, maps, xp)  # keep_alive: device arrays the launches read
    fields.update(map_fields)
    if pb.varlen:
        fields["lse_sh"] = _elem_strides(lse)[0]
        for name in ("cu_seqlens_q", "cu_seqlens_k"):
            keep_alive.append(xp.asarray(getattr(pb, name), dtype=xp.int32))
            fields[name] = keep_alive[-1].data.ptr
    else:
        fields["lse_sb"], fields["lse_sh"] = _elem_strides(_merge_batch(lse, pb.batch, xp))[:2]
        for name, lengths in (("seqlens_q", pb.q_lengths), ("seqlens_k", pb.kv_lengths)):
            if lengths is not None:
                keep_alive.append(xp.asarray(np.ascontiguousarray(lengths, dtype=np.int32).reshape(-1)))
                fields[name] = keep_alive[-1].data.ptr
    batch = math.prod(pb.batch)
    for name, short in (("mask", "mask"), ("bias", "bias"), ("block_mask", "bm")):
        x = getattr(pb, name)
        if x is not None:
            x = _merge_batch(_score_operand(x, xp) if name != "block_mask" else x, pb.batch, xp)
            keep_alive.append(x)
            fields[name] = x.data.ptr
            for suffix, s in zip(("sb", "sh", "si", "sj"), _elem_strides(x)):
                fields[f"{short}_{suffix}"] = s
    if pb.rng_state is not None:
        keep_alive.append(pb.rng_state)
        fields["rng_state"] = pb.rng_state.data.ptr
    # ALiBi slopes, and the sinks the forward's epilogue folds in (kernels_cu/epilogue.cuh)
    for name, x in (("alibi", pb.alibi_slopes), ("sinks", pb.sinks if row_blocks else None)):
        if x is not None:
            keep_alive.append(per_head(x, (batch, pb.num_heads_q), xp))
            fields.update({name: keep_alive[-1].data.ptr, f"{name}_sb": pb.num_heads_q, f"{name}_sh": 1})
    left, right = pb.window if pb.window is not None else (None, None)
    params = P.pack(
        q=q.data.ptr, k=k.data.ptr, v=v.data.ptr, o=out.data.ptr, lse=lse.data.ptr,
        batch=batch, hq=pb.num_heads_q, hk=pb.num_heads_k, lq=pb.seqlen_q, lk=pb.seqlen_k,
        d=q.shape[-1], dv=pb.head_dim_v, dv_stored=v.shape[-1], causal=P.CAUSAL_CODE[pb.causal],
        window_left=-1 if left is None else min(left, 2**31 - 1),
        window_right=-1 if right is None else min(right, 2**31 - 1),
        block_size=pb.block_size or 1, seed=pb.seed or 0, scale=pb.scale, row_blocks=row_blocks,
        softcap=pb.softcap or 0.0,
        dropout_threshold=rng.dropout_threshold(pb.dropout_p) if pb.dropout_p > 0 else 0,
        dropout_offset=pb.dropout_offset, dropout_scale=1.0 / (1.0 - pb.dropout_p),
        **fields,
    )
    return params, keep_alive


def _operands(pb: Problem, xp):
    """q, k, v as the kernels read them (see :func:`_rows`)."""
    return tuple(_rows(pb, x, xp) for x in (pb.q, pb.k, pb.v))


def score_set(pb: Problem) -> ScoreSet:
    """The score options a problem's kernels are compiled for (beyond causal, window, lengths)."""
    return ScoreSet.of(bias_dtype=None if pb.bias is None else pb.bias.dtype.name, mask=pb.mask is not None,
                       block_mask=pb.block_mask is not None, alibi=pb.alibi_slopes is not None,
                       softcap=pb.softcap is not None, dropout=pb.dropout_p > 0)


#: The pointer fields a forward template fills, in the order :meth:`~params.Template.fill_into` takes them.
_FORWARD_POINTERS = ("q", "k", "v", "o", "lse")
#: The same for the backward block: the forward's, then those of the gradients and buffers.
_BACKWARD_POINTERS = ("f.q", "f.k", "f.v", "f.o", "f.lse", "dout", "out", "delta", "lse2", "dq", "dk", "dv",
                      "dq_accum")


class LaunchPlan:
    """The launches of calls laid out alike (:func:`_layout_key`): their parameter block as a
    template whose pointers each call fills in (in the order of ``_FORWARD_POINTERS`` or
    ``_BACKWARD_POINTERS``), and each launch's CUfunction, grid, threads and shared memory,
    launched through the driver with a parameter block kept per thread. ``copied``: which
    row operands :func:`_rows` copied for the call that made the plan; ``packed``: whether
    each of those copies was C-contiguous (a caller may then pass its own contiguous copy)."""

    def __init__(self, template: P.Template, launches: list[Launch], device_id: int, copied: tuple[bool, ...],
                 packed: tuple[bool, ...]) -> None:
        self.template, self.launches, self.device_id = template, launches, device_id
        self.copied, self.packed = copied, packed
        self._functions = tuple((get_function(x.family, x.name, device_id, x.smem_bytes).kernel.ptr, x.grid,
                                 x.threads, x.smem_bytes) for x in launches)
        self._blocks = ThreadBlocks(template)

    def run(self, stream: int, *pointers: int) -> None:
        """Queue the launches on ``stream`` (a CUDA stream handle) with the template's
        pointer fields set to ``pointers``; the current device must be the plan's."""
        kept = self._blocks.get()
        self.template.fill_into(kept.block, *pointers)
        bind_context(self.device_id)
        for function, grid, threads, smem_bytes in self._functions:
            launch_ptr(function, grid, threads, kept.one, smem_bytes, stream)


def _launch_plan(template: P.Template, launches: list[Launch], device_id: int, rows: tuple,
                 operands: tuple) -> LaunchPlan:
    """The plan of a call's block and launches; ``rows``: its row operands as :func:`_rows`
    made them from ``operands``."""
    copied = tuple(r.data.ptr != x.data.ptr for r, x in zip(rows, operands))
    # a plain copy: C-contiguous and no larger (rows padded to 16 bytes hold more elements)
    packed = tuple(c and r.flags.c_contiguous and r.size == x.size for c, r, x in zip(copied, rows, operands))
    return LaunchPlan(template, launches, device_id, copied, packed)


class _Templates:
    """Earlier calls' :class:`LaunchPlan` by :func:`_layout_key` (the key holds everything
    their blocks and launches depend on but the pointers); beyond ``size`` entries the
    oldest goes."""

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._entries: dict[tuple, LaunchPlan] = {}
        self._lock = threading.Lock()  # writers only: a lookup is one atomic dict.get

    def get(self, key: tuple | None) -> LaunchPlan | None:
        return None if key is None else self._entries.get(key)

    def put(self, key: tuple, plan: LaunchPlan) -> None:
        with self._lock:
            if len(self._entries) >= self._size:
                del self._entries[next(iter(self._entries))]
            self._entries[key] = plan


_FORWARD_TEMPLATES = _Templates()
_BACKWARD_TEMPLATES = _Templates()


def _points_to_operands_only(pb: Problem) -> bool:
    """Whether a problem's blocks point to its operands, results and buffers only: no masks,
    bias, ALiBi slopes, sinks, lengths, packed sequences or device rng_state."""
    return not (pb.varlen or pb.mask is not None or pb.bias is not None or pb.block_mask is not None
                or pb.alibi_slopes is not None or pb.sinks is not None or pb.q_lengths is not None
                or pb.kv_lengths is not None or pb.rng_state is not None)


def _layout_key(pb: Problem, device_id: int, operands: tuple, *extra: Any) -> tuple | None:
    """Everything a parameter block holds but its pointers: the device, the shapes and strides
    of the row ``operands`` and whether their addresses are 16-byte aligned (which decides
    what :func:`_rows` copies; the outputs are allocated contiguous from the problem's shapes),
    the dtype and the options (the scale with its sign: -0.0 == 0.0), and ``extra``. None for
    problems whose blocks point to more arrays (masks, bias, ALiBi slopes, sinks, lengths,
    packed sequences, a device rng_state): those are packed for every launch."""
    if not _points_to_operands_only(pb):
        return None
    return (device_id, pb.dtype, pb.causal, pb.window, pb.scale, math.copysign(1.0, pb.scale), pb.softcap,
            pb.dropout_p, pb.seed, pb.dropout_offset, *[(x.shape, x.strides, _address(x) % 16 == 0) for x in operands],
            *extra)


def _template_rows(pb: Problem, operands: tuple, cached: LaunchPlan | None, xp) -> list | None:
    """The row operands of a call reusing the plan ``cached`` (from _Templates, or None):
    each operand itself where the plan's call used it so, else a fresh copy by
    :func:`_rows`, laid out as that call's was (the key fixes shapes and strides). None where
    the plan does not apply: none cached, a pointer not 16-byte aligned where the plan's
    call had one that was, or an operand :func:`_rows` no longer copies (its copy then was
    for a misaligned pointer: the plan's block holds the copy's strides)."""
    if cached is None:
        return None
    rows = []
    for x, copied in zip(operands, cached.copied):
        if copied:
            x_rows = _rows(pb, x, xp)
            if x_rows.data.ptr == x.data.ptr:
                return None
            rows.append(x_rows)
        elif x.data.ptr % 16:
            return None
        else:
            rows.append(x)
    return rows


def _forward_spec(pb: Problem, device_id: int) -> KernelSpec:
    """The forward kernel of a problem on ``device_id`` (NoKernelError where none fits)."""
    arch, smem_limit = device_limits(device_id)
    return select_forward(_dtype_name(pb.dtype), pb.head_dim, pb.head_dim_v, arch, smem_limit, pb.allow_tf32,
                          scores=score_set(pb))


def _backward_spec(pb: Problem, device_id: int, deterministic: bool) -> BackwardSpec:
    """The backward kernels of a problem on ``device_id`` (NoKernelError where none fits)."""
    arch, smem_limit = device_limits(device_id)
    return select_backward(_dtype_name(pb.dtype), pb.head_dim, pb.head_dim_v, arch, smem_limit, pb.allow_tf32,
                           deterministic=deterministic, scores=score_set(pb))


def forward(pb: Problem) -> tuple[Any, Any]:
    """(out, lse) of a problem on CuPy arrays, in the problem's internal layout.

    A problem laid out like an earlier one (:func:`_layout_key`) reuses that launch's
    parameter block with its own pointers filled in, copying again the operands copied then
    (:func:`_template_rows`).
    """
    import cupy as xp

    device_id = pb.q.device.id
    with xp.cuda.Device(device_id):
        spec = _forward_spec(pb, device_id)
        out = _empty(pb.out_shape, pb.dtype, xp)
        lse = _empty(pb.lse_shape, accumulator_dtype(pb.dtype), xp)
        operands = (pb.q, pb.k, pb.v)
        key = _layout_key(pb, device_id, operands, spec)
        cached = _FORWARD_TEMPLATES.get(key)
        stream = xp.cuda.get_current_stream()
        with temporaries(stream):
            rows = _template_rows(pb, operands, cached, xp)
            if rows is not None:
                cached.run(stream.ptr, *(x.data.ptr for x in rows), out.data.ptr, lse.data.ptr)
                keep_alive = rows
            else:
                block, launches, keep_alive = _pack_forward(pb, spec, device_id, key, out, lse, xp)
                for launch in launches:
                    _run(launch, device_id, block)
            del keep_alive, rows  # safe: memory CuPy frees now is reused only by work queued after this launch
    return out, lse


def _pack_forward(pb: Problem, spec: KernelSpec, device_id: int, key: tuple | None, out: Any, lse: Any,
                  xp) -> tuple[bytearray, list[Launch], list]:
    """(the parameter block of a forward into ``out`` and ``lse``, its launches, the device
    arrays the block points into), its plan kept under ``key`` (:func:`_layout_key`) when
    there is one. Runs nothing."""
    operands = (pb.q, pb.k, pb.v)
    q, k, v = _operands(pb, xp)
    params, keep_alive = _problem_params(pb, q, k, v, _merged(pb, out, xp), lse, xp,
                                         row_blocks=forward_row_blocks(pb, spec), maps=spec.tile_maps)
    launches = forward_launches(pb, spec)
    if key is not None:
        _FORWARD_TEMPLATES.put(key, _launch_plan(P.Template(params, _FORWARD_POINTERS), launches, device_id,
                                                 (q, k, v), operands))
    return bytearray(params.tobytes()), launches, [*keep_alive, q, k, v]


def _dbias_buffer(pb: Problem, deterministic: bool, xp):
    """(buffer the kernels add dS into, its (B, Hq, Lq, Lk) strided view, reduce()): reduce()
    gives dbias in the bias's shape and the accumulator dtype, a view of the buffer or a new
    array (the caller converts it to the bias's dtype).

    The buffer has the bias's own (padded) shape, broadcast by zero strides, so atomics
    reduce over broadcast dims; ``deterministic`` (or batch dims that cannot merge into one
    strided view) takes one element per score instead and reduces by a sum afterwards.
    """
    scores = pb.batch + (pb.num_heads_q, pb.seqlen_q, pb.seqlen_k)
    full = (1,) * (len(scores) - len(pb.bias_shape)) + pb.bias_shape
    acc_dtype = accumulator_dtype(pb.dtype)
    reduced = full != scores
    if not (deterministic and reduced):
        acc = xp.zeros(full, dtype=acc_dtype)
        view = _merge_batch(xp.broadcast_to(acc, scores), pb.batch, xp)
        if view.data.ptr == acc.data.ptr and (view.base is not None or not reduced):
            return view, lambda: acc.reshape(pb.bias_shape)
    acc = xp.zeros(scores, dtype=acc_dtype)
    axes = tuple(a for a, (n, m) in enumerate(zip(full, scores)) if n != m)
    return _merge_batch(acc, pb.batch, xp), lambda: acc.sum(axis=axes, keepdims=True).reshape(pb.bias_shape)


def backward(pb: Problem, dout, out, lse, bias_grad: bool, deterministic: bool):
    """(dq, dk, dv, dbias, delta) of a problem on CuPy arrays, in its internal layout; dbias
    None unless ``bias_grad``; delta = rowsum(dO * O) laid out like lse, in the accumulator
    dtype (what the row pass computed for the kernels; the sinks' gradient reads it). dout,
    out, lse: device arrays in the internal layout. The parameter block is reused as in
    :func:`forward` (dout and out count as operands)."""
    import cupy as xp

    device_id = pb.q.device.id
    with xp.cuda.Device(device_id):
        spec = _backward_spec(pb, device_id, deterministic)
        acc = accumulator_dtype(pb.dtype)
        dq = _empty(pb.q.shape, pb.dtype, xp)
        dk = _empty(pb.k.shape, pb.dtype, xp)
        dv = _empty(pb.v.shape, pb.dtype, xp)
        stream = xp.cuda.get_current_stream()
        with temporaries(stream):  # delta too: callers read it and let it go
            lse = xp.ascontiguousarray(lse, dtype=acc)
            delta, lse2 = xp.empty(pb.lse_shape, dtype=acc), xp.empty(pb.lse_shape, dtype=acc)
            grads = {"dq": dq, "dk": dk, "dv": dv}
            # The fused dQ's accumulator (flash_bwd.cu, kDqAccumScaled): atomics add column pairs
            # into (..., rows, D rounded up to even), zeroed by flash_bwd_delta. With dQ's own
            # dtype, an even D and spec.dq_accum_scaled that is dQ itself, and no conversion pass runs.
            if dq_is_accumulator(pb, spec):
                grads["dqa"] = dq
            elif spec.fused_dq:
                grads["dqa"] = _empty(pb.q.shape[:-1] + (-(-pb.head_dim // 2) * 2,), acc, xp)
            dq_accum = grads["dqa"].data.ptr if spec.fused_dq else 0
            operands = (pb.q, pb.k, pb.v, dout, out)
            key = _layout_key(pb, device_id, operands, spec)
            cached = _BACKWARD_TEMPLATES.get(key)
            rows = _template_rows(pb, operands, cached, xp)
            reduce_dbias = dbias_acc = None
            if rows is not None:
                q_ptr, k_ptr, v_ptr, dout_ptr, out_ptr = (x.data.ptr for x in rows)
                cached.run(stream.ptr, q_ptr, k_ptr, v_ptr, out_ptr, lse.data.ptr, dout_ptr, out_ptr,
                           delta.data.ptr, lse2.data.ptr, dq.data.ptr, dk.data.ptr, dv.data.ptr, dq_accum)
                keep_alive = rows
            else:
                q, k, v = _operands(pb, xp)
                dout, out = _rows(pb, dout, xp), _rows(pb, out, xp)
                params, keep_alive = _problem_params(pb, q, k, v, out, lse, xp, maps=spec.tile_maps)
                fields = _rows_fields(pb, {"do": dout, "out": out,
                                           **{n: _merged(pb, g, xp) for n, g in grads.items()}})
                if bias_grad:
                    dbias_view, reduce_dbias = _dbias_buffer(pb, deterministic, xp)
                    fields["dbias"] = dbias_view.data.ptr
                    for suffix, s in zip(("sb", "sh", "si", "sj"), _elem_strides(dbias_view)):
                        fields[f"db_{suffix}"] = s
                bparams = P.pack(
                    P.BWD_PARAMS_DTYPE, f=params, dout=dout.data.ptr, out=out.data.ptr, delta=delta.data.ptr,
                    lse2=lse2.data.ptr, dq=dq.data.ptr, dk=dk.data.ptr, dv=dv.data.ptr, d_true=pb.head_dim,
                    key_block_major=int(backward_key_block_major(spec, pb.causal is not None)), dq_accum=dq_accum,
                    **dict(zip(("key_blocks", "dq_row_blocks"), backward_blocks(pb, spec))),
                    **fields,
                )
                launches = backward_launches(pb, spec)
                if key is not None:
                    _BACKWARD_TEMPLATES.put(key, _launch_plan(P.Template(bparams, _BACKWARD_POINTERS), launches,
                                                              device_id, (q, k, v, dout, out), operands))
                block = bytearray(bparams.tobytes())
                for launch in launches:
                    _run(launch, device_id, block)
                if reduce_dbias is not None:
                    dbias_acc = reduce_dbias()
        # dbias is a result, so converted out here (always a copy); its buffers go with this frame
        dbias = dbias_acc.astype(pb.bias.dtype) if dbias_acc is not None else None
        del keep_alive, dbias_acc
    return dq, dk, dv, dbias, delta


class CallPlan(NamedTuple):
    """A planned call's work beyond its operands, for callers that key repeated calls on their
    layout and options (``flashcupy.calls``): the results to allocate, contiguous, as (shape,
    dtype, poisoned when :data:`poison_outputs` is set); a scratch block of ``scratch_bytes``
    for the temporaries the caller never sees (one allocation, the parts at
    ``scratch_offsets``); which operands to pass as fresh C-contiguous copies instead of
    themselves; and the launches, whose pointers come in ``order`` from the operands, the
    results, then the scratch parts (-1: a null pointer)."""

    launches: LaunchPlan
    results: tuple[tuple[tuple[int, ...], np.dtype, bool], ...]
    scratch_bytes: int
    scratch_offsets: tuple[int, ...]
    copies: tuple[bool, ...]
    order: tuple[int, ...]

    def run(self, stream: int, pointers: list[int]) -> None:
        """Queue the launches on ``stream`` with the addresses of the operands, the results and
        the scratch parts."""
        self.launches.run(stream, *[pointers[i] if i >= 0 else 0 for i in self.order])


#: Where each part of a plan's scratch block starts: a multiple of this many bytes (the
#: kernels read 16-byte vectors; 256 as the allocators' own blocks).
SCRATCH_ALIGN = 256


def _call_plan(plan: LaunchPlan | None, operands: int, results: list, scratch: list,
               order: tuple[int, ...]) -> CallPlan | None:
    """A CallPlan of ``operands`` operands (the plan's row operands first) over ``plan``, when
    each operand it copied can be any C-contiguous copy; ``scratch``: the (shape, dtype) of
    each temporary, laid out one after another in one block."""
    if plan is None or any(c and not p for c, p in zip(plan.copied, plan.packed)):
        return None
    offsets, end = [], 0
    for shape, dtype in scratch:
        offsets.append(end)
        end += -(-math.prod(shape) * np.dtype(dtype).itemsize // SCRATCH_ALIGN) * SCRATCH_ALIGN
    return CallPlan(plan, tuple(results), end, tuple(offsets), plan.copied + (False,) * (operands - len(plan.copied)),
                    order)


def _caller_shape(pb: Problem, shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape[1:] if pb.squeeze_head else shape


def _kept_forward(pb: Problem) -> tuple[LaunchPlan | None, KernelSpec | None]:
    """(the kept LaunchPlan of ``pb``'s layout, its kernel), (None, None) where no kernel fits
    (the call ran on the CPU backend), a None plan where the layout keeps none. A forward of
    the layout ran just before, but its plan may be gone (the oldest of _FORWARD_TEMPLATES'
    entries go) or was never put there (the call ran through a caller's plan, as the torch
    path's full path may through flashcupy.calls' CuPy entries): then it is packed again,
    with results allocated for their strides and nothing run."""
    device_id = pb.q.device.id
    try:
        spec = _forward_spec(pb, device_id)
    except NoKernelError:
        return None, None
    key = _layout_key(pb, device_id, (pb.q, pb.k, pb.v), spec)
    plan = _FORWARD_TEMPLATES.get(key)
    if plan is None and key is not None:
        import cupy as xp

        with xp.cuda.Device(device_id):
            _pack_forward(pb, spec, device_id, key, xp.empty(pb.out_shape, pb.dtype),
                          xp.empty(pb.lse_shape, accumulator_dtype(pb.dtype)), xp)
        plan = _FORWARD_TEMPLATES.get(key)
    return plan, spec


def forward_plan(pb: Problem) -> CallPlan | None:
    """The plan of :func:`forward` for calls laid out as ``pb`` (CuPy arrays, on the current
    device, with the caller's allocator: the block may be packed again, :func:`_kept_forward`):
    operands q, k, v; results out and lse in the caller's shapes. None where the layout keeps
    no block (:func:`_layout_key`) or copies rows as no contiguous copy can stand for."""
    if pb.sinks is not None:  # the block points to the sinks, an array no plan fills in
        return None
    plan, _ = _kept_forward(pb)
    results = [(_caller_shape(pb, pb.out_shape), pb.dtype, True),
               (_caller_shape(pb, pb.lse_shape), accumulator_dtype(pb.dtype), True)]
    return _call_plan(plan, 3, results, [], (0, 1, 2, 3, 4))


def backward_plan(pb: Problem, dout: Any, out: Any, lse: Any, deterministic: bool) -> CallPlan | None:
    """The plan of :func:`backward` (no dbias) for calls laid out as ``pb`` with these dout,
    out (internal layout) and lse: operands q, k, v, dout, out, lse (contiguous, the
    accumulator dtype); results dq, dk, dv in the caller's shapes; scratch delta, lse2 and
    the fused dQ's accumulator where it is not dQ. None as in :func:`forward_plan`, or for
    another lse or sinks."""
    if pb.sinks is not None:
        return None
    device_id = pb.q.device.id
    try:
        spec = _backward_spec(pb, device_id, deterministic)
    except NoKernelError:
        return None
    acc = accumulator_dtype(pb.dtype)
    if lse.dtype != acc or not lse.flags.c_contiguous:
        return None
    key = _layout_key(pb, device_id, (pb.q, pb.k, pb.v, dout, out), spec)
    plan = _BACKWARD_TEMPLATES.get(key)
    if plan is None and key is not None:  # gone or never put, as in _kept_forward: one more backward keeps it
        backward(pb, dout, out, lse, False, deterministic)
        plan = _BACKWARD_TEMPLATES.get(key)
    results = [(_caller_shape(pb, x.shape), pb.dtype, True) for x in (pb.q, pb.k, pb.v)]
    scratch = [(pb.lse_shape, acc), (pb.lse_shape, acc)]
    dq_accum = 6 if dq_is_accumulator(pb, spec) else -1  # dq itself, or none
    if spec.fused_dq and dq_accum < 0:
        scratch.append((pb.q.shape[:-1] + (-(-pb.head_dim // 2) * 2,), acc))  # zeroed by the delta kernel
        dq_accum = 11
    # operands q, k, v, dout, out, lse; results dq, dk, dv; scratch delta, lse2, dq_accum, in
    # _BACKWARD_POINTERS' order: q, k, v, out, lse, dout, out, delta, lse2, dq, dk, dv, dq_accum
    return _call_plan(plan, 6, results, scratch, (0, 1, 2, 4, 5, 3, 4, 9, 10, 6, 7, 8, dq_accum))


#: The fields of a plain forward's block that follow its operands' lengths and strides.
_FORWARD_SHAPED = ("q_sb", "q_sh", "q_sr", "k_sb", "k_sh", "k_sr", "v_sb", "v_sh", "v_sr", "o_sb", "o_sh", "o_sr",
                   "lse_sb", "lse_sh", "lq", "lk", "row_blocks")


class LengthPlan:
    """The forward of plain 4-D calls (one batch axis; no window, array option or dropout)
    that differ from a planned one only in their lengths Lq, Lk and their strides: the same
    kernel and block, with the pointers, strides, lengths and grid of each call. Callers
    check each call's operands (:meth:`takes`); results are out (B, Hq, Lq, Dv) and lse
    (B, Hq, Lq), contiguous."""

    def __init__(self, plan: LaunchPlan, pb: Problem, spec: KernelSpec) -> None:
        self.template = P.Template(plan.template.record, _FORWARD_POINTERS + _FORWARD_SHAPED)
        (self._function, (_, self._grid_y, self._grid_z), self._threads, self._smem), = plan._functions
        self._spec, self._hq, self.head_dim_v = spec, pb.num_heads_q, pb.head_dim_v
        self.device_id = plan.device_id
        self.dtype, self.lse_dtype = pb.dtype, accumulator_dtype(pb.dtype)
        self._vector = 16 // pb.dtype.itemsize  # elements of a 16-byte copy
        self._blocks = ThreadBlocks(self.template)

    def takes(self, q_shape: tuple, k_shape: tuple, v_shape: tuple, *strides: tuple) -> bool:
        """Whether a call's operands (shapes, then the strides of q, k, v in elements) fit:
        keys and values of one length, no empty length, unit last strides and the others
        whole 16-byte vectors (the kernels' copies), lengths within int32."""
        lq, lk = q_shape[2], k_shape[2]
        if not (0 < lq < 2**31 and 0 < lk < 2**31 and v_shape[2] == lk):
            return False
        vector = self._vector
        return all(s[3] == 1 and s[0] % vector == 0 and s[1] % vector == 0 and s[2] % vector == 0 for s in strides)

    def run(self, stream: int, pointers: tuple, lq: int, lk: int, q_strides: tuple, k_strides: tuple,
            v_strides: tuple) -> None:
        """Queue the forward on ``stream``: ``pointers`` of q, k, v, out, lse; the strides of
        q, k, v in elements (out and lse are contiguous)."""
        kept = self._blocks.get()
        hq, dv = self._hq, self.head_dim_v
        bind_context(self.device_id)
        self.template.fill_into(kept.block, *pointers, *q_strides[:3], *k_strides[:3], *v_strides[:3],
                                hq * lq * dv, lq * dv, dv, hq * lq, lq, lq, lk, -(-lq // self._spec.block_m))
        launch_ptr(self._function, (_forward_blocks(lq, dv, self._spec), self._grid_y, self._grid_z), self._threads,
                   kept.one, self._smem, stream)


def length_plan(pb: Problem) -> LengthPlan | None:
    """The :class:`LengthPlan` of a forward that ran (its block kept) for a plain 4-D problem
    with a single launch and no row copies, or None."""
    if (len(pb.batch) != 1 or pb.window is not None or pb.dropout_p > 0 or pb.seqlen_q == 0 or pb.seqlen_k == 0
            or pb.sinks is not None or not _points_to_operands_only(pb)):
        return None
    plan, spec = _kept_forward(pb)
    if plan is None or True in plan.copied or len(plan.launches) != 1:
        return None
    return LengthPlan(plan, pb, spec)
