"""The engine core's step counters: the loop's statistics report what docs/continuous.md lists."""

from __future__ import annotations

import pytest
from _continuous_steps import WAIT, GatedStep, small_cache

import batchkit

torch = pytest.importorskip("torch")


def test_statistics_report_what_the_page_lists() -> None:
    """TTFT, TPOT, queue wait, tokens/s, running / waiting / swapped counts, KV usage,
    preemptions, steps and step times."""
    with batchkit.ContinuousDecodeLoop(GatedStep(), small_cache(), max_num_seqs=4) as loop:
        futures = [loop.submit([1, 2, 3], max_new_tokens=4) for _ in range(3)]
        assert [f.result(WAIT) for f in futures] == [[0] * 4] * 3
        stats = loop.statistics()
    s = stats.scheduler
    assert (s.running, s.waiting, s.swapped, s.preemptions, s.finished) == (0, 0, 0, 0, 3)
    assert s.generated_tokens == 12
    assert s.ttft is not None
    assert s.ttft.count == 3
    assert s.tpot is not None
    assert s.tpot.count > 0
    assert s.queue_wait is not None
    assert s.queue_wait.count == 3
    assert s.kv_usage == 0.0
    assert stats.steps >= 4
    assert stats.step_time is not None
    assert stats.step_time.count == stats.steps
    assert stats.tokens_per_s > 0
