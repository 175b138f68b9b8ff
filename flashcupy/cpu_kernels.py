"""The elementwise work on one score tile of the CPU backend, in two implementations.

Tiles are *transposed*: ``st`` holds S^T, shape (keys, queries), C-contiguous,
so that every per-query statistic (running shift, running sum, lse, D) is a
vector along the fast axis and every loop here is elementwise across queries:
it vectorises without reassociating a sum, and sums are taken in key order.

Scores are in base-2 units, S * log2(e) (the caller folds log2(e) into the
scale), so that probabilities are 2^(s - m): the range reduction of exp2 is a
single exact subtraction.

- the compiled kernels (with Numba installed, ``pip install 'flashcupy[cpu]'``):
  one vectorised pass per step with the GIL released. 2^x = 2^n 2^f with n =
  round(x), |f| <= 1/2, and 2^f a polynomial: for float32 of degree 6, fitted
  to minimise the relative error on [-1/2, 1/2] with p(0) = 1 (1e-7 in float32
  arithmetic); for float64 the Taylor series of e^(f ln 2) to degree 13. x is
  clamped to [lowest, 64] first by two compare-and-selects that keep NaN: at the
  lowest exponent the power of two's bits are those of 0, so results below half
  the smallest normal number are exactly 0 with no further select. The forward
  rescales lazily: a query's shift m starts at its score for the first key and
  stays put while a tile's sum of 2^(s - m) is at most 2^SUM_HEADROOM times the
  tile's keys (so no probability passes that either); past that the shift moves
  up by about log2 of the sum, and no pass ever looks for the maximum. A query
  whose sum reaches 2^60 (a score far past its shift, or +inf, both read as 2^64
  by the clamp) is recomputed alone with the exact two-pass step.
- :class:`NumpyKernels`: the same steps as NumPy calls (np.exp2), with the
  running maximum as the shift.

Both give the semantics of docs/semantics.md with the same special values: a
query whose scores are all -inf keeps m = -inf and l = 0; NaN or +inf among a
query's scores makes its l (and so out and lse) NaN. Callers run them under
``np.errstate(all="ignore")`` (see cpu_parallel), so that Inf/NaN inputs raise
no RuntimeWarning. tests/test_cpu_kernels.py holds the two to each other.

Select with :func:`kernels`; ``FLASHCUPY_CPU_JIT=0`` in the environment forces
NumPy.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace
from typing import Protocol

import numpy as np

from . import rng

#: Scores are held in base 2 (S log2 e): probabilities are exp2 of a difference.
LOG2E = 1 / math.log(2)
LN2 = math.log(2)
#: How large (base 2) a tile's sum of 2^(s - m) may grow, over its key count, before the forward
#: moves the shift m up. A tile's sum is at most its keys while no score exceeds the shift, so
#: ordinary tiles never rescale; sums (and so the unnormalised output, sum_j 2^(s_j - m) v_j) stay
#: within 2^8 times the keys, as with a running maximum kept within 8 of the scores'.
SUM_HEADROOM = 8.0
#: A tile's sum at which a lazily shifted query is recomputed alone (exp2 reads arguments past
#: 64 as 64: a sum this large means a score at least 60 past the shift, or +inf).
DAMAGED_SUM = 2.0**60
#: float32 coefficients of 2^f on [-1/2, 1/2], degree 0 up (see the module docstring).
EXP2_F32 = (1.0, 0.693147182, 0.240226477, 0.0555033237, 0.00961843692, 0.0013398875, 0.00015353362)


class TileKernels(Protocol):
    """The elementwise steps on transposed tiles; every array is modified in place.

    Shapes: st, dpt (n keys, m queries) C-contiguous; vectors (m,); z (n, m).
    """

    name: str

    def forward_tile(self, st: np.ndarray, m: np.ndarray, l: np.ndarray, alpha: np.ndarray,
                     scratch: np.ndarray, damaged: np.ndarray, exact: bool) -> int:
        """Online softmax step with shift m (base 2): st = 2^(st - m_new), alpha =
        2^(m - m_new), l = l * alpha + sum_j st, m = m_new, where sum_j st <=
        2^SUM_HEADROOM times st's keys; with ``exact``, m_new = max(m, max_j st). Special values as in the
        module docstring (a NaN or +inf score leaves l NaN). ``scratch`` is (3, queries).
        Returns how many queries (listed in ``damaged``) were left untouched but for their
        st column, to be recomputed and passed alone with ``exact``. Each query's result
        depends on its own column only."""

    def backward_tile(self, st: np.ndarray, dpt: np.ndarray, lse: np.ndarray, delta: np.ndarray,
                      z: np.ndarray | None) -> None:
        """P = 2^(st - lse); st = P * z; dpt = P * (dpt * z - delta) (z = 1 without dropout).

        ``lse`` is base 2, with -inf already replaced by 0."""

    def mask_outside(self, st: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """st[j, i] = -inf unless lo[i] <= j < hi[i] (tile-relative key bounds per query)."""

    def mask_where(self, st: np.ndarray, keep: np.ndarray) -> None:
        """st[j, i] = -inf where not keep[i, j] (keep: (queries, keys) bool, any layout)."""

    def add_bias(self, st: np.ndarray, bias: np.ndarray, factor: float) -> None:
        """st[j, i] += bias[i, j] * factor (bias: (queries, keys), any layout and float dtype;
        st may be a column slice of a tile)."""

    def add_alibi(self, st: np.ndarray, slopes: np.ndarray, diagonals: np.ndarray) -> None:
        """st[j, i] -= slopes[i] * |diagonals[i] - j|, the product in float64 (slopes float64,
        diagonals int64: each query's diagonal key relative to the tile's first)."""

    def dropout_scale(self, z: np.ndarray, seed: int, offset: int, bh: int, i0: int, j0: int, p: float) -> None:
        """z[j, i] = keep(bh, i0 + i, j0 + j) / (1 - p): the Philox bits of flashcupy.rng."""

    def rescale_add(self, o: np.ndarray, alpha: np.ndarray, pv: np.ndarray) -> None:
        """o = o * alpha[:, None] + pv, with o and pv (m, Dv)."""

    def finish(self, o: np.ndarray, m: np.ndarray, l: np.ndarray, lse: np.ndarray, out: np.ndarray) -> None:
        """out = o / l and lse = (m + log2 l) ln 2 (natural log), where l != 0; out = 0 and
        lse = -inf for rows whose every score was masked (NaN rows stay NaN). o, out (m, Dv)."""


class NumpyKernels:
    """The tile steps as NumPy calls."""

    name = "numpy"

    def forward_tile(self, st, m, l, alpha, scratch, damaged, exact):
        m_new = np.maximum(m, st.max(axis=0))
        m_safe = np.where(m_new == -np.inf, m.dtype.type(0), m_new)
        np.exp2(m - m_safe, out=alpha)
        alpha[~(m_new < np.inf)] = np.nan  # NaN or +inf among the scores: the whole row is NaN
        st -= m_safe
        np.exp2(st, out=st)
        l *= alpha
        l += st.sum(axis=0)
        m[...] = m_new
        return 0

    def backward_tile(self, st, dpt, lse, delta, z):
        st -= lse
        np.exp2(st, out=st)  # P
        if z is not None:
            dpt *= z
        dpt -= delta
        dpt *= st  # dS = P (dP z - D)
        if z is not None:
            st *= z  # P z, for dV

    def dropout_scale(self, z, seed, offset, bh, i0, j0, p):
        keep = rng.dropout_keep(seed, offset, bh, np.arange(i0, i0 + z.shape[1])[:, None],
                                np.arange(j0, j0 + z.shape[0])[None, :], p)
        np.multiply(keep.T, z.dtype.type(1 / (1 - p)), out=z)

    def mask_outside(self, st, lo, hi):
        kept_from, kept_to = lo.max(), hi.min()  # keys every query keeps: nothing to mask there
        for start, stop in ((0, kept_from), (max(kept_from, kept_to), st.shape[0])):
            keys = np.arange(start, stop)[:, None]
            np.copyto(st[start:stop], -np.inf, where=(keys < lo) | (keys >= hi))

    def mask_where(self, st, keep):
        np.copyto(st, -np.inf, where=~keep.T)

    def add_bias(self, st, bias, factor):
        st += np.multiply(bias.T, factor, dtype=st.dtype)

    def add_alibi(self, st, slopes, diagonals):
        st -= (slopes * np.abs(diagonals[None, :] - np.arange(st.shape[0])[:, None])).astype(st.dtype)

    def rescale_add(self, o, alpha, pv):
        o *= alpha[:, None]
        o += pv

    def finish(self, o, m, l, lse, out):
        live = l != 0  # l = 0 only when every score of the row was masked; NaN stays live
        inv_l = (1 / np.where(live, l, 1)).astype(o.dtype)
        np.copyto(out, np.where(live[:, None], o * inv_l[:, None], 0), casting="unsafe")
        lse[...] = np.where(live, (m + np.log2(l)) * LN2, -np.inf)


def _numba_kernels():
    """The compiled tile steps (imports Numba; compiles on first use, cached on disk)."""
    from numba import njit, types
    from numba.extending import intrinsic, overload

    same_size = {types.float32: types.int32, types.int32: types.float32,
                 types.float64: types.int64, types.int64: types.float64}

    @intrinsic
    def bitcast(typingctx, x):
        """The bits of a float32/float64 read as an int32/int64, and back."""
        if x not in same_size:
            return None
        return same_size[x](x), lambda context, builder, sig, args: builder.bitcast(
            args[0], context.get_value_type(sig.return_type))

    def exp2(x):
        """2^x, with x < lowest read as lowest (result exactly 0) and x > 64 as 64; NaN -> NaN.
        Results between the smallest normal number and half of it come out subnormal."""

    @overload(exp2, fastmath={"contract"})
    def exp2_impl(x):
        if x == types.float32:
            f, i, lowest, bias, mantissa = np.float32, np.int32, -127.0, 127, 23
            coefs = EXP2_F32
        elif x == types.float64:
            f, i, lowest, bias, mantissa = np.float64, np.int64, -1023.0, 1023, 52
            coefs = tuple(math.log(2) ** d / math.factorial(d) for d in range(14))
        else:
            return None
        lowest, highest = f(lowest), f(64)
        magic = f(1.5 * 2.0**mantissa)  # adding it rounds to an integer, held in the low mantissa bits
        bias, mantissa = i(bias), i(mantissa)
        top, rest = f(coefs[-1]), tuple(f(c) for c in coefs[-2::-1])

        def impl(x):
            # Clamp: a compare that is false for NaN selects x, so NaN stays NaN.
            xc = lowest if lowest > x else x
            xc = highest if xc > highest else xc
            t = xc + magic
            frac = xc - (t - magic)  # x - round(x), exact
            p = top
            for c in rest:
                p = p * frac + c
            # 2^round(x) from the bits of t: its low bits hold round(x), the shift drops the magic's
            # exponent; round(x) = lowest gives exponent bits 0, the bits of 0.
            return p * bitcast(i((bitcast(t) + bias) << mantissa))

        return impl

    jit = njit(nogil=True, cache=True, fastmath={"contract"})

    @jit
    def forward_tile(st, m, l, alpha, scratch, damaged, exact, headroom, damaged_sum):
        n, cols = st.shape
        shift, top, total = scratch[0], scratch[1], scratch[2]
        need_max = exact
        for i in range(cols):  # each query's shift: its running one, else its first finite score
            if not exact and -np.inf < m[i] < np.inf:
                shift[i] = m[i]
            elif not exact and m[i] == -np.inf and -np.inf < st[0, i] < np.inf:
                shift[i] = st[0, i]
            elif m[i] == -np.inf or (exact and m[i] == m[i]):
                shift[i] = np.nan  # from the maximum below
                need_max = True
            else:
                shift[i] = 0  # a NaN row already
        if need_max:  # the two-pass step: the maximum first (NaN never wins a compare)
            for i in range(cols):
                top[i] = m[i] if m[i] == m[i] else -np.inf
            for j in range(n):
                for i in range(cols):
                    x = st[j, i]
                    top[i] = x if x > top[i] else top[i]
            for i in range(cols):
                if shift[i] != shift[i]:
                    shift[i] = top[i] if -np.inf < top[i] < np.inf else 0
        for i in range(cols):
            total[i] = 0
        for j in range(n):  # P^T = 2^(S^T - shift), and its column sums
            for i in range(cols):
                e = exp2(st[j, i] - shift[i])
                st[j, i] = e
                total[i] += e
        count = 0
        rescale = False
        for i in range(cols):
            s = total[i]
            inf_score = need_max and top[i] == np.inf
            top[i] = 1  # from here: the factor each column of st is rescaled by
            if m[i] != m[i] or s != s or inf_score:  # a NaN or +inf score: a NaN row
                m[i] = np.nan
                l[i] = np.nan
                alpha[i] = np.nan
            elif s >= damaged_sum:  # a score far past the lazy shift, or +inf: the caller recomputes
                damaged[count] = i
                count += 1
            elif s == 0 and m[i] == -np.inf:  # nothing kept yet: l = 0, o = 0 stay
                alpha[i] = 1
            else:
                m_new = shift[i]
                if s > headroom * n:  # move the shift up by about log2(s), to a value m holds exactly
                    m_new = shift[i] + np.floor(np.log2(s))
                    top[i] = exp2(shift[i] - m_new)  # a power of two unless m_new was rounded
                    s *= top[i]
                    rescale = True
                alpha[i] = exp2(m[i] - m_new)  # 1 when the shift stays, 0 for the first tile
                l[i] = l[i] * alpha[i] + s
                m[i] = m_new
        if rescale:
            for j in range(n):
                for i in range(cols):
                    st[j, i] *= top[i]
        return count

    @jit
    def backward_tile(st, dpt, lse, delta, z):
        n, cols = st.shape
        if z is None:
            for j in range(n):
                for i in range(cols):
                    p = exp2(st[j, i] - lse[i])  # read as 2^64 past 64: beyond any consistent lse
                    st[j, i] = p
                    dpt[j, i] = p * (dpt[j, i] - delta[i])
        else:
            for j in range(n):
                for i in range(cols):
                    p = exp2(st[j, i] - lse[i])
                    st[j, i] = p * z[j, i]
                    dpt[j, i] = p * (dpt[j, i] * z[j, i] - delta[i])

    @jit
    def philox_keep(z, key0, key1, offset, bh, i0, j0, threshold, scale):
        n, cols = z.shape
        m0, m1 = np.uint64(rng.PHILOX_M0), np.uint64(rng.PHILOX_M1)
        w0, w1 = np.uint64(rng.PHILOX_W0), np.uint64(rng.PHILOX_W1)
        low, shift, zero = np.uint64(0xFFFFFFFF), np.uint64(32), z.dtype.type(0)
        half = np.uint64(0xFFFF)
        for group in range(j0 >> 3, ((j0 + n - 1) >> 3) + 1):  # one Philox call: keys 8 group .. 8 group + 7
            first = 8 * group - j0
            for i in range(cols):
                c0, c1, c2, c3 = np.uint64(group), np.uint64(i0 + i), np.uint64(bh), np.uint64(offset)
                k0, k1 = np.uint64(key0), np.uint64(key1)
                for _ in range(rng.PHILOX_ROUNDS):
                    p0, p1 = m0 * c0, m1 * c2
                    c0, c1, c2, c3 = (p1 >> shift) ^ c1 ^ k0, p1 & low, (p0 >> shift) ^ c3 ^ k1, p0 & low
                    k0, k1 = (k0 + w0) & low, (k1 + w1) & low
                for w, word in enumerate((c0, c1, c2, c3)):  # key 2 w + h: half h of word w, low half first
                    for h in range(2):
                        if 0 <= first + 2 * w + h < n:
                            z[first + 2 * w + h, i] = scale if (word >> np.uint64(16 * h)) & half >= threshold else zero

    def dropout_scale(z, seed, offset, bh, i0, j0, p):
        philox_keep(z, seed & 0xFFFFFFFF, seed >> 32, offset, bh, i0, j0, rng.dropout_threshold(p),
                    z.dtype.type(1 / (1 - p)))

    @jit
    def mask_outside(st, lo, hi):
        n, cols = st.shape
        kept_from, kept_to = lo.max(), hi.min()  # keys every query keeps: nothing to mask there
        for j in range(n):
            if kept_from <= j < kept_to:
                continue
            for i in range(cols):
                st[j, i] = st[j, i] if (j >= lo[i]) & (j < hi[i]) else np.float32(-np.inf)

    @jit
    def mask_where(st, keep):
        # keep read along its keys (a mask's rows), only the masked scores written: 0.7 ns a
        # score for a 10% random mask against NumPy's copyto through keep.T at 1.6 (a walk in
        # 32 x 32 squares, or selecting every score, ran slower still).
        n, cols = st.shape
        for i in range(cols):
            for j in range(n):
                if not keep[i, j]:
                    st[j, i] = -np.inf

    @jit
    def add_bias_columns(st, bias, factor):
        # Eight queries at a time (one 32-byte run of each key's row of st) over every key: the
        # bias is read down its columns eight at a time while st's lines stay in cache. 222 us a
        # float32 (1024, 256) tile, against 809 for NumPy's product through bias.T and 419 / 771
        # with 16 / 32 queries at a time.
        n, cols = st.shape
        for i0 in range(0, cols, 8):
            i1 = min(i0 + 8, cols)
            for j in range(n):
                for i in range(i0, i1):
                    st[j, i] += bias[i, j] * factor

    def add_bias(st, bias, factor):
        if bias.dtype not in (np.float32, np.float64):  # 16-bit biases: Numba has no float16
            bias = bias.astype(st.dtype)
        add_bias_columns(st, bias, st.dtype.type(factor))

    @jit
    def add_alibi(st, slopes, diagonals):
        n, cols = st.shape
        for j in range(n):
            for i in range(cols):
                st[j, i] -= st.dtype.type(slopes[i] * abs(diagonals[i] - j))

    @jit
    def rescale_add(o, alpha, pv):
        rows, cols = o.shape
        for i in range(rows):
            a = alpha[i]
            for d in range(cols):
                o[i, d] = o[i, d] * a + pv[i, d]

    @jit
    def finish(o, m, l, lse, out):
        rows, cols = o.shape
        for i in range(rows):
            if l[i] != 0:  # l = 0 only when every score of the row was masked; NaN stays live
                inv = np.float32(1) / l[i]
                for d in range(cols):
                    out[i, d] = o[i, d] * inv
                lse[i] = (m[i] + np.log2(l[i])) * LN2
            else:
                for d in range(cols):
                    out[i, d] = 0
                lse[i] = -np.inf

    def forward_tile_step(st, m, l, alpha, scratch, damaged, exact):
        return forward_tile(st, m, l, alpha, scratch, damaged, exact, 2.0**SUM_HEADROOM, DAMAGED_SUM)

    return SimpleNamespace(name="numba", forward_tile=forward_tile_step, backward_tile=backward_tile,
                           dropout_scale=dropout_scale, mask_outside=mask_outside, mask_where=mask_where,
                           add_bias=add_bias, add_alibi=add_alibi, rescale_add=rescale_add, finish=finish)


_NUMPY = NumpyKernels()
_compiled: list = []  # the Numba kernels once built, or None when Numba is missing


def numba_kernels() -> TileKernels | None:
    """The compiled kernels, or None when Numba cannot be imported."""
    if not _compiled:
        try:
            _compiled.append(_numba_kernels())
        except ImportError:
            _compiled.append(None)
    return _compiled[0]


def kernels(jit: bool | None = None) -> TileKernels:
    """The kernels to use: compiled when ``jit`` (default: unless FLASHCUPY_CPU_JIT=0) and
    Numba is installed, else NumPy's."""
    if jit is None:
        jit = os.environ.get("FLASHCUPY_CPU_JIT", "1").strip() not in ("0", "false", "no", "off")
    return (numba_kernels() or _NUMPY) if jit else _NUMPY
