"""The elementwise work on one score tile of the CPU backend, in two implementations.

Tiles are *transposed*: ``st`` holds S^T, shape (keys, queries), C-contiguous,
so that every per-query statistic (running max, running sum, lse, D) is a
vector along the fast axis and every loop here is elementwise across queries:
it vectorises without reassociating a sum, and sums are taken in key order.

- the compiled kernels (with Numba installed, ``pip install 'flashcupy[cpu]'``):
  one compiled pass per step, vectorised, the GIL released; exp is evaluated by
  range reduction (x = n ln 2 + r, Cody-Waite) and a Taylor polynomial in r
  (degree 7 for float32, 13 for float64: relative error about 1 ulp), exactly 0
  below the smallest normal result.
- :class:`NumpyKernels`: the same steps as NumPy calls (np.exp).

Both give the semantics of design.md section 2 with the same special values: a
query whose scores are all -inf keeps m = -inf and l = 0; NaN or +inf among a
query's scores makes its l (and so out and lse) NaN. Callers run them under
``np.errstate(all="ignore")`` (see cpu_parallel), so that Inf/NaN inputs raise
no RuntimeWarning.

Select with :func:`kernels`; ``FLASHCUPY_CPU_JIT=0`` in the environment forces
NumPy.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace
from typing import Protocol

import numpy as np


class TileKernels(Protocol):
    """The elementwise steps on transposed tiles; every array is modified in place.

    Shapes: st, dpt (n keys, m queries) C-contiguous; vectors (m,); z (n, m).
    """

    name: str

    def forward_tile(self, st: np.ndarray, m: np.ndarray, l: np.ndarray, alpha: np.ndarray,
                     shift: np.ndarray) -> None:
        """Online softmax step: m_new = max(m, max_j st), alpha = exp(m - m_new),
        st = exp(st - m_new), l = l * alpha + sum_j st, m = m_new (m_new read as 0
        where it is -inf; alpha NaN where m_new is NaN or +inf). ``shift`` is scratch."""

    def backward_tile(self, st: np.ndarray, dpt: np.ndarray, lse: np.ndarray, delta: np.ndarray,
                      z: np.ndarray | None) -> None:
        """P = exp(st - lse); st = P * z; dpt = P * (dpt * z - delta) (z = 1 without dropout).

        ``lse`` has -inf already replaced by 0."""

    def mask_outside(self, st: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """st[j, i] = -inf unless lo[i] <= j < hi[i] (tile-relative key bounds per query)."""

    def rescale_add(self, o: np.ndarray, alpha: np.ndarray, pv: np.ndarray) -> None:
        """o = o * alpha[:, None] + pv, with o and pv (m, Dv)."""


class NumpyKernels:
    """The tile steps as NumPy calls."""

    name = "numpy"

    def forward_tile(self, st, m, l, alpha, shift):
        m_new = np.maximum(m, st.max(axis=0))
        m_safe = np.where(m_new == -np.inf, m.dtype.type(0), m_new)
        np.exp(m - m_safe, out=alpha)
        alpha[~(m_new < np.inf)] = np.nan  # NaN or +inf among the scores: the whole row is NaN
        st -= m_safe
        np.exp(st, out=st)
        l *= alpha
        l += st.sum(axis=0)
        m[...] = m_new

    def backward_tile(self, st, dpt, lse, delta, z):
        st -= lse
        np.exp(st, out=st)  # P
        if z is not None:
            dpt *= z
        dpt -= delta
        dpt *= st  # dS = P (dP z - D)
        if z is not None:
            st *= z  # P z, for dV

    def mask_outside(self, st, lo, hi):
        keys = np.arange(st.shape[0])[:, None]
        np.copyto(st, -np.inf, where=(keys < lo) | (keys >= hi))

    def rescale_add(self, o, alpha, pv):
        o *= alpha[:, None]
        o += pv


def _numba_kernels():
    """The compiled tile steps (imports Numba; compiles on first use, cached on disk)."""
    from llvmlite import ir
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

    def exp_finite(x):
        """exp(x) for x <= 88 (float32) / 709 (float64), 0 below the smallest normal result, NaN -> 0."""

    def exp_any(x):
        """exp_finite, with NaN -> NaN."""

    @overload(exp_finite, fastmath={"contract"})
    def exp_finite_impl(x):
        if x == types.float32:
            f, i, taylor = np.float32, np.int32, 7
            lowest, highest, ln2_hi, ln2_lo, bias, mantissa = -87.3, 88.0, 0.693359375, -2.12194440e-4, 127, 23
        elif x == types.float64:
            f, i, taylor = np.float64, np.int64, 13
            lowest, highest, ln2_hi, ln2_lo, bias, mantissa = (
                -708.3, 709.0, 6.93147180369123816490e-01, 1.90821492927058770002e-10, 1023, 52)
        else:
            return None
        lowest, highest, ln2_hi, ln2_lo, zero = f(lowest), f(highest), f(ln2_hi), f(ln2_lo), f(0)
        log2e = f(1 / math.log(2))
        magic = f(1.5 * 2.0**mantissa)  # adding it rounds to an integer, held in the low mantissa bits
        bias, mantissa = i(bias), i(mantissa)
        coefs = tuple(f(1 / math.factorial(d)) for d in range(taylor - 1, -1, -1))
        top = f(1 / math.factorial(taylor))

        def impl(x):
            xc = x if x > lowest else lowest
            xc = xc if xc < highest else highest
            t = xc * log2e + magic
            n = t - magic  # round(x / ln 2)
            r = xc - n * ln2_hi
            r = r - n * ln2_lo  # x - n ln 2, |r| <= ln 2 / 2
            p = top
            for c in coefs:
                p = p * r + c
            # 2^n from the bits of t: its low bits hold n, the shift drops the magic's exponent.
            y = p * bitcast(i((bitcast(t) + bias) << mantissa))
            return y if x > lowest else zero

        return impl

    @overload(exp_any, fastmath={"contract"})
    def exp_any_impl(x):
        def impl(x):
            y = exp_finite(x)
            return y if x == x else x

        return impl if x in (types.float32, types.float64) else None

    jit = njit(nogil=True, cache=True, fastmath={"contract"})

    @jit
    def forward_tile(st, m, l, alpha, shift):
        n, cols = st.shape
        for i in range(cols):
            shift[i] = m[i]  # the new running max, first
        for j in range(n):
            for i in range(cols):
                x = st[j, i]
                shift[i] = x if (x > shift[i]) | (x != x) else shift[i]  # NaN sticks
        for i in range(cols):
            m_new = shift[i]
            shift[i] = m_new if m_new != -np.inf else np.float32(0)  # all masked so far: exp(-inf - 0) = 0
            alpha[i] = exp_any(m[i] - shift[i]) if m_new < np.inf else np.float32(np.nan)  # NaN/+inf: NaN row
            m[i] = m_new
            l[i] *= alpha[i]
        for j in range(n):
            for i in range(cols):
                e = exp_finite(st[j, i] - shift[i])
                st[j, i] = e
                l[i] += e

    @jit
    def backward_tile(st, dpt, lse, delta, z):
        n, cols = st.shape
        if z is None:
            for j in range(n):
                for i in range(cols):
                    p = exp_any(st[j, i] - lse[i])
                    st[j, i] = p
                    dpt[j, i] = p * (dpt[j, i] - delta[i])
        else:
            for j in range(n):
                for i in range(cols):
                    p = exp_any(st[j, i] - lse[i])
                    st[j, i] = p * z[j, i]
                    dpt[j, i] = p * (dpt[j, i] * z[j, i] - delta[i])

    @jit
    def mask_outside(st, lo, hi):
        n, cols = st.shape
        for j in range(n):
            for i in range(cols):
                st[j, i] = st[j, i] if (j >= lo[i]) & (j < hi[i]) else -np.inf

    @jit
    def rescale_add(o, alpha, pv):
        rows, cols = o.shape
        for i in range(rows):
            a = alpha[i]
            for d in range(cols):
                o[i, d] = o[i, d] * a + pv[i, d]

    return SimpleNamespace(name="numba", forward_tile=forward_tile, backward_tile=backward_tile,
                           mask_outside=mask_outside, rescale_add=rescale_add)


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
