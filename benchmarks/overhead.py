"""Per-request overhead of batchkit's dynamic batcher, with a no-op batch function.

Measures requests/s and microseconds per request for:
  - 512 concurrent asyncio tasks (each awaits one request at a time) through ``asubmit``;
  - the same tasks through ``AsyncBatcher.submit`` (same loop, no thread, no lock);
  - the same tasks awaiting an ``@batched async def`` (as users write it: the on-loop batcher);
  - the same callers through a bare, minimal asyncio batcher (a baseline with none of batchkit's
    guarantees: no bound, no deadlines, no thread safety), run side by side in the same process;
  - 64 threads calling the blocking ``batcher(x)``.
Beside wall-clock rates it prints the process's CPU time per request (all threads), the part of
it spent in the main thread (the callers' event loop, in the asyncio and trio rows: their resumes
and submits; the rest is batchkit's dispatcher and worker threads), and its voluntary context
switches per 1,000 requests: what the thread hand-offs of DynamicBatcher cost.

Run:  python benchmarks/overhead.py [--requests 20000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import threading
import time
from collections.abc import Callable

import anyio

import batchkit


def noop(xs: list[int]) -> list[int]:
    return xs


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


def bench_batchkit_async(n: int, callers: int, backend: str) -> float:
    b = batchkit.DynamicBatcher(noop, max_batch_size=callers, max_wait_ms=1, max_queue=4 * callers)
    try:
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

    return asyncio.run(main())


def bench_batchkit_decorator(n: int, callers: int) -> float:
    async def main() -> float:
        @batchkit.batched(max_batch=callers, max_wait_ms=1, max_queue=4 * callers)
        async def predict(xs: list[int]) -> list[int]:
            return xs

        try:
            return await _drive_async(predict, n, callers)
        finally:
            await predict.aclose()

    return asyncio.run(main())


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


def bench_bare_asyncio(n: int, callers: int) -> float:
    async def main() -> float:
        b = BareAsyncioBatcher(noop, callers, 0.001)
        rate = await _drive_async(b, n, callers)
        assert b.task is not None
        b.task.cancel()
        return rate

    return asyncio.run(main())


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--requests", type=int, default=20_000, help="requests per run, at least 512 (one per caller) (default: 20000)"
    )
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs, at least 1 (default: 3)")
    args = ap.parse_args()
    if args.requests < 512:  # 512 asyncio callers share them: fewer would leave every caller idle
        ap.error(f"--requests must be at least 512 (one per caller of the 512-task rows), got {args.requests}")
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    n = args.requests
    rows: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    main_cpu: dict[str, list[float]] = {}
    switches: dict[str, list[float]] = {}
    configs: list[tuple[str, Callable[[], float]]] = [
        ("bare asyncio batcher, 512 tasks (baseline)", lambda: bench_bare_asyncio(n, 512)),
        ("batchkit AsyncBatcher, 512 asyncio tasks", lambda: bench_batchkit_same_loop(n, 512)),
        ("batchkit @batched async def, 512 asyncio tasks", lambda: bench_batchkit_decorator(n, 512)),
        ("batchkit asubmit, 512 asyncio tasks", lambda: bench_batchkit_async(n, 512, "asyncio")),
        ("batchkit asubmit, 512 trio tasks", lambda: bench_batchkit_async(n, 512, "trio")),
        ("batchkit blocking call, 64 threads", lambda: bench_batchkit_threads(n, 64)),
    ]
    for _ in range(args.repeats):  # interleaved, so that machine noise hits every row alike
        for name, run in configs:
            c0, m0, sw0 = time.process_time(), time.thread_time(), resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
            rows.setdefault(name, []).append(run())
            # every thread of the process, setup and teardown included
            cpu.setdefault(name, []).append((time.process_time() - c0) / n)
            main_cpu.setdefault(name, []).append((time.thread_time() - m0) / n)
            switches.setdefault(name, []).append((resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw - sw0) / n)
    base = statistics.median(rows[configs[0][0]])
    print(f"no-op batch function, {n} requests per run, median of {args.repeats} runs\n")
    print(
        f"{'configuration':48} {'req/s':>10} {'us/req':>8} {'vs bare':>8} {'cpu us/req':>11} "
        f"{'main thread':>12} {'switches/1k':>12}"
    )
    for name, rates in rows.items():
        r = statistics.median(rates)
        print(
            f"{name:48} {r:10,.0f} {1e6 / r:8.2f} {r / base:8.2f} {1e6 * statistics.median(cpu[name]):11.2f} "
            f"{1e6 * statistics.median(main_cpu[name]):12.2f} {1e3 * statistics.median(switches[name]):12.1f}"
        )


if __name__ == "__main__":
    main()
