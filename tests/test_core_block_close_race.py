"""A writer blocked on a full "block" queue learns of close() even when close() wakes the waiting
writers between its finding the queue full and its starting to wait (it missed that wake-up)."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

from batchkit import BatcherClosed, DynamicBatcher

WAIT = 10.0


@pytest.mark.parametrize("caller", ["submit", "asubmit"])
def test_a_writer_that_starts_waiting_just_after_close_gets_batcher_closed(
    caller: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    started = threading.Event()

    def fn(xs: list[int]) -> list[int]:
        started.set()
        assert release.wait(WAIT)
        return xs

    b = DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, max_concurrent_batches=1, max_queue=1, on_full="block")
    queue = b.queue
    woken = threading.Event()
    real_wake = queue.wake_room_waiters

    def wake() -> None:
        real_wake()
        woken.set()

    monkeypatch.setattr(queue, "wake_room_waiters", wake)
    closer = threading.Thread(target=b.close)

    def close_first() -> None:
        """The writer found the queue full; close() runs (and wakes the waiting writers, of which
        there are none yet) before the writer starts waiting."""
        if not closer.is_alive() and not woken.is_set():
            closer.start()
            assert woken.wait(WAIT)

    real_wait, real_await = queue.wait_for_room, queue.await_room

    def wait_for_room(timeout: float | None = None) -> bool:
        close_first()
        return real_wait(timeout)

    async def await_room() -> None:
        close_first()
        await real_await()

    monkeypatch.setattr(queue, "wait_for_room", wait_for_room)
    monkeypatch.setattr(queue, "await_room", await_room)

    running = b.submit(0)
    assert started.wait(WAIT)
    queued = b.submit(1)  # the queue (max_queue=1) is now full
    outcome: list[Any] = []

    def writer() -> None:
        try:
            if caller == "submit":
                b.submit(2).result(WAIT)
            else:
                anyio.run(b.asubmit, 2)
        except BaseException as exc:  # the outcome is what the test checks
            outcome.append(exc)

    t = threading.Thread(target=writer)
    t.start()
    try:
        t.join(WAIT)  # the held batch still runs: the queue has no room until it is released
        assert not t.is_alive(), "the writer waited for room after close()"
        assert len(outcome) == 1, outcome
        assert isinstance(outcome[0], BatcherClosed), outcome
    finally:
        release.set()
        closer.join(WAIT)
        t.join(WAIT)
    assert (running.result(WAIT), queued.result(WAIT)) == (0, 1)  # close() drains what it had
