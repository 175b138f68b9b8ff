"""flashcupy's CUDA forward beside PyTorch SDPA's backends and naive CuPy attention, on one GPU.

    PYTHONPATH=. python bench/bench_attention.py [options]       # from the repository root
    PYTHONPATH=. python bench/bench_attention.py --quick         # L = 1024 only, 5 repeats
    python bench/bench_attention.py --dry-run                    # print the plan: no GPU, torch or CuPy
    python bench/plot.py bench/results/<gpu>-<yyyy-mm-dd>.json   # the PNG beside the JSON

Grid (design.md section 5): for each dtype, head dim D, length L and causal flag,
B = tokens // L (at least 1) and H = hidden // D, q, k, v of shape (B, H, L, D)
drawn by torch.randn on the GPU. flashcupy reads the same memory through
zero-copy CuPy views (cupy.from_dlpack) and runs on torch's current stream.
Systems: flashcupy (backend="cuda"), torch SDPA restricted to one backend each
(sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math; Lq == Lk, so SDPA's
top-left causal mask equals flashcupy's bottom-right one) and cupy-naive
(scores in the input dtype, softmax in float32, or float64 for float64).

Correctness before timing: each system's output is compared with a reference
computed by torch in float32 (float64 for float64 inputs) from the same inputs;
the relative Frobenius error ||out - ref|| / ||ref|| must stay below 2e-2 for
float16/bfloat16, 1e-4 for float32 and 1e-10 for float64. A system that fails
the check, or flashcupy raising, goes to "failures" and is not timed; a
baseline that raises (unsupported dtype, head dim, out of memory) goes to
"skipped" with the first line of its exception, as does cupy-naive when its
(B, H, L, L) score tensor would take more than a quarter of the free GPU memory.

Timing: CUDA events on torch's current stream around each call, ``--warmup``
calls first, then ``--repeats`` calls timed one by one; the row holds the
median (ms) and the minimum (ms_min). Inputs under 64 MiB in all are drawn
twice and the calls alternate between the two sets, so that no call finds its
inputs in L2 from the call before. TFLOP/s count FlashAttention's FLOPs:
4 * B * H * L * L * D for the forward, halved when causal.

Peak memory (``--memory``): one non-causal float16 forward at B=1, H=16, D=64
for each L in ``--memory-lengths``, after a warm-up call. For torch:
torch.cuda.max_memory_allocated() during the call minus memory_allocated()
before it (torch's caching allocator, reset_peak_memory_stats first). For
flashcupy: the call runs with a fresh cupy.cuda.MemoryPool as CuPy's
allocator; a pool gives nothing back to the device until told to, so its
total_bytes() after the call is the high-water mark of what the call
allocated. Both count the output and every temporary but not the inputs, in
the allocators' 512-byte blocks.

Results go to ``--out`` (default bench/results/<gpu>-<yyyy-mm-dd>.json, the
GPU's name lowercased with spaces as '-'), rewritten after every
configuration: top-level gpu, date, cupy, torch, flashcupy, python, runs (the
command lines that produced the file), rows {system, dtype, B, H, L, D,
causal, mode, ms, ms_min, tflops, rel_error}, skipped (the same keys but
reason), failures (error, and rel_error where the check failed), memory
(peak_bytes and peak_mib, or reason). ``--append`` merges into an existing
file of the same GPU, new entries replacing old ones of the same system and
configuration. A table of TFLOP/s and flashcupy's ratio to each baseline
closes the run; the exit status is 1 when anything is in failures. Progress
goes to stderr: a tqdm bar on a terminal, else one line per step.

Only the forward exists: ``--modes bwd`` is refused until the CUDA backward
kernels do (its FLOPs, 2.5x the forward's, are already in attention_flops).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import platform
import re
import statistics
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

SYSTEMS = ("flashcupy", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math", "cupy-naive")
#: torch.nn.attention.SDPBackend member per SDPA system.
SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-math": "MATH",
}
#: Systems of the peak-memory sweep.
MEMORY_SYSTEMS = ("flashcupy", "sdpa-flash", "sdpa-cudnn", "sdpa-efficient", "sdpa-math")
DTYPES = ("float16", "bfloat16", "float32", "float64")
MODES = ("fwd", "bwd")
IMPLEMENTED_MODES = ("fwd",)
#: FLOPs of a mode as a multiple of the forward's (FlashAttention's count).
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5}
#: Largest relative Frobenius error against the reference that passes, per dtype.
TOLERANCE = {"float16": 2e-2, "bfloat16": 2e-2, "float32": 1e-4, "float64": 1e-10}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
#: Inputs smaller than this (q, k, v together) are drawn twice and alternated.
ROTATE_BELOW_BYTES = 64 * 2**20
#: cupy-naive runs only while its score tensor fits in this fraction of the free GPU memory.
NAIVE_MEMORY_FRACTION = 0.25
#: Score elements per chunk of the reference computation (1 GiB in float32).
REFERENCE_CHUNK_ELEMENTS = 2**28
#: Shape of the peak-memory sweep: (dtype, B, H, D), non-causal forward.
MEMORY_SHAPE = ("float16", 1, 16, 64)
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# --------------------------------------------------------------------------- configurations


def attention_flops(B: int, H: int, L: int, D: int, causal: bool, mode: str) -> float:
    """FlashAttention's FLOP count: forward 4 * B * H * L * L * D, halved when causal; backward 2.5x."""
    flops = 4.0 * B * H * L * L * D * MODE_FLOP_FACTOR[mode]
    return flops / 2 if causal else flops


@dataclass(frozen=True)
class Config:
    """One benchmarked shape: q, k, v of shape (B, H, L, D) and dtype, causal or not, one mode."""

    dtype: str
    B: int
    H: int
    L: int
    D: int
    causal: bool
    mode: str

    @property
    def flops(self) -> float:
        return attention_flops(self.B, self.H, self.L, self.D, self.causal, self.mode)

    @property
    def input_bytes(self) -> int:
        """Bytes of q, k and v together."""
        return 3 * self.B * self.H * self.L * self.D * ITEMSIZE[self.dtype]

    @property
    def input_sets(self) -> int:
        """How many input sets the timed calls alternate between."""
        return 2 if self.input_bytes < ROTATE_BELOW_BYTES else 1

    @property
    def score_bytes(self) -> int:
        """Bytes of cupy-naive's (B, H, L, L) score tensor in its softmax dtype."""
        return self.B * self.H * self.L * self.L * (8 if self.dtype == "float64" else 4)

    @property
    def label(self) -> str:
        causal = "causal" if self.causal else "non-causal"
        return f"{self.dtype} B={self.B} H={self.H} L={self.L} D={self.D} {causal} {self.mode}"


def build_configs(dtypes: Sequence[str], head_dims: Sequence[int], lengths: Sequence[int],
                  causal: Sequence[bool], modes: Sequence[str], tokens: int, hidden: int) -> list[Config]:
    """The grid, dtype-major: B = max(1, tokens // L), H = max(1, hidden // D)."""
    return [
        Config(dtype, max(1, tokens // L), max(1, hidden // D), L, D, c, mode)
        for dtype in dtypes for D in head_dims for L in lengths for c in causal for mode in modes
    ]


def memory_configs(lengths: Sequence[int]) -> list[Config]:
    """The peak-memory sweep's shapes."""
    dtype, B, H, D = MEMORY_SHAPE
    return [Config(dtype, B, H, L, D, False, "fwd") for L in lengths]


def record(system: str, config: Config, **fields: Any) -> dict[str, Any]:
    """A JSON entry: the system, the configuration's fields (flops excluded), then ``fields``."""
    return {"system": system, **asdict(config), **fields}


def entry_key(entry: dict[str, Any]) -> tuple:
    """What identifies a row, skip, failure or memory entry: its system and configuration."""
    return tuple(entry[f] for f in ("system", "dtype", "B", "H", "L", "D", "causal", "mode"))


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (other odd characters become '-' too)."""
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-")


def default_out_path(gpu: str, date: str) -> Path:
    """bench/results/<gpu slug>-<date>.json."""
    return RESULTS_DIR / f"{gpu_slug(gpu)}-{date}.json"


def first_line(exc: BaseException) -> str:
    """'ExceptionType: first line of its message'."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def warning_note(caught: Sequence[warnings.WarningMessage]) -> str:
    """' (first lines of the distinct warnings)', or ''; SDPA explains in warnings why a backend
    cannot run, then raises a bare 'No available kernel'."""
    lines = dict.fromkeys(str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip())
    return f" ({'; '.join(lines)})" if lines else ""


# --------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float16", "bfloat16"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], metavar="D")
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096], metavar="L")
    parser.add_argument("--causal", nargs="+", choices=["false", "true"], default=["false", "true"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=["fwd"],
                        help="fwd only for now; bwd waits for the CUDA backward kernels")
    parser.add_argument("--tokens", type=int, default=16384, help="B = tokens // L (default 16384)")
    parser.add_argument("--hidden", type=int, default=2048, help="H = hidden // D (default 2048)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--out", type=Path, help="JSON path (default bench/results/<gpu>-<yyyy-mm-dd>.json)")
    parser.add_argument("--append", action="store_true",
                        help="merge into an existing --out file of the same GPU instead of replacing it")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per system and config (median)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls before them")
    parser.add_argument("--quick", action="store_true", help="lengths 1024 only and 5 repeats")
    parser.add_argument("--memory", action="store_true",
                        help="also measure peak device memory of one forward (B=1, H=16, D=64, float16)")
    parser.add_argument("--memory-lengths", nargs="+", type=int, default=[1024, 4096, 16384, 32768, 65536],
                        metavar="L")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the inputs")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit: no GPU work, no output")
    args = parser.parse_args(argv)

    missing = [m for m in args.modes if m not in IMPLEMENTED_MODES]
    if missing:
        parser.error(f"--modes {' '.join(missing)}: not implemented yet (the CUDA backward kernels do not "
                     f"exist); use --modes fwd")
    if args.quick:
        args.lengths, args.repeats = [1024], 5
    for name in ("head_dims", "lengths", "memory_lengths"):
        if any(n < 1 for n in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')}: expected positive integers")
    if args.tokens < 1 or args.hidden < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--tokens, --hidden and --repeats must be >= 1 and --warmup >= 0")
    args.causal = [c == "true" for c in dict.fromkeys(args.causal)]
    args.systems = [s for s in SYSTEMS if s in args.systems]
    return args


# --------------------------------------------------------------------------- progress


class LinePrinter:
    """Progress as one line per step on stderr (no tqdm, or stderr is not a terminal)."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def step(self, label: str) -> None:
        """Announce the step about to run."""
        self.done += 1
        print(f"[{self.done}/{self.total}] {label}", file=sys.stderr, flush=True)

    def write(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


class TqdmBar:
    """Progress as a tqdm bar on stderr."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._tqdm = tqdm
        self._bar = tqdm(total=total, unit="run", dynamic_ncols=True)
        self._started = False

    def step(self, label: str) -> None:
        """Announce the step about to run (the bar counts the previous one as done)."""
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_description_str(label, refresh=True)

    def write(self, message: str) -> None:
        self._tqdm.write(message, file=sys.stderr)

    def close(self) -> None:
        if self._started:
            self._bar.update(1)
        self._bar.close()


def progress(total: int) -> LinePrinter | TqdmBar:
    """A tqdm bar where tqdm imports and stderr is a terminal, else a line printer."""
    if sys.stderr.isatty():
        try:
            return TqdmBar(total)
        except ImportError:
            pass
    return LinePrinter(total)


# --------------------------------------------------------------------------- attention implementations


def naive_attention(q: Any, k: Any, v: Any, causal: bool, xp: Any) -> Any:
    """softmax(q k^T / sqrt(D)) v with the whole score tensor in memory, in array module ``xp``.

    The products run in the input dtype; the softmax in float32 (float64 for
    float64 inputs); the probabilities are cast back to the input dtype for the
    product with v. causal keeps j <= i (Lq == Lk here).
    """
    soft = np.float64 if q.dtype == np.float64 else np.float32
    s = xp.matmul(q, xp.swapaxes(k, -1, -2)).astype(soft, copy=False)
    s *= 1.0 / math.sqrt(q.shape[-1])
    if causal:
        L = s.shape[-1]
        s += xp.triu(xp.full((L, L), -np.inf, dtype=soft), 1)
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    return xp.matmul(s.astype(q.dtype, copy=False), v)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Plain attention in torch, float32 (float64 for float64 inputs), in chunks of at most
    REFERENCE_CHUNK_ELEMENTS scores; causal keeps j <= i (Lq == Lk here)."""
    import torch

    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    B, H, L, D = q.shape
    qf, kf, vf = (x.reshape(B * H, L, D) for x in (q, k, v))
    out = torch.empty((B * H, L, D), dtype=acc, device=q.device)
    rows = max(1, min(L, REFERENCE_CHUNK_ELEMENTS // L))
    heads = max(1, REFERENCE_CHUNK_ELEMENTS // (rows * L))
    cols = torch.arange(L, device=q.device)
    for h0 in range(0, B * H, heads):
        kh, vh = kf[h0:h0 + heads].to(acc), vf[h0:h0 + heads].to(acc)
        for i0 in range(0, L, rows):
            s = qf[h0:h0 + heads, i0:i0 + rows].to(acc) @ kh.transpose(-1, -2)
            s *= D ** -0.5
            if causal:
                i = torch.arange(i0, i0 + s.shape[-2], device=q.device)
                s.masked_fill_(cols[None, :] > i[:, None], -math.inf)
            out[h0:h0 + heads, i0:i0 + rows] = torch.softmax(s, dim=-1) @ vh
    return out.reshape(B, H, L, D)


def relative_error(out: Any, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| (Frobenius, in float64); NaN when out holds NaN or has the wrong shape."""
    import torch

    if tuple(out.shape) != tuple(ref.shape):
        return math.nan
    diff = torch.linalg.vector_norm(out.to(torch.float64) - ref.to(torch.float64))
    return float(diff / torch.linalg.vector_norm(ref.to(torch.float64)))


def as_torch(out: Any) -> torch.Tensor:
    """A torch view of a system's output; CuPy outputs cross as float32 (float64 stays float64),
    so that no narrow dtype has to pass through DLPack."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    wide = np.float64 if out.dtype == np.float64 else np.float32
    return torch.from_dlpack(out.astype(wide, copy=False))


@dataclass
class Inputs:
    """One input set: torch tensors and zero-copy CuPy views of the same memory."""

    q: Any
    k: Any
    v: Any
    qc: Any
    kc: Any
    vc: Any


def make_inputs(config: Config, seed: int, sets: int) -> list[Inputs]:
    """``sets`` sets of randn q, k, v on the current CUDA device, set s drawn with seed + s."""
    import cupy
    import torch

    dtype = getattr(torch, config.dtype)
    shape = (config.B, config.H, config.L, config.D)
    inputs = []
    for s in range(sets):
        gen = torch.Generator(device="cuda").manual_seed(seed + s)
        q, k, v = (torch.randn(shape, dtype=dtype, device="cuda", generator=gen) for _ in range(3))
        inputs.append(Inputs(q, k, v, *(cupy.from_dlpack(x) for x in (q, k, v))))
    return inputs


def forward_runner(system: str) -> Callable[[Inputs, bool], Any]:
    """The forward call of ``system`` on one input set: (inputs, causal) -> output array."""
    if system == "flashcupy":
        import flashcupy

        return lambda x, causal: flashcupy.flash_attention(x.qc, x.kc, x.vc, causal=causal, backend="cuda")
    if system == "cupy-naive":
        import cupy

        return lambda x, causal: naive_attention(x.qc, x.kc, x.vc, causal, cupy)
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[system])

    def run(x: Inputs, causal: bool) -> torch.Tensor:
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(x.q, x.k, x.v, is_causal=causal)

    return run


# --------------------------------------------------------------------------- GPU plumbing


class _StreamHandle:
    """A raw cudaStream_t behind the CUDA stream protocol, for cupy.cuda.Stream.from_external."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def torch_stream_for_cupy() -> Any:
    """torch's current CUDA stream as a CuPy stream: ``with`` it, CuPy (and so flashcupy) launches there."""
    import cupy
    import torch

    return cupy.cuda.Stream.from_external(_StreamHandle(torch.cuda.current_stream().cuda_stream))


def release_memory() -> None:
    """Wait for the GPU, then hand the cached blocks of CuPy's pool and torch's allocator back."""
    import cupy
    import torch

    torch.cuda.synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    torch.cuda.empty_cache()


def time_calls(calls: Sequence[Callable[[], Any]], warmup: int, repeats: int) -> list[float]:
    """Milliseconds of ``repeats`` calls, each between two CUDA events on torch's current stream,
    after ``warmup`` untimed ones; call i is calls[i % len(calls)] (one per input set)."""
    import torch

    stream = torch.cuda.current_stream()
    for i in range(warmup):
        calls[i % len(calls)]()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        starts[i].record(stream)
        calls[(warmup + i) % len(calls)]()
        ends[i].record(stream)
    ends[-1].synchronize()
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


@dataclass
class Results:
    """What one run produced, in JSON-ready entries."""

    rows: list[dict[str, Any]]
    skipped: list[dict[str, Any]]
    failures: list[dict[str, Any]]
    memory: list[dict[str, Any]]


def bench_config(config: Config, systems: Sequence[str], args: argparse.Namespace,
                 results: Results, bar: LinePrinter | TqdmBar) -> None:
    """Check, then time, every system on one configuration; entries go to ``results``."""
    import torch

    def skip(system: str, reason: str) -> None:
        results.skipped.append(record(system, config, reason=reason))
        bar.write(f"  skipped {system} at {config.label}: {reason}")

    def fail(system: str, error: str, **fields: Any) -> None:
        results.failures.append(record(system, config, error=error, **fields))
        bar.write(f"  FAILED {system} at {config.label}: {error}")

    release_memory()
    inputs = make_inputs(config, args.seed, config.input_sets)
    try:
        ref = reference_attention(inputs[0].q, inputs[0].k, inputs[0].v, config.causal)
    except Exception as exc:  # noqa: BLE001  (out of memory, most likely: nothing can be checked)
        for system in systems:
            bar.step(f"{config.label} {system}")
            skip(system, f"reference failed: {first_line(exc)}")
        return
    for system in systems:
        bar.step(f"{config.label} {system}")
        if system == "cupy-naive":
            release_memory()
            free = torch.cuda.mem_get_info()[0]
            if config.score_bytes > NAIVE_MEMORY_FRACTION * free:
                skip(system, f"its score tensor ({config.score_bytes / 2**30:.1f} GiB) exceeds "
                             f"{NAIVE_MEMORY_FRACTION:.0%} of the free GPU memory ({free / 2**30:.1f} GiB)")
                continue
        run = forward_runner(system)
        tolerance = TOLERANCE[config.dtype]
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                err = relative_error(as_torch(run(inputs[0], config.causal)), ref)
            if not err < tolerance:
                fail(system, f"relative error {err:.3g} exceeds {tolerance:g}",
                     rel_error=float(f"{err:.3g}") if math.isfinite(err) else None)
                continue
            times = time_calls([functools.partial(run, x, config.causal) for x in inputs], args.warmup, args.repeats)
        except Exception as exc:  # noqa: BLE001  (any error of one system is that system's result)
            (fail if system == "flashcupy" else skip)(system, first_line(exc) + warning_note(caught))
            release_memory()
            continue
        ms = statistics.median(times)
        results.rows.append(record(system, config, ms=float(f"{ms:.5g}"), ms_min=float(f"{min(times):.5g}"),
                                   tflops=float(f"{config.flops / (ms * 1e-3) / 1e12:.4g}"),
                                   rel_error=float(f"{err:.3g}")))


def peak_memory(system: str, x: Inputs) -> int:
    """Peak device bytes of one forward of ``system`` beyond its inputs (method: module docstring)."""
    import cupy
    import torch

    run = forward_runner(system)
    run(x, False)  # warm-up: kernel compilation, library handles and workspaces
    release_memory()
    if system == "flashcupy":
        pool = cupy.cuda.MemoryPool()
        with cupy.cuda.using_allocator(pool.malloc):
            out = run(x, False)
            torch.cuda.synchronize()
            peak = pool.total_bytes()
            del out
        pool.free_all_blocks()
        return peak
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run(x, False)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def bench_memory(configs: Sequence[Config], systems: Sequence[str], args: argparse.Namespace,
                 results: Results, bar: LinePrinter | TqdmBar) -> None:
    """The peak-memory sweep: one entry per system and length in results.memory, with
    peak_bytes and peak_mib, or with the reason (first line of the exception) it has none."""
    for config in configs:
        release_memory()
        (x,) = make_inputs(config, args.seed, 1)
        for system in systems:
            bar.step(f"memory {config.label} {system}")
            try:
                peak = peak_memory(system, x)
            except Exception as exc:  # noqa: BLE001  (out of memory, for the O(L^2) backends at long L)
                results.memory.append(record(system, config, reason=first_line(exc)))
                bar.write(f"  no peak memory for {system} at {config.label}: {first_line(exc)}")
                release_memory()
                continue
            results.memory.append(record(system, config, peak_bytes=peak, peak_mib=round(peak / 2**20, 1)))
        del x
        release_memory()


# --------------------------------------------------------------------------- output


def merge(old: Iterable[dict[str, Any]], new: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``old`` entries whose system and configuration ``new`` does not measure again, then ``new``."""
    new = list(new)
    fresh = {entry_key(e) for e in new}
    return [e for e in old if entry_key(e) not in fresh] + new


def build_document(meta: dict[str, Any], results: Results, previous: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON document; with ``previous`` (--append), its entries and runs are kept unless measured again.

    An entry measured again in any list (row, skipped or failure) replaces the
    previous entries of its system and configuration in all three lists.
    """
    previous = previous or {}
    measured = {entry_key(e) for e in results.rows + results.skipped + results.failures}
    earlier = {name: [e for e in previous.get(name, []) if entry_key(e) not in measured]
               for name in ("rows", "skipped", "failures")}
    return {
        **meta,
        "runs": previous.get("runs", []) + meta["runs"],
        "rows": earlier["rows"] + results.rows,
        "skipped": earlier["skipped"] + results.skipped,
        "failures": earlier["failures"] + results.failures,
        "memory": merge(previous.get("memory", []), results.memory),
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` through a temporary file, so a crash leaves the old file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    tmp.replace(path)


def format_table(configs: Sequence[Config], systems: Sequence[str], results: Results) -> str:
    """Per configuration: each system's ms, TFLOP/s and error, and flashcupy's speed ratio to it
    (its TFLOP/s over the system's: the system's median ms over flashcupy's)."""
    by_key = {entry_key(e): e for e in results.rows}
    notes = {entry_key(e): f"skipped: {e['reason']}" for e in results.skipped}
    notes.update({entry_key(e): f"FAILED: {e['error']}" for e in results.failures})
    lines = []
    for config in configs:
        ours = by_key.get(entry_key(record("flashcupy", config)))
        lines.append(f"\n{config.label}  ({config.flops / 1e9:.1f} GFLOP)")
        lines.append(f"  {'system':<15} {'ms':>9} {'ms_min':>9} {'TFLOP/s':>8} {'rel_err':>8}  flashcupy/x")
        for system in systems:
            key = entry_key(record(system, config))
            row = by_key.get(key)
            if row is None:
                lines.append(f"  {system:<15} {notes.get(key, 'not run')}")
                continue
            ratio = f"{row['ms'] / ours['ms']:.2f}x" if ours and system != "flashcupy" else ""
            lines.append(f"  {system:<15} {row['ms']:>9.3f} {row['ms_min']:>9.3f} {row['tflops']:>8.4g} "
                         f"{row['rel_error']:>8.1e}  {ratio}")
    if results.memory:
        lines.append(f"\npeak memory of one forward beyond the inputs (MiB), {MEMORY_SHAPE[0]} "
                     f"B={MEMORY_SHAPE[1]} H={MEMORY_SHAPE[2]} D={MEMORY_SHAPE[3]} non-causal")
        mem_systems = [s for s in MEMORY_SYSTEMS if any(e["system"] == s for e in results.memory)]
        lines.append(f"  {'L':>6} " + " ".join(f"{s:>15}" for s in mem_systems))
        cell = {(e["system"], e["L"]): f"{e['peak_mib']:.1f}" if "peak_mib" in e else "failed" for e in results.memory}
        for L in sorted({e["L"] for e in results.memory}):
            cells = (f"{cell.get((s, L), '-'):>15}" for s in mem_systems)
            lines.append(f"  {L:>6} " + " ".join(cells))
    return "\n".join(lines)


def print_plan(configs: Sequence[Config], mem_configs: Sequence[Config], args: argparse.Namespace) -> None:
    """The --dry-run report: what a real run would measure."""
    print(f"systems: {' '.join(args.systems)}")
    print(f"repeats {args.repeats}, warm-up {args.warmup}, seed {args.seed}")
    print(f"{'config':<58} {'GFLOP':>9} {'inputs MiB':>10} {'sets':>4} {'naive scores GiB':>16}")
    for c in configs:
        print(f"{c.label:<58} {c.flops / 1e9:>9.1f} {c.input_bytes / 2**20:>10.1f} {c.input_sets:>4} "
              f"{c.score_bytes / 2**30:>16.2f}")
    for c in mem_configs:
        print(f"memory sweep: {c.label}")
    out = args.out or RESULTS_DIR / f"<gpu>-{datetime.date.today().isoformat()}.json"
    print(f"output: {out}{' (appended to)' if args.append else ''}; no GPU work in a dry run, nothing written")


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configs = build_configs(args.dtypes, args.head_dims, args.lengths, args.causal, args.modes,
                            args.tokens, args.hidden)
    mem_systems = [s for s in args.systems if s in MEMORY_SYSTEMS]
    mem_configs = memory_configs(args.memory_lengths) if args.memory and mem_systems else []
    if args.dry_run:
        print_plan(configs, mem_configs, args)
        return 0

    try:
        import cupy
        import torch

        import flashcupy
    except ImportError as exc:
        print(f"{first_line(exc)}: this benchmark needs torch, cupy and flashcupy (PYTHONPATH=. from the "
              "repository root); --dry-run needs none of them", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("no CUDA GPU visible to torch: this benchmark needs one (--dry-run does not)", file=sys.stderr)
        return 1
    torch.set_float32_matmul_precision("highest")  # float32 references and baselines without TF32
    cupy.cuda.Device(torch.cuda.current_device()).use()
    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    out_path = args.out or default_out_path(gpu, date)
    previous = None
    if args.append and out_path.exists():
        previous = json.loads(out_path.read_text())
        if previous.get("gpu") != gpu:
            print(f"--append: {out_path} holds results of {previous.get('gpu')!r}, not {gpu!r}", file=sys.stderr)
            return 1
    meta = {
        "gpu": gpu,
        "date": previous["date"] if previous else date,
        "cupy": cupy.__version__,
        "torch": torch.__version__,
        "flashcupy": flashcupy.__version__,
        "python": platform.python_version(),
        "runs": [{"date": date, "argv": sys.argv[1:] if argv is None else list(argv),
                  "repeats": args.repeats, "warmup": args.warmup}],
    }
    results = Results([], [], [], [])
    bar = progress(len(configs) * len(args.systems) + len(mem_configs) * len(mem_systems))
    with torch_stream_for_cupy():
        for config in configs:
            bench_config(config, args.systems, args, results, bar)
            write_json(out_path, build_document(meta, results, previous))
        bench_memory(mem_configs, mem_systems, args, results, bar)
    bar.close()
    write_json(out_path, build_document(meta, results, previous))
    print(f"{gpu}, cupy {cupy.__version__}, torch {torch.__version__}, flashcupy {flashcupy.__version__}")
    print(format_table(configs, args.systems, results))
    print(f"\nwrote {out_path}")
    return 1 if results.failures else 0


if __name__ == "__main__":
    sys.exit(main())
