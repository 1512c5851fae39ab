"""Dynamic batching on a real model: a torch MLP 1024->4096->1024 on CPU (2 threads).

1. Closed loop: 64 concurrent callers, one vector per request, max batch 32, 5 ms wait.
   Throughput as a fraction of the ceiling (the model called directly on ready-made batches of
   32, measured in the same run), and p50/p99 latency.
2. Open loop: Poisson arrivals at 70% of the closed-loop throughput for 5 s; p50/p99 latency,
   compared with the bound max_wait_ms + 2 * t_batch(32).

Run:  python benchmarks/model.py [--seconds 5] [--open-seconds 5]
"""

from __future__ import annotations

import argparse
import random
import threading
import time

import torch

import batchkit
from batchkit import _demo
from batchkit.metrics import percentiles


def open_loop(model, inputs, rate: float, seconds: float, max_batch: int, max_wait_ms: float):  # type: ignore[no-untyped-def]
    """Submit at Poisson times from one thread; latency = completion - scheduled arrival."""
    b = batchkit.DynamicBatcher(_demo.batch_fn_for(model), max_batch_size=max_batch, max_wait_ms=max_wait_ms)
    rng = random.Random(7)
    lat: list[float] = []
    lock = threading.Lock()
    futs = []
    t0 = time.perf_counter()
    t = t0
    i = 0
    while t - t0 < seconds:
        t += rng.expovariate(rate)
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        sched = t

        def done(f, sched=sched):  # type: ignore[no-untyped-def]
            with lock:
                lat.append(time.perf_counter() - sched)

        f = b.submit(inputs[i % len(inputs)])
        f.add_done_callback(done)
        futs.append(f)
        i += 1
    for f in futs:
        f.result(60)
    stats = b.statistics()
    b.close()
    p50, p99 = percentiles(lat, [50, 99])
    return i / seconds, p50 * 1e3, p99 * 1e3, stats.mean_batch_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--open-seconds", type=float, default=5.0)
    ap.add_argument("--callers", type=int, default=64)
    args = ap.parse_args()
    model = _demo.make_mlp(threads=2)
    torch.manual_seed(1)
    inputs = [torch.randn(1024) for _ in range(args.callers)]
    _demo.ceiling_rps(model, inputs, 32, 0.5)  # warm up
    ceiling = _demo.ceiling_rps(model, inputs, 32, args.seconds)
    direct1 = _demo.ceiling_rps(model, inputs, 1, min(args.seconds, 2.0))
    batched = _demo.serve_batched(model, inputs, args.callers, args.seconds, 32, 5)
    ceiling2 = _demo.ceiling_rps(model, inputs, 32, args.seconds)  # again after, to bracket drift
    ceil = (ceiling + ceiling2) / 2
    t_batch_ms = 32 / ceil * 1e3
    print("torch MLP 1024->4096->1024, CPU, 2 threads")
    print(f"ceiling (model on ready batches of 32): {ceil:9,.0f} req/s   t_batch(32) = {t_batch_ms:.2f} ms")
    print(f"model on single requests              : {direct1:9,.0f} req/s")
    print(
        f"batchkit closed loop, {args.callers} callers        : {batched.rps:9,.0f} req/s = "
        f"{batched.rps / ceil:.1%} of ceiling; p50 {batched.p50_ms:.2f} ms, p99 {batched.p99_ms:.2f} ms, "
        f"mean batch {batched.mean_batch:.1f}"
    )
    rate = 0.7 * batched.rps
    _got, p50, p99, mean_b = open_loop(model, inputs, rate, args.open_seconds, 32, 5)
    bound = 5 + 2 * t_batch_ms
    print(
        f"open loop, Poisson {rate:,.0f} req/s for {args.open_seconds:g} s: p50 {p50:.2f} ms, p99 {p99:.2f} ms, "
        f"mean batch {mean_b:.1f}; bound max_wait + 2 t_batch = {bound:.2f} ms -> "
        f"{'within' if p99 <= bound else 'OVER'}"
    )


if __name__ == "__main__":
    main()
