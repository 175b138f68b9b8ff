"""flashcupy.torch: the autograd Function over flashcupy, against PyTorch's SDPA.

CPU tensors run everywhere (on a machine with a GPU, ``backend="auto"`` sends
them through the GPU like NumPy arrays); tests marked ``gpu`` use CUDA tensors.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import flashcupy as fc
from flashcupy import api, reference
from flashcupy.testing import tolerance

torch = pytest.importorskip("torch")
fct = importlib.import_module("flashcupy.torch")  # after the skip: it needs torch

F = torch.nn.functional
ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers


def _randn(shape, dtype=torch.float64, device="cpu", seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)
    return x.requires_grad_(requires_grad)


def _sdpa(q, k, v, *, causal=False, mask=None, bias=None, scale=None):
    """PyTorch SDPA with flashcupy's conventions: GQA by repeating k/v heads (autograd sums
    their grads back), causal top-left (SDPA's is_causal), mask/bias as attn_mask."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    attn_mask = mask if mask is not None else bias
    if causal and attn_mask is not None:  # SDPA takes one or the other: fold top-left causal into the mask
        lq, lk = q.shape[-2], k.shape[-2]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        attn_mask = attn_mask & keep if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~keep, -torch.inf)
        causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal, scale=scale)


def _grads(out, dout, inputs):
    grads = torch.autograd.grad(out, [x for x in inputs if x is not None], dout)
    return list(grads)


def _leaves(*xs):
    return [None if x is None else x.detach().clone().requires_grad_(x.requires_grad) for x in xs]


def _max_abs(a, b):
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _scale_of(x):
    return max(1.0, x.detach().double().abs().max().item())


# --------------------------------------------------------------------------- import


def _python(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=False)


def test_import_flashcupy_does_not_import_torch() -> None:
    result = _python("import sys, flashcupy; assert 'torch' not in sys.modules, 'torch imported'")
    assert result.returncode == 0, result.stderr


def test_flashcupy_torch_without_torch_says_how_to_install() -> None:
    result = _python(
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import flashcupy.torch\nexcept ImportError as e:\n    print(e)\nelse:\n    print('imported')"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "flashcupy.torch needs PyTorch: pip install torch"


# --------------------------------------------------------------------------- against SDPA on the CPU

# (name, q shape, k shape, Dv, options for flashcupy); SDPA gets the same problem.
CPU_CASES = [
    ("plain", (2, 3, 17, 8), (2, 3, 23, 8), 8, {}),
    ("dv", (2, 2, 9, 8), (2, 2, 12, 8), 5, {}),
    ("causal_square", (1, 2, 21, 8), (1, 2, 21, 8), 8, {"causal": True}),
    ("causal_top_left", (2, 2, 13, 8), (2, 2, 29, 8), 8, {"causal": "top_left"}),
    ("mask", (2, 2, 15, 8), (2, 2, 19, 8), 8, {"mask": True}),
    ("bias", (2, 4, 11, 8), (2, 4, 14, 8), 8, {"bias": True}),
    ("gqa_scale", (2, 4, 16, 8), (2, 2, 20, 8), 8, {"scale": 0.3}),
    ("gqa_causal_bias", (1, 6, 19, 16), (1, 2, 19, 16), 16, {"causal": True, "bias": True}),
    ("one_head_2d", (13, 8), (17, 8), 8, {}),
]


def _cpu_problem(qs, ks, dv, opts, dtype, seed=0):
    q = _randn(qs, dtype, seed=seed)
    k = _randn(ks, dtype, seed=seed + 1)
    v = _randn(ks[:-1] + (dv,), dtype, seed=seed + 2)
    dout = _randn(qs[:-1] + (dv,), dtype, seed=seed + 3, requires_grad=False)
    ours, sdpa = dict(opts), {}
    if opts.get("causal"):
        sdpa["causal"] = True
    if "scale" in opts:
        sdpa["scale"] = opts["scale"]
    if opts.get("mask"):
        keep = torch.rand(qs[:-1] + (ks[-2],), generator=torch.Generator().manual_seed(seed + 4)) < 0.6
        keep[..., 0] = True  # SDPA gives NaN for fully masked rows; flashcupy gives 0
        ours["mask"] = sdpa["mask"] = keep
    if opts.get("bias"):
        # broadcast over the batch: dbias reduces over it
        bias = _randn((1,) + qs[-3:-1] + (ks[-2],), dtype, seed=seed + 5)
        ours["bias"] = sdpa["bias"] = bias
    return q, k, v, dout, ours, sdpa


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("name,qs,ks,dv,opts", CPU_CASES, ids=[c[0] for c in CPU_CASES])
def test_matches_sdpa_on_cpu(name, qs, ks, dv, opts, dtype) -> None:
    q, k, v, dout, ours, sdpa = _cpu_problem(qs, ks, dv, opts, dtype)
    bias = ours.get("bias")
    out = fct.flash_attention(q, k, v, **ours)
    assert out.dtype == dtype and out.device == q.device and out.shape == qs[:-1] + (dv,)
    got = _grads(out, dout, [q, k, v, bias])

    if len(qs) == 2:  # SDPA wants a head axis
        rq, rk, rv = (x.detach()[None].requires_grad_() for x in (q, k, v))
        ref = _sdpa(rq, rk, rv, **sdpa)[0]
        want = [g[0] for g in _grads(ref, dout, [rq, rk, rv])]
    else:
        rq, rk, rv, rbias = _leaves(q, k, v, bias)
        if rbias is not None:
            sdpa["bias"] = rbias
        ref = _sdpa(rq, rk, rv, **sdpa)
        want = _grads(ref, dout, [rq, rk, rv, rbias])

    tol = 1e-10 if dtype == torch.float64 else 1e-5
    names = ["out", "dq", "dk", "dv", "dbias"]
    for label, a, b in zip(names, [out] + got, [ref] + want):
        assert a.shape == b.shape and a.dtype == b.dtype, label
        assert _max_abs(a, b) <= tol * _scale_of(b), f"{label}: {_max_abs(a, b):.3g}"


def test_gradcheck_with_bias() -> None:
    q = _randn((1, 2, 4, 3), seed=10)
    k = _randn((1, 1, 5, 3), seed=11)
    v = _randn((1, 1, 5, 2), seed=12)
    bias = _randn((2, 4, 5), seed=13)  # broadcast over the batch

    def fn(q, k, v, bias):
        return fct.flash_attention(q, k, v, bias=bias, causal=True, softcap=3.0)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_with_sinks_and_bias() -> None:
    q = _randn((2, 2, 4, 3), seed=14)
    k = _randn((2, 2, 5, 3), seed=15)
    v = _randn((2, 2, 5, 2), seed=16)
    bias = _randn((4, 5), seed=17)
    sinks = _randn((2, 1), seed=18)  # per batch entry, broadcast over the heads
    q_lengths = torch.tensor([4, 2])

    def fn(q, k, v, bias, sinks):
        return fct.flash_attention(q, k, v, bias=bias, sinks=sinks, q_lengths=q_lengths, causal=True)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias, sinks), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_masked_lengths_and_alibi() -> None:
    q = _randn((2, 2, 5, 3), seed=20)
    k = _randn((2, 2, 6, 3), seed=21)
    v = _randn((2, 2, 6, 3), seed=22)
    kv_lengths = torch.tensor([6, 3])
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64)

    def fn(q, k, v):
        return fct.flash_attention(q, k, v, kv_lengths=kv_lengths, alibi_slopes=slopes, window=(2, 1))

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-8, rtol=1e-6)


# --------------------------------------------------------------------------- behaviour


def test_return_lse_has_no_gradient_and_matches_logsumexp() -> None:
    q, k, v = _randn((2, 3, 7, 4), seed=1), _randn((2, 3, 9, 4), seed=2), _randn((2, 3, 9, 4), seed=3)
    out, lse = fct.flash_attention(q, k, v, return_lse=True, scale=0.7)
    assert out.requires_grad and not lse.requires_grad and lse.grad_fn is None
    assert lse.dtype == torch.float64 and lse.shape == (2, 3, 7)
    want = torch.logsumexp(0.7 * q.detach() @ k.detach().transpose(-1, -2), dim=-1)
    assert _max_abs(lse, want) <= 1e-12
    (out * lse[..., None]).sum().backward()  # lse enters as a constant
    assert q.grad is not None and torch.isfinite(q.grad).all()
    _, lse32 = fct.flash_attention(*(x.detach().float() for x in (q, k, v)), return_lse=True)
    assert lse32.dtype == torch.float32


def test_fully_masked_rows_give_zero_and_zero_grads() -> None:
    q, k, v = _randn((1, 2, 6, 4), seed=1), _randn((1, 2, 5, 4), seed=2), _randn((1, 2, 5, 4), seed=3)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[2] = False
    out, lse = fct.flash_attention(q, k, v, mask=mask, return_lse=True)
    assert (out[..., 2, :] == 0).all() and torch.isneginf(lse[..., 2]).all()
    out.sum().backward()
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all()
    assert (q.grad[..., 2, :] == 0).all()


def test_dropout_seed_and_gradients_match_flashcupy(monkeypatch) -> None:
    q, k, v = _randn((2, 2, 9, 4), seed=1), _randn((2, 2, 11, 4), seed=2), _randn((2, 2, 11, 4), seed=3)
    bias = _randn((2, 9, 11), seed=4)
    dout = _randn((2, 2, 9, 4), seed=5, requires_grad=False)
    opts = {"dropout_p": 0.3, "causal": True, "backend": "cpu"}  # exact comparisons: one backend

    a = fct.flash_attention(q, k, v, bias=bias, seed=1234, **opts)
    b = fct.flash_attention(q, k, v, bias=bias, seed=1234, **opts)
    c = fct.flash_attention(q, k, v, bias=bias, seed=1235, **opts)
    plain = fct.flash_attention(q, k, v, bias=bias, causal=True)
    assert torch.equal(a, b) and not torch.equal(a, c) and not torch.equal(a, plain)

    # seed=None draws one seed at the forward and the backward reuses it.
    monkeypatch.setattr(fc.rng, "new_seed", lambda: 1234)
    d = fct.flash_attention(q, k, v, bias=bias, **opts)
    assert torch.equal(a, d)
    got = _grads(d, dout, [q, k, v, bias])

    arrays = [x.detach().numpy() for x in (q, k, v, bias, dout)]
    out, lse = fc.flash_attention_forward(*arrays[:3], bias=arrays[3], seed=1234, **opts)
    want = fc.flash_attention_backward(arrays[4], *arrays[:3], out, lse, bias=arrays[3], bias_grad=True,
                                       seed=1234, **opts)
    np.testing.assert_array_equal(a.detach().numpy(), out)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.numpy(), w)


def test_only_needed_grads_are_returned(monkeypatch) -> None:
    calls = []
    backward = api.flash_attention_backward

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return backward(*args, **kwargs)

    monkeypatch.setattr(api, "flash_attention_backward", spy)
    q, k = _randn((1, 2, 5, 4), seed=1, requires_grad=False), _randn((1, 2, 6, 4), seed=2, requires_grad=False)
    v = _randn((1, 2, 6, 4), seed=3)
    bias = _randn((5, 6), seed=4, requires_grad=False)
    fct.flash_attention(q, k, v, bias=bias).sum().backward()
    assert q.grad is None and k.grad is None and v.grad is not None
    assert calls[-1]["bias_grad"] is False and calls[-1]["deterministic"] is False

    bias.requires_grad_()
    v.grad = None
    fct.flash_attention(q, k, v, bias=bias).sum().backward()
    assert calls[-1]["bias_grad"] is True and bias.grad is not None and bias.grad.shape == (5, 6)


def test_deterministic_follows_torch(monkeypatch) -> None:
    calls = []
    backward = api.flash_attention_backward
    monkeypatch.setattr(api, "flash_attention_backward", lambda *a, **kw: calls.append(kw) or backward(*a, **kw))
    q = _randn((1, 1, 3, 2), seed=1)
    fct.flash_attention(q, q, q).sum().backward()
    fct.flash_attention(q, q, q, deterministic=True).sum().backward()
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        fct.flash_attention(q, q, q).sum().backward()
    finally:
        torch.use_deterministic_algorithms(previous)
    assert [kw["deterministic"] for kw in calls] == [False, True, True]


def test_cpu_tensors_are_not_copied(monkeypatch) -> None:
    seen = {}
    forward = api.flash_attention_forward

    def spy(q, k, v, **options):
        seen["q"], seen["mask"] = q, options["mask"]
        seen["out"], seen["lse"] = forward(q, k, v, **options)
        return seen["out"], seen["lse"]

    monkeypatch.setattr(api, "flash_attention_forward", spy)
    base = _randn((2, 7, 3, 4), dtype=torch.float32, seed=1)  # (B, L, H, D): FlashAttention's layout
    q = base.transpose(1, 2)  # a strided view, no copy
    mask = torch.ones(7, 7, dtype=torch.bool)
    out, lse = fct.flash_attention(q, q, q, mask=mask, return_lse=True, backend="cpu")
    assert isinstance(seen["q"], np.ndarray) and seen["q"].ctypes.data == q.data_ptr()
    assert seen["q"].strides == tuple(s * 4 for s in q.stride())
    assert seen["mask"].ctypes.data == mask.data_ptr()
    assert out.data_ptr() == seen["out"].ctypes.data and lse.data_ptr() == seen["lse"].ctypes.data


def test_array_options_accept_tensors_numpy_and_lists() -> None:
    q, k, v = _randn((2, 2, 6, 4), seed=1), _randn((2, 2, 8, 4), seed=2), _randn((2, 2, 8, 4), seed=3)
    mask = torch.rand(2, 1, 6, 8, generator=torch.Generator().manual_seed(0)) < 0.7
    opts = {"q_lengths": [5, 6], "kv_lengths": torch.tensor([8, 4]), "alibi_slopes": torch.tensor([0.1, 0.2]),
            "block_mask": torch.tensor([[True, False], [True, True]]), "block_size": 4, "softcap": 4.0}
    out = fct.flash_attention(q, k, v, mask=mask, **opts)
    np_opts = {n: np.asarray(x) if isinstance(x, torch.Tensor) else x for n, x in opts.items()}
    want = fc.flash_attention(*(x.detach().numpy() for x in (q, k, v)), mask=mask.numpy(), backend="cpu", **np_opts)
    np.testing.assert_allclose(out.detach().numpy(), want, rtol=0, atol=1e-12)


def test_bfloat16_cpu_tensors_keep_their_dtype() -> None:
    q, k, v = (_randn((1, 2, 9, 8), torch.bfloat16, seed=s) for s in (1, 2, 3))
    out = fct.flash_attention(q, k, v, causal=True)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    assert all(x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad).all() for x in (q, k, v))
    ref = reference.attention_reference(*(x.detach().float().numpy() for x in (q, k, v)), causal=True)
    naive = _sdpa(*(x.detach() for x in (q, k, v)), causal=True)
    bound = tolerance(ref, naive.float().numpy(), np.dtype(ml_dtypes.bfloat16))
    assert _max_abs(out, torch.from_numpy(ref)) <= bound


def test_varlen_equals_padded() -> None:
    q, k, v = _randn((2, 9, 4), seed=1), _randn((2, 11, 4), seed=2), _randn((2, 11, 4), seed=3)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 6, 11], dtype=torch.int32)
    out = fct.flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    out.sum().backward()
    for b in range(2):
        qs, ks = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        sq, sk, sv = _leaves(q[:, qs], k[:, ks], v[:, ks])
        part = fct.flash_attention(sq, sk, sv, causal=True)
        part.sum().backward()
        assert _max_abs(out[:, qs], part) <= 1e-12
        assert _max_abs(q.grad[:, qs], sq.grad) <= 1e-12 and _max_abs(k.grad[:, ks], sk.grad) <= 1e-12


def test_bad_arguments() -> None:
    q = _randn((1, 2, 3, 4))
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        fct.flash_attention(q.detach().numpy(), q, q)
    with pytest.raises(ValueError, match="k: expected a tensor on cpu"):
        fct.flash_attention(q, torch.empty(1, 2, 3, 4, device="meta"), q)
    with pytest.raises(TypeError, match="unexpected keyword"):
        fct.flash_attention(q, q, q, is_causal=True)
    with pytest.raises(TypeError, match="return_lse"):
        fct.flash_attention(q, q, q, return_lse=1)
    with pytest.raises(TypeError, match="q, k, v: expected one dtype"):
        fct.flash_attention(q, q.float(), q)


class _TinyAttention(torch.nn.Module):
    def __init__(self, dim=16, heads=2, dtype=torch.float32):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim, dtype=dtype)
        self.proj = torch.nn.Linear(dim, dim, dtype=dtype)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = fct.flash_attention(q, k, v, causal=True)  # strided views of one projection
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


def _train(device: str) -> list[float]:
    torch.manual_seed(0)
    model = _TinyAttention().to(device)
    x = torch.randn(4, 12, 16, device=device)
    target = torch.roll(x, 1, dims=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = F.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_training_step_cpu() -> None:
    losses = _train("cpu")
    assert losses[-1] < 0.8 * losses[0], losses


# --------------------------------------------------------------------------- CUDA tensors

GPU_CASES = [
    ("plain", (2, 4, 130, 64), (2, 4, 130, 64), {}),
    ("causal_top_left", (2, 4, 97, 64), (2, 4, 161, 64), {"causal": "top_left"}),
    ("gqa_causal", (1, 8, 200, 128), (1, 2, 200, 128), {"causal": True}),
    ("bias", (2, 2, 77, 64), (2, 2, 93, 64), {"bias": True}),
    ("mask_d40", (2, 2, 64, 40), (2, 2, 80, 40), {"mask": True}),
]
GPU_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
NP_DTYPES = {torch.float16: np.dtype(np.float16), torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
             torch.float32: np.dtype(np.float32)}


def _gpu_problem(qs, ks, opts, dtype):
    q, k, v, dout, ours, sdpa = _cpu_problem(qs, ks, ks[-1], opts, torch.float64)

    def move(x, dt):
        return x.detach().to("cuda", dt).requires_grad_(x.requires_grad)

    q, k, v = (move(x, dtype) for x in (q, k, v))
    dout = dout.to("cuda", dtype)
    for name in ("mask", "bias"):
        if name in ours:
            ours[name] = sdpa[name] = move(ours[name], dtype if name == "bias" else torch.bool)
    return q, k, v, dout, ours, sdpa


def _assert_rule(label, ours, ref64, same, dtype):
    """docs/semantics.md#accuracy: max |ours - ref64| <= 2 max |SDPA in the same dtype - ref64| + floor."""
    ref = ref64.detach().double().cpu().numpy()
    bound = tolerance(ref, same.detach().double().cpu().numpy(), NP_DTYPES[dtype])
    err = _max_abs(ours.cpu(), ref64.cpu())
    assert err <= bound, f"{label}: max error {err:.3g} > bound {bound:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_DTYPES.values()), ids=list(GPU_DTYPES))
@pytest.mark.parametrize("name,qs,ks,opts", GPU_CASES, ids=[c[0] for c in GPU_CASES])
def test_cuda_matches_sdpa(name, qs, ks, opts, dtype) -> None:
    q, k, v, dout, ours, sdpa = _gpu_problem(qs, ks, opts, dtype)
    bias = ours.get("bias")
    out = fct.flash_attention(q, k, v, **ours)
    assert isinstance(out, torch.Tensor) and out.device == q.device and out.dtype == dtype
    got = _grads(out, dout, [q, k, v, bias])

    same_inputs = _leaves(q, k, v, bias)
    same_kw = {**sdpa, **({"bias": same_inputs[3]} if bias is not None else {})}
    same = _sdpa(*same_inputs[:3], **same_kw)
    same_grads = _grads(same, dout, same_inputs)

    ref_inputs = [None if x is None else x.detach().double().requires_grad_() for x in (q, k, v, bias)]
    ref_kw = {**sdpa, **({"bias": ref_inputs[3]} if bias is not None else {})}
    ref = _sdpa(*ref_inputs[:3], **ref_kw)
    ref_grads = _grads(ref, dout.double(), ref_inputs)

    for label, a, r, s in zip(["out", "dq", "dk", "dv", "dbias"], [out] + got, [ref] + ref_grads,
                              [same] + same_grads):
        assert a.dtype == s.dtype and a.shape == s.shape and a.device == q.device, label
        _assert_rule(label, a, r, s, dtype)


@pytest.mark.gpu
def test_cuda_tensors_are_not_copied(monkeypatch) -> None:
    monkeypatch.setattr(fct, "_CALLS", fct._calls.Calls(fct._TorchKind()))  # the full path: no planned call
    seen = {}
    forward, backward = api.flash_attention_forward, api.flash_attention_backward

    def spy_forward(q, k, v, **options):
        seen["q"] = q
        seen["out"], seen["lse"] = forward(q, k, v, **options)
        return seen["out"], seen["lse"]

    def spy_backward(dout, *args, **options):
        seen["grads"] = backward(dout, *args, **options)
        return seen["grads"]

    monkeypatch.setattr(api, "flash_attention_forward", spy_forward)
    monkeypatch.setattr(api, "flash_attention_backward", spy_backward)
    base = _randn((2, 100, 4, 64), torch.float16, device="cuda", seed=1)
    q = base.transpose(1, 2)  # (B, H, L, D) view of FlashAttention's (B, L, H, D) layout
    out, lse = fct.flash_attention(q, q, q, causal=True, return_lse=True)
    assert type(seen["q"]).__module__.startswith("cupy") and seen["q"].data.ptr == q.data_ptr()
    assert out.device == q.device and out.dtype == torch.float16 and lse.dtype == torch.float32
    assert out.data_ptr() == seen["out"].data.ptr and lse.data_ptr() == seen["lse"].data.ptr
    dq = torch.autograd.grad(out.float().sum(), base)[0]
    assert dq.device == q.device and dq.dtype == torch.float16 and torch.isfinite(dq).all()
    # the grads autograd hands on are flashcupy's CuPy results, shared with torch (dq, dk, dv of one
    # tensor are summed by autograd, so compare one of them before that sum)
    assert all(type(g).__module__.startswith("cupy") for g in seen["grads"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.bool, torch.int32])
def test_cuda_views_share_memory_shape_and_strides(dtype) -> None:
    """A CUDA tensor reaches CuPy as a view built from its pointer and strides: sliced and
    transposed views at an offset, every element as torch sees it; no elements: DLPack."""
    import cupy

    base = (torch.arange(3 * 5 * 7, device="cuda") % 3).to(dtype).reshape(3, 5, 7)
    for x in (base, base[1:, ::2].transpose(0, 2), base[:, 2], base[:0]):
        view = fct._to_array(x)
        assert view.shape == tuple(x.shape) and (x.numel() == 0 or view.data.ptr == x.data_ptr())
        as_float = (lambda a: a.astype(cupy.float32)) if dtype == torch.bfloat16 else (lambda a: a)
        want = x.float() if dtype == torch.bfloat16 else x
        assert (cupy.asnumpy(as_float(view)) == want.cpu().numpy()).all()


@pytest.mark.gpu
def test_cuda_runs_on_torchs_current_stream() -> None:
    import cupy

    q, k, v = (_randn((2, 4, 256, 64), torch.float16, device="cuda", seed=s) for s in (1, 2, 3))
    want = fct.flash_attention(q, k, v, causal=True, deterministic=True)  # bitwise-repeatable grads
    want_grads = torch.autograd.grad(want.float().square().sum(), (q, k, v))
    torch.cuda.synchronize()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    before = cupy.cuda.get_current_stream().ptr
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # keep the stream busy: work on another stream would race ahead
        q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))  # written after the sleep
        out = fct.flash_attention(q2, k2, v2, causal=True, deterministic=True)
        grads = torch.autograd.grad(out.float().square().sum(), (q2, k2, v2))
        result = [out.clone()] + [g.clone() for g in grads]
    assert cupy.cuda.get_current_stream().ptr == before
    stream.synchronize()
    for got, exp in zip(result, [want] + list(want_grads)):
        assert torch.equal(got, exp)


@pytest.mark.gpu
def test_cuda_dropout_matches_cpu_backend() -> None:
    q, k, v = (_randn((2, 2, 70, 32), torch.float32, device="cuda", seed=s) for s in (1, 2, 3))
    bias = _randn((2, 70, 70), torch.float32, device="cuda", seed=4)
    dout = _randn((2, 2, 70, 32), torch.float32, device="cuda", seed=5, requires_grad=False)
    opts = {"dropout_p": 0.25, "seed": 99, "causal": True}
    out = fct.flash_attention(q, k, v, bias=bias, **opts)
    got = _grads(out, dout, [q, k, v, bias])
    cpu = [x.detach().cpu().numpy() for x in (q, k, v, bias, dout)]
    ref_out, lse = fc.flash_attention_forward(*cpu[:3], bias=cpu[3], backend="cpu", **opts)
    ref = fc.flash_attention_backward(cpu[4], *cpu[:3], ref_out, lse, bias=cpu[3], bias_grad=True, backend="cpu",
                                      **opts)
    for label, a, b in zip(["out", "dq", "dk", "dv", "dbias"], [out] + got, [ref_out] + list(ref)):
        b = torch.from_numpy(b)
        assert _max_abs(a.cpu(), b) <= 1e-4 * _scale_of(b), label


@pytest.mark.gpu
def test_training_step_cuda() -> None:
    losses = _train("cuda")
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.gpu
@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward_backward"])
def test_cuda_graph_replays_with_new_inputs(backward) -> None:
    """A call captured in a torch.cuda.CUDAGraph replays on new values in its input buffers:
    its allocations come from torch's caching allocator (the graph's private pool), its
    kernels run on the capturing stream, and a repeated call does no host-device work."""
    shape = (2, 4, 96, 64)
    static = [_randn(shape, torch.float16, device="cuda", seed=s, requires_grad=backward) for s in (80, 81, 82)]
    dout = _randn(shape, torch.float16, device="cuda", seed=83, requires_grad=False)

    def step(q, k, v):
        out = fct.flash_attention(q, k, v, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout)) if backward else (out,)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(*static)  # compiles the kernels and fills the host caches before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*static)
    for seed in (90, 91):
        with torch.no_grad():
            for n, x in enumerate(static):
                x.copy_(_randn(shape, torch.float16, device="cuda", seed=seed + 10 * n, requires_grad=False))
        graph.replay()
        want = step(*(x.detach().clone().requires_grad_(backward) for x in static))  # fresh leaves, eagerly
        for got, exp in zip(captured, want, strict=True):
            assert torch.equal(got, exp)


#: (q shape, k shape, options, dtype, layout) of planned calls: "blhd" views (B, L, H, D) memory as (B, H, L, D).
PLANNED_CASES = {
    "fp16": ((2, 4, 96, 64), (2, 4, 96, 64), {}, torch.float16, "bhld"),
    "bf16 GQA causal top-left, (B, L, H, D)": ((1, 8, 130, 64), (1, 2, 70, 64), {"causal": "top_left"}, torch.bfloat16,
                                               "blhd"),
    "fp16 window softcap D 128": ((2, 2, 77, 128), (2, 2, 77, 128), {"window": (9, 3), "softcap": 5.0}, torch.float16,
                                  "bhld"),
    "fp32 return_lse scale D 40": ((2, 2, 33, 40), (2, 2, 45, 40), {"return_lse": True, "scale": 0.3}, torch.float32,
                                   "blhd"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("dout_kind", ["given", "sum"])
@pytest.mark.parametrize("case", list(PLANNED_CASES))
def test_planned_calls_equal_the_full_path_and_skip_it(case, dout_kind, monkeypatch) -> None:
    """A call laid out like an earlier one (flashcupy.calls) runs its kept plans: outputs and
    deterministic gradients equal the full path's bit for bit, poisoned outputs are all
    written, and neither flashcupy's forward nor its backward runs again. The backward's plan
    comes from the first planned call's backward (dout given, or torch's broadcast gradient
    of out.sum(), copied contiguous)."""
    import flashcupy.cuda as fcuda

    qs, ks, opts, dtype, layout = PLANNED_CASES[case]
    monkeypatch.setattr(fct, "_CALLS", fct._calls.Calls(fct._TorchKind()))
    monkeypatch.setattr(fcuda, "poison_outputs", True)

    def make(shape, seed):
        x = _randn(shape, dtype, device="cuda", seed=seed, requires_grad=False)
        if layout == "blhd":
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        return x.requires_grad_()

    q, k = make(qs, 1), make(ks, 2)
    v = make(ks, 3)
    dout = _randn(qs, dtype, device="cuda", seed=4, requires_grad=False)
    full_calls = []
    for name in ("flash_attention_forward", "flash_attention_backward"):
        real = getattr(api, name)
        monkeypatch.setattr(api, name, lambda *a, _f=real, _n=name, **kw: full_calls.append(_n) or _f(*a, **kw))

    def call():
        result = fct.flash_attention(q, k, v, deterministic=True, **opts)
        out = result[0] if isinstance(result, tuple) else result
        grads = torch.autograd.grad(out.sum() if dout_kind == "sum" else out, (q, k, v),
                                    None if dout_kind == "sum" else dout)
        return [*(result if isinstance(result, tuple) else (result,)), *grads]

    runs = []
    for _ in range(3):
        full_calls.clear()
        runs.append(call())
        runs[-1].append(list(full_calls))
    kept = (list(fct._CALLS._entries.values()), list(fct._CALLS._lengths.values()))
    assert runs[0][-1] == ["flash_attention_forward", "flash_attention_backward"]
    assert runs[1][-1] == ["flash_attention_backward"], kept  # planned forward; its backward's first call plans it
    assert runs[2][-1] == [], kept
    for planned in runs[1:]:
        for got, want in zip(planned[:-1], runs[0][:-1], strict=True):
            assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device
            assert not got.isnan().any()
            assert torch.equal(got, want)


@pytest.mark.gpu
def test_planned_calls_follow_the_options_and_grad_mode(monkeypatch) -> None:
    """Another option value is another key (full path, then planned); without grad a planned
    call builds no autograd node."""
    monkeypatch.setattr(fct, "_CALLS", fct._calls.Calls(fct._TorchKind()))
    q, k, v = (_randn((1, 2, 64, 64), torch.float16, device="cuda", seed=s) for s in (5, 6, 7))
    for opts in ({"causal": True}, {"causal": "top_left"}, {"scale": 0.5}, {"scale": -0.5}):
        want = fct.flash_attention(q, k, v, **opts)
        assert torch.equal(fct.flash_attention(q, k, v, **opts), want)
        with torch.no_grad():
            planned = fct.flash_attention(q, k, v, **opts)
        assert planned.grad_fn is None and torch.equal(planned, want)
    assert len(fct._CALLS._entries) == 4
    assert all(entry is not None for entry in fct._CALLS._entries.values())


@pytest.mark.gpu
def test_calls_the_plans_cannot_take_stay_on_the_full_path(monkeypatch) -> None:
    """Rows padded to 16 bytes (fp16 D 36) and negative views (a complex tensor's conj().imag)
    are copied by the full path in ways no plan repeats: every call takes it, with the same
    results; an lse changed in place after a planned call makes the backward raise."""
    import flashcupy.cuda as fcuda

    monkeypatch.setattr(fct, "_CALLS", fct._calls.Calls(fct._TorchKind()))
    monkeypatch.setattr(fcuda, "poison_outputs", True)
    full_calls = []
    real = api.flash_attention_forward
    monkeypatch.setattr(api, "flash_attention_forward", lambda *a, **kw: full_calls.append(1) or real(*a, **kw))
    q, k, v = (_randn((2, 2, 64, 36), torch.float16, device="cuda", seed=s) for s in (11, 12, 13))
    negative = torch.randn((2, 2, 64, 32), dtype=torch.complex64, device="cuda").conj().imag
    k32, v32 = (_randn((2, 2, 64, 32), torch.float32, device="cuda", seed=s, requires_grad=False) for s in (14, 15))
    for arrays, resolved in (((q, k, v), (q, k, v)), ((negative, k32, v32), (negative.resolve_neg(), k32, v32))):
        want = fct.flash_attention(*(x.detach().contiguous() for x in resolved))
        full_calls.clear()
        for _ in range(3):
            assert torch.equal(fct.flash_attention(*arrays), want)
        assert len(full_calls) == 3
    q, k, v = (_randn((1, 2, 64, 64), torch.float16, device="cuda", seed=s) for s in (16, 17, 18))
    full_calls.clear()
    for _ in range(2):
        out, lse = fct.flash_attention(q, k, v, return_lse=True)
    assert full_calls == [1]  # the second call was planned
    lse.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_other_lengths_take_the_length_plan(dtype, monkeypatch) -> None:
    """Calls whose q, k, v differ from a planned call's only in their lengths and strides (a
    generation loop's keys, sliced from a static cache or concatenated; queries as (B, L, H, D)
    views) run the planned kernel with their own lengths, strides and grid: outputs and lse
    equal the full path's bit for bit, poisoned outputs are all written, and flashcupy's
    forward runs once. Calls needing gradients take the full path (it plans their backward)."""
    import flashcupy.cuda as fcuda

    table = fct._calls.Calls(fct._TorchKind())
    monkeypatch.setattr(fcuda, "poison_outputs", True)
    full_calls = []
    real = api.flash_attention_forward
    monkeypatch.setattr(api, "flash_attention_forward", lambda *a, **kw: full_calls.append(1) or real(*a, **kw))

    def attend(calls, *arrays, **options):
        monkeypatch.setattr(fct, "_CALLS", calls)
        return fct.flash_attention(*arrays, causal=True, return_lse=True, scale=0.2, **options)

    k_cache, v_cache = (_randn((2, 2, 300, 64), dtype, device="cuda", seed=s, requires_grad=False) for s in (1, 2))
    queries = _randn((2, 300, 8, 64), dtype, device="cuda", seed=3, requires_grad=False).transpose(1, 2)
    steps = [(queries[:, :, n - 1:n], k_cache[:, :, :n], v_cache[:, :, :n]) for n in (17, 18, 100, 299)]
    steps += [(queries[:, :, :n].contiguous(), torch.cat([k_cache[:, :, :n - 1], k_cache[:, :, n - 1:n]], 2),
               v_cache[:, :, :n].contiguous()) for n in (5, 130)]
    for n, (q, k, v) in enumerate(steps):
        got = attend(table, q, k, v)
        fresh = full_calls.copy()
        want = attend(fct._calls.Calls(fct._TorchKind()), q, k, v)
        assert len(fresh) == (1 if n == 0 else 0), f"step {n}: flashcupy's forward ran"
        full_calls.clear()
        if n:
            assert isinstance(table.find(q, k, v, {"causal": True, "return_lse": True, "scale": 0.2}, False)[1],
                              fct._calls.LengthPlanned)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype and not a.isnan().any()
            assert torch.equal(a, b), f"step {n}"
    q, k, v = (x.detach().clone().requires_grad_() for x in steps[2])
    out, _ = attend(table, q, k, v)
    assert full_calls == [1] and out.grad_fn is not None


@pytest.mark.gpu
def test_cuda_graph_dropout_follows_the_rng_state() -> None:
    """Dropout inside a captured forward + backward draws its seed and offset from a device
    rng_state when the kernels run: a replay after the caller advances the offset equals an
    eager call at the new offset (outputs and gradients), and differs from the previous one."""
    shape = (2, 4, 96, 64)
    static = [_randn(shape, torch.float16, device="cuda", seed=s, requires_grad=True) for s in (50, 51, 52)]
    dout = _randn(shape, torch.float16, device="cuda", seed=53, requires_grad=False)
    state = torch.tensor([2**40 + 7, 0], dtype=torch.int64, device="cuda")

    def step(q, k, v, **dropout):
        out = fct.flash_attention(q, k, v, dropout_p=0.25, **dropout)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(*static, rng_state=state)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(*static, rng_state=state)
    before = None
    for offset in (3, 4):
        state[1] = offset
        graph.replay()
        want = step(*(x.detach().clone().requires_grad_(True) for x in static), seed=2**40 + 7, dropout_offset=offset)
        for got, exp in zip(captured, want, strict=True):
            assert torch.equal(got, exp)
        if before is not None:
            assert not torch.equal(captured[0], before)
        before = captured[0].clone()


def test_rng_state_is_seed_and_offset_and_the_backward_keeps_the_forwards() -> None:
    """A (2,) int64 rng_state gives the bits of its (seed, offset), forward and gradients; the
    forward copies it, so writing the tensor before the backward changes nothing."""
    q, k, v = (_randn((2, 3, 20, 8), torch.float64, seed=s, requires_grad=True) for s in (60, 61, 62))
    state = torch.tensor([-5, 2**32 + 9], dtype=torch.int64)  # seed 2**64 - 5, offset 9

    def grads(**dropout):
        out = fct.flash_attention(q, k, v, dropout_p=0.4, **dropout)
        if "rng_state" in dropout:
            dropout["rng_state"][1] = 1234  # after the forward: not the backward's concern
        return (out, *torch.autograd.grad(out.sum(), (q, k, v)))

    for got, want in zip(grads(rng_state=state), grads(seed=2**64 - 5, dropout_offset=9), strict=True):
        assert torch.equal(got, want)


# --------------------------------------------------------------------------- custom ops


def _op_args(data_seed: int = 30, **extra):
    q = _randn((2, 2, 5, 4), seed=data_seed)
    k = _randn((2, 1, 7, 4), seed=data_seed + 1)
    v = _randn((2, 1, 7, 3), seed=data_seed + 2)
    tensors, scalars = fct._encode({"causal": True, **extra}, q, k)
    return (q, k, v), tensors, scalars


@pytest.mark.parametrize("extra", [{}, {"bias": _randn((5, 7), seed=40), "sinks": _randn((2,), seed=41)},
                                   {"window": (2, None), "softcap": 3.0, "dropout_p": 0.3, "seed": 2**64 - 5}])
def test_ops_pass_torch_library_opcheck(extra) -> None:
    """Schema, fake functions (shapes and dtypes without running), autograd registration."""
    (q, k, v), tensors, scalars = _op_args(**extra)
    torch.library.opcheck(fct._attention_op, (q, k, v), {**tensors, **scalars, "deterministic": False})
    out, lse = fct._attention_op(q, k, v, **tensors, **scalars, deterministic=False)
    dout = torch.ones_like(out)
    # the backward has no autograd of its own (no double backward): its schema and fake function
    torch.library.opcheck(fct._attention_backward_op, (dout, q, k, v, out, lse),
                          {**tensors, **scalars, "bias_grad": tensors["bias"] is not None, "deterministic": False},
                          test_utils=("test_schema", "test_faketensor"))


def test_eager_calls_skip_the_dispatcher_and_match_the_ops(monkeypatch) -> None:
    """Eager calls run the ops' implementations through an autograd.Function, not the ops
    (torch.library's Python dispatch costs more than a small problem's kernels); results and
    gradients, bias and sinks included, equal the ops' bit for bit."""
    (q, k, v), tensors, scalars = _op_args(bias=_randn((5, 7), seed=42), sinks=_randn((2,), seed=43), softcap=2.0)
    bias, sinks = tensors["bias"], tensors["sinks"]
    inputs = (q, k, v, bias, sinks)
    out, _ = fct._attention_op(q, k, v, **tensors, **scalars, deterministic=False)
    want = (out, *torch.autograd.grad(out.square().sum(), inputs))

    def no_op(*args, **kwargs):
        raise AssertionError("an eager call went through the custom op")

    monkeypatch.setattr(fct, "_attention_op", no_op)
    monkeypatch.setattr(fct, "_attention_backward_op", no_op)
    out = fct.flash_attention(q, k, v, bias=bias, sinks=sinks, causal=True, softcap=2.0)
    got = (out, *torch.autograd.grad(out.square().sum(), inputs))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_fullgraph_compile_has_no_graph_break() -> None:
    q, k, v = (_randn((2, 2, 6, 4), seed=s) for s in (50, 51, 52))
    bias = _randn((6, 6), seed=53)

    def step(q, k, v, bias):
        return fct.flash_attention(q, k, v, bias=bias, causal=True, window=(3, None)).square().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    loss = compiled(q, k, v, bias)
    grads = torch.autograd.grad(loss, (q, k, v, bias))
    want = torch.autograd.grad(step(q, k, v, bias), (q, k, v, bias))
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_compile_with_dynamic_shapes() -> None:
    compiled = torch.compile(lambda q, k, v: fct.flash_attention(q, k, v, causal=True), fullgraph=True,
                             backend="aot_eager", dynamic=True)
    for length in (5, 9, 17):
        q, k, v = (_randn((1, 2, length, 8), seed=length + s, requires_grad=False) for s in range(3))
        torch.testing.assert_close(compiled(q, k, v), fct.flash_attention(q, k, v, causal=True), rtol=0, atol=0)


def test_compiled_backward_with_strided_inputs() -> None:
    """The backward's fake gradients are contiguous, as the real ones: q in FlashAttention's
    (B, L, H, D) layout (and every transformers model's q) trains under torch.compile."""
    x = _randn((2, 5, 4, 3), seed=60)
    k, v = _randn((2, 4, 6, 3), seed=61), _randn((2, 4, 6, 2), seed=62)

    def loss(x, k, v):
        return fct.flash_attention(x.transpose(1, 2), k, v, causal=True).square().sum()

    grads = torch.autograd.grad(torch.compile(loss, fullgraph=True, backend="aot_eager")(x, k, v), (x, k, v))
    for got, want in zip(grads, torch.autograd.grad(loss(x, k, v), (x, k, v)), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    (q, k, v), tensors, scalars = _op_args()
    q = q.detach().transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, L, D) view of (B, L, H, D) memory
    out, lse = fct._attention_op(q, k, v, **tensors, **scalars, deterministic=False)
    torch.library.opcheck(fct._attention_backward_op, (torch.ones_like(out), q, k, v, out, lse),
                          {**tensors, **scalars, "bias_grad": False, "deterministic": False},
                          test_utils=("test_schema", "test_faketensor"))


def test_options_convert_and_fail_as_flashcupys_own() -> None:
    q, k, v = (_randn((1, 2, 8, 4), seed=s, requires_grad=False) for s in (70, 71, 72))
    packed = [x[0].clone() for x in (q, k, v)]
    out = fct.flash_attention_varlen(*packed, [0, 3, 8], [0, 4, 8])  # lists, as flashcupy takes them
    assert out.shape == (2, 8, 4)
    mask = np.ones((8, 8), bool)[::-1]  # negative strides: copied, not refused
    sinks = np.array([0.5, -1.0], dtype=">f8")  # big-endian
    torch.testing.assert_close(fct.flash_attention(q, k, v, mask=mask, sinks=sinks),
                               fct.flash_attention(q, k, v, sinks=torch.tensor([0.5, -1.0])))
    lse = fct.flash_attention(q, k, v, return_lse=np.True_)[1]
    assert lse.shape == (1, 2, 8)
    assert fct.flash_attention(q, k, v, dropout_p=np.float32(0.2)).shape == q.shape  # a seed is drawn
    for options, error, match in (({"dropout_offset": 1.5}, TypeError, "dropout_offset"),
                                  ({"seed": -1, "dropout_p": 0.1}, ValueError, "seed"),
                                  ({"scale": "x"}, TypeError, "scale"),
                                  ({"allow_tf32": "yes"}, TypeError, "allow_tf32"),
                                  ({"backend": 3}, ValueError, "backend")):
        with pytest.raises(error, match=match):
            fct.flash_attention(q, k, v, **options)


def test_ops_take_flashcupys_array_options_in_order() -> None:
    """The ops' tensor arguments follow flashcupy.problem.ARRAY_OPTIONS, which _encode fills."""
    from flashcupy.problem import ARRAY_OPTIONS

    forward = [a.name for a in torch.ops.flashcupy.attention.default._schema.arguments]
    backward = [a.name for a in torch.ops.flashcupy.attention_backward.default._schema.arguments]
    assert tuple(forward[3 : 3 + len(ARRAY_OPTIONS)]) == ARRAY_OPTIONS
    assert tuple(backward[6 : 6 + len(ARRAY_OPTIONS)]) == ARRAY_OPTIONS
