"""flashcupy.explain: the kernels a call would run and the rule that chose them, without a GPU."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import flashcupy as fc
from flashcupy.cuda import spec as S


def _qkv(shape=(2, 4, 300, 64), dtype=np.float16, kv_len=None):
    q = np.zeros(shape, dtype)
    kv = q if kv_len is None else np.zeros(shape[:-2] + (kv_len, shape[-1]), dtype)
    return q, kv, kv


@pytest.mark.parametrize("arch", [75, 80, 86, 90])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_explain_names_the_kernels_select_returns(arch, dtype) -> None:
    q, k, v = _qkv(dtype=dtype)
    for options, scores in (({}, S.PLAIN), ({"causal": True, "window": (20, 3)}, S.PLAIN),
                            ({"softcap": 20.0}, S.ScoreSet(("softcap",))),
                            ({"bias": np.zeros((300, 300), np.float32)}, S.ScoreSet(("bias",), "float32"))):
        for deterministic in (False, True):
            e = fc.explain(q, k, v, arch=f"sm_{arch}", deterministic=deterministic, **options)
            name = np.dtype(dtype).name
            fwd = S.select_forward(name, 64, 64, arch, S.ARCH_SMEM[arch], scores=scores, portable=False)
            bwd = S.select_backward(name, 64, 64, arch, S.ARCH_SMEM[arch], scores=scores, portable=False,
                                    deterministic=deterministic)
            assert e.forward.spec == fwd and e.backward.spec == bwd
            assert e.forward.rule in S.FORWARD_RULES and e.backward.rule in S.BACKWARD_RULES
            names = [launch.name for launch in e.launches]
            assert names[0] == fwd.name_expression and bwd.dkdv_name in names and bwd.delta_name in names
            text = str(e)
            assert f"rule '{e.forward.rule.name}'" in text and f"rule '{e.backward.rule.name}'" in text
            assert fwd.name_expression in text and f"sm_{arch}" in text


def test_explain_reports_rules_and_launch_shapes() -> None:
    q, k, v = _qkv((1, 8, 4096, 128), kv_len=4096)
    e = fc.explain(q, k, v, arch=90, causal=True)
    assert e.forward.rule.name == "wgmma16-overlap" and e.forward.spec.mainloop == "FwdOverlap"
    assert e.backward.rule.name == "wgmma16" and e.backward.spec.mainloop == "BwdWgmma"
    forward = e.launches[0]
    assert forward.threads == 128 and forward.grid == (4096 // 64, 8, 1) and forward.smem_bytes <= S.ARCH_SMEM[90]
    assert [launch.role for launch in e.launches] == ["forward", "backward delta", "backward dK/dV",
                                                      "backward dQ convert"]
    f32 = fc.explain(*_qkv((1, 8, 1024, 128), np.float32), arch=90)
    assert f32.forward.rule.name == "3xtf32-producer-consumer" and f32.forward.spec.threads == 256
    assert f32.backward.rule.name == "3xtf32-split-roles" and f32.backward.spec.roles == 2
    # the accumulator is dQ itself at an even head dim: no conversion pass
    assert [launch.role for launch in f32.launches][-1] == "backward dK/dV"
    assert fc.explain(q, k, v, arch=90, backward=False).backward is None


def test_explain_falls_back_and_lists_what_did_not_fit() -> None:
    """Rules marked fallback hand a call none of their candidates fits to the next rule; the
    explanation lists the candidates that did not fit."""
    call = S.Call("float32", 128, 90, 200 * 1024)
    choice = S.choose_forward(call)
    assert choice.rule.name == "3xtf32" and choice.rejected
    assert all(rule == "3xtf32-producer-consumer" and spec.smem_bytes > call.smem_limit
               for rule, spec in choice.rejected)


def test_explain_reads_no_element_and_takes_options_of_every_kind() -> None:
    """Stand-ins of the arrays' shape and dtype go through validation: no element is read."""
    q = np.broadcast_to(np.zeros((), np.float16), (4, 16, 8192, 64))  # 1 GiB as a real array
    e = fc.explain(q, q, q, arch=80, mask=np.ones((8192, 8192), bool), alibi_slopes=np.ones(16),
                   q_lengths=np.full(4, 100), dropout_p=0.1, seed=3)
    assert e.forward.spec.full and e.backward.spec.full
    assert "mask" in e.call and "dropout_p" in e.call


def test_explain_errors_name_the_argument(monkeypatch) -> None:
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="arch: expected a compute capability"):
        fc.explain(q, k, v, arch="hopper")
    with pytest.raises(ValueError, match=r"arch: expected one of sm_75.*received sm_70"):
        fc.explain(q, k, v, arch=70)
    monkeypatch.setattr(fc.explain.__globals__["interop"], "gpu_usable", lambda: False)
    with pytest.raises(ValueError, match="arch: no usable CUDA GPU"):
        fc.explain(q, k, v)
    with pytest.raises(TypeError, match="unexpected keyword"):
        fc.explain(q, k, v, arch=90, casual=True)
    with pytest.raises(ValueError, match="window"):
        fc.explain(q, k, v, arch=90, window=(-1, 2))


def test_explain_says_where_sinks_go() -> None:
    e = fc.explain(*_qkv(), arch=90, sinks=np.zeros(1))
    assert "PlainScores" in e.forward.spec.name_expression  # sinks change no score: the plain kernels
    assert "sinks: no kernel of their own" in str(e)
    out = subprocess.run([sys.executable, "-m", "flashcupy", "explain", "--shape", "1,2,64,64", "--arch", "sm_90",
                          "--sinks"], capture_output=True, text=True, check=True).stdout
    assert "sinks: no kernel of their own" in out and "; sinks" in out


def test_explain_notes_forced_portable_kernels(monkeypatch) -> None:
    monkeypatch.setenv(S.FORCE_PORTABLE_ENV, "1")
    e = fc.explain(*_qkv(), arch=90)
    assert e.forward.spec.policy == "simt" and "FLASHCUPY_FORCE_PORTABLE=1" in str(e)


@pytest.mark.compile_matrix
def test_explain_compiles_for_registers_without_a_gpu() -> None:
    """registers=True: each kernel compiled by NVRTC for the named architecture, ptxas' figures."""
    from test_kernels_compile import nvrtc_problem

    problem = nvrtc_problem()
    if problem is not None:
        pytest.skip(problem)
    e = fc.explain(*_qkv((1, 2, 64, 64), np.float16), arch=80, backward=False, registers=True)
    (launch,) = e.launches
    assert 0 < launch.registers <= 255 and launch.spill_bytes == 0
    assert f"{launch.registers} registers, 0 bytes spilled" in str(e)


@pytest.mark.parametrize("mask_shape, planes", [
    ((2, 8, 256, 300), 16), ((8, 256, 300), 8), ((2, 1, 1, 300), 2), ((256, 300), 1)])
def test_explain_gives_tile_maps_a_plane_per_axis_the_mask_does_not_broadcast_over(mask_shape, planes) -> None:
    """The masks' tile maps (score/tile_map.cuh) run before the kernels, one grid plane per
    (batch, head) pair the mask varies over, as a real call launches them."""
    q = np.zeros((2, 8, 256, 64), np.float16)
    k = np.zeros((2, 8, 300, 64), np.float16)
    e = fc.explain(q, k, k, arch=90, mask=np.ones(mask_shape, bool), deterministic=True)
    maps = [launch for launch in e.launches if launch.role.endswith("tile map")]
    assert [launch.role for launch in e.launches][0] == "forward tile map" and len(maps) == 3
    assert all(launch.grid[1] * launch.grid[2] == planes for launch in maps)
    assert [m.grid[0] for m in maps] == [256 // 64, -(-300 // 64), 256 // 64]  # row tiles, key blocks, row tiles


@pytest.mark.parametrize("mask_shape", [(2, 8, 256, 300), (8, 256, 300), (2, 1, 1, 300), (256, 300), (2, 1, 256, 1)])
def test_a_calls_tile_map_planes_are_what_explain_lists(mask_shape) -> None:
    """The planes a real call's tile maps take (from the problem's mask views) and those
    explain lists (from the caller's arrays) agree, a block mask counted as well."""
    from flashcupy.cuda import _mask_planes
    from flashcupy.problem import make_host_problem

    q = np.zeros((2, 8, 256, 64), np.float16)
    k = np.zeros((2, 8, 300, 64), np.float16)
    options = {"mask": np.ones(mask_shape, bool), "block_mask": np.ones((1, 8, 4, 5), bool), "block_size": 64}
    pb = make_host_problem(q, k, k, {**options, "backend": "cpu"})
    e = fc.explain(q, k, k, arch=90, **options)
    (tile_map,) = [launch for launch in e.launches if launch.role == "forward tile map"]
    planes_b, planes_h = _mask_planes(pb)
    assert planes_h == 8 and tile_map.grid[1] * tile_map.grid[2] == planes_b * planes_h
