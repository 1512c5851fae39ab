"""LoopPump: a former's plan carried out from callbacks of one asyncio loop, on a mock clock."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from batchkit.dynamic._loop_pump import LoopPump
from batchkit.dynamic._queue_core import QueueCore, QueueEntry
from batchkit.dynamic.former import BatchFormer, FormedBatch
from batchkit.testing import MockClock

WAIT = 5.0


class Driver:
    """A pump over a real former, recording what it starts, times out and drops."""

    def __init__(self, clock: MockClock, **former: Any) -> None:
        self.clock = clock
        self.former: BatchFormer[QueueEntry[Any]] = BatchFormer(QueueCore(100), **former)
        self.started: list[FormedBatch[Any]] = []
        self.pumps = 0
        self.timed_out: list[FormedBatch[Any]] = []
        self.pump = LoopPump(
            self.former,
            clock,
            self._now,
            start=self.started.append,
            resolve_drops=lambda drops: None,
            timed_out=self.timed_out.append,
        )

    def _now(self) -> float:
        self.pumps += 1  # the pump reads the time once per pump
        return self.clock.now()

    def add(self, n: int = 1) -> None:
        for _ in range(n):
            _, replan = self.former.add(QueueEntry(None, 0, 0, 0.0, None, None, 1), self.clock.now())
            if replan:
                self.pump.soon()


async def _until(predicate: Any) -> None:
    async with asyncio.timeout(WAIT):
        while not predicate():
            await asyncio.sleep(0)


def test_asks_in_one_loop_iteration_make_one_pump() -> None:
    async def main() -> None:
        d = Driver(MockClock(), max_batch_size=2, max_wait_ms=10)
        d.pump.bind(asyncio.get_running_loop())
        for _ in range(3):
            d.pump.soon()
        await asyncio.sleep(0)
        assert d.pumps == 1
        d.pump.stop()

    asyncio.run(main())


def test_a_full_batch_starts_in_the_next_callback_and_a_lone_item_when_the_clock_moves() -> None:
    """A mock clock wakes the pump through its listener: nothing starts before ``max_wait_ms``
    and the batch starts once the clock passes it."""

    async def main() -> None:
        clock = MockClock()
        d = Driver(clock, max_batch_size=2, max_wait_ms=10)
        d.pump.bind(asyncio.get_running_loop())
        d.add(2)
        await _until(lambda: d.started)
        d.former.complete(d.started[0])
        d.add(1)
        await asyncio.sleep(0)
        assert len(d.started) == 1  # waits for company
        clock.advance(0.009)
        await asyncio.sleep(0.01)
        assert len(d.started) == 1
        clock.advance(0.002)
        await _until(lambda: len(d.started) == 2)
        assert d.started[1].info.reason == "timeout"
        d.pump.stop()

    asyncio.run(main())


def test_finished_is_set_once_closed_and_drained_and_stop_silences_the_clock() -> None:
    async def main() -> None:
        clock = MockClock()
        d = Driver(clock, max_batch_size=4, max_wait_ms=10)
        d.pump.bind(asyncio.get_running_loop())
        d.add(1)
        await asyncio.sleep(0)  # the pump it asked for: the item waits for company
        assert not d.started
        d.former.close()
        d.pump.pump()
        assert len(d.started) == 1  # closing: what waits goes now
        assert d.pump.finished is not None
        assert not d.pump.finished.is_set()  # its batch still runs
        d.former.complete(d.started[0])
        d.pump.pump()
        assert d.pump.finished.is_set()
        d.pump.stop()
        pumps = d.pumps
        clock.advance(1.0)
        await asyncio.sleep(0.01)
        assert d.pumps == pumps

    asyncio.run(main())


def test_a_batch_past_its_timeout_is_handed_back() -> None:
    async def main() -> None:
        clock = MockClock()
        d = Driver(clock, max_batch_size=1, max_wait_ms=0, batch_timeout_s=1.0)
        d.pump.bind(asyncio.get_running_loop())
        d.add(1)
        await _until(lambda: d.started)
        clock.advance(1.0)
        await _until(lambda: d.timed_out)
        assert d.timed_out == d.started
        assert d.timed_out[0].abandoned
        d.pump.stop()

    asyncio.run(main())


def test_soon_threadsafe_without_a_loop_does_nothing() -> None:
    d = Driver(MockClock(), max_batch_size=2, max_wait_ms=10)
    d.pump.soon_threadsafe()  # never bound
    assert d.pumps == 0


@pytest.mark.parametrize("calls", [1, 3])
def test_soon_threadsafe_from_another_thread_pumps_on_the_loop(calls: int) -> None:
    async def main() -> None:
        d = Driver(MockClock(), max_batch_size=2, max_wait_ms=10)
        d.pump.bind(asyncio.get_running_loop())

        def poke() -> None:
            for _ in range(calls):
                d.pump.soon_threadsafe()

        await asyncio.to_thread(poke)
        await _until(lambda: d.pumps >= 1)
        d.pump.stop()

    asyncio.run(main())
