"""flashcupy's CUDA forward and backward beside PyTorch SDPA's backends and naive CuPy attention, on one GPU.

    PYTHONPATH=. python bench/bench_attention.py [options]       # from the repository root
    PYTHONPATH=. python bench/bench_attention.py --quick         # L = 1024 only, 5 repeats
    python bench/bench_attention.py --dry-run                    # print the plan: no GPU, torch or CuPy
    python bench/plot.py bench/results/<gpu>-<yyyy-mm-dd>.json   # the PNG beside the JSON

Grid (docs/architecture.md#benchmarks): for each dtype, head dim D, length L, causal flag
and mode (``--modes``, default fwd and bwd), B = tokens // L (at least 1) and
H = hidden // D, q, k, v (and for bwd the output gradient dout) of shape
(B, H, L, D) drawn by torch.randn on the GPU. flashcupy reads the same memory
through zero-copy CuPy views (cupy.from_dlpack) and runs on torch's current
stream. Systems: flashcupy (backend="cuda"), torch SDPA restricted to one
backend each (sdpa-flash, sdpa-cudnn, sdpa-efficient, sdpa-math; Lq == Lk, so
SDPA's top-left causal mask equals flashcupy's bottom-right one) and cupy-naive
(scores in the input dtype, softmax in float32, or float64 for float64).

What a timed call is, per mode:

- fwd: the forward alone, out = attention(q, k, v): flashcupy.flash_attention,
  torch.nn.functional.scaled_dot_product_attention on inputs that do not
  require grad, naive_attention.
- bwd: the backward alone, (dq, dk, dv) from q, k, v, dout and what the
  forward left. The forward runs once per input set before the timed calls
  and is not timed: flashcupy.flash_attention_forward gives out and lse, and
  each call is flashcupy.flash_attention_backward(dout, q, k, v, out, lse);
  SDPA runs on leaves that require grad and each call is
  torch.autograd.grad(out, (q, k, v), dout, retain_graph=True); cupy-naive
  keeps the forward's (B, H, L, L) probabilities P and each call is
  naive_attention_backward (dV = P^T dout, dS = P * (dout V^T - rowsum(dout *
  out)), dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D)).

Correctness before timing: each system's results (fwd: out; bwd: dq, dk and
dv) are compared with a reference computed by torch in float32 (float64 for
float64 inputs) from the same inputs (and dout): plain attention in chunks of
query rows and heads, the gradients by torch.autograd.grad through each chunk.
The reference covers every (b, h) head where that costs at most
REFERENCE_FLOPS (about 5 s of float32 GEMMs on an H200), else as many evenly
spaced heads as that buys, the first and the last always among them
(Config.checked_heads; rows hold the count as checked_heads and the table
names it where it is not all). The relative Frobenius error ||x - ref|| /
||ref|| over the checked heads must stay below 2e-2 for float16/bfloat16, 1e-4
for float32 and 1e-10 for float64, for gradients as for outputs; a row's
rel_error is the largest of its results'. flashcupy must also pass the tests'
tolerance rule (docs/semantics.md#accuracy, flashcupy.testing): max |ours - ref| <= 2
x the error of plain attention in the input dtype + a rounding floor, against
the float64 reference. Both references are dense and computed on the host, so
at L = 16k they are affordable on a few rows only: the rule checks the result
that depends on each query row alone (fwd: out; bwd: dq), on Config.rule_rows
(up to RULE_MAX_ROWS rows, as many as RULE_MACS multiply-adds buy, evenly
spaced, first and last included) of Config.rule_heads (the first and the last
checked head); those rows' problem gives those rows exactly. dk and dv sum
over every row and keep the relative check alone, as do the baselines, which
are measured here, not certified. A system that fails a check, or
flashcupy raising, goes to "failures" and is not timed; a baseline that
raises (unsupported dtype, head dim, out of memory) goes to "skipped" with the
first line of its exception, as does cupy-naive when its (B, H, L, L) arrays
(one score tensor for fwd, three for bwd) would take more than a quarter of
the free GPU memory.

Timing: CUDA events on torch's current stream around each call, ``--warmup``
calls first, then ``--repeats`` calls timed one by one; the row holds the
median (ms) and the minimum (ms_min). Where the tensors a call reads (q, k, v;
for bwd also out and dout) are under 64 MiB in all, two input sets are drawn
and the calls alternate between them, so that no call finds its inputs in L2
from the call before. TFLOP/s count FlashAttention's FLOPs: 4 * B * H * L * L
* D for the forward, halved when causal, and 2.5 times that for the backward.

Peak memory (``--memory``): non-causal float16 at B=1, H=16, D=64 for each L in
``--memory-lengths`` and each mode in ``--memory-modes``: for fwd one forward,
for bwd one forward followed by its backward (the SDPA graph, out and lse, the
gradients and every temporary of both passes: what a training step holds), all
systems alike, after one untimed warm-up of the same. For torch:
torch.cuda.max_memory_allocated() during the measured span minus
memory_allocated() before it (torch's caching allocator, reset_peak_memory_stats
first). For flashcupy: the span runs with a fresh cupy.cuda.MemoryPool as
CuPy's allocator; a pool gives nothing back to the device until told to, so
its total_bytes() afterwards is the high-water mark of what the span
allocated. Both count outputs and temporaries but not the inputs (q, k, v,
dout), in the allocators' 512-byte blocks. A system that raises (sdpa-math out
of memory at long L, say) gets the first line of the exception as its reason.

Overhead (``--overhead``, both modes whatever ``--modes`` says), on the tiny
shape float16 B=1 H=1 L=128 D=64, non-causal, as wall time (time.perf_counter,
the stream synchronized before the clock stops):

- flashcupy's first call, in a fresh Python subprocess whose CUPY_CACHE_DIR is
  a new empty folder: the first flash_attention_forward, then the first
  flash_attention_backward (flashcupy's lazy imports, kernel selection,
  NVRTC compilation of the kernels they launch, module load and the launch
  itself; the inputs, and the CuPy kernels that draw them, are ready before
  the clock starts);
- the same in a second fresh subprocess reusing that folder: the first call
  with a warm disk cache (a cache load instead of a compile);
- per-call overhead of every selected system: after OVERHEAD_WARMUP calls,
  the median of OVERHEAD_REPEATS calls each followed by a synchronize of
  torch's current stream (flashcupy on CuPy views, SDPA on torch tensors;
  bwd calls are the backward alone, as above).

Results go to ``--out`` (default bench/results/<gpu>-<yyyy-mm-dd>.json, the
GPU's name lowercased with spaces as '-'), rewritten after every
configuration: top-level gpu, date, cupy, torch, flashcupy, python, runs (the
command lines that produced the file), rows {system, dtype, B, H, L, D,
causal, mode, ms, ms_min, tflops, rel_error, checked_heads}, skipped (the
same keys but reason), failures (error, and rel_error where the check
failed), memory (peak_bytes and peak_mib, or reason; mode fwd or bwd as
above) and overhead (the configuration's keys, what, and ms or reason).
``--append`` merges into an existing file of the same GPU, new entries
replacing old ones of the same system and configuration (and what, for
overhead). Tables close the run: per mode, each configuration's TFLOP/s and
flashcupy's speed ratio to each baseline; peak memory per mode; overhead. The
exit status is 1 when anything is in failures. Progress goes to stderr: a tqdm
bar on a terminal, else one line per step.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
#: A prepared timed call: returns the results the correctness check compares (see OUTPUTS).
Call = Callable[[], tuple[Any, ...]]

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
#: What a timed call of each mode returns, in order: what the correctness check compares.
OUTPUTS = {"fwd": ("out",), "bwd": ("dq", "dk", "dv")}
#: How the tables name each mode.
MODE_TITLES = {"fwd": "forward: out from q, k, v",
               "bwd": "backward: dq, dk, dv from q, k, v, out, dout (FLOPs 2.5x the forward's)"}
#: What the peak-memory sweep measures, per mode.
MEMORY_SPANS = {"fwd": "one forward", "bwd": "one forward and its backward"}
#: FLOPs of a mode as a multiple of the forward's (FlashAttention's count).
MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5}
#: (B, H, L, D) tensors a timed call reads, per mode: q, k, v; for bwd also out and dout.
MODE_TENSORS = {"fwd": 3, "bwd": 5}
#: Largest relative Frobenius error against the reference that passes, per dtype (outputs and gradients).
TOLERANCE = {"float16": 2e-2, "bfloat16": 2e-2, "float32": 1e-4, "float64": 1e-10}
ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
#: Inputs smaller than this (what a call reads, together) are drawn twice and alternated.
ROTATE_BELOW_BYTES = 64 * 2**20
#: cupy-naive runs only while its (B, H, L, L) arrays fit in this fraction of the free GPU memory.
NAIVE_MEMORY_FRACTION = 0.25
#: cupy-naive's (B, H, L, L) arrays alive at once, in score tensors (softmax dtype), per mode:
#: the forward's scores; the backward's saved P, dS and the input-dtype casts of P and dS.
NAIVE_SCORE_COPIES = {"fwd": 1, "bwd": 3}
#: Score elements per chunk of the reference computation (1 GiB in float32).
REFERENCE_CHUNK_ELEMENTS = 2**28
#: FLOPs the reference may spend on one configuration, about 5 s at an H200's float32 GEMM rate
#: (51 TFLOP/s); where all heads would cost more, only some are checked (checked_heads).
REFERENCE_FLOPS = 2.5e11
#: Heads checked at the least (the first and the last), whatever they cost.
REFERENCE_MIN_HEADS = 2
#: The reference's FLOPs per head in units of 4 * L * L * D, per mode: fwd's two products
#: (q k^T and P v), and for bwd also autograd's four (dv, dP, dq and dk).
REFERENCE_FLOP_FACTOR = {"fwd": 1, "bwd": 3}
#: flashcupy's tolerance-rule check (rule_check): query rows per head at most, and the host
#: multiply-adds of one pass of its reference over them (rows * 2 heads * L * D) at most.
RULE_MAX_ROWS = 64
RULE_MACS = 2**26
#: The result of each mode whose rows the tolerance rule checks: the one that depends on each
#: query row alone (dk and dv sum over every row and keep the relative check only).
RULE_OUTPUT = {"fwd": "out", "bwd": "dq"}
#: Shape of the peak-memory sweep: (dtype, B, H, D), non-causal.
MEMORY_SHAPE = ("float16", 1, 16, 64)
#: Shape of the overhead measurements: (dtype, B, H, L, D), non-causal.
OVERHEAD_SHAPE = ("float16", 1, 1, 128, 64)
#: Untimed, then timed calls per system and mode of the per-call overhead.
OVERHEAD_WARMUP, OVERHEAD_REPEATS = 20, 200
#: The overhead entries' ``what``.
FIRST_CALL_COLD = "first call, empty kernel cache"
FIRST_CALL_WARM = "first call, warm disk cache"
CACHED_CALL = f"cached call, median of {OVERHEAD_REPEATS}"
#: Seconds a first-call subprocess may take (NVRTC compiles several kernels on a cold cache).
FIRST_CALL_TIMEOUT_S = 900
#: The source location torch appends to the warnings of its C++ code.
TORCH_SOURCE_NOTE = re.compile(r"\s*\(Triggered internally at [^)]*\)")
BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"


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
        """Bytes of the (B, H, L, D) tensors a timed call reads: q, k, v; for bwd also out and dout."""
        return MODE_TENSORS[self.mode] * self.B * self.H * self.L * self.D * ITEMSIZE[self.dtype]

    @property
    def input_sets(self) -> int:
        """How many input sets the timed calls alternate between."""
        return 2 if self.input_bytes < ROTATE_BELOW_BYTES else 1

    @property
    def naive_bytes(self) -> int:
        """Bytes of cupy-naive's (B, H, L, L) arrays alive at once (NAIVE_SCORE_COPIES score tensors
        in its softmax dtype)."""
        itemsize = 8 if self.dtype == "float64" else 4
        return NAIVE_SCORE_COPIES[self.mode] * self.B * self.H * self.L * self.L * itemsize

    @property
    def checked_heads(self) -> list[int]:
        """The heads, as indices b * H + h, whose results the correctness check compares: all B * H
        where the reference costs at most REFERENCE_FLOPS, else as many as that buys (at least
        REFERENCE_MIN_HEADS), evenly spaced, the first and the last included."""
        heads = self.B * self.H
        per_head = 4.0 * self.L * self.L * self.D * REFERENCE_FLOP_FACTOR[self.mode]
        n = min(heads, max(REFERENCE_MIN_HEADS, int(REFERENCE_FLOPS // per_head)))
        return sorted({round(i * (heads - 1) / (n - 1)) for i in range(n)}) if n > 1 else [0]

    @property
    def rule_heads(self) -> list[int]:
        """The heads (indices b * H + h) of flashcupy's tolerance-rule check: the first and the
        last of checked_heads."""
        return sorted({self.checked_heads[0], self.checked_heads[-1]})

    @property
    def rule_rows(self) -> list[int]:
        """The query rows of flashcupy's tolerance-rule check in each of rule_heads: as many as
        RULE_MACS buys (2 to RULE_MAX_ROWS), evenly spaced, the first and the last included."""
        n = min(self.L, RULE_MAX_ROWS, max(2, RULE_MACS // (2 * self.L * self.D)))
        return sorted({round(i * (self.L - 1) / (n - 1)) for i in range(n)}) if n > 1 else [0]

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


def memory_configs(lengths: Sequence[int], modes: Sequence[str]) -> list[Config]:
    """The peak-memory sweep's shapes, length-major."""
    dtype, B, H, D = MEMORY_SHAPE
    return [Config(dtype, B, H, L, D, False, mode) for L in lengths for mode in modes]


def overhead_config(mode: str) -> Config:
    """The tiny shape of the overhead measurements."""
    dtype, B, H, L, D = OVERHEAD_SHAPE
    return Config(dtype, B, H, L, D, False, mode)


def record(system: str, config: Config, **fields: Any) -> dict[str, Any]:
    """A JSON entry: the system, the configuration's fields (flops excluded), then ``fields``."""
    return {"system": system, **asdict(config), **fields}


def entry_key(entry: dict[str, Any]) -> tuple:
    """What identifies a row, skip, failure, memory or overhead entry: its system and
    configuration, and its ``what`` (None in all but overhead entries)."""
    return tuple(entry.get(f) for f in ("system", "dtype", "B", "H", "L", "D", "causal", "mode", "what"))


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3' (other odd characters become '-' too)."""
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-")


def git_commit(path: Path = BENCH_DIR) -> str:
    """The short commit of the checkout holding ``path``, or 'unknown' (a copy without git
    history: pass the benchmarks' --commit there)."""
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def add_run_arguments(parser: argparse.ArgumentParser, suite: str) -> None:
    """The arguments every suite script shares: --commit, --out and --dry-run."""
    parser.add_argument("--commit", help="the measured commit, where git history did not travel with the tree")
    parser.add_argument("--out", type=Path, help=f"JSON path (default bench/results/<gpu>-<date>-{suite}.json)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")


def suite_document(suite: str, args: argparse.Namespace, argv: Sequence[str] | None) -> tuple[Path, dict[str, Any]]:
    """For a suite script, on the GPU torch uses (CuPy set to it, float32 products in full
    precision): the JSON path (``args.out``, else bench/results/<gpu>-<date>-<suite>.json) and
    the run's document, its header filled and no rows, skipped entries or failures yet."""
    import cupy
    import torch

    torch.set_float32_matmul_precision("highest")
    cupy.cuda.Device(torch.cuda.current_device()).use()
    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    out = args.out or RESULTS_DIR / f"{gpu_slug(gpu)}-{date}-{suite}.json"
    doc = {"gpu": gpu, "date": date, "commit": args.commit or git_commit(), "cupy": cupy.__version__,
           "torch": torch.__version__, "suite": suite, "argv": sys.argv[1:] if argv is None else list(argv),
           "rows": [], "skipped": [], "failures": []}
    return out, doc


def default_out_path(gpu: str, date: str) -> Path:
    """bench/results/<gpu slug>-<date>.json."""
    return RESULTS_DIR / f"{gpu_slug(gpu)}-{date}.json"


def first_line(exc: BaseException) -> str:
    """'ExceptionType: first line of its message'."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def warning_note(caught: Sequence[warnings.WarningMessage]) -> str:
    """' (first lines of the distinct warnings)', or ''; SDPA explains in warnings why a backend
    cannot run, then raises a bare 'No available kernel'. torch's '(Triggered internally at
    <source>:<line>.)' suffixes are dropped."""
    firsts = (str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip())
    lines = dict.fromkeys(TORCH_SOURCE_NOTE.sub("", line) for line in firsts)
    return f" ({'; '.join(line for line in lines if line)})" if any(lines) else ""


def attempt(call: Callable[[], T]) -> tuple[T | None, str | None]:
    """``call()`` with warnings recorded: (its result, None), or (None, the first line of what it
    raised and of the warnings issued before). The exception and its frames are gone on return,
    so whatever memory they held can be released."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return call(), None
        except Exception as exc:  # noqa: BLE001  (any error of one system is that system's result)
            return None, first_line(exc) + warning_note(caught)


# --------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float16", "bfloat16"])
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], metavar="D")
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096], metavar="L")
    parser.add_argument("--causal", nargs="+", choices=["false", "true"], default=["false", "true"])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="fwd times the forward, bwd the backward alone (default both)")
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
                        help="also measure peak device memory (B=1, H=16, D=64, float16, non-causal)")
    parser.add_argument("--memory-lengths", nargs="+", type=int, default=[1024, 4096, 16384, 32768, 65536],
                        metavar="L")
    parser.add_argument("--memory-modes", nargs="+", choices=MODES, default=list(MODES),
                        help="fwd: one forward; bwd: one forward and its backward (default both)")
    parser.add_argument("--overhead", action="store_true",
                        help="also measure flashcupy's first-call compile time (empty and warm kernel cache) "
                             "and every system's per-call wall time on a tiny shape, fwd and bwd")
    parser.add_argument("--seed", type=int, default=0, help="torch seed of the inputs")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit: no GPU work, no output")
    args = parser.parse_args(argv)

    if args.quick:
        args.lengths, args.repeats = [1024], 5
    for name in ("head_dims", "lengths", "memory_lengths"):
        if any(n < 1 for n in getattr(args, name)):
            parser.error(f"--{name.replace('_', '-')}: expected positive integers")
    if args.tokens < 1 or args.hidden < 1 or args.repeats < 1 or args.warmup < 0:
        parser.error("--tokens, --hidden and --repeats must be >= 1 and --warmup >= 0")
    args.causal = [c == "true" for c in dict.fromkeys(args.causal)]
    args.systems = [s for s in SYSTEMS if s in args.systems]
    args.modes = [m for m in MODES if m in args.modes]
    args.memory_modes = [m for m in MODES if m in args.memory_modes]
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


def naive_probabilities(q: Any, k: Any, causal: bool, xp: Any) -> Any:
    """softmax(q k^T / sqrt(D)) with the whole score tensor in memory, in array module ``xp``.

    The product runs in the input dtype, the softmax in float32 (float64 for
    float64 inputs), which is the result's dtype. causal keeps j <= i (Lq == Lk here).
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
    return s


def naive_attention(q: Any, k: Any, v: Any, causal: bool, xp: Any) -> Any:
    """softmax(q k^T / sqrt(D)) v: naive_probabilities, cast back to the input dtype for the product with v."""
    return xp.matmul(naive_probabilities(q, k, causal, xp).astype(q.dtype, copy=False), v)


def naive_attention_backward(q: Any, k: Any, v: Any, p: Any, out: Any, dout: Any, xp: Any) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of naive_attention from its probabilities ``p`` (naive_probabilities) and output.

    dV = P^T dout; dS = P * (dout V^T - rowsum(dout * out)) / sqrt(D) in p's
    dtype (rowsum(dout * out) equals rowsum(P * dout V^T), as in FlashAttention);
    dQ = dS K and dK = dS^T Q. The products run in the input dtype.
    """
    soft = p.dtype
    dv = xp.matmul(xp.swapaxes(p.astype(q.dtype, copy=False), -1, -2), dout)
    ds = xp.matmul(dout, xp.swapaxes(v, -1, -2)).astype(soft, copy=False)
    ds -= (dout.astype(soft) * out.astype(soft)).sum(axis=-1, keepdims=True)
    ds *= p
    ds *= 1.0 / math.sqrt(q.shape[-1])
    ds = ds.astype(q.dtype, copy=False)
    return xp.matmul(ds, k), xp.matmul(xp.swapaxes(ds, -1, -2), q), dv


def pick_heads(x: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """The heads ``heads`` (indices b * H + h) of a (B, H, L, D) tensor, as an (n, L, D) copy."""
    return x.reshape(-1, *x.shape[-2:])[heads]


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        dout: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Plain attention in torch over (N, L, D) heads, float32 (float64 for float64 inputs):
    ``(out,)``, or with ``dout`` the gradients ``(dq, dk, dv)`` of <out, dout>, by torch.autograd.grad.

    It runs in chunks of at most REFERENCE_CHUNK_ELEMENTS scores (query rows of
    a few heads): softmax is row-wise, so each chunk's autograd gives its rows
    of dq exactly and a share of dk and dv, which the chunks sum. causal keeps
    j <= i (Lq == Lk here).
    """
    import torch

    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    grad = dout is not None
    N, L, D = q.shape
    # out, or dq then the sums dk and dv
    results = [torch.empty(q.shape, dtype=acc, device=q.device)]
    results += [torch.zeros(q.shape, dtype=acc, device=q.device) for _ in range(2 if grad else 0)]
    rows = max(1, min(L, REFERENCE_CHUNK_ELEMENTS // L))
    heads = max(1, REFERENCE_CHUNK_ELEMENTS // (rows * L))
    cols = torch.arange(L, device=q.device)
    with torch.set_grad_enabled(grad):
        for h0 in range(0, N, heads):
            h = slice(h0, h0 + heads)
            kh, vh = (x[h].to(acc).detach().requires_grad_(grad) for x in (k, v))
            for i0 in range(0, L, rows):
                i = slice(i0, i0 + rows)
                qi = q[h, i].to(acc).detach().requires_grad_(grad)
                s = qi @ kh.transpose(-1, -2)
                s *= D ** -0.5  # in place (the product's backward needs its inputs only), as the mask
                if causal:
                    r = torch.arange(i0, i0 + s.shape[-2], device=q.device)
                    s.masked_fill_(cols[None, :] > r[:, None], -math.inf)
                out = torch.softmax(s, dim=-1) @ vh
                if not grad:
                    results[0][h, i] = out
                    continue
                dq, dk, dv = torch.autograd.grad(out, (qi, kh, vh), dout[h, i].to(acc))
                results[0][h, i] = dq
                results[1][h] += dk
                results[2][h] += dv
    return tuple(results)


def host_array(x: Any, dtype: str) -> np.ndarray:
    """A torch tensor's or CuPy array's values as a NumPy array of ``dtype`` (float16 and
    bfloat16 pass through float32, which holds them exactly)."""
    import torch

    from flashcupy import testing

    wide = as_torch(x).to(torch.float64 if dtype == "float64" else torch.float32)
    return wide.detach().cpu().numpy().astype(testing.DTYPES[dtype])


def rule_check(config: Config, x: Inputs, results: Sequence[Any]) -> str:
    """'' when flashcupy's ``results`` (of inputs ``x``) pass the tolerance rule of docs/semantics.md#accuracy
    section 4 on config.rule_rows of config.rule_heads (rule_failure), else what fails."""
    import torch

    heads = torch.tensor(config.rule_heads, device="cuda")
    rows = config.rule_rows

    def host(t: Any, only_rows: bool) -> np.ndarray:
        picked = pick_heads(as_torch(t), heads)
        return host_array(picked[:, rows] if only_rows else picked, config.dtype)

    ours = results[OUTPUTS[config.mode].index(RULE_OUTPUT[config.mode])]
    dout = None if x.do is None else host(x.do, True)
    return rule_failure(config, host(x.q, True), host(x.k, False), host(x.v, False), dout, host(ours, True))


def rule_failure(config: Config, q: np.ndarray, k: np.ndarray, v: np.ndarray, dout: np.ndarray | None,
                 ours: np.ndarray) -> str:
    """'' when ``ours`` (RULE_OUTPUT of the mode, on the rows config.rule_rows of the heads
    config.rule_heads) passes the tolerance rule (flashcupy.testing: float64 reference and
    plain attention in the input dtype, on the host), else what fails. q and dout hold those
    rows, (heads, rows, D); k and v every key, (heads, L, D). The result checked depends on
    each query row alone, so the rows' problem gives it exactly; the causal mask is written
    out (Lq == Lk here)."""
    from flashcupy import testing

    rows = config.rule_rows
    options = {"mask": np.arange(config.L) <= np.array(rows)[:, None]} if config.causal else {}
    name = RULE_OUTPUT[config.mode]
    ref, naive = testing.reference_results(q, k, v, options, dout)
    magnitude = testing.cancelling_terms(q, k, dout, ref["out"])["dq"] if name == "dq" else 0.0
    result = testing.compare(ours, ref[name], naive[name], q.dtype, magnitude, name=name,
                             axes=("head", "row", "column"))
    if result.ok:
        return ""
    return (f"tolerance rule: {result.message} (indices into heads {config.rule_heads} and the "
            f"{len(rows)} evenly spaced rows {rows[0]}..{rows[-1]})")


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
    """One input set: torch tensors and zero-copy CuPy views of the same memory; the output
    gradient (do, doc) only for bwd."""

    q: Any
    k: Any
    v: Any
    qc: Any
    kc: Any
    vc: Any
    do: Any = None
    doc: Any = None


def make_inputs(config: Config, seed: int, sets: int) -> list[Inputs]:
    """``sets`` sets of randn q, k, v (then dout, for bwd) on the current CUDA device, set s
    drawn with seed + s."""
    import cupy
    import torch

    dtype = getattr(torch, config.dtype)
    shape = (config.B, config.H, config.L, config.D)
    count = 4 if config.mode == "bwd" else 3
    inputs = []
    for s in range(sets):
        gen = torch.Generator(device="cuda").manual_seed(seed + s)
        tensors = [torch.randn(shape, dtype=dtype, device="cuda", generator=gen) for _ in range(count)]
        views = [cupy.from_dlpack(x) for x in tensors]
        inputs.append(Inputs(*tensors[:3], *views[:3], *tensors[3:], *views[3:]))
    return inputs


def runner(system: str, mode: str) -> Callable[[Inputs, bool], Call]:
    """``prepare(inputs, causal)`` of ``system``, which returns the call to time: for fwd the
    forward, returning (out,); for bwd the forward runs in ``prepare`` (untimed) and the call
    is the backward, returning (dq, dk, dv). See the module docstring for each system's calls."""
    if system == "flashcupy":
        return _flashcupy_runner(mode)
    if system == "cupy-naive":
        return _naive_runner(mode)
    return _sdpa_runner(system, mode)


def _flashcupy_runner(mode: str) -> Callable[[Inputs, bool], Call]:
    import flashcupy

    def prepare(x: Inputs, causal: bool) -> Call:
        if mode == "fwd":
            return lambda: (flashcupy.flash_attention(x.qc, x.kc, x.vc, causal=causal, backend="cuda"),)
        out, lse = flashcupy.flash_attention_forward(x.qc, x.kc, x.vc, causal=causal, backend="cuda")
        return lambda: flashcupy.flash_attention_backward(x.doc, x.qc, x.kc, x.vc, out, lse, causal=causal,
                                                          backend="cuda")

    return prepare


def _naive_runner(mode: str) -> Callable[[Inputs, bool], Call]:
    import cupy

    def prepare(x: Inputs, causal: bool) -> Call:
        if mode == "fwd":
            return lambda: (naive_attention(x.qc, x.kc, x.vc, causal, cupy),)
        p = naive_probabilities(x.qc, x.kc, causal, cupy)
        out = cupy.matmul(p.astype(x.qc.dtype, copy=False), x.vc)
        return lambda: naive_attention_backward(x.qc, x.kc, x.vc, p, out, x.doc, cupy)

    return prepare


def _sdpa_runner(system: str, mode: str) -> Callable[[Inputs, bool], Call]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[system])
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        with sdpa_kernel(backend):
            return sdpa(q, k, v, is_causal=causal)

    def prepare(x: Inputs, causal: bool) -> Call:
        if mode == "fwd":
            return lambda: (forward(x.q, x.k, x.v, causal),)
        leaves = tuple(t.detach().requires_grad_() for t in (x.q, x.k, x.v))
        out = forward(*leaves, causal)
        return lambda: torch.autograd.grad(out, leaves, x.do, retain_graph=True)

    return prepare


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


def wall_ms(call: Callable[[], T], synchronize: Callable[[], Any]) -> tuple[float, T]:
    """(wall-clock milliseconds of ``call()`` followed by ``synchronize()``, what the call returned)."""
    start = time.perf_counter()
    result = call()
    synchronize()
    return (time.perf_counter() - start) * 1e3, result


@dataclass
class Results:
    """What one run produced, in JSON-ready entries."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    memory: list[dict[str, Any]] = field(default_factory=list)
    overhead: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Measurement:
    """One system's check and timing: the worst relative error, of which result, the
    milliseconds of the timed calls (None when a check failed, so none ran) and, for
    flashcupy, what fails the tolerance rule ('' when nothing does)."""

    rel_error: float
    output: str
    times: list[float] | None
    rule: str = ""


def check_and_time(system: str, config: Config, inputs: Sequence[Inputs], heads: torch.Tensor,
                   ref: Sequence[torch.Tensor], args: argparse.Namespace) -> Measurement:
    """Prepare ``system``'s call on every input set, compare the ``heads`` of the first set's
    results with ``ref`` (and flashcupy's with the tolerance rule: rule_check), and time the
    calls when they pass. What the calls hold (for bwd the forward's results and graph) is
    dropped on return."""
    prepare = runner(system, config.mode)
    calls = [prepare(x, config.causal) for x in inputs]
    results = calls[0]()
    errors = [relative_error(pick_heads(as_torch(got), heads), want) for got, want in zip(results, ref, strict=True)]
    err, name = max(zip(errors, OUTPUTS[config.mode]), key=lambda e: (math.isnan(e[0]), e[0]))
    if not err < TOLERANCE[config.dtype]:
        return Measurement(err, name, None)
    rule = rule_check(config, inputs[0], results) if system == "flashcupy" else ""
    del results
    if rule:
        return Measurement(err, name, None, rule)
    return Measurement(err, name, time_calls(calls, args.warmup, args.repeats))


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
    x = inputs[0]
    heads = torch.tensor(config.checked_heads, device="cuda")
    tensors = [pick_heads(t, heads) for t in (x.q, x.k, x.v, x.do) if t is not None]
    ref, error = attempt(functools.partial(reference_attention, *tensors[:3], config.causal, *tensors[3:]))
    del tensors  # the picked inputs' copies
    if ref is None:  # out of memory, most likely: nothing can be checked
        for system in systems:
            bar.step(f"{config.label} {system}")
            skip(system, f"reference failed: {error}")
        return
    tolerance = TOLERANCE[config.dtype]
    for system in systems:
        bar.step(f"{config.label} {system}")
        if system == "cupy-naive":
            release_memory()
            free = torch.cuda.mem_get_info()[0]
            if config.naive_bytes > NAIVE_MEMORY_FRACTION * free:
                skip(system, f"its (B, H, L, L) arrays ({config.naive_bytes / 2**30:.1f} GiB) exceed "
                             f"{NAIVE_MEMORY_FRACTION:.0%} of the free GPU memory ({free / 2**30:.1f} GiB)")
                continue
        measured, error = attempt(functools.partial(check_and_time, system, config, inputs, heads, ref, args))
        release_memory()
        if measured is None:
            (fail if system == "flashcupy" else skip)(system, error)
            continue
        err = measured.rel_error
        if measured.times is None:
            fail(system, measured.rule or f"relative error of {measured.output} {err:.3g} exceeds {tolerance:g}",
                 rel_error=float(f"{err:.3g}") if math.isfinite(err) else None)
            continue
        ms = statistics.median(measured.times)
        results.rows.append(record(system, config, ms=float(f"{ms:.5g}"), ms_min=float(f"{min(measured.times):.5g}"),
                                   tflops=float(f"{config.flops / (ms * 1e-3) / 1e12:.4g}"),
                                   rel_error=float(f"{err:.3g}"), checked_heads=len(config.checked_heads)))


def peak_memory(system: str, config: Config, x: Inputs) -> int:
    """Peak device bytes beyond the inputs of one forward of ``system`` (mode fwd), or of one
    forward and its backward (bwd), measured as the module docstring says."""
    import cupy
    import torch

    prepare = runner(system, config.mode)

    def span() -> tuple[Any, ...]:
        return prepare(x, config.causal)()

    span()  # warm-up: kernel compilation, library handles and workspaces
    release_memory()
    if system == "flashcupy":
        pool = cupy.cuda.MemoryPool()
        with cupy.cuda.using_allocator(pool.malloc):
            result = span()
            torch.cuda.synchronize()
            peak = pool.total_bytes()
            del result
        pool.free_all_blocks()
        return peak
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    result = span()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del result
    return peak


def bench_memory(configs: Sequence[Config], systems: Sequence[str], args: argparse.Namespace,
                 results: Results, bar: LinePrinter | TqdmBar) -> None:
    """The peak-memory sweep: one entry per system, length and mode in results.memory, with
    peak_bytes and peak_mib, or with the reason (first line of the exception) it has none."""
    for config in configs:
        release_memory()
        (x,) = make_inputs(config, args.seed, 1)
        for system in systems:
            bar.step(f"memory {config.label} {system}")
            peak, error = attempt(functools.partial(peak_memory, system, config, x))
            release_memory()
            if peak is None:  # out of memory, for the O(L^2) backends at long L
                results.memory.append(record(system, config, reason=error))
                bar.write(f"  no peak memory for {system} at {config.label}: {error}")
                continue
            results.memory.append(record(system, config, peak_bytes=peak, peak_mib=round(peak / 2**20, 1)))
        del x
        release_memory()


# --------------------------------------------------------------------------- overhead


def first_call_probe(device: int) -> None:
    """The body of run_first_call_probe's subprocess: the wall milliseconds of flashcupy's first
    forward, then of its first backward, on OVERHEAD_SHAPE on CUDA device ``device``, printed
    as one JSON object {"fwd": ms, "bwd": ms} on stdout."""
    import cupy

    import flashcupy

    cupy.cuda.Device(device).use()
    dtype, B, H, L, D = OVERHEAD_SHAPE
    gen = cupy.random.default_rng(0)
    q, k, v, dout = (gen.standard_normal((B, H, L, D), dtype=np.float32).astype(dtype) for _ in range(4))
    synchronize = cupy.cuda.get_current_stream().synchronize
    synchronize()
    fwd_ms, (out, lse) = wall_ms(lambda: flashcupy.flash_attention_forward(q, k, v, backend="cuda"), synchronize)
    bwd_ms, _ = wall_ms(lambda: flashcupy.flash_attention_backward(dout, q, k, v, out, lse, backend="cuda"),
                        synchronize)
    print(json.dumps({"fwd": fwd_ms, "bwd": bwd_ms}))


def run_first_call_probe(device: int, cache_dir: str) -> dict[str, float]:
    """first_call_probe in a fresh Python subprocess with CUPY_CACHE_DIR = ``cache_dir`` (and
    the folder holding the imported flashcupy first on PYTHONPATH); its {"fwd": ms, "bwd": ms}.
    Raises RuntimeError with the last line of its stderr when it fails."""
    import flashcupy

    root = str(Path(flashcupy.__file__).resolve().parents[1])
    env = {**os.environ, "CUPY_CACHE_DIR": cache_dir,
           "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
    env.pop("CUPY_CACHE_IN_MEMORY", None)
    code = (f"import sys; sys.path.insert(0, {str(BENCH_DIR)!r}); import bench_attention; "
            f"bench_attention.first_call_probe({device})")
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                              timeout=FIRST_CALL_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"the subprocess ran past {FIRST_CALL_TIMEOUT_S} s") from exc
    if proc.returncode:
        lines = proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}, no stderr"]
        raise RuntimeError(f"the subprocess failed: {lines[-1]}")
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError("the subprocess exited 0 but printed no result")
    return json.loads(lines[-1])


def per_call_ms(system: str, config: Config, x: Inputs) -> float:
    """Median wall milliseconds of ``system``'s call (prepared once) followed by a synchronize of
    torch's current stream, over OVERHEAD_REPEATS calls after OVERHEAD_WARMUP."""
    import torch

    call = runner(system, config.mode)(x, config.causal)
    synchronize = torch.cuda.current_stream().synchronize
    times = [wall_ms(call, synchronize)[0] for _ in range(OVERHEAD_WARMUP + OVERHEAD_REPEATS)]
    return statistics.median(times[OVERHEAD_WARMUP:])


def bench_overhead(systems: Sequence[str], args: argparse.Namespace, results: Results,
                   bar: LinePrinter | TqdmBar) -> None:
    """flashcupy's first calls with an empty, then a warm, kernel cache (when flashcupy is among
    ``systems``), and every system's per-call wall time on the tiny shape, fwd and bwd; entries
    go to results.overhead."""
    import torch

    def add(system: str, mode: str, what: str, ms: float | None, error: str | None) -> None:
        config = overhead_config(mode)
        if ms is None:
            results.overhead.append(record(system, config, what=what, reason=error))
            bar.write(f"  no {what} time for {system} at {config.label}: {error}")
        else:
            results.overhead.append(record(system, config, what=what, ms=float(f"{ms:.4g}")))

    device = torch.cuda.current_device()
    with tempfile.TemporaryDirectory(prefix="flashcupy-bench-cache-") as cache_dir:
        for what in (FIRST_CALL_COLD, FIRST_CALL_WARM) if "flashcupy" in systems else ():
            bar.step(f"overhead flashcupy {what}")
            ms, error = attempt(functools.partial(run_first_call_probe, device, cache_dir))
            for mode in MODES:
                add("flashcupy", mode, what, ms[mode] if ms else None, error)

    for mode in MODES:
        config = overhead_config(mode)
        (x,) = make_inputs(config, args.seed, 1)
        for system in systems:
            bar.step(f"overhead {config.label} {system}")
            add(system, mode, CACHED_CALL, *attempt(functools.partial(per_call_ms, system, config, x)))
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
        "overhead": merge(previous.get("overhead", []), results.overhead),
    }


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write ``document`` to ``path`` through a temporary file, so a crash leaves the old file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n")
    tmp.replace(path)


def format_speed_table(configs: Sequence[Config], systems: Sequence[str], results: Results) -> list[str]:
    """Per mode, then per configuration: each system's ms, TFLOP/s and error, and flashcupy's speed
    ratio to it (its TFLOP/s over the system's: the system's median ms over flashcupy's)."""
    by_key = {entry_key(e): e for e in results.rows}
    notes = {entry_key(e): f"skipped: {e['reason']}" for e in results.skipped}
    notes.update({entry_key(e): f"FAILED: {e['error']}" for e in results.failures})
    lines = []
    for mode in MODES:
        mode_configs = [c for c in configs if c.mode == mode]
        if mode_configs:
            lines.append(f"\n=== {MODE_TITLES[mode]}")
        for config in mode_configs:
            ours = by_key.get(entry_key(record("flashcupy", config)))
            checked = len(config.checked_heads)
            note = f", checked on {checked} of {config.B * config.H} heads" if checked < config.B * config.H else ""
            lines.append(f"\n{config.label}  ({config.flops / 1e9:.1f} GFLOP{note})")
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
    return lines


def format_memory_table(memory: Sequence[dict[str, Any]]) -> list[str]:
    """Per mode: peak MiB per length (rows) and system (columns); 'failed' where it has none."""
    lines = []
    for mode in MODES:
        entries = [e for e in memory if e["mode"] == mode]
        if not entries:
            continue
        lines.append(f"\npeak memory of {MEMORY_SPANS[mode]} beyond the inputs (MiB), {MEMORY_SHAPE[0]} "
                     f"B={MEMORY_SHAPE[1]} H={MEMORY_SHAPE[2]} D={MEMORY_SHAPE[3]} non-causal")
        mem_systems = [s for s in MEMORY_SYSTEMS if any(e["system"] == s for e in entries)]
        lines.append(f"  {'L':>6} " + " ".join(f"{s:>15}" for s in mem_systems))
        cell = {(e["system"], e["L"]): f"{e['peak_mib']:.1f}" if "peak_mib" in e else "failed" for e in entries}
        for L in sorted({e["L"] for e in entries}):
            lines.append(f"  {L:>6} " + " ".join(f"{cell.get((s, L), '-'):>15}" for s in mem_systems))
    return lines


def format_overhead_table(overhead: Sequence[dict[str, Any]]) -> list[str]:
    """Wall milliseconds per system and what (rows) and mode (columns); 'failed' where none."""
    if not overhead:
        return []
    dtype, B, H, L, D = OVERHEAD_SHAPE
    lines = [f"\noverhead: wall ms, {dtype} B={B} H={H} L={L} D={D} non-causal",
             f"  {'system':<15} {'what':<33} " + " ".join(f"{m:>10}" for m in MODES)]
    cell = {(e["system"], e["what"], e["mode"]): f"{e['ms']:.3f}" if "ms" in e else "failed" for e in overhead}
    for system, what in dict.fromkeys((e["system"], e["what"]) for e in overhead):
        lines.append(f"  {system:<15} {what:<33} " + " ".join(f"{cell.get((system, what, m), '-'):>10}" for m in MODES))
    return lines


def format_table(configs: Sequence[Config], systems: Sequence[str], results: Results) -> str:
    """The closing report: speed per mode, peak memory per mode, overhead."""
    return "\n".join(format_speed_table(configs, systems, results) + format_memory_table(results.memory)
                     + format_overhead_table(results.overhead))


def print_plan(configs: Sequence[Config], mem_configs: Sequence[Config], args: argparse.Namespace) -> None:
    """The --dry-run report: what a real run would measure."""
    print(f"systems: {' '.join(args.systems)}")
    print(f"repeats {args.repeats}, warm-up {args.warmup}, seed {args.seed}")
    print(f"{'config':<58} {'GFLOP':>9} {'inputs MiB':>10} {'sets':>4} {'naive GiB':>9} {'checked heads':>13}")
    for c in configs:
        print(f"{c.label:<58} {c.flops / 1e9:>9.1f} {c.input_bytes / 2**20:>10.1f} {c.input_sets:>4} "
              f"{c.naive_bytes / 2**30:>9.2f} {f'{len(c.checked_heads)}/{c.B * c.H}':>13}")
    for c in mem_configs:
        print(f"memory sweep: {c.label} ({MEMORY_SPANS[c.mode]})")
    if args.overhead:
        label = overhead_config("fwd").label.removesuffix(" fwd")
        if "flashcupy" in args.systems:
            print(f"overhead: flashcupy's first forward and backward call at {label} in a fresh subprocess "
                  "with an empty CUPY_CACHE_DIR, then in another reusing that cache")
        print(f"overhead: per-call wall time (median of {OVERHEAD_REPEATS} after {OVERHEAD_WARMUP}) of "
              f"{' '.join(args.systems)} at {label}, {' and '.join(MODES)}")
    out = args.out or RESULTS_DIR / f"<gpu>-{datetime.date.today().isoformat()}.json"
    print(f"output: {out}{' (appended to)' if args.append else ''}; no GPU work in a dry run, nothing written")


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configs = build_configs(args.dtypes, args.head_dims, args.lengths, args.causal, args.modes,
                            args.tokens, args.hidden)
    mem_systems = [s for s in args.systems if s in MEMORY_SYSTEMS]
    mem_configs = memory_configs(args.memory_lengths, args.memory_modes) if args.memory and mem_systems else []
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
    results = Results()
    overhead_steps = (2 * ("flashcupy" in args.systems) + len(MODES) * len(args.systems)) if args.overhead else 0
    bar = progress(len(configs) * len(args.systems) + len(mem_configs) * len(mem_systems) + overhead_steps)
    with torch_stream_for_cupy():
        for config in configs:
            bench_config(config, args.systems, args, results, bar)
            write_json(out_path, build_document(meta, results, previous))
        bench_memory(mem_configs, mem_systems, args, results, bar)
        if args.overhead:
            write_json(out_path, build_document(meta, results, previous))
            bench_overhead(args.systems, args, results, bar)
    bar.close()
    write_json(out_path, build_document(meta, results, previous))
    print(f"{gpu}, cupy {cupy.__version__}, torch {torch.__version__}, flashcupy {flashcupy.__version__}")
    print(format_table(configs, args.systems, results))
    print(f"\nwrote {out_path}")
    return 1 if results.failures else 0


if __name__ == "__main__":
    sys.exit(main())
