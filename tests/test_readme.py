"""The README: its first lines are the two commands CI runs, and its performance tables are
what bench/tables.py writes from the committed results in bench/results/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tables():
    """bench/tables.py as a module (bench/ is not a package)."""
    if "bench_tables" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "bench" / "tables.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # before running it: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["bench_tables"]


def test_readme_tables_are_written_from_the_committed_results() -> None:
    readme = (ROOT / "README.md").read_text()
    assert _tables().rewrite(readme) == readme, "README.md's tables differ: run python bench/tables.py"


def test_tables_name_each_suite_and_refuse_a_misfiled_run(monkeypatch) -> None:
    tables = _tables()
    text = tables.render()
    for name in tables.SOURCES:
        assert f"### {tables.SUITES[name].title}" in text
        for source in tables.SOURCES[name]:
            assert f"(bench/results/{source})" in text
    monkeypatch.setitem(tables.SOURCES, "cpu", tables.SOURCES["core"][:1])
    with pytest.raises(ValueError, match="a core file listed under cpu"):
        tables.render()


def test_readme_starts_with_the_two_commands_ci_runs() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```sh") + 1:]
    demo, tests = block[0], block[1]
    assert demo.startswith("python3 -m venv .venv && . .venv/bin/activate && pip install ")
    assert demo.endswith(" && python -m flashcupy demo")
    assert tests == "python3 -m venv .venv && . .venv/bin/activate && pip install '.[test]' && python -m pytest"
