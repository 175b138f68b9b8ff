#!/usr/bin/env python3
"""A representative set of CUDA forward and backward calls, small enough to run under
compute-sanitizer (see tests/gpu/sanitize.sh, which runs this script under each tool).

    python tests/gpu/sanitize_cases.py [--quick] [--portable] [--only SUBSTR] [--jobs N] [--list]

Every case runs through ``flashcupy`` with ``backend="cuda"`` on lengths that are not tile
multiples (Lq=37, Lk=53 and friends), synchronizes the device and prints one line. The
script exits 0 when every case ran (no result checks: correctness is pytest's job; this is
about memory errors, races and barriers), 1 when a case raised.

--portable   sets FLASHCUPY_FORCE_PORTABLE=1 (the SIMT kernels of GPUs before sm_80) and runs
             the portable subset.
--quick      a smaller subset (one case per kernel family), for racecheck.
--jobs N     run the cases on N threads (warm-up: NVRTC compiles in parallel). Keep 1 under a
             sanitizer.
--list       print the selected case names and exit (no GPU needed).

Environment: FLASHCUPY_NO_POOL=1 disables CuPy's memory pools, so every array is its own
cudaMalloc (initcheck and memcheck then see real allocation bounds and first writes).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - flashcupy depends on ml_dtypes
    BF16 = None

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)

# The checkout's flashcupy when run from anywhere.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


@dataclass
class Case:
    """One call: shapes, dtype, options; which subsets it belongs to."""

    name: str
    dtype: Any = F16
    batch: int = 2
    hq: int = 2
    hk: int = 2
    lq: int = 37
    lk: int = 53
    d: int = 64
    dv: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    backward: bool = True
    bias_grad: bool = False
    deterministic: bool = False
    varlen: tuple[list[int], list[int]] | None = None  # (q lengths, kv lengths) of packed sequences
    layout_blhd: bool = False  # q, k, v as (B, L, H, D) arrays seen as (B, H, L, D)
    quick: bool = False
    portable: bool = False  # also in the --portable pass
    portable_quick: bool = False

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode())


def make_cases() -> list[Case]:
    """The case list. Options holding arrays are built from a per-case generator at run time
    (``options`` values that are callables taking (rng, case) are evaluated then)."""
    mask = lambda rs, c: rs.random((c.lq, c.lk)) < 0.7
    bias_b = lambda rs, c: rs.standard_normal((1, c.hq, c.lq, c.lk)).astype(c.dtype)
    bias_hb = lambda rs, c: rs.standard_normal((c.lq, c.lk)).astype(np.float32)
    slopes = lambda rs, c: rs.uniform(0.0, 0.5, (c.hq,))
    block_mask = lambda rs, c: rs.random((c.hq, -(-c.lq // 16), -(-c.lk // 16))) < 0.6
    cases = [
        # one per dtype / warp product
        Case("float16", F16, quick=True, portable=True, portable_quick=True),
        Case("bfloat16", BF16, portable=True),
        Case("float32", F32, quick=True, portable=True, portable_quick=True),
        Case("float32 allow_tf32", F32, options={"allow_tf32": True}, quick=True),
        Case("float64", F64, quick=True, portable=True, portable_quick=True),
        # causal, both alignments (Lq != Lk, so they differ)
        Case("float16 causal bottom_right", options={"causal": True}, portable=True),
        Case("bfloat16 causal top_left", BF16, options={"causal": "top_left"}, quick=True),
        Case("float64 causal top_left", F64, options={"causal": "top_left"}),
        # full score pipeline
        Case("float16 mask", options={"mask": mask}),
        Case("float16 bias broadcast, bias_grad", options={"bias": bias_b}, bias_grad=True, quick=True,
             portable=True, portable_quick=True),
        Case("float32 bias (Lq, Lk) float32, bias_grad", F32, options={"bias": bias_hb}, bias_grad=True),
        Case("bfloat16 dropout", BF16, options={"dropout_p": 0.2, "seed": 1234, "dropout_offset": 3}, portable=True),
        Case("float64 dropout causal", F64, options={"dropout_p": 0.3, "seed": 2**40 + 7, "causal": True}),
        Case("float16 block_mask", options={"block_mask": block_mask, "block_size": 16}),
        Case("bfloat16 window+softcap+alibi", BF16,
             options={"window": (7, 3), "softcap": 5.0, "alibi_slopes": slopes}, quick=True),
        Case("float32 window+softcap+alibi", F32, options={"window": (None, 2), "softcap": 3.0, "alibi_slopes": slopes},
             portable=True),
        # heads
        Case("float16 GQA 4:2", hq=4, hk=2, options={"causal": True}),
        Case("bfloat16 MQA 3:1", BF16, hq=3, hk=1),
        # lengths
        Case("float16 padded lengths", options={"q_lengths": np.array([37, 5]), "kv_lengths": np.array([20, 53]),
                                                "causal": True}, portable=True),
        Case("float16 varlen causal dropout", varlen=([37, 0, 20], [53, 11, 0]),
             options={"causal": True, "dropout_p": 0.1, "seed": 9}, quick=True, portable=True),
        Case("float64 varlen", F64, varlen=([5, 31], [53, 1])),
        # deterministic backward (broadcast bias: the dbias reduction path)
        Case("float16 deterministic, bias broadcast", options={"bias": bias_hb}, bias_grad=True, deterministic=True),
        Case("float32 deterministic", F32, options={"causal": True}, deterministic=True),
        # head dims that are not 16-byte rows; Dv != D
        Case("float16 D=59 Dv=40", d=59, dv=40, quick=True, portable=True, portable_quick=True),
        Case("float32 D=59 Dv=24", F32, d=59, dv=24),
        Case("float64 D=59 Dv=96", F64, d=59, dv=96),
        Case("bfloat16 D=130 Dv=8", BF16, d=130, dv=8),
        # odd lengths
        Case("float16 Lq=130 Lk=1", lq=130, lk=1, quick=True, portable=True),
        Case("float64 Lq=130 Lk=1", F64, lq=130, lk=1),
        Case("float16 Lq=1 Lk=130 causal", lq=1, lk=130, options={"causal": True}),
        # strided (B, L, H, D) layout
        Case("bfloat16 (B, L, H, D) layout", BF16, layout_blhd=True, options={"causal": True}),
    ]
    return [c for c in cases if c.dtype is not None]


def select(cases: list[Case], quick: bool, portable: bool, only: str | None) -> list[Case]:
    if portable:
        cases = [c for c in cases if (c.portable_quick if quick else c.portable)]
    elif quick:
        cases = [c for c in cases if c.quick]
    if only:
        cases = [c for c in cases if only.lower() in c.name.lower()]
    return cases


# --------------------------------------------------------------------------- running


def _array(rs: np.random.Generator, shape: tuple[int, ...], dtype, blhd: bool = False) -> np.ndarray:
    if blhd and len(shape) == 4:
        b, h, l, d = shape
        return rs.standard_normal((b, l, h, d)).astype(dtype).swapaxes(1, 2)
    return rs.standard_normal(shape).astype(dtype)


def _to_device(xp, x: np.ndarray):
    """A device copy keeping a swapped-axes view a strided view."""
    if x.ndim == 4 and not x.flags.c_contiguous:
        return xp.asarray(np.ascontiguousarray(x.swapaxes(1, 2))).swapaxes(1, 2)
    return xp.asarray(x)


def run_case(c: Case, fc, xp, sync: Callable[[], None], backend: str = "cuda") -> str:
    """Run one case on ``backend`` with arrays of module ``xp`` (cupy; numpy for a CPU dry run),
    calling ``sync`` after each call; returns a short description of what ran."""
    rs = np.random.default_rng(c.seed)
    dv = c.d if c.dv is None else c.dv
    options = {n: (f(rs, c) if callable(f) else f) for n, f in c.options.items()}
    options = {n: (xp.asarray(x) if n in ("mask", "bias", "block_mask") else x) for n, x in options.items()}
    done = []
    if c.varlen is not None:
        ql, kl = (np.asarray(x) for x in c.varlen)
        cu_q = np.concatenate([[0], np.cumsum(ql)]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum(kl)]).astype(np.int32)
        q = xp.asarray(_array(rs, (c.hq, int(cu_q[-1]), c.d), c.dtype))
        k = xp.asarray(_array(rs, (c.hk, int(cu_k[-1]), c.d), c.dtype))
        v = xp.asarray(_array(rs, (c.hk, int(cu_k[-1]), dv), c.dtype))
        dout = xp.asarray(_array(rs, (c.hq, int(cu_q[-1]), dv), c.dtype))
        out = fc.flash_attention_varlen(q, k, v, cu_q, cu_k, backend=backend, **options)
        sync()
        done.append("varlen fwd")
        if c.backward:
            out2, vjp = fc.flash_attention_vjp(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, backend=backend,
                                               **options)
            grads = vjp(dout)
            sync()
            done.append("vjp")
            del out2, vjp, grads
        del q, k, v, dout, out
        return ", ".join(done)
    q = _to_device(xp, _array(rs, (c.batch, c.hq, c.lq, c.d), c.dtype, c.layout_blhd))
    k = _to_device(xp, _array(rs, (c.batch, c.hk, c.lk, c.d), c.dtype, c.layout_blhd))
    v = _to_device(xp, _array(rs, (c.batch, c.hk, c.lk, dv), c.dtype, c.layout_blhd))
    dout = xp.asarray(_array(rs, (c.batch, c.hq, c.lq, dv), c.dtype))
    out, lse = fc.flash_attention_forward(q, k, v, backend=backend, **options)
    sync()
    done.append("fwd")
    if c.backward:
        grads = fc.flash_attention_backward(dout, q, k, v, out, lse, bias_grad=c.bias_grad,
                                            deterministic=c.deterministic, backend=backend, **options)
        sync()
        done.append("bwd" + (" +dbias" if c.bias_grad else "") + (" deterministic" if c.deterministic else ""))
        del grads
    del q, k, v, dout, out, lse, options
    return ", ".join(done)


def _release(cupy) -> None:
    """Free every device allocation this process still holds (memcheck's leak check runs at exit)."""
    gc.collect()
    cupy.cuda.Device().synchronize()
    cupy.get_default_memory_pool().free_all_blocks()
    cupy.get_default_pinned_memory_pool().free_all_blocks()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small subset (one case per kernel family)")
    parser.add_argument("--portable", action="store_true", help="force the portable SIMT kernels (second pass)")
    parser.add_argument("--only", metavar="SUBSTR", help="only cases whose name contains SUBSTR")
    parser.add_argument("--jobs", type=int, default=1, help="run cases on this many threads (warm-up only)")
    parser.add_argument("--list", action="store_true", help="print the selected case names and exit")
    parser.add_argument("--backend", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of the case list on NumPy arrays (no GPU needed)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs: expected an int >= 1")

    cases = select(make_cases(), args.quick, args.portable, args.only)
    label = ("portable" if args.portable else "normal") + (" quick" if args.quick else "")
    if args.list:
        for c in cases:
            print(c.name)
        print(f"{len(cases)} cases ({label})")
        return 0
    if not cases:
        print("no case selected", file=sys.stderr)
        return 2

    if args.portable:
        os.environ["FLASHCUPY_FORCE_PORTABLE"] = "1"  # read at each kernel choice
    import flashcupy as fc

    if args.backend == "cpu":
        xp, sync, release = np, (lambda: None), (lambda: gc.collect())
        print(f"sanitize_cases: {len(cases)} cases ({label}) on the CPU backend (dry run)", flush=True)
    else:
        import cupy

        if os.environ.get("FLASHCUPY_NO_POOL") == "1":
            cupy.cuda.set_allocator(None)
            cupy.cuda.set_pinned_memory_allocator(None)
        xp, sync, release = cupy, (lambda: cupy.cuda.Device().synchronize()), (lambda: _release(cupy))
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        pool = "off" if os.environ.get("FLASHCUPY_NO_POOL") == "1" else "on"
        print(f"sanitize_cases: {len(cases)} cases ({label}) on device {dev.id} {name} "
              f"sm_{props['major']}{props['minor']}, memory pool {pool}", flush=True)

    failures = 0
    start = time.perf_counter()

    def one(c: Case) -> tuple[Case, str, float, BaseException | None]:
        t0 = time.perf_counter()
        try:
            what = run_case(c, fc, xp, sync, args.backend)
            return c, what, time.perf_counter() - t0, None
        except BaseException as exc:  # noqa: BLE001 - reported per case
            return c, traceback.format_exc(), time.perf_counter() - t0, exc

    def report(result: tuple[Case, str, float, BaseException | None]) -> None:
        nonlocal failures
        c, what, seconds, exc = result
        if exc is None:
            print(f"ok    {c.name:42s} {what}  ({seconds:.2f} s)", flush=True)
        else:
            failures += 1
            print(f"FAIL  {c.name:42s} {type(exc).__name__}: {exc}  ({seconds:.2f} s)", flush=True)
            print(what, file=sys.stderr, flush=True)

    if args.jobs == 1:
        for c in cases:
            report(one(c))
    else:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for result in pool.map(one, cases):
                report(result)
    released = True
    try:
        release()
    except Exception as exc:  # noqa: BLE001 - e.g. a sticky CUDA error after a failed case
        print(f"sanitize_cases: releasing device memory failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        released = False
    total = time.perf_counter() - start
    print(f"sanitize_cases: {len(cases) - failures}/{len(cases)} ran ({label}) in {total:.1f} s", flush=True)
    return 1 if failures or not released else 0


if __name__ == "__main__":
    sys.exit(main())
