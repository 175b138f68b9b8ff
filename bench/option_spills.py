"""Which score option sets make the tensor-core kernels spill: every set, compiled by NVRTC.

    PYTHONPATH=. python bench/option_spills.py --arch 90 [--min-regs 240] [--out FILE]

The compile matrix (tests/test_kernels_compile.py) compiles two option sets per kernel:
none, and every option at once (``spec.EVERY_OPTION``, its stand-in for the rest). ptxas'
register use is not monotone in the set, though: on sm_90 the float16 D = 128 forward spills
with bias, ALiBi and dropout but not with those and a mask. This script screens every
tensor-core kernel the rules choose on ``--arch`` with every option at once, and for each
call (dtype, padded head dim, determinism) whose kernel uses at least ``--min-regs``
registers there, compiles the kernels the rules choose for every option set: each non-empty
subset of ``spec.SCORE_MODS``, with a float32 and a float64 bias where a bias is in it (95
sets). No GPU is needed: NVRTC and ptxas' verbose report, as the compile matrix uses them.

Prints each screened call's register range over the sets and the sets that spill, and writes
JSON (default bench/results/option-spills-sm<arch>-<yyyy-mm-dd>.json): the arch, NVRTC's
version, the commit, the every-option screen (each kernel's name expression and figures),
and rows {family, dtype, hd, allow_tf32, deterministic, set, regs, stack, stores, loads}: the
kernels the rules choose for that call and set at that commit. About 3 s a kernel: half an
hour per arch on two cores.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import itertools
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

from bench_attention import git_commit  # noqa: E402
from flashcupy.cuda import spec as S  # noqa: E402
from flashcupy.cuda.compile import compile_for_arch, parse_ptxas  # noqa: E402

TENSOR_CORE = ("mma16", "wgmma", "wgmma_tf32x3", "tf32", "tf32x3", "dmma")
BIAS_DTYPES = ("float32", "float64")


def option_sets() -> list[S.ScoreSet]:
    """Every non-empty subset of SCORE_MODS, with each of BIAS_DTYPES where a bias is in it."""
    sets = []
    for size in range(1, len(S.SCORE_MODS) + 1):
        for mods in itertools.combinations(S.SCORE_MODS, size):
            for bias in (BIAS_DTYPES if "bias" in mods else (None,)):
                sets.append(S.ScoreSet(mods, bias))
    return sets


def chosen(family: str, call: S.Call) -> list[tuple[str, str]]:
    """(family, name expression) of the option-carrying tensor-core kernels the rules choose."""
    try:
        spec = (S.choose_forward if family == "forward" else S.choose_backward)(call).spec
    except S.NoKernelError:
        return []
    if spec.policy not in TENSOR_CORE:
        return []
    if family == "forward":
        return [("forward", spec.name_expression)]
    return [("backward", spec.dkdv_name)] + ([] if spec.fused_dq else [("backward", spec.dq_name)])


def figures(job: tuple[str, str, int]) -> dict:
    """ptxas' figures of one kernel compiled for an arch."""
    family, name, arch = job
    entry = parse_ptxas(compile_for_arch(family, [name], arch))[0]
    return {key: entry[key] for key in ("regs", "stack", "stores", "loads")}


def calls(arch: int) -> list[tuple[str, S.Call]]:
    """(family, call) for every dtype, padded head dim, float32 mode (3xTF32 or allow_tf32)
    and backward determinism on ``arch``, with every option at once; not the portable kernels."""
    out = []
    for family in ("forward", "backward"):
        for dtype in S.CXX_TYPE:
            for hd in S.HEAD_DIM_BUCKETS:
                for allow_tf32 in ((False, True) if dtype == "float32" else (False,)):
                    for deterministic in ((False, True) if family == "backward" else (False,)):
                        out.append((family, S.Call(dtype, hd, arch, S.ARCH_SMEM[arch], allow_tf32, False,
                                                   S.EVERY_OPTION, deterministic)))
    return out


def _screen(args: argparse.Namespace, pool: concurrent.futures.Executor) -> tuple[dict, list]:
    """({(family, name): figures} of every option-carrying tensor-core kernel with every option
    at once, [(family, call)] whose kernels reach args.min_regs registers, of args.dtypes)."""
    screened = [(family, call, chosen(family, call)) for family, call in calls(args.arch)]
    screened = [(family, call, names) for family, call, names in screened if names]
    unique = sorted({job for _, _, names in screened for job in names})
    screen = dict(zip(unique, pool.map(figures, [(f, n, args.arch) for f, n in unique])))
    heavy = [(family, call) for family, call, names in screened
             if max(screen[n]["regs"] for n in names) >= args.min_regs and call.dtype in args.dtypes]
    return screen, heavy


def _sweep(heavy: list, arch: int, pool: concurrent.futures.Executor) -> list[dict]:
    """A row per (call of ``heavy``, option set, kernel the rules choose): ptxas' figures."""
    jobs: dict = {}
    for family, call in heavy:
        for scores in option_sets():
            for job in chosen(family, S.Call(call.dtype, call.hd, call.arch, call.smem_limit, call.allow_tf32,
                                             False, scores, call.deterministic)):
                jobs.setdefault(job, []).append((family, call, scores))
    results = dict(zip(jobs, pool.map(figures, [(f, n, arch) for f, n in jobs])))
    rows = []
    for job, uses in jobs.items():
        for family, call, scores in uses:
            rows.append({"family": family, "dtype": call.dtype, "hd": call.hd, "allow_tf32": call.allow_tf32,
                         "deterministic": call.deterministic, "set": str(scores), **results[job]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, required=True, choices=sorted(S.ARCH_SMEM))
    parser.add_argument("--min-regs", type=int, default=240,
                        help="sweep the calls whose every-option kernel uses at least this many registers")
    parser.add_argument("--dtypes", nargs="+", choices=list(S.CXX_TYPE), default=list(S.CXX_TYPE),
                        help="dtypes to sweep (bfloat16's figures have matched float16's kernel for kernel)")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from cupy_backends.cuda.libs import nvrtc

    with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
        screen, heavy = _screen(args, pool)
        print(f"sm_{args.arch}: {len(screen)} every-option kernels, {len(heavy)} calls at >= {args.min_regs} "
              f"registers", flush=True)
        rows = _sweep(heavy, args.arch, pool)
    for family, call in heavy:
        mine = [r for r in rows if (r["family"], r["dtype"], r["hd"], r["allow_tf32"], r["deterministic"])
                == (family, call.dtype, call.hd, call.allow_tf32, call.deterministic)]
        spilled = [r for r in mine if r["stack"] or r["stores"] or r["loads"]]
        regs = [r["regs"] for r in mine]
        print(f"{family:8} {call.dtype:8} hd {call.hd:3} tf32 {call.allow_tf32!s:5} det {call.deterministic!s:5}: "
              f"regs {min(regs)}-{max(regs)}, {len(spilled)} of {len(mine)} kernels spill", flush=True)
        for r in spilled:
            print(f"    {r['set']:<62} stack {r['stack']:3} stores {r['stores']:3} loads {r['loads']:3}")
    out = args.out or ROOT / "bench" / "results" / f"option-spills-sm{args.arch}-{datetime.date.today().isoformat()}.json"
    out.write_text(json.dumps({"arch": args.arch, "nvrtc": ".".join(map(str, nvrtc.getVersion())), "commit": git_commit(),
                               "min_regs": args.min_regs, "date": datetime.date.today().isoformat(),
                               "screen": [{"family": f, "kernel": n, **figs} for (f, n), figs in screen.items()],
                               "rows": rows}) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
