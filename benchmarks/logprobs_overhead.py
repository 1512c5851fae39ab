"""Step time of plain requests with and without logprob requests beside them.

Runs one ContinuousDecodeLoop over a small random LlamaModel in this thread (``step_once``):
``--rows`` plain greedy requests decoding together, then the same beside ``--with-logprobs``
requests asking for ``logprobs=5``. Prints the median step time of each run and their ratio.
A step of plain requests only takes the path it took before logprobs existed (one ``any()``
over the step's requests is the whole cost).

    python benchmarks/logprobs_overhead.py --rows 16 --steps 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from batchkit import ContinuousDecodeLoop
from batchkit.continuous import Request, SamplingParams
from batchkit.models import LlamaConfig, LlamaModel


def run(rows: int, extra: int, steps: int, repeat: int) -> float:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    model = LlamaModel(config)
    loop = ContinuousDecodeLoop(model, model.make_cache(num_blocks=1024, block_size=16), max_num_seqs=rows + extra)
    times: list[float] = []
    for r in range(repeat):
        for i in range(rows + extra):
            params = SamplingParams(max_new_tokens=steps + 8, logprobs=5 if i >= rows else None)
            loop.scheduler.add(Request((r, i), [1 + i, 2, 3, 4], params))
        loop.step_once()  # the prefill
        for _ in range(steps):
            t0 = time.perf_counter()
            loop.step_once()
            times.append(time.perf_counter() - t0)
        for i in range(rows + extra):
            loop.scheduler.abort((r, i))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--with-logprobs", type=int, default=4)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    plain = run(args.rows, 0, args.steps, args.repeat)
    plain_again = run(args.rows, 0, args.steps, args.repeat)
    mixed = run(args.rows, args.with_logprobs, args.steps, args.repeat)
    print(f"plain {args.rows} rows: median step {plain * 1e3:.3f} ms (again: {plain_again * 1e3:.3f} ms)")
    print(f"plain + {args.with_logprobs} logprobs=5 rows: median step {mixed * 1e3:.3f} ms ({mixed / plain:.3f}x)")


if __name__ == "__main__":
    main()
