"""The continuous-batching scheduler: a sans-I/O core, ``schedule()`` -> user step -> ``update()``.

Every step, each running sequence gets its next tokens (one for a decode, a chunk for a prompt
still being prefilled) within one token budget, ``max_num_batched_tokens``; waiting requests are
admitted into what is left, up to ``max_num_seqs`` running. Admission reserves KV room for the
whole prompt (above the allocator's watermark), so that a long prompt is not admitted only to
be preempted. When decoding runs out of blocks, the worst running request (highest priority
value, then most recent arrival) is preempted: by recompute (its blocks are freed and it re-enters
the waiting queue with its generated tokens as part of its prompt; with prefix caching it reuses
its own cached blocks) or by swap (its blocks move to the CPU pool). A waiting request of better
priority may preempt a worse running one. Finished sequences free their blocks in the same step.

Nothing here calls the model, sleeps or takes a lock: the runtime (``ContinuousDecodeLoop``) does.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
import numbers
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .._clock import Clock, MonotonicClock
from .._errors import DeadlineExceeded, KVCacheExhausted
from ..kv.allocator import PagedKVAllocator
from ..metrics import LatencySummary, SampleWindow
from .logprobs import TokenLogprobs
from .sampling import DecodedText, SamplingParams, find_stop

__all__ = ["Request", "RequestStatus", "ScheduledStep", "Scheduler", "SchedulerStatistics", "TokenEvent"]

PreemptionMode = Literal["recompute", "swap"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"
    ABORTED = "aborted"


class Request:
    """One generation request and its progress."""

    __slots__ = (
        "arrival",
        "deadline",
        "finish_reason",
        "generator",
        "num_computed",
        "num_preemptions",
        "order",
        "output",
        "params",
        "priority",
        "prompt_len",
        "prompt_logprobs",
        "prompt_logprobs_done",
        "request_id",
        "status",
        "stop_text",
        "t_first_scheduled",
        "t_last_token",
        "tenant",
        "tokens",
    )

    def __init__(
        self,
        request_id: Hashable,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        tenant: Hashable = None,
        arrival: float = 0.0,
        deadline: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.deadline = deadline  # on the scheduler's clock: dropped with DeadlineExceeded past it
        self.tokens: list[int] = [int(t) for t in prompt]  # prompt + output
        self.prompt_len = len(self.tokens)
        self.output: list[int] = []
        self.params = params
        self.priority = priority
        self.tenant = tenant
        self.arrival = arrival
        self.order = 0
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.t_first_scheduled: float | None = None
        self.t_last_token: float | None = None
        self.num_preemptions = 0
        self.generator: Any = None
        self.stop_text: DecodedText | None = None  # the output's text, for stop strings
        # params.prompt_logprobs: the prompt tokens' entries not yet handed out, and how many of
        # the prompt's positions (from 1 on) have theirs.
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs_done = 0

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether this request still wants logits at prompt positions (``prompt_logprobs``)."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs_done < self.prompt_len - 1

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.order)

    def __repr__(self) -> str:
        return (
            f"<Request {self.request_id!r} {self.status.value} prompt={self.prompt_len} "
            f"out={len(self.output)} computed={self.num_computed}>"
        )


@dataclass(frozen=True)
class ScheduledStep:
    """What one step runs: for each scheduled request, how many new tokens and whether it samples.

    Block moves the KV cache must perform before the step runs, in this order: ``swap_out``
    (device -> CPU), ``swap_in`` (CPU -> device), ``copies`` (copy-on-write, device).

    ``slot_mapping`` (int64, one entry per new token, request after request) is where each new
    token's K/V go, as the allocator handed the slots out while scheduling; None in a step
    built by hand, whose runtime then derives the slots from the block tables.
    """

    requests: tuple[Request, ...]
    num_new_tokens: tuple[int, ...]
    samples: tuple[bool, ...]
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    slot_mapping: np.ndarray | None = field(default=None, compare=False)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass(frozen=True)
class TokenEvent:
    """A token produced for a request (or its end: ``token`` None when it ended without one)."""

    request_id: Hashable
    token: int | None
    finished: bool
    finish_reason: str | None = None
    error: BaseException | None = None
    logprobs: TokenLogprobs | None = None  # the token's, when its request asked (``logprobs=``)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # the prompt's (``prompt_logprobs=``), with the first token


@dataclass(frozen=True)
class SchedulerStatistics:
    """A snapshot of the scheduler (latencies in ms). ``ttft``, ``tpot`` and ``queue_wait`` cover
    the whole run (mergeable); the ``*_recent`` ones the last 10,000 samples of each."""

    waiting: int
    running: int
    swapped: int
    finished: int
    aborted: int
    expired: int
    steps: int
    preemptions: int
    generated_tokens: int
    prompt_tokens_computed: int
    kv_usage: float
    mean_batch_tokens: float
    ttft: LatencySummary
    tpot: LatencySummary
    queue_wait: LatencySummary
    ttft_recent: LatencySummary
    tpot_recent: LatencySummary
    queue_wait_recent: LatencySummary


class Scheduler:
    """Iteration-level scheduling over a :class:`PagedKVAllocator`.

    Args:
        allocator: the block bookkeeping (its watermark applies to admission).
        max_num_seqs: at most this many requests run (>= 1).
        max_num_batched_tokens: token budget per step, shared by prefill chunks and decodes.
        preemption_mode: ``"recompute"`` (default) or ``"swap"`` (needs ``num_cpu_blocks``).
        clock: time for the metrics.
        detokenize: ``detokenize(token_ids) -> str``, needed for stop strings.

    Raises:
        ValueError: non-positive limits or an unknown preemption mode.
    """

    def __init__(
        self,
        allocator: PagedKVAllocator,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        preemption_mode: PreemptionMode = "recompute",
        clock: Clock | None = None,
        detokenize: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        if not isinstance(allocator, PagedKVAllocator):
            raise TypeError(f"allocator must be a batchkit.PagedKVAllocator, got {allocator!r}")
        for name, value in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if preemption_mode == "swap" and allocator.num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs an allocator with num_cpu_blocks > 0")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode: PreemptionMode = preemption_mode
        self.clock: Clock = clock if clock is not None else MonotonicClock()
        self.detokenize = detokenize
        self.waiting: list[Request] = []  # sorted by (priority, arrival order)
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self._requests: dict[Hashable, Request] = {}
        self._order = 0
        self._steps = 0
        self._preemptions = 0
        self._generated = 0
        self._prompt_computed = 0
        self._batch_tokens = 0
        self._finished = 0
        self._aborted = 0
        self._ttft = SampleWindow()
        self._tpot = SampleWindow()
        self._queue_wait = SampleWindow()
        self._pending_events: list[TokenEvent] = []
        self._deadlines: list[tuple[float, int, Request]] = []  # heap; finished requests leave lazily
        self._expired = 0

    # ------------------------------------------------------------------ requests

    def add(self, request: Request) -> None:
        """Queue a request.

        Raises:
            TypeError: not a :class:`Request`, its ``params`` not a :class:`SamplingParams`, or
                its ``priority`` not an int, or its ``deadline`` not a number (or None).
            ValueError: a duplicate id or an empty prompt.
            KVCacheExhausted: the prompt can never be admitted (cache or tenant quota too small).
        """
        if not isinstance(request, Request):
            raise TypeError(f"add() takes a batchkit.continuous.Request, got {request!r}")
        if not isinstance(request.params, SamplingParams):
            raise TypeError(
                f"request {request.request_id!r}: params must be a batchkit.SamplingParams, got {request.params!r}"
            )
        if isinstance(request.priority, bool) or not isinstance(request.priority, int):
            raise TypeError(
                f"request {request.request_id!r}: priority must be an int (lower is served first), "
                f"got {request.priority!r}"
            )
        deadline = request.deadline
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, numbers.Real) or math.isnan(deadline)
        ):
            raise TypeError(
                f"request {request.request_id!r}: deadline must be a time on the scheduler's clock (a number) "
                f"or None, got {deadline!r}"
            )
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if not request.tokens:
            raise ValueError("a prompt needs at least one token")
        if request.params.stop and self.detokenize is None:
            raise ValueError(
                f"request {request.request_id!r} has stop strings {request.params.stop!r} but the scheduler has no "
                "detokenize hook to match them; pass detokenize= (token ids -> text) to the ContinuousDecodeLoop "
                "or Scheduler, or use stop_token_ids"
            )
        # The prompt must fit the cache above the watermark; a request that later outgrows the
        # whole cache on its own ends with KVCacheExhausted then.
        problem = self._never_fits(request, request.prompt_len)
        if problem is not None:
            raise KVCacheExhausted(f"{problem}; shorten the prompt or give the cache more blocks")
        request.arrival = self.clock.now()
        self._order += 1
        request.order = self._order
        request.status = RequestStatus.WAITING
        if request.params.seed is not None:
            import torch

            request.generator = torch.Generator().manual_seed(request.params.seed)
        self._requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=Request.sort_key)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.order, request))

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request wherever it is and free its blocks. False if it is not known (done)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self._detach(req)
        req.status = RequestStatus.ABORTED
        req.finish_reason = "abort"
        self._aborted += 1
        return True

    def _detach(self, req: Request) -> None:
        """Take ``req`` out of whichever queue holds it, and free its blocks if it has any."""
        if req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.allocator.free(req.request_id)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
            self.allocator.free(req.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def get(self, request_id: Hashable) -> Request | None:
        return self._requests.get(request_id)

    def take_events(self) -> list[TokenEvent]:
        """Events produced outside ``update`` (requests failed while scheduling)."""
        out, self._pending_events = self._pending_events, []
        return out

    # ------------------------------------------------------------------ scheduling

    def _never_fits(self, req: Request, num_tokens: int) -> str | None:
        """Why a request holding ``num_tokens`` tokens (and about to take one more) could never be
        admitted again, even with the cache to itself; None if it could."""
        a = self.allocator
        most = a.blocks_needed(num_tokens + 1)
        room = a.total_blocks - a.watermark_blocks
        if most > room:
            return (
                f"request {req.request_id!r}: {num_tokens} tokens need {most} KV blocks but admission has {room} "
                f"(the cache's {a.total_blocks} blocks less the watermark's {a.watermark_blocks})"
            )
        quota = a.quota_of(req.tenant)
        if quota is not None and most > quota:
            return f"request {req.request_id!r} needs {most} KV blocks, over tenant {req.tenant!r}'s quota of {quota}"
        return None

    def _outgrown(self, req: Request) -> None:
        """End a running request that no longer fits the cache even on its own."""
        self.running.remove(req)
        self.allocator.free(req.request_id)
        problem = self._never_fits(req, len(req.tokens)) or f"request {req.request_id!r} alone no longer fits"
        self._fail(
            req,
            KVCacheExhausted(
                f"{problem}; it outgrew the KV cache while generating after {len(req.output)} tokens. Lower "
                "max_new_tokens or give the cache more blocks"
            ),
        )

    def _victim(self, exclude: set[int], *, tenant_of: Request | None = None) -> Request | None:
        """The running request to preempt: worst priority, then most recent arrival (with
        ``tenant_of``, only among the requests of that request's tenant)."""
        best: Request | None = None
        for r in self.running:
            if id(r) in exclude or (tenant_of is not None and r.tenant != tenant_of.tenant):
                continue
            if best is None or (r.priority, r.order) > (best.priority, best.order):
                best = r
        return best

    def _room_without(self, requests: list[Request]) -> int:
        """Blocks admission could hand out if these running requests gave theirs back: the
        blocks no other sequence shares with them."""
        a = self.allocator
        held: Counter[int] = Counter()
        for r in requests:
            held.update(a.block_table(r.request_id).tolist())
        freed = sum(1 for block, n in held.items() if a.ref_count(block) == n)
        return a.num_free_blocks + freed - a.watermark_blocks

    def _preempt(self, req: Request, swap_out: list[tuple[int, int]], *, allow_swap: bool = True) -> bool:
        """Take ``req`` off the running list: swapped out (True; its copies added to
        ``swap_out``) or back to the waiting queue, recomputed (False)."""
        self.running.remove(req)
        self._preemptions += 1
        req.num_preemptions += 1
        if self.preemption_mode == "swap" and allow_swap:
            try:
                swap_out.extend(self.allocator.swap_out(req.request_id))
            except KVCacheExhausted:
                pass  # no CPU room: recompute instead
            else:
                req.status = RequestStatus.SWAPPED
                self.swapped.append(req)
                return True
        self.allocator.free(req.request_id)
        req.num_computed = 0
        req.status = RequestStatus.WAITING
        bisect.insort(self.waiting, req, key=Request.sort_key)
        return False

    def _fail(self, req: Request, error: BaseException) -> None:
        """End a request with an error; the caller has taken it off its list and freed its blocks."""
        self._requests.pop(req.request_id, None)
        req.status = RequestStatus.FINISHED
        req.finish_reason = "error"
        self._finished += 1
        self._pending_events.append(TokenEvent(req.request_id, None, True, "error", error))

    def _expire(self, now: float) -> None:
        """Drop every request whose deadline has passed, wherever it is; free its blocks."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, req = heapq.heappop(heap)
            if self._requests.get(req.request_id) is not req:
                continue  # finished or aborted already
            self._detach(req)
            self._expired += 1
            self._fail(
                req,
                DeadlineExceeded(
                    f"request {req.request_id!r} passed its deadline ({now - req.arrival:.3f} s after arrival, "
                    f"{len(req.output)} tokens generated); give it a longer deadline or add capacity"
                ),
            )

    def schedule(self) -> ScheduledStep:
        """Decide this step's work (may preempt, swap and admit). Empty when nothing can run.

        Requests past their deadline are dropped first (their streams get
        :class:`DeadlineExceeded` through :meth:`take_events`).
        """
        a = self.allocator
        now = self.clock.now()
        if self._deadlines:
            self._expire(now)
        budget = self.max_num_batched_tokens
        chosen: list[Request] = []
        counts: list[int] = []
        slots: list[np.ndarray] = []  # the slots of the chosen requests' new tokens, in order
        scheduled: set[int] = set()
        swap_out: list[tuple[int, int]] = []
        swap_in: list[tuple[int, int]] = []
        swapped_here: list[Request] = []  # swapped out by this step
        preempted = False

        # A max_num_seqs lowered while requests run (set_batch_limit, an AdaptiveTuner) holds
        # from this step on: the worst running requests over it are preempted, as when blocks
        # run out, and come back when there is room under the limit.
        while len(self.running) > self.max_num_seqs:
            victim = self._victim(set())
            assert victim is not None  # running is not empty
            if self._preempt(victim, swap_out):
                swapped_here.append(victim)
            preempted = True

        # A better-priority waiting request may push out a worse running one, for a seat under
        # max_num_seqs or for KV room. Only when that lets it in: not past its tenant's quota
        # (other tenants' blocks would not help), not while swapped requests wait to come back
        # first (step 3 admits nothing then), not if it can never fit, not if preempting every
        # worse request would still leave too little room (the better ones hold the blocks).
        # Victims are recomputed, not swapped, so that they do not block admission in turn.
        if self.waiting and self.running and not self.swapped:
            head = self.waiting[0]
            total = len(head.tokens)
            worse = [r for r in self.running if r.priority > head.priority]
            if (
                worse
                and a.within_quota(total, head.tenant)
                and self._never_fits(head, total) is None
                and self._room_without(worse) >= a.blocks_needed(total)
            ):
                if len(self.running) >= self.max_num_seqs:
                    worst = self._victim(set())
                    if worst is not None and worst.priority > head.priority:
                        self._preempt(worst, swap_out, allow_swap=False)
                while len(self.running) < self.max_num_seqs and not a.can_allocate(total, tenant=head.tenant):
                    worst = self._victim(set())
                    if worst is None or worst.priority <= head.priority:
                        break
                    self._preempt(worst, swap_out, allow_swap=False)

        # 1. Running requests, best first. The common case, every running request decoding one
        #    token with room for all, is one vectorised allocator call.
        self.running.sort(key=Request.sort_key)
        decoding = [r for r in self.running if len(r.tokens) - r.num_computed == 1]
        if decoding and len(decoding) == len(self.running) and len(decoding) <= budget and not a.has_quotas:
            handle = a.batch([r.request_id for r in decoding])
            # A request whose prefill stopped one token short already holds that token's slot:
            # then the per-request path below runs, which reserves nothing for it. The allocator
            # holds at least each request's computed tokens, so equal sums mean none is ahead.
            ahead = int(a.tables.lens[handle.rows].sum()) != sum([r.num_computed for r in decoding])
            if not ahead and a.blocks_needed_batch(handle) <= a.num_free_blocks:
                ids = [r.tokens[-1] for r in decoding] if a.enable_prefix_caching else None
                slots.append(a.append_slots_batch(handle, ids))
                chosen.extend(decoding)
                counts.extend([1] * len(decoding))
                scheduled.update(id(r) for r in decoding)
                budget -= len(decoding)
        i = len(chosen)
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(len(req.tokens) - req.num_computed, budget)
            need = req.num_computed + n - a.num_tokens(req.request_id)
            if need > 0 and not a.can_append_slots([req.request_id], need):
                held = a.num_tokens(req.request_id)
                quota = a.quota_of(req.tenant)
                if quota is not None and a.blocks_needed(held + need) > quota:
                    # Its tenant's quota can never hold it: preempting others would not help.
                    self._outgrown(req)
                    continue
                # With room in the pool, what is short is the tenant's quota: only that tenant's
                # own blocks can give it back, and only freed ones (a swapped-out sequence still
                # counts against its quota), so the victim is one of its requests, recomputed.
                short_of_quota = (
                    quota is not None and a.blocks_needed(held + need) - a.blocks_needed(held) <= a.num_free_blocks
                )
                victim = self._victim(scheduled | {id(req)}, tenant_of=req if short_of_quota else None) or req
                # Preempting a request that could never be admitted again would park it in the
                # waiting queue for ever (and block the queue behind it): end it instead.
                if victim is req and (
                    (not short_of_quota and len(self.running) == 1 and not chosen)
                    or self._never_fits(req, len(req.tokens)) is not None
                ):
                    self._outgrown(req)
                    continue
                if self._preempt(victim, swap_out, allow_swap=not short_of_quota):
                    swapped_here.append(victim)
                preempted = True
                continue  # the list changed: look at position i again
            slots.append(self._reserve(req, n, need))
            chosen.append(req)
            counts.append(n)
            scheduled.add(id(req))
            budget -= n
            i += 1

        # 2. Swapped requests come back first, if nothing was preempted this step.
        if not preempted:
            while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.swapped[0]
                n = min(len(req.tokens) - req.num_computed, budget)
                held = a.num_tokens(req.request_id)
                need = req.num_computed + n - held
                # Room for its blocks and this step's tokens, and a block to grow into while
                # others run (with nothing running, what it needs is enough: it held no more
                # than the pool less its preemptor's blocks, so it always fits alone).
                if a.num_free_blocks < a.blocks_needed(held + max(need, 0)) + (1 if self.running else 0):
                    break
                quota = a.quota_of(req.tenant)
                if quota is not None and need > 0:
                    # A swapped-out sequence keeps its blocks' share of its tenant's quota; the
                    # blocks its next tokens take must fit the quota too.
                    if a.blocks_needed(held + need) > quota:  # never: end it, as a running one
                        self.swapped.pop(0)
                        a.free(req.request_id)
                        why = self._never_fits(req, len(req.tokens)) or f"request {req.request_id!r}"
                        self._fail(
                            req,
                            KVCacheExhausted(
                                f"{why}; it outgrew its tenant's quota while generating after "
                                f"{len(req.output)} tokens. Lower max_new_tokens or raise the quota"
                            ),
                        )
                        continue
                    if not a.quotas.allows(req.tenant, a.blocks_needed(held + need) - a.blocks_needed(held)):
                        # Its tenant's other requests hold the rest of the quota: give its share
                        # back (recompute) rather than hold it while waiting for theirs.
                        self.swapped.pop(0)
                        a.free(req.request_id)
                        req.num_computed = 0
                        req.status = RequestStatus.WAITING
                        bisect.insort(self.waiting, req, key=Request.sort_key)
                        continue
                swap_in.extend(a.swap_in(req.request_id))
                self.swapped.pop(0)
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                slots.append(self._reserve(req, n, need, with_ids=False))
                chosen.append(req)
                counts.append(n)
                budget -= n

        # 3. Waiting requests, admitted with room for their whole prompt. A request whose tenant
        #    is at its quota waits without holding up other tenants' requests behind it.
        if not preempted and not self.swapped:
            j = 0
            while j < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[j]
                total = len(req.tokens)
                problem = self._never_fits(req, total)
                if problem is not None:  # grown while others preempted it: it can never come back
                    self.waiting.pop(j)
                    self._fail(req, KVCacheExhausted(f"{problem}; lower max_new_tokens or give the cache more blocks"))
                    continue
                if not a.within_quota(total, req.tenant):
                    j += 1
                    continue
                if not a.can_allocate(total, tenant=req.tenant):
                    break
                # Cached tokens have no logits: a request that wants its prompt's logprobs
                # neither hits the prefix cache nor fills it (its length alone is allocated).
                prompt: Sequence[int] | int = len(req.tokens) if req.needs_prompt_logits else req.tokens
                cached = a.allocate(req.request_id, prompt, tenant=req.tenant)
                self.waiting.pop(j)
                req.num_computed = cached
                req.status = RequestStatus.RUNNING
                if req.t_first_scheduled is None:
                    req.t_first_scheduled = now
                    self._queue_wait.add(now - req.arrival)
                self.running.append(req)
                n = min(total - cached, budget)
                slots.append(a.slot_mapping(req.request_id, cached, cached + n))
                chosen.append(req)
                counts.append(n)
                budget -= n

        if swap_out and not chosen:
            # A step that runs no request carries no block moves: a runtime skips such a step
            # (ContinuousDecodeLoop.step_once does), and the swapped-out K/V would never reach
            # the CPU pool. This happens when the only request left running after a swap (for a
            # lowered max_num_seqs) ends at once, outgrown: the requests swapped out here are
            # recomputed instead.
            for req in swapped_here:
                self.swapped.remove(req)
                a.free(req.request_id)
                req.num_computed = 0
                req.status = RequestStatus.WAITING
                bisect.insort(self.waiting, req, key=Request.sort_key)
            swap_out = []
        samples = tuple(r.num_computed + n == len(r.tokens) for r, n in zip(chosen, counts, strict=True))
        copies = tuple(a.take_copies())
        if chosen:
            self._steps += 1
            self._batch_tokens += sum(counts)
        slot_mapping = np.concatenate(slots) if slots else np.empty(0, dtype=np.int64)
        return ScheduledStep(
            tuple(chosen), tuple(counts), samples, tuple(swap_out), tuple(swap_in), copies, slot_mapping
        )

    def _reserve(self, req: Request, n: int, need: int, *, with_ids: bool = True) -> np.ndarray:
        """Slots for a running request's next ``n`` tokens (from ``num_computed`` on), of which
        the last ``need`` are new to the allocator; with ``with_ids``, the allocator is told
        their ids (prefix caching)."""
        a = self.allocator
        rid = req.request_id
        if need <= 0:
            return a.slot_mapping(rid, req.num_computed, req.num_computed + n)
        start = a.num_tokens(rid)
        ids = req.tokens[start : start + need] if with_ids and a.enable_prefix_caching else None
        new = a.append_slots(rid, need, ids)
        if need == n:  # the usual case: the step computes exactly the tokens just reserved
            return new
        return a.slot_mapping(rid, req.num_computed, req.num_computed + n)

    # ------------------------------------------------------------------ results

    def update(
        self,
        step: ScheduledStep,
        sampled: Sequence[int],
        logprobs: Sequence[TokenLogprobs | None] | None = None,
    ) -> list[TokenEvent]:
        """Apply a step's results: one sampled token per sequence that sampled, in order (and,
        with ``logprobs``, each one's :class:`TokenLogprobs` or None, in the same order).

        Finished sequences leave at once and free their blocks. A token's event carries its
        logprobs, and the first token's the prompt's (``Request.prompt_logprobs``).

        Raises:
            ValueError: ``sampled`` does not hold one token per sampling sequence (nothing is
                changed).
        """
        wanted = sum(1 for s in step.samples if s)
        if len(sampled) != wanted:
            raise ValueError(f"update needs one sampled token per sequence that samples: {wanted}, got {len(sampled)}")
        now = self.clock.now()
        events = self.take_events()
        a = self.allocator
        prefix = a.enable_prefix_caching
        bs = a.block_size
        it = iter(sampled)
        lps = iter(logprobs) if logprobs is not None else None
        for req, n, samples in zip(step.requests, step.num_new_tokens, step.samples, strict=True):
            if req.status != RequestStatus.RUNNING:
                if samples:
                    next(it, None)  # aborted mid-step: drop its token
                    if lps is not None:
                        next(lps, None)
                continue
            was_prompt = req.num_computed < req.prompt_len
            before = req.num_computed
            req.num_computed += n
            if prefix and before // bs != req.num_computed // bs:
                # The step wrote these blocks' K/V: only now may they serve as prefix-cache hits.
                a.mark_computed(req.request_id, req.num_computed)
            if was_prompt:
                self._prompt_computed += min(req.num_computed, req.prompt_len) - before
            if not samples:
                continue
            token = next(it)
            token_lp = next(lps) if lps is not None else None
            req.tokens.append(token)
            req.output.append(token)
            self._generated += 1
            if req.t_last_token is None:
                self._ttft.add(now - req.arrival)
            else:
                self._tpot.add(now - req.t_last_token)
            req.t_last_token = now
            try:
                reason = self._stop_reason(req, token)
            except Exception as exc:  # noqa: BLE001 - the detokenize hook failed on this output: fail it alone
                self.running.remove(req)
                self.allocator.free(req.request_id)
                self._fail(req, exc)
                continue
            if reason is not None:
                self.running.remove(req)
                self.allocator.free(req.request_id)
                self._requests.pop(req.request_id, None)
                req.status = RequestStatus.FINISHED
                req.finish_reason = reason
                self._finished += 1
            if token_lp is None and not req.prompt_logprobs:
                events.append(TokenEvent(req.request_id, token, reason is not None, reason))
            else:
                prompt_lps, req.prompt_logprobs = tuple(req.prompt_logprobs), []
                events.append(TokenEvent(req.request_id, token, reason is not None, reason, None, token_lp, prompt_lps))
        return events + self.take_events()

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        if token in p.stop_token_ids:
            return "stop"
        if p.eos_token_id is not None and token == p.eos_token_id and not p.ignore_eos:
            return "eos"
        if p.stop and self.detokenize is not None:
            # A short window of the latest tokens is decoded, not the whole output (O(n^2) per
            # request); batchkit serve reads the text the same way, so both find the same stops.
            decoded = req.stop_text
            if decoded is None:
                decoded = req.stop_text = DecodedText(self.detokenize)
            pending = decoded.pending(req.output)
            start = max(0, len(decoded.text) - max(len(s) for s in p.stop))
            if find_stop(decoded.text + pending, p.stop, start) >= 0:
                return "stop"
            if pending and not pending.endswith("\ufffd"):
                decoded.commit(pending, len(req.output))
        if len(req.output) >= p.max_new_tokens:
            return "length"
        return None

    def tpot_samples(self, since: int = 0) -> tuple[list[float], int]:
        """Time-per-output-token samples (seconds) recorded after the first ``since`` (those still
        in the window), and the count to pass next time."""
        return self._tpot.since(since)

    def statistics(self) -> SchedulerStatistics:
        s = self.allocator.statistics()
        return SchedulerStatistics(
            waiting=len(self.waiting),
            running=len(self.running),
            swapped=len(self.swapped),
            finished=self._finished,
            aborted=self._aborted,
            expired=self._expired,
            steps=self._steps,
            preemptions=self._preemptions,
            generated_tokens=self._generated,
            prompt_tokens_computed=self._prompt_computed,
            kv_usage=s.usage,
            mean_batch_tokens=self._batch_tokens / self._steps if self._steps else 0.0,
            ttft=self._ttft.summary(),
            tpot=self._tpot.summary(),
            queue_wait=self._queue_wait.summary(),
            ttft_recent=self._ttft.recent(),
            tpot_recent=self._tpot.recent(),
            queue_wait_recent=self._queue_wait.recent(),
        )
