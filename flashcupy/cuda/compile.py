"""NVRTC compilation of the kernel sources: lazily at run time through CuPy, or ahead of
time for a named architecture (CI, no GPU needed).

Run time: one ``cupy.RawModule`` per (device, spec), built from the spec's
``name_expression``, cached in memory here and on disk by CuPy. CuPy's disk cache
keys on the source text and the options, not on included headers, so the options
carry a hash of every file in kernels_cu/: editing a header recompiles.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import threading
from pathlib import Path
from typing import Any

from .params import BWD_PARAMS_DTYPE, PARAMS_DTYPE
from .spec import KernelSpec

_SOURCES = {"forward": "flash_fwd.cu", "backward": "flash_bwd.cu", "philox_test": "philox_test.cu"}


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel: the message carries the specialisation and the compiler log."""


@functools.lru_cache(maxsize=1)
def kernel_dir() -> Path:
    """kernels_cu/: inside the installed package (flashcupy/kernels_cu, a data folder without
    __init__.py), or at the top of a source checkout."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package / "kernels_cu", package.parent / "kernels_cu"):
        if (candidate / "flash_fwd.cu").is_file():
            return candidate
    raise FileNotFoundError(
        f"flashcupy's kernels_cu/ sources are missing from this installation (looked in {package / 'kernels_cu'} "
        f"and {package.parent / 'kernels_cu'})"
    )


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """Hash of every kernel source and header: part of the compile options."""
    digest = hashlib.sha256()
    for path in sorted(kernel_dir().glob("*.cu*")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def cuda_include_dirs() -> tuple[str, ...]:
    """Folders with the CUDA runtime headers (cuda_fp16.h, ...) that CuPy may not add itself:
    the pip wheel nvidia-cuda-runtime-cu12's include/ and $CUDA_PATH/include."""
    candidates = []
    try:
        spec = importlib.util.find_spec("nvidia.cuda_runtime")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:  # a namespace package in recent wheels: no __init__.py, origin None
        locations = list(spec.submodule_search_locations or [])
        if spec.origin:
            locations.append(str(Path(spec.origin).parent))
        candidates += [Path(loc) / "include" for loc in locations]
    if os.environ.get("CUDA_PATH"):
        candidates.append(Path(os.environ["CUDA_PATH"]) / "include")
    found: list[str] = []
    for folder in candidates:
        if (folder / "cuda_fp16.h").is_file() and str(folder) not in found:
            found.append(str(folder))
    return tuple(found)


def compile_options() -> tuple[str, ...]:
    return (
        "-std=c++17",
        f"-I{kernel_dir()}",
        *(f"-I{d}" for d in cuda_include_dirs()),
        f"-DFLASH_PARAMS_SIZE={PARAMS_DTYPE.itemsize}",
        f"-DFLASH_BWD_PARAMS_SIZE={BWD_PARAMS_DTYPE.itemsize}",
        f"-DFLASH_SOURCE_HASH={source_hash()}",
    )


def read_source(family: str) -> str:
    return (kernel_dir() / _SOURCES[family]).read_text()


_locks_guard = threading.Lock()
_locks: dict[tuple[int, str, str], threading.Lock] = {}
_functions: dict[tuple[int, str, str], Any] = {}


def get_function(family: str, name: str, device_id: int, smem_bytes: int = 0):
    """The compiled kernel ``name`` of source ``family`` on ``device_id``, compiled once per process.

    Thread-safe: each specialisation has its own lock, so different ones compile in
    parallel (NVRTC releases the GIL) and concurrent callers of one wait for it.
    Raises KernelCompileError with NVRTC's log when compilation fails.
    """
    key = (device_id, family, name)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    import cupy

    with _locks_guard:
        lock = _locks.setdefault(key, threading.Lock())
    with lock:
        fn = _functions.get(key)
        if fn is None:
            with cupy.cuda.Device(device_id):
                module = cupy.RawModule(code=read_source(family), options=compile_options(), name_expressions=[name])
                try:
                    fn = module.get_function(name)
                except cupy.cuda.compiler.CompileException as exc:
                    raise KernelCompileError(f"NVRTC failed to compile {name}:\n{exc}") from exc
                if smem_bytes > 48 * 1024:  # above 48 KB a block must opt in
                    fn.max_dynamic_shared_size_bytes = smem_bytes
            _functions[key] = fn
    return fn


def forward_function(spec: KernelSpec, device_id: int):
    return get_function("forward", spec.name_expression, device_id, spec.smem_bytes)


def precompile(specs: list[KernelSpec], device_id: int, workers: int = 8) -> None:
    """Compile forward ``specs`` for ``device_id`` ahead of use, ``workers`` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(forward_function, spec, device_id) for spec in specs]:
            future.result()


def compile_for_arch(family: str, names: list[str], arch: int) -> str:
    """Compile ``names`` for sm_``arch`` with NVRTC directly (no GPU needed); returns the log
    with ptxas' verbose report. Raises KernelCompileError on failure."""
    from cupy_backends.cuda.libs import nvrtc

    options = [*compile_options(), f"-arch=sm_{arch}", "--ptxas-options=--verbose"]
    program = nvrtc.createProgram(read_source(family), _SOURCES[family], [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program)
            raise KernelCompileError(f"NVRTC failed for sm_{arch}:\n{log}") from exc
        return nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)
