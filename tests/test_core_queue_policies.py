"""BoundedQueue's full policies as docs/api.md states them, with aging and priorities."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import batchkit
from batchkit import QueueEntry
from batchkit.testing import MockClock


def _dropped_into(out: list[str]) -> Callable[[QueueEntry[str], BaseException], None]:
    def on_drop(entry: QueueEntry[str], error: BaseException) -> None:
        assert isinstance(error, batchkit.QueueFull)
        out.append(entry.item)

    return on_drop


def test_drop_oldest_evicts_the_longest_waiting_item_whatever_its_priority() -> None:
    dropped: list[str] = []
    q: batchkit.BoundedQueue[str] = batchkit.BoundedQueue(2, "drop_oldest", on_drop=_dropped_into(dropped))
    q.put_nowait("urgent", priority=-1)
    q.put_nowait("low", priority=5)
    q.put_nowait("new", priority=0)
    assert dropped == ["urgent"]
    assert [q.get_nowait(), q.get_nowait()] == ["new", "low"]


def test_shed_lowest_priority_evicts_the_newest_of_the_worst_level() -> None:
    dropped: list[str] = []
    q: batchkit.BoundedQueue[str] = batchkit.BoundedQueue(3, "shed_lowest_priority", on_drop=_dropped_into(dropped))
    q.put_nowait("a5", priority=5)
    q.put_nowait("b5", priority=5)
    q.put_nowait("c1", priority=1)
    q.put_nowait("n0", priority=0)
    assert dropped == ["b5"]
    with pytest.raises(batchkit.QueueFull):
        q.put_nowait("n5", priority=5)  # no better than the worst waiting item: refused
    with pytest.raises(batchkit.QueueFull):
        q.put_nowait("m5", priority=6)


def test_shed_lowest_priority_judges_waiting_items_by_their_aged_priority() -> None:
    """An item that aged past the newcomer's level is not the one shed: aging protects it."""
    clock = MockClock()
    dropped: list[str] = []
    q: batchkit.BoundedQueue[str] = batchkit.BoundedQueue(
        2,
        "shed_lowest_priority",
        aging_s=1.0,
        clock=clock,
        on_drop=_dropped_into(dropped),
    )
    q.put_nowait("old3", priority=3)
    clock.advance(10.0)  # old3's effective priority is now 3 - 10 = -7
    q.put_nowait("x2", priority=2)
    q.put_nowait("new1", priority=1)
    assert dropped == ["x2"]
    assert [q.get_nowait(), q.get_nowait()] == ["old3", "new1"]


def test_shed_in_a_batcher_with_aging_spares_the_aged_item() -> None:
    """The same rule through DynamicBatcher's own admission (the former)."""
    clock = MockClock()
    q: batchkit.BoundedQueue[str] = batchkit.BoundedQueue(2, "shed_lowest_priority", aging_s=1.0, clock=clock)
    b = batchkit.DynamicBatcher(lambda xs: xs, max_batch_size=8, max_wait_ms=1e6, queue=q, clock=clock)
    old = b.submit("old3", priority=3)
    clock.advance(10.0)
    mid = b.submit("x2", priority=2)
    new = b.submit("new1", priority=1)
    with pytest.raises(batchkit.QueueFull):
        mid.result(10)
    b.flush()
    assert old.result(10) == "old3"
    assert new.result(10) == "new1"
    b.close()


def test_an_on_drop_that_raises_does_not_fail_the_put_that_evicted(caplog: pytest.LogCaptureFixture) -> None:
    """The put succeeded (its item is queued), so it returns; the callback's error is logged."""

    def on_drop(entry: QueueEntry[str], error: BaseException) -> None:
        raise RuntimeError("callback bug")

    q: batchkit.BoundedQueue[str] = batchkit.BoundedQueue(1, "drop_oldest", on_drop=on_drop)
    q.put_nowait("a")
    with caplog.at_level("ERROR", logger="batchkit.queue"):
        entry = q.put_nowait("b")
    assert entry.item == "b"
    assert len(q) == 1
    assert q.get_nowait() == "b"
    assert "callback bug" in caplog.text
