"""batchkit.serve, Prometheus metrics: the server's /metrics, and BatchkitCollector over a batcher and
a loop without a server.

The fixtures are tests/_serve_fixtures.py's.
"""

from __future__ import annotations

from typing import Any

import pytest
from _serve_app_support import CHAT, QUESTION, _metrics, needs_models, prometheus_parser

from _support import LiveServer

pytestmark = pytest.mark.timeout(600)


@needs_models
def test_metrics_parse_and_count_what_was_sent(live: LiveServer, client: Any) -> None:
    """/metrics parses as Prometheus text; request and token counters move by exactly what was sent."""
    before = _metrics(live.url)
    sent = [
        client.chat.completions.create(model=CHAT, messages=QUESTION, temperature=0, max_tokens=n) for n in (3, 5, 4)
    ]
    after = _metrics(live.url)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    tokens = sum(r.usage.completion_tokens for r in sent)
    assert delta("batchkit_http_requests_total", route="chat", status="200") == 3
    assert delta("batchkit_request_generation_tokens_total", route="chat") == tokens
    assert delta("batchkit_decode_generation_tokens_total", loop="chat") == tokens
    assert delta("batchkit_decode_requests_finished_total", loop="chat") == 3
    assert delta("batchkit_request_time_to_first_token_seconds_count", route="chat") == 3
    assert delta("batchkit_request_inter_token_latency_seconds_count", route="chat") == tokens - 3
    for name, labels in [
        ("batchkit_kv_usage_ratio", {"pool": "chat"}),
        ("batchkit_kv_prefix_hit_ratio", {"pool": "chat"}),
        ("batchkit_decode_requests_running", {"loop": "chat"}),
        ("batchkit_decode_max_num_seqs", {"loop": "chat"}),
        ("batchkit_batcher_max_batch_size", {"batcher": "embeddings"}),
        ("batchkit_ready", {}),
    ]:
        assert (name, tuple(sorted(labels.items()))) in after, name
    assert after[("batchkit_decode_max_num_seqs", (("loop", "chat"),))] == 4
    assert after[("batchkit_ready", ())] == 1


def test_the_collector_exports_a_batcher_and_a_loop_without_a_server() -> None:
    """BatchkitCollector alone: counters and the batch-size histogram add up to what was submitted."""
    import torch
    from prometheus_client import CollectorRegistry, generate_latest

    import batchkit
    from batchkit.serve.metrics import BatchkitCollector
    from batchkit.testing import echo_batch

    batcher = batchkit.DynamicBatcher(echo_batch, max_batch_size=4, max_wait_ms=1)
    kv = batchkit.PagedKVCache(1, 16, 4, 1, 2, dtype=torch.float32)
    loop = batchkit.ContinuousDecodeLoop(lambda batch, kv: torch.zeros(len(batch.sample_indices), 8), kv)
    try:
        assert [f.result(timeout=30) for f in [batcher.submit(i) for i in range(10)]] == list(range(10))
        assert [f.result(timeout=30) for f in [loop.submit([1, 2, 3], max_new_tokens=3) for _ in range(2)]] == [
            [0, 0, 0],
            [0, 0, 0],
        ]
        registry = CollectorRegistry()
        BatchkitCollector(batchers={"echo": batcher}, loops={"lm": loop}).register(registry)
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in prometheus_parser.text_string_to_metric_families(generate_latest(registry).decode())
            for s in fam.samples
        }
    finally:
        batcher.close()
        loop.close()
    stats = batcher.statistics()
    assert samples[("batchkit_batcher_submitted_total", (("batcher", "echo"),))] == 10
    assert samples[("batchkit_batcher_items_total", (("batcher", "echo"), ("outcome", "succeeded")))] == 10
    assert samples[("batchkit_batcher_batch_size_count", (("batcher", "echo"),))] == stats.batches
    assert samples[("batchkit_batcher_batch_size_sum", (("batcher", "echo"),))] == 10
    assert samples[("batchkit_batcher_batch_size_bucket", (("batcher", "echo"), ("le", "4.0")))] == stats.batches
    assert samples[("batchkit_batcher_max_batch_size", (("batcher", "echo"),))] == 4
    assert samples[("batchkit_decode_generation_tokens_total", (("loop", "lm"),))] == 6
    assert samples[("batchkit_decode_requests_finished_total", (("loop", "lm"),))] == 2
    step_time = loop.statistics().step_time  # every step's duration, summed: the engine's busy seconds
    busy = samples[("batchkit_decode_step_seconds_total", (("loop", "lm"),))]
    assert busy > 0
    assert busy == pytest.approx(step_time.count * step_time.mean_ms / 1e3)
    blocks = [samples[("batchkit_kv_blocks", (("pool", "lm"), ("state", st)))] for st in ("free", "used", "cached")]
    assert sum(blocks) == kv.num_blocks - 1  # block 0 is the null block
    assert blocks[1] == 0


def test_the_collectors_latency_quantiles_are_over_the_recent_samples() -> None:
    """The quantile gauges read the recent window (the last 10,000 samples), as serving.md says:
    2,000 early items that waited 10 s are gone from it after 10,000 that did not wait."""
    from prometheus_client import CollectorRegistry, generate_latest

    import batchkit
    from batchkit.serve.metrics import BatchkitCollector
    from batchkit.testing import MockClock, echo_batch

    clock = MockClock()
    batcher = batchkit.DynamicBatcher(echo_batch, max_batch_size=10_000, max_wait_ms=1e9, max_queue=10_000, clock=clock)
    try:
        early = [batcher.submit(i) for i in range(2_000)]
        clock.advance(10)
        batcher.flush()
        assert [f.result(timeout=30) for f in early] == list(range(2_000))
        late = [batcher.submit(i) for i in range(10_000)]
        batcher.flush()
        assert [f.result(timeout=30) for f in late] == list(range(10_000))
    finally:
        batcher.close()
    registry = CollectorRegistry()
    BatchkitCollector(batchers={"echo": batcher}).register(registry)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in prometheus_parser.text_string_to_metric_families(generate_latest(registry).decode())
        for s in fam.samples
    }
    stats = batcher.statistics()
    assert stats.latency is not None
    assert stats.latency.max_ms == 10_000.0  # the whole run remembers the early waits
    assert samples[("batchkit_batcher_latency_seconds", (("batcher", "echo"), ("quantile", "1")))] == 0.0


def test_the_collector_refuses_objects_it_cannot_read() -> None:
    """Passing something that is not a batcher, loop or pool fails at once, naming the argument."""
    from batchkit.serve.metrics import BatchkitCollector

    with pytest.raises(TypeError, match="batcher 'x' must be a DynamicBatcher"):
        BatchkitCollector(batchers={"x": object()})
    with pytest.raises(TypeError, match="loop 'y' must be a ContinuousDecodeLoop"):
        BatchkitCollector(loops={"y": object()})  # type: ignore[dict-item]
