"""docs/api.md promises of batchkit.sim's arrival processes: times lie within the duration asked
for, and arguments that describe no process are refused instead of hanging or stretching time."""

from __future__ import annotations

import pytest

from batchkit import sim


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


COST = sim.linear_cost(fixed_ms=15, per_item_ms=5)


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
