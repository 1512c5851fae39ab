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


@pytest.mark.parametrize(
    "bad",
    [
        {"eta": 1.5},
        {"max_batch": 8.0},
        {"initial": 2.5},
        {"eta": True},
        {"target_queue": float("nan")},
        {"cooldown_s": float("nan")},
        {"deadband": float("inf")},
        {"latency_slo_ms": float("nan")},
        {"min_headroom": 2.0},
        {"min_headroom": -0.1},
    ],
)
def test_controller_refuses_fractional_batch_sizes_and_numbers_that_are_not_finite(bad: dict[str, object]) -> None:
    """Batch sizes are whole numbers and limits are finite: a bad one fails at construction with
    ValueError naming it, not later as a fractional batch size or a guard that never fires."""
    kwargs: dict[str, object] = {"target_queue": 1.0, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        batchkit.AdaptiveBatchController(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan"), float("inf")])
def test_tuner_start_refuses_an_interval_that_is_not_a_positive_number(interval: float) -> None:
    """start(0) would spin a core on step() with no pause; it is refused, and nothing starts."""
    b = batchkit.DynamicBatcher(batchkit.testing.echo_batch, max_batch_size=4)
    policy = _Policy(3)
    tuner = batchkit.AdaptiveTuner(b, policy)
    with pytest.raises(ValueError, match="interval_s"):
        tuner.start(interval_s=interval)
    tuner.stop()
    assert not policy.called.is_set()
    b.close()


class _FailsThenSizes:
    """Raises on its first two decisions, then chooses ``size`` (and sets ``recovered``)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.calls = 0
        self.recovered = threading.Event()

    def decide(self, queue_depth: float, latencies_s: list[float], now: float) -> int:
        self.calls += 1
        if self.calls <= 2:
            raise RuntimeError("the policy's metrics source is down")
        self.recovered.set()
        return self.size


def test_a_failing_step_is_logged_and_the_timer_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """One failing step (a policy that raised) must not end the tuning for good: the timer thread
    logs it and steps again, and the policy's next choice is applied."""
    b = batchkit.DynamicBatcher(batchkit.testing.echo_batch, max_batch_size=4)
    policy = _FailsThenSizes(7)
    tuner = batchkit.AdaptiveTuner(b, policy)
    with caplog.at_level("ERROR", logger="batchkit.adaptive"):
        tuner.start(interval_s=0.001)
        try:
            assert policy.recovered.wait(WAIT)
        finally:
            tuner.stop()
    assert b.max_batch_size == 7
    assert [r.getMessage() for r in caplog.records if "metrics source is down" in r.getMessage()] != []
    b.close()
