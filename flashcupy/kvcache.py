"""Decoding against a key/value cache, and the merge of partial attention results.

:func:`flash_attention_with_kvcache` appends new keys and values to a contiguous or paged
cache in place and attends over each sequence's valid keys; :func:`merge_attention_states`
combines attention over two disjoint key sets into attention over their union.

Both take NumPy or CuPy arrays (the cache is written in place, so it must already be one of
them) and return the kind that went in. On CuPy arrays the attention runs on the split-KV decode kernels
(:mod:`flashcupy.cuda.decode`: the keys split across blocks, the query heads that share a KV
head read each key once, paged caches read through the block table in place); calls they do
not take (more than 16 query rows a KV head, head dims past 256 or not whole 16-byte chunks,
unaligned caches), and NumPy arrays, run :func:`flashcupy.flash_attention` with
``kv_lengths``, a paged cache gathered into a contiguous copy of the blocks in use first.

A call's layout (array kinds, shapes, strides, dtypes, options) is checked once and kept; each
call checks its values. On the decode kernels a CuPy ``cache_seqlens`` or ``block_table`` is
left on the device for the kernels to check (a bad entry gives NaN, never a read or write
outside the caches); everywhere else lengths and tables are checked on the host first.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np

from . import api as _api
from . import interop
from .problem import dtype_name
from .problem import device_array, make_device_problem, make_host_problem
from .problem.validate import check_array, check_float_dtype, host_array


def _module(name: str, x: Any, xp: Any) -> None:
    """A TypeError unless ``x`` is an array of module ``xp`` (a cache written in place cannot be
    converted, and the arrays of one call live in one place)."""
    check_array(name, x)
    if interop.array_module(x) is not xp or not hasattr(x, "flags"):
        want = "a NumPy array" if xp is np else "a CuPy array"
        raise TypeError(f"{name}: expected {want} like q (the cache is written in place), "
                        f"received {type(x).__module__}.{type(x).__name__}")


def _shape(name: str, x: Any, want: tuple, rule: str) -> None:
    """A ValueError unless ``x.shape`` matches ``want`` (None entries match anything)."""
    if x.ndim != len(want) or any(w is not None and s != w for s, w in zip(x.shape, want)):
        shown = tuple("*" if w is None else w for w in want)
        raise ValueError(f"{name}: expected shape {shown} ({rule}), received {tuple(x.shape)}")


def _seqlens(cache_seqlens: Any, batch: int, capacity: int) -> tuple[np.ndarray | None, int | None]:
    """(lens, start): cache_seqlens as host int64 (B,), each in [0, capacity], and the one
    value when every sequence has it (then lens may be None); all ``capacity`` when None."""
    if cache_seqlens is None:
        return None, capacity
    if isinstance(cache_seqlens, (int, np.integer)) and not isinstance(cache_seqlens, (bool, np.bool_)):
        if not 0 <= cache_seqlens <= capacity:
            raise ValueError(f"cache_seqlens: expected values in [0, {capacity}] (the cache's capacity), "
                             f"received {cache_seqlens}")
        return None, int(cache_seqlens)
    lens = host_array("cache_seqlens", cache_seqlens)
    if lens.dtype.kind not in "iu":
        raise TypeError(f"cache_seqlens: expected integers, received dtype {dtype_name(lens.dtype)}")
    if lens.ndim > 1 or lens.size not in (1, batch):
        raise ValueError(f"cache_seqlens: expected an int or a shape ({batch},) (one per sequence), "
                         f"received {tuple(lens.shape)}")
    lens = np.broadcast_to(lens.reshape(-1), (batch,)).astype(np.int64)
    if batch and (lens.min() < 0 or lens.max() > capacity):
        raise ValueError(f"cache_seqlens: expected values in [0, {capacity}] (the cache's capacity), "
                         f"received values in [{lens.min()}, {lens.max()}]")
    return lens, int(lens[0]) if batch and (lens == lens[0]).all() else None


@functools.lru_cache(maxsize=64)
def _standin_cached(xp: Any, dtype: np.dtype, shape: tuple[int, ...], device: int) -> Any:
    return xp.broadcast_to(xp.zeros((), dtype), shape)


def _standin(xp: Any, dtype: Any, shape: tuple[int, ...]) -> Any:
    """A zero-stride array of ``shape``: what validation reads of an array it will not see
    (NumPy, or CuPy on the current device), made once per shape."""
    device = -1 if xp is np else xp.cuda.Device().id
    return _standin_cached(xp, np.dtype(dtype), tuple(shape), device)


def _cuda_decode():
    """flashcupy.cuda.decode, imported where a GPU call first needs it (CuPy stays optional)."""
    global _DECODE
    if _DECODE is None:
        from .cuda import decode

        _DECODE = decode
    return _DECODE


_DECODE = None


def flash_attention_with_kvcache(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    k: Any = None,
    v: Any = None,
    *,
    cache_seqlens: Any = None,
    block_table: Any = None,
    causal: bool | str = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    alibi_slopes: Any = None,
    softcap: float | None = None,
    sinks: Any = None,
    return_lse: bool = False,
    num_splits: int = 0,
    allow_tf32: bool = False,
    backend: str = "auto",
):
    """Attention of a few queries against a key/value cache, after appending new keys in place.

    Args:
        q: (B, Hq, Lq, D) queries (Lq = 1 for decoding; more for chunked prefill or
            speculative decoding).
        k_cache, v_cache: contiguous (B, Hk, Lmax, D) and (B, Hk, Lmax, Dv); or, with
            ``block_table``, paged: (num_blocks, Hk, block_size, D) and (.., Dv). q's dtype
            and array kind; Hq % Hk == 0 (GQA).
        k, v: optional (B, Hk, Lnew, D) and (B, Hk, Lnew, Dv): written into the cache in place
            at positions cache_seqlens[b] .. cache_seqlens[b] + Lnew - 1 (through block_table
            when paged), then attended to. Every argument is checked before anything is
            written: writing past the cache's capacity, or any bad option, leaves it as it was.
        cache_seqlens: int or (B,) ints, each sequence's valid keys before this call; not
            modified (the caller advances it). Default: the whole capacity (Lmax, or
            max_blocks * block_size).
        block_table: (B, max_blocks) ints: sequence b's logical block n is physical block
            block_table[b, n] of the paged cache; slots past a sequence's keys are not read
            (they may hold -1).
        causal, scale, window, alibi_slopes, softcap, sinks, return_lse, allow_tf32,
            backend: as :func:`flashcupy.flash_attention`, over each sequence's keys: causal
            is bottom-right, query row i sees keys <= i + keys - Lq, with keys =
            cache_seqlens[b] + Lnew.
        Lengths and tables on the host (ints, NumPy arrays) are checked before anything is
            written (a ValueError names the bad value). On the decode kernels a CuPy
            cache_seqlens or block_table is not read back (no host-device sync): the kernels
            check it (and, with CuPy lengths, the table wherever it lies), and a sequence whose
            length is negative or past the capacity, or whose keys fall in a slot naming no
            block, is neither written nor read and gets NaN outputs (and lse). With CuPy
            lengths the split is planned for the whole capacity.
        num_splits: blocks each sequence's keys are split over on the GPU, their partial
            results merged: 0 (default) chooses from the batch, KV heads, keys and the GPU's
            multiprocessors; a number is honoured up to one split per tile of keys and 256
            splits. The result is the same up to rounding; the CPU backend and the general
            GPU path ignore it.

    Returns:
        out (B, Hq, Lq, Dv), and with ``return_lse`` also lse (B, Hq, Lq).
    """
    options = {"causal": causal, "scale": scale, "window": window, "alibi_slopes": alibi_slopes,
               "softcap": softcap, "sinks": sinks, "return_lse": return_lse, "allow_tf32": allow_tf32,
               "backend": backend}
    key = _layout_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, options, num_splits)
    lay = _LAYOUTS.get(key) if key is not None else None
    if lay is None:
        lay = _layout(q, k_cache, v_cache, k, v, block_table, options, num_splits)
        if key is not None:
            if len(_LAYOUTS) >= 256:
                _LAYOUTS.clear()
            _LAYOUTS[key] = lay
    if lay.decode:
        return _decode(lay, q, k_cache, v_cache, k, v, cache_seqlens, block_table, int(num_splits))
    # The general forward over each sequence's keys (NumPy, or calls the decode kernels do not take).
    xp, paged, batch, block_size, new = lay.xp, lay.paged, lay.batch, lay.block_size, lay.new
    if new and xp is np:
        _writable(k_cache, v_cache)
    lens, start = _seqlens(cache_seqlens, batch, lay.capacity)
    keys = _room(lay, lens, start)
    options["kv_lengths"] = total = np.full(batch, keys) if start is not None else lens + new
    table = device_table = prepared = None
    if paged:
        table = _checked_table(block_table, total, lay)
        if xp is not np and interop.is_gpu_array(block_table):  # a CuPy view of the caller's device table
            device_table = interop.to_device(block_table)
        make = make_host_problem if xp is np else make_device_problem
        pb = make(q, _standin(xp, q.dtype, (batch, lay.hk, keys, lay.d)),
                  _standin(xp, q.dtype, (batch, lay.hk, keys, lay.dv)), options)
    else:
        k_seq, v_seq = k_cache[:, :, :keys], v_cache[:, :, :keys]
        prepared = _api._prepare(q, k_seq, v_seq, options)
        pb = prepared[0]
    if new:
        _append(xp, k_cache, v_cache, k, v, lens, start, table, device_table, block_size)
    if paged:  # the blocks in use, gathered in logical order: (B, Hk, blocks * block_size, D)
        used = xp.asarray(table[:, : -(-keys // block_size)])
        k_seq, v_seq = (c[used].transpose(0, 2, 1, 3, 4).reshape(batch, lay.hk, used.shape[1] * block_size,
                                                                     c.shape[-1])[:, :, :keys]
                        for c in (k_cache, v_cache))
    pb, out, lse = _api._forward(q, k_seq, v_seq, options, prepared)
    return (out, lse) if pb.return_lse else out


def _writable(k_cache: np.ndarray, v_cache: np.ndarray) -> None:
    """A ValueError, before anything is written, unless both host caches can take an append
    (the layout's checks hold for read-only arrays of the same shape too)."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.flags.writeable:
            raise ValueError(f"{name}: expected a writable array (new keys and values are written into the "
                             f"caches in place), received a read-only one; nothing was written")


def _room(lay: _Layout, lens: np.ndarray | None, start: int | None) -> int:
    """The most keys a sequence attends after the append; a ValueError (nothing written yet)
    when the append would run past the cache's capacity."""
    most = start if start is not None else int(lens.max()) if lay.batch else 0
    if lay.batch and lay.new and most + lay.new > lay.capacity:
        raise ValueError(f"k, v: {lay.new} new keys after cache_seqlens up to {most} exceed the cache's "
                         f"capacity of {lay.capacity} keys a sequence; nothing was written")
    return most + lay.new


def _checked_table(block_table: Any, total: np.ndarray, lay: _Layout) -> np.ndarray:
    """The block table on the host (a device one read back: a sync), with a ValueError unless
    the slots each sequence uses for its ``total`` keys name blocks; the other slots (which
    may hold anything, -1 padding say) read 0."""
    table = host_array("block_table", block_table)
    in_use = np.arange(table.shape[1]) < -(-total[:, None] // lay.block_size)
    named = table[in_use]
    if named.size and (named.min() < 0 or named.max() >= lay.n_blocks):
        raise ValueError(f"block_table: expected block numbers in [0, {lay.n_blocks - 1}] in the slots the "
                         f"sequences use, received values in [{named.min()}, {named.max()}]")
    return np.where(in_use, table, 0)


def _decode(lay: _Layout, q, k_cache, v_cache, k, v, cache_seqlens, block_table, num_splits: int):
    """A call on the decode kernels, which write the append and attend. Host values (ints,
    NumPy lengths and tables) are checked here first; device ones (CuPy cache_seqlens and
    block_table) go to the kernels unread: no sync, and a sequence with a bad length or table
    entry gets NaN (the kernels read and write nothing outside the caches for it)."""
    dec = _cuda_decode()
    xp, batch = lay.xp, lay.batch
    stream = xp.cuda.get_current_stream()
    capturing = stream.is_capturing()
    device_lengths = interop._is_cupy(cache_seqlens)
    with dec.temporaries(stream, capturing):  # lengths, table and per-head arrays made here
        if device_lengths:
            if cache_seqlens.dtype.kind not in "iu":
                raise TypeError(f"cache_seqlens: expected integers, received dtype {dtype_name(cache_seqlens.dtype)}")
            if cache_seqlens.ndim > 1 or cache_seqlens.size not in (1, batch):
                raise ValueError(f"cache_seqlens: expected an int or a shape ({batch},) (one per sequence), "
                                 f"received {tuple(cache_seqlens.shape)}")
            device_array("cache_seqlens", cache_seqlens, q.data.device_id)  # on q's device (no copy)
            lengths = cache_seqlens if cache_seqlens.shape == (batch,) and cache_seqlens.dtype == np.int32 and \
                cache_seqlens.strides == (4,) else \
                xp.ascontiguousarray(xp.broadcast_to(cache_seqlens.reshape(-1), (batch,)), dtype=np.int32)
            most = lay.capacity
        else:
            lens, start = _seqlens(cache_seqlens, batch, lay.capacity)
            most = _room(lay, lens, start)
            lengths = most if start is not None else xp.asarray(lens.astype(np.int32))
        table = None
        if lay.paged:
            if interop._is_cupy(block_table):
                table = dec.device_table(device_array("block_table", block_table, q.data.device_id))
            elif device_lengths:  # the slots in use are known on the device only, where they are checked
                table = xp.asarray(np.ascontiguousarray(host_array("block_table", block_table), dtype=np.int32))
            else:
                total = np.full(batch, most) if start is not None else lens + lay.new
                table = xp.asarray(_checked_table(block_table, total, lay).astype(np.int32))
        stride = None if table is None else table.strides[0]
        plan = lay.plans.get(stride)  # the layout fixes all the plan depends on but a copied table's stride
        if plan is None:
            plan = lay.plans[stride] = dec.plan_for(
                q, k_cache, v_cache, lay.pb, k, v, lay.block_size, 0 if table is None else table.strides[0] // 4,
                lay.capacity, lay.n_blocks)
        alibi, sinks = (None, None) if lay.pb.alibi_slopes is None and lay.pb.sinks is None else \
            dec.score_arrays(lay.pb, q.shape[:2])
    out, lse = plan.launch(q, k_cache, v_cache, k, v, lengths, most, table, alibi, sinks, num_splits, stream,
                           capturing, want_lse=lay.pb.return_lse)
    return (out, lse) if lay.pb.return_lse else out


class _Layout(NamedTuple):
    """What a call's arrays' layout and options decide, checked once per layout: the array
    module, paged or not, the dims, the cache's capacity a sequence, Lnew, and whether the
    decode kernels take it (then ``pb``: their problem, the options on the whole cache, and
    ``plans``, their launch plans)."""

    xp: Any
    paged: bool
    batch: int
    hk: int
    d: int
    dv: int
    block_size: int
    n_blocks: int
    capacity: int
    new: int
    decode: bool
    pb: Any
    plans: dict  # the decode kernels' plans by the device table's row stride, made on first use


#: Layouts by :func:`_layout_key`; a decode loop repeats one per layer shape.
_LAYOUTS: dict[tuple, _Layout] = {}


def _described(x: Any) -> tuple | None:
    """(type, shape, strides, dtype) of a NumPy or CuPy array; None for anything else; a
    16-byte alignment flag for CuPy's (the decode kernels' admission reads it)."""
    if isinstance(x, np.ndarray):
        return np.ndarray, x.shape, x.strides, x.dtype
    if interop._is_cupy(x):
        data = x.data
        return type(x), x.shape, x.strides, x.dtype, data.device_id, data.ptr % 16 == 0
    return None


def _layout_key(q, k_cache, v_cache, k, v, cache_seqlens, block_table, options, num_splits) -> tuple | None:
    """Everything :func:`_layout` reads, or None when a call must be checked afresh (arrays
    other than NumPy and CuPy, option arrays (ALiBi slopes, sinks), unhashable options)."""
    if options["alibi_slopes"] is not None or options["sinks"] is not None:
        return None
    arrays = [_described(x) for x in (q, k_cache, v_cache)]
    for x in (k, v, block_table):
        arrays.append(None if x is None else _described(x) or False)
    if not all(arrays[:3]) or False in arrays:
        return None
    seqlens = type(cache_seqlens) if cache_seqlens is None or isinstance(cache_seqlens, (int, np.integer)) \
        else _described(cache_seqlens)
    if seqlens is None:
        return None
    key = (*arrays, seqlens, *options.values(), num_splits, type(num_splits))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _layout(q, k_cache, v_cache, k, v, block_table, options, num_splits) -> _Layout:
    """The checks of a call that its arrays' layout and options decide (every value check is
    :func:`flash_attention_with_kvcache`'s, each call), and the decode kernels' problem."""
    check_array("q", q)
    xp = interop.array_module(q)
    if not hasattr(q, "flags"):
        raise TypeError(f"q: expected a NumPy or CuPy array, received {type(q).__module__}.{type(q).__name__}")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        _module(name, x, xp)
    _shape("q", q, (None,) * 4, "B, Hq, Lq, D")
    batch, _, _, d = q.shape
    paged = block_table is not None
    block_size = n_blocks = 0
    if paged:
        _shape("k_cache", k_cache, (None, None, None, d), "num_blocks, Hk, block_size, D: paged, D as q's")
        n_blocks, hk, block_size, _ = k_cache.shape
        if block_size == 0:
            raise ValueError("k_cache: expected blocks of at least one key (num_blocks, Hk, block_size, D), "
                             f"received shape {tuple(k_cache.shape)}")
        _shape("v_cache", v_cache, (n_blocks, hk, block_size, None), "num_blocks, Hk, block_size, Dv like k_cache")
        table = block_table if isinstance(block_table, np.ndarray) or interop._is_cupy(block_table) \
            else host_array("block_table", block_table)
        if table.dtype.kind not in "iu":
            raise TypeError(f"block_table: expected integers, received dtype {dtype_name(table.dtype)}")
        _shape("block_table", table, (batch, None), "B, max_blocks")
        capacity = table.shape[1] * block_size
    else:
        _shape("k_cache", k_cache, (batch, None, None, d), "B, Hk, Lmax, D as q's")
        _, hk, capacity, _ = k_cache.shape
        _shape("v_cache", v_cache, (batch, hk, capacity, None), "B, Hk, Lmax, Dv like k_cache")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected q's dtype {dtype_name(q.dtype)}, received {dtype_name(x.dtype)}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)):
        raise TypeError(f"num_splits: expected an int, received {type(num_splits).__name__}")
    if num_splits < 0:
        raise ValueError(f"num_splits: expected 0 (choose) or a positive count, received {num_splits}")
    new = 0
    if (k is None) != (v is None):
        raise ValueError(f"k, v: expected both or neither, received {'k' if v is None else 'v'} alone")
    if k is not None:
        _module("k", k, xp)
        _module("v", v, xp)
        _shape("k", k, (batch, hk, None, d), "B, Hk, Lnew, D like the cache")
        new = k.shape[2]
        _shape("v", v, (batch, hk, new, v_cache.shape[-1]), "B, Hk, Lnew, Dv like k and v_cache")
        for name, x in (("k", k), ("v", v)):
            if x.dtype != q.dtype:
                raise TypeError(f"{name}: expected q's dtype {dtype_name(q.dtype)}, received {dtype_name(x.dtype)}")
    # The decode kernels' problem is the options on the whole cache's shape (a signature that
    # stays put while the sequences grow; the kernels take the lengths themselves), checked
    # before anything is written. The general path's problem depends on the lengths: it is
    # made each call (validated on stand-ins of the keys' shapes, or on views of the cache).
    runs_on = _api._backend(options["backend"], q)
    decode = runs_on == "cuda" and xp is not np and capacity < 2**31 and n_blocks < 2**31 \
        and _cuda_decode().unsupported(q, k_cache, v_cache) is None  # the kernels count keys in int32
    pb = None
    if decode:
        whole = (k_cache, v_cache) if not paged else tuple(
            _standin(xp, q.dtype, (batch, hk, capacity, c.shape[-1])) for c in (k_cache, v_cache))
        pb = make_device_problem(q, *whole, options)
        _cuda_decode().kernels(q, v_cache, pb, block_size)  # compiled before the cache is written
        pb = _without_arrays(pb)  # a kept layout must not keep this call's q and caches alive
    return _Layout(xp, paged, batch, hk, d, v_cache.shape[-1], block_size, n_blocks, capacity, new, decode, pb, {})


def _without_arrays(pb: Any) -> Any:
    """``pb`` with q, k and v None: its shapes, dtype and options, which the decode kernels'
    plan reads, without the arrays (the layout cache would otherwise hold on to the first
    call's caches, gigabytes of device memory, after the caller let them go)."""
    kept = object.__new__(type(pb))
    kept.__dict__.update(pb.__dict__, q=None, k=None, v=None)
    return kept


def _append(xp, k_cache, v_cache, k, v, lens, start, table, device_table, block_size) -> None:
    """k, v (B, Hk, Lnew, D / Dv) written into the caches at each sequence's cache_seqlens
    (``start`` when every sequence has the same), through the (checked, host) block table when
    paged."""
    batch, new = k.shape[0], k.shape[2]
    slot = None if start is None or table is None or start // block_size != (start + new - 1) // block_size \
        else start // block_size  # one append position for all, inside one block of each sequence
    if start is not None and (table is None or slot is not None):
        # One copy a cache, no index arrays to move (on the GPU: no host-to-device copy, no sync).
        if table is not None:
            blocks = device_table[:, slot] if device_table is not None else xp.asarray(table[:, slot])
            k_cache[blocks, :, start % block_size: start % block_size + new] = k
            v_cache[blocks, :, start % block_size: start % block_size + new] = v
        else:
            k_cache[:, :, start:start + new] = k
            v_cache[:, :, start:start + new] = v
        return
    # (B, Lnew) positions; advanced indices around a slice put (B, Lnew) first: k as (B, Lnew, Hk, D)
    pos = (np.full(batch, start) if start is not None else lens)[:, None] + np.arange(new)
    if table is not None:
        rows = (xp.asarray(table[np.arange(batch)[:, None], pos // block_size]), xp.asarray(pos % block_size))
    else:
        rows = (xp.asarray(np.arange(batch)[:, None]), xp.asarray(pos))
    k_cache[rows[0], :, rows[1]] = k.transpose(0, 2, 1, 3)
    v_cache[rows[0], :, rows[1]] = v.transpose(0, 2, 1, 3)


def merge_attention_states(out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """Attention over two disjoint key sets combined into attention over their union.

    out_a, out_b: (..., H, L, Dv) of one float dtype; lse_a, lse_b: (..., H, L), both float32
    or both float64, the natural-log log-sum-exp of each part (as ``return_lse`` gives it).
    Returns (out, lse): lse = logaddexp(lse_a, lse_b) and out = out_a exp(lse_a - lse) +
    out_b exp(lse_b - lse), computed in lse's dtype and rounded to out's once. A part with
    lse = -inf (no key) adds nothing; where both are -inf, out is 0 and lse -inf, never NaN.
    NumPy or CuPy arrays, all of one kind, returned as that kind (NumPy arrays in the other
    byte order are read in the native one).
    """
    check_array("out_a", out_a)
    xp = interop.array_module(out_a)
    if not hasattr(out_a, "flags"):
        raise TypeError(f"out_a: expected a NumPy or CuPy array, received {type(out_a).__module__}."
                        f"{type(out_a).__name__}")
    for name, x in (("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        _module(name, x, xp)
    if xp is np:  # the other byte order copied into the native one, as every entry point does
        out_a, lse_a, out_b, lse_b = (host_array(name, x) for name, x in
                                      (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)))
    check_float_dtype("out_a", out_a)
    if out_b.shape != out_a.shape or out_b.dtype != out_a.dtype:
        raise ValueError(f"out_b: expected out_a's shape {tuple(out_a.shape)} and dtype {dtype_name(out_a.dtype)}, "
                         f"received {tuple(out_b.shape)} {dtype_name(out_b.dtype)}")
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if x.shape != out_a.shape[:-1]:
            raise ValueError(f"{name}: expected shape {tuple(out_a.shape[:-1])} (out's without Dv), "
                             f"received {tuple(x.shape)}")
        if x.dtype not in (np.float32, np.float64):
            raise TypeError(f"{name}: expected float32 or float64, received {dtype_name(x.dtype)}")
    if lse_b.dtype != lse_a.dtype:
        raise TypeError(f"lse_b: expected lse_a's dtype {dtype_name(lse_a.dtype)}, received {dtype_name(lse_b.dtype)}")
    lse = xp.logaddexp(lse_a, lse_b)
    base = xp.where(lse != -np.inf, lse, 0)  # both parts empty: exp(-inf - 0) = 0 weights, out 0
    acc = np.float64 if np.float64 in (lse.dtype, out_a.dtype) else np.float32
    out = (out_a.astype(acc) * xp.exp(lse_a - base)[..., None] + out_b.astype(acc) * xp.exp(lse_b - base)[..., None])
    return out.astype(out_a.dtype, copy=False), lse
