"""Per-call time of small attention calls, flashcupy beside SDPA (suite "overhead").

    PYTHONPATH=. python bench/bench_overhead.py [options]      # from the repository root
    python -m flashcupy bench --suite overhead [options]       # the same
    python bench/bench_overhead.py --dry-run                   # the plan

Shapes (B, H, L, D): (1, 1, 128, 64), (1, 8, 512, 64), (4, 16, 1024, 128), float16, non-causal.
Paths: "cupy" (flashcupy.flash_attention on CuPy arrays; fwd+bwd is flash_attention_vjp and its
vjp), "torch" (flashcupy.torch.flash_attention on torch tensors, autograd for the backward), and
SDPA (system "sdpa": torch.nn.functional.scaled_dot_product_attention, whichever backend it
picks) on the same torch tensors; "graph" (GPU only, flashcupy's and SDPA's): the torch path's
calls captured in a torch.cuda.CUDAGraph, GRAPH_CALLS back to back, the graph replayed: the
kernels' own time with no host work. Modes: fwd, and fwd+bwd (the forward and the gradients of
q, k and v for a given dout).

What a row measures: ``us``, the wall time per call of ``--calls`` back-to-back calls with one
synchronisation at the end, after ``--warmup`` calls; the median of ``--repeats`` such loops.
For small shapes this is the host's cost per call (what the GPU cannot hide); for the largest it
approaches the kernels' time.

``--model`` adds a tiny randomly initialised Llama (transformers; bf16 on the GPU, float32 on
the CPU; GQA 8/2, 2 layers): a training step (forward, loss, backward) and greedy generate()
of 32 tokens, with attn_implementation "sdpa" and flashcupy's (rows with path "transformers",
mode "train-step" or "generate", B, H, L, D of the call).

Without a GPU (``--device cpu``, the default where torch sees none) the torch path and SDPA run on
the CPU backend and torch's CPU kernels, and the cupy path is skipped: a smoke run, not the suite.

Output: bench/results/<gpu>-<date>-overhead.json (``--out``): gpu, date, commit, cupy, torch,
suite "overhead", rows {system, path, mode, B, H, L, D, us}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench_attention import RESULTS_DIR, add_run_arguments, git_commit, gpu_slug

SHAPES = ((1, 1, 128, 64), (1, 8, 512, 64), (4, 16, 1024, 128))
PATHS = ("cupy", "torch", "graph")
MODES = ("fwd", "fwd+bwd")
#: Calls a "graph" row captures in one CUDA graph.
GRAPH_CALLS = 20


def plan(args: argparse.Namespace) -> list[tuple[str, str, str, tuple[int, int, int, int]]]:
    """(system, path, mode, shape) of every row, in the order they run."""
    rows = []
    for shape in SHAPES:
        for mode in MODES:
            for path in args.paths:
                if path in ("cupy", "graph") and args.device != "cuda":
                    continue
                rows.append(("flashcupy", path, mode, shape))
            rows.append(("sdpa", "torch", mode, shape))
            if "graph" in args.paths and args.device == "cuda":
                rows.append(("sdpa", "graph", mode, shape))
    return rows


def per_call_us(call: Callable[[], Any], sync: Callable[[], Any], args: argparse.Namespace) -> float:
    """Median over --repeats loops of --calls back-to-back calls (one sync each loop), in us per call."""
    for _ in range(args.warmup):
        call()
    sync()
    loops = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        sync()
        loops.append((time.perf_counter() - start) / args.calls * 1e6)
    return statistics.median(loops)


def attention_call(system: str, path: str, mode: str, shape: tuple[int, int, int, int], device: str):
    """The call a row times."""
    import torch

    import flashcupy
    import flashcupy.torch as fct

    dtype = torch.float16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v, dout = (torch.randn(shape, dtype=dtype, device=device, generator=gen) for _ in range(4))
    if path == "cupy":
        import cupy

        qc, kc, vc, doc = (cupy.from_dlpack(x) for x in (q, k, v, dout))
        if mode == "fwd":
            return lambda: flashcupy.flash_attention(qc, kc, vc)
        return lambda: flashcupy.flash_attention_vjp(qc, kc, vc)[1](doc)
    attend = fct.flash_attention if system == "flashcupy" else torch.nn.functional.scaled_dot_product_attention
    if mode == "fwd":
        def forward():
            with torch.no_grad():
                return attend(q, k, v)
        return forward
    leaves = tuple(x.detach().requires_grad_() for x in (q, k, v))
    return lambda: torch.autograd.grad(attend(*leaves), leaves, dout)


def graph_us(system: str, mode: str, shape: tuple[int, int, int, int], args: argparse.Namespace) -> float:
    """us a call of the torch path's calls captured GRAPH_CALLS at a time in a CUDA graph and
    replayed (the median of --repeats loops of replays, --calls calls each)."""
    import torch

    call = attention_call(system, "torch", mode, shape, "cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # compiled, planned and the allocator warm before the capture
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            call()
    loops = argparse.Namespace(warmup=2, repeats=args.repeats, calls=max(1, args.calls // GRAPH_CALLS))
    return per_call_us(graph.replay, torch.cuda.synchronize, loops) / GRAPH_CALLS


def model_rows(device: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The tiny Llama's training step and generate(), with SDPA and with flashcupy."""
    import torch
    import transformers

    import flashcupy.integrations.transformers as flashcupy_hf

    name = flashcupy_hf.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = transformers.LlamaForCausalLM(config).to(device, dtype)
    batch, length = 4, 256
    ids = torch.randint(0, config.vocab_size, (batch, length), device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    for system, implementation in (("sdpa", "sdpa"), ("flashcupy", name)):
        model.set_attn_implementation(implementation)

        def step():
            model.zero_grad(set_to_none=True)
            model(input_ids=ids, labels=ids).loss.backward()

        def generate():
            with torch.no_grad():
                model.generate(input_ids=ids[:1, :32], max_new_tokens=32, do_sample=False, min_new_tokens=32)

        shape = {"B": batch, "H": config.num_attention_heads, "L": length, "D": config.head_dim}
        for mode, call in (("train-step", step), ("generate", generate)):
            quick = argparse.Namespace(warmup=2, repeats=args.repeats, calls=1)
            rows.append({"system": system, "path": "transformers", "mode": mode, **shape,
                         "us": round(per_call_us(call, sync, quick), 1)})
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=["overhead"], default="overhead", help="the only suite of this script")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    parser.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda where torch sees a GPU")
    parser.add_argument("--calls", type=int, default=200, help="back-to-back calls per timed loop")
    parser.add_argument("--repeats", type=int, default=5, help="timed loops (the median is kept)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--model", action="store_true", help="also the tiny Llama's training step and generate()")
    add_run_arguments(parser, "overhead")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device is None:
        try:
            import torch

            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            args.device = "cpu"
    rows_plan = plan(args)
    if args.dry_run:
        for system, path, mode, shape in rows_plan:
            print(f"{system:10s} {path:6s} {mode:8s} B={shape[0]} H={shape[1]} L={shape[2]} D={shape[3]}")
        return 0
    import torch

    if args.device == "cuda":
        import cupy

        cupy.cuda.Device(torch.cuda.current_device()).use()
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    machine = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    date = datetime.date.today().isoformat()
    doc: dict[str, Any] = {"gpu": machine if args.device == "cuda" else None, "date": date,
                           "commit": args.commit or git_commit(), "torch": torch.__version__, "suite": "overhead",
                           "device": args.device, "argv": sys.argv[1:] if argv is None else list(argv), "rows": []}
    try:
        import cupy

        doc["cupy"] = cupy.__version__
    except ImportError:
        doc["cupy"] = None
    for system, path, mode, shape in rows_plan:
        if path == "graph":
            us = graph_us(system, mode, shape, args)
        else:
            us = per_call_us(attention_call(system, path, mode, shape, args.device), sync, args)
        row = {"system": system, "path": path, "mode": mode, **dict(zip("BHLD", shape)), "us": round(us, 1)}
        doc["rows"].append(row)
        print(f"{system:10s} {path:6s} {mode:8s} B={shape[0]} H={shape[1]} L={shape[2]} D={shape[3]}: {us:9.1f} us",
              flush=True)
    if args.model:
        doc["rows"] += model_rows(args.device, args)
        for row in doc["rows"][-4:]:
            print(f"{row['system']:10s} {row['path']} {row['mode']}: {row['us'] / 1e3:.2f} ms", flush=True)
    out = args.out or RESULTS_DIR / f"{gpu_slug(machine)}-{date}-overhead.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
