"""Per-request overhead of batchkit's dynamic batcher, with a no-op batch function.

Measures requests/s and microseconds per request for:
  - 512 concurrent asyncio tasks (each awaits one request at a time) through ``asubmit``;
  - the same tasks through ``AsyncBatcher.submit`` (same loop, no thread, no lock);
  - the same tasks awaiting an ``@batched async def`` (as users write it: the on-loop batcher);
  - the same callers through a bare, minimal asyncio batcher (a baseline with none of batchkit's
    guarantees: no bound, no deadlines, no thread safety), run side by side in the same process;
  - 64 threads calling the blocking ``batcher(x)``;
  - the peers' no-op shape (``benchmarks/peers.py``): 64 asyncio tasks, batches of 32, 5 ms, through
    ``asubmit`` and through the bare batcher.
Beside wall-clock rates it prints the process's CPU time per request (all threads), the part of
it spent in the main thread (the callers' event loop, in the asyncio and trio rows: their resumes
and submits; the rest is batchkit's dispatcher and worker threads), its voluntary context
switches per 1,000 requests (what the thread hand-offs of DynamicBatcher cost), and, for the
asyncio rows, the share of the run the callers' event loop sat blocked in its selector with
nothing to run (waiting for another thread to answer it).

Run:  .venv/bin/python benchmarks/overhead.py [--requests 20000] [--repeats 3] [--json PATH]
"""

from __future__ import annotations

import asyncio
import resource
import selectors
import threading
import time
from collections.abc import Callable

import _harness as harness
import anyio

import batchkit


def noop(xs: list[int]) -> list[int]:
    return xs


class TimedSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The event loop's selector, counting the seconds a ``select`` blocked (a timeout of None
    or > 0: the loop had nothing ready to run)."""

    blocked_s = 0.0

    def select(self, timeout: float | None = None):  # type: ignore[no-untyped-def]
        if timeout is not None and timeout <= 0:
            return super().select(timeout)
        t0 = time.perf_counter()
        try:
            return super().select(timeout)
        finally:
            TimedSelector.blocked_s += time.perf_counter() - t0


def run_asyncio(main):  # type: ignore[no-untyped-def]
    """``asyncio.run(main())`` on a loop whose selector counts its blocked time."""
    loop = asyncio.SelectorEventLoop(TimedSelector())
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


async def _drive_async(call, n_requests: int, callers: int) -> float:  # type: ignore[no-untyped-def]
    per = n_requests // callers

    async def caller() -> None:
        for i in range(per):
            await call(i)

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(callers):
            tg.start_soon(caller)
    return (per * callers) / (time.perf_counter() - t0)


def bench_batchkit_async(n: int, callers: int, backend: str, batch: int | None = None, wait_ms: float = 1) -> float:
    b = batchkit.DynamicBatcher(noop, max_batch_size=batch or callers, max_wait_ms=wait_ms, max_queue=4 * callers)
    try:
        if backend == "asyncio":
            return run_asyncio(lambda: _drive_async(b.asubmit, n, callers))  # type: ignore[no-any-return]
        return anyio.run(_drive_async, b.asubmit, n, callers, backend=backend)
    finally:
        b.close()


def bench_batchkit_same_loop(n: int, callers: int) -> float:
    async def main() -> float:
        b = batchkit.AsyncBatcher(noop, max_batch_size=callers, max_wait_ms=1, max_queue=4 * callers)
        try:
            return await _drive_async(b.submit, n, callers)
        finally:
            await b.aclose()

    return run_asyncio(main)  # type: ignore[no-any-return]


def bench_batchkit_decorator(n: int, callers: int) -> float:
    async def main() -> float:
        @batchkit.batched(max_batch=callers, max_wait_ms=1, max_queue=4 * callers)
        async def predict(xs: list[int]) -> list[int]:
            return xs

        try:
            return await _drive_async(predict, n, callers)
        finally:
            await predict.aclose()

    return run_asyncio(main)  # type: ignore[no-any-return]


class BareAsyncioBatcher:
    """The smallest useful asyncio batcher: a list, a wake event, one loop task."""

    def __init__(self, fn, max_batch: int, max_wait_s: float) -> None:  # type: ignore[no-untyped-def]
        self.fn, self.max_batch, self.max_wait_s = fn, max_batch, max_wait_s
        self.items: list = []  # type: ignore[type-arg]
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None  # type: ignore[type-arg]

    async def __call__(self, x):  # type: ignore[no-untyped-def]
        if self.task is None:
            self.task = asyncio.get_running_loop().create_task(self.run())
        fut = asyncio.get_running_loop().create_future()
        self.items.append((x, fut))
        if len(self.items) == 1 or len(self.items) >= self.max_batch:
            self.wake.set()
        return await fut

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            if len(self.items) < self.max_batch:
                await asyncio.sleep(self.max_wait_s)
            batch, self.items = self.items[: self.max_batch], self.items[self.max_batch :]
            if self.items:
                self.wake.set()
            results = self.fn([x for x, _ in batch])
            for (_, fut), r in zip(batch, results, strict=False):
                fut.set_result(r)


def bench_bare_asyncio(n: int, callers: int, batch: int | None = None, wait_ms: float = 1) -> float:
    async def main() -> float:
        b = BareAsyncioBatcher(noop, batch or callers, wait_ms / 1000)
        rate = await _drive_async(b, n, callers)
        assert b.task is not None
        b.task.cancel()
        return rate

    return run_asyncio(main)  # type: ignore[no-any-return]


def bench_batchkit_threads(n: int, threads: int) -> float:
    b = batchkit.DynamicBatcher(noop, max_batch_size=threads, max_wait_ms=1, max_queue=4 * threads)
    per = n // threads
    barrier = threading.Barrier(threads + 1)

    def worker() -> None:
        barrier.wait()
        for i in range(per):
            b(i)

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    rate = per * threads / (time.perf_counter() - t0)
    b.close()
    return rate


def measured(run: Callable[[], float], n: int) -> dict[str, float]:
    """One run of a row: its requests/s, and per request its CPU seconds (all threads, set-up and
    teardown included), main-thread CPU seconds and voluntary context switches; and the share of
    the timed drive the event loop sat blocked in its selector."""
    c0, m0, sw0 = time.process_time(), time.thread_time(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
    TimedSelector.blocked_s = 0.0
    rate = run()
    return {
        "rate": rate,
        "blocked": TimedSelector.blocked_s * rate / n,
        "cpu": (time.process_time() - c0) / n,
        "main_cpu": (time.thread_time() - m0) / n,
        "switches": (resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - sw0) / n,
    }


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument(
        "--requests", type=int, default=20_000, help="requests per run, at least 512 (one per caller) (default: 20000)"
    )
    ap.add_argument("--repeat", "--repeats", type=int, default=3, help="interleaved runs, at least 1 (default: 3)")
    args = ap.parse_args()
    if args.requests < 512:  # 512 asyncio callers share them: fewer would leave every caller idle
        ap.error(f"--requests must be at least 512 (one per caller of the 512-task rows), got {args.requests}")
    record = harness.start(args)
    n = args.requests
    configs: list[tuple[str, Callable[[], float]]] = [
        ("bare asyncio batcher, 512 tasks (baseline)", lambda: bench_bare_asyncio(n, 512)),
        ("batchkit AsyncBatcher, 512 asyncio tasks", lambda: bench_batchkit_same_loop(n, 512)),
        ("batchkit @batched async def, 512 asyncio tasks", lambda: bench_batchkit_decorator(n, 512)),
        ("batchkit asubmit, 512 asyncio tasks", lambda: bench_batchkit_async(n, 512, "asyncio")),
        ("batchkit asubmit, 512 trio tasks", lambda: bench_batchkit_async(n, 512, "trio")),
        ("batchkit blocking call, 64 threads", lambda: bench_batchkit_threads(n, 64)),
        ("bare asyncio batcher, 64 tasks, batch 32, 5 ms", lambda: bench_bare_asyncio(n, 64, 32, 5)),
        ("batchkit asubmit, 64 asyncio tasks, batch 32, 5 ms", lambda: bench_batchkit_async(n, 64, "asyncio", 32, 5)),
    ]
    # Interleaved, so that machine noise hits every row alike.
    runs = harness.interleave(
        {name: lambda run=run: measured(run, n) for name, run in configs}, args.repeat, args.warmup
    )
    # Each row's median of each measure.
    med = {name: {k: harness.median(r[k] for r in row) for k in row[0]} for name, row in runs.items()}
    for name, row in runs.items():
        record.add("requests/s", [r["rate"] for r in row], "req/s", row=name)
        record.add("cpu per request", [1e6 * r["cpu"] for r in row], "us", row=name)
        record.add("main thread cpu per request", [1e6 * r["main_cpu"] for r in row], "us", row=name)
        record.add("voluntary switches per 1k requests", [1e3 * r["switches"] for r in row], row=name)
        record.add("loop blocked", [r["blocked"] for r in row], "fraction", row=name)
    base = med[configs[0][0]]["rate"]
    print(f"no-op batch function, {n} requests per run, median of {args.repeat} runs\n")
    print(
        f"{'configuration':52} {'req/s':>10} {'us/req':>8} {'vs bare':>8} {'cpu us/req':>11} "
        f"{'main thread':>12} {'switches/1k':>12} {'loop blocked':>13}"
    )
    for name, m in med.items():
        r, share = m["rate"], m["blocked"]
        print(
            f"{name:52} {r:10,.0f} {1e6 / r:8.2f} {r / base:8.2f} {1e6 * m['cpu']:11.2f} "
            f"{1e6 * m['main_cpu']:12.2f} {1e3 * m['switches']:12.1f} "
            f"{'' if 'trio' in name or 'threads' in name else f'{share:.0%}':>13}"
        )
    peers_bare = med["bare asyncio batcher, 64 tasks, batch 32, 5 ms"]["rate"]
    peers_batchkit = med["batchkit asubmit, 64 asyncio tasks, batch 32, 5 ms"]["rate"]
    record.add("the peers' shape: asubmit / bare batcher", peers_batchkit / peers_bare)
    print(f"\nthe peers' shape: asubmit / bare batcher {peers_batchkit / peers_bare:.2f}x (issue 26's target >= 0.5x)")
    record.write()


if __name__ == "__main__":
    main()
