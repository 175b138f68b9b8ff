"""Every forward and backward kernel specialisation compiles with NVRTC, without spills,
for sm_75..sm_90 (the portable SIMT kernels: for sm_75 and sm_90, see SIMT_ARCHS).

No GPU is needed: NVRTC compiles to SASS for a named architecture (``compile_for_arch``)
and ptxas' ``--verbose`` report gives each entry function's stack frame, spill stores,
spill loads and registers. One test per (family, architecture) compiles every kernel of
``all_forward_specs(arch)`` or ``all_backward_specs(arch)``.

SIMT kernels are the only path before sm_80, and on sm_80+ run only when
FLASHCUPY_FORCE_PORTABLE=1 forces them; their source takes one branch on every sm_80+
architecture (cp.async), so they are compiled for sm_75 and sm_90 only: 1117 kernels
instead of about 1600, a third less of CI's compile time, which is most of its 20 minutes.

Requirements: ``pip install '.[nvrtc]'`` (cupy-cuda12x, nvidia-cuda-nvrtc-cu12 and
nvidia-cuda-runtime-cu12, whose include/ folder holds cuda_fp16.h and friends; a CUDA
toolkit's ``$CUDA_PATH/include`` works as well). Without them the tests skip, unless
``FLASHCUPY_REQUIRE_NVRTC=1`` (CI sets it), which turns the skip into a failure.

NVRTC's lowered names are not returned by ``compile_for_arch``, so entries are matched
to specs by count (exactly one entry per spec) and by demangling each entry with
libstdc++'s ``__cxa_demangle`` into ``void <name_expression>(flash::Params)`` (or
``flash::BwdParams``)
(without a demangler: by count, the policy read from the mangled name). Tensor-core
entries (mma16, wgmma, tf32, dmma) must have no stack frame and no spills. SIMT entries are
checked too; a SIMT spill is reported as a warning (visible in pytest's warnings
summary) rather than failing the test. On failure, the assertion message holds the
table of registers, stack frame and spills of every entry.

The (family, architecture) pairs compile in parallel, started once per module for all the
pairs selected, since each takes minutes on two cores: every pair's kernels in PARTS NVRTC
programs (more, smaller jobs keep the workers busy to the end), on up to MAX_WORKERS worker
processes, one per CPU core (each NVRTC process peaks near 2.5 GB).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import ctypes.util
import os
import re
import warnings
from typing import NamedTuple

import pytest

from flashcupy.cuda.compile import compile_for_arch, cuda_include_dirs

ARCHS = (75, 80, 86, 89, 90)
TENSOR_CORE_POLICIES = ("mma16", "wgmma", "tf32", "tf32x3", "dmma")
FAMILIES = ("forward", "backward")
REQUIRE_ENV = "FLASHCUPY_REQUIRE_NVRTC"
MAX_WORKERS = 4
SIMT_ARCHS = (75, 90)
PARTS = 2

_COMPILING = re.compile(r"Compiling entry function '(?P<name>[^']+)' for 'sm_(?P<arch>\d+)a?'")
_PROPERTIES = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, (?P<loads>\d+) bytes spill loads"
)
_REGISTERS = re.compile(r"Used (?P<regs>\d+) registers")


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


def parse_ptxas(log: str) -> list[dict]:
    """One dict per entry function in ptxas' verbose report, in report order."""
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


def _canonical(signature: str) -> str:
    return re.sub(r"\s+", "", signature)


class Kernel(NamedTuple):
    """One compiled entry function: its NVRTC name expression, warp policy and parameter block."""

    name_expression: str
    policy: str
    params: str


def kernels(family: str, arch: int) -> list[Kernel]:
    """Every kernel the dispatcher can launch on ``arch`` for a source family (SIMT ones only
    for SIMT_ARCHS)."""
    from flashcupy.cuda.spec import all_backward_specs, all_forward_specs

    if family == "forward":
        found = [Kernel(s.name_expression, s.policy, "flash::Params") for s in all_forward_specs(arch)]
    else:
        unique = {}
        for s in all_backward_specs(arch):
            for name, _ in s.kernels:  # the delta kernel and the dQ converter have no matrix products
                products = not name.startswith(("flash::flash_bwd_delta<", "flash::flash_bwd_dq_convert<"))
                unique[name] = Kernel(name, s.policy if products else "none", "flash::BwdParams")
        found = sorted(unique.values())
    return [k for k in found if k.policy != "simt" or arch in SIMT_ARCHS]


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


@pytest.fixture(scope="module")
def compiled(request):
    """{(family, arch): futures of compile_for_arch's logs, one per part}, for every pair the
    session selected."""
    problem = nvrtc_problem()
    if problem is not None:
        _unavailable(problem)
    wanted = {(item.callspec.params["family"], item.callspec.params["arch"]) for item in request.session.items
              if item.module is request.module and hasattr(item, "callspec") and "arch" in item.callspec.params}
    jobs = []  # (family, arch, names of one part)
    for family, arch in wanted:
        names = [k.name_expression for k in kernels(family, arch)]
        jobs += [(family, arch, names[i::PARTS]) for i in range(PARTS) if names[i::PARTS]]
    jobs.sort(key=lambda job: -len(job[2]))  # largest first: the workers finish together
    workers = max(1, min(MAX_WORKERS, os.cpu_count() or 1, len(jobs)))
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers) as pool:
        futures: dict[tuple[str, int], list] = {}
        for family, arch, names in jobs:
            futures.setdefault((family, arch), []).append(pool.submit(compile_for_arch, family, names, arch))
        yield futures
        for parts in futures.values():
            for future in parts:
                future.cancel()


@pytest.mark.parametrize("arch", ARCHS, ids=[f"sm_{a}" for a in ARCHS])
@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_compile_without_spills(compiled, family, arch):
    from flashcupy.cuda.spec import ARCH_SMEM

    assert arch in ARCH_SMEM
    specs = kernels(family, arch)
    assert specs, f"no {family} kernels for sm_{arch}"
    if (family, arch) in compiled:
        log = "\n".join(part.result() for part in compiled[family, arch])  # KernelCompileError carries NVRTC's log
    else:  # not among the items the fixture saw (another plugin's selection): compile here
        log = compile_for_arch(family, [s.name_expression for s in specs], arch)

    entries = parse_ptxas(log)
    matched = match_entries(entries, specs)
    rows = [(s.name_expression.removeprefix("flash::") if s else e["name"], e) for e, s in zip(entries, matched)]
    table = register_table(arch, rows)

    assert len(entries) == len(specs), (
        f"sm_{arch}: ptxas compiled {len(entries)} entry functions for {len(specs)} specs\n{table}"
    )
    assert all(e["arch"] == arch for e in entries), table
    incomplete = [e["name"] for e in entries if None in (e["stack"], e["stores"], e["loads"], e["regs"])]
    assert not incomplete, f"sm_{arch}: ptxas report incomplete for {incomplete}\n{table}"
    unmatched = [e["name"] for e, s in zip(entries, matched) if s is None]
    assert not unmatched, f"sm_{arch}: entries matching no spec's name_expression: {unmatched}\n{table}"
    if not isinstance(matched[0], _PolicyOnly):
        assert len(set(map(id, matched))) == len(specs), f"sm_{arch}: some spec compiled twice\n{table}"

    spilled = [s for e, s in zip(entries, matched) if (e["stack"], e["stores"], e["loads"]) != (0, 0, 0)]
    strict = (*TENSOR_CORE_POLICIES, "tensor-core")  # "tensor-core": the no-demangler stand-in
    simt = [s.name_expression for s in spilled if s.policy not in strict]
    tensor_core = [s.name_expression for s in spilled if s.policy in strict]
    if simt:
        warnings.warn(
            f"sm_{arch}: {len(simt)} SIMT kernel(s) use local memory (stack frame or spills): " + "; ".join(simt),
            stacklevel=1,
        )
    assert not tensor_core, (
        f"sm_{arch}: {len(tensor_core)} tensor-core kernel(s) ({', '.join(TENSOR_CORE_POLICIES)}) with a stack "
        f"frame or spills: " + "; ".join(tensor_core) + f"\n{table}"
    )
