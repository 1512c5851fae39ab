"""BatchFormer, the flush policy of dynamic batching, driven directly on exact times."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest

from batchkit import AdaptiveBatchController, CircuitBreaker, QueueFull
from batchkit.dynamic._queue_core import QueueCore, QueueEntry
from batchkit.dynamic.former import FLUSH_REASONS, BatchFormer, FlushReason
from batchkit.testing import MockClock

Entry = QueueEntry[Any]


def entry(item: object = None) -> Entry:
    return QueueEntry(item, 0, 0, 0.0, None, None, 1)


def former(maxsize: int = 100, **kwargs: Any) -> BatchFormer[Entry]:
    return BatchFormer(QueueCore(maxsize), **kwargs)


def add(f: BatchFormer[Entry], now: float, item: object = None, key: Hashable = None, cost: float = 1) -> bool:
    _, replan = f.add(entry(item), now, 0, None, key, cost)
    return replan


def test_a_lone_item_waits_max_wait_ms_from_its_arrival() -> None:
    """Nothing is due before the oldest item has waited ``max_wait_ms``; the former names that
    instant as its wake-up, and at it the batch goes with reason ``timeout``."""
    f = former(max_batch_size=8, max_wait_ms=10)
    add(f, 1.0, "a")
    add(f, 1.004, "b")
    batch, wake_at = f.next_batch(1.009)
    assert batch is None
    assert wake_at == pytest.approx(1.010)
    batch, _ = f.next_batch(1.010)
    assert batch is not None
    assert [e.item for e in batch.entries] == ["a", "b"]
    assert batch.info.reason == "timeout"


def test_a_full_batch_goes_at_once_with_reason_size() -> None:
    """``max_batch_size`` waiting items are due now, whatever the wait; the rest stay queued."""
    f = former(max_batch_size=3, max_wait_ms=1e6)
    for i in range(4):
        add(f, 0.0, i)
    batch, _ = f.next_batch(0.0)
    assert batch is not None
    assert [e.item for e in batch.entries] == [0, 1, 2]
    assert batch.info.reason == FlushReason.SIZE
    assert f.queue.depth == 1


def test_cost_limit_bounds_a_batch_and_a_costly_item_runs_alone() -> None:
    """With ``max_batch_cost``, a batch never exceeds it; an item costlier than the limit is
    still served, alone, so that nothing waits forever."""
    f = former(max_batch_size=100, max_wait_ms=1e6, max_batch_cost=10)
    add(f, 0.0, "big", cost=25)
    add(f, 0.0, "a", cost=4)
    add(f, 0.0, "b", cost=4)
    batch, _ = f.next_batch(0.0)
    assert batch is not None
    assert ([e.item for e in batch.entries], batch.info.reason, batch.info.cost) == (["big"], "cost", 25.0)
    f.complete(batch)
    assert f.next_batch(0.0)[0] is None  # 8 < 10: not due yet


def test_groups_never_share_a_batch_and_a_full_group_goes_first() -> None:
    """With ``grouped``, a batch holds one key; a group that fills up goes before an older one."""
    f = former(max_batch_size=2, max_wait_ms=5, grouped=True, max_concurrent_batches=2)
    add(f, 0.0, "a1", key="a")
    add(f, 0.001, "b1", key="b")
    add(f, 0.002, "b2", key="b")
    batch, _ = f.next_batch(0.002)
    assert batch is not None
    assert ([e.item for e in batch.entries], batch.info.key) == (["b1", "b2"], "b")
    assert f.next_batch(0.002)[0] is None
    late, _ = f.next_batch(0.005)
    assert late is not None
    assert ([e.item for e in late.entries], late.info.reason) == (["a1"], "timeout")


def test_flush_makes_what_waits_now_due_and_not_what_comes_after() -> None:
    """``flush()`` dispatches the items waiting at the call (reason ``flush``); a later arrival
    waits its own ``max_wait_ms``."""
    f = former(max_batch_size=8, max_wait_ms=1e6)
    add(f, 0.0, "a")
    f.flush()
    add(f, 0.0, "b")
    batch, _ = f.next_batch(0.0)
    assert batch is not None
    assert batch.info.reason == "flush"
    # The batch takes what is waiting in order; "b" rode along because the batch had room.
    assert [e.item for e in batch.entries] == ["a", "b"]
    f.complete(batch)
    add(f, 1.0, "c")
    assert f.next_batch(1.0)[0] is None


def test_close_drains_everything_then_reports_finished() -> None:
    """After ``close()`` every waiting item is due (reason ``close``) and the former reports
    ``finished`` once nothing waits or runs."""
    f = former(max_batch_size=2, max_wait_ms=1e6)
    for i in range(3):
        add(f, 0.0, i)
    f.close()
    first, _ = f.next_batch(0.0)
    assert first is not None
    assert first.info.reason == "size"
    f.complete(first)
    second, _ = f.next_batch(0.0)
    assert second is not None
    assert second.info.reason == "close"
    assert not f.finished
    f.complete(second)
    assert f.finished


def test_a_batch_is_sealed_only_when_a_slot_is_free_so_it_keeps_growing() -> None:
    """While ``max_concurrent_batches`` batches run, nothing is sealed: arrivals join the next
    batch, which takes them all when the slot frees."""
    f = former(max_batch_size=8, max_wait_ms=0)
    add(f, 0.0, "a")
    running, _ = f.next_batch(0.0)
    assert running is not None
    for item in "bcd":
        add(f, 0.001, item)
    assert f.next_batch(0.01)[0] is None
    f.complete(running)
    batch, _ = f.next_batch(0.01)
    assert batch is not None
    assert [e.item for e in batch.entries] == ["b", "c", "d"]


def test_add_says_when_an_arrival_changes_the_plan() -> None:
    """``add`` returns True for a first item (it starts the wait clock), for a group that became
    full, and for a deadline before the former's wake-up; otherwise False."""
    f = former(max_batch_size=3, max_wait_ms=10)
    assert add(f, 0.0) is True
    assert f.next_batch(0.0)[0] is None  # wake_at = 0.010
    assert add(f, 0.001) is False
    _, replan = f.add(entry(), 0.002, 0, 5.0, None, 1)  # deadline 0.007 < 0.010
    assert replan is True
    assert f.next_batch(0.002)[0] is not None  # three waiting: full
    assert add(f, 0.003) is True  # the queue was empty again


@pytest.mark.parametrize("grouped", [False, True])
def test_arrivals_to_a_full_group_ask_nothing_while_every_slot_is_busy(grouped: bool) -> None:
    """A saturated batcher's arrivals do not change the plan: a full group cannot go until a
    slot frees, and the driver asks again then (``complete``, then ``next_batch``)."""
    f = former(max_batch_size=2, max_wait_ms=10, grouped=grouped)
    key = "k" if grouped else None
    assert add(f, 0.0, key=key) is True  # a first item
    assert add(f, 0.001, key=key) is True  # full, and the slot is free
    running, _ = f.next_batch(0.001)
    assert running is not None
    assert add(f, 0.002, key=key) is True  # a first item again: starts the wait clock
    assert [add(f, 0.003, key=key) for _ in range(3)] == [False] * 3  # full, no free slot
    f.complete(running)
    batch, _ = f.next_batch(0.003)  # what the driver does when a batch completes
    assert batch is not None
    assert batch.info.reason == "size"
    assert len(batch.entries) == 2


def test_expired_items_leave_with_deadline_exceeded() -> None:
    """An item past its deadline leaves through ``expire`` with the error its owner should see,
    and never reaches a batch."""
    f = former(max_batch_size=8, max_wait_ms=1e6)
    f.add(entry("late"), 0.0, 0, 5.0, None, 1)
    add(f, 0.0, "ok")
    assert f.expire(0.004) == []
    drops = f.expire(0.005)
    assert [(e.item, type(exc).__name__) for e, exc in drops] == [("late", "DeadlineExceeded")]
    f.flush()
    batch, _ = f.next_batch(0.005)
    assert batch is not None
    assert [e.item for e in batch.entries] == ["ok"]


def test_a_full_queue_refuses_and_the_former_counts_no_batch() -> None:
    """Admission applies the queue core's full policy: a ``reject`` queue raises QueueFull."""
    f = former(maxsize=1, max_batch_size=8, max_wait_ms=1e6)
    add(f, 0.0)
    with pytest.raises(QueueFull, match="queue is full"):
        add(f, 0.0)
    assert f.queue.statistics().rejections == 1


def test_a_batch_past_its_timeout_is_abandoned_and_counted_as_a_failure() -> None:
    """``timed_out`` reports a batch older than ``batch_timeout_s``, frees its slot and tells the
    circuit breaker it failed; the former asks to be woken at that timeout."""
    breaker = CircuitBreaker(failure_threshold=1, reset_timeout_s=10, clock=MockClock())
    f = former(max_batch_size=1, max_wait_ms=0, batch_timeout_s=2.0, circuit_breaker=breaker)
    add(f, 0.0)
    batch, _ = f.next_batch(0.0)
    assert batch is not None
    add(f, 0.5)
    assert f.next_batch(0.5) == (None, 2.0)
    assert f.timed_out(1.9) == []
    assert f.timed_out(2.0) == [batch]
    assert batch.abandoned
    assert not f.running
    assert breaker.state == "open"
    f.record(batch, 1, 2.5, True, 2.5)  # the abandoned call returns late: no success recorded
    assert breaker.state == "open"


def test_an_open_circuit_holds_batches_until_it_half_opens() -> None:
    """While the breaker is open nothing is dispatched and the wake-up is its half-open time;
    then exactly one probe batch goes."""
    clock = MockClock()
    breaker = CircuitBreaker(failure_threshold=1, reset_timeout_s=5, clock=clock)
    breaker.record(False)
    f = former(max_batch_size=1, max_wait_ms=0, max_concurrent_batches=2, circuit_breaker=breaker)
    add(f, 0.0)
    add(f, 0.0)
    assert f.next_batch(0.0) == (None, 5.0)
    clock.advance(5)
    probe, _ = f.next_batch(5.0)
    assert probe is not None
    assert f.next_batch(5.0)[0] is None  # only the probe while half-open
    f.record(probe, 1, 0.1, True, 5.1)
    f.complete(probe)
    assert f.next_batch(5.1)[0] is not None


def test_the_controller_sets_the_size_of_each_batch_from_the_backlog() -> None:
    """With a controller, each batch's size is its decision from the backlog a batch of the
    current size would leave behind."""
    ctl = AdaptiveBatchController(target_queue=0, eta=2, min_batch=1, max_batch=8)
    f = former(max_batch_size=99, max_wait_ms=0, controller=ctl)
    assert f.max_batch_size == 1  # the controller's initial size
    for _ in range(10):
        add(f, 0.0)
    batch, _ = f.next_batch(0.0)
    assert batch is not None
    assert len(batch.entries) == 3
    f.on_oom(3, 0.0)
    assert f.max_batch_size == 1


def test_flush_reasons_are_strings_and_counted() -> None:
    """Flush reasons compare equal to their names; the former counts batches per reason and keeps
    the recent ones."""
    assert FLUSH_REASONS == ("size", "cost", "timeout", "flush", "close")
    assert str(FlushReason.TIMEOUT) == "timeout"
    f = former(max_batch_size=1, max_wait_ms=0)
    add(f, 0.0)
    batch, _ = f.next_batch(0.0)
    assert batch is not None
    assert type(batch.info.reason) is str
    assert (f.batches, dict(f.reasons), dict(f.sizes)) == (1, {"size": 1}, {1: 1})
    assert list(f.recent) == [batch.info]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be an int >= 1"),
        ({"max_wait_ms": -1}, "max_wait_ms must be >= 0"),
        ({"max_concurrent_batches": 0}, "max_concurrent_batches must be an int >= 1"),
        ({"max_batch_cost": 0}, "max_batch_cost must be > 0"),
        ({"batch_timeout_s": 0}, "batch_timeout_s must be > 0"),
    ],
)
def test_bad_settings_are_refused_with_the_argument_named(kwargs: dict[str, Any], message: str) -> None:
    """Each setting out of range raises ValueError naming it."""
    with pytest.raises(ValueError, match=message):
        former(**kwargs)


def _half_open_former(**kwargs: Any) -> tuple[BatchFormer[Entry], CircuitBreaker]:
    """A former whose breaker opened at 0.0 and turned half-open at 1.0."""
    breaker = CircuitBreaker(failure_threshold=1, reset_timeout_s=1.0, clock=MockClock())
    breaker.record(False, 0.0)
    return former(circuit_breaker=breaker, **kwargs), breaker


@pytest.mark.parametrize("reason", FLUSH_REASONS)
def test_a_half_open_circuit_probes_with_the_first_batch_due_for_every_reason(reason: str) -> None:
    """After the cool-down, the probe goes with the first batch that is due, whatever made it
    due; asking before it is due (an item still within ``max_wait_ms``) takes no probe, so the
    circuit cannot be left half-open with a probe that never ran. The probe's success closes it."""
    f, breaker = _half_open_former(max_batch_size=4, max_wait_ms=5, max_batch_cost=3)
    add(f, 1.0, "a")
    assert f.next_batch(1.0) == (None, 1.005)  # not due yet: no probe taken
    if reason == "size":
        for item in "bcd":
            add(f, 1.001, item, cost=0.5)
        now = 1.001
    elif reason == "cost":
        add(f, 1.001, "b", cost=2)
        now = 1.001
    elif reason == "flush":
        f.flush()
        now = 1.001
    elif reason == "close":
        f.close()
        now = 1.001
    else:
        assert f.next_batch(1.004)[0] is None
        now = 1.005
    probe, _ = f.next_batch(now)
    assert probe is not None, "the due batch was held back: the probe was taken by an earlier look"
    assert probe.info.reason == reason
    f.record(probe, probe.info.size, 0.01, True, now + 0.01)
    f.complete(probe)
    assert breaker.state_at(now + 0.01) == "closed"


def test_a_half_open_circuit_whose_probe_is_out_holds_the_next_due_batch() -> None:
    """While the probe batch runs, another batch that is due waits for its outcome, looking
    again every 50 ms (the probe may belong to another batcher sharing the breaker)."""
    f, _ = _half_open_former(max_batch_size=1, max_wait_ms=0, max_concurrent_batches=2)
    add(f, 1.0, "a")
    probe, _ = f.next_batch(1.0)
    assert probe is not None
    add(f, 1.0, "b")
    assert f.next_batch(1.0) == (None, 1.05)
    f.record(probe, 1, 0.01, True, 1.01)
    f.complete(probe)
    batch, _ = f.next_batch(1.01)
    assert batch is not None
    assert batch.entries[0].item == "b"
