"""bench/bench_options.py without a GPU: the plan its --dry-run prints, reached through the CLI."""

from __future__ import annotations

import flashcupy.__main__ as cli

from support import ROOT, bench_plan


def _plan(*args: str) -> list[list[str]]:
    return [line.split() for line in bench_plan("options", *args)]


def test_cli_routes_the_options_suite_to_bench_options() -> None:
    assert cli.find_bench_script([ROOT], relative=cli.SUITE_SCRIPTS["options"]) == ROOT / "bench" / "bench_options.py"
    plan = _plan()
    # 16-bit: 2 dtypes x 2 head dims x 1 length; wide: 2 dtypes x 1 head dim x 2 lengths; x causal x mode x option
    assert len(plan) == (2 * 2 + 2 * 2) * 2 * 2 * 11
    assert {line[0] for line in plan} == {"float16", "bfloat16", "float32", "float64"}


def test_every_option_has_flashcupy_and_its_anchors() -> None:
    rows = {(line[0], line[7]): set(line[8:]) for line in _plan("--modes", "fwd", "--causal", "false",
                                                                  "--head-dims", "64")}
    assert all("flashcupy" in systems for systems in rows.values())
    assert rows[("float16", "bias")] >= {"sdpa-cudnn", "sdpa-efficient", "flex"}
    assert rows[("float16", "dropout")] >= {"sdpa-flash", "sdpa-efficient"}
    assert rows[("float16", "alibi")] == {"flashcupy", "flex"}
    assert rows[("float16", "sinks")] == {"flashcupy"}
    assert rows[("float32", "mask")] >= {"sdpa-efficient"}
    assert rows[("float64", "bias+mask+dropout")] == {"flashcupy", "sdpa-math"}
    for masks in ("padding", "block_mask"):
        assert rows[("float16", masks)] == {"flashcupy", "sdpa-cudnn", "sdpa-efficient", "flex"}
        assert rows[("float64", masks)] == {"flashcupy", "sdpa-math"}
