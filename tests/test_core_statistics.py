"""statistics() fields as docs/api.md defines them."""

from __future__ import annotations

import asyncio
import threading

import pytest

import batchkit
from batchkit.integrations.ray import QUEUE_DEPTH_METRIC, RUNNING_BATCHES_METRIC, autoscaling_stats
from batchkit.testing import MockClock

WAIT = 10.0


def test_in_flight_counts_items_of_running_batches() -> None:
    """A running batch of 3 is 3 items in flight and 1 running batch; the waiting ones are pending."""
    gate = threading.Event()
    started = threading.Event()

    def fn(xs: list[int]) -> list[int]:
        started.set()
        assert gate.wait(WAIT)
        return xs

    b = batchkit.DynamicBatcher(fn, max_batch_size=3, max_wait_ms=1e6)
    futs = [b.submit(i) for i in range(5)]
    assert started.wait(WAIT)
    s = b.statistics()
    assert (s.pending, s.in_flight, s.running_batches) == (2, 3, 1)
    assert autoscaling_stats(b) == {QUEUE_DEPTH_METRIC: 2.0, RUNNING_BATCHES_METRIC: 1.0}
    gate.set()
    b.flush()
    assert [f.result(WAIT) for f in futs] == [0, 1, 2, 3, 4]
    b.close()
    s = b.statistics()
    assert (s.pending, s.in_flight, s.running_batches, s.submitted, s.succeeded) == (0, 0, 0, 5, 5)


def test_asyncbatcher_in_flight_counts_items_too() -> None:
    async def main() -> tuple[int, int]:
        gate = asyncio.Event()

        async def fn(xs: list[int]) -> list[int]:
            await gate.wait()
            return xs

        b = batchkit.AsyncBatcher(fn, max_batch_size=4, max_wait_ms=0)
        calls = [asyncio.ensure_future(b.submit(i)) for i in range(4)]
        for _ in range(5):
            await asyncio.sleep(0)
        s = b.statistics()
        gate.set()
        assert await asyncio.gather(*calls) == [0, 1, 2, 3]
        await b.aclose()
        return s.in_flight, s.running_batches

    assert asyncio.run(main()) == (4, 1)


def test_counters_of_each_outcome() -> None:
    """One caller of each outcome lands in its own counter."""
    clock = MockClock()
    gate = threading.Event()
    started = threading.Event()

    def fn(xs: list[str]) -> list[object]:
        started.set()
        assert gate.wait(WAIT)
        return [ValueError(x) if x == "bad" else x for x in xs]

    b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, max_queue=3, clock=clock)
    first = b.submit("ok")
    assert started.wait(WAIT)
    late = b.submit("late", deadline_ms=10, fallback="fb")
    gone = b.submit("gone")
    bad = b.submit("bad")
    with pytest.raises(batchkit.QueueFull):
        b.submit("refused")
    assert gone.cancel()
    clock.advance(1.0)
    assert late.result(WAIT) == "fb"
    gate.set()
    assert first.result(WAIT) == "ok"
    assert isinstance(bad.exception(WAIT), ValueError)
    b.close()
    s = b.statistics()
    assert (s.submitted, s.succeeded, s.failed, s.cancelled, s.expired, s.rejected) == (4, 1, 1, 1, 1, 1)
