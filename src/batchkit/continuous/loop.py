"""ContinuousDecodeLoop: iteration-level batching around a user's torch decode step.

One engine thread owns the scheduler and the KV cache and runs, while there is work:
``schedule()`` -> :meth:`StepRunner.run` (block moves, ``step_fn(batch, kv)``, sampling) ->
``update()`` -> stream the new tokens to their callers. Callers (threads, asyncio or trio tasks) only touch an inbox and
their own token stream, so the step never waits on them and they never wait on each other.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import operator
import threading
from collections import deque
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Hashable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast

from .._clock import Clock, checked_clock
from .._errors import BatcherClosed, KVCacheExhausted, QueueFull
from .._waiters import ThreadWaiter, new_async_waiter, wake_all
from ..kv.allocator import PagedKVAllocator
from ..kv.cache import PagedKVCache
from ..metrics import LatencySummary, SampleWindow
from .grammar import GrammarMatchers
from .logprobs import TokenLogprobs
from .request import Request, ScheduledStep, TokenEvent
from .runner import StepFn, StepRunner, logit_bias_past
from .sampling import SamplingParams, nth_seed, token_ids
from .scheduler import PreemptionMode, Scheduler, SchedulerStatistics
from .step import StepBatch

__all__ = ["ContinuousDecodeLoop", "LoopStatistics"]

logger = logging.getLogger(__name__)


def _with_logprobs(sampling: dict[str, Any]) -> None:
    """The sampling options of a call that returns logprobs: ``logprobs`` 0 (each token's own,
    no alternatives) unless it asks for alternatives; None means 0 here too."""
    if sampling.get("logprobs") is None:
        sampling["logprobs"] = 0


T = TypeVar("T")


class _Stream:
    """The tokens of one request, produced by the engine thread and consumed by its caller."""

    __slots__ = ("detailed", "done", "error", "future", "lock", "output", "tokens", "waiter")

    def __init__(self, detailed: bool = False) -> None:
        self.lock = threading.Lock()
        # detailed: the items are TokenLogprobs (the prompt's first, then each token's), not ids.
        self.detailed = detailed
        self.tokens: deque[Any] = deque()
        self.output: list[Any] = []
        self.done = False
        self.error: BaseException | None = None
        self.waiter: Any = None
        self.future: concurrent.futures.Future[list[Any]] | None = None

    def push(self, event: TokenEvent) -> Any:
        """Record an event (engine thread); return the waiter to wake, if any."""
        with self.lock:
            if self.detailed:
                items: list[Any] = list(event.prompt_logprobs)
                if event.token is not None:
                    items.append(event.logprobs or TokenLogprobs(event.token, math.nan))
                self.tokens.extend(items)
                self.output.extend(items)
            elif event.token is not None:
                self.tokens.append(event.token)
                self.output.append(event.token)
            if event.finished:
                self.done = True
                self.error = event.error
            w, self.waiter = self.waiter, None
        if event.finished and self.future is not None and not self.future.done():
            try:
                if event.error is not None:
                    self.future.set_exception(event.error)
                else:
                    self.future.set_result(list(self.output))
            except concurrent.futures.InvalidStateError:
                pass  # the caller cancelled it after done() was checked: nobody wants the result
        return w

    def _next_or_park(self, make_waiter: Callable[[], Any]) -> tuple[bool, Any, Any]:
        with self.lock:
            if self.tokens:
                return True, self.tokens.popleft(), None
            if self.done:
                if self.error is not None:
                    raise self.error
                return True, None, None
            self.waiter = make_waiter()
            return False, None, self.waiter


def _check_prompt(prompt_ids: Sequence[int], vocab_size: int | None) -> list[int]:
    """The prompt as a list of token ids; refuse what no step could embed.

    Raises:
        TypeError: a string instead of token ids, or an id that is not an integer.
        ValueError: no token, a negative id, or an id past ``vocab_size``.
    """
    if isinstance(prompt_ids, str | bytes):
        raise TypeError("prompt_ids must be token ids (a sequence of ints), got a string; tokenize it first")
    try:
        items = list(prompt_ids)
    except TypeError:  # one bare id, None, a 0-d tensor...
        raise TypeError(f"prompt_ids must be token ids (a sequence of ints), got {prompt_ids!r}") from None
    prompt: list[int] = []
    for t in items:
        try:
            if isinstance(t, bool):
                raise TypeError
            prompt.append(operator.index(t))  # ints, numpy ints, 0-d integer tensors
        except TypeError:
            raise TypeError(f"prompt_ids must be ints (token ids), got {t!r}") from None
    if not prompt:
        raise ValueError("prompt_ids needs at least one token")
    low, high = min(prompt), max(prompt)
    if low < 0:
        raise ValueError(f"token ids must be >= 0, got {low}")
    if vocab_size is not None and high >= vocab_size:
        raise ValueError(f"token id {high} is past the model's vocabulary (vocab_size={vocab_size})")
    return prompt


def _no_room(waiting: int, seats: int, num_samples: int, max_waiting: int) -> str:
    """QueueFull's message: ``num_samples`` more would leave more than ``max_waiting`` requests
    waiting beyond the ``seats`` free now (the next step admits that many waiting requests)."""
    are = "request is" if waiting == 1 else "requests are"
    free = "seat" if seats == 1 else "seats"
    these = "this request" if num_samples == 1 else f"these {num_samples} samples"
    return (
        f"{waiting} {are} already waiting, {max(0, waiting - seats)} of them beyond the {seats} free decode {free} "
        f"(max_waiting={max_waiting} bounds those beyond the seats): no room for {these}; retry later, raise "
        "max_waiting, or add capacity"
    )


def _checked_loop_args(
    step_fn: object,
    kv_cache: object,
    detokenize: object,
    eos_token_id: int | None,
    clock: object,
    max_waiting: int | None,
    engine: str,
) -> int | None:
    """Refuse the :class:`ContinuousDecodeLoop` arguments it documents as errors; the
    ``eos_token_id`` as an int (or None).

    Raises:
        TypeError: a ``step_fn``, ``kv_cache``, ``detokenize``, ``eos_token_id`` or ``clock`` of
            the wrong kind. ValueError: a ``max_waiting`` or ``engine`` out of range.
    """
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable as step_fn(batch, kv), got {step_fn!r}")
    if not isinstance(kv_cache, PagedKVCache):
        raise TypeError(
            f"kv_cache must be a batchkit.PagedKVCache (e.g. model.make_cache(num_blocks)), got {kv_cache!r}"
        )
    if detokenize is not None and not callable(detokenize):
        raise TypeError(f"detokenize must be callable as detokenize(token_ids) -> str, or None, got {detokenize!r}")
    if eos_token_id is not None:
        SamplingParams(eos_token_id=eos_token_id)  # the TypeError every request would raise, now
        eos_token_id = operator.index(eos_token_id)
    if max_waiting is not None and (
        isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1
    ):
        raise ValueError(f"max_waiting must be an int >= 1 or None (unbounded), got {max_waiting!r}")
    if engine not in ("thread", "caller"):
        raise ValueError(f"engine must be 'thread' or 'caller', got {engine!r}")
    return eos_token_id


def _sliding_window_of(step_fn: object) -> int | None:
    """The window every layer of the step's model attends over (its ``sliding_window``
    attribute, as :class:`~batchkit.models.HFStepModel` has), or None."""
    window = getattr(step_fn, "sliding_window", None)
    return window if isinstance(window, int) and not isinstance(window, bool) and window >= 1 else None


@dataclass(frozen=True)
class LoopStatistics:
    """Scheduler counters and latencies, plus the loop's throughput and step times (``step_time``:
    every step of the run, mergeable; ``step_time_recent``: the last 10,000 steps)."""

    scheduler: SchedulerStatistics
    steps: int
    tokens_per_s: float
    step_time: LatencySummary
    step_time_recent: LatencySummary


class ContinuousDecodeLoop:
    """Serve many generation requests through one decode step function, continuously batched.

    Args:
        step_fn: ``step_fn(batch: StepBatch, kv: PagedKVCache) -> logits`` (see
            :mod:`batchkit.continuous.step` for the contract), e.g. a :class:`batchkit.models.LlamaModel`.
        kv_cache: the :class:`PagedKVCache` the step reads and writes.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget per step (prefill chunks and decodes share it).
        enable_prefix_caching: reuse cached blocks of identical prompt prefixes (and of a
            preempted request's own tokens).
        watermark: fraction of blocks admission leaves free for running requests.
        preemption_mode: ``"recompute"`` or ``"swap"`` (then ``num_cpu_blocks`` > 0).
        num_cpu_blocks: size of the CPU swap pool.
        tenant_quotas: ``{tenant: max blocks}`` (an int, or a float fraction of the pool): a
            request's ``tenant=`` may hold at most that much KV memory, so that one tenant never
            starves another; a request over its tenant's quota waits (or, if it can never fit,
            fails with :class:`KVCacheExhausted`) without holding up other tenants.
        eos_token_id: default end-of-sequence token for requests that give none.
        detokenize: ``detokenize(token_ids) -> str``, for stop strings (a request with ``stop=``
            strings and no hook is refused with ValueError).
        max_waiting: most requests waiting to be admitted (submitted, not yet running, or
            preempted) beyond the seats free now (``max_num_seqs`` less the running requests:
            the next step admits those, so a burst at an idle server fills the seats, then
            ``max_waiting`` more); a request beyond it is refused at once with
            :class:`QueueFull`, so that a server can answer "busy" instead of queueing without
            bound. None: unbounded.
        engine: ``"thread"`` (default): the loop starts its own engine thread on the first
            request. ``"caller"``: no thread is started; a thread of yours (typically the main
            thread, see :meth:`run_engine`) runs the engine, and requests wait until it does.
        clock: time source for the metrics.

    Raises:
        TypeError: ``step_fn`` is not callable. ValueError: out-of-range limits.
    """

    def __init__(
        self,
        step_fn: StepFn,
        kv_cache: PagedKVCache,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        enable_prefix_caching: bool = False,
        watermark: float = 0.01,
        preemption_mode: PreemptionMode = "recompute",
        num_cpu_blocks: int = 0,
        tenant_quotas: Mapping[Hashable, int | float] | None = None,
        eos_token_id: int | None = None,
        detokenize: Callable[[Sequence[int]], str] | None = None,
        max_waiting: int | None = None,
        engine: Literal["thread", "caller"] = "thread",
        clock: Clock | None = None,
    ) -> None:
        eos_token_id = _checked_loop_args(step_fn, kv_cache, detokenize, eos_token_id, clock, max_waiting, engine)
        self.max_waiting = max_waiting
        self.engine = engine
        self.kv = kv_cache
        self.clock: Clock = checked_clock(clock)
        self.allocator = PagedKVAllocator(
            kv_cache.num_blocks,
            kv_cache.block_size,
            watermark=watermark,
            enable_prefix_caching=enable_prefix_caching,
            num_cpu_blocks=num_cpu_blocks,
            tenant_quotas=dict(tenant_quotas) if tenant_quotas else None,
        )
        self.scheduler = Scheduler(
            self.allocator,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            preemption_mode=preemption_mode,
            clock=self.clock,
            detokenize=detokenize,
            sliding_window=_sliding_window_of(step_fn),
        )
        self.cpu_cache: PagedKVCache | None = None  # the CPU swap pool's tensors
        if num_cpu_blocks:
            self.cpu_cache = PagedKVCache(
                kv_cache.num_layers,
                num_cpu_blocks,
                kv_cache.block_size,
                kv_cache.num_kv_heads,
                kv_cache.head_dim,
                dtype=kv_cache.dtype,
                device="cpu",
            )
        self._runner = StepRunner(step_fn, kv_cache, self.cpu_cache, self.allocator, self.clock)
        self.eos_token_id = eos_token_id
        self._extra_eos_ids: tuple[int, ...] = ()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._inbox: list[tuple[Request, _Stream]] = []
        self._admitting: list[tuple[Request, _Stream]] = []  # taken from the inbox, not yet in the scheduler
        self._aborts: list[Hashable] = []
        self._streams: dict[Hashable, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()  # set when the engine has ended
        self._closing = False
        self._next_id = 0
        self._steps = 0
        self._step_time = SampleWindow()
        self._t_first: float | None = None
        self._t_last = 0.0
        self._generated = 0

    @property
    def step_fn(self) -> StepFn:
        """The step function the loop runs (settable: the next step calls the new one)."""
        return self._runner.step_fn

    @step_fn.setter
    def step_fn(self, step_fn: StepFn) -> None:
        self._runner.step_fn = step_fn

    @property
    def _grammars(self) -> GrammarMatchers:
        """The matchers of the requests with a grammar (the runner's)."""
        return self._runner.grammars

    @property
    def extra_eos_ids(self) -> tuple[int, ...]:
        """More end-of-sequence ids than ``eos_token_id`` (a model whose generation config lists
        several, e.g. end-of-text and end-of-turn): every request submitted afterwards that does
        not set ``ignore_eos`` also stops on these. ``PretrainedLM.make_loop`` sets them.

        Settable to any sequence of token ids (kept as a tuple).

        Raises:
            TypeError: (on setting) not a sequence of ints, e.g. one bare id.
        """
        return self._extra_eos_ids

    @extra_eos_ids.setter
    def extra_eos_ids(self, ids: Iterable[int]) -> None:
        self._extra_eos_ids = token_ids("extra_eos_ids", ids)

    # ------------------------------------------------------------------ submitting

    def _params(self, kwargs: dict[str, Any]) -> SamplingParams:
        if "eos_token_id" not in kwargs and self.eos_token_id is not None:
            kwargs["eos_token_id"] = self.eos_token_id
        params = SamplingParams(**kwargs)  # checks every field first
        if self.extra_eos_ids and not params.ignore_eos:
            own = params.stop_token_ids
            params = dataclasses.replace(
                params, stop_token_ids=own + tuple(t for t in self.extra_eos_ids if t not in own)
            )
        return params

    def _submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        priority: int,
        tenant: Hashable,
        stream: _Stream | None = None,
        deadline_s: float | None = None,
        after: Request | None = None,
    ) -> tuple[Hashable, _Stream]:
        req, stream = self._enqueue(prompt_ids, params, priority, tenant, stream, deadline_s, after)
        return req.request_id, stream

    def _enqueue(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        priority: int,
        tenant: Hashable,
        stream: _Stream | None,
        deadline_s: float | None,
        after: Request | None,
    ) -> tuple[Request, _Stream]:
        """Check a request and queue it for the engine; its scheduler request and its stream."""
        return self._enqueue_group(prompt_ids, [params], priority, tenant, [stream or _Stream()], deadline_s, after)[0]

    def _enqueue_group(
        self,
        prompt_ids: Sequence[int],
        params: Sequence[SamplingParams],
        priority: int,
        tenant: Hashable,
        streams: Sequence[_Stream],
        deadline_s: float | None,
        after: Request | None,
    ) -> list[tuple[Request, _Stream]]:
        """Check requests of one prompt (one per entry of ``params``) and queue them for the
        engine together, in one hold of the lock: ``max_waiting`` lets in all or none of them.
        The first waits for ``after`` (if given), the others for the first."""
        vocab = self._runner.vocab_size()
        prompt = _check_prompt(prompt_ids, vocab)
        width = vocab if vocab is not None else self._runner.logits_width
        for p in params:
            if width is not None and (bias_error := logit_bias_past(p, width)) is not None:
                raise bias_error
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int (lower is served first), got {priority!r}")
        try:
            hash(tenant)
        except TypeError:
            raise TypeError(f"tenant must be hashable (a name, e.g. a string), got {tenant!r}") from None
        if deadline_s is not None and (
            isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float) or not 0 < deadline_s < math.inf
        ):
            raise ValueError(f"deadline_s must be a finite number of seconds > 0 (or None), got {deadline_s!r}")
        if any(p.stop for p in params) and self.scheduler.detokenize is None:
            raise ValueError(
                f"stop strings {params[0].stop!r} need a detokenize hook to be matched; pass detokenize= "
                "(token ids -> text) to ContinuousDecodeLoop, or stop on token ids with stop_token_ids="
            )
        self._check_fits(len(prompt), tenant)
        queued: list[tuple[Request, _Stream]] = []
        with self._cond:
            if self._closing:
                raise BatcherClosed("the decode loop is closed")
            if self.max_waiting is not None:
                waiting, seats = self._num_waiting(), self.free_seats()
                # The free seats take waiting requests first (this one's samples included).
                if waiting + len(params) - seats > self.max_waiting:
                    raise QueueFull(_no_room(waiting, seats, len(params), self.max_waiting))
            deadline = None if deadline_s is None else self.clock.now() + deadline_s
            for p, stream in zip(params, streams, strict=True):
                self._next_id += 1
                req = Request(self._next_id, prompt, p, priority=priority, tenant=tenant, deadline=deadline)
                req.after = after
                after = after or req
                self._inbox.append((req, stream))
                queued.append((req, stream))
            if self._thread is None and self.engine == "thread":
                self._thread = threading.Thread(target=self._engine, name="batchkit-decode-loop", daemon=True)
                self._thread.start()
            self._cond.notify()
        return queued

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        priority: int = 0,
        tenant: Hashable = None,
        deadline_s: float | None = None,
        **sampling: Any,
    ) -> AsyncIterator[int]:
        """Stream a request's new tokens (asyncio or trio). Keyword arguments are
        :class:`SamplingParams` fields (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``,
        ``seed``, ``stop_token_ids``, ``eos_token_id``, ``stop``...). Nothing is submitted until
        the iteration begins.

        ``deadline_s``: the request must finish within this many seconds of its submission;
        past it, at the next step boundary, it is dropped (its blocks freed) and the stream raises
        :class:`DeadlineExceeded` after the tokens it already produced. Leaving the iteration
        early (``break``, cancellation, ``aclose()``) aborts the request and frees its KV blocks.
        """
        return self._items(prompt_ids, priority, tenant, deadline_s, sampling, detailed=False)

    def generate_logprobs(
        self,
        prompt_ids: Sequence[int],
        *,
        priority: int = 0,
        tenant: Hashable = None,
        deadline_s: float | None = None,
        **sampling: Any,
    ) -> AsyncIterator[TokenLogprobs]:
        """:meth:`generate`, streaming a :class:`TokenLogprobs` per item instead of a bare id.

        With ``prompt_logprobs=k``, the prompt's tokens come first (``prompt=True``): one entry
        per prompt token after the first (the first has no context to be predicted from). Then
        each new token with its logprob and its ``logprobs`` (default 0) most likely
        alternatives, from the raw logits (before temperature, top-k, top-p).
        """
        _with_logprobs(sampling)
        return self._items(prompt_ids, priority, tenant, deadline_s, sampling, detailed=True)

    async def _items(
        self,
        prompt_ids: Sequence[int],
        priority: int,
        tenant: Hashable,
        deadline_s: float | None,
        sampling: dict[str, Any],
        *,
        detailed: bool,
    ) -> AsyncIterator[Any]:
        rid, stream = self._submit(
            prompt_ids, self._params(sampling), priority, tenant, _Stream(detailed), deadline_s=deadline_s
        )
        async with contextlib.aclosing(self._read(rid, stream)) as items:  # closed when this one is
            async for item in items:
                yield item

    async def _read(self, rid: Hashable, stream: _Stream) -> AsyncGenerator[Any, None]:
        """A submitted request's items as they come; leaving early aborts it."""
        try:
            while True:
                ready, item, waiter = stream._next_or_park(new_async_waiter)
                if not ready:
                    await waiter
                    continue
                if item is None:
                    return
                yield item
        finally:
            if not stream.done:
                self.abort(rid)

    def generate_n(
        self,
        prompt_ids: Sequence[int],
        n: int,
        *,
        priority: int = 0,
        tenant: Hashable = None,
        deadline_s: float | None = None,
        detailed: bool = False,
        **sampling: Any,
    ) -> list[AsyncGenerator[Any, None]]:
        """``n`` samples of one prompt: an async iterator each, of token ids as :meth:`generate`
        streams them (``detailed``: of :class:`TokenLogprobs`, as :meth:`generate_logprobs`).

        Sample ``i`` is seeded ``seed + i`` (wrapping within the seeds a generator takes; without
        a seed, each draws its own). The ``n`` requests are queued together when any iterator
        is first read, and refused together (the refusal is raised by every iterator, and none of
        them runs): ``max_waiting`` lets in all ``n`` or none. With prefix caching, the samples
        after the first are admitted once the first has computed the prompt, and take its full
        blocks from the prefix cache instead of computing them again (its last, partial block
        each computes). Leaving an
        iterator early aborts its own sample only.

        Raises:
            ValueError: ``n`` is not an int >= 1, or a sampling field is invalid (on the call).
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if detailed:
            _with_logprobs(sampling)
        first = self._params(dict(sampling))
        seed = first.seed
        params = [first] + [
            first if seed is None else dataclasses.replace(first, seed=nth_seed(seed, i)) for i in range(1, n)
        ]
        queued: list[tuple[Hashable, _Stream]] = []
        refused: list[BaseException] = []

        def queue_all() -> None:
            if queued or refused:
                return
            try:
                group = self._enqueue_group(
                    prompt_ids, params, priority, tenant, [_Stream(detailed) for _ in params], deadline_s, None
                )
            except BaseException as exc:
                refused.append(exc)
                raise
            queued.extend((req.request_id, stream) for req, stream in group)

        async def sample_stream(i: int) -> AsyncGenerator[Any, None]:
            queue_all()
            if refused:
                raise refused[0]
            rid, stream = queued[i]
            async with contextlib.aclosing(self._read(rid, stream)) as items:
                async for item in items:
                    yield item

        return [sample_stream(i) for i in range(n)]

    def generate_sync(
        self,
        prompt_ids: Sequence[int],
        *,
        priority: int = 0,
        tenant: Hashable = None,
        deadline_s: float | None = None,
        **sampling: Any,
    ) -> Iterator[int]:
        """The blocking twin of :meth:`generate`, for threads."""
        return self._items_sync(prompt_ids, priority, tenant, deadline_s, sampling, detailed=False)

    def generate_logprobs_sync(
        self,
        prompt_ids: Sequence[int],
        *,
        priority: int = 0,
        tenant: Hashable = None,
        deadline_s: float | None = None,
        **sampling: Any,
    ) -> Iterator[TokenLogprobs]:
        """The blocking twin of :meth:`generate_logprobs`, for threads."""
        _with_logprobs(sampling)
        return self._items_sync(prompt_ids, priority, tenant, deadline_s, sampling, detailed=True)

    def _items_sync(
        self,
        prompt_ids: Sequence[int],
        priority: int,
        tenant: Hashable,
        deadline_s: float | None,
        sampling: dict[str, Any],
        *,
        detailed: bool,
    ) -> Iterator[Any]:
        rid, stream = self._submit(
            prompt_ids, self._params(sampling), priority, tenant, _Stream(detailed), deadline_s=deadline_s
        )
        try:
            while True:
                ready, item, waiter = stream._next_or_park(ThreadWaiter)
                if not ready:
                    waiter.wait()
                    continue
                if item is None:
                    return
                yield item
        finally:
            if not stream.done:
                self.abort(rid)

    def submit(
        self,
        prompt_ids: Sequence[int],
        *,
        priority: int = 0,
        tenant: Hashable = None,
        deadline_s: float | None = None,
        **sampling: Any,
    ) -> concurrent.futures.Future[list[int]]:
        """Queue a request; the future resolves to its complete list of new tokens (or raises
        :class:`DeadlineExceeded` past ``deadline_s``, see :meth:`generate`).

        Cancelling the future aborts the request.
        """
        return self._submit_future(prompt_ids, priority, tenant, deadline_s, sampling, detailed=False)

    def submit_logprobs(
        self,
        prompt_ids: Sequence[int],
        *,
        priority: int = 0,
        tenant: Hashable = None,
        deadline_s: float | None = None,
        **sampling: Any,
    ) -> concurrent.futures.Future[list[TokenLogprobs]]:
        """:meth:`submit` whose future resolves to the items :meth:`generate_logprobs` streams."""
        _with_logprobs(sampling)
        return self._submit_future(prompt_ids, priority, tenant, deadline_s, sampling, detailed=True)

    def _submit_future(
        self,
        prompt_ids: Sequence[int],
        priority: int,
        tenant: Hashable,
        deadline_s: float | None,
        sampling: dict[str, Any],
        *,
        detailed: bool,
    ) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        stream = _Stream(detailed)
        stream.future = fut
        rid, _ = self._submit(prompt_ids, self._params(sampling), priority, tenant, stream, deadline_s)
        fut.add_done_callback(lambda f: self._future_cancelled(f, rid) if f.cancelled() else None)
        return fut

    def _future_cancelled(self, fut: concurrent.futures.Future[Any], rid: Hashable) -> None:
        # A cancelled future counts as done for concurrent.futures.wait() and as_completed() only
        # once notified; no one else calls set_running_or_notify_cancel() on these futures.
        fut.set_running_or_notify_cancel()
        self.abort(rid)

    async def agenerate_all(self, prompt_ids: Sequence[int], **kwargs: Any) -> list[int]:
        """Await a request's complete output (async twin of :meth:`submit`)."""
        return [t async for t in self.generate(prompt_ids, **kwargs)]

    def abort(self, request_id: Hashable) -> None:
        """Stop a request and free its blocks at the next step boundary, of the engine thread or
        of :meth:`step_once` (which then reports it as a finished ``"abort"`` event). The ids are
        those of requests added with ``scheduler.add(Request(request_id, ...))``; a ``generate``
        stream is aborted by leaving it, a ``submit`` future by cancelling it."""
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    def _check_fits(self, prompt_len: int, tenant: Hashable) -> None:
        """Refuse at submit a prompt that could never be admitted, even with the cache to itself
        (the scheduler would refuse it too, but only on the engine thread, after the call).

        It counts the prompt and the first token it generates, as the scheduler's admission does
        (a running request always has room for its next token's K/V): a prompt that exactly
        fills the cache is refused, whatever its ``max_new_tokens``.

        Raises:
            KVCacheExhausted: the prompt and its first generated token need more blocks than
                admission can ever give them, or than its tenant's quota.
        """
        problem = self.allocator.never_fits(prompt_len + 1, tenant)
        if problem is not None:
            raise KVCacheExhausted(
                f"a {prompt_len}-token prompt, with its first generated token, {problem}; shorten the prompt "
                "or give the cache more blocks"
            )

    # ------------------------------------------------------------------ the engine

    def _engine(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            # A fault of the loop itself (not of a step: those fail their requests): no engine
            # is left to serve, so end every request now and refuse new ones, instead of leaving
            # their callers waiting for ever.
            with self._cond:
                self._closing = True
                # The inbox, and what was being taken from it (those the scheduler has not seen).
                inbox = self._inbox + [(r, s) for r, s in self._admitting if r.request_id not in self._streams]
                pending = list(self._streams.items()) + [(r.request_id, s) for r, s in inbox]
                self._streams, self._inbox, self._admitting = {}, [], []
            failed = BatcherClosed(f"the decode loop's engine failed: {exc!r}")
            failed.__cause__ = exc
            wake_all(
                w for rid, st in pending if (w := st.push(TokenEvent(rid, None, True, "error", failed))) is not None
            )
            # As a close would: the blocks back in the pool, statistics() counting them aborted.
            try:
                self._abort_all([r for r, _ in inbox if self.scheduler.get(r.request_id) is None])
            except Exception:  # a scheduler the fault left inconsistent: the fault is what to raise
                logger.exception("the decode loop could not abort its requests after its engine failed")
            raise
        finally:
            self._stopped.set()

    def _serve(self) -> None:
        while True:
            with self._cond:
                while not (self._inbox or self._aborts or self._closing or self.scheduler.has_work()):
                    self._cond.wait()
                if self._closing:
                    pending = list(self._streams.items()) + [(r.request_id, s) for r, s in self._inbox]
                    unadmitted = [r for r, _ in self._inbox]
                    self._inbox.clear()
                    self._streams = {}
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, []
                self._admitting = inbox
            now = self.clock.now()  # the step's time: its arrivals' and its scheduling's
            if inbox:
                with self._cond:  # counted by _num_waiting() once, in the inbox or the scheduler
                    wake = self._add_inbox(inbox, now)
                    self._admitting = []
            else:
                wake = []
            for rid in aborts:
                if self.scheduler.abort(rid):
                    aborted = self._streams.pop(rid, None)
                    if aborted is not None:
                        wake.append(aborted.push(TokenEvent(rid, None, True, "abort")))
            step, events = self._step(now)
            wake += self._route(events)
            wake_all(w for w in wake if w is not None)
            if not step.requests and not inbox and not aborts:
                with self._cond:  # nothing could run (e.g. waiting on room): wait for news
                    self._cond.wait(0.01)
        self._shut_down(pending, unadmitted)

    def _add_inbox(self, inbox: list[tuple[Request, _Stream]], now: float) -> list[Any]:
        """Hand the requests taken from the inbox to the scheduler, arrived at ``now``; the
        waiters to wake of those it refused (their streams get the error)."""
        wake: list[Any] = []
        for req, stream in inbox:
            try:
                self.scheduler.add(req, now)
            except Exception as exc:  # noqa: BLE001 - the caller gets it on its stream
                wake.append(stream.push(TokenEvent(req.request_id, None, True, "error", exc)))
                continue
            self._streams[req.request_id] = stream
        return wake

    def _route(self, events: list[TokenEvent]) -> list[Any]:
        """Push each event to its request's stream (a finished one leaves); the waiters to wake."""
        wake: list[Any] = []
        for ev in events:
            target = self._streams.get(ev.request_id)
            if target is None:
                continue
            if ev.finished:
                del self._streams[ev.request_id]
            wake.append(target.push(ev))
        return wake

    def _shut_down(self, pending: list[tuple[Hashable, _Stream]], unadmitted: list[Request]) -> None:
        """End what the closed engine leaves: abort it in the scheduler (this is its thread), so
        that its blocks go back to the pool and statistics() counts it aborted, not running or
        waiting for ever; its callers get BatcherClosed."""
        self._abort_all(unadmitted)
        closed = BatcherClosed("the decode loop was closed")
        wake_all(w for rid, s in pending if (w := s.push(TokenEvent(rid, None, True, "abort", closed))) is not None)

    def step_once(self) -> tuple[ScheduledStep, list[TokenEvent]]:
        """Run one iteration in the calling thread: schedule, run the step, sample, update.

        The engine thread calls this in a loop; tests and simulators may drive a loop whose
        threaded API is unused the same way (with ``scheduler.add``), never both at once.
        A step function that raises fails that step's requests, not the loop.

        Raises:
            RuntimeError: another thread runs the engine (``generate()`` / ``submit()`` started
                it): two threads stepping one scheduler would corrupt it.
            BatcherClosed: after :meth:`close` of a loop no engine thread ran (close aborted
                what was left).
        """
        engine = self._thread
        if engine is None and self._closing:
            raise BatcherClosed("the decode loop was closed: step_once() has nothing left to run")
        if engine is not None and engine is not threading.current_thread() and engine.is_alive():
            raise RuntimeError(
                f"the engine runs in thread {engine.name!r}; step_once() drives a loop whose generate()/"
                "submit() API is unused (add requests with scheduler.add), or use engine='caller'"
            )
        return self._step(self.clock.now())

    def _step(self, now: float) -> tuple[ScheduledStep, list[TokenEvent]]:
        """One iteration that starts at ``now``: the aborts asked for, schedule, run, update."""
        with self._cond:  # aborts asked for with abort() (the engine thread drains its own first)
            aborts, self._aborts = self._aborts, []
        dropped = [TokenEvent(rid, None, True, "abort") for rid in aborts if self.scheduler.abort(rid)]
        step = self.scheduler.schedule(now)
        events = dropped + self.scheduler.take_events()
        if step.requests:
            try:
                events += self._run_step(step)
            except Exception as exc:  # noqa: BLE001 - a failing step fails its requests, not the loop
                for req in step.requests:
                    if self.scheduler.abort(req.request_id):
                        events.append(TokenEvent(req.request_id, None, True, "error", exc))
        if self._runner.grammars:  # after every way this step ends requests: finished, failed, aborted
            self._runner.grammars.discard_ended()
        return step, events

    def _run_step(self, step: ScheduledStep) -> list[TokenEvent]:
        """Run a scheduled step (:meth:`StepRunner.run`), then the scheduler's update; the
        requests whose rows failed end with their errors."""
        out = self._runner.run(step)
        self._record_step(out.started, out.ended, len(out.tokens))
        events = self.scheduler.update(step, out.tokens, out.logprobs, out.ended)
        return self._fail_rows(events, out.failed) if out.failed else events

    def _record_step(self, t0: float, done: float, num_tokens: int) -> None:
        """Count a step that ran from ``t0`` to ``done`` and sampled ``num_tokens`` tokens."""
        self._step_time.add(done - t0)
        self._steps += 1
        self._generated += num_tokens
        if self._t_first is None:
            self._t_first = t0
        self._t_last = done

    def _fail_rows(self, events: list[TokenEvent], failed: Mapping[Hashable, BaseException]) -> list[TokenEvent]:
        """``events`` with the requests of ``failed`` (rows no token could be drawn from, a bias
        past the logits, a grammar, sampling that raised) failed instead, each with its error."""
        events = [ev for ev in events if ev.request_id not in failed]
        for rid, error in failed.items():
            self.scheduler.abort(rid)  # False if the sampled token had finished it: fail it all the same
            events.append(TokenEvent.ended(rid, "error", error))
        return events

    def build_batch(self, step: ScheduledStep, device: Any = "cpu") -> StepBatch:
        """The :class:`StepBatch` that :meth:`step_once` hands the step function for ``step``
        (a ``Scheduler.schedule()`` result), on ``device``; for profiling and custom drivers."""
        return self._runner.build_batch(step, device)

    # ------------------------------------------------------------------ tuning (batchkit.control.TunableTarget)

    def _num_waiting(self) -> int:
        """Requests not yet running (call under the lock). Those the engine took from the inbox
        count until they are in the scheduler, which it adds them to under the lock: each is
        counted once."""
        return len(self._inbox) + len(self._admitting) + len(self.scheduler.waiting)

    def queue_depth(self) -> int:
        """Requests waiting for admission now: submitted or preempted, not running."""
        with self._cond:
            return self._num_waiting()

    def free_seats(self) -> int:
        """Seats free now: ``max_num_seqs`` less the running requests. The next step admits
        waiting requests into them (KV blocks allowing): ``max_waiting`` bounds the requests
        waiting beyond them."""
        return max(0, self.scheduler.max_num_seqs - len(self.scheduler.running))

    def latency_samples(self, since: int = 0) -> tuple[list[float], int]:
        """Time-per-output-token samples (seconds) after the first ``since``, and the next count."""
        return self.scheduler.tpot_samples(since)

    def set_batch_limit(self, size: int) -> None:
        """Run at most ``size`` requests at once from the next step on (``max_num_seqs``).

        Raises:
            ValueError: ``size`` < 1.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"the batch limit (max_num_seqs) must be an int >= 1, got {size!r}")
        self.scheduler.max_num_seqs = size  # read once per schedule(): one attribute store is atomic

    # ------------------------------------------------------------------ lifecycle

    def run_engine(self) -> None:
        """Run the engine in the calling thread until :meth:`close` is called (from another thread).

        For a loop made with ``engine="caller"``, so that the model steps in a thread you choose,
        e.g. the main thread with the server or event loop in another one (on a CPU, torch's
        OpenMP workers behave differently in the main thread; ``benchmarks/llm_real.py`` measures
        both). Requests submitted before this is called wait.

        Raises:
            RuntimeError: the loop starts its own engine thread, or the engine already runs.
            BatcherClosed: the engine ran and stopped (the loop was closed): make a new loop.
        """
        self._claim_engine("run_engine")
        self._engine()

    def _claim_engine(self, caller: str) -> None:
        """Make the calling thread the engine's, or raise why it cannot be."""
        if self.engine != "caller":
            raise RuntimeError(f"{caller}() needs a loop made with engine='caller'; this one runs its own thread")
        with self._cond:
            if self._thread is not None:
                if self._stopped.is_set():
                    raise BatcherClosed(
                        f"the decode loop is closed: its engine ran in thread {self._thread.name!r} and stopped; "
                        "make a new loop"
                    )
                raise RuntimeError(f"the engine already runs in thread {self._thread.name!r}")
            self._thread = threading.current_thread()

    def run_with(self, main: Callable[[], Awaitable[T]], *, backend: str = "asyncio") -> T:
        """Run ``main`` (an async function of yours: a server, a client, a job) on an event loop
        in a second thread while the calling thread runs the engine; once ``main`` returns, close
        the loop and return its result (or raise what it raised).

        For a loop made with ``engine="caller"``, called from the main thread: on a CPU, torch
        steps the model faster there (measured in docs/benchmarks.md, "A real LLM")::

            loop = ContinuousDecodeLoop(model, kv, engine="caller")

            async def main() -> list[int]:
                return [t async for t in loop.generate(prompt_ids, max_new_tokens=32)]

            tokens = loop.run_with(main)

        Args:
            main: an async function taking no arguments.
            backend: ``"asyncio"`` or ``"trio"`` (anyio's backends).

        Raises:
            RuntimeError: the loop starts its own engine thread, or the engine already runs.
            BatcherClosed: the engine ran and stopped (the loop was closed, e.g. by an earlier
                ``run_with``): make a new loop. ``main`` is not started then.
        """
        import anyio

        self._claim_engine("run_with")
        outcome: list[Any] = []

        def app() -> None:
            try:
                outcome.append((True, anyio.run(main, backend=backend)))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                outcome.append((False, exc))
            finally:
                self.close()

        thread = threading.Thread(target=app, name="batchkit-app", daemon=True)
        thread.start()
        self._engine()
        thread.join()
        ok, value = outcome[0]
        if not ok:
            raise value
        return cast(T, value)

    def close(self, timeout: float | None = None) -> None:
        """Stop the engine: requests still running end with :class:`BatcherClosed`. Idempotent.

        Waits up to ``timeout`` seconds (None: as long as it takes) for the engine to finish its
        step, unless called from the engine's own thread.
        """
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread = self._thread
            # No engine ever ran (engine="caller" before run_engine()): nobody else will end
            # the requests waiting in the inbox, so end them here.
            orphans = [] if thread is not None else self._inbox
            if thread is None:
                self._inbox = []
        if thread is None:
            # Nor will anyone step the scheduler again: requests added with scheduler.add() and
            # driven by step_once() are aborted too, their blocks back in the pool.
            self._abort_all([r for r, _ in orphans])
        if orphans:
            closed = BatcherClosed("the decode loop was closed")
            wake_all(
                w
                for r, s in orphans
                if (w := s.push(TokenEvent(r.request_id, None, True, "abort", closed))) is not None
            )
        if thread is not None and thread is not threading.current_thread():
            self._stopped.wait(timeout)

    def _abort_all(self, unadmitted: list[Request]) -> None:
        """Abort every request the scheduler holds, and ``unadmitted`` (taken from the inbox
        before it saw them), so that their blocks go back to the pool and statistics() counts
        them aborted. Only the thread that steps the scheduler, or close() when none does."""
        sched = self.scheduler
        for req in [*sched.running, *sched.swapped, *sched.waiting]:
            sched.abort(req.request_id)
        self._abort_unadmitted(unadmitted)

    def _abort_unadmitted(self, requests: list[Request]) -> None:
        """Requests that close() ends before the scheduler ever saw them (still in the inbox)
        are added and aborted there, so that statistics() counts them aborted like the rest."""
        for req in requests:
            try:
                self.scheduler.add(req)
            except Exception:  # noqa: BLE001 - refused at add: it never ran, nothing to count
                continue
            self.scheduler.abort(req.request_id)

    async def aclose(self) -> None:
        import anyio

        await anyio.to_thread.run_sync(self.close)

    def __enter__(self) -> ContinuousDecodeLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def statistics(self) -> LoopStatistics:
        span = self._t_last - self._t_first if self._t_first is not None else 0.0
        return LoopStatistics(
            scheduler=self.scheduler.statistics(),
            steps=self._steps,
            tokens_per_s=self._generated / span if span > 0 else 0.0,
            step_time=self._step_time.summary(),
            step_time_recent=self._step_time.recent(),
        )

    def __repr__(self) -> str:
        s = self.scheduler
        return (
            f"<ContinuousDecodeLoop running={len(s.running)} waiting={len(s.waiting)} "
            f"max_num_seqs={s.max_num_seqs} max_num_batched_tokens={s.max_num_batched_tokens}>"
        )
