"""EngineCore: the decode loop's step, ``schedule()`` -> :meth:`StepRunner.run` -> ``update()``.

It owns no thread and no lock: the loop's engine thread (or a caller of ``step_once``) drives it,
one thread at a time, and hands it what the inbox gathered (arrivals, aborts) at each step
boundary. It keeps each admitted request's :class:`RequestStream`, pushes the step's events to
them and returns the waiters to wake; it counts the steps for :class:`LoopStatistics`.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import BatcherClosed
from .._waiters import wake_all
from ..metrics import LatencySummary, SampleWindow
from .request import Request, ScheduledStep, TokenEvent
from .runner import StepRunner
from .scheduler import Scheduler, SchedulerStatistics
from .stream import RequestStream

__all__ = ["EngineCore", "LoopStatistics"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopStatistics:
    """Scheduler counters and latencies, plus the loop's throughput and step times (``step_time``:
    every step of the run, mergeable; ``step_time_recent``: the last 10,000 steps)."""

    scheduler: SchedulerStatistics
    steps: int
    tokens_per_s: float
    step_time: LatencySummary
    step_time_recent: LatencySummary


def _end_all(pending: Iterable[tuple[Hashable, RequestStream]], reason: str, error: BaseException) -> None:
    """End each stream of ``pending`` with ``error`` and wake its caller."""
    wake_all(w for rid, s in pending if (w := s.push(TokenEvent(rid, None, True, reason, error))) is not None)


class EngineCore:
    """One step at a time over a :class:`Scheduler` and a :class:`StepRunner`.

    Args:
        scheduler: which requests run each step.
        runner: the step's torch work (the block moves, the model, sampling).
    """

    def __init__(self, scheduler: Scheduler, runner: StepRunner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.streams: dict[Hashable, RequestStream] = {}  # of the requests in the scheduler
        self._steps = 0
        self._step_time = SampleWindow()
        self._t_first: float | None = None
        self._t_last = 0.0
        self._generated = 0

    def admit(self, arrivals: list[tuple[Request, RequestStream]], now: float) -> list[Any]:
        """Hand requests taken from the inbox to the scheduler, arrived at ``now``; the waiters
        to wake of those it refused (their streams get the error)."""
        wake: list[Any] = []
        for req, stream in arrivals:
            try:
                self.scheduler.add(req, now)
            except Exception as exc:  # noqa: BLE001 - the caller gets it on its stream
                wake.append(stream.push(TokenEvent(req.request_id, None, True, "error", exc)))
                continue
            self.streams[req.request_id] = stream
        return wake

    def step(self, now: float, aborts: list[Hashable]) -> tuple[ScheduledStep, list[TokenEvent]]:
        """One iteration that starts at ``now``: ``aborts``, schedule, run, update."""
        dropped = [TokenEvent(rid, None, True, "abort") for rid in aborts if self.scheduler.abort(rid)]
        step = self.scheduler.schedule(now)
        events = dropped + self.scheduler.take_events()
        if step.requests:
            try:
                events += self._run(step)
            except Exception as exc:  # noqa: BLE001 - a failing step fails its requests, not the loop
                for req in step.requests:
                    if self.scheduler.abort(req.request_id):
                        events.append(TokenEvent(req.request_id, None, True, "error", exc))
        if self.runner.grammars:  # after every way this step ends requests: finished, failed, aborted
            self.runner.grammars.discard_ended()
        return step, events

    def route(self, events: list[TokenEvent]) -> list[Any]:
        """Push each event to its request's stream (a finished one leaves); the waiters to wake."""
        wake: list[Any] = []
        for ev in events:
            target = self.streams.get(ev.request_id)
            if target is None:
                continue
            if ev.finished:
                del self.streams[ev.request_id]
            wake.append(target.push(ev))
        return wake

    def _run(self, step: ScheduledStep) -> list[TokenEvent]:
        """Run a scheduled step (:meth:`StepRunner.run`), then the scheduler's update; the
        requests whose rows failed end with their errors."""
        out = self.runner.run(step)
        self._record_step(out.started, out.ended, len(out.tokens))
        events = self.scheduler.update(step, out.tokens, out.logprobs, out.ended)
        return self._fail_rows(events, out.failed) if out.failed else events

    def _record_step(self, t0: float, done: float, num_tokens: int) -> None:
        """Count a step that ran from ``t0`` to ``done`` and sampled ``num_tokens`` tokens."""
        self._step_time.add(done - t0)
        self._steps += 1
        self._generated += num_tokens
        if self._t_first is None:
            self._t_first = t0
        self._t_last = done

    def _fail_rows(self, events: list[TokenEvent], failed: Mapping[Hashable, BaseException]) -> list[TokenEvent]:
        """``events`` with the requests of ``failed`` (rows no token could be drawn from, a bias
        past the logits, a grammar, sampling that raised) failed instead, each with its error."""
        events = [ev for ev in events if ev.request_id not in failed]
        for rid, error in failed.items():
            self.scheduler.abort(rid)  # False if the sampled token had finished it: fail it all the same
            events.append(TokenEvent.ended(rid, "error", error))
        return events

    def shut_down(self, unadmitted: list[tuple[Request, RequestStream]]) -> None:
        """End what a closed loop leaves: every request in the scheduler and ``unadmitted`` (left
        in the inbox) is aborted there, so that its blocks go back to the pool and statistics()
        counts it aborted, not running or waiting for ever; its caller gets BatcherClosed."""
        self._abort_all([r for r, _ in unadmitted])
        pending = [*self.streams.items(), *((r.request_id, s) for r, s in unadmitted)]
        self.streams = {}
        _end_all(pending, "abort", BatcherClosed("the decode loop was closed"))

    def fail(self, unadmitted: list[tuple[Request, RequestStream]], fault: BaseException) -> None:
        """End every request after a fault of the engine itself: its caller gets
        :class:`BatcherClosed` caused by ``fault``; then, as a close would, the blocks go back to
        the pool and statistics() counts the requests aborted (``unadmitted``: those the
        scheduler has not seen)."""
        pending = [*self.streams.items(), *((r.request_id, s) for r, s in unadmitted)]
        self.streams = {}
        failed = BatcherClosed(f"the decode loop's engine failed: {fault!r}")
        failed.__cause__ = fault
        _end_all(pending, "error", failed)
        try:
            self._abort_all([r for r, _ in unadmitted if self.scheduler.get(r.request_id) is None])
        except Exception:  # a scheduler the fault left inconsistent: the fault is what to raise
            logger.exception("the decode loop could not abort its requests after its engine failed")

    def _abort_all(self, unadmitted: list[Request]) -> None:
        """Abort every request the scheduler holds, and ``unadmitted`` (which it never saw: each
        is added and aborted, so that statistics() counts it aborted like the rest)."""
        sched = self.scheduler
        for req in [*sched.running, *sched.swapped, *sched.waiting]:
            sched.abort(req.request_id)
        for req in unadmitted:
            try:
                sched.add(req)
            except Exception:  # noqa: BLE001 - refused at add: it never ran, nothing to count
                continue
            sched.abort(req.request_id)

    def statistics(self) -> LoopStatistics:
        """The scheduler's statistics, the steps run, the tokens per second over the steps' span."""
        span = self._t_last - self._t_first if self._t_first is not None else 0.0
        return LoopStatistics(
            scheduler=self.scheduler.statistics(),
            steps=self._steps,
            tokens_per_s=self._generated / span if span > 0 else 0.0,
            step_time=self._step_time.summary(),
            step_time_recent=self._step_time.recent(),
        )
