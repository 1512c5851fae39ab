"""benchmarks/peers.py: its batchkit and bare-batcher paths run in-process, outputs checked.

A smoke test of the comparison script, with the no-op workload (no torch, no peers needed) and a
few hundred requests; it asserts what the script promises about each row, never a timing.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

import batchkit
from _support import load_benchmark

REQUESTS = 320


@pytest.fixture(scope="module")
def peers() -> ModuleType:
    """The script, imported as a module (benchmarks/ is not a package)."""
    return load_benchmark("peers")


def _closed_noop(peers: ModuleType, row: str) -> dict[str, Any]:
    result: dict[str, Any] = peers.measure(row, "noop", "closed", duration_s=None, requests=REQUESTS)
    return result


@pytest.mark.timeout(30)
@pytest.mark.parametrize("row", ["batchkit", "batchkit-decorator", "bare"])
def test_closed_loop_row_serves_every_request_and_checks_outputs(peers: ModuleType, row: str) -> None:
    """A closed-loop run of the no-op workload completes every request of every caller, checks each
    caller's first result against its own input, and reports a rate and the mean batch size."""
    res = _closed_noop(peers, row)
    assert "error" not in res, res
    per_caller = REQUESTS // peers.CALLERS
    assert res["requests"] == per_caller * peers.CALLERS
    assert res["checked"] == peers.CALLERS
    assert res["mismatches"] == 0
    assert res["rate"] > 0
    assert 1 <= res["mean_batch"] <= peers.MAX_BATCH


@pytest.mark.timeout(30)
def test_async_batcher_row_runs_or_says_why(peers: ModuleType) -> None:
    """The AsyncBatcher row runs where batchkit has AsyncBatcher, and otherwise reports that it is
    missing instead of failing the comparison."""
    res = _closed_noop(peers, "batchkit-async")
    if hasattr(batchkit, "AsyncBatcher"):
        assert "error" not in res, res
        assert res["mismatches"] == 0
        assert res["requests"] == (REQUESTS // peers.CALLERS) * peers.CALLERS
    else:
        assert "no AsyncBatcher" in res["error"]


@pytest.mark.timeout(30)
def test_open_loop_row_reports_latency_percentiles(peers: ModuleType) -> None:
    """An open-loop run through the bare batcher serves the Poisson arrivals it started and
    reports p50 <= p99, with the first callers' outputs checked."""
    res: dict[str, Any] = peers.measure("bare", "noop", "open", duration_s=0.2, rate=1000.0)
    assert "error" not in res, res
    assert res["requests"] > 0
    assert res["mismatches"] == 0
    assert res["checked"] == min(res["requests"], peers.CALLERS)
    assert 0 <= res["p50_ms"] <= res["p99_ms"]


def test_report_names_the_missing_target_and_by_how_much(peers: ModuleType) -> None:
    """The per-workload table carries every row and a ratio line with the verdict for each target,
    saying by how much a missed target is missed."""

    def run(rate: float) -> list[dict[str, Any]]:
        return [{"rate": rate, "mean_batch": 32.0, "checked": 64, "mismatches": 0}]

    closed = {"batchkit": run(80.0), "bare": run(100.0), "ray": [{"error": "ray[serve] not installed (x)"}]}
    text: str = peers.report("noop", ["batchkit", "bare", "ray"], closed, {})
    assert "| batchkit DynamicBatcher | 80 | 32.0 | 64 checked, equal |" in text
    assert "not run: ray[serve] not installed" in text
    assert "0.80x (target >= 0.5x): met" in text
    closed["batchkit"] = run(40.0)
    text = peers.report("noop", ["batchkit", "bare"], closed, {})
    assert "0.40x (target >= 0.5x): NOT met, by 20%" in text
