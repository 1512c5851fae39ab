"""``batchkit demo``: its command-line options and the run that prints each row as it is measured.

The workloads are :mod:`batchkit.demo.mlp` and :mod:`batchkit.demo.llm`; torch is imported
only when the demo runs (``batchkit`` checks it is installed first).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .._argtypes import MAX_SECONDS, MAX_THREADS, MAX_WAIT_MS, add_max_wait_ms, add_threads, float_in, int_in
from . import llm as llm_demo
from . import mlp as mlp_demo

__all__ = ["add_demo_parser", "busy_machine_warning", "run_demo"]

MAX_CALLERS = 1024  # one thread each
MAX_BATCH = 4096
MAX_LLM_REQUESTS = 1024
MAX_LLM_OUT = 2048
MAX_LLM_BATCH = 64


def add_demo_parser(
    sub: Any, *, parents: Sequence[argparse.ArgumentParser], formatter_class: type[argparse.HelpFormatter]
) -> argparse.ArgumentParser:
    """Add ``batchkit demo`` to ``sub`` (an ``add_subparsers()`` result) and return its parser."""
    demo: argparse.ArgumentParser = sub.add_parser(
        "demo",
        parents=list(parents),
        formatter_class=formatter_class,
        help="show dynamic and continuous batching paying off on CPU torch models (needs torch)",
        description="Serve a CPU torch MLP one request at a time (a FIFO queue, one worker) and through "
        "batchkit; then a small Llama-style model one at a time, in static batches and continuously. "
        "Needs torch: pip install 'batchkit[torch]'.",
    )
    demo.add_argument("--part", choices=["all", "dynamic", "llm"], default="all", help="which half of the demo to run")
    demo.add_argument(
        "--callers",
        metavar="N",
        type=int_in(1, MAX_CALLERS),
        default=64,
        help=f"concurrent callers (threads) of the MLP, 1..{MAX_CALLERS}",
    )
    demo.add_argument(
        "--seconds",
        metavar="S",
        type=float_in(0, MAX_SECONDS, lo_open=True),
        default=3.0,
        help=f"seconds each MLP row runs, in (0, {MAX_SECONDS:g}]",
    )
    add_threads(
        demo,
        help=f"torch intra-op threads, 1..{MAX_THREADS} (default: the CPUs this process may use, capped by a "
        "cgroup CPU quota; OMP_NUM_THREADS where set)",
    )
    demo.add_argument(
        "--max-batch",
        metavar="N",
        type=int_in(1, MAX_BATCH),
        default=32,
        help=f"batchkit's max_batch_size for the MLP, 1..{MAX_BATCH}",
    )
    add_max_wait_ms(demo, default=5.0, help=f"batchkit's max_wait_ms for the MLP, in [0, {MAX_WAIT_MS:g}]")
    demo.add_argument(
        "--llm-requests",
        metavar="N",
        type=int_in(1, MAX_LLM_REQUESTS),
        default=24,
        help=f"LLM requests, all arriving at once, 1..{MAX_LLM_REQUESTS}",
    )
    demo.add_argument(
        "--llm-max-out",
        metavar="TOKENS",
        type=int_in(8, MAX_LLM_OUT),
        default=128,
        help=f"longest LLM output in tokens (outputs are 8..this), 8..{MAX_LLM_OUT}",
    )
    demo.add_argument(
        "--llm-batch",
        metavar="N",
        type=int_in(1, MAX_LLM_BATCH),
        default=8,
        help=f"LLM batch size (static batches and continuous max_num_seqs), 1..{MAX_LLM_BATCH}",
    )
    return demo


def run_demo(args: argparse.Namespace) -> int:
    """Run the parts of the demo ``args.part`` names, printing each row as it is measured."""
    import torch

    if getattr(args, "cpu_threads", None) is not None:  # batchkit's main() configured them
        print(args.cpu_threads.describe())
        warning = busy_machine_warning(args.cpu_threads.cpus, os.getloadavg()[0])
        if warning:
            print(warning, file=sys.stderr)
    print("Loading the models and measuring each row; rows print as they finish.", flush=True)
    if args.part in ("all", "dynamic"):
        _demo_dynamic(args, torch)
    if args.part in ("all", "llm"):
        if args.part == "all":
            print()
        _demo_llm(args)
    return 0


def _demo_dynamic(args: argparse.Namespace, torch: Any) -> None:
    model = mlp_demo.make_mlp(threads=args.threads)
    torch.manual_seed(1)
    inputs = [torch.randn(1024) for _ in range(min(args.callers, 256))]
    print(
        f"Dynamic batching: a 1024->4096->1024 torch MLP on CPU ({args.threads} threads), {args.callers} "
        f"concurrent callers, {args.seconds:g} s per row."
    )
    print(f"{'serving':44} {'req/s':>9} {'speed-up':>9} {'p50 ms':>8} {'p99 ms':>8} {'batch':>6}", flush=True)
    rows: tuple[Callable[[], mlp_demo.ServeResult], ...] = (
        lambda: mlp_demo.serve_one_by_one(model, inputs, args.callers, args.seconds),
        lambda: mlp_demo.serve_batched(model, inputs, args.callers, args.seconds, args.max_batch, args.max_wait_ms),
    )
    base = 0.0
    for row in rows:  # each row printed as soon as it is measured
        r = row()
        base = base or r.rps
        print(
            f"{r.name:44} {r.rps:9,.0f} {r.rps / base:8.1f}x {r.p50_ms:8.2f} {r.p99_ms:8.2f} {r.mean_batch:6.1f}",
            flush=True,
        )


def _demo_llm(args: argparse.Namespace) -> None:
    model = llm_demo.make_model(threads=args.threads)
    reqs = llm_demo.make_requests(args.llm_requests, 8, args.llm_max_out, seed=0)
    print(
        f"Continuous batching: a random Llama-style model (4 layers, hidden 256, GQA 8/4 heads) on CPU, "
        f"{len(reqs)} requests arriving together, outputs of 8..{args.llm_max_out} tokens, batch {args.llm_batch}."
    )
    print(
        f"{'serving':30} {'tok/s':>7} {'speed-up':>9} {'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'util':>5}",
        flush=True,
    )
    base = 0.0
    for mode in ("single", "static", "continuous"):  # each row printed as soon as it is measured
        r = llm_demo.serve(model, reqs, mode, batch=args.llm_batch)
        base = base or r.tokens_per_s
        print(
            f"{r.name:30} {r.tokens_per_s:7.0f} {r.tokens_per_s / base:8.1f}x {r.ttft_p50:7.0f}/{r.ttft_p99:<8.0f}"
            f" {r.tpot_p50:7.1f}/{r.tpot_p99:<8.1f} {r.utilisation:5.2f}",
            flush=True,
        )


def busy_machine_warning(cpus: int, load: float) -> str | None:
    """A warning where the 1-minute load average says other processes hold the CPUs the demo
    times itself on (a load of half the CPUs or more, at least 1), else None."""
    if load < max(1.0, cpus / 2):
        return None
    return (
        f"warning: the load average is {load:.2f} on {cpus} CPU{'s' if cpus != 1 else ''}: other processes are "
        "using the CPU, so the timings below will not hold (rerun on a quiet machine to compare)"
    )
