"""batchkit._clock: every component that takes a ``clock`` refuses one without ``now()`` where
it is given, not with an AttributeError at its first read."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import batchkit
from batchkit._clock import MonotonicClock, checked_clock
from batchkit.testing import MockClock


def test_checked_clock_defaults_to_the_monotonic_clock_and_keeps_a_given_one() -> None:
    assert isinstance(checked_clock(None), MonotonicClock)
    clock = MockClock()
    assert checked_clock(clock) is clock


def _target() -> Any:
    return batchkit.DynamicBatcher(lambda xs: xs)


BUILDERS: dict[str, Callable[[Any], object]] = {
    "CircuitBreaker": lambda clock: batchkit.CircuitBreaker(clock=clock),
    "AdaptiveBatchController": lambda clock: batchkit.AdaptiveBatchController(target_queue=8, clock=clock),
    "BoundedQueue": lambda clock: batchkit.BoundedQueue(4, clock=clock),
    "DynamicBatcher": lambda clock: batchkit.DynamicBatcher(lambda xs: xs, clock=clock),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("clock", [3, "now", object()])
def test_a_clock_without_now_is_a_type_error_at_construction(name: str, clock: object) -> None:
    with pytest.raises(TypeError, match=r"clock must have a now\(\) method"):
        BUILDERS[name](clock)


def test_the_tuner_refuses_a_clock_without_now_at_construction() -> None:
    target = _target()
    try:
        with pytest.raises(TypeError, match=r"clock must have a now\(\) method"):
            batchkit.AdaptiveTuner(target, batchkit.AdaptiveBatchController(target_queue=8), clock=3)  # type: ignore[arg-type]
    finally:
        target.close()
