"""The CPU backend against naive NumPy attention: time and peak host memory.

    python bench/bench_cpu.py [--lengths 1024 4096 ...] [--D 64] [--dtype float32] [--out FILE]

One head, Lq = Lk = L. Naive attention materialises the (L, L) score matrix;
flashcupy's CPU backend works tile by tile. Each system is checked against the
other (and, at the smallest L, against the float64 reference) before timing.
Time: median of repeated runs after a warm-up; memory: tracemalloc's peak of
one run (NumPy reports its allocations to tracemalloc). Naive runs are skipped
where its score matrix would exceed --naive-max-gib.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time
import tracemalloc
from pathlib import Path

import numpy as np

import flashcupy as fc


def naive_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    """softmax(q k^T / sqrt(D)) v with the whole (L, L) score matrix in memory."""
    s = q @ k.T
    s *= s.dtype.type(1 / np.sqrt(q.shape[-1]))
    if causal:
        s[np.triu_indices(s.shape[0], 1, s.shape[1])] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


def measure(fn, repeats: int) -> tuple[float, float]:
    """(median seconds over ``repeats`` runs after one warm-up, peak traced MiB of one run)."""
    fn()
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1] / 2**20
    tracemalloc.stop()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--D", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--naive-max-gib", type=float, default=4.0)
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()

    dtype = np.dtype(args.dtype)
    rows = []
    print(f"{'L':>6} {'system':>10} {'ms':>10} {'peak MiB':>10} {'ratio':>7}")
    for L in args.lengths:
        rs = np.random.default_rng(L)
        q, k, v = (rs.standard_normal((L, args.D)).astype(dtype) for _ in range(3))
        repeats = max(1, min(7, int(2e9 / (L * L * args.D))))
        ours = lambda: fc.flash_attention(q, k, v, causal=args.causal, backend="cpu")  # noqa: E731
        naive = lambda: naive_attention(q, k, v, args.causal)  # noqa: E731
        naive_ok = L * L * dtype.itemsize <= args.naive_max_gib * 2**30
        if L == min(args.lengths):
            ref = fc.attention_reference(q, k, v, causal=args.causal)
            err = np.abs(ours() - ref).max()
            assert err < (1e-4 if dtype == np.float32 else 1e-10), f"flashcupy error {err} at L={L}"
        if naive_ok:
            diff = np.abs(ours() - naive()).max()
            assert diff < (1e-4 if dtype == np.float32 else 1e-10), f"flashcupy vs naive differ by {diff} at L={L}"
        t_ours, m_ours = measure(ours, repeats)
        result = {"L": L, "D": args.D, "dtype": args.dtype, "causal": args.causal,
                  "flashcupy_ms": 1e3 * t_ours, "flashcupy_peak_mib": m_ours}
        line = f"{L:>6} {'flashcupy':>10} {1e3 * t_ours:>10.1f} {m_ours:>10.1f}"
        if naive_ok:
            t_naive, m_naive = measure(naive, repeats)
            result.update(naive_ms=1e3 * t_naive, naive_peak_mib=m_naive)
            print(f"{line} {t_ours / t_naive:>6.2f}x")
            print(f"{L:>6} {'naive':>10} {1e3 * t_naive:>10.1f} {m_naive:>10.1f}")
        else:
            print(f"{line}   (naive skipped: its {L}x{L} score matrix exceeds {args.naive_max_gib} GiB)")
        rows.append(result)

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                "numpy": np.__version__, "date": datetime.date.today().isoformat(), "rows": rows}
        args.out.write_text(json.dumps(meta, indent=1) + "\n")


if __name__ == "__main__":
    main()
