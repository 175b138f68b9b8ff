"""flashcupy decoding against a key/value cache beside SDPA, FlexAttention and a device copy of
the same bytes, on one GPU (suite "decode").

    PYTHONPATH=. python bench/bench_decode.py [options]     # from the repository root
    python -m flashcupy bench --suite decode [options]     # the same
    python bench/bench_decode.py --dry-run                 # the plan: no GPU, torch or CuPy

Grid (issue "Decode and KV cache"): float16 and bfloat16; heads (Hq/Hk, D) 32/8 at D 128 (GQA)
and 32/32 at D 64 (MHA) (``--heads``); batch 1, 4, 16, 64; keys 1k, 4k, 16k, 64k, 128k; Lq 1 and
4; the cache contiguous (B, Hk, Lk, D) or paged (num_blocks, Hk, block_size, D) with block
sizes 16, 64 and 256, its blocks in a random order. Every sequence holds Lk valid keys, the
cache is exactly that long, no key is appended, and the Lq queries attend the whole cache
(non-causal: SDPA's is_causal aligns the triangle top-left, which is not decoding's). A cell
whose K and V exceed ``--max-cache-gib`` is skipped (listed under "skipped").

Systems (``--systems``): flashcupy (``flash_attention_with_kvcache`` on CuPy views of torch's
tensors on torch's stream; with ``block_table`` on the paged layout); sdpa-default (SDPA with
no backend forced, on the contiguous cache of the same keys, also in paged cells, where it
has no paged form: its best case; GQA both through ``enable_gqa`` and with the key/value heads
repeated, the faster kept, ``variant`` naming it); flex (FlexAttention under torch.compile
with ``enable_gqa``, contiguous cells); copy (torch's device copy of as many bytes as K and V
hold: the bandwidth a decode can hope for).

Correctness before timing: the first and the last (batch, query head) pairs of each system's
output against a float64 torch reference, by relative Frobenius error (2e-2); a system that
fails goes to "failures" (flashcupy) or "skipped" (the others) untimed.

Timing as bench_attention.py: CUDA events on torch's stream around each call, ``--warmup``
calls first, the median of ``--repeats``. Caches smaller than ROTATE_BYTES are drawn several
times and the calls take them in turn, so that K and V come from memory rather than L2.

Output: bench/results/<gpu>-<date>-decode.json (``--out``): gpu, date, commit, cupy, torch,
suite "decode", rows {system, dtype, D, Hq, Hk, B, Lq, Lk, layout, block_size, ms, gbps,
variant} (gbps: bytes of K and V read / time, in 1e9 bytes a second; block_size 0 for the
contiguous layout), skipped {..., reason}, failures {..., reason}. A table closes the run: per
cell, flashcupy's GB/s, SDPA's, their ratio and flashcupy's share of the copy's.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from bench_attention import (
    ITEMSIZE, TOLERANCE, add_run_arguments, attempt, release_memory, suite_document, time_calls, torch_stream_for_cupy,
)

SYSTEMS = ("flashcupy", "sdpa-default", "flex", "copy")
DTYPES = ("float16", "bfloat16")
#: The head layouts: name -> (Hq, Hk, D).
HEADS = {"gqa": (32, 8, 128), "mha": (32, 32, 64)}
LAYOUTS = ("contiguous", "paged")
#: Caches smaller than this are drawn ceil(ROTATE_BYTES / bytes) times (at most MAX_SETS) and
#: the calls take them in turn: several times an H100's or H200's 50-60 MB of L2.
ROTATE_BYTES = 256 * 2**20
MAX_SETS = 32
#: The (batch, query head) pairs checked against the reference: the first and the last.
CHECKED = ((0, 0), (-1, -1))


@dataclass(frozen=True)
class Cell:
    """One decode problem: q (B, Hq, Lq, D), a cache of Lk keys per sequence and Hk heads, laid
    out contiguous (block_size 0) or paged in blocks of block_size keys."""

    dtype: str
    D: int
    Hq: int
    Hk: int
    B: int
    Lq: int
    Lk: int
    layout: str
    block_size: int

    @property
    def cache_bytes(self) -> int:
        """Bytes of K and V: what a call must read (Dv = D)."""
        return 2 * self.B * self.Hk * self.Lk * self.D * ITEMSIZE[self.dtype]

    @property
    def sets(self) -> int:
        """How many caches the timed calls take in turn (see ROTATE_BYTES)."""
        return max(1, min(MAX_SETS, math.ceil(ROTATE_BYTES / self.cache_bytes)))

    @property
    def label(self) -> str:
        cache = "contiguous" if self.layout == "contiguous" else f"paged/{self.block_size}"
        return (f"{self.dtype} D={self.D} {self.Hq}/{self.Hk} B={self.B} Lq={self.Lq} Lk={self.Lk} "
                f"{cache}")


def build_cells(args: argparse.Namespace) -> tuple[list[Cell], list[tuple[Cell, str]]]:
    """(the cells to run, [(cell, why skipped)]) of the grid the arguments name."""
    cells, skipped = [], []
    limit = args.max_cache_gib * 2**30
    for dtype in args.dtypes:
        for heads in args.heads:
            hq, hk, d = HEADS[heads]
            for b in args.batches:
                for lk in args.keys:
                    for lq in args.queries:
                        for layout in args.layouts:
                            sizes = [0] if layout == "contiguous" else args.block_sizes
                            for bs in sizes:
                                cell = Cell(dtype, d, hq, hk, b, lq, lk, layout, bs)
                                if bs and lk % bs:
                                    skipped.append((cell, f"{lk} keys are not whole blocks of {bs}"))
                                elif cell.cache_bytes > limit:
                                    why = (f"K and V take {cell.cache_bytes / 2**30:.1f} GiB, "
                                           f"over --max-cache-gib {args.max_cache_gib:g}")
                                    skipped.append((cell, why))
                                else:
                                    cells.append(cell)
    return cells, skipped


def runs(system: str, cell: Cell) -> bool:
    """FlexAttention and the copy on the contiguous cells (the copy's bytes are the paged
    cells' too); flashcupy and SDPA on every cell."""
    return system not in ("flex", "copy") or cell.layout == "contiguous"


def block_table(batch: int, blocks: int, rng: np.random.Generator) -> np.ndarray:
    """(batch, blocks) int32: sequence b's logical block n is physical block table[b, n], every
    physical block of the batch * blocks used once, in a random order."""
    return rng.permutation(batch * blocks).astype(np.int32).reshape(batch, blocks)


# --------------------------------------------------------------------------- inputs


@dataclass
class Inputs:
    """One cache set of a cell: q and the contiguous K and V as torch tensors; the paged K and V
    and the block table where the cell is paged (else None)."""

    q: Any
    k: Any
    v: Any
    k_paged: Any
    v_paged: Any
    table: Any


def paged(x: Any, table: np.ndarray, block_size: int) -> Any:
    """The contiguous cache x (B, Hk, Lk, D) in blocks (num_blocks, Hk, block_size, D): logical
    block n of sequence b at physical block table[b, n]."""
    import torch

    b, hk, lk, d = x.shape
    logical = x.view(b, hk, lk // block_size, block_size, d).permute(0, 2, 1, 3, 4).reshape(-1, hk, block_size, d)
    out = torch.empty_like(logical)
    out[torch.from_numpy(table.reshape(-1).astype(np.int64)).to(x.device)] = logical
    return out


def make_inputs(cell: Cell, seed: int) -> list[Inputs]:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    rng = np.random.default_rng(seed)
    dtype = getattr(torch, cell.dtype)
    sets = []
    for _ in range(cell.sets):
        q = torch.randn((cell.B, cell.Hq, cell.Lq, cell.D), dtype=dtype, device="cuda", generator=gen)
        k, v = (torch.randn((cell.B, cell.Hk, cell.Lk, cell.D), dtype=dtype, device="cuda", generator=gen)
                for _ in range(2))
        if cell.layout == "paged":
            table = block_table(cell.B, cell.Lk // cell.block_size, rng)
            sets.append(Inputs(q, k, v, paged(k, table, cell.block_size), paged(v, table, cell.block_size),
                               torch.from_numpy(table).to("cuda")))
        else:
            sets.append(Inputs(q, k, v, None, None, None))
    return sets


# --------------------------------------------------------------------------- systems


def flashcupy_call(cell: Cell, x: Inputs) -> Callable[[], Any]:
    import cupy

    import flashcupy

    c = cupy.from_dlpack
    q = c(x.q)
    if cell.layout == "paged":
        kc, vc, table = c(x.k_paged), c(x.v_paged), c(x.table)
        return lambda: flashcupy.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=cell.Lk, block_table=table,
                                                              backend="cuda")
    kc, vc = c(x.k), c(x.v)
    return lambda: flashcupy.flash_attention_with_kvcache(q, kc, vc, cache_seqlens=cell.Lk, backend="cuda")


def sdpa_variants(cell: Cell, x: Inputs, limit: int) -> dict[str, Callable[[], Any]]:
    """SDPA's default choice two ways for GQA: enable_gqa, and the heads repeated (where the
    repeated K and V fit ``limit`` bytes); one way for MHA."""
    import torch
    import torch.nn.functional as F

    if cell.Hq == cell.Hk:
        return {"": lambda: F.scaled_dot_product_attention(x.q, x.k, x.v)}
    variants = {"enable_gqa": lambda: F.scaled_dot_product_attention(x.q, x.k, x.v, enable_gqa=True)}
    group = cell.Hq // cell.Hk
    if cell.cache_bytes * group <= limit:
        k, v = (torch.repeat_interleave(t, group, dim=1) for t in (x.k, x.v))
        variants["repeat"] = lambda: F.scaled_dot_product_attention(x.q, k, v)
    return variants


_FLEX: dict[str, Any] = {}


def flex_call(cell: Cell, x: Inputs) -> Callable[[], Any]:
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    if "compiled" not in _FLEX:
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    compiled = _FLEX["compiled"]
    return lambda: compiled(x.q, x.k, x.v, enable_gqa=cell.Hq != cell.Hk)


def copy_call(cell: Cell) -> Callable[[], Any]:
    import torch

    src = torch.empty(cell.cache_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


# --------------------------------------------------------------------------- reference


def reference(cell: Cell, x: Inputs) -> Any:
    """float64 outputs (len(CHECKED), Lq, D) of the checked (batch, query head) pairs."""
    import torch

    group = cell.Hq // cell.Hk
    outs = []
    for b, h in CHECKED:
        b, h = b % cell.B, h % cell.Hq
        q, k, v = (t.to(torch.float64) for t in (x.q[b, h], x.k[b, h // group], x.v[b, h // group]))
        s = (q @ k.T) / math.sqrt(cell.D)
        outs.append(torch.softmax(s, dim=-1) @ v)
    return torch.stack(outs)


def check(out: Any, ref: Any, dtype: str) -> str:
    """'' when the checked pairs of ``out`` (B, Hq, Lq, D) are within tolerance of ``ref``."""
    import cupy
    import torch

    if isinstance(out, cupy.ndarray):
        out = torch.from_dlpack(out)
    got = torch.stack([out[b, h] for b, h in CHECKED]).to(torch.float64)
    err = float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))
    return "" if err <= TOLERANCE[dtype] else f"out: relative error {err:.3g} > {TOLERANCE[dtype]:g}"


# --------------------------------------------------------------------------- run


def measure(calls: Sequence[Callable[[], Any]], args: argparse.Namespace) -> float:
    """Median ms of the calls over the input sets in turn, after each set's call has run once
    at least: a decode loop attends each layer's cache every step, so what a call does the
    first time it sees a cache (flashcupy encodes the cache's tensor maps) is not per step."""
    return statistics.median(time_calls(list(calls), max(args.warmup, len(calls)), args.repeats))


def bench_cell(cell: Cell, args: argparse.Namespace, doc: dict[str, Any]) -> None:
    sets = make_inputs(cell, args.seed)
    ref = reference(cell, sets[0])
    limit = int(args.max_cache_gib * 2**30)
    for system in args.systems:
        if not runs(system, cell):
            continue
        base = {"system": system, **asdict(cell)}
        if system == "copy":
            ms, variant = measure([copy_call(cell)], args), ""
        else:
            if system == "flashcupy":
                per_set, error = attempt(lambda: [flashcupy_call(cell, x) for x in sets])
                variants = None if per_set is None else {"": per_set}
            elif system == "flex":
                per_set, error = attempt(lambda: [flex_call(cell, x) for x in sets])
                variants = None if per_set is None else {"": per_set}
            else:
                found, error = attempt(lambda: [sdpa_variants(cell, x, limit) for x in sets])
                variants = None if found is None else {name: [v[name] for v in found] for name in found[0]}
            if variants is None:
                (doc["failures"] if system == "flashcupy" else doc["skipped"]).append(base | {"reason": error})
                continue
            timed = {}
            for name, calls in variants.items():
                first, error = attempt(calls[0])
                wrong = error or check(first, ref, cell.dtype)
                del first
                if wrong:
                    (doc["failures"] if system == "flashcupy" else doc["skipped"]).append(
                        base | {"variant": name, "reason": wrong})
                    continue
                timed[name] = measure(calls, args)
            if not timed:
                continue
            variant = min(timed, key=timed.get)
            ms = timed[variant]
        gbps = cell.cache_bytes / ms / 1e6
        doc["rows"].append(base | {"ms": round(ms, 5), "gbps": round(gbps, 1), "variant": variant})
        print(f"{cell.label:60s} {system:13s} {ms:9.4f} ms {gbps:8.1f} GB/s {variant}", flush=True)
        release_memory()


def summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per cell: flashcupy's GB/s, SDPA's, their ratio (SDPA's time over flashcupy's) and
    flashcupy's share of the copy's bandwidth."""
    fields = tuple(Cell.__dataclass_fields__)
    same_bytes = ("dtype", "D", "Hk", "B", "Lk")
    by = {(r["system"], tuple(r[f] for f in fields)): r for r in rows}
    copy = {tuple(r[f] for f in same_bytes): r["gbps"] for r in rows if r["system"] == "copy"}
    lines = [f"{'cell':60s} {'flashcupy':>10s} {'sdpa':>8s} {'ratio':>6s} {'of copy':>8s}"]
    for r in rows:
        if r["system"] != "flashcupy":
            continue
        key = tuple(r[f] for f in fields)
        sdpa = by.get(("sdpa-default", key))
        cp = copy.get(tuple(r[f] for f in same_bytes))
        sdpa_gbps = f"{sdpa['gbps']:.1f}" if sdpa else "-"
        ratio = f"{sdpa['ms'] / r['ms']:.2f}" if sdpa else "-"
        share = f"{r['gbps'] / cp:.0%}" if cp else "-"
        lines.append(f"{Cell(*key).label:60s} {r['gbps']:10.1f} {sdpa_gbps:>8} {ratio:>6} {share:>8}")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["decode"], default="decode", help="the only suite of this script")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--heads", nargs="+", choices=list(HEADS), default=list(HEADS),
                        help="gqa: 32 query heads over 8 key heads at D 128; mha: 32/32 at D 64")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64], metavar="B")
    parser.add_argument("--keys", nargs="+", type=int, default=[1024, 4096, 16384, 65536, 131072], metavar="LK")
    parser.add_argument("--queries", nargs="+", type=int, default=[1, 4], metavar="LQ")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--block-sizes", nargs="+", type=int, default=[16, 64, 256], metavar="BS")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--max-cache-gib", type=float, default=8.0,
                        help="skip cells whose K and V take more (the paged copy and SDPA's repeated heads "
                             "take as much again)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    add_run_arguments(parser, "decode")
    args = parser.parse_args(argv)
    for name in ("batches", "keys", "queries", "block_sizes"):
        if min(getattr(args, name)) < 1:
            parser.error(f"--{name.replace('_', '-')}: expected positive ints, received {getattr(args, name)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cells, skipped = build_cells(args)
    if args.dry_run:
        for cell in cells:
            print(f"{cell.label:60s} {cell.sets:3d} {' '.join(s for s in args.systems if runs(s, cell))}")
        for cell, why in skipped:
            print(f"skip {cell.label}: {why}")
        return 0
    out, doc = suite_document("decode", args, argv)
    doc["skipped"] = [asdict(cell) | {"reason": why} for cell, why in skipped]
    with torch_stream_for_cupy():
        for cell in cells:
            bench_cell(cell, args, doc)
            release_memory()  # the cell's caches
            out.write_text(json.dumps(doc, indent=1) + "\n")
    print("\n".join(summary(doc["rows"])))
    for entry in doc["failures"]:
        print(f"FAILED {entry['system']} {Cell(*(entry[f] for f in Cell.__dataclass_fields__)).label}: "
              f"{entry['reason']}")
    print(f"wrote {out}")
    return 1 if doc["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
