"""Tiled CPU backend: FlashAttention's algorithm in NumPy and BLAS, on every core.

Tiles. Per (batch..., query head) segment, query rows are cut into blocks of
``BLOCK_M`` and keys into tiles of ``BLOCK_N`` (:func:`tile_sizes`). Scores are
computed transposed, S^T = K_j Q_i^T of shape (keys, queries): that product
runs near BLAS's peak even for small head dims, and every per-query statistic
is a vector along the tile's fast axis (see cpu_kernels). Scores are held in
base 2 (log2(e) folded into the scale, as FlashAttention does) so that
probabilities are exp2 of a difference. The forward keeps a running shift ``m``
(from a query's first score, moved up lazily: cpu_kernels), a running sum ``l``
and an unnormalised accumulator, rescaling them as each key tile arrives (online
softmax), and
normalises once at the end; the backward recomputes each probability tile from
the saved log-sum-exp. Nothing larger than a tile is allocated for scores, so extra
memory is O(L) per thread, and key tiles that causal, window, block or boolean
masks rule out entirely are never computed; causal and window bounds inside a
tile are applied per query as key ranges.

Work. The forward's tasks are (segment, query block) pairs, or, for a few query rows a head
(decoding), several KV heads with their query heads' rows stacked (:func:`_stacked`: K and V
read once a KV head); the backward's are
(batch, kv head) groups, each owning dK and dV of its keys and dQ of its query
heads, so no two tasks write the same element. When there are fewer groups
than cores, each group's keys are cut into ranges whose dQ contributions are
summed afterwards in range order (:func:`backward_splits`). cpu_parallel runs
the tasks on ``flashcupy.get_cpu_threads()`` threads; every task has a fixed
order of operations, so results are bitwise the same for every thread count.

Accumulation is float32 for float16, bfloat16 and float32 inputs, float64 for
float64 inputs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import numpy as np

from . import cpu_kernels, cpu_parallel
from .cpu_kernels import LOG2E
from .problem import Problem, Segment, accumulator_dtype, lse_dtype

#: A key tile (j0, j1, ranges, keep): ``ranges`` None or per-query key bounds (lo, hi) relative
#: to j0; ``keep`` None or a (rows, keys) bool array; None means every score is kept.
Tile = tuple[int, int, "tuple[np.ndarray, np.ndarray] | None", "np.ndarray | None"]


def tile_sizes(pb: Problem) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): query rows and keys per tile; the only place they are chosen.

    A (BLOCK_N, BLOCK_M) score tile of 1 MiB measured fastest (of 128 KiB to 4 MiB,
    on an AVX-512 server core with 1 MiB of L2): large enough for BLAS to run near
    its peak and for the per-tile Python work to be a few percent, small enough to
    stay in cache between the two products and the elementwise passes. Wider head
    dims take more query rows per tile, which suits the K Q^T product. Where a task has
    fewer rows than BLOCK_M (decoding: a query or a few a head, or a group's heads stacked,
    :func:`_stacked`) and no mask makes the key tiles' edges matter, its keys grow to keep
    the tile near 1 MiB, up to MAX_BLOCK_N.
    """
    block_m = 256 if pb.head_dim <= 64 else 512
    itemsize = accumulator_dtype(pb.dtype).itemsize
    block_n = (1 << 20) // (block_m * itemsize)
    # the longest valid query length (a padded call with q_lengths tiles as its packed twin)
    longest = pb.seqlen_q if pb.q_lengths is None else int(np.max(pb.q_lengths, initial=0))
    rows = min(block_m, max(1, longest)) * max(1, _stacked(pb, block_m) * pb.group_size)
    if rows < block_m and pb.mask is None and pb.block_mask is None:
        block_n = max(block_n, min(MAX_BLOCK_N, (1 << 20) // (rows * itemsize)))
    return block_m, block_n


def backward_tile_sizes(pb: Problem) -> tuple[int, int]:
    """The backward's (BLOCK_M, BLOCK_N): :func:`tile_sizes` without the forward's wider key
    tiles for few rows (the backward keeps (BLOCK_N, D) dK and dV sums per thread and splits
    short problems' keys across cores by BLOCK_N)."""
    block_m, block_n = tile_sizes(pb)
    return block_m, min(block_n, (1 << 20) // (block_m * accumulator_dtype(pb.dtype).itemsize))


#: The machine's cores (not those this process may use, nor the thread count): backward_splits
#: depends on it so that results never depend on thread settings.
MACHINE_CORES = os.cpu_count() or 1


def backward_splits(pb: Problem, groups: int) -> int:
    """Key ranges per (batch, kv head) group in the backward.

    Enough that every core of the machine has a task when there are few groups
    (a single head, MQA), at most 8; it depends on the problem and the machine
    (MACHINE_CORES), never on the thread count, so results do not either. Each
    extra range costs a dQ-sized buffer for its group.
    """
    cores = MACHINE_CORES
    if groups >= cores or groups == 0:  # no group (an empty batch): nothing to split
        return 1
    _, block_n = backward_tile_sizes(pb)
    return max(1, min(8, -(-2 * cores // groups), -(-pb.seqlen_k // block_n)))


def _key_range(pb: Problem, seg: Segment, i0: int, i1: int) -> tuple[int, int]:
    """Keys [lo, hi) that some row of [i0, i1) may attend under causal and window."""
    lo, hi = 0, seg.kv_len
    diag = seg.diagonal
    if pb.causal is not None:
        hi = min(hi, i1 + (0 if pb.causal == "top_left" else diag))
    if pb.window is not None:
        left, right = pb.window
        if left is not None:
            lo = max(lo, i0 + diag - left)
        if right is not None:
            hi = min(hi, i1 + diag + right)
    return lo, hi


def _tile_ranges(pb: Problem, seg: Segment, i0: int, i1: int, j0: int, j1: int):
    """Per-row key bounds (lo, hi) relative to j0 under causal and window, or None when
    they keep the whole tile [i0, i1) x [j0, j1)."""
    diag = seg.diagonal
    rows = None
    lo = hi = None
    if pb.causal is not None:
        c = 0 if pb.causal == "top_left" else diag
        if j1 - 1 > i0 + c:  # some (row, col) pair lies above the diagonal
            rows = np.arange(i0 - j0, i1 - j0)
            hi = rows + (c + 1)
    if pb.window is not None:
        left, right = pb.window
        if left is not None and j0 < i1 - 1 + diag - left:
            rows = np.arange(i0 - j0, i1 - j0) if rows is None else rows
            lo = rows + (diag - left)
        if right is not None and j1 - 1 > i0 + diag + right:
            rows = np.arange(i0 - j0, i1 - j0) if rows is None else rows
            bound = rows + (diag + right + 1)
            hi = bound if hi is None else np.minimum(hi, bound)
    if rows is None:
        return None
    lo = np.zeros(i1 - i0, np.int64) if lo is None else np.clip(lo, 0, j1 - j0)
    hi = np.full(i1 - i0, j1 - j0, np.int64) if hi is None else np.clip(hi, 0, j1 - j0)
    return lo, hi


def _tile_masks(pb: Problem, seg: Segment, i0: int, i1: int, j0: int, j1: int):
    """(ranges, keep) for tile [i0, i1) x [j0, j1), or False when no score survives.

    ``ranges`` are causal and window bounds (see :func:`_tile_ranges`); ``keep`` the
    boolean and block masks as a (rows, keys) bool array, with the ranges folded in
    when both are present. None for either means nothing to mask.
    """
    ranges = _tile_ranges(pb, seg, i0, i1, j0, j1)
    if pb.block_mask is None and pb.mask is None:
        if ranges is not None and not np.any(ranges[1] > ranges[0]):
            return False
        return ranges, None
    keep = None
    if pb.block_mask is not None:
        bs = pb.block_size
        blocks = np.asarray(pb.block_mask[seg.head][i0 // bs : (i1 - 1) // bs + 1, j0 // bs : (j1 - 1) // bs + 1])
        if not blocks.any():
            return False
        if not blocks.all():  # each block's flag repeated over its rows and keys in the tile
            rows = np.diff(np.clip(np.arange(i0 // bs, (i1 - 1) // bs + 2) * bs, i0, i1))
            keys = np.diff(np.clip(np.arange(j0 // bs, (j1 - 1) // bs + 2) * bs, j0, j1))
            keep = np.repeat(np.repeat(blocks, rows, 0), keys, 1)
    if pb.mask is not None:
        tile = np.asarray(pb.mask[seg.head][i0:i1, j0:j1])
        keep = tile if keep is None else keep & tile
    if keep is not None and ranges is not None:
        lo, hi = ranges
        cols = np.arange(j1 - j0)[None, :]
        keep = keep & (cols >= lo[:, None]) & (cols < hi[:, None])
        ranges = None
    if keep is not None and not keep.any():
        return False
    return ranges, keep


def _key_tiles(pb: Problem, seg: Segment, i0: int, i1: int, block_n: int,
               keys: tuple[int, int] | None = None, diagonal_first: bool = False) -> Iterator[Tile]:
    """The key tiles query rows [i0, i1) attend (inside ``keys`` = [start, stop) when
    given), with their masks; ruled-out tiles skipped. ``diagonal_first``: the first tile is
    centred on the rows' diagonal keys (i + Lk - Lq; every row's where BLOCK_N >= the rows),
    the rest follow right and then left of it."""
    lo, hi = _key_range(pb, seg, i0, i1)
    if keys is not None:
        lo, hi = max(lo, keys[0]), min(hi, keys[1])
    unmasked = pb.causal is None and pb.window is None and pb.mask is None and pb.block_mask is None
    starts: Iterable[int] = range(lo, hi, block_n)
    if diagonal_first and hi - lo > block_n:
        first = min(max((i0 + i1 - block_n) // 2 + seg.diagonal, lo), hi - block_n)
        starts = [first, *range(first + block_n, hi, block_n), *range(first - block_n, lo - block_n, -block_n)]
    for j0 in starts:
        j0, j1 = max(j0, lo), min(j0 + block_n, hi)
        masks = (None, None) if unmasked else _tile_masks(pb, seg, i0, i1, j0, j1)
        if masks is not False:
            yield (j0, j1) + masks


def _scores(pb: Problem, seg: Segment, st: np.ndarray, i0: int, j0: int, ranges, keep, kernels, heads: int = 1):
    """Turn S^T log2(e) = scale log2(e) K Q^T (keys, rows) into the final scores (base 2)
    in place; returns tanh(S_raw / softcap) transposed (None without softcap). ``heads``:
    query heads whose rows are stacked in st (:func:`_stacked`: a bias the same in every head,
    ALiBi's slope each head's own), each rows / heads of them from i0, seg the first.

    Masked scores become -inf, which exp2 turns into an exact 0 probability.
    """
    cols, rows = st.shape
    tanh = None
    if pb.softcap is not None:
        softcap = pb.softcap * LOG2E
        tanh = np.tanh(st / softcap)
        np.multiply(tanh, softcap, out=st)  # S = softcap * tanh(S / softcap)
    if pb.bias is not None:
        tile = np.asarray(pb.bias[seg.head][i0 : i0 + rows // heads, j0 : j0 + cols])
        for h in range(heads):  # stacked heads: the same bias in each
            kernels.add_bias(st[:, h * (rows // heads) : (h + 1) * (rows // heads)], tile, LOG2E)
    if pb.alibi_slopes is not None:
        positions = np.arange(i0, i0 + rows // heads)
        slope = pb.alibi_slopes[seg.head]
        if heads > 1:  # stacked heads: each row its head's slope and its own position
            slope = np.repeat(pb.alibi_slopes[seg.head[:-1] + (slice(seg.head[-1], seg.head[-1] + heads),)],
                              rows // heads)
            positions = np.tile(positions, heads)
        slopes = np.broadcast_to(np.multiply(slope, LOG2E, dtype=np.float64), (rows,))
        kernels.add_alibi(st, slopes, positions + (seg.diagonal - j0))  # S -= slope * |i + Lk - Lq - j|
    if ranges is not None:
        kernels.mask_outside(st, *ranges)
    if keep is not None:
        kernels.mask_where(st, keep)
    return tanh


def _is_operand(x: Any, acc: np.dtype) -> bool:
    """Whether BLAS reads ``x`` as it is: the accumulator dtype, the last axis contiguous."""
    return x.dtype == acc and (x.strides[-1] == x.itemsize or x.shape[-1] <= 1)


def _as_operand(x: Any, acc: np.dtype) -> np.ndarray:
    """``x`` as a BLAS operand: x itself when it already is one, else one converted copy."""
    return x if _is_operand(x, acc) else np.ascontiguousarray(x, dtype=acc)


def _operand_rows(x: np.ndarray, acc: np.dtype, scratch: "_Scratch", name: str) -> np.ndarray:
    """Rows ``x`` (rows, D) as a BLAS operand: ``x`` itself when it already is one, else
    converted into scratch buffer ``name``."""
    if _is_operand(x, acc):
        return x
    rows = scratch.get(name, *x.shape)
    rows[...] = x
    return rows


class _Scratch:
    """One thread's reusable buffers: score tiles and small blocks, grown on demand."""

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self.buffers: dict[str, np.ndarray] = {}

    def get(self, name: str, *shape: int, dtype: Any = None) -> np.ndarray:
        """A C-contiguous array of ``shape`` (contents undefined) backed by buffer ``name``,
        of the accumulator dtype unless ``dtype`` is given."""
        size = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.size < size:
            buf = self.buffers[name] = np.empty(size, self.dtype if dtype is None else dtype)
        return buf[:size].reshape(shape)


def _by_cost(tasks: list, costs: list[float]) -> list:
    """Tasks with the longest first (ties in their given order), so threads finish together."""
    if len(tasks) < 2:
        return tasks
    order = sorted(range(len(tasks)), key=lambda t: -costs[t])
    return [tasks[t] for t in order]


def _attended(pb: Problem, seg: Segment, i0: int, i1: int, keys: tuple[int, int] | None = None) -> int:
    """Rows times keys in the key range of rows [i0, i1): a task's cost estimate."""
    lo, hi = _key_range(pb, seg, i0, i1)
    if keys is not None:
        lo, hi = max(lo, keys[0]), min(hi, keys[1])
    return (i1 - i0) * max(0, hi - lo)


# --------------------------------------------------------------------------- forward


#: Keys a forward tile at most. A task of few rows (decoding: a query or a few a head) takes
#: as many keys as make its 1 MiB score tile, up to this: with BLOCK_N keys it would spend most
#: of its time in per-tile Python work (1024 tiles of 512 keys for 32 heads of 16k keys).
MAX_BLOCK_N = 4096


#: Queries a head up to which the forward stacks heads (:func:`_stacked`) even when that
#: leaves cores idle: decoding, and speculative decoding's few tokens.
DECODE_ROWS = 4


def _stacked(pb: Problem, block_m: int) -> int:
    """KV heads a forward task takes together, their query heads' rows stacked (0: one query
    head a task, as for long queries). Decoding is a few rows against many keys: stacked, each
    K and V is read once a KV head rather than once a query head, and a task's Python work
    serves many heads. Only where no score term but ALiBi's slope differs between heads (a
    bias, mask or block mask broadcast over the heads, as a padding mask is; no dropout),
    every row is valid (no q_lengths, not packed sequences), a KV head's rows (G Lq) fit one
    block, and either there are at least as many (batch, kv head) groups as the machine has
    cores or the queries are at most DECODE_ROWS a head (their products are bound by reading
    K and V, which stacking cuts G-fold, not by the cores: MQA with 32 query heads, 16k keys,
    2 cores: 21 -> 6 ms); as many KV heads as leave a task per core and the rows in a block.
    It depends on the problem and MACHINE_CORES, never on the thread count, so results do not."""
    groups = math.prod(pb.batch) * pb.num_heads_k
    rows = pb.group_size * pb.seqlen_q
    per_head = [x for x in (pb.bias, pb.mask, pb.block_mask) if x is not None and x.strides[len(pb.batch)] != 0]
    if (pb.varlen or pb.q_lengths is not None or per_head or pb.dropout_p > 0
            or not 0 < rows <= block_m or (groups < MACHINE_CORES and pb.seqlen_q > DECODE_ROWS)):
        return 0
    heads = max(1, min(pb.num_heads_k, block_m // rows, groups // MACHINE_CORES))
    return heads if pb.group_size > 1 or heads > 1 else 0


@np.errstate(all="ignore")  # Inf/NaN inputs flow through to the results without RuntimeWarnings
def forward(pb: Problem) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) in the problem's internal layout: out (..., Hq, Lq, Dv) of q's dtype, lse float32/64."""
    acc = accumulator_dtype(pb.dtype)
    out = np.empty(pb.out_shape, dtype=pb.dtype)
    lse = np.empty(pb.lse_shape, dtype=lse_dtype(pb.dtype))
    block_m, block_n = tile_sizes(pb)
    kernels = cpu_kernels.kernels()
    k, v = _as_operand(pb.k, acc), _as_operand(pb.v, acc)
    scale2 = acc.type(pb.scale * LOG2E)
    seed, offset = pb.dropout_key()  # read once (an rng_state's values as the call runs)
    tasks, costs = [], []
    stacked = _stacked(pb, block_m)
    if stacked:  # (segments of `stacked` kv heads' query heads, 0, Lq): every row valid, heads adjacent
        for group in _groups(pb):
            head = group[0].k_index[-1]
            if head % stacked == 0:
                tasks.append(([], 0, pb.seqlen_q))
                costs.append(0)
            tasks[-1][0].extend(group)
            costs[-1] += len(group) * _attended(pb, group[0], 0, pb.seqlen_q)
        tasks = [(tuple(segs), i0, i1) for segs, i0, i1 in tasks]
    else:
        for seg in pb.segments():
            out[seg.q_index][seg.q_len :] = 0  # padded rows: output 0, lse -inf
            lse[seg.lse_index][seg.q_len :] = -np.inf
            for i0 in range(0, seg.q_len, block_m):
                i1 = min(i0 + block_m, seg.q_len)
                tasks.append(((seg,), i0, i1))
                costs.append(_attended(pb, seg, i0, i1))

    def rows_of(x: np.ndarray, segs: tuple[Segment, ...], i0: int, i1: int) -> np.ndarray:
        """Rows [i0, i1) of x (q, out or lse) for a task's segments: one segment's frame, or
        stacked KV heads' adjacent query heads (*batch, heads, Lq, ...) with the head axis kept."""
        if len(segs) == 1:
            return x[segs[0].q_index][i0:i1]
        first = segs[0].q_index
        return x[first[:-1] + (slice(first[-1], first[-1] + len(segs)),)][:, i0:i1]

    def run(task: tuple[tuple[Segment, ...], int, int], scratch: _Scratch) -> None:
        segs, i0, i1 = task
        seg, heads = segs[0], len(segs)
        rows = heads * (i1 - i0)
        q = scratch.get("q", rows, pb.head_dim)
        q_rows = rows_of(pb.q, segs, i0, i1)  # query heads stacked: row h (i1 - i0) + i
        np.multiply(q_rows, scale2, out=q.reshape(q_rows.shape), dtype=acc)  # scale log2(e) Q, rounded once
        kv = max(1, heads // pb.group_size)  # KV heads: each of its query heads' rows stacked, gr rows a KV head
        gr = rows // kv
        if kv == 1:
            ks, vs = k[seg.k_index], v[seg.k_index]  # (Lk, D), (Lk, Dv)
        else:  # (kv, Lk, D), (kv, Lk, Dv): the task's KV heads, adjacent
            heads_k = seg.k_index[:-1] + (slice(seg.k_index[-1], seg.k_index[-1] + kv),)
            ks, vs = k[heads_k], v[heads_k]
        m = scratch.get("m", rows)  # running shift (base 2), moved up lazily
        m[...] = -np.inf
        l = scratch.get("l", rows)  # running row sum of 2^(S - m)
        l[...] = 0
        alpha, vectors = scratch.get("alpha", rows), scratch.get("vectors", 3, rows)
        damaged = scratch.get("damaged", rows, dtype=np.int64)
        o = scratch.get("o", rows, pb.head_dim_v)  # (rows, Dv), unnormalised
        o[...] = 0
        pv = scratch.get("pv", rows, pb.head_dim_v)
        # ALiBi's scores fall away from each row's diagonal key by its slope times the distance,
        # past the lazy shift's headroom within a tile: the tile around the diagonals comes
        # first and sets the shift exactly (its maximum), so the rest stay under it; taken in
        # order, the tiles' scores rose past the shift and every query was recomputed alone
        # (bench/NOTES.md, 'CPU: ALiBi's diagonal tile first').
        alibi = pb.alibi_slopes is not None
        exact = alibi
        for j0, j1, ranges, keep in _key_tiles(pb, seg, i0, i1, block_n, diagonal_first=alibi):
            if heads > 1:  # the same positions, and masks the same in every head
                ranges = ranges and (np.tile(ranges[0], heads), np.tile(ranges[1], heads))
                keep = None if keep is None else np.tile(keep, (heads, 1))
            st = scratch.get("s", j1 - j0, rows)
            if kv == 1:
                np.matmul(ks[j0:j1], q.T, out=st)  # S^T = scale log2(e) K Q^T
            else:  # per KV head, then its columns placed beside the others': (keys, kv gr)
                s3 = scratch.get("s3", kv, j1 - j0, gr)
                np.matmul(ks[:, j0:j1], q.reshape(kv, gr, -1).transpose(0, 2, 1), out=s3)
                np.copyto(st.reshape(j1 - j0, kv, gr), s3.transpose(1, 0, 2))
            _scores(pb, seg, st, i0, j0, ranges, keep, kernels, heads)
            count = kernels.forward_tile(st, m, l, alpha, vectors, damaged, exact)  # P^T = 2^(S^T - m)
            exact = False
            for c in damaged[:count]:  # a query whose scores leapt past its shift: alone, exactly
                column = scratch.get("column", j1 - j0, 1)
                np.matmul((ks if kv == 1 else ks[c // gr])[j0:j1], q[c : c + 1].T, out=column)
                row = i0 + c % (i1 - i0)  # the query's position (in its head, when stacked)
                _scores(pb, segs[c // (i1 - i0)], column, row, j0,  # the query's own head
                        ranges and (ranges[0][c : c + 1], ranges[1][c : c + 1]),
                        None if keep is None else keep[c : c + 1], kernels)
                kernels.forward_tile(column, m[c : c + 1], l[c : c + 1], alpha[c : c + 1],
                                     scratch.get("column vectors", 3, 1), damaged[count:], True)
                st[:, c] = column[:, 0]
            if pb.dropout_p > 0:  # after l: lse is taken before dropout
                z = scratch.get("z", j1 - j0, rows)
                kernels.dropout_scale(z, seed, offset, seg.bh, i0, j0, pb.dropout_p)
                st *= z
            if kv == 1:
                np.matmul(st.T, vs[j0:j1], out=pv)
            else:  # P of each KV head's rows against its V
                np.matmul(st.reshape(j1 - j0, kv, gr).transpose(1, 2, 0), vs[:, j0:j1],
                          out=pv.reshape(kv, gr, pb.head_dim_v))
            kernels.rescale_add(o, alpha, pv)  # O = alpha O + P V
        out_rows = rows_of(out, segs, i0, i1).reshape(rows, pb.head_dim_v)  # views: out is C-contiguous
        lse_rows = rows_of(lse, segs, i0, i1).reshape(rows)
        kernels.finish(o, m, l, lse_rows, out_rows if out.dtype == acc else o)
        if out.dtype != acc:
            out_rows[...] = o

    cpu_parallel.run_tasks(_by_cost(tasks, costs), run, lambda: _Scratch(acc))
    return out, lse


# --------------------------------------------------------------------------- backward


@dataclass(frozen=True)
class _Unit:
    """Backward work: the segments of one (batch, kv head) group over keys [start, stop);
    ``part`` numbers the key range within the group (0: its dQ goes straight to dq)."""

    segments: tuple[Segment, ...]
    start: int
    stop: int
    part: int


def _groups(pb: Problem) -> list[tuple[Segment, ...]]:
    """Segments grouped by (batch, kv head), in segment order."""
    groups: dict[tuple[int, int], list[Segment]] = {}
    for seg in pb.segments():
        batch, head = divmod(seg.bh, pb.num_heads_q)
        groups.setdefault((batch, head // pb.group_size), []).append(seg)
    return [tuple(g) for g in groups.values()]


def _dbias_target(pb: Problem, seg: Segment) -> tuple[tuple, bool, bool]:
    """Index of this segment's slice of the dbias accumulator, and whether rows/cols are broadcast."""
    full = (1,) * (len(pb.batch) + 3 - len(pb.bias_shape)) + pb.bias_shape
    head = tuple(0 if n == 1 else ix for ix, n in zip(seg.head, full[:-2]))
    return head, full[-2] == 1, full[-1] == 1


def _dbias_slices(pb: Problem, segments: tuple[Segment, ...]) -> frozenset:
    """The dbias slices (:func:`_dbias_target` indices) the segments add into."""
    return frozenset(_dbias_target(pb, seg)[0] for seg in segments)


def _backward_tasks(pb: Problem, units: list[_Unit], bias_grad: bool) -> list[list[_Unit]]:
    """Units in tasks: one each, except that with ``bias_grad`` units adding into the
    same dbias elements (a bias broadcast over batch or heads, or over keys) share one
    task and run in order."""
    if not bias_grad:
        return [[u] for u in units]
    tasks: dict[tuple, list[_Unit]] = {}
    for u in units:
        cols_broadcast = _dbias_target(pb, u.segments[0])[2]
        key = (_dbias_slices(pb, u.segments), None if cols_broadcast else u.part)
        tasks.setdefault(key, []).append(u)
    return list(tasks.values())


@np.errstate(all="ignore")
def backward(pb: Problem, dout: np.ndarray, out: np.ndarray, lse: np.ndarray, bias_grad: bool):
    """(dq, dk, dv, dbias) in the problem's internal layout; dbias None unless ``bias_grad``.

    Recomputes P = exp(S - lse) tile by tile; D = rowsum(dO * O); dS = P (dP - D)
    with dP = dO V^T (times keep / (1 - p) under dropout); dQ = scale dS K,
    dK = scale dS^T Q (through tanh's derivative under softcap), dV = P'^T dO.
    dK and dV are summed over each GQA group.
    """
    acc = accumulator_dtype(pb.dtype)
    seed, offset = pb.dropout_key()  # read once (an rng_state's values as the call runs)
    dq = np.zeros(pb.q.shape, dtype=acc)
    dk = np.zeros(pb.k.shape, dtype=acc)
    dv = np.zeros(pb.v.shape, dtype=acc)
    dbias = None
    if bias_grad:
        full = (1,) * (len(pb.batch) + 3 - len(pb.bias_shape)) + pb.bias_shape
        dbias = np.zeros(full, dtype=acc)
    block_m, block_n = backward_tile_sizes(pb)
    kernels = cpu_kernels.kernels()
    k, v = _as_operand(pb.k, acc), _as_operand(pb.v, acc)
    scale, scale2 = acc.type(pb.scale), acc.type(pb.scale * LOG2E)

    groups = _groups(pb)
    # A dbias shared by groups (a bias broadcast over batch or heads) makes one task of the
    # units that add into each of its slices (_backward_tasks): split the keys as if there
    # were as many groups as slices, so that every core has a task.
    parallel = len({_dbias_slices(pb, g) for g in groups}) if bias_grad else len(groups)
    splits = backward_splits(pb, parallel)
    # Key ranges of whole tiles, cut at the same keys in every group (from the longest), so
    # that one part's units of all groups touch the same dbias columns: _backward_tasks runs
    # those of a shared dbias slice in one task, and the parts' columns never overlap.
    longest = max((group[0].kv_len for group in groups), default=1)
    step = -(-max(longest, 1) // splits)
    step = -(-step // block_n) * block_n
    units = []
    for group in groups:
        kv_len = group[0].kv_len
        for part, start in enumerate(range(0, max(kv_len, 1), step)):
            units.append(_Unit(group, start, min(start + step, kv_len), part))
    dq_parts: dict[tuple[int, int], np.ndarray] = {}  # (part, segment bh) -> dQ of a later key range

    def run_unit(u: _Unit, scratch: _Scratch) -> None:
        for seg in u.segments:
            ks, vs = k[seg.k_index], v[seg.k_index]
            dk_seg, dv_seg = dk[seg.k_index], dv[seg.k_index]
            if u.part == 0:
                dq_seg = dq[seg.q_index]
            else:
                dq_seg = dq_parts[(u.part, seg.bh)] = np.zeros((seg.q_len, pb.head_dim), dtype=acc)
            if bias_grad:
                head, rows_b, cols_b = _dbias_target(pb, seg)
                db_seg = dbias[head]
            for i0 in range(0, seg.q_len, block_m):
                i1 = min(i0 + block_m, seg.q_len)
                rows = i1 - i0
                tiles = _key_tiles(pb, seg, i0, i1, block_n, (u.start, u.stop))
                first = next(tiles, None)
                if first is None:
                    continue
                q_rows = pb.q[seg.q_index][i0:i1]
                q2 = scratch.get("q2", rows, pb.head_dim)
                np.multiply(q_rows, scale2, out=q2, dtype=acc)  # for S in base 2, as the forward
                q = _operand_rows(q_rows, acc, scratch, "q")  # for dK = dS^T Q, scaled at the end
                do = _operand_rows(dout[seg.q_index][i0:i1], acc, scratch, "do")
                o_rows = _operand_rows(out[seg.q_index][i0:i1], acc, scratch, "o")
                delta = np.einsum("ij,ij->i", do, o_rows)  # D = rowsum(dO * O)
                lse_rows = np.asarray(lse[seg.lse_index][i0:i1], dtype=acc) * acc.type(LOG2E)
                lse_safe = np.where(lse_rows == -np.inf, acc.type(0), lse_rows)  # fully masked rows: P = 0
                dq_rows = dq_seg[i0:i1]  # this unit's alone, zero until written below
                for j0, j1, ranges, keep in _with_first(first, tiles):
                    n = j1 - j0
                    st = scratch.get("s", n, rows)
                    np.matmul(ks[j0:j1], q2.T, out=st)  # S^T log2(e)
                    tanh = _scores(pb, seg, st, i0, j0, ranges, keep, kernels)
                    dpt = scratch.get("dp", n, rows)
                    np.matmul(vs[j0:j1], do.T, out=dpt)  # dP^T = V dO^T
                    z = None
                    if pb.dropout_p > 0:
                        z = scratch.get("z", n, rows)
                        kernels.dropout_scale(z, seed, offset, seg.bh, i0, j0, pb.dropout_p)
                    kernels.backward_tile(st, dpt, lse_safe, delta, z)  # st = P'^T, dpt = dS^T
                    dv_seg[j0:j1] += np.matmul(st, do, out=scratch.get("dv", n, pb.head_dim_v))  # dV += P'^T dO
                    if bias_grad:
                        r = slice(0, 1) if rows_b else slice(i0, i1)
                        c = slice(0, 1) if cols_b else slice(j0, j1)
                        red = dpt.sum(axis=1, keepdims=True) if rows_b else dpt
                        db_seg[r, c] += (red.sum(axis=0, keepdims=True) if cols_b else red).T
                    if tanh is not None:
                        dpt *= 1 - tanh * tanh  # d(softcap tanh(x / softcap)) / dx = 1 - tanh^2
                    dk_seg[j0:j1] += np.matmul(dpt, q, out=scratch.get("dk", n, pb.head_dim))  # scaled at the end
                    if j0 == first[0]:
                        np.matmul(dpt.T, ks[j0:j1], out=dq_rows)  # dQ = dS K, scaled at the end
                    else:
                        dq_rows += np.matmul(dpt.T, ks[j0:j1], out=scratch.get("dqt", rows, pb.head_dim))

    tasks = _backward_tasks(pb, units, bias_grad)
    costs = [] if len(tasks) < 2 else [
        sum(_attended(pb, seg, i0, min(i0 + block_m, seg.q_len), (u.start, u.stop))
            for u in task for seg in u.segments for i0 in range(0, seg.q_len, block_m))
        for task in tasks
    ]

    def run(task: list[_Unit], scratch: _Scratch) -> None:
        for u in task:
            run_unit(u, scratch)

    cpu_parallel.run_tasks(_by_cost(tasks, costs), run, lambda: _Scratch(acc))
    for u in units:  # later key ranges' dQ, in range order
        if u.part:
            for seg in u.segments:
                dq[seg.q_index][: seg.q_len] += dq_parts[(u.part, seg.bh)]
    dq *= scale  # dQ = scale * dS K
    dk *= scale  # dK = scale * dS^T Q
    if dbias is not None:
        dbias = dbias.reshape(pb.bias_shape).astype(pb.bias.dtype)
    return dq.astype(pb.dtype, copy=False), dk.astype(pb.dtype, copy=False), dv.astype(pb.dtype, copy=False), dbias


def _with_first(first: Tile, rest: Iterator[Tile]) -> Iterator[Tile]:
    """``first`` followed by the rest of its iterator."""
    yield first
    yield from rest
