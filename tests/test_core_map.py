"""``f.map``: an offline job through a batcher that other callers share."""

from __future__ import annotations

import threading

import pytest

import batchkit
from batchkit import batched

WAIT = 10.0


class _RoomWatch(batchkit.BoundedQueue[int]):
    """A queue that tells a test when someone waits for room in it."""

    def __init__(self, maxsize: int) -> None:
        super().__init__(maxsize, on_full="reject")
        self.waiting = threading.Event()

    def wait_for_room(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait_for_room(timeout)


def test_map_waits_for_room_in_a_full_reject_queue() -> None:
    """A queue filled by other callers slows map() down; it does not fail it with QueueFull."""
    gate = threading.Event()
    started = threading.Event()
    q = _RoomWatch(2)

    @batched(max_batch=1, max_wait_ms=0, queue=q)
    def inc(xs: list[int]) -> list[int]:
        started.set()
        assert gate.wait(WAIT)
        return [x + 1 for x in xs]

    first = inc.submit(0)
    assert started.wait(WAIT)
    others = [inc.submit(1), inc.submit(2)]  # the queue is full now
    outcome: dict[str, object] = {}
    finished = threading.Event()

    def job() -> None:
        try:
            outcome["results"] = list(inc.map([10, 11, 12]))
        except BaseException as exc:  # handed to the test thread
            outcome["error"] = exc
        finally:
            finished.set()
            q.waiting.set()

    t = threading.Thread(target=job)
    t.start()
    assert q.waiting.wait(WAIT)  # map met the full queue (or failed on it)
    gate.set()
    assert finished.wait(WAIT)
    t.join(WAIT)
    assert "error" not in outcome, outcome
    assert outcome["results"] == [11, 12, 13]
    assert [f.result(WAIT) for f in [first, *others]] == [1, 2, 3]
    inc.close()


def test_map_refuses_a_bad_window_or_total_at_the_call() -> None:
    """Bad arguments fail when map() is called, before any item is read."""

    @batched(max_batch=2, max_wait_ms=1)
    def ident(xs: list[int]) -> list[int]:
        return xs

    for window in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            ident.map([1], window=window)  # type: ignore[arg-type]
    for total in (-1, "3", 1.5):
        with pytest.raises(ValueError, match="total"):
            ident.map([1], total=total)  # type: ignore[arg-type]
    assert list(ident.map([1, 2, 3], total=3)) == [1, 2, 3]
    ident.close()


def test_map_after_close_raises_batcher_closed() -> None:
    """A closed function's map() refuses its first item with BatcherClosed."""

    @batched(max_batch=2, max_wait_ms=1)
    def ident(xs: list[int]) -> list[int]:
        return xs

    ident.close()
    with pytest.raises(batchkit.BatcherClosed):
        list(ident.map([1]))
