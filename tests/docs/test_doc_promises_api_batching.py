"""docs/api.md, "Time and testing": MockClock's listeners, checked through the public API (the
section's other promises are tested beside their units in tests/dynamic/, tests/control/ and
tests/test_collate.py)."""

from __future__ import annotations

import threading

import batchkit
from batchkit.testing import MockClock

WAIT_S = 10.0  # the bound of every wait below; never reached when the promise holds


# ---------------------------------------------------------------------------- time and testing


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
