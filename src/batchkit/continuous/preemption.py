"""Preemption: which running request leaves, and how, when seats or KV blocks run out.

Three occasions, each a public method the :class:`Scheduler` calls in its step's phases:
the running requests over ``max_num_seqs`` (:meth:`Preemption.over_limit`), a better-priority
waiting request that needs a seat or room (:meth:`Preemption.for_waiting`), and a running request
whose next tokens find no free block (:meth:`Preemption.make_room`). The victim is swapped out
(``preemption_mode="swap"``, with CPU room) or recomputed; a request that could never fit again
ends instead. Every move goes through :meth:`RequestQueues.move`.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from typing import Literal

from .._errors import KVCacheExhausted
from .queues import RequestQueues
from .request import Request, RequestStatus, StepPlan, Transition

__all__ = ["Preemption", "PreemptionMode", "is_held"]

PreemptionMode = Literal["recompute", "swap"]


def is_held(req: Request) -> bool:
    """Whether ``req`` waits while the better request that pushed it out runs in its seat."""
    return req.displaced_by is not None and req.displaced_by.status is RequestStatus.RUNNING


class Preemption:
    """The preemption policy over a scheduler's :class:`RequestQueues`.

    Args:
        queues: the live requests (their lists, their moves, the allocator under them).
        mode: ``"recompute"`` or ``"swap"``.

    Attributes:
        count: preemptions so far.
    """

    def __init__(self, queues: RequestQueues, mode: PreemptionMode) -> None:
        self.queues = queues
        self.allocator = queues.allocator
        self.waiting = queues.waiting
        self.running = queues.running
        self.swapped = queues.swapped
        self.mode: PreemptionMode = mode
        self.count = 0

    def over_limit(self, plan: StepPlan, max_num_seqs: int) -> None:
        """Preempt the worst running requests over ``max_num_seqs``.

        A ``max_num_seqs`` lowered while requests run (``set_batch_limit``, an AdaptiveTuner)
        holds from this step on, as when blocks run out; they come back when there is room under
        the limit.
        """
        while len(self.running) > max_num_seqs:
            victim = self._victim(set())
            assert victim is not None  # running is not empty
            self.preempt(victim, plan)
            plan.preempted = True

    def for_waiting(self, plan: StepPlan, max_num_seqs: int) -> None:
        """Let the head of the waiting queue push out worse-priority running requests, for a seat
        under ``max_num_seqs`` (or, with one free, when :meth:`_seat_owed`) or for KV room, when
        that lets it in. Each request pushed out waits while the head runs (:func:`is_held`).

        Not past its tenant's quota (other tenants' blocks would not help), not while swapped
        requests wait to come back first (admission waits for them), not if it can never fit, not
        if preempting every worse request would still leave too little room (the better ones
        hold the blocks). Victims are recomputed, not swapped, so that they do not block
        admission in turn.
        """
        if not (self.waiting and self.running and not self.swapped):
            return
        a = self.allocator
        head = self.waiting[0]
        total = len(head.tokens)
        worse = [r for r in self.running if r.priority > head.priority]
        if not (
            worse
            and a.within_quota(total, head.tenant)
            and self.queues.never_fits(head, total) is None
            and self._room_without(worse) >= a.blocks_needed(total)
        ):
            return
        worst = self._victim(set(), for_better=True)
        if (
            worst is not None
            and worst.priority > head.priority
            and (len(self.running) >= max_num_seqs or self._seat_owed(head, worst))
        ):
            self.preempt(worst, plan, allow_swap=False)
            worst.displaced_by = head
        while len(self.running) < max_num_seqs and not a.can_allocate(total, tenant=head.tenant):
            worst = self._victim(set(), for_better=True)
            if worst is None or worst.priority <= head.priority:
                break
            self.preempt(worst, plan, allow_swap=False)
            worst.displaced_by = head

    def make_room(self, plan: StepPlan, req: Request, need: int) -> None:
        """Running request ``req`` needs ``need`` more slots than the blocks give: preempt the
        worst request not yet scheduled (perhaps ``req`` itself), or end ``req`` if it could
        never fit."""
        a = self.allocator
        held = a.num_tokens(req.request_id)
        quota = a.quota_of(req.tenant)
        if quota is not None and a.blocks_needed(held + need) > quota:
            # Its tenant's quota can never hold it: preempting others would not help.
            self._outgrown(req)
            return
        # With room in the pool, what is short is the tenant's quota: only that tenant's own
        # blocks can give it back, and only freed ones (a swapped-out sequence still counts
        # against its quota), so the victim is one of its requests, recomputed.
        short_of_quota = quota is not None and a.blocks_needed(held + need) - a.blocks_needed(held) <= a.num_free_blocks
        victim = self._victim(plan.scheduled | {id(req)}, tenant_of=req if short_of_quota else None) or req
        # Preempting a request that could never be admitted again would park it in the waiting
        # queue for ever (and block the queue behind it): end it instead.
        if victim is req and (
            (not short_of_quota and len(self.running) == 1 and not plan.requests)
            or self.queues.never_fits(req, len(req.tokens)) is not None
        ):
            self._outgrown(req)
            return
        self.preempt(victim, plan, allow_swap=not short_of_quota)
        plan.preempted = True

    def _seat_owed(self, head: Request, victim: Request) -> bool:
        """Whether ``head`` should push out ``victim`` (worse, running) even with a seat free:
        when a worse request waits behind ``head`` to take that seat (one not :func:`is_held`), and
        ``victim`` was never pushed out, or less often than that one. ``victim`` then waits while
        ``head`` runs, and the seat goes to the one waiting.

        So each better request's tokens delay the worse one it pushes out, not the queue behind
        it. 8 chats of 16 tokens among 24 requests of 96 tokens on 8 seats need 304 steps; when
        each chat took the seat the one before it freed, they all delayed the same place in the
        queue, and the request at that place ended the run alone (384 steps, 96 of them thin).
        """
        behind = itertools.islice(self.waiting, 1, None)
        taker = next((r for r in behind if r.priority > head.priority and not is_held(r)), None)
        return taker is not None and (victim.num_preemptions == 0 or victim.num_preemptions < taker.num_preemptions)

    def _victim(
        self, exclude: set[int], *, tenant_of: Request | None = None, for_better: bool = False
    ) -> Request | None:
        """The running request to preempt: worst priority, then most recent arrival (with
        ``tenant_of``, only among the requests of that request's tenant).

        With ``for_better`` (a better-priority arrival pushes one out): worst priority, then the
        one preempted fewest times, then the earliest arrival. A stream of better arrivals thus
        takes its seats from each worse request in turn, and the victims come back in the order
        they left (the waiting queue is in arrival order): none is pushed out again and again or
        waits behind the others' returns (it would starve, and a set of equal requests would end
        with it running alone). The earliest holds the most blocks, so with prefix caching off
        its recompute costs the most; with it, its full blocks come back from the cache.
        """
        key: Callable[[Request], tuple[int, ...]] = (
            (lambda r: (r.priority, -r.num_preemptions, -r.order)) if for_better else (lambda r: (r.priority, r.order))
        )
        candidates = (
            r for r in self.running if id(r) not in exclude and (tenant_of is None or r.tenant == tenant_of.tenant)
        )
        return max(candidates, key=key, default=None)

    def _room_without(self, requests: list[Request]) -> int:
        """Blocks admission could hand out if these running requests gave theirs back: the
        blocks no other sequence shares with them."""
        a = self.allocator
        held: Counter[int] = Counter()
        for r in requests:
            held.update(a.block_table(r.request_id).tolist())
        held.pop(0, None)  # the null block: where a sliding window gave blocks back
        freed = sum(1 for block, n in held.items() if a.ref_count(block) == n)
        return a.num_free_blocks + freed - a.watermark_blocks

    def preempt(self, req: Request, plan: StepPlan, *, allow_swap: bool = True) -> None:
        """Take ``req`` off the running list: swapped out (its copies added to the plan's
        ``swap_out``) or, without CPU room or ``allow_swap``, back to the waiting queue."""
        self.count += 1
        req.num_preemptions += 1
        if self.mode == "swap" and allow_swap:
            try:
                copies = self.allocator.swap_out(req.request_id)
            except KVCacheExhausted:
                pass  # no CPU room: recompute instead
            else:
                plan.swap_out.extend(copies)
                plan.swapped_here.append(req)
                self.queues.move(req, Transition.SWAP_OUT)
                return
        self.queues.move(req, Transition.RECOMPUTE)

    def _outgrown(self, req: Request) -> None:
        """End a running request that no longer fits the cache even on its own."""
        problem = self.queues.never_fits(req, len(req.tokens)) or f"request {req.request_id!r} alone no longer fits"
        self.queues.fail(
            req,
            KVCacheExhausted(
                f"{problem}; it outgrew the KV cache while generating after {len(req.output)} tokens. Lower "
                "max_new_tokens or give the cache more blocks"
            ),
        )
