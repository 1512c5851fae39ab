"""RequestLedger: one transition table for a request's life, and each rule on exact inputs."""

from __future__ import annotations

from typing import Any

import pytest

from batchkit import BatcherClosed, CircuitOpen, DeadlineExceeded, QueueFull
from batchkit.dynamic._queue_core import QueueCore
from batchkit.dynamic.ledger import (
    FINAL,
    NO_FALLBACK,
    TRANSITIONS,
    Event,
    Fail,
    IllegalTransition,
    Phase,
    RequestLedger,
    Split,
)


class Req:
    """A request as a shell holds one: the fields the ledger reads and writes."""

    def __init__(self, arrival: float = 0.0, fallback: Any = NO_FALLBACK) -> None:
        self.phase = Phase.WAITING
        self.fallback = fallback
        self.value: Any = None
        self.error: BaseException | None = None
        self.arrival = arrival


def counts(ledger: RequestLedger) -> dict[str, int]:
    names = ("submitted", "succeeded", "failed", "cancelled", "expired", "rejected")
    return {n: getattr(ledger, n) for n in names if getattr(ledger, n)}


class TestTheTable:
    def test_the_final_phases_are_the_ones_without_a_row(self) -> None:
        """Answered, gone or given up: no event moves a request out of these."""
        assert {
            Phase.SUCCEEDED,
            Phase.FAILED,
            Phase.CANCELLED,
            Phase.EXPIRED,
            Phase.EVICTED,
            Phase.ABANDONED,
        } == FINAL

    def test_a_waiting_request_can_start_or_leave_unrun(self) -> None:
        """From WAITING: start, or be cancelled, expired, evicted, abandoned or failed unrun."""
        assert TRANSITIONS[Phase.WAITING] == {
            Event.START: Phase.RUNNING,
            Event.CANCEL: Phase.CANCELLED,
            Event.EXPIRE: Phase.EXPIRED,
            Event.EVICT: Phase.EVICTED,
            Event.ABANDON: Phase.ABANDONED,
            Event.FAIL: Phase.FAILED,
        }

    def test_a_running_request_ends_answered_cancelled_or_abandoned(self) -> None:
        """From RUNNING: a result, an exception, a caller that gave up, or a close before the call."""
        assert TRANSITIONS[Phase.RUNNING] == {
            Event.SUCCEED: Phase.SUCCEEDED,
            Event.FAIL: Phase.FAILED,
            Event.CANCEL: Phase.CANCELLED,
            Event.ABANDON: Phase.ABANDONED,
        }

    def test_the_queue_core_takes_a_queued_request_or_lets_it_leave_unserved(self) -> None:
        """From QUEUED (the queue core's two moves): taken into a batch, or out unserved."""
        assert TRANSITIONS[Phase.QUEUED] == {Event.TAKE: Phase.WAITING, Event.LEAVE: Phase.LEFT}

    def test_a_request_out_of_the_queue_unserved_is_told_why(self) -> None:
        """From LEFT: the drop (or the cancel) that took it out names its end."""
        assert TRANSITIONS[Phase.LEFT] == {
            Event.CANCEL: Phase.CANCELLED,
            Event.EXPIRE: Phase.EXPIRED,
            Event.EVICT: Phase.EVICTED,
            Event.ABANDON: Phase.ABANDONED,
        }

    def test_the_queue_core_moves_the_one_phase_of_an_entry(self) -> None:
        """A queue entry's only state is its phase: QUEUED, then WAITING once taken, or LEFT
        once expired, evicted, cancelled or discarded; never both at once."""
        core: QueueCore[str] = QueueCore(4)
        taken, cancelled = (core.insert(x, 0, None, None, 1, now=0.0)[0] for x in "ab")
        assert (taken.phase, cancelled.phase) == (Phase.QUEUED, Phase.QUEUED)
        assert core.take(1, now=0.0) == [taken]
        assert core.cancel(cancelled)
        assert (taken.phase, cancelled.phase) == (Phase.WAITING, Phase.LEFT)
        assert (taken.waiting, cancelled.waiting) == (False, False)

    @pytest.mark.parametrize("final", sorted(FINAL, key=str))
    @pytest.mark.parametrize("event", list(Event))
    def test_a_final_request_ignores_every_event(self, final: Phase, event: Event) -> None:
        """A request is answered once: later events change nothing and count nothing."""
        ledger, req = RequestLedger(), Req()
        req.phase = final
        assert ledger.move(req, event) is False
        assert req.phase is final
        assert counts(ledger) == {}

    def test_a_move_the_table_lacks_is_a_bug_in_the_shell(self) -> None:
        """A waiting request cannot succeed: it never ran."""
        with pytest.raises(IllegalTransition, match="waiting cannot succeed"):
            RequestLedger().move(Req(), Event.SUCCEED)


class TestCounters:
    def test_admission_and_refusal_are_counted(self) -> None:
        """submitted counts admissions; rejected counts refusals."""
        ledger = RequestLedger()
        ledger.admitted(1.0)
        ledger.admitted(2.0)
        ledger.refused()
        assert counts(ledger) == {"submitted": 2, "rejected": 1}
        assert ledger.t_first == 1.0

    def test_answers_count_successes_and_per_item_failures(self) -> None:
        """A result counts succeeded; an Exception in a slot counts failed."""
        ledger = RequestLedger()
        a, b = Req(arrival=1.0), Req(arrival=2.0)
        bad = ValueError("bad item")
        woken, latencies = ledger.answer(ledger.start([a, b]), ["x", bad], now=5.0)
        assert woken == [a, b]
        assert latencies == [4.0, 3.0]
        assert (a.value, b.error) == ("x", bad)
        assert counts(ledger) == {"succeeded": 1, "failed": 1}
        assert ledger.latency.total == 2
        assert ledger.t_last == 5.0

    def test_throughput_is_answers_per_second_from_first_admission(self) -> None:
        """Two answers over two seconds: one per second."""
        ledger = RequestLedger()
        ledger.admitted(1.0)
        ledger.answer(ledger.start([Req(), Req()]), [1, 2], now=3.0)
        assert ledger.throughput_rps() == 1.0

    def test_a_failed_batch_fails_the_callers_still_waiting_for_it(self) -> None:
        """fail() skips a caller that gave up; the rest count failed."""
        ledger = RequestLedger()
        a, b = ledger.start([Req(), Req()])
        ledger.cancel(a)
        woken, _ = ledger.fail([a, b], RuntimeError("boom"), now=1.0)
        assert woken == [b]
        assert counts(ledger) == {"failed": 1, "cancelled": 1}

    def test_cancel_counts_once_and_start_skips_the_cancelled(self) -> None:
        """A cancelled request is not started, and a second cancel counts nothing."""
        ledger = RequestLedger()
        a, b = Req(), Req()
        assert ledger.cancel(a) is True
        assert ledger.cancel(a) is False
        assert ledger.start([a, b]) == [b]
        assert counts(ledger) == {"cancelled": 1}

    def test_abandon_counts_as_cancelled(self) -> None:
        """Requests close failed before they ran count as cancelled, with the close's error."""
        ledger = RequestLedger()
        closed = BatcherClosed("closed")
        reqs = [Req(), *ledger.start([Req()])]
        assert ledger.abandon(reqs, closed) == reqs
        assert all(r.error is closed for r in reqs)
        assert counts(ledger) == {"cancelled": 2}


class TestDrops:
    def test_a_deadline_answers_with_the_fallback_when_there_is_one(self) -> None:
        """The fallback rule: an expired request with a fallback gets it as its value."""
        ledger = RequestLedger()
        with_fb, without = Req(fallback="fb"), Req()
        late = DeadlineExceeded("late")
        assert ledger.drop([(with_fb, late), (without, late)]) == [with_fb, without]
        assert (with_fb.value, with_fb.error) == ("fb", None)
        assert without.error is late
        assert counts(ledger) == {"expired": 2}

    def test_an_eviction_never_uses_the_fallback_and_counts_rejected(self) -> None:
        """Evicted from a full queue: the error, counted as rejected."""
        ledger, req = RequestLedger(), Req(fallback="fb")
        full = QueueFull("evicted")
        ledger.drop([(req, full)])
        assert (req.phase, req.error, req.value) == (Phase.EVICTED, full, None)
        assert counts(ledger) == {"rejected": 1}

    @pytest.mark.parametrize("exc", [BatcherClosed("closed"), CircuitOpen("open")])
    def test_a_close_never_uses_the_fallback_and_counts_cancelled(self, exc: BaseException) -> None:
        """Failed at close (BatcherClosed, or an open breaker behind a drain): cancelled."""
        ledger, req = RequestLedger(), Req(fallback="fb")
        ledger.drop([(req, exc)])
        assert (req.phase, req.error) == (Phase.ABANDONED, exc)
        assert counts(ledger) == {"cancelled": 1}

    def test_closing_counts_any_drop_as_cancelled(self) -> None:
        """closing=True: whatever the exception, the request never ran because of the close
        (and a close never answers with the fallback)."""
        ledger, req = RequestLedger(), Req(fallback="fb")
        ledger.drop([(req, DeadlineExceeded("late"))], closing=True)
        assert (req.phase, req.value) == (Phase.ABANDONED, None)
        assert isinstance(req.error, DeadlineExceeded)
        assert counts(ledger) == {"cancelled": 1}

    def test_a_request_answered_already_is_not_dropped(self) -> None:
        """A request its caller gave up on is not woken again by its drop."""
        ledger, req = RequestLedger(), Req()
        ledger.cancel(req)
        assert ledger.drop([(req, DeadlineExceeded("late"))]) == []
        assert counts(ledger) == {"cancelled": 1}


class TestSplitAndRetry:
    def test_out_of_memory_splits_the_batch_in_halves(self) -> None:
        """Out of memory on 5 requests: retry the first 2, then the last 3."""
        reqs = [Req() for _ in range(5)]
        verdict = RequestLedger().after_error(reqs, MemoryError(), oom=True)
        assert verdict == Split(reqs[:2], reqs[2:], oom=True)

    def test_isolate_errors_splits_an_ordinary_error(self) -> None:
        """isolate_errors: any Exception splits."""
        reqs = [Req(), Req()]
        verdict = RequestLedger(isolate_errors=True).after_error(reqs, ValueError(), oom=False)
        assert verdict == Split(reqs[:1], reqs[1:], oom=False)

    def test_an_ordinary_error_fails_the_batch_without_isolate_errors(self) -> None:
        """No isolate_errors, no out of memory: fail every request with the error."""
        exc = ValueError()
        assert RequestLedger().after_error([Req(), Req()], exc, oom=False) == Fail(exc, oom=False)

    def test_a_single_request_is_never_split(self) -> None:
        """Down to one request, out of memory fails it."""
        exc = MemoryError()
        assert RequestLedger(isolate_errors=True).after_error([Req()], exc, oom=True) == Fail(exc, oom=True)

    @pytest.mark.parametrize("exc", [BatcherClosed("closed"), KeyboardInterrupt()])
    def test_a_close_or_a_base_exception_is_never_split(self, exc: BaseException) -> None:
        """A close (or KeyboardInterrupt) would fail the halves the same way: fail at once."""
        verdict = RequestLedger(isolate_errors=True).after_error([Req(), Req()], exc, oom=False)
        assert verdict == Fail(exc, oom=False)
