"""Seeded, randomised stress of DynamicBatcher (@batched) and AsyncBatcher under mixed traffic.

Many callers (threads with futures, a blocking caller, ``map``, asyncio tasks) submit items with
random priorities, deadlines on a MockClock, fallbacks, group keys and costs; some are cancelled
at random moments, before or after their batch starts; the batch function returns per-item
errors, raises for some batches, and holds some batches until a caller lets them go; the queue is
small, under every ``on_full`` policy; a close (drain or not) comes in the middle of the traffic.

The promises checked (docs/concepts.md, docs/api.md): every call resolves exactly once, within a
bound (its result, its error, its fallback or its cancellation); an item reaches the batch
function at most once (``isolate_errors`` re-runs only the halves of a batch that raised) and
never after it expired, was evicted or was failed by ``close(drain=False)``; every caller gets
its own item back; batches respect ``max_batch_size``, ``max_batch_cost`` and ``group_by``; after
close, ``pending == in_flight == 0`` and the counters add up: ``submitted == succeeded + failed +
cancelled + expired + evicted``, the evicted items being the part of ``rejected`` that had been
admitted (``rejected`` = refused submits + evicted items).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import sys
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio

import batchkit
from batchkit.testing import MockClock

WAIT = 20.0  # bound on every wait; a healthy run takes a fraction of a second per seed
CLOSE_TIMEOUT_S = 0.2  # how long a close waits for hung batches before it cancels them (nothing is timed)
POLICIES = ("reject", "block", "drop_oldest", "shed_lowest_priority")
EVICTING = ("drop_oldest", "shed_lowest_priority")


# ---------------------------------------------------------------------------------------- items


class Fallback:
    """The fallback object of one item (identity tells whose it is)."""

    def __init__(self, n: int) -> None:
        self.n = n


class Item:
    """One request. Compared by identity: the batch function returns the very object."""

    __slots__ = ("cost", "deadline_ms", "fallback", "fate", "group", "hold", "n", "priority")

    def __init__(self, n: int, rng: random.Random) -> None:
        self.n = n
        self.priority = rng.choice([-1, 0, 0, 0, 1, 2])
        self.deadline_ms: float | None = rng.choice([None, None, None, 0.0, 1.0, 5.0, 20.0, 100.0])
        self.fallback: Fallback | None = Fallback(n) if self.deadline_ms is not None and rng.random() < 0.5 else None
        self.fate = rng.choices(["ok", "item_error", "raise"], weights=[85, 8, 7])[0]
        self.group = rng.randrange(3)
        self.cost = rng.choice([0.0, 0.5, 1.0, 1.0, 2.0, 3.0, 9.0])
        self.hold = rng.random() < 0.08  # its batch waits for a ticket from a caller

    def kwargs(self, block_timeout: float | None) -> dict[str, Any]:
        kw: dict[str, Any] = {"priority": self.priority}
        if self.deadline_ms is not None:
            kw["deadline_ms"] = self.deadline_ms
        if self.fallback is not None:
            kw["fallback"] = self.fallback
        if block_timeout is not None:
            kw["timeout"] = block_timeout
        return kw

    def __repr__(self) -> str:
        return f"Item({self.n}, {self.fate}, p={self.priority}, dl={self.deadline_ms}, g={self.group})"


class ItemError(Exception):
    """Returned in an item's slot: fails only that caller."""

    def __init__(self, item: Item) -> None:
        super().__init__(f"item {item.n} failed")
        self.item = item


class Boom(Exception):
    """Raised by the batch function for a batch holding a culprit (``fate == "raise"``)."""

    def __init__(self, item: Item) -> None:
        super().__init__(f"batch with item {item.n} raised")
        self.item = item


@dataclass
class Config:
    max_batch_size: int
    max_wait_ms: float
    max_queue: int
    on_full: str
    max_concurrent_batches: int
    group_by: bool
    cost_limit: float | None
    isolate_errors: bool
    fn_kind: str
    drain: bool
    close_timeout: float | None = None  # set where held batches of an async def hang until close cancels them
    batch_timeout_s: float | None = None  # on the MockClock: a held batch times out as the callers move time

    def block_timeout(self, rng: random.Random) -> float | None:
        """A ``"block"`` queue's submit always has a (wall-clock) bound on its wait for room."""
        return rng.choice([0.0, 0.005, 0.02, 0.05]) if self.on_full == "block" else None


def make_config(seed: int, rng: random.Random, fn_kinds: Sequence[str]) -> Config:
    return Config(
        max_batch_size=rng.choice([1, 2, 3, 4, 8]),
        max_wait_ms=rng.choice([0.0, 2.0, 10.0]),
        max_queue=rng.choice([4, 8, 16, 48]),
        on_full=POLICIES[seed % 4],  # every policy, each drain mode, over the seeds
        max_concurrent_batches=rng.choice([1, 2, 3]),
        group_by=rng.random() < 0.5,
        cost_limit=rng.choice([None, 2.5, 4.0]),
        isolate_errors=rng.random() < 0.5,
        fn_kind=rng.choice(list(fn_kinds)),
        drain=(seed // 4) % 2 == 0,
    )


# ------------------------------------------------------------------------ the batch function


class Ledger:
    """What the batch function saw: how often each item ran in a batch that returned and in one
    that raised, and any broken batch-shape promise."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()
        self.returned: Counter[int] = Counter()
        self.raised: Counter[int] = Counter()
        self.violations: list[str] = []

    def run(self, items: list[Item]) -> list[object]:
        cfg = self.cfg
        with self.lock:
            if not items:
                self.violations.append("an empty batch")
            if len(items) > cfg.max_batch_size:
                self.violations.append(f"a batch of {len(items)} > max_batch_size {cfg.max_batch_size}")
            if len({id(it) for it in items}) != len(items):
                self.violations.append(f"an item twice in one batch: {items}")
            if cfg.group_by and len({it.group for it in items}) > 1:
                self.violations.append(f"groups mixed in one batch: {items}")
            if cfg.cost_limit is not None and len(items) > 1 and sum(it.cost for it in items) > cfg.cost_limit:
                self.violations.append(f"a batch over max_batch_cost {cfg.cost_limit}: {items}")
            culprits = [it for it in items if it.fate == "raise"]
            for it in items:
                (self.raised if culprits else self.returned)[it.n] += 1
        if culprits:
            raise Boom(culprits[0])
        return [ItemError(it) if it.fate == "item_error" else it for it in items]


# ---------------------------------------------------------------------------------- outcomes


@dataclass
class Outcome:
    """How one call ended, as its caller saw it."""

    item: Item
    value: object = None
    error: BaseException | None = None
    cancelled: bool = False
    admitted: bool | None = None  # None: the caller cannot tell a refusal from an answer
    cancelled_by_test: bool = False


class Suspends:
    """Await ``make()`` and note whether it suspended: a submit refused at admission raises before
    its first suspension (on a queue that does not wait for room), an admitted one always waits."""

    def __init__(self, make: Callable[[], Coroutine[Any, Any, Any]]) -> None:
        self._make = make
        self.suspended = False

    def __await__(self) -> Generator[Any, Any, Any]:
        coro = self._make()
        send: Any = None
        throw: BaseException | None = None
        while True:
            try:
                yielded = coro.send(send) if throw is None else coro.throw(throw)
            except StopIteration as stop:
                return stop.value
            self.suspended = True
            send, throw = None, None
            try:
                send = yield yielded
            except BaseException as exc:
                throw = exc


@dataclass
class Tally:
    """The outcomes by category, and every broken promise found while sorting them."""

    by: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)


NEVER_RAN = ("expired", "evicted", "refused", "queue_full", "closed")


def sort_outcomes(outcomes: Sequence[Outcome], cfg: Config, ledger: Ledger) -> Tally:
    """Check each outcome against its item and the ledger; count them by category."""
    t = Tally()
    for o in outcomes:
        it = o.item
        cat = _category(o, cfg, ledger, t.violations)
        t.by[cat] += 1
        ran = ledger.returned[it.n] + ledger.raised[it.n]
        if ledger.returned[it.n] > 1:
            t.violations.append(f"{it} ran {ledger.returned[it.n]} times in batches that returned")
        if not cfg.isolate_errors and ran > 1:
            t.violations.append(f"{it} reached the batch function {ran} times without isolate_errors")
        if cat in ("succeeded", "item_failed") and ledger.returned[it.n] != 1:
            t.violations.append(f"{it} was answered by a batch ({cat}) but ran {ledger.returned[it.n]} times")
        # close(timeout=...) fails the callers of an async def batch still running at its deadline
        # with BatcherClosed too (counted as failed, api.md), and such a call may have got as far
        # as the function's body: only then may a "closed" item have reached it.
        ran_before_close = cat == "closed" and cfg.close_timeout is not None
        if cat in NEVER_RAN and ran and not ran_before_close:
            t.violations.append(f"{it} ({cat}: {o.error!r}) reached the batch function")
        if it.deadline_ms == 0 and ran:
            t.violations.append(f"{it} had deadline_ms=0 yet ran")
    return t


def _category(o: Outcome, cfg: Config, ledger: Ledger, bad: list[str]) -> str:
    it = o.item
    if o.cancelled:
        if not o.cancelled_by_test:
            bad.append(f"{it}: cancelled, but nobody cancelled it")
        return "cancelled"
    e = o.error
    if e is None:
        if o.value is it:
            if it.fate != "ok":
                bad.append(f"{it}: a result for an item whose batch must fail it")
            return "succeeded"
        if it.fallback is not None and o.value is it.fallback:
            return "expired"
        bad.append(f"{it}: got {o.value!r}, not its own item or fallback")
        return "wrong"
    if isinstance(e, ItemError):
        if e.item is not it or it.fate != "item_error":
            bad.append(f"{it}: got {e!r}, another item's error")
        return "item_failed"
    if isinstance(e, Boom):
        if cfg.isolate_errors and e.item is not it:
            bad.append(f"{it}: isolate_errors, yet failed with {e!r} raised for another item")
        if not ledger.raised[it.n]:
            bad.append(f"{it}: failed with {e!r} but never ran in a batch that raised")
        return "failed"
    if isinstance(e, batchkit.BatchTimeout):
        if cfg.batch_timeout_s is None:
            bad.append(f"{it}: BatchTimeout without batch_timeout_s")
        return "timed_out"
    if isinstance(e, batchkit.DeadlineExceeded):
        if it.deadline_ms is None or it.fallback is not None:
            bad.append(f"{it}: DeadlineExceeded without a deadline, or despite a fallback")
        return "expired"
    if isinstance(e, batchkit.QueueFull):
        if o.admitted is False:
            return "refused"
        if o.admitted is None:
            return "queue_full"
        if cfg.on_full not in EVICTING:
            bad.append(f"{it}: evicted from a {cfg.on_full!r} queue")
        return "evicted"
    if isinstance(e, batchkit.BatcherClosed):
        if o.admitted is False:
            return "refused_closed"
        if o.admitted and cfg.drain and cfg.close_timeout is None:
            bad.append(f"{it}: admitted, then failed with {e!r} by a draining close")
        return "closed"
    bad.append(f"{it}: unexpected {e!r}")
    return "unexpected"


def outcome_of_future(item: Item, fut: concurrent.futures.Future[Any], cancelled_by_test: bool) -> Outcome:
    o = Outcome(item, admitted=True, cancelled_by_test=cancelled_by_test)
    if fut.cancelled():
        o.cancelled = True
    elif fut.exception() is not None:
        o.error = fut.exception()
    else:
        o.value = fut.result()
    return o


def assert_batch_counts_add_up(s: batchkit.BatcherStatistics) -> None:
    """Every batch has one size and one flush reason; the mean is over them."""
    assert sum(s.flush_reasons.values()) == s.batches, s
    assert sum(s.batch_size_histogram.values()) == s.batches, s
    items = sum(size * n for size, n in s.batch_size_histogram.items())
    assert s.mean_batch_size == pytest.approx(items / s.batches if s.batches else 0.0), s


def tweak(
    rng: random.Random, b: batchkit.DynamicBatcher[Item, object] | batchkit.AsyncBatcher[Item, object], cfg: Config
) -> None:
    """Now and then a caller flushes, or changes the batch size (within the configured one)."""
    r = rng.random()
    if r < 0.04:
        b.flush()
    elif r < 0.07:
        b.max_batch_size = rng.randint(1, cfg.max_batch_size)


# ------------------------------------------------------------------- DynamicBatcher, threads


class Traffic:
    """What the thread callers share: the clock, the tickets that release held batches, the
    count of attempts that triggers the mid-traffic close, and a count-down of the callers
    still submitting."""

    def __init__(self, clock: MockClock, close_after: int, submitters: int) -> None:
        self.clock = clock
        self.tickets = threading.Semaphore(0)
        self.lock = threading.Lock()
        self.attempts = 0
        self.close_after = close_after
        self.close_now = threading.Event()
        self.submitting = submitters
        self.all_submitted = threading.Event()

    def step(self, rng: random.Random) -> None:
        """One caller's move between submits: count the attempt, maybe move time, maybe let a
        held batch go."""
        with self.lock:
            self.attempts += 1
            if self.attempts >= self.close_after:
                self.close_now.set()
        if rng.random() < 0.25:
            self.clock.advance(rng.choice([0.0005, 0.002, 0.01, 0.05]))
        if rng.random() < 0.2:
            self.tickets.release()

    def submitted(self) -> None:
        with self.lock:
            self.submitting -= 1
            if self.submitting == 0:
                self.all_submitted.set()


def _wait_all(futs: Sequence[concurrent.futures.Future[Any]]) -> None:
    _, not_done = concurrent.futures.wait(futs, timeout=WAIT)
    assert not not_done, f"{len(not_done)} futures never resolved"


@pytest.mark.parametrize("seed", range(12))
def test_dynamic_batcher_under_mixed_traffic_answers_everyone_once_and_counts_add_up(seed: int) -> None:
    rng = random.Random(seed)
    cfg = make_config(seed, rng, ["sync", "sync", "async"])
    cfg.close_timeout = CLOSE_TIMEOUT_S if cfg.fn_kind == "async" else None
    cfg.batch_timeout_s = rng.choice([None, 0.02])
    clock = MockClock()
    queue: batchkit.BoundedQueue[Any] = batchkit.BoundedQueue(
        cfg.max_queue,
        cfg.on_full,  # type: ignore[arg-type]
        aging_s=rng.choice([None, None, 0.005]),
        clock=clock,
    )
    ledger = Ledger(cfg)
    counter = iter(range(10**9))
    future_callers, per_caller, async_tasks = 3, 80, 60
    items_of = {k: [Item(next(counter), rng) for _ in range(per_caller)] for k in range(future_callers)}
    blocking_items = [Item(next(counter), rng) for _ in range(15)]
    map_items = [Item(next(counter), rng) for _ in range(30)]
    for it in map_items:  # map passes no per-item options
        it.priority, it.deadline_ms, it.fallback = 0, None, None
    task_items = {
        loop: [Item(next(counter), rng) for _ in range(async_tasks)] for loop in ("asyncio0", "asyncio1", "trio")
    }
    total = future_callers * per_caller + async_tasks * len(task_items)
    traffic = Traffic(
        clock, close_after=int(total * rng.uniform(0.5, 0.9)), submitters=future_callers + len(task_items)
    )
    tickets = traffic.tickets

    def sync_fn(items: list[Item]) -> list[object]:
        if any(it.hold for it in items) and not tickets.acquire(timeout=WAIT):
            ledger.violations.append("a held batch was never let go")
        return ledger.run(items)

    async def async_fn(items: list[Item]) -> list[object]:
        if any(it.hold for it in items):
            await asyncio.sleep(WAIT * 6)  # hangs until close(timeout=...) cancels it
        await asyncio.sleep(0)
        return ledger.run(items)

    fn: Any = sync_fn if cfg.fn_kind == "sync" else async_fn
    f = batchkit.batched(
        max_batch=cfg.max_batch_size,
        max_wait_ms=cfg.max_wait_ms,
        queue=queue,
        max_concurrent_batches=cfg.max_concurrent_batches,
        group_by=(lambda it: it.group) if cfg.group_by else None,
        size_fn=(lambda it: it.cost) if cfg.cost_limit is not None else None,
        max_batch_cost=cfg.cost_limit,
        isolate_errors=cfg.isolate_errors,
        batch_timeout_s=cfg.batch_timeout_s,
    )(fn)
    b: batchkit.DynamicBatcher[Item, object] = f.batcher
    outcomes: list[Outcome] = []
    after_close: list[batchkit.BatcherStatistics] = []
    out_lock = threading.Lock()
    errors: list[BaseException] = []

    def record(os: list[Outcome]) -> None:
        with out_lock:
            outcomes.extend(os)

    def guarded(body: Callable[..., None], *args: Any) -> Callable[[], None]:
        def run() -> None:
            try:
                body(*args)
            except BaseException as exc:  # a broken caller must fail the test, not vanish
                errors.append(exc)

        return run

    def future_caller(k: int) -> None:
        crng = random.Random(seed * 1000 + k)
        mine: list[tuple[Item, concurrent.futures.Future[Any]]] = []
        cancelled: set[int] = set()
        done: list[Outcome] = []
        try:
            for it in items_of[k]:
                traffic.step(crng)
                tweak(crng, b, cfg)
                try:
                    mine.append((it, f.submit(it, **it.kwargs(cfg.block_timeout(crng)))))
                except (batchkit.QueueFull, batchkit.BatcherClosed) as exc:
                    done.append(Outcome(it, error=exc, admitted=False))
                if mine and crng.random() < 0.15:
                    victim_item, victim = crng.choice(mine)
                    if victim.cancel():
                        cancelled.add(victim_item.n)
        finally:
            traffic.submitted()
        _wait_all([fut for _, fut in mine])
        done += [outcome_of_future(it, fut, it.n in cancelled) for it, fut in mine]
        record(done)

    def blocking_caller() -> None:
        crng = random.Random(seed * 1000 + 100)
        done = []
        for it in blocking_items:
            o = Outcome(it)
            try:
                o.value = b(it, **it.kwargs(cfg.block_timeout(crng)))
            except Exception as exc:
                o.error = exc
            done.append(o)
        record(done)

    def map_caller() -> None:
        done = []
        try:
            for it, value in zip(map_items, f.map(map_items), strict=False):
                done.append(Outcome(it, value=value))
        except (ItemError, Boom, batchkit.QueueFull, batchkit.BatcherClosed, batchkit.BatchTimeout):
            pass  # an item's failure (or the close) ends the map; it cancels the items after it
        record(done)

    def asyncio_caller(j: int) -> None:
        crng = random.Random(seed * 1000 + 200 + j)
        items = task_items[f"asyncio{j}"]

        async def call(it: Item, kw: dict[str, Any], o: Outcome) -> None:
            for _ in range(crng.randrange(30)):
                await asyncio.sleep(0)
            traffic.step(crng)
            tweak(crng, b, cfg)
            probe = Suspends(lambda: f.acall(it, **kw))
            try:
                o.value = await probe
            except asyncio.CancelledError:
                o.cancelled = True
                raise
            except Exception as exc:
                o.error = exc
            finally:
                o.admitted = probe.suspended if cfg.on_full != "block" else None

        async def main() -> None:
            os = [Outcome(it) for it in items]
            tasks = [
                asyncio.ensure_future(call(it, it.kwargs(cfg.block_timeout(crng)), o))
                for it, o in zip(items, os, strict=True)
            ]
            try:
                for _ in range(len(tasks) // 3):
                    for _ in range(crng.randrange(4)):
                        await asyncio.sleep(0)
                    i = crng.randrange(len(tasks))
                    if tasks[i].cancel():
                        os[i].cancelled_by_test = True
            finally:
                traffic.submitted()
            _, pending = await asyncio.wait(tasks, timeout=WAIT)
            assert not pending, f"{len(pending)} asyncio callers never resolved"
            # A task cancelled before it ran never submitted: nothing to check for it.
            record([o for o, t in zip(os, tasks, strict=True) if not (t.cancelled() and o.admitted is None)])

        asyncio.run(main())

    def trio_caller() -> None:
        crng = random.Random(seed * 1000 + 300)
        items = task_items["trio"]

        async def call(it: Item, kw: dict[str, Any], o: Outcome, scope: trio.CancelScope) -> None:
            with scope:
                for _ in range(crng.randrange(30)):
                    await trio.sleep(0)
                traffic.step(crng)
                tweak(crng, b, cfg)
                probe = Suspends(lambda: f.acall(it, **kw))
                try:
                    o.value = await probe
                except trio.Cancelled:
                    o.cancelled = True
                    raise
                except Exception as exc:
                    o.error = exc
                finally:
                    o.admitted = probe.suspended if cfg.on_full != "block" else None

        async def main() -> None:
            os = [Outcome(it) for it in items]
            scopes = [trio.CancelScope() for _ in items]
            with trio.fail_after(WAIT):
                async with trio.open_nursery() as nursery:
                    for it, o, scope in zip(items, os, scopes, strict=True):
                        nursery.start_soon(call, it, it.kwargs(cfg.block_timeout(crng)), o, scope)
                    try:
                        for _ in range(len(items) // 3):
                            for _ in range(crng.randrange(4)):
                                await trio.sleep(0)
                            i = crng.randrange(len(items))
                            scopes[i].cancel()
                            os[i].cancelled_by_test = True
                    finally:
                        traffic.submitted()
            # A call cancelled before it submitted has nothing to check.
            record([o for o in os if not (o.cancelled_by_test and o.admitted is None)])

        trio.run(main)

    def closer() -> None:
        assert traffic.close_now.wait(WAIT)
        f.close(drain=cfg.drain, timeout=cfg.close_timeout)
        after_close.append(b.statistics())  # nothing waits or runs once close has returned

    threads = [threading.Thread(target=guarded(future_caller, k), name=f"futures{k}") for k in range(future_callers)]
    threads += [threading.Thread(target=guarded(asyncio_caller, j), name=f"asyncio{j}") for j in range(2)]
    threads += [
        threading.Thread(target=guarded(fn_), name=fn_.__name__)
        for fn_ in (blocking_caller, map_caller, trio_caller, closer)
    ]
    for t in threads:
        t.start()
    assert traffic.all_submitted.wait(WAIT), "the callers never finished submitting"
    traffic.close_now.set()
    tickets.release(10**6)  # every held batch may go now
    for t in threads:
        t.join(WAIT)
    hung = [t.name for t in threads if t.is_alive()]
    assert not hung, f"{hung} hung"
    f.close()
    assert not errors, errors
    assert [(a.pending, a.in_flight, a.running_batches) for a in after_close] == [(0, 0, 0)]

    tally = sort_outcomes(outcomes, cfg, ledger)
    assert not ledger.violations, ledger.violations[:5]
    assert not tally.violations, tally.violations[:5]
    s = b.statistics()
    qs = queue.statistics()
    by = tally.by
    assert (s.pending, s.in_flight, s.running_batches, qs.depth) == (0, 0, 0, 0), (s, qs)
    assert s.submitted == qs.arrivals, (s, qs)
    assert qs.served + qs.cancellations + qs.expiries + qs.drops == qs.arrivals, qs
    assert s.submitted == s.succeeded + s.failed + s.cancelled + s.expired + qs.drops, (s, qs)
    assert s.rejected == qs.rejections + qs.drops, (s, qs)
    assert s.expired == qs.expiries, (s, qs)
    assert_batch_counts_add_up(s)
    assert sum(size * n for size, n in s.batch_size_histogram.items()) == qs.served, (s, qs)
    if cfg.on_full not in EVICTING:
        assert qs.drops == 0, qs
    # Each counter holds at least the callers that saw that outcome (a caller that gave up
    # while its answer was on its way saw a cancellation instead).
    assert s.succeeded >= by["succeeded"], (s, by)
    assert s.failed >= by["failed"] + by["item_failed"], (s, by)
    assert s.expired >= by["expired"], (s, by)
    assert qs.drops >= by["evicted"], (qs, by)
    assert qs.rejections >= by["refused"], (qs, by)
    assert qs.rejections + qs.drops >= by["refused"] + by["evicted"] + by["queue_full"], (qs, by)
    assert s.succeeded + s.failed + s.expired + s.cancelled + qs.drops >= sum(
        by[c] for c in ("succeeded", "failed", "item_failed", "expired", "evicted", "cancelled")
    )


# ------------------------------------------------------------------- AsyncBatcher, one loop


@pytest.mark.parametrize("seed", range(12))
def test_async_batcher_under_mixed_traffic_answers_everyone_once_and_counts_add_up(seed: int) -> None:
    rng = random.Random(seed)
    cfg = make_config(seed, rng, ["async", "loop", "offload"])
    cfg.close_timeout = CLOSE_TIMEOUT_S if cfg.fn_kind == "async" else None
    cfg.batch_timeout_s = rng.choice([None, 0.02]) if cfg.fn_kind != "loop" else None  # "loop" refuses it
    clock = MockClock()
    ledger = Ledger(cfg)
    items = [Item(n, rng) for n in range(400)]
    close_after = int(len(items) * rng.uniform(0.5, 0.9))
    thread_tickets = threading.Semaphore(0)

    async def main() -> tuple[list[Outcome], batchkit.BatcherStatistics]:
        async def async_fn(xs: list[Item]) -> list[object]:
            if any(it.hold for it in xs):
                await asyncio.sleep(WAIT * 6)  # hangs until aclose(timeout=...) cancels it
            await asyncio.sleep(0)
            return ledger.run(xs)

        def plain_fn(xs: list[Item]) -> list[object]:
            if cfg.fn_kind == "offload" and any(it.hold for it in xs) and not thread_tickets.acquire(timeout=WAIT):
                ledger.violations.append("a held batch was never let go")
            return ledger.run(xs)

        fn: Any = async_fn if cfg.fn_kind == "async" else plain_fn
        b: batchkit.AsyncBatcher[Item, object] = batchkit.AsyncBatcher(
            fn,
            max_batch_size=cfg.max_batch_size,
            max_wait_ms=cfg.max_wait_ms,
            max_queue=cfg.max_queue,
            on_full=cfg.on_full,  # type: ignore[arg-type]
            max_concurrent_batches=cfg.max_concurrent_batches,
            group_by=(lambda it: it.group) if cfg.group_by else None,
            size_fn=(lambda it: it.cost) if cfg.cost_limit is not None else None,
            max_batch_cost=cfg.cost_limit,
            isolate_errors=cfg.isolate_errors,
            offload=cfg.fn_kind == "offload",
            batch_timeout_s=cfg.batch_timeout_s,
            clock=clock,
        )
        attempts = 0
        close_now = asyncio.Event()
        crng = random.Random(seed * 1000 + 300)

        def let_one_go() -> None:
            thread_tickets.release()

        async def call(it: Item, kw: dict[str, Any], o: Outcome) -> None:
            nonlocal attempts
            for _ in range(crng.randrange(40)):
                await asyncio.sleep(0)
            attempts += 1
            if attempts >= close_after:
                close_now.set()
            if crng.random() < 0.25:
                clock.advance(crng.choice([0.0005, 0.002, 0.01, 0.05]))
            if crng.random() < 0.2:
                let_one_go()
            tweak(crng, b, cfg)
            probe = Suspends(lambda: b.submit(it, **kw))
            try:
                o.value = await probe
            except asyncio.CancelledError:
                o.cancelled = True
                raise
            except Exception as exc:
                o.error = exc
            finally:
                o.admitted = probe.suspended if cfg.on_full != "block" else None

        async def closer() -> None:
            await asyncio.wait_for(close_now.wait(), WAIT)
            await b.aclose(drain=cfg.drain, timeout=cfg.close_timeout)
            s = b.statistics()  # nothing waits or runs once aclose has returned
            assert (s.pending, s.in_flight, s.running_batches) == (0, 0, 0), s

        os = [Outcome(it) for it in items]
        tasks = [
            asyncio.ensure_future(call(it, it.kwargs(cfg.block_timeout(crng)), o))
            for it, o in zip(items, os, strict=True)
        ]
        closing = asyncio.ensure_future(closer())
        for _ in range(len(tasks) // 3):
            for _ in range(crng.randrange(3)):
                await asyncio.sleep(0)
            i = crng.randrange(len(tasks))
            if tasks[i].cancel():
                os[i].cancelled_by_test = True
        # Every caller has submitted (or waits for room, or was cancelled): close, let go.
        for _ in range(10):
            await asyncio.sleep(0)
        close_now.set()
        for _ in items:  # more tickets than batches: every held batch may go now
            let_one_go()
        _, pending = await asyncio.wait([*tasks, closing], timeout=WAIT)
        assert not pending, f"{len(pending)} callers (or the close) never resolved"
        assert closing.exception() is None, closing.exception()
        await asyncio.wait_for(b.aclose(), WAIT)
        keep = [o for o, t in zip(os, tasks, strict=True) if not (t.cancelled() and o.admitted is None)]
        return keep, b.statistics()

    outcomes, s = asyncio.run(main())
    assert_batch_counts_add_up(s)
    tally = sort_outcomes(outcomes, cfg, ledger)
    assert not ledger.violations, ledger.violations[:5]
    assert not tally.violations, tally.violations[:5]
    by = tally.by
    assert (s.pending, s.in_flight, s.running_batches) == (0, 0, 0), s
    # Refusals are seen by their callers (a refused submit raises at once, and a "block" queue
    # never evicts); rejected counts them and the evicted items.
    refused = by["refused"] + (by["queue_full"] if cfg.on_full == "block" else 0)
    evicted = s.rejected - refused
    assert evicted >= by["evicted"], (s, by)
    if cfg.on_full not in EVICTING:
        assert evicted == 0, (s, by)
    assert s.submitted == s.succeeded + s.failed + s.cancelled + s.expired + evicted, (s, by)
    assert s.succeeded >= by["succeeded"], (s, by)
    assert s.failed >= by["failed"] + by["item_failed"], (s, by)
    assert s.expired >= by["expired"], (s, by)


# ------------------------------------------------------------- regressions the stress found


async def _close_then_raise_cancelled(xs: list[int]) -> list[int]:
    await HOLDER["async"].aclose()  # from inside its own batch: closes and returns at once
    raise asyncio.CancelledError("raised by the batch function, nobody cancelled it")


def _close_then_raise_cancelled_sync(xs: list[int]) -> list[int]:
    HOLDER["closing"].set()  # the loop closes the batcher while this call runs
    assert HOLDER["closed"].wait(WAIT)
    raise asyncio.CancelledError("raised by the batch function, nobody cancelled it")


HOLDER: dict[str, Any] = {}


@pytest.mark.parametrize("offload", [False, True], ids=["async_def", "offload"])
def test_a_batch_function_raising_cancelled_error_while_aclose_drains_still_answers_its_callers(
    offload: bool,
) -> None:
    """A CancelledError that the batch function raises itself (nobody cancelled its batch) fails
    that batch's callers, also while aclose() drains; they were left waiting forever."""
    HOLDER["closing"], HOLDER["closed"] = threading.Event(), threading.Event()
    fn: Any = _close_then_raise_cancelled_sync if offload else _close_then_raise_cancelled

    async def main() -> tuple[bool, batchkit.BatcherStatistics]:
        b = batchkit.AsyncBatcher(fn, max_batch_size=1, max_wait_ms=0, offload=offload)
        HOLDER["async"] = b
        call = asyncio.ensure_future(b.submit(1))
        closing: asyncio.Future[None] | None = None
        if offload:
            await asyncio.wait_for(asyncio.to_thread(HOLDER["closing"].wait, WAIT), WAIT)
            closing = asyncio.ensure_future(b.aclose())
            await asyncio.sleep(0)  # the closing task's first step: it marks the batcher closed
            assert b.closed
            HOLDER["closed"].set()
        done, _ = await asyncio.wait([call], timeout=WAIT)
        if closing is not None:
            await asyncio.wait_for(closing, WAIT)
        await asyncio.wait_for(b.aclose(), WAIT)
        return call in done, b.statistics()

    answered, s = asyncio.run(main())
    assert answered
    assert (s.submitted, s.failed, s.pending, s.in_flight) == (1, 1, 0, 0)


def test_a_cancelled_future_is_done_for_concurrent_futures_wait_and_as_completed() -> None:
    """A submit's Future cancelled while its item waits counts as done for
    ``concurrent.futures.wait()`` and ``as_completed()``, as an executor's Future does: they
    wait for the cancellation to be notified (``set_running_or_notify_cancel``), which nothing
    did, so a wait on a cancelled call never returned."""
    clock = MockClock()
    b = batchkit.DynamicBatcher(batchkit.testing.echo_batch, max_batch_size=8, max_wait_ms=10, clock=clock)
    gone, kept = b.submit(1), b.submit(2)
    assert gone.cancel()
    done, not_done = concurrent.futures.wait([gone], timeout=0)  # no waiting: it is done already
    assert (done, not_done) == ({gone}, set())
    assert list(concurrent.futures.as_completed([gone], timeout=0)) == [gone]
    clock.advance(1.0)
    assert kept.result(WAIT) == 2
    b.close()
    s = b.statistics()
    assert (s.submitted, s.succeeded, s.cancelled) == (2, 1, 1)


def test_close_with_timeout_answers_a_stuck_async_batch_and_what_waits_before_it_returns() -> None:
    """close(timeout=...) with a hung ``async def`` batch function: when it returns, the running
    batch's caller has its BatcherClosed (failed), so has the item still waiting (cancelled), and
    nothing is in flight. A worker answered them some time after close returned."""
    started = threading.Event()
    release = threading.Event()

    async def hang(xs: list[int]) -> list[int]:
        started.set()
        await asyncio.sleep(WAIT * 6)  # cancelled by close at its deadline
        return xs

    b = batchkit.DynamicBatcher(hang, max_batch_size=1, max_wait_ms=0)
    running = b.submit(0)
    assert started.wait(WAIT)
    waiting = b.submit(1)
    closer = threading.current_thread()
    # A worker that answers `running` is held here, as a slow thread would be.
    running.add_done_callback(lambda _: None if threading.current_thread() is closer else release.wait(WAIT))
    try:
        b.close(timeout=0.2)
        answered = (running.done(), waiting.done())
        s = b.statistics()
    finally:
        release.set()
    assert answered == (True, True)
    assert (s.pending, s.in_flight, s.running_batches) == (0, 0, 0)
    assert (s.submitted, s.succeeded, s.failed, s.cancelled) == (2, 0, 1, 1)
    for fut in (running, waiting):
        with pytest.raises(batchkit.BatcherClosed):
            fut.result(0)


def test_aclose_with_timeout_leaves_no_batch_in_flight() -> None:
    """aclose(timeout=...) cancels a hung batch; when it returns, statistics() no longer count
    that batch as running (it did until the cancelled task's next step)."""

    async def main() -> batchkit.BatcherStatistics:
        started = asyncio.Event()

        async def hang(xs: list[int]) -> list[int]:
            started.set()
            await asyncio.sleep(WAIT * 6)
            return xs

        b = batchkit.AsyncBatcher(hang, max_batch_size=1, max_wait_ms=0)
        call = asyncio.ensure_future(b.submit(0))
        await asyncio.wait_for(started.wait(), WAIT)
        await b.aclose(timeout=0.2)
        s = b.statistics()
        with pytest.raises(batchkit.BatcherClosed):
            await asyncio.wait_for(call, WAIT)
        return s

    s = asyncio.run(main())
    assert (s.pending, s.in_flight, s.running_batches) == (0, 0, 0)
    assert (s.submitted, s.failed) == (1, 1)


def test_batch_timeout_cancels_the_call_of_an_async_batch_function_and_close_does_not_wait_for_it() -> None:
    """With ``batch_timeout_s``, a timed-out call of an ``async def`` batch function is cancelled
    (its callers have BatchTimeout), and close(timeout=...) returns. The call went on running on
    the batcher's event loop, and close waited for it to end, whatever its timeout."""
    clock = MockClock()
    started, cancelled = threading.Event(), threading.Event()

    async def hang(xs: list[int]) -> list[int]:
        started.set()
        try:
            await asyncio.sleep(WAIT)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return xs

    b = batchkit.DynamicBatcher(hang, max_batch_size=1, max_wait_ms=0, batch_timeout_s=0.05, clock=clock)
    try:
        fut = b.submit(0)
        assert started.wait(WAIT)
        clock.advance(1.0)  # past batch_timeout_s
        with pytest.raises(batchkit.BatchTimeout):
            fut.result(WAIT)
        assert cancelled.wait(WAIT)
    finally:
        b.close(timeout=WAIT)
    s = b.statistics()
    assert (s.submitted, s.failed, s.pending, s.in_flight) == (1, 1, 0, 0)


def test_a_batch_that_timed_out_is_not_split_and_retried_when_its_call_fails_later() -> None:
    """``isolate_errors`` retries the halves of a failing batch to answer its callers; a batch
    whose callers already have their BatchTimeout is not retried when its call fails after the
    timeout (its halves ran again, for nobody)."""
    clock = MockClock()
    started, release = threading.Event(), threading.Event()
    calls: list[list[int]] = []

    def fn(xs: list[int]) -> list[int]:
        calls.append(list(xs))
        if len(calls) == 1:
            started.set()
            assert release.wait(WAIT)
            raise RuntimeError("failed after its batch timed out")
        return xs

    b = batchkit.DynamicBatcher(
        fn,
        max_batch_size=2,
        max_wait_ms=10,
        isolate_errors=True,
        batch_timeout_s=0.05,
        clock=clock,
        name="late-failure",
    )
    futs = [b.submit(0), b.submit(1)]  # one batch, by size
    assert started.wait(WAIT)
    clock.advance(1.0)  # past batch_timeout_s
    for fut in futs:
        with pytest.raises(batchkit.BatchTimeout):
            fut.result(WAIT)
    release.set()
    b.close()
    for t in threading.enumerate():  # the timed-out batch's worker, which close does not join
        if t.name == "batchkit-worker-late-failure":
            t.join(WAIT)
    assert calls == [[0, 1]]


class _ParkingClock:
    """A clock that parks the batcher's dispatcher in ``now()`` once, when armed: the dispatcher
    calls it holding the batcher's lock, first thing each time it looks at the queue."""

    def __init__(self) -> None:
        self.t = 0.0
        self.armed = False
        self.parked = threading.Event()
        self.go = threading.Event()

    def now(self) -> float:
        if self.armed and threading.current_thread().name.startswith("batchkit-dispatch"):
            self.armed = False
            self.parked.set()
            assert self.go.wait(WAIT)
        return self.t


def test_a_batch_that_times_out_just_after_its_call_returned_leaves_no_worker_behind() -> None:
    """A batch can time out after its call returned and before its worker frees its slot: the
    worker was replaced yet carried on serving, one worker more than close() stops, so one of
    them waited for work forever (and close() with it)."""
    clock = _ParkingClock()
    registered = threading.Event()

    def fn(xs: list[int]) -> list[int]:
        assert registered.wait(WAIT)
        return xs

    b = batchkit.DynamicBatcher(fn, max_batch_size=1, max_wait_ms=0, batch_timeout_s=100, clock=clock, name="late")
    switch = sys.getswitchinterval()

    def answered(_: object) -> None:  # in the worker, after the call returned, before it frees the slot
        clock.t = 1000.0  # past batch_timeout_s
        clock.armed = True
        b.flush()  # the dispatcher looks again and parks, holding the lock
        assert clock.parked.wait(WAIT)
        sys.setswitchinterval(1000)  # this worker keeps running until it waits for the lock
        clock.go.set()

    try:
        fut = b.submit(0)
        fut.add_done_callback(answered)
        registered.set()
        assert fut.result(WAIT) == 0
        b.close(timeout=WAIT)
    finally:
        sys.setswitchinterval(switch)
    workers = [t for t in threading.enumerate() if t.name == "batchkit-worker-late"]
    for t in workers:
        t.join(WAIT / 4)
    assert not [t for t in workers if t.is_alive()]
