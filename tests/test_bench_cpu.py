"""The cpu benchmark suite's plan and its route through ``python -m flashcupy bench --suite cpu``."""

from __future__ import annotations

import json
import subprocess
import sys

from flashcupy import __main__ as cli

from support import ROOT, bench_plan, bench_script

FIELDS = {"system", "dtype", "B", "H", "L", "D", "causal", "mode", "threads"}


def _plan(*args: str) -> list[dict]:
    return [json.loads(line) for line in bench_plan("cpu", *args)]


def test_cli_routes_the_cpu_suite_to_bench_cpu() -> None:
    assert cli.find_bench_script([ROOT], relative=cli.SUITE_SCRIPTS["cpu"]) == ROOT / "bench" / "bench_cpu.py"
    plan = _plan()
    assert plan and all(FIELDS <= set(spec) for spec in plan)
    shapes = {(s["dtype"], s["L"], s["D"], s["causal"]) for s in plan}
    assert shapes == {("float32", 1024, 64, False), ("float32", 4096, 64, False), ("float32", 4096, 128, False),
                      ("float32", 4096, 64, True), ("float64", 4096, 64, False)}
    assert {s["mode"] for s in plan} == {"fwd", "fwd+bwd"}
    assert {s["system"] for s in plan} == {"flashcupy", "torch-cpu", "jax-cpu", "numpy-naive"}
    assert all(len(s["cores"]) == s["threads"] for s in plan)


def test_thread_counts_are_checked() -> None:
    proc = subprocess.run([sys.executable, "bench/bench_cpu.py", "--dry-run", "--threads", "100000"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode != 0 and "--threads: expected 1.." in proc.stderr


def test_rounds_take_turns_and_combine_by_the_median() -> None:
    bench = bench_script("bench_cpu")
    plan = _plan("--systems", "flashcupy", "torch-cpu", "--modes", "fwd", "--threads", "1")
    groups = bench._shape_groups(plan)
    assert len(groups) == 5 and all([s["system"] for s in g] == ["flashcupy", "torch-cpu"] for g in groups)
    runs = [dict(plan[0], ms=ms, ms_min=ms - 1, peak_mib=peak, rss_mib=100.0, rel_error=1e-7)
            for ms, peak in ((30.0, 5.0), (10.0, 7.0), (20.0, 6.0))]
    row = bench._combine(runs)
    assert (row["ms"], row["ms_min"], row["ms_rounds"], row["peak_mib"]) == (20.0, 9.0, [30.0, 10.0, 20.0], 7.0)
    failed = dict(plan[0], failure="relative error 1 > 0.0001")
    assert bench._combine([runs[0], failed]) is failed
