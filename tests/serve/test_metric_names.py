"""batchkit.serve, the metrics docs/serving.md lists are served with their types and labels, and a
refusal is counted under its reason.

The promises of docs/serving.md's "metrics" part.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from _serve_app_support import CHAT, EMBED, HI, _metrics, _post, httpx
from _serve_app_support import needs_model_packages as needs_models

from _support import LiveServer
from _support import wait_until as _wait_until

pytestmark = [pytest.mark.timeout(600), needs_models]

WAIT_S = 120.0


METRIC_TYPES = {
    "batchkit_http_requests_total": "counter",
    "batchkit_http_rejections_total": "counter",
    "batchkit_http_in_flight": "gauge",
    "batchkit_ready": "gauge",
    "batchkit_request_prompt_tokens_total": "counter",
    "batchkit_request_generation_tokens_total": "counter",
    "batchkit_request_time_to_first_token_seconds": "histogram",
    "batchkit_request_inter_token_latency_seconds": "histogram",
    "batchkit_request_duration_seconds": "histogram",
    "batchkit_replica_requests_waiting": "gauge",
    "batchkit_replica_requests_running": "gauge",
    "batchkit_replica_kv_usage_ratio": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "batchkit_decode_requests_running": "gauge",
    "batchkit_decode_requests_waiting": "gauge",
    "batchkit_decode_requests_swapped": "gauge",
    "batchkit_decode_max_num_seqs": "gauge",
    "batchkit_decode_max_num_batched_tokens": "gauge",
    "batchkit_decode_requests_finished_total": "counter",
    "batchkit_decode_requests_aborted_total": "counter",
    "batchkit_decode_generation_tokens_total": "counter",
    "batchkit_decode_prompt_tokens_total": "counter",
    "batchkit_decode_steps_total": "counter",
    "batchkit_decode_step_seconds_total": "counter",
    "batchkit_decode_preemptions_total": "counter",
    "batchkit_decode_tokens_per_second": "gauge",
    "batchkit_decode_time_to_first_token_seconds": "gauge",
    "batchkit_decode_inter_token_latency_seconds": "gauge",
    "batchkit_decode_queue_wait_seconds": "gauge",
    "batchkit_decode_step_duration_seconds": "gauge",
    "batchkit_kv_blocks": "gauge",
    "batchkit_kv_usage_ratio": "gauge",
    "batchkit_kv_fragmentation_ratio": "gauge",
    "batchkit_kv_sequences": "gauge",
    "batchkit_kv_prefix_hit_ratio": "gauge",
    "batchkit_kv_prefix_queries_total": "counter",
    "batchkit_kv_prefix_hits_total": "counter",
    "batchkit_kv_swaps_total": "counter",
    "batchkit_kv_evictions_total": "counter",
    "batchkit_kv_tenant_blocks": "gauge",
    "batchkit_batcher_queue_depth": "gauge",
    "batchkit_batcher_in_flight": "gauge",
    "batchkit_batcher_max_batch_size": "gauge",
    "batchkit_batcher_submitted_total": "counter",
    "batchkit_batcher_items_total": "counter",
    "batchkit_batcher_batches_total": "counter",
    "batchkit_batcher_flushes_total": "counter",
    "batchkit_batcher_batch_size": "histogram",
    "batchkit_batcher_queue_wait_seconds": "gauge",
    "batchkit_batcher_latency_seconds": "gauge",
    "batchkit_batcher_batch_duration_seconds": "gauge",
}


def test_every_documented_metric_is_served_with_its_type_and_labels(live: LiveServer, client: Any) -> None:
    """The metrics table of docs/serving.md: each family is exported with its type; the loop is
    `loop="chat"` / `pool="chat"`, the embedding batcher `batcher="embeddings"`; latency gauges
    have quantiles 0.5, 0.9, 0.99, 1; the batch-size histogram has buckets 1, 2, 4, ... 1024."""
    client.chat.completions.create(model=CHAT, messages=HI, max_tokens=2)
    client.embeddings.create(model=EMBED, input=["a", "b"])
    text = httpx.get(f"{live.url}/metrics", timeout=30).text
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE))
    for name, kind in METRIC_TYPES.items():
        assert types.get(name) == kind, (name, types.get(name))
    samples = _metrics(live.url)
    labels = {key[0]: dict(key[1]) for key in samples}
    for name, (label, value) in {
        "batchkit_decode_steps_total": ("loop", "chat"),
        "batchkit_kv_usage_ratio": ("pool", "chat"),
        "batchkit_batcher_submitted_total": ("batcher", "embeddings"),
    }.items():
        assert labels[name][label] == value
    quantiles = {dict(k[1])["quantile"] for k in samples if k[0] == "batchkit_decode_step_duration_seconds"}
    assert quantiles == {"0.5", "0.9", "0.99", "1"}
    buckets = {
        dict(k[1])["le"]
        for k in samples
        if k[0] == "batchkit_batcher_batch_size_bucket" and dict(k[1])["batcher"] == "embeddings"
    }
    assert buckets == {f"{2.0**i}" for i in range(11)} | {"+Inf"}
    states = {dict(k[1])["state"] for k in samples if k[0] == "batchkit_kv_blocks"}
    assert states == {"free", "used", "cached"}
    directions = {dict(k[1])["direction"] for k in samples if k[0] == "batchkit_kv_swaps_total"}
    assert directions == {"out", "in"}
    outcomes = {dict(k[1])["outcome"] for k in samples if k[0] == "batchkit_batcher_items_total"}
    assert outcomes == {"succeeded", "failed", "cancelled", "expired", "rejected"}


def test_a_prompt_too_long_is_counted_as_a_rejection(live: LiveServer) -> None:
    """`batchkit_http_rejections_total{reason="prompt_too_long"}` counts a 400
    `context_length_exceeded`, and a request with a tenant shows in `batchkit_kv_tenant_blocks`."""
    key = ("batchkit_http_rejections_total", (("reason", "prompt_too_long"),))
    before = _metrics(live.url).get(key, 0.0)
    r = _post(f"{live.url}/v1/completions", {"model": CHAT, "prompt": "Hi", "max_tokens": 10**6})
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert _metrics(live.url)[key] == before + 1
    body = {"model": CHAT, "prompt": "Count:", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{live.url}/v1/completions", json=body, headers={"X-Batchkit-Tenant": "acme"}, timeout=WAIT_S
    ) as s:
        lines = s.iter_lines()  # kept: a line iterator left to the collector closes the stream (an abort)
        assert next(line for line in lines if line.startswith("data: "))
        # The series exists only while the tenant holds blocks (none, e.g., while its request is
        # preempted), so look until it shows, with a deadline, while the request still streams.
        tenant_key = ("batchkit_kv_tenant_blocks", (("pool", "chat"), ("tenant", "acme")))
        _wait_until(lambda: _metrics(live.url).get(tenant_key, 0.0) > 0, "tenant acme's blocks in /metrics")
