"""What an ``AdaptiveTuner`` policy returns is checked before it reaches the target: a bool, a
string ``int()`` would parse, None or NaN is a ValueError and the batch size stays."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import batchkit


class _Policy:
    def __init__(self, choice: Any) -> None:
        self.choice = choice

    def decide(self, queue_depth: float, latencies_s: Any, now: float) -> Any:
        return self.choice


@pytest.mark.parametrize("choice", [True, "8", None, float("nan"), float("inf")], ids=repr)
def test_a_policy_choice_that_is_not_a_number_is_refused(choice: Any) -> None:
    with batchkit.DynamicBatcher(lambda xs: xs, max_batch_size=4, max_wait_ms=1) as b:
        tuner = batchkit.AdaptiveTuner(b, _Policy(choice))
        with pytest.raises(ValueError, match="policy chose batch size"):
            tuner.step()
        assert b.max_batch_size == 4
        assert b(1) == 1


@pytest.mark.parametrize("choice", [6, 6.0, np.int64(6), np.float32(6.5)], ids=repr)
def test_a_policy_choice_that_is_a_number_is_applied(choice: Any) -> None:
    with batchkit.DynamicBatcher(lambda xs: xs, max_batch_size=4, max_wait_ms=1) as b:
        assert batchkit.AdaptiveTuner(b, _Policy(choice)).step() == 6
        assert b.max_batch_size == 6
