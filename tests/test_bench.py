"""batchkit bench: sweeps, the B_opt recommendation, JSON and plot output, and the CLI."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from batchkit import BatchTimeout, bench
from batchkit.cli import main
from batchkit.testing import echo_batch

WAIT = 30.0


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


def test_qps_max_uses_the_batch_size_actually_reached() -> None:
    """QPS_max = mean batch at B_opt / t_batch(B_opt): a limit of 1,000,000 that 4 callers can fill
    only to 4 must not promise a million-fold capacity."""
    report = bench.sweep(echo_batch, lambda i: i, [1_000_000], concurrency=4, duration_s=0.1)
    (p,) = report.points
    assert report.b_opt == 1_000_000
    assert p.mean_batch_size <= 4
    assert report.qps_max == pytest.approx(p.mean_batch_size / (p.t_batch_ms / 1e3))
    assert any("cannot fill" in n for n in report.notes)


def test_duplicate_batch_sizes_are_measured_once() -> None:
    """A size listed twice is one point (and so at most one B_opt mark)."""
    report = bench.sweep(echo_batch, lambda i: i, [2, 1, 2], concurrency=2, duration_s=0.05)
    assert [p.batch_size for p in report.points] == [1, 2]
    assert report.table().count("<- B_opt") == 1


def test_a_raising_target_ends_the_run_with_its_own_exception() -> None:
    """The first exception of the batch function comes out as it is, not inside an ExceptionGroup."""

    def boom(xs: list[int]) -> list[int]:
        raise KeyError("bad batch")

    with pytest.raises(KeyError, match="bad batch"):
        bench.sweep(boom, lambda i: i, [1, 2], concurrency=4, duration_s=0.05)


def test_a_target_that_never_returns_ends_with_batch_timeout() -> None:
    """A batch function stuck past timeout_s ends the run with BatchTimeout instead of hanging."""
    release = threading.Event()

    def stuck(xs: list[int]) -> list[int]:
        release.wait(30)
        return xs

    try:
        with pytest.raises(BatchTimeout, match="batch_timeout_s"):
            bench.run_point(stuck, lambda i: i, 2, concurrency=2, duration_s=0.05, timeout_s=0.2)
    finally:
        release.set()


def test_a_raising_make_item_is_not_swallowed() -> None:
    """make_item's own error surfaces before any request is sent."""

    def bad_item(i: int) -> int:
        raise IndexError("no such sample")

    with pytest.raises(IndexError, match="no such sample"):
        bench.run_point(echo_batch, bad_item, 2, concurrency=2, duration_s=0.05)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"concurrency": 0}, "concurrency must be an int >= 1"),
        ({"concurrency": None}, "concurrency must be an int >= 1"),
        ({"rate": 0.0}, "rate must be a finite number > 0"),
        ({"rate": float("nan")}, "rate must be a finite number > 0"),
        ({"duration_s": 0.0}, "duration_s must be a finite number > 0"),
        ({"timeout_s": float("inf")}, "timeout_s must be a finite number > 0"),
    ],
)
def test_run_point_refuses_bad_loads(kwargs: dict[str, object], match: str) -> None:
    """Loads that would hang, spin or report nonsense are refused before anything runs."""
    with pytest.raises(ValueError, match=match):
        bench.run_point(echo_batch, lambda i: i, 2, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("sizes", [[], [0], [2, -1], [True]])
def test_sweep_refuses_bad_batch_sizes(sizes: list[int]) -> None:
    """Batch sizes are ints >= 1, and there is at least one."""
    with pytest.raises(ValueError, match="batch"):
        bench.sweep(echo_batch, lambda i: i, sizes, concurrency=1, duration_s=0.05)


def test_every_closed_loop_caller_sends_at_least_one_request() -> None:
    """Even a duration shorter than one call measures something: no empty point, no util 1.00 of nothing."""
    p = bench.run_point(echo_batch, lambda i: i, 4, concurrency=3, duration_s=1e-9)
    assert p.requests >= 3
    assert 0 <= p.utilisation <= 1


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_such_module_for_bench:f", "no module named 'no_such_module_for_bench'"),
        ("batchkit.testing:no_such_name", "has no attribute 'no_such_name'"),
        (":f", "expected 'module:function'"),
        ("batchkit.testing:", "expected 'module:function'"),
    ],
)
def test_load_callable_names_what_is_wrong(spec: str, match: str) -> None:
    """A target that cannot be found is a ValueError naming the missing piece."""
    with pytest.raises(ValueError, match=match):
        bench.load_callable(spec)


def test_load_callable_keeps_a_missing_dependency_of_the_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module the target imports and lacks is the target's failure (ModuleNotFoundError), not a bad spec."""
    (tmp_path / "bk_needs_dep.py").write_text("import no_such_dependency_xyz\n\ndef f(xs):\n    return xs\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_xyz"):
        bench.load_callable("bk_needs_dep:f")


def test_a_model_idle_most_of_the_run_gets_a_note_with_the_measured_throughput() -> None:
    """echo_batch takes microseconds, so the batcher around it, not the function, limits the run:
    QPS_max (the function's time alone) is far above what was served, and the report says so."""
    report = bench.sweep(echo_batch, lambda i: i, [4], concurrency=4, duration_s=0.1)
    (p,) = report.points
    assert report.qps_max is not None
    assert p.utilisation < bench.LOW_UTILISATION  # microseconds of work per batch
    (note,) = [n for n in report.notes if "busy" in n]
    assert f"{bench._significant(p.throughput)}/s was measured" in note
    assert note in report.table()


def test_an_open_loop_run_below_capacity_is_not_told_to_plan_with_the_offered_rate() -> None:
    """With --rate, a model idle most of the run only says the offered rate was low: the note
    names the offered rate and QPS_max as the capacity (it said to plan with the measured
    throughput, which is then the offered rate, however large the capacity)."""
    report = bench.sweep(echo_batch, lambda i: i, [4], rate=200, duration_s=0.1)
    (p,) = report.points
    assert report.qps_max is not None
    assert p.utilisation < bench.LOW_UTILISATION
    (note,) = [n for n in report.notes if "busy" in n]
    assert "offered 200/s" in note
    assert "plan with" not in note


def test_b_opt_meets_the_sla_even_when_the_knee_misses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """P99 is not monotone in B: here B = 8 reaches 90% of the best throughput (the knee) but its
    P99 misses the SLA, which B = 16 and B = 32 meet. B_opt must be a size that meets the SLA:
    the smallest one above the knee, 16, not min(B_knee, B_SLA) = 8."""
    measured = {  # B: (throughput, p99 ms)
        4: (500.0, 90.0),
        8: (950.0, 45.0),
        16: (1000.0, 38.0),
        32: (1000.0, 39.0),
        64: (990.0, 80.0),
    }

    def fake_point(fn: object, make_item: object, batch_size: int, **kwargs: object) -> bench.BenchPoint:
        thr, p99 = measured[batch_size]
        return bench.BenchPoint(
            batch_size, 5.0, "closed", 64.0, int(thr), 1.0, thr, p99 / 2, p99 * 0.9, p99,
            float(batch_size), 1000 * batch_size / thr, 1.0, 64.0, 64.0,
        )  # fmt: skip

    monkeypatch.setattr(bench, "run_point", fake_point)
    report = bench.sweep(echo_batch, lambda i: i, list(measured), sla_ms=40)
    assert (report.b_knee, report.b_sla) == (8, 32)
    assert report.b_opt == 16
    at = measured[report.b_opt]
    assert at[1] <= 40
    assert any("B_knee = 8 misses the SLA" in n for n in report.notes)
    # without an SLA (every size qualifies) B_opt is the knee
    assert bench.sweep(echo_batch, lambda i: i, list(measured)).b_opt == 8


@pytest.mark.parametrize("load", [{"concurrency": 8}, {"rate": 2000.0}], ids=["closed", "open"])
def test_littles_law_holds_exactly_when_nothing_is_lost(load: dict[str, float]) -> None:
    """L (the time-averaged requests in the system) and lambda * W count each request over the
    same span, from its arrival (the scheduled time in the open loop, where a task may start
    late) to its answer: with nothing lost they agree to rounding, in both loops."""
    p = bench.run_point(echo_batch, lambda i: i, 4, duration_s=0.2, **load)  # type: ignore[arg-type]
    assert p.requests > 0
    assert p.rejected == 0
    assert p.little_l == pytest.approx(p.little_lambda_w, rel=1e-9)


HANGING_TARGET = """
import sys
import threading

never = threading.Event()


def fn(xs):
    print("target called", flush=True)
    never.wait()
    return xs
"""


def test_ctrl_c_while_the_target_hangs_exits_130(tmp_path: Path) -> None:
    """A target call that never returns does not hold Ctrl-C back: the bench exits with 130
    at once (the hung call's thread is left behind), not after --timeout."""
    (tmp_path / "bk_hanging_target.py").write_text(HANGING_TARGET)
    argv = [sys.executable, "-m", "batchkit", "bench", "bk_hanging_target:fn", "--batch-sizes", "2"]
    argv += ["--concurrency", "2", "--duration", "0.05", "--timeout", "3600"]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the target prints from inside its (hung) call
            if line.strip() == "target called":
                break
        else:
            pytest.fail(f"the target was never called: {proc.communicate(timeout=WAIT)}")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted" in err


def test_threads_limits_the_blas_and_openmp_pools_of_the_thread_that_calls_the_target() -> None:
    """sweep(threads=1) limits every BLAS and OpenMP pool the target's calling thread uses (an
    OpenMP limit holds per thread, so one set in the main thread alone would not reach it), and
    the report names the pools and the threads they ran with."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    pytest.importorskip("numpy")
    seen: list[list[dict[str, Any]]] = []

    def fn(xs: list[int]) -> list[int]:
        seen.append(threadpoolctl.threadpool_info())
        return xs

    report = bench.sweep(fn, lambda i: i, [2], concurrency=2, duration_s=0.05, threads=1)
    assert seen
    assert {(pool["user_api"], pool["num_threads"]) for call in seen for pool in call} <= {("blas", 1), ("openmp", 1)}
    assert report.thread_pools
    assert set(report.thread_pools.values()) == {1}
    assert any("(blas)" in name for name in report.thread_pools)
    line = next(line for line in report.table().splitlines() if line.startswith("threads (limited to 1): "))
    assert all(f"{name} 1" in line for name in report.thread_pools)


def test_slow_rates_print_with_significant_digits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A target serving a quarter of a request per second shows 0.250/s, not 0/s, in the req/s
    column and in QPS_max."""

    def fake_point(fn: object, make_item: object, batch_size: int, **kwargs: object) -> bench.BenchPoint:
        return bench.BenchPoint(
            batch_size, 5.0, "closed", 1.0, 2, 8.0, 0.25, 4000.0, 4000.0, 4000.0,
            1.0, 4000.0, 1.0, 1.0, 1.0,
        )  # fmt: skip

    monkeypatch.setattr(bench, "run_point", fake_point)
    report = bench.sweep(echo_batch, lambda i: i, [1])
    table = report.table()
    assert report.qps_max == pytest.approx(0.25)
    assert table.splitlines()[1].split()[:2] == ["1", "0.250"]
    assert "= 0.250/s" in table
    assert "0/s" not in table.replace("0.250/s", "")


def test_no_progress_bar_when_stderr_is_not_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    """`batchkit bench` draws its progress bar only on a terminal (as `batchkit run` does), so a
    file or a pipe gets the report alone; --progress draws it anyway."""
    args = ["bench", "batchkit.testing:echo_batch", "--batch-sizes", "1", "--duration", "0.05", "--concurrency", "2"]
    assert main(args) == 0
    assert "bench" not in capsys.readouterr().err
    assert main([*args, "--progress"]) == 0
    assert "bench" in capsys.readouterr().err


# --------------------------------------------------------------------------- docs/api.md: sweep's inputs


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"sla_ms": 0}, "sla_ms"),
        ({"sla_ms": math.nan}, "sla_ms"),
        ({"price_per_hour": -1.0}, "price_per_hour"),
        ({"price_per_hour": math.inf}, "price_per_hour"),
        ({"tokens_per_item": 0}, "tokens_per_item"),
    ],
)
def test_sweep_refuses_an_sla_price_or_token_count_that_means_nothing(kwargs: dict[str, Any], name: str) -> None:
    """sweep's sla_ms (a P99 bound), price_per_hour and tokens_per_item (the cost per token's
    inputs) are checked before any batch size runs: an SLA of 0 left no B_opt, a negative price
    gave a negative cost per token."""
    from batchkit import bench
    from batchkit.testing import echo_batch

    calls: list[int] = []

    def make_item(i: int) -> int:
        calls.append(i)
        return i

    with pytest.raises(ValueError, match=name):
        bench.sweep(echo_batch, make_item, [1, 2], concurrency=2, duration_s=0.05, **kwargs)
    assert calls == []
    report = bench.sweep(echo_batch, make_item, [2], concurrency=2, duration_s=0.05, price_per_hour=0.0)
    assert report.cost_per_token == 0.0


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
