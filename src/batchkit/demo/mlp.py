"""The dynamic-batching demo workload of ``batchkit demo`` and the model benchmarks: a torch MLP on CPU.

A 1024 -> 4096 -> 1024 MLP reads ~32 MB of weights per call, so one request at a time is bound by
memory traffic and a batch of 32 costs little more than a batch of 1: the case batching is for.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._errors import BatcherClosed
from .._validate import positive_float, positive_int
from ..dynamic.batcher import DynamicBatcher
from ..metrics import percentiles

__all__ = [
    "OneByOneServer",
    "ServeResult",
    "batch_fn_for",
    "ceiling_rps",
    "make_mlp",
    "serve_batched",
    "serve_one_by_one",
]


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


# How long past the end of a run a caller may still wait for its answer before the demo gives up
# (a model call that never returns must end the demo with an error, not hang it).
CALL_TIMEOUT_S = 60.0


def _check_load(inputs: list[Any], callers: int, duration_s: float) -> None:
    """Refuse a closed loop that could not run (before any thread or server starts).

    Raises:
        ValueError: no inputs, ``callers`` not an int >= 1, or ``duration_s`` not a finite
            number of seconds > 0.
    """
    if len(inputs) == 0:
        raise ValueError("inputs is empty: the callers need at least one input to send")
    positive_int("callers", callers)
    positive_float("duration_s", duration_s, note="(seconds)")


def _closed_loop(
    call: Callable[[Any], Any], inputs: list[Any], callers: int, duration_s: float
) -> tuple[int, float, list[float]]:
    """``callers`` threads each call in a loop for ``duration_s``; return count, seconds, latencies.

    Raises:
        TimeoutError: the callers did not finish within ``duration_s + CALL_TIMEOUT_S``.
        Exception: the first exception a call raised.
    """
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop = time.perf_counter() + duration_s
    start = threading.Barrier(callers + 1)

    def worker(k: int) -> None:
        mine: list[float] = []
        x = inputs[k % len(inputs)]
        try:
            start.wait(CALL_TIMEOUT_S)
            while time.perf_counter() < stop:
                t0 = time.perf_counter()
                call(x)
                mine.append(time.perf_counter() - t0)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, raised there
            with lock:
                errors.append(exc)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(callers)]
    for t in threads:
        t.start()
    start.wait(CALL_TIMEOUT_S)
    t0 = time.perf_counter()
    give_up = t0 + duration_s + CALL_TIMEOUT_S
    for t in threads:
        t.join(max(give_up - time.perf_counter(), 0.0))
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"demo callers still waiting {CALL_TIMEOUT_S:g} s after the end of the run")
    return len(latencies), time.perf_counter() - t0, latencies


class OneByOneServer:
    """The unbatched baseline: one FIFO queue in front of one worker thread that runs the model on
    one input at a time, as one accelerator serving without batching would.

    First come, first served: the latency percentiles show honest queueing (by Little's law, the
    mean latency is about callers / throughput). A bare lock instead would let a caller that
    just released it take it again and again, flattering the median and inflating the tail.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._closed = False
        self._jobs: queue.SimpleQueue[tuple[Any, concurrent.futures.Future[Any]] | None] = queue.SimpleQueue()
        self._worker = threading.Thread(target=self._serve, name="batchkit-demo-one-by-one", daemon=True)
        self._worker.start()

    def _serve(self) -> None:
        import torch

        with torch.inference_mode():
            while (job := self._jobs.get()) is not None:
                x, fut = job
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(self.model(x.unsqueeze(0))[0])
                except BaseException as exc:  # noqa: BLE001 - the caller sees the model's error
                    fut.set_exception(exc)

    def submit(self, x: Any) -> concurrent.futures.Future[Any]:
        """Queue one input behind every input queued before it.

        Raises:
            BatcherClosed: :meth:`close` was called (no worker would ever serve it).
        """
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise BatcherClosed("the one-by-one server is closed")
            self._jobs.put((x, fut))
        return fut

    def close(self, timeout: float = CALL_TIMEOUT_S) -> None:
        """Serve what is queued, then stop the worker (waiting at most ``timeout`` seconds);
        later calls of :meth:`submit` raise :class:`BatcherClosed`. Idempotent."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._jobs.put(None)
        self._worker.join(timeout)


def serve_one_by_one(model: Any, inputs: list[Any], callers: int, duration_s: float) -> ServeResult:
    """The same callers through a :class:`OneByOneServer` (FIFO, one input per model call).

    Raises:
        ValueError: no inputs, ``callers`` < 1 or ``duration_s`` not > 0.
    """
    _check_load(inputs, callers, duration_s)
    server = OneByOneServer(model)

    def call(x: Any) -> Any:
        return server.submit(x).result(timeout=duration_s + CALL_TIMEOUT_S)

    try:
        n, secs, lat = _closed_loop(call, inputs, callers, duration_s)
    finally:
        server.close()
    p50, p99 = percentiles(lat, [50, 99])
    return ServeResult("one request at a time (FIFO)", n, secs, p50 * 1e3, p99 * 1e3, 1.0)


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
    """The same callers through a :class:`DynamicBatcher`.

    Raises:
        ValueError: no inputs, ``callers`` < 1 or ``duration_s`` not > 0 (and the batcher's own
            checks of ``max_batch_size`` and ``max_wait_ms``).
    """
    _check_load(inputs, callers, duration_s)
    b = DynamicBatcher(
        batch_fn_for(model),
        max_batch_size=max_batch_size,
        max_wait_ms=max_wait_ms,
        batch_timeout_s=CALL_TIMEOUT_S,
        name="mlp",
    )

    def call(x: Any) -> Any:
        return b.submit(x).result(timeout=duration_s + max_wait_ms / 1e3 + CALL_TIMEOUT_S)

    try:
        n, secs, lat = _closed_loop(call, inputs, callers, duration_s)
        stats = b.statistics()
    finally:
        b.close(drain=False, timeout=CALL_TIMEOUT_S)
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
    """Requests/s of the model on ready-made batches of ``batch``: what no batcher can beat.

    Raises:
        ValueError: no inputs, ``batch`` < 1 or ``duration_s`` not > 0.
    """
    import torch

    _check_load(inputs, 1, duration_s)
    positive_int("batch", batch)

    x = torch.stack([inputs[i % len(inputs)] for i in range(batch)])
    n = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        while time.perf_counter() - t0 < duration_s:
            model(x)
            n += batch
    return n / (time.perf_counter() - t0)
