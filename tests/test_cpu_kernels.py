"""The CPU backend's tile kernels: compiled (Numba) against NumPy's, and exp2's accuracy."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

import flashcupy as fc
from flashcupy import cpu_kernels, rng
from flashcupy.testing import assert_attention_close
from support import cpu_tiles

NUMBA = cpu_kernels.numba_kernels()
NUMPY = cpu_kernels.NumpyKernels()
pytestmark = [
    pytest.mark.skipif(NUMBA is None, reason="Numba is not installed"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),  # the NumPy kernels on Inf/NaN, outside the backend
]
DTYPES = [np.float32, np.float64]
#: Relative error of one compiled exp2 against NumPy's (1 ulp is 6e-8 / 1.1e-16).
EXP2_RTOL = {np.float32: 2.5e-7, np.float64: 1e-15}


def _tile(dtype, n=37, cols=19, seed=0, spread=20.0):
    rs = np.random.default_rng(seed)
    return (rs.standard_normal((n, cols)) * spread).astype(dtype)


def _online(kernels, tiles, dtype, exact=False):
    """Run forward_tile over ``tiles`` as the forward does: (m, l, o, paths) with o = sum_t
    P_t^T v_t and paths the set of what the lazy steps after the first did to the shift."""
    cols = tiles[0].shape[1]
    m = np.full(cols, -np.inf, dtype)
    l = np.zeros(cols, dtype)
    alpha, scratch, damaged = np.empty(cols, dtype), np.empty((3, cols), dtype), np.empty(cols, np.int64)
    o = np.zeros((cols, 3), dtype)
    rs = np.random.default_rng(1)
    paths = set()
    for t, tile in enumerate(tiles):
        v = rs.standard_normal((tile.shape[0], 3)).astype(dtype)
        st, before = tile.copy(), m.copy()
        count = kernels.forward_tile(st, m, l, alpha, scratch, damaged, exact)
        for c in damaged[:count]:
            paths.add("recomputed")
            column = tile[:, c : c + 1].copy()
            kernels.forward_tile(column, m[c : c + 1], l[c : c + 1], alpha[c : c + 1], np.empty((3, 1), dtype),
                                 damaged[count:], True)
            st[:, c] = column[:, 0]
        if t and not exact and not count and np.isfinite(before).all():
            moved = m != before
            paths.add("moved" if moved.any() else "kept")
            assert np.all((m - before)[moved] == np.round((m - before)[moved]))  # by whole powers of two
        kernels.rescale_add(o, alpha, st.T @ v)
    return m, l, o, paths


@pytest.mark.parametrize("dtype", DTYPES)
def test_exp2_accuracy_and_exact_zeros(dtype):
    x = np.concatenate([np.linspace(-125.9, 0, 200001), [0.0, -0.5, -1.0]]).astype(dtype)
    st = x[:, None].copy()  # one query: after the exact step st = 2^(x - max x) = 2^x
    m, l = np.full(1, -np.inf, dtype), np.zeros(1, dtype)
    scratch, damaged = np.empty((3, 1), dtype), np.empty(1, np.int64)
    NUMBA.forward_tile(st, m, l, np.empty(1, dtype), scratch, damaged, True)
    want = np.exp2(x.astype(np.float64))
    np.testing.assert_allclose(st[:, 0], want, rtol=EXP2_RTOL[dtype], atol=0)
    assert st[-3, 0] == 1.0  # the row max gets probability exactly 1
    st = np.array([[-np.inf], [-1e30], [-1e4], [0.0]], dtype)
    m[...], l[...] = -np.inf, 0
    NUMBA.forward_tile(st, m, l, np.empty(1, dtype), scratch, damaged, True)
    assert list(st[:, 0]) == [0.0, 0.0, 0.0, 1.0] and l[0] == 1.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("jump, path", [(0.0, "kept"), (20.0, "moved"), (100.0, "recomputed")])
def test_lazy_forward_matches_the_exact_one(dtype, jump, path):
    """Lazy shifts (kept, moved by a power of two, or recomputed) give the same softmax."""
    tiles = [_tile(dtype, 40 + t, 23, seed=t, spread=1.0) for t in range(3)]
    tiles[1][5, 3] = tiles[0][:, 3].max() + jump  # one query's scores jump in the second tile
    m0, l0, o0, _ = _online(NUMPY, tiles, dtype, True)
    m1, l1, o1, paths = _online(NUMBA, tiles, dtype)
    assert path in paths
    # Same distribution: l 2^m and o / l agree whatever shift each chose.
    np.testing.assert_allclose(np.log2(l1) + m1, np.log2(l0) + m0, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(o1 / l1[:, None], o0 / l0[:, None], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_tile_whose_sum_passes_the_headroom_moves_the_shift(dtype):
    """No score of the second tile is far past the shift, but their sum passes
    2^SUM_HEADROOM: the shift moves up by a power of two and the softmax is unchanged."""
    first = np.zeros((4, 3), dtype)
    second = np.full((2048, 3), 10.0, dtype)  # 2^10 each, 2^21 in all: past 2^20
    second[:, 2] = -1.0  # a query that stays put
    m0, l0, o0, _ = _online(NUMPY, [first, second], dtype, True)
    m1, l1, o1, paths = _online(NUMBA, [first, second], dtype)
    assert paths == {"moved"} and m1[0] == m1[1] == 21 and m1[2] == 0
    np.testing.assert_allclose(np.log2(l1) + m1, np.log2(l0) + m0, rtol=1e-6)
    np.testing.assert_allclose(o1 / l1[:, None], o0 / l0[:, None], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_moved_shift_weighs_every_tile_alike(dtype):
    """Scores near 1000 (base 2): the moved shift lands where m can hold it exactly, and the
    tiles before and after the move are weighed by the same m (the last key's weight: about 1/2)."""
    tiles = [np.array([[1000.00006]], dtype), np.array([[1030.0]], dtype), np.array([[1030.0]], dtype)]
    values = [0.0, 0.0, 1.0]
    m, l, o = np.full(1, -np.inf, dtype), np.zeros(1, dtype), np.zeros((1, 1), dtype)
    alpha, scratch, damaged = np.empty(1, dtype), np.empty((3, 1), dtype), np.empty(1, np.int64)
    for tile, value in zip(tiles, values):
        st = tile.copy()
        count = NUMBA.forward_tile(st, m, l, alpha, scratch, damaged, False)
        if count:
            st = tile.copy()
            NUMBA.forward_tile(st, m, l, alpha, scratch, damaged, True)
        NUMBA.rescale_add(o, alpha, st.T @ np.full((1, 1), value, dtype))
    first = float(tiles[0][0, 0])
    want = 1 / (2 + 2.0 ** (first - 1030))  # softmax weight of the last key
    assert abs(o[0, 0] / l[0] - want) <= 4 * np.finfo(dtype).eps


def test_large_values_with_a_lazy_shift_stay_finite():
    """A score 19.5 (base 2) past a query's first keeps its probability bounded before P V:
    v near float32's largest values still gives their average, not inf."""
    q = np.ones((1, 1, 1), np.float32)
    k = np.array([[[0.0], [19.5 * np.log(2)]]], np.float32)
    v = np.full((1, 2, 1), 1e33, np.float32)
    out = fc.flash_attention(q, k, v, scale=1.0, backend="cpu")
    np.testing.assert_allclose(out, 1e33, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_special_values_agree(dtype):
    tiles = [_tile(dtype, 16, 6, seed=s, spread=4.0) for s in range(3)]
    tiles[0][:, 0] = -np.inf  # query 0 masked in its first tile, live later
    for t in tiles:
        t[:, 1] = -np.inf  # query 1 masked everywhere
    tiles[1][3, 2] = np.nan  # query 2: NaN in a later tile
    tiles[2][4, 3] = np.inf  # query 3: +inf in a later tile
    for exact in (False, True):
        m0, l0, o0, _ = _online(NUMPY, tiles, dtype, True)
        m1, l1, o1, _ = _online(NUMBA, tiles, dtype, exact)
        assert l1[1] == 0 and m1[1] == -np.inf and np.all(o1[1] == 0)
        assert np.isnan(l1[2]) and np.isnan(l1[3]) and np.isnan(l0[2]) and np.isnan(l0[3])
        live = [0, 4, 5]
        want = (o0 / l0[:, None])[live]
        np.testing.assert_allclose((o1 / l1[:, None])[live], want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dropout", [False, True])
def test_backward_tile_agrees(dtype, dropout):
    rs = np.random.default_rng(5)
    st = _tile(dtype, 29, 17, spread=3.0)
    st[2, 4] = -np.inf
    st[7, 1] = np.nan
    dpt = rs.standard_normal(st.shape).astype(dtype)
    lse = (np.log2(np.exp2(st.astype(np.float64)).sum(axis=0)) + 0.5).astype(dtype)
    lse[1] = 0
    delta = rs.standard_normal(17).astype(dtype)
    z = (rs.random(st.shape) < 0.7).astype(dtype) / dtype(0.7) if dropout else None
    results = []
    for kernels in (NUMPY, NUMBA):
        a, b = st.copy(), dpt.copy()
        kernels.backward_tile(a, b, lse, delta, z)
        results.append((a, b))
    for x, y in zip(*results):
        assert np.array_equal(np.isnan(x), np.isnan(y))
        x, y = x[~np.isnan(x)], y[~np.isnan(y)]  # dS = P (dP - D) cancels: error relative to the largest
        np.testing.assert_allclose(x, y, rtol=0, atol=EXP2_RTOL[dtype] * 8 * np.abs(y).max())


@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_outside_agrees(dtype):
    rs = np.random.default_rng(6)
    for n, cols in ((40, 9), (5, 30), (1, 1)):
        lo = rs.integers(0, n + 1, cols)
        hi = rs.integers(0, n + 1, cols)
        results = []
        for kernels in (NUMPY, NUMBA):
            st = _tile(dtype, n, cols)
            kernels.mask_outside(st, lo, hi)
            results.append(st)
        assert np.array_equal(results[0], results[1])
        keys = np.arange(n)[:, None]
        assert np.array_equal(np.isinf(results[1]), (keys < lo) | (keys >= hi))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mask_where_agrees_in_every_layout(dtype):
    """keep as a mask's rows (a strided view), transposed (the block mask's repeats) and whole."""
    rs = np.random.default_rng(8)
    for n, cols in ((40, 9), (5, 30), (1, 1), (70, 33)):
        whole = rs.random((2 * cols + 3, 3 * n + 1)) < 0.8
        for keep in (whole[1 : 1 + cols, 2 : 2 + n], np.asfortranarray(whole[:cols, :n]), whole[:cols, :n].copy()):
            results = []
            for kernels in (NUMPY, NUMBA):
                st = _tile(dtype, n, cols)
                kernels.mask_where(st, keep)
                results.append(st)
            assert np.array_equal(results[0], results[1])
            assert np.array_equal(np.isneginf(results[1]), ~keep.T)  # the tile holds finite scores


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_bias_agrees_in_every_layout(dtype):
    """A bias tile as a strided view, transposed, whole or 16-bit, into a tile and into a column
    slice of one (stacked heads): NumPy's two roundings against Numba's fused product and sum."""
    rs = np.random.default_rng(9)
    for n, cols in ((40, 9), (5, 30), (1, 1), (70, 33)):
        whole = rs.standard_normal((2 * cols + 3, 3 * n + 1))
        for bias in (whole[1 : 1 + cols, 2 : 2 + n].astype(dtype), np.asfortranarray(whole[:cols, :n]),
                     whole[:cols, :n].astype(np.float16)):
            results = []
            for kernels in (NUMPY, NUMBA):
                st = _tile(dtype, n, 2 * cols)
                kernels.add_bias(st[:, cols:], bias, cpu_kernels.LOG2E)
                results.append(st)
                assert np.array_equal(st[:, :cols], _tile(dtype, n, 2 * cols)[:, :cols])  # the other head's
            scale = np.abs(results[0]).max()
            np.testing.assert_allclose(results[1], results[0], rtol=0, atol=4 * np.finfo(dtype).eps * scale)
            added = results[0][:, cols:] - _tile(dtype, n, 2 * cols)[:, cols:]
            expected = bias.T.astype(np.float64) * cpu_kernels.LOG2E
            np.testing.assert_allclose(added, expected, rtol=0, atol=8 * np.finfo(dtype).eps * scale)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_alibi_agrees(dtype):
    """ALiBi's term, each query its slope (stacked heads: several) and its diagonal key, some
    inside the tile, some before or past it."""
    rs = np.random.default_rng(10)
    for n, cols in ((40, 9), (5, 30), (1, 1), (700, 33)):
        slopes = rs.uniform(0.001, 0.5, cols) * cpu_kernels.LOG2E
        diagonals = rs.integers(-2 * n, 3 * n, cols)
        results = []
        for kernels in (NUMPY, NUMBA):
            st = _tile(dtype, n, cols)
            kernels.add_alibi(st, slopes, diagonals)
            results.append(st)
        dist = np.abs(diagonals[None, :] - np.arange(n)[:, None])
        expected = _tile(dtype, n, cols).astype(np.float64) - slopes * dist
        atol = 4 * np.finfo(dtype).eps * np.abs(expected).max()  # float64: Numba fuses the product
        for result in results:
            np.testing.assert_allclose(result, expected, rtol=0, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_finish_agrees_and_zeroes_masked_rows(dtype):
    rs = np.random.default_rng(7)
    o = rs.standard_normal((6, 5)).astype(dtype)
    o[1] = np.nan  # a masked row whose p @ v met inf: still out 0
    m = rs.standard_normal(6).astype(dtype)
    l = rs.random(6).astype(dtype) + 0.5
    l[1] = 0
    l[3] = np.nan
    results = []
    for kernels in (NUMPY, NUMBA):
        out, lse = np.empty_like(o), np.empty(6, dtype)
        kernels.finish(o, m, l, lse, out)
        results.append((out, lse))
    (out0, lse0), (out1, lse1) = results
    assert np.all(out1[1] == 0) and lse1[1] == -np.inf and np.all(np.isnan(out1[3])) and np.isnan(lse1[3])
    np.testing.assert_allclose(out1, out0, rtol=1e-6)
    np.testing.assert_allclose(lse1, lse0, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "seed, offset, bh, i0, j0, n, cols, p",
    [
        (0, 0, 0, 0, 0, 16, 8, 0.5),
        (2**63 + 5, 2**32 - 1, 77, 13, 5, 37, 19, 0.17),  # a key not at a multiple of 4, both seed words
        (2**64 - 1, 7, 2**31 - 1, 10**6, 1021, 1, 3, 0.9),
        (12345, 3, 4, 2, 2, 2, 1, 0.999),
    ],
)
def test_dropout_bits_are_rng_s(dtype, seed, offset, bh, i0, j0, n, cols, p):
    """The compiled Philox gives flashcupy.rng's keep mask bit for bit, scaled by 1 / (1 - p)."""
    z = np.empty((n, cols), dtype)
    NUMBA.dropout_scale(z, seed, offset, bh, i0, j0, p)
    keep = rng.dropout_keep(seed, offset, bh, np.arange(i0, i0 + cols)[:, None], np.arange(j0, j0 + n)[None, :], p)
    assert np.array_equal(z, np.where(keep.T, dtype(1 / (1 - p)), 0).astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_leaping_query_is_recomputed_alone(dtype):
    """Through the backend: a query whose score leaps by 2^60+ in a later tile matches the
    reference, and every other query is bitwise what it is without the leap."""
    import flashcupy as fc
    from support import cpu_tiles

    rs = np.random.default_rng(8)
    q, k, v = (rs.standard_normal((40, 16)).astype(dtype) for _ in range(3))
    bias = np.zeros((40, 40), dtype)
    leap = bias.copy()
    leap[3, 25] = 150.0  # 216 in base 2: past the shift query 3 took from its first tile
    with cpu_tiles((8, 8)):
        plain = fc.flash_attention(q, k, v, bias=bias, backend="cpu")
        out, lse = fc.flash_attention(q, k, v, bias=leap, return_lse=True, backend="cpu")
    ref_out, ref_lse = fc.attention_reference(q, k, v, bias=leap, return_lse=True)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-6)
    others = np.arange(40) != 3
    assert np.array_equal(out[others], plain[others])


@pytest.mark.parametrize("causal", [False, True])
def test_alibi_forward_recomputes_no_query_alone(causal):
    """ALiBi's scores climb by slope x distance toward each row's diagonal key, far past the
    lazy shift's headroom: the forward takes the tile around the diagonals first, its shift
    exactly, so no query leaves the vectorised step (taken in order, every one did, 5-10x the
    time), and the result is the reference's."""
    rs = np.random.default_rng(11)
    q, k, v = (rs.standard_normal((1, 2, 2048, 16)).astype(np.float32) for _ in range(3))
    slopes = np.array([0.5, 0.03], np.float32)
    recomputed = []

    class Counting:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def forward_tile(self, st, m, l, alpha, scratch, damaged, exact):
            count = self.inner.forward_tile(st, m, l, alpha, scratch, damaged, exact)
            recomputed.append(count)
            return count

    with mock.patch.object(cpu_kernels, "kernels", lambda jit=None: Counting(NUMBA)):
        out = fc.flash_attention(q, k, v, alibi_slopes=slopes, causal=causal, backend="cpu")
    assert len(recomputed) > 1 and sum(recomputed) == 0
    assert_attention_close(out, q, k, v, alibi_slopes=slopes, causal=causal)
