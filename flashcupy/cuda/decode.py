"""Split-KV decoding against a contiguous or paged key/value cache (kernels_cu/flash_decode.cu).

One block per (sequence, KV head, split of the keys) holds every query row that reads that KV
head (the query heads of its group times Lq), so each key and value is read once per group;
the last block of a (sequence, KV head) to finish merges the splits' partial outputs and
log-sum-exps, with the sinks (its count of finished splits: :func:`counters`).
Paged caches are read through the block table in place. :func:`unsupported` says which calls
this path takes; :mod:`flashcupy.kvcache` sends the others to the general forward.
"""

from __future__ import annotations

import ctypes
import functools
import math
import threading
from typing import Any

import numpy as np

from ..problem import Problem, accumulator_dtype
from . import _dtype_name, _elem_strides, _empty, device_limits, per_head, temporaries
from . import params as P
from .compile import KeptBlock, ThreadBlocks, bind_context, get_function, launch_ptr
from .spec import CXX_TYPE
from .tensor_map import MAP_BYTES, TensorMapError, TiledLayout, strides_for

#: Head dims the kernel is compiled for (a call's D and Dv each take the smallest that fits).
HEAD_DIMS = (32, 64, 128, 256)
#: Query rows a block holds: G * Lq (query heads a KV head times queries a sequence) at most.
MAX_ROWS = 16
#: Threads of the decode kernels; stages of decode_split's copies (DecodeShape).
THREADS = 128
STAGES = 4
#: Keys a split takes at least when the count is chosen (num_splits=0): below that the merge
#: and the block's setup outweigh what the extra blocks add (B 1, 16k keys, D 128: 16 splits
#: ran faster than 32)...
MIN_SPLIT_KEYS = 1024
#: ...unless the grid would leave SMs without a block: splits then go down to this many keys,
#: up to a block an SM (B 1, 1k keys, D 128: 8 splits of 128 keys 14.6 us against 25.3 for
#: one; bench/NOTES.md, 'Decode: short caches split to fill the SMs').
SHORT_SPLIT_KEYS = 128


#: Warps of decode_split_mma and keys a warp's tile: a block steps over WARPS * 16 keys.
MMA_WARPS, MMA_KEYS = 4, 16


@functools.cache
def mma_shape(hk: int, hv: int, tma: bool = False) -> tuple[int, int]:
    """(keys a block's step, shared-memory bytes) of decode_split_mma<T, hk, hv, tma> (16-bit
    T), as DecodeMmaShape works them out (the kernel checks the bytes against its own)."""
    stages = 2 if hk + hv > 256 else 3
    tile_k, tile_v = (MMA_KEYS * 2 * h + (0 if tma else MMA_KEYS * 16) for h in (hk, hv))
    tiles = MMA_WARPS * stages * (tile_k + tile_v)
    merge = MMA_WARPS * 16 * (hv + 8 + 2) * 4  # O at a pitch of hv + 8 floats, then m and l
    used = max(tiles, merge) + 16 * (hk + 8) * 2 + 16 * 4 * 4 + (MMA_WARPS * stages * 8 if tma else 0)
    return MMA_WARPS * MMA_KEYS, used + (1024 if tma else 0)


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


def tma_fits(dtype: np.dtype, d: int, dv: int, device_id: int) -> bool:
    """Whether decode_split_mma can take its K and V tiles by tensor copies: sm_90+, 16-bit,
    both padded head dims whole 64-column boxes (the layout's page and strides are the
    caller's to check: :meth:`DecodePlan.maps`)."""
    return (np.dtype(dtype).itemsize == 2 and device_limits(device_id)[0] >= 90
            and min(_padded(d), _padded(dv)) >= 64)


def _padded(d: int) -> int:
    return next(h for h in HEAD_DIMS if h >= d)


def _rows(rows: int) -> int:
    return 1 << max(0, rows - 1).bit_length()


@functools.cache
def plan(dtype: np.dtype, d: int, dv: int, rows: int, device_id: int,
         tma: bool = False) -> tuple[str, int, int, str]:
    """(decode kernel's name expression, keys a step of its key loop, shared-memory bytes, its
    copies) for head dims d, dv and G * Lq rows on a device: mma.sync for float16 and bfloat16
    on sm_80+, its K and V tiles by tensor copies ("tma") where ``tma`` and :func:`tma_fits`,
    else by cp.async ("cp.async"); the CUDA-core kernel ("simt") otherwise."""
    name = _dtype_name(dtype)
    hk, hv = _padded(d), _padded(dv)
    if np.dtype(dtype).itemsize == 2 and device_limits(device_id)[0] >= 80:
        tma = tma and tma_fits(dtype, d, dv, device_id)
        tile, smem = mma_shape(hk, hv, tma)
        return (f"flash::decode_split_mma<{CXX_TYPE[name]}, {hk}, {hv}, {str(tma).lower()}, {smem}>", tile, smem,
                "tma" if tma else "cp.async")
    tile, smem = tile_shape(name, hk, hv, _rows(rows))
    return f"flash::decode_split<{CXX_TYPE[name]}, {hk}, {hv}, {_rows(rows)}, {smem}>", tile, smem, "simt"


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
def _multiprocessors(device_id: int) -> int:
    """The multiprocessors (SMs) of ``device_id``."""
    import cupy

    return int(cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"])


@functools.cache
def _busy_blocks(device_id: int, smem: int, regs: int, copies: str) -> int:
    """Blocks of a split kernel that keep the GPU busy: what the SMs hold at once, by shared
    memory (1 KB of it reserved a block) and registers; for decode_split_mma at most two an SM
    (at D 64, where four fit, two an SM ran faster: the other two only added splits to merge;
    bench/NOTES.md, 'Decode: the last split merges')."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    sms = _multiprocessors(device_id)
    by_smem = int(props["sharedMemPerMultiprocessor"]) // (smem + 1024)
    by_regs = int(props["regsPerMultiprocessor"]) // max(1, regs * THREADS)
    each = max(1, min(by_smem, by_regs))
    return sms * (each if copies == "simt" else min(each, 2))


@functools.lru_cache(maxsize=1024)
def choose_splits(blocks: int, max_keys: int, slots: int, sms: int) -> int:
    """Splits over the keys when the caller leaves it to us. With S splits the kernel runs
    ceil(blocks S / slots) waves of blocks (slots: :func:`_busy_blocks`) that each do 1/S of a
    sequence's keys; S minimises that time, with 1% a split added for the merge and each
    block's fixed work, each split at least MIN_SPLIT_KEYS keys, or SHORT_SPLIT_KEYS while
    the grid stays within a block for each of the ``sms`` multiprocessors. A grid a little
    over one wave (512 blocks on 396 slots) thus splits in 3 rather than run a second, mostly
    idle wave."""
    blocks, slots = max(blocks, 1), max(slots, 1)
    most = max_keys // MIN_SPLIT_KEYS
    if blocks * most < sms:  # SMs left idle: shorter splits, up to a block an SM
        most = min(max_keys // SHORT_SPLIT_KEYS, max(most, sms // blocks))
    most = max(1, min(P.DECODE_MAX_SPLITS, most))
    return min(range(1, most + 1), key=lambda s: -(-blocks * s // slots) / s * (1 + 0.01 * s))


def counters(blocks: int, device_id: int, stream: Any, capturing: bool) -> Any:
    """``blocks`` int32 counts of finished splits, zero, for a split launch on ``stream`` (the
    last block of each (sequence, KV head) zeroes its count again for the next launch). Kept
    a stream, where launches run in order (the per-thread default stream, one handle for a
    different stream in each thread, a thread); a stream being captured into a CUDA graph
    (``capturing``) gets fresh ones, zeroed by a node of the graph, so replays share counts
    with no other work (allocate them under :func:`temporaries`)."""
    import cupy as cp

    per_thread = threading.get_ident() if stream.ptr == _PER_THREAD_STREAM else 0
    key = (device_id, stream.ptr, per_thread)
    kept = _COUNTERS.get(key)
    if kept is not None and kept.size >= blocks and not capturing:
        return kept
    size = blocks if capturing or kept is None else max(blocks, 2 * kept.size)
    with cp.cuda.Device(device_id):
        fresh = cp.zeros(size, np.int32)  # zeroed on the stream
    if not capturing:
        if len(_COUNTERS) >= 1024:  # a few streams a process: bounded all the same
            _COUNTERS.clear()
        _COUNTERS[key] = fresh
    return fresh


#: cudaStreamPerThread's handle.
_PER_THREAD_STREAM = 2

#: Each stream's counts of finished splits (:func:`counters`) by (device, stream, thread).
_COUNTERS: dict[tuple[int, int, int], Any] = {}


def kernels(q: Any, v_cache: Any, pb: Problem, page: int = 0,
            tma: bool = True) -> tuple[Any, Any, int, int, str]:
    """(split kernel, append kernel, keys a step, shared memory, the split kernel's copies
    as :func:`plan` names them) of a call,
    compiled (once a process; flash_attention_with_kvcache asks before it writes the cache,
    so a compile error leaves the cache as it was). page: keys a block of a paged cache (0:
    contiguous); tensor copies where ``tma`` and the layout allows (:func:`tma_fits`, pages of
    whole 16-key tiles)."""
    tma = tma and page % MMA_KEYS == 0
    split_name, tile, smem, copies = plan(pb.dtype, q.shape[-1], v_cache.shape[-1], pb.group_size * q.shape[2],
                                          q.device.id, tma)
    split_fn = get_function("decode", split_name, q.device.id, smem)
    append_fn = get_function("decode", f"flash::decode_append<{CXX_TYPE[_dtype_name(pb.dtype)]}>", q.device.id)
    return split_fn, append_fn, tile, smem, copies


#: DecodeParams' fields each launch fills (pointers, then the split of the keys), in DecodePlan's order.
_FILLED = ("q", "k", "v", "keys", "block_table", "alibi", "sinks", "o_part", "lse_part", "o", "lse", "k_new",
           "v_new", "counters", "splits", "split_keys", "keys_all")


def _template(fields: tuple[tuple[str, Any], ...]) -> P.Template:
    """The parameter block of these fixed fields, packed once a plan; each launch fills the rest."""
    return P.Template(P.pack(P.DECODE_PARAMS_DTYPE, **dict(fields)), _FILLED)


class DecodePlan:
    """What every decode call of one layout shares: its kernels, their shared memory and
    busy blocks, the output shapes and the parameter block's fixed fields (shapes, strides,
    scale and score options). Made once per layout by :func:`plan_for`; each call then costs
    its allocations, one block fill and one launch, two with an append (:meth:`launch`)."""

    def __init__(self, q: Any, k_cache: Any, v_cache: Any, pb: Problem, k: Any, v: Any, page: int,
                 table_stride: int, capacity: int, num_blocks: int) -> None:
        batch, hq, lq, d = q.shape
        self.hk, self.dv = k_cache.shape[1], v_cache.shape[-1]
        self.device_id = q.device.id
        self.dtype, self.acc = pb.dtype, accumulator_dtype(pb.dtype)
        self.out_shape, self.lse_shape = (batch, hq, lq, self.dv), (batch, hq, lq)
        self.rows = batch * hq * lq
        self.blocks = batch * self.hk
        self.split_fn, self.append_fn, self.tile, self.smem, self.copies = kernels(q, v_cache, pb, page)
        #: Tensor maps of the caches by their addresses (TMA kernels; else a zero block).
        self._maps: dict[tuple[int, int], Any] = {}
        self._map_layouts: list[TiledLayout] = []  # the K and V caches' shapes, as the driver takes them
        #: splits() by (most keys, num_splits).
        self._splits: dict[tuple[int, int], tuple[int, int]] = {}
        if self.copies == "tma":
            try:
                self.maps(k_cache, v_cache)
            except TensorMapError:  # the driver refuses this layout: cp.async copies instead
                self.split_fn, _, self.tile, self.smem, self.copies = kernels(q, v_cache, pb, page, tma=False)
        import cupy

        with cupy.cuda.Device(self.device_id):  # the CUfunctions of q's device, launched through the driver
            self.split_ptr, self.append_ptr = self.split_fn.kernel.ptr, self.append_fn.kernel.ptr
        self.new = 0 if k is None else k.shape[2]
        self.slots = _busy_blocks(self.device_id, self.smem, int(getattr(self.split_fn, "num_regs", 0)), self.copies)
        self.sms = _multiprocessors(self.device_id)
        #: q is copied when its last axis is strided (the kernels read 16-byte chunks).
        self.copy_q = q.strides[-1] != q.itemsize
        q_strides = _elem_strides(q) if not self.copy_q else _packed(q.shape)
        fields = dict(scale=pb.scale, softcap=pb.softcap or 0.0, batch=batch, hq=hq, hk=self.hk, lq=lq, d=d,
                      dv=self.dv, causal=P.CAUSAL_CODE[pb.causal], page=page, bt_sb=table_stride,
                      keys_add=self.new, capacity=capacity, num_blocks=num_blocks)
        #: k and v (the new keys) are copied when their last axis is strided (the append reads rows).
        self.copy_new = self.new and (k.strides[-1] != k.itemsize or v.strides[-1] != v.itemsize)
        rows = [("q", q_strides), ("k", _elem_strides(k_cache)), ("v", _elem_strides(v_cache))]
        if self.new:
            rows += [("kn", _elem_strides(k) if not self.copy_new else _packed(k.shape)),
                     ("vn", _elem_strides(v) if not self.copy_new else _packed(v.shape))]
        for prefix, strides in rows:
            for axis, stride in zip(("sb", "sh", "sr"), strides[:3]):
                fields[f"{prefix}_{axis}"] = stride
        left, right = pb.window if pb.window is not None else (None, None)
        fields["window_left"] = -1 if left is None else min(left, 2**31 - 1)
        fields["window_right"] = -1 if right is None else min(right, 2**31 - 1)
        self.template = _template(tuple(fields.items()))
        #: Each thread's parameter block and the driver's argument arrays over it (_Arguments).
        self._arguments = ThreadBlocks(self.template, _Arguments)

    def maps(self, k_cache: Any, v_cache: Any) -> Any:
        """The split kernel's DecodeMaps block for these caches (a ctypes array): their tensor
        maps (4-d, (D, rows, Hk, B or num_blocks), boxes of (64, 16, 1, 1), 128-byte swizzle)
        where the kernel takes its tiles by tensor copies, encoded once per pair of addresses;
        zeros otherwise."""
        if self.copies != "tma":
            return _NO_MAPS
        key = (k_cache.data.ptr, v_cache.data.ptr)
        block = self._maps.get(key)
        if block is None:
            if len(self._maps) >= 4096:  # a few per layer of a model: bounded all the same
                self._maps.clear()
            if not self._map_layouts:
                for cache in (k_cache, v_cache):
                    dims = cache.shape[::-1]
                    self._map_layouts.append(TiledLayout(dims, strides_for(dims, cache.strides[-2::-1]),
                                                         (64, MMA_KEYS, 1, 1)))
            block = (ctypes.c_uint8 * (2 * MAP_BYTES))()
            for n, address in enumerate(key):
                ctypes.memmove(ctypes.addressof(block) + n * MAP_BYTES, self._map_layouts[n].encode(address),
                               MAP_BYTES)
            self._maps[key] = block
        return block

    def splits(self, max_keys: int, num_splits: int) -> tuple[int, int]:
        """(splits, keys a split) for sequences of at most ``max_keys`` keys: ``num_splits``
        (0: chosen by :func:`choose_splits`) cut to one split per step of the key loop and to
        DECODE_MAX_SPLITS."""
        if num_splits <= 0:
            num_splits = choose_splits(self.blocks, max_keys, self.slots, self.sms)
        tiles = max(1, -(-max_keys // self.tile))
        split_keys = -(-tiles // min(num_splits, tiles, P.DECODE_MAX_SPLITS)) * self.tile
        return max(1, -(-max_keys // split_keys)), split_keys

    def launch(self, q: Any, k_cache: Any, v_cache: Any, k: Any, v: Any, lengths: Any, max_keys: int, table: Any,
               alibi: Any, sinks: Any, num_splits: int, stream: Any, capturing: bool,
               want_lse: bool = True) -> tuple[Any, Any]:
        """(out (B, Hq, Lq, Dv), lse (B, Hq, Lq)) of one call, after k and v (B, Hk, Lnew, D /
        Dv; None without an append) are written into the caches, on the current stream.
        lengths: an int, every sequence's keys after the append, or a device (B,) int32 array
        of each one's before it (its bad values give NaN, see decode_params.cuh); max_keys: the
        most keys a sequence attends (the split is planned for it); table: the device int32
        block table this plan's stride describes, or None; alibi, sinks: device (B, Hq) float64
        arrays or None; stream: CuPy's current stream, ``capturing`` whether it is being
        captured into a CUDA graph (the temporaries are then the graph's, :func:`temporaries`).
        Without ``want_lse`` the lse returned is None (the merge writes it beside the partials)."""
        import cupy as cp

        out = _empty(self.out_shape, self.dtype, cp)
        lse = _empty(self.lse_shape, self.acc, cp) if want_lse else None
        if self.blocks == 0:
            return out, lse
        split = self._splits.get((max_keys, num_splits))
        if split is None:
            if len(self._splits) >= 1024:
                self._splits.clear()
            split = self._splits[max_keys, num_splits] = self.splits(max_keys, num_splits)
        splits, split_keys = split
        with temporaries(stream, capturing):
            if self.copy_q:
                q = cp.ascontiguousarray(q)
            if self.copy_new:
                k, v = cp.ascontiguousarray(k), cp.ascontiguousarray(v)
            # The splits' partial outputs (splits, rows, Dv) and log-sum-exps (splits, rows), and
            # the lse when the caller does not keep it (rows), in one allocation.
            item = self.acc.itemsize
            part = cp.cuda.alloc((splits * (self.dv + 1) + (lse is None)) * self.rows * item)
            count = counters(self.blocks, self.device_id, stream, capturing) if splits > 1 else None
        o_part = part.ptr
        lse_part = o_part + splits * self.rows * self.dv * item
        lse_ptr = lse.data.ptr if lse is not None else lse_part + splits * self.rows * item
        per_sequence = not isinstance(lengths, int)
        call = self._arguments.get()
        self.template.fill_into(
            call.block, q.data.ptr, k_cache.data.ptr, v_cache.data.ptr, lengths.data.ptr if per_sequence else 0,
            0 if table is None else table.data.ptr, 0 if alibi is None else alibi.data.ptr,
            0 if sinks is None else sinks.data.ptr, o_part, lse_part, out.data.ptr, lse_ptr,
            k.data.ptr if self.new else 0, v.data.ptr if self.new else 0, 0 if count is None else count.data.ptr,
            splits, split_keys, 0 if per_sequence else lengths)
        handle = stream.ptr
        bind_context(self.device_id)
        if self.new:
            launch_ptr(self.append_ptr, (self.blocks, min(self.new, 65535)), THREADS, call.one, 0, handle)
        if self.rows:
            split_args = call.one
            if self.copies != "simt":
                call.maps = self.maps(k_cache, v_cache)  # held here: another thread may clear the plan's maps
                call.pair[1] = ctypes.addressof(call.maps)
                split_args = call.pair_ptr
            launch_ptr(self.split_ptr, (self.blocks, splits), THREADS, split_args, self.smem, handle)
        # CuPy's pool hands freed memory only to later work on the stream; in a capture, the
        # graph frees its own (temporaries())
        del part, count
        return out, lse


#: The DecodeMaps block of a kernel that takes its tiles by cp.async (unread).
_NO_MAPS = (ctypes.c_char * (2 * MAP_BYTES))()


class _Arguments(KeptBlock):
    """One thread's DecodeParams block for a plan's launches (the plan's fixed fields written
    once, the rest by each call): ``one`` for the append and the CUDA-core split,
    and ``pair`` (the block, then the split's DecodeMaps) at ``pair_ptr`` for decode_split_mma."""

    def __init__(self, template: P.Template) -> None:
        super().__init__(template)
        self.maps = _NO_MAPS  # the DecodeMaps block pair[1] points to, kept alive with it
        self.pair = (ctypes.c_void_p * 2)(ctypes.addressof(self.block), ctypes.addressof(self.maps))
        self.pair_ptr = ctypes.addressof(self.pair)


def _packed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides in elements of a C-contiguous array of ``shape``."""
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


def plan_for(q: Any, k_cache: Any, v_cache: Any, pb: Problem, k: Any = None, v: Any = None, page: int = 0,
             table_stride: int = 0, capacity: int = 0, num_blocks: int = 0) -> DecodePlan:
    """The :class:`DecodePlan` of a call's layout (made on the first call of it): q, the caches,
    the problem's scalar options, the new keys and values (or None); page: keys a block of a
    paged cache (0: contiguous); table_stride: the device block table's row stride in
    elements; capacity: keys a sequence's cache holds; num_blocks: blocks of a paged cache."""
    new = None if k is None else (k.shape, k.strides, v.shape, v.strides)
    key = (q.device.id, pb.dtype, q.shape, q.strides, k_cache.shape, k_cache.strides, v_cache.shape,
           v_cache.strides, new, pb.scale, math.copysign(1.0, pb.scale), pb.softcap, pb.causal, pb.window, page,
           table_stride, capacity, num_blocks)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 256:  # a few per model (a layer shape and batch size each): bounded all the same
            _PLANS.clear()
        plan = _PLANS[key] = DecodePlan(q, k_cache, v_cache, pb, k, v, page, table_stride, capacity, num_blocks)
    return plan


#: Plans by layout key.
_PLANS: dict[tuple, DecodePlan] = {}


def device_table(table: Any) -> Any:
    """A block table as the kernels read it: a device int32 array with a contiguous last axis
    (the caller's own where it is one; else a copy)."""
    import cupy as cp

    if isinstance(table, cp.ndarray) and table.dtype == np.int32 and table.strides[-1] == 4 \
            and table.strides[0] % 4 == 0:
        return table
    return cp.ascontiguousarray(cp.asarray(table).astype(np.int32, copy=False))


def score_arrays(pb: Problem, heads: tuple[int, int]) -> tuple[Any, Any]:
    """(ALiBi slopes, sinks) of a problem as the kernels read them: device (B, Hq) float64
    arrays for heads = (B, Hq), or None for an option not in use."""
    import cupy as cp

    return tuple(None if x is None else per_head(x, heads, cp) for x in (pb.alibi_slopes, pb.sinks))
