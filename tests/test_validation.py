"""Bad input becomes a clear TypeError or ValueError, through every public function.

Every rejection is asserted with ``pytest.raises(..., match=...)`` on a message of
the form ``"<argument>: expected <what>, received <what came>"``: the argument's
name, the word "expected" and a fragment of the received value. Never a bare
assert, an IndexError or an error from deep inside NumPy. A few borderline-valid
inputs are checked to be accepted with the right result, and a Hypothesis fuzz
test throws garbage at one option at a time.

All calls use ``backend="cpu"``. Shapes are tiny: the whole file runs in seconds.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import flashcupy as fc
from flashcupy.problem import make_problem

F32 = np.dtype(np.float32)

# Default problem: batch (2,), Hq 4 over Hk 2 (GQA), Lq 5, Lk 7, D 8, Dv 6.
B, HQ, HK, LQ, LK, D, DV = 2, 4, 2, 5, 7, 8, 6
SCORES = (B, HQ, LQ, LK)


def make_qkv(batch=(B,), hq=HQ, hk=HK, lq=LQ, lk=LK, d=D, dv=DV, dtype=F32, seed=0):
    rs = np.random.default_rng(seed)
    q = rs.standard_normal(batch + (hq, lq, d)).astype(dtype)
    k = rs.standard_normal(batch + (hk, lk, d)).astype(dtype)
    v = rs.standard_normal(batch + (hk, lk, dv)).astype(dtype)
    return q, k, v


def rejects(exc: type[BaseException], name: str, received: Any):
    """``pytest.raises(exc)`` for a message "<name>: expected ..., received ...<received>..."."""
    pattern = rf"(?s)^{re.escape(name)}: expected .*{re.escape(str(received))}"
    return pytest.raises(exc, match=pattern)


# --------------------------------------------------------------------------- entry points

def _dout_out_lse(q: Any, v: Any):
    """Zero dout/out/lse of the right shapes when q and v allow it, else small placeholders."""
    try:
        out = np.zeros(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=q.dtype)
        return out, out.copy(), np.zeros(q.shape[:-1], dtype=np.float32)
    except Exception:  # q or v is the garbage under test: _prepare rejects it first
        z = np.zeros((1, 1), dtype=np.float32)
        return z, z, z[0]


def _flash(q, k, v, **o):
    return fc.flash_attention(q, k, v, **o)


def _forward(q, k, v, **o):
    return fc.flash_attention_forward(q, k, v, **o)


def _backward(q, k, v, **o):
    dout, out, lse = _dout_out_lse(q, v)
    return fc.flash_attention_backward(dout, q, k, v, out, lse, **o)


def _vjp(q, k, v, **o):
    return fc.flash_attention_vjp(q, k, v, **o)


def _reference(q, k, v, **o):
    return fc.attention_reference(q, k, v, **o)


ENTRIES: dict[str, Callable] = {
    "flash_attention": _flash,
    "forward": _forward,
    "backward": _backward,
    "vjp": _vjp,
    "reference": _reference,
}


@pytest.fixture(params=list(ENTRIES))
def call(request) -> Callable:
    """One public attention function as ``call(q, k, v, **options)`` with backend='cpu'."""
    fn = ENTRIES[request.param]

    def run(q, k, v, **options):
        options.setdefault("backend", "cpu")
        return fn(q, k, v, **options)

    return run


# --------------------------------------------------------------------------- q, k, v


def test_mismatched_dtypes(call):
    q, k, v = make_qkv()
    with rejects(TypeError, "q, k, v", "float32, float64, float32"):
        call(q, k.astype(np.float64), v)
    with rejects(TypeError, "q, k, v", "float16, float16, bfloat16"):
        call(q.astype(np.float16), k.astype(np.float16), v.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize(
    "dtype", [np.int32, np.int64, np.uint8, np.bool_, np.complex64, np.complex128, "U3", "S2", "M8[s]"]
)
def test_non_float_dtype(call, which, dtype):
    arrays = dict(zip("qkv", make_qkv()))
    arrays[which] = arrays[which].astype(dtype)
    with rejects(TypeError, which, np.dtype(dtype).name):
        call(**arrays)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize(
    "bad, received",
    [
        (None, "NoneType None"),
        ({"a": 1}, "dict {'a': 1}"),
        ("abc", "str 'abc'"),
        (object(), "object <object"),
        ([[1.0], [1.0, 2.0]], "list [[1.0], [1.0, 2.0]]"),
        (np.empty((2, 3), dtype=object), "dtype object"),
    ],
)
def test_non_array_qkv(call, which, bad, received):
    arrays = dict(zip("qkv", make_qkv()))
    arrays[which] = bad
    with rejects(TypeError, which, received):
        call(**arrays)


def test_scalar_q(call):
    _, k, v = make_qkv()
    with rejects(ValueError, "q", "shape ()"):
        call(np.float32(3.0), k, v)


def test_a_tensor_numpy_cannot_read_names_the_argument_and_the_way_in():
    """torch tensors NumPy's DLPack cannot take (bfloat16; one that requires grad) are a
    TypeError naming the argument and pointing to flashcupy.torch, not an error from inside
    the validation about torch's dtype; so are torch tensors where a NumPy array is needed."""
    torch = pytest.importorskip("torch")
    bf16 = torch.zeros((1, 1, 4, 8), dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^q: expected an array, received Tensor of shape \(1, 1, 4, 8\) and dtype "
                                        r"torch\.bfloat16 .*flashcupy\.torch takes torch tensors"):
        fc.flash_attention(bf16, bf16, bf16, backend="cpu")
    grad = torch.zeros((1, 1, 4, 8), requires_grad=True)
    with pytest.raises(TypeError, match=r"^q: expected an array, .*require gradient"):
        fc.flash_attention(grad, grad.detach(), grad.detach(), backend="cpu")
    with pytest.raises(TypeError, match="^out_a: expected a NumPy or CuPy array, received torch.Tensor"):
        fc.merge_attention_states(torch.zeros(1, 4, 8), torch.zeros(1, 4), torch.zeros(1, 4, 8), torch.zeros(1, 4))


def test_a_foreign_dtype_is_named_as_its_library_names_it():
    class Dtype:
        def __str__(self):
            return "other.float8"

    assert fc.problem.dtype_name(Dtype()) == "other.float8"
    assert fc.problem.dtype_name(np.dtype(">f4")) == "float32 (big-endian)"


def test_long_repr_is_truncated():
    _, k, v = make_qkv()
    with pytest.raises(TypeError, match=r"^q: expected an array, received list \[\['x'") as info:
        fc.flash_attention([["x"] * 1000], k, v, backend="cpu")
    assert len(str(info.value)) < 200


# --------------------------------------------------------------------------- shapes


def test_ndim_mismatch(call):
    q, k, v = make_qkv()
    with rejects(ValueError, "q, k, v", "(2, 4, 5, 8), (2, 7, 8), (2, 7, 6)"):
        call(q, k[0], v[0])


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_ndim_below_two(call, which):
    arrays = dict(zip("qkv", make_qkv(batch=(), hq=1, hk=1)))
    arrays[which] = arrays[which][0, 0]
    with rejects(ValueError, which, f"shape {arrays[which].shape}"):
        call(**arrays)


def test_head_dim_mismatch(call):
    q, _, v = make_qkv()
    _, k, _ = make_qkv(d=9)
    with rejects(ValueError, "k", "received 9"):
        call(q, k, v)


@pytest.mark.parametrize("heads, length", [(3, LK), (HK, LK + 1), (1, LK - 1)])
def test_v_heads_or_length_differ_from_k(call, heads, length):
    q, k, _ = make_qkv()
    v = np.zeros((B, heads, length, DV), F32)
    with rejects(ValueError, "v", f"received {(heads, length)}"):
        call(q, k, v)


def test_batch_dims_differ(call):
    q, _, _ = make_qkv()
    _, k, v = make_qkv(batch=(3,))
    with rejects(ValueError, "q, k, v", "(2,), (3,), (3,)"):
        call(q, k, v)
    _, k, v = make_qkv(batch=(1,))  # broadcasting is not implied
    with rejects(ValueError, "q, k, v", "(2,), (1,), (1,)"):
        call(q, k, v)


@pytest.mark.parametrize("hq, hk", [(4, 3), (2, 4), (3, 2), (4, 0)])
def test_heads_not_divisible(call, hq, hk):
    q, k, v = make_qkv(hq=hq, hk=hk)
    with rejects(ValueError, "k", f"received {hk}"):
        call(q, k, v)


@pytest.mark.parametrize("dim", [0, 513, 1024])
def test_head_dim_out_of_range(call, dim):
    q, k, v = make_qkv(d=dim)
    with rejects(ValueError, "q", f"1..512, received {dim}"):
        call(q, k, v)
    q, k, v = make_qkv(dv=dim)
    with rejects(ValueError, "v", f"1..512, received {dim}"):
        call(q, k, v)


# --------------------------------------------------------------------------- dropout


@pytest.mark.parametrize("p", [-0.1, -1e-300, 1.0, 1.5, math.nan, math.inf, -math.inf, 10**400, 2])
def test_dropout_p_out_of_range(call, p):
    q, k, v = make_qkv()
    with rejects(ValueError, "dropout_p", repr(p)[:20]):
        call(q, k, v, dropout_p=p, seed=0)


@pytest.mark.parametrize("p", ["0.1", True, [0.1], 0.1j, None])
def test_dropout_p_wrong_type(call, p):
    q, k, v = make_qkv()
    with rejects(TypeError, "dropout_p", repr(p)):
        call(q, k, v, dropout_p=p, seed=0)


@pytest.mark.parametrize(
    "seed, exc",
    [(-1, ValueError), (2**64, ValueError), (2**100, ValueError), (1.5, TypeError), (3.0, TypeError),
     (True, TypeError), (False, TypeError), ("1", TypeError), (np.float64(2.0), TypeError)],
)
def test_bad_seed(call, seed, exc):
    q, k, v = make_qkv()
    for p in (0.0, 0.25):  # validated even when dropout is off
        with rejects(exc, "seed", seed):
            call(q, k, v, dropout_p=p, seed=seed)


@pytest.mark.parametrize(
    "offset, exc", [(-1, ValueError), (2**32, ValueError), (1.0, TypeError), (True, TypeError), (None, TypeError)]
)
def test_bad_dropout_offset(call, offset, exc):
    q, k, v = make_qkv()
    with rejects(exc, "dropout_offset", offset):
        call(q, k, v, dropout_p=0.25, seed=1, dropout_offset=offset)


def test_forward_with_dropout_needs_seed():
    q, k, v = make_qkv()
    with rejects(ValueError, "seed", "None"):
        fc.flash_attention_forward(q, k, v, dropout_p=0.25, backend="cpu")


def test_backward_with_dropout_needs_seed():
    q, k, v = make_qkv()
    out, lse = fc.flash_attention_forward(q, k, v, dropout_p=0.25, seed=5, backend="cpu")
    with rejects(ValueError, "seed", "None"):
        fc.flash_attention_backward(np.ones_like(out), q, k, v, out, lse, dropout_p=0.25, backend="cpu")


def test_reference_with_dropout_needs_seed():
    q, k, v = make_qkv()
    with rejects(ValueError, "seed", "None"):
        fc.attention_reference(q, k, v, dropout_p=0.25)


# --------------------------------------------------------------------------- mask, bias, slopes


@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.float32, np.float64, np.complex64])
def test_mask_wrong_dtype(call, dtype):
    q, k, v = make_qkv()
    with rejects(TypeError, "mask", np.dtype(dtype).name):
        call(q, k, v, mask=np.ones(SCORES, dtype))


@pytest.mark.parametrize("shape", [(3, LQ, LK), (LQ, LK + 1), (1, 1, 1, 1, LQ, LK), (B, HQ, LQ, LK, 1), (LK, LQ)])
def test_mask_not_broadcastable(call, shape):
    q, k, v = make_qkv()
    with rejects(ValueError, "mask", f"received {shape}"):
        call(q, k, v, mask=np.ones(shape, bool))


@pytest.mark.parametrize("bad, received", [("yes", "str 'yes'"), ({"m": 1}, "dict")])
def test_mask_not_an_array(call, bad, received):
    q, k, v = make_qkv()
    with rejects(TypeError, "mask", received):
        call(q, k, v, mask=bad)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.bool_, np.complex128])
def test_bias_wrong_dtype(call, dtype):
    q, k, v = make_qkv()
    with rejects(TypeError, "bias", np.dtype(dtype).name):
        call(q, k, v, bias=np.zeros((LQ, LK), dtype))


@pytest.mark.parametrize("shape", [(HQ + 1, LQ, LK), (LQ + 1, LK), (1, 1, 1, 1, 1)])
def test_bias_not_broadcastable(call, shape):
    q, k, v = make_qkv()
    with rejects(ValueError, "bias", f"received {shape}"):
        call(q, k, v, bias=np.zeros(shape, F32))


PER_HEAD = pytest.mark.parametrize("name", ["alibi_slopes", "sinks"])


@PER_HEAD
@pytest.mark.parametrize("shape", [(HQ + 1,), (3, HQ), (B, HQ, 1), (1, 1, HQ)])
def test_per_head_option_not_broadcastable(call, name, shape):
    q, k, v = make_qkv()
    with rejects(ValueError, name, f"received {shape}"):
        call(q, k, v, **{name: np.ones(shape, F32)})


@PER_HEAD
@pytest.mark.parametrize("dtype", [np.complex64, np.bool_, "U2"])
def test_per_head_option_wrong_dtype(call, name, dtype):
    q, k, v = make_qkv()
    with rejects(TypeError, name, np.dtype(dtype).name):
        call(q, k, v, **{name: np.ones(HQ, dtype)})


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_alibi_not_finite(call, value):
    q, k, v = make_qkv()
    values = np.full(HQ, 0.5)
    values[2] = value
    with rejects(ValueError, "alibi_slopes", value):
        call(q, k, v, alibi_slopes=values)


@PER_HEAD
@pytest.mark.parametrize("bad, received", [("0.5", "str '0.5'"), ({"s": 1}, "dict")])
def test_per_head_option_not_an_array(call, name, bad, received):
    q, k, v = make_qkv()
    with rejects(TypeError, name, received):
        call(q, k, v, **{name: bad})


# --------------------------------------------------------------------------- lengths


@pytest.mark.parametrize("name, limit", [("q_lengths", LQ), ("kv_lengths", LK)])
class TestLengths:
    def test_float_dtype(self, call, name, limit):
        q, k, v = make_qkv()
        with rejects(TypeError, name, "float64"):
            call(q, k, v, **{name: np.array([1.0, 2.0])})
        with rejects(TypeError, name, "float64"):
            call(q, k, v, **{name: 2.0})

    def test_bool_dtype(self, call, name, limit):
        q, k, v = make_qkv()
        with rejects(TypeError, name, "bool"):
            call(q, k, v, **{name: np.array([True, False])})

    def test_negative(self, call, name, limit):
        q, k, v = make_qkv()
        with rejects(ValueError, name, "received values in [-1, 2]"):
            call(q, k, v, **{name: np.array([-1, 2])})

    def test_too_long(self, call, name, limit):
        q, k, v = make_qkv()
        with rejects(ValueError, name, f"[0, {limit}], received values in [1, {limit + 1}]"):
            call(q, k, v, **{name: np.array([1, limit + 1])})

    def test_huge_unsigned_does_not_wrap(self, call, name, limit):
        q, k, v = make_qkv()
        with rejects(ValueError, name, str(2**64 - 1)):
            call(q, k, v, **{name: np.array([1, 2**64 - 1], dtype=np.uint64)})

    @pytest.mark.parametrize("shape", [(3,), (B, 1), (1, B)])
    def test_not_broadcastable(self, call, name, limit, shape):
        q, k, v = make_qkv()
        with rejects(ValueError, name, f"received {shape}"):
            call(q, k, v, **{name: np.ones(shape, np.int32)})

    def test_not_an_array(self, call, name, limit):
        q, k, v = make_qkv()
        with rejects(TypeError, name, "str 'abc'"):
            call(q, k, v, **{name: "abc"})


# --------------------------------------------------------------------------- block mask


BLOCKS = (B, HQ, 2, 2)  # block_size 4: ceil(5/4) x ceil(7/4)


def test_block_mask_without_block_size(call):
    q, k, v = make_qkv()
    with rejects(ValueError, "block_size", "None"):
        call(q, k, v, block_mask=np.ones(BLOCKS, bool))


def test_block_size_without_block_mask(call):
    q, k, v = make_qkv()
    with rejects(ValueError, "block_size", "4"):
        call(q, k, v, block_size=4)


@pytest.mark.parametrize(
    "size, exc", [(0, ValueError), (-4, ValueError), (4.0, TypeError), (True, TypeError), ("4", TypeError)]
)
def test_bad_block_size(call, size, exc):
    q, k, v = make_qkv()
    with rejects(exc, "block_size", repr(size)):
        call(q, k, v, block_mask=np.ones(BLOCKS, bool), block_size=size)


@pytest.mark.parametrize("shape", [(B, HQ, 2, 3), (3, 2), (5, 7), (1, 1, 1, 1, 1)])
def test_block_mask_not_broadcastable(call, shape):
    q, k, v = make_qkv()
    with rejects(ValueError, "block_mask", f"received {shape}"):
        call(q, k, v, block_mask=np.ones(shape, bool), block_size=4)


@pytest.mark.parametrize("dtype", [np.int32, np.float32, np.uint8])
def test_block_mask_wrong_dtype(call, dtype):
    q, k, v = make_qkv()
    with rejects(TypeError, "block_mask", np.dtype(dtype).name):
        call(q, k, v, block_mask=np.ones(BLOCKS, dtype), block_size=4)


# --------------------------------------------------------------------------- window, causal, backend


@pytest.mark.parametrize(
    "window, side, value", [((-1, 0), "left", -1), ((0, -2), "right", -2), ((None, -1), "right", -1)]
)
def test_window_negative(call, window, side, value):
    q, k, v = make_qkv()
    with rejects(ValueError, "window", f"{side} to be >= 0 or None, received {value}"):
        call(q, k, v, window=window)


@pytest.mark.parametrize("window", [3, (1,), (1, 2, 3), "ab", np.array([1, 2]), {1: 2}, ()])
def test_window_not_a_pair(call, window):
    q, k, v = make_qkv()
    with rejects(TypeError, "window", "received"):
        call(q, k, v, window=window)


@pytest.mark.parametrize(
    "window, value", [((1.0, 2), "1.0"), ((1, 2.5), "2.5"), ((True, 1), "True"), ((1, "2"), "'2'")]
)
def test_window_not_ints(call, window, value):
    q, k, v = make_qkv()
    with rejects(TypeError, "window", f"received {value}"):
        call(q, k, v, window=window)


@pytest.mark.parametrize("causal", ["left", "TOP_LEFT", "", "true", 2, 1, 0, 1.0, None, [True]])
def test_bad_causal(call, causal):
    q, k, v = make_qkv()
    with rejects(ValueError, "causal", repr(causal)):
        call(q, k, v, causal=causal)


@pytest.mark.parametrize("backend", ["gpu", "CPU", "", None, 0])
def test_unknown_backend(call, backend):
    q, k, v = make_qkv()
    with rejects(ValueError, "backend", repr(backend)):
        call(q, k, v, backend=backend)


@pytest.mark.parametrize("entry", ["flash_attention", "forward", "backward", "vjp"])
def test_cuda_backend_unavailable(entry):
    # No CUDA kernels yet: a clear RuntimeError naming CUDA and the way out, not a crash.
    q, k, v = make_qkv()
    with pytest.raises(RuntimeError, match=r"(?i)backend='cuda'.*cuda.*backend='cpu'"):
        ENTRIES[entry](q, k, v, backend="cuda")


def test_array_backend(call):
    # api._backend tests ``name not in BACKENDS``: an array there is NumPy's "truth value ... ambiguous".
    q, k, v = make_qkv()
    with rejects(ValueError, "backend", "array([1, 2])"):
        call(q, k, v, backend=np.array([1, 2]))


@pytest.mark.parametrize("entry", ["flash_attention", "forward", "vjp"])
def test_array_dropout_p_without_seed(entry):
    # api tests ``dropout_p not in (0, 0.0)`` before validation: an array there is NumPy's
    # "truth value ... ambiguous", not an error naming dropout_p.
    q, k, v = make_qkv()
    with rejects(TypeError, "dropout_p", "array([0.1, 0.2])"):
        ENTRIES[entry](q, k, v, dropout_p=np.array([0.1, 0.2]), backend="cpu")


# --------------------------------------------------------------------------- scale, softcap


@pytest.mark.parametrize(
    "scale, exc",
    [(math.nan, ValueError), (math.inf, ValueError), (-math.inf, ValueError), (10**400, ValueError),
     ("0.5", TypeError), (True, TypeError), ([0.5], TypeError), (0.5j, TypeError), (np.array(0.5), TypeError)],
)
def test_bad_scale(call, scale, exc):
    q, k, v = make_qkv()
    with rejects(exc, "scale", repr(scale)[:20]):
        call(q, k, v, scale=scale)


@pytest.mark.parametrize(
    "softcap, exc",
    [(0, ValueError), (0.0, ValueError), (-1.0, ValueError), (math.inf, ValueError), (math.nan, ValueError),
     (10**400, ValueError), ("30", TypeError), (True, TypeError), (1j, TypeError)],
)
def test_bad_softcap(call, softcap, exc):
    q, k, v = make_qkv()
    with rejects(exc, "softcap", repr(softcap)[:20]):
        call(q, k, v, softcap=softcap)


# --------------------------------------------------------------------------- flags, keywords


@pytest.mark.parametrize("name", ["return_lse", "allow_tf32"])
@pytest.mark.parametrize("value", [1, 0, "yes", None, 1.0])
def test_flags_not_bool(call, name, value):
    q, k, v = make_qkv()
    with rejects(TypeError, name, repr(value)):
        call(q, k, v, **{name: value})


def test_unknown_keyword(call):
    q, k, v = make_qkv()
    with pytest.raises(TypeError, match="casual"):
        call(q, k, v, casual=True)
    with pytest.raises(TypeError, match="softmax_scale"):
        call(q, k, v, softmax_scale=0.5)


def test_unknown_keyword_varlen():
    q, k, v, cu_q, cu_k = packed()
    with pytest.raises(TypeError, match="casual"):
        fc.flash_attention_varlen(q, k, v, cu_q, cu_k, casual=True, backend="cpu")


# --------------------------------------------------------------------------- varlen


def packed(dtype=F32):
    rs = np.random.default_rng(1)
    q = rs.standard_normal((HQ, 9, D)).astype(dtype)
    k = rs.standard_normal((HK, 11, D)).astype(dtype)
    v = rs.standard_normal((HK, 11, DV)).astype(dtype)
    return q, k, v, np.array([0, 4, 9], np.int32), np.array([0, 5, 11], np.int32)


def _varlen(q, k, v, cu_q, cu_k, **o):
    return fc.flash_attention_varlen(q, k, v, cu_q, cu_k, backend="cpu", **o)


def _varlen_forward(q, k, v, cu_q, cu_k, **o):
    return fc.flash_attention_forward(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend="cpu", **o)


def _varlen_reference(q, k, v, cu_q, cu_k, **o):
    return fc.attention_reference(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **o)


@pytest.fixture(params=[_varlen, _varlen_forward, _varlen_reference], ids=["varlen", "forward", "reference"])
def varlen(request):
    return request.param


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
class TestCuSeqlens:
    def _call(self, varlen, which, value):
        q, k, v, cu_q, cu_k = packed()
        if which == "cu_seqlens_q":
            cu_q = value
        else:
            cu_k = value
        return varlen(q, k, v, cu_q, cu_k)

    def test_float_dtype(self, varlen, which):
        with rejects(TypeError, which, "float64"):
            self._call(varlen, which, np.array([0.0, 4.0, 9.0]))
        with rejects(TypeError, which, "float64"):
            self._call(varlen, which, [0, 4.5, 9])

    def test_int64_array(self, varlen, which):
        with rejects(TypeError, which, "int64"):
            self._call(varlen, which, np.array([0, 4, 9], np.int64))

    def test_not_1d(self, varlen, which):
        with rejects(ValueError, which, "shape (1, 3)"):
            self._call(varlen, which, np.array([[0, 4, 9]], np.int32))
        with rejects(ValueError, which, "shape ()"):
            self._call(varlen, which, np.array(0, np.int32))
        with rejects(ValueError, which, "shape (0,)"):
            self._call(varlen, which, np.array([], np.int32))
        with rejects(ValueError, which, "shape (0,)"):
            self._call(varlen, which, [])

    def test_not_starting_at_zero(self, varlen, which):
        with rejects(ValueError, which, "first value to be 0, received 1"):
            self._call(varlen, which, np.array([1, 4, 9], np.int32))

    def test_decreasing(self, varlen, which):
        with rejects(ValueError, which, "[0, 8, 3, 9]"):
            self._call(varlen, which, np.array([0, 8, 3, 9], np.int32))

    def test_last_not_total(self, varlen, which):
        total = 9 if which == "cu_seqlens_q" else 11
        with rejects(ValueError, which, f"packed length {total}, received 8"):
            self._call(varlen, which, np.array([0, 4, 8], np.int32))

    def test_list_out_of_int32(self, varlen, which):
        with rejects(ValueError, which, str(2**40)):
            self._call(varlen, which, [0, 2**40])

    def test_not_an_array(self, varlen, which):
        with rejects(TypeError, which, "str"):
            self._call(varlen, which, "0,4,9")
        with rejects(TypeError, which, "list"):
            self._call(varlen, which, [0, "4", 9])

    def test_missing(self, which):
        q, k, v, cu_q, cu_k = packed()
        other = "cu_seqlens_k" if which == "cu_seqlens_q" else "cu_seqlens_q"
        given_ = {which: cu_q if which == "cu_seqlens_q" else cu_k}
        with rejects(ValueError, other, "None"):
            fc.flash_attention(q, k, v, backend="cpu", **given_)
        with rejects(ValueError, other, "None"):
            fc.attention_reference(q, k, v, **given_)


def test_cu_seqlens_lengths_differ(varlen):
    q, k, v, cu_q, _ = packed()
    with rejects(ValueError, "cu_seqlens_k", "length 3 like cu_seqlens_q, received 2"):
        varlen(q, k, v, cu_q, np.array([0, 11], np.int32))


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_varlen_not_3d(varlen, which):
    q, k, v, cu_q, cu_k = packed()
    arrays = {"q": q, "k": k, "v": v}
    arrays[which] = arrays[which][None]
    with rejects(ValueError, which, f"received shape {arrays[which].shape}"):
        varlen(arrays["q"], arrays["k"], arrays["v"], cu_q, cu_k)
    arrays[which] = arrays[which][0, 0]
    with rejects(ValueError, which, f"received shape {arrays[which].shape}"):
        varlen(arrays["q"], arrays["k"], arrays["v"], cu_q, cu_k)


@pytest.mark.parametrize("name", ["q_lengths", "kv_lengths"])
def test_varlen_with_lengths(varlen, name):
    q, k, v, cu_q, cu_k = packed()
    with rejects(ValueError, name, "received"):
        varlen(q, k, v, cu_q, cu_k, **{name: np.array([3, 4])})


# --------------------------------------------------------------------------- backward arrays


@pytest.fixture(params=[False, True], ids=["4d", "2d"])
def grads_case(request):
    """(q, k, v, out, lse, dout) for a valid backward call; 2-D inputs squeeze the head axis."""
    if request.param:
        q, k, v = (x[0, 0] for x in make_qkv(hq=1, hk=1))
    else:
        q, k, v = make_qkv()
    out, lse = fc.flash_attention_forward(q, k, v, backend="cpu")
    return q, k, v, out, lse, np.ones_like(out)


def _bwd(dout, q, k, v, out, lse, **o):
    return fc.flash_attention_backward(dout, q, k, v, out, lse, backend="cpu", **o)


def test_backward_valid(grads_case):
    q, k, v, out, lse, dout = grads_case
    dq, dk, dv = _bwd(dout, q, k, v, out, lse)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_backward_dout_wrong_shape(grads_case):
    q, k, v, out, lse, dout = grads_case
    with rejects(ValueError, "dout", f"shape {out.shape} (the forward's out: q's shape with v's head dim), "
                                     f"received {dout[..., :-1].shape}"):
        _bwd(dout[..., :-1], q, k, v, out, lse)
    with rejects(ValueError, "dout", f"received {dout[None].shape}"):
        _bwd(dout[None], q, k, v, out, lse)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
def test_backward_dout_wrong_dtype(grads_case, dtype):
    q, k, v, out, lse, dout = grads_case
    with rejects(TypeError, "dout", f"float32 like q, received {np.dtype(dtype).name}"):
        _bwd(dout.astype(dtype), q, k, v, out, lse)


def test_backward_dout_none(grads_case):
    q, k, v, out, lse, _ = grads_case
    with pytest.raises(TypeError, match=r"^dout: expected .*received .*(NoneType None|dtype object)"):
        _bwd(None, q, k, v, out, lse)
    with pytest.raises(TypeError, match=r"^dout: expected .*received .*(dict|dtype object)"):
        _bwd({"x": 1}, q, k, v, out, lse)


def test_backward_out_wrong(grads_case):
    q, k, v, out, lse, dout = grads_case
    with rejects(ValueError, "out", f"received {out[..., :1, :].shape}"):
        _bwd(dout, q, k, v, out[..., :1, :], lse)
    with rejects(TypeError, "out", "received float64"):
        _bwd(dout, q, k, v, out.astype(np.float64), lse)


def test_backward_lse_wrong(grads_case):
    q, k, v, out, lse, dout = grads_case
    with rejects(ValueError, "lse", f"received {lse[..., None].shape}"):
        _bwd(dout, q, k, v, out, lse[..., None])
    with rejects(ValueError, "lse", f"received {out.shape}"):
        _bwd(dout, q, k, v, out, out)
    with rejects(TypeError, "lse", "received int64"):
        _bwd(dout, q, k, v, out, lse.astype(np.int64))
    with rejects(TypeError, "lse", "received bool"):
        _bwd(dout, q, k, v, out, lse > 0)


@pytest.mark.parametrize("dtype, lse_dtype", [(np.float16, np.float16), (np.float32, np.float64),
                                              (np.float32, np.float16), (np.float64, np.float32)])
def test_backward_lse_must_have_the_forwards_dtype(dtype, lse_dtype):
    # The forward's lse is float32, float64 for float64 inputs; any other dtype is a
    # caller's mix-up (an lse from another call, or cast on the way) and is refused.
    q, k, v = (x.astype(dtype) for x in make_qkv())
    out, lse = fc.flash_attention_forward(q, k, v, backend="cpu")
    assert lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    expected = f"{np.dtype(lse.dtype).name} (the forward's lse for {np.dtype(dtype).name} inputs), "
    with rejects(TypeError, "lse", expected + f"received {np.dtype(lse_dtype).name}"):
        _bwd(np.ones_like(out), q, k, v, out, lse.astype(lse_dtype))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_backward_out_must_have_qs_dtype_and_the_forwards_shape(dtype):
    q, k, v = (x.astype(dtype) for x in make_qkv())
    out, lse = fc.flash_attention_forward(q, k, v, backend="cpu")
    other = np.float32 if dtype != np.float32 else np.float64
    with rejects(TypeError, "out", f"{np.dtype(dtype).name} like q, received {np.dtype(other).name}"):
        _bwd(np.ones_like(out), q, k, v, out.astype(other), lse)
    with rejects(ValueError, "lse", f"shape {lse.shape} (the forward's lse: q's shape without its head dim), "
                                    f"received {lse[:1].shape}"):
        _bwd(np.ones_like(out), q, k, v, out, lse[:1])


@pytest.mark.parametrize("which", ["dout", "out", "lse"])
def test_backward_ragged_list(grads_case, which):
    # api converts dout/out/lse with interop.to_numpy: a ragged list fails inside NumPy.
    q, k, v, out, lse, dout = grads_case
    arrays = {"dout": dout, "out": out, "lse": lse, which: [[1.0], [1.0, 2.0]]}
    with rejects(TypeError, which, "list [[1.0], [1.0, 2.0]]"):
        _bwd(arrays["dout"], q, k, v, arrays["out"], arrays["lse"])


def test_bias_grad_without_bias(grads_case):
    q, k, v, out, lse, dout = grads_case
    with rejects(ValueError, "bias_grad", "bias=None"):
        _bwd(dout, q, k, v, out, lse, bias_grad=True)


@pytest.mark.parametrize("name", ["bias_grad", "deterministic"])
@pytest.mark.parametrize("value", [1, "yes", None, 0.0])
def test_backward_flags_not_bool(grads_case, name, value):
    q, k, v, out, lse, dout = grads_case
    with rejects(TypeError, name, repr(value)):
        _bwd(dout, q, k, v, out, lse, **{name: value})


def test_vjp_bad_dout(grads_case):
    q, k, v, out, _, dout = grads_case
    _, vjp = fc.flash_attention_vjp(q, k, v, backend="cpu")
    with rejects(ValueError, "dout", f"received {dout[..., :-1].shape}"):
        vjp(dout[..., :-1])
    with rejects(TypeError, "dout", "received float64"):
        vjp(dout.astype(np.float64))
    with pytest.raises(TypeError, match=r"^dout: expected .*received .*(NoneType None|dtype object)"):
        vjp(None)
    assert all(g.shape == x.shape for g, x in zip(vjp(dout), (q, k, v)))


# --------------------------------------------------------------------------- dropout_mask


@pytest.mark.parametrize(
    "shape, exc, fragment",
    [((2, -1, 4), ValueError, "-1"), ((4,), ValueError, "(4,)"), ((), ValueError, "()"),
     (5, TypeError, "int"), (None, TypeError, "NoneType"), ((2, 2.0), TypeError, "float")],
)
def test_dropout_mask_bad_shape(shape, exc, fragment):
    with pytest.raises(exc, match=rf"^shape .*received .*{re.escape(fragment)}"):
        fc.dropout_mask(shape, 0.5, 1)


@pytest.mark.parametrize(
    "p, exc",
    [(-0.1, ValueError), (1.0, ValueError), (math.nan, ValueError), (10**400, ValueError),  # rng: OverflowError
     ("0.5", TypeError), (None, TypeError)],
)
def test_dropout_mask_bad_p(p, exc):
    # rng names the probability "dropout_p" (the argument is ``p``): see the report.
    with pytest.raises(exc, match=r"^dropout_p .*received"):
        fc.dropout_mask((2, 3), p, 1)


@pytest.mark.parametrize(
    "seed, exc, fragment",
    [(-1, ValueError, "-1"), (2**64, ValueError, str(2**64)), (1.5, TypeError, "float"),
     (True, TypeError, "bool"), (None, TypeError, "NoneType")],
)
def test_dropout_mask_bad_seed(seed, exc, fragment):
    with pytest.raises(exc, match=rf"^seed .*received {re.escape(fragment)}"):
        fc.dropout_mask((2, 3), 0.5, seed)


@pytest.mark.parametrize("offset, exc", [(-1, ValueError), (2**32, ValueError), (0.5, TypeError)])
def test_dropout_mask_bad_offset(offset, exc):
    with pytest.raises(exc, match=r"^offset .*received"):
        fc.dropout_mask((2, 3), 0.5, 1, offset)


# --------------------------------------------------------------------------- borderline but valid


def flash(q, k, v, **o):
    return fc.flash_attention(q, k, v, backend="cpu", **o)


def assert_matches_reference(q, k, v, atol=2e-5, **o):
    out, lse = flash(q, k, v, return_lse=True, **o)
    ref_out, ref_lse = fc.attention_reference(q, k, v, return_lse=True, **o)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out, ref_out, atol=atol, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, atol=atol, rtol=0)
    return out, lse


def test_window_zero_zero_attends_the_diagonal():
    q, k, v = make_qkv(lk=LQ)
    out, _ = assert_matches_reference(q, k, v, window=(0, 0))
    group = HQ // HK
    for h in range(HQ):
        np.testing.assert_allclose(out[:, h], v[:, h // group], atol=1e-6)


def test_window_none_none_is_no_window():
    q, k, v = make_qkv()
    np.testing.assert_array_equal(flash(q, k, v, window=(None, None)), flash(q, k, v))
    np.testing.assert_array_equal(flash(q, k, v, window=[None, None]), flash(q, k, v))


def test_huge_window_and_block_size_are_unbounded():
    q, k, v = make_qkv()
    plain = flash(q, k, v)
    # left clamped to Lk and right to Lq: no longer a restriction, and the kernels' 32-bit
    # band sums stay within +-(Lq + Lk)
    lq, lk = q.shape[-2], k.shape[-2]
    assert make_problem(q, k, v, {"window": (2**70, 2**64)}).window == (lk, lq)
    assert make_problem(q, k, v, {"window": (lk + 1, None)}).window == (lk, None)
    np.testing.assert_array_equal(flash(q, k, v, window=(2**70, 2**64)), plain)
    assert_matches_reference(q, k, v, window=(2**70, 0))
    assert_matches_reference(q, k, v, window=(np.uint64(2**63), 1), causal=True)
    np.testing.assert_array_equal(flash(q, k, v, block_mask=np.ones((1, 1), bool), block_size=2**70), plain)
    assert_matches_reference(q, k, v, block_mask=np.array([[True]]), block_size=10**30)


def test_empty_queries():
    q, k, v = make_qkv(lq=0)
    out, lse = assert_matches_reference(q, k, v)
    assert out.shape == (B, HQ, 0, DV) and lse.shape == (B, HQ, 0)
    dq, dk, dv = fc.flash_attention_backward(np.zeros_like(out), q, k, v, out, lse, backend="cpu")
    assert not dk.any() and not dv.any() and dq.shape == q.shape


def test_empty_keys():
    q, k, v = make_qkv(lk=0)
    out, lse = assert_matches_reference(q, k, v)
    assert out.shape == (B, HQ, LQ, DV) and not out.any()
    assert np.all(lse == -np.inf)
    dq, dk, dv = fc.flash_attention_backward(np.ones_like(out), q, k, v, out, lse, backend="cpu")
    assert not dq.any() and dk.shape == k.shape and dv.shape == v.shape


def test_scale_zero_is_uniform():
    q, k, v = make_qkv()
    out, _ = assert_matches_reference(q, k, v, scale=0)
    mean = np.repeat(v.mean(axis=-2, keepdims=True), HQ // HK, axis=1)
    np.testing.assert_allclose(out, np.broadcast_to(mean, out.shape), atol=1e-6)
    assert_matches_reference(q, k, v, scale=-0.0)


def test_extreme_seed_and_offset():
    q, k, v = make_qkv()
    assert_matches_reference(q, k, v, dropout_p=0.5, seed=2**64 - 1)
    assert_matches_reference(q, k, v, dropout_p=0.5, seed=0, dropout_offset=2**32 - 1)
    assert_matches_reference(q, k, v, dropout_p=0.5, seed=np.uint64(2**64 - 1), dropout_offset=np.uint32(7))
    assert_matches_reference(q, k, v, dropout_p=np.float32(0.25), seed=3)
    extreme = {"dropout_p": 0.5, "seed": 2**64 - 1, "dropout_offset": 2**32 - 1, "backend": "cpu"}
    out, lse = fc.flash_attention_forward(q, k, v, **extreme)
    grads = fc.flash_attention_backward(np.ones_like(out), q, k, v, out, lse, **extreme)
    assert all(np.isfinite(g).all() for g in grads)


def test_lists_as_slopes_and_lengths():
    q, k, v = make_qkv()
    slopes = [0.5, 0.25, 0.125, 0.0625]
    lens_q, lens_k = [3, 5], [7, 2]
    as_lists = flash(q, k, v, alibi_slopes=slopes, q_lengths=lens_q, kv_lengths=lens_k)
    as_arrays = flash(q, k, v, alibi_slopes=np.array(slopes), q_lengths=np.array(lens_q), kv_lengths=np.array(lens_k))
    np.testing.assert_array_equal(as_lists, as_arrays)
    assert_matches_reference(q, k, v, alibi_slopes=slopes, q_lengths=lens_q, kv_lengths=lens_k)
    assert not as_lists[0, :, 3:].any()  # rows >= q_len are 0
    assert_matches_reference(q, k, v, alibi_slopes=(1, 2, 3, 4), q_lengths=(5, 0), kv_lengths=(0, 7))
    assert_matches_reference(q, k, v, alibi_slopes=0.5, q_lengths=np.uint8(4), kv_lengths=np.int16(6))


def test_python_int_lengths_on_3d():
    q, k, v = make_qkv(batch=())
    out, lse = assert_matches_reference(q, k, v, q_lengths=3, kv_lengths=4, causal=True)
    assert not out[:, 3:].any() and np.all(lse[:, 3:] == -np.inf)
    assert_matches_reference(q, k, v, q_lengths=np.int64(LQ), kv_lengths=0)


def test_cu_seqlens_as_list():
    q, k, v, cu_q, cu_k = packed()
    as_arrays = fc.flash_attention_varlen(q, k, v, cu_q, cu_k, backend="cpu")
    as_lists = fc.flash_attention_varlen(q, k, v, [0, 4, 9], (0, 5, 11), backend="cpu")
    np.testing.assert_array_equal(as_arrays, as_lists)
    ref = fc.attention_reference(q, k, v, cu_seqlens_q=[0, 4, 9], cu_seqlens_k=[0, 5, 11])
    np.testing.assert_allclose(as_lists, ref, atol=2e-5)
    # empty sequences and an empty batch
    _, kk, vv, _, _ = packed()
    out = fc.flash_attention_varlen(q, kk, vv, [0, 0, 9], [0, 11, 11], backend="cpu")
    assert not out.any()  # the first sequence has no queries, the second no keys
    q0 = q[:, :0]
    out = fc.flash_attention_varlen(q0, kk[:, :0], vv[:, :0], [0], np.array([0], np.int32), backend="cpu")
    assert out.shape == (HQ, 0, DV)


def test_head_dim_512():
    q, k, v = make_qkv(batch=(), hq=2, hk=1, lq=3, lk=4, d=512, dv=512, dtype=np.float64)
    assert_matches_reference(q, k, v, atol=1e-9)
    q, k, v = make_qkv(batch=(), hq=1, hk=1, lq=3, lk=4, d=1, dv=512, dtype=np.float64)
    assert_matches_reference(q, k, v, atol=1e-9)


def test_numpy_scalars_and_lists_accepted():
    q, k, v = make_qkv()
    assert_matches_reference(
        q, k, v, scale=np.float32(0.5), softcap=np.int64(20), causal=np.bool_(True),
        window=(np.int64(2), None), block_mask=np.ones((2, 2), bool), block_size=np.int32(4),
        allow_tf32=np.bool_(True), mask=True,
    )
    out, lse = flash(q, k, v, return_lse=np.bool_(True))
    assert lse.shape == (B, HQ, LQ)
    out = flash(q.tolist(), k.tolist(), v.tolist())  # nested lists are float64 arrays
    np.testing.assert_allclose(out, fc.attention_reference(q, k, v), atol=1e-6)


def test_two_dimensional_inputs():
    q, k, v = (x[0, 0] for x in make_qkv())
    out, lse = assert_matches_reference(q, k, v, causal="top_left", bias=np.zeros((LQ, LK), ml_dtypes.bfloat16))
    assert out.shape == (LQ, DV) and lse.shape == (LQ,)


# --------------------------------------------------------------------------- fuzz: garbage options

# q (2, 2, 3, 4), k (2, 1, 4, 4), v (2, 1, 4, 3): batch (2,), GQA, Lq != Lk, D != Dv.
FUZZ_SCORES = (2, 2, 3, 4)
_RS = np.random.default_rng(123)
FUZZ_Q = _RS.standard_normal((2, 2, 3, 4)).astype(F32)
FUZZ_K = _RS.standard_normal((2, 1, 4, 4)).astype(F32)
FUZZ_V = _RS.standard_normal((2, 1, 4, 3)).astype(F32)

_shapes = st.one_of(
    hnp.array_shapes(min_dims=0, max_dims=5, min_side=0, max_side=4),
    hnp.broadcastable_shapes(FUZZ_SCORES, min_side=0, max_side=4),
    hnp.broadcastable_shapes((2, 2), min_side=0, max_side=3),
    hnp.broadcastable_shapes((2,), min_side=0, max_side=3),
)
_dtypes = st.one_of(
    hnp.scalar_dtypes(),
    hnp.unicode_string_dtypes(max_len=3),
    hnp.byte_string_dtypes(max_len=3),
)
_arrays = st.one_of(
    hnp.arrays(_dtypes, _shapes),
    hnp.arrays(np.float32, _shapes).map(lambda a: a.astype(ml_dtypes.bfloat16)),
    hnp.arrays(np.int32, _shapes, elements=st.integers(0, 4)),  # plausible lengths / cu_seqlens
    hnp.arrays(np.bool_, _shapes),  # plausible masks
)
GARBAGE = st.one_of(st.none(), st.integers(), st.floats(), st.text(max_size=8), st.booleans(), _arrays)

#: Names a rejection of garbage for option X may carry (the other half of a pair).
FUZZ_NAMES = {
    "cu_seqlens_q": ("cu_seqlens",),
    "cu_seqlens_k": ("cu_seqlens",),
    "block_mask": ("block_mask", "block_size"),
}
FUZZ_OPTIONS = [
    "causal", "scale", "window", "mask", "bias", "alibi_slopes", "softcap", "q_lengths", "kv_lengths",
    "block_mask", "block_size", "dropout_p", "seed", "dropout_offset", "cu_seqlens_q", "cu_seqlens_k",
    "return_lse", "allow_tf32", "backend",
]


def _moderate(x: Any) -> bool:
    """True when x holds no non-finite or huge numbers (so the output must be finite)."""
    if isinstance(x, (bool, np.bool_, str)) or x is None:
        return True
    if isinstance(x, int):
        return abs(x) <= 1000
    arr = np.asarray(x)
    if arr.dtype.kind in "bUSmMO" or arr.size == 0:
        return True
    vals = arr.astype(np.float64)
    return bool(np.isfinite(vals).all() and np.abs(vals).max() <= 1000)


@pytest.mark.parametrize("option", FUZZ_OPTIONS)
@settings(max_examples=max(30, settings.default.max_examples), deadline=None)
@given(garbage=GARBAGE)
@example(garbage=10**400)
@example(garbage=-(10**400))
@example(garbage=math.nan)
@example(garbage=np.array([1, 2]))
@example(garbage=np.array([[True]]))
@example(garbage=[[1, 2], [3]])
@example(garbage=np.uint64(2**64 - 1))
@example(garbage="cuda")
def test_fuzz_one_option(option, garbage):
    options: dict[str, Any] = {"backend": "cpu", option: garbage}
    if option == "block_size":
        options.setdefault("block_mask", np.ones((1, 1), bool))
    try:
        result = fc.flash_attention(FUZZ_Q, FUZZ_K, FUZZ_V, **options)
    except (TypeError, ValueError) as exc:
        names = FUZZ_NAMES.get(option, (option,))
        assert any(str(exc).startswith(n) for n in names), f"{type(exc).__name__} does not name {option}: {exc}"
        with pytest.raises(type(exc)):  # the reference validates identically
            fc.attention_reference(FUZZ_Q, FUZZ_K, FUZZ_V, **{"seed": 7, **options})
        return
    except RuntimeError as exc:  # only the documented "no CUDA" error
        assert option == "backend" and garbage == "cuda", repr(exc)
        return
    out = result[0] if isinstance(result, tuple) else result
    assert out.shape == (2, 2, 3, 3) and out.dtype == F32
    if option != "seed":  # a fixed seed, so that accepted dropout compares with the reference
        options["seed"] = 7
    out = fc.flash_attention(FUZZ_Q, FUZZ_K, FUZZ_V, **options)
    ref = fc.attention_reference(FUZZ_Q, FUZZ_K, FUZZ_V, **options)
    out, ref = (x[0] if isinstance(x, tuple) else x for x in (out, ref))
    if _moderate(garbage):
        assert np.isfinite(out).all(), f"non-finite output for {option}={garbage!r}"
        err = np.max(np.abs(out - ref), initial=0.0)
        assert err <= 1e-3 * max(1.0, float(np.max(np.abs(ref), initial=0.0))), err


@pytest.mark.parametrize("which", ["q", "k", "v"])
@settings(max_examples=max(30, settings.default.max_examples), deadline=None)
@given(garbage=GARBAGE)
@example(garbage=[[1.0, 2.0], [3.0]])
@example(garbage=FUZZ_Q.astype(np.float64))
@example(garbage=FUZZ_Q[0])
def test_fuzz_qkv(which, garbage):
    arrays = {"q": FUZZ_Q, "k": FUZZ_K, "v": FUZZ_V, which: garbage}
    try:
        out = fc.flash_attention(**arrays, backend="cpu")
    except (TypeError, ValueError) as exc:
        assert str(exc).startswith((which, "q, k, v")), f"{type(exc).__name__} does not name {which}: {exc}"
        return
    ref = fc.attention_reference(**arrays)
    np.testing.assert_allclose(out, ref, atol=1e-4)


@pytest.mark.parametrize("which", ["dout", "out", "lse"])
@settings(max_examples=max(30, settings.default.max_examples), deadline=None)
@given(garbage=GARBAGE)
@example(garbage=[[1.0, 2.0], [3.0]])
@example(garbage=np.zeros((2, 2, 3), np.float32))
@example(garbage=np.zeros((2, 2, 3, 3), np.float16))
def test_fuzz_backward_arrays(which, garbage):
    out, lse = fc.flash_attention_forward(FUZZ_Q, FUZZ_K, FUZZ_V, backend="cpu")
    arrays = {"dout": np.ones_like(out), "out": out, "lse": lse, which: garbage}
    try:
        grads = fc.flash_attention_backward(
            arrays["dout"], FUZZ_Q, FUZZ_K, FUZZ_V, arrays["out"], arrays["lse"], backend="cpu"
        )
    except (TypeError, ValueError) as exc:
        assert str(exc).startswith(which), f"{type(exc).__name__} does not name {which}: {exc}"
        return
    assert [g.shape for g in grads] == [FUZZ_Q.shape, FUZZ_K.shape, FUZZ_V.shape]


# --------------------------------------------------------------------------- byte order


def _swapped(x: np.ndarray) -> np.ndarray:
    """The same values stored in the other byte order (big-endian on a little-endian machine)."""
    return x.astype(x.dtype.newbyteorder("S"))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_byte_swapped_arrays_compute_as_their_native_copies(dtype):
    # Data read from a big-endian file keeps its byte order in NumPy; every array argument
    # in that order is copied to the native one, and the results are those of the copy.
    q, k, v = make_qkv(dtype=dtype)
    rs = np.random.default_rng(1)
    options = {
        "causal": True,
        "mask": rs.random((LQ, LK)) < 0.8,
        "bias": rs.standard_normal((HQ, LQ, LK)).astype(np.float32),
        "alibi_slopes": np.linspace(0.1, 0.5, HQ),
        "q_lengths": np.array([LQ - 1] * B),
        "dropout_p": 0.1,
        "seed": 3,
        "backend": "cpu",
    }
    swapped = {n: _swapped(x) if isinstance(x, np.ndarray) and x.dtype.kind != "b" else x
               for n, x in options.items()}
    out, lse = fc.flash_attention_forward(q, k, v, **options)
    out_s, lse_s = fc.flash_attention_forward(*map(_swapped, (q, k, v)), **swapped)
    assert out_s.dtype.isnative and lse_s.dtype.isnative
    np.testing.assert_array_equal(out_s, out)
    np.testing.assert_array_equal(lse_s, lse)
    dout = np.ones_like(out)
    grads = fc.flash_attention_backward(dout, q, k, v, out, lse, bias_grad=True, **options)
    grads_s = fc.flash_attention_backward(*map(_swapped, (dout, q, k, v, out, lse)), bias_grad=True, **swapped)
    for ours, want in zip(grads_s, grads):
        assert ours.dtype == want.dtype
        np.testing.assert_array_equal(ours, want)


def test_byte_swapped_cu_seqlens_are_converted():
    q, k, v = (x[0] for x in make_qkv())
    cu_q, cu_k = np.array([0, 2, LQ], np.int32), np.array([0, 5, LK], np.int32)
    want = fc.flash_attention_varlen(q, k, v, cu_q, cu_k, backend="cpu")
    got = fc.flash_attention_varlen(q, k, v, _swapped(cu_q), _swapped(cu_k), backend="cpu")
    np.testing.assert_array_equal(got, want)


def test_dtype_names_in_messages_say_the_byte_order():
    from flashcupy.problem import dtype_name

    assert dtype_name(np.float32) == "float32"
    assert dtype_name(np.dtype(np.float32).newbyteorder("S")).startswith("float32 (")
    assert dtype_name(np.dtype(">i4")) in ("int32", "int32 (big-endian)")  # native on big-endian machines
