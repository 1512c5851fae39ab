"""AsyncBatcher: one asyncio program, many concurrent callers, one model call per batch.

Run: python examples/async_batcher.py

Each of 200 tasks asks for one score; the batcher forms batches on the program's own event
loop (no threads) and the numpy "model" runs once per batch, in the main thread.
"""

from __future__ import annotations

import asyncio

import numpy as np

import batchkit

WEIGHTS = np.linspace(-1.0, 1.0, 16)


def score(rows: list[np.ndarray]) -> list[float]:
    """The model: one matrix product for the whole batch."""
    return [float(v) for v in np.stack(rows) @ WEIGHTS]


async def serve_all() -> None:
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(16) for _ in range(200)]
    async with batchkit.AsyncBatcher(score, max_batch_size=32, max_wait_ms=2) as batcher:
        results = await asyncio.gather(*(batcher.submit(x) for x in inputs))
        stats = batcher.statistics()
    assert np.allclose(results, [float(x @ WEIGHTS) for x in inputs])
    print(f"{stats.succeeded} requests in {stats.batches} batches (mean size {stats.mean_batch_size:.1f})")
    if stats.latency is not None:
        print(f"latency p50 {stats.latency.p50_ms:.2f} ms, p99 {stats.latency.p99_ms:.2f} ms")


def main() -> None:
    asyncio.run(serve_all())


if __name__ == "__main__":
    main()
