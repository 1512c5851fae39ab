"""``batchkit`` command line: ``batchkit demo``, ``batchkit plan`` and ``batchkit bench``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        print("batchkit demo needs torch: pip install 'batchkit[torch]'", file=sys.stderr)
        return 1
    if args.part in ("all", "dynamic"):
        _demo_dynamic(args, torch)
    if args.part in ("all", "llm"):
        if args.part == "all":
            print()
        _demo_llm(args)
    return 0


def _demo_dynamic(args: argparse.Namespace, torch: Any) -> None:
    from . import _demo

    model = _demo.make_mlp(threads=args.threads)
    torch.manual_seed(1)
    inputs = [torch.randn(1024) for _ in range(args.callers)]
    print(
        f"Dynamic batching: a 1024->4096->1024 torch MLP on CPU ({args.threads} threads), {args.callers} "
        f"concurrent callers, {args.seconds:g} s per row."
    )
    rows = [
        _demo.serve_one_by_one(model, inputs, args.callers, args.seconds),
        _demo.serve_batched(model, inputs, args.callers, args.seconds, args.max_batch, args.max_wait_ms),
    ]
    base = rows[0].rps
    print(f"{'serving':44} {'req/s':>9} {'speed-up':>9} {'p50 ms':>8} {'p99 ms':>8} {'batch':>6}")
    for r in rows:
        print(f"{r.name:44} {r.rps:9,.0f} {r.rps / base:8.1f}x {r.p50_ms:8.2f} {r.p99_ms:8.2f} {r.mean_batch:6.1f}")


def _demo_llm(args: argparse.Namespace) -> None:
    from . import _llm_demo

    model = _llm_demo.make_model(threads=args.threads)
    reqs = _llm_demo.make_requests(args.llm_requests, 8, args.llm_max_out, seed=0)
    print(
        f"Continuous batching: a random Llama-style model (4 layers, hidden 256, GQA 8/4 heads) on CPU, "
        f"{len(reqs)} requests arriving together, outputs of 8..{args.llm_max_out} tokens, batch {args.llm_batch}."
    )
    rows = [
        _llm_demo.serve(model, reqs, "single"),
        _llm_demo.serve(model, reqs, "static", batch=args.llm_batch),
        _llm_demo.serve(model, reqs, "continuous", batch=args.llm_batch),
    ]
    base = rows[0].tokens_per_s
    print(f"{'serving':30} {'tok/s':>7} {'speed-up':>9} {'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'util':>5}")
    for r in rows:
        print(
            f"{r.name:30} {r.tokens_per_s:7.0f} {r.tokens_per_s / base:8.1f}x {r.ttft_p50:7.0f}/{r.ttft_p99:<8.0f}"
            f" {r.tpot_p50:7.1f}/{r.tpot_p99:<8.1f} {r.utilisation:5.2f}"
        )


def _plan(args: argparse.Namespace) -> int:
    from .kv.planner import PRESETS, ModelShape, plan

    if args.config:
        source: object = args.config
    elif args.preset in PRESETS:
        source = PRESETS[args.preset]
    else:
        print(f"unknown preset {args.preset!r}; choose from {', '.join(PRESETS)} or pass --config", file=sys.stderr)
        return 2
    shape = ModelShape.from_hf_config(source)
    gib = 1024**3
    try:
        p = plan(
            shape,
            device_bytes=int(args.device_gib * gib),
            gpu_memory_utilization=args.gpu_memory_utilization,
            weight_bytes=None if args.weights_gib is None else int(args.weights_gib * gib),
            activation_bytes=int(args.activation_gib * gib),
            block_size=args.block_size,
            mean_seq_len=args.mean_len,
        )
    except ValueError as exc:
        print(f"batchkit plan: {exc}", file=sys.stderr)
        return 2
    name = args.config or args.preset
    print(
        f"{name}: {shape.num_layers} layers, {shape.num_kv_heads} KV heads x {shape.head_dim}, "
        f"{shape.dtype_bytes} bytes per value"
    )
    print(p.table())
    return 0


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    if args.target == "demo":
        import torch

        from . import _demo

        model = _demo.make_mlp(threads=args.threads)
        fn = _demo.batch_fn_for(model)
        gen = torch.Generator().manual_seed(0)

        def make_item(i: int) -> object:
            return torch.randn(1024, generator=gen)

    else:
        fn = bench.load_callable(args.target)
        make_item = bench.load_callable(args.make_item) if args.make_item else (lambda i: i)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    report = bench.sweep(
        fn,
        make_item,
        sizes,
        max_wait_ms=args.max_wait_ms,
        concurrency=None if args.rate else args.concurrency,
        rate=args.rate,
        duration_s=args.duration,
        sla_ms=args.sla_ms,
        price_per_hour=args.price_per_hour,
        tokens_per_item=args.tokens_per_item,
        progress=not args.no_progress,
    )
    load = f"open loop, Poisson {args.rate:g}/s" if args.rate else f"closed loop, {args.concurrency} callers"
    print(f"{args.target}: {load}, max_wait_ms={args.max_wait_ms:g}, {args.duration:g} s per point")
    print(report.table())
    if args.json:
        report.to_json(args.json)
        print(f"wrote {args.json}")
    if args.plot:
        report.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchkit", description="batching for any model callable")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="show dynamic batching paying off on a CPU torch model")
    demo.add_argument("--callers", type=int, default=64)
    demo.add_argument("--seconds", type=float, default=3.0)
    demo.add_argument("--threads", type=int, default=2)
    demo.add_argument("--max-batch", type=int, default=32)
    demo.add_argument("--max-wait-ms", type=float, default=5.0)
    demo.add_argument("--part", choices=["all", "dynamic", "llm"], default="all")
    demo.add_argument("--llm-requests", type=int, default=24)
    demo.add_argument("--llm-max-out", type=int, default=128)
    demo.add_argument("--llm-batch", type=int, default=8)
    demo.set_defaults(run=_demo)
    pl = sub.add_parser("plan", help="print the KV-cache memory budget for a model on a device")
    src = pl.add_mutually_exclusive_group()
    src.add_argument("--config", help="path to a Hugging Face config.json")
    src.add_argument("--preset", default="llama-2-7b", help="llama-2-7b, llama-3-8b or llama-2-70b")
    pl.add_argument("--device-gib", type=float, default=80.0)
    pl.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    pl.add_argument("--weights-gib", type=float, default=None, help="default: estimated from the config")
    pl.add_argument("--activation-gib", type=float, default=2.0)
    pl.add_argument("--block-size", type=int, default=16)
    pl.add_argument("--mean-len", type=int, default=1024)
    pl.set_defaults(run=_plan)
    be = sub.add_parser("bench", help="load-test a batch function and find B_opt under a P99 SLA")
    be.add_argument("target", nargs="?", default="demo", help="module:function (a batch function), or 'demo'")
    be.add_argument("--make-item", help="module:function(i) -> one request's input (default: i)")
    be.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    be.add_argument("--max-wait-ms", type=float, default=5.0)
    be.add_argument("--concurrency", type=int, default=64)
    be.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals per second")
    be.add_argument("--duration", type=float, default=2.0, help="seconds per batch size")
    be.add_argument("--sla-ms", type=float, default=None, help="P99 latency SLA")
    be.add_argument("--price-per-hour", type=float, default=None, help="accelerator price, for cost per token")
    be.add_argument("--tokens-per-item", type=float, default=1.0)
    be.add_argument("--threads", type=int, default=2)
    be.add_argument("--json", help="write the report as JSON")
    be.add_argument("--plot", help="write throughput and P99 vs batch size as a PNG (needs matplotlib)")
    be.add_argument("--no-progress", action="store_true")
    be.set_defaults(run=_bench)
    args = parser.parse_args(argv)
    return int(args.run(args))
