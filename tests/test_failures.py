"""Failure paths: NVRTC errors, CuPy's kernel cache, out of device memory.

CPU tests (no GPU needed, run in CI): the KernelCompileError message from real NVRTC
(``compile_for_arch``) and from ``get_function`` with CuPy's RawModule faked; the cache
fallback of ``get_function`` (warn once, recompile without the disk cache) with faked
failures; CuPy's own disk-cache guarantees (atomic writes, checksummed entries) on
``DiskKernelCacheBackend`` directly.

GPU tests (``-m gpu``): a truncated and a well-formed-but-unloadable cache entry for a real
kernel; out of device memory in the forward and the backward leaves the memory pool as it
was and raises CuPy's OutOfMemoryError (a MemoryError).
"""

from __future__ import annotations

import gc
import os
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
from cupy.cuda import compiler as cupy_compiler  # noqa: E402
from cupy_backends.cuda.api.driver import CUDADriverError  # noqa: E402

import flashcupy as fc  # noqa: E402
from flashcupy.cuda import compile as cc  # noqa: E402

FWD_NAME = "flash::flash_fwd<float, flash::Simt<float, float>, 64, 64, 32, 4, false, 2>"


class _DriverError(CUDADriverError):
    """CUDADriverError(status) without libcuda (the real constructor asks the driver for the
    error's name)."""

    def __init__(self, status: int):
        RuntimeError.__init__(self, f"CUDA driver error {status}")
        self._status = status

    status = property(lambda self: self._status)


def _nvrtc_usable() -> bool:
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
        return True
    except Exception:  # noqa: BLE001
        return False


needs_nvrtc = pytest.mark.skipif(not _nvrtc_usable(), reason="NVRTC not loadable")


# --------------------------------------------------------------------------- NVRTC errors


@needs_nvrtc
def test_compile_for_arch_broken_source(monkeypatch):
    """A source NVRTC rejects: the error carries the log line, the name, the arch and the options."""
    broken = '#error "flashcupy-broken-marker"\n__global__ void k() {}\n'
    monkeypatch.setattr(cc, "read_source", lambda family: broken)
    with pytest.raises(cc.KernelCompileError) as info:
        cc.compile_for_arch("forward", ["k"], 80)
    msg = str(info.value)
    assert "flashcupy-broken-marker" in msg  # NVRTC's log
    assert "NVRTC failed to compile k" in msg
    assert "sm_80" in msg and "-std=c++17" in msg and "flash_fwd.cu" in msg
    assert isinstance(info.value, RuntimeError)


@needs_nvrtc
def test_compile_for_arch_bogus_name_expression():
    """A template argument the source cannot instantiate: the name expression is in the message."""
    bogus = "flash::flash_fwd<float, flash::NoSuchPolicy, 64, 64, 32, 4, false, 2>"
    with pytest.raises(cc.KernelCompileError) as info:
        cc.compile_for_arch("forward", [bogus], 90)
    msg = str(info.value)
    assert bogus in msg and "sm_90" in msg
    assert "NoSuchPolicy" in msg.split("NVRTC log:", 1)[1]  # and NVRTC's own complaint


class _FakeDevice:
    """Stands in for cupy.cuda.Device on a machine without a GPU."""

    compute_capability = "90"

    def __init__(self, device_id=None):
        self.id = device_id or 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _FakeModule:
    """cupy.RawModule whose get_function runs the next behaviour of a shared script:
    an exception instance to raise, or anything else to return."""

    script: list = []
    calls: list = []

    def __init__(self, code=None, options=(), name_expressions=None, **kw):
        self.options = options

    def get_function(self, name):
        _FakeModule.calls.append((name, os.environ.get("CUPY_CACHE_IN_MEMORY")))
        action = _FakeModule.script.pop(0)
        if isinstance(action, BaseException):
            raise action
        return action


class _Fn:
    max_dynamic_shared_size_bytes = 0


@pytest.fixture
def fake_cupy(monkeypatch):
    """get_function with RawModule and Device faked; a fresh in-process cache and warn-once flag."""
    monkeypatch.setattr(cupy, "RawModule", _FakeModule)
    monkeypatch.setattr(cupy.cuda, "Device", _FakeDevice)
    monkeypatch.setattr(cc, "_functions", {})
    monkeypatch.setattr(cc, "_locks", {})
    monkeypatch.setattr(cc, "_cache_warned", False)
    monkeypatch.delenv("CUPY_CACHE_IN_MEMORY", raising=False)
    _FakeModule.script, _FakeModule.calls = [], []
    yield _FakeModule
    assert not _FakeModule.script, "script not used up"


def _compile_exception(log: str):
    return cupy_compiler.CompileException(log, "source", "flash_fwd.cu", ("-std=c++17",))


def test_get_function_compile_error_message(fake_cupy):
    fake_cupy.script = [_compile_exception("flash_fwd.cu(12): error: identifier \"oops\" is undefined")]
    with pytest.raises(cc.KernelCompileError) as info:
        cc.get_function("forward", FWD_NAME, 0)
    msg = str(info.value)
    assert FWD_NAME in msg and 'identifier "oops" is undefined' in msg
    assert "sm_90" in msg and f"-DFLASH_SOURCE_HASH={cc.source_hash()}" in msg
    assert isinstance(info.value.__cause__, cupy_compiler.CompileException)
    assert len(fake_cupy.calls) == 1  # a compile error is not retried


@pytest.mark.parametrize("failure", [
    _DriverError(200),  # CUDA_ERROR_INVALID_IMAGE: a damaged cached cubin
    _DriverError(209),  # CUDA_ERROR_NO_BINARY_FOR_GPU
    PermissionError(13, "Permission denied", "/cache/abc.cubin"),  # unwritable cache folder
    OSError(28, "No space left on device"),
])
def test_cache_failure_falls_back_once(fake_cupy, failure):
    """The first attempt fails in the cache: one RuntimeWarning naming the cache folder and the
    reason, a second compile with CUPY_CACHE_IN_MEMORY=1, the variable restored afterwards."""
    fn = _Fn()
    fake_cupy.script = [failure, fn]
    with pytest.warns(RuntimeWarning) as record:
        assert cc.get_function("forward", FWD_NAME, 0) is fn
    assert len(record) == 1
    msg = str(record[0].message)
    assert cc.cache_dir() in msg and type(failure).__name__ in msg
    assert fake_cupy.calls == [(FWD_NAME, None), (FWD_NAME, "1")]
    assert "CUPY_CACHE_IN_MEMORY" not in os.environ
    assert cc.get_function("forward", FWD_NAME, 0) is fn  # kept in memory: no more compiles
    assert len(fake_cupy.calls) == 2

    # a second specialisation that hits the same problem recompiles but does not warn again
    fake_cupy.script = [failure, fn]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cc.get_function("backward", "flash::other<float>", 0) is fn


def test_cache_fallback_restores_a_user_setting(fake_cupy, monkeypatch):
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "0")
    fake_cupy.script = [_DriverError(200), _Fn()]
    with pytest.warns(RuntimeWarning):
        cc.get_function("forward", FWD_NAME, 0)
    assert os.environ["CUPY_CACHE_IN_MEMORY"] == "0"


def test_cache_fallback_failing_again_raises(fake_cupy):
    """Nothing hides a failure that is not the cache's: the retry's error propagates."""
    fake_cupy.script = [PermissionError(13, "Permission denied"), PermissionError(13, "still denied")]
    with pytest.warns(RuntimeWarning), pytest.raises(PermissionError, match="still denied"):
        cc.get_function("forward", FWD_NAME, 0)
    assert "CUPY_CACHE_IN_MEMORY" not in os.environ
    assert not cc._functions


def test_cache_fallback_compile_error_on_retry(fake_cupy):
    fake_cupy.script = [_DriverError(200), _compile_exception("error: retry-log-marker")]
    with pytest.warns(RuntimeWarning), pytest.raises(cc.KernelCompileError, match="retry-log-marker"):
        cc.get_function("forward", FWD_NAME, 0)


@pytest.mark.parametrize("failure", [
    _DriverError(2),  # CUDA_ERROR_OUT_OF_MEMORY while loading the module
    cupy.cuda.memory.OutOfMemoryError(1 << 20, 0, 0),
    ValueError("not a cache problem"),
])
def test_other_errors_are_not_retried(fake_cupy, failure):
    fake_cupy.script = [failure]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(type(failure)):
            cc.get_function("forward", FWD_NAME, 0)
    assert len(fake_cupy.calls) == 1


def test_smem_opt_in_after_fallback(fake_cupy):
    fn = _Fn()
    fake_cupy.script = [_DriverError(200), fn]
    with pytest.warns(RuntimeWarning):
        cc.get_function("forward", FWD_NAME, 0, smem_bytes=100_000)
    assert fn.max_dynamic_shared_size_bytes == 100_000


# --------------------------------------------------------------------------- CuPy's disk cache


def test_cupy_cache_writes_are_atomic(tmp_path, monkeypatch):
    """CuPy writes an entry to a temporary file in the cache folder and os.replace()s it into
    place: a write interrupted before the rename leaves nothing under the entry's name."""
    from cupy.cuda._compiler_cache import DiskKernelCacheBackend

    backend = DiskKernelCacheBackend(str(tmp_path))
    renames = []
    real_replace = os.replace

    def interrupted(src, dst):
        renames.append((src, dst))
        raise KeyboardInterrupt  # the process dies between write and rename

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        backend.save("abc.cubin", b"\x7fELF" + b"x" * 1000, "source")
    monkeypatch.setattr(os, "replace", real_replace)
    assert len(renames) == 1 and Path(renames[0][0]).parent == tmp_path and renames[0][1] == str(tmp_path / "abc.cubin")
    assert not (tmp_path / "abc.cubin").exists()
    assert backend.load("abc.cubin") is None  # a miss, so CuPy compiles


def test_cupy_cache_rejects_truncated_entries(tmp_path):
    """Every entry starts with the SHA-1 of its payload: a truncated or altered entry loads as a
    miss (None), so CuPy recompiles and rewrites it instead of handing the driver garbage."""
    from cupy.cuda._compiler_cache import DiskKernelCacheBackend

    backend = DiskKernelCacheBackend(str(tmp_path))
    payload = b"\x7fELF" + bytes(range(256)) * 8
    backend.save("k.cubin", payload, "source")
    assert backend.load("k.cubin") == payload
    data = (tmp_path / "k.cubin").read_bytes()
    for damaged in (data[: len(data) // 2], data[:10], b"", data[:-1] + b"\0"):
        (tmp_path / "k.cubin").write_bytes(damaged)
        assert backend.load("k.cubin") is None


def test_cache_dir_is_cupys():
    assert cc.cache_dir() == getattr(cupy_compiler._kernel_cache_backend, "_cache_dir", cc.cache_dir())


# --------------------------------------------------------------------------- GPU: real cache entries


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """CuPy's disk cache pointed at an empty folder, flashcupy's in-process cache emptied."""
    from cupy.cuda._compiler_cache import DiskKernelCacheBackend

    if not hasattr(cupy_compiler, "_kernel_cache_backend"):
        pytest.skip("this CuPy has no pluggable kernel cache backend")
    backend = DiskKernelCacheBackend(str(tmp_path))
    monkeypatch.setattr(cupy_compiler, "_kernel_cache_backend", backend)
    # A fresh define per test: CuPy's in-process module cache, keyed by source and options,
    # cannot answer, so every test really compiles through (and writes) this disk cache.
    options = cc.compile_options
    nonce = f"-DFLASHCUPY_TEST_NONCE={uuid.uuid4().hex}"
    monkeypatch.setattr(cc, "compile_options", lambda: (*options(), nonce))
    monkeypatch.setattr(cc, "_functions", {})
    monkeypatch.setattr(cc, "_cache_warned", False)
    return tmp_path, backend


def _run_philox(device: int) -> np.ndarray:
    from flashcupy import rng

    ctr = np.arange(64 * 4, dtype=np.uint32).reshape(64, 4)
    key = np.full((64, 2), 7, np.uint32)
    out = cupy.zeros((64, 4), dtype=cupy.uint32)
    cc.get_function("philox_test", "philox_ours", device)((1,), (64,), (cupy.asarray(ctr), cupy.asarray(key), out,
                                                                         np.int32(64)))
    expect = np.stack(rng.philox4x32_10(tuple(ctr.T), tuple(key.T)), axis=1)
    np.testing.assert_array_equal(out.get(), expect)
    return out


@pytest.mark.gpu
def test_truncated_cache_entry_recompiles(private_cache):
    """A truncated entry for the exact key CuPy uses: CuPy's checksum makes it a miss, the kernel
    is recompiled (no error, no warning: nothing for flashcupy to fall back from) and the
    entry rewritten whole."""
    folder, backend = private_cache
    device = cupy.cuda.Device().id
    _run_philox(device)
    entries = [p for p in folder.iterdir() if p.suffix == ".cubin"]
    assert len(entries) == 1
    good = entries[0].read_bytes()
    entries[0].write_bytes(good[: len(good) // 3])
    cc._functions.clear()
    cupy._util.clear_memo()  # CuPy's in-process module memo would answer without the disk
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run_philox(device)
    assert backend.load(entries[0].name) is not None  # rewritten whole by the recompile
    assert len(entries[0].read_bytes()) == len(good)


@pytest.mark.gpu
def test_unloadable_cache_entry_falls_back(private_cache):
    """An entry whose checksum holds but whose cubin the driver rejects: one RuntimeWarning,
    a recompile without the disk cache, the right result."""
    folder, backend = private_cache
    device = cupy.cuda.Device().id
    _run_philox(device)
    (entry,) = [p for p in folder.iterdir() if p.suffix == ".cubin"]
    # CuPy's own payload layout (one mangled name, then the "cubin"): an ELF header and garbage
    garbage = cupy_compiler._encode_cache_payload(["philox_ours"], b"\x7fELF\x02\x01\x01" + b"\xab" * 512)
    entry.write_bytes(backend._encode_cubin(garbage))
    assert backend.load(entry.name) == garbage
    cc._functions.clear()
    cupy._util.clear_memo()  # CuPy's in-process module memo would answer without the disk
    with pytest.warns(RuntimeWarning, match="kernel cache") as record:
        _run_philox(device)
    assert len(record) == 1 and str(folder) in str(record[0].message)
    assert "CUPY_CACHE_IN_MEMORY" not in os.environ


@pytest.mark.gpu
def test_unwritable_cache_falls_back(private_cache):
    folder, _ = private_cache
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    folder.chmod(0o500)
    try:
        with pytest.warns(RuntimeWarning, match="PermissionError"):
            _run_philox(cupy.cuda.Device().id)
    finally:
        folder.chmod(0o700)


# --------------------------------------------------------------------------- GPU: out of memory


def _free_bytes() -> int:
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    return cupy.cuda.runtime.memGetInfo()[0]


def _expect_oom(call) -> str:
    """Run ``call``; it must raise MemoryError. Returns the message. The exception (and the
    frames its traceback holds) is dropped before returning."""
    try:
        call()
    except MemoryError as exc:  # cupy.cuda.memory.OutOfMemoryError is a MemoryError
        return f"{type(exc).__name__}: {exc}"
    raise AssertionError("expected the call to run out of device memory")


def _check_oom_message(msg: str, q_shape) -> None:
    if msg.startswith("OutOfMemoryError"):  # CuPy's own: says how much it could not allocate
        assert "Out of memory allocating" in msg, msg
    else:  # a flashcupy wrapper must name the problem size
        assert "flashcupy" in msg and str(tuple(q_shape)) in msg, msg


@pytest.mark.gpu
def test_forward_out_of_memory_leaks_nothing():
    """q takes ~60% of free memory and needs a padded copy (D = 59: rows not 16-byte aligned),
    so the forward cannot allocate its copy; k and v are small, so if it somehow fit the
    launch would still be quick. The pool's used bytes return to their level before the call."""
    pool = cupy.get_default_memory_pool()
    d = 59
    rows = int(0.6 * _free_bytes()) // (d * 4)
    q = cupy.zeros((1, 1, rows, d), cupy.float32)
    k = cupy.zeros((1, 1, 16, d), cupy.float32)
    v = cupy.zeros((1, 1, 16, d), cupy.float32)
    gc.collect()
    before = pool.used_bytes()
    msg = _expect_oom(lambda: fc.flash_attention(q, k, v, backend="cuda"))
    gc.collect()
    assert pool.used_bytes() == before, (pool.used_bytes() - before, msg)
    _check_oom_message(msg, q.shape)
    q = k = v = None
    gc.collect()
    # the library still works afterwards
    small = cupy.ones((1, 2, 8, 59), cupy.float32)
    assert bool(cupy.isfinite(fc.flash_attention(small, small, small, backend="cuda")).all())


@pytest.mark.gpu
def test_backward_out_of_memory_leaks_nothing():
    """q, dout and out take ~20% of free memory each; the backward needs padded copies of all
    three plus dq: it cannot fit."""
    pool = cupy.get_default_memory_pool()
    d = 59
    rows = int(0.2 * _free_bytes()) // (d * 4)
    q = cupy.zeros((1, 1, rows, d), cupy.float32)
    k = cupy.zeros((1, 1, 16, d), cupy.float32)
    v = cupy.zeros((1, 1, 16, d), cupy.float32)
    out = cupy.zeros_like(q)
    dout = cupy.zeros_like(q)
    lse = cupy.zeros((1, 1, rows), cupy.float32)
    gc.collect()
    before = pool.used_bytes()
    msg = _expect_oom(lambda: fc.flash_attention_backward(dout, q, k, v, out, lse, backend="cuda"))
    gc.collect()
    assert pool.used_bytes() == before, (pool.used_bytes() - before, msg)
    _check_oom_message(msg, q.shape)
