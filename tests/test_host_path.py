"""The per-call caches of the host path give exactly what the uncached path computes, and key on
everything that matters: a changed option (value or type), dtype, shape, stride, pointer
alignment or device never reuses a stale entry.

CPU: parameter-block packing and templates against NumPy field assignment, the problem cache
against full validation, the dropout-check and kernel-selection caches, the CUDA backend's
layout key. GPU (``pytest -m gpu``): calls that reuse a parameter block give bitwise the results
of calls with every cache emptied.
"""

from __future__ import annotations

import dataclasses
import math
import re

import ml_dtypes
import numpy as np
import pytest

from flashcupy import cuda
from flashcupy import problem as problems
from flashcupy.cuda import params as P
from flashcupy.cuda import spec as S
from flashcupy.problem import check_dropout, make_host_problem, make_problem

F16, F32 = np.dtype(np.float16), np.dtype(np.float32)
BF16 = np.dtype(ml_dtypes.bfloat16)


def _arrays(q_shape=(2, 4, 5, 8), k_shape=(2, 2, 7, 8), dv=6, dtype=F32, seed=0):
    rs = np.random.default_rng(seed)
    v_shape = k_shape[:-1] + (dv,)
    return tuple(rs.standard_normal(s).astype(dtype) for s in (q_shape, k_shape, v_shape))


# --------------------------------------------------------------------------- parameter blocks


def _numpy_pack(dtype: np.dtype, **fields) -> np.void:
    """The reference packing: a zeroed record, each field assigned through NumPy."""
    record = np.zeros((), dtype)
    for name, value in fields.items():
        record[name] = value
    return record[()]


def _random_fields(dtype: np.dtype, rs: np.random.Generator) -> dict:
    """A random subset of the scalar fields of ``dtype``, each with a random value of its range."""
    fields = {}
    for name in dtype.names:
        field = dtype.fields[name][0]
        if field.names is not None or rs.random() < 0.3:
            continue
        if field.kind == "f":
            fields[name] = float(rs.standard_normal() * 10.0 ** rs.integers(-30, 30))
        else:
            info = np.iinfo(field)
            fields[name] = int(rs.integers(info.min, info.max, endpoint=True, dtype=field))
    return fields


def test_pack_matches_numpy_field_assignment() -> None:
    rs = np.random.default_rng(0)
    for _ in range(50):
        fields = _random_fields(P.PARAMS_DTYPE, rs)
        ours, want = P.pack(**fields), _numpy_pack(P.PARAMS_DTYPE, **fields)
        assert ours.dtype == want.dtype and ours.tobytes() == want.tobytes()
        bwd = _random_fields(P.BWD_PARAMS_DTYPE, rs)
        assert (P.pack(P.BWD_PARAMS_DTYPE, f=ours, **bwd).tobytes()
                == _numpy_pack(P.BWD_PARAMS_DTYPE, f=want, **bwd).tobytes())
    with pytest.raises(KeyError, match=r"not fields of the parameter block: \['nope', 'q_sx'\]"):
        P.pack(q=1, nope=2, q_sx=3)


def test_template_fill_equals_packing_those_pointers() -> None:
    rs = np.random.default_rng(1)

    def pointers(names):
        return {n: int(rs.integers(0, 2**64 - 1, endpoint=True, dtype=np.uint64)) for n in names}

    fields = _random_fields(P.PARAMS_DTYPE, rs)
    template = P.Template(P.pack(**fields), cuda._FORWARD_POINTERS)
    kept = template.buffer()
    for _ in range(3):  # each fill of the kept block rewrites the named fields, keeps the rest
        new = pointers(cuda._FORWARD_POINTERS)
        template.fill_into(kept, *new.values())
        assert bytes(kept) == P.pack(**{**fields, **new}).tobytes()

    bwd = _random_fields(P.BWD_PARAMS_DTYPE, rs)
    template = P.Template(P.pack(P.BWD_PARAMS_DTYPE, f=P.pack(**fields), **bwd), cuda._BACKWARD_POINTERS)
    new = pointers(cuda._BACKWARD_POINTERS)
    inner = {name[2:]: value for name, value in new.items() if name.startswith("f.")}
    outer = {name: value for name, value in new.items() if not name.startswith("f.")}
    want = P.pack(P.BWD_PARAMS_DTYPE, f=P.pack(**{**fields, **inner}), **{**bwd, **outer})
    kept = template.buffer()
    template.fill_into(kept, *new.values())
    assert bytes(kept) == want.tobytes()


# --------------------------------------------------------------------------- the problem cache

OPTION_CASES = [
    {},
    {"causal": True},
    {"causal": "top_left", "window": (3, None)},
    {"window": (None, 2), "scale": -0.0},
    {"scale": 0.25, "softcap": 5.0, "return_lse": True, "allow_tf32": True},
    {"dropout_p": 0.2, "seed": 7, "dropout_offset": 3},
]


def _fields(pb) -> dict:
    return {f.name: getattr(pb, f.name) for f in dataclasses.fields(pb) if f.name not in ("q", "k", "v")}


@pytest.mark.parametrize("shapes", [((2, 4, 5, 8), (2, 2, 7, 8)), ((5, 8), (7, 8))], ids=["4d", "2d"])
@pytest.mark.parametrize("options", OPTION_CASES)
def test_cached_problem_equals_full_validation(shapes, options) -> None:
    options = {"backend": "cpu", **options}
    problems._validated.cache_clear()
    make_host_problem(*_arrays(*shapes), options)  # fills the cache
    q, k, v = _arrays(*shapes, seed=1)
    cached, full = make_host_problem(q, k, v, options), make_problem(q, k, v, options)
    assert problems._validated.cache_info().hits >= 1
    assert _fields(cached) == _fields(full)
    assert math.copysign(1.0, cached.scale) == math.copysign(1.0, full.scale)
    for ours, want, given in zip((cached.q, cached.k, cached.v), (full.q, full.k, full.v), (q, k, v)):
        assert ours.shape == want.shape and np.shares_memory(ours, given) and np.array_equal(ours, want)


def test_problem_cache_keys_on_option_types_values_shapes_and_dtypes() -> None:
    q, k, v = _arrays()
    cpu = {"backend": "cpu"}
    accepted_then_rejected = [
        ({"causal": True}, {"causal": 1}, ValueError, "causal: expected"),
        ({"window": (1, None)}, {"window": (True, None)}, TypeError, "window: expected left"),
        ({"window": (1, None)}, {"window": (1.0, None)}, TypeError, "window: expected left"),
        ({"scale": 2}, {"scale": True}, TypeError, "scale: expected"),
        ({"dropout_offset": 1}, {"dropout_offset": True}, TypeError, "dropout_offset: expected"),
        ({"seed": 3}, {"seed": 3.0}, TypeError, "seed: expected"),
        ({"return_lse": True}, {"return_lse": 1}, TypeError, "return_lse: expected a bool"),
        ({"softcap": 2.0}, {"softcap": -2.0}, ValueError, "softcap: expected a positive"),
        ({}, {"causal_": True}, TypeError, "unexpected keyword argument"),
    ]
    for good, bad, error, match in accepted_then_rejected:
        make_host_problem(q, k, v, {**cpu, **good})
        with pytest.raises(error, match=match):
            make_host_problem(q, k, v, {**cpu, **bad})
    assert math.copysign(1.0, make_host_problem(q, k, v, {**cpu, "scale": 0.0}).scale) == 1.0
    assert math.copysign(1.0, make_host_problem(q, k, v, {**cpu, "scale": -0.0}).scale) == -1.0
    assert make_host_problem(*_arrays(dtype=F16), cpu).dtype == F16
    assert make_host_problem(*_arrays(dtype=BF16), cpu).dtype == BF16
    assert make_host_problem(*_arrays(q_shape=(2, 4, 9, 8)), cpu).seqlen_q == 9
    with pytest.raises(TypeError, match="q, k, v: expected one dtype"):
        make_host_problem(q, k.astype(F16), v, cpu)
    with pytest.raises(ValueError, match="k: expected a number of heads"):
        make_host_problem(q, *_arrays(k_shape=(2, 3, 7, 8))[1:], cpu)


def test_calls_with_array_or_numpy_scalar_options_are_validated_in_full() -> None:
    q, k, v = _arrays()
    assert problems._signature(q, k, v, {"scale": np.float64(0.5)}) is None
    assert problems._signature(q, k, v, {"mask": np.ones((5, 7), bool)}) is None
    assert problems._signature(q, k, v, {"q_lengths": 3}) is None
    assert problems._signature(q, k, v, {"window": [1, 2]}) is None
    pb = make_host_problem(q, k, v, {"backend": "cpu", "q_lengths": np.array([5, 2])})
    assert pb.q_lengths.tolist() == [5, 2]


def test_dropout_check_cache_keys_on_types() -> None:
    assert check_dropout(0.0, None, 1) == (0.0, None, 1)
    with pytest.raises(TypeError, match="dropout_offset: expected an int"):
        check_dropout(0.0, None, True)
    assert check_dropout(0.5, 3, 0) == (0.5, 3, 0)
    with pytest.raises(TypeError, match="seed: expected an int"):
        check_dropout(0.5, 3.0, 0)
    with pytest.raises(TypeError, match="dropout_p: expected a float"):
        check_dropout([0.5], None, 0)  # unhashable: checked uncached
    with pytest.raises(ValueError, match="dropout_p: expected a float in"):
        check_dropout(1.0, None, 0)


# --------------------------------------------------------------------------- kernel selection


def _uncached_forward(dtype, d, dv, arch, smem, tf32, portable, scores):
    return S.choose_forward.__wrapped__(S.Call(dtype, S.head_dim_bucket(max(d, dv)), arch, smem, tf32, portable,
                                               scores)).spec


def _uncached_backward(dtype, d, dv, arch, smem, tf32, portable, deterministic, scores):
    return S.choose_backward.__wrapped__(S.Call(dtype, S.head_dim_bucket(max(d, dv)), arch, smem, tf32, portable,
                                                scores, deterministic)).spec


def test_kernel_selection_cache_matches_uncached_and_follows_the_portable_switch(monkeypatch) -> None:
    monkeypatch.delenv(S.FORCE_PORTABLE_ENV, raising=False)
    for arch, smem in S.ARCH_SMEM.items():
        for dtype in S.CXX_TYPE:
            for d in (1, 64, 111, 256, 512):
                for tf32, portable, scores, deterministic in ((False, False, S.PLAIN, False),
                                                              (True, True, S.EVERY_OPTION, True)):
                    for cached, uncached, extra in (
                        (S.select_forward, _uncached_forward, (scores,)),
                        (S.select_backward, _uncached_backward, (deterministic, scores)),
                    ):
                        try:
                            want = uncached(dtype, d, d, arch, smem, tf32, portable, *extra)
                        except S.NoKernelError as exc:
                            with pytest.raises(S.NoKernelError, match=re.escape(str(exc))):
                                cached(dtype, d, d, arch, smem, tf32, portable, *extra)
                        else:
                            assert cached(dtype, d, d, arch, smem, tf32, portable, *extra) == want
    assert S.select_forward("float16", 64, 64, 80, S.ARCH_SMEM[80]).policy == "mma16"
    assert S.select_backward("float16", 128, 128, 90, S.ARCH_SMEM[90], scores=S.EVERY_OPTION).policy == "mma16"
    assert S.select_backward("float16", 64, 64, 90, S.ARCH_SMEM[90]).policy == "wgmma"
    assert S.select_forward("float16", 128, 128, 90, S.ARCH_SMEM[90]).policy == "wgmma"
    monkeypatch.setenv(S.FORCE_PORTABLE_ENV, "1")
    assert S.select_forward("float16", 128, 128, 90, S.ARCH_SMEM[90]).policy == "simt"
    assert S.select_forward("float16", 64, 64, 90, S.ARCH_SMEM[90]).policy == "simt"
    assert S.select_backward("float16", 64, 64, 90, S.ARCH_SMEM[90]).policy == "simt"


# --------------------------------------------------------------------------- the CUDA layout key


def test_layout_key_covers_device_strides_dtype_and_options() -> None:
    q, k, v = _arrays()
    cpu = {"backend": "cpu"}

    def key(q, k, v, device=0, **options):
        pb = make_host_problem(q, k, v, {**cpu, **options})
        return cuda._layout_key(pb, device, (pb.q, pb.k, pb.v))

    blhd = [np.ascontiguousarray(x.swapaxes(-2, -3)).swapaxes(-2, -3) for x in (q, k, v)]
    keys = [
        key(q, k, v), key(q, k, v, device=1), key(*blhd), key(*(x.astype(F16) for x in (q, k, v))),
        key(q, k, v, causal=True), key(q, k, v, causal="top_left"), key(q, k, v, window=(2, 3)),
        key(q, k, v, scale=0.0), key(q, k, v, scale=-0.0), key(q, k, v, softcap=3.0),
        key(q, k, v, dropout_p=0.1, seed=1), key(q, k, v, dropout_p=0.1, seed=2),
        key(q, k, v, dropout_p=0.1, seed=1, dropout_offset=4), key(*_arrays(q_shape=(2, 4, 9, 8))),
    ]
    misaligned = np.frombuffer(np.zeros(q.size * 4 + 4, np.uint8), F32, q.size, 4).reshape(q.shape)
    keys.append(key(misaligned, k, v))  # _rows copies q: the block holds the copy's strides
    assert None not in keys and len(set(keys)) == len(keys)
    assert key(q, k, v) == key(*_arrays(seed=5))  # other data, same layout
    for options in ({"mask": np.ones((5, 7), bool)}, {"bias": np.zeros((5, 7), F32)}, {"alibi_slopes": [1.0] * 4},
                    {"q_lengths": [5, 2]}, {"block_mask": np.ones((1, 1), bool), "block_size": 8}):
        assert key(q, k, v, **options) is None, options


def test_each_thread_fills_its_own_kept_block() -> None:
    import threading

    from flashcupy.cuda.compile import KeptBlock, ThreadBlocks

    blocks = ThreadBlocks(P.Template(P.pack(), cuda._FORWARD_POINTERS))
    mine = blocks.get()
    assert isinstance(mine, KeptBlock) and blocks.get() is mine
    theirs = []
    worker = threading.Thread(target=lambda: theirs.append(blocks.get()))
    worker.start()
    worker.join()
    assert theirs[0] is not mine and bytes(theirs[0].block) == bytes(mine.block) == P.pack().tobytes()


def test_rows_padded_to_16_bytes_are_never_planned() -> None:
    """A row operand whose copy was padded (a head dim of 36 halves: rows of 72 -> 80 bytes)
    is no plain contiguous copy: no CallPlan may pass a caller's own copy for it."""
    from types import SimpleNamespace

    def array(ptr, size, contiguous=True):
        return SimpleNamespace(data=SimpleNamespace(ptr=ptr), size=size, flags=SimpleNamespace(c_contiguous=contiguous))

    q, k, v = array(16, 720), array(2048, 720), array(4096, 720)
    plain = cuda._launch_plan(None, [], 0, (array(8192, 720), k, v), (q, k, v))
    padded = cuda._launch_plan(None, [], 0, (array(8192, 800), k, v), (q, k, v))
    assert plain.copied == padded.copied == (True, False, False)
    assert plain.packed == (True, False, False) and padded.packed == (False, False, False)
    assert cuda._call_plan(plain, 3, [], [], (0, 1, 2)).copies == (True, False, False)
    assert cuda._call_plan(padded, 3, [], [], (0, 1, 2)) is None


def test_forward_plans_are_the_kept_blocks_of_their_layout(monkeypatch) -> None:
    """forward_plan hands a caller the kept block of the problem's layout with the results in
    the caller's shapes; none where no kernel fits, with sinks, or for a block with copies no
    caller can repeat."""
    from types import SimpleNamespace

    from flashcupy.cuda.spec import NoKernelError

    host = make_host_problem(*_arrays(), {"backend": "cpu"})

    def device_array(x, ptr):
        return SimpleNamespace(shape=x.shape, strides=x.strides, device=SimpleNamespace(id=0),
                               data=SimpleNamespace(ptr=ptr))

    pb = dataclasses.replace(host, q=device_array(host.q, 256), k=device_array(host.k, 512),
                             v=device_array(host.v, 1024))
    templates = cuda._Templates()
    monkeypatch.setattr(cuda, "_FORWARD_TEMPLATES", templates)
    monkeypatch.setattr(cuda, "_forward_spec", lambda pb, device_id: "spec")
    key = cuda._layout_key(pb, 0, (pb.q, pb.k, pb.v), "spec")
    kept = cuda.LaunchPlan(P.Template(P.pack(), cuda._FORWARD_POINTERS), [], 0, (False,) * 3, (False,) * 3)
    templates.put(key, kept)
    plan = cuda.forward_plan(pb)
    assert plan.launches is kept and plan.copies == (False,) * 3 and plan.order == (0, 1, 2, 3, 4)
    assert [(shape, dtype) for shape, dtype, _ in plan.results] == [((2, 4, 5, 6), F32), ((2, 4, 5), F32)]
    assert cuda.length_plan(pb) is None  # one launch only: this block has none
    assert cuda.forward_plan(dataclasses.replace(pb, sinks=np.zeros(4))) is None
    templates.put(key, cuda.LaunchPlan(kept.template, [], 0, (True, False, False), (False, False, False)))
    assert cuda.forward_plan(pb) is None  # q was copied as no caller can repeat (padded rows)

    def no_kernel(pb, device_id):
        raise NoKernelError("none fits")

    monkeypatch.setattr(cuda, "_forward_spec", no_kernel)
    assert cuda.forward_plan(pb) is None and cuda.length_plan(pb) is None


def test_array_options_given_as_numbers_or_tuples_are_never_planned_or_cached() -> None:
    """sinks=0.5 or a tuple of slopes are array options: validated in full every call (their
    arrays are made then) and never a planned call's (a plan fills in no option array)."""
    for options in ({"sinks": 0.5}, {"sinks": (0.1, 0.2)}, {"alibi_slopes": 0.25}, {"bias": 1.0},
                    {"q_lengths": 3}, {"kv_lengths": (2, 3)}):
        assert problems.option_signature(options) is None, options
    assert problems.option_signature({"sinks": None, "causal": True}) == ("sinks", ("causal", True, bool))


# --------------------------------------------------------------------------- GPU


def _offset(cupy, x, elements: int):
    """A copy of ``x`` with x's shape and contiguous strides, ``elements`` past a fresh allocation."""
    y = cupy.empty(x.size + elements, x.dtype)[elements:].reshape(x.shape)
    y[...] = x
    return y


@pytest.mark.gpu
def test_reused_parameter_blocks_give_the_results_of_fresh_ones(monkeypatch) -> None:
    cupy = pytest.importorskip("cupy")
    import flashcupy as fc

    monkeypatch.setattr(cuda, "poison_outputs", True)
    real_pack, packs = P.pack, []

    def counting_pack(*args, **kwargs):
        packs.append(args)
        return real_pack(*args, **kwargs)

    monkeypatch.setattr(P, "pack", counting_pack)

    def run(q, k, v, dout, **options):
        out, lse = fc.flash_attention_forward(q, k, v, backend="cuda", **options)
        grads = fc.flash_attention_backward(dout, q, k, v, out, lse, backend="cuda", deterministic=True, **options)
        return [x.get() for x in (out, lse, *grads)]

    def fresh(*arrays, **options):
        monkeypatch.setattr(cuda, "_FORWARD_TEMPLATES", cuda._Templates())
        monkeypatch.setattr(cuda, "_BACKWARD_TEMPLATES", cuda._Templates())
        problems._validated.cache_clear()
        return run(*arrays, **options)

    def device(shape, dtype=F16, seed=0):
        rs = np.random.default_rng(seed)
        return [cupy.asarray(rs.standard_normal(shape).astype(dtype)) for _ in range(4)]

    shape = (2, 3, 130, 64)
    base = device(shape)
    fresh(*base)
    packs.clear()
    run(*base)
    assert not packs, "a repeated call packed its parameter blocks again"

    other = device(shape, seed=1)
    strided = [cupy.ascontiguousarray(x.swapaxes(2, 3)).swapaxes(2, 3) for x in other]  # keys strided: copied
    fresh(*strided)
    packs.clear()
    run(*strided)
    assert not packs, "a repeated call whose operands are copied packed its parameter blocks again"
    variants = {
        "other data, same layout": (other, {}),
        "16-byte misaligned pointers": ([_offset(cupy, x, 4) for x in other], {}),
        "(B, L, H, D) strides": ([cupy.ascontiguousarray(x.swapaxes(1, 2)).swapaxes(1, 2) for x in other], {}),
        "keys strided, copied each call": (strided, {}),
        "dout of one element broadcast (torch's grad of a sum)": (
            other[:3] + [cupy.broadcast_to(other[3][:1, :1, :1, :1], shape)], {}),
        "bfloat16": (device(shape, BF16, seed=2), {}),
        "one head, 2-D": ([x[0, 0] for x in other], {}),
        "causal": (other, {"causal": True}),
        "window": (other, {"window": (5, 0)}),
        "negative zero scale": (other, {"scale": -0.0}),
        "softcap": (other, {"softcap": 3.0}),
        "dropout": (other, {"dropout_p": 0.25, "seed": 11}),
        "dropout, another seed": (other, {"dropout_p": 0.25, "seed": 12}),
    }
    for what, (arrays, options) in variants.items():
        run(*base)  # the caches hold the base layout and options
        cached = run(*arrays, **options)
        again = run(*arrays, **options)
        want = fresh(*arrays, **options)
        for n, (a, b, c) in enumerate(zip(cached, again, want)):
            for got in (a, b):
                assert got.shape == c.shape and got.dtype == c.dtype, (what, n)
                assert np.array_equal(got.view(np.uint8), c.view(np.uint8)), f"{what}: result {n} differs bitwise"


#: (q shape, k shape, options, dtype, layout) of planned CuPy calls; "blhd": (B, L, H, D) memory.
PLANNED_CASES = {
    "fp16": ((2, 3, 130, 64), (2, 3, 130, 64), {}, F16, "bhld"),
    "bf16 GQA causal, (B, L, H, D)": ((1, 8, 70, 64), (1, 2, 90, 64), {"causal": True}, BF16, "blhd"),
    "fp32 one head 2-D, window": ((33, 40), (45, 40), {"window": (4, 2), "scale": 0.3}, F32, "bhld"),
}


@pytest.mark.gpu
def test_gpu_alibi_slopes_are_never_copied_back(monkeypatch) -> None:
    """ALiBi slopes on the GPU of a GPU call are read by the kernels where they lie (a copy back
    would wait for the GPU at every call): the general forward and backward, and the decode
    kernels, give bitwise the results of the same slopes given on the host."""
    import cupy

    import flashcupy as fc
    from flashcupy.problem import options as option_checks

    q, k, v = (cupy.asarray(x) for x in _arrays((2, 4, 70, 64), (2, 2, 90, 64), 64, F16, seed=3))
    host = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    slopes = cupy.asarray(host)
    dout = cupy.ones((2, 4, 70, 64), F16)
    want = fc.flash_attention_vjp(q, k, v, alibi_slopes=host, causal=True)
    want = (want[0], *want[1](dout))
    cache = (q[:, :, :1], k, v)
    want_decode = fc.flash_attention_with_kvcache(*cache, alibi_slopes=host, cache_seqlens=80)
    real = option_checks.host_array

    def host_array(name, x):
        assert name != "alibi_slopes", "GPU slopes copied back to the host"
        return real(name, x)

    monkeypatch.setattr(option_checks, "host_array", host_array)
    monkeypatch.setattr(problems.arrays, "host_array", host_array)
    got = fc.flash_attention_vjp(q, k, v, alibi_slopes=slopes, causal=True)
    got = (got[0], *got[1](dout))
    for g, w in zip(got, want, strict=True):
        assert cupy.array_equal(g, w)
    assert cupy.array_equal(fc.flash_attention_with_kvcache(*cache, alibi_slopes=slopes, cache_seqlens=80),
                            want_decode)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(PLANNED_CASES))
def test_planned_cupy_calls_equal_the_full_path_and_skip_it(case, monkeypatch) -> None:
    """flash_attention, flash_attention_forward / _backward and flash_attention_vjp on CuPy
    arrays laid out like an earlier call run its kept plans (flashcupy.calls): no validation,
    results equal the full path's bit for bit (dQ of the non-deterministic vjp to rounding),
    poisoned outputs all written; torch's broadcast gradient of a sum is copied contiguous."""
    cupy = pytest.importorskip("cupy")
    import flashcupy as fc
    from flashcupy import api, calls

    qs, ks, opts, dtype, layout = PLANNED_CASES[case]
    monkeypatch.setattr(calls, "CUPY", calls.Calls(calls.CUPY.kind))
    monkeypatch.setattr(cuda, "poison_outputs", True)
    prepared = []
    real_prepare = api._prepare
    monkeypatch.setattr(api, "_prepare", lambda *a, **kw: prepared.append(1) or real_prepare(*a, **kw))
    rs = np.random.default_rng(5)

    def device(shape):
        x = cupy.asarray(rs.standard_normal(shape).astype(dtype))
        return cupy.ascontiguousarray(x.swapaxes(1, 2)).swapaxes(1, 2) if layout == "blhd" else x

    q, k, v, dout = device(qs), device(ks), device(ks), device(qs)
    broadcast = cupy.broadcast_to(dout.ravel()[:1].reshape((1,) * dout.ndim), dout.shape)

    def host(results):
        return [x.get() for x in results]

    def steps():
        out, lse = fc.flash_attention(q, k, v, return_lse=True, **opts)
        f_out, f_lse = fc.flash_attention_forward(q, k, v, **opts)
        det = fc.flash_attention_backward(dout, q, k, v, f_out, f_lse, deterministic=True, **opts)
        summed = fc.flash_attention_backward(broadcast, q, k, v, f_out, f_lse, deterministic=True, **opts)
        v_out, vjp = fc.flash_attention_vjp(q, k, v, **opts)
        return host([out, lse, f_out, f_lse, *det, *summed, v_out]), host(vjp(dout))

    want, want_vjp = steps()  # full path (the vjp's forward is flash_attention_forward's plan)
    assert np.array_equal(want[-1].view(np.uint8), want[0].view(np.uint8))
    steps()
    prepared.clear()
    got, got_vjp = steps()
    assert not prepared, "a planned call was validated again"
    for a, b in zip(got + got_vjp[1:], want + want_vjp[1:], strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype and not np.isnan(a.astype(np.float32)).any()
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    np.testing.assert_allclose(got_vjp[0].astype(np.float32), want_vjp[0].astype(np.float32), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
def test_cupy_calls_of_other_lengths_take_the_length_plan(monkeypatch) -> None:
    """flash_attention on CuPy arrays that differ from a planned call only in lengths and
    strides runs the planned kernel without validation; results equal the full path's."""
    cupy = pytest.importorskip("cupy")
    import flashcupy as fc
    from flashcupy import api, calls

    table = calls.Calls(calls.CUPY.kind)
    monkeypatch.setattr(cuda, "poison_outputs", True)
    prepared = []
    real_prepare = api._prepare
    monkeypatch.setattr(api, "_prepare", lambda *a, **kw: prepared.append(1) or real_prepare(*a, **kw))
    rs = np.random.default_rng(7)
    cache = [cupy.asarray(rs.standard_normal((1, 4, 500, 128)).astype(BF16)) for _ in range(2)]
    queries = cupy.asarray(rs.standard_normal((1, 500, 8, 128)).astype(BF16)).swapaxes(1, 2)
    for n, length in enumerate((33, 34, 200, 499)):
        q, k, v = queries[:, :, :length], cache[0][:, :, :length], cache[1][:, :, :length]
        monkeypatch.setattr(calls, "CUPY", table)
        got = fc.flash_attention(q, k, v, causal=True, return_lse=True)
        assert len(prepared) == (1 if n == 0 else 0), f"length {length} was validated"
        monkeypatch.setattr(calls, "CUPY", calls.Calls(calls.CUPY.kind))
        want = fc.flash_attention(q, k, v, causal=True, return_lse=True)
        prepared.clear()
        for a, b in zip(got, want, strict=True):
            a, b = a.get(), b.get()
            assert a.shape == b.shape and not np.isnan(a.astype(np.float32)).any()
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"length {length}"


def test_score_operands_reach_the_kernels_with_contiguous_aligned_rows() -> None:
    """Biases and masks whose keys are strided or broadcast, or whose rows are not 16-byte
    aligned, are copied once (their distinct elements, rows padded) and broadcast back: the
    forward's staged tiles then copy 16-byte chunks. Aligned ones pass untouched."""
    rs = np.random.default_rng(0)
    target = (2, 3, 5, 17)
    operands = [
        rs.standard_normal((5, 17)).astype(np.float16),  # odd key count: rows 34 bytes apart
        np.ascontiguousarray(rs.standard_normal((17, 5)).astype(np.float32)).T,  # keys strided
        rs.standard_normal((5, 1)),  # one value a row, broadcast over the keys
        rs.random((2, 1, 1, 17)) < 0.5,  # key padding, one row a batch entry
        rs.standard_normal((3, 5, 40)).astype(ml_dtypes.bfloat16)[..., 3:20],  # rows start unaligned
    ]
    for x in operands:
        view = np.broadcast_to(x, target)
        got = cuda._score_operand(view, np)
        assert got.shape == target and got.dtype == x.dtype and np.array_equal(got, view)
        assert got.strides[-1] == got.itemsize and cuda._address(got) % 16 == 0
        assert all(s % 16 == 0 for n, s in zip(got.shape[:-1], got.strides[:-1]) if n > 1)
        own = (1,) * (4 - x.ndim) + x.shape
        assert all(s == 0 for s, a, b in zip(got.strides[:-1], own[:-1], target[:-1]) if a < b)  # no copy over them
    aligned = np.zeros((5, 32), np.float16)
    if cuda._address(aligned) % 16 == 0:
        view = np.broadcast_to(aligned[:, :17], target)  # rows 64 bytes apart: aligned already
        assert cuda._score_operand(view, np) is view


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("full", [False, True])
def test_hopper_forward_takes_wgmma_only_where_it_compiles(dtype, full) -> None:
    """wgmma (sm_90a) only on compute capability 9.0, only at head dims of whole 64-column
    slabs, and its tiles (swizzled, plus 1024 bytes of alignment slack, then the staged bias
    and mask tiles of each stage) fit the GPU."""
    for d in (33, 64, 97, 120, 128, 129, 256):
        spec = S.select_forward(dtype, d, d, 90, S.ARCH_SMEM[90], scores=S.EVERY_OPTION if full else S.PLAIN)
        assert spec.policy == "wgmma" and spec.head_dim in S.WGMMA_HEAD_DIMS
        assert spec.num_warps % 4 == 0 and spec.block_n % 64 == 0 and spec.dv_tile % 64 == 0
        assert spec.smem_bytes == 1024 + 2 * (spec.block_m * spec.head_dim
                                              + spec.stages * spec.block_n * (spec.head_dim + spec.dv_tile)) \
            + spec.stages * S.score_tile_bytes(spec.scores, spec.block_m, spec.block_n)
        assert spec.smem_bytes <= S.ARCH_SMEM[90]
        assert spec.name_expression.startswith("flash::flash_fwd<flash::FwdOverlap<" if spec.mainloop == "FwdOverlap"
                                               else "flash::flash_fwd<flash::FwdSerial<__")
        assert spec.mainloop == "FwdOverlap" or "flash::MmaWgmma<" in spec.name_expression
    for d, arch in ((32, 90), (96, 90), (512, 90), (64, 80), (128, 80), (128, 86), (128, 89)):
        assert S.select_forward(dtype, d, d, arch, S.ARCH_SMEM[arch], scores=S.EVERY_OPTION if full else S.PLAIN).policy == "mma16"
    assert S.select_forward("float32", 128, 128, 90, S.ARCH_SMEM[90], scores=S.EVERY_OPTION).policy == "tf32x3"


def test_key_block_major_order_for_causal_float32_and_float64_only() -> None:
    """flash_bwd_dkdv's block order: key block by key block (heavy blocks first) where a
    causal mask makes blocks unequal and the kernels do not stream through L2 at 16-bit
    speeds; head by head otherwise."""
    for dtype in ("float16", "bfloat16", "float32", "float64"):
        for d, arch, full in ((64, 90, False), (128, 90, True), (128, 80, False)):
            spec = S.select_backward(dtype, d, d, arch, S.ARCH_SMEM[arch], scores=S.EVERY_OPTION if full else S.PLAIN)
            assert S.backward_key_block_major(spec, True) == (dtype in ("float32", "float64"))
            assert not S.backward_key_block_major(spec, False)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_split_roles_only_for_plain_float32_float64_at_96_and_128_on_sm90(dtype) -> None:
    """Two warps per 16 keys (ROLES = 2) where measured: float32 (3xTF32) and float64 without
    options or determinism, padded head dims 96 and 128, sm_90; one chunk of the whole head,
    256 threads, a fused dQ whose accumulator is dQ itself (P^T handed over times the scale),
    and P^T's hand-off buffer counted in shared memory; 3xTF32's tiles split once into hi and
    lo tiles (twice the tiles' bytes, one stage), float64's in two stages."""
    smem = S.ARCH_SMEM[90]
    for d in (65, 80, 96, 97, 128):
        spec = S.select_backward(dtype, d, d, 90, smem)
        assert spec.roles == 2 and spec.kv_chunk == spec.head_dim and spec.fused_dq and spec.threads == 256
        assert spec.dkdv_name.startswith("flash::flash_bwd_dkdv<flash::BwdSplitRoles<")
        assert f", {spec.head_dim}, 64, {spec.block_c}, {spec.stages}>, flash::PlainScores, " in spec.dkdv_name
        assert spec.presplit == (dtype == "float32") and spec.stages == (1 if spec.presplit else 2)
        one = dataclasses.replace(spec, roles=1)
        tiles = (2 * spec.block_r + 2 * spec.stages * spec.block_c) * (spec.head_dim + 4) * spec.itemsize
        handoff = spec.block_r * spec.block_c * spec.acc_itemsize
        assert spec.dkdv_smem_bytes == one.dkdv_smem_bytes + handoff + (tiles if spec.presplit else 0) <= smem
        assert spec.dq_threads == 2 * spec.block_r
        assert spec.dq_accum_scaled and one.dq_accum_scaled == (dtype == "float64")  # dS carries the scale
    for d, arch, full, deterministic in ((64, 90, False, False), (200, 90, False, False), (128, 90, True, False),
                                         (128, 90, False, True), (128, 80, False, False), (128, 89, False, False)):
        assert S.select_backward(dtype, d, d, arch, S.ARCH_SMEM[arch], scores=S.EVERY_OPTION if full else S.PLAIN,
                                 deterministic=deterministic).roles == 1
    assert S.select_backward(dtype, 128, 128, 90, smem, allow_tf32=True).roles == (2 if dtype == "float64"
                                                                                               else 1)


def test_tf32x3_wgmma_forward_only_for_plain_float32_at_128_on_sm90() -> None:
    """The 3xTF32 warpgroup forward where measured: float32 at float32 accuracy, no score
    option, padded head dim 128, sm_90; one warpgroup of 64 rows and a producer warpgroup,
    32-key tiles, and its hi and lo tiles (Q, K, V^T) beside the copied V in shared memory,
    which take one block an SM."""
    smem = S.ARCH_SMEM[90]
    for d, dv in ((97, 97), (128, 128), (64, 128), (128, 1)):
        spec = S.select_forward("float32", d, dv, 90, smem)
        assert spec.policy == "wgmma_tf32x3" and spec.name_expression == (
            f"flash::flash_fwd<flash::FwdProducerConsumer<128, 128, 32>, flash::PlainScores, {spec.smem_bytes}, 256>")
        assert (spec.block_m, spec.threads) == (64, 256)
        # Q hi and lo (64, 128); per stage K hi and lo (32, 128), V^T hi and lo (128, 32), V (32, 128)
        assert spec.smem_bytes == 4 * (2 * 64 * 128 + 2 * (2 * 32 * 128 + 3 * 32 * 128)) + 1024 <= smem
        assert 2 * spec.smem_bytes > smem
    for d, arch, full, tf32 in ((96, 90, False, False), (200, 90, False, False), (128, 90, True, False),
                                (128, 90, False, True), (128, 80, False, False), (128, 89, False, False)):
        assert S.select_forward("float32", d, d, arch, S.ARCH_SMEM[arch], allow_tf32=tf32,
                                scores=S.EVERY_OPTION if full else S.PLAIN).policy != "wgmma_tf32x3"
    assert S.select_forward("float32", 128, 128, 90, 200 * 1024).policy == "tf32x3"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_hopper_backward_takes_wgmma_only_without_options(dtype) -> None:
    """The wgmma backward (sm_90a) covers plain problems with a fused dQ: two warpgroups of
    64 keys, gradient chunks of at most 128 columns, 128-query tiles up to D = 64 and 64
    above; its swizzled tiles, dS^T and the 1024 bytes of alignment slack fit the GPU.
    Options, determinism, D = 32 or 512 and other GPUs keep mma.sync."""
    smem = S.ARCH_SMEM[90]
    for d in (33, 64, 97, 128, 200, 256):
        spec = S.select_backward(dtype, d, d, 90, smem)
        assert spec.policy == "wgmma" and spec.head_dim in S.WGMMA_BACKWARD_HEAD_DIMS
        assert spec.kv_chunk == min(spec.head_dim, 128) and spec.fused_dq and not spec.full
        assert spec.block_r == 128 and spec.block_c == (128 if spec.head_dim <= 64 else 64) and spec.threads == 256
        tiles = (2 * spec.block_r + 2 * spec.stages * spec.block_c) * spec.head_dim + spec.block_r * spec.block_c
        assert spec.dkdv_smem_bytes == 1024 + 2 * tiles + spec.stages * 2 * spec.block_c * 4 <= smem
        assert spec.stages == (1 if spec.head_dim == 256 else 2)
        assert spec.dkdv_name.startswith(f"flash::flash_bwd_dkdv<flash::BwdWgmma<{S.CXX_TYPE[dtype]}, ")
    for d, arch, full, deterministic in ((32, 90, False, False), (512, 90, False, False), (128, 90, True, False),
                                         (128, 90, False, True), (128, 80, False, False), (64, 89, False, False)):
        spec = S.select_backward(dtype, d, d, arch, S.ARCH_SMEM[arch], scores=S.EVERY_OPTION if full else S.PLAIN, deterministic=deterministic)
        assert spec.policy == "mma16"


@pytest.mark.parametrize("arch", [75, 80, 86, 89, 90])
def test_float32_keeps_float32_accuracy_unless_tf32_is_allowed(arch) -> None:
    """float32 takes three TF32 products per product (3xTF32) on sm_80+ by default, one with
    allow_tf32, and FMA before sm_80 or when forced portable; forward and backward alike."""
    smem = S.ARCH_SMEM[arch]
    for select in (S.select_forward, S.select_backward):
        for d in (40, 64, 128, 256):
            want = ("simt", "simt") if arch < 80 else ("tf32x3", "tf32")
            full = {"scores": S.EVERY_OPTION}  # the plain D = 128 forward on sm_90 takes TF32 wgmma
            assert (select("float32", d, d, arch, smem, **full).policy,
                    select("float32", d, d, arch, smem, True, **full).policy) == want
            assert select("float32", d, d, arch, smem, portable=True).policy == "simt"
    assert "flash::MmaTf32<true, " in S.select_forward("float32", 64, 64, 80, S.ARCH_SMEM[80]).name_expression


def test_arch_flag_names_sm_90a_only_for_compute_capability_9_0() -> None:
    assert S.arch_flag(90) == "sm_90a"
    assert [S.arch_flag(a) for a in (75, 80, 86, 89)] == ["sm_75", "sm_80", "sm_86", "sm_89"]


def test_temporaries_are_the_graphs_own_only_under_a_capture(monkeypatch) -> None:
    """cuda.temporaries: CuPy's allocator unchanged outside a capture and under an allocator
    marked graph_safe (the torch path's); stream-ordered allocations on the captured stream
    otherwise; where the driver has none, a RuntimeWarning once and the allocator unchanged."""
    import warnings

    cupy = pytest.importorskip("cupy")
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    monkeypatch.setattr(cuda, "_graph_allocations", lambda device: True)

    class Stream:
        ptr = 0x1230

    stream = Stream()
    assert cuda.temporaries(stream, False) is cuda._NO_CONTEXT
    with cuda.temporaries(stream, True):
        graph_memory = cupy.cuda.get_allocator()
    assert isinstance(graph_memory, cuda._GraphMemory) and graph_memory.stream is stream
    assert not isinstance(cupy.cuda.get_allocator(), cuda._GraphMemory)  # restored on the way out

    class SafeInCapture:
        graph_safe = True

        def __call__(self, nbytes):
            raise AssertionError("not called here")

    with cupy.cuda.using_allocator(SafeInCapture()):
        assert cuda.temporaries(stream, True) is cuda._NO_CONTEXT
    monkeypatch.setattr(cuda, "_graph_allocations", lambda device: False)
    cuda._warn_pool_temporaries.cache_clear()
    with pytest.warns(RuntimeWarning, match="stream-ordered"):
        assert cuda.temporaries(stream, True) is cuda._NO_CONTEXT
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cuda.temporaries(stream, True) is cuda._NO_CONTEXT  # warned once
