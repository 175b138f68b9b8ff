"""The CUDA backend against the float64 reference. Run on a GPU: ``pytest -m gpu``.

Outputs are poisoned (NaN) before every launch, so an element a kernel forgets to
write fails the comparison.
"""

from __future__ import annotations

import os
from unittest import mock

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import flashcupy as fc
from flashcupy import reference, rng
from support import (
    BF16, F16, F32, F64, FLOOR, Case, assert_rule, cancelling_terms, captured_replays, cases, cu_seqlens,
    gradient_names, padded_to_packed,
)

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")
from flashcupy import cuda  # noqa: E402  (needs CuPy)
from flashcupy.cuda import compile as kernels  # noqa: E402
from flashcupy.cuda.spec import (  # noqa: E402
    EVERY_OPTION,
    FORCE_PORTABLE_ENV,
    PLAIN,
    ScoreSet,
    all_kernels,
    backward_key_block_major,
    select_backward,
    select_forward,
)

GPU_SETTINGS = settings(max_examples=int(os.environ.get("FLASHCUPY_GPU_EXAMPLES", "60")), deadline=None)


@pytest.fixture(scope="module", autouse=True)
def gpu_session():
    """Poison every output; compile every kernel of this GPU up front, in parallel."""
    device = cupy.cuda.Device().id
    arch, _ = cuda.device_limits(device)
    kernels.precompile(all_kernels(min(arch, 90)), device, workers=os.cpu_count() or 4)
    cuda.poison_outputs = True
    yield
    cuda.poison_outputs = False


def _device(x: np.ndarray):
    """A CuPy copy of x with x's strides (a (B, L, H, D) view stays a strided view)."""
    if x.flags.c_contiguous or x.ndim < 3:
        return cupy.asarray(x)
    return cupy.asarray(np.ascontiguousarray(x.swapaxes(-2, -3))).swapaxes(-2, -3)


def _device_options(options: dict) -> dict:
    return {n: (cupy.asarray(x) if n in ("mask", "bias", "block_mask", "sinks") else x) for n, x in options.items()}


def _check_forward(case: Case, **extra) -> None:
    q, k, v = (_device(x) for x in (case.q, case.k, case.v))
    out, lse = fc.flash_attention(q, k, v, return_lse=True, backend="cuda", **_device_options(case.options), **extra)
    assert isinstance(out, cupy.ndarray) and out.dtype == case.dtype and out.device.id == q.device.id
    ref, naive = case.references(with_backward=False)
    assert_rule("out", out.get(), ref["out"], naive["out"], case.dtype)
    assert_rule("lse", lse.get(), ref["lse"], naive["lse"], case.dtype)


def _sm90_limits(what: str) -> tuple[int, int]:
    """This GPU's (compute capability, shared memory per block); skips the test off 9.0, where
    `what` (e.g. "wgmma kernels need") compute capability 9.0."""
    arch, smem = cuda.device_limits(cupy.cuda.Device().id)
    if arch != 90:
        pytest.skip(f"{what} compute capability 9.0, this GPU has {arch // 10}.{arch % 10}")
    return arch, smem


def _case(shape_q, shape_k, dv=None, dtype=F16, data_seed=0, **options) -> Case:
    rs = np.random.default_rng(data_seed)
    dv = shape_k[-1] if dv is None else dv
    arrays = [rs.standard_normal(s).astype(dtype) for s in (shape_q, shape_k, shape_k[:-1] + (dv,), shape_q[:-1] + (dv,))]
    return Case(*arrays, options)


@GPU_SETTINGS
@given(cases())
@example(_case((2, 4, 1025, 40), (2, 2, 1025, 40), causal=True))
@example(_case((1, 3, 97, 512), (1, 3, 130, 512), dtype=BF16))
@example(_case((1, 2, 200, 256), (1, 2, 77, 256), dtype=F64, causal="top_left"))
@example(_case((2, 1, 300, 80), (2, 1, 300, 80), dtype=F32, window=(17, 3), softcap=4.0))
@example(_case((3, 2, 64, 128), (3, 2, 64, 128), dv=24, dropout_p=0.3, seed=2**40 + 9, dropout_offset=5))
@example(_case((1, 1, 1, 1), (1, 1, 17, 1), window=(1, None), scale=0.0, q_lengths=np.array([1]),
               kv_lengths=np.array([9]), dropout_p=0.17, seed=0))  # regression: first key tile at odd key 7
def test_forward_matches_reference(case: Case) -> None:
    _check_forward(case)


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("shape, options", [
    ((2, 3, 333, 290, 128, 128), {}),
    ((2, 2, 300, 517, 64, 64), {"causal": True}),  # five key tiles: the overlapped pipeline's steady state
    ((1, 1, 70, 129, 48, 64), {}),  # two key tiles, the second one key wide
    ((1, 2, 200, 700, 128, 128), {"scale": -0.3}),  # a negative scale takes the general score path
    ((1, 2, 1, 77, 100, 112), {"causal": True}),
    ((2, 2, 290, 333, 256, 256), {"causal": "top_left"}),
    ((1, 3, 200, 200, 128, 64), {"window": (40, 7), "q_lengths": np.array([150]), "kv_lengths": np.array([171])}),
    ((2, 2, 130, 150, 200, 136), {"softcap": 5.0, "dropout_p": 0.2, "seed": 3}),
    ((1, 2, 129, 140, 128, 128), {"bias": np.linspace(-2, 2, 129 * 140).reshape(129, 140), "alibi_slopes": np.array([0.5, 0.1])}),
])
def test_hopper_forward_matches_reference(dtype, shape, options) -> None:
    """The wgmma forward (compute capability 9.0) on partial tiles, every option kind."""
    arch, smem = _sm90_limits("wgmma kernels need")
    b, h, lq, lk, d, dv = shape
    assert select_forward(np.dtype(dtype).name, d, dv, arch, smem, scores=EVERY_OPTION if set(options) - {"causal"} else PLAIN).policy \
        == "wgmma"
    options = {n: (x.astype(dtype) if n == "bias" else x) for n, x in options.items()}
    _check_forward(_case((b, h, lq, d), (b, h, lk, d), dv=dv, dtype=dtype, **options))


@pytest.mark.parametrize("shape, options", [
    ((2, 3, 3, 333, 290, 128, 128), {}),
    ((2, 4, 2, 300, 517, 128, 128), {"causal": True}),  # GQA; 17 key tiles: the loop's steady state
    ((1, 2, 1, 70, 33, 80, 112), {}),  # Dv wider than D, MQA, the second key tile one key wide
    ((1, 2, 2, 1, 77, 100, 112), {"causal": True}),
    ((2, 2, 2, 290, 333, 128, 128), {"causal": "top_left"}),
    ((1, 3, 3, 200, 200, 128, 64), {"window": (40, 7), "q_lengths": np.array([150]), "kv_lengths": np.array([171])}),
    ((1, 2, 2, 129, 1, 128, 128), {}),  # one key: one tile, no loop iteration
    ((1, 2, 2, 64, 64, 97, 97), {"scale": -0.3}),  # two key tiles
    ((1, 2, 1, 150, 90, 120, 120), {"causal": True}),  # bottom-right, lq > lk: 60 rows without keys
    ((2, 2, 2, 111, 111, 104, 104), {"window": (9, 30), "kv_lengths": np.array([111, 50])}),
    ((1, 1, 1, 64, 8192, 128, 128), {}),  # 256 key tiles: O's per-tile sums keep float32 accuracy
    ((1, 2, 2, 200, 70, 128, 128), {"causal": True}),  # two row blocks without a key tile: neither warpgroup waits
])
def test_hopper_tf32x3_forward_matches_reference(shape, options) -> None:
    """The float32 forward on 3xTF32 warpgroup products (compute capability 9.0, head dims
    97 to 128, no score option) on partial tiles and every band; 0 to 256 key tiles, so the
    producer's and consumer's barriers meet at every pipeline depth."""
    arch, smem = _sm90_limits("3xTF32 wgmma kernels need")
    b, hq, hk, lq, lk, d, dv = shape
    assert select_forward("float32", d, dv, arch, smem).policy == "wgmma_tf32x3"
    _check_forward(_case((b, hq, lq, d), (b, hk, lk, d), dv=dv, dtype=F32, **options))


def test_hopper_tf32x3_packed_forward_equals_padded() -> None:
    """Packed sequences (cu_seqlens) through the 3xTF32 wgmma forward equal the padded batch
    bit for bit: the same tiles from each sequence's start."""
    _sm90_limits("3xTF32 wgmma kernels need")
    ql, kl = np.array([70, 1, 130]), np.array([90, 77, 5])
    case = _case((3, 2, 130, 128), (3, 2, 90, 128), dtype=F32)
    packed = [cupy.asarray(padded_to_packed(x, n)) for x, n in ((case.q, ql), (case.k, kl), (case.v, kl))]
    out = fc.flash_attention(*packed, cu_seqlens_q=cu_seqlens(ql), cu_seqlens_k=cu_seqlens(kl), causal=True,
                             backend="cuda").get()
    padded = fc.flash_attention(*(cupy.asarray(x) for x in (case.q, case.k, case.v)), causal=True, q_lengths=ql,
                                kv_lengths=kl, backend="cuda").get()
    assert np.array_equal(out, padded_to_packed(padded, ql))


#: (dtype, head dim) reaching every forward mainloop that runs score options on compute
#: capability 9.0: the overlapped wgmma one (64, 128), the serial one on wgmma (256) and on
#: mma.sync (96, 512), 3xTF32 and DMMA.
OPTION_PIPELINES = ((F16, 64), (BF16, 128), (F16, 256), (BF16, 96), (F16, 512), (F32, 64), (F64, 64))


def _operand_on_device(x: np.ndarray, layout: str):
    """A bias or mask on the device as a caller may hand it over: "contiguous"; "transposed"
    (memory of the last two axes swapped, seen back as x: keys strided, rows contiguous);
    "padded" (each row inside a row three elements longer: an odd row stride)."""
    if layout == "transposed" and x.ndim >= 2:
        return cupy.asarray(np.ascontiguousarray(np.swapaxes(x, -1, -2))).swapaxes(-1, -2)
    if layout == "padded":
        wide = np.zeros(x.shape[:-1] + (x.shape[-1] + 3,), x.dtype)
        wide[..., : x.shape[-1]] = x
        return cupy.asarray(wide)[..., : x.shape[-1]]
    return cupy.asarray(x)


@pytest.mark.parametrize("dtype, d", OPTION_PIPELINES)
@given(data=st.data())
@settings(max_examples=max(1, GPU_SETTINGS.max_examples // 6), deadline=None)  # a kernel per option set drawn
def test_forward_score_operands_match_reference(dtype, d, data) -> None:
    """Bias and mask tiles staged in shared memory with each key tile's K (score/tiles.cuh),
    on every forward pipeline: every broadcast shape, aligned rows (16-byte copies) and not
    (an odd Lk, strided keys, an odd row stride: element by element), several key tiles a
    row block so that the stages alternate, masked rows and a whole masked tile, beside the
    band, lengths, softcap and dropout."""
    b, h = 2, 2
    lq = data.draw(st.sampled_from([1, 63, 65, 130, 300]), label="lq")
    lk = data.draw(st.sampled_from([1, 17, 64, 129, 257, 384]), label="lk")
    rs = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="values"))
    shapes = st.sampled_from([(lq, lk), (h, lq, lk), (b, 1, lq, lk), (b, 1, 1, lk), (lq, 1), (b, h, lq, lk)])
    layouts = st.sampled_from(["contiguous", "transposed", "padded"])
    options: dict = {}
    if data.draw(st.booleans(), label="bias"):
        options["bias"] = rs.standard_normal(data.draw(shapes)).astype(data.draw(st.sampled_from([dtype, F32])))
    if data.draw(st.booleans(), label="mask") or not options:
        mask = rs.random(data.draw(shapes)) < data.draw(st.sampled_from([0.9, 0.5]))
        if mask.shape[-2] > 1:
            mask[..., rs.integers(0, mask.shape[-2]), :] = False  # a fully masked row
        mask[..., 64:128, 64:128] = False  # a whole masked tile amid live ones where rows and keys reach it
        options["mask"] = mask
    if data.draw(st.booleans(), label="band"):
        options.update(data.draw(st.sampled_from([{"causal": True}, {"causal": "top_left"}, {"window": (40, 3)}])))
    if data.draw(st.booleans(), label="lengths"):
        options["q_lengths"], options["kv_lengths"] = np.array([lq, lq // 2]), np.array([lk // 3, lk])
    if data.draw(st.booleans(), label="softcap"):
        options["softcap"] = 5.0
    if data.draw(st.booleans(), label="dropout"):
        options["dropout_p"], options["seed"] = 0.3, data.draw(st.integers(0, 2**64 - 1), label="seed")
    case = _case((b, h, lq, d), (b, h, lk, d), dtype=dtype, data_seed=1, **options)
    device = {n: (_operand_on_device(x, data.draw(layouts, label=f"{n} layout")) if n in ("bias", "mask") else x)
              for n, x in options.items()}
    q, k, v = (cupy.asarray(x) for x in (case.q, case.k, case.v))
    out, lse = fc.flash_attention(q, k, v, return_lse=True, backend="cuda", **device)
    ref, naive = case.references(with_backward=False)
    assert_rule("out", out.get(), ref["out"], naive["out"], dtype)
    assert_rule("lse", lse.get(), ref["lse"], naive["lse"], dtype)


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64])
def test_deterministic_backward_with_dropout_matches_reference(dtype) -> None:
    """The query-major dQ kernel (deterministic=True) draws its dropout bits in quads
    (DropoutBits::quads), as the forward does."""
    case = _case((2, 2, 130, 64), (2, 2, 257, 64), dtype=dtype, causal=True, dropout_p=0.3, seed=2**40 + 3,
                 dropout_offset=9, bias=np.linspace(-1, 1, 130 * 257).reshape(130, 257).astype(np.float32))
    _check_backward(case, deterministic=True)


@GPU_SETTINGS
@given(cases())
def test_portable_path_matches_reference(case: Case) -> None:
    """The SIMT kernels GPUs before sm_80 run, forced on this GPU."""
    with mock.patch.dict(os.environ, {FORCE_PORTABLE_ENV: "1"}):
        _check_forward(case)


@GPU_SETTINGS
@given(cases(dtypes=(F32,)))
def test_tf32_close_to_reference(case: Case) -> None:
    """allow_tf32 trades float32 accuracy for tensor cores: 10-bit mantissas in both products."""
    q, k, v = (_device(x) for x in (case.q, case.k, case.v))
    out = fc.flash_attention(q, k, v, allow_tf32=True, backend="cuda", **_device_options(case.options)).get()
    ref, _ = case.references(with_backward=False)
    finite = np.isfinite(ref["out"])
    assert np.array_equal(np.isfinite(out), finite)
    assert np.max(np.abs(out - ref["out"])[finite], initial=0.0) <= 4e-3 * max(1.0, np.abs(ref["out"][finite]).max(initial=0.0))


def test_philox_equals_curand() -> None:
    """Our device Philox, cuRAND's Philox4_32_10 (through curand_init's counter and key) and rng.py agree."""
    rs = np.random.default_rng(0)
    n = 4096
    ctr = rs.integers(0, 2**32, (n, 4), dtype=np.uint64).astype(np.uint32)
    ctr[:, 1] %= 2**30  # curand_init's offset is 4 * (x | y << 32) in 64 bits
    key = rs.integers(0, 2**32, (n, 2), dtype=np.uint64).astype(np.uint32)
    results = {}
    device = cupy.cuda.Device().id
    for name in ("philox_ours", "philox_curand"):
        out = cupy.zeros((n, 4), dtype=cupy.uint32)
        kernels.get_function("philox_test", name, device)(
            ((n + 127) // 128,), (128,), (cupy.asarray(ctr), cupy.asarray(key), out, np.int32(n))
        )
        results[name] = out.get()
    host = np.stack(rng.philox4x32_10(tuple(ctr.T), tuple(key.T)), axis=1)
    np.testing.assert_array_equal(results["philox_ours"], host)
    np.testing.assert_array_equal(results["philox_curand"], host)


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64])
def test_dropout_bits_equal_dropout_mask(dtype) -> None:
    """With v = I the output row is the dropped-out probability row: zero exactly where dropped."""
    lq, lk, p, seed = 70, 48, 0.35, 2**33 + 17
    rs = np.random.default_rng(1)
    q = cupy.asarray((0.1 * rs.standard_normal((2, 3, lq, 16))).astype(dtype))
    k = cupy.asarray((0.1 * rs.standard_normal((2, 3, lk, 16))).astype(dtype))
    v = cupy.asarray(np.broadcast_to(np.eye(lk, dtype=dtype), (2, 3, lk, lk)).copy())
    out = fc.flash_attention(q, k, v, dropout_p=p, seed=seed, dropout_offset=3, backend="cuda").get()
    keep = fc.dropout_mask((2, 3, lq, lk), p, seed, offset=3)
    np.testing.assert_array_equal(out != 0, keep)


def test_results_are_bitwise_repeatable() -> None:
    case = _case((2, 4, 333, 64), (2, 2, 333, 64), causal=True, dropout_p=0.2, seed=5)
    q, k, v = (cupy.asarray(x) for x in (case.q, case.k, case.v))
    runs = [fc.flash_attention(q, k, v, backend="cuda", **case.options).get() for _ in range(3)]
    for r in runs[1:]:
        np.testing.assert_array_equal(r, runs[0])


def test_numpy_in_numpy_out_through_the_gpu() -> None:
    case = _case((2, 2, 50, 32), (2, 2, 60, 32), dtype=F32)
    out = fc.flash_attention(case.q, case.k, case.v, backend="auto")
    assert type(out) is np.ndarray and out.dtype == np.float32
    ref, naive = case.references(with_backward=False)
    assert_rule("out", out, ref["out"], naive["out"], F32)


def test_torch_in_torch_out_zero_copy() -> None:
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(2, 4, 100, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    out = fc.flash_attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.float16
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert (out.float() - ref).abs().max().item() < 5e-3


@pytest.mark.parametrize("lq, lk", [(0, 5), (5, 0), (1, 1)])
def test_empty_and_single_lengths(lq, lk) -> None:
    case = _case((2, 3, lq, 16), (2, 3, lk, 16), dtype=F32)
    _check_forward(case)


def test_fully_masked_rows_are_zero_with_minus_inf_lse() -> None:
    mask = np.ones((40, 50), bool)
    mask[[0, 13, 39]] = False
    case = _case((2, 2, 40, 64), (2, 2, 50, 64), mask=mask)
    _check_forward(case)


@given(st.data())
@settings(max_examples=15, deadline=None)
def test_varlen_equals_padded(data) -> None:
    batch, hq, lq, lk = 3, 2, data.draw(st.integers(1, 150)), data.draw(st.integers(1, 150))
    dtype = data.draw(st.sampled_from([F16, F64]))
    case = _case((batch, hq, lq, 64), (batch, hq, lk, 64), dtype=dtype, data_seed=data.draw(st.integers(0, 99)))
    rs = np.random.default_rng(data.draw(st.integers(0, 99)))
    ql, kl = rs.integers(0, lq + 1, batch), rs.integers(0, lk + 1, batch)
    ql[0], kl[0] = lq, lk
    opts = {"causal": data.draw(st.sampled_from([False, True])), "dropout_p": 0.2, "seed": 3, "backend": "cuda"}
    q, k, v = (cupy.asarray(x) for x in (case.q, case.k, case.v))
    padded = fc.flash_attention(q, k, v, q_lengths=ql, kv_lengths=kl, **opts).get()
    packed = [cupy.asarray(padded_to_packed(x, n)) for x, n in ((case.q, ql), (case.k, kl), (case.v, kl))]
    out = fc.flash_attention_varlen(*packed, cu_seqlens(ql), cu_seqlens(kl), **opts).get()
    np.testing.assert_array_equal(out, padded_to_packed(padded, ql))


def test_more_than_65535_heads() -> None:
    """batch x heads beyond gridDim.y's limit of 65535."""
    case = _case((70000, 1, 3, 8), (70000, 1, 5, 8), dtype=F32)
    q, k, v = (cupy.asarray(x) for x in (case.q, case.k, case.v))
    out = fc.flash_attention(q, k, v, backend="cuda").get()
    ref = fc.attention_reference(case.q, case.k, case.v)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- backward


def _check_backward(case: Case, deterministic: bool = False) -> None:
    q, k, v, dout = (_device(x) for x in (case.q, case.k, case.v, case.dout))
    options = _device_options(case.options)
    bias_grad = "bias" in options
    out, lse = fc.flash_attention_forward(q, k, v, backend="cuda", **options)
    grads = fc.flash_attention_backward(dout, q, k, v, out, lse, bias_grad=bias_grad, deterministic=deterministic,
                                        backend="cuda", **options)
    ref, naive = case.references()
    terms = cancelling_terms(case, ref)
    for name, x, g in zip(("dq", "dk", "dv"), (case.q, case.k, case.v), grads):
        assert isinstance(g, cupy.ndarray) and g.dtype == case.dtype and g.shape == x.shape, name
        assert_rule(name, g.get(), ref[name], naive[name], case.dtype, terms[name])
    named = dict(zip(gradient_names(options), grads, strict=True))
    if bias_grad:
        bias = case.options["bias"]
        dbias = named["dbias"].get()
        assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
        floor_dtype = max(case.dtype, bias.dtype, key=lambda d: FLOOR[d])
        assert_rule("dbias", dbias, ref["dbias"], naive["dbias"], floor_dtype, terms["dbias"])
    if "sinks" in options:
        dsinks = named["dsinks"]
        assert isinstance(dsinks, cupy.ndarray) and dsinks.shape == np.shape(case.options["sinks"])
        assert_rule("dsinks", dsinks.get(), ref["dsinks"], naive["dsinks"], case.dtype, terms["dsinks"])


@GPU_SETTINGS
@given(cases())
@example(_case((2, 4, 300, 64), (2, 2, 257, 64), causal=True, dropout_p=0.25, seed=11, bias=np.ones((1, 300, 257), np.float16)))
@example(_case((1, 2, 97, 256), (1, 2, 130, 256), dtype=F64, softcap=3.0, window=(20, 5)))
@example(_case((2, 1, 64, 128), (2, 1, 80, 128), dv=40, dtype=BF16, alibi_slopes=np.array([0.3])))
def test_backward_matches_reference(case: Case) -> None:
    _check_backward(case)


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("shape, options", [
    ((2, 3, 3, 333, 290, 128, 128), {}),
    ((2, 4, 2, 300, 517, 64, 64), {"causal": True}),  # GQA: two query heads per block, many tiles each
    ((1, 2, 1, 70, 129, 48, 64), {}),  # MQA, Dv wider than D, the last key block one key wide
    ((1, 2, 2, 1, 77, 100, 112), {"causal": True}),
    ((2, 2, 2, 290, 333, 128, 128), {"causal": "top_left"}),
    ((1, 3, 3, 200, 200, 128, 64), {"window": (40, 7), "q_lengths": np.array([150]), "kv_lengths": np.array([171])}),
    ((1, 2, 2, 129, 1, 64, 64), {}),  # one key: 127 padding keys in the block
    ((1, 1, 1, 64, 64, 33, 33), {"scale": -0.3}),
    ((2, 2, 2, 150, 290, 256, 256), {"causal": "top_left"}),  # two gradient chunks, one stage
    ((1, 2, 1, 70, 130, 200, 256), {"causal": True}),
])
def test_hopper_backward_matches_reference(dtype, shape, options) -> None:
    """The wgmma backward (compute capability 9.0, no score option) on partial tiles."""
    arch, smem = _sm90_limits("wgmma kernels need")
    b, hq, hk, lq, lk, d, dv = shape
    assert select_backward(np.dtype(dtype).name, d, dv, arch, smem).policy == "wgmma"
    _check_backward(_case((b, hq, lq, d), (b, hk, lk, d), dv=dv, dtype=dtype, **options))


#: (dtype, head dim) of the wgmma backward's element passes with score options: two passes
#: with the bias and mask staged with Q (64; 128 in 64-column chunks with a bias or with sets
#: too large for 128-wide dK and dV), two passes reading them in the first (128, at most two
#: options), full_elements' one pass (softcap everywhere; 256 with a bias or dropout).
HOPPER_OPTION_BACKWARDS = ((F16, 64), (BF16, 64), (F16, 128), (BF16, 256))


def _drawn_options(data, rs: np.random.Generator, names: list[str], b: int, hq: int, lq: int, lk: int,
                   bias_dtypes: tuple) -> dict:
    """The options ``names`` of a (b, hq, lq, lk) call drawn for the option tests: bias and mask
    of every broadcast shape (a fully masked row, a masked (64, 64) tile), a block mask, ALiBi,
    softcap, dropout, and maybe a band and lengths."""
    shapes = st.sampled_from([(lq, lk), (hq, lq, lk), (b, 1, lq, lk), (b, 1, 1, lk), (b, hq, lq, lk)])
    options: dict = {}
    if "bias" in names:  # beside a mask, a float64 bias at D = 64 takes one stage (two do not fit)
        options["bias"] = rs.standard_normal(data.draw(shapes)).astype(data.draw(st.sampled_from(bias_dtypes)))
    if "mask" in names:
        mask = rs.random(data.draw(shapes)) < 0.8
        if mask.shape[-2] > 1:
            mask[..., rs.integers(0, mask.shape[-2]), :] = False  # a fully masked row
        mask[..., 64:128, 64:128] = False  # a whole masked tile where rows and keys reach it
        options["mask"] = mask
    if "block_mask" in names:
        options["block_size"] = data.draw(st.sampled_from([16, 64]), label="block_size")
        blocks = (-(-lq // options["block_size"]), -(-lk // options["block_size"]))
        options["block_mask"] = rs.random((hq,) + blocks) < 0.7
    if "alibi" in names:
        options["alibi_slopes"] = rs.uniform(0.05, 0.5, (b, hq)).astype(np.float32)
    if "softcap" in names:
        options["softcap"] = 5.0
    if "dropout" in names:
        options["dropout_p"], options["seed"] = 0.3, data.draw(st.integers(0, 2**64 - 1), label="seed")
    if data.draw(st.booleans(), label="band"):
        options.update(data.draw(st.sampled_from([{"causal": True}, {"causal": "top_left"}, {"window": (40, 3)}])))
    if data.draw(st.booleans(), label="lengths"):
        options["q_lengths"], options["kv_lengths"] = np.array([lq, lq // 2]), np.array([lk // 3, lk])
    return options


def _scores_of(options: dict) -> ScoreSet:
    """The option set (ScoreSet) the kernels compile for a call's options."""
    bias = options.get("bias")
    return ScoreSet.of(bias_dtype=None if bias is None else bias.dtype.name, mask="mask" in options,
                       block_mask="block_mask" in options, alibi="alibi_slopes" in options,
                       softcap="softcap" in options, dropout="dropout_p" in options)


@pytest.mark.parametrize("dtype, d", HOPPER_OPTION_BACKWARDS)
@given(data=st.data())
@settings(max_examples=max(1, GPU_SETTINGS.max_examples // 4), deadline=None)  # a kernel per option set drawn
def test_hopper_backward_score_options_match_reference(dtype, d, data) -> None:
    """The wgmma dK/dV kernel with score options (OptionElements, full_elements): every option
    alone and together as far as the rules keep them on it, partial query and key tiles, GQA,
    fully masked rows and a masked tile, the band and lengths; dbias reduced over the
    broadcast axes."""
    arch, smem = _sm90_limits("wgmma kernels need")
    b, hq, hk = 2, 2, 1
    lq = data.draw(st.sampled_from([1, 65, 130, 300]), label="lq")
    lk = data.draw(st.sampled_from([1, 63, 129, 257]), label="lk")
    rs = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="values"))
    names = data.draw(st.lists(st.sampled_from(["bias", "mask", "block_mask", "alibi", "softcap", "dropout"]),
                               min_size=1, max_size=6, unique=True), label="options")
    wide = d > 128 or set(names) & {"softcap", "block_mask"}  # spec.wgmma_backward_takes: no chunks
    if d > 64 and wide:
        del names[2:]  # at most two options
    if d > 64 and wide and "dropout" in names and not set(names) <= {"dropout", "bias"}:
        names.remove("dropout")  # dropout alone or beside a bias
    pair = set(names)
    if (d > 64 and wide and pair == {"mask", "block_mask"}) or (d > 128 and pair == {"softcap", "mask"}):
        names.remove("mask")  # these pairs take mma.sync
    if {"softcap", "dropout"} <= set(names) and set(names) & {"mask", "block_mask"}:
        names.remove("dropout")  # softcap, dropout and a mask take mma.sync (spec.wgmma_backward_takes)
    options = _drawn_options(data, rs, names, b, hq, lq, lk, (dtype, F32, F64))
    case = _case((b, hq, lq, d), (b, hk, lk, d), dtype=dtype, **options)
    scores = _scores_of(options)
    assert select_backward(np.dtype(dtype).name, d, d, arch, smem, scores=scores).policy == "wgmma"
    _check_backward(case)


@pytest.mark.parametrize("dtype, d", [(F32, 64), (F32, 128), (F64, 64), (F64, 128), (F16, 32)])
@given(data=st.data())
@settings(max_examples=max(1, GPU_SETTINGS.max_examples // 4), deadline=None)  # a kernel per option set drawn
def test_warp_backward_staged_options_match_reference(dtype, d, data) -> None:
    """The one-role warp dK/dV kernel (3xTF32, DMMA, and mma.sync with two 16-key groups a warp
    at D = 32) with the bias or the mask staged with each query tile (BwdWarp's Staged,
    OptionElements' two passes): every shape of them, partial tiles, GQA, fully masked rows
    and tiles, the band, lengths and the other options beside them."""
    b, hq, hk = 2, 2, 1
    lq = data.draw(st.sampled_from([1, 33, 130, 300]), label="lq")
    lk = data.draw(st.sampled_from([1, 63, 129, 257]), label="lk")
    rs = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="values"))
    staged = data.draw(st.sampled_from([["bias"], ["mask"]]), label="staged")
    others = data.draw(st.lists(st.sampled_from(["block_mask", "alibi", "dropout"]), max_size=2, unique=True),
                       label="others")
    options = _drawn_options(data, rs, staged + others, b, hq, lq, lk, (F32, F64, F16))
    case = _case((b, hq, lq, d), (b, hk, lk, d), dtype=dtype, **options)
    scores = _scores_of(options)
    arch, smem = cuda.device_limits(cupy.cuda.Device().id)
    spec = select_backward(np.dtype(dtype).name, d, d, arch, smem, scores=scores)
    assert spec.mainloop == "BwdWarp" and spec.stages_scores
    _check_backward(case)


@pytest.mark.parametrize("dtype, d", [(F16, 64), (BF16, 64), (F16, 128)])
@given(data=st.data())
@settings(max_examples=max(1, GPU_SETTINGS.max_examples // 4), deadline=None)  # a kernel per option set drawn
def test_hopper_backward_staged_bias_mask_dropout_match_reference(dtype, d, data) -> None:
    """The wgmma dK/dV kernel with a bias, a mask and dropout together, their tiles staged
    with Q (BwdWgmma's Staged; at D = 128 in 64-column chunks): every broadcast shape and bias
    dtype, ALiBi and a block mask beside them, partial tiles, GQA, fully masked rows and tiles,
    the band, lengths."""
    arch, smem = _sm90_limits("wgmma kernels need")
    b, hq, hk = 2, 2, 1
    lq = data.draw(st.sampled_from([1, 65, 130, 300]), label="lq")
    lk = data.draw(st.sampled_from([1, 63, 129, 257]), label="lk")
    rs = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="values"))
    others = data.draw(st.lists(st.sampled_from(["block_mask", "alibi"]), unique=True), label="others")
    options = _drawn_options(data, rs, ["bias", "mask", "dropout"] + others, b, hq, lq, lk, (dtype, F32, F64))
    case = _case((b, hq, lq, d), (b, hk, lk, d), dtype=dtype, **options)
    spec = select_backward(np.dtype(dtype).name, d, d, arch, smem, scores=_scores_of(options))
    assert spec.policy == "wgmma" and spec.stages_scores and spec.kv_chunk == 64
    _check_backward(case)


@pytest.mark.parametrize("dtype, d", [(F16, 64), (BF16, 128), (F32, 64), (F64, 32)])
@pytest.mark.parametrize("masks", ["block128", "block64+window", "block128+mask", "padding+softcap",
                                   "block64+mask+lengths"])
def test_tiles_kept_whole_match_reference(dtype, d, masks) -> None:
    """Tiles the masks keep whole (the tile maps' whole bit) skip the block mask's reads and,
    in the backward, take the fast element passes: blocks of 128 (tiles whole or dead) or 64
    (tiles mixed too), some dropped, some kept, beside a mask kept whole in one corner and mixed
    elsewhere; a key-padding mask beside softcap (one element pass); a window; lengths shorter
    than the frame; partial tiles, GQA, causal and not."""
    rs = np.random.default_rng(d + len(masks))
    lq, lk = 300, 420
    options: dict = {}
    if masks.startswith("block"):
        bs = 128 if masks.startswith("block128") else 64
        block_mask = rs.random((2, -(-lq // bs), -(-lk // bs))) < 0.7
        block_mask[:, 0, 0] = True
        options.update(block_mask=block_mask, block_size=bs)
    if "+mask" in masks:
        mask = rs.random((lq, lk)) < 0.9
        mask[:128, :256] = True  # whole tiles beside a mask
        options["mask"] = mask
    if masks == "padding+softcap":
        options["mask"] = np.arange(lk)[None, None, None, :] < np.array([lk, 333])[:, None, None, None]
        options["softcap"] = 5.0
    if masks.endswith("+window"):
        options["window"] = (200, 150)
    if masks.endswith("+lengths"):
        options["q_lengths"], options["kv_lengths"] = np.array([lq, 170]), np.array([250, lk])
    for causal in (False, True):
        case = _case((2, 2, lq, d), (2, 1, lk, d), dtype=dtype, data_seed=d, causal=causal, **options)
        _check_forward(case)
        _check_backward(case)


def test_tf32_backward_with_staged_bias_and_mask_close_to_reference() -> None:
    """allow_tf32's backward (one TF32 product per product) with the bias and mask staged."""
    rs = np.random.default_rng(12)
    mask = rs.random((130, 129)) < 0.8
    mask[7] = False
    case = _case((2, 2, 130, 64), (2, 1, 129, 64), dtype=F32, causal=True,
                 bias=rs.standard_normal((2, 1, 130, 129)).astype(F32), mask=mask)
    arch, smem = cuda.device_limits(cupy.cuda.Device().id)
    scores = ScoreSet.of(bias_dtype="float32", mask=True)
    assert select_backward("float32", 64, 64, arch, smem, True, scores=scores).stages_scores
    q, k, v, dout = (_device(x) for x in (case.q, case.k, case.v, case.dout))
    options = _device_options(case.options)
    out, lse = fc.flash_attention_forward(q, k, v, allow_tf32=True, backend="cuda", **options)
    grads = fc.flash_attention_backward(dout, q, k, v, out, lse, allow_tf32=True, backend="cuda", **options)
    ref, _ = case.references()
    for name, g in zip(("dq", "dk", "dv"), grads):
        want = ref[name]
        assert np.max(np.abs(g.get() - want)) <= 1e-2 * max(1.0, np.abs(want).max()), name


def _structured_mask(rs: np.random.Generator, kind: str, shape: tuple[int, ...], tile: int) -> np.ndarray:
    """A boolean mask of ``shape`` (..., Lq, Lk) whose tiles are often all masked: "documents"
    (block diagonal, each query and key in one of a few segments), "tiles" (random
    (tile, tile) squares masked, the rest kept with probability 0.9) or "padding" (each
    broadcast row keeps a random prefix of keys, possibly none)."""
    lq, lk = shape[-2:]
    if kind == "documents":
        docs = rs.integers(1, 5)
        q_doc = np.sort(rs.integers(0, docs, lq))
        k_doc = np.sort(rs.integers(0, docs, lk))
        return np.broadcast_to(q_doc[:, None] == k_doc[None, :], shape).copy()
    if kind == "tiles":
        mask = rs.random(shape) < 0.9
        dead = rs.random(shape[:-2] + (-(-lq // tile), -(-lk // tile))) < 0.5
        return mask & ~np.repeat(np.repeat(dead, tile, -2), tile, -1)[..., :lq, :lk]
    keep = rs.integers(0, lk + 1, shape[:-1])
    return np.arange(lk) < keep[..., None]


def _expected_tile_map(keep: np.ndarray, rows: int, cols: int, key_major: bool) -> np.ndarray:
    """score/tile_map.cuh's map of a (planes..., Lq, Lk) keep array, in NumPy: per outer tile
    (rows queries, or cols keys when key-major) and inner tile along the other axis, the first
    position of a live tile at or after it, plus 1 where that tile is kept whole; the axis'
    length in whole tiles where none is live."""
    if key_major:
        keep, outer, inner = keep.swapaxes(-1, -2), cols, rows
    else:
        outer, inner = rows, cols
    n_outer, n_inner = -(-keep.shape[-2] // outer), -(-keep.shape[-1] // inner)
    expected = np.empty(keep.shape[:-2] + (n_outer, n_inner), dtype=np.int32)
    for plane in np.ndindex(keep.shape[:-2]):
        for o in range(n_outer):
            strip = keep[plane][o * outer:(o + 1) * outer]
            entry = n_inner * inner
            for n in reversed(range(n_inner)):
                tile = strip[:, n * inner:(n + 1) * inner]
                if tile.any():
                    entry = n * inner | int(tile.all())
                expected[plane + (o, n)] = entry
    return expected


@pytest.mark.parametrize("kind", ["documents", "tiles", "padding"])
@pytest.mark.parametrize("with_block_mask", [False, True])
def test_tile_maps_name_the_next_live_tile_and_whole_ones(kind, with_block_mask) -> None:
    """Every tile map a forward and a deterministic backward launch (query-major for the
    forward and dQ kernels, key-major for dK/dV) against its NumPy form: dead tiles skipped and
    whole ones marked exactly, not merely a superset of the live ones."""
    b, hq, lq, lk, d = 2, 2, 300, 517, 64
    rs = np.random.default_rng(7)
    shape = (b, 1, 1, lk) if kind == "padding" else (b, hq, lq, lk)
    options: dict = {"mask": _structured_mask(rs, kind, shape, 64)}
    keep = np.broadcast_to(options["mask"], (b, hq, lq, lk))
    if with_block_mask:
        options["block_size"] = 32
        options["block_mask"] = rs.random((b, 1, -(-lq // 32), -(-lk // 32))) < 0.7
        blocks = options["block_mask"].repeat(32, -2).repeat(32, -1)[..., :lq, :lk]
        keep = keep & blocks
    captured = []
    fields_of = cuda._tile_map_fields

    def capture(pb, maps, xp):
        fields, arrays = fields_of(pb, maps, xp)
        captured.extend(zip(maps, arrays))
        return fields, arrays

    case = _case((b, hq, lq, d), (b, hq, lk, d), **options)
    q, k, v, dout = (cupy.asarray(x) for x in (case.q, case.k, case.v, case.dout))
    with mock.patch.object(cuda, "_tile_map_fields", capture):
        out, lse = fc.flash_attention_forward(q, k, v, backend="cuda", **_device_options(options))
        fc.flash_attention_backward(dout, q, k, v, out, lse, deterministic=True, backend="cuda",
                                    **_device_options(options))
    assert {m.key_major for m, _ in captured} == {False, True}
    for tile_map, array in captured:
        got = array.get()
        expected = _expected_tile_map(keep[:got.shape[0], :got.shape[1]], tile_map.rows, tile_map.cols,
                                      tile_map.key_major)
        np.testing.assert_array_equal(got, expected, err_msg=str(tile_map))


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64])
@given(data=st.data())
@settings(max_examples=max(1, GPU_SETTINGS.max_examples // 4), deadline=None)
def test_masks_with_dead_tiles_match_reference(dtype, data) -> None:
    """Masks that rule out whole tiles at every granularity (score/tile_map.cuh's maps: the
    forward's and the dQ kernel's query-major walk, the dK/dV kernel's key-major one over a
    GQA group): block-diagonal documents, random dead squares and key padding, every
    broadcast shape, with a block mask, the band and lengths; forward and backward, fused dQ
    and deterministic."""
    b, (hq, hk) = 2, data.draw(st.sampled_from([(2, 1), (4, 2), (2, 2)]), label="heads")
    lq = data.draw(st.sampled_from([1, 17, 64, 100, 257, 513]), label="lq")
    lk = data.draw(st.sampled_from([1, 31, 64, 130, 257, 600]), label="lk")
    d = data.draw(st.sampled_from([32, 64, 128]), label="d")
    rs = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="values"))
    kind = data.draw(st.sampled_from(["documents", "tiles", "padding"]), label="kind")
    shapes = [(b, 1, 1, lk)] if kind == "padding" else [(lq, lk), (hq, lq, lk), (b, 1, lq, lk), (b, hq, lq, lk)]
    shape = data.draw(st.sampled_from(shapes), label="shape")
    options: dict = {"mask": _structured_mask(rs, kind, shape, data.draw(st.sampled_from([16, 32, 64, 128])))}
    if data.draw(st.booleans(), label="block_mask"):
        options["block_size"] = data.draw(st.sampled_from([16, 64]), label="block_size")
        blocks = (-(-lq // options["block_size"]), -(-lk // options["block_size"]))
        options["block_mask"] = rs.random((b, 1) + blocks) < 0.6
    if data.draw(st.booleans(), label="band"):
        options.update(data.draw(st.sampled_from([{"causal": True}, {"causal": "top_left"}, {"window": (40, 3)}])))
    if data.draw(st.booleans(), label="lengths"):
        options["q_lengths"], options["kv_lengths"] = np.array([lq, lq // 2]), np.array([lk // 3, lk])
    case = _case((b, hq, lq, d), (b, hk, lk, d), dtype=dtype, **options)
    _check_forward(case)
    _check_backward(case, deterministic=data.draw(st.booleans(), label="deterministic"))


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("shape, options", [
    ((2, 3, 3, 333, 290, 128, 128), {}),
    ((2, 4, 2, 300, 517, 128, 128), {"causal": True}),  # GQA: two query heads per block
    ((1, 2, 1, 70, 129, 80, 96), {}),  # bucket 96, Dv wider than D, MQA, the last key block one key wide
    ((1, 2, 2, 1, 77, 100, 112), {"causal": True}),
    ((2, 2, 2, 290, 333, 128, 128), {"causal": "top_left"}),
    ((1, 3, 3, 200, 200, 128, 64), {"window": (40, 7), "q_lengths": np.array([150]), "kv_lengths": np.array([171])}),
    ((1, 2, 2, 129, 1, 128, 128), {}),  # one key: 63 padding keys in the block
    ((1, 1, 1, 64, 64, 97, 97), {"scale": -0.3}),
    ((1, 2, 1, 150, 90, 96, 96), {"causal": True}),  # bottom-right, lq > lk: 60 rows without keys
    ((2, 2, 2, 111, 111, 72, 72), {"window": (9, 30), "kv_lengths": np.array([111, 50])}),  # bucket 96
])
def test_split_roles_backward_matches_reference(dtype, shape, options) -> None:
    """The dK/dV kernel with two warps per 16 keys (float32 and float64 at D = 96 and 128,
    compute capability 9.0, no score option), P handed from the dV warp to the dK warp, on
    partial tiles and every band."""
    arch, smem = _sm90_limits("split roles are chosen on")
    b, hq, hk, lq, lk, d, dv = shape
    assert select_backward(np.dtype(dtype).name, d, dv, arch, smem).roles == 2
    _check_backward(_case((b, hq, lq, d), (b, hk, lk, d), dv=dv, dtype=dtype, **options))


@pytest.mark.parametrize("dtype", [F16, F32])
def test_backward_more_than_65535_heads(dtype) -> None:
    """batch x key heads beyond gridDim.y's limit, causal: the dK/dV grid's padding blocks in
    both block orders (key block by key block for float32, head by head for float16)."""
    spec = select_backward(np.dtype(dtype).name, 8, 8, *cuda.device_limits(cupy.cuda.Device().id))
    assert backward_key_block_major(spec, True) == (dtype == F32)
    _check_backward(_case((70000, 1, 3, 8), (70000, 1, 5, 8), dtype=dtype, causal=True))


@pytest.mark.parametrize("dtype, d", [(F64, 128), (F32, 96)])
def test_split_roles_packed_backward_equals_padded(dtype, d) -> None:
    """Packed sequences (cu_seqlens) through the split-roles dK/dV kernel: dK and dV equal the
    padded batch's bit for bit (same tiles from each sequence's start, no atomics), dQ (added
    by atomics in any order) to rounding."""
    _sm90_limits("split roles are chosen on")
    ql, kl = np.array([70, 1, 130]), np.array([90, 77, 5])
    case = _case((3, 2, 130, d), (3, 2, 90, d), dtype=dtype)
    opts = {"causal": True, "backend": "cuda"}
    packed = [cupy.asarray(padded_to_packed(x, n)) for x, n in ((case.q, ql), (case.k, kl), (case.v, kl))]
    _, vjp = fc.flash_attention_vjp(*packed, cu_seqlens_q=cu_seqlens(ql), cu_seqlens_k=cu_seqlens(kl), **opts)
    q, k, v = (cupy.asarray(x) for x in (case.q, case.k, case.v))
    _, padded_vjp = fc.flash_attention_vjp(q, k, v, q_lengths=ql, kv_lengths=kl, **opts)
    grads = vjp(cupy.asarray(padded_to_packed(case.dout, ql)))
    padded = [g.get() for g in padded_vjp(cupy.asarray(case.dout))]
    np.testing.assert_allclose(grads[0].get(), padded_to_packed(padded[0], ql), rtol=1e-5 if dtype == F32 else 1e-12,
                               atol=1e-6 if dtype == F32 else 1e-13)
    for got, want in zip(grads[1:3], padded[1:3]):
        np.testing.assert_array_equal(got.get(), padded_to_packed(want, kl))


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64])
@pytest.mark.parametrize("options", [{"causal": True}, {"causal": "top_left"}, {"window": (5, 0)},
                                     {"causal": True, "window": (None, 0), "kv_lengths": np.array([290])}])
def test_backward_masked_scores_past_exp_range(dtype, options) -> None:
    """Masked scores far above every kept one: the backward's masked tiles compute
    exp2(S - lse) on every element and select the masked ones away afterwards, so P overflows
    there (inf) and must not reach dQ, dK or dV (inf * 0 would be NaN). S = 2 (j - i) from
    small integers (bfloat16 rounds k's above 256, the reference alike), so inside a diagonal
    tile a masked key 45 or more past a row's last kept one exceeds float's exp2 range, while
    kept scores stay small enough for float32's rounding (float64's range needs more than
    1024: no overflow there)."""
    lq, lk = 300, 340
    rs = np.random.default_rng(3)
    q = np.zeros((1, 2, lq, 64))
    k = np.zeros((1, 2, lk, 64))
    q[..., 0], q[..., 1] = 1.0, np.arange(lq)
    k[..., 0], k[..., 1] = 2.0 * np.arange(lk), -2.0  # q_i . k_j = 2 (j - i)
    v, dout = (rs.standard_normal((1, 2, n, 64)) for n in (lk, lq))
    _check_backward(Case(*(x.astype(dtype) for x in (q, k, v, dout)), {**options, "scale": 1.0}))


@GPU_SETTINGS
@given(cases())
def test_portable_backward_matches_reference(case: Case) -> None:
    with mock.patch.dict(os.environ, {FORCE_PORTABLE_ENV: "1"}):
        _check_backward(case)


@given(cases(), st.booleans())
@settings(max_examples=20, deadline=None)
def test_deterministic_backward_is_bitwise_repeatable(case: Case, with_bias: bool) -> None:
    options = _device_options(case.options)
    if with_bias:
        scores = (case.q.shape[-2], case.k.shape[-2])  # broadcast over batch and heads: dbias reduces
        options["bias"] = cupy.asarray(np.random.default_rng(0).standard_normal(scores).astype(np.float32))
    q, k, v, dout = (_device(x) for x in (case.q, case.k, case.v, case.dout))
    out, lse = fc.flash_attention_forward(q, k, v, backend="cuda", **options)
    bias_grad = options.get("bias") is not None
    runs = [fc.flash_attention_backward(dout, q, k, v, out, lse, bias_grad=bias_grad, deterministic=True,
                                        backend="cuda", **options) for _ in range(5)]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a.get(), b.get())


def test_float64_gradients_match_central_finite_differences() -> None:
    rs = np.random.default_rng(3)
    q, k, v = rs.standard_normal((1, 2, 5, 3)), rs.standard_normal((1, 1, 6, 3)), rs.standard_normal((1, 1, 6, 2))
    dout = rs.standard_normal((1, 2, 5, 2))
    options = {"causal": True, "softcap": 2.0, "bias": rs.standard_normal((5, 6)), "backend": "cuda"}
    dev = [cupy.asarray(x) for x in (q, k, v, dout)]
    dev_opts = {**options, "bias": cupy.asarray(options["bias"])}
    out, lse = fc.flash_attention_forward(*dev[:3], **dev_opts)
    grads = [g.get() for g in fc.flash_attention_backward(dev[3], *dev[:3], out, lse, bias_grad=True, **dev_opts)]

    def loss() -> float:
        return float(np.sum(dout * fc.flash_attention(q, k, v, **{**options, "backend": "cpu"})))

    for x, g in zip((q, k, v, options["bias"]), grads):
        numeric = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            orig = x[idx]
            x[idx] = orig + 1e-6
            hi = loss()
            x[idx] = orig - 1e-6
            numeric[idx] = (hi - loss()) / 2e-6
            x[idx] = orig
        np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-8)


# --------------------------------------------------------------------------- review regressions


def test_batch_dims_that_do_not_merge_into_one_stride() -> None:
    """k broadcast over a batch dim and q with permuted batch dims: copied once, read right."""
    rs = np.random.default_rng(5)
    q0 = rs.standard_normal((3, 2, 2, 40, 32)).astype(np.float32)
    k0 = rs.standard_normal((2, 1, 2, 50, 32)).astype(np.float32)
    v = rs.standard_normal((2, 3, 2, 50, 32)).astype(np.float32)
    q = cupy.asarray(q0).transpose(1, 0, 2, 3, 4)  # (2, 3, ...) with non-mergeable strides
    k = cupy.broadcast_to(cupy.asarray(k0), (2, 3, 2, 50, 32))
    ref = fc.attention_reference(q0.transpose(1, 0, 2, 3, 4), np.broadcast_to(k0, (2, 3, 2, 50, 32)), v, causal=True)
    out = fc.flash_attention(q, k, cupy.asarray(v), causal=True, backend="cuda").get()
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
    out, lse = fc.flash_attention_forward(q, k, cupy.asarray(v), causal=True, backend="cuda")
    dout = cupy.asarray(rs.standard_normal(out.shape).astype(np.float32))
    grads = fc.flash_attention_backward(dout, q, k, cupy.asarray(v), out, lse, causal=True, backend="cuda")
    ref_grads = reference.attention_reference_backward(
        dout.get(), q0.transpose(1, 0, 2, 3, 4), np.broadcast_to(k0, (2, 3, 2, 50, 32)), v, causal=True)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g.get(), r, rtol=1e-4, atol=1e-5)


def test_backward_accepts_out_with_a_strided_last_axis() -> None:
    case = _case((2, 2, 30, 16), (2, 2, 30, 16), dtype=F32)
    q, k, v, dout = (cupy.asarray(x) for x in (case.q, case.k, case.v, case.dout))
    out, lse = fc.flash_attention_forward(q, k, v, backend="cuda")
    fortran = cupy.asfortranarray(out)
    a = fc.flash_attention_backward(dout, q, k, v, fortran, lse, backend="cuda")
    b = fc.flash_attention_backward(dout, q, k, v, out, lse, backend="cuda")
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.get(), y.get())


def test_torch_bfloat16_cuda_tensors() -> None:
    torch = pytest.importorskip("torch")
    q, k, v = (torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = fc.flash_attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert (out.double() - ref).abs().max().item() < 2e-2


def test_nan_row_has_nan_lse_and_a_row_without_keys_is_zero() -> None:
    """A row that attends no key is 0 even when a masked value is NaN; a live row is not
    shielded from it (out_i = sum_j p'_ij v_j with p' = 0 still meets 0 * NaN)."""
    case = _case((1, 1, 8, 16), (1, 1, 8, 16), dtype=F32)
    q, v = case.q.copy(), case.v.copy()
    q[0, 0, 3, 0] = np.nan
    v[0, 0, 5] = np.nan  # key 5 is masked for every row below
    mask = np.ones((8, 8), bool)
    mask[:, 5] = False
    mask[6] = False  # row 6 sees nothing: 0 and -inf, never NaN
    out, lse = fc.flash_attention(cupy.asarray(q), cupy.asarray(case.k), cupy.asarray(v), mask=cupy.asarray(mask),
                                  return_lse=True, backend="cuda")
    out, lse = out.get(), lse.get()
    assert np.isnan(lse[0, 0, 3]) and np.isnan(out[0, 0, 3]).all()
    assert lse[0, 0, 6] == -np.inf and np.all(out[0, 0, 6] == 0)
    assert np.isfinite(np.delete(lse[0, 0], [3, 6])).all()


@pytest.mark.parametrize("options", [{}, {"bias": "keys", "causal": True}, {"sinks": "heads"}],
                         ids=["planned", "bias", "sinks"])
def test_captured_calls_keep_their_temporaries_from_later_work(options) -> None:
    """A forward and backward captured in a CUDA graph replay on new query values while
    results of eager calls made after the capture are held: the graph's temporaries (the
    backward's lse copy, second lse and dQ accumulator, a broadcast bias's dbias buffer) are
    its own, so a replay writes neither those results nor anything CuPy's pool handed out
    since (the backward's row sums D, which the sinks' gradient reads, included); each
    result matches its call made alone."""
    import cupy

    rs = np.random.default_rng(8)
    shape = (2, 4, 200, 64)
    k, v, dout = (cupy.asarray(rs.standard_normal(shape).astype(F16)) for _ in range(3))
    queries = [cupy.asarray(rs.standard_normal(shape).astype(F16)) for _ in range(3)]
    if options.get("bias") == "keys":  # (B, 1, 1, Lk): its gradient sums into a buffer of the bias's shape
        options = {**options, "bias": cupy.asarray(rs.standard_normal((2, 1, 1, 200)).astype(np.float32))}
    if options.get("sinks") == "heads":
        options = {"sinks": cupy.asarray(rs.standard_normal(4))}
    grad = {"bias_grad": True} if "bias" in options else {}

    def call(x):
        out, lse = fc.flash_attention_forward(x, k, v, **options)
        return (out, lse, *fc.flash_attention_backward(dout, x, k, v, out, lse, **grad, **options))

    for got, want in captured_replays(call, queries):
        for g, w in zip(got, want, strict=True):  # dQ and dbias add by atomics: in any order
            np.testing.assert_allclose(g.astype(np.float32), w.astype(np.float32), rtol=1e-2, atol=1e-2)
