"""docs/api.md promises of AdaptiveTuner and AdaptiveBatchController, checked from the outside."""

from __future__ import annotations

import threading

import pytest

import batchkit

WAIT = 10


class _Policy:
    """Always batch size ``size``; sets ``called`` on every decision."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.called = threading.Event()

    def decide(self, queue_depth: float, latencies_s: list[float], now: float) -> int:
        self.called.set()
        return self.size


def test_a_stopped_tuner_steps_again_after_start() -> None:
    """start(), stop(), start(): the second start steps on a timer again."""
    b = batchkit.DynamicBatcher(batchkit.testing.echo_batch, max_batch_size=4)
    policy = _Policy(3)
    tuner = batchkit.AdaptiveTuner(b, policy)
    tuner.start(interval_s=0.001)
    assert policy.called.wait(WAIT)
    tuner.stop()
    policy.called.clear()
    policy.size = 5
    tuner.start(interval_s=0.001)
    try:
        assert policy.called.wait(WAIT)
    finally:
        tuner.stop()
    b.close()


def test_a_policy_that_chooses_batch_size_zero_is_refused_and_nothing_changes() -> None:
    """A batch size of 0 would stall a batcher for good: step() refuses it and keeps the size."""
    b = batchkit.DynamicBatcher(batchkit.testing.echo_batch, max_batch_size=4, max_wait_ms=1)
    tuner = batchkit.AdaptiveTuner(b, _Policy(0))
    with pytest.raises(ValueError, match="batch size"):
        tuner.step()
    assert b.max_batch_size == 4
    assert b.submit(7).result(timeout=WAIT) == 7
    b.close()


@pytest.mark.parametrize("quantile", [-1.0, 100.5, 150.0])
def test_controller_refuses_a_quantile_that_is_not_a_percentile(quantile: float) -> None:
    """slo_quantile is a percentile: out of [0, 100] it fails at construction, not at the first update."""
    with pytest.raises(ValueError, match="slo_quantile"):
        batchkit.AdaptiveBatchController(target_queue=1, latency_slo_ms=10, slo_quantile=quantile)
