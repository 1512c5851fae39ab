"""Continuous batching under randomised traffic: shared prompt prefixes with prefix caching, a KV
pool small enough to force preemption (recompute and swap), random aborts, priorities and
deadlines on a MockClock, and close() while requests run.

The step function is a fake model that reads its context back from the paged KV cache: it writes
each new token's id and position as its K/V, gathers every scheduled sequence's pages, checks
that they hold exactly the sequence's tokens at their positions, and returns one-hot logits for
a hash of the context it read. So a block served from the prefix cache, swapped or reused with
the wrong content changes the tokens a request generates, and is reported at the step where it
is read. Every case is seeded and deterministic.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from batchkit import (
    BatcherClosed,
    ContinuousDecodeLoop,
    DeadlineExceeded,
    KVCacheExhausted,
    PagedKVAllocator,
    PagedKVCache,
    SamplingParams,
    Scheduler,
)
from batchkit.continuous import Request, RequestStatus, StepBatch, TokenEvent
from batchkit.testing import MockClock

torch = pytest.importorskip("torch")

VOCAB = 40
EOS = 3
BS = 4
WAIT = 30


def next_token(context: Sequence[int]) -> int:
    """The fake model's greedy choice: a hash of the whole context."""
    h = 17
    for t in context:
        h = (h * 31 + t + 1) % 1_000_003
    return h % VOCAB


def greedy_reference(prompt: Sequence[int], params: SamplingParams) -> list[int]:
    """What a greedy request generates on the fake model with nothing in its way."""
    ctx = list(prompt)
    out: list[int] = []
    while len(out) < params.max_new_tokens:
        t = next_token(ctx)
        ctx.append(t)
        out.append(t)
        if t in params.stop_token_ids or (params.eos_token_id is not None and t == params.eos_token_id):
            break
    return out


class ReadbackStep:
    """A fake model: writes K = (id + 1, position + 1) and V = (position + 1, id + 1) for every
    new token, reads every scheduled sequence's context back from the pages, and samples from
    one-hot-ish logits at ``next_token(context read back)``.

    A context that does not hold the sequence's own tokens at their positions is recorded in
    ``problems`` (``tokens_of(request_id)`` gives the tokens the request holds now).
    """

    def __init__(self, margin: float = 2.0, after: Callable[[int], None] | None = None) -> None:
        self.margin = margin
        self.after = after  # called with the number of calls so far, at the end of each
        self.tokens_of: Callable[[Hashable], list[int]] = lambda rid: []
        self.problems: list[str] = []
        self.calls = 0

    def __call__(self, batch: StepBatch, kv: PagedKVCache) -> Any:
        self.calls += 1
        ids = batch.input_ids.to(torch.float32) + 1
        pos = batch.positions.to(torch.float32) + 1
        kv.scatter(
            0, torch.stack((ids, pos), 1).view(-1, 1, 2), torch.stack((pos, ids), 1).view(-1, 1, 2), batch.slot_mapping
        )
        keys, values = kv.gather(0, batch.block_tables, batch.seq_lens)
        rows: list[int] = []
        start = 0
        for i, rid in enumerate(batch.seq_ids):
            n = int(batch.seq_lens[i])
            k = keys[start : start + n, 0].to(torch.int64) - 1
            v = values[start : start + n, 0].to(torch.int64) - 1
            start += n
            ctx = k[:, 0].tolist()
            want = list(self.tokens_of(rid))[:n]
            if ctx != want or k[:, 1].tolist() != list(range(n)) or not torch.equal(v.flip(1), k):
                self.problems.append(
                    f"call {self.calls}: request {rid!r} read ids {ctx} at positions {k[:, 1].tolist()}, holds {want}"
                )
            if batch.sampling[i]:
                rows.append(next_token(ctx))
        logits = torch.full((len(rows), VOCAB), -self.margin)
        if rows:
            logits[torch.arange(len(rows)), torch.tensor(rows)] = self.margin
        if self.after is not None:
            self.after(self.calls)
        return logits


def make_loop(
    step: ReadbackStep, num_blocks: int, *, clock: MockClock | None = None, block_size: int = BS, **kw: Any
) -> ContinuousDecodeLoop:
    kv = PagedKVCache(1, num_blocks, block_size, 1, 2)
    kv.key(0).fill_(-1.0)  # never written: reads back as id -2, position -2
    kv.value(0).fill_(-1.0)
    loop = ContinuousDecodeLoop(step, kv, clock=clock or MockClock(), **kw)

    def tokens_of(rid: Hashable) -> list[int]:
        req = loop.scheduler.get(rid)
        return [] if req is None else req.tokens

    step.tokens_of = tokens_of
    return loop


def check_pool(loop: ContinuousDecodeLoop) -> None:
    """The allocator's public counters agree with each other and with the live sequences."""
    a = loop.allocator
    s = a.statistics()
    assert s.free_blocks + s.used_blocks + s.cached_blocks == s.total_blocks, s
    held: Counter[int] = Counter()
    cpu_held = 0
    for sid in a:
        if a.is_swapped(sid):
            cpu_held += a.blocks_needed(a.num_tokens(sid))
        else:
            table = a.block_table(sid).tolist()
            assert len(table) == a.blocks_needed(a.num_tokens(sid))
            assert 0 not in table, f"sequence {sid!r} holds the null block"
            held.update(table)
    refs = {b: a.ref_count(b) for b in range(1, a.num_blocks)}
    assert min(refs.values()) >= 0, "a negative reference count"
    assert {b: r for b, r in refs.items() if r} == dict(held), "reference counts differ from the block tables"
    assert s.used_blocks == len(held)
    assert s.cpu_free_blocks + cpu_held == s.cpu_total_blocks
    st = loop.scheduler.statistics()
    assert st.running + st.swapped == len(a) == s.num_seqs
    assert st.swapped == sum(1 for sid in a if a.is_swapped(sid))


# --------------------------------------------------------------------------- randomised traffic


@dataclass
class Spec:
    rid: int
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrive: int  # step number
    deadline_in: float | None  # seconds after arrival; the clock moves 1 s per step
    abort_at: int | None  # step number
    abort_in_scheduler: bool  # Scheduler.abort (no event) rather than loop.abort ("abort" event)
    tenant: str | None


def make_traffic(seed: int, n: int = 36) -> list[Spec]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, VOCAB) for _ in range(rng.choice((4, 8, 12)))] for _ in range(3)]
    specs: list[Spec] = []
    for rid in range(n):
        kind = rng.random()
        suffix = [rng.randrange(4, VOCAB) for _ in range(rng.randrange(0, 5))]
        greedy_before = [s for s in specs if s.params.greedy]
        if kind < 0.55:
            prompt = rng.choice(prefixes) + suffix
        elif kind < 0.7 and specs:
            prompt = list(rng.choice(specs).prompt)  # the same prompt again
        elif kind < 0.85 and greedy_before:
            # A prompt that continues another request's prompt with its output: its blocks
            # are served from the other request's generated (then cached) blocks.
            other = rng.choice(greedy_before)
            done = greedy_reference(other.prompt, other.params)
            prompt = other.prompt + done[: rng.randrange(0, len(done) + 1)] + suffix
        else:
            prompt = [rng.randrange(4, VOCAB) for _ in range(rng.randrange(1, 14))]
        prompt = prompt[:20] or [5]
        sampling: dict[str, Any] = {"max_new_tokens": rng.randrange(1, 24)}
        if rng.random() < 0.5:
            sampling["eos_token_id"] = EOS
        if rng.random() < 0.15:
            sampling["stop_token_ids"] = (rng.randrange(4, VOCAB),)
        if rng.random() < 0.2:
            sampling.update(temperature=1.0, seed=rng.randrange(1000))
        arrive = rng.randrange(0, 25)
        abort_at = arrive + rng.randrange(0, 25) if rng.random() < 0.2 else None
        specs.append(
            Spec(
                rid,
                prompt,
                SamplingParams(**sampling),
                priority=rng.randrange(0, 3),
                arrive=arrive,
                deadline_in=float(rng.randrange(1, 40)) if rng.random() < 0.2 else None,
                abort_at=abort_at,
                abort_in_scheduler=rng.random() < 0.5,
                tenant=rng.choice((None, "a", "b")),
            )
        )
    return specs


@dataclass
class Outcome:
    outputs: dict[Hashable, list[int]]
    ends: dict[Hashable, str]  # finish reason, "abort" (either way), or the error's class name
    refused: set[Hashable]
    loop: ContinuousDecodeLoop
    step: ReadbackStep


def run_traffic(
    specs: list[Spec],
    *,
    reference: bool = False,
    limits: dict[int, int] | None = None,
    block_size: int = BS,
    **loop_kw: Any,
) -> Outcome:
    """Drive the loop with step_once(): arrivals, aborts and deadlines at their steps, batch
    limits (``set_batch_limit``, as an AdaptiveTuner sets them) from ``limits``' steps on, the
    invariants checked after every step."""
    clock = MockClock()
    step_fn = ReadbackStep()
    if reference:  # room for everything, nothing in the way
        loop_kw = {"max_num_seqs": len(specs), "max_num_batched_tokens": 4096}
        loop = make_loop(step_fn, 2048 // block_size, clock=clock, block_size=block_size, **loop_kw)
    else:
        loop = make_loop(step_fn, clock=clock, block_size=block_size, **loop_kw)
    sched = loop.scheduler
    budget = sched.max_num_batched_tokens
    arrivals: dict[int, list[Spec]] = {}
    aborts: dict[int, list[Spec]] = {}
    for s in specs:
        arrivals.setdefault(0 if reference else s.arrive, []).append(s)
        if s.abort_at is not None and not reference:
            aborts.setdefault(s.abort_at, []).append(s)
    last = max([*arrivals, *aborts])
    outputs: dict[Hashable, list[int]] = {}
    ends: dict[Hashable, str] = {}
    refused: set[Hashable] = set()
    added = 0
    for step_no in range(5_000):
        for s in arrivals.get(step_no, []):
            deadline = None if s.deadline_in is None or reference else clock.now() + s.deadline_in
            try:
                sched.add(Request(s.rid, s.prompt, s.params, priority=s.priority, tenant=s.tenant, deadline=deadline))
            except KVCacheExhausted:
                refused.add(s.rid)
            else:
                added += 1
        for s in aborts.get(step_no, []):
            if s.abort_in_scheduler:
                if sched.abort(s.rid):
                    assert s.rid not in ends, f"request {s.rid} aborted after its end"
                    ends[s.rid] = "abort"
            else:
                loop.abort(s.rid)  # reported by the next step_once() if still live
        if limits and step_no in limits:
            loop.set_batch_limit(limits[step_no])
        if step_no > last and not sched.has_work():
            break
        step, events = loop.step_once()
        clock.advance(1.0)
        assert step.num_tokens <= budget
        assert len(step.requests) <= sched.max_num_seqs
        assert sched.statistics().running <= sched.max_num_seqs
        # step_once() performs a step's block moves only when the step runs requests.
        assert step.requests or not (step.swap_out or step.swap_in or step.copies), step
        for ev in events:
            assert ev.request_id not in ends, f"an event for request {ev.request_id} after its end: {ev}"
            if ev.token is not None:
                outputs.setdefault(ev.request_id, []).append(ev.token)
            if ev.finished:
                ends[ev.request_id] = type(ev.error).__name__ if ev.error is not None else str(ev.finish_reason)
            else:
                assert ev.error is None
                assert ev.token is not None
        check_pool(loop)
        st = sched.statistics()
        assert st.waiting + st.running + st.swapped == added - len(ends), "a request neither live nor ended"
    else:
        raise AssertionError(f"the loop stopped making progress: {sched.statistics()}")
    assert not step_fn.problems, step_fn.problems[:5]
    return Outcome(outputs, ends, refused, loop, step_fn)


QUOTAS = {"a": 6, "b": 0.5}

CASES = [
    # seed, preemption mode, prefix caching, num_blocks, num_cpu_blocks, budget, max_num_seqs, watermark, quotas,
    # block_size
    (1, "recompute", True, 14, 0, 16, 6, 0.0, None, 4),
    (2, "swap", True, 14, 24, 16, 6, 0.0, None, 4),
    (3, "recompute", True, 12, 0, 8, 8, 0.1, None, 4),
    (4, "swap", True, 12, 6, 12, 8, 0.0, None, 4),  # a CPU pool too small at times: recompute instead
    (5, "swap", True, 16, 40, 24, 4, 0.0, None, 4),
    (6, "recompute", False, 13, 0, 16, 6, 0.0, None, 4),
    (7, "swap", False, 13, 20, 16, 6, 0.0, None, 4),
    (8, "recompute", True, 10, 0, 32, 3, 0.0, None, 4),
    (9, "swap", True, 10, 16, 32, 5, 0.1, None, 4),
    (10, "swap", True, 18, 30, 6, 8, 0.0, None, 4),
    (11, "recompute", True, 16, 0, 16, 6, 0.0, QUOTAS, 4),
    (12, "swap", True, 16, 24, 16, 6, 0.0, QUOTAS, 4),
    (9007, "swap", False, 4, 8, 32, 4, 0.1, None, 8),  # 3 blocks of 8: a swapped request needs them all
    (14, "swap", True, 30, 16, 8, 6, 0.0, None, 2),
    (15, "recompute", True, 28, 0, 12, 5, 0.1, QUOTAS, 2),
]


@pytest.mark.parametrize(
    ("seed", "mode", "prefix", "blocks", "cpu", "budget", "seqs", "watermark", "quotas", "bs"), CASES
)
def test_random_traffic_keeps_every_promise(
    seed: int,
    mode: str,
    prefix: bool,
    blocks: int,
    cpu: int,
    budget: int,
    seqs: int,
    watermark: float,
    quotas: dict[Hashable, int | float] | None,
    bs: int,
) -> None:
    """Every request ends exactly once; no block leaks, reference counts match the block tables
    at every step; every step reads back exactly its sequences' tokens; a request that ran to
    its end generated what it generates alone in a big cache (preemption, swap, prefix hits and
    neighbours change no token, greedy or seeded); one cut short generated a prefix of it; and
    the scheduler's counters add up."""
    specs = make_traffic(seed)
    ref = run_traffic(specs, reference=True, block_size=bs)
    assert ref.loop.scheduler.statistics().preemptions == 0
    assert not ref.refused
    for s in specs:
        assert ref.ends[s.rid] in ("length", "eos", "stop"), (s.rid, ref.ends[s.rid])
        if s.params.greedy:
            assert ref.outputs[s.rid] == greedy_reference(s.prompt, s.params), s.rid

    rng = random.Random(-seed)
    limits = {rng.randrange(60): rng.randrange(1, seqs + 1) for _ in range(3)}
    out = run_traffic(
        specs,
        limits=limits,
        block_size=bs,
        num_blocks=blocks,
        preemption_mode=mode,
        num_cpu_blocks=cpu,
        enable_prefix_caching=prefix,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        watermark=watermark,
        tenant_quotas=quotas,
    )
    loop, a = out.loop, out.loop.allocator
    for s in specs:
        room = a.total_blocks - a.watermark_blocks
        quota = a.quota_of(s.tenant)
        room = room if quota is None else min(room, quota)
        if s.rid in out.refused:
            assert a.blocks_needed(len(s.prompt) + 1) > room, f"request {s.rid} refused but fits"
            continue
        assert s.rid in out.ends, f"request {s.rid} never ended"
        got, want = out.outputs.get(s.rid, []), ref.outputs[s.rid]
        end = out.ends[s.rid]
        if end in ("length", "eos", "stop"):
            assert got == want, f"request {s.rid} ({end}) generated {got}, alone {want}"
        else:
            assert got == want[: len(got)], f"request {s.rid} ({end}) generated {got}, alone {want}"
            assert end in ("abort", "DeadlineExceeded", "KVCacheExhausted"), (s.rid, end)
            if end == "abort":
                assert s.abort_at is not None
            if end == "DeadlineExceeded":
                assert s.deadline_in is not None
            if end == "KVCacheExhausted":  # only a request that can outgrow the cache
                assert a.blocks_needed(len(s.prompt) + len(want)) > room, f"request {s.rid} outgrew a cache it fits"

    # Nothing leaks: every block is free or cached, the CPU pool is whole.
    s_end = a.statistics()
    assert (s_end.used_blocks, s_end.num_seqs, len(a)) == (0, 0, 0)
    assert s_end.free_blocks + s_end.cached_blocks == s_end.total_blocks
    assert s_end.cpu_free_blocks == s_end.cpu_total_blocks
    assert all(a.ref_count(b) == 0 for b in range(1, a.num_blocks))

    # The counters add up.
    st = loop.scheduler.statistics()
    added = len(specs) - len(out.refused)
    reasons = Counter(out.ends.values())
    assert (st.waiting, st.running, st.swapped) == (0, 0, 0)
    assert st.finished + st.aborted == added, (st, reasons)
    assert st.aborted == reasons["abort"], (st, reasons)
    assert st.expired == reasons["DeadlineExceeded"], (st, reasons)
    assert st.generated_tokens == sum(len(v) for v in out.outputs.values())
    # The case is meant to stress: the pool forced preemptions (swaps in swap mode).
    assert st.preemptions > 0, "not a stress case: nothing was preempted"
    if mode == "swap" and cpu >= 16:
        assert s_end.swaps_out > 0, "not a stress case: nothing was swapped out"


# --------------------------------------------------------------------------- close() mid-traffic


@pytest.mark.parametrize(("seed", "mode", "close_after"), [(11, "swap", 40), (12, "recompute", 25), (13, "swap", 60)])
def test_close_while_requests_run_ends_each_once_and_frees_everything(seed: int, mode: str, close_after: int) -> None:
    """submit() traffic with shared prefixes, priorities, cancellations and deadlines on a
    cache that forces preemption: close() from the caller's thread while the engine steps.
    Every future resolves once (its full greedy output, DeadlineExceeded, BatcherClosed or
    cancelled), every block comes back, and finished + aborted counts every request."""
    clock = MockClock()
    stepped = threading.Event()

    def after(calls: int) -> None:
        clock.advance(1.0)
        if calls == close_after:
            stepped.set()

    step_fn = ReadbackStep(after=after)
    loop = make_loop(
        step_fn,
        14,
        clock=clock,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        preemption_mode=mode,
        num_cpu_blocks=24 if mode == "swap" else 0,
        watermark=0.0,
    )
    rng = random.Random(seed)
    prefix = [rng.randrange(4, VOCAB) for _ in range(8)]
    futures = []
    for i in range(40):
        prompt = prefix + [rng.randrange(4, VOCAB) for _ in range(rng.randrange(0, 5))]
        max_new = rng.randrange(1, 16)
        deadline = float(rng.randrange(5, 60)) if i % 5 == 0 else None
        fut = loop.submit(
            prompt, priority=rng.randrange(3), deadline_s=deadline, max_new_tokens=max_new, eos_token_id=EOS
        )
        futures.append((prompt, SamplingParams(max_new_tokens=max_new, eos_token_id=EOS), fut))
    for _, _, fut in futures[3::7]:
        fut.cancel()
    assert stepped.wait(WAIT), "the engine did not step"
    loop.close(timeout=WAIT)
    kinds: Counter[str] = Counter()
    for prompt, params, fut in futures:
        assert fut.done()
        if fut.cancelled():
            kinds["cancelled"] += 1
            continue
        exc = fut.exception(timeout=0)
        if exc is None:
            assert fut.result() == greedy_reference(prompt, params)
            kinds["done"] += 1
        else:
            assert isinstance(exc, DeadlineExceeded | BatcherClosed), exc
            kinds[type(exc).__name__] += 1
    assert not step_fn.problems, step_fn.problems[:5]
    check_pool(loop)
    s = loop.allocator.statistics()
    assert (s.used_blocks, s.num_seqs, s.cpu_free_blocks) == (0, 0, s.cpu_total_blocks)
    st = loop.scheduler.statistics()
    assert (st.waiting, st.running, st.swapped) == (0, 0, 0)
    assert st.finished + st.aborted == len(futures), (st, kinds)
    assert kinds["done"] > 0


# --------------------------------------------------------------------------- tenants at their quota


def drive(loop: ContinuousDecodeLoop, max_steps: int) -> tuple[dict[Hashable, list[int]], dict[Hashable, TokenEvent]]:
    """Step ``loop`` until it has no work (at most ``max_steps``): each request's tokens, and the
    event that ended it."""
    out: dict[Hashable, list[int]] = {}
    ends: dict[Hashable, TokenEvent] = {}
    for _ in range(max_steps):
        if not loop.scheduler.has_work():
            break
        _, events = loop.step_once()
        for ev in events:
            if ev.token is not None:
                out.setdefault(ev.request_id, []).append(ev.token)
            if ev.finished:
                ends[ev.request_id] = ev
    return out, ends


def _step_all(sched: Scheduler, token: int = 7) -> tuple[Any, list[TokenEvent]]:
    """One schedule/update round of a sans-I/O scheduler, every sampling request drawing ``token``."""
    step = sched.schedule()
    return step, sched.update(step, [token] * sum(step.samples))


def test_a_request_over_its_tenants_quota_preempts_no_other_tenants_request() -> None:
    """A request that needs a block its tenant's quota can never give it ends with
    KVCacheExhausted, and the other tenant's request running beside it is left alone (it was
    preempted first, for blocks that could not help)."""
    a = PagedKVAllocator(17, block_size=4, tenant_quotas={"t": 3})
    sched = Scheduler(a, max_num_batched_tokens=64)
    sched.add(Request("t", list(range(1, 9)), SamplingParams(max_new_tokens=20), tenant="t"))
    sched.add(Request("u", [1, 2, 3, 4], SamplingParams(max_new_tokens=30), priority=1, tenant="u"))
    ended: dict[Hashable, TokenEvent] = {}
    for _ in range(10):
        _, events = _step_all(sched)
        ended.update((ev.request_id, ev) for ev in events if ev.finished)
        if "t" in ended:
            break
    assert isinstance(ended["t"].error, KVCacheExhausted)
    assert "quota" in str(ended["t"].error)
    u = sched.get("u")
    assert u is not None
    assert u.status is RequestStatus.RUNNING
    assert sched.statistics().preemptions == 0


def test_a_tenant_short_of_quota_preempts_its_own_worst_request_not_another_tenants() -> None:
    """When a running request's next block would take its tenant over quota (the pool has room),
    the request preempted is the worst of that tenant's own, not a worse-priority request of
    another tenant (whose blocks count against another quota)."""
    a = PagedKVAllocator(33, block_size=4, tenant_quotas={"t": 5})
    sched = Scheduler(a, max_num_batched_tokens=64)
    sched.add(Request("t1", list(range(1, 9)), SamplingParams(max_new_tokens=8), tenant="t"))
    sched.add(Request("t2", [1, 2, 3, 4], SamplingParams(max_new_tokens=30), priority=1, tenant="t"))
    sched.add(Request("u", [1, 2, 3, 4], SamplingParams(max_new_tokens=30), priority=2, tenant="u"))
    for _ in range(10):
        _step_all(sched)
        if sched.statistics().preemptions:
            break
    assert sched.statistics().preemptions == 1
    statuses = {rid: r.status for rid in ("t1", "t2", "u") if (r := sched.get(rid)) is not None}
    assert statuses == {"t1": RequestStatus.RUNNING, "t2": RequestStatus.WAITING, "u": RequestStatus.RUNNING}
    while sched.has_work():
        _step_all(sched)
    assert a.statistics().used_blocks == 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_tenant_at_its_quota_leaves_other_tenants_kv_intact(mode: str) -> None:
    """Through the loop (swap: the other tenant's request was swapped out in a step that ran no
    request, so its K/V never reached the CPU pool and came back as garbage): every request
    reads back its own tokens and generates what it generates alone."""
    step_fn = ReadbackStep()
    loop = make_loop(
        step_fn,
        17,
        tenant_quotas={"t": 3},
        preemption_mode=mode,
        num_cpu_blocks=16 if mode == "swap" else 0,
        watermark=0.0,
    )
    t_prompt, u_prompt = list(range(4, 12)), [5, 6, 7, 8]
    t_params, u_params = SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=12)
    loop.scheduler.add(Request("t", t_prompt, t_params, tenant="t"))
    loop.scheduler.add(Request("u", u_prompt, u_params, priority=1, tenant="u"))
    out, ends = drive(loop, max_steps=100)
    assert not step_fn.problems, step_fn.problems[:3]
    assert isinstance(ends["t"].error, KVCacheExhausted)
    assert out["t"] == greedy_reference(t_prompt, t_params)[: len(out["t"])]
    assert (ends["u"].finish_reason, out["u"]) == ("length", greedy_reference(u_prompt, u_params))
    s = loop.allocator.statistics()
    assert (s.used_blocks, s.num_seqs, s.cpu_free_blocks) == (0, 0, s.cpu_total_blocks)


def test_a_swapped_request_over_its_tenants_quota_is_ended_not_raised_from_schedule() -> None:
    """A request swapped out (for another tenant's growth) at a block boundary, holding its
    tenant's whole quota: when it comes back its next token needs a block the quota can never
    give. It ends with KVCacheExhausted and the loop serves on; schedule() raised
    KVCacheExhausted out of step_once() (the engine's failure: every request ended)."""
    step_fn = ReadbackStep()
    loop = make_loop(step_fn, 8, tenant_quotas={"t": 3}, preemption_mode="swap", num_cpu_blocks=16, watermark=0.0)
    u_prompt, s_prompt = list(range(4, 19)), list(range(20, 31))  # 4 blocks (of 7), 3 blocks (t's quota)
    u_params, s_params = SamplingParams(max_new_tokens=4), SamplingParams(max_new_tokens=10)
    loop.scheduler.add(Request("u", u_prompt, u_params, tenant="u"))
    loop.scheduler.add(Request("s", s_prompt, s_params, priority=1, tenant="t"))
    out, ends = drive(loop, max_steps=50)
    assert loop.allocator.statistics().swaps_out == 1, "the case is meant to swap 's' out"
    assert not step_fn.problems, step_fn.problems[:3]
    assert (ends["u"].finish_reason, out["u"]) == ("length", greedy_reference(u_prompt, u_params))
    assert isinstance(ends["s"].error, KVCacheExhausted)
    assert "quota" in str(ends["s"].error)
    assert out["s"] == greedy_reference(s_prompt, s_params)[: len(out["s"])]
    s = loop.allocator.statistics()
    assert (s.used_blocks, s.num_seqs, s.cpu_free_blocks) == (0, 0, s.cpu_total_blocks)
    assert loop.scheduler.statistics().finished == 2


def test_a_step_that_runs_nothing_swaps_nothing_out() -> None:
    """set_batch_limit(1) swaps the worse of two running requests out, and the other, at its
    tenant's quota, ends at once (outgrown): the step runs no request, so step_once() performs
    no block moves. The swapped-out request is recomputed instead; it used to come back from a
    CPU copy that was never made, reading K/V it never wrote."""
    step_fn = ReadbackStep()
    loop = make_loop(step_fn, 17, tenant_quotas={"t": 2}, preemption_mode="swap", num_cpu_blocks=16, watermark=0.0)
    a_prompt, b_prompt = [4, 5, 6, 7], [8, 9, 10, 11]
    a_params, b_params = SamplingParams(max_new_tokens=20), SamplingParams(max_new_tokens=12)
    loop.scheduler.add(Request("a", a_prompt, a_params, tenant="t"))
    loop.scheduler.add(Request("b", b_prompt, b_params, priority=1, tenant="u"))
    out: dict[Hashable, list[int]] = {}
    ends: dict[Hashable, TokenEvent] = {}
    for i in range(100):
        if not loop.scheduler.has_work():
            break
        if i == 5:  # "a" holds 8 tokens, its tenant's 2 blocks: its next token needs a third
            loop.set_batch_limit(1)
        step, events = loop.step_once()
        assert step.requests or not step.swap_out, step
        for ev in events:
            if ev.token is not None:
                out.setdefault(ev.request_id, []).append(ev.token)
            if ev.finished:
                ends[ev.request_id] = ev
    assert not step_fn.problems, step_fn.problems[:3]
    assert isinstance(ends["a"].error, KVCacheExhausted)
    assert len(out["a"]) == 5
    assert (ends["b"].finish_reason, out["b"]) == ("length", greedy_reference(b_prompt, b_params))
    assert loop.scheduler.statistics().preemptions == 1
    s = loop.allocator.statistics()
    assert (s.used_blocks, s.num_seqs, s.cpu_free_blocks) == (0, 0, s.cpu_total_blocks)


def test_a_swapped_request_short_of_quota_waits_recomputed_while_its_tenant_runs() -> None:
    """A request swapped out at a block boundary comes back when the pool has room, but another
    request of its tenant has grown into the rest of the quota meanwhile: it gives its share back
    and waits (recomputed) until its tenant has room, and every request generates what it
    generates alone. schedule() raised KVCacheExhausted out of step_once() instead."""
    step_fn = ReadbackStep()
    loop = make_loop(step_fn, 9, tenant_quotas={"t": 5}, preemption_mode="swap", num_cpu_blocks=16, watermark=0.0)
    prompts = {"t1": [4, 5, 6, 7], "u": list(range(8, 23)), "s": list(range(24, 31))}
    params = {
        "t1": SamplingParams(max_new_tokens=10),
        "u": SamplingParams(max_new_tokens=6),
        "s": SamplingParams(max_new_tokens=8),
    }
    loop.scheduler.add(Request("t1", prompts["t1"], params["t1"], tenant="t"))
    loop.scheduler.add(Request("u", prompts["u"], params["u"], priority=1, tenant="u"))
    loop.scheduler.add(Request("s", prompts["s"], params["s"], priority=2, tenant="t"))
    out, ends = drive(loop, max_steps=100)
    assert not step_fn.problems, step_fn.problems[:3]
    swaps = loop.allocator.statistics()
    assert (swaps.swaps_out, swaps.swaps_in) == (1, 0), "'s' is swapped out, then recomputed"
    for rid, prompt in prompts.items():
        assert (ends[rid].finish_reason, out[rid]) == ("length", greedy_reference(prompt, params[rid])), rid
    s = loop.allocator.statistics()
    assert (s.used_blocks, s.num_seqs, s.cpu_free_blocks, s.tenant_usage) == (0, 0, s.cpu_total_blocks, {})


def test_a_better_priority_request_preempts_nobody_when_that_would_not_let_it_in() -> None:
    """A waiting request of better priority than a running one, but too big for the room that
    preempting every worse request would free (an equal-priority request holds the blocks),
    preempts nobody: the worse request keeps running. It was preempted for nothing, then waited
    behind the request it had made way for."""
    a = PagedKVAllocator(17, block_size=4)  # 16 blocks
    sched = Scheduler(a, max_num_batched_tokens=256)
    sched.add(Request("big", list(range(1, 45)), SamplingParams(max_new_tokens=8)))  # 11 blocks
    sched.add(Request("low", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=30), priority=1))  # 2 blocks
    _step_all(sched)
    sched.add(Request("head", list(range(1, 37)), SamplingParams(max_new_tokens=4)))  # 9 blocks: 3 free + 2
    _step_all(sched)
    statuses = {rid: r.status for rid in ("big", "low", "head") if (r := sched.get(rid)) is not None}
    assert statuses == {"big": RequestStatus.RUNNING, "low": RequestStatus.RUNNING, "head": RequestStatus.WAITING}
    assert sched.statistics().preemptions == 0
    ended: dict[Hashable, TokenEvent] = {}
    for _ in range(100):
        if not sched.has_work():
            break
        _, events = _step_all(sched)
        ended.update((ev.request_id, ev) for ev in events if ev.finished)
    assert {rid: ev.finish_reason for rid, ev in ended.items()} == {"big": "length", "low": "length", "head": "length"}
    assert a.statistics().used_blocks == 0


def test_a_request_swapped_out_at_a_block_boundary_comes_back_when_it_fits_alone() -> None:
    """A request swapped out holding all the blocks but its preemptor's, at a block boundary:
    its next token needs the whole pool. Once the preemptor finishes it comes back (the swap-in
    asked for one block more than the pool holds, so it stayed swapped out for ever and the
    requests behind it were never admitted)."""
    step_fn = ReadbackStep()
    loop = make_loop(step_fn, 4, preemption_mode="swap", num_cpu_blocks=8, watermark=0.0)  # 3 blocks
    prompts = {"first": [4, 5, 6], "second": [7, 8, 9, 10, 11, 12, 13], "later": [14, 15]}
    params = {rid: SamplingParams(max_new_tokens=3) for rid in prompts}
    loop.scheduler.add(Request("first", prompts["first"], params["first"]))
    loop.scheduler.add(Request("second", prompts["second"], params["second"], priority=1))
    loop.scheduler.add(Request("later", prompts["later"], params["later"], priority=2))
    out, ends = drive(loop, max_steps=100)
    assert not loop.scheduler.has_work(), f"stuck: {loop.scheduler.statistics()}"
    assert not step_fn.problems, step_fn.problems[:3]
    swaps = loop.allocator.statistics()
    assert (swaps.swaps_out, swaps.swaps_in) == (1, 1), "the case is meant to swap 'second' out and in"
    for rid, prompt in prompts.items():
        assert (ends[rid].finish_reason, out[rid]) == ("length", greedy_reference(prompt, params[rid])), rid
    assert loop.allocator.statistics().used_blocks == 0
