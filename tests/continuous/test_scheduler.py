"""Scheduler: the request state machine, each phase of ``schedule()`` on exact told times, and
the invariants of any sequence of adds, steps, aborts and limit changes (hypothesis).

The phases are driven one at a time on a ``StepPlan``, as ``schedule()`` drives them in turn;
the scheduler's clock fails any test that reads it while the time is told.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable
from typing import Any, Literal, cast

import pytest
from hypothesis import settings, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import batchkit
from batchkit import DeadlineExceeded, KVCacheExhausted, PagedKVAllocator, SamplingParams
from batchkit.continuous.request import Request, RequestStatus, ScheduledStep, StepPlan, Transition
from batchkit.continuous.scheduler import Scheduler
from batchkit.testing import MockClock

BS = 4  # tokens per block
FINAL = (RequestStatus.FINISHED, RequestStatus.ABORTED)


class UnreadClock:
    """A clock that fails the test when read: a scheduler told the time never reads its own."""

    def now(self) -> float:
        raise AssertionError("the scheduler read its clock although it was told the time")


def scheduler(
    num_blocks: int = 9, *, cpu: int = 0, quotas: dict[Hashable, int | float] | None = None, **kw: Any
) -> Scheduler:
    alloc = PagedKVAllocator(num_blocks, BS, num_cpu_blocks=cpu, tenant_quotas=quotas)
    return Scheduler(alloc, clock=kw.pop("clock", UnreadClock()), **kw)


def request(
    rid: Hashable, prompt_len: int = 3, *, max_new: int = 16, priority: int = 0, tenant: Hashable = None, **kw: Any
) -> Request:
    prompt = [1 + i % 9 for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_new_tokens=max_new), priority=priority, tenant=tenant, **kw)


def step(s: Scheduler, now: float) -> ScheduledStep:
    """One whole step at ``now``: schedule, then every sampling request draws token 5."""
    scheduled = s.schedule(now)
    s.update(scheduled, [5] * sum(scheduled.samples), now=now)
    return scheduled


def statuses(s: Scheduler, *rids: Hashable) -> dict[Hashable, RequestStatus]:
    out: dict[Hashable, RequestStatus] = {}
    for rid in rids:
        req = s.get(rid)
        assert req is not None, f"{rid!r} is not live"
        out[rid] = req.status
    return out


def with_b_swapped_out() -> Scheduler:
    """A scheduler preempting by swap, with two seats: "a" running and "b" swapped out (by the
    limit lowered to one for a step, then given back)."""
    s = scheduler(cpu=8, preemption_mode="swap", max_num_seqs=2)
    s.add(request("a"), 0.0)
    s.add(request("b"), 0.0)
    step(s, 0.0)
    s.max_num_seqs = 1
    step(s, 0.0)
    s.max_num_seqs = 2
    assert statuses(s, "a", "b") == {"a": RequestStatus.RUNNING, "b": RequestStatus.SWAPPED}
    return s


# --------------------------------------------------------------------------- the transition table


class TestTransitionTable:
    def test_a_move_the_table_lacks_is_refused_and_changes_nothing(self) -> None:
        """Swapping in a waiting request is a bug: RuntimeError, and the request stays put."""
        s = scheduler()
        r = request("r")
        s.add(r, 0.0)
        with pytest.raises(RuntimeError, match="no 'swap_in' transition from 'waiting'"):
            s.queues.move(r, Transition.SWAP_IN)
        assert r.status is RequestStatus.WAITING
        assert s.waiting == [r]

    def test_a_move_to_a_final_status_frees_the_blocks_and_forgets_the_request(self) -> None:
        """Aborting a running request returns its blocks, takes it off every list and counts it."""
        s = scheduler()
        s.add(request("r"), 0.0)
        step(s, 0.0)
        assert s.abort("r")
        assert s.get("r") is None
        assert (s.waiting, s.running, s.swapped) == ([], [], [])
        assert s.allocator.statistics().used_blocks == 0
        assert s.statistics().aborted == 1


# --------------------------------------------------------------------------- told the time


class TestToldTheTime:
    def test_add_takes_the_arrival_it_is_told(self) -> None:
        """``add(request, now)`` sets the arrival to ``now`` (the clock is not read)."""
        s = scheduler()
        r = request("r", arrival=99.0)
        s.add(r, 2.5)
        assert r.arrival == 2.5

    def test_queue_wait_runs_from_the_told_arrival_to_the_told_admission(self) -> None:
        """Added at 1.0 and scheduled at 3.5: 2.5 s in the queue, and first scheduled at 3.5."""
        s = scheduler()
        r = request("r")
        s.add(r, 1.0)
        s.schedule(3.5)
        assert r.t_first_scheduled == 3.5
        assert s.statistics().queue_wait.mean_ms == pytest.approx(2500.0)

    def test_ttft_and_tpot_come_from_the_times_update_is_told(self) -> None:
        """Arrived at 0, first token recorded at 2.0 (TTFT 2 s), the next at 2.25 (TPOT 0.25 s)."""
        s = scheduler()
        s.add(request("r"), 0.0)
        first = s.schedule(1.0)
        s.update(first, [5], now=2.0)
        second = s.schedule(2.0)
        s.update(second, [5], now=2.25)
        stats = s.statistics()
        assert stats.ttft.mean_ms == pytest.approx(2000.0)
        assert stats.tpot.mean_ms == pytest.approx(250.0)

    def test_a_deadline_holds_until_the_told_time_reaches_it(self) -> None:
        """A request with deadline 2.0 runs at 1.999 and is dropped at exactly 2.0, its blocks freed."""
        s = scheduler()
        s.add(request("r", deadline=2.0), 0.0)
        assert step(s, 1.999).requests
        assert not s.take_events()
        assert not s.schedule(2.0).requests
        [event] = s.take_events()
        assert isinstance(event.error, DeadlineExceeded)
        assert s.statistics().expired == 1
        assert len(s.allocator) == 0

    def test_untold_the_scheduler_reads_its_clock(self) -> None:
        """Without ``now``, ``add``, ``schedule`` and ``update`` read the clock it was given."""
        clock = MockClock(10.0)
        s = scheduler(clock=clock)
        r = request("r")
        s.add(r)
        clock.advance(1.0)
        scheduled = s.schedule()
        clock.advance(0.5)
        s.update(scheduled, [5])
        stats = s.statistics()
        assert (r.arrival, r.t_first_scheduled) == (10.0, 11.0)
        assert stats.queue_wait.mean_ms == pytest.approx(1000.0)
        assert stats.ttft.mean_ms == pytest.approx(1500.0)


# --------------------------------------------------------------------------- phase: preempt


class TestPreemptOverLimit:
    def test_the_latest_running_request_over_a_lowered_limit_waits_again(self) -> None:
        """Three running, the limit lowered to two: the most recent arrival is recomputed."""
        s = scheduler(max_num_seqs=3)
        for rid in "abc":
            s.add(request(rid), 0.0)
        step(s, 0.0)
        s.max_num_seqs = 2
        plan = StepPlan(100)
        s.preemption.over_limit(plan, s.max_num_seqs)
        assert statuses(s, "a", "b", "c") == {
            "a": RequestStatus.RUNNING,
            "b": RequestStatus.RUNNING,
            "c": RequestStatus.WAITING,
        }
        assert s.waiting[0].num_computed == 0
        assert "c" not in s.allocator
        assert plan.preempted

    def test_the_victim_is_the_worst_priority_before_the_latest_arrival(self) -> None:
        """Of priority 1 (first to arrive) and priority 0 ones, the priority-1 request goes."""
        s = scheduler(max_num_seqs=3)
        s.add(request("worse", priority=1), 0.0)
        s.add(request("b"), 0.0)
        s.add(request("c"), 0.0)
        step(s, 0.0)
        s.max_num_seqs = 2
        s.preemption.over_limit(StepPlan(100), s.max_num_seqs)
        assert [r.request_id for r in s.waiting] == ["worse"]

    def test_in_swap_mode_the_victim_is_swapped_out(self) -> None:
        """With ``preemption_mode="swap"`` the victim's blocks go to the CPU pool, as block moves
        of the plan."""
        s = scheduler(cpu=8, preemption_mode="swap", max_num_seqs=2)
        s.add(request("a"), 0.0)
        s.add(request("b"), 0.0)
        step(s, 0.0)
        s.max_num_seqs = 1
        plan = StepPlan(100)
        s.preemption.over_limit(plan, s.max_num_seqs)
        assert statuses(s, "b")["b"] is RequestStatus.SWAPPED
        assert s.allocator.is_swapped("b")
        assert len(plan.swap_out) == 1
        assert [r.request_id for r in plan.swapped_here] == ["b"]

    def test_under_the_limit_nothing_is_preempted(self) -> None:
        """Running requests within ``max_num_seqs`` stay."""
        s = scheduler(max_num_seqs=2)
        s.add(request("a"), 0.0)
        step(s, 0.0)
        plan = StepPlan(100)
        s.preemption.over_limit(plan, s.max_num_seqs)
        assert [r.request_id for r in s.running] == ["a"]
        assert not plan.preempted


class TestPreemptForWaiting:
    def test_a_better_waiting_request_takes_the_seat_of_a_worse_running_one(self) -> None:
        """At ``max_num_seqs``, a priority-0 arrival pushes out the priority-1 request; the step
        may still admit (``preempted`` stays False)."""
        s = scheduler(max_num_seqs=1)
        s.add(request("low", priority=1), 0.0)
        step(s, 0.0)
        s.add(request("high", priority=0), 1.0)
        plan = StepPlan(100)
        s.preemption.for_waiting(plan, s.max_num_seqs)
        assert statuses(s, "low", "high") == {"low": RequestStatus.WAITING, "high": RequestStatus.WAITING}
        assert s.running == []
        assert not plan.preempted

    def test_equal_priorities_never_preempt_each_other(self) -> None:
        """A waiting request of the running one's priority waits for its seat."""
        s = scheduler(max_num_seqs=1)
        s.add(request("first"), 0.0)
        step(s, 0.0)
        s.add(request("second"), 1.0)
        s.preemption.for_waiting(StepPlan(100), s.max_num_seqs)
        assert statuses(s, "first")["first"] is RequestStatus.RUNNING

    def test_its_victims_are_recomputed_even_in_swap_mode(self) -> None:
        """A request pushed out for a better one is not swapped (it would hold up admission)."""
        s = scheduler(cpu=8, preemption_mode="swap", max_num_seqs=1)
        s.add(request("low", priority=1), 0.0)
        step(s, 0.0)
        s.add(request("high", priority=0), 1.0)
        plan = StepPlan(100)
        s.preemption.for_waiting(plan, s.max_num_seqs)
        assert statuses(s, "low")["low"] is RequestStatus.WAITING
        assert plan.swap_out == []

    def test_better_arrivals_take_their_seats_from_each_worse_request_in_turn(self) -> None:
        """Two priority-1 requests arrive together; a priority-0 one pushes out the earlier ("a"),
        ends, and "a" comes back; the next priority-0 arrival pushes out "b", preempted fewer
        times, not "a" again (which a stream of them would starve)."""
        s = scheduler(num_blocks=16, max_num_seqs=2)
        s.add(request("a", priority=1), 0.0)
        s.add(request("b", priority=1), 0.0)
        step(s, 0.0)
        s.add(request("high-1", max_new=1), 1.0)
        step(s, 1.0)  # high-1 in for a; it samples its one token and ends
        assert statuses(s, "a", "b") == {"a": RequestStatus.WAITING, "b": RequestStatus.RUNNING}
        step(s, 2.0)  # a back in the seat high-1 left
        assert statuses(s, "a")["a"] is RequestStatus.RUNNING
        s.add(request("high-2", max_new=1), 3.0)
        step(s, 3.0)
        assert statuses(s, "a", "b") == {"a": RequestStatus.RUNNING, "b": RequestStatus.WAITING}
        assert [s.get(r).num_preemptions for r in "ab"] == [1, 1]  # type: ignore[union-attr]

    @pytest.mark.parametrize(("first", "gap"), [(18, 9), (64, 16), (79, 14), (50, 12)])
    def test_a_stream_of_better_arrivals_costs_the_worse_ones_only_its_seats(self, first: int, gap: int) -> None:
        """The gateway case: 24 priority-1 requests of 96 tokens, 8 seats; from step ``first``
        on, 8 priority-0 requests of 16 tokens arrive ``gap`` steps apart. Every step runs 8
        requests, and the run takes exactly the 304 steps its tokens need (24 x 96 + 8 x 16 over
        8 seats). Pushing out the most recent arrival each time, while victims came back in
        arrival order, left one request behind every other's return, to end alone (18/9: 367
        steps, 72 of them with fewer than 8 running); letting each arrival take the seat the one
        before it freed, while its victim waited, made them all delay the same place in the
        queue (64/16: 384 steps, 96 thin; 79/14: 385; 50/12: 342)."""
        s = scheduler(num_blocks=400, max_num_seqs=8)
        for i in range(24):
            s.add(request(f"bulk-{i}", priority=1, max_new=96), 0.0)
        steps = thin = chats = 0
        while s.has_work() or chats < 8:
            if chats < 8 and steps == first + gap * chats:
                s.add(request(f"chat-{chats}", max_new=16), float(steps))
                chats += 1
            scheduled = step(s, float(steps))
            steps += 1
            thin += len(scheduled.requests) < 8
        assert (steps, thin) == (304, 0)

    def test_with_a_seat_free_a_better_arrival_still_pushes_out_a_worse_one_for_the_queue(self) -> None:
        """A seat frees as a priority-0 request arrives, with a priority-1 one waiting: the
        arrival pushes out the running priority-1 request (never preempted) and the waiting one
        takes the free seat. The arrival's tokens then delay the request it pushed out, not the
        queue behind it."""
        s = scheduler(num_blocks=16, max_num_seqs=2)
        s.add(request("short", priority=1, max_new=1), 0.0)
        s.add(request("long", priority=1, max_new=20), 0.0)
        s.add(request("queued", priority=1), 0.0)
        step(s, 0.0)  # "short" samples its one token and ends
        s.add(request("chat"), 1.0)
        step(s, 1.0)
        assert statuses(s, "long", "queued", "chat") == {
            "long": RequestStatus.WAITING,
            "queued": RequestStatus.RUNNING,
            "chat": RequestStatus.RUNNING,
        }

    def test_with_a_seat_free_and_no_one_worse_waiting_a_better_arrival_pushes_out_no_one(self) -> None:
        """Nothing waits for the free seat: the arrival takes it and the worse request runs on."""
        s = scheduler(num_blocks=16, max_num_seqs=2)
        s.add(request("bulk", priority=1), 0.0)
        step(s, 0.0)
        s.add(request("chat"), 1.0)
        step(s, 1.0)
        assert statuses(s, "bulk", "chat") == {"bulk": RequestStatus.RUNNING, "chat": RequestStatus.RUNNING}
        assert s.statistics().preemptions == 0

    def test_a_pushed_out_request_takes_a_seat_no_one_else_waits_for(self) -> None:
        """The request pushed out waits while the better one runs, but not for nothing: when a
        seat frees and no one else waits, it comes back at once."""
        s = scheduler(num_blocks=16, max_num_seqs=2)
        s.add(request("a", priority=1), 0.0)
        s.add(request("b", priority=1, max_new=2), 0.0)
        step(s, 0.0)
        s.add(request("chat"), 1.0)
        step(s, 1.0)  # the chat pushes out "a"; "b" samples its second token and ends
        assert statuses(s, "a", "chat") == {"a": RequestStatus.WAITING, "chat": RequestStatus.RUNNING}
        assert s.get("b") is None
        step(s, 2.0)
        assert statuses(s, "a", "chat") == {"a": RequestStatus.RUNNING, "chat": RequestStatus.RUNNING}

    def test_no_one_is_pushed_out_for_a_request_its_tenant_quota_holds_back(self) -> None:
        """Other tenants' blocks would not let in a request over its own tenant's quota."""
        s = scheduler(max_num_seqs=2, quotas={"t": 1})
        s.add(request("t-running", tenant="t", priority=0), 0.0)
        s.add(request("other", priority=1), 0.0)
        step(s, 0.0)
        s.add(request("t-waiting", tenant="t", priority=0), 1.0)
        s.preemption.for_waiting(StepPlan(100), s.max_num_seqs)
        assert statuses(s, "other")["other"] is RequestStatus.RUNNING


# --------------------------------------------------------------------------- phase: grow running


class TestGrowRunning:
    def test_decoding_requests_each_get_one_token_in_one_allocator_call(self) -> None:
        """All running requests decoding, room for all: one slot array for the lot, one token each."""
        s = scheduler()
        s.add(request("a"), 0.0)
        s.add(request("b"), 0.0)
        step(s, 0.0)
        plan = StepPlan(100)
        s._grow_running(plan)
        assert [r.request_id for r in plan.requests] == ["a", "b"]
        assert plan.counts == [1, 1]
        assert len(plan.slots) == 1
        assert plan.budget == 98

    def test_a_prompt_is_prefilled_in_chunks_of_the_budget_left(self) -> None:
        """A 10-token prompt 4 tokens in gets the next 4 of a budget of 4."""
        s = scheduler(max_num_batched_tokens=4)
        s.add(request("r", 10), 0.0)
        step(s, 0.0)
        plan = StepPlan(4)
        s._grow_running(plan)
        assert plan.counts == [4]
        assert plan.budget == 0

    def test_the_best_running_request_grows_first(self) -> None:
        """With a budget of one token, it goes to the better priority, whatever the arrival order."""
        s = scheduler()
        s.add(request("worse", priority=1), 0.0)
        s.add(request("better", priority=0), 0.0)
        step(s, 0.0)
        plan = StepPlan(1)
        s._grow_running(plan)
        assert [r.request_id for r in plan.requests] == ["better"]

    def test_when_blocks_run_out_the_worst_request_not_yet_scheduled_is_preempted(self) -> None:
        """Three one-block requests in four blocks each need a second one: the latest arrival
        is recomputed and the other two grow into the room."""
        s = scheduler(num_blocks=5)
        for rid in "abc":
            s.add(request(rid, 4), 0.0)
        step(s, 0.0)
        plan = StepPlan(100)
        s._grow_running(plan)
        assert [r.request_id for r in plan.requests] == ["a", "b"]
        assert statuses(s, "c")["c"] is RequestStatus.WAITING
        assert plan.preempted

    def test_a_request_that_outgrows_the_cache_on_its_own_fails(self) -> None:
        """Alone in a two-block cache and needing a third block: KVCacheExhausted, blocks freed."""
        s = scheduler(num_blocks=3)
        s.add(request("r", 7), 0.0)
        step(s, 0.0)
        step(s, 1.0)  # the eighth token fills the second block
        plan = StepPlan(100)
        s._grow_running(plan)
        assert plan.requests == []
        [event] = s.take_events()
        assert isinstance(event.error, KVCacheExhausted)
        assert "outgrew the KV cache" in str(event.error)
        assert s.get("r") is None
        assert len(s.allocator) == 0


# --------------------------------------------------------------------------- phase: bring back swapped


class TestBringBackSwapped:
    def test_a_swapped_request_comes_back_with_its_block_moves(self) -> None:
        """With a seat and blocks free, the swapped request runs again: its swap-in copies are
        in the plan and it is scheduled in the same step."""
        s = with_b_swapped_out()
        plan = StepPlan(100)
        s._bring_back_swapped(plan)
        assert statuses(s, "b")["b"] is RequestStatus.RUNNING
        assert not s.allocator.is_swapped("b")
        assert len(plan.swap_in) == 1
        assert [r.request_id for r in plan.requests] == ["b"]

    def test_nothing_comes_back_in_a_step_that_preempted(self) -> None:
        """A step that had to preempt leaves swapped requests where they are."""
        s = with_b_swapped_out()
        plan = StepPlan(100)
        plan.preempted = True
        s._bring_back_swapped(plan)
        assert statuses(s, "b")["b"] is RequestStatus.SWAPPED
        assert plan.swap_in == []

    def test_a_swapped_request_waits_while_the_blocks_have_no_room_for_it(self) -> None:
        """Its blocks and a block to grow into must be free: with the pool taken, it stays out."""
        s = with_b_swapped_out()
        a = s.allocator
        a.allocate("filler", a.num_free_blocks * BS)  # another sequence takes every free block
        plan = StepPlan(100)
        s._bring_back_swapped(plan)
        assert statuses(s, "b")["b"] is RequestStatus.SWAPPED
        assert plan.requests == []


# --------------------------------------------------------------------------- phase: admit waiting


class TestAdmitWaiting:
    def test_waiting_requests_are_admitted_best_first_up_to_the_seats(self) -> None:
        """Two seats, three waiting: the two of priority 0 run, the priority-1 one waits."""
        s = scheduler(max_num_seqs=2)
        s.add(request("worse", priority=1), 0.0)
        s.add(request("a"), 0.0)
        s.add(request("b"), 0.0)
        plan = StepPlan(100)
        s._admit_waiting(plan, 0.0)
        assert [r.request_id for r in plan.requests] == ["a", "b"]
        assert [r.request_id for r in s.waiting] == ["worse"]

    def test_admission_starts_a_request_at_the_told_time(self) -> None:
        """The request's first scheduling time is the ``now`` admission was told."""
        s = scheduler()
        r = request("r")
        s.add(r, 0.0)
        s._admit_waiting(StepPlan(100), 4.0)
        assert r.t_first_scheduled == 4.0

    def test_a_prompt_is_reserved_whole_and_computed_within_the_budget(self) -> None:
        """A 10-token prompt with a budget of 4: slots for all 10, 4 of them in this step."""
        s = scheduler()
        s.add(request("r", 10), 0.0)
        plan = StepPlan(4)
        s._admit_waiting(plan, 0.0)
        assert s.allocator.num_tokens("r") == 10
        assert plan.counts == [4]

    def test_nothing_is_admitted_while_swapped_requests_wait(self) -> None:
        """Swapped requests come back before any waiting one is let in."""
        s = with_b_swapped_out()
        s.add(request("new"), 1.0)
        plan = StepPlan(100)
        s._admit_waiting(plan, 1.0)
        assert statuses(s, "new")["new"] is RequestStatus.WAITING
        assert plan.requests == []

    def test_nothing_is_admitted_in_a_step_that_preempted(self) -> None:
        """A step short of blocks admits nothing."""
        s = scheduler()
        s.add(request("r"), 0.0)
        plan = StepPlan(100)
        plan.preempted = True
        s._admit_waiting(plan, 0.0)
        assert statuses(s, "r")["r"] is RequestStatus.WAITING

    def test_a_tenant_at_its_quota_waits_without_holding_up_another_tenant(self) -> None:
        """The head of the queue is over its tenant's quota: the request behind it is admitted."""
        s = scheduler(quotas={"t": 1})
        s.add(request("t-running", tenant="t"), 0.0)
        step(s, 0.0)
        s.add(request("t-waiting", tenant="t"), 1.0)
        s.add(request("other"), 1.0)
        plan = StepPlan(100)
        s._admit_waiting(plan, 1.0)
        assert [r.request_id for r in plan.requests] == ["other"]
        assert statuses(s, "t-waiting")["t-waiting"] is RequestStatus.WAITING

    def test_admission_stops_at_the_first_request_the_blocks_cannot_hold(self) -> None:
        """A long prompt that does not fit now holds back the short one behind it (no overtaking)."""
        s = scheduler(num_blocks=5)
        s.add(request("running", 8), 0.0)
        step(s, 0.0)
        s.add(request("long", 12), 1.0)
        s.add(request("short", 1), 1.0)
        plan = StepPlan(100)
        s._admit_waiting(plan, 1.0)
        assert plan.requests == []
        assert [r.request_id for r in s.waiting] == ["long", "short"]

    def test_a_waiting_request_grown_past_the_cache_fails(self) -> None:
        """A request whose tokens (prompt and output so far) could never fit again ends with
        KVCacheExhausted instead of blocking the queue for ever."""
        s = scheduler(num_blocks=3)
        r = request("r", 3)
        s.add(r, 0.0)
        r.tokens.extend([5] * 6)  # as if it had generated 6 tokens before a preemption
        s._admit_waiting(StepPlan(100), 0.0)
        [event] = s.take_events()
        assert isinstance(event.error, KVCacheExhausted)
        assert s.get("r") is None


# --------------------------------------------------------------------------- last: lone swaps, sealing


class TestRecomputeLoneSwaps:
    def test_a_step_that_runs_nothing_recomputes_what_it_swapped_out(self) -> None:
        """No request runs, so no block moves would happen: the swapped-out request is
        recomputed instead, its CPU blocks freed and the plan's swap-outs dropped."""
        s = scheduler(cpu=8, preemption_mode="swap")
        s.add(request("a"), 0.0)
        step(s, 0.0)
        plan = StepPlan(100)
        s.preemption.preempt(s.running[0], plan)
        assert plan.swap_out
        s._recompute_lone_swaps(plan)
        assert statuses(s, "a")["a"] is RequestStatus.WAITING
        assert plan.swap_out == []
        assert "a" not in s.allocator
        assert s.allocator.statistics().cpu_free_blocks == 8

    def test_a_step_that_runs_a_request_keeps_its_swap_outs(self) -> None:
        """The swap-outs of a step that runs something are performed by its runtime."""
        s = scheduler(cpu=8, preemption_mode="swap")
        s.add(request("a"), 0.0)
        s.add(request("b"), 0.0)
        step(s, 0.0)
        plan = StepPlan(100)
        s.preemption.preempt(s.running[1], plan)
        s._grow_running(plan)
        s._recompute_lone_swaps(plan)
        assert statuses(s, "b")["b"] is RequestStatus.SWAPPED
        assert len(plan.swap_out) == 1


class TestSeal:
    def test_a_request_samples_only_in_the_step_that_reaches_its_last_token(self) -> None:
        """A first chunk of a longer prompt does not sample; the chunk that ends it does."""
        s = scheduler(max_num_batched_tokens=4)
        s.add(request("r", 6), 0.0)
        assert step(s, 0.0).samples == (False,)
        assert step(s, 1.0).samples == (True,)

    def test_an_empty_step_is_not_counted(self) -> None:
        """A step that runs nothing leaves ``steps`` alone."""
        s = scheduler()
        assert s._seal(StepPlan(100)).requests == ()
        assert s.statistics().steps == 0


# --------------------------------------------------------------------------- invariants (hypothesis)


class SchedulerMachine(RuleBasedStateMachine):
    """Random adds, steps (with aborts mid-step), aborts and limit changes on a small cache,
    preempting by recompute."""

    preemption_mode: Literal["recompute", "swap"] = "recompute"

    def __init__(self) -> None:
        super().__init__()
        self.s = scheduler()
        self.now = 0.0
        self.added: list[Hashable] = []
        self.requests: dict[Hashable, Request] = {}

    @initialize(max_num_seqs=st.integers(2, 4))
    def make(self, max_num_seqs: int) -> None:
        self.s = scheduler(
            6,  # 5 blocks, 20 tokens: a few requests fill them
            cpu=8 if self.preemption_mode == "swap" else 0,
            quotas={"t": 3},
            preemption_mode=self.preemption_mode,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=8,
        )

    @rule(
        specs=st.lists(
            st.tuples(
                st.integers(1, 10),  # prompt length
                st.integers(4, 24),  # max_new_tokens
                st.integers(0, 2),  # priority
                st.sampled_from([None, None, None, "t"]),  # tenant (quota 3 blocks)
                st.sampled_from([None, None, None, None, 0.0, 3.0]),  # deadline, from now
            ),
            min_size=2,
            max_size=4,
        )
    )
    def add(self, specs: list[tuple[int, int, int, Hashable, float | None]]) -> None:
        """A few arrivals at ``now`` (refused if they can never fit: never live then)."""
        for prompt_len, max_new, priority, tenant, deadline_in in specs:
            rid = len(self.added)
            deadline = None if deadline_in is None else self.now + deadline_in
            params = SamplingParams(max_new_tokens=max_new, eos_token_id=0)
            prompt = [1 + i % 9 for i in range(prompt_len)]
            req = Request(rid, prompt, params, priority=priority, tenant=tenant, deadline=deadline)
            try:
                self.s.add(req, self.now)
            except KVCacheExhausted:
                continue
            self.added.append(rid)
            self.requests[rid] = req

    @rule(
        dt=st.sampled_from([0.0, 0.5, 1.0]),
        tokens=st.lists(st.lists(st.integers(0, 49), min_size=8, max_size=8), min_size=2, max_size=8),
    )
    def steps(self, dt: float, tokens: list[list[int]]) -> None:
        """A few whole steps, ``dt`` apart (token 0 is every request's EOS)."""
        s = self.s
        for sampled in tokens:
            self.now += dt
            scheduled = s.schedule(self.now)
            assert len(s.running) <= s.max_num_seqs
            assert scheduled.num_tokens <= s.max_num_batched_tokens
            s.update(scheduled, sampled[: sum(scheduled.samples)], now=self.now)

    @rule(data=st.data())
    def abort_mid_step(self, data: st.DataObject) -> None:
        """A request aborted between schedule() and update() has its token dropped."""
        s = self.s
        scheduled = s.schedule(self.now)
        if scheduled.requests:
            victim = data.draw(st.sampled_from(scheduled.requests))
            assert s.abort(victim.request_id)
        s.update(scheduled, [1] * sum(scheduled.samples), now=self.now)

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """Abort any request added, live or ended (then a no-op)."""
        if self.added:
            self.s.abort(data.draw(st.sampled_from(self.added)))

    @rule(limit=st.integers(1, 4))
    def set_limit(self, limit: int) -> None:
        """Change ``max_num_seqs`` between steps, as ``set_batch_limit`` does."""
        self.s.max_num_seqs = limit

    @invariant()
    def every_request_is_in_exactly_the_list_of_its_status(self) -> None:
        s = self.s
        lists = {RequestStatus.WAITING: s.waiting, RequestStatus.RUNNING: s.running, RequestStatus.SWAPPED: s.swapped}
        listed = Counter(id(r) for queue in lists.values() for r in queue)
        assert all(n == 1 for n in listed.values()), "a request is listed twice"
        for status, queue in lists.items():
            for r in queue:
                assert r.status is status
                assert s.get(r.request_id) is r
        for rid, req in self.requests.items():
            if req.status in FINAL:
                assert s.get(rid) is None, f"{rid!r} ended but is still known"
                assert req.finish_reason is not None
            else:
                assert id(req) in listed, f"{rid!r} is {req.status.value} but in no list"
        assert s.waiting == sorted(s.waiting, key=Request.sort_key)

    @invariant()
    def every_request_added_is_live_or_counted_ended_once(self) -> None:
        stats = self.s.statistics()
        assert stats.waiting + stats.running + stats.swapped + stats.finished + stats.aborted == len(self.added)

    @invariant()
    def the_allocator_holds_the_running_and_swapped_requests_only(self) -> None:
        s = self.s
        a = s.allocator
        assert set(a) == {r.request_id for r in [*s.running, *s.swapped]}
        assert {sid for sid in a if a.is_swapped(sid)} == {r.request_id for r in s.swapped}

    @invariant()
    def no_block_is_leaked(self) -> None:
        a = self.s.allocator
        stats = a.statistics()
        assert stats.free_blocks + stats.used_blocks + stats.cached_blocks == stats.total_blocks
        held: set[int] = set()
        cpu_held = 0
        for sid in a:
            if a.is_swapped(sid):
                cpu_held += a.blocks_needed(a.num_tokens(sid))
            else:
                held.update(a.block_table(sid).tolist())
        assert stats.used_blocks == len(held)
        assert stats.cpu_free_blocks + cpu_held == stats.cpu_total_blocks

    def teardown(self) -> None:
        """Aborting what is left gives every block back."""
        # Steer the search towards runs that preempt and swap, where bookkeeping goes wrong.
        target(float(self.s.statistics().preemptions), label="preemptions")
        target(float(self.s.allocator.statistics().swaps_out), label="swaps")
        for rid in self.added:
            self.s.abort(rid)
        stats = self.s.allocator.statistics()
        assert stats.used_blocks == 0
        assert stats.cpu_free_blocks == stats.cpu_total_blocks


class SwappingSchedulerMachine(SchedulerMachine):
    """The same traffic, preempting by swap (a CPU pool of 8 blocks)."""

    preemption_mode = "swap"


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestSwappingSchedulerMachine = SwappingSchedulerMachine.TestCase
TestSwappingSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("sampled", [[], [7, 8]])
def test_scheduler_update_refuses_a_wrong_number_of_tokens_and_changes_nothing(sampled: list[int]) -> None:
    """update(step, sampled) takes one token per request that samples: another count is a
    ValueError (not a StopIteration escaping into the caller's loop), and the step can be applied
    afterwards with the right tokens."""
    from batchkit.continuous import Request

    sched = batchkit.Scheduler(batchkit.PagedKVAllocator(num_blocks=16, block_size=4))
    sched.add(Request("r1", [1, 2, 3], batchkit.SamplingParams(max_new_tokens=2)))
    step = sched.schedule()
    with pytest.raises(ValueError, match="one sampled token per sequence"):
        sched.update(step, sampled)
    request = sched.get("r1")
    assert request is not None
    assert request.num_computed == 0
    events = sched.update(step, [7])
    assert [(e.request_id, e.token) for e in events] == [("r1", 7)]


@pytest.mark.parametrize(
    ("priorities", "victim"),
    [((0, 1, 1), "C"), ((1, 0, 0), "A"), ((0, 0, 0), "C")],
    ids=["worst-priority-most-recent", "worst-priority-oldest", "equal-most-recent"],
)
def test_running_out_of_blocks_preempts_the_worst_running_request(priorities: tuple[int, ...], victim: str) -> None:
    """When decoding runs out of blocks, the running request with the highest priority value, then
    the most recent, is preempted (back to waiting)."""
    sched = batchkit.Scheduler(batchkit.PagedKVAllocator(num_blocks=8, block_size=4))
    names = ("A", "B", "C")
    for i, (name, priority) in enumerate(zip(names, priorities, strict=True)):
        params = batchkit.SamplingParams(max_new_tokens=40, ignore_eos=True)
        sched.add(Request(name, [1, 2, 3], params, priority=priority, arrival=float(i)))
    for _ in range(30):
        step = sched.schedule()
        sched.update(step, [5] * sum(step.samples))
        if sched.statistics().preemptions:
            break
    assert sched.statistics().preemptions == 1
    statuses = {}
    for name in names:
        request = sched.get(name)
        assert request is not None
        statuses[name] = request.status.name
    assert statuses == {n: ("WAITING" if n == victim else "RUNNING") for n in names}


# --------------------------------------------------------------------------- docs/api.md: the Scheduler's inputs


def test_scheduler_inputs_of_the_wrong_type_are_type_errors() -> None:
    """Scheduler(allocator) takes a PagedKVAllocator; add(request) a Request whose params is a
    SamplingParams: anything else is a TypeError naming it, and nothing is queued."""
    with pytest.raises(TypeError, match="allocator"):
        batchkit.Scheduler(cast(Any, "blocks"))
    sched = batchkit.Scheduler(batchkit.PagedKVAllocator(num_blocks=16, block_size=4))
    with pytest.raises(TypeError, match="params"):
        sched.add(Request("r", [1, 2], cast(Any, {"max_new_tokens": 2})))
    with pytest.raises(TypeError, match="Request"):
        sched.add(cast(Any, ("r", [1, 2])))
    assert not sched.has_work()
    assert sched.get("r") is None


def test_prompt_tokens_computed_counts_only_prompt_tokens_when_a_recomputed_chunk_spans_the_output() -> None:
    """SchedulerStatistics.prompt_tokens_computed (batchkit serve's "prompt tokens computed"):
    a request preempted by recompute computes its prompt again, in chunks that may run on into
    its earlier output; only the prompt's tokens count (a chunk's every token counted before)."""
    sched = batchkit.Scheduler(
        batchkit.PagedKVAllocator(num_blocks=16, block_size=4), max_num_seqs=1, max_num_batched_tokens=2
    )
    a = Request("a", [1, 2, 3], batchkit.SamplingParams(max_new_tokens=4))
    sched.add(a)

    def step() -> None:
        s = sched.schedule()
        sched.update(s, [7] * sum(s.samples))

    while len(a.output) < 2:
        step()
    assert sched.statistics().prompt_tokens_computed == 3
    sched.add(Request("b", [5], batchkit.SamplingParams(max_new_tokens=1), priority=-1))
    step()  # b takes a's seat: a is preempted by recompute
    assert sched.statistics().preemptions == 1
    while sched.has_work():
        step()
    s = sched.statistics()
    assert a.output == [7, 7, 7, 7]
    assert s.prompt_tokens_computed == 3 + 1 + 3  # a, b, a's prompt again (its 2 outputs are not prompt)


def test_scheduler_add_refuses_a_priority_that_is_not_an_int_and_queues_nothing() -> None:
    """Requests are ordered by priority (an int): a str priority beside an int one left the
    request known to get() but in no queue, and abort() then failed; now add() refuses it."""
    sched = batchkit.Scheduler(batchkit.PagedKVAllocator(num_blocks=16, block_size=4))
    sched.add(Request("a", [1], batchkit.SamplingParams()))
    with pytest.raises(TypeError, match="priority"):
        sched.add(Request("b", [1], batchkit.SamplingParams(), priority=cast(Any, "high")))
    assert sched.get("b") is None
    assert sched.abort("b") is False
    assert sched.abort("a") is True


@pytest.mark.parametrize("deadline", ["soon", math.nan])
def test_scheduler_add_refuses_a_deadline_that_is_not_a_time(deadline: Any) -> None:
    """Request.deadline is a time on the scheduler's clock: a string beside numeric deadlines
    broke the deadline heap half-way through add() (and every schedule() after it)."""
    sched = batchkit.Scheduler(batchkit.PagedKVAllocator(num_blocks=16, block_size=4))
    sched.add(Request("a", [1], batchkit.SamplingParams(max_new_tokens=1), deadline=1e9))
    with pytest.raises(TypeError, match="deadline"):
        sched.add(Request("b", [1], batchkit.SamplingParams(), deadline=deadline))
    assert sched.get("b") is None
    step = sched.schedule()
    assert [e.token for e in sched.update(step, [3])] == [3]
    assert not sched.has_work()
