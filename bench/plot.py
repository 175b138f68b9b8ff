"""Plot a result file of bench_attention.py or bench_options.py: a PNG beside the JSON.

    python bench/plot.py bench/results/<gpu>-<yyyy-mm-dd>.json    # writes <gpu>-<yyyy-mm-dd>.png

One panel per (dtype, D, causal, mode): TFLOP/s against L (log2 axis), one
line per system, markers at the measured points, so a single L plots too. The
forward's panels come first, then, from a new row of the grid, the backward's
in the same order. When the file has peak-memory entries, one more panel per
memory mode, from a new row: MiB against L, log-log (fwd: one forward; bwd: one
forward and its backward). Overhead entries are not plotted.

An options-suite file (``suite: "options"``) gets one panel per (dtype, D, L, causal, mode):
milliseconds per option (log axis), one bar per system that runs it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # file output only; before pyplot is imported
import matplotlib.pyplot as plt
from bench_attention import DTYPES, MEMORY_SPANS, MODES, SYSTEMS  # bench/, the script's directory, is on sys.path
from bench_options import OPTIONS

#: One colour per system, the same in every panel; systems unknown here get later colours.
COLORS = {system: f"C{i}" for i, system in enumerate(SYSTEMS + ("flex",))}
PANEL_COLUMNS = 4


@dataclass
class Panel:
    """One plot: its lines (system -> {L: value}), title and y axis."""

    lines: dict[str, dict[Any, float]]  # system -> {L, or option for bars: value}
    title: str
    ylabel: str
    log_y: bool
    bars: bool = False


def system_order(systems: set[str]) -> list[str]:
    """Known systems in bench_attention's order, then any others by name."""
    return [s for s in SYSTEMS if s in systems] + sorted(systems - set(SYSTEMS))


def mode_rank(mode: str) -> int:
    """A mode's place in bench_attention's order; unknown modes last."""
    return MODES.index(mode) if mode in MODES else len(MODES)


def panel_key(panel: tuple) -> tuple:
    """Sort key of a panel (dtype, D, causal, mode): modes, then dtypes, in their benchmark order."""
    dtype, D, causal, mode = panel
    rank = {name: i for i, name in enumerate(DTYPES)}
    return (mode_rank(mode), mode, rank.get(dtype, len(rank)), dtype, D, causal)


def series(entries: Sequence[dict[str, Any]], value: str, group: Sequence[str]) -> dict[tuple, dict[str, dict[int, float]]]:
    """group values -> system -> {L: value}, for the entries that have ``value``; a repeated
    (group, system, L) keeps the last entry and says so on stderr."""
    out: dict[tuple, dict[str, dict[int, float]]] = {}
    for e in entries:
        if value not in e:
            continue
        points = out.setdefault(tuple(e[g] for g in group), {}).setdefault(e["system"], {})
        if e["L"] in points:
            print(f"plot: several {e['system']} entries at L={e['L']} for {tuple(e[g] for g in group)}; "
                  "plotting the last", file=sys.stderr)
        points[e["L"]] = e[value]
    return out


def length_label(L: int) -> str:
    """1024 -> '1k', 65536 -> '64k', 1000 -> '1000'."""
    return f"{L // 1024}k" if L % 1024 == 0 else str(L)


def draw_bars(ax: Any, panel: Panel) -> None:
    """Grouped bars: one group per option (in the suite's order), one bar per system."""
    options = [o for o in OPTIONS if any(o in points for points in panel.lines.values())]
    systems = system_order(set(panel.lines))
    width = 0.8 / len(systems)
    for k, system in enumerate(systems):
        xs = [i for i, o in enumerate(options) if o in panel.lines[system]]
        ax.bar([x - 0.4 + width * (k + 0.5) for x in xs], [panel.lines[system][options[x]] for x in xs], width,
               label=system, color=COLORS.get(system))
    ax.set_xticks(range(len(options)), options, rotation=45, ha="right")
    ax.set_yscale("log")
    ax.grid(True, axis="y", alpha=0.3)
    ax.set_title(panel.title)
    ax.set_ylabel(panel.ylabel)


def draw(ax: Any, panel: Panel) -> None:
    """One line per system over L on a log2 axis, ticks at the measured lengths."""
    if panel.bars:
        draw_bars(ax, panel)
        return
    lines = panel.lines
    lengths = sorted({L for points in lines.values() for L in points})
    for system in system_order(set(lines)):
        xs = sorted(lines[system])
        ax.plot(xs, [lines[system][L] for L in xs], marker="o", label=system, color=COLORS.get(system),
                linewidth=2.5 if system == "flashcupy" else 1.5)
    ax.set_xscale("log", base=2)
    ax.set_xlim(lengths[0] / 1.5, lengths[-1] * 1.5)
    ax.set_xticks(lengths, [length_label(L) for L in lengths])
    ax.minorticks_off()
    ax.set_xlabel("L")
    if panel.log_y:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.set_title(panel.title)
    ax.set_ylabel(panel.ylabel)


def option_sections(document: dict[str, Any]) -> list[list[Panel]]:
    """An options-suite file's panels, a row per mode: ms per option and system."""
    by_mode: dict[str, list[Panel]] = {}
    panels: dict[tuple, dict[str, dict[str, float]]] = {}
    for row in document.get("rows", []):
        key = (row["mode"], row["dtype"], row["D"], row["L"], row["causal"])
        panels.setdefault(key, {}).setdefault(row["system"], {})[row["option"]] = row["ms"]
    for mode, dtype, D, L, causal in sorted(panels, key=lambda k: panel_key((k[1], k[2], k[4], k[0])) + (k[3],)):
        title = f"{dtype} D={D} L={L} {'causal' if causal else 'non-causal'} {mode}"
        by_mode.setdefault(mode, []).append(
            Panel(panels[mode, dtype, D, L, causal], title, "ms (lower is faster)", True, bars=True))
    return list(by_mode.values())


def sections(document: dict[str, Any]) -> list[list[Panel]]:
    """The panels, grouped so that each group starts a row of the grid: the speed panels of
    each mode, then the peak-memory panels."""
    if document.get("suite") == "options":
        return option_sections(document)
    speed = series(document.get("rows", []), "tflops", ("dtype", "D", "causal", "mode"))
    by_mode: dict[str, list[Panel]] = {}
    for dtype, D, causal, mode in sorted(speed, key=panel_key):
        title = f"{dtype} D={D} {'causal' if causal else 'non-causal'} {mode}"
        by_mode.setdefault(mode, []).append(Panel(speed[dtype, D, causal, mode], title, "TFLOP/s", False))
    entries = [e for e in document.get("memory", []) if "peak_mib" in e]
    memory = series(entries, "peak_mib", ("mode",))
    memory_panels = []
    for (mode,) in sorted(memory, key=lambda key: mode_rank(key[0])):
        title = f"peak memory, {MEMORY_SPANS.get(mode, mode)}"
        shapes = {(e["dtype"], e["B"], e["H"], e["D"]) for e in entries if e["mode"] == mode}
        if len(shapes) == 1:
            dtype, B, H, D = shapes.pop()
            title += f"\n{dtype} B={B} H={H} D={D}"
        memory_panels.append(Panel(memory[(mode,)], title, "MiB beyond the inputs", True))
    return [panels for panels in (*by_mode.values(), memory_panels) if panels]


def plot(document: dict[str, Any], path: Path) -> Path:
    """Draw ``document`` (a bench_attention.py result) and save it as ``path`` with a .png suffix."""
    groups = sections(document)
    if not groups:
        raise ValueError(f"{path}: no rows or peak-memory entries to plot")
    cols = min(PANEL_COLUMNS, max(len(panels) for panels in groups))
    grid_rows = sum(math.ceil(len(panels) / cols) for panels in groups)
    # 3.4 inches a row of panels, and an inch for the title and the legend
    fig, axes = plt.subplots(grid_rows, cols, figsize=(4.2 * cols, 3.4 * grid_rows + 1.0), squeeze=False)
    used = []
    row = 0
    for panels in groups:
        for i, panel in enumerate(panels):
            ax = axes[row + i // cols, i % cols]
            draw(ax, panel)
            used.append(ax)
        row += math.ceil(len(panels) / cols)
    for ax in axes.flat:
        if ax not in used:
            ax.set_visible(False)
    handles: dict[str, Any] = {}
    for ax in used:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    labels = system_order(set(handles))
    fig.legend([handles[s] for s in labels], labels, loc="lower center", ncol=len(labels), frameon=False)
    versions = ", ".join(f"{name} {document[name]}" for name in ("cupy", "torch", "flashcupy") if name in document)
    fig.suptitle(f"{document.get('gpu', '?')}, {document.get('date', '?')}   ({versions})")
    margin = 0.5 / fig.get_figheight()  # half an inch for the legend below and the title above
    fig.tight_layout(rect=(0, margin, 1, 1 - margin))
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="a JSON file written by bench/bench_attention.py or bench_options.py")
    args = parser.parse_args(argv)
    try:
        out = plot(json.loads(args.result.read_text()), args.result)
    except (OSError, ValueError) as exc:
        print(f"plot: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
