"""Fuzzing: garbage arguments through every public function, extreme but valid values, and
how far a NaN or Inf in an input travels.

(a) Garbage of every kind (wrong types, shapes, dtypes, ranges; lists, tuples, None,
    strings, objects, nested garbage, NumPy object arrays), several arguments at once,
    through every public function: only TypeError or ValueError (or a result), never another
    exception, a crash or a hang (Hypothesis deadline 2 s an example).
(b) Extreme valid values (float16 scores near 6e4, scale 1e4 and 1e-8, L = 1, D = 1, one key
    per row, tiny and huge softcap): out and lse finite, out inside the range of v, gradients
    finite wherever the float64 reference gradient fits the dtype.
(c) NaN/Inf: exactly what README's "Design decisions" NaN paragraph states.

Each runs on the CPU backend (CI) and, marked ``gpu``, with backend="cuda" on CuPy arrays.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import flashcupy as fc
from flashcupy import interop, reference
from flashcupy.problem import make_host_problem
from flashcupy.testing import DTYPES, attention_problems

F16, BF16, F64 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float64)
DTYPE_NAMES = tuple(DTYPES)

GPU = interop.gpu_usable()  # also imports CuPy now, not inside a timed example
FUZZ = settings(deadline=2000, suppress_health_check=[HealthCheck.too_slow])
GPU_FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])  # first calls compile kernels

_RS = np.random.default_rng(7)
Q = _RS.standard_normal((2, 2, 3, 4)).astype(np.float32)
K = _RS.standard_normal((2, 1, 5, 4)).astype(np.float32)
V = _RS.standard_normal((2, 1, 5, 3)).astype(np.float32)


# --------------------------------------------------------------------------- (a) garbage


class _Opaque:
    """An object no argument should accept."""

    def __repr__(self) -> str:
        return "<opaque>"


class _LiesAboutShape:
    """Looks array-like (shape, dtype, ndim) but is not."""

    shape = (2, 2, 3, 4)
    dtype = np.dtype(np.float32)
    ndim = 4

    def __repr__(self) -> str:
        return "<fake array>"


def _object_array(draw_items: list) -> np.ndarray:
    arr = np.empty(len(draw_items), dtype=object)
    arr[:] = draw_items
    return arr


_small_shapes = hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=4)
_numeric = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(-3, 8), st.floats(), st.complex_numbers(),
    st.text(max_size=6), st.binary(max_size=4), st.just(_Opaque()), st.just(_LiesAboutShape()),
    st.just(Ellipsis), st.just(slice(None)), st.just(np.float32), st.just(float("nan")),
    st.sampled_from([np.int64(2**63 - 1), np.uint64(2**64 - 1), np.float16(65504), np.bool_(True)]),
    st.sampled_from(["cpu", "cuda", "auto", "top_left", "bottom_right", ""]),
)
_arrays = st.one_of(
    hnp.arrays(st.one_of(hnp.scalar_dtypes(), hnp.unicode_string_dtypes(max_len=2)), _small_shapes),
    hnp.arrays(np.float32, _small_shapes).map(lambda a: a.astype(ml_dtypes.bfloat16)),
    hnp.arrays(np.bool_, hnp.broadcastable_shapes((2, 2, 3, 5), max_side=5)),
    hnp.arrays(np.int32, hnp.array_shapes(max_dims=2, max_side=4), elements=st.integers(-1, 6)),
    st.lists(_numeric, max_size=3).map(_object_array),
    st.sampled_from([Q, K, V, Q.astype(np.float64), Q[..., :2], Q.T, Q[0], K.astype(np.float16)]),
)
GARBAGE = st.recursive(
    st.one_of(_numeric, _arrays),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=2), inner, max_size=2),
    ),
    max_leaves=6,
)

OPTIONS = [
    "causal", "scale", "window", "mask", "bias", "alibi_slopes", "softcap", "q_lengths", "kv_lengths",
    "block_mask", "block_size", "dropout_p", "seed", "dropout_offset", "return_lse", "allow_tf32",
]
ENTRIES = ["flash_attention", "forward", "backward", "vjp", "vjp_call", "varlen", "reference", "dropout_mask"]


def _call(entry: str, args: dict[str, Any], options: dict[str, Any], extra: dict[str, Any]):
    q, k, v = args["q"], args["k"], args["v"]
    if entry == "flash_attention":
        return fc.flash_attention(q, k, v, **options)
    if entry == "forward":
        return fc.flash_attention_forward(q, k, v, **options)
    if entry == "backward":
        return fc.flash_attention_backward(extra["dout"], q, k, v, extra["out"], extra["lse"],
                                           bias_grad=extra["bias_grad"], deterministic=extra["deterministic"],
                                           **options)
    if entry == "vjp":
        return fc.flash_attention_vjp(q, k, v, **options)
    if entry == "vjp_call":
        _, vjp = fc.flash_attention_vjp(Q, K, V, backend=options.get("backend", "cpu"))
        return vjp(extra["dout"])
    if entry == "varlen":
        return fc.flash_attention_varlen(q, k, v, extra["cu_q"], extra["cu_k"], **options)
    if entry == "reference":
        options = {n: x for n, x in options.items() if n != "backend"}
        return fc.attention_reference(q, k, v, **options)
    return fc.dropout_mask(extra["shape"], extra["p"], extra["seed"], extra["offset"])


@st.composite
def garbage_calls(draw, xp=np):
    """(entry, args, options, extra): a public function and its arguments, some of them garbage."""
    entry = draw(st.sampled_from(ENTRIES))
    args: dict[str, Any] = {"q": Q, "k": K, "v": V}
    for name in draw(st.sets(st.sampled_from(["q", "k", "v"]), max_size=3)):
        args[name] = draw(GARBAGE)
    options: dict[str, Any] = {}
    for name in draw(st.lists(st.sampled_from(OPTIONS), max_size=4, unique=True)):
        options[name] = draw(GARBAGE)
    if draw(st.integers(0, 5)) == 0:
        options[draw(st.sampled_from(["backend", "not_an_option", "Causal"]))] = draw(GARBAGE)
    out = np.zeros((2, 2, 3, 3), np.float32)
    extra = {
        "dout": out, "out": out, "lse": np.zeros((2, 2, 3), np.float32), "bias_grad": False,
        "deterministic": False, "cu_q": np.array([0, 3], np.int32), "cu_k": np.array([0, 5], np.int32),
        "shape": (1, 2, 3), "p": 0.5, "seed": 1, "offset": 0,
    }
    for name in draw(st.sets(st.sampled_from(sorted(extra)), max_size=3)):
        extra[name] = draw(GARBAGE | st.integers(10**5, 10**12).map(lambda n: (n, n)))
    if xp is not np:
        args = {n: _to(xp, x) for n, x in args.items()}
        options = {n: _to(xp, x) if n in ("mask", "bias", "block_mask") else x for n, x in options.items()}
        extra = {n: _to(xp, x) if n in ("dout", "out", "lse") else x for n, x in extra.items()}
    return entry, args, options, extra


def _to(xp, x):
    """A CuPy copy of a plausible numeric NumPy array; anything else unchanged."""
    if isinstance(x, np.ndarray) and x.dtype.kind in "biuf" and x.dtype != BF16:
        return xp.asarray(x)
    return x


def _expect_clean_rejection(entry, args, options, extra, backend: str):
    options = {"backend": backend, **options}
    try:
        _call(entry, args, options, extra)
    except (TypeError, ValueError):
        pass
    except RuntimeError as exc:  # only the documented "backend='cuda' without a GPU"
        assert options.get("backend") == "cuda" and not GPU, repr(exc)
    except MemoryError:
        # dropout_mask of a shape that is valid but too large to hold: NumPy's own error
        assert entry == "dropout_mask", "MemoryError outside dropout_mask"


@FUZZ
@given(call=garbage_calls())
@example(call=("dropout_mask", {"q": Q, "k": K, "v": V}, {}, {
    "dout": None, "out": None, "lse": None, "bias_grad": False, "deterministic": False, "cu_q": None,
    "cu_k": None, "shape": [[1, 2], 3], "p": 0.5, "seed": 1, "offset": 0}))
def test_garbage_cpu(call):
    _expect_clean_rejection(*call, backend="cpu")


@pytest.mark.gpu
@GPU_FUZZ
@given(data=st.data())
def test_garbage_cuda(data):
    import cupy

    _expect_clean_rejection(*data.draw(garbage_calls(cupy)), backend="cuda")


@pytest.mark.gpu
def test_arrays_on_another_device_or_host_mix():
    """CuPy arrays on two devices, or CuPy mixed with lists: a TypeError/ValueError, not a crash."""
    import cupy

    q = cupy.asarray(Q)
    for k, v in ((K.tolist(), cupy.asarray(V)), (cupy.asarray(K), "v")):
        with pytest.raises((TypeError, ValueError)):
            fc.flash_attention(q, k, v, backend="cuda")
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("one GPU: no second device to mix")
    with cupy.cuda.Device(1):
        k1, v1 = cupy.asarray(K), cupy.asarray(V)
    try:
        out = fc.flash_attention(q, k1, v1, backend="cuda")
    except (TypeError, ValueError):
        return
    np.testing.assert_allclose(cupy.asnumpy(out), fc.attention_reference(Q, K, V), atol=1e-4)


# --------------------------------------------------------------------------- (b) extreme values


#: Shapes of the extreme and poisoned problems: D as in the kernels' smallest and usual tiles.
FUZZ_HEAD_DIMS = (1, 8, 40, 64)


@st.composite
def extreme_cases(draw):
    """(q, k, v, dout, options): valid inputs at the edges of the dtypes and options, made from a
    public attention problem (shapes, GQA, Dv) whose values are pushed to the edge."""
    kind = draw(st.sampled_from(["fp16_scores", "scale_big", "scale_tiny", "one_key", "softcap", "tiny_shapes"]))
    problem = draw(attention_problems(
        dtypes=("float16",) if kind == "fp16_scores" else DTYPE_NAMES, options=("gqa", "value_dim"), max_len=70,
        head_dims=(1,) if kind == "tiny_shapes" else FUZZ_HEAD_DIMS))
    rs = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q, k, v, dout = (x.astype(np.float64) for x in (problem.q, problem.k, problem.v, problem.dout))
    d, lq, lk = q.shape[-1], q.shape[-2], k.shape[-2]
    options: dict[str, Any] = {}
    if kind == "fp16_scores":  # |q| = |k| ~ sqrt(6e4 / d) per element: q . k up to ~6e4
        mag = math.sqrt(6e4 / d)
        q, k = np.sign(q) * mag, np.sign(k) * mag
        options["scale"] = draw(st.sampled_from([1.0, None]))
    elif kind == "scale_big":
        options["scale"] = draw(st.sampled_from([1e4, -1e4]))
    elif kind == "scale_tiny":
        options["scale"] = draw(st.sampled_from([1e-8, -1e-8, 0.0]))
    elif kind == "one_key":  # exactly one key per row
        mask = np.zeros(q.shape[:-1] + (lk,), bool)
        mask[..., np.arange(lq), rs.integers(0, lk, lq)] = True
        options["mask"] = mask
    elif kind == "softcap":
        options["softcap"] = draw(st.sampled_from([1e-6, 1e-3, 1e6, 1e30]))
        q, k = q * 30, k * 30
    elif kind == "tiny_shapes":
        options["causal"] = draw(st.sampled_from([False, True]))
    v = v * draw(st.sampled_from([1.0, 100.0]))
    return tuple(x.astype(problem.dtype) for x in (q, k, v, dout)) + (options,)


def _check_extreme(q, k, v, dout, options, backend, xp):
    dev = (lambda x: xp.asarray(x)) if xp is not np else (lambda x: x)
    host = (lambda x: np.asarray(xp.asnumpy(x) if xp is not np else x, dtype=np.float64))
    dev_opts = {n: (dev(x) if n == "mask" else x) for n, x in options.items()}
    args = [dev(x) for x in (q, k, v)]
    out, lse = fc.flash_attention_forward(*args, backend=backend, **dev_opts)
    out, lse = host(out), host(lse)
    pb = make_host_problem(q, k, v, options)
    live = np.stack([np.stack([_attends(pb, b, h).any(axis=1) for h in range(q.shape[1])])
                     for b in range(q.shape[0])])
    assert np.isfinite(lse[live]).all(), "lse not finite in a row that attends a key"
    assert (lse[~live] == -np.inf).all() and not out[~live].any(), "a row with no key is not 0 / -inf"
    assert np.isfinite(out).all(), "out not finite"
    vv = v.astype(np.float64)
    lo, hi = min(vv.min(), 0.0), max(vv.max(), 0.0)
    slack = 1e-2 * max(1.0, abs(lo), abs(hi))  # out is a convex combination of v's rows
    assert (out >= lo - slack).all() and (out <= hi + slack).all(), (out.min(), out.max(), lo, hi)
    grads = fc.flash_attention_backward(dev(dout), *args, dev(out.astype(q.dtype)), dev(lse.astype(
        np.float64 if q.dtype == F64 else np.float32)), backend=backend, **dev_opts)
    ref = reference.backward(pb, dout, F64)
    big = float(np.finfo(np.float16).max if q.dtype == F16 else np.finfo(np.float32).max) / 4
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
        g = host(g)
        fits = np.abs(r) < big  # where the true gradient fits the dtype, ours must be finite
        assert np.isfinite(g[fits]).all(), f"{name}: non-finite where the reference is {np.abs(r[fits]).max()}"


def _one_key_fp16_scores():
    """Regression (H200, CUDA 13 NVRTC): 70 float16 queries of +-245 against one key of 245,
    scale 1, so scores are +-6e4 and lse < 0 on half the rows. The dK/dV kernel took the
    fast path on its 127 padding keys (a miscompiled full-tile test) and dQ came out NaN."""
    rs = np.random.default_rng(0)
    q = np.sign(rs.standard_normal((1, 2, 70, 1))) * 245
    k = np.full((1, 2, 1, 1), 245.0)
    v = rs.standard_normal((1, 2, 1, 1))
    dout = rs.standard_normal((1, 2, 70, 1))
    return tuple(x.astype(F16) for x in (q, k, v, dout)) + ({"scale": 1.0},)


@FUZZ
@given(case=extreme_cases())
@example(case=_one_key_fp16_scores())
def test_extreme_values_cpu(case):
    _check_extreme(*case, backend="cpu", xp=np)


@pytest.mark.gpu
@GPU_FUZZ
@given(case=extreme_cases())
@example(case=_one_key_fp16_scores())
def test_extreme_values_cuda(case):
    import cupy

    _check_extreme(*case, backend="cuda", xp=cupy)


# --------------------------------------------------------------------------- (c) NaN and Inf


@st.composite
def poison_cases(draw):
    """(q, k, v, options, where, value): a public attention problem with masks, causal and lengths
    (Hq = Hk, (B, H, L, D) arrays), and one element (array, b, h, position, column) to poison."""
    q, k, v, options = draw(attention_problems(DTYPE_NAMES, ("mask", "causal", "lengths"), max_len=70,
                                               head_dims=FUZZ_HEAD_DIMS[:3]))
    which = draw(st.sampled_from(["q", "k", "v"]))
    shape = {"q": q, "k": k, "v": v}[which].shape
    where = (which,) + tuple(draw(st.integers(0, n - 1)) for n in shape)
    value = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return q, k, v, options, where, value


def _attends(pb, b: int, h: int) -> np.ndarray:
    """(Lq, Lk) bool: which (row, key) pairs of batch b, query head h are kept."""
    keep = np.ones((pb.seqlen_q, pb.seqlen_k), bool)
    i = np.arange(pb.seqlen_q)[:, None]
    j = np.arange(pb.seqlen_k)[None, :]
    lq = pb.seqlen_q if pb.q_lengths is None else int(np.broadcast_to(pb.q_lengths, pb.batch)[b])
    lk = pb.seqlen_k if pb.kv_lengths is None else int(np.broadcast_to(pb.kv_lengths, pb.batch)[b])
    if pb.mask is not None:
        keep &= np.broadcast_to(np.asarray(pb.mask), pb.batch + (pb.num_heads_q, pb.seqlen_q, pb.seqlen_k))[b, h]
    if pb.causal == "top_left":
        keep &= j <= i
    elif pb.causal:
        keep &= j <= i + lk - lq
    keep &= (i < lq) & (j < lk)
    return keep


def _check_poison(q, k, v, options, where, value, backend, xp):
    which, b, h, row, col = where
    arrays = {"q": q, "k": k, "v": v}
    clean = fc.flash_attention(*(_dev(xp, x) for x in (q, k, v)), return_lse=True, backend=backend,
                               **{n: _dev(xp, x) if n == "mask" else x for n, x in options.items()})
    poisoned = arrays[which].copy()
    poisoned[b, h, row, col] = value
    arrays[which] = poisoned
    dirty = fc.flash_attention(*(_dev(xp, arrays[n]) for n in "qkv"), return_lse=True, backend=backend,
                               **{n: _dev(xp, x) if n == "mask" else x for n, x in options.items()})
    (o0, l0), (o1, l1) = ((_host(xp, o), _host(xp, lse)) for o, lse in (clean, dirty))
    pb = make_host_problem(q, k, v, options)
    other = np.ones(o0.shape[:2], bool)
    other[b, h] = False
    # other (batch, head) pairs never see the poisoned element: bitwise unchanged
    np.testing.assert_array_equal(o1[other], o0[other])
    np.testing.assert_array_equal(l1[other], l0[other])
    keep = _attends(pb, b, h)
    live = keep.any(axis=1)
    # a row that attends no key at all is exactly 0 with lse -inf, poisoned or not
    assert not o1[b, h][~live].any() and (l1[b, h][~live] == -np.inf).all()
    if which == "q":
        # stays in its row: every other row of (b, h) is unchanged
        rows = np.arange(o0.shape[2]) != row
        np.testing.assert_array_equal(o1[b, h][rows], o0[b, h][rows])
        np.testing.assert_array_equal(l1[b, h][rows], l0[b, h][rows])
        if live[row] and np.isnan(value):
            assert np.isnan(o1[b, h, row]).all() and np.isnan(l1[b, h, row])
        if live[row]:
            assert not np.isfinite(o1[b, h, row]).all() or not np.isfinite(l1[b, h, row])
    elif which == "k":
        if np.isnan(value):
            # a NaN score reaches exactly the rows that attend key `row` (masks replace scores)
            hit = keep[:, row]
            assert np.isnan(o1[b, h][hit]).all() and np.isnan(l1[b, h][hit]).all()
            np.testing.assert_array_equal(o1[b, h][~hit], o0[b, h][~hit])
            np.testing.assert_array_equal(l1[b, h][~hit], l0[b, h][~hit])
    else:
        # v: reaches every row that attends the key (column `col` of the output); lse unchanged
        hit = keep[:, row]
        assert not np.isfinite(o1[b, h][hit, col]).any()
        np.testing.assert_array_equal(l1, l0)
        # columns other than `col` are untouched (out_i,c = sum_j p_ij v_j,c)
        cols = np.arange(o0.shape[-1]) != col
        np.testing.assert_array_equal(o1[..., cols], o0[..., cols])
    if row >= (pb.seqlen_k if which != "q" else pb.seqlen_q) or not keep.any():
        return
    # keys beyond kv_len / rows beyond q_len are never read: covered by `live` and `hit` above


def _dev(xp, x):
    return x if xp is np else xp.asarray(x)


def _host(xp, x):
    return np.asarray(x if xp is np else xp.asnumpy(x), dtype=np.float64)


@FUZZ
@given(case=poison_cases())
def test_nan_inf_reach_cpu(case):
    _check_poison(*case, backend="cpu", xp=np)


@pytest.mark.gpu
@GPU_FUZZ
@given(case=poison_cases())
def test_nan_inf_reach_cuda(case):
    import cupy

    _check_poison(*case, backend="cuda", xp=cupy)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_nan_beyond_lengths_is_never_read(backend):
    """NaN in q rows >= q_len and in k, v keys >= kv_len changes nothing."""
    xp = np
    if backend == "cuda":
        import cupy as xp
    q, k, v = (np.random.default_rng(1).standard_normal(s).astype(np.float32)
               for s in ((2, 2, 9, 8), (2, 2, 11, 8), (2, 2, 11, 8)))
    lengths = {"q_lengths": np.array([5, 9]), "kv_lengths": np.array([7, 0])}
    clean = fc.flash_attention(*(_dev(xp, x) for x in (q, k, v)), backend=backend, return_lse=True, **lengths)
    q, k, v = q.copy(), k.copy(), v.copy()
    q[0, :, 5:] = np.nan
    k[0, :, 7:] = np.nan
    v[0, :, 7:] = np.inf
    dirty = fc.flash_attention(*(_dev(xp, x) for x in (q, k, v)), backend=backend, return_lse=True, **lengths)
    for a, b in zip(clean, dirty):
        np.testing.assert_array_equal(_host(xp, a), _host(xp, b))
    assert not _host(xp, dirty[0])[0, :, 5:].any() and not _host(xp, dirty[0])[1].any()
