"""Ahead-of-time compilation of the CUDA kernels a program will use: :func:`precompile`.

Kernels are compiled lazily by NVRTC on first use (a few seconds each, then cached on
disk by CuPy). ``precompile`` compiles, in parallel threads, the kernels that calls of
the given dtypes and head dims would select on one GPU, so that the first real call
does not wait for them; the compile times are saved to a small JSON file in CuPy's
kernel cache directory (:func:`record_path`), which ``python -m flashcupy info`` reports.

Note: ``flashcupy.precompile`` is the function (exported by the package); this module
is ``sys.modules["flashcupy.precompile"]`` (``from flashcupy.precompile import ...``
works as usual).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Iterable, NamedTuple

import numpy as np

#: Name of the compile-time record inside CuPy's kernel cache directory.
RECORD_NAME = "flashcupy-precompile.json"

DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")

#: The option sets :func:`precompile` covers by default: calls with causal, window and
#: lengths only (kernels are compiled per set of the other options a call uses).
DEFAULT_OPTIONS: tuple[tuple[str, ...], ...] = ((),)


class Kernel(NamedTuple):
    """One kernel to compile: source family ('forward' or 'backward'), NVRTC name
    expression, and the dynamic shared memory it opts into."""

    family: str
    name: str
    smem_bytes: int


def cache_dir() -> Path:
    """CuPy's on-disk kernel cache: ``$CUPY_CACHE_DIR``, else ``~/.cupy/kernel_cache``."""
    return Path(os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache"))


def record_path() -> Path:
    """The JSON file holding the compile times recorded by :func:`precompile`."""
    return cache_dir() / RECORD_NAME


def load_records() -> dict[str, Any]:
    """The recorded compile times: {"<device> sm_<arch>": record}; {} when none (or unreadable)."""
    try:
        data = json.loads(record_path().read_text())
    except (OSError, ValueError):
        return {}
    records = data.get("records") if isinstance(data, dict) else None
    return records if isinstance(records, dict) else {}


def _dtype_name(dtype: Any) -> str:
    try:
        name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    except TypeError:
        name = None
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtypes: expected names among {', '.join(DTYPE_NAMES)}, received {dtype!r}")
    return name


def _score_set(names: Iterable[str], dtype: str) -> Any:
    """The kernels' score option set of calls with the options ``names`` (some of
    flashcupy.cuda.spec.SCORE_MODS; a bias of the calls' dtype)."""
    from .cuda.spec import SCORE_MODS, ScoreSet

    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = [n for n in names if n not in SCORE_MODS]
    if unknown:
        raise ValueError(f"options: expected option names among {', '.join(SCORE_MODS)}, received {unknown[0]!r}")
    return ScoreSet(tuple(m for m in SCORE_MODS if m in names), dtype if "bias" in names else None)


def _head_dim(d: Any) -> int:
    if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 1 <= int(d) <= 512:
        raise ValueError(f"head_dims: expected ints in 1..512, received {d!r}")
    return int(d)


def kernels_for(dtypes: Iterable[str], head_dims: Iterable[int], arch: int, smem_limit: int,
                backward: bool = True, allow_tf32: bool = False, skipped: list[str] | None = None,
                options: Iterable[Iterable[str]] = DEFAULT_OPTIONS) -> list[Kernel]:
    """The kernels calls with these dtypes and head dims (D = Dv) select on a GPU of compute
    capability ``arch`` with ``smem_limit`` bytes of opt-in shared memory per block, for each
    score option set of ``scores`` (see :func:`precompile`): the forward, and with ``backward``
    its three kernels, and the tile maps of sets with masks.
    ``FLASHCUPY_FORCE_PORTABLE`` is honoured as in real calls. Where no kernel fits the
    GPU (such calls run on the CPU backend under ``backend='auto'``), the reason is
    appended to ``skipped``."""
    from .cuda.spec import NoKernelError, select_backward, select_forward


    found: dict[tuple[str, str], Kernel] = {}
    for dtype in dtypes:
        for d in head_dims:
            try:
                for score_set in dict.fromkeys(_score_set(names, dtype) for names in options):
                    spec = select_forward(dtype, d, d, arch, smem_limit, allow_tf32, scores=score_set)
                    found.setdefault(("forward", spec.name_expression),
                                     Kernel("forward", spec.name_expression, spec.smem_bytes))
                    for m in spec.tile_maps:
                        found.setdefault((m.family, m.name), Kernel(m.family, m.name, 0))
                    for deterministic in (False, True) if backward else ():
                        bspec = select_backward(dtype, d, d, arch, smem_limit, allow_tf32,
                                                deterministic=deterministic, scores=score_set)
                        for name, smem in (*bspec.kernels, *((m.name, 0) for m in bspec.tile_maps)):
                            found.setdefault(("backward", name), Kernel("backward", name, smem))
            except NoKernelError as exc:
                if skipped is not None:
                    skipped.append(str(exc))
    return list(found.values())


class _Counter:
    """A stand-in for tqdm: 'flashcupy precompile: i/n kernels' rewritten on stderr."""

    def __init__(self, total: int, desc: str) -> None:
        self.total, self.desc, self.n = total, desc, 0
        self._show()

    def _show(self) -> None:
        end = "\n" if self.n >= self.total else ""
        sys.stderr.write(f"\r{self.desc}: {self.n}/{self.total} kernels{end}")
        sys.stderr.flush()

    def update(self, n: int = 1) -> None:
        self.n += n
        self._show()

    def close(self) -> None:
        if self.n < self.total:
            sys.stderr.write("\n")
            sys.stderr.flush()


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _Silent()
    try:
        from tqdm import tqdm
    except ImportError:
        return _Counter(total, "flashcupy precompile")
    return tqdm(total=total, desc="flashcupy precompile", unit="kernel", file=sys.stderr)


def _device_info(device: Any) -> tuple[int, str, int, int]:
    """(device index, name, compute capability like 90, opt-in shared memory per block) of
    ``device``: None (CuPy's current device), an index or a ``cupy.cuda.Device``."""
    import cupy

    from .cuda import device_limits

    if device is None:
        device_id = cupy.cuda.Device().id
    else:
        device_id = getattr(device, "id", device)
        if isinstance(device_id, bool) or not isinstance(device_id, (int, np.integer)):
            raise TypeError(f"device: expected None, a device index or a cupy.cuda.Device, received {device!r}")
        count = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= int(device_id) < count:
            raise ValueError(f"device: expected an index in 0..{count - 1}, received {device_id}")
        device_id = int(device_id)
    arch, smem_limit = device_limits(device_id)
    name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
    return device_id, name.decode() if isinstance(name, bytes) else str(name), arch, smem_limit


def _save(device_name: str, arch: int, times: dict[str, float], wall: float, workers: int) -> None:
    """Merge this run's times into the record of (device, arch); a record of other kernel
    sources or another flashcupy version is replaced. Never raises: a read-only cache
    directory only costs the record."""
    from . import __version__
    from .cuda.compile import source_hash

    key = f"{device_name} sm_{arch}"
    records = load_records()
    old = records.get(key)
    same = isinstance(old, dict) and old.get("source_hash") == source_hash() and old.get("flashcupy") == __version__
    kernels = dict(old.get("kernels", {})) if same else {}
    kernels.update({name: round(seconds, 3) for name, seconds in times.items()})
    records[key] = {
        "device": device_name,
        "arch": arch,
        "flashcupy": __version__,
        "source_hash": source_hash(),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "wall_seconds": round(wall, 3),
        "workers": workers,
        "kernels": kernels,
    }
    path = record_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"format": 1, "records": records}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as exc:
        print(f"flashcupy precompile: could not save the compile times to {path}: {exc}", file=sys.stderr)


def precompile(
    dtypes: Iterable[Any] = DTYPE_NAMES,
    head_dims: Iterable[int] = (64, 128),
    backward: bool = True,
    device: Any = None,
    allow_tf32: bool = False,
    progress: bool = True,
    workers: int | None = None,
    options: Iterable[Iterable[str]] = DEFAULT_OPTIONS,
) -> dict[str, float]:
    """Compile, ahead of first use, the CUDA kernels that calls would select on one GPU.

    For each dtype and head dim (D = Dv, any value in 1..512; kernels exist per padded
    bucket 32, 64, 96, 128, 256, 512) and each option set of ``options`` this compiles the
    forward and, with ``backward``, the backward's kernels. Kernels are compiled per set of
    the options beyond causal, window and lengths that a call uses (bias, mask, block_mask,
    alibi, softcap, dropout); the default covers calls without them. ``allow_tf32`` selects the float32 kernels of ``allow_tf32=True`` calls
    instead of the float32-accurate ones. Compilation runs in ``workers`` threads
    (default min(8, CPU count)); kernels already compiled in this process return at once,
    and kernels in CuPy's disk cache load in well under a second.

    Args:
        dtypes: dtype names ('float16', 'bfloat16', 'float32', 'float64') or NumPy dtypes.
        head_dims: head dims to cover.
        backward: also compile the backward kernels.
        device: CUDA device index or ``cupy.cuda.Device``; default CuPy's current device.
        allow_tf32: as the calls' ``allow_tf32``.
        progress: show a progress bar on stderr (tqdm when installed, else a counter).
        workers: compile threads.
        options: option sets, each an iterable of names among "softcap", "bias" (a bias of
            the calls' dtype), "alibi", "mask", "block_mask" and "dropout"; e.g.
            ``[(), ("bias",), ("mask", "dropout")]``.

    Returns:
        {kernel name expression: seconds it took}, in completion order. The times are
        also saved to :func:`record_path` (in CuPy's kernel cache directory) for
        ``python -m flashcupy info``.

    Warns:
        RuntimeWarning: for a dtype and head dim that no kernel of this GPU serves (shared
        memory too small; such calls run on the CPU backend with ``backend='auto'``).

    Raises:
        RuntimeError: no usable CUDA GPU (CuPy missing, no driver or no device).
        ValueError: an unknown dtype or a head dim outside 1..512.
        flashcupy.cuda.compile.KernelCompileError: NVRTC rejected a kernel.
    """
    dtype_names = list(dict.fromkeys(_dtype_name(d) for d in (dtypes if not isinstance(dtypes, str) else [dtypes])))
    dims = list(dict.fromkeys(_head_dim(d) for d in ((head_dims,) if isinstance(head_dims, int) else head_dims)))
    if workers is None:
        workers = min(8, os.cpu_count() or 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected a positive int, received {workers!r}")

    from . import interop

    if not interop.gpu_usable():
        raise RuntimeError(
            "flashcupy.precompile needs a usable CUDA GPU and found none (it needs CuPy, e.g. pip install "
            "'flashcupy[cuda12]', a CUDA driver and a visible device): kernels are compiled for the GPU "
            "they run on. The CPU backend needs no compilation."
        )
    from .cuda.compile import get_function

    device_id, device_name, arch, smem_limit = _device_info(device)
    skipped: list[str] = []
    todo = kernels_for(dtype_names, dims, arch, smem_limit, backward, bool(allow_tf32), skipped, list(options))
    for reason in skipped:
        warnings.warn(f"flashcupy.precompile: {reason.split('; use')[0]}: such calls run on the CPU backend "
                      f"with backend='auto'", RuntimeWarning, stacklevel=2)

    def compile_one(kernel: Kernel) -> float:
        t0 = time.perf_counter()
        get_function(kernel.family, kernel.name, device_id, kernel.smem_bytes)
        return time.perf_counter() - t0

    times: dict[str, float] = {}
    bar = _progress_bar(len(todo), progress)
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(compile_one, kernel): kernel for kernel in todo}
            for future in as_completed(futures):
                times[futures[future].name] = future.result()
                bar.update(1)
    finally:
        bar.close()
    _save(device_name, arch, times, time.perf_counter() - start, workers)
    return times
