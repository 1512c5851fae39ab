"""batchkit bench: sweeps, the B_opt recommendation, JSON and plot output, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchkit import bench
from batchkit.cli import main
from batchkit.testing import echo_batch


def test_sweep_reports_every_point_and_a_recommendation() -> None:
    """Each batch size gets measured; B_opt = min(B_knee, B_SLA); QPS_max and cost follow."""
    report = bench.sweep(echo_batch, lambda i: i, [1, 4], concurrency=8, duration_s=0.2, price_per_hour=3.6)
    assert [p.batch_size for p in report.points] == [1, 4]
    for p in report.points:
        assert p.requests > 0
        assert p.p50_ms <= p.p99_ms
        assert p.little_l == pytest.approx(p.little_lambda_w, rel=0.25)
    assert report.b_sla == 4  # no SLA given: every size qualifies
    assert report.b_opt == min(report.b_knee or 0, 4)
    assert report.qps_max is not None
    assert report.cost_per_token is not None
    assert "B_opt" in report.table()


def test_unmeetable_sla_is_reported() -> None:
    """When no batch size meets the SLA, B_opt is None and the report says so."""
    report = bench.sweep(echo_batch, lambda i: i, [2], concurrency=4, duration_s=0.1, sla_ms=1e-9)
    assert report.b_opt is None
    assert "no batch size met the SLA" in report.table()


def test_open_loop_point() -> None:
    """An open-loop point serves roughly the offered rate."""
    p = bench.run_point(echo_batch, lambda i: i, 4, rate=400, duration_s=0.5)
    assert p.mode == "open"
    assert 100 < p.requests < 400


def test_load_callable_errors() -> None:
    """Targets must be module:function and callable."""
    with pytest.raises(ValueError, match="module:function"):
        bench.load_callable("batchkit.testing")
    with pytest.raises(ValueError, match="not callable"):
        bench.load_callable("batchkit:__version__")
    assert bench.load_callable("batchkit.testing:echo_batch") is echo_batch


def test_cli_bench_writes_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`batchkit bench module:function` prints the table and writes JSON and a PNG."""
    pytest.importorskip("matplotlib")
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    args = [
        "bench",
        "batchkit.testing:echo_batch",
        "--batch-sizes",
        "1,2",
        "--duration",
        "0.1",
        "--concurrency",
        "4",
        "--sla-ms",
        "1000",
        "--json",
        str(out_json),
        "--plot",
        str(out_png),
        "--no-progress",
    ]
    assert main(args) == 0
    assert "B_opt" in capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert [p["batch_size"] for p in data["points"]] == [1, 2]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
