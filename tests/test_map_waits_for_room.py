"""@batched map() waits for room in a full queue under every on_full policy: it never evicts
another caller's waiting item (docs/api.md: "map waits for room (whatever on_full says)")."""

from __future__ import annotations

import threading

import pytest

from batchkit import batched
from batchkit.batcher import DynamicBatcher
from batchkit.queue import OnFull

WAIT = 10.0


@pytest.mark.parametrize("on_full", ["drop_oldest", "shed_lowest_priority"])
def test_map_waits_for_room_instead_of_evicting(on_full: OnFull) -> None:
    started = threading.Event()
    release = threading.Event()

    @batched(max_batch=1, max_wait_ms=0, max_queue=2, on_full=on_full, max_concurrent_batches=1)
    def double(xs: list[int]) -> list[int]:
        started.set()
        assert release.wait(WAIT)
        return [2 * x for x in xs]

    try:
        first = double.submit(1)  # runs, and holds the only worker
        assert started.wait(WAIT)
        others = [double.submit(2, priority=5), double.submit(3, priority=5)]  # fill the queue
        b: DynamicBatcher[int, int] = double.batcher
        waiting = threading.Event()
        original = b.queue.wait_for_room

        def wait_for_room(timeout: float | None = None) -> bool:
            waiting.set()
            return original(timeout)

        b.queue.wait_for_room = wait_for_room  # type: ignore[method-assign]
        results: list[int] = []
        job = threading.Thread(target=lambda: results.extend(double.map([4], window=1)))
        job.start()
        assert waiting.wait(WAIT)  # map found the queue full and waits for room
        assert not any(f.done() for f in others)  # nobody was evicted for it
        release.set()
        job.join(WAIT)
        assert not job.is_alive()
        assert results == [8]
        assert first.result(WAIT) == 2
        assert [f.result(WAIT) for f in others] == [4, 6]
    finally:
        release.set()
        double.close()
