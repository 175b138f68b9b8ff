"""Command line: ``python -m flashcupy <command>``.

Commands:
    demo        run flash_attention on random inputs, check it against the float64
                reference with the tolerance rule of the design (section 4), time it.
                Exit status 1 when the check fails.
    info        versions (flashcupy, Python, NumPy, SciPy, ml_dtypes, CuPy, CUDA, NVRTC),
                the GPUs, the kernel sources and CuPy's kernel cache, which kernel path
                each dtype takes here, and the compile times recorded by precompile.
    check       a short self-test: small problems of every dtype and the main options,
                forward and backward, against the float64 reference. Exit status 1 on
                any failure.
    precompile  compile the CUDA kernels ahead of first use (flashcupy.precompile).
    bench       run bench/bench_attention.py from a source checkout, passing the
                remaining arguments through. Exit status 2 when the script is missing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np

import flashcupy
from flashcupy import api, interop, reference
from flashcupy.problem import make_host_problem

DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


# --------------------------------------------------------------------------- devices


def cuda_backend_available() -> bool:
    """True when a GPU is usable and this flashcupy has a CUDA backend to run on it."""
    if not interop.gpu_usable():
        return False
    try:
        return api._backend("cuda") == "cuda"
    except (RuntimeError, ValueError):  # today: "no CUDA kernels yet"
        return False


def _gpu_name() -> str:
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def _synchronizer(on_gpu: bool) -> Callable[[], None]:
    if not on_gpu:
        return lambda: None
    import cupy

    return lambda: cupy.cuda.get_current_stream().synchronize()


# --------------------------------------------------------------------------- tolerance


def tolerance(q: np.ndarray, k: np.ndarray, v: np.ndarray, ref: np.ndarray, options: dict[str, Any]) -> float:
    """The bound of design.md section 4 (:func:`flashcupy.reference.tolerance`) for this call."""
    naive, _ = reference.forward(make_host_problem(q, k, v, options), compute_dtype=q.dtype)
    return reference.tolerance(ref, naive, q.dtype)


# --------------------------------------------------------------------------- demo


def demo(args: argparse.Namespace) -> int:
    dtype = DTYPES[args.dtype]
    shape_q = (args.batch, args.heads, args.L, args.D)
    rng = np.random.default_rng(args.seed)
    q, k, v = (rng.standard_normal(shape_q, dtype=np.float32).astype(dtype) for _ in range(3))
    options: dict[str, Any] = {"causal": bool(args.causal)}

    on_gpu = cuda_backend_available()
    if on_gpu:
        import cupy

        inputs = tuple(cupy.asarray(x) for x in (q, k, v))
        where = f"cuda ({_gpu_name()})"
    else:
        inputs = (q, k, v)
        where = "cpu"
    sync = _synchronizer(on_gpu)

    print(
        f"flashcupy {flashcupy.__version__} demo: q, k, v ({args.batch}, {args.heads}, {args.L}, {args.D}) "
        f"{args.dtype}, causal={bool(args.causal)}"
    )
    print(f"backend: {where}")

    def run():
        out = flashcupy.flash_attention(*inputs, backend="auto", **options)
        sync()
        return out

    out = run()  # warm-up (on a GPU: compilation and caches)
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)

    out = interop.to_numpy(out)
    ref = flashcupy.attention_reference(q, k, v, **options)
    err = float(np.max(np.abs(out.astype(np.float64) - ref)))
    tol = tolerance(q, k, v, ref, options)
    ok = bool(err <= tol)  # False for NaN too

    flops = 4.0 * args.batch * args.heads * args.L * args.L * args.D * (0.5 if args.causal else 1.0)
    print(f"max |out - reference|: {err:.3e}")
    print(f"tolerance:             {tol:.3e}  (2 * naive {args.dtype} error + rounding floor)")
    print(f"time:                  {ms:.2f} ms (median of {args.repeats} after a warm-up), "
          f"{flops / (ms * 1e-3) / 1e9:.1f} GFLOP/s")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


# --------------------------------------------------------------------------- parser


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, received {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flashcupy",
        description="flashcupy: exact FlashAttention for NumPy, CuPy and DLPack arrays.",
    )
    parser.add_argument("--version", action="version", version=f"flashcupy {flashcupy.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = commands.add_parser(
        "demo",
        help="run flash_attention on random inputs, check it against the reference and time it",
        description="Random q, k, v (seeded); flash_attention with backend='auto' (CuPy inputs on a GPU "
        "when a CUDA backend is available, else NumPy on the CPU); max error against the float64 "
        "reference, the tolerance bound, PASS/FAIL and the median time. Exit status 1 on FAIL.",
    )
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="input dtype (default float32)")
    p.add_argument("--L", type=_positive, default=1024, help="sequence length, Lq = Lk (default 1024)")
    p.add_argument("--D", type=_positive, default=64, help="head dim (default 64)")
    p.add_argument("--heads", type=_positive, default=8, help="heads (default 8)")
    p.add_argument("--batch", type=_positive, default=2, help="batch size (default 2)")
    p.add_argument("--causal", action="store_true", help="causal (bottom-right) masking")
    p.add_argument("--repeats", type=_positive, default=3, help="timed runs after the warm-up (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.set_defaults(func=demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
