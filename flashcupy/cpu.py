"""Tiled NumPy backend: FlashAttention's algorithm on the CPU.

Per (batch..., query head) segment, the query rows are cut into tiles of
``BLOCK_M`` rows and the keys into tiles of ``BLOCK_N``. The forward keeps a
running row maximum ``m``, a running sum ``l`` and an unnormalised accumulator,
rescaling them as each key tile arrives (online softmax), and normalises once
at the end. The backward recomputes each probability tile from the saved
log-sum-exp. Nothing larger than a (BLOCK_M, BLOCK_N) tile is ever allocated
for scores, so extra memory is O(L) per head, and key tiles that causal, window,
block or boolean masks rule out entirely are never computed.

Accumulation is float32 for float16, bfloat16 and float32 inputs, float64 for
float64 inputs.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from . import rng
from .problem import Problem, Segment, accumulator_dtype, lse_dtype

Tile = tuple[int, int, "np.ndarray | None"]  # (j0, j1, keep): keep None means every score is kept


def tile_sizes(pb: Problem) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): query rows and keys per tile; the only place they are chosen.

    A (256, 1024) float32 score tile is 1 MiB: large enough that NumPy's per-call
    overhead is amortised over a BLAS-sized product, small enough that the
    handful of tile temporaries stays a few MiB whatever the sequence length.
    """
    return 256, 1024


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


def _tile_keep(pb: Problem, seg: Segment, i0: int, i1: int, j0: int, j1: int):
    """Which scores of tile [i0, i1) x [j0, j1) survive the masks.

    Returns None when all do (interior tiles pay nothing), False when none do
    (the tile is skipped), else a (i1 - i0, j1 - j0) bool array.
    """
    keep = None
    rows = np.arange(i0, i1)[:, None]
    cols = np.arange(j0, j1)[None, :]

    def both(cond):
        return cond if keep is None else keep & cond

    diag = seg.diagonal
    if pb.causal is not None:
        c = 0 if pb.causal == "top_left" else diag
        if j1 - 1 > i0 + c:  # some (row, col) pair lies above the diagonal
            keep = both(cols <= rows + c)
    if pb.window is not None:
        left, right = pb.window
        if left is not None and j0 < i1 - 1 + diag - left:
            keep = both(cols >= rows + diag - left)
        if right is not None and j1 - 1 > i0 + diag + right:
            keep = both(cols <= rows + diag + right)
    if pb.block_mask is not None:
        bs = pb.block_size
        blocks = np.asarray(pb.block_mask[seg.head][i0 // bs : (i1 - 1) // bs + 1, j0 // bs : (j1 - 1) // bs + 1])
        if not blocks.any():
            return False
        if not blocks.all():
            keep = both(blocks[(rows // bs - i0 // bs), (cols // bs - j0 // bs)])
    if pb.mask is not None:
        keep = both(np.asarray(pb.mask[seg.head][i0:i1, j0:j1]))
    if keep is not None and not keep.any():
        return False
    return keep


def _key_tiles(pb: Problem, seg: Segment, i0: int, i1: int, block_n: int) -> Iterator[Tile]:
    """The key tiles query rows [i0, i1) attend, with their keep masks; ruled-out tiles skipped."""
    lo, hi = _key_range(pb, seg, i0, i1)
    for j0 in range(lo, hi, block_n):
        j1 = min(j0 + block_n, hi)
        keep = _tile_keep(pb, seg, i0, i1, j0, j1)
        if keep is not False:
            yield j0, j1, keep


def _scores(pb: Problem, seg: Segment, qt: np.ndarray, kt: np.ndarray, i0: int, j0: int, keep):
    """S for one tile, (rows, keys), and tanh(S_raw / softcap) (None without softcap).

    ``qt`` is already multiplied by the scale. Masked scores become -inf, which
    exp turns into an exact 0 probability.
    """
    s = qt @ kt.T  # S = scale * Q K^T
    tanh = None
    if pb.softcap is not None:
        tanh = np.tanh(s / pb.softcap)
        s = pb.softcap * tanh  # S = softcap * tanh(S / softcap)
    rows, cols = s.shape
    if pb.bias is not None:
        s += pb.bias[seg.head][i0 : i0 + rows, j0 : j0 + cols]
    if pb.alibi_slopes is not None:
        dist = np.abs(np.arange(i0, i0 + rows)[:, None] + seg.diagonal - np.arange(j0, j0 + cols)[None, :])
        s -= (pb.alibi_slopes[seg.head] * dist).astype(s.dtype)  # S -= slope * |i + Lk - Lq - j|
    if keep is not None:
        np.copyto(s, -np.inf, where=~keep)
    return s, tanh


def _dropout_scale(pb: Problem, seg: Segment, i0: int, i1: int, j0: int, j1: int, dtype) -> np.ndarray:
    """keep / (1 - dropout_p) for one tile, from the same Philox bits as every backend."""
    keep = rng.dropout_keep(
        pb.seed, pb.dropout_offset, seg.bh,
        np.arange(i0, i1)[:, None], np.arange(j0, j1)[None, :], pb.dropout_p,
    )
    return keep.astype(dtype) * dtype.type(1.0 / (1.0 - pb.dropout_p))


def _segment_inputs(pb: Problem, seg: Segment, acc):
    """The segment's valid q rows (times the scale), k and v keys, in the accumulator dtype."""
    q = np.asarray(pb.q[seg.q_index][: seg.q_len], dtype=acc) * acc.type(pb.scale)
    k = np.ascontiguousarray(pb.k[seg.k_index][: seg.kv_len], dtype=acc)
    v = np.ascontiguousarray(pb.v[seg.k_index][: seg.kv_len], dtype=acc)
    return q, k, v


def forward(pb: Problem) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) in the problem's internal layout: out (..., Hq, Lq, Dv) of q's dtype, lse float32/64."""
    acc = accumulator_dtype(pb.dtype)
    out = np.empty(pb.out_shape, dtype=pb.dtype)
    lse = np.empty(pb.lse_shape, dtype=lse_dtype(pb.dtype))
    block_m, block_n = tile_sizes(pb)
    for seg in pb.segments():
        o, lse_seg = out[seg.q_index], lse[seg.lse_index]
        o[seg.q_len :] = 0  # padded rows: output 0, lse -inf
        lse_seg[seg.q_len :] = -np.inf
        q, k, v = _segment_inputs(pb, seg, acc)
        for i0 in range(0, seg.q_len, block_m):
            i1 = min(i0 + block_m, seg.q_len)
            m = np.full(i1 - i0, -np.inf, dtype=acc)  # running row max
            l = np.zeros(i1 - i0, dtype=acc)  # running row sum of exp(S - m)
            o_acc = np.zeros((i1 - i0, pb.head_dim_v), dtype=acc)  # (BLOCK_M, Dv), unnormalised
            for j0, j1, keep in _key_tiles(pb, seg, i0, i1, block_n):
                s, _ = _scores(pb, seg, q[i0:i1], k[j0:j1], i0, j0, keep)
                m_new = np.maximum(m, s.max(axis=1))
                # Rows with every score so far masked have m = -inf; subtracting 0 instead keeps
                # exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN.
                m_safe = np.where(m_new == -np.inf, acc.type(0), m_new)
                alpha = np.exp(m - m_safe)  # rescales the old sum and accumulator
                s -= m_safe[:, None]
                p = np.exp(s, out=s)  # P = exp(S - m)
                l = l * alpha + p.sum(axis=1)  # lse is taken before dropout
                if pb.dropout_p > 0:
                    p *= _dropout_scale(pb, seg, i0, i1, j0, j1, acc)
                o_acc *= alpha[:, None]
                o_acc += p @ v[j0:j1]  # O += P V
                m = m_new
            live = l != 0  # l = 0 only when every score of the row was masked; NaN stays live
            inv_l = np.where(live, 1.0 / np.where(live, l, 1), 0).astype(acc)
            o[i0:i1] = np.where(live[:, None], o_acc * inv_l[:, None], 0).astype(pb.dtype)
            with np.errstate(divide="ignore"):
                lse_seg[i0:i1] = np.where(live, m + np.log(l), -np.inf)  # natural-log lse
    return out, lse


def _dbias_target(pb: Problem, seg: Segment) -> tuple[tuple, bool, bool]:
    """Index of this segment's slice of the dbias accumulator, and whether rows/cols are broadcast."""
    full = (1,) * (len(pb.batch) + 3 - len(pb.bias_shape)) + pb.bias_shape
    head = tuple(0 if n == 1 else ix for ix, n in zip(seg.head, full[:-2]))
    return head, full[-2] == 1, full[-1] == 1


def backward(pb: Problem, dout: np.ndarray, out: np.ndarray, lse: np.ndarray, bias_grad: bool):
    """(dq, dk, dv, dbias) in the problem's internal layout; dbias None unless ``bias_grad``.

    Recomputes P = exp(S - lse) tile by tile; D = rowsum(dO * O); dS = P (dP - D)
    with dP = dO V^T (times keep / (1 - p) under dropout); dQ = scale dS K,
    dK = scale dS^T Q (through tanh's derivative under softcap), dV = P'^T dO.
    dK and dV are summed over each GQA group.
    """
    acc = accumulator_dtype(pb.dtype)
    dq = np.zeros(pb.q.shape, dtype=acc)
    dk = np.zeros(pb.k.shape, dtype=acc)
    dv = np.zeros(pb.v.shape, dtype=acc)
    dbias = None
    if bias_grad:
        full = (1,) * (len(pb.batch) + 3 - len(pb.bias_shape)) + pb.bias_shape
        dbias = np.zeros(full, dtype=acc)
    block_m, block_n = tile_sizes(pb)
    for seg in pb.segments():
        q, k, v = _segment_inputs(pb, seg, acc)
        do = np.asarray(dout[seg.q_index][: seg.q_len], dtype=acc)
        delta = np.sum(do * np.asarray(out[seg.q_index][: seg.q_len], dtype=acc), axis=1)  # D = rowsum(dO * O)
        lse_seg = np.asarray(lse[seg.lse_index][: seg.q_len], dtype=acc)
        lse_safe = np.where(lse_seg == -np.inf, acc.type(0), lse_seg)  # fully masked rows: P = exp(-inf) = 0
        dq_seg = dq[seg.q_index]
        dk_seg, dv_seg = dk[seg.k_index], dv[seg.k_index]
        if bias_grad:
            head, rows_b, cols_b = _dbias_target(pb, seg)
            db_seg = dbias[head]
        for i0 in range(0, seg.q_len, block_m):
            i1 = min(i0 + block_m, seg.q_len)
            do_t = do[i0:i1]
            for j0, j1, keep in _key_tiles(pb, seg, i0, i1, block_n):
                s, tanh = _scores(pb, seg, q[i0:i1], k[j0:j1], i0, j0, keep)
                s -= lse_safe[i0:i1, None]
                p = np.exp(s, out=s)  # P = exp(S - lse)
                dp = do_t @ v[j0:j1].T  # dP = dO V^T
                pd = p
                if pb.dropout_p > 0:
                    z = _dropout_scale(pb, seg, i0, i1, j0, j1, acc)
                    pd = p * z
                    dp *= z
                dv_seg[j0:j1] += pd.T @ do_t  # dV += P'^T dO
                ds = p * (dp - delta[i0:i1, None])  # dS = P (dP - D)
                if bias_grad:
                    r = slice(0, 1) if rows_b else slice(i0, i1)
                    c = slice(0, 1) if cols_b else slice(j0, j1)
                    red = ds.sum(axis=0, keepdims=True) if rows_b else ds
                    db_seg[r, c] += red.sum(axis=1, keepdims=True) if cols_b else red
                if tanh is not None:
                    ds *= 1 - tanh * tanh  # d(softcap tanh(x / softcap)) / dx = 1 - tanh^2
                dq_seg[i0:i1] += ds @ k[j0:j1]
                dk_seg[j0:j1] += ds.T @ q[i0:i1]  # q is pre-scaled: scale * dS^T Q
        dq_seg *= pb.scale  # dQ = scale * dS K
    if dbias is not None:
        dbias = dbias.reshape(pb.bias_shape).astype(pb.bias.dtype)
    return dq.astype(pb.dtype), dk.astype(pb.dtype), dv.astype(pb.dtype), dbias
