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
    explain     which CUDA kernels a call of a given shape and options runs on a GPU
                architecture, and the rule that chose them (no GPU needed).
    bench       run bench/bench_attention.py from a source checkout, passing the
                remaining arguments through. Exit status 2 when the script is missing.

A bad argument of any command is one line on stderr, ``python -m flashcupy <command>:
error: <what was expected, what was received>``, and exit status 2, never a traceback:
argparse's own errors and the commands' :class:`UsageError` go through :func:`main`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np

import flashcupy
from flashcupy import api, interop, testing
from flashcupy.cuda.spec import NoKernelError
from flashcupy.problem import MAX_HEAD_DIM, Problem, make_host_problem

DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
}


# --------------------------------------------------------------------------- errors


class UsageError(Exception):
    """A bad command-line argument: :func:`main` prints ``<prog>: error: <message>`` as one
    line on stderr and exits with status 2. ``prog`` defaults to the running command's."""

    def __init__(self, message: str, prog: str | None = None):
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors (unknown options, bad values, missing arguments) raise
    :class:`UsageError` instead of printing the usage block and exiting."""

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)", self.prog)


def _int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in [low, high] (unbounded above when ``high`` is None)."""
    what = (f"an int in {low}..{high}" if high is not None else
            "a positive int" if low == 1 else f"an int >= {low}")

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, received {text!r}")
        return value

    return parse


_positive = _int_in(1)
_head_dim = _int_in(1, MAX_HEAD_DIM)


def checked_problem(shapes: Sequence[tuple[int, ...]], dtype: np.dtype, options: dict[str, Any]) -> Problem:
    """The validated problem of q, k, v of these shapes and dtype with ``options``, from
    zero-stride stand-ins (no memory is allocated): what a command checks before it builds
    its arrays. The library's TypeError or ValueError becomes a :class:`UsageError`."""
    standins = [np.broadcast_to(np.zeros((), dtype), shape) for shape in shapes]
    try:
        return make_host_problem(*standins, options)
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from exc


# --------------------------------------------------------------------------- devices


def cuda_backend_available() -> bool:
    """True when a GPU is usable and this flashcupy has a CUDA backend to run on it."""
    if not interop.gpu_usable():
        return False
    try:
        return api._backend("cuda") == "cuda"
    except (RuntimeError, ValueError):  # today: "no CUDA kernels yet"
        return False


def gpu_unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here, in words for a user; None when it can."""
    if cuda_backend_available():
        return None
    _, why = _gpus()
    if why == "CuPy is not installed":
        return "CuPy is not installed (pip install 'flashcupy[cuda12]' or '[cuda13]' for the GPU backend)"
    if why is not None and "InsufficientDriver" in why:
        return f"CuPy found no NVIDIA driver, or one older than its CUDA runtime ({why})"
    return f"no usable CUDA GPU ({why})" if why else "no usable CUDA GPU"


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


# --------------------------------------------------------------------------- demo


#: Peak host memory of the dense float64 reference, in units of one (batch, heads, Lq, Lk)
#: float64 array (measured with tracemalloc: 6.5); the demo checks its result against it.
REFERENCE_SCORE_ARRAYS = 7


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (Linux's MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_demo_memory(args: argparse.Namespace) -> None:
    """A UsageError when the float64 reference of this demo cannot fit in the memory available."""
    need = REFERENCE_SCORE_ARRAYS * args.batch * args.heads * args.L * args.L * 8
    have = available_memory()
    if have is not None and need > have:
        raise UsageError(
            f"--L {args.L} --batch {args.batch} --heads {args.heads}: the dense float64 reference the demo "
            f"checks against needs about {need / 2**30:.1f} GiB, {have / 2**30:.1f} GiB are available; "
            "lower --L, --batch or --heads"
        )


def demo(args: argparse.Namespace) -> int:
    dtype = DTYPES[args.dtype]
    shape_q = (args.batch, args.heads, args.L, args.D)
    options: dict[str, Any] = {"causal": bool(args.causal)}
    checked_problem([shape_q] * 3, dtype, options)
    _check_demo_memory(args)
    rng = np.random.default_rng(args.seed)
    q, k, v = (rng.standard_normal(shape_q, dtype=np.float32).astype(dtype) for _ in range(3))

    why_not = gpu_unavailable_reason()
    backend = "cpu" if why_not else "cuda"
    print(
        f"flashcupy {flashcupy.__version__} demo: q, k, v ({args.batch}, {args.heads}, {args.L}, {args.D}) "
        f"{args.dtype}, causal={bool(args.causal)}"
    )
    if backend == "cuda":
        import cupy

        inputs = tuple(cupy.asarray(x) for x in (q, k, v))
        print(f"backend: cuda ({_gpu_name()})")
    else:
        inputs = (q, k, v)
        print(f"backend: cpu, because the GPU cannot be used: {why_not}")

    def run():
        out = flashcupy.flash_attention(*inputs, backend=backend, **options)
        _synchronizer(backend == "cuda")()
        return out

    try:
        out = run()  # warm-up (on a GPU: compilation and caches)
    except NoKernelError as exc:  # no tile of this dtype and head dim fits the GPU's shared memory
        backend, inputs = "cpu", (q, k, v)
        print(f"backend: cpu instead, because no CUDA kernel fits: {exc}")
        out = run()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
    ms = 1e3 * statistics.median(times)

    result = testing.attention_close(interop.to_numpy(out), q, k, v, **options)

    flops = 4.0 * args.batch * args.heads * args.L * args.L * args.D * (0.5 if args.causal else 1.0)
    print(f"max |out - reference|: {result.error:.3e}")
    print(f"tolerance:             {result.bound:.3e}  (2 * naive {args.dtype} error + rounding floor)")
    print(f"time:                  {ms:.2f} ms (median of {args.repeats} after a warm-up), "
          f"{flops / (ms * 1e-3) / 1e9:.1f} GFLOP/s")
    if not result.ok:
        print(result.message)
    print("PASS" if result.ok else "FAIL")
    return 0 if result.ok else 1


# --------------------------------------------------------------------------- info

#: What each warp policy of flashcupy.cuda.spec is, for ``info``.
POLICY_DESCRIPTIONS = {
    "mma16": "tensor cores (mma.sync m16n8k16)",
    "wgmma": "Hopper warpgroup tensor cores (wgmma.mma_async)",
    "tf32": "TF32 tensor cores (allow_tf32: one TF32 product per product)",
    "tf32x3": "TF32 tensor cores, three products per product (3xTF32: float32 accuracy)",
    "wgmma_tf32x3": ("Hopper warpgroup TF32 tensor cores, three products per product (3xTF32), "
                     "operands split by a producer warpgroup"),
    "dmma": "FP64 tensor cores (DMMA)",
    "simt": "SIMT (CUDA-core FMA)",
}


def _version(module_name: str) -> str:
    try:
        module = __import__(module_name)
    except ImportError:
        return "not installed"
    except Exception as exc:  # an installed but broken package
        return f"not importable ({type(exc).__name__}: {exc})"
    return str(getattr(module, "__version__", "unknown"))


def _cuda_version(number: int) -> str:
    """12090 -> '12.9'."""
    return f"{number // 1000}.{number % 1000 // 10}"


def _attempt(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"unavailable ({type(exc).__name__}{': ' + first if first else ''})"


def _dir_size(path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _gpus() -> tuple[list[dict[str, Any]], str | None]:
    """(one dict per visible GPU, None) or ([], why there is none)."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except ImportError:
        return [], "CuPy is not installed"
    except Exception as exc:
        return [], f"{type(exc).__name__}: {exc}"
    gpus = []
    for i in range(count):
        props = cupy.cuda.runtime.getDeviceProperties(i)
        name = props["name"]
        gpus.append({
            "index": i,
            "name": name.decode() if isinstance(name, bytes) else str(name),
            "compute_capability": f"{props['major']}.{props['minor']}",
            "arch": 10 * props["major"] + props["minor"],
            "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
            "sms": int(props["multiProcessorCount"]),
            "smem_optin_kib": int(props["sharedMemPerBlockOptin"]) // 1024,
        })
    return gpus, None if gpus else "no CUDA device visible"


def kernel_paths(arch: int | None) -> dict[str, str]:
    """Which kernel path each dtype takes on a GPU of compute capability ``arch`` (None: no GPU):
    the forward's product policy (flashcupy.cuda.spec's rule table, without score options) at
    each padded head dim, the most common first."""
    from flashcupy.cuda.spec import ARCH_SMEM, HEAD_DIM_BUCKETS, Call, NoKernelError, choose_forward, force_portable

    paths = {}
    for label, dtype, tf32 in [(name, name, False) for name in DTYPES] + [("float32 allow_tf32", "float32", True)]:
        if arch is None:
            paths[label] = "cpu backend"
            continue
        smem = ARCH_SMEM.get(arch, min(ARCH_SMEM.values()))
        dims: dict[str, list[int]] = {}
        for hd in HEAD_DIM_BUCKETS:
            try:
                policy = choose_forward(Call(dtype, hd, arch, smem, tf32, force_portable())).spec.policy
            except NoKernelError:
                continue
            dims.setdefault(policy, []).append(hd)
        first, *others = sorted(dims, key=lambda policy: -len(dims[policy]))
        paths[label] = f"{first}: {POLICY_DESCRIPTIONS[first]}" + "".join(
            f"; forward at head dims {'/'.join(map(str, dims[p]))}: {p}: {POLICY_DESCRIPTIONS[p]}" for p in others)
    return paths


def collect_info() -> dict[str, Any]:
    """Everything ``info`` prints, as plain data (``info --json`` prints it as JSON)."""
    import platform

    from flashcupy.cuda import compile as cc
    from flashcupy.cuda.spec import FORCE_PORTABLE_ENV, force_portable
    from flashcupy.precompile import cache_dir, load_records, record_path

    info: dict[str, Any] = {
        "flashcupy": flashcupy.__version__,
        "flashcupy_location": str(Path(flashcupy.__file__).resolve().parent),
        "python": f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        "numpy": _version("numpy"),
        "scipy": _version("scipy"),
        "ml_dtypes": _version("ml_dtypes"),
        "cupy": _version("cupy"),
    }
    if not info["cupy"][:1].isdigit():
        info.update(cuda_runtime="unavailable (no CuPy)", cuda_driver="unavailable (no CuPy)",
                    nvrtc="unavailable (no CuPy)")
    else:
        from cupy.cuda import nvrtc, runtime

        info["cuda_runtime"] = _attempt(lambda: _cuda_version(runtime.runtimeGetVersion()))
        info["cuda_driver"] = _attempt(
            lambda: _cuda_version(v) if (v := runtime.driverGetVersion()) else "none (no CUDA driver)")
        info["nvrtc"] = _attempt(lambda: ".".join(map(str, nvrtc.getVersion())))
    gpus, why = _gpus()
    info["gpus"] = gpus
    info["no_gpu_reason"] = why
    info["kernel_dir"] = _attempt(lambda: str(cc.kernel_dir()))
    info["kernel_source_hash"] = _attempt(cc.source_hash)
    info["cuda_include_dirs"] = _attempt(lambda: list(cc.cuda_include_dirs()))
    cache = cache_dir()
    info["kernel_cache_dir"] = str(cache)
    info["kernel_cache_mib"] = round(_dir_size(cache) / 2**20, 1) if cache.is_dir() else None
    usable = bool(gpus) and cuda_backend_available()
    info["force_portable"] = f"{FORCE_PORTABLE_ENV}={'1' if force_portable() else 'unset/0'}"
    info["kernel_paths_device"] = f"GPU 0 ({gpus[0]['name']}, sm_{gpus[0]['arch']})" if usable else "no GPU"
    info["kernel_paths"] = kernel_paths(gpus[0]["arch"] if usable else None)
    info["compile_record_path"] = str(record_path())
    info["compile_records"] = load_records()
    return info


def _print_info(info: dict[str, Any]) -> None:
    row = lambda label, value: print(f"  {label:<22} {value}")  # noqa: E731
    print(f"flashcupy {info['flashcupy']}  ({info['flashcupy_location']})")
    print("versions:")
    for key, label in (("python", "Python"), ("numpy", "NumPy"), ("scipy", "SciPy"), ("ml_dtypes", "ml_dtypes"),
                       ("cupy", "CuPy"), ("cuda_runtime", "CUDA runtime (CuPy)"),
                       ("cuda_driver", "CUDA driver"), ("nvrtc", "NVRTC")):
        row(label, info[key])
    print("GPUs:")
    if not info["gpus"]:
        row("none", info["no_gpu_reason"])
    for g in info["gpus"]:
        print(f"  [{g['index']}] {g['name']}: compute capability {g['compute_capability']}, "
              f"{g['memory_gib']} GiB, {g['sms']} SMs, {g['smem_optin_kib']} KiB shared memory per block (opt-in)")
    print("kernels:")
    row("sources", info["kernel_dir"])
    row("source hash", info["kernel_source_hash"])
    includes = info["cuda_include_dirs"]
    row("CUDA headers", ", ".join(includes) if isinstance(includes, list) and includes else
        includes if not isinstance(includes, list) else "none found (CuPy's own include path only)")
    size = info["kernel_cache_mib"]
    row("CuPy kernel cache", f"{info['kernel_cache_dir']} ({'absent' if size is None else f'{size} MiB'})")
    print(f"which kernel path each dtype takes here ({info['kernel_paths_device']}; {info['force_portable']}):")
    for label, path in info["kernel_paths"].items():
        row(label, path)
    records = info["compile_records"]
    if not records:
        print(f"compile times: none recorded (python -m flashcupy precompile records them in "
              f"{info['compile_record_path']})")
        return
    print(f"compile times recorded by precompile ({info['compile_record_path']}):")
    for key, rec in sorted(records.items()):
        kernels = rec.get("kernels", {})
        current = rec.get("source_hash") == info["kernel_source_hash"]
        print(f"  {key}: {len(kernels)} kernels, last run {rec.get('date', '?')}: {rec.get('wall_seconds', 0):.1f} s "
              f"with {rec.get('workers', '?')} threads (flashcupy {rec.get('flashcupy', '?')}, sources "
              f"{rec.get('source_hash', '?')}{'' if current else ', not the current sources'})")
        ranked = sorted(kernels.items(), key=lambda item: -item[1])
        for name, seconds in ranked[:10]:
            print(f"    {seconds:7.2f} s  {name}")
        if len(ranked) > 10:
            print(f"    ... {len(ranked) - 10} more, {sum(s for _, s in ranked[10:]):.1f} s in all")


def info(args: argparse.Namespace) -> int:
    data = collect_info()
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        _print_info(data)
    return 0


# --------------------------------------------------------------------------- check


def _check_case(label: str, dtype: np.dtype, shape_q: tuple, shape_kv: tuple, dv: int | None = None,
                **options: Any) -> dict[str, Any]:
    """Inputs of one self-test case (seeded by its label)."""
    rs = np.random.default_rng(sum(label.encode()) + 7 * len(label))
    dv = shape_kv[-1] if dv is None else dv
    q = rs.standard_normal(shape_q).astype(dtype)
    k = rs.standard_normal(shape_kv).astype(dtype)
    v = rs.standard_normal(shape_kv[:-1] + (dv,)).astype(dtype)
    dout = rs.standard_normal(shape_q[:-1] + (dv,)).astype(dtype)
    scores = shape_q[:-1] + (shape_kv[-2],)
    if options.get("mask") is True:
        options["mask"] = rs.random(scores) < 0.7
    if options.get("bias") is not None:  # True: the input dtype, else the dtype named
        bias_dtype = dtype if options["bias"] is True else np.dtype(options["bias"])
        options["bias"] = rs.standard_normal(scores).astype(bias_dtype)
    return {"label": label, "q": q, "k": k, "v": v, "dout": dout, "options": options}


def check_cases() -> list[dict[str, Any]]:
    """The self-test: every dtype plain, then causal, mask, bias, dropout, GQA, sinks and varlen."""
    f16, bf16, f32, f64 = (DTYPES[n] for n in ("float16", "bfloat16", "float32", "float64"))
    cu_q = np.array([0, 23, 23, 80], np.int32)  # three sequences, one of them empty
    cu_k = np.array([0, 31, 40, 96], np.int32)
    cases = [_check_case(f"{dt.name} plain", dt, (2, 2, 37, 64), (2, 2, 45, 64)) for dt in (f16, bf16, f32, f64)]
    cases += [
        _check_case("float16 causal", f16, (2, 2, 70, 64), (2, 2, 70, 64), causal=True),
        _check_case("float32 causal, L = 1100 (several tiles)", f32, (1, 1, 1100, 64), (1, 1, 1100, 64), causal=True),
        _check_case("float64 causal, Lq < Lk, Dv = 24", f64, (1, 2, 33, 64), (1, 2, 50, 64), dv=24, causal=True),
        _check_case("bfloat16 mask", bf16, (2, 2, 37, 64), (2, 2, 45, 64), mask=True),
        _check_case("float32 mask, window", f32, (1, 3, 40, 40), (1, 3, 52, 40), mask=True, window=(9, 3)),
        _check_case("float32 bias (with dbias)", f32, (2, 2, 37, 64), (2, 2, 45, 64), bias=True),
        _check_case("float16 float32-bias (with dbias), causal", f16, (1, 2, 48, 64), (1, 2, 48, 64), bias="float32",
                    causal=True),
        _check_case("float32 dropout", f32, (2, 2, 37, 64), (2, 2, 45, 64), dropout_p=0.2, seed=1234),
        _check_case("bfloat16 dropout, causal", bf16, (1, 2, 64, 64), (1, 2, 64, 64), dropout_p=0.3, seed=99,
                    causal=True),
        _check_case("float16 GQA 4:2", f16, (2, 4, 37, 64), (2, 2, 45, 64)),
        _check_case("bfloat16 sinks (with dsinks), causal, lengths", bf16, (2, 2, 40, 64), (2, 2, 40, 64), causal=True,
                    sinks=np.array([[0.5, -1.0]]), q_lengths=np.array([40, 17])),
        _check_case("float64 GQA 4:1 (MQA), causal, dropout", f64, (1, 4, 30, 64), (1, 1, 30, 64), causal=True,
                    dropout_p=0.1, seed=5),
        _check_case("float32 varlen, causal", f32, (2, 80, 64), (2, 96, 64), causal=True,
                    cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
        _check_case("bfloat16 varlen", bf16, (2, 80, 64), (2, 96, 64), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
        _check_case("float64 all: GQA bias mask softcap ALiBi window dropout", f64, (2, 4, 29, 40),
                    (2, 2, 41, 40), causal=True, bias=True, mask=True, softcap=5.0, window=(20, 4),
                    alibi_slopes=np.array([0.1, 0.2, 0.3, 0.4]), dropout_p=0.25, seed=2**40 + 3),
    ]
    return cases


def run_check_case(case: dict[str, Any], backend: str) -> list[tuple[str, float, float, str]]:
    """Forward and backward of one case on ``backend``; (result name, error, bound, problem) each."""
    q, k, v, dout, options = case["q"], case["k"], case["v"], case["dout"], case["options"]
    dtype = q.dtype
    bias_grad = options.get("bias") is not None
    out, lse = flashcupy.flash_attention_forward(q, k, v, backend=backend, **options)
    grads = flashcupy.flash_attention_backward(dout, q, k, v, out, lse, bias_grad=bias_grad, backend=backend,
                                               **options)
    ref, naive = testing.reference_results(q, k, v, options, dout)
    terms = testing.cancelling_terms(q, k, dout, ref["out"], options.get("scale"),
                                     np.shape(options["bias"]) if bias_grad else None, options.get("cu_seqlens_q"))
    names = ("out", "lse", "dq", "dk", "dv") + (("dbias",) if bias_grad else ()) + (
        ("dsinks",) if options.get("sinks") is not None else ())
    ours = dict(zip(names, (out, lse) + tuple(grads), strict=True))
    results = []
    for name, x in ours.items():
        rule_dtype = testing.floor_dtype(dtype, options["bias"].dtype) if name == "dbias" else dtype
        results.append((name, *testing.compare(interop.to_numpy(x), ref[name], naive[name], rule_dtype,
                                               terms.get(name, 0.0), name=name)))
    return results


def check(args: argparse.Namespace) -> int:
    why_not = gpu_unavailable_reason()
    if args.backend == "cuda" and why_not:
        raise UsageError(f"--backend cuda: {why_not}")
    backend = args.backend if args.backend != "auto" else "cpu" if why_not else "cuda"
    where = f"cuda ({_gpu_name()})" if backend == "cuda" else "cpu"
    print(f"flashcupy {flashcupy.__version__} check on {where}: forward and backward against the float64 "
          f"reference (max error / bound)")
    if backend == "cpu":
        print("backend: cpu, as asked (--backend cpu)" if args.backend == "cpu" else
              f"backend: cpu, because the GPU cannot be used: {why_not}")
    start = time.perf_counter()
    if backend == "cuda" and not args.no_precompile:
        from flashcupy.precompile import precompile

        t0 = time.perf_counter()
        times = precompile(head_dims=(64,), progress=sys.stderr.isatty())
        print(f"precompiled {len(times)} kernels in {time.perf_counter() - t0:.1f} s")
    failed = 0
    cases = check_cases()
    for case in cases:
        t0 = time.perf_counter()
        try:
            results = run_check_case(case, backend)
        except Exception as exc:
            results = [("error", float("nan"), 0.0, f"{type(exc).__name__}: {exc}")]
        ok = all(not problem for *_, problem in results)
        failed += not ok
        worst = max(results, key=lambda r: (bool(r[3]), r[1] / r[2] if r[2] > 0 else float(r[1] > 0)))
        name, err, bound, problem = worst
        detail = f"worst {name} {err:.1e} / {bound:.1e}" + (f": {problem}" if problem else "")
        print(f"{'PASS' if ok else 'FAIL'}  {case['label']:<56} {detail}  ({time.perf_counter() - t0:.2f} s)")
        if not ok and args.verbose:
            for name, err, bound, problem in results:
                print(f"        {name:<6} {err:.3e} / {bound:.3e} {problem}")
    total = time.perf_counter() - start
    print(f"{len(cases) - failed} passed, {failed} failed on {where} in {total:.1f} s")
    print("PASS" if not failed else "FAIL")
    return 1 if failed else 0


# --------------------------------------------------------------------------- precompile


def precompile_command(args: argparse.Namespace) -> int:
    from flashcupy.precompile import precompile, record_path

    start = time.perf_counter()
    try:
        times = precompile(dtypes=args.dtypes, head_dims=args.head_dims, backward=not args.no_backward,
                           device=args.device, allow_tf32=args.allow_tf32, progress=not args.no_progress,
                           workers=args.workers, options=[tuple(o.split(",")) if o else () for o in args.options])
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from exc
    except RuntimeError as exc:  # no usable GPU, or the driver failing: not the arguments
        print(f"python -m flashcupy precompile: error: {exc}", file=sys.stderr)
        return 1
    wall = time.perf_counter() - start
    print(f"compiled {len(times)} kernels in {wall:.1f} s (sum of per-kernel times {sum(times.values()):.1f} s); "
          f"times recorded in {record_path()}")
    for name, seconds in sorted(times.items(), key=lambda item: -item[1]):
        print(f"  {seconds:7.2f} s  {name}")
    return 0


# --------------------------------------------------------------------------- bench

BENCH_SCRIPT = Path("bench") / "bench_attention.py"
#: The scripts of the suites bench_attention.py does not run: bench ... --suite NAME.
SUITE_SCRIPTS = {"cpu": Path("bench") / "bench_cpu.py", "decode": Path("bench") / "bench_decode.py",
                 "options": Path("bench") / "bench_options.py", "overhead": Path("bench") / "bench_overhead.py"}


def find_bench_script(roots: Sequence[Path] | None = None, relative: Path = BENCH_SCRIPT) -> Path | None:
    """bench/bench_attention.py (or ``relative``) of a source checkout: beside the imported flashcupy
    package (its parent directory is the checkout's root), else under the current directory.
    None when neither has it (an installed wheel has no bench/)."""
    if roots is None:
        roots = [Path(flashcupy.__file__).resolve().parent.parent, Path.cwd()]
    for root in roots:
        script = Path(root) / relative
        if script.is_file():
            return script
    return None


BENCH_MISSING = """\
python -m flashcupy bench runs bench/bench_attention.py, which lives in flashcupy's source
repository and is not part of the installed package (this flashcupy is at {location}, with
no bench/ folder beside it, nor under the current directory {cwd}).
To run the benchmarks, clone the flashcupy repository and, from its root:
    python3 -m venv .venv && . .venv/bin/activate
    pip install -e '.[cuda12,bench]' torch
    python -m flashcupy bench --help          # or: python bench/bench_attention.py --help"""


def bench(argv: Sequence[str], script: Path | None = None) -> int:
    """Run the benchmark script with ``argv`` (the suite's own for ``--suite`` cpu, decode,
    options or overhead: SUITE_SCRIPTS); its exit status, or 2 when it is missing."""
    suites = [b for a, b in zip(argv, argv[1:]) if a == "--suite"] + [a[8:] for a in argv if a.startswith("--suite=")]
    relative = SUITE_SCRIPTS.get(suites[-1], BENCH_SCRIPT) if suites else BENCH_SCRIPT
    if script is None:
        script = find_bench_script(relative=relative)
    if script is None:
        print(BENCH_MISSING.format(location=Path(flashcupy.__file__).resolve().parent, cwd=Path.cwd()),
              file=sys.stderr)
        return 2
    root = script.resolve().parent.parent
    env = dict(os.environ)  # the script imports flashcupy: the checkout's own, as its docstring runs it
    env["PYTHONPATH"] = os.pathsep.join([str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return subprocess.call([sys.executable, str(script), *argv], env=env)


# --------------------------------------------------------------------------- explain


def _shape(text: str) -> tuple[int, ...]:
    """An argparse type: 'B,H,L,D' (two to six positive ints)."""
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not 2 <= len(shape) <= 6 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected a shape such as 2,16,4096,128, received {text!r}")
    return shape


def _window(text: str) -> tuple[int | None, int | None]:
    """An argparse type: 'LEFT,RIGHT', each an int >= 0 or 'none'."""
    parts = text.split(",")
    try:
        sides = tuple(None if part.strip().lower() == "none" else int(part) for part in parts)
    except ValueError:
        sides = ()
    if len(sides) != 2 or any(side is not None and side < 0 for side in sides):
        raise argparse.ArgumentTypeError(f"expected LEFT,RIGHT (ints >= 0 or none), received {text!r}")
    return sides


def explain_command(args: argparse.Namespace) -> int:
    """Print which kernels a call of this shape and these options runs, and the rules that chose them."""
    from flashcupy.explain import explain

    dtype = DTYPES[args.dtype]
    q_shape = args.shape
    kv_shape = args.kv_shape or q_shape
    v_shape = kv_shape[:-1] + (args.dv or kv_shape[-1],)
    lq, lk = q_shape[-2], kv_shape[-2]
    options: dict[str, Any] = {"allow_tf32": args.allow_tf32}
    if args.causal != "none":
        options["causal"] = True if args.causal == "bottom_right" else "top_left"
    if args.window is not None:
        options["window"] = args.window
    if args.bias:
        options["bias"] = np.broadcast_to(np.zeros((), np.float32), (lq, lk))
    if args.mask:
        options["mask"] = np.broadcast_to(np.ones((), bool), (lq, lk))
    if args.block_mask:
        options.update(block_size=128, block_mask=np.broadcast_to(np.ones((), bool), (-(-lq // 128), -(-lk // 128))))
    if args.alibi:
        options["alibi_slopes"] = np.ones(q_shape[-3] if len(q_shape) > 2 else 1)
    if args.sinks:
        options["sinks"] = np.zeros(q_shape[-3] if len(q_shape) > 2 else 1)
    if args.softcap is not None:
        options["softcap"] = args.softcap
    if args.dropout:
        options.update(dropout_p=args.dropout, seed=0)
    if args.lengths:
        batch = q_shape[:-3]
        options.update(q_lengths=np.full(batch, lq, np.int32), kv_lengths=np.full(batch, lk, np.int32))
    standins = [np.broadcast_to(np.zeros((), dtype), shape) for shape in (q_shape, kv_shape, v_shape)]
    try:
        print(explain(*standins, arch=args.arch, backward=not args.no_backward, deterministic=args.deterministic,
                      registers=args.registers, **options))
    except (TypeError, ValueError, NoKernelError) as exc:  # NoKernelError: no tile fits that GPU's shared memory
        raise UsageError(str(exc)) from exc
    return 0


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
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
    p.add_argument("--D", type=_head_dim, default=64, help=f"head dim, 1..{MAX_HEAD_DIM} (default 64)")
    p.add_argument("--heads", type=_positive, default=8, help="heads (default 8)")
    p.add_argument("--batch", type=_positive, default=2, help="batch size (default 2)")
    p.add_argument("--causal", action="store_true", help="causal (bottom-right) masking")
    p.add_argument("--repeats", type=_positive, default=3, help="timed runs after the warm-up (default 3)")
    p.add_argument("--seed", type=_int_in(0), default=0, help="seed of the random inputs, an int >= 0 (default 0)")
    p.set_defaults(func=demo)

    p = commands.add_parser(
        "info",
        help="versions, GPUs, kernel sources and cache, which kernel path each dtype takes here",
        description="flashcupy's version and location; Python, NumPy, SciPy, ml_dtypes and CuPy versions; "
        "the CUDA runtime, driver and NVRTC versions (through CuPy); each visible GPU; the kernel sources, "
        "their hash and CuPy's kernel cache; which kernel path each dtype takes on GPU 0 (or 'cpu "
        "backend'); the compile times recorded by 'precompile'.",
    )
    p.add_argument("--json", action="store_true", help="print the same facts as JSON")
    p.set_defaults(func=info)

    p = commands.add_parser(
        "check",
        help="self-test: small problems of every dtype and option, forward and backward, vs the reference",
        description="Small problems (every dtype; causal, mask, window, bias with dbias, dropout, GQA, "
        "varlen, all together) through flash_attention_forward and flash_attention_backward on the GPU "
        "when one is usable (else the CPU), each result checked against the float64 reference under the "
        "tolerance rule of the tests (float64 within 1e-9). One PASS/FAIL line per case, then a summary; "
        "exit status 1 on any failure.",
    )
    p.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto",
                   help="where to run (default auto: the GPU when usable, else the CPU)")
    p.add_argument("--no-precompile", action="store_true",
                   help="on a GPU, compile kernels lazily on first use instead of in parallel up front")
    p.add_argument("--verbose", "-v", action="store_true", help="every result's error and bound for failing cases")
    p.set_defaults(func=check)

    p = commands.add_parser(
        "precompile",
        help="compile the CUDA kernels ahead of first use (flashcupy.precompile)",
        description="Compile, in parallel threads, the forward and backward kernels that calls with these "
        "dtypes, head dims and option sets select on the current GPU; the times are recorded in CuPy's "
        "kernel cache directory and shown by 'info'. Exit status 1 without a GPU.",
    )
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES), metavar="DTYPE",
                   help=f"dtypes to cover (default all: {' '.join(DTYPES)})")
    p.add_argument("--head-dims", nargs="+", type=_head_dim, default=[64, 128], metavar="D",
                   help=f"head dims to cover, each 1..{MAX_HEAD_DIM} (default 64 128)")
    p.add_argument("--no-backward", action="store_true", help="forward kernels only")
    p.add_argument("--device", type=_int_in(0), default=None,
                   help="CUDA device index (default CuPy's current device)")
    p.add_argument("--allow-tf32", action="store_true", help="the float32 kernels of allow_tf32=True calls")
    p.add_argument("--workers", type=_positive, default=None, help="compile threads (default min(8, CPUs))")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--options", nargs="+", default=[""], metavar="SET",
                   help="option sets to cover, each comma-separated names among softcap, bias, alibi, mask, "
                        "block_mask, dropout, or '' for none (default: '' only, calls with causal, window and "
                        "lengths alone); e.g. --options '' bias mask,dropout")
    p.set_defaults(func=precompile_command)

    p = commands.add_parser(
        "explain",
        help="which CUDA kernels a call runs, their tiles and shared memory, and the rule that chose them",
        description="For q of --shape (and k, v of --kv-shape) and the options given, the forward and backward "
        "kernels the rule tables of flashcupy.cuda.spec choose on the GPU architecture --arch (the current "
        "GPU's when omitted), without running them and without a GPU: each rule's name and reason, the "
        "kernels' tiles, threads, shared memory and grid, and with --registers ptxas' registers and spills "
        "(NVRTC compiles each kernel). Option flags stand for an array of their usual shape.",
    )
    p.add_argument("--shape", type=_shape, required=True, metavar="B,H,L,D", help="q's shape, e.g. 2,16,4096,128")
    p.add_argument("--kv-shape", type=_shape, default=None, metavar="B,HK,LK,D", help="k's shape (default q's)")
    p.add_argument("--dv", type=_head_dim, default=None, help="v's head dim (default k's)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float16", help="input dtype (default float16)")
    p.add_argument("--arch", default=None, help="compute capability, e.g. sm_90 or 80 (default: the current GPU's)")
    p.add_argument("--causal", choices=["none", "bottom_right", "top_left"], default="none", nargs="?",
                   const="bottom_right", help="causal mask (--causal alone: bottom_right)")
    p.add_argument("--window", type=_window, default=None, metavar="LEFT,RIGHT", help="sliding window")
    p.add_argument("--bias", action="store_true", help="an (Lq, Lk) float32 bias")
    p.add_argument("--mask", action="store_true", help="an (Lq, Lk) boolean mask")
    p.add_argument("--block-mask", action="store_true", help="a block mask of 128-wide blocks")
    p.add_argument("--alibi", action="store_true", help="ALiBi slopes, one per query head")
    p.add_argument("--sinks", action="store_true", help="attention sinks, one per query head")
    p.add_argument("--softcap", type=float, default=None, help="softcap value")
    p.add_argument("--dropout", type=float, default=0.0, metavar="P", help="dropout probability")
    p.add_argument("--lengths", action="store_true", help="per-batch q_lengths and kv_lengths")
    p.add_argument("--allow-tf32", action="store_true", help="float32 on single TF32 products")
    p.add_argument("--deterministic", action="store_true", help="the backward's deterministic dQ")
    p.add_argument("--no-backward", action="store_true", help="the forward only")
    p.add_argument("--registers", action="store_true", help="compile each kernel with NVRTC for its registers")
    p.set_defaults(func=explain_command)

    commands.add_parser(
        "bench",
        help="run bench/bench_attention.py from a source checkout (arguments pass through)",
        description="Runs bench/bench_attention.py of a source checkout with the remaining arguments "
        "('python -m flashcupy bench --help' shows the script's own options). Exit status 2 when the "
        "script is missing (installed packages do not include bench/).",
        add_help=False,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after 'bench' belongs to the benchmark script
        return bench(argv[1:])
    parser = build_parser()
    args = None
    try:
        args = parser.parse_args(argv)
        return args.func(args)
    except UsageError as exc:
        prog = exc.prog or (f"{parser.prog} {args.command}" if args is not None else parser.prog)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
