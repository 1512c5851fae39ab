"""The discrete-event simulator: the worked example, determinism, Little's law, the adaptive
scenario (low -> high -> low traffic), and agreement with a real run."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import pytest

import batchkit
from batchkit import AdaptiveBatchController, bench, sim
from batchkit.testing import MockClock, echo_batch

COST = sim.linear_cost(fixed_ms=15, per_item_ms=5)  # t(1) = 20 ms, t(8) = 55 ms
WAIT = 30  # seconds: the bound on every wait in this file


def test_worked_example_50_vs_145_per_second() -> None:
    """A step of 20 ms at B=1 and 55 ms at B=8 serves 50 vs about 145 per second at saturation."""
    one = sim.simulate(COST, sim.poisson(1000, 20, seed=1), max_batch_size=1, max_wait_ms=10)
    eight = sim.simulate(COST, sim.poisson(1000, 20, seed=1), max_batch_size=8, max_wait_ms=10)
    assert one.throughput == pytest.approx(50, rel=0.01)
    assert eight.throughput == pytest.approx(8 / 0.055, rel=0.01)
    assert eight.mean_batch_size == pytest.approx(8, rel=0.01)
    assert eight.utilisation == pytest.approx(1.0, abs=0.01)


def test_deterministic_under_a_seed_and_consistent_with_littles_law() -> None:
    """Same seed, same result; L = lambda * W holds on the simulated system."""
    a = sim.simulate(COST, sim.poisson(100, 200, seed=7), max_batch_size=8, max_wait_ms=10)
    b = sim.simulate(COST, sim.poisson(100, 200, seed=7), max_batch_size=8, max_wait_ms=10)
    assert a == b
    assert a.littles_law_ratio == pytest.approx(1.0, rel=0.02)
    assert a.latency.p99_ms < 10 + 2 * 55 + 1  # max_wait plus two batch times


def test_cost_table_trace_and_bursty_arrivals(tmp_path: Path) -> None:
    """A measured cost table interpolates; arrivals can come from a trace file or bursts."""
    cost = sim.table_cost({1: 0.020, 8: 0.055})
    assert cost(4) == pytest.approx(0.035)
    assert cost(16) == pytest.approx(0.055 + 8 * 0.005)
    path = tmp_path / "trace.txt"
    path.write_text("0.0\n0.001\n0.002\n1.0\n")
    r = sim.simulate(cost, sim.trace(path), max_batch_size=8, max_wait_ms=5)
    assert (r.arrivals, r.completed, r.batches) == (4, 4, 2)
    arrivals = list(sim.bursty(base_rate=10, burst_rate=1000, period_s=1, burst_s=0.1, duration_s=3, seed=0))
    in_bursts = sum(1 for t in arrivals if t % 1 < 0.1)
    assert in_bursts > 0.8 * len(arrivals)
    with pytest.raises(ValueError, match="empty"):
        sim.table_cost({})


def test_queue_bound_and_deadlines_are_simulated() -> None:
    """Admission and expiry run through the real queue core."""
    r = sim.simulate(COST, sim.poisson(500, 5, seed=2), max_batch_size=1, max_queue=10, deadline_ms=100)
    assert r.rejected > 0
    assert r.expired > 0
    assert r.completed + r.rejected + r.expired == r.arrivals


# --------------------------------------------------------------------------- the adaptive scenario

MLP_COST = sim.linear_cost(fixed_ms=1.8, per_item_ms=0.24)  # the CPU MLP of benchmarks/model.py
PHASES = [(4.0, 400.0), (4.0, 2500.0), (4.0, 400.0)]  # low -> high (near saturation) -> low
WINDOWS = [(0.0, 4.0), (4.0, 8.0), (8.0, 12.0)]
SLO_MS = 50.0


def run_fixed(b: int) -> sim.SimResult:
    return sim.simulate(MLP_COST, sim.steps(PHASES, seed=3), max_batch_size=b, max_wait_ms=40, phases=WINDOWS)


def run_adaptive() -> sim.SimResult:
    ctl = AdaptiveBatchController(target_queue=1, min_batch=1, max_batch=128, latency_slo_ms=SLO_MS)
    return sim.simulate(
        MLP_COST, sim.steps(PHASES, seed=3), max_batch_size=1, max_wait_ms=40, controller=ctl, phases=WINDOWS
    )


def test_adaptive_controller_meets_the_slo_in_every_phase_at_full_throughput() -> None:
    """The acceptance scenario on virtual time: the controller keeps P99 under the SLO in every
    phase with high-phase throughput >= 90% of the best fixed setting that meets the SLO; the
    smallest fixed setting loses throughput and the largest breaks the SLO."""
    adaptive = run_adaptive()
    for p in adaptive.phases:
        assert p.latency.p99_ms < SLO_MS, p
    fixed = {b: run_fixed(b) for b in (1, 4, 8, 16, 32, 64, 128)}
    meeting = [r for r in fixed.values() if all(p.latency.p99_ms < SLO_MS for p in r.phases)]
    assert meeting, "some fixed setting should meet the SLO, or the scenario proves nothing"
    best_high = max(r.phases[1].throughput for r in meeting)
    assert adaptive.phases[1].throughput >= 0.9 * best_high
    assert fixed[1].phases[1].throughput < 0.5 * adaptive.phases[1].throughput  # too small: falls behind
    assert fixed[128].phases[1].latency.p99_ms > SLO_MS  # too large: breaks the SLO
    sizes = [b for t, b in adaptive.batch_sizes if 5.0 < t < 8.0]
    assert max(sizes) > 4, "the batch grew under load"
    assert [b for t, b in adaptive.batch_sizes if t > 11.0][-1] <= 4, "and shrank again after"


# --------------------------------------------------------------------------- simulation vs reality


@pytest.mark.slow
def test_simulation_agrees_with_a_real_run_within_ten_percent() -> None:
    """A real batcher (its dispatcher, worker and 16 caller threads) serving a model whose batch
    costs t(B) = 15 + 5B ms matches the simulator's throughput and batch size within 10%, under the
    same closed-loop load.

    Time is the batcher's MockClock, moved by the model by t(B), as an accelerator's batch would
    take it: how busy the machine is changes nothing. The model returns once every caller it
    does not serve has either queued its next item or left, as happens while a real batch runs
    (each caller answered by the previous batch submits again at once).
    """
    clock = MockClock()
    callers = 16
    stop = 1.5
    cond = threading.Condition()
    left = 0
    done: list[float] = []
    b: batchkit.DynamicBatcher[int, int]

    def model(xs: list[int]) -> list[int]:
        with cond:
            assert cond.wait_for(lambda: b.queue_depth() + left + len(xs) == callers, timeout=WAIT)
        clock.advance(COST(len(xs)))
        return xs

    b = batchkit.DynamicBatcher(model, max_batch_size=8, max_wait_ms=5, clock=clock)

    def caller() -> None:
        nonlocal left
        while True:
            with cond:
                if clock.now() >= stop:
                    left += 1
                    cond.notify_all()
                    return
                fut = b.submit(1)
                cond.notify_all()
            fut.result(WAIT)
            with cond:
                done.append(clock.now())

    threads = [threading.Thread(target=caller) for _ in range(callers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert not any(t.is_alive() for t in threads)
    real_throughput = len(done) / max(done)
    real_batch = b.statistics().mean_batch_size
    b.close(timeout=WAIT)
    simulated = sim.simulate(COST, sim.ClosedLoop(concurrency=16, duration_s=30), max_batch_size=8, max_wait_ms=5)
    assert real_throughput == pytest.approx(simulated.throughput, rel=0.10)
    assert real_batch == pytest.approx(simulated.mean_batch_size, rel=0.10)


@pytest.mark.parametrize("max_batch_size", [1, 32], ids=["batches-by-size", "batches-by-timeout"])
def test_a_circuit_breaker_opens_in_an_outage_and_recovers_after_it(max_batch_size: int) -> None:
    """An outage (every batch that starts before 1 s fails) opens the breaker, whose probes fail
    until the outage ends; the first probe after it closes the circuit, and from then on every
    arrival is served, whether batches go by size or wait ``max_wait_ms`` for company."""
    breaker = batchkit.CircuitBreaker(failure_threshold=5, reset_timeout_s=0.25)
    arrivals = [i / 100 for i in range(300)]  # every 10 ms for 3 s
    r = sim.simulate(
        sim.linear_cost(fixed_ms=1, per_item_ms=0),
        arrivals,
        max_batch_size=max_batch_size,
        max_wait_ms=5,
        circuit_breaker=breaker,
        fails=lambda t: t < 1.0,
        phases=[(1.5, 3.0)],
    )
    assert breaker.opens >= 2  # opened by the outage, and again by a probe that failed in it
    assert r.failed >= 5
    assert r.rejected > 0
    assert r.completed + r.failed + r.rejected == r.arrivals == 300
    after = r.phases[0]
    assert after.completed == after.arrivals == 150
    assert breaker.state_at(r.duration) == "closed"
    assert {size for _, size in r.batch_sizes} == {1}  # each arrival alone: by size, or after max_wait_ms


def test_the_simulation_tells_a_controller_its_time_and_leaves_its_clock_alone() -> None:
    """A controller driven by the simulation decides on virtual time (its decisions are stamped
    with simulated seconds) and keeps the clock it was given."""
    clock = MockClock()
    clock.advance(1e6)
    ctl = AdaptiveBatchController(target_queue=1, eta=4, max_batch=64, initial=1, clock=clock)
    r = sim.simulate(COST, sim.poisson(500, 5, seed=2), max_batch_size=1, controller=ctl)
    assert ctl.clock is clock
    assert clock.now() == 1e6
    assert ctl.decisions
    assert all(0 <= d.time <= r.duration for d in ctl.decisions)
    assert ctl.batch_size > 1


# docs/api.md promises of the arrival processes: times lie within the duration asked for, and
# arguments that describe no process are refused instead of hanging or stretching time.


@pytest.mark.parametrize(("period_s", "burst_s"), [(0.0, 0.0), (-1.0, 0.1), (1.0, 2.0), (1.0, -0.1)])
def test_bursty_refuses_a_period_that_cannot_hold_its_burst(period_s: float, burst_s: float) -> None:
    """period_s=0 used to loop for ever; a burst longer than its period put arrivals past duration_s."""
    with pytest.raises(ValueError, match="period_s"):
        sim.bursty(10, 100, period_s, burst_s, duration_s=5)


def test_bursty_arrivals_lie_within_the_duration() -> None:
    times = list(sim.bursty(10, 100, period_s=1.0, burst_s=1.0, duration_s=3, seed=0))
    assert times
    assert max(times) < 3
    assert times == sorted(times)


def test_poisson_refuses_a_negative_rate_and_gives_nothing_at_rate_zero() -> None:
    with pytest.raises(ValueError, match="rate"):
        list(sim.poisson(-1, 10))
    with pytest.raises(ValueError, match="duration_s"):
        list(sim.poisson(10, -1))
    assert list(sim.poisson(0, 10)) == []


@pytest.mark.parametrize(("concurrency", "duration_s"), [(0, 1.0), (-2, 1.0), (1.5, 1.0), (4, 0.0)])
def test_closed_loop_refuses_no_callers_or_no_time(concurrency: int, duration_s: float) -> None:
    with pytest.raises(ValueError, match=r"concurrency|duration_s"):
        sim.ClosedLoop(concurrency, duration_s)


def _bound_ms(batch: int, max_wait_ms: float) -> float:
    return max_wait_ms + 2 * COST(batch) * 1e3


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("load", [0.3, 0.9, 0.99])
def test_evenly_spaced_arrivals_below_capacity_wait_within_the_bound(batch: int, load: float) -> None:
    """docs/tuning.md: the worst wait is max_wait_ms + 2 * t_batch(B) while no more than B
    requests arrive per batch time; evenly spaced arrivals below capacity never exceed it."""
    rate = load * batch / COST(batch)
    times = [i / rate for i in range(int(rate * 20))]
    r = sim.simulate(COST, sim.trace(times), max_batch_size=batch, max_wait_ms=10)
    assert r.completed == len(times)
    assert r.latency.max_ms <= _bound_ms(batch, 10)


@pytest.mark.parametrize(("batch", "load"), [(2, 0.5), (4, 0.7)])
def test_poisson_arrivals_pass_the_bound_well_below_capacity(batch: int, load: float) -> None:
    """docs/tuning.md: random arrivals bunch up, so the P99 passes the bound from about half of
    capacity at B = 2 and about 70% at B = 4 (deterministic under the seed)."""
    rate = load * batch / COST(batch)
    r = sim.simulate(COST, sim.poisson(rate, 60, seed=0), max_batch_size=batch, max_wait_ms=10)
    assert r.latency.p99_ms > _bound_ms(batch, 10)


@pytest.mark.parametrize("bad", [-0.001, float("nan"), float("inf"), "fast", None])
def test_a_cost_that_is_not_a_time_is_refused_naming_the_batch_size(bad: object) -> None:
    """t_batch(B) is a duration: a negative one gave negative latencies (-995 ms), a NaN one a
    run that looked fine. Both are a ValueError naming B and the value."""
    with pytest.raises(ValueError, match=r"cost\(1\) returned"):
        sim.simulate(lambda b: bad, sim.poisson(10, 1), max_batch_size=1)  # type: ignore[arg-type, return-value]


def test_a_cost_returning_a_numpy_number_is_a_time() -> None:
    np = pytest.importorskip("numpy")
    r = sim.simulate(lambda b: np.float32(0.01), sim.poisson(10, 1, seed=1), max_batch_size=1)
    assert r.completed == r.arrivals


@pytest.mark.parametrize("table", [{0: 0.01}, {-2: 0.01, 4: 0.02}, {1: -0.01}, {1: float("nan")}])
def test_table_cost_refuses_sizes_below_one_and_times_that_are_not_finite(table: dict[int, float]) -> None:
    """{0: t} used to fail later with ZeroDivisionError on the first call."""
    with pytest.raises(ValueError, match="cost table"):
        sim.table_cost(table)


# --------------------------------------------------------------------------- docs/api.md: the simulator's inputs


@pytest.mark.parametrize("deadline_ms", [0, -5.0, math.nan, math.inf])
def test_simulate_refuses_a_deadline_that_is_not_a_time(deadline_ms: float) -> None:
    """deadline_ms is each request's deadline: 0, negative or NaN would silently expire every
    request (or none); it is refused naming deadline_ms."""
    with pytest.raises(ValueError, match="deadline_ms"):
        sim.simulate(sim.linear_cost(1, 0.1), [0.0, 0.1], deadline_ms=deadline_ms)


def test_simulate_refuses_a_phase_that_ends_before_it_starts() -> None:
    with pytest.raises(ValueError, match="phase"):
        sim.simulate(sim.linear_cost(1, 0.1), [0.0, 0.1], phases=[(0.0, 1.0), (2.0, 1.0)])


@pytest.mark.parametrize(("arrivals", "index"), [([1.0, 0.5, 0.7], "arrival 1"), ([0.0, math.nan], "arrival 1")])
def test_simulate_refuses_arrival_times_out_of_order(arrivals: list[float], index: str) -> None:
    """Arrival times are read in order: one earlier than its predecessor (or NaN) would move the
    virtual clock backwards and give negative latencies; it is a ValueError naming the arrival.
    trace() sorts a file's times for you."""
    with pytest.raises(ValueError, match=index):
        sim.simulate(sim.linear_cost(1, 0.1), arrivals)
    if not any(math.isnan(a) for a in arrivals):
        assert sim.simulate(sim.linear_cost(1, 0.1), sim.trace(arrivals)).completed == len(arrivals)


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
