"""The cpu benchmark suite's plan and its route through ``python -m flashcupy bench --suite cpu``."""

from __future__ import annotations

import json
import subprocess
import sys

from flashcupy import __main__ as cli

from support import ROOT, bench_plan

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
