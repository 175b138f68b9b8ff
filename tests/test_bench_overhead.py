"""bench/bench_overhead.py without a GPU: its plan through the CLI."""

from __future__ import annotations

import flashcupy.__main__ as cli

from support import ROOT, bench_plan


def _plan(*args: str) -> list[list[str]]:
    return [line.split() for line in bench_plan("overhead", *args)]


def test_cli_routes_the_overhead_suite_to_bench_overhead() -> None:
    assert cli.find_bench_script([ROOT], relative=cli.SUITE_SCRIPTS["overhead"]) == ROOT / "bench" / "bench_overhead.py"


def test_plan_has_every_path_beside_sdpa_on_a_gpu_and_the_torch_path_on_a_cpu() -> None:
    gpu = _plan("--device", "cuda")
    assert len(gpu) == 3 * 2 * 5  # shapes x modes x (cupy, torch, graph, sdpa, sdpa graph)
    assert {(line[0], line[1]) for line in gpu} == {("flashcupy", "cupy"), ("flashcupy", "torch"),
                                                    ("flashcupy", "graph"), ("sdpa", "torch"), ("sdpa", "graph")}
    assert len(_plan("--device", "cuda", "--paths", "torch")) == 3 * 2 * 2
    assert {line[2] for line in gpu} == {"fwd", "fwd+bwd"}
    cpu = _plan("--device", "cpu")
    assert {(line[0], line[1]) for line in cpu} == {("flashcupy", "torch"), ("sdpa", "torch")}
