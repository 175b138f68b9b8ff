"""Two builds of flashcupy timed side by side in one process on one GPU: this checkout and an
earlier one (for example the previous main), on the plain grid (the core suite of docs/architecture.md).

    git worktree add /tmp/base <rev>                      # the build to compare against
    PYTHONPATH=. python bench/compare_builds.py --base /tmp/base [--quick] [--out FILE]

The base checkout's package is imported under the name ``flashcupy_base`` (its kernels_cu/
beside it, compiled by NVRTC into CuPy's cache under its own source hash), so both builds
read the same inputs and are timed alternately: per cell, ``--rounds`` rounds of
``--repeats`` calls of each build, CUDA events around each call, the median per build over
all its calls (which build goes first alternates from round to round). Before timing, each cell's outputs (and gradients) of the two builds are
compared: the largest absolute difference goes into the row, and a build whose results are
not finite where the other's are fails the run.

Grid (issue 26's "plain grid"): float16 and bfloat16 at D 64, 128, 256 and L 1024, 4096,
16384; float32 and float64 at D 64, 128 and L 1024, 4096; B = 16384 // L, H = 2048 // D,
causal and not, forward and backward. ``--quick``: L 1024 only.

Output: one JSON file with the core suite's fields (docs/architecture.md), rows for both
builds (``build``: "base" or "new", ``system``: "flashcupy"), each new row also holding
``ratio`` = base ms / new ms (above 1: the new build is faster), and the summary.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import numpy as np
from bench_attention import git_commit  # bench/, the script's directory, is on sys.path

ROOT = Path(__file__).resolve().parents[1]
GRID_16 = {"dtypes": ("float16", "bfloat16"), "dims": (64, 128, 256), "lengths": (1024, 4096, 16384)}
GRID_WIDE = {"dtypes": ("float32", "float64"), "dims": (64, 128), "lengths": (1024, 4096)}


def load_base(path: Path):
    """The package at ``path``/flashcupy imported as ``flashcupy_base``."""
    package = path / "flashcupy"
    spec = importlib.util.spec_from_file_location("flashcupy_base", package / "__init__.py",
                                                  submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["flashcupy_base"] = module
    spec.loader.exec_module(module)
    return module


def cells(quick: bool):
    for grid in (GRID_16, GRID_WIDE):
        for dtype in grid["dtypes"]:
            for d in grid["dims"]:
                for length in grid["lengths"][:1] if quick else grid["lengths"]:
                    for causal in (False, True):
                        yield dtype, d, length, causal


def _time(cp, fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop))
    return times


def _max_diff(a, b) -> float:
    import cupy as cp

    a = a.astype(cp.float64)
    b = b.astype(cp.float64)
    if not bool(cp.array_equal(cp.isfinite(a), cp.isfinite(b))):
        raise AssertionError("the builds' results are not finite in the same places")
    finite = cp.isfinite(a)
    return float(cp.abs(a - b)[finite].max()) if bool(finite.any()) else 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="checkout of the build to compare against")
    parser.add_argument("--quick", action="store_true", help="L = 1024 only")
    parser.add_argument("--rounds", type=int, default=4, help="alternations of the two builds per cell")
    parser.add_argument("--repeats", type=int, default=8, help="timed calls per build and round")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--base-commit", help="the base's commit, where --base is a copy without git history")
    parser.add_argument("--commit", help="this checkout's commit, where its git history did not travel with it")
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/<gpu>-<date>-builds.json)")
    args = parser.parse_args(argv)

    import cupy as cp
    import ml_dtypes

    import flashcupy as new

    base = load_base(args.base.resolve())
    builds = {"base": base, "new": new}
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    gpu = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    todo = list(cells(args.quick))
    for module in builds.values():
        for grid in (GRID_16, GRID_WIDE):
            module.precompile(dtypes=grid["dtypes"], head_dims=grid["dims"], progress=False, workers=16)

    rows = []
    np_dtypes = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32, "float64": np.float64}
    for dtype, d, length, causal in todo:
        b, h = max(1, 16384 // length), 2048 // d
        rng = cp.random.default_rng(0)
        shape = (b, h, length, d)

        def draw():
            x = rng.standard_normal(shape, dtype=cp.float32 if dtype != "float64" else cp.float64)
            return x.astype(np_dtypes[dtype])

        q, k, v, dout = draw(), draw(), draw(), draw()
        fwd = {name: m.flash_attention_forward(q, k, v, causal=causal) for name, m in builds.items()}
        grads = {name: m.flash_attention_backward(dout, q, k, v, *fwd[name], causal=causal)
                 for name, m in builds.items()}
        diff = max([_max_diff(fwd["base"][0], fwd["new"][0])]
                   + [_max_diff(x, y) for x, y in zip(grads["base"], grads["new"])])
        calls = {
            "fwd": {name: (lambda m=m: m.flash_attention(q, k, v, causal=causal)) for name, m in builds.items()},
            "bwd": {name: (lambda m=m, n=name: m.flash_attention_backward(dout, q, k, v, *fwd[n], causal=causal))
                    for name, m in builds.items()},
        }
        flops = 4 * b * h * length * length * d / (2 if causal else 1)
        for mode, fns in calls.items():
            times = {name: [] for name in builds}
            for name, fn in fns.items():
                _time(cp, fn, args.warmup)
            order = list(fns)
            for _ in range(args.rounds):  # the order alternates, so that neither build always runs first
                for name in order:
                    times[name] += _time(cp, fns[name], args.repeats)
                order.reverse()
            ms = {name: statistics.median(t) for name, t in times.items()}
            work = flops * (2.5 if mode == "bwd" else 1.0)
            for name in builds:
                row = {"system": "flashcupy", "build": name, "dtype": dtype, "B": b, "H": h, "L": length, "D": d,
                       "causal": causal, "mode": mode, "ms": round(ms[name], 5),
                       "tflops": round(work / ms[name] / 1e9, 2), "max_diff_between_builds": diff}
                if name == "new":
                    row["ratio"] = round(ms["base"] / ms["new"], 4)
                rows.append(row)
            print(f"{dtype:9} D={d:3} L={length:5} causal={causal!s:5} {mode}: base {ms['base']:.3f} ms, "
                  f"new {ms['new']:.3f} ms, base/new {ms['base'] / ms['new']:.3f} (max diff {diff:.2g})", flush=True)
        del q, k, v, dout, fwd, grads
        cp.get_default_memory_pool().free_all_blocks()

    ratios = [row["ratio"] for row in rows if "ratio" in row]
    summary = {"cells": len(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios),
               "geomean_ratio": float(np.exp(np.mean(np.log(ratios)))),
               "slower_than_3_percent": [f"{r['dtype']} D={r['D']} L={r['L']} causal={r['causal']} {r['mode']}: "
                                         f"{r['ratio']}" for r in rows if r.get("ratio", 1) < 1 / 1.03]}
    today = datetime.date.today().isoformat()
    from flashcupy.cuda.compile import source_hash

    result = {"gpu": gpu, "date": today, "commit": args.commit or git_commit(ROOT),
              "base_commit": args.base_commit or git_commit(args.base), "kernel_hash": source_hash(),
              "base_kernel_hash": base.cuda.compile.source_hash(),
              "cupy": cp.__version__, "torch": None, "suite": "core", "rows": rows, "summary": summary}
    out = args.out or ROOT / "bench" / "results" / f"{gpu.lower().replace(' ', '-')}-{today}-builds.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
