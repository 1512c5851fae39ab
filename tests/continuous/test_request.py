"""Request: the state machine of a request's life, one read-only table (``TRANSITIONS``)."""

from __future__ import annotations

import pytest

from batchkit.continuous.request import HOLDS_BLOCKS, TRANSITIONS, RequestStatus, Transition

LIVE = (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED)
FINAL = (RequestStatus.FINISHED, RequestStatus.ABORTED)


class TestTransitionTable:
    def test_every_status_has_a_row(self) -> None:
        """The table names every status, the final ones too (with no way out)."""
        assert set(TRANSITIONS) == set(RequestStatus)

    def test_finished_and_aborted_are_final(self) -> None:
        """No transition leaves FINISHED or ABORTED."""
        assert all(not TRANSITIONS[status] for status in FINAL)

    def test_every_live_status_can_fail_and_be_aborted(self) -> None:
        """A deadline, an error or an abort can end a request wherever it is."""
        for status in LIVE:
            assert TRANSITIONS[status][Transition.FAIL] is RequestStatus.FINISHED
            assert TRANSITIONS[status][Transition.ABORT] is RequestStatus.ABORTED

    def test_each_move_between_live_statuses_has_one_source(self) -> None:
        """Admission starts only a waiting request, a swap in only a swapped one, a swap out and
        a finish only a running one; both running and swapped requests can be recomputed."""
        sources: dict[Transition, set[RequestStatus]] = {}
        for status, row in TRANSITIONS.items():
            for transition in row:
                sources.setdefault(transition, set()).add(status)
        assert sources[Transition.ADMIT] == {RequestStatus.WAITING}
        assert sources[Transition.SWAP_IN] == {RequestStatus.SWAPPED}
        assert sources[Transition.SWAP_OUT] == {RequestStatus.RUNNING}
        assert sources[Transition.FINISH] == {RequestStatus.RUNNING}
        assert sources[Transition.RECOMPUTE] == {RequestStatus.RUNNING, RequestStatus.SWAPPED}

    def test_running_and_swapped_requests_hold_blocks(self) -> None:
        """Blocks are held on the device while running and in the CPU pool while swapped."""
        assert frozenset({RequestStatus.RUNNING, RequestStatus.SWAPPED}) == HOLDS_BLOCKS

    def test_the_table_is_read_only(self) -> None:
        """Neither the table nor a row of it can be changed."""
        with pytest.raises(TypeError):
            TRANSITIONS[RequestStatus.WAITING] = {}  # type: ignore[index]
        with pytest.raises(TypeError):
            TRANSITIONS[RequestStatus.FINISHED][Transition.ADMIT] = RequestStatus.RUNNING  # type: ignore[index]
