"""close(timeout=t) with an async batch function that hangs: the batch running at the deadline
fails (its call was cancelled), the items still waiting never run and count as cancelled, the
same in DynamicBatcher and AsyncBatcher (api.md, BatcherStatistics)."""

from __future__ import annotations

import threading

import anyio
import pytest

from batchkit import AsyncBatcher, BatcherClosed, DynamicBatcher

WAIT = 10.0
CLOSE_TIMEOUT_S = 0.2  # how long close() waits for the hung batch; nothing is timed against it


def test_dynamic_batcher_counts_items_that_never_ran_as_cancelled() -> None:
    started = threading.Event()

    async def hang(xs: list[int]) -> list[int]:
        started.set()
        await anyio.sleep(WAIT * 6)  # cancelled by close at its deadline
        return xs

    b = DynamicBatcher(hang, max_batch_size=1, max_wait_ms=0, max_concurrent_batches=1)
    futs = [b.submit(0)]
    assert started.wait(WAIT)
    futs += [b.submit(i) for i in (1, 2)]  # wait behind the hung batch
    b.close(timeout=CLOSE_TIMEOUT_S)
    for f in futs:
        with pytest.raises(BatcherClosed):
            f.result(WAIT)
    s = b.statistics()
    assert (s.submitted, s.succeeded, s.failed, s.cancelled) == (3, 0, 1, 2)


def test_async_batcher_counts_them_the_same() -> None:
    async def main() -> tuple[int, int, int, int]:
        started = anyio.Event()

        async def hang(xs: list[int]) -> list[int]:
            started.set()
            await anyio.sleep(WAIT * 6)
            return xs

        b = AsyncBatcher(hang, max_batch_size=1, max_wait_ms=0, max_concurrent_batches=1)
        outcomes: list[BaseException] = []

        async def one(i: int) -> None:
            try:
                await b.submit(i)
            except BatcherClosed as exc:
                outcomes.append(exc)

        with anyio.fail_after(WAIT):
            async with anyio.create_task_group() as tg:
                tg.start_soon(one, 0)
                await started.wait()
                tg.start_soon(one, 1)
                tg.start_soon(one, 2)
                await anyio.wait_all_tasks_blocked()
                await b.aclose(timeout=CLOSE_TIMEOUT_S)
        assert len(outcomes) == 3
        s = b.statistics()
        return s.submitted, s.succeeded, s.failed, s.cancelled

    assert anyio.run(main) == (3, 0, 1, 2)
