"""``batchkit`` command line: ``batchkit demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    try:
        import torch
    except ImportError:
        print("batchkit demo needs torch: pip install 'batchkit[torch]'", file=sys.stderr)
        return 1
    from . import _demo

    model = _demo.make_mlp(threads=args.threads)
    torch.manual_seed(1)
    inputs = [torch.randn(1024) for _ in range(args.callers)]
    print(
        f"A 1024->4096->1024 torch MLP on CPU ({args.threads} threads), {args.callers} concurrent callers, "
        f"{args.seconds:g} s per row.\n"
    )
    rows = [
        _demo.serve_one_by_one(model, inputs, args.callers, args.seconds),
        _demo.serve_batched(model, inputs, args.callers, args.seconds, args.max_batch, args.max_wait_ms),
    ]
    base = rows[0].rps
    print(f"{'serving':44} {'req/s':>9} {'speed-up':>9} {'p50 ms':>8} {'p99 ms':>8} {'batch':>6}")
    for r in rows:
        print(f"{r.name:44} {r.rps:9,.0f} {r.rps / base:8.1f}x {r.p50_ms:8.2f} {r.p99_ms:8.2f} {r.mean_batch:6.1f}")
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
    demo.set_defaults(run=_demo)
    args = parser.parse_args(argv)
    return int(args.run(args))
