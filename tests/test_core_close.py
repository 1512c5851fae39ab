"""close()/aclose() called from inside the batch function: it neither deadlocks nor leaves threads."""

from __future__ import annotations

import asyncio
import threading

import batchkit

WAIT = 10.0


def test_close_from_the_batch_function_then_from_outside_joins_every_thread() -> None:
    """A close() inside the batch function returns; the next close() (outside) joins the threads."""
    ran_in: list[threading.Thread] = []
    inner: dict[str, object] = {}
    holder: dict[str, batchkit.DynamicBatcher[int, int]] = {}
    both_submitted = threading.Event()

    def fn(xs: list[int]) -> list[int]:
        ran_in.append(threading.current_thread())
        if 0 in xs:
            assert both_submitted.wait(WAIT)  # close only once the second item is queued
            holder["b"].close(timeout=WAIT)
            inner["closed"] = holder["b"].closed
        return xs

    b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0)
    holder["b"] = b
    try:
        first, second = b.submit(0), b.submit(1)
    finally:
        both_submitted.set()
    assert first.result(WAIT) == 0
    assert second.result(WAIT) == 1  # waiting work still drains
    assert inner == {"closed": True}
    b.close()
    assert not [t.name for t in ran_in if t.is_alive()]


def test_aclose_from_an_async_batch_function_does_not_deadlock() -> None:
    """``await batcher.aclose()`` inside the ``async def`` batch function returns, and the batch's
    caller gets its result."""
    holder: dict[str, batchkit.DynamicBatcher[int, int]] = {}
    inner: list[str] = []

    async def fn(xs: list[int]) -> list[int]:
        if 0 in xs:
            await holder["b"].aclose()
            inner.append("closed")
        return [x + 1 for x in xs]

    b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0)
    holder["b"] = b
    fut = b.submit(0)
    assert fut.result(WAIT) == 1
    assert inner == ["closed"]
    b.close()
    assert b.closed


def test_close_from_an_async_batch_function_does_not_deadlock() -> None:
    """The blocking ``close()`` inside an ``async def`` batch function returns as well."""
    holder: dict[str, batchkit.DynamicBatcher[int, int]] = {}

    async def fn(xs: list[int]) -> list[int]:
        if 0 in xs:
            holder["b"].close()
        return xs

    b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0)
    holder["b"] = b
    assert b.submit(0).result(WAIT) == 0
    b.close()


def test_asyncbatcher_aclose_from_its_batch_function_does_not_deadlock() -> None:
    """``await b.aclose()`` in an AsyncBatcher's own batch function returns; the batch's caller
    gets its result, the items still waiting drain, and later submits are refused."""

    async def main() -> tuple[list[int], list[str]]:
        holder: dict[str, batchkit.AsyncBatcher[int, int]] = {}
        inner: list[str] = []

        async def fn(xs: list[int]) -> list[int]:
            if 0 in xs:
                await holder["b"].aclose()
                inner.append("closed")
            return [x + 1 for x in xs]

        b = batchkit.AsyncBatcher(fn, max_batch_size=1, max_wait_ms=0)
        holder["b"] = b
        futs = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
        done, _ = await asyncio.wait(futs, timeout=WAIT)
        assert len(done) == 3
        try:
            await b.submit(9)
        except batchkit.BatcherClosed:
            inner.append("refused")
        await b.aclose()
        return [f.result() for f in futs], inner

    assert asyncio.run(main()) == ([1, 2, 3], ["closed", "refused"])
