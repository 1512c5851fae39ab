"""``batchkit bench``: load-test a batch function and find the batch size to run it at.

For each batch size of a sweep, the function is served by a :class:`~batchkit.DynamicBatcher`
under a closed loop (``concurrency`` callers) or an open loop (Poisson ``rate``), and the run
reports throughput, p50/p90/p99 latency, mean batch size, model utilisation, the mean batch time
``t_batch(B)``, and a Little's-law check (``L``, the time-averaged number of requests in the
system, against ``lambda * W`` from throughput and mean latency, measured independently).

Then: ``B_knee`` is the smallest batch size reaching 90% of the best throughput, ``B_SLA`` the
largest whose P99 meets the SLA, ``B_opt = min(B_knee, B_SLA)``, ``QPS_max = B_opt /
t_batch(B_opt)``, and, given a price per hour, ``C_token = C_gpu * T_run / N_tokens``.
"""

from __future__ import annotations

import importlib
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio

from .batcher import DynamicBatcher
from .metrics import percentiles

__all__ = ["BenchPoint", "BenchReport", "load_callable", "run_point", "sweep"]


def load_callable(spec: str) -> Callable[..., Any]:
    """Import ``module:function`` (``module:object.attr`` works too).

    Raises:
        ValueError: not of the form ``module:name``, or the name is not callable.
    """
    if ":" not in spec:
        raise ValueError(f"expected 'module:function', got {spec!r}")
    mod_name, attr = spec.split(":", 1)
    obj: Any = importlib.import_module(mod_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{spec} is not callable")
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

    def table(self) -> str:
        lines = [
            f"{'B':>5} {'req/s':>10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'batch':>6} {'t_batch':>8} "
            f"{'util':>5} {'L':>7} {'lam*W':>7}"
        ]
        for p in self.points:
            mark = " <- B_opt" if p.batch_size == self.b_opt else ""
            lines.append(
                f"{p.batch_size:5d} {p.throughput:10,.0f} {p.p50_ms:8.2f} {p.p90_ms:8.2f} {p.p99_ms:8.2f} "
                f"{p.mean_batch_size:6.1f} {p.t_batch_ms:8.2f} {p.utilisation:5.2f} {p.little_l:7.1f} "
                f"{p.little_lambda_w:7.1f}{mark}"
            )
        lines.append(
            f"B_knee = {self.b_knee}, B_SLA = {self.b_sla}"
            + (f" (P99 <= {self.sla_ms:g} ms)" if self.sla_ms is not None else "")
            + f", B_opt = {self.b_opt}"
            + (f", QPS_max = B_opt / t_batch(B_opt) = {self.qps_max:,.0f}/s" if self.qps_max else "")
        )
        if self.cost_per_token is not None:
            lines.append(f"cost per token at B_opt: {self.cost_per_token:.3e} (at {self.price_per_hour:g} per hour)")
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


def run_point(
    fn: Callable[[list[Any]], Any],
    make_item: Callable[[int], Any],
    batch_size: int,
    *,
    max_wait_ms: float = 5.0,
    concurrency: int | None = 64,
    rate: float | None = None,
    duration_s: float = 2.0,
    seed: int = 0,
) -> BenchPoint:
    """Serve ``fn`` at one batch size for ``duration_s`` and measure (closed loop, or open with ``rate``)."""
    b = DynamicBatcher(fn, max_batch_size=batch_size, max_wait_ms=max_wait_ms, max_queue=1_000_000)
    items = [make_item(i) for i in range(256)]
    lat: list[float] = []
    area = 0.0
    in_system = 0
    last = 0.0
    t0 = 0.0

    def change(delta: int) -> None:
        nonlocal area, in_system, last
        now = time.perf_counter()
        area += in_system * (now - last)
        last = now
        in_system += delta

    async def one(i: int, scheduled: float | None) -> None:
        start = time.perf_counter() if scheduled is None else scheduled
        change(+1)
        await b.asubmit(items[i % len(items)])
        change(-1)
        lat.append(time.perf_counter() - start)

    async def main() -> None:
        nonlocal t0, last
        t0 = last = time.perf_counter()
        stop = t0 + duration_s
        async with anyio.create_task_group() as tg:
            if rate is None:
                assert concurrency is not None

                async def caller(k: int) -> None:
                    i = k
                    while time.perf_counter() < stop:
                        await one(i, None)
                        i += concurrency

                for k in range(concurrency):
                    tg.start_soon(caller, k)
            else:
                rng = random.Random(seed)
                t = t0
                i = 0
                while True:
                    t += rng.expovariate(rate)
                    if t >= stop:
                        break
                    delay = t - time.perf_counter()
                    if delay > 0:
                        await anyio.sleep(delay)
                    tg.start_soon(one, i, t)
                    i += 1

    try:
        anyio.run(main)
        seconds = time.perf_counter() - t0
        stats = b.statistics()
    finally:
        b.close()
    p50, p90, p99 = percentiles(lat, [50, 90, 99])
    mean_lat = sum(lat) / len(lat) if lat else float("nan")
    thr = len(lat) / seconds
    t_batch = stats.batch_time.mean_ms if stats.batch_time is not None else float("nan")
    busy = (t_batch / 1e3) * stats.batches
    return BenchPoint(
        batch_size=batch_size,
        max_wait_ms=max_wait_ms,
        mode="closed" if rate is None else "open",
        load=float(concurrency if rate is None else rate),  # type: ignore[arg-type]
        requests=len(lat),
        seconds=seconds,
        throughput=thr,
        p50_ms=p50 * 1e3,
        p90_ms=p90 * 1e3,
        p99_ms=p99 * 1e3,
        mean_batch_size=stats.mean_batch_size,
        t_batch_ms=t_batch,
        utilisation=min(1.0, busy / seconds),
        little_l=area / seconds,
        little_lambda_w=thr * mean_lat,
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
    sla_ms: float | None = None,
    price_per_hour: float | None = None,
    tokens_per_item: float = 1.0,
    progress: bool = False,
) -> BenchReport:
    """Measure every batch size and derive B_knee, B_SLA, B_opt, QPS_max and the cost per token."""
    if not batch_sizes:
        raise ValueError("batch_sizes is empty")
    bar = None
    if progress:
        from .decorator import _progress_bar

        bar = _progress_bar(len(batch_sizes), "bench")
    points = []
    for bsz in sorted(batch_sizes):
        points.append(
            run_point(
                fn, make_item, bsz, max_wait_ms=max_wait_ms, concurrency=concurrency, rate=rate, duration_s=duration_s
            )
        )
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    best = max(p.throughput for p in points)
    b_knee = min(p.batch_size for p in points if p.throughput >= 0.9 * best)
    meets = [p.batch_size for p in points if sla_ms is None or p.p99_ms <= sla_ms]
    b_sla = max(meets) if meets else None
    b_opt = None if b_sla is None else min(b_knee, b_sla)
    report = BenchReport(points, sla_ms=sla_ms, b_knee=b_knee, b_sla=b_sla, b_opt=b_opt, price_per_hour=price_per_hour)
    if b_opt is None:
        report.notes.append("no batch size met the SLA: add capacity or relax the SLA")
        return report
    at = next(p for p in points if p.batch_size == b_opt)
    report.qps_max = b_opt / (at.t_batch_ms / 1e3) if at.t_batch_ms > 0 else None
    if price_per_hour is not None:
        report.cost_per_token = price_per_hour / 3600 * at.seconds / (at.requests * tokens_per_item)
    return report
