"""flashcupy's CPU backend beside PyTorch SDPA (CPU), JAX and naive NumPy: time, peak memory, threads.

    PYTHONPATH=. python bench/bench_cpu.py [options]          # from the repository root
    python -m flashcupy bench --suite cpu [options]            # the same
    python bench/bench_cpu.py --quick                          # L = 1024 only, 3 repeats
    python bench/bench_cpu.py --dry-run                        # print the plan

Grid (suite "cpu"): B = 1, H = 8; float32 at (L, D, causal) = (1024, 64, no),
(4096, 64, no), (4096, 128, no), (4096, 64, yes) and float64 at (4096, 64, no);
modes fwd and fwd+bwd; 1 thread and all the cores this process may use
(``--threads``). Systems: flashcupy (backend="cpu"), torch-cpu
(torch.nn.functional.scaled_dot_product_attention; PyTorch picks its CPU flash
kernel here), jax-cpu (jax.nn.dot_product_attention under jax.jit) and
numpy-naive (the (B, H, L, L) scores in memory, BLAS products); a system that
is not installed is skipped.

Isolation: every (system, shape, mode, threads) measurement runs in its own
process, pinned with sched_setaffinity (what ``taskset -c`` does) to the first
``threads`` cores of this process's set before anything is imported, with
OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS set to the thread
count; flashcupy.set_cpu_threads and torch.set_num_threads get it too. Systems
of one shape run back to back, so they see the same machine load.

What a timed call is: fwd is out = attention(q, k, v) (torch without grad);
fwd+bwd is the forward and the gradients of q, k and v for a given dout:
flashcupy.flash_attention_vjp then vjp(dout), torch.autograd.grad, jax.vjp
inside one jitted function, and naive NumPy's analytic backward from its
stored probabilities. Inputs are standard normal in the row's dtype.

Correctness before timing: each process compares out (and dq, dk, dv) of
head (0, 0) with a dense float64 NumPy computation from the same inputs (on
one BLAS thread, before the system's warm-up call: see _one_blas_thread); the
relative Frobenius error must stay below 1e-4 (float32) or 1e-10 (float64),
else the row is reported as a failure and not timed. rows hold rel_error.

Timing: one warm-up call (compilation included, checked), untimed calls for
SETTLE_SECONDS (at least two), then ``--repeats`` calls timed one by one with
a wall clock; a process's time is their median. With
``--rounds`` R (default 3), each row is measured in R processes, the systems
of a shape taking turns round by round, so that a slow spell of the machine
falls on every system alike: ms is the median of the R processes' times
(ms_rounds lists them), ms_min the fastest call of any.
Memory: peak_mib is the peak resident memory during the timed calls above the
resident memory just before them (after the warm-up, the check and
malloc_trim): what a call needs beyond its inputs and what the process keeps
between calls (Linux: VmHWM reset through /proc/self/clear_refs); rss_mib is
the process's peak resident memory, imports included.

The JSON (``--out``, default bench/results/cpu-<yyyy-mm-dd>.json) has the
top-level fields of the GPU suites (gpu is null here), the machine (CPU model,
family and model numbers, cores, vector flags, caches, BLAS, load average
before and after) and rows with
suite ("cpu"), system, dtype, B, H, L, D, causal, mode, threads, ms, peak_mib
and more.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

SYSTEMS = ("flashcupy", "torch-cpu", "jax-cpu", "numpy-naive")
MODES = ("fwd", "fwd+bwd")
#: (dtype, L, D, causal) at B = 1, H = 8.
SHAPES = (
    ("float32", 1024, 64, False),
    ("float32", 4096, 64, False),
    ("float32", 4096, 128, False),
    ("float32", 4096, 64, True),
    ("float64", 4096, 64, False),
)
TOLERANCE = {"float32": 1e-4, "float64": 1e-10}
#: Untimed calls after the warm-up and check, for at least this long (and at least two): on a
#: 2-core VM the first calls after the single-threaded check ran up to twice as slow as the rest.
SETTLE_SECONDS = 0.5
#: A row's identity: the cpu suite's fields (docs/architecture.md#benchmarks) besides ms and peak_mib.
ROW_KEYS = ("system", "dtype", "B", "H", "L", "D", "causal", "mode", "threads")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- one measurement (worker process)


def _status_kib(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS, VmHWM) in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _trim() -> None:
    """Return freed heap memory to the system, so that the next peak counts new allocations."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


@contextlib.contextmanager
def _one_blas_thread():
    """NumPy's BLAS at one thread inside (through threadpoolctl, when installed). The reference
    check runs so: OpenBLAS's worker threads spin for about 0.1 s after a multi-threaded call,
    and would take a core from the first timed calls of the system under test."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1, user_api="blas"):
        yield


def _reference(q, k, v, dout, causal: bool, backward: bool):
    """Dense float64 out (and dq, dk, dv) of one head: (L, D) arrays."""
    import numpy as np

    q, k, v, dout = (np.asarray(x, np.float64) for x in (q, k, v, dout))
    scale = 1 / np.sqrt(q.shape[-1])
    s = scale * (q @ k.T)
    if causal:
        s[np.triu_indices(s.shape[0], 1)] = -np.inf
    p = np.exp(s - s.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    out = p @ v
    if not backward:
        return [out]
    dp = dout @ v.T
    ds = p * (dp - np.sum(dout * out, axis=1, keepdims=True))
    return [out, scale * ds @ k, scale * ds.T @ q, p.T @ dout]


def _naive(q, k, v, dout, causal: bool, backward: bool):
    """Plain attention with the (B, H, L, L) scores in memory, in the inputs' dtype."""
    import numpy as np

    scale = q.dtype.type(1 / np.sqrt(q.shape[-1]))
    s = q @ k.swapaxes(-1, -2)
    s *= scale
    if causal:
        rows, cols = np.triu_indices(s.shape[-1], 1)
        s[..., rows, cols] = -np.inf
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    out = s @ v
    if not backward:
        return [out]
    dv = s.swapaxes(-1, -2) @ dout
    ds = dout @ v.swapaxes(-1, -2)
    ds -= np.sum(dout * out, axis=-1, keepdims=True)
    ds *= s
    ds *= scale
    return [out, ds @ k, ds.swapaxes(-1, -2) @ q, dv]


def _system(name: str, q, k, v, dout, causal: bool, backward: bool, threads: int):
    """(call, to_numpy, details): a call returning the system's results, and what runs."""
    import numpy as np

    if name == "flashcupy":
        import flashcupy as fc
        from flashcupy import cpu_kernels, cpu_parallel

        fc.set_cpu_threads(threads)
        details = {"kernels": cpu_kernels.kernels().name,
                   "threadpoolctl": cpu_parallel._blas_libraries() is not None}
        if backward:
            def call():
                out, vjp = fc.flash_attention_vjp(q, k, v, causal=causal, backend="cpu")
                return [out, *vjp(dout)]
        else:
            def call():
                return [fc.flash_attention(q, k, v, causal=causal, backend="cpu")]
        return call, np.asarray, details
    if name == "torch-cpu":
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(threads)
        tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, dout))
        details = {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
        if backward:
            tq, tk, tv = (x.clone().requires_grad_() for x in (tq, tk, tv))

            def call():
                out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
                return [out.detach(), *torch.autograd.grad(out, (tq, tk, tv), tdo)]
        else:
            def call():
                with torch.no_grad():
                    return [F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)]
        return call, lambda x: x.detach().numpy(), details
    if name == "jax-cpu":
        import jax
        import jax.numpy as jnp

        if q.dtype == np.float64:
            jax.config.update("jax_enable_x64", True)
        blhd = [jnp.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3))) for x in (q, k, v, dout)]
        attention = lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal)  # noqa: E731
        details = {"jax": jax.__version__}
        if backward:
            def both(a, b, c, d):
                out, pull = jax.vjp(attention, a, b, c)
                return (out, *pull(d))
            step = jax.jit(both)
        else:
            step = jax.jit(lambda a, b, c, d: (attention(a, b, c),))

        def call():
            return jax.block_until_ready(step(*blhd))
        return call, lambda x: np.asarray(x).transpose(0, 2, 1, 3), details
    if name == "numpy-naive":
        return (lambda: _naive(q, k, v, dout, causal, backward)), np.asarray, {"numpy": np.__version__}
    raise ValueError(f"system: expected one of {SYSTEMS}, received {name!r}")


def measure(spec: dict) -> dict:
    """One row: the system of ``spec`` on its shape, mode and threads, in this process."""
    import numpy as np

    dtype, L, D, causal, mode = spec["dtype"], spec["L"], spec["D"], spec["causal"], spec["mode"]
    B, H, threads, backward = spec["B"], spec["H"], spec["threads"], spec["mode"] == "fwd+bwd"
    rs = np.random.default_rng(0)
    q, k, v, dout = (rs.standard_normal((B, H, L, D)).astype(dtype) for _ in range(4))
    row = {"suite": "cpu"} | {key: spec[key] for key in ROW_KEYS}
    row["cores"] = sorted(os.sched_getaffinity(0))
    try:
        call, to_numpy, details = _system(spec["system"], q, k, v, dout, causal, backward, threads)
    except ImportError as exc:
        return {**row, "skipped": f"{type(exc).__name__}: {exc}"}
    row.update(details)
    with _one_blas_thread():
        expected = _reference(q[0, 0], k[0, 0], v[0, 0], dout[0, 0], causal, backward)
    results = [to_numpy(x) for x in call()]  # the warm-up call, also checked
    errors = [float(np.linalg.norm(np.asarray(r[0, 0], np.float64) - e) / np.linalg.norm(e))
              for r, e in zip(results, expected)]
    row["rel_error"] = max(errors)
    if not row["rel_error"] <= TOLERANCE[dtype]:
        return {**row, "failure": f"relative error {row['rel_error']:.3g} > {TOLERANCE[dtype]:g}"}
    del results, expected
    _trim()
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    settle = time.perf_counter() + SETTLE_SECONDS
    for _ in range(2):  # untimed: the calls right after the check ran up to 2x slower on a 2-core VM
        call()
    while time.perf_counter() < settle:
        call()
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    row.update(ms=1e3 * statistics.median(times), ms_min=1e3 * min(times), repeats=len(times),
               peak_mib=(_status_kib("VmHWM") - base) / 1024)
    row["rss_mib"] = _status_kib("VmHWM") / 1024
    return row


def worker(spec: dict) -> None:
    """Entry of a measurement process: pin, limit threads, measure, print the row as JSON."""
    os.sched_setaffinity(0, spec["cores"])
    print(json.dumps(measure(spec)))


# --------------------------------------------------------------------------- the driver


def run_worker(spec: dict) -> dict:
    """Measure ``spec`` in a fresh, pinned process; its row, or a failure row."""
    env = dict(os.environ)
    env.update({name: str(spec["threads"]) for name in THREAD_VARIABLES})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                          capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"suite": "cpu"} | {key: spec[key] for key in ROW_KEYS} | {"failure": f"exit {proc.returncode}: {tail}"}
    return json.loads(lines[-1])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> list[str]:
    """The vector-extension flags of /proc/cpuinfo (what BLAS and the compiled kernels can use)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    keep = ("sse4_2", "avx", "avx2", "fma", "f16c")
                    return [x for x in flags if x in keep or x.startswith(("avx512", "amx"))]
    except OSError:
        pass
    return []


LSCPU_FIELDS = ("Vendor ID", "CPU family", "Model", "Stepping", "Thread(s) per core", "Core(s) per socket",
                "Socket(s)", "Hypervisor vendor", "L1d cache", "L2 cache", "L3 cache")


def _lscpu() -> dict[str, str]:
    """What lscpu says of the processor (family and model tell the microarchitecture where a VM
    hides the model name) and its caches."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in out.splitlines() if ":" in line)
    return {name.strip(): value.strip() for name, value in fields if name.strip() in LSCPU_FIELDS}


def _blas() -> list[dict]:
    try:
        import numpy  # noqa: F401 - loads NumPy's BLAS for threadpoolctl to see
        import threadpoolctl
    except ImportError:
        return []
    return [{key: info.get(key) for key in ("internal_api", "version", "architecture", "threading_layer")}
            for info in threadpoolctl.threadpool_info() if info["user_api"] == "blas"]


def _version(distribution: str) -> str | None:
    """An installed distribution's version, without importing it; None when missing."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _shape_groups(specs: list[dict]) -> list[list[dict]]:
    """``specs`` cut into runs of consecutive rows that differ only in their system."""
    groups: list[list[dict]] = []
    for spec in specs:
        key = tuple(spec[k] for k in ROW_KEYS if k != "system")
        if groups and tuple(groups[-1][0][k] for k in ROW_KEYS if k != "system") == key:
            groups[-1].append(spec)
        else:
            groups.append([spec])
    return groups


def _combine(runs: list[dict]) -> dict:
    """One row from the rows of several processes of the same spec: ms the median of their
    medians, ms_min the least, peak_mib the largest; the first failure or skip if any."""
    bad = [r for r in runs if "ms" not in r]
    if bad:
        return bad[0]
    row = dict(runs[0])
    row.update(ms=statistics.median(r["ms"] for r in runs), ms_min=min(r["ms_min"] for r in runs),
               ms_rounds=[r["ms"] for r in runs], rounds=len(runs),
               peak_mib=max(r["peak_mib"] for r in runs), rss_mib=max(r["rss_mib"] for r in runs),
               rel_error=max(r["rel_error"] for r in runs))
    return row


def machine(cores: list[int]) -> dict:
    return {
        "cpu_model": _cpu_model(),
        "cores_available": len(cores),
        "cpu_count": os.cpu_count(),
        "flags": _cpu_flags(),
        "lscpu": _lscpu(),
        "blas": _blas(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "numba": _version("numba"),
        "jax": _version("jax"),
        "platform": platform.platform(),
    }


def _thread_counts(values: list[str], cores: list[int]) -> list[int]:
    counts = []
    for value in values:
        n = len(cores) if value == "all" else int(value)
        if not 1 <= n <= len(cores):
            raise SystemExit(f"--threads: expected 1..{len(cores)} or 'all', received {value}")
        if n not in counts:
            counts.append(n)
    return counts


def _print_row(row: dict) -> None:
    shape = f"{row['dtype']:>7} L={row['L']:<5} D={row['D']:<3} {'causal' if row['causal'] else '      '}"
    head = f"{shape} {row['mode']:>7} t={row['threads']} {row['system']:>11}"
    if "ms" in row:
        print(f"{head} {row['ms']:9.1f} ms  peak {row['peak_mib']:7.1f} MiB  err {row['rel_error']:.1e}", flush=True)
    else:
        print(f"{head}  {row.get('failure') or row.get('skipped')}", flush=True)


def _paired_ratios(baseline: dict, row: dict) -> list[float]:
    """baseline's ms over row's, round by round (the two ran back to back in each round)."""
    return [b / r for b, r in zip(baseline.get("ms_rounds", [baseline["ms"]]), row.get("ms_rounds", [row["ms"]]))]


def _print_ratios(rows: list[dict]) -> None:
    """flashcupy's speedup over torch-cpu per shape, mode and threads, and its 1 -> n scaling."""
    timed = {(r["system"], r["dtype"], r["L"], r["D"], r["causal"], r["mode"], r["threads"]): r
             for r in rows if "ms" in r}
    print("\nspeedup of flashcupy over torch-cpu (torch ms / flashcupy ms; per round, the two measured "
          "back to back: their median and range), peak memory ratio:")
    for key, row in timed.items():
        if key[0] != "flashcupy":
            continue
        other = timed.get(("torch-cpu",) + key[1:])
        if other:
            mem = row["peak_mib"] / other["peak_mib"] if other["peak_mib"] > 0 else float("nan")
            paired = _paired_ratios(other, row)
            rounds = (f"   rounds {statistics.median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f})"
                      if len(paired) > 1 else "")
            print(f"  {key[1]:>7} L={key[2]:<5} D={key[3]:<3} causal={key[4]!s:<5} {key[5]:>7} t={key[6]}: "
                  f"{other['ms'] / row['ms']:.2f}x{rounds}   memory {mem:.2f}x")
    counts = sorted({key[6] for key in timed})
    if len(counts) > 1:
        print(f"scaling from {counts[0]} to {counts[-1]} threads (ms at {counts[0]} / ms at {counts[-1]}):")
        for key, row in timed.items():
            if key[6] == counts[0] and key[:6] + (counts[-1],) in timed:
                print(f"  {key[0]:>11} {key[1]:>7} L={key[2]:<5} D={key[3]:<3} causal={key[4]!s:<5} {key[5]:>7}: "
                      f"{row['ms'] / timed[key[:6] + (counts[-1],)]['ms']:.2f}x")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["cpu"], default="cpu", help="the only suite of this script")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--threads", nargs="+", default=["1", "all"], metavar="N",
                        help="thread counts: integers or 'all' (the cores this process may use; default 1 all)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per process (median)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="processes per row, the systems of a shape taking turns (median of their medians)")
    parser.add_argument("--quick", action="store_true", help="L = 1024 only, 3 repeats, 1 round")
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/cpu-<yyyy-mm-dd>.json)")
    parser.add_argument("--no-save", action="store_true", help="print only")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return

    cores = sorted(os.sched_getaffinity(0))
    counts = _thread_counts(args.threads, cores)
    shapes = [s for s in SHAPES if s[1] == 1024] if args.quick else list(SHAPES)
    repeats = 3 if args.quick else args.repeats
    rounds = 1 if args.quick else args.rounds
    if rounds < 1 or repeats < 1:
        raise SystemExit(f"--rounds, --repeats: expected positive integers, received {rounds}, {repeats}")
    specs = [
        {"system": system, "dtype": dtype, "B": 1, "H": 8, "L": L, "D": D, "causal": causal, "mode": mode,
         "threads": n, "cores": cores[:n], "repeats": repeats}
        for (dtype, L, D, causal) in shapes for mode in args.modes for n in counts for system in args.systems
    ]
    if args.dry_run:
        for spec in specs:
            print(json.dumps(spec))
        return

    load_before = os.getloadavg()
    info = machine(cores)
    print(f"{info['cpu_model']}, {len(cores)} cores available, load {load_before[0]:.2f}", flush=True)
    rows = []
    for group in _shape_groups(specs):
        measured = [[] for _ in group]
        for _ in range(rounds):
            for spec, runs in zip(group, measured):
                runs.append(run_worker(spec))
        for runs in measured:
            row = _combine(runs)
            _print_row(row)
            rows.append(row)
    info["load_before"], info["load_after"] = list(load_before), list(os.getloadavg())
    _print_ratios(rows)
    if args.no_save:
        return
    out = args.out or ROOT / "bench" / "results" / f"cpu-{datetime.date.today().isoformat()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "gpu": None, "date": datetime.date.today().isoformat(), "commit": _commit(), "cupy": _version("cupy-cuda12x") or _version("cupy-cuda13x") or _version("cupy"),
        "torch": _version("torch"), "suite": "cpu", "machine": info, "rows": rows,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
