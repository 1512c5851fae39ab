"""AsyncBatcher.aclose() awaited from a task the batch function started (asyncio.gather,
asyncio.wait_for before 3.12, a TaskGroup) returns, as when awaited in the function itself,
instead of waiting for the batch that waits for it."""

from __future__ import annotations

import asyncio

import batchkit

WAIT = 10.0


def test_aclose_in_a_task_started_by_the_batch_function_does_not_deadlock() -> None:
    async def main() -> tuple[list[int], list[str]]:
        holder: dict[str, batchkit.AsyncBatcher[int, int]] = {}
        inner: list[str] = []

        async def fn(xs: list[int]) -> list[int]:
            if 0 in xs:
                await asyncio.wait_for(asyncio.gather(holder["b"].aclose()), WAIT)
                inner.append("closed")
            return [x + 1 for x in xs]

        b = batchkit.AsyncBatcher(fn, max_batch_size=1, max_wait_ms=0)
        holder["b"] = b
        futs = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
        done, _ = await asyncio.wait(futs, timeout=2 * WAIT)
        assert len(done) == 3
        await b.aclose()
        return [f.result() for f in futs], inner

    assert asyncio.run(main()) == ([1, 2, 3], ["closed"])


def test_aclose_of_another_batcher_from_a_batch_function_still_waits() -> None:
    """Only a batcher's own batch function is 'inside': closing another batcher from it waits
    for that one's running batch."""

    async def main() -> list[str]:
        log: list[str] = []
        started = asyncio.Event()
        go = asyncio.Event()

        async def slow(xs: list[int]) -> list[int]:
            started.set()
            await go.wait()
            log.append("other ran")
            return xs

        other = batchkit.AsyncBatcher(slow, max_batch_size=1, max_wait_ms=0)

        async def fn(xs: list[int]) -> list[int]:
            pending = asyncio.ensure_future(other.submit(1))
            await asyncio.wait_for(started.wait(), WAIT)
            asyncio.get_running_loop().call_soon(go.set)
            await asyncio.wait_for(other.aclose(), WAIT)
            log.append("other closed")
            assert pending.done()
            return xs

        b = batchkit.AsyncBatcher(fn, max_batch_size=1, max_wait_ms=0)
        assert await asyncio.wait_for(b.submit(0), 2 * WAIT) == 0
        await b.aclose()
        return log

    assert asyncio.run(main()) == ["other ran", "other closed"]
