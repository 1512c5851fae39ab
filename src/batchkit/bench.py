"""``batchkit bench``: load-test a batch function and find the batch size to run it at.

For each batch size of a sweep, the function is served by a :class:`~batchkit.DynamicBatcher`
under a closed loop (``concurrency`` callers) or an open loop (Poisson ``rate``), and the run
reports throughput, p50/p90/p99 latency, mean batch size, model utilisation, the mean batch time
``t_batch(B)``, and a Little's-law check (``L``, the time-averaged number of requests in the
system, from a count of the requests inside, against ``lambda * W`` from throughput and mean
latency). Both follow each request from its arrival (its scheduled time in the open loop, its
send in the closed loop) to its answer, over the same span: with nothing lost they agree.

Then: ``B_knee`` is the smallest batch size reaching 90% of the best throughput, ``B_SLA`` the
largest whose P99 meets the SLA, ``B_opt = min(B_knee, B_SLA)`` (or, when that size misses the
SLA, the smallest larger one that meets it), ``QPS_max = B_opt /
t_batch(B_opt)`` and, given a price per hour, ``C_token = C_gpu * T_run / N_tokens``. In
``QPS_max`` the batch size is the mean batch the run at ``B_opt`` actually reached, not the
nominal limit: a limit that the load never fills must not inflate the capacity.

A batch function that raises ends the run with its own exception (the first one seen, not a
group); one that runs longer than ``timeout_s`` ends it with :class:`~batchkit.BatchTimeout`.
An interrupt (Ctrl-C) ends it at once, even while a call hangs: that call's thread is left
behind (a daemon), not waited for.

``sweep(threads=N)`` runs the target with its BLAS and OpenMP thread pools (threadpoolctl) and
torch's intra-op threads at ``N``, and reports the pools it ran with.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
import random
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio

from ._errors import QueueFull
from ._validate import non_negative_float, positive_float, positive_int, positive_int_or_none
from .dynamic.batcher import DynamicBatcher, is_async_callable
from .metrics import percentiles

__all__ = ["BenchPoint", "BenchReport", "MAX_QUEUE", "load_callable", "run_point", "sweep"]


def load_callable(spec: str) -> Callable[..., Any]:
    """Import ``module:function`` (``module:object.attr`` works too).

    The module is imported from ``sys.path`` as it is; the CLI puts the current folder first.

    Raises:
        ValueError: not of the form ``module:name``, no such module, no such attribute, or the
            name is not callable.
        Exception: whatever importing the module raised (its own code failed).
    """
    mod_name, sep, attr = spec.partition(":")
    parts = attr.split(".")
    if not sep or not all(p.isidentifier() for p in mod_name.split(".")) or not all(p.isidentifier() for p in parts):
        raise ValueError(f"expected 'module:function' (for example mypackage.model:predict_batch), got {spec!r}")
    try:
        obj: Any = importlib.import_module(mod_name)
    except ModuleNotFoundError as exc:
        # Only a missing target module (or one of its packages) is the spec's fault; a module the
        # target itself imports and lacks is the target failing, and keeps its own error.
        if exc.name is None or not (mod_name == exc.name or mod_name.startswith(exc.name + ".")):
            raise
        raise ValueError(f"no module named {mod_name!r}: run from the folder that holds it, or install it") from None
    for i, part in enumerate(parts):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            where = ".".join([mod_name, *parts[:i]])
            raise ValueError(f"{where} has no attribute {part!r} (from {spec!r})") from None
    if not callable(obj):
        raise ValueError(f"{spec} is not callable (it is a {type(obj).__name__})")
    return obj  # type: ignore[no-any-return]


@dataclass(frozen=True)
class BenchPoint:
    """One configuration's measurements (times in ms)."""

    batch_size: int
    max_wait_ms: float
    mode: str
    load: float  # concurrency (closed) or offered rate per s (open)
    requests: int
    seconds: float
    throughput: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_batch_size: float
    t_batch_ms: float
    utilisation: float
    little_l: float  # time-averaged requests in the system
    little_lambda_w: float  # throughput * mean latency
    rejected: int = 0  # open loop: arrivals refused because the queue was full


@dataclass
class BenchReport:
    """A sweep and what it recommends."""

    points: list[BenchPoint]
    sla_ms: float | None = None
    b_knee: int | None = None
    b_sla: int | None = None
    b_opt: int | None = None
    qps_max: float | None = None
    cost_per_token: float | None = None
    price_per_hour: float | None = None
    notes: list[str] = field(default_factory=list)
    threads: int | None = None  # the limit asked for (None: the pools as they were)
    # The target's thread pools as its calling thread saw them: "libgomp (openmp)": threads.
    thread_pools: dict[str, int] = field(default_factory=dict)

    def table(self) -> str:
        lines = [
            f"{'B':>5} {'req/s':>10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'batch':>6} {'t_batch':>8} "
            f"{'util':>5} {'L':>7} {'lam*W':>7}"
        ]
        for p in self.points:
            mark = " <- B_opt" if p.batch_size == self.b_opt else ""
            lines.append(
                f"{p.batch_size:5d} {_significant(p.throughput):>10} {p.p50_ms:8.2f} {p.p90_ms:8.2f} {p.p99_ms:8.2f} "
                f"{p.mean_batch_size:6.1f} {_significant(p.t_batch_ms):>8} {p.utilisation:5.2f} {p.little_l:7.1f} "
                f"{p.little_lambda_w:7.1f}{mark}"
            )
        lines.append(
            f"B_knee = {self.b_knee}, B_SLA = {self.b_sla}"
            + (f" (P99 <= {self.sla_ms:g} ms)" if self.sla_ms is not None else "")
            + f", B_opt = {self.b_opt}"
            + (
                f", QPS_max = mean batch at B_opt / t_batch(B_opt) = {_significant(self.qps_max)}/s"
                if self.qps_max is not None
                else ""
            )
        )
        if self.cost_per_token is not None:
            lines.append(f"cost per token at B_opt: {self.cost_per_token:.3e} (at {self.price_per_hour:g} per hour)")
        if self.thread_pools or self.threads is not None:
            how = f"limited to {self.threads}" if self.threads is not None else "as found"
            pools = ", ".join(f"{name} {n}" for name, n in self.thread_pools.items()) or "none found"
            lines.append(f"threads ({how}): {pools}")
        lines += self.notes
        return "\n".join(lines)

    def to_json(self, path: str | Path) -> None:
        data = asdict(self)
        Path(path).write_text(json.dumps(data, indent=2))

    def plot(self, path: str | Path) -> None:
        """Throughput and P99 against batch size, with the SLA line and B_opt marked (PNG).

        Raises:
            ImportError: matplotlib is not installed (``pip install 'batchkit[plot]'``).
        """
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:
            raise ImportError("plotting needs matplotlib: pip install 'batchkit[plot]'") from exc
        bs = [p.batch_size for p in self.points]
        fig, ax1 = plt.subplots(figsize=(7, 4))
        ax1.plot(bs, [p.throughput for p in self.points], "o-", color="tab:blue", label="throughput")
        ax1.set_xscale("log", base=2)
        ax1.set_xlabel("max batch size B")
        ax1.set_ylabel("requests/s", color="tab:blue")
        ax2 = ax1.twinx()
        ax2.plot(bs, [p.p99_ms for p in self.points], "s--", color="tab:red", label="P99")
        ax2.set_ylabel("P99 latency (ms)", color="tab:red")
        if self.sla_ms is not None:
            ax2.axhline(self.sla_ms, color="tab:red", linestyle=":", label=f"SLA {self.sla_ms:g} ms")
        if self.b_opt is not None:
            ax1.axvline(self.b_opt, color="gray", linestyle="-.", label=f"B_opt = {self.b_opt}")
        fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88))
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _significant(x: float, digits: int = 3) -> str:
    """``x`` with ``digits`` significant digits, and whole (thousands separated) from
    ``10 ** (digits - 1)`` up: 43,021 and 517 as they are, 14.43 as 14.4, 0.25 as 0.250."""
    if not math.isfinite(x) or x == 0:
        return f"{x:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


# Below this share of busy time at B_opt, QPS_max (the model's time alone) overstates what the
# run served, and the report says so.
LOW_UTILISATION = 0.5

# Open-loop arrivals beyond this many waiting requests are refused (and counted), so that an
# offered rate the target cannot serve ends as a report, not as unbounded memory.
MAX_QUEUE = 100_000


class _ThreadPools:
    """Holds the target's thread pools at ``threads`` for a sweep (None: leaves them as they are)
    and records what the target's calling thread ran with.

    OpenMP keeps its limit per thread, and the target runs in the batcher's worker threads, so
    :meth:`wrap` sets the limit in each thread on its first call; the limits set here, in the
    sweep's thread, cover the pools shared by the whole process (OpenBLAS on pthreads, MKL) and
    torch (whose threads read its own setting), and are restored at exit. A library the target
    loads only during its first call is not limited.
    """

    def __init__(self, threads: int | None) -> None:
        from threadpoolctl import ThreadpoolController

        self.threads = threads
        self.used: dict[str, int] = {}
        self._controller = ThreadpoolController()
        self._local = threading.local()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _ThreadPools:
        if self.threads is not None:
            self._stack.enter_context(self._controller.limit(limits=self.threads))
            torch = sys.modules.get("torch")
            if torch is not None:
                before = torch.get_num_threads()
                torch.set_num_threads(self.threads)
                self._stack.callback(torch.set_num_threads, before)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def wrap(self, fn: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
        """``fn`` run under the limits in whichever thread calls it."""
        # The name only (the batcher's name and its errors read it), not the function's __dict__.
        if is_async_callable(fn):

            @functools.wraps(fn, updated=())
            async def call_async(xs: list[Any]) -> Any:
                first = self._enter_thread()
                result = await fn(xs)
                if first:
                    self._record()
                return result

            return call_async

        @functools.wraps(fn, updated=())
        def call(xs: list[Any]) -> Any:
            first = self._enter_thread()
            result = fn(xs)
            if first:
                self._record()
            return result

        return call

    def _enter_thread(self) -> bool:
        if getattr(self._local, "entered", False):
            return False
        self._local.entered = True
        if self.threads is not None:
            # Set for this thread's life (the batcher's worker: it ends with the point); not restored.
            self._controller.limit(limits=self.threads)
        return True

    def _record(self) -> None:
        """After the thread's first call, so that what the call set up (torch) shows."""
        if self.used:
            return
        used = {f"{pool['prefix']} ({pool['user_api']})": int(pool["num_threads"]) for pool in self._controller.info()}
        torch = sys.modules.get("torch")
        if torch is not None:
            used["torch"] = int(torch.get_num_threads())
        self.used = dict(sorted(used.items()))


class _Tally:
    """What a point counts as requests come and go: each latency, the arrivals refused, the
    first failure, and the area under ``L(t)`` (requests in the system) for Little's law."""

    def __init__(self) -> None:
        self.latencies: list[float] = []
        self.rejected = 0
        self.failure: BaseException | None = None
        self.area = 0.0
        self.in_system = 0
        self.t0 = 0.0
        self.last = 0.0

    def start(self) -> float:
        self.t0 = self.last = time.perf_counter()
        return self.t0

    def arrive(self, at: float) -> None:
        """A request in the system since ``at``: in the open loop its scheduled time, which its
        task may start after. L counts it from there, as its latency does."""
        now = time.perf_counter()
        self.area += self.in_system * (now - self.last) + (now - at)
        self.last = now
        self.in_system += 1

    def leave(self) -> float:
        now = time.perf_counter()
        self.area += self.in_system * (now - self.last)
        self.last = now
        self.in_system -= 1
        return now


async def _request(
    b: DynamicBatcher[Any, Any], item: Any, scheduled: float | None, tally: _Tally, tg: anyio.abc.TaskGroup
) -> None:
    """One request, from its arrival (``scheduled``, or now) to its answer; a failure of the
    target stops the run and is kept."""
    start = time.perf_counter() if scheduled is None else scheduled
    tally.arrive(start)
    try:
        await b.asubmit(item)
    except QueueFull:
        tally.rejected += 1
        return
    except Exception as exc:  # noqa: BLE001 - the target failed: stop the run, keep the cause
        if tally.failure is None:
            tally.failure = exc
        tg.cancel_scope.cancel()
        return
    finally:
        end = tally.leave()
    tally.latencies.append(end - start)  # the instant that ended its time in L


async def _offer_load(
    b: DynamicBatcher[Any, Any],
    items: list[Any],
    tally: _Tally,
    *,
    n_callers: int,
    rate: float | None,
    duration_s: float,
    seed: int,
) -> None:
    """``n_callers`` callers in a closed loop, or Poisson arrivals at ``rate``, for ``duration_s``."""
    t0 = tally.start()
    stop = t0 + duration_s
    async with anyio.create_task_group() as tg:
        if rate is None:

            async def caller(k: int) -> None:
                i = k
                while True:
                    await _request(b, items[i % len(items)], None, tally, tg)
                    i += n_callers
                    if time.perf_counter() >= stop:
                        return

            for k in range(n_callers):
                tg.start_soon(caller, k)
            return
        rng = random.Random(seed)
        t = t0
        i = 0
        while True:
            t += rng.expovariate(rate)
            if t >= stop:
                break
            # Yield even when behind schedule, so that queued requests reach the batcher.
            await anyio.sleep(max(t - time.perf_counter(), 0.0))
            tg.start_soon(_request, b, items[i % len(items)], t, tally, tg)
            i += 1


def _run_within(main: Callable[[], Awaitable[None]], limit: float) -> bool:
    """Run ``main`` on an event loop of its own for at most ``limit`` seconds: whether it
    finished. Ctrl-C stops it and raises ``KeyboardInterrupt``."""
    interrupted = False

    async def on_ctrl_c(scope: anyio.CancelScope, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        # Ctrl-C read by the event loop, not the host task's native cancel that asyncio's runner
        # sends: anyio's cancel scopes can swallow that one, leaving the run hanging.
        nonlocal interrupted
        with anyio.open_signal_receiver(signal.SIGINT) as signals:
            task_status.started()
            async for _ in signals:
                interrupted = True
                scope.cancel()
                return

    async def guarded() -> bool:
        async with anyio.create_task_group() as tg:
            if threading.current_thread() is threading.main_thread() and sys.platform != "win32":
                await tg.start(on_ctrl_c, tg.cancel_scope)
            with anyio.move_on_after(limit):
                await main()
                tg.cancel_scope.cancel()
                return True
            tg.cancel_scope.cancel()
        return False

    finished = anyio.run(guarded)
    if interrupted:
        raise KeyboardInterrupt
    return finished


def run_point(
    fn: Callable[[list[Any]], Any],
    make_item: Callable[[int], Any],
    batch_size: int,
    *,
    max_wait_ms: float = 5.0,
    concurrency: int | None = 64,
    rate: float | None = None,
    duration_s: float = 2.0,
    timeout_s: float = 60.0,
    seed: int = 0,
) -> BenchPoint:
    """Serve ``fn`` at one batch size for ``duration_s`` and measure (closed loop, or open with ``rate``).

    In the closed loop every caller sends at least one request, so a point is never empty.

    Raises:
        ValueError: a size, rate, duration or timeout out of range.
        BatchTimeout: one call of ``fn`` ran longer than ``timeout_s``.
        TimeoutError: the point did not finish within ``duration_s`` plus the waits it allows.
        Exception: the first exception ``fn`` (or ``make_item``) raised.
    """
    positive_float("duration_s", duration_s)
    positive_float("timeout_s", timeout_s)
    n_callers = 0
    if rate is None:
        n_callers = positive_int("concurrency", concurrency, note="(or pass rate)")
    else:
        positive_float("rate", rate)
    b = DynamicBatcher(
        fn,
        max_batch_size=batch_size,
        max_wait_ms=max_wait_ms,
        max_queue=MAX_QUEUE,
        batch_timeout_s=timeout_s,
    )
    tally = _Tally()
    # Every request is bounded by the queue wait and timeout_s per batch; this guard is the last resort.
    limit = duration_s + max_wait_ms / 1e3 + 3 * timeout_s + 10.0
    try:
        items = [make_item(i) for i in range(256)]
        load = functools.partial(
            _offer_load, b, items, tally, n_callers=n_callers, rate=rate, duration_s=duration_s, seed=seed
        )
        finished = _run_within(load, limit)
        seconds = time.perf_counter() - tally.t0
        stats = b.statistics()
    except BaseException:
        # Interrupted (Ctrl-C) or broken: leave now. A call that never returns keeps its worker
        # (a daemon thread); waiting for it would hold the interrupt back for up to timeout_s.
        b.close(drain=False, timeout=0)
        raise
    b.close(drain=False, timeout=timeout_s)
    if tally.failure is not None:
        raise tally.failure
    if not finished:
        raise TimeoutError(f"the run at batch size {batch_size} did not finish within {limit:g} s")
    batch_time = stats.batch_time.mean_ms if stats.batch_time is not None and stats.batches else None
    return _point(
        tally,
        seconds,
        batch_size=batch_size,
        max_wait_ms=max_wait_ms,
        load=rate,
        n_callers=n_callers,
        mean_batch_size=stats.mean_batch_size,
        batch_time_ms=batch_time,
        batches=stats.batches,
    )


def _point(
    tally: _Tally,
    seconds: float,
    *,
    batch_size: int,
    max_wait_ms: float,
    load: float | None,
    n_callers: int,
    mean_batch_size: float,
    batch_time_ms: float | None,
    batches: int,
) -> BenchPoint:
    """The point's figures from what was counted (``load``: the open loop's rate, or None;
    ``batch_time_ms``: the mean time of a batch, None when none ran)."""
    lat = tally.latencies
    p50, p90, p99 = percentiles(lat, [50, 90, 99])
    mean_lat = sum(lat) / len(lat) if lat else float("nan")
    thr = len(lat) / seconds
    if batch_time_ms is not None:
        t_batch = batch_time_ms
        utilisation = min(1.0, (t_batch / 1e3) * batches / seconds)
    else:
        t_batch, utilisation = float("nan"), 0.0  # no batch ran: nothing was busy
    return BenchPoint(
        batch_size=batch_size,
        max_wait_ms=max_wait_ms,
        mode="closed" if load is None else "open",
        load=float(n_callers) if load is None else float(load),
        requests=len(lat),
        seconds=seconds,
        throughput=thr,
        p50_ms=p50 * 1e3,
        p90_ms=p90 * 1e3,
        p99_ms=p99 * 1e3,
        mean_batch_size=mean_batch_size,
        t_batch_ms=t_batch,
        utilisation=utilisation,
        little_l=tally.area / seconds,
        little_lambda_w=thr * mean_lat,
        rejected=tally.rejected,
    )


def sweep(
    fn: Callable[[list[Any]], Any],
    make_item: Callable[[int], Any],
    batch_sizes: Sequence[int],
    *,
    max_wait_ms: float = 5.0,
    concurrency: int | None = 64,
    rate: float | None = None,
    duration_s: float = 2.0,
    timeout_s: float = 60.0,
    sla_ms: float | None = None,
    price_per_hour: float | None = None,
    tokens_per_item: float = 1.0,
    progress: bool = False,
    threads: int | None = None,
) -> BenchReport:
    """Measure every batch size (each once, in increasing order) and derive B_knee, B_SLA, B_opt,
    QPS_max and the cost per token.

    ``threads`` limits the target's BLAS and OpenMP thread pools and torch's intra-op threads
    for the sweep (None: as they are); ``report.thread_pools`` shows what its calling thread ran
    with either way.

    Raises:
        ValueError: an empty list or a batch size that is not an int >= 1, an ``sla_ms`` or
            ``tokens_per_item`` that is not a finite number > 0, a ``price_per_hour`` that is not a
            finite number >= 0, a ``threads`` that is not an int >= 1 (checked before anything
            runs), and what :func:`run_point` raises.
    """
    positive_int_or_none("threads", threads, note="(None: leave the thread pools as they are)")
    if sla_ms is not None:
        positive_float("sla_ms", sla_ms)
    positive_float("tokens_per_item", tokens_per_item)
    if price_per_hour is not None:
        non_negative_float("price_per_hour", price_per_hour)
    for bsz in batch_sizes:
        positive_int("batch size", bsz)
    sizes = sorted(set(batch_sizes))
    if not sizes:
        raise ValueError("batch_sizes is empty")
    point = functools.partial(
        run_point,
        max_wait_ms=max_wait_ms,
        concurrency=concurrency,
        rate=rate,
        duration_s=duration_s,
        timeout_s=timeout_s,
    )
    points, pools = _measure(fn, make_item, sizes, point, threads=threads, progress=progress)
    report = BenchReport(points, sla_ms=sla_ms, price_per_hour=price_per_hour, threads=threads, thread_pools=pools)
    _note_the_load(report, rate=rate, concurrency=concurrency)
    _recommend(report, rate=rate, tokens_per_item=tokens_per_item)
    return report


def _measure(
    fn: Callable[[list[Any]], Any],
    make_item: Callable[[int], Any],
    sizes: list[int],
    point: Callable[..., BenchPoint],
    *,
    threads: int | None,
    progress: bool,
) -> tuple[list[BenchPoint], dict[str, int]]:
    """One point per batch size, in order, with the thread pools ``threads`` asks for: the
    points and the pools the target ran with."""
    bar = None
    if progress:
        from .dynamic._progress import progress_bar

        bar = progress_bar(len(sizes), "bench")
    points = []
    try:
        with _ThreadPools(threads) as pools:
            target = pools.wrap(fn)
            for bsz in sizes:
                points.append(point(target, make_item, bsz))
                if bar is not None:
                    bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return points, pools.used


def _note_the_load(report: BenchReport, *, rate: float | None, concurrency: int | None) -> None:
    """Notes on what the load itself limited: sizes the callers cannot fill, arrivals refused."""
    largest = report.points[-1].batch_size
    if rate is None and concurrency is not None and largest > concurrency:
        report.notes.append(
            f"batch sizes above the concurrency ({concurrency}) cannot fill: each batch holds at most "
            f"{concurrency} requests"
        )
    for p in report.points:
        if p.rejected:
            report.notes.append(
                f"B={p.batch_size}: {p.rejected:,} arrivals refused (more than {MAX_QUEUE:,} waiting): "
                "the offered rate exceeds what this batch size serves"
            )


def _recommend(report: BenchReport, *, rate: float | None, tokens_per_item: float) -> None:
    """B_knee, B_SLA, B_opt, QPS_max and the cost per token from the report's points, with a
    note where one cannot be given or needs care."""
    points, sla_ms = report.points, report.sla_ms
    served = [p for p in points if p.requests > 0]
    if not served:
        report.notes.append("no request completed: lengthen the duration or raise the rate")
        return
    best = max(p.throughput for p in served)
    report.b_knee = min(p.batch_size for p in served if p.throughput >= 0.9 * best)
    meets = [p.batch_size for p in served if sla_ms is None or p.p99_ms <= sla_ms]
    report.b_sla = max(meets) if meets else None
    if report.b_sla is None:
        report.notes.append("no batch size met the SLA: add capacity or relax the SLA")
        return
    b_opt = min(report.b_knee, report.b_sla)
    if b_opt not in meets:
        # P99 is not monotone in B (small batches queue): the knee itself may miss the SLA.
        # Recommend the smallest larger size that meets it (B_SLA at the latest).
        b_opt = min(b for b in meets if b > b_opt)
        report.notes.append(f"B_knee = {report.b_knee} misses the SLA; B_opt is the next size that meets it, {b_opt}")
    report.b_opt = b_opt
    at = next(p for p in points if p.batch_size == report.b_opt)
    # The batch the load actually formed at B_opt, not the nominal limit (it may never fill).
    report.qps_max = at.mean_batch_size / (at.t_batch_ms / 1e3) if at.t_batch_ms > 0 else None
    if report.qps_max is not None and at.utilisation < LOW_UTILISATION and rate is not None:
        # Open loop: the model idles because the offered rate is lower than what it serves.
        report.notes.append(
            f"at B_opt the model was busy {at.utilisation:.0%} of the time: the offered {_significant(rate)}/s "
            "is below its capacity, so the measured throughput is the offered rate, not a limit; "
            "QPS_max is the capacity (raise --rate to measure P99 near it)"
        )
    elif report.qps_max is not None and at.utilisation < LOW_UTILISATION:
        report.notes.append(
            f"at B_opt the model was busy {at.utilisation:.0%} of the time: QPS_max counts its time alone, but "
            f"{_significant(at.throughput)}/s was measured (the callers or the overhead around each request "
            "limited it); plan with the lower figure"
        )
    if report.price_per_hour is not None:
        report.cost_per_token = report.price_per_hour / 3600 * at.seconds / (at.requests * tokens_per_item)
