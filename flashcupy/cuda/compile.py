"""NVRTC compilation of the kernel sources: lazily at run time through CuPy, or ahead of
time for a named architecture (CI, no GPU needed).

Run time: one ``cupy.RawModule`` per (device, spec), built from the spec's
``name_expression``, cached in memory here and on disk by CuPy. CuPy's disk cache
keys on the source text and the options, not on included headers, so the options
carry a hash of every file in kernels_cu/: editing a header recompiles.

The disk cache, as CuPy (checked against 14.2, cupy/cuda/_compiler_cache.py) keeps it: an
entry is written to a temporary file in the cache folder and moved into place with
``os.replace``, so an interrupted compile leaves no half-written entry under the final name,
and each entry starts with the SHA-1 of its payload, checked on every load, so a truncated or
otherwise damaged entry is a cache miss: CuPy recompiles and rewrites it without an error.
What can still fail is the disk itself (a cache folder we may not read or write, a full disk,
no writable temporary folder: ``OSError``) and a payload whose checksum holds but that the
driver refuses (``CUDA_ERROR_INVALID_IMAGE`` and kin, e.g. an entry written by another tool).
For those :func:`get_function` compiles once more with CuPy's disk cache off
(``CUPY_CACHE_IN_MEMORY=1``: no load, no save, no temporary files) and warns once per process.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import re
import threading
import warnings
from pathlib import Path
from typing import Any, Iterable

from .params import BWD_PARAMS_DTYPE, DECODE_MAX_SPLITS, DECODE_PARAMS_DTYPE, PARAMS_DTYPE
from .spec import arch_flag

_SOURCES = {"forward": "flash_fwd.cu", "backward": "flash_bwd.cu", "decode": "flash_decode.cu",
            "philox_test": "philox_test.cu"}


class KernelCompileError(RuntimeError):
    """NVRTC rejected a kernel: the message carries the specialisation and the compiler log."""


def _compile_error(family: str, names: list[str], arch: Any, options: tuple[str, ...] | list[str],
                   log: str) -> KernelCompileError:
    """A KernelCompileError naming the specialisation (source, name expressions, architecture,
    options) above NVRTC's log."""
    arch_text = f"sm_{arch}" if arch is not None else "unknown (the current device's)"
    return KernelCompileError(
        f"NVRTC failed to compile {', '.join(names)}\n"
        f"  source: {_SOURCES.get(family, family)} in {kernel_dir()}\n"
        f"  architecture: {arch_text}\n"
        f"  options: {' '.join(options)}\n"
        f"NVRTC log:\n{str(log).rstrip()}"
    )


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
    root = kernel_dir()
    for path in sorted(root.rglob("*.cu*")):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
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
        f"-DFLASH_DECODE_PARAMS_SIZE={DECODE_PARAMS_DTYPE.itemsize}",
        f"-DFLASH_DECODE_MAX_SPLITS={DECODE_MAX_SPLITS}",
        f"-DFLASH_SOURCE_HASH={source_hash()}",
    )


def read_source(family: str) -> str:
    return (kernel_dir() / _SOURCES[family]).read_text()


_locks_guard = threading.Lock()
_locks: dict[tuple[int, str, str], threading.Lock] = {}
_functions: dict[tuple[int, str, str], Any] = {}

#: Driver errors that mean "this binary is unusable" (a damaged cache entry), not "the GPU is
#: out of resources": cuModuleLoadData's CUDA_ERROR_INVALID_IMAGE, _NO_BINARY_FOR_GPU,
#: _INVALID_PTX, _UNSUPPORTED_PTX_VERSION, _INVALID_SOURCE.
_BAD_BINARY_STATUS = frozenset({200, 209, 218, 222, 300})

_cache_guard = threading.Lock()
_cache_off_depth = 0  # callers inside _disk_cache_off(); the first sets the variable, the last restores it
_cache_saved: str | None = None
_cache_warned = False


def cache_dir() -> str:
    """The folder CuPy's kernel cache uses (fixed when CuPy is imported)."""
    try:
        from cupy.cuda import compiler

        folder = getattr(getattr(compiler, "_kernel_cache_backend", None), "_cache_dir", None)
    except ImportError:
        folder = None
    return folder or os.environ.get("CUPY_CACHE_DIR") or os.path.expanduser("~/.cupy/kernel_cache")


def _cache_failure(exc: BaseException) -> bool:
    """True for errors of CuPy's disk cache or of a damaged cached binary (worth one retry
    without the cache); False for everything else (NVRTC errors, out of memory, ...)."""
    if isinstance(exc, OSError):
        return True
    try:
        from cupy_backends.cuda.api.driver import CUDADriverError
    except ImportError:  # pragma: no cover - CuPy without its backends
        return False
    return isinstance(exc, CUDADriverError) and getattr(exc, "status", None) in _BAD_BINARY_STATUS


class _disk_cache_off:
    """Context: CuPy compiles in memory (``CUPY_CACHE_IN_MEMORY=1``, read on every compile).

    Process-wide while any caller is inside; other threads compiling meanwhile only skip the
    disk cache too, which costs a recompile, never a wrong result.
    """

    def __enter__(self):
        global _cache_off_depth, _cache_saved
        with _cache_guard:
            if _cache_off_depth == 0:
                _cache_saved = os.environ.get("CUPY_CACHE_IN_MEMORY")
                os.environ["CUPY_CACHE_IN_MEMORY"] = "1"
            _cache_off_depth += 1

    def __exit__(self, *exc):
        global _cache_off_depth
        with _cache_guard:
            _cache_off_depth -= 1
            if _cache_off_depth == 0:
                if _cache_saved is None:
                    os.environ.pop("CUPY_CACHE_IN_MEMORY", None)
                else:
                    os.environ["CUPY_CACHE_IN_MEMORY"] = _cache_saved
        return False


def _warn_cache(exc: BaseException) -> None:
    """One RuntimeWarning per process: the cache folder and what went wrong with it."""
    global _cache_warned
    with _cache_guard:
        if _cache_warned:
            return
        _cache_warned = True
    warnings.warn(
        f"flashcupy: CuPy's kernel cache at {cache_dir()} could not be used "
        f"({type(exc).__name__}: {exc}); compiling without the disk cache in this process. "
        "Check that the folder is readable and writable (or set CUPY_CACHE_DIR), or delete it "
        "to drop damaged entries.",
        RuntimeWarning,
        stacklevel=4,
    )


def _device_arch(cupy: Any, device_id: int) -> str | None:
    try:
        return str(cupy.cuda.Device(device_id).compute_capability)
    except Exception:  # noqa: BLE001 - only for the error message
        return None


def _arch_options(cupy: Any, device_id: int) -> tuple[str, ...]:
    """An -arch option where ours differs from the sm_XX CuPy passes: sm_90a on compute
    capability 9.0 (NVRTC compiles for the later, wider target of the two)."""
    arch = int(cupy.cuda.Device(device_id).compute_capability)
    flag = arch_flag(arch)
    return (f"-arch={flag}",) if flag != f"sm_{arch}" else ()


def _load(cupy: Any, family: str, name: str, options: tuple[str, ...], device_id: int):
    """Compile (or load from CuPy's cache) ``name`` and return its function; on a cache
    failure, warn once and compile again with the disk cache off."""
    source = read_source(family)
    for attempt in (0, 1):
        try:
            if attempt:
                with _disk_cache_off():
                    module = cupy.RawModule(code=source, options=options, name_expressions=[name])
                    return module.get_function(name)
            module = cupy.RawModule(code=source, options=options, name_expressions=[name])
            return module.get_function(name)
        except cupy.cuda.compiler.CompileException as exc:
            raise _compile_error(family, [name], _device_arch(cupy, device_id), options,
                                 exc.get_message()) from exc
        except Exception as exc:
            if attempt or not _cache_failure(exc):
                raise
            _warn_cache(exc)
    raise AssertionError("unreachable")  # pragma: no cover


def get_function(family: str, name: str, device_id: int, smem_bytes: int = 0):
    """The compiled kernel ``name`` of source ``family`` on ``device_id``, compiled once per process.

    Thread-safe: each specialisation has its own lock, so different ones compile in
    parallel (NVRTC releases the GIL) and concurrent callers of one wait for it.
    Raises KernelCompileError with the specialisation and NVRTC's log when compilation
    fails. When CuPy's disk cache fails (unreadable or unwritable folder, a cached binary
    the driver rejects) it warns once (RuntimeWarning) and compiles without the cache.
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
                fn = _load(cupy, family, name, compile_options() + _arch_options(cupy, device_id), device_id)
                if smem_bytes > 48 * 1024:  # above 48 KB a block must opt in
                    fn.max_dynamic_shared_size_bytes = smem_bytes
            _functions[key] = fn
    return fn


def kernel_args(block: bytearray) -> tuple[Any, int]:
    """(keep-alive, address) of the driver's argument array for kernels taking one by-value
    parameter block: pass the address to :func:`launch_ptr`; keep the first alive until the
    launches are queued (the driver copies the block at each launch)."""
    import ctypes

    arg = (ctypes.c_char * len(block)).from_buffer(block)
    args = (ctypes.c_void_p * 1)(ctypes.addressof(arg))
    return (arg, args), ctypes.addressof(args)


class KeptBlock:
    """One thread's copy of a parameter block (:meth:`params.Template.buffer`) and the driver's
    argument array over it, for kernels taking the block as their one by-value parameter:
    launch with ``one``'s address (:func:`launch_ptr`). The driver copies the arguments at each
    launch, so the thread's next call may refill the block at once."""

    def __init__(self, template: Any) -> None:
        import ctypes

        self.block = template.buffer()
        self._one = (ctypes.c_void_p * 1)(ctypes.addressof(self.block))
        self.one = ctypes.addressof(self._one)


class ThreadBlocks:
    """Each thread's :class:`KeptBlock` (or ``kind``, a subclass) of one template, made on the
    thread's first call: threads fill their own blocks, so concurrent calls never share one."""

    def __init__(self, template: Any, kind: type = KeptBlock) -> None:
        self._template, self._kind = template, kind
        self._local = threading.local()

    def get(self) -> Any:
        kept = getattr(self._local, "kept", None)
        if kept is None:
            kept = self._local.kept = self._kind(self._template)
        return kept


def bind_context(device_id: int) -> None:
    """Make ``device_id``'s primary context current on this thread where none is. The
    driver's launches need one, and a thread that has made no CUDA runtime call yet has
    none: autograd's device threads, a new thread whose calls all run kept plans.
    cudaSetDevice binds it (callers launch on their current device, so it is that one)."""
    import cupy

    if not cupy.cuda.driver.ctxGetCurrent():
        cupy.cuda.runtime.setDevice(device_id)


def launch_ptr(function: int, grid: tuple[int, ...], threads: int, args: int, smem_bytes: int, stream: int) -> None:
    """Launch the CUfunction ``function`` on ``stream`` with the argument array at ``args``
    (:func:`kernel_args`), through the driver API: CuPy's own call wraps and converts each
    argument first, a few microseconds a launch that decoding's short calls feel."""
    import cupy

    gx, gy, gz = (*grid, 1, 1)[:3]
    cupy.cuda.driver.launchKernel(function, gx, gy, gz, threads, 1, 1, smem_bytes, stream, args, 0)


def launch(fn: Any, grid: tuple[int, ...], threads: int, block: bytearray, smem_bytes: int = 0) -> None:
    """Launch ``fn`` (from :func:`get_function`) on the current stream with one by-value
    argument, a parameter block's bytes (:func:`launch_ptr`)."""
    import cupy

    keep, args = kernel_args(block)
    launch_ptr(fn.kernel.ptr, grid, threads, args, smem_bytes, cupy.cuda.get_current_stream().ptr)
    del keep


def precompile(kernels: Iterable[tuple[str, str, int]], device_id: int, workers: int = 8) -> None:
    """Compile (family, name, shared memory) kernels for ``device_id`` ahead of use,
    ``workers`` at a time (e.g. ``spec.all_kernels(arch)``)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        for future in [pool.submit(get_function, family, name, device_id, smem) for family, name, smem in kernels]:
            future.result()


def compile_for_arch(family: str, names: list[str], arch: int, front_end: bool = False) -> str:
    """Compile ``names`` for sm_``arch`` with NVRTC directly (no GPU needed); returns the log
    with ptxas' verbose report. With ``front_end``, only NVRTC's front end runs, for
    compute_``arch`` (templates instantiated, static_asserts checked, no code generated).
    Raises KernelCompileError on failure."""
    from cupy_backends.cuda.libs import nvrtc

    options = ([*compile_options(), f"-arch=compute_{arch}", "-fdevice-syntax-only"] if front_end else
               [*compile_options(), f"-arch={arch_flag(arch)}", "--ptxas-options=--verbose"])
    program = nvrtc.createProgram(read_source(family), _SOURCES[family], [], [])
    try:
        for name in names:
            nvrtc.addNameExpression(program, name)
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program)
            raise _compile_error(family, names, arch, options, log) from exc
        return nvrtc.getProgramLog(program)
    finally:
        nvrtc.destroyProgram(program)


_COMPILING = re.compile(r"Compiling entry function '(?P<name>[^']+)' for 'sm_(?P<arch>\d+)a?'")
_PROPERTIES = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads"
)
_REGISTERS = re.compile(r"Used (?P<regs>\d+) registers")


def parse_ptxas(log: str) -> list[dict]:
    """One dict per entry function in ptxas' verbose report (:func:`compile_for_arch`'s log),
    in report order: its mangled ``name``, ``arch``, ``regs`` and the bytes of ``stack``
    frame, spill ``stores`` and spill ``loads`` (None where the report lacks a figure)."""
    log = log.replace("\0", "")
    entries = []
    for line in log.splitlines():
        m = _COMPILING.search(line)
        if m:
            entries.append({"name": m["name"], "arch": int(m["arch"]), "stack": None, "stores": None,
                            "loads": None, "regs": None})
            continue
        if not entries:
            continue
        m = _PROPERTIES.search(line)
        if m and entries[-1]["stack"] is None:
            entries[-1].update(stack=int(m["stack"]), stores=int(m["stores"]), loads=int(m["loads"]))
            continue
        m = _REGISTERS.search(line)
        if m and entries[-1]["regs"] is None:
            entries[-1]["regs"] = int(m["regs"])
    return entries
