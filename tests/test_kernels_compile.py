"""Every kernel the dispatcher can return compiles with NVRTC, without spills, for sm_75..sm_90.

No GPU is needed: NVRTC compiles to SASS for a named architecture (``compile_for_arch``) and
ptxas' ``--verbose`` report gives each entry function's registers, stack frame, spill stores
and spill loads. Tensor-core entries (mma16, wgmma, tf32, tf32x3, dmma) must have no stack
frame and no spills; a SIMT entry that uses local memory is a warning (pytest's warnings
summary). On failure the message holds the table of every entry's figures.

Two tiers:

- **The matrix** (marker ``compile_matrix``, left out of the default run; ``.ci/run`` runs it):
  every kernel of ``all_forward_specs(arch)`` and ``all_backward_specs(arch)`` for every arch of
  ``ARCH_SMEM``, compiled once per architecture class (:data:`CLASSES`), in parallel over the
  machine's cores, with a progress line every half minute.
- **The representative check** (default run): per class and family, one kernel per pipeline,
  the cheapest (smallest head dim), compiled to machine code, so that a source that no longer
  compiles anywhere fails in seconds.

Architecture classes. A class compiles its kernels for one architecture on behalf of its
members where ptxas' reports agree: sm_86 and sm_89 (the same kernel set, and the same
registers, stack frame and spills kernel by kernel for every kernel, measured when the
classes were drawn). The matrix also recompiles a sample of each multi-member class for its
other members and fails if a report differs, so the classes cannot silently stop agreeing.

The portable SIMT kernels (the only path before sm_80; on sm_80+ only under
FLASHCUPY_FORCE_PORTABLE=1) are two classes: sm_75, and every sm_80+ set at once (their source
takes one branch, cp.async, on every sm_80+ architecture). Their spills only warn, and their
machine code is two thirds of all the NVRTC work, so the matrix puts every one of them through
NVRTC's front end (``-fdevice-syntax-only``: each template instantiated, every static_assert
checked, in milliseconds) and compiles to machine code, with ptxas' report, the widest of each
variant (dtype, entry, options compiled in: the largest head dim, where registers run out
first); the default run compiles the narrowest.

Requirements: ``pip install '.[nvrtc]'`` (cupy-cuda12x, nvidia-cuda-nvrtc-cu12 and
nvidia-cuda-runtime-cu12, whose include/ folder holds cuda_fp16.h and friends; a CUDA
toolkit's ``$CUDA_PATH/include`` works as well). Without them the tests skip, unless
``FLASHCUPY_REQUIRE_NVRTC=1`` (CI sets it), which turns the skip into a failure.

Entries are matched to kernels by demangling each entry with libstdc++'s ``__cxa_demangle``
into ``void <name_expression>(flash::Params)`` (or ``flash::BwdParams``); without a
demangler, by count, the SIMT policy read from the mangled name.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import os
import re
import threading
import time
import warnings
from typing import NamedTuple

import pytest

from flashcupy.cuda.compile import compile_for_arch, cuda_include_dirs, kernel_dir, parse_ptxas
from flashcupy.cuda.spec import EVERY_OPTION

ARCHS = (75, 80, 86, 89, 90)
TENSOR_CORE_POLICIES = ("mma16", "wgmma", "wgmma_tf32x3", "tf32", "tf32x3", "dmma")
FAMILIES = ("forward", "backward")
REQUIRE_ENV = "FLASHCUPY_REQUIRE_NVRTC"
#: Kernels per NVRTC program of the matrix: small enough that the workers finish together.
CHUNK = 12
#: Kernels per family recompiled for each other member of a class to check that they agree.
AGREEMENT_SAMPLE = 6
#: Peak memory of one NVRTC process on the largest programs, to bound the workers.
NVRTC_PEAK_BYTES = 2.5 * 2**30
#: Seconds between the matrix's progress lines.
PROGRESS_SECONDS = 30


class ArchClass(NamedTuple):
    """Architectures whose kernels compile once, for ``arch``: every kernel of the members'
    sets whose policy is SIMT (``simt`` True) or not (False), or all of them (None); all to
    machine code, or (``front_end``) all through NVRTC's front end and the widest of each
    variant to machine code."""

    name: str
    arch: int
    members: tuple[int, ...]
    simt: bool | None
    front_end: bool = False


CLASSES = (
    ArchClass("sm_75", 75, (75,), None, front_end=True),  # SIMT only: no tensor-core kernels before sm_80
    ArchClass("sm_80", 80, (80,), False),
    ArchClass("sm_86+sm_89", 86, (86, 89), False),
    ArchClass("sm_90", 90, (90,), False),
    ArchClass("simt-sm_80-to-sm_90", 80, (80, 86, 89, 90), True, front_end=True),
)
CLASS_IDS = [c.name for c in CLASSES]
#: Classes compiled to machine code whose members share ptxas' reports.
AGREEING = [c for c in CLASSES if len(c.members) > 1 and not c.front_end]
MACHINE_CODE = [c for c in CLASSES if not c.front_end]
FRONT_END = [c for c in CLASSES if c.front_end]


def _unavailable(reason: str):
    """Skip, or fail when FLASHCUPY_REQUIRE_NVRTC=1 so CI can never skip silently."""
    if os.environ.get(REQUIRE_ENV, "0") == "1":
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1 requires the NVRTC compile check; pip install '.[nvrtc]')")
    pytest.skip(f"{reason}; pip install '.[nvrtc]' to compile the kernels without a GPU")


def nvrtc_problem() -> str | None:
    """Why NVRTC cannot be used here, or None when it can."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except Exception as exc:  # noqa: BLE001 - ImportError, or CuPy failing to load a CUDA library
        return f"CuPy's NVRTC bindings are unavailable ({type(exc).__name__}: {exc})"
    try:
        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001 - the NVRTC shared library is missing
        return f"the NVRTC library cannot be loaded ({type(exc).__name__}: {exc})"
    if not cuda_include_dirs():
        return "no CUDA runtime headers (nvidia-cuda-runtime-cu12's include/ or $CUDA_PATH/include)"
    return None


def _cxa_demangle():
    """libstdc++'s demangler through ctypes, or None where it cannot be loaded."""
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        demangle = lib.__cxa_demangle
        free = ctypes.CDLL(None).free
    except (OSError, AttributeError):
        return None
    demangle.restype = ctypes.c_void_p
    demangle.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    free.argtypes = [ctypes.c_void_p]

    def run(name: str) -> str | None:
        status = ctypes.c_int(-1)
        out = demangle(name.encode(), None, None, ctypes.byref(status))
        if status.value != 0 or not out:
            return None
        try:
            return ctypes.string_at(out).decode()
        finally:
            free(out)

    return run


def _score_mod_bits() -> dict[str, int]:
    """flash::ScoreMod's constants (kernels_cu/score/modifiers.cuh): {"kModBias": 2, ...}."""
    text = (kernel_dir() / "score" / "modifiers.cuh").read_text()
    return {name: int(value) for name, value in re.findall(r"\b(kMod\w+) = (\d+)u,", text)}


def _canonical(signature: str) -> str:
    """A signature without spaces, its score option sets written as the demangler writes
    them: flash::PlainScores and flash::ScoreMods<flash::kModA | flash::kModB[, T]> as
    flash::ScoreMods<Nu, T> (N the bits' sum, T void without a bias)."""
    bits = _score_mod_bits()

    def numeric(m: re.Match) -> str:
        names, bias = m.group(1).split(","), m.group(2) or "void"
        return f"flash::ScoreMods<{sum(bits[n.strip().removeprefix('flash::')] for n in names[0].split('|'))}u,{bias}>"

    signature = re.sub(r"\s+", "", signature).replace("flash::PlainScores", "flash::ScoreMods<0u,void>")
    return re.sub(r"flash::ScoreMods<((?:flash::kMod\w+\|?)+)(?:,([\w:]+))?>", numeric, signature)


class Kernel(NamedTuple):
    """One compiled entry function: its NVRTC name expression, warp policy, parameter block,
    padded head dim and dtype."""

    name_expression: str
    policy: str
    params: str
    head_dim: int
    dtype: str
    full: bool

    @property
    def entry(self) -> str:
        """The kernel template: flash::flash_fwd, flash::flash_bwd_dkdv, ..."""
        return self.name_expression.split("<", 1)[0]


def kernels(family: str, arch: int) -> list[Kernel]:
    """Every kernel the dispatcher can launch on ``arch`` for a source family, each once."""
    from flashcupy.cuda.spec import all_backward_specs, all_forward_specs

    unique = {}
    if family == "forward":
        for s in all_forward_specs(arch):
            unique[s.name_expression] = Kernel(s.name_expression, s.policy, "flash::Params", s.head_dim, s.dtype,
                                               s.full)
            unique.update({m.name: Kernel(m.name, "none", "flash::Params", 0, "none", True) for m in s.tile_maps})
        return sorted(unique.values())
    for s in all_backward_specs(arch):
        for name, _ in s.kernels:  # the delta kernel and the dQ converter have no matrix products
            products = not name.startswith(("flash::flash_bwd_delta<", "flash::flash_bwd_dq_convert<"))
            unique[name] = Kernel(name, s.policy if products else "none", "flash::BwdParams", s.head_dim, s.dtype,
                                  s.full)
        unique.update({m.name: Kernel(m.name, "none", "flash::BwdParams", 0, "none", True) for m in s.tile_maps})
    return sorted(unique.values())


def _in_class(kernel: Kernel, cls: ArchClass, arch: int) -> bool:
    """Whether ``cls`` compiles ``kernel`` of ``arch``'s set: SIMT kernels in the SIMT class,
    the others (kernels without matrix products too) in the other, where the arch has one."""
    if arch not in cls.members:
        return False
    if cls.simt is None:
        return True
    return (kernel.policy == "simt") == cls.simt


def class_kernels(family: str, cls: ArchClass) -> list[Kernel]:
    """The kernels ``cls`` compiles for a family: its members' kernels of its kind, each once."""
    found = {}
    for arch in cls.members:
        for k in kernels(family, arch):
            if _in_class(k, cls, arch):
                found.setdefault(k.name_expression, k)
    return sorted(found.values())


def representatives(family: str, cls: ArchClass) -> list[Kernel]:
    """One kernel per pipeline (policy) of the class: the one with the smallest head dim."""
    best: dict[str, Kernel] = {}
    for k in class_kernels(family, cls):
        if k.policy != "none" and (k.policy not in best or (k.head_dim, k) < (best[k.policy].head_dim, best[k.policy])):
            best[k.policy] = k
    return sorted(best.values())


def widest(family: str, cls: ArchClass) -> list[Kernel]:
    """Per variant (dtype, entry, options compiled in), the kernel of the largest head dim."""
    best: dict[tuple, Kernel] = {}
    for k in class_kernels(family, cls):
        variant = (k.dtype, k.entry, k.full)
        if variant not in best or (-k.head_dim, k) < (-best[variant].head_dim, best[variant]):
            best[variant] = k
    return sorted(best.values())


def agreement_sample(family: str, cls: ArchClass) -> list[Kernel]:
    """Evenly spaced kernels of a class, recompiled for its other members."""
    found = class_kernels(family, cls)
    step = max(1, len(found) // AGREEMENT_SAMPLE)
    return found[::step][:AGREEMENT_SAMPLE]


def match_entries(entries: list[dict], specs: list[Kernel]) -> list:
    """The kernel of each entry, or None where it matches none.

    Demangled, an entry reads ``void <name_expression>(<params>)``. Without a demangler,
    only the policy is recovered (the SIMT policy's name in the mangled name), as a
    stand-in object, and the match is by count alone.
    """
    demangle = _cxa_demangle()
    if demangle is None:
        return [_PolicyOnly("simt" if "4Simt" in e["name"] else "tensor-core", e["name"]) for e in entries]
    by_signature = {_canonical(f"void {s.name_expression}({s.params})"): s for s in specs}
    out = []
    for e in entries:
        demangled = demangle(e["name"])
        out.append(by_signature.get(_canonical(demangled)) if demangled else None)
    return out


class _PolicyOnly:
    def __init__(self, policy: str, name: str):
        self.policy = policy
        self.name_expression = name


def register_table(arch: int, rows: list[tuple]) -> str:
    """ptxas' figures per entry: registers, stack frame, spill stores and loads (bytes)."""
    width = max([len(label) for label, _ in rows] + [4])
    lines = [f"sm_{arch} kernel{'':<{width - 6}}  regs  stack  spill-st  spill-ld"]
    for label, e in rows:
        lines.append(f"{label:<{width}}  {e['regs']!s:>4}  {e['stack']!s:>5}  {e['stores']!s:>8}  {e['loads']!s:>8}")
    return "\n".join(lines)


def check_report(log: str, specs: list[Kernel], arch: int) -> dict[str, dict]:
    """Assert that ptxas compiled each of ``specs`` once, for ``arch``, and that no tensor-core
    entry uses local memory (SIMT ones warn); returns each kernel's figures by name."""
    entries = parse_ptxas(log)
    matched = match_entries(entries, specs)
    rows = [(s.name_expression.removeprefix("flash::") if s else e["name"], e) for e, s in zip(entries, matched)]
    table = register_table(arch, rows)

    assert len(entries) == len(specs), (
        f"sm_{arch}: ptxas compiled {len(entries)} entry functions for {len(specs)} kernels\n{table}"
    )
    assert all(e["arch"] == arch for e in entries), table
    incomplete = [e["name"] for e in entries if None in (e["stack"], e["stores"], e["loads"], e["regs"])]
    assert not incomplete, f"sm_{arch}: ptxas report incomplete for {incomplete}\n{table}"
    unmatched = [e["name"] for e, s in zip(entries, matched) if s is None]
    assert not unmatched, f"sm_{arch}: entries matching no kernel's name_expression: {unmatched}\n{table}"
    if entries and not isinstance(matched[0], _PolicyOnly):
        assert len(set(map(id, matched))) == len(specs), f"sm_{arch}: some kernel compiled twice\n{table}"

    spilled = [s for e, s in zip(entries, matched) if (e["stack"], e["stores"], e["loads"]) != (0, 0, 0)]
    strict = (*TENSOR_CORE_POLICIES, "tensor-core")  # "tensor-core": the no-demangler stand-in
    simt = [s.name_expression for s in spilled if s.policy not in strict]
    tensor_core = [s.name_expression for s in spilled if s.policy in strict]
    # Every score option at once (the matrix's stand-in for every option set) still spills in
    # a few float64 and D = 128 kernels (bench/NOTES.md, 'Open: score options'): those warn,
    # every other tensor-core kernel fails the test.
    heavy = [name for name in tensor_core if EVERY_OPTION.cxx in name]
    tensor_core = [name for name in tensor_core if name not in heavy]
    for what, names in (("SIMT", simt), ("every-option tensor-core", heavy)):
        if names:
            warnings.warn(f"sm_{arch}: {len(names)} {what} kernel(s) use local memory (stack frame or spills): "
                          + "; ".join(names), stacklevel=2)
    assert not tensor_core, (
        f"sm_{arch}: {len(tensor_core)} tensor-core kernel(s) ({', '.join(TENSOR_CORE_POLICIES)}) with a stack "
        f"frame or spills: " + "; ".join(tensor_core) + f"\n{table}"
    )
    return {s.name_expression: {k: e[k] for k in ("regs", "stack", "stores", "loads")}
            for e, s in zip(entries, matched)}


def _compile(front_end: bool, family: str, names: list[str], arch: int) -> str:
    """One job of the pool: NVRTC's front end only, or machine code with ptxas' report (its log)."""
    return compile_for_arch(family, names, arch, front_end=front_end)


def _workers(jobs: int) -> int:
    """Processes for ``jobs`` NVRTC programs: one per core this process may use, fewer where
    memory would not hold that many NVRTC processes at their peak."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        pages = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        cores = min(cores, max(1, int(pages // NVRTC_PEAK_BYTES)))
    except (ValueError, OSError, AttributeError):
        pass
    return max(1, min(cores, jobs))


def _cost(names: list[str], simt: bool, front_end: bool) -> float:
    """A job's expected compile time in tensor-core kernels, for largest-first scheduling:
    a SIMT kernel takes about three times as long to machine code; the front end, nothing."""
    return len(names) * (0.01 if front_end else 3.0 if simt else 1.0)


def _selected(request, test_name: str) -> set[tuple[str, str]]:
    """(family, class name) of the items of ``test_name`` this session runs."""
    return {(item.callspec.params["family"], item.callspec.params["cls"].name) for item in request.session.items
            if item.module is request.module and item.originalname == test_name and hasattr(item, "callspec")}


class _Progress:
    """Kernels compiled so far, as a line on the terminal at most every PROGRESS_SECONDS and
    at the end (from the pool's callback threads)."""

    def __init__(self, request, total: int):
        self.reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        self.capture = request.config.pluginmanager.get_plugin("capturemanager")
        self.total, self.done = total, 0
        self.start = self.last = time.monotonic()
        self.lock = threading.Lock()

    def add(self, count: int) -> None:
        with self.lock:
            self.done += count
            now = time.monotonic()
            if self.reporter is None or (now - self.last < PROGRESS_SECONDS and self.done < self.total):
                return
            self.last = now
            line = f"compile matrix: {self.done} of {self.total} kernels compiled in {now - self.start:.0f} s"
            if self.capture is None:
                self.reporter.write_line(line)
                return
            with self.capture.global_and_fixture_disabled():  # past pytest's capture, as its own lines go
                self.reporter.write_line(line)


def _pooled(request, jobs: list[tuple[tuple, str, int, list[str], bool, bool]], progress: bool):
    """Generator of {key: [futures]} for ``jobs`` (key, family, arch, names, simt, front_end), all
    submitted at once to a process pool, largest first so that the cores stay busy to the
    end; what is still pending at the end is cancelled."""
    jobs = sorted(jobs, key=lambda job: -_cost(job[3], job[4], job[5]))
    counter = _Progress(request, sum(len(job[3]) for job in jobs)) if progress else None
    futures: dict[tuple, list] = {}
    with concurrent.futures.ProcessPoolExecutor(max_workers=_workers(len(jobs))) as pool:
        for key, family, arch, names, _, front_end in jobs:
            future = pool.submit(_compile, front_end, family, names, arch)
            if counter is not None:
                future.add_done_callback(lambda f, n=len(names): counter.add(n))
            futures.setdefault(key, []).append(future)
        yield futures
        for parts in futures.values():
            for future in parts:
                future.cancel()


def _chunks(key: tuple, family: str, arch: int, found: list[Kernel], simt: bool, front_end: bool) -> list[tuple]:
    """Jobs of CHUNK kernels each (the front end takes them all at once: it costs milliseconds)."""
    names = [k.name_expression for k in found]
    size = len(names) if front_end else CHUNK
    return [(key, family, arch, names[i:i + size], simt, front_end) for i in range(0, len(names), size)]


@pytest.fixture(scope="module")
def matrix(request):
    """Futures of the matrix items of the session: key (family, class name) for a class's
    kernels, in programs of CHUNK kernels (or the front end's one); ("widest", family, class
    name) for the widest SIMT kernels' machine code; (family, class name, member) for the
    agreement sample compiled for another member."""
    problem = nvrtc_problem()
    if problem is not None:
        _unavailable(problem)
    by_name = {c.name: c for c in CLASSES}
    whole = (_selected(request, "test_kernels_compile_without_spills")
             | _selected(request, "test_simt_kernels_instantiate"))
    jobs = []
    for family, name in whole:
        cls = by_name[name]
        jobs += _chunks((family, name), family, cls.arch, class_kernels(family, cls), bool(cls.simt), cls.front_end)
    for family, name in _selected(request, "test_widest_simt_kernels_compile_without_spills"):
        cls = by_name[name]
        jobs += _chunks(("widest", family, name), family, cls.arch, widest(family, cls), True, False)
    for family, name in _selected(request, "test_class_members_agree"):
        cls = by_name[name]
        sample = agreement_sample(family, cls)
        others = [m for m in cls.members if m != cls.arch or (family, name) not in whole]
        for member in others:
            jobs += _chunks((family, name, member), family, member, sample, False, False)
    yield from _pooled(request, jobs, progress=True)


@pytest.fixture(scope="module")
def representative(request):
    """Futures of the representative check's items of the session, key (family, class name)."""
    problem = nvrtc_problem()
    if problem is not None:
        _unavailable(problem)
    by_name = {c.name: c for c in CLASSES}
    jobs = []
    for family, name in _selected(request, "test_representative_kernels_compile_without_spills"):
        cls = by_name[name]
        found = [k.name_expression for k in representatives(family, cls)]
        jobs.append(((family, name), family, cls.arch, found, bool(cls.simt), False))
    yield from _pooled(request, jobs, progress=False)


def _results(futures: dict, key: tuple, front_end: bool, family: str, names: list[str], arch: int) -> list:
    """The compile results of ``names`` for ``arch``: from the fixture's futures (a
    KernelCompileError carries NVRTC's log), or compiled here when the fixture did not see
    the item."""
    if key in futures:
        return [future.result() for future in futures[key]]
    return [_compile(front_end, family, names, arch)]


def _log(futures: dict, key: tuple, family: str, names: list[str], arch: int) -> str:
    """ptxas' report of ``names`` compiled to machine code for ``arch``."""
    return "\n".join(_results(futures, key, False, family, names, arch))


@pytest.mark.compile_matrix
@pytest.mark.parametrize("cls", MACHINE_CODE, ids=[c.name for c in MACHINE_CODE])
@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_compile_without_spills(matrix, family, cls):
    from flashcupy.cuda.spec import ARCH_SMEM

    assert set(cls.members) <= set(ARCH_SMEM)
    specs = class_kernels(family, cls)
    assert specs, f"no {family} kernels in {cls.name}"
    check_report(_log(matrix, (family, cls.name), family, [s.name_expression for s in specs], cls.arch),
                 specs, cls.arch)


@pytest.mark.compile_matrix
@pytest.mark.parametrize("cls", FRONT_END, ids=[c.name for c in FRONT_END])
@pytest.mark.parametrize("family", FAMILIES)
def test_simt_kernels_instantiate(matrix, family, cls):
    """Every kernel of the class through NVRTC's front end for compute_<arch> (a failure
    raises KernelCompileError with NVRTC's log)."""
    specs = class_kernels(family, cls)
    assert specs, f"no {family} kernels in {cls.name}"
    _results(matrix, (family, cls.name), True, family, [s.name_expression for s in specs], cls.arch)


@pytest.mark.compile_matrix
@pytest.mark.parametrize("cls", FRONT_END, ids=[c.name for c in FRONT_END])
@pytest.mark.parametrize("family", FAMILIES)
def test_widest_simt_kernels_compile_without_spills(matrix, family, cls):
    """Per variant, the kernel of the largest head dim, to machine code for the class's arch,
    with ptxas' report (a SIMT spill warns)."""
    specs = widest(family, cls)
    check_report(_log(matrix, ("widest", family, cls.name), family, [s.name_expression for s in specs], cls.arch),
                 specs, cls.arch)


@pytest.mark.compile_matrix
@pytest.mark.parametrize("cls", AGREEING, ids=[c.name for c in AGREEING])
@pytest.mark.parametrize("family", FAMILIES)
def test_class_members_agree(matrix, family, cls):
    """A sample of the class's kernels gets from every member the report it gets from the
    class's arch (whose figures come from the whole class's compile when it ran)."""
    sample = agreement_sample(family, cls)
    names = [k.name_expression for k in sample]
    reports = {}
    for arch in cls.members:
        if arch == cls.arch and (family, cls.name) in matrix:
            specs = class_kernels(family, cls)
            whole = check_report(_log(matrix, (family, cls.name), family, [], arch), specs, arch)
            reports[arch] = {n: whole[n] for n in names}
        else:
            reports[arch] = check_report(_log(matrix, (family, cls.name, arch), family, names, arch), sample, arch)
    for member in cls.members:
        assert reports[member] == reports[cls.arch], (
            f"sm_{member} and sm_{cls.arch} disagree on {family} kernels of {cls.name}; split the class:\n"
            + "\n".join(f"{n}: sm_{member} {reports[member][n]}, sm_{cls.arch} {reports[cls.arch][n]}"
                        for n in names if reports[member][n] != reports[cls.arch][n]))


@pytest.mark.parametrize("cls", CLASSES, ids=CLASS_IDS)
@pytest.mark.parametrize("family", FAMILIES)
def test_representative_kernels_compile_without_spills(representative, family, cls):
    """The default run's quick check: each pipeline of each class, at its smallest head dim,
    to machine code for the class's arch."""
    specs = representatives(family, cls)
    assert specs, f"no {family} kernels in {cls.name}"
    names = [s.name_expression for s in specs]
    check_report(_log(representative, (family, cls.name), family, names, cls.arch), specs, cls.arch)


@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm_{a}" for a in ARCHS])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_kernel_is_in_one_class(family, arch):
    """The classes cover every kernel the dispatcher can return on each architecture, once."""
    from flashcupy.cuda.spec import ARCH_SMEM

    assert arch in ARCH_SMEM and set(ARCHS) == set(ARCH_SMEM)
    for k in kernels(family, arch):
        owners = [c.name for c in CLASSES if _in_class(k, c, arch)]
        assert len(owners) == 1, f"sm_{arch} {k.name_expression}: in classes {owners}"


@pytest.mark.compile_matrix
def test_wgmma_backward_takes_only_option_sets_that_compile_without_spills():
    """Every score option set the warpgroup dK/dV kernel admits (spec.wgmma_backward_takes), at
    each of its head dims, compiles for sm_90 without a spill; the matrix above compiles only
    the plain set and every option at once."""
    from itertools import combinations

    from flashcupy.cuda.spec import ARCH_SMEM, SCORE_MODS, WGMMA_BACKWARD_HEAD_DIMS, ScoreSet, select_backward

    specs = {}
    for d in WGMMA_BACKWARD_HEAD_DIMS:
        for size in range(1, len(SCORE_MODS) + 1):
            for mods in combinations(SCORE_MODS, size):
                scores = ScoreSet(mods, "float16" if "bias" in mods else None)
                spec = select_backward("float16", d, d, 90, ARCH_SMEM[90], scores=scores)
                if spec.policy == "wgmma":
                    specs[spec.dkdv_name] = Kernel(spec.dkdv_name, "wgmma", "flash::BwdParams", d, "float16", True)
    assert len(specs) > 3 * len(SCORE_MODS), sorted(specs)
    names = list(specs)
    chunks = [names[i:i + CHUNK] for i in range(0, len(names), CHUNK)]
    with concurrent.futures.ProcessPoolExecutor(max_workers=_workers(len(chunks))) as pool:
        logs = list(pool.map(_compile, [False] * len(chunks), ["backward"] * len(chunks), chunks, [90] * len(chunks)))
    check_report("".join(logs), list(specs.values()), 90)


@pytest.mark.compile_matrix
def test_every_option_set_instantiates_the_one_role_backward():
    """BackwardSpec.stages_scores and dkdv_smem_bytes mirror BwdWarp's Staged (which sets copy
    their bias and mask tiles, and the bytes), and flash_bwd_dkdv's static_assert compares the
    two: NVRTC's front end instantiates the one-role dK/dV kernel of every option set, each
    bias dtype, every dtype, head dim, TF32 and determinism choice, on sm_86 (the smallest
    shared memory: the most tile choices). The matrix above compiles only the plain set and
    every option at once."""
    from itertools import combinations

    from flashcupy.cuda import spec as S

    problem = nvrtc_problem()
    if problem:
        _unavailable(problem)
    arch, names = 86, set()
    for size in range(len(S.SCORE_MODS) + 1):
        for mods in combinations(S.SCORE_MODS, size):
            for bias in (("float16", "float32", "float64") if "bias" in mods else (None,)):
                for dtype in S.CXX_TYPE:
                    for d in S.HEAD_DIM_BUCKETS:
                        for tf32, deterministic in ((False, False), (False, True), (True, False)):
                            call = S.Call(dtype, d, arch, S.ARCH_SMEM[arch], tf32, False, S.ScoreSet(mods, bias),
                                          deterministic)
                            try:
                                spec = S.choose_backward(call).spec
                            except S.NoKernelError:  # wide float64 heads on sm_86: the CPU's
                                continue
                            if spec.mainloop == "BwdWarp":
                                names.add(spec.dkdv_name)
    assert len(names) > 1000, len(names)
    names = sorted(names)
    chunks = [names[i:i + 200] for i in range(0, len(names), 200)]
    with concurrent.futures.ProcessPoolExecutor(max_workers=_workers(len(chunks))) as pool:
        list(pool.map(_compile, [True] * len(chunks), ["backward"] * len(chunks), chunks, [arch] * len(chunks)))


def _decode_kernels(arch: int) -> list[str]:
    """The decode kernels (kernels_cu/flash_decode.cu) a call can reach on ``arch``: mma.sync
    for 16-bit on sm_80+ at every head-dim pair (cp.async copies, and on sm_90 tensor copies
    where both head dims are at least 64), the CUDA-core kernel for float32 and float64
    (and 16-bit before sm_80) at each row count, and the appends, named as
    decode.plan names them."""
    from flashcupy.cuda import decode
    from flashcupy.cuda.spec import CXX_TYPE

    dims = decode.HEAD_DIMS
    names = [f"flash::decode_append<{t}>" for t in CXX_TYPE.values()]
    for dtype, cxx in CXX_TYPE.items():
        if dtype in ("float16", "bfloat16") and arch >= 80:
            names += [f"flash::decode_split_mma<{cxx}, {hk}, {hv}, {str(tma).lower()}, "
                      f"{decode.mma_shape(hk, hv, tma)[1]}>"
                      for hk in dims for hv in dims for tma in (False, True) if not tma or (arch >= 90 and hk >= 64
                                                                                          and hv >= 64)]
        else:
            names += [f"flash::decode_split<{cxx}, {hk}, {hk}, {rows}, {decode.tile_shape(dtype, hk, hk, rows)[1]}>"
                      for hk in dims for rows in (1, 4, 16)]
    return names


def _check_decode(arch: int, names: list[str]) -> None:
    """Compile ``names`` (decode kernels) for ``arch`` in parallel programs of a few kernels:
    all compile, and the mma.sync ones with equal head dims have no stack frame or spills. The
    CUDA-core ones, and mma.sync ones of mixed head dims (D 32 with Dv 128 spills 4 bytes under
    NVRTC 12.9, a heuristic of ptxas that moving Q to shared memory only shifts to D 32 / 32),
    warn."""
    problem = nvrtc_problem()
    if problem:
        _unavailable(problem)
    programs = [names[i:i + 4] for i in range(0, len(names), 4)]
    with concurrent.futures.ThreadPoolExecutor(_workers(len(programs))) as pool:
        logs = list(pool.map(lambda part: compile_for_arch("decode", part, arch), programs))
    entries = [e for log in logs for e in parse_ptxas(log)]
    assert len(entries) == len(names)
    local = [e["name"] for e in entries if (e["stack"], e["stores"], e["loads"]) != (0, 0, 0)]
    equal = [n for n in local if re.search(r"decode_split_mma.*?Li(\d+)ELi\1E", n)]
    assert not equal, equal
    if local:
        warnings.warn(f"sm_{arch}: {len(local)} CUDA-core or mixed-head-dim decode kernel(s) use local memory: "
                      + "; ".join(local), stacklevel=2)


@pytest.mark.parametrize("arch", [75, 80, 90])
def test_decode_kernels_compile(arch):
    """The representative check: a few decode kernels of each path and the append."""
    names = _decode_kernels(arch)
    keep = ("decode_append<__half>", "decode_split_mma<__half, 64, 64, true,", "decode_split_mma<__half, 128, 128, false,",
            "decode_split_mma<__half, 128, 128, true,", "decode_split<float, 64, 64, 4,",
            "decode_split<__half, 64, 64, 1,")
    _check_decode(arch, [n for n in names if any(k in n for k in keep)])


@pytest.mark.compile_matrix
@pytest.mark.parametrize("arch", [80, 90])
def test_every_decode_kernel_compiles(arch):
    """Every decode kernel for sm_80 (sm_86 and sm_89 compile the same source paths) and sm_90.
    Not sm_75: its 64 KB of shared memory a block admits no decode kernel (decode.unsupported
    sends those calls to the general forward); the default run still compiles the file there."""
    _check_decode(arch, _decode_kernels(arch))
