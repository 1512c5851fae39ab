"""Promises of docs/tuning.md, checked as a user reads them: the bench report's formulas and CLI,
the simulator's cost models fed from a bench JSON, and the adaptive controller and tuner."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

import batchkit
from batchkit import AdaptiveBatchController, AdaptiveTuner, DynamicBatcher, bench, sim
from batchkit.cli import main
from batchkit.testing import MockClock, echo_batch

WAIT = 10.0


def _fake_points(monkeypatch: pytest.MonkeyPatch, measured: dict[int, tuple[float, float]]) -> None:
    """Replace the measurement with fixed figures (B: throughput, p99 ms), 2 s per point."""

    def fake_point(fn: object, make_item: object, batch_size: int, **kwargs: object) -> bench.BenchPoint:
        thr, p99 = measured[batch_size]
        return bench.BenchPoint(
            batch_size, 5.0, "closed", 64.0, int(2 * thr), 2.0, thr, p99 / 2, p99 * 0.9, p99,
            float(batch_size), 1000 * batch_size / thr, 1.0, 64.0, 64.0,
        )  # fmt: skip

    monkeypatch.setattr(bench, "run_point", fake_point)


def test_b_knee_is_the_smallest_size_reaching_90_percent_and_b_sla_the_largest_meeting_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """B_knee: the smallest batch size that reaches 90% of the best throughput (900 of 1000
    reaches it); B_SLA: the largest whose P99 meets the SLA (a P99 equal to it meets it)."""
    _fake_points(monkeypatch, {1: (100.0, 5.0), 2: (899.0, 8.0), 4: (900.0, 9.0), 8: (1000.0, 20.0), 16: (990.0, 21.0)})
    report = bench.sweep(echo_batch, lambda i: i, [1, 2, 4, 8, 16], sla_ms=20)
    assert (report.b_knee, report.b_sla, report.b_opt) == (4, 8, 4)


def test_cost_per_token_is_the_price_of_the_run_over_its_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """C_token = C_gpu * T_run / N_tokens at B_opt, each request standing for tokens_per_item tokens."""
    _fake_points(monkeypatch, {1: (100.0, 5.0), 2: (1000.0, 5.0)})
    report = bench.sweep(echo_batch, lambda i: i, [1, 2], price_per_hour=3.6, tokens_per_item=10)
    assert report.b_opt == 2
    point = report.points[1]
    expected = 3.6 / 3600 * point.seconds / (point.requests * 10)
    assert report.cost_per_token == pytest.approx(expected)


def test_qps_max_is_the_mean_batch_at_b_opt_over_its_batch_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """QPS_max = B_opt / t_batch(B_opt), with the mean batch actually formed in place of B_opt."""
    _fake_points(monkeypatch, {4: (1000.0, 5.0)})
    report = bench.sweep(echo_batch, lambda i: i, [4])
    (p,) = report.points
    assert report.qps_max == pytest.approx(p.mean_batch_size / (p.t_batch_ms / 1000))


def test_the_report_shows_every_column_the_guide_lists() -> None:
    """Throughput, p50/p90/p99, mean batch, t_batch, utilisation and the Little's-law pair."""
    report = bench.sweep(echo_batch, lambda i: i, [2], concurrency=2, duration_s=0.05)
    header = report.table().splitlines()[0].split()
    for column in ("B", "req/s", "p50", "p90", "p99", "batch", "t_batch", "util", "L", "lam*W"):
        assert column in header, column


def test_a_bench_json_feeds_table_cost_through_mean_batch_size_and_t_batch(tmp_path: Path) -> None:
    """sim.table_cost({B: seconds}) from the bench JSON: each point's mean_batch_size (a float)
    and t_batch_ms / 1000; the simulator then runs on it."""
    report = bench.sweep(echo_batch, lambda i: i, [1, 4], concurrency=4, duration_s=0.05)
    path = tmp_path / "bench.json"
    report.to_json(path)
    points = json.loads(path.read_text())["points"]
    table = {p["mean_batch_size"]: p["t_batch_ms"] / 1000 for p in points}
    cost = sim.table_cost(table)
    for b, seconds in table.items():
        assert cost(max(1, round(b))) >= 0
        assert math.isfinite(seconds)
    r = sim.simulate(cost, sim.poisson(rate=100, duration_s=2, seed=1), max_batch_size=4)
    assert r.completed == r.arrivals


def test_linear_cost_is_the_worked_example() -> None:
    """linear_cost(fixed_ms=15, per_item_ms=5): t(1) = 20 ms, t(8) = 55 ms."""
    cost = sim.linear_cost(fixed_ms=15, per_item_ms=5)
    assert cost(1) == pytest.approx(0.020)
    assert cost(8) == pytest.approx(0.055)


def test_bench_cli_imports_a_package_from_the_current_folder(tmp_path: Path) -> None:
    """`batchkit bench mypackage.model:predict_batch --make-item mypackage.model:sample_input`
    run from the folder that holds mypackage/ finds it (the console script, not python -m)."""
    pkg = tmp_path / "bk_tuning_doc_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(
        "import numpy as np\n\n"
        "WEIGHTS = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)\n\n\n"
        "def predict_batch(xs):\n    return list(np.stack(xs) @ WEIGHTS)\n\n\n"
        "def sample_input(i):\n    return np.full(256, i % 7, dtype=np.float32)\n"
    )
    script = Path(sys.executable).with_name("batchkit")
    if not script.exists():
        pytest.skip("the batchkit console script is not installed beside this interpreter")
    args = [str(script), "bench", "bk_tuning_doc_pkg.model:predict_batch"]
    args += ["--make-item", "bk_tuning_doc_pkg.model:sample_input", "--batch-sizes", "1,2", "--concurrency", "2"]
    args += ["--duration", "0.05", "--sla-ms", "1000", "--price-per-hour", "2.5", "--json", "bench.json"]
    args += ["--no-progress"]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "B_opt" in done.stdout
    assert "cost per token" in done.stdout
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [p["batch_size"] for p in data["points"]] == [1, 2]


def test_bench_threads_default_leaves_the_callers_a_core_and_the_report_names_the_pools(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Without --threads the target's pools get one thread less than the CPUs the process may
    use (at least 1); the first line names the setting, the report the pools the target ran with."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cpus - 1)
    args = ["bench", "batchkit.testing:echo_batch", "--batch-sizes", "1", "--duration", "0.05", "--concurrency", "2"]
    assert main([*args, "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(f", --threads {threads}")
    (pools,) = [line for line in lines if line.startswith(f"threads (limited to {threads}): ")]
    assert "(blas)" in pools  # numpy's BLAS is loaded with batchkit


def test_latencies_older_than_the_window_no_longer_shrink_the_batch() -> None:
    """The latency guard reads the P99 over the last window_s: a slow minute long past does not
    keep stepping the batch down."""
    clock = MockClock()
    ctl = AdaptiveBatchController(
        target_queue=1, eta=1, min_batch=1, max_batch=64, initial=8, latency_slo_ms=80, window_s=5.0, clock=clock
    )
    ctl.observe_latencies([0.079] * 20)
    assert ctl.update(queue_depth=1).reason == "latency"
    clock.advance(6.0)
    assert math.isnan(ctl.latency_ms())
    assert ctl.update(queue_depth=1).reason != "latency"


def test_a_cuda_out_of_memory_error_splits_the_batch_and_lowers_the_ceiling() -> None:
    """torch.cuda.OutOfMemoryError, like MemoryError, always splits and retries (no isolate_errors
    needed) and lowers the controller's ceiling."""
    torch = pytest.importorskip("torch")

    def fn(xs: list[int]) -> list[int]:
        if len(xs) > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return [2 * x for x in xs]

    clock = MockClock()
    ctl = AdaptiveBatchController(target_queue=0, max_batch=8, initial=8, clock=clock)
    with DynamicBatcher(fn, max_batch_size=8, max_wait_ms=1e6, controller=ctl, clock=clock) as b:
        futures = [b.submit(i) for i in range(8)]
        assert [f.result(WAIT) for f in futures] == [2 * i for i in range(8)]
    assert ctl.ceiling <= 4


def test_a_tuned_batcher_gives_the_controller_the_backlog_a_batch_leaves_behind() -> None:
    """Q_t is the backlog a batch of the current size would leave behind, whether the controller
    runs inside the batcher or through AdaptiveTuner: 3 items waiting for a batch of 8 are no
    backlog (step down); 20 waiting for a batch of 7 leave 13 behind (step up)."""
    clock = MockClock()
    release, started = threading.Event(), threading.Event()

    def gated(xs: list[int]) -> list[int]:
        started.set()
        assert release.wait(WAIT)
        return xs

    ctl = AdaptiveBatchController(target_queue=1, eta=1, min_batch=1, max_batch=64, initial=8, clock=clock)
    b = DynamicBatcher(gated, max_batch_size=8, max_wait_ms=1e6, clock=clock)
    try:
        tuner = AdaptiveTuner(b, ctl, clock=clock)
        futures = [b.submit(i) for i in range(3)]
        assert tuner.step() == 7
        assert ctl.decisions[-1].queue_depth == 0
        b.flush()
        assert started.wait(WAIT)  # the slot is busy: what comes now waits
        futures += [b.submit(i) for i in range(3, 23)]
        clock.advance(1.0)
        assert tuner.step() == 8
        assert ctl.decisions[-1].queue_depth == 20 - 7
        release.set()
        b.flush()
        assert sorted(f.result(WAIT) for f in futures) == list(range(23))
    finally:
        release.set()
        b.close()


def test_a_tuned_decode_loop_gives_the_controller_its_waiting_requests() -> None:
    """A decode loop's waiting requests are already the backlog (the running ones hold their
    seats): the tuner passes them to the controller as they are."""

    class Target:
        def __init__(self) -> None:
            self.limit = 0

        def queue_depth(self) -> int:
            return 5

        def latency_samples(self, since: int = 0) -> tuple[list[float], int]:
            return [], since

        def set_batch_limit(self, size: int) -> None:
            self.limit = size

    ctl = AdaptiveBatchController(target_queue=1, eta=2, min_batch=1, max_batch=64, initial=8, clock=MockClock())
    target = Target()
    assert AdaptiveTuner(target, ctl).step() == 10
    assert target.limit == 10
    assert ctl.decisions[-1].queue_depth == 5


def test_the_circuit_breaker_example_arguments_are_its_defaults() -> None:
    """CircuitBreaker(failure_threshold=5, reset_timeout_s=10), as the guide writes it, is the default."""
    cb = batchkit.CircuitBreaker()
    assert (cb.failure_threshold, cb.reset_timeout_s, cb.state) == (5, 10.0, "closed")


def test_simulated_utilisation_is_the_share_of_time_the_model_was_busy() -> None:
    """Two batches running side by side (max_concurrent_batches=2) keep the model busy once, not
    twice: utilisation is a share of the run, at most 1."""
    cost = sim.linear_cost(fixed_ms=10, per_item_ms=0)
    r = sim.simulate(cost, sim.trace([0, 0, 0, 0]), max_batch_size=2, max_concurrent_batches=2)
    assert r.batches == 2
    assert r.duration == pytest.approx(0.010)
    assert r.utilisation == pytest.approx(1.0)
    # then idle from 0.010 until a lone item's batch at 0.035 (max_wait_ms=5) runs to 0.045
    r = sim.simulate(cost, sim.trace([0, 0, 0, 0, 0.03]), max_batch_size=2, max_concurrent_batches=2)
    assert r.duration == pytest.approx(0.045)
    assert r.utilisation == pytest.approx(0.020 / 0.045)


def test_an_out_of_memory_error_lowers_the_ceiling_to_half_the_failed_batch() -> None:
    """A batch of 8 that ran out of memory puts the ceiling at 4, whatever it was (64 here), and
    the batch size under it; later steps up stop there."""
    clock = MockClock()
    ctl = AdaptiveBatchController(target_queue=1, eta=4, min_batch=1, max_batch=64, initial=8, clock=clock)
    ctl.on_oom(8)
    assert (ctl.ceiling, ctl.batch_size) == (4, 4)
    clock.advance(1)
    assert ctl.update(queue_depth=100).batch_size == 4


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"failure_threshold": 0}, "failure_threshold"),
        ({"failure_threshold": 2.5}, "failure_threshold"),
        ({"failure_threshold": True}, "failure_threshold"),
        ({"failure_threshold": "3"}, "failure_threshold"),
        ({"reset_timeout_s": 0}, "reset_timeout_s"),
        ({"reset_timeout_s": float("nan")}, "reset_timeout_s"),
        ({"reset_timeout_s": float("inf")}, "reset_timeout_s"),
        ({"reset_timeout_s": "10"}, "reset_timeout_s"),
    ],
)
def test_a_circuit_breaker_refuses_settings_that_would_never_open_or_never_probe(
    kwargs: dict[str, object], match: str
) -> None:
    """failure_threshold is a count (an int >= 1); reset_timeout_s a finite number of seconds > 0:
    a NaN or infinite cool-down would keep an open circuit open for good."""
    with pytest.raises(ValueError, match=match):
        batchkit.CircuitBreaker(**kwargs)  # type: ignore[arg-type]
