"""Per-step bookkeeping cost of the paged KV allocator, and its fragmentation.

1. Decode-step cost: 256 running sequences, each appending one token per step (one
   append_slots_batch call), with sequences finishing and new ones admitted as in a decode loop
   (allocate + free). Microseconds per step.
2. Fragmentation on a realistic mix: prompts uniform in 16..1024 tokens, outputs uniform in
   1..512, block size 16: wasted slots / allocated slots, measured over the whole run.

Run:  .venv/bin/python benchmarks/kv_allocator.py [--steps 2000] [--seqs 256] [--repeat 3] [--json PATH]
"""

from __future__ import annotations

import random
import time

import _harness as harness
import numpy as np

from batchkit import PagedKVAllocator


def run(steps: int, n_seqs: int, block_size: int, seed: int = 0) -> tuple[float, float, float, float]:
    rng = random.Random(seed)
    alloc = PagedKVAllocator(200_000, block_size)
    remaining: dict[int, int] = {}
    next_id = 0

    def admit() -> None:
        nonlocal next_id
        alloc.allocate(next_id, rng.randint(16, 1024))
        remaining[next_id] = rng.randint(1, 512)
        next_id += 1

    for _ in range(n_seqs):
        admit()
    frag_samples = []
    append_time = 0.0
    churn_time = 0.0
    ids = list(remaining)
    running = alloc.batch(ids)  # a decode loop keeps its running set as a handle
    for step in range(steps):
        t0 = time.perf_counter()
        alloc.append_slots_batch(running)
        t1 = time.perf_counter()
        finished = []
        for sid in ids:
            remaining[sid] -= 1
            if remaining[sid] == 0:
                finished.append(sid)
        t2 = time.perf_counter()
        for sid in finished:
            alloc.free(sid)
            del remaining[sid]
            admit()
        if finished:
            ids = list(remaining)
            running = alloc.batch(ids)
        t3 = time.perf_counter()
        append_time += t1 - t0
        churn_time += t3 - t2
        if step % 50 == 0:
            frag_samples.append(alloc.statistics().fragmentation)
    per_step_us = (append_time + churn_time) / steps * 1e6
    return per_step_us, append_time / steps * 1e6, churn_time / steps * 1e6, float(np.mean(frag_samples))


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="recorded runs, one seed each (default 3)")
    ap.add_argument("--warmup", type=int, default=1, help="unrecorded runs before them (default 1)")
    args = ap.parse_args()
    record = harness.start(args)
    seeds = iter(range(args.warmup + args.repeat))
    results = harness.measure(lambda: run(args.steps, args.seqs, 16, next(seeds)), args.repeat, args.warmup)
    names = ("bookkeeping per decode step", "append_slots_batch", "finish + admit", "fragmentation")
    for i, name in enumerate(names):
        record.add(name, [r[i] for r in results], "fraction" if i == 3 else "us")
    per_step, append, churn, frag = (harness.median(r[i] for r in results) for i in range(4))
    print(f"{args.seqs} running sequences, block size 16, {args.steps} decode steps, median of {args.repeat} runs")
    print(
        f"bookkeeping per decode step: {per_step:.1f} us  (append_slots_batch {append:.1f} us, "
        f"finish + admit {churn:.1f} us)"
    )
    print(f"fragmentation (prompt 16..1024, output 1..512): {frag:.2%} of allocated slots unused")
    record.write()


if __name__ == "__main__":
    main()
