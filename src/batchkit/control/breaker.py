"""The circuit breaker: fail fast after repeated failures of the batch function, probe again
after a cool-down. A state machine told the time, its transitions one table."""

from __future__ import annotations

import enum

from .._clock import Clock, checked_clock
from .._errors import CircuitOpen
from .._validate import positive_int
from .controller import is_finite

__all__ = ["BreakerState", "CircuitBreaker"]


class BreakerState(str, enum.Enum):
    """A :class:`CircuitBreaker`'s state; compares equal to its value (``BreakerState.OPEN == "open"``)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    def __str__(self) -> str:
        return self.value


_CLOSED, _OPEN, _HALF_OPEN = BreakerState.CLOSED, BreakerState.OPEN, BreakerState.HALF_OPEN

#: The breaker's state machine: (state, event) -> next state. Events: a batch ``succeeded``; a
#: batch ``failed`` with fewer consecutive failures than the threshold; one ``tripped`` it (the
#: threshold reached, or any failure of a half-open probe); the cool-down ``elapsed``. Entering
#: ``OPEN`` (from any state, again from ``OPEN`` too) restarts the cool-down.
_TRANSITIONS: dict[tuple[BreakerState, str], BreakerState] = {
    (_CLOSED, "succeeded"): _CLOSED,
    (_CLOSED, "failed"): _CLOSED,
    (_CLOSED, "tripped"): _OPEN,
    (_OPEN, "succeeded"): _CLOSED,  # a batch dispatched before it opened came back fine
    (_OPEN, "tripped"): _OPEN,
    (_OPEN, "elapsed"): _HALF_OPEN,
    (_HALF_OPEN, "succeeded"): _CLOSED,
    (_HALF_OPEN, "tripped"): _OPEN,
}


class CircuitBreaker:
    """Fail fast after repeated failures; probe again after a cool-down.

    closed -> (``failure_threshold`` consecutive failures) -> open: :meth:`check` raises
    :class:`CircuitOpen` -> (``reset_timeout_s`` later) -> half-open: one probe may run ->
    success closes, failure opens again (the transitions are one table, ``_TRANSITIONS``).

    Like the batch former, the breaker is told the time: every method that depends on it takes
    ``now`` (seconds on the driver's clock), and reads ``clock`` only when ``now`` is omitted
    (the ``state`` property, for a health check reading it from another thread).

    Raises:
        ValueError: ``failure_threshold`` is not an int >= 1, or ``reset_timeout_s`` is not a
            finite number of seconds > 0.
    """

    def __init__(self, failure_threshold: int = 5, reset_timeout_s: float = 10.0, clock: Clock | None = None) -> None:
        positive_int("failure_threshold", failure_threshold)
        # A NaN or infinite cool-down would keep an open circuit open for good.
        if not (is_finite(reset_timeout_s) and reset_timeout_s > 0):
            raise ValueError(f"reset_timeout_s must be a finite number of seconds > 0, got {reset_timeout_s!r}")
        self.failure_threshold = int(failure_threshold)
        self.reset_timeout_s = float(reset_timeout_s)
        self.clock: Clock = checked_clock(clock)
        self._state = _CLOSED
        self._failures = 0
        self._opened_at = 0.0
        # The _opened_at of the opening whose probe went out: a probe belongs to one opening, so
        # a state read racing from another thread cannot hand out a second one by resetting a flag.
        self._probe_for: float | None = None
        self.opens = 0

    def _now(self, now: float | None) -> float:
        return self.clock.now() if now is None else now

    def _fire(self, event: str, now: float) -> None:
        new = _TRANSITIONS[(self._state, event)]
        if new is _OPEN:
            if self._state is not _OPEN:
                self.opens += 1
            self._opened_at = now
        self._state = new

    def state_at(self, now: float) -> BreakerState:
        """The state at ``now``: an open circuit whose ``reset_timeout_s`` has passed is
        half-open (its probe may go). A question only: the breaker is not changed (asking about
        a later time does not let work through early, and a health check reading :attr:`state`
        from another thread moves nothing)."""
        if self._state is _OPEN and now - self._opened_at >= self.reset_timeout_s:
            return _HALF_OPEN
        return self._state

    def _advance(self, now: float) -> BreakerState:
        """Enter half-open if the cool-down has passed at ``now``; the state then."""
        if self.state_at(now) is not self._state:
            self._fire("elapsed", now)
        return self._state

    @property
    def state(self) -> BreakerState:
        """:meth:`state_at` the breaker's ``clock`` reads now (``"closed"``, ``"open"`` or
        ``"half_open"``)."""
        return self.state_at(self.clock.now())

    def check(self, now: float | None = None) -> None:
        """Raise :class:`CircuitOpen` if new work must fail fast at ``now`` (default: ``clock``)."""
        now = self._now(now)
        if self._advance(now) is _OPEN:
            left = self.reset_timeout_s - (now - self._opened_at)
            raise CircuitOpen(
                f"{self._failures} consecutive batch failures opened the circuit; new work fails fast for "
                f"another {left:.1f} s, then one probe batch is let through"
            )

    def allow_dispatch(self, now: float | None = None) -> bool:
        """Whether a batch may be dispatched at ``now`` (half-open: only the one probe). A True
        in half-open hands out the probe: call it only for a batch that is then dispatched, and
        :meth:`release_probe` if that batch does not run after all."""
        state = self._advance(self._now(now))
        if state is _CLOSED:
            return True
        if state is _HALF_OPEN and self._probe_for != self._opened_at:
            self._probe_for = self._opened_at
            return True
        return False

    @property
    def half_open_at(self) -> float:
        """When an open circuit lets a probe through (meaningful while ``state == "open"``)."""
        return self._opened_at + self.reset_timeout_s

    def release_probe(self) -> None:
        """A batch allowed by :meth:`allow_dispatch` did not run (its callers all gave up): in
        half-open, let the next batch be the probe. Neither a success nor a failure."""
        self._probe_for = None

    def record(self, success: bool, now: float | None = None) -> None:
        """Report a dispatched batch's outcome at ``now`` (default: ``clock``): a success is a
        batch whose function returned one result per item (per-item exceptions included); a
        failure is one that raised, returned a malformed result, or ran past its timeout."""
        now = self._now(now)
        state = self._advance(now)
        if success:
            self._failures = 0
            self._fire("succeeded", now)
            return
        self._failures += 1
        tripped = state is not _CLOSED or self._failures >= self.failure_threshold
        self._fire("tripped" if tripped else "failed", now)

    def __repr__(self) -> str:
        return f"<CircuitBreaker {self._state.value} failures={self._failures}>"
