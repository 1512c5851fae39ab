"""The server's life (batchkit.serve.lifecycle): one table, one writer, and the requests a shutdown
waits for."""

from __future__ import annotations

import anyio
import pytest

from batchkit.serve.lifecycle import TRANSITIONS, InFlight, Lifecycle, ServerState, Transition


class _Gauge:
    def __init__(self) -> None:
        self.value: float = -1

    def set(self, value: float) -> None:
        self.value = value


def test_a_server_starts_loading_and_the_ready_gauge_reads_1_only_while_ready() -> None:
    """LOADING -> READY -> STOPPING, the gauge following each move."""
    gauge = _Gauge()
    life = Lifecycle(gauge)
    assert (life.state, life.ready, life.accepting) == (ServerState.LOADING, False, True)
    assert life.move(Transition.LOADED) is ServerState.READY
    assert (gauge.value, life.ready, life.accepting) == (1, True, True)
    assert life.move(Transition.STOP) is ServerState.STOPPING
    assert (gauge.value, life.ready, life.accepting) == (0, False, False)


def test_a_load_that_ends_after_the_shutdown_began_leaves_the_server_stopping() -> None:
    """A model that finishes loading during the shutdown is not served."""
    life = Lifecycle(_Gauge())
    life.move(Transition.STOP)
    assert life.move(Transition.LOADED) is ServerState.STOPPING


def test_a_failure_is_kept_through_the_shutdown() -> None:
    """FAILED stays FAILED when the server stops, with the error that failed it."""
    life = Lifecycle(_Gauge())
    error = OSError("no such model")
    life.fail(error)
    life.move(Transition.STOP)
    assert (life.state, life.load_error, life.accepting) == (ServerState.FAILED, error, False)


def test_a_move_the_table_does_not_list_is_a_bug() -> None:
    """READY has no LOADED transition: the writer raises instead of guessing."""
    life = Lifecycle(_Gauge())
    life.move(Transition.LOADED)
    with pytest.raises(RuntimeError, match="no 'loaded' transition from 'ready'"):
        life.move(Transition.LOADED)


def test_every_state_is_in_the_table_and_stop_is_always_allowed() -> None:
    """A shutdown may begin whatever the state."""
    assert set(TRANSITIONS) == set(ServerState)
    assert all(Transition.STOP in moves for moves in TRANSITIONS.values())


def test_drain_returns_at_once_without_requests_and_after_end_grace() -> None:
    """No request in flight, or the grace cut short: the shutdown does not wait."""
    gauge = _Gauge()
    in_flight = InFlight(gauge)

    async def main() -> None:
        with anyio.fail_after(5):
            await in_flight.drain(3600)
            in_flight.enter()
            assert gauge.value == 1
            in_flight.end_grace()
            await in_flight.drain(3600)
            in_flight.leave()
            assert gauge.value == 0

    anyio.run(main)
