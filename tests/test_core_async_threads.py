"""AsyncBatcher(offload=True) joins its worker threads on aclose(), as every batcher joins its own."""

from __future__ import annotations

import asyncio
import threading

import batchkit


def test_aclose_joins_the_offload_worker_threads() -> None:
    """After aclose() returns, no thread that ran the batch function is still alive."""
    ran_in: set[threading.Thread] = set()

    def double(xs: list[int]) -> list[int]:
        ran_in.add(threading.current_thread())
        return [2 * x for x in xs]

    async def main() -> tuple[list[int], list[str]]:
        async with batchkit.AsyncBatcher(
            double, max_batch_size=4, max_wait_ms=0, max_concurrent_batches=2, offload=True
        ) as b:
            results = await asyncio.gather(*(b.submit(i) for i in range(16)))
        return results, [t.name for t in ran_in if t.is_alive()]  # checked at once, on the loop

    results, alive = asyncio.run(main())
    assert results == [2 * i for i in range(16)]
    assert ran_in
    assert threading.main_thread() not in ran_in
    assert alive == []


def test_aclose_twice_after_offload_is_harmless() -> None:
    """A second aclose() returns at once; the batcher refuses new work."""

    async def main() -> None:
        b = batchkit.AsyncBatcher(lambda xs: xs, max_batch_size=2, max_wait_ms=0, offload=True)
        assert await b.submit(1) == 1
        await b.aclose()
        await b.aclose()
        try:
            await b.submit(2)
        except batchkit.BatcherClosed:
            return
        raise AssertionError("submit after aclose was accepted")

    asyncio.run(main())
