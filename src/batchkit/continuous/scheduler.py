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

Nothing here calls the model, sleeps, takes a lock or reads a clock of its own: the runtime
(``ContinuousDecodeLoop``) does, and tells ``add``, ``schedule`` and ``update`` the time (``now``;
left out, they read the scheduler's ``clock``). A request's life is :data:`TRANSITIONS`, one
table (``continuous/request.py``): it starts ``WAITING`` in ``add``, and from then on
:meth:`RequestQueues.move` (``continuous/queues.py``) alone moves it (through :meth:`Request.move`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from .._clock import Clock, checked_clock
from .._errors import KVCacheExhausted
from .._validate import positive_int, positive_int_or_none
from ..kv.allocator import PagedKVAllocator
from ..metrics import LatencySummary, SampleWindow
from .logprobs import TokenLogprobs
from .preemption import Preemption, PreemptionMode, is_held
from .queues import RequestQueues
from .request import Request, RequestStatus, ScheduledStep, StepPlan, TokenEvent, Transition
from .sampling import SamplingParams
from .stops import DecodedText, StopStrings

__all__ = ["PreemptionMode", "Scheduler", "SchedulerStatistics"]


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
        clock: the time ``add``, ``schedule`` and ``update`` read when they are not told
            ``now`` (arrivals, deadlines and the metrics).
        detokenize: ``detokenize(token_ids) -> str``, needed for stop strings.
        sliding_window: the window every layer of the model attends over (None: the whole past):
            a running request's blocks that fall out of it go back to the pool after each step.

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
        sliding_window: int | None = None,
    ) -> None:
        if not isinstance(allocator, PagedKVAllocator):
            raise TypeError(f"allocator must be a batchkit.PagedKVAllocator, got {allocator!r}")
        positive_int("max_num_seqs", max_num_seqs)
        positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {preemption_mode!r}")
        if preemption_mode == "swap" and allocator.num_cpu_blocks == 0:
            raise ValueError("preemption_mode='swap' needs an allocator with num_cpu_blocks > 0")
        positive_int_or_none("sliding_window", sliding_window)
        self.sliding_window = sliding_window
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.clock: Clock = checked_clock(clock)
        self.detokenize = detokenize
        self.queues = RequestQueues(allocator)  # the live requests and their one writer of moves
        self.waiting = self.queues.waiting  # sorted by (priority, arrival order)
        self.running = self.queues.running
        self.swapped = self.queues.swapped
        self.preemption = Preemption(self.queues, preemption_mode)  # who leaves when room runs out
        self._steps = 0
        self._generated = 0
        self._prompt_computed = 0
        self._batch_tokens = 0
        self._ttft = SampleWindow()
        self._tpot = SampleWindow()
        self._queue_wait = SampleWindow()

    @property
    def preemption_mode(self) -> PreemptionMode:
        """``"recompute"`` or ``"swap"``: how a preempted request leaves (the :class:`Preemption`'s)."""
        return self.preemption.mode

    # ------------------------------------------------------------------ requests

    def add(self, request: Request, now: float | None = None) -> None:
        """Queue a request that arrives at ``now`` (its ``arrival``; None: the scheduler's clock).

        Raises:
            TypeError: not a :class:`Request`, its ``params`` not a :class:`SamplingParams`, or
                its ``priority`` not an int, or its ``deadline`` not a number (or None).
            ValueError: a duplicate id or an empty prompt.
            KVCacheExhausted: the prompt can never be admitted (cache or tenant quota too small).
        """
        self._check_request(request)
        self.queues.add(request, self.clock.now() if now is None else now)

    def _check_request(self, request: Request) -> None:
        """Refuse, as :meth:`add` documents, a request this scheduler could never serve."""
        if not isinstance(request, Request):
            raise TypeError(f"add() takes a batchkit.continuous.Request, got {request!r}")
        rid = request.request_id
        if not isinstance(request.params, SamplingParams):
            raise TypeError(f"request {rid!r}: params must be a batchkit.SamplingParams, got {request.params!r}")
        if isinstance(request.priority, bool) or not isinstance(request.priority, int):
            raise TypeError(
                f"request {rid!r}: priority must be an int (lower is served first), got {request.priority!r}"
            )
        deadline = request.deadline
        if deadline is not None and (
            isinstance(deadline, bool) or not isinstance(deadline, numbers.Real) or math.isnan(deadline)
        ):
            raise TypeError(
                f"request {rid!r}: deadline must be a time on the scheduler's clock (a number) "
                f"or None, got {deadline!r}"
            )
        if self.queues.get(rid) is not None:
            raise ValueError(f"request id {rid!r} is already in use")
        if not request.tokens:
            raise ValueError("a prompt needs at least one token")
        if request.params.stop and self.detokenize is None:
            raise ValueError(
                f"request {rid!r} has stop strings {request.params.stop!r} but the scheduler has no "
                "detokenize hook to match them; pass detokenize= (token ids -> text) to the ContinuousDecodeLoop "
                "or Scheduler, or use stop_token_ids"
            )
        # The prompt must fit the cache above the watermark; a request that later outgrows the
        # whole cache on its own ends with KVCacheExhausted then.
        problem = self.queues.never_fits(request, request.prompt_len)
        if problem is not None:
            raise KVCacheExhausted(f"{problem}; shorten the prompt or give the cache more blocks")

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request wherever it is and free its blocks. False if it is not known (done)."""
        return self.queues.abort(request_id)

    def has_work(self) -> bool:
        return self.queues.has_work()

    def get(self, request_id: Hashable) -> Request | None:
        return self.queues.get(request_id)

    def take_events(self) -> list[TokenEvent]:
        """Events produced outside ``update`` (requests failed while scheduling)."""
        return self.queues.take_events()

    # ------------------------------------------------------------------ scheduling

    def schedule(self, now: float | None = None) -> ScheduledStep:
        """Decide the work of a step that starts at ``now`` (None: the scheduler's clock): it may
        preempt, swap and admit. Empty when nothing can run.

        Requests past their deadline are dropped first (their streams get
        :class:`DeadlineExceeded` through :meth:`take_events`). Then, in this order: the
        requests over ``max_num_seqs`` are preempted, a better-priority waiting request may
        preempt worse running ones, the running requests grow (preempting when blocks run
        out), swapped requests come back, and waiting ones are admitted.
        """
        now = self.clock.now() if now is None else now
        self.queues.expire(now)
        plan = StepPlan(self.max_num_batched_tokens)
        self.preemption.over_limit(plan, self.max_num_seqs)
        self.preemption.for_waiting(plan, self.max_num_seqs)
        self._grow_running(plan)
        self._bring_back_swapped(plan)
        self._admit_waiting(plan, now)
        self._recompute_lone_swaps(plan)
        return self._seal(plan)

    def _grow_running(self, plan: StepPlan) -> None:
        """Give each running request, best first, its next tokens within the budget, preempting
        the worst when blocks run out (:meth:`Preemption.make_room`)."""
        self.running.sort(key=Request.sort_key)
        if self._grow_decodes_at_once(plan):
            return
        i = 0
        while i < len(self.running) and plan.budget > 0:
            if self._grow_one(plan, self.running[i]):
                i += 1
            # else the list changed (the request ended, or a later one was preempted): look again

    def _grow_decodes_at_once(self, plan: StepPlan) -> bool:
        """The common case as one vectorised allocator call: every running request decodes one
        token, and there is room for all. False (nothing done) when it is not the case."""
        a = self.allocator
        decoding = [r for r in self.running if len(r.tokens) - r.num_computed == 1]
        if not decoding or len(decoding) != len(self.running) or len(decoding) > plan.budget or a.has_quotas:
            return False
        handle = a.batch([r.request_id for r in decoding])
        # A request whose prefill stopped one token short already holds that token's slot: then
        # the per-request path runs, which reserves nothing for it. The allocator holds at least
        # each request's computed tokens, so equal sums mean none is ahead.
        if int(a.tables.lens[handle.rows].sum()) != sum([r.num_computed for r in decoding]):
            return False
        if a.blocks_needed_batch(handle) > a.num_free_blocks:
            return False
        ids = [r.tokens[-1] for r in decoding] if a.enable_prefix_caching else None
        plan.slots.append(a.append_slots_batch(handle, ids))
        plan.requests.extend(decoding)
        plan.counts.extend([1] * len(decoding))
        plan.scheduled.update(id(r) for r in decoding)
        plan.budget -= len(decoding)
        return True

    def _grow_one(self, plan: StepPlan, req: Request) -> bool:
        """Schedule a running request's next tokens (a decode, or its prompt's next chunk); False
        if it did not fit and :meth:`Preemption.make_room` changed the running list instead."""
        a = self.allocator
        n = min(len(req.tokens) - req.num_computed, plan.budget)
        need = req.num_computed + n - a.num_tokens(req.request_id)
        if need > 0 and not a.can_append_slots([req.request_id], need):
            self.preemption.make_room(plan, req, need)
            return False
        plan.take(req, n, self._reserve(req, n, need))
        return True

    def _bring_back_swapped(self, plan: StepPlan) -> None:
        """Swap requests back in, oldest swapped first, unless this step preempted any."""
        if plan.preempted:
            return
        while self.swapped and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            if not self._bring_back_one(plan, self.swapped[0]):
                break

    def _bring_back_one(self, plan: StepPlan, req: Request) -> bool:
        """Swap ``req`` in and schedule its next tokens, or, when its tenant's quota stands in
        the way, recompute or end it; False if the blocks have no room for it yet."""
        a = self.allocator
        n = min(len(req.tokens) - req.num_computed, plan.budget)
        held = a.num_tokens(req.request_id)
        need = req.num_computed + n - held
        # Room for its blocks and this step's tokens, and a block to grow into while others run
        # (with nothing running, what it needs is enough: it held no more than the pool less its
        # preemptor's blocks, so it always fits alone).
        if a.num_free_blocks < a.blocks_needed(held + max(need, 0)) + (1 if self.running else 0):
            return False
        quota = a.quota_of(req.tenant)
        if quota is not None and need > 0:
            # A swapped-out sequence keeps its blocks' share of its tenant's quota; the blocks
            # its next tokens take must fit the quota too.
            if a.blocks_needed(held + need) > quota:  # never: end it, as a running one
                why = self.queues.never_fits(req, len(req.tokens)) or f"request {req.request_id!r}"
                self.queues.fail(
                    req,
                    KVCacheExhausted(
                        f"{why}; it outgrew its tenant's quota while generating after "
                        f"{len(req.output)} tokens. Lower max_new_tokens or raise the quota"
                    ),
                )
                return True
            if not a.quotas.allows(req.tenant, a.blocks_needed(held + need) - a.blocks_needed(held)):
                # Its tenant's other requests hold the rest of the quota: give its share back
                # (recompute) rather than hold it while waiting for theirs.
                self.queues.move(req, Transition.RECOMPUTE)
                return True
        plan.swap_in.extend(a.swap_in(req.request_id))
        self.queues.move(req, Transition.SWAP_IN)
        plan.take(req, n, self._reserve(req, n, need, with_ids=False))
        return True

    def _admit_waiting(self, plan: StepPlan, now: float) -> None:
        """Admit waiting requests, best first, each with room for its whole prompt, unless this
        step preempted any or swapped requests wait to come back. A request whose tenant is at
        its quota waits without holding up other tenants' requests behind it."""
        if plan.preempted or self.swapped:
            return
        if self._admit_from(plan, now, held=False):
            self._admit_from(plan, now, held=True)  # the seats no one else took

    def _admit_from(self, plan: StepPlan, now: float, *, held: bool) -> bool:
        """Admit, best first, the waiting requests that are (or are not) :func:`is_held`; whether
        it passed over one of the others."""
        a = self.allocator
        j = 0
        passed = False
        while j < len(self.waiting) and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[j]
            if is_held(req) is not held:
                passed = True
                j += 1
                continue
            total = len(req.tokens)
            problem = self.queues.never_fits(req, total)
            if problem is not None:  # grown while others preempted it: it can never come back
                self.queues.fail(
                    req, KVCacheExhausted(f"{problem}; lower max_new_tokens or give the cache more blocks")
                )
                continue
            if not a.within_quota(total, req.tenant):
                j += 1
                continue
            if self._waits_for_its_prompt(req):
                j += 1  # its prompt's blocks are being computed by the request it follows
                continue
            if not a.can_allocate(total, tenant=req.tenant):
                return True  # out of room: the held pass may still fit a smaller request
            self._admit(plan, req, now)
        return passed

    def _waits_for_its_prompt(self, req: Request) -> bool:
        """Whether ``req`` follows a live request (``req.after``) still computing the same prompt,
        whose full blocks the prefix cache will then hand it."""
        lead = req.after
        return (
            lead is not None
            and self.allocator.enable_prefix_caching
            and self.queues.is_live(lead)
            and lead.num_computed < lead.prompt_len
        )

    def _admit(self, plan: StepPlan, req: Request, now: float) -> None:
        """Allocate a waiting request's prompt, start it at ``now`` and schedule its first chunk."""
        a = self.allocator
        # Cached tokens have no logits: a request that wants its prompt's logprobs neither hits
        # the prefix cache nor fills it (its length alone is allocated).
        prompt: Sequence[int] | int = len(req.tokens) if req.needs_prompt_logits else req.tokens
        cached = a.allocate(req.request_id, prompt, tenant=req.tenant)
        req.after = req.displaced_by = None
        self.queues.move(req, Transition.ADMIT)
        req.num_computed = cached
        if req.t_first_scheduled is None:
            req.t_first_scheduled = now
            self._queue_wait.add(now - req.arrival)
        n = min(len(req.tokens) - cached, plan.budget)
        plan.take(req, n, a.slot_mapping(req.request_id, cached, cached + n))

    def _recompute_lone_swaps(self, plan: StepPlan) -> None:
        """Recompute, instead, the requests this step swapped out when it runs no request.

        A step that runs no request carries no block moves: a runtime skips such a step
        (ContinuousDecodeLoop.step_once does), and the swapped-out K/V would never reach the CPU
        pool. This happens when the only request left running after a swap (for a lowered
        max_num_seqs) ends at once, outgrown.
        """
        if not plan.swap_out or plan.requests:
            return
        for req in plan.swapped_here:
            self.queues.move(req, Transition.RECOMPUTE)
        plan.swap_out.clear()

    def _seal(self, plan: StepPlan) -> ScheduledStep:
        """The step ``plan`` holds, with the allocator's pending copies; counted if it runs anything."""
        samples = tuple(r.num_computed + n == len(r.tokens) for r, n in zip(plan.requests, plan.counts, strict=True))
        copies = tuple(self.allocator.take_copies())
        if plan.requests:
            self._steps += 1
            self._batch_tokens += sum(plan.counts)
        slot_mapping = np.concatenate(plan.slots) if plan.slots else np.empty(0, dtype=np.int64)
        return ScheduledStep(
            tuple(plan.requests),
            tuple(plan.counts),
            samples,
            tuple(plan.swap_out),
            tuple(plan.swap_in),
            copies,
            slot_mapping,
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
        now: float | None = None,
    ) -> list[TokenEvent]:
        """Apply the results of a step that ended at ``now`` (None: the scheduler's clock): one
        sampled token per sequence that sampled, in order (and, with ``logprobs``, each one's
        :class:`TokenLogprobs` or None, in the same order).

        Finished sequences leave at once and free their blocks. A token's event carries its
        logprobs, and the first token's the prompt's (``Request.prompt_logprobs``).

        Raises:
            ValueError: ``sampled`` does not hold one token per sampling sequence (nothing is
                changed).
        """
        wanted = sum(1 for s in step.samples if s)
        if len(sampled) != wanted:
            raise ValueError(f"update needs one sampled token per sequence that samples: {wanted}, got {len(sampled)}")
        now = self.clock.now() if now is None else now
        events = self.take_events()
        it = iter(sampled)
        lps = iter(logprobs) if logprobs is not None else None
        for req, n, samples in zip(step.requests, step.num_new_tokens, step.samples, strict=True):
            if req.status != RequestStatus.RUNNING:
                if samples:
                    next(it, None)  # aborted mid-step: drop its token
                    if lps is not None:
                        next(lps, None)
                continue
            self._computed(req, n)
            if samples:
                event = self._sampled(req, next(it), next(lps) if lps is not None else None, now)
                if event is not None:
                    events.append(event)
        return events + self.take_events()

    def _computed(self, req: Request, n: int) -> None:
        """Record that a step wrote the K/V of a running request's next ``n`` tokens."""
        a = self.allocator
        was_prompt = req.num_computed < req.prompt_len
        before = req.num_computed
        req.num_computed += n
        if a.enable_prefix_caching and before // a.block_size != req.num_computed // a.block_size:
            # The step wrote these blocks' K/V: only now may they serve as prefix-cache hits.
            a.mark_computed(req.request_id, req.num_computed)
        window = self.sliding_window
        if window is not None:
            # The next token, at position num_computed, sees only the window's last positions:
            # a block wholly before them is read by no later step.
            first = req.num_computed + 1 - window
            if first >= a.block_size and max(before + 1 - window, 0) // a.block_size < first // a.block_size:
                a.release_before(req.request_id, first)
        if was_prompt:
            self._prompt_computed += min(req.num_computed, req.prompt_len) - before

    def _sampled(self, req: Request, token: int, token_lp: TokenLogprobs | None, now: float) -> TokenEvent | None:
        """Append a token sampled at ``now`` to a running request and end it if it stops there;
        its event (None when the request failed instead: that event waits in :meth:`take_events`)."""
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
            self.queues.fail(req, exc)
            return None
        if reason is not None:
            self.queues.move(req, Transition.FINISH)
            req.finish_reason = reason
        if token_lp is None and not req.prompt_logprobs:
            return TokenEvent(req.request_id, token, reason is not None, reason)
        prompt_lps, req.prompt_logprobs = tuple(req.prompt_logprobs), []
        return TokenEvent(req.request_id, token, reason is not None, reason, None, token_lp, prompt_lps)

    def _stop_reason(self, req: Request, token: int) -> str | None:
        p = req.params
        stopping = len(req.output) >= p.min_tokens  # before min_tokens, nothing but the limit ends it
        if stopping and token in p.stop_token_ids:
            return "stop"
        if stopping and p.eos_token_id is not None and token == p.eos_token_id and not p.ignore_eos:
            return "eos"
        if p.stop and self.detokenize is not None:
            # A short window of the latest tokens is decoded, not the whole output (O(n^2) per
            # request); batchkit serve reads the text and finds stops the same way (stops.py).
            decoded, stops = req.stop_text, req.stop_strings
            if decoded is None or stops is None:
                decoded = req.stop_text = DecodedText(self.detokenize)
                stops = req.stop_strings = StopStrings(p.stop, p.min_tokens)
            pending = decoded.pending(req.output)
            if stops.find(decoded.text + pending, len(req.output), searched=len(decoded.text)) >= 0:
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
            finished=self.queues.finished,
            aborted=self.queues.aborted,
            expired=self.queues.expired,
            steps=self._steps,
            preemptions=self.preemption.count,
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
