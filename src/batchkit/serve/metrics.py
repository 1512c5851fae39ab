"""Prometheus metrics for batchkit's primitives: a collector that reads their ``statistics()``.

Usable without the server::

    from prometheus_client import CollectorRegistry, generate_latest
    from batchkit.serve.metrics import BatchkitCollector

    registry = CollectorRegistry()
    BatchkitCollector(batchers={"embed": embed}, loops={"chat": loop}).register(registry)
    print(generate_latest(registry).decode())

Every name starts with ``batchkit_`` (the vLLM names below aside) and is in base units (seconds,
ratios in 0..1, counts). Counters are the primitives' own lifetime counters; latency quantiles are
gauges over the most recent samples each primitive keeps (its ``statistics()`` window), labelled
``quantile``. The label that names the object is ``batcher``, ``loop`` or ``pool``.

The ``batchkit_replica_*`` gauges carry no label: the totals over every decode loop the collector
reads, the load of this replica as a router or an autoscaler weighs it (the Gateway API Inference
Extension's model server protocol: requests queued, requests running, KV-cache use as a fraction).
``vllm_names=True`` exports them under vLLM's names too, so that a router configured for vLLM
reads batchkit unchanged. Needs ``prometheus-client`` (``pip install 'batchkit[serve]'``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from ..continuous.loop import ContinuousDecodeLoop, LoopStatistics
from ..dynamic.batcher import DynamicBatcher
from ..kv.allocator import AllocatorStatistics, PagedKVAllocator
from ..metrics import LatencySummary

__all__ = ["BATCH_SIZE_BUCKETS", "VLLM_NAMES", "BatchkitCollector", "ServerMetrics"]

#: Upper bounds of the batch-size histogram (the last bucket is +Inf).
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

#: The vLLM names each replica gauge is also exported under with ``vllm_names=True``: the names
#: routers and autoscalers built for vLLM read by default (``vllm:gpu_cache_usage_perc`` is the
#: older name of ``vllm:kv_cache_usage_perc``, still the default of older routers). vLLM's
#: ``*_perc`` gauges are fractions in 0..1 too.
VLLM_NAMES: Mapping[str, tuple[str, ...]] = {
    "batchkit_replica_requests_waiting": ("vllm:num_requests_waiting",),
    "batchkit_replica_requests_running": ("vllm:num_requests_running",),
    "batchkit_replica_kv_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}


def _quantiles(name: str, doc: str, label: str, rows: Iterable[tuple[str, LatencySummary | None]]) -> Metric:
    """Gauges ``name{label=..., quantile=...}`` in seconds from millisecond summaries (empty: absent)."""
    g = GaugeMetricFamily(name, doc, labels=[label, "quantile"])
    for key, s in rows:
        if s is None or s.count == 0:
            continue
        for q, ms in (("0.5", s.p50_ms), ("0.9", s.p90_ms), ("0.99", s.p99_ms), ("1", s.max_ms)):
            if not math.isnan(ms):
                g.add_metric([key, q], ms / 1e3)
    return g


def _batch_size_histogram(name: str, doc: str, rows: Iterable[tuple[str, Mapping[int, int]]]) -> Metric:
    h = HistogramMetricFamily(name, doc, labels=["batcher"])
    for key, sizes in rows:
        buckets: list[tuple[str, float]] = []
        for bound in BATCH_SIZE_BUCKETS:
            buckets.append((str(float(bound)), float(sum(n for s, n in sizes.items() if s <= bound))))
        buckets.append(("+Inf", float(sum(sizes.values()))))
        h.add_metric([key], buckets, sum_value=float(sum(s * n for s, n in sizes.items())))
    return h


class BatchkitCollector(Collector):
    """Exports ``statistics()`` of named batchers, decode loops and KV block pools.

    Args:
        batchers: ``DynamicBatcher`` or ``@batched`` functions (anything with a ``.batcher``), by name.
        loops: ``ContinuousDecodeLoop`` objects by name (their KV pool is exported under the same
            name, as ``pool``).
        allocators: further ``PagedKVAllocator`` objects by name.
        vllm_names: also export the ``batchkit_replica_*`` gauges under vLLM's names
            (:data:`VLLM_NAMES`). Off by default: a process that also hosts vLLM's own metrics
            would export those names twice.

    Objects can be added later with :meth:`add_batcher`, :meth:`add_loop` and :meth:`add_allocator`.
    Collecting reads each object's ``statistics()`` snapshot; it never blocks on a model call.
    """

    def __init__(
        self,
        *,
        batchers: Mapping[str, Any] | None = None,
        loops: Mapping[str, ContinuousDecodeLoop] | None = None,
        allocators: Mapping[str, PagedKVAllocator] | None = None,
        vllm_names: bool = False,
    ) -> None:
        self.vllm_names = vllm_names
        self._batchers: dict[str, DynamicBatcher[Any, Any]] = {}
        self._loops: dict[str, ContinuousDecodeLoop] = {}
        self._allocators: dict[str, PagedKVAllocator] = {}
        for name, b in (batchers or {}).items():
            self.add_batcher(name, b)
        for name, loop in (loops or {}).items():
            self.add_loop(name, loop)
        for name, a in (allocators or {}).items():
            self.add_allocator(name, a)

    def add_batcher(self, name: str, batcher: Any) -> None:
        """Export a :class:`DynamicBatcher` (or a ``@batched`` function's) under ``batcher=name``."""
        b = batcher if isinstance(batcher, DynamicBatcher) else getattr(batcher, "batcher", None)
        if not isinstance(b, DynamicBatcher):
            raise TypeError(f"batcher {name!r} must be a DynamicBatcher or a @batched function, got {batcher!r}")
        self._batchers[name] = b

    def add_loop(self, name: str, loop: ContinuousDecodeLoop) -> None:
        """Export a :class:`ContinuousDecodeLoop` under ``loop=name`` and its KV pool under ``pool=name``."""
        if not isinstance(loop, ContinuousDecodeLoop):
            raise TypeError(f"loop {name!r} must be a ContinuousDecodeLoop, got {loop!r}")
        self._loops[name] = loop
        self._allocators.setdefault(name, loop.allocator)

    def add_allocator(self, name: str, allocator: PagedKVAllocator) -> None:
        """Export a :class:`PagedKVAllocator` under ``pool=name``."""
        if not isinstance(allocator, PagedKVAllocator):
            raise TypeError(f"allocator {name!r} must be a PagedKVAllocator, got {allocator!r}")
        self._allocators[name] = allocator

    def register(self, registry: CollectorRegistry) -> BatchkitCollector:
        """Register with ``registry`` (a ``prometheus_client.CollectorRegistry``); returns self."""
        registry.register(self)
        return self

    def describe(self) -> Iterable[Metric]:
        # Nothing up front: the set of objects may grow after registration.
        return []

    def collect(self) -> Iterator[Metric]:
        loops = {name: loop.statistics() for name, loop in self._loops.items()}
        pools = {name: a.statistics() for name, a in self._allocators.items()}
        yield from self._collect_replica(loops, pools)
        yield from self._collect_batchers()
        yield from self._collect_loops(loops)
        yield from self._collect_allocators(pools)

    # ------------------------------------------------------------------ the replica

    def _collect_replica(
        self, loops: Mapping[str, LoopStatistics], pools: Mapping[str, AllocatorStatistics]
    ) -> Iterator[Metric]:
        """One unlabelled gauge each for what a router weighs a replica by: routers read one series
        of a metric (the Inference Extension's picker the first one), so a total, not a series per loop."""
        if not self._loops:
            return
        # Waiting: everything submitted and not running, as vLLM counts it (its preempted requests
        # wait in its one queue): the loop's inbox, its waiting queue, and requests swapped out.
        waiting = sum(loop.queue_depth() + loops[name].scheduler.swapped for name, loop in self._loops.items())
        running = sum(s.scheduler.running for s in loops.values())
        # KV use over the device pools the loops decode into, each counted once (loops may share
        # one); a cached block nobody holds is reclaimable, so free, as vLLM counts it.
        by_id = {id(a): pools[name] for name, a in self._allocators.items()}
        used = total = 0
        for a in {id(loop.allocator): loop.allocator for loop in self._loops.values()}.values():
            s = by_id.get(id(a))
            if s is None:  # its name was taken by another allocator: read it here
                s = a.statistics()
            used, total = used + s.used_blocks, total + s.total_blocks
        for metric, doc, value in (
            (
                "batchkit_replica_requests_waiting",
                "Requests submitted to the decode loops and not running: not yet admitted, preempted, or swapped out.",
                float(waiting),
            ),
            (
                "batchkit_replica_requests_running",
                "Requests running in the decode loops (each holds a seat of max_num_seqs and its KV blocks).",
                float(running),
            ),
            (
                "batchkit_replica_kv_usage_ratio",
                "Share of the decode loops' KV blocks held by requests, 0..1 (reclaimable cached blocks are free).",
                used / total if total else 0.0,
            ),
        ):
            yield GaugeMetricFamily(metric, doc, value=value)
            if self.vllm_names:
                for alias in VLLM_NAMES[metric]:
                    yield GaugeMetricFamily(alias, f"{doc} The same as {metric}.", value=value)

    # ------------------------------------------------------------------ batchers

    def _collect_batchers(self) -> Iterator[Metric]:
        if not self._batchers:
            return
        stats = {name: b.statistics() for name, b in self._batchers.items()}
        depth = GaugeMetricFamily("batchkit_batcher_queue_depth", "Items waiting for a batch.", labels=["batcher"])
        inflight = GaugeMetricFamily(
            "batchkit_batcher_in_flight", "Items in batches being computed.", labels=["batcher"]
        )
        limit = GaugeMetricFamily(
            "batchkit_batcher_max_batch_size",
            "Current batch size limit (moves when an adaptive controller drives it).",
            labels=["batcher"],
        )
        submitted = CounterMetricFamily("batchkit_batcher_submitted", "Items submitted.", labels=["batcher"])
        outcomes = CounterMetricFamily(
            "batchkit_batcher_items",
            "Items by outcome (succeeded, failed, cancelled, expired, rejected).",
            labels=["batcher", "outcome"],
        )
        batches = CounterMetricFamily("batchkit_batcher_batches", "Batches run.", labels=["batcher"])
        reasons = CounterMetricFamily(
            "batchkit_batcher_flushes", "Batches by the reason they were flushed.", labels=["batcher", "reason"]
        )
        for name, s in stats.items():
            depth.add_metric([name], s.pending)
            inflight.add_metric([name], s.in_flight)
            limit.add_metric([name], self._batchers[name].max_batch_size)
            submitted.add_metric([name], s.submitted)
            for outcome in ("succeeded", "failed", "cancelled", "expired", "rejected"):
                outcomes.add_metric([name, outcome], getattr(s, outcome))
            batches.add_metric([name], s.batches)
            for reason, n in s.flush_reasons.items():
                reasons.add_metric([name, str(reason)], n)
        yield from (depth, inflight, limit, submitted, outcomes, batches, reasons)
        yield _batch_size_histogram(
            "batchkit_batcher_batch_size",
            "Items per batch.",
            ((name, s.batch_size_histogram) for name, s in stats.items()),
        )
        for attr, metric, doc in (
            ("queue_wait", "batchkit_batcher_queue_wait_seconds", "Time items waited before their batch ran."),
            ("latency", "batchkit_batcher_latency_seconds", "Time from submit to result."),
            ("batch_time", "batchkit_batcher_batch_duration_seconds", "Time one batch call took."),
        ):
            yield _quantiles(
                metric,
                doc + " Recent samples.",
                "batcher",
                ((n, getattr(s, attr + "_recent")) for n, s in stats.items()),
            )

    # ------------------------------------------------------------------ decode loops

    def _collect_loops(self, stats: Mapping[str, LoopStatistics]) -> Iterator[Metric]:
        if not self._loops:
            return

        def gauge(metric: str, doc: str, value: Any) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["loop"])
            for name, s in stats.items():
                g.add_metric([name], float(value(name, s)))
            return g

        def counter(metric: str, doc: str, value: Any) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["loop"])
            for name, s in stats.items():
                c.add_metric([name], float(value(name, s)))
            return c

        yield gauge("batchkit_decode_requests_running", "Requests running.", lambda n, s: s.scheduler.running)
        yield gauge(
            "batchkit_decode_requests_waiting",
            "Requests waiting for admission (including preempted ones).",
            lambda n, s: s.scheduler.waiting,
        )
        yield gauge("batchkit_decode_requests_swapped", "Requests swapped to CPU.", lambda n, s: s.scheduler.swapped)
        yield gauge(
            "batchkit_decode_max_num_seqs",
            "Most requests that run together (moves when a tuner drives it).",
            lambda n, s: self._loops[n].scheduler.max_num_seqs,
        )
        yield gauge(
            "batchkit_decode_max_num_batched_tokens",
            "Token budget per step.",
            lambda n, s: self._loops[n].scheduler.max_num_batched_tokens,
        )
        yield counter("batchkit_decode_requests_finished", "Requests finished.", lambda n, s: s.scheduler.finished)
        yield counter("batchkit_decode_requests_aborted", "Requests aborted.", lambda n, s: s.scheduler.aborted)
        yield counter("batchkit_decode_steps", "Decode steps run.", lambda n, s: s.steps)
        yield counter(
            "batchkit_decode_step_seconds",
            "Seconds the model steps took, summed (the engine's busy time).",
            lambda n, s: s.step_time.count * s.step_time.mean_ms / 1e3 if s.step_time.count else 0.0,
        )
        yield counter(
            "batchkit_decode_generation_tokens", "Tokens generated.", lambda n, s: s.scheduler.generated_tokens
        )
        yield counter(
            "batchkit_decode_prompt_tokens",
            "Prompt tokens computed (prefix-cache hits excluded).",
            lambda n, s: s.scheduler.prompt_tokens_computed,
        )
        yield counter("batchkit_decode_preemptions", "Requests preempted.", lambda n, s: s.scheduler.preemptions)
        yield gauge(
            "batchkit_decode_tokens_per_second",
            "Generated tokens per second of engine time.",
            lambda n, s: s.tokens_per_s,
        )
        for attr, metric, doc in (
            ("ttft", "batchkit_decode_time_to_first_token_seconds", "Time from submit to a request's first token."),
            ("tpot", "batchkit_decode_inter_token_latency_seconds", "Time between a request's tokens."),
            ("queue_wait", "batchkit_decode_queue_wait_seconds", "Time from submit to first scheduled."),
        ):
            yield _quantiles(
                metric,
                doc + " Recent samples.",
                "loop",
                ((n, getattr(s.scheduler, attr + "_recent")) for n, s in stats.items()),
            )
        yield _quantiles(
            "batchkit_decode_step_duration_seconds",
            "Time one model step took. Recent samples.",
            "loop",
            ((n, s.step_time_recent) for n, s in stats.items()),
        )

    # ------------------------------------------------------------------ KV pools

    def _collect_allocators(self, stats: Mapping[str, AllocatorStatistics]) -> Iterator[Metric]:
        if not self._allocators:
            return
        blocks = GaugeMetricFamily(
            "batchkit_kv_blocks", "KV blocks by state (free, used, cached).", labels=["pool", "state"]
        )
        usage = GaugeMetricFamily("batchkit_kv_usage_ratio", "Share of KV blocks in use.", labels=["pool"])
        frag = GaugeMetricFamily(
            "batchkit_kv_fragmentation_ratio", "Share of allocated slots that hold no token.", labels=["pool"]
        )
        hit = GaugeMetricFamily(
            "batchkit_kv_prefix_hit_ratio", "Prompt tokens served from the prefix cache / looked up.", labels=["pool"]
        )
        seqs = GaugeMetricFamily("batchkit_kv_sequences", "Sequences holding blocks.", labels=["pool"])
        queries = CounterMetricFamily(
            "batchkit_kv_prefix_queries", "Prompt tokens looked up in the prefix cache.", labels=["pool"]
        )
        hits = CounterMetricFamily(
            "batchkit_kv_prefix_hits", "Prompt tokens found in the prefix cache.", labels=["pool"]
        )
        swaps = CounterMetricFamily(
            "batchkit_kv_swaps", "Sequences swapped, by direction.", labels=["pool", "direction"]
        )
        evictions = CounterMetricFamily("batchkit_kv_evictions", "Cached blocks evicted for reuse.", labels=["pool"])
        tenants = GaugeMetricFamily(
            "batchkit_kv_tenant_blocks", "KV blocks held per tenant.", labels=["pool", "tenant"]
        )
        for name, s in stats.items():
            blocks.add_metric([name, "free"], s.free_blocks)
            blocks.add_metric([name, "used"], s.used_blocks)
            blocks.add_metric([name, "cached"], s.cached_blocks)
            usage.add_metric([name], s.usage)
            frag.add_metric([name], s.fragmentation)
            hit.add_metric([name], s.prefix_hit_rate)
            seqs.add_metric([name], s.num_seqs)
            queries.add_metric([name], s.prefix_queries)
            hits.add_metric([name], s.prefix_hits)
            swaps.add_metric([name, "out"], s.swaps_out)
            swaps.add_metric([name, "in"], s.swaps_in)
            evictions.add_metric([name], s.evictions)
            for tenant, n in s.tenant_usage.items():  # requests without a tenant: tenant=""
                tenants.add_metric([name, "" if tenant is None else str(tenant)], n)
        yield from (blocks, usage, frag, hit, seqs, queries, hits, swaps, evictions, tenants)


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The server's own request metrics (the primitives' come from :class:`BatchkitCollector`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "batchkit_http_requests",
            "HTTP requests answered, by route and status.",
            ["route", "status"],
            registry=registry,
        )
        self.rejections = Counter(
            "batchkit_http_rejections", "Requests refused before running, by reason.", ["reason"], registry=registry
        )
        self.in_flight = Gauge("batchkit_http_in_flight", "Requests being served.", registry=registry)
        self.ready = Gauge("batchkit_ready", "1 once the models are loaded and warm.", registry=registry)
        self.step_compiled = Gauge(
            "batchkit_decode_step_compiled", "1 once the chat model's decode step runs compiled.", registry=registry
        )
        self.prompt_tokens = Counter(
            "batchkit_request_prompt_tokens", "Prompt tokens of accepted requests.", ["route"], registry=registry
        )
        self.generation_tokens = Counter(
            "batchkit_request_generation_tokens", "Tokens generated for clients.", ["route"], registry=registry
        )
        self.ttft = Histogram(
            "batchkit_request_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "batchkit_request_inter_token_latency_seconds",
            "Between a request's consecutive tokens.",
            ["route"],
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "batchkit_request_duration_seconds",
            "From a request's arrival to its last byte (successful requests).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
