"""MockClock refuses times that would break every deadline computed from it."""

from __future__ import annotations

import math

import pytest

from batchkit.testing import MockClock


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
