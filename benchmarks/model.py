"""Dynamic batching on a real model: a torch MLP 1024->4096->1024 on CPU (2 threads).

1. Closed loop: 64 concurrent callers, one vector per request, max batch 32, 5 ms wait, as
   asyncio tasks and as threads. Throughput as a fraction of the ceiling: the model called
   directly on ready-made batches of 32. The machine is shared and noisy, so ceiling and batched
   windows are interleaved (--rounds of each) and the ratio is taken per round, then the median.
2. Open loop: Poisson arrivals at 70% of the closed-loop throughput (asyncio tasks started on
   schedule); p50/p99 latency, compared with max_wait_ms + 2 * t_batch(32).

Run:  .venv/bin/python benchmarks/model.py [--rounds 5] [--window 2] [--open-seconds 5] [--json PATH]
"""

from __future__ import annotations

import time

import _harness as harness
import anyio
import torch

import batchkit
from batchkit.demo import mlp as mlp_demo
from batchkit.metrics import percentiles

MAX_BATCH, MAX_WAIT_MS, CALLERS = 32, 5.0, 64


def closed_loop_async(b: batchkit.DynamicBatcher, inputs: list, seconds: float) -> tuple[float, list[float]]:  # type: ignore[type-arg]
    lat: list[float] = []

    async def main() -> float:
        n = 0
        stop = time.perf_counter() + seconds

        async def caller(k: int) -> None:
            nonlocal n
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                await b.asubmit(inputs[k])
                lat.append(time.perf_counter() - t0)
                n += 1

        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for k in range(CALLERS):
                tg.start_soon(caller, k)
        return n / (time.perf_counter() - t0)

    return anyio.run(main), lat


def open_loop(b: batchkit.DynamicBatcher, inputs: list, rate: float, seconds: float) -> list[float]:  # type: ignore[type-arg]
    """Start one task per request at Poisson times; latency counts from the scheduled arrival."""
    lat: list[float] = []

    async def main() -> None:
        async def one(i: int, sched: float) -> None:
            await b.asubmit(inputs[i % len(inputs)])
            lat.append(time.perf_counter() - sched)

        async with anyio.create_task_group() as tg:
            t0 = time.perf_counter()
            for i, at in enumerate(harness.poisson_arrivals(rate, seconds, seed=7)):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    await anyio.sleep(delay)
                tg.start_soon(one, i, t0 + at)

    anyio.run(main)
    return lat


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--rounds", "--repeat", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--window", type=float, default=2.0, help="seconds per measurement window")
    ap.add_argument("--open-seconds", type=float, default=5.0)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    record = harness.start(args)
    model = mlp_demo.make_mlp(threads=2)
    torch.manual_seed(1)
    inputs = [torch.randn(1024) for _ in range(CALLERS)]
    mlp_demo.ceiling_rps(model, inputs, MAX_BATCH, 0.5)  # warm up
    fn = mlp_demo.batch_fn_for(model)
    ratios_async, ratios_threads, ceilings, rps_async = [], [], [], []
    lat_async: list[float] = []
    lat_threads: list[float] = []
    batch_sizes = []
    for _ in range(args.rounds):
        ceil = mlp_demo.ceiling_rps(model, inputs, MAX_BATCH, args.window)
        ceilings.append(ceil)
        b = batchkit.DynamicBatcher(fn, max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_MS)
        r, lat = closed_loop_async(b, inputs, args.window)
        batch_sizes.append(b.statistics().mean_batch_size)
        b.close()
        ratios_async.append(r / ceil)
        rps_async.append(r)
        lat_async += lat
        res = mlp_demo.serve_batched(model, inputs, CALLERS, args.window, MAX_BATCH, MAX_WAIT_MS)
        ratios_threads.append(res.rps / ceil)
        lat_threads += [res.p50_ms, res.p99_ms]
    record.add("ceiling", ceilings, "req/s")
    record.add("asyncio tasks", rps_async, "req/s")
    record.add("asyncio tasks / ceiling", ratios_async)
    record.add("threads / ceiling", ratios_threads)
    record.add("mean batch", batch_sizes)
    med = harness.median
    ceil = med(ceilings)
    t_batch_ms = MAX_BATCH / ceil * 1e3
    a50, a99 = (x * 1e3 for x in percentiles(lat_async, [50, 99]))
    print(
        f"torch MLP 1024->4096->1024, CPU, 2 threads; {CALLERS} callers, max_batch_size={MAX_BATCH}, "
        f"max_wait_ms={MAX_WAIT_MS:g}; median of {args.rounds} interleaved rounds of {args.window:g} s"
    )
    print(f"ceiling (model on ready batches of 32) : {ceil:8,.0f} req/s  (t_batch(32) = {t_batch_ms:.2f} ms)")
    print(
        f"batchkit, 64 asyncio tasks             : {med(rps_async):8,.0f} req/s = "
        f"{med(ratios_async):.1%} of ceiling; p50 {a50:.1f} ms, p99 {a99:.1f} ms; "
        f"mean batch {med(batch_sizes):.1f}"
    )
    print(f"batchkit, 64 threads                   : {med(ratios_threads):.1%} of ceiling")
    rate = 0.7 * med(rps_async)
    b = batchkit.DynamicBatcher(fn, max_batch_size=MAX_BATCH, max_wait_ms=MAX_WAIT_MS)
    lat = open_loop(b, inputs, rate, args.open_seconds)
    s = b.statistics()
    b.close()
    p50, p99 = (x * 1e3 for x in percentiles(lat, [50, 99]))
    bound = MAX_WAIT_MS + 2 * t_batch_ms
    record.add("asyncio tasks p50", a50, "ms")
    record.add("asyncio tasks p99", a99, "ms")
    record.add("open loop p50", p50, "ms", rate=rate, requests=len(lat))
    record.add("open loop p99", p99, "ms", rate=rate, requests=len(lat))
    record.add("open loop p99 <= max_wait_ms + 2 t_batch", "met" if p99 <= bound else "not met", bound_ms=bound)
    print(
        f"open loop, Poisson {rate:,.0f} req/s for {args.open_seconds:g} s ({len(lat)} requests): "
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms, mean batch {s.mean_batch_size:.1f}; "
        f"bound max_wait_ms + 2 t_batch = {bound:.1f} ms: {'met' if p99 <= bound else 'NOT met'}"
    )
    record.write()


if __name__ == "__main__":
    main()
