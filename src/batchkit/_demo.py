"""The demo workload shared by ``batchkit demo`` and the model benchmarks: a torch MLP on CPU.

A 1024 -> 4096 -> 1024 MLP reads ~32 MB of weights per call, so one request at a time is bound by
memory traffic and a batch of 32 costs little more than a batch of 1: the case batching is for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .batcher import DynamicBatcher
from .metrics import percentiles

__all__ = ["ServeResult", "make_mlp", "serve_batched", "serve_one_by_one"]


def make_mlp(d_in: int = 1024, d_hidden: int = 4096, threads: int = 2, seed: int = 0) -> Any:
    """A seeded MLP in eval mode, with torch limited to ``threads`` intra-op threads."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(d_in, d_hidden),
        torch.nn.GELU(),
        torch.nn.Linear(d_hidden, d_in),
    ).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@dataclass(frozen=True)
class ServeResult:
    """Throughput and latency of one way of serving a closed-loop load."""

    name: str
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    mean_batch: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


def _closed_loop(
    call: Callable[[Any], Any], inputs: list[Any], callers: int, duration_s: float
) -> tuple[int, float, list[float]]:
    """``callers`` threads each call in a loop for ``duration_s``; return count, seconds, latencies."""
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + duration_s
    start = threading.Barrier(callers + 1)

    def worker(k: int) -> None:
        mine: list[float] = []
        x = inputs[k % len(inputs)]
        start.wait()
        while time.perf_counter() < stop:
            t0 = time.perf_counter()
            call(x)
            mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(callers)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return len(latencies), time.perf_counter() - t0, latencies


def serve_one_by_one(model: Any, inputs: list[Any], callers: int, duration_s: float) -> ServeResult:
    """Every caller runs the model on its own input (a lock serialises the model, as one GPU would)."""
    import torch

    lock = threading.Lock()

    def call(x: Any) -> Any:
        with lock, torch.inference_mode():
            return model(x.unsqueeze(0))[0]

    n, secs, lat = _closed_loop(call, inputs, callers, duration_s)
    p50, p99 = percentiles(lat, [50, 99])
    return ServeResult("one request at a time", n, secs, p50 * 1e3, p99 * 1e3, 1.0)


def batch_fn_for(model: Any) -> Callable[[list[Any]], Any]:
    """The batch function the demo hands to batchkit: stack, run once, split."""
    import torch

    def run(xs: list[Any]) -> Any:
        with torch.inference_mode():
            return list(model(torch.stack(xs)).unbind(0))

    return run


def serve_batched(
    model: Any, inputs: list[Any], callers: int, duration_s: float, max_batch_size: int = 32, max_wait_ms: float = 5
) -> ServeResult:
    """The same callers through a :class:`DynamicBatcher`."""
    b = DynamicBatcher(batch_fn_for(model), max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, name="mlp")
    try:
        n, secs, lat = _closed_loop(b, inputs, callers, duration_s)
        stats = b.statistics()
    finally:
        b.close()
    p50, p99 = percentiles(lat, [50, 99])
    return ServeResult(
        f"batchkit (max_batch_size={max_batch_size}, max_wait_ms={max_wait_ms:g})",
        n,
        secs,
        p50 * 1e3,
        p99 * 1e3,
        stats.mean_batch_size,
    )


def ceiling_rps(model: Any, inputs: list[Any], batch: int, duration_s: float) -> float:
    """Requests/s of the model on ready-made batches of ``batch``: what no batcher can beat."""
    import torch

    x = torch.stack([inputs[i % len(inputs)] for i in range(batch)])
    n = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        while time.perf_counter() - t0 < duration_s:
            model(x)
            n += batch
    return n / (time.perf_counter() - t0)
