"""batchkit.serve.metrics: the collector's KV families as Prometheus reads them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from batchkit.continuous.loop import ContinuousDecodeLoop  # noqa: E402
from batchkit.continuous.request import Request  # noqa: E402
from batchkit.continuous.sampling import SamplingParams  # noqa: E402
from batchkit.models import LlamaConfig, LlamaModel  # noqa: E402
from batchkit.serve.metrics import BatchkitCollector  # noqa: E402


def test_kv_tenant_blocks_count_untenanted_requests_under_an_empty_tenant() -> None:
    """Requests without a tenant are ``tenant=""``, not ``tenant="None"``, which a tenant
    named "None" (the header's text) would share: two series with the same labels, one dropped."""
    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
    loop = ContinuousDecodeLoop(model, model.make_cache(num_blocks=32, block_size=4), engine="caller")
    try:
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        loop.scheduler.add(Request("plain", [1, 2, 3, 4, 5], params))  # 2 blocks
        loop.scheduler.add(Request("named", [1, 2, 3], params, tenant="None"))  # 1 block
        loop.step_once()
        registry = CollectorRegistry()
        BatchkitCollector(loops={"chat": loop}).register(registry)
        families = {
            f.name: f for f in prometheus_parser.text_string_to_metric_families(generate_latest(registry).decode())
        }
        samples = [(s.labels["tenant"], s.value) for s in families["batchkit_kv_tenant_blocks"].samples]
        assert sorted(samples) == [("", 2.0), ("None", 1.0)]
    finally:
        loop.close()
