"""Ray Serve replicas around a batchkit batcher: one process vs 1 and 2 replicas, and Serve's
default ``max_ongoing_requests=5`` against the value ``deployment_options`` derives.

The batch function sleeps ``t_batch(B) = T0 + T1 * B`` (100 ms + 2 ms per item by default), so it
holds no CPU: what the table shows is batching and routing, not this machine's cores. A closed
loop of ``--callers`` concurrent callers (asyncio tasks awaiting ``handle.remote(x)``) sends
``--requests`` requests per row after a warm-up. Each answer carries the size of the batch that
served it, so the mean batch is ``N / sum(1 / b_i)`` (batch-weighted, like ``statistics()``).

Rows:
  - one process: the same function behind a plain ``DynamicBatcher`` in this process (no Ray);
  - 1 replica, Ray's default max_ongoing_requests (5);
  - 1 replica and 2 replicas, sized by ``deployment_options(max_batch=...)``.

Run:  .venv/bin/python benchmarks/ray_replicas.py [--requests 1000] [--callers 128] [--max-batch 32] [--json PATH]
(needs ``pip install "batchkit[ray]"``; starts and stops a local Ray instance).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

import _harness as harness

import batchkit
from batchkit.integrations.ray import batched_deployment, deployment_options

T0 = 0.100  # seconds per batch
T1 = 0.002  # seconds per item


def sleepy(items: list[int]) -> list[tuple[int, int]]:
    """A sleep-bound batch function: each item comes back with the size of its batch."""
    time.sleep(T0 + T1 * len(items))
    return [(x, len(items)) for x in items]


async def drive(call: Any, n: int, callers: int) -> tuple[float, float, float, float]:
    """req/s, mean batch, p50 ms, p99 ms for n requests from `callers` concurrent callers."""
    sizes: list[int] = []
    latencies: list[float] = []
    per = n // callers

    async def caller(k: int) -> None:
        for i in range(per):
            t = time.perf_counter()
            _, b = await call(k * per + i)
            latencies.append(time.perf_counter() - t)
            sizes.append(b)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller(k) for k in range(callers)))
    wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100)
    return len(sizes) / wall, len(sizes) / sum(1 / b for b in sizes), q[49] * 1e3, q[98] * 1e3


def main() -> None:
    parser = harness.parser(
        __doc__, once=True, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--callers", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--max-wait-ms", type=float, default=10.0)
    args = parser.parse_args()
    record = harness.start(args)

    import ray
    from ray import serve

    rows: list[tuple[str, int, float, float, float, float]] = []

    async def local() -> None:
        with batchkit.DynamicBatcher(sleepy, max_batch_size=args.max_batch, max_wait_ms=args.max_wait_ms) as b:
            await drive(b.asubmit, args.callers * 2, args.callers)  # warm-up
            rows.append(("one process, no Ray", 0, *await drive(b.asubmit, args.requests, args.callers)))

    asyncio.run(local())

    ray.init(address="local", num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False)
    serve.start(proxy_location="Disabled")
    derived = deployment_options(max_batch=args.max_batch)["max_ongoing_requests"]
    configs = [
        ("1 replica, Serve default max_ongoing_requests=5", 1, 5, max(args.requests // 4, args.callers)),
        (f"1 replica, max_ongoing_requests={2 * args.max_batch} (2 batches)", 1, 2 * args.max_batch, args.requests),
        (f"1 replica, max_ongoing_requests={derived} (derived)", 1, derived, args.requests),
        (f"2 replicas, max_ongoing_requests={derived} (derived)", 2, derived, args.requests),
    ]
    try:
        for label, replicas, max_ongoing, n in configs:
            app = batched_deployment(
                sleepy,
                max_batch=args.max_batch,
                max_wait_ms=args.max_wait_ms,
                num_replicas=replicas,
                name="sleepy",
                ray_actor_options={"num_cpus": 0},
                deployment_kwargs={"max_ongoing_requests": max_ongoing},
            )
            handle = serve.run(app.bind(), name="sleepy", route_prefix=None)

            async def measure(h: Any = handle, n: int = n) -> tuple[float, float, float, float]:
                async def call(x: int) -> Any:
                    return await h.remote(x)

                await drive(call, args.callers * 2, args.callers)  # warm-up
                return await drive(call, n, args.callers)

            rows.append((label, replicas, *asyncio.run(measure())))
            serve.delete("sleepy")
    finally:
        serve.shutdown()
        ray.shutdown()

    print(
        f"t_batch(B) = {T0 * 1e3:.0f} ms + {T1 * 1e3:.0f} ms * B (sleep), max_batch={args.max_batch}, "
        f"max_wait_ms={args.max_wait_ms:g}, {args.callers} concurrent callers, {args.requests} requests per row "
        f"(a quarter at Serve's default, which is slow), "
        f"{os.cpu_count()} cores"
    )
    print()
    print("| setup | replicas | req/s | mean batch | p50 ms | p99 ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, replicas, rps, mean_b, p50, p99 in rows:
        print(f"| {label} | {replicas} | {rps:,.0f} | {mean_b:.1f} | {p50:,.0f} | {p99:,.0f} |")
        for name, value, unit in (
            ("req/s", rps, "req/s"),
            ("mean batch", mean_b, ""),
            ("p50", p50, "ms"),
            ("p99", p99, "ms"),
        ):
            record.add(name, value, unit, setup=label, replicas=replicas)
    record.write()


if __name__ == "__main__":
    main()
