"""Split-KV decoding against a contiguous or paged key/value cache (kernels_cu/flash_decode.cu).

One block per (sequence, KV head, split of the keys) holds every query row that reads that KV
head (the query heads of its group times Lq), so each key and value is read once per group;
the splits' partial outputs and log-sum-exps are merged by a second kernel, with the sinks.
Paged caches are read through the block table in place. :func:`unsupported` says which calls
this path takes; :mod:`flashcupy.kvcache` sends the others to the general forward.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..problem import Problem, accumulator_dtype
from . import _dtype_name, _empty, device_limits
from . import params as P
from .compile import get_function
from .spec import CXX_TYPE

#: Head dims the kernel is compiled for (a call's D and Dv each take the smallest that fits).
HEAD_DIMS = (32, 64, 128, 256)
#: Query rows a block holds: G * Lq (query heads a KV head times queries a sequence) at most.
MAX_ROWS = 16
#: Threads of decode_split and decode_merge; stages of decode_split's copies (DecodeShape).
THREADS = 128
STAGES = 4
#: Keys a split takes at least when the count is chosen (num_splits=0): below that the merge
#: and the block's setup outweigh what the extra blocks add.
MIN_SPLIT_KEYS = 512


#: Warps of decode_split_mma and keys a warp's tile: a block steps over WARPS * 16 keys.
MMA_WARPS, MMA_KEYS = 4, 16


@functools.cache
def mma_shape(hk: int, hv: int) -> tuple[int, int]:
    """(keys a block's step, shared-memory bytes) of decode_split_mma<T, hk, hv> (16-bit T), as
    DecodeMmaShape works them out (the kernel checks the bytes against its own)."""
    stages = 2 if hk + hv > 256 else 3
    ldk, ldv = hk + 8, hv + 8
    tiles = MMA_WARPS * stages * MMA_KEYS * (ldk + ldv) * 2
    merge = MMA_WARPS * 16 * (hv + 2) * 4
    return MMA_WARPS * MMA_KEYS, max(tiles, merge) + 16 * ldk * 2 + 16 * 4 * 4


@functools.cache
def tile_shape(dtype_name: str, hk: int, hv: int, rows: int) -> tuple[int, int]:
    """(keys a tile, shared-memory bytes) of decode_split<T, hk, hv, rows> (float32, float64),
    as DecodeShape works them out (the kernel checks the bytes against its own)."""
    size = np.dtype(np.float16 if dtype_name == "bfloat16" else dtype_name).itemsize
    acc = 8 if dtype_name == "float64" else 4
    vec = 16 // size
    keys = min(128, 8192 // (max(hk, hv) * size))
    split = min(THREADS // keys, hk // vec)
    pitch_k, pitch_v = (hk // vec + split) * 16, (hv // vec + 1) * 16
    tiles = STAGES * keys * (pitch_k + pitch_v)
    return keys, tiles + rows * hk * acc + rows * keys * acc + rows * (4 * acc + 3 * 4)


def _padded(d: int) -> int:
    return next(h for h in HEAD_DIMS if h >= d)


def _rows(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length()


@functools.cache
def plan(dtype: np.dtype, d: int, dv: int, rows: int, device_id: int) -> tuple[str, int, int]:
    """(decode kernel's name expression, keys a step of its key loop, shared-memory bytes) for
    head dims d, dv and G * Lq rows on a device: mma.sync for float16 and bfloat16 on sm_80+,
    the CUDA-core kernel otherwise."""
    name = _dtype_name(dtype)
    hk, hv = _padded(d), _padded(dv)
    if np.dtype(dtype).itemsize == 2 and device_limits(device_id)[0] >= 80:
        tile, smem = mma_shape(hk, hv)
        return f"flash::decode_split_mma<{CXX_TYPE[name]}, {hk}, {hv}, {smem}>", tile, smem
    tile, smem = tile_shape(name, hk, hv, _rows(rows))
    return f"flash::decode_split<{CXX_TYPE[name]}, {hk}, {hv}, {_rows(rows)}, {smem}>", tile, smem


def unsupported(q: Any, k_cache: Any, v_cache: Any) -> str | None:
    """Why the decode kernels cannot run this call (None: they can), from its arrays alone:
    q (B, Hq, Lq, D) CuPy; the caches (B or num_blocks, Hk, rows, D / Dv) as
    flash_attention_with_kvcache takes them, checked already against q's batch and D."""
    return _unsupported(q.device.id,
                        *((x.dtype, x.shape, x.strides, x.data.ptr % 16 == 0) for x in (q, k_cache, v_cache)))


@functools.lru_cache(maxsize=256)
def _unsupported(device_id: int, *arrays: tuple) -> str | None:
    """:func:`unsupported` of arrays described by (dtype, shape, strides, 16-byte aligned)."""
    (dtype, q_shape, _, _), (k_dtype, k_shape, _, _), (v_dtype, v_shape, _, _) = arrays
    if dtype.name not in CXX_TYPE or k_dtype != dtype or v_dtype != dtype:
        return f"dtype {dtype.name}"
    hq, hk = q_shape[1], k_shape[1]
    if hk == 0 or hq % hk:
        return f"{hq} query heads over {hk} key/value heads"
    rows = hq // hk * q_shape[2]
    if rows > MAX_ROWS:
        return f"{rows} query rows a KV head (more than {MAX_ROWS})"
    for name, (_, shape, strides, aligned) in zip(("q", "k_cache", "v_cache"), arrays):
        if shape[-1] > HEAD_DIMS[-1] or (shape[-1] * dtype.itemsize) % 16:
            return f"{name}'s head dim {shape[-1]} (16-byte chunks up to {HEAD_DIMS[-1]} wanted)"
        if name != "q" and (not aligned or strides[-1] != dtype.itemsize
                            or any(s % 16 for n, s in zip(shape[:-1], strides[:-1]) if n > 1)):
            return f"{name}'s layout (16-byte aligned rows with a contiguous last axis wanted)"
    limit = device_limits(device_id)[1]
    smem = plan(dtype, q_shape[-1], v_shape[-1], rows, device_id)[2]
    if smem > limit:
        return f"{smem} bytes of shared memory a block (the GPU allows {limit})"
    return None


@functools.cache
def _resident_blocks(device_id: int, smem: int, regs: int) -> int:
    """Blocks of decode_split an SM holds at once: multiprocessors times the blocks each takes
    by its shared memory (1 KB of it reserved a block) and registers."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    by_smem = int(props["sharedMemPerMultiprocessor"]) // (smem + 1024)
    by_regs = int(props["regsPerMultiprocessor"]) // max(1, regs * THREADS)
    return int(props["multiProcessorCount"]) * max(1, min(by_smem, by_regs))


@functools.lru_cache(maxsize=1024)
def choose_splits(blocks: int, max_keys: int, slots: int) -> int:
    """Splits over the keys when the caller leaves it to us. With S splits the kernel runs
    ceil(blocks S / slots) waves of blocks that each do 1/S of a sequence's keys; S minimises
    that time, with 1% a split added for the merge and each block's fixed work, each split at
    least MIN_SPLIT_KEYS keys. A grid a little over one wave (512 blocks on 396 slots) thus
    splits in 3 rather than run a second, mostly idle wave."""
    most = max(1, min(256, max_keys // MIN_SPLIT_KEYS))
    blocks, slots = max(blocks, 1), max(slots, 1)
    return min(range(1, most + 1), key=lambda s: -(-blocks * s // slots) / s * (1 + 0.01 * s))


def kernels(q: Any, v_cache: Any, pb: Problem) -> tuple[Any, Any, int, int]:
    """(split kernel, merge kernel, keys a step, shared memory) of a call, compiled (once a
    process; flash_attention_with_kvcache asks before it writes the cache, so a compile error
    leaves the cache as it was)."""
    split_name, tile, smem = plan(pb.dtype, q.shape[-1], v_cache.shape[-1], pb.group_size * q.shape[2], q.device.id)
    split_fn = get_function("decode", split_name, q.device.id, smem)
    merge_fn = get_function("decode", f"flash::decode_merge<{CXX_TYPE[_dtype_name(pb.dtype)]}>", q.device.id)
    return split_fn, merge_fn, tile, smem


#: DecodeParams' pointer fields, in the order decode fills them.
_POINTERS = ("q", "k", "v", "keys", "block_table", "alibi", "sinks", "o_part", "lse_part", "o", "lse")


@functools.lru_cache(maxsize=256)
def _template(fields: tuple[tuple[str, Any], ...]) -> P.Template:
    """The parameter block of these scalar fields, packed once; each launch fills its pointers."""
    return P.Template(P.pack(P.DECODE_PARAMS_DTYPE, **dict(fields)), _POINTERS)


def decode(q: Any, k_cache: Any, v_cache: Any, keys: np.ndarray, table: Any, pb: Problem,
           num_splits: int) -> tuple[Any, Any]:
    """(out (B, Hq, Lq, Dv), lse (B, Hq, Lq)) of q against the caches, CuPy arrays.

    keys: host (B,) ints, the keys each sequence attends; table: (B, max_blocks) ints, host
    or device, in range in the slots the sequences use (paged), or None (contiguous);
    num_splits: 0 to choose, else at most one split per step of the key loop (64 keys on
    tensor cores) is kept. Options (scale, causal, window, ALiBi, softcap, sinks) come from
    ``pb``.
    """
    import cupy as cp

    batch, hq, lq, d = q.shape
    hk, dv = k_cache.shape[1], v_cache.shape[-1]
    acc = accumulator_dtype(pb.dtype)
    out = _empty((batch, hq, lq, dv), pb.dtype, cp)
    lse = _empty((batch, hq, lq), acc, cp)
    if out.size == 0 and lse.size == 0:
        return out, lse
    split_fn, merge_fn, tile, smem = kernels(q, v_cache, pb)
    device_id = q.device.id
    max_keys = int(keys.max()) if batch else 0
    if num_splits <= 0:
        slots = _resident_blocks(device_id, smem, int(getattr(split_fn, "num_regs", 0)))
        num_splits = choose_splits(batch * hk, max_keys, slots)
    tiles = max(1, -(-max_keys // tile))
    num_splits = min(num_splits, tiles, 65535)  # grid y
    split_keys = -(-tiles // num_splits) * tile
    num_splits = max(1, -(-max_keys // split_keys))

    if q.strides[-1] != q.itemsize:
        q = cp.ascontiguousarray(q)
    o_part = _empty((num_splits, batch * hq * lq, dv), acc, cp)
    lse_part = _empty((num_splits, batch * hq * lq), acc, cp)
    keep = []
    pointers = dict.fromkeys(_POINTERS, 0)
    pointers.update(q=q.data.ptr, k=k_cache.data.ptr, v=v_cache.data.ptr, o_part=o_part.data.ptr,
                    lse_part=lse_part.data.ptr, o=out.data.ptr, lse=lse.data.ptr)
    fields = dict(scale=pb.scale, softcap=pb.softcap or 0.0, batch=batch, hq=hq, hk=hk, lq=lq, d=d, dv=dv,
                  causal=P.CAUSAL_CODE[pb.causal], page=0, splits=num_splits, split_keys=split_keys)
    for prefix, x in (("q", q), ("k", k_cache), ("v", v_cache)):
        for axis, stride in zip(("sb", "sh", "sr"), x.strides[:3]):
            fields[f"{prefix}_{axis}"] = stride // x.itemsize
    if batch and (keys == max_keys).all():  # one length: a scalar, no copy to the device
        fields["keys_all"] = max_keys
    else:
        keys_dev = cp.asarray(keys.astype(np.int32))
        keep.append(keys_dev)
        pointers["keys"] = keys_dev.data.ptr
    left, right = pb.window if pb.window is not None else (None, None)
    fields["window_left"] = -1 if left is None else min(left, 2**31 - 1)
    fields["window_right"] = -1 if right is None else min(right, 2**31 - 1)
    if table is not None:  # the caller's device table as it is where its layout allows
        if not (isinstance(table, cp.ndarray) and table.dtype == np.int32 and table.strides[-1] == 4
                and table.strides[0] % 4 == 0):
            table = cp.ascontiguousarray(cp.asarray(table).astype(np.int32, copy=False))
        keep.append(table)
        pointers["block_table"] = table.data.ptr
        fields.update(bt_sb=table.strides[0] // 4, page=k_cache.shape[2])
    if pb.alibi_slopes is not None:
        slopes = cp.asarray(np.ascontiguousarray(np.broadcast_to(pb.alibi_slopes, (batch, hq)), dtype=np.float64))
        keep.append(slopes)
        pointers["alibi"] = slopes.data.ptr
    if pb.sinks is not None:
        sinks = cp.ascontiguousarray(cp.broadcast_to(cp.asarray(pb.sinks, dtype=np.float64), (batch, hq)))
        keep.append(sinks)
        pointers["sinks"] = sinks.data.ptr
    block = _template(tuple(fields.items())).fill(*pointers.values())
    if batch * hk:
        split_fn((batch * hk, num_splits), (THREADS,), (block,), shared_mem=smem)
    merge_fn((batch * hq * lq,), (THREADS,), (block,))
    del keep  # CuPy's pool hands freed memory only to later work on the stream
    return out, lse
