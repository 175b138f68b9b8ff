"""How many threads the CPU backend uses, and running its independent tasks on them.

The count, in order of precedence:

1. ``with flashcupy.cpu_threads(n):`` for the code inside (per thread and per
   asyncio task: a context variable);
2. ``flashcupy.set_cpu_threads(n)`` for the whole process (``None`` restores 3);
3. by default, the cores this process may run on (``os.sched_getaffinity``,
   so ``taskset`` and container CPU sets count), lowered to the first of
   OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and MKL_NUM_THREADS that is set to a
   positive integer, read at each call.

Tasks run on a persistent pool of worker threads plus the calling thread;
NumPy, BLAS and the compiled tile kernels release the GIL. While tasks run,
BLAS is held at one thread (through threadpoolctl), so that n tasks use n
cores rather than n times BLAS's own threads; each task is computed by one
thread with a fixed order of operations, so results do not depend on the
thread count. Without threadpoolctl (``pip install 'flashcupy[cpu]'``) the
tasks run one after another on the calling thread and BLAS keeps its own
threading.

Inside a task, NumPy floating-point warnings are off: Inf and NaN inputs flow
through to the results (docs/semantics.md) without RuntimeWarnings.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence, TypeVar

import numpy as np

T = TypeVar("T")
S = TypeVar("S")

#: Environment variables whose positive integer value caps the default thread count, first set wins.
THREAD_LIMIT_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")

_context_threads: contextvars.ContextVar[int | None] = contextvars.ContextVar("flashcupy_cpu_threads", default=None)
_process_threads: int | None = None


def _check_threads(n: object) -> int | None:
    """``n`` as a positive int or None, else a TypeError/ValueError naming ``threads``."""
    if n is None:
        return None
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)):
        raise TypeError(f"threads: expected a positive int or None, received {n!r}")
    if n < 1:
        raise ValueError(f"threads: expected a positive int or None, received {n}")
    return int(n)


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no sched_getaffinity (macOS, Windows)
        return os.cpu_count() or 1


def _environment_limit() -> int | None:
    """The first of THREAD_LIMIT_VARIABLES set to a positive integer (OMP's 'n,m' list: n)."""
    for name in THREAD_LIMIT_VARIABLES:
        text = os.environ.get(name, "").split(",")[0].strip()
        if text.isdigit() and int(text) > 0:
            return int(text)
    return None


def default_threads() -> int:
    """The available cores, capped by OMP_NUM_THREADS-style environment variables."""
    cores = available_cores()
    limit = _environment_limit()
    return cores if limit is None else min(cores, limit)


def get_cpu_threads() -> int:
    """The number of threads the next CPU-backend call in this context will use."""
    n = _context_threads.get()
    if n is None:
        n = _process_threads
    return default_threads() if n is None else n


def set_cpu_threads(threads: int | None) -> None:
    """Set the CPU backend's thread count for the whole process; None restores the default
    (available cores, capped by OMP_NUM_THREADS and the like). ``cpu_threads`` overrides it."""
    global _process_threads
    _process_threads = _check_threads(threads)


@contextlib.contextmanager
def cpu_threads(threads: int | None) -> Iterator[None]:
    """Use ``threads`` threads (None: the process setting) for CPU-backend calls made inside
    the ``with`` block, in this thread or asyncio task only."""
    token = _context_threads.set(_check_threads(threads))
    try:
        yield
    finally:
        _context_threads.reset(token)


# --------------------------------------------------------------------------- BLAS threads

_blas_lock = threading.Lock()
_blas_state: dict = {"users": 0, "restore": None, "libraries": None}


def _blas_libraries() -> list | None:
    """threadpoolctl's controllers of the BLAS libraries loaded now (found once); None without
    threadpoolctl."""
    if _blas_state["libraries"] is None:
        try:
            import threadpoolctl
        except ImportError:
            return None
        _blas_state["libraries"] = threadpoolctl.ThreadpoolController().select(user_api="blas").lib_controllers
    return _blas_state["libraries"]


@contextlib.contextmanager
def _single_threaded_blas() -> Iterator[bool]:
    """BLAS held at one thread while any caller is inside; yields False when it cannot be
    (no threadpoolctl). The first caller in sets the limit and the last one out restores
    each library's own count."""
    with _blas_lock:
        libraries = _blas_libraries()
        if libraries is not None:
            if _blas_state["users"] == 0:
                _blas_state["restore"] = [(lib, lib.num_threads) for lib in libraries]
                for lib, threads in _blas_state["restore"]:
                    if threads != 1:
                        lib.set_num_threads(1)
            _blas_state["users"] += 1
    try:
        yield libraries is not None
    finally:
        if libraries is not None:
            with _blas_lock:
                _blas_state["users"] -= 1
                if _blas_state["users"] == 0:
                    for lib, threads in _blas_state["restore"]:
                        if threads != 1:
                            lib.set_num_threads(threads)
                    _blas_state["restore"] = None


# --------------------------------------------------------------------------- the pool

_pool_lock = threading.Lock()
_pool_state: dict = {"pool": None, "size": 0}


def _pool(workers: int) -> ThreadPoolExecutor:
    """A pool with at least ``workers`` threads, kept between calls."""
    with _pool_lock:
        if _pool_state["size"] < workers:
            old = _pool_state["pool"]
            _pool_state["pool"] = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="flashcupy-cpu")
            _pool_state["size"] = workers
            if old is not None:
                old.shutdown(wait=False)
        return _pool_state["pool"]


def _forget_pool() -> None:
    """After fork: the parent's worker threads do not exist in the child."""
    _pool_state.update(pool=None, size=0)
    _blas_state.update(users=0, restore=None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def run_tasks(tasks: Sequence[T], run: Callable[[T, S], None], scratch: Callable[[], S],
              threads: int | None = None) -> None:
    """``run(task, state)`` for every task, on up to ``threads`` threads (default
    :func:`get_cpu_threads`), in the order given as threads free up (put long tasks first).

    Each thread makes its own ``state = scratch()`` once (buffers reused across its
    tasks). Tasks must write disjoint outputs. The first exception stops the rest and
    is raised here.
    """
    if not tasks:
        return
    threads = get_cpu_threads() if threads is None else threads
    with _single_threaded_blas() as limited:
        workers = min(threads, len(tasks)) if limited else 1
        counter = itertools.count()  # next() is atomic under the GIL
        failed: list[BaseException] = []

        def work() -> None:
            state = scratch()
            with np.errstate(all="ignore"):
                while not failed:
                    index = next(counter)
                    if index >= len(tasks):
                        return
                    try:
                        run(tasks[index], state)
                    except BaseException as exc:
                        failed.append(exc)
                        raise

        if workers == 1:
            work()
            return
        futures = [_pool(workers - 1).submit(work) for _ in range(workers - 1)]
        try:
            work()
        finally:
            for future in futures:  # wait for every worker: none may outlive the call
                future.exception()
        if failed:
            raise failed[0]


def chunks(n: int, parts: int) -> list[range]:
    """range(n) cut into ``parts`` contiguous ranges of near-equal length (empty ones dropped)."""
    size = math.ceil(n / max(parts, 1)) if n else 1
    return [range(start, min(start + size, n)) for start in range(0, n, size)]
