"""The replica gauges routers and autoscalers read (the Gateway API Inference Extension's model
server protocol): requests waiting, requests running, KV-cache use as a fraction; unlabelled
totals over the collector's decode loops, and the same values under vLLM's names when asked.

The loops are stepped by the test (``step_once``) or by a model that takes one step per permit
the test hands it, so every state read is one the test has made; every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any, cast

import pytest

from _support import LiveServer, wait_until, word_tokenizer

torch = pytest.importorskip("torch")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

from batchkit.continuous.loop import ContinuousDecodeLoop  # noqa: E402
from batchkit.continuous.request import Request  # noqa: E402
from batchkit.continuous.sampling import SamplingParams  # noqa: E402
from batchkit.models import LlamaConfig, LlamaModel  # noqa: E402
from batchkit.serve.metrics import VLLM_NAMES, BatchkitCollector  # noqa: E402

WAIT_S = 60.0
WAITING, RUNNING, KV = (
    "batchkit_replica_requests_waiting",
    "batchkit_replica_requests_running",
    "batchkit_replica_kv_usage_ratio",
)
VLLM = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
)


def _tiny_llama() -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1))


def _families(text: str) -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], float]]]:
    """Each family of a Prometheus text page: its type and its samples by sorted labels."""
    return {
        f.name: (f.type, {tuple(sorted(s.labels.items())): s.value for s in f.samples})
        for f in prometheus_parser.text_string_to_metric_families(text)
    }


def _scrape(collector: BatchkitCollector) -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], float]]]:
    registry = CollectorRegistry()
    collector.register(registry)
    return _families(generate_latest(registry).decode())


def _replica(families: dict[str, Any], names: tuple[str, ...] = (WAITING, RUNNING, KV)) -> list[float]:
    """The values of unlabelled gauges, each a single series (what a router reads)."""
    values = []
    for name in names:
        kind, samples = families[name]
        assert (kind, list(samples)) == ("gauge", [()]), name
        values.append(samples[()])
    return values


def _add(loop: ContinuousDecodeLoop, rid: int, prompt: list[int], max_new_tokens: int) -> None:
    loop.scheduler.add(Request(rid, prompt, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)))


class TestTheCollectorsReplicaGauges:
    """Unlabelled totals over every loop the collector reads."""

    def test_they_total_every_loop_and_weigh_kv_use_over_all_their_blocks(self) -> None:
        """Two loops: waiting and running add up; KV use is the blocks held over all blocks (not
        the mean of the two pools' shares), and reads 0 once the requests end (their cached blocks
        are reclaimable, so free)."""
        model = _tiny_llama()
        small = ContinuousDecodeLoop(
            model, model.make_cache(5, 4), max_num_seqs=1, enable_prefix_caching=True, engine="caller"
        )
        big = ContinuousDecodeLoop(model, model.make_cache(17, 4), max_num_seqs=1, engine="caller")
        collector = BatchkitCollector(loops={"small": small, "big": big})
        assert _replica(_scrape(collector)) == [0.0, 0.0, 0.0]
        for rid in (1, 2):
            _add(small, rid, [5, 6, 7, 8, 9], 3)  # two blocks each; one seat: the second waits
        _add(big, 3, [5, 6, 7], 3)  # one block
        small.step_once()
        big.step_once()
        held = small.allocator.statistics().used_blocks + big.allocator.statistics().used_blocks
        assert held == 3
        assert _replica(_scrape(collector)) == [1.0, 2.0, held / (4 + 16)]
        while small.scheduler.has_work() or big.scheduler.has_work():
            for loop in (small, big):
                if loop.scheduler.has_work():
                    loop.step_once()
        families = _scrape(collector)
        assert _replica(families) == [0.0, 0.0, 0.0]
        assert families["batchkit_kv_blocks"][1][(("pool", "small"), ("state", "cached"))] > 0

    def test_a_request_swapped_out_counts_as_waiting(self) -> None:
        """A request preempted by swap holds no seat and no device block: it waits (as a preempted
        request waits in vLLM's queue), though the scheduler's own waiting queue is empty."""
        model = _tiny_llama()
        loop = ContinuousDecodeLoop(
            model, model.make_cache(5, 4), preemption_mode="swap", num_cpu_blocks=8, watermark=0.0, engine="caller"
        )
        for rid in (1, 2):
            _add(loop, rid, [5, 6, 7, 8], 12)
        for _ in range(20):
            loop.step_once()
            if loop.scheduler.statistics().swapped:
                break
        stats = loop.scheduler.statistics()
        assert (stats.waiting, stats.running, stats.swapped) == (0, 1, 1)
        families = _scrape(BatchkitCollector(loops={"lm": loop}))
        assert _replica(families) == [1.0, 1.0, loop.allocator.statistics().used_blocks / 4]
        assert families["batchkit_decode_requests_waiting"][1][(("loop", "lm"),)] == 0

    def test_a_collector_without_loops_has_none(self) -> None:
        """Batchers alone are no decode replica: no replica gauges (a router would read zeros)."""
        import batchkit
        from batchkit.testing import echo_batch

        batcher = batchkit.DynamicBatcher(echo_batch, max_batch_size=4, max_wait_ms=1)
        try:
            families = _scrape(BatchkitCollector(batchers={"echo": batcher}, vllm_names=True))
        finally:
            batcher.close()
        assert not {WAITING, RUNNING, KV, *VLLM} & set(families)


class TestVllmNames:
    """vllm_names=True: the replica gauges under vLLM's names as well, the same values."""

    def test_they_are_off_by_default(self) -> None:
        model = _tiny_llama()
        loop = ContinuousDecodeLoop(model, model.make_cache(5, 4), engine="caller")
        families = _scrape(BatchkitCollector(loops={"lm": loop}))
        assert WAITING in families
        assert not set(VLLM) & set(families)

    def test_each_reads_what_its_replica_gauge_reads(self) -> None:
        """Each vLLM name is a gauge with one unlabelled series equal to the replica gauge it
        names (VLLM_NAMES), here with a request running and one waiting."""
        model = _tiny_llama()
        loop = ContinuousDecodeLoop(model, model.make_cache(9, 4), max_num_seqs=1, engine="caller")
        for rid in (1, 2):
            _add(loop, rid, [5, 6, 7, 8, 9], 3)
        loop.step_once()
        families = _scrape(BatchkitCollector(loops={"lm": loop}, vllm_names=True))
        assert sorted(a for aliases in VLLM_NAMES.values() for a in aliases) == sorted(VLLM)
        waiting, running, kv = _replica(families)
        assert (waiting, running, kv) == (1.0, 1.0, 2 / 8)
        assert _replica(families, VLLM) == [waiting, running, kv, kv]


class _GatedModel:
    """A tiny Llama whose steps the test lets through one at a time: ``began`` is released as a
    step starts, which then waits for a permit from ``permits`` (or none once ``open`` is set)."""

    def __init__(self) -> None:
        self.model = _tiny_llama()
        self.config = self.model.config
        self.began = threading.Semaphore(0)
        self.permits = threading.Semaphore(0)
        self.open = threading.Event()

    def make_cache(self, *args: Any, **kwargs: Any) -> Any:
        return self.model.make_cache(*args, **kwargs)

    def __call__(self, batch: Any, kv: Any) -> Any:
        self.began.release()
        if not self.open.is_set() and not self.permits.acquire(timeout=WAIT_S):
            raise TimeoutError("the test handed out no permit for this step")
        return self.model(batch, kv)


def test_a_served_apps_metrics_follow_a_running_and_a_waiting_request() -> None:
    """GET /metrics of `batchkit serve`'s app, under both sets of names: idle, 0 0 0; with one
    request in a step and a second queued behind it (one seat), 1 waiting, 1 running and the first
    one's blocks in use; both answered, 0 0 0 again."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    pytest.importorskip("transformers")
    from batchkit.models import PretrainedLM
    from batchkit.serve import create_app

    model = _GatedModel()
    lm = PretrainedLM(
        model=cast(Any, model),
        tokenizer=word_tokenizer(64),
        eos_token_id=None,
        stop_token_ids=(),
        max_model_len=64,
        name="gated",
        path=Path("."),
    )
    app = create_app(lm, warmup=False, num_blocks=9, block_size=4, max_num_seqs=1)
    body = {"model": "gated", "prompt": "w5 w6 w7 w8 w9", "max_tokens": 3, "temperature": 0}

    def replica(url: str) -> list[float]:
        families = _families(httpx.get(f"{url}/metrics", timeout=WAIT_S).text)
        values = _replica(families)
        assert _replica(families, VLLM) == [*values, values[2]]
        return values

    with LiveServer(app) as server, concurrent.futures.ThreadPoolExecutor(2) as pool:
        try:
            url = f"{server.url}/v1/completions"
            assert replica(server.url) == [0.0, 0.0, 0.0]
            first = pool.submit(httpx.post, url, json=body, timeout=WAIT_S)
            assert model.began.acquire(timeout=WAIT_S)  # the first request's prefill is in the step
            assert replica(server.url) == [0.0, 1.0, 2 / 8]  # 5 prompt tokens: 2 blocks of 4
            second = pool.submit(httpx.post, url, json=body, timeout=WAIT_S)
            # Submitted while the engine is in the step: it waits in the loop's inbox, then (one
            # seat) in its queue; counted waiting in both.
            wait_until(lambda: replica(server.url)[0] == 1.0, "the second request to be counted waiting", WAIT_S)
            assert replica(server.url) == [1.0, 1.0, 2 / 8]
            model.open.set()
            model.permits.release()
            for answer in (first.result(timeout=WAIT_S), second.result(timeout=WAIT_S)):
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["completion_tokens"] == 3
            assert replica(server.url) == [0.0, 0.0, 0.0]
        finally:
            model.open.set()
            model.permits.release()
