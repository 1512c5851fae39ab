"""CircuitBreaker: its states on a clock, and a batcher that fails fast behind an open circuit, probes and recovers."""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

import pytest

import batchkit
from _support import DUE_BY_REASON, DUE_BY_REASON_OPTIONS, wait_until
from batchkit import (
    BatchSizeMismatch,
    BatchTimeout,
    CircuitBreaker,
    CircuitOpen,
    DynamicBatcher,
)
from batchkit.testing import MockClock

WAIT = 10


def test_state_at_is_a_question_that_changes_nothing() -> None:
    """Asking for the state at a later time answers half-open but leaves the breaker open now:
    no work is let through early, and no probe is handed out before the cool-down."""
    clock = MockClock()
    br = CircuitBreaker(failure_threshold=1, reset_timeout_s=10, clock=clock)
    br.record(False)
    assert br.state_at(10.0) == "half_open"
    assert br.state == "open"
    with pytest.raises(CircuitOpen):
        br.check()
    assert not br.allow_dispatch()
    clock.advance(10)
    assert br.state == "half_open"
    assert br.allow_dispatch()


def test_circuit_breaker_opens_probes_and_closes() -> None:
    """closed -> open after N failures -> half-open after the cool-down -> closed on success."""
    clock = MockClock()
    br = CircuitBreaker(failure_threshold=2, reset_timeout_s=5, clock=clock)
    br.record(False)
    br.check()
    br.record(False)
    with pytest.raises(CircuitOpen, match="fails fast"):
        br.check()
    assert not br.allow_dispatch()
    clock.advance(5)
    br.check()
    assert br.allow_dispatch()
    assert not br.allow_dispatch(), "one probe at a time"
    br.record(False)
    assert br.state == "open"
    clock.advance(5)
    assert br.allow_dispatch()
    br.record(True)
    assert br.state == "closed"


def test_a_state_read_racing_the_probe_does_not_let_a_second_probe_through() -> None:
    """A health check reads ``state`` (which turns a cooled-down circuit half-open) from its own
    thread. If the dispatcher takes the probe between that read's check and its update, the
    probe stays taken: the next allow_dispatch() is refused."""
    clock = MockClock()
    interleave: list[Callable[[], None]] = []

    class RacingClock:
        """Runs the dispatcher's move inside the health check's read of the time."""

        def now(self) -> float:
            if interleave:
                interleave.pop()()
            return clock.now()

    br = CircuitBreaker(failure_threshold=1, reset_timeout_s=5, clock=RacingClock())
    br.record(False)
    clock.advance(5)
    probes: list[bool] = []
    interleave.append(lambda: probes.append(br.allow_dispatch()))
    assert br.state == "half_open"  # the health check's read, with the dispatcher's move inside
    assert probes == [True]
    assert not br.allow_dispatch(), "a second probe went out"
    br.record(False)
    clock.advance(5)
    assert br.allow_dispatch(), "the next opening has its own probe"


def test_circuit_breaker_in_a_batcher_fails_fast_then_recovers() -> None:
    """After repeated failing batches new submits raise CircuitOpen; a probe after the
    cool-down closes the circuit again."""
    clock = MockClock()
    healthy = {"ok": False}

    def fn(xs: list[int]) -> list[int]:
        if not healthy["ok"]:
            raise RuntimeError("backend down")
        return xs

    br = CircuitBreaker(failure_threshold=2, reset_timeout_s=30, clock=clock)
    with DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, circuit_breaker=br, clock=clock) as b:
        for _ in range(2):
            with pytest.raises(RuntimeError):
                b.submit(1).result(WAIT)
        with pytest.raises(CircuitOpen):
            b.submit(1)
        healthy["ok"] = True
        clock.advance(30)
        assert b.submit(7).result(WAIT) == 7
        assert br.state == "closed"
        assert b.statistics().rejected == 1


def _failing_batcher_with_waiting_items(
    clock: MockClock,
) -> tuple[DynamicBatcher[int, int], CircuitBreaker, list[concurrent.futures.Future[int]]]:
    """A batcher whose first batch (item 0) fails and opens its circuit while items 1-4 wait."""
    gate = threading.Event()

    def fn(xs: list[int]) -> list[int]:
        assert gate.wait(WAIT)
        raise RuntimeError("backend down")

    br = CircuitBreaker(failure_threshold=1, reset_timeout_s=30, clock=clock)
    b = DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, circuit_breaker=br, clock=clock)
    futs = [b.submit(i) for i in range(5)]
    gate.set()
    with pytest.raises(RuntimeError, match="backend down"):
        futs[0].result(WAIT)
    wait_until(lambda: br.state == "open", "the circuit to open", timeout=WAIT)
    return b, br, futs


def test_close_fails_what_waits_behind_an_open_circuit_at_once() -> None:
    """close() (drain) does not wait out reset_timeout_s for a probe per batch: the items still
    waiting behind an open circuit fail with CircuitOpen, counted as cancelled (they never ran)."""
    clock = MockClock()  # never advanced: the circuit stays open, and no probe would ever go
    b, _, futs = _failing_batcher_with_waiting_items(clock)
    assert not any(f.done() for f in futs[1:])
    b.close(timeout=WAIT)
    assert all(f.done() for f in futs), "close() left callers waiting behind the open circuit"
    for f in futs[1:]:
        assert isinstance(f.exception(), CircuitOpen)
    st = b.statistics()
    assert (st.submitted, st.failed, st.cancelled, st.pending) == (5, 1, 4, 0)


def test_close_still_runs_the_probe_of_a_half_open_circuit() -> None:
    """A circuit whose cool-down has passed lets close()'s drain send its probe batch; when the
    probe fails, the items still waiting fail fast."""
    clock = MockClock()
    b, br, futs = _failing_batcher_with_waiting_items(clock)
    clock.advance(30)
    assert br.state == "half_open"
    b.close(timeout=WAIT)
    errors = [type(f.exception(WAIT)).__name__ for f in futs]
    assert errors == ["RuntimeError", "RuntimeError", "CircuitOpen", "CircuitOpen", "CircuitOpen"]
    assert b.statistics().batches == 2


def test_close_waits_for_a_running_batch_that_may_close_the_circuit() -> None:
    """With two batch slots, one batch fails and opens the circuit while the other still runs:
    a close() then waits for that one, whose success closes the circuit, and the items waiting
    run instead of failing with CircuitOpen."""
    started, release, queued = threading.Event(), threading.Event(), threading.Event()

    def fn(xs: list[int]) -> list[int]:
        if xs == [0]:
            assert started.wait(WAIT)  # batch [1] is running
            assert queued.wait(WAIT)  # and every item is in (an open circuit refuses submits)
            raise RuntimeError("one bad batch")
        if xs == [1]:
            started.set()
            assert release.wait(WAIT)
        return xs

    br = CircuitBreaker(failure_threshold=1, reset_timeout_s=30, clock=MockClock())
    b = DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, max_concurrent_batches=2, circuit_breaker=br)
    futs = [b.submit(i) for i in range(6)]
    queued.set()
    with pytest.raises(RuntimeError, match="one bad batch"):
        futs[0].result(WAIT)
    wait_until(lambda: br.state == "open", "the circuit to open", timeout=WAIT)
    closer = threading.Thread(target=b.close, kwargs={"timeout": WAIT})
    closer.start()
    wait_until(lambda: b.closed, "close() to begin", timeout=WAIT)
    release.set()
    closer.join(WAIT)
    assert not closer.is_alive()
    assert [f.result(0) for f in futs[1:]] == [1, 2, 3, 4, 5]
    assert br.state == "closed"


def test_a_probe_of_another_batcher_sharing_the_breaker_does_not_strand_a_closing_one() -> None:
    """Two batchers share a breaker (as the instances of a @batched method do). B holds the
    half-open probe while A's items wait and A closes; when B's probe fails, A's items fail fast
    and A.close() returns, instead of A sleeping with no wake-up for good."""
    probing, release = threading.Event(), threading.Event()

    def fb(xs: list[str]) -> list[str]:
        if xs == ["probe"]:
            probing.set()
            assert release.wait(WAIT)
        raise RuntimeError("B down")

    br = CircuitBreaker(failure_threshold=1, reset_timeout_s=0.5)
    a = DynamicBatcher(lambda xs: xs, max_batch_size=1, max_wait_ms=0, circuit_breaker=br, name="A")
    b = DynamicBatcher(fb, max_batch_size=1, max_wait_ms=0, circuit_breaker=br, name="B")
    try:
        with pytest.raises(RuntimeError, match="B down"):
            b.submit("first").result(WAIT)
        wait_until(lambda: br.state == "half_open", "the cool-down", timeout=WAIT, every=0.01)
        probe = b.submit("probe")
        assert probing.wait(WAIT)
        futs = [a.submit(i) for i in range(3)]
        assert a.statistics().pending == 3  # the probe is out: A may not dispatch
        closer = threading.Thread(target=a.close, kwargs={"timeout": WAIT})
        closer.start()
        wait_until(lambda: a.closed, "close() to begin", timeout=WAIT)
        release.set()
        with pytest.raises(RuntimeError, match="B down"):
            probe.result(WAIT)
        closer.join(WAIT)
        assert not closer.is_alive(), "A.close() never returned"
        assert all(f.done() for f in futs)
        for i, f in enumerate(futs):  # failed fast; or, on a slow machine, A's own later probe ran them
            assert isinstance(f.exception(), CircuitOpen) or f.result() == i
    finally:
        release.set()
        b.close(timeout=WAIT)


@pytest.mark.parametrize(
    "bad_result",
    [lambda xs: xs + xs, lambda xs: 42],
    ids=["too-many-results", "not-a-sequence"],
)
def test_malformed_results_count_as_failures_for_the_circuit_breaker(bad_result: Callable[[list[int]], object]) -> None:
    """A batch that returns the wrong number of results (or no sequence) is a failed batch:
    failure_threshold of them in a row open the circuit, and the next submit fails fast."""
    clock = MockClock()
    br = CircuitBreaker(failure_threshold=3, reset_timeout_s=30, clock=clock)
    fn: Any = bad_result  # malformed on purpose: not a batch function's type
    b: DynamicBatcher[int, Any]
    with DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, circuit_breaker=br, clock=clock) as b:
        for i in range(3):
            with pytest.raises(BatchSizeMismatch):
                b.submit(i).result(WAIT)
        assert br.state == "open"
        with pytest.raises(CircuitOpen):
            b.submit(3)


def test_a_timed_out_batch_counts_as_a_failure_for_the_circuit_breaker() -> None:
    """A batch abandoned after batch_timeout_s is a failure for the breaker at once, and a
    success if its hung call returns later does not close the circuit again."""
    clock = MockClock()
    br = CircuitBreaker(failure_threshold=1, reset_timeout_s=30, clock=clock)
    started, hang, returned = threading.Event(), threading.Event(), threading.Event()

    def fn(xs: list[int]) -> list[int]:
        started.set()
        hang.wait(WAIT)
        returned.set()
        return xs

    b = DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, batch_timeout_s=5, circuit_breaker=br, clock=clock)
    try:
        fut = b.submit(1)
        assert started.wait(WAIT)
        clock.advance(5)
        with pytest.raises(BatchTimeout):
            fut.result(WAIT)
        assert br.state == "open"
        hang.set()
        assert returned.wait(WAIT)
        assert br.state == "open"
    finally:
        hang.set()
        b.close(timeout=WAIT)


def test_a_probe_that_never_ran_frees_the_half_open_slot() -> None:
    """If the one probe batch of a half-open circuit does not run (its callers all gave up),
    the next batch may probe; the circuit does not stay half-open with nothing let through."""
    clock = MockClock()
    br = CircuitBreaker(failure_threshold=1, reset_timeout_s=5, clock=clock)
    br.record(False)
    clock.advance(5)
    assert br.allow_dispatch()
    assert not br.allow_dispatch()
    br.release_probe()
    assert br.state == "half_open"
    assert br.allow_dispatch()


class _Flaky:
    """A batch function that raises while ``down`` is set; ``batches`` records what ran."""

    def __init__(self) -> None:
        self.down = True
        self.batches: list[list[int]] = []

    def __call__(self, xs: list[int]) -> list[int]:
        self.batches.append(list(xs))
        if self.down:
            raise RuntimeError("backend down")
        return [x * 10 for x in xs]


@pytest.mark.parametrize("reason", sorted(DUE_BY_REASON))
def test_a_threaded_batcher_recovers_when_its_probe_batch_is_due_for_any_reason(reason: str) -> None:
    """``max_wait_ms > 0``: once the cool-down passed, the first batch due (by size, cost,
    max_wait_ms, flush() or close()) is the probe, and its success closes the circuit. A look
    at the queue before that batch was due (the dispatcher woken by the arrival) takes no probe,
    so later calls, and close(), no longer hang."""
    clock = MockClock()
    fn = _Flaky()
    br = CircuitBreaker(failure_threshold=5, reset_timeout_s=1.0, clock=clock)
    b: DynamicBatcher[int, int] = DynamicBatcher(fn, circuit_breaker=br, clock=clock, **DUE_BY_REASON_OPTIONS)
    for _ in range(5):
        f = b.submit(1)
        clock.advance(0.005)
        with pytest.raises(RuntimeError, match="backend down"):
            f.result(WAIT)
    assert br.state == "open"
    fn.down = False
    clock.advance(1.5)
    items, then = DUE_BY_REASON[reason]
    arrived = clock.now()
    futs = [b.submit(x) for x in items]
    if then is not None:  # the dispatcher has looked once, before the batch is due
        wait_until(lambda: b.former.wake_at == arrived + 0.005, "the dispatcher to look", timeout=WAIT)
    if then == "advance":
        clock.advance(0.005)
    elif then == "flush":
        b.flush()
    elif then == "close":
        b.close(timeout=WAIT)
    assert [f.result(WAIT) for f in futs] == [x * 10 for x in items]
    assert br.state == "closed"
    b.close(timeout=WAIT)
    assert b.recent_batches()[-1].reason == reason
    assert fn.batches[-1] == items


def test_the_circuit_breaker_example_arguments_are_its_defaults() -> None:
    """CircuitBreaker(failure_threshold=5, reset_timeout_s=10), as the guide writes it, is the default."""
    cb = batchkit.CircuitBreaker()
    assert (cb.failure_threshold, cb.reset_timeout_s, cb.state) == (5, 10.0, "closed")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"failure_threshold": 0}, "failure_threshold"),
        ({"failure_threshold": 2.5}, "failure_threshold"),
        ({"failure_threshold": True}, "failure_threshold"),
        ({"failure_threshold": "3"}, "failure_threshold"),
        ({"reset_timeout_s": 0}, "reset_timeout_s"),
        ({"reset_timeout_s": float("nan")}, "reset_timeout_s"),
        ({"reset_timeout_s": float("inf")}, "reset_timeout_s"),
        ({"reset_timeout_s": "10"}, "reset_timeout_s"),
    ],
)
def test_a_circuit_breaker_refuses_settings_that_would_never_open_or_never_probe(
    kwargs: dict[str, object], match: str
) -> None:
    """failure_threshold is a count (an int >= 1); reset_timeout_s a finite number of seconds > 0:
    a NaN or infinite cool-down would keep an open circuit open for good."""
    with pytest.raises(ValueError, match=match):
        batchkit.CircuitBreaker(**kwargs)  # type: ignore[arg-type]


def test_a_circuit_breaker_reads_half_open_once_its_cool_down_has_passed() -> None:
    """api.md: after ``reset_timeout_s`` one probe batch runs; ``state`` says so when read,
    without a ``check()`` or ``allow_dispatch()`` first."""
    clock = MockClock()
    breaker = batchkit.CircuitBreaker(failure_threshold=2, reset_timeout_s=5.0, clock=clock)
    breaker.record(False)
    assert breaker.state == "closed"
    breaker.record(False)
    assert breaker.state == "open"
    assert breaker.half_open_at == 5.0
    with pytest.raises(batchkit.CircuitOpen):
        breaker.check()
    clock.advance(5.0)
    assert breaker.state == "half_open"
    breaker.check()  # new work is admitted again, to make the probe
    assert breaker.allow_dispatch()
    assert not breaker.allow_dispatch()  # one probe only
    breaker.release_probe()  # it did not run: the next batch probes
    assert breaker.allow_dispatch()
    breaker.record(True)
    assert breaker.state == "closed"
