"""Promises of docs/tuning.md, checked as a user reads them: the bench report's formulas and CLI,
and the simulator's cost models fed from a bench JSON (the adaptive controller's, tuner's and
circuit breaker's are tested beside their units in tests/control/)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchkit import bench, sim
from batchkit.cli import main
from batchkit.testing import echo_batch

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
