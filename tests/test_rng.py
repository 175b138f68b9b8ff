"""Tests for flashcupy.rng: Philox4x32-10 and the dropout keep mask."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flashcupy as fc
from flashcupy import rng
from flashcupy.rng import (
    dropout_keep,
    dropout_mask,
    dropout_threshold,
    new_seed,
    philox4x32_10,
)

MASK32 = 0xFFFFFFFF
u32 = st.integers(min_value=0, max_value=MASK32)
u64 = st.integers(min_value=0, max_value=2**64 - 1)

# Known-answer vectors for philox4x32 with 10 rounds, copied from Random123's
# own test file: repository DEShawResearch/random123, path tests/kat_vectors
# (lines 27-29 at commit 9545ff6413f258be2f04c1d319d99aaef7521150), format
# "philox4x32 10 CTR[4] KEY[2] EXPECTED[4]".
KAT_VECTORS = [
    (
        (0x00000000, 0x00000000, 0x00000000, 0x00000000),
        (0x00000000, 0x00000000),
        (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8),
    ),
    (
        (0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF),
        (0xFFFFFFFF, 0xFFFFFFFF),
        (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
    ),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def ref_philox(ctr: tuple[int, ...], key: tuple[int, int]) -> tuple[int, ...]:
    """Scalar Philox4x32-10 on plain Python ints (independent reference)."""
    x0, x1, x2, x3 = ctr
    k0, k1 = key
    for rnd in range(10):
        if rnd > 0:
            k0 = (k0 + 0x9E3779B9) & MASK32
            k1 = (k1 + 0xBB67AE85) & MASK32
        prod_a = 0xD2511F53 * x0
        prod_b = 0xCD9E8D57 * x2
        x0, x1, x2, x3 = (
            (prod_b >> 32) ^ x1 ^ k0,
            prod_b & MASK32,
            (prod_a >> 32) ^ x3 ^ k1,
            prod_a & MASK32,
        )
    return x0, x1, x2, x3


def ref_keep(seed: int, offset: int, bh: int, i: int, j: int, p: float) -> bool:
    """Scalar restatement of the dropout contract."""
    t = min(round(p * 2**16), 2**16 - 1)
    words = ref_philox((j >> 3, i, bh, offset), (seed & MASK32, seed >> 32))
    return (words[(j >> 1) & 3] >> (16 * (j & 1))) & 0xFFFF >= t


# --------------------------------------------------------------------------
# Philox
# --------------------------------------------------------------------------


@pytest.mark.parametrize("ctr,key,expected", KAT_VECTORS)
def test_philox_known_answers(ctr, key, expected):
    out = philox4x32_10(ctr, key)
    assert len(out) == 4
    assert all(isinstance(w, np.ndarray) for w in out)
    assert all(w.dtype == np.uint32 and w.shape == () for w in out)
    assert tuple(int(w) for w in out) == expected
    assert ref_philox(ctr, key) == expected


def test_philox_known_answers_vectorised():
    ctr = [np.array([v[0][n] for v in KAT_VECTORS], dtype=np.uint32) for n in range(4)]
    key = [np.array([v[1][n] for v in KAT_VECTORS], dtype=np.uint32) for n in range(2)]
    out = philox4x32_10(ctr, key)
    for n in range(4):
        assert out[n].tolist() == [v[2][n] for v in KAT_VECTORS]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(u32, u32, u32, u32, u32, u32), min_size=1, max_size=16)
)
def test_philox_matches_scalar_reference(rows):
    cols = [np.array([r[n] for r in rows], dtype=np.uint64) for n in range(6)]
    out = philox4x32_10(cols[:4], cols[4:])
    for idx, r in enumerate(rows):
        got = tuple(int(w[idx]) for w in out)
        assert got == ref_philox(r[:4], r[4:])


@settings(max_examples=30, deadline=None)
@given(u32, u32, u32, u32)
def test_philox_broadcasting(c3, k0, k1, base):
    c0 = (np.arange(5, dtype=np.int64) + base) & MASK32
    c1 = np.arange(3, dtype=np.uint32).reshape(3, 1)
    out = philox4x32_10((c0, c1, 7, c3), (k0, k1))
    assert all(w.shape == (3, 5) and w.dtype == np.uint32 for w in out)
    for a in range(3):
        for b in range(5):
            expected = ref_philox((int(c0[b]), a, 7, c3), (k0, k1))
            assert tuple(int(w[a, b]) for w in out) == expected


def test_philox_output_is_writable_full_shape():
    out = philox4x32_10((np.arange(4), 0, 0, 0), (np.zeros((2, 1), np.uint32), 0))
    for w in out:
        assert w.shape == (2, 4)
        w[...] = 0


@pytest.mark.parametrize(
    "counter,key,exc",
    [
        ((0, 0, 0), (0, 0), ValueError),
        ((0, 0, 0, 0), (0,), ValueError),
        ((0, 0, -1, 0), (0, 0), ValueError),
        ((0, 0, 0, 2**32), (0, 0), ValueError),
        ((0.5, 0, 0, 0), (0, 0), TypeError),
        ((0, 0, 0, 0), (0, np.array([1.0])), TypeError),
    ],
)
def test_philox_rejects_bad_words(counter, key, exc):
    with pytest.raises(exc):
        philox4x32_10(counter, key)


# --------------------------------------------------------------------------
# dropout_threshold
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "p,t",
    [
        (0.0, 0),
        (0.5, 2**15),
        (0.25, 2**14),
        (0.1, round(0.1 * 2**16)),
        (2**-18, 0),  # below the resolution: nothing is dropped
        (1.0 - 2**-20, 2**16 - 1),
        (np.float32(0.5), 2**15),
        (0, 0),
    ],
)
def test_dropout_threshold(p, t):
    assert dropout_threshold(p) == t


@pytest.mark.parametrize(
    "p,exc",
    [
        (-0.1, ValueError),
        (1.0, ValueError),
        (1.5, ValueError),
        (float("nan"), ValueError),
        ("0.1", TypeError),
        (None, TypeError),
        (True, TypeError),
    ],
)
def test_dropout_threshold_rejects(p, exc):
    with pytest.raises(exc, match="dropout_p") as info:
        dropout_threshold(p)
    assert repr(p) in str(info.value) or type(p).__name__ in str(info.value)


# --------------------------------------------------------------------------
# dropout_mask / dropout_keep
# --------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.05, 0.1, 0.3, 0.5, 0.9])
def test_keep_rate_within_binomial_bounds(p):
    mask = dropout_mask((2, 3, 64, 160), p, seed=12345, offset=7)
    n = mask.size
    kept = int(mask.sum())
    mean = n * (1 - p)
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(kept - mean) <= 5 * sigma
    # Every 16-bit half (j & 7) on its own must also be unbiased.
    for half in range(8):
        sub = mask[..., half::8]
        m = sub.size
        assert abs(int(sub.sum()) - m * (1 - p)) <= 5 * math.sqrt(m * p * (1 - p))


def test_p_zero_keeps_everything():
    mask = dropout_mask((3, 2, 17, 33), 0.0, seed=2**64 - 1, offset=2**32 - 1)
    assert mask.dtype == np.bool_ and mask.shape == (3, 2, 17, 33)
    assert mask.all()


def test_deterministic_for_fixed_arguments():
    a = dropout_mask((2, 4, 31, 45), 0.3, seed=99, offset=5)
    b = dropout_mask((2, 4, 31, 45), 0.3, seed=99, offset=5)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "other",
    [
        dict(seed=100, offset=5),
        dict(seed=99, offset=6),
        dict(seed=99 + 2**32, offset=5),  # differs only in the key's high word
    ],
)
def test_seed_and_offset_change_the_mask(other):
    base = dropout_mask((2, 4, 31, 45), 0.3, seed=99, offset=5)
    changed = dropout_mask((2, 4, 31, 45), 0.3, **other)
    frac = np.mean(base != changed)
    # Independent masks with keep prob 0.7 disagree on 2 * 0.7 * 0.3 = 42%.
    assert 0.35 < frac < 0.49


@settings(max_examples=25, deadline=None)
@given(
    seed=st.one_of(u64, st.integers(min_value=2**32, max_value=2**64 - 1)),
    offset=u32,
    p=st.floats(min_value=0.0, max_value=0.95),
    data=st.data(),
)
def test_mask_elements_match_dropout_keep_and_reference(seed, offset, p, data):
    shape = (2, 3, 9, 22)
    mask = dropout_mask(shape, p, seed, offset)
    idx = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, 1),
                st.integers(0, 2),
                st.integers(0, 8),
                st.integers(0, 21),
            ),
            min_size=1,
            max_size=12,
        )
    )
    for a, h, i, j in idx:
        bh = a * 3 + h
        expected = ref_keep(seed, offset, bh, i, j, p)
        assert bool(mask[a, h, i, j]) == expected
        assert bool(dropout_keep(seed, offset, bh, i, j, p)) == expected


def test_full_mask_matches_reference_high_seed():
    seed, offset, p = 0xDEADBEEF_12345677, 3, 0.4
    shape = (2, 5, 7)
    mask = dropout_mask(shape, p, seed, offset)
    for bh in range(2):
        for i in range(5):
            for j in range(7):
                assert bool(mask[bh, i, j]) == ref_keep(seed, offset, bh, i, j, p)


def test_two_dim_shape_uses_bh_zero():
    seed, offset, p = 2**40 + 17, 11, 0.5
    mask = dropout_mask((13, 29), p, seed, offset)
    assert mask.shape == (13, 29)
    i = np.arange(13).reshape(-1, 1)
    j = np.arange(29).reshape(1, -1)
    np.testing.assert_array_equal(mask, dropout_keep(seed, offset, 0, i, j, p))
    np.testing.assert_array_equal(mask, dropout_mask((1, 13, 29), p, seed, offset)[0])


def test_leading_dims_flatten_in_c_order():
    seed, offset, p = 7, 0, 0.25
    mask = dropout_mask((2, 3, 4, 5, 6), p, seed, offset)
    flat = dropout_mask((24, 5, 6), p, seed, offset)
    np.testing.assert_array_equal(mask.reshape(24, 5, 6), flat)
    i = np.arange(5).reshape(-1, 1)
    j = np.arange(6).reshape(1, -1)
    bh = (1 * 3 + 2) * 4 + 3
    expected = dropout_keep(seed, offset, bh, i, j, p)
    np.testing.assert_array_equal(mask[1, 2, 3], expected)


@pytest.mark.parametrize(
    "shape", [(0, 5), (5, 0), (0, 0), (2, 3, 0, 4), (2, 3, 4, 0), (0, 3, 4, 5)]
)
def test_empty_shapes(shape):
    mask = dropout_mask(shape, 0.5, seed=1)
    assert mask.shape == shape and mask.dtype == np.bool_ and mask.size == 0


def test_chunked_equals_unchunked(monkeypatch):
    shape, p, seed, offset = (3, 2, 11, 37), 0.3, 2**50 + 3, 9
    whole = dropout_mask(shape, p, seed, offset)
    monkeypatch.setattr(rng, "_CHUNK_ELEMS", 100)  # forces row chunks
    np.testing.assert_array_equal(dropout_mask(shape, p, seed, offset), whole)
    monkeypatch.setattr(rng, "_CHUNK_ELEMS", 11 * 37 * 2)  # several bh per chunk
    np.testing.assert_array_equal(dropout_mask(shape, p, seed, offset), whole)


def _ref_grid(seed, offset, bh, i, j, p):
    b = np.broadcast(np.asarray(bh), np.asarray(i), np.asarray(j))
    flat = [ref_keep(seed, offset, int(x), int(y), int(z), p) for x, y, z in b]
    return np.array(flat, dtype=bool).reshape(b.shape)


@pytest.mark.parametrize(
    "i,j",
    [
        (np.arange(4).reshape(-1, 1), np.arange(3, 30).reshape(1, -1)),  # odd start
        (np.arange(4).reshape(-1, 1), np.arange(6, 7).reshape(1, -1)),  # one column
        (np.arange(4).reshape(-1, 1), np.array([[9, 2, 2, 31, 0, 5, 4]])),  # arbitrary
        (np.arange(5).reshape(1, -1), np.arange(3, 9).reshape(-1, 1)),  # transposed
        (np.array([3, 1, 4, 1, 5]), np.array([2, 7, 1, 8, 2])),  # elementwise
        (2, np.arange(13)),  # 1-D row
        (np.arange(3).reshape(3, 1), np.arange(2**35 - 6, 2**35)),  # near j limit
    ],
)
def test_dropout_keep_arbitrary_indices(i, j):
    seed, offset, p, bh = 2**63 + 12345, 77, 0.45, 5
    got = dropout_keep(seed, offset, bh, i, j, p)
    expected = _ref_grid(seed, offset, bh, i, j, p)
    assert got.shape == expected.shape and got.dtype == np.bool_
    np.testing.assert_array_equal(got, expected)


def test_dropout_keep_contiguous_and_generic_paths_agree():
    seed, offset, p = 31337, 2, 0.5
    i = np.arange(6).reshape(-1, 1)
    j = np.arange(5, 70)
    fast = dropout_keep(seed, offset, 3, i, j.reshape(1, -1), p)
    perm = np.random.default_rng(0).permutation(j.size)
    slow = dropout_keep(seed, offset, 3, i, j[perm].reshape(1, -1), p)
    np.testing.assert_array_equal(fast[:, perm], slow)


def test_numpy_integer_arguments_accepted():
    shape = (np.int64(2), np.int32(5), np.uint16(9))
    a = dropout_mask(shape, np.float64(0.2), np.uint64(2**63), np.uint32(4))
    b = dropout_mask((2, 5, 9), 0.2, 2**63, 4)
    np.testing.assert_array_equal(a, b)


def test_new_seed():
    seeds = {new_seed() for _ in range(8)}
    assert all(isinstance(s, int) and 0 <= s < 2**64 for s in seeds)
    assert len(seeds) > 1
    mask = dropout_mask((4, 8), 0.5, new_seed())
    assert mask.shape == (4, 8)


GOOD = dict(shape=(2, 3, 4), p=0.1, seed=1, offset=0)


@pytest.mark.parametrize(
    "name,value,exc",
    [
        ("shape", 5, TypeError),
        ("shape", None, TypeError),
        ("shape", (4,), ValueError),
        ("shape", (), ValueError),
        ("shape", (2, -1), ValueError),
        ("shape", (2, 3.0), TypeError),
        ("shape", (2, True), TypeError),
        ("shape", ("a", "b"), TypeError),
        ("p", -0.01, ValueError),
        ("p", 1.0, ValueError),
        ("p", float("nan"), ValueError),
        ("p", "0.5", TypeError),
        ("seed", -1, ValueError),
        ("seed", 2**64, ValueError),
        ("seed", 1.0, TypeError),
        ("seed", True, TypeError),
        ("seed", None, TypeError),
        ("seed", "1", TypeError),
        ("offset", -1, ValueError),
        ("offset", 2**32, ValueError),
        ("offset", 2.0, TypeError),
        ("offset", False, TypeError),
    ],
)
def test_dropout_mask_rejects_invalid_arguments(name, value, exc):
    kwargs = dict(GOOD, **{name: value})
    arg_name = "dropout_p" if name == "p" else name
    with pytest.raises(exc, match=arg_name):
        dropout_mask(**kwargs)


@pytest.mark.parametrize(
    "kwargs,exc,name",
    [
        (dict(seed=-1), ValueError, "seed"),
        (dict(seed=1.5), TypeError, "seed"),
        (dict(offset=2**32), ValueError, "offset"),
        (dict(p=1.0), ValueError, "dropout_p"),
        (dict(bh=-1), ValueError, "bh"),
        (dict(i=np.array([2**32])), ValueError, "i"),
        (dict(j=np.array([0.0])), TypeError, "j"),
        (dict(j=np.array([-3])), ValueError, "j"),
    ],
)
def test_dropout_keep_rejects_invalid_arguments(kwargs, exc, name):
    args = dict(
        seed=1, offset=0, bh=0, i=np.arange(3)[:, None], j=np.arange(4), p=0.1
    )
    args.update(kwargs)
    with pytest.raises(exc, match=rf"\b{name}\b"):
        dropout_keep(**args)


def _dropout_call(xp, backend, **dropout):
    """out and (dq, dk, dv) of one dropout call on ``xp`` arrays through flash_attention_vjp."""
    rs = np.random.default_rng(9)
    q, k, v = (xp.asarray(rs.standard_normal((2, 3, 45, 16)).astype(np.float32)) for _ in range(3))
    out, vjp = fc.flash_attention_vjp(q, k, v, dropout_p=0.3, backend=backend, **dropout)
    return (out, *vjp(xp.ones_like(out)))


@pytest.mark.parametrize("state, seed, offset", [((2**40 + 3, 11), 2**40 + 3, 11),
                                                 ((-1, 2**32 + 6), 2**64 - 1, 6)])
def test_rng_state_is_seed_and_offset(state, seed, offset):
    """rng_state (seed, offset) gives the bits of seed mod 2**64 and offset mod 2**32: the
    CPU backend's forward and gradients, and the reference, equal those of seed and
    dropout_offset."""
    dtype = np.uint64 if state[0] >= 0 else np.int64
    got = _dropout_call(np, "cpu", rng_state=np.array(state, dtype=dtype))
    want = _dropout_call(np, "cpu", seed=seed, dropout_offset=offset)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    rs = np.random.default_rng(9)
    q, k, v = (rs.standard_normal((2, 3, 45, 16)) for _ in range(3))
    np.testing.assert_array_equal(fc.attention_reference(q, k, v, dropout_p=0.3, rng_state=np.array(state, dtype)),
                                  fc.attention_reference(q, k, v, dropout_p=0.3, seed=seed, dropout_offset=offset))


@pytest.mark.parametrize("state, extra, exc, match", [
    (np.array([1, 2], np.int32), {}, TypeError, "int64 or uint64"),
    (np.array([1.0, 2.0]), {}, TypeError, "int64 or uint64"),
    (np.array([1, 2, 3], np.int64), {}, ValueError, "shape \\(2,\\)"),
    (np.arange(4, dtype=np.int64)[::2], {}, ValueError, "contiguous"),
    ("seed", {}, TypeError, "rng_state: expected an array"),
    (np.array([1, 2], np.int64), {"seed": 3}, ValueError, "seed=None and dropout_offset=0"),
    (np.array([1, 2], np.int64), {"dropout_offset": 1}, ValueError, "seed=None and dropout_offset=0"),
])
def test_bad_rng_state_names_itself(state, extra, exc, match):
    q = np.ones((1, 4, 8), np.float32)
    with pytest.raises(exc, match=match):
        fc.flash_attention(q, q, q, dropout_p=0.5, rng_state=state, **extra)


@pytest.mark.gpu
def test_device_rng_state_is_read_when_the_kernels_run():
    """On the GPU: a CuPy rng_state gives the bits of its values (forward and gradients,
    bitwise), and a captured forward replays with the values written into it since."""
    import cupy

    state = cupy.asarray(np.array([2**40 + 3, 11], np.int64))
    got = _dropout_call(cupy, "cuda", rng_state=state)
    want = _dropout_call(cupy, "cuda", seed=2**40 + 3, dropout_offset=11)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a.get(), b.get())
    rs = np.random.default_rng(10)
    q, k, v = (cupy.asarray(rs.standard_normal((2, 4, 70, 64)).astype(np.float16)) for _ in range(3))
    call = lambda: fc.flash_attention(q, k, v, dropout_p=0.2, rng_state=state)  # noqa: E731
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        call()  # compiled and cached before the capture
        stream.begin_capture()
        out = call()
        graph = stream.end_capture()
        for offset in (5, 6):
            state[1] = offset
            graph.launch()
            want = fc.flash_attention(q, k, v, dropout_p=0.2, seed=2**40 + 3, dropout_offset=offset)
            np.testing.assert_array_equal(out.get(), want.get())


def test_vjp_keeps_the_forwards_rng_state():
    """flash_attention_vjp copies rng_state after its forward: values written into the array
    before vjp(dout) change nothing; explain and the testing assertions take rng_state too."""
    from flashcupy.testing import assert_attention_close

    rs = np.random.default_rng(4)
    q, k, v = (rs.standard_normal((2, 3, 30, 16)).astype(np.float32) for _ in range(3))
    state = np.array([77, 5], np.int64)
    out, vjp = fc.flash_attention_vjp(q, k, v, dropout_p=0.3, rng_state=state)
    state[:] = (1, 2)
    got = vjp(np.ones_like(out))
    _, want_vjp = fc.flash_attention_vjp(q, k, v, dropout_p=0.3, seed=77, dropout_offset=5)
    for a, b in zip(got, want_vjp(np.ones_like(out)), strict=True):
        np.testing.assert_array_equal(a, b)
    state[:] = (77, 5)
    assert_attention_close(out, q, k, v, dropout_p=0.3, rng_state=state)
    assert fc.explain(q, k, v, arch=90, dropout_p=0.3, rng_state=state)
