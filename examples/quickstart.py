"""Quickstart: batch a function over a list so that callers call it one item at a time.

Run:  python examples/quickstart.py
"""

from __future__ import annotations

import concurrent.futures

import anyio

import batchkit


@batchkit.batched(max_batch=8, max_wait_ms=20)
def embed(texts: list[str]) -> list[list[float]]:
    """Pretend model: one call embeds a whole list (a real model would run one forward pass)."""
    return [[float(len(t)), float(sum(map(ord, t)) % 97)] for t in texts]


@batchkit.batched(max_batch=32, max_wait_ms=5)
async def score(xs: list[float]) -> list[float]:
    """An async batch function: awaited by async callers."""
    return [x * 0.5 for x in xs]


def main() -> None:
    # Blocking callers on many threads share batches.
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        vectors = list(pool.map(embed, [f"text {i}" for i in range(32)]))
    print(f"embedded {len(vectors)} texts; first = {vectors[0]}")

    # Async callers.
    async def run_async() -> list[float]:
        results: list[float] = [0.0] * 64

        async def one(i: int) -> None:
            results[i] = await score(float(i))

        async with anyio.create_task_group() as tg:
            for i in range(64):
                tg.start_soon(one, i)
        return results

    scores = anyio.run(run_async)
    print(f"scored {len(scores)} values; last = {scores[-1]}")

    # An offline job streamed through the batcher, results in input order.
    total = sum(v[0] for v in embed.map((f"doc {i}" for i in range(1000)), total=1000))
    print(f"offline job done: sum of lengths = {total:g}")

    s = embed.statistics()
    print(f"embed: {s.batches} batches, mean size {s.mean_batch_size:.1f}, flush reasons {s.flush_reasons}")
    embed.close()
    score.close()


if __name__ == "__main__":
    main()
