"""The README's performance tables, written from the committed JSON in bench/results/.

    python bench/tables.py            # rewrite the README between its table markers
    python bench/tables.py --check    # exit status 1 when the README differs from what this writes

One table per suite (docs/architecture.md, "Benchmarks"): the suite is a file's top-level
``suite``, or, in files written before that field, what its rows measure (``option``:
options, ``gbps``: decode, ``us``: overhead, CPU rows: cpu, else core). A table has one row
per problem (its suite's key fields), flashcupy's figure at each length, and flashcupy's
speed relative to every other system measured in the same file, length by length. The plot
that bench/plot.py wrote beside a source file (same name, .png) follows its table.

Which runs the README shows is :data:`SOURCES`, oldest first; where two files measure the
same problem, the later one's figures replace the earlier one's.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
BEGIN = "<!-- performance tables: written by bench/tables.py from bench/results/; do not edit by hand -->"
END = "<!-- end of the performance tables -->"

#: The runs the README shows, per suite, oldest first (file names in bench/results/).
SOURCES: dict[str, list[str]] = {
    "core": [
        "nvidia-h100-80gb-hbm3-2026-11-21.json",
        "nvidia-h100-80gb-hbm3-2026-11-22-float32.json",
        "nvidia-h100-80gb-hbm3-2026-11-22-float64.json",
    ],
    "options": ["nvidia-h100-80gb-hbm3-2026-11-25-options.json", "nvidia-h100-80gb-hbm3-2026-11-25-options-philox.json",
                "nvidia-h100-80gb-hbm3-2026-11-28-options-staged.json",
                "nvidia-h200-2026-11-28-options-bwd-staged.json", "nvidia-h200-2026-11-28-options-bwd-mask128.json",
                "nvidia-h200-2026-11-28-options-d128bias-alibi.json", "nvidia-h200-2026-11-28-options-whole-tiles.json",
                "nvidia-h200-2026-11-28-options-softcap.json", "nvidia-h200-2026-11-28-options-dropout.json",
                "nvidia-h200-2026-11-28-options-softcap-once.json", "nvidia-h200-2026-11-28-options-softcap-fma.json",
                "nvidia-h200-2026-11-28-options-wide.json", "nvidia-h200-2026-11-28-options-f32-staged.json",
                "nvidia-h200-2026-11-28-options-f64-staged.json", "nvidia-h200-2026-11-28-options-triple.json",
                "nvidia-h200-2026-11-28-options-padding-blockmask.json"],
    "decode": ["nvidia-h200-2026-11-28-decode-fixed-costs.json"],
    "overhead": ["nvidia-h200-2026-11-28-overhead-graph.json"],
    "cpu": ["cpu-2026-11-29.json"],
}


@dataclass(frozen=True)
class Suite:
    """How a suite's rows become a table: the fields that name a problem, the field spread
    across one cell (lengths), the measured field, its unit, and whether more is faster."""

    title: str
    keys: tuple[str, ...]
    spread: str
    value: str
    unit: str
    higher_is_faster: bool
    memory: str | None = None  # a field of peak memory (MiB), shown per system
    only: tuple[tuple[str, tuple[Any, ...]], ...] = ()  # (field, values shown): rows the README shows
    note: str = ""  # what ``only`` leaves out, said under the title


SUITES = {
    "core": Suite("Speed", ("mode", "dtype", "D", "causal"), "L", "tflops", "TFLOP/s", True),
    "options": Suite("Speed with score options", ("option", "mode", "dtype", "D", "causal"), "L", "tflops",
                     "TFLOP/s", True),
    "decode": Suite("Decoding with a KV cache", ("layout", "block_size", "dtype", "D", "Hq", "Hk", "B", "Lq"), "Lk",
                    "gbps", "GB/s", True, only=(("dtype", ("float16",)), ("block_size", (0, 64))),
                    note="float16 shown, contiguous (block_size 0) and paged with 64-key blocks; the files hold "
                         "bfloat16 and blocks of 16 and 256 too."),
    "overhead": Suite("Per-call overhead", ("path", "mode", "B", "H", "D"), "L", "us", "us per call", False),
    "cpu": Suite("CPU backend", ("mode", "dtype", "B", "H", "D", "causal", "threads"), "L", "ms", "ms", False,
                 "peak_mib"),
}
#: Orders of key values in tables (others after these, by name).
VALUE_ORDER = {"mode": ("fwd", "bwd", "fwd+bwd"), "dtype": ("float16", "bfloat16", "float32", "float64")}
#: Systems in the order their columns appear (others follow by name).
SYSTEM_ORDER = ("flashcupy", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "sdpa-default", "sdpa",
                "flex", "cupy-naive", "torch-cpu", "jax-cpu", "numpy-naive", "copy")
SYSTEM_NAMES = {"sdpa-flash": "SDPA-flash (FA2)", "sdpa-cudnn": "cuDNN", "sdpa-efficient": "SDPA-efficient",
                "sdpa-math": "SDPA-math", "sdpa-default": "SDPA", "sdpa": "SDPA", "flex": "FlexAttention"}


def suite_of(data: dict[str, Any]) -> str:
    """A result file's suite: its ``suite`` field, or what its rows measure."""
    if "suite" in data:
        return data["suite"]
    row = data["rows"][0] if data.get("rows") else {}
    for field, suite in (("option", "options"), ("gbps", "decode"), ("us", "overhead"), ("flashcupy_ms", "cpu"),
                         ("peak_mib", "cpu")):
        if field in row:
            return suite
    return "core"


def rows_of(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A file's measured rows in the suites' format (rows a system skipped or failed, which
    carry no figure, left out). CPU files written before it hold one row per length with
    flashcupy's and naive NumPy's figures side by side (one head, forward). In overhead files
    SDPA's rows (torch tensors) are the baseline of the CuPy path's rows too."""
    rows = [r for r in data.get("rows", []) if "skipped" not in r and "failure" not in r]
    if suite_of(data) == "overhead":
        rows += [{**r, "path": "cupy"} for r in rows if r.get("system") == "sdpa" and r.get("path") == "torch"]
    if rows and "flashcupy_ms" in rows[0]:
        return [{"system": system, "mode": "fwd", "dtype": r["dtype"], "B": 1, "H": 1, "D": r["D"],
                 "causal": r["causal"], "threads": None, "L": r["L"], "ms": r[f"{prefix}_ms"],
                 "peak_mib": r[f"{prefix}_peak_mib"]}
                for r in rows for system, prefix in (("flashcupy", "flashcupy"), ("numpy-naive", "naive"))]
    return rows


def machine(data: dict[str, Any]) -> str:
    """The GPU (or CPU machine) a file was measured on, short: 'H100 80GB HBM3', or for the cpu
    suite's description of the machine 'AMD EPYC, 2 cores, OpenBLAS 0.3.31.188.0'."""
    found = data.get("gpu") or data.get("machine") or "unknown machine"
    if isinstance(found, dict):
        blas = ", ".join(f"{b.get('internal_api', '?')} {b.get('version', '')}".strip() for b in found.get("blas", []))
        return ", ".join(part for part in (found.get("cpu_model"), f"{found.get('cores_available')} cores", blas)
                         if part)
    return str(found).removeprefix("NVIDIA ")


def _number(x: float) -> str:
    """Three significant figures, no exponent: 314, 52.6, 3.18, 0.437."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _cell(values: list[str]) -> str:
    return " / ".join(values) if any(values) else ""


def _sort_key(keys: tuple[str, ...], problem: tuple) -> tuple:
    """Problems in table order: known values (modes, dtypes) in their order, then numbers, then names."""
    out = []
    for key, value in zip(keys, problem):
        order = VALUE_ORDER.get(key, ())
        out.append((order.index(value) if value in order else len(order), value is None,
                    value if isinstance(value, (int, float)) else 0, str(value)))
    return tuple(out)


def _text(value: Any) -> str:
    return {True: "yes", False: "no", None: "-"}.get(value, str(value)) if isinstance(value, (bool, type(None))) \
        else str(value)


def table(suite_name: str, files: list[str]) -> str:
    """The markdown of one suite's table (with its sources and plots) from ``files``."""
    suite = SUITES[suite_name]
    cells: dict[tuple, dict[str, Any]] = {}  # problem -> {length: {system: row}, "source": file}
    sources = []
    for name in files:
        data = json.loads((RESULTS / name).read_text())
        if suite_of(data) != suite_name:
            raise ValueError(f"bench/results/{name}: a {suite_of(data)} file listed under {suite_name}")
        sources.append((name, data))
        for row in rows_of(data):
            if any(row.get(field) not in values for field, values in suite.only):
                continue
            problem = tuple(row.get(k) for k in suite.keys)
            entry = cells.setdefault(problem, {})
            if entry.get("source") not in (None, name):
                entry.clear()  # a later run measured this problem: its figures replace the earlier ones
            entry["source"] = name
            entry.setdefault(row[suite.spread], {})[row["system"]] = row
    systems = sorted({s for entry in cells.values() for per in entry.values() if isinstance(per, dict) for s in per},
                     key=lambda s: (SYSTEM_ORDER.index(s) if s in SYSTEM_ORDER else len(SYSTEM_ORDER), s))
    others = [s for s in systems if s != "flashcupy"]
    labels = {name: f"[{i}]" for i, (name, _) in enumerate(sources, 1)}
    keys = [i for i, k in enumerate(suite.keys) if any(p[i] is not None for p in cells)]  # drop empty columns
    header = [*(suite.keys[i] for i in keys), suite.spread, f"flashcupy {suite.unit}",
              *(f"vs {SYSTEM_NAMES.get(s, s)}" for s in others)]
    if suite.memory:
        header += [f"{SYSTEM_NAMES.get(s, s)} peak MiB" for s in systems]
    header.append("run")
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" if i < len(keys) and suite.keys[keys[i]] in ("mode", "dtype", "causal")
                            else "---:" for i in range(len(header))) + "|"]
    for problem in sorted(cells, key=lambda p: _sort_key(suite.keys, p)):
        entry = cells[problem]
        lengths = sorted(k for k in entry if k != "source")
        ours = [entry[n].get("flashcupy") for n in lengths]
        row = [_text(problem[i]) for i in keys]
        row.append(" / ".join(str(n) for n in lengths))
        row.append(_cell([_number(r[suite.value]) if r else "" for r in ours]))
        for system in others:
            ratios = []
            for n, mine in zip(lengths, ours):
                theirs = entry[n].get(system)
                if mine is None or theirs is None:
                    ratios.append("")
                    continue
                a, b = (mine, theirs) if suite.higher_is_faster else (theirs, mine)
                ratios.append(f"{a[suite.value] / b[suite.value]:.2f}x")
            row.append(_cell(ratios))
        if suite.memory:
            for system in systems:
                row.append(_cell([_number(entry[n][system][suite.memory]) if system in entry[n] else ""
                                  for n in lengths]))
        row.append(labels[entry["source"]])
        lines.append("| " + " | ".join(row) + " |")

    direction = "higher" if suite.higher_is_faster else "lower"
    out = [f"### {suite.title}", "",
           f"flashcupy's {suite.unit} ({direction} is faster) at each {suite.spread}; \"vs X\": flashcupy's speed "
           f"over X's, measured in the same run.{' ' + suite.note if suite.note else ''} Runs:", ""]
    for name, data in sources:
        versions = ", ".join(f"{k} {data[k]}" for k in ("torch", "cupy", "numpy") if data.get(k))
        out.append(f"- {labels[name]} [{name}](bench/results/{name}): {machine(data)}, {data.get('date', '?')}"
                   + (f" ({versions})" if versions else ""))
    out += ["", *lines]
    for name, _ in sources:
        plot = (RESULTS / name).with_suffix(".png")
        if plot.is_file():
            out += ["", f"![{suite.title}: {machine(_)} ({name})](bench/results/{plot.name})"]
    return "\n".join(out)


def render() -> str:
    """Every suite's table, in SUITES order, as the text between the README's markers."""
    return "\n\n".join(table(name, SOURCES[name]) for name in SUITES if SOURCES.get(name))


def rewrite(readme: str) -> str:
    """``readme`` with the text between its markers replaced by :func:`render`'s."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md: expected the markers {BEGIN!r} and {END!r}, in that order")
    return readme[: start + len(BEGIN)] + "\n\n" + render() + "\n\n" + readme[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare: exit status 1 when README.md differs")
    args = parser.parse_args(argv)
    current = README.read_text()
    wanted = rewrite(current)
    if args.check:
        if wanted != current:
            print("README.md's performance tables differ from bench/results/: run python bench/tables.py",
                  file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
