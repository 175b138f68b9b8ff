"""flashcupy with each score option beside every library that supports it, on one GPU (suite "options").

    PYTHONPATH=. python bench/bench_options.py [options]     # from the repository root
    python -m flashcupy bench --suite options [options]      # the same
    python bench/bench_options.py --dry-run                  # the plan: no GPU, torch or CuPy

Grid (docs/architecture.md#benchmarks): float16 and bfloat16 at D 64 and 128, L 4096; float32 and
float64 at D 64, L 1024 and 4096; B 4, H 16 throughout; causal and not; forward and backward
(``--dtypes``, ``--head-dims``, ``--lengths``, ``--causal``, ``--modes`` narrow it; the wide
dtypes take their own lengths and head dims, ``--wide-lengths`` and ``--wide-head-dims``).

Options (``--options``), each on its own and bias+mask+dropout together:

- plain: no option (the anchor of each system's own cost of an option);
- bias: (L, L) in the input dtype, standard normal, broadcast over batch and heads; no dbias
  (the bias is a constant for every system);
- mask: (L, L) bool, each score kept with probability 0.9 and the diagonal always (no row
  is fully masked, where SDPA's math backend gives NaN);
- padding: a (B, 1, 1, L) key-padding mask, sequence b keeping its first L, 7 L / 8, 3 L / 4
  or L / 2 keys (in turn): the masks of padded batches, most tiles kept whole or ruled out;
- block_mask: an (H, L / 128, L / 128) block mask of 128-blocks, each kept with probability
  0.9 and the diagonal's always (FlexAttention's native form; SDPA takes it as a dense mask);
- alibi: slopes 2^(-8 (h + 1) / H); softcap: 30; window: (256, 256), (256, 0) when causal;
- dropout: p = 0.1; sinks: standard normal logits, one per head;
- bias+mask+dropout: the three above together.

Systems (``--systems``) and the options each runs, as a user of it would write them:
flashcupy (every option, backend="cuda", CuPy views of torch's tensors on torch's stream);
sdpa-cudnn (16-bit; bias and masks as ``attn_mask``, a float mask with -inf where the boolean
one says no, the causal triangle folded into it); sdpa-efficient (16-bit and float32; the same,
and dropout); sdpa-flash (16-bit; dropout); sdpa-math (float64 only, where it is the anchor;
bias, masks, window as a mask, dropout); flex (FlexAttention under torch.compile, 16-bit and
float32: ALiBi and softcap as score_mod, bias as a score_mod reading it, masks, causal and
windows as mask_mod through create_block_mask). Sinks have no anchor: their row is read
against flashcupy's own plain time.

Correctness before timing: on the first and the last (batch, head) pair, every system's out
(fwd) or dq, dk, dv (bwd) against a float64 torch reference of the same option, by relative
Frobenius error (2e-2 for 16-bit, 1e-4 for float32, 1e-10 for float64). A system that fails
goes to "failures" untimed. Dropout draws different bits in every system, so rows with
dropout are timed unchecked (``checked``: false); flashcupy's dropout is checked bit for bit
by its GPU test suite.

Timing as bench_attention.py: CUDA events on torch's stream around each call, ``--warmup``
calls first, the median of ``--repeats``. The backward is the backward alone, the forward
run once before. FLOPs count as the core suite's (the option's own work and skipped tiles
not counted), so TFLOP/s compare within a row of options; window rows count the scores inside
the band (and the causal triangle) alone: window_flops.

Output: bench/results/<gpu>-<date>-options.json (``--out``): gpu, date, commit, cupy, torch,
suite "options", rows {system, option, dtype, B, H, L, D, causal, mode, ms, tflops, checked},
skipped {..., reason}, failures {..., error}. A table closes the run: per configuration and
option, flashcupy's time, the fastest anchor and the ratio, and flashcupy's time over its own
plain time.
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

from bench_attention import (
    SDPA_BACKENDS, TOLERANCE, Config, add_run_arguments, attempt, release_memory, suite_document, time_calls,
    torch_stream_for_cupy,
)

OPTIONS = ("plain", "bias", "mask", "padding", "block_mask", "alibi", "softcap", "dropout", "window", "sinks",
           "bias+mask+dropout")
MASKS = ("mask", "padding", "block_mask")
SYSTEMS = ("flashcupy", "sdpa-cudnn", "sdpa-efficient", "sdpa-flash", "sdpa-math", "flex")
DTYPES = ("float16", "bfloat16", "float32", "float64")
SIXTEEN = ("float16", "bfloat16")
#: (dtypes, options) each anchor runs; flashcupy runs everything.
SUPPORT: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sdpa-cudnn": (SIXTEEN, ("plain", "bias") + MASKS),
    "sdpa-efficient": (SIXTEEN + ("float32",), ("plain", "bias") + MASKS + ("dropout", "bias+mask+dropout")),
    "sdpa-flash": (SIXTEEN, ("plain", "dropout")),
    "sdpa-math": (("float64",), ("plain", "bias") + MASKS + ("window", "dropout", "bias+mask+dropout")),
    "flex": (SIXTEEN + ("float32",), ("plain", "bias") + MASKS + ("alibi", "softcap", "window")),
}
SOFTCAP, DROPOUT, MASK_KEEP, WINDOW, BLOCK = 30.0, 0.1, 0.9, 256, 128
#: The share of L each sequence of the padding option keeps, sequence b taking entry b % 4.
PADDING_KEEP = (1.0, 7 / 8, 3 / 4, 1 / 2)


def build_configs(args: argparse.Namespace) -> list[Config]:
    """16-bit dtypes at --head-dims x --lengths, the wide ones at --wide-head-dims x --wide-lengths."""
    configs = []
    for dtype in args.dtypes:
        dims, lengths = (args.head_dims, args.lengths) if dtype in SIXTEEN else (args.wide_head_dims, args.wide_lengths)
        configs += [Config(dtype, args.batch, args.heads, L, D, c == "true", mode)
                    for D in dims for L in lengths for c in args.causal for mode in args.modes]
    return configs


def runs(system: str, option: str, dtype: str) -> bool:
    if system == "flashcupy":
        return True
    dtypes, options = SUPPORT[system]
    return dtype in dtypes and option in options


def parts(option: str) -> set[str]:
    return set(option.split("+")) - {"plain"}


# --------------------------------------------------------------------------- option inputs


@dataclass
class Inputs:
    """q, k, v (and dout) as torch tensors and CuPy views, and the option arrays of one config."""

    q: Any
    k: Any
    v: Any
    do: Any
    bias: Any      # (L, L), the input dtype
    mask: Any      # (L, L) bool, True = attend, diagonal kept
    lengths: Any   # (B,) int64: the keys each sequence of the padding option keeps
    padding: Any   # (B, 1, 1, L) bool: key j < lengths[b]
    blocks: Any    # (H, L / BLOCK, L / BLOCK) bool, diagonal blocks kept
    slopes: Any    # (H,) float32
    sinks: Any     # (H,) float32
    allowed: Any   # (L, L) bool: the causal triangle (or all True)


def make_inputs(config: Config, seed: int) -> Inputs:
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = getattr(torch, config.dtype)
    shape = (config.B, config.H, config.L, config.D)
    q, k, v, do = (torch.randn(shape, dtype=dtype, device="cuda", generator=gen) for _ in range(4))
    L = config.L
    bias = torch.randn((L, L), dtype=dtype, device="cuda", generator=gen)
    mask = torch.rand((L, L), device="cuda", generator=gen) < MASK_KEEP
    mask |= torch.eye(L, dtype=torch.bool, device="cuda")
    lengths = torch.tensor([int(L * PADDING_KEEP[b % len(PADDING_KEEP)]) for b in range(config.B)], device="cuda")
    padding = (torch.arange(L, device="cuda") < lengths[:, None])[:, None, None, :]
    nb = -(-L // BLOCK)
    blocks = torch.rand((config.H, nb, nb), device="cuda", generator=gen) < MASK_KEEP
    blocks |= torch.eye(nb, dtype=torch.bool, device="cuda")
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / config.H) for h in range(config.H)], device="cuda")
    sinks = torch.randn((config.H,), device="cuda", generator=gen)
    allowed = torch.ones((L, L), dtype=torch.bool, device="cuda")
    if config.causal:
        allowed = torch.tril(allowed)
    return Inputs(q, k, v, do, bias, mask, lengths, padding, blocks, slopes, sinks, allowed)


def window_of(config: Config) -> tuple[int, int]:
    return (WINDOW, 0 if config.causal else WINDOW)


def window_flops(config: Config) -> float:
    """FlashAttention's FLOPs of the scores a window (and the causal triangle) keeps: 4 D per
    kept score and head, 2.5 times that for the backward."""
    left, right = window_of(config)
    i = range(config.L)
    kept = sum(min(config.L - 1, r + right) - max(0, r - left) + 1 for r in i)
    return 4.0 * config.B * config.H * kept * config.D * (2.5 if config.mode == "bwd" else 1.0)


def keep_matrix(option: str, config: Config, x: Inputs) -> Any:
    """The bool of every mask the option and causality apply (for SDPA and the reference):
    (L, L), (B, 1, L, L) with padding, (1, H, L, L) with a block mask."""
    import torch

    keep = x.allowed
    if "mask" in parts(option):
        keep = keep & x.mask
    if "padding" in parts(option):
        keep = keep & x.padding
    if "block_mask" in parts(option):
        dense = x.blocks.repeat_interleave(BLOCK, -2).repeat_interleave(BLOCK, -1)[:, :config.L, :config.L]
        keep = keep & dense[None]
    if "window" in parts(option):
        left, right = window_of(config)
        i = torch.arange(config.L, device="cuda")[:, None]
        j = torch.arange(config.L, device="cuda")[None, :]
        keep = keep & (j >= i - left) & (j <= i + right)
    return keep


# --------------------------------------------------------------------------- systems


def flashcupy_call(option: str, config: Config, x: Inputs, mode: str) -> Callable[[], tuple]:
    import cupy

    import flashcupy

    c = cupy.from_dlpack
    opts: dict[str, Any] = {"causal": config.causal, "backend": "cuda"}
    p = parts(option)
    if "bias" in p:
        opts["bias"] = c(x.bias)
    if "mask" in p:
        opts["mask"] = c(x.mask)
    if "padding" in p:
        opts["mask"] = c(x.padding)
    if "block_mask" in p:
        opts.update(block_mask=c(x.blocks), block_size=BLOCK)
    if "alibi" in p:
        opts["alibi_slopes"] = c(x.slopes)
    if "softcap" in p:
        opts["softcap"] = SOFTCAP
    if "window" in p:
        opts["window"] = window_of(config)
    if "sinks" in p:
        opts["sinks"] = c(x.sinks)
    if "dropout" in p:
        opts.update(dropout_p=DROPOUT, seed=1234)
    q, k, v, do = (c(t) for t in (x.q, x.k, x.v, x.do))
    if mode == "fwd":
        return lambda: (flashcupy.flash_attention(q, k, v, **opts),)
    out, lse = flashcupy.flash_attention_forward(q, k, v, **opts)
    return lambda: flashcupy.flash_attention_backward(do, q, k, v, out, lse, **opts)[:3]


def sdpa_call(system: str, option: str, config: Config, x: Inputs, mode: str) -> Callable[[], tuple]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[system])
    p = parts(option)
    attn_mask, is_causal = None, config.causal
    if p & {"bias", "window", *MASKS}:
        is_causal = False  # SDPA takes a mask or is_causal, not both: the triangle goes into the mask
        keep = keep_matrix(option, config, x)
        if "bias" in p:
            attn_mask = torch.where(keep, x.bias, -math.inf)
        else:
            attn_mask = keep if system != "sdpa-cudnn" else torch.where(keep, 0.0, -math.inf).to(x.bias.dtype)
    dropout = DROPOUT if "dropout" in p else 0.0

    def forward(q, k, v):
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout,
                                                                    is_causal=is_causal)

    if mode == "fwd":
        return lambda: (forward(x.q, x.k, x.v),)
    leaves = tuple(t.detach().requires_grad_() for t in (x.q, x.k, x.v))
    out = forward(*leaves)
    return lambda: torch.autograd.grad(out, leaves, x.do, retain_graph=True)


_FLEX: dict[str, Any] = {}


def flex_call(option: str, config: Config, x: Inputs, mode: str) -> Callable[[], tuple]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "compiled" not in _FLEX:
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=False)
    compiled = _FLEX["compiled"]
    p = parts(option)
    left, right = window_of(config)
    causal, mask, bias, slopes = config.causal, x.mask, x.bias, x.slopes
    lengths, blocks = x.lengths, x.blocks

    def mask_mod(b, h, i, j):
        keep = (j <= i) if causal else (i >= 0)
        if "mask" in p:
            keep = keep & mask[i, j]
        if "padding" in p:
            keep = keep & (j < lengths[b])
        if "block_mask" in p:
            keep = keep & blocks[h, i // BLOCK, j // BLOCK]
        if "window" in p:
            keep = keep & (j >= i - left) & (j <= i + right)
        return keep

    def score_mod(score, b, h, i, j):
        if "softcap" in p:
            score = SOFTCAP * torch.tanh(score / SOFTCAP)
        if "bias" in p:
            score = score + bias[i, j]
        if "alibi" in p:
            score = score - slopes[h] * (i - j).abs()
        return score

    block_mask = None
    if causal or p & {"window", *MASKS}:
        batch = config.B if "padding" in p else None
        heads = config.H if "block_mask" in p else None
        block_mask = create_block_mask(mask_mod, batch, heads, config.L, config.L, device="cuda")
    mod = score_mod if p & {"softcap", "bias", "alibi"} else None

    def forward(q, k, v):
        return compiled(q, k, v, score_mod=mod, block_mask=block_mask)

    if mode == "fwd":
        return lambda: (forward(x.q, x.k, x.v),)
    leaves = tuple(t.detach().requires_grad_() for t in (x.q, x.k, x.v))
    out = forward(*leaves)
    return lambda: torch.autograd.grad(out, leaves, x.do, retain_graph=True)


def prepare(system: str, option: str, config: Config, x: Inputs) -> Callable[[], tuple]:
    if system == "flashcupy":
        return flashcupy_call(option, config, x, config.mode)
    if system == "flex":
        return flex_call(option, config, x, config.mode)
    return sdpa_call(system, option, config, x, config.mode)


# --------------------------------------------------------------------------- reference


HEADS = ((0, 0), (-1, -1))  # the (batch, head) pairs checked: the first and the last


def reference(option: str, config: Config, x: Inputs) -> list[Any]:
    """float64 results of the checked heads: out (fwd) or dq, dk, dv (bwd), stacked over HEADS."""
    import torch

    f64 = torch.float64
    q, k, v, do = (torch.stack([t[b, h] for b, h in HEADS]).to(f64) for t in (x.q, x.k, x.v, x.do))
    heads = [h % config.H for _, h in HEADS]
    p = parts(option)
    every = keep_matrix(option, config, x).expand(config.B, config.H, config.L, config.L)
    keep = torch.stack([every[b, h] for b, h in HEADS])
    if config.mode == "bwd":
        q, k, v = (t.requires_grad_() for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(config.D)
    if "softcap" in p:
        s = SOFTCAP * torch.tanh(s / SOFTCAP)
    if "bias" in p:
        s = s + x.bias.to(f64)
    if "alibi" in p:
        i = torch.arange(config.L, device="cuda")
        dist = (i[:, None] - i[None, :]).abs().to(f64)
        s = s - x.slopes[heads].to(f64)[:, None, None] * dist
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    if "sinks" in p:
        lse = torch.logaddexp(lse, x.sinks[heads].to(f64)[:, None, None])
    out = torch.exp(s - lse) @ v
    if config.mode == "fwd":
        return [out.detach()]
    return [g.detach() for g in torch.autograd.grad(out, (q, k, v), do)]


def check(results: Sequence[Any], ref: Sequence[Any], dtype: str) -> str:
    """'' when every result's checked heads are within TOLERANCE of the reference, else why not."""
    import cupy
    import torch

    names = ("out",) if len(ref) == 1 else ("dq", "dk", "dv")
    for name, got, want in zip(names, results, ref):
        if isinstance(got, cupy.ndarray):
            got = torch.from_dlpack(got.astype(cupy.float64))
        got = torch.stack([got[b, h] for b, h in HEADS]).to(torch.float64)
        err = float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))
        if not err <= TOLERANCE[dtype]:
            return f"{name}: relative error {err:.3g} > {TOLERANCE[dtype]:g}"
    return ""


# --------------------------------------------------------------------------- run


def bench_config(config: Config, args: argparse.Namespace, doc: dict[str, Any]) -> None:
    x = make_inputs(config, args.seed)
    for option in args.options:
        ref = None if "dropout" in parts(option) else reference(option, config, x)
        for system in args.systems:
            base = {"system": system, "option": option, **asdict(config)}
            if not runs(system, option, config.dtype):
                continue
            call, error = attempt(lambda: prepare(system, option, config, x))
            if call is None:
                (doc["failures"] if system == "flashcupy" else doc["skipped"]).append(base | {"reason": error})
                continue
            first, error = attempt(call)
            wrong = error or ("" if ref is None else check(first, ref, config.dtype))
            del first
            if wrong:
                (doc["failures"] if system == "flashcupy" or not error else doc["skipped"]).append(
                    base | {"reason": wrong})
                continue
            times = time_calls([call], args.warmup, args.repeats)
            ms = statistics.median(times)
            flops = window_flops(config) if "window" in parts(option) else config.flops
            doc["rows"].append(base | {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 2),
                                       "checked": ref is not None})
            print(f"{config.label:48s} {option:18s} {system:15s} {ms:9.3f} ms", flush=True)
            del call
            release_memory()
    del x
    release_memory()


def summary(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per configuration and option: flashcupy, the fastest anchor, their ratio, and the option's
    cost over flashcupy's own plain time."""
    key = lambda r: (r["dtype"], r["D"], r["L"], r["causal"], r["mode"])  # noqa: E731
    plain = {key(r): r["ms"] for r in rows if r["system"] == "flashcupy" and r["option"] == "plain"}
    lines = [f"{'configuration':40s} {'option':18s} {'flashcupy':>10s} {'best other':>24s} {'ratio':>6s} {'/plain':>7s}"]
    for r in rows:
        if r["system"] != "flashcupy":
            continue
        others = [o for o in rows if o["system"] != "flashcupy" and key(o) == key(r) and o["option"] == r["option"]]
        best = min(others, key=lambda o: o["ms"], default=None)
        other = f"{best['system']} {best['ms']:.3f}" if best else "-"
        ratio = f"{best['ms'] / r['ms']:.2f}" if best else "-"
        own = f"{r['ms'] / plain[key(r)]:.2f}" if key(r) in plain else "-"
        label = f"{r['dtype']} D={r['D']} L={r['L']} {'causal' if r['causal'] else 'non-causal'} {r['mode']}"
        lines.append(f"{label:40s} {r['option']:18s} {r['ms']:10.3f} {other:>24s} {ratio:>6s} {own:>7s}")
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["options"], default="options", help="the only suite of this script")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], metavar="D")
    parser.add_argument("--lengths", nargs="+", type=int, default=[4096], metavar="L")
    parser.add_argument("--wide-head-dims", nargs="+", type=int, default=[64], metavar="D")
    parser.add_argument("--wide-lengths", nargs="+", type=int, default=[1024, 4096], metavar="L")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--causal", nargs="+", choices=["false", "true"], default=["false", "true"])
    parser.add_argument("--modes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    parser.add_argument("--options", nargs="+", choices=OPTIONS, default=list(OPTIONS))
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    add_run_arguments(parser, "options")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configs = build_configs(args)
    if args.dry_run:
        for config in configs:
            for option in args.options:
                systems = [s for s in args.systems if runs(s, option, config.dtype)]
                print(f"{config.label:48s} {option:18s} {' '.join(systems)}")
        return 0
    out, doc = suite_document("options", args, argv)
    with torch_stream_for_cupy():
        for config in configs:
            bench_config(config, args, doc)
            out.write_text(json.dumps(doc, indent=1) + "\n")
    print("\n".join(summary(doc["rows"])))
    for entry in doc["failures"]:
        config = Config(*(entry[f] for f in Config.__dataclass_fields__))
        print(f"FAILED {entry['system']} {entry['option']} {config.label}: {entry['reason']}")
    print(f"wrote {out}")
    return 1 if doc["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
