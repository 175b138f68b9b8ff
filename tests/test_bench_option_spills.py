"""bench/option_spills.py's option sets and the calls it screens (no NVRTC needed)."""

from __future__ import annotations

from flashcupy.cuda import spec

from support import bench_script


def test_every_option_set_once_with_each_bias_dtype() -> None:
    sets = bench_script("option_spills").option_sets()
    assert len(sets) == len(set(sets)) == 95  # 63 subsets, the 32 with a bias twice
    subsets = {tuple(m for i, m in enumerate(spec.SCORE_MODS) if bits >> i & 1) for bits in range(1, 64)}
    assert {s.mods for s in sets} == subsets
    assert spec.EVERY_OPTION in sets and all(s.full for s in sets)


def test_screened_calls_carry_every_option_on_tensor_cores() -> None:
    tool = bench_script("option_spills")
    calls = tool.calls(90)
    assert calls and all(call.scores == spec.EVERY_OPTION and not call.portable for _, call in calls)
    kernels = [tool.chosen(family, call) for family, call in calls]
    assert all("Simt" not in name for names in kernels for _, name in names)
    assert any(family == "backward" and len(names) == 2 for (family, _), names in zip(calls, kernels))
