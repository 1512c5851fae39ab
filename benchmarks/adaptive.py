"""Adaptive batch sizing under changing traffic, on the CPU MLP of benchmarks/model.py.

Traffic steps low -> high -> low (Poisson; the high phase at 60% of what a batch of 16 serves on
an idle machine, which is near saturation once the callers share the two cores with the model).
Served by fixed settings (max_batch_size B, max_wait_ms 40) and by the adaptive controller
(target backlog 1, step 4, B in 1..128, the SLO as its latency guard). For each: P99 and throughput per
phase. The same scenario then runs in the simulator with the cost table t(B) measured here, side
by side. Writes a plot (P99 per phase and setting; the controller's batch size over time).

One run of each setting: ``--repeat`` and ``--warmup`` are refused above 1 and 0.

Run:  .venv/bin/python benchmarks/adaptive.py [--phase-s 4] [--slo-ms 80] [--plot docs/img/adaptive.png] [--json PATH]
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import _harness as harness
import anyio
import torch

import batchkit
from batchkit import sim
from batchkit.demo import mlp as demo_mlp
from batchkit.metrics import percentiles

FIXED = (1, 4, 16, 64, 128)
MAX_WAIT_MS = 40.0
ETA = 4  # the controller's step: a phase change is met within a few batches


def measure_cost(model, sizes=(1, 2, 4, 8, 16, 32, 64, 128)) -> dict[int, float]:  # type: ignore[no-untyped-def]
    fn = demo_mlp.batch_fn_for(model)
    table = {}
    for b in sizes:
        xs = [torch.randn(1024) for _ in range(b)]
        fn(xs)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < 0.3:
            fn(xs)
            n += 1
        table[b] = (time.perf_counter() - t0) / n
    return table


def run(model, phases, windows, slo_ms: float, fixed_b: int | None):  # type: ignore[no-untyped-def]
    ctl = None
    if fixed_b is None:
        ctl = batchkit.AdaptiveBatchController(
            target_queue=1, eta=ETA, min_batch=1, max_batch=128, latency_slo_ms=slo_ms
        )
    b = batchkit.DynamicBatcher(
        demo_mlp.batch_fn_for(model),
        max_batch_size=fixed_b or 1,
        max_wait_ms=MAX_WAIT_MS,
        max_queue=1_000_000,
        controller=ctl,
    )
    x = torch.randn(1024)
    records: list[tuple[float, float]] = []  # (arrival, latency)
    sizes: list[tuple[float, int]] = []

    async def main() -> float:
        t0 = time.perf_counter()

        async def one(sched: float) -> None:
            await b.asubmit(x)
            records.append((sched - t0, time.perf_counter() - sched))

        rng = random.Random(3)
        async with anyio.create_task_group() as tg:
            t = t0
            for duration, rate in phases:
                end = t + duration
                while True:
                    t += rng.expovariate(rate)
                    if t >= end:
                        t = end
                        break
                    delay = t - time.perf_counter()
                    if delay > 0:
                        await anyio.sleep(delay)
                    tg.start_soon(one, t)
                    if ctl is not None:
                        sizes.append((t - t0, b.max_batch_size))
        return t0

    anyio.run(main)
    b.close()
    out = []
    for start, end in windows:
        lat = [lat for arr, lat in records if start <= arr < end]
        done = sum(1 for arr, lat in records if start <= arr + lat < end)
        out.append((percentiles(lat, [99])[0] * 1e3, done / (end - start)))
    return out, sizes


def main() -> None:
    ap = harness.parser(__doc__, once=True)
    ap.add_argument("--phase-s", type=float, default=4.0)
    ap.add_argument("--slo-ms", type=float, default=80.0)
    ap.add_argument("--plot", default=None, help="write the plot here (PNG)")
    args = ap.parse_args()
    record = harness.start(args)
    model = demo_mlp.make_mlp(threads=2)
    cost = measure_cost(model)
    cap16 = 16 / cost[16]
    high, low = 0.6 * cap16, 0.1 * cap16
    p = args.phase_s
    phases = [(p, low), (p, high), (p, low)]
    windows = [(0, p), (p, 2 * p), (2 * p, 3 * p)]
    print("CPU MLP, t_batch(B) ms: " + ", ".join(f"{k}: {v * 1e3:.1f}" for k, v in cost.items()))
    print(
        f"traffic: {low:,.0f} -> {high:,.0f} -> {low:,.0f} req/s, {p:g} s each; SLO P99 {args.slo_ms:g} ms; "
        f"fixed settings wait up to {MAX_WAIT_MS:g} ms"
    )
    print(
        f"{'setting':14} {'':3} {'P99 low':>9} {'P99 high':>9} {'P99 low':>9} {'thr high':>9}   sim: "
        f"{'P99 low':>8} {'P99 high':>9} {'P99 low':>8} {'thr high':>9}"
    )
    rows = {}
    adaptive_sizes: list[tuple[float, int]] = []
    for fixed_b in (*FIXED, None):
        real, sizes = run(model, phases, windows, args.slo_ms, fixed_b)
        if fixed_b is None:
            adaptive_sizes = sizes
        ctl = (
            None
            if fixed_b
            else batchkit.AdaptiveBatchController(
                target_queue=1, min_batch=1, max_batch=128, latency_slo_ms=args.slo_ms
            )
        )
        s = sim.simulate(
            sim.table_cost(cost),
            sim.steps(phases, seed=3),
            max_batch_size=fixed_b or 1,
            max_wait_ms=MAX_WAIT_MS,
            controller=ctl,
            phases=windows,
        )
        name = f"fixed B={fixed_b}" if fixed_b else "adaptive"
        rows[name] = real
        for phase, (p99, throughput) in zip(("low", "high", "low again"), real, strict=True):
            record.add("P99", p99, "ms", setting=name, phase=phase)
            record.add("throughput", throughput, "req/s", setting=name, phase=phase)
        ok = "ok " if all(x[0] <= args.slo_ms for x in real) else "SLO"
        print(
            f"{name:14} {ok:3} "
            + " ".join(f"{x[0]:9.1f}" for x in real)
            + f" {real[1][1]:9,.0f}   sim: "
            + " ".join(f"{ph.latency.p99_ms:8.1f}" for ph in s.phases)
            + f" {s.phases[1].throughput:9,.0f}"
        )
    meeting = [v[1][1] for k, v in rows.items() if k != "adaptive" and all(x[0] <= args.slo_ms for x in v)]
    if meeting:
        print(
            f"adaptive high-phase throughput = {rows['adaptive'][1][1] / max(meeting):.0%} of the best fixed "
            f"setting meeting the SLO"
        )
    else:
        print("no fixed setting met the SLO in every phase")
    record.write()
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
        names = list(rows)
        for i, phase in enumerate(("low", "high", "low again")):
            ax1.bar([j + 0.27 * i for j in range(len(names))], [rows[n][i][0] for n in names], width=0.27, label=phase)
        ax1.axhline(args.slo_ms, color="red", linestyle=":", label=f"SLO {args.slo_ms:g} ms")
        ax1.set_xticks([j + 0.27 for j in range(len(names))], names, rotation=30, ha="right")
        ax1.set_yscale("log")
        ax1.set_ylabel("P99 latency (ms)")
        ax1.legend()
        ax2.plot([t for t, _ in adaptive_sizes], [b for _, b in adaptive_sizes], drawstyle="steps-post")
        for x in (p, 2 * p):
            ax2.axvline(x, color="gray", linestyle=":")
        ax2.set_xlabel("time (s)")
        ax2.set_ylabel("adaptive max_batch_size")
        fig.tight_layout()
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
