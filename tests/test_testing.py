"""MockClock refuses times that would break every deadline computed from it, and tells its
listeners when time advances (docs/api.md, "Time and testing")."""

from __future__ import annotations

import math
import threading

import pytest

import batchkit
from batchkit.testing import MockClock

WAIT_S = 10.0  # the bound of every wait below; never reached when the promise holds


@pytest.mark.parametrize("seconds", [-1.0, math.nan, math.inf, "1", None, True])
def test_advance_refuses_negative_non_finite_and_non_numeric_steps(seconds: float) -> None:
    clock = MockClock(1.0)
    with pytest.raises(ValueError, match="seconds"):
        clock.advance(seconds)
    assert clock.now() == 1.0


@pytest.mark.parametrize("start", [math.nan, math.inf, -math.inf])
def test_a_non_finite_start_is_refused(start: float) -> None:
    with pytest.raises(ValueError, match="start"):
        MockClock(start)


def test_advance_moves_time_by_exactly_the_step() -> None:
    clock = MockClock()
    clock.advance(0.25)
    clock.advance(0)
    assert clock.now() == 0.25


def test_mock_clock_notifies_its_listeners_when_it_advances_and_stops_after_removal() -> None:
    """api.md: ``add_listener(cond)`` has ``notify_all()`` called on the condition whenever time
    advances; ``remove_listener(cond)`` stops it (and removing twice is harmless)."""
    clock = MockClock(start=5.0)
    cond = threading.Condition()
    clock.add_listener(cond)
    outcomes: list[tuple[bool, float]] = []
    ready = threading.Event()

    def wait_once(limit: float) -> None:
        with cond:
            ready.set()
            outcomes.append((cond.wait(limit), clock.now()))

    waiter = threading.Thread(target=wait_once, args=(WAIT_S,))
    waiter.start()
    assert ready.wait(WAIT_S)
    with cond:  # taken only once the waiter waits (wait releases it)
        pass
    clock.advance(0.5)
    waiter.join(WAIT_S)
    assert outcomes == [(True, 5.5)]

    clock.remove_listener(cond)
    clock.remove_listener(cond)
    ready.clear()
    waiter = threading.Thread(target=wait_once, args=(0.05,))
    waiter.start()
    assert ready.wait(WAIT_S)
    with cond:
        pass
    clock.advance(1.0)  # nobody is told: the waiter's own limit ends its wait
    waiter.join(WAIT_S)
    assert outcomes[1] == (False, 6.5)
    assert batchkit.testing.echo_batch([1, "a"]) == [1, "a"]
