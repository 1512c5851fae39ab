"""AdaptiveTuner: a policy applied to any tunable target (a batcher, a decode loop) through its public protocol."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import batchkit
from batchkit import (
    AdaptiveBatchController,
    AdaptiveTuner,
    DynamicBatcher,
)
from batchkit.control import TunableTarget
from batchkit.testing import MockClock

WAIT = 10


def test_tuner_applies_a_policy_to_a_batcher_and_a_decode_loop() -> None:
    """AdaptiveTuner reads the target's statistics and sets its live limit; any policy object works."""
    # max_batch_size above the 10 items and a clock that never moves: nothing is dispatched, the depth is exact.
    b = DynamicBatcher(lambda xs: xs, max_batch_size=64, max_wait_ms=1e6, clock=MockClock())
    for i in range(10):
        b.submit(i)
    seen = []

    class Policy:
        def decide(self, queue_depth: float, latencies_s: list[float], now: float) -> int:
            seen.append(queue_depth)
            return 16

    assert AdaptiveTuner(b, Policy()).step() == 16
    assert b.max_batch_size == 16
    assert seen == [10.0]
    b.close()
    torch = pytest.importorskip("torch")
    kv = batchkit.PagedKVCache(1, 16, 4, 1, 4)
    loop = batchkit.ContinuousDecodeLoop(lambda batch, kv: torch.zeros(len(batch.sample_indices), 8), kv)
    tuner = AdaptiveTuner(loop, AdaptiveBatchController(target_queue=1, max_batch=64, initial=32))
    assert tuner.step() == 31  # nothing waiting: step down
    assert loop.scheduler.max_num_seqs == 31


def test_tuner_drives_any_tunable_target_through_its_public_protocol() -> None:
    """AdaptiveTuner reads queue_depth() and the new latency samples of a TunableTarget and applies
    the policy's size with set_batch_limit(); it passes each sample to the policy once."""

    class Target:
        def __init__(self) -> None:
            self.samples = [0.1, 0.2]
            self.limit = 0

        def queue_depth(self) -> int:
            return 7

        def latency_samples(self, since: int = 0) -> tuple[list[float], int]:
            return self.samples[since:], len(self.samples)

        def set_batch_limit(self, size: int) -> None:
            self.limit = size

    seen: list[tuple[float, list[float]]] = []

    class Policy:
        def decide(self, queue_depth: float, latencies_s: list[float], now: float) -> int:
            seen.append((queue_depth, latencies_s))
            return 5

    target = Target()
    assert isinstance(target, TunableTarget)
    tuner = AdaptiveTuner(target, Policy(), clock=MockClock())
    assert tuner.step() == 5
    target.samples.append(0.3)
    tuner.step()
    assert seen == [(7.0, [0.1, 0.2]), (7.0, [0.3])]
    assert target.limit == 5


def test_tuner_refuses_a_target_it_cannot_drive() -> None:
    """A target that is neither a TunableTarget nor a decode loop is a TypeError naming the protocol."""
    with pytest.raises(TypeError, match="needs a TunableTarget"):
        AdaptiveTuner(object(), AdaptiveBatchController(target_queue=1))


def test_a_batcher_is_a_tunable_target() -> None:
    """DynamicBatcher implements TunableTarget: its queue depth, each answered caller's latency
    once, and set_batch_limit setting max_batch_size."""
    clock = MockClock()
    with DynamicBatcher(lambda xs: xs, max_batch_size=2, max_wait_ms=1e6, clock=clock) as b:
        assert isinstance(b, TunableTarget)
        futures = [b.submit(i) for i in range(2)]
        assert [f.result(WAIT) for f in futures] == [0, 1]
        assert b.latency_samples(0) == ([0.0, 0.0], 2)
        assert b.latency_samples(2) == ([], 2)
        b.submit(9)
        assert b.queue_depth() == 1
        b.set_batch_limit(5)
        assert b.max_batch_size == 5


class _Policy:
    def __init__(self, choice: Any) -> None:
        self.choice = choice

    def decide(self, queue_depth: float, latencies_s: Any, now: float) -> Any:
        return self.choice


class TestAPolicysAnswerIsCheckedBeforeItIsApplied:
    """What an ``AdaptiveTuner`` policy returns is checked before it reaches the target: a bool, a
    string ``int()`` would parse, None or NaN is a ValueError and the batch size stays."""

    @pytest.mark.parametrize("choice", [True, "8", None, float("nan"), float("inf")], ids=repr)
    def test_a_policy_choice_that_is_not_a_number_is_refused(self, choice: Any) -> None:
        with batchkit.DynamicBatcher(lambda xs: xs, max_batch_size=4, max_wait_ms=1) as b:
            tuner = batchkit.AdaptiveTuner(b, _Policy(choice))
            with pytest.raises(ValueError, match="policy chose batch size"):
                tuner.step()
            assert b.max_batch_size == 4
            assert b(1) == 1

    @pytest.mark.parametrize("choice", [6, 6.0, np.int64(6), np.float32(6.5)], ids=repr)
    def test_a_policy_choice_that_is_a_number_is_applied(self, choice: Any) -> None:
        with batchkit.DynamicBatcher(lambda xs: xs, max_batch_size=4, max_wait_ms=1) as b:
            assert batchkit.AdaptiveTuner(b, _Policy(choice)).step() == 6
            assert b.max_batch_size == 6


class _SizePolicy:
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
    policy = _SizePolicy(3)
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
    tuner = batchkit.AdaptiveTuner(b, _SizePolicy(0))
    with pytest.raises(ValueError, match="batch size"):
        tuner.step()
    assert b.max_batch_size == 4
    assert b.submit(7).result(timeout=WAIT) == 7
    b.close()


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan"), float("inf")])
def test_tuner_start_refuses_an_interval_that_is_not_a_positive_number(interval: float) -> None:
    """start(0) would spin a core on step() with no pause; it is refused, and nothing starts."""
    b = batchkit.DynamicBatcher(batchkit.testing.echo_batch, max_batch_size=4)
    policy = _SizePolicy(3)
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


def test_a_tuned_batcher_gives_the_controller_the_backlog_a_batch_leaves_behind() -> None:
    """Q_t is the backlog a batch of the current size would leave behind, whether the controller
    runs inside the batcher or through AdaptiveTuner: 3 items waiting for a batch of 8 are no
    backlog (step down); 20 waiting for a batch of 7 leave 13 behind (step up)."""
    clock = MockClock()
    release, started = threading.Event(), threading.Event()

    def gated(xs: list[int]) -> list[int]:
        started.set()
        assert release.wait(WAIT)
        return xs

    ctl = AdaptiveBatchController(target_queue=1, eta=1, min_batch=1, max_batch=64, initial=8, clock=clock)
    b = DynamicBatcher(gated, max_batch_size=8, max_wait_ms=1e6, clock=clock)
    try:
        tuner = AdaptiveTuner(b, ctl, clock=clock)
        futures = [b.submit(i) for i in range(3)]
        assert tuner.step() == 7
        assert ctl.decisions[-1].queue_depth == 0
        b.flush()
        assert started.wait(WAIT)  # the slot is busy: what comes now waits
        futures += [b.submit(i) for i in range(3, 23)]
        clock.advance(1.0)
        assert tuner.step() == 8
        assert ctl.decisions[-1].queue_depth == 20 - 7
        release.set()
        b.flush()
        assert sorted(f.result(WAIT) for f in futures) == list(range(23))
    finally:
        release.set()
        b.close()


def test_a_tuned_decode_loop_gives_the_controller_its_waiting_requests() -> None:
    """A decode loop's waiting requests are already the backlog (the running ones hold their
    seats): the tuner passes them to the controller as they are."""

    class Target:
        def __init__(self) -> None:
            self.limit = 0

        def queue_depth(self) -> int:
            return 5

        def latency_samples(self, since: int = 0) -> tuple[list[float], int]:
            return [], since

        def set_batch_limit(self, size: int) -> None:
            self.limit = size

    ctl = AdaptiveBatchController(target_queue=1, eta=2, min_batch=1, max_batch=64, initial=8, clock=MockClock())
    target = Target()
    assert AdaptiveTuner(target, ctl).step() == 10
    assert target.limit == 10
    assert ctl.decisions[-1].queue_depth == 5
