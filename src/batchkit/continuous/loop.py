"""ContinuousDecodeLoop: iteration-level batching around a user's torch decode step.

A thin shell: the engine thread and the public API. Callers (threads, asyncio or trio tasks)
submit through one path (a :class:`RequestOptions` each) into the :class:`Inbox` and read their
own :class:`RequestStream`, so the step never waits on them and they never wait on each other.
One engine thread takes the inbox at each step boundary and drives the :class:`EngineCore`
(``schedule()`` -> :meth:`StepRunner.run` -> ``update()``), which streams the new tokens to their
callers.
"""

from __future__ import annotations

import concurrent.futures
import functools
import operator
import threading
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
from typing import Any, Literal, TypeVar, cast

from .._clock import Clock, checked_clock
from .._validate import positive_int, positive_int_or_none
from .._waiters import wake_all
from ..kv.allocator import PagedKVAllocator
from ..kv.cache import PagedKVCache
from .engine import EngineCore, LoopStatistics
from .inbox import Inbox
from .logprobs import TokenLogprobs
from .options import RequestOptions, sampling_params
from .request import ScheduledStep, TokenEvent
from .runner import StepFn, StepRunner
from .sampling import SamplingParams, token_ids
from .scheduler import PreemptionMode, Scheduler
from .step import StepBatch
from .submit import Submitter

__all__ = ["ContinuousDecodeLoop", "LoopStatistics"]

T = TypeVar("T")


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
    positive_int_or_none("max_waiting", max_waiting, note="(None: unbounded)")
    if engine not in ("thread", "caller"):
        raise ValueError(f"engine must be 'thread' or 'caller', got {engine!r}")
    return eos_token_id


def _sliding_window_of(step_fn: object) -> int | None:
    """The window every layer of the step's model attends over (its ``sliding_window``
    attribute, as :class:`~batchkit.models.HFStepModel` has), or None."""
    window = getattr(step_fn, "sliding_window", None)
    return window if isinstance(window, int) and not isinstance(window, bool) and window >= 1 else None


def _cpu_pool(kv_cache: PagedKVCache, num_cpu_blocks: int) -> PagedKVCache | None:
    """The CPU swap pool's tensors, shaped as ``kv_cache``'s blocks (None without CPU blocks)."""
    if not num_cpu_blocks:
        return None
    return PagedKVCache(
        kv_cache.num_layers,
        num_cpu_blocks,
        kv_cache.block_size,
        kv_cache.num_kv_heads,
        kv_cache.head_dim,
        dtype=kv_cache.dtype,
        device="cpu",
    )


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

    Attributes:
        core: the :class:`EngineCore` the engine thread steps (``scheduler``, ``runner``).

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
        self.cpu_cache = _cpu_pool(kv_cache, num_cpu_blocks)
        runner = StepRunner(step_fn, kv_cache, self.cpu_cache, self.allocator, self.clock)
        self.core = EngineCore(self.scheduler, runner)
        self.eos_token_id = eos_token_id
        self._extra_eos_ids: tuple[int, ...] = ()
        # The inbox, and the engine's lifecycle; len(_inbox): requests it holds.
        self._inbox = Inbox(self.scheduler, self.clock, max_waiting, self._engine if engine == "thread" else None)
        self._submitter = Submitter(runner, self.scheduler, self._inbox)

    @property
    def max_waiting(self) -> int | None:
        """Most requests waiting beyond the free seats (None: unbounded); settable, from the next
        submit on (the :class:`Inbox` holds it).

        Raises:
            ValueError: (on setting) not an int >= 1 nor None.
        """
        return self._inbox.max_waiting

    @max_waiting.setter
    def max_waiting(self, max_waiting: int | None) -> None:
        self._inbox.max_waiting = positive_int_or_none("max_waiting", max_waiting, note="(None: unbounded)")

    @property
    def step_fn(self) -> StepFn:
        """The step function the loop runs (settable: the next step calls the new one)."""
        return self.core.runner.step_fn

    @step_fn.setter
    def step_fn(self, step_fn: StepFn) -> None:
        self.core.runner.step_fn = step_fn

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

    def _sampling(self, fields: dict[str, Any], detailed: bool) -> SamplingParams:
        """A call's sampling fields with this loop's end-of-sequence ids."""
        return sampling_params(fields, self.eos_token_id, self._extra_eos_ids, detailed=detailed)

    def _options(
        self, fields: dict[str, Any], priority: int, tenant: Hashable, deadline_s: float | None, detailed: bool
    ) -> RequestOptions:
        """The options of a call that submits one request."""
        return RequestOptions(self._sampling(fields, detailed), priority, tenant, deadline_s, detailed=detailed)

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
        return self._submitter.stream(prompt_ids, lambda: self._options(sampling, priority, tenant, deadline_s, False))

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
        return self._submitter.stream(prompt_ids, lambda: self._options(sampling, priority, tenant, deadline_s, True))

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
        positive_int("n", n)
        params = self._sampling(sampling, detailed)
        return self._submitter.samples(
            prompt_ids, n, lambda: RequestOptions(params, priority, tenant, deadline_s, n, detailed)
        )

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
        return self._submitter.stream_sync(
            prompt_ids, lambda: self._options(sampling, priority, tenant, deadline_s, False)
        )

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
        return self._submitter.stream_sync(
            prompt_ids, lambda: self._options(sampling, priority, tenant, deadline_s, True)
        )

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
        return self._submitter.future(prompt_ids, self._options(sampling, priority, tenant, deadline_s, False))

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
        return self._submitter.future(prompt_ids, self._options(sampling, priority, tenant, deadline_s, True))

    async def agenerate_all(self, prompt_ids: Sequence[int], **kwargs: Any) -> list[int]:
        """Await a request's complete output (async twin of :meth:`submit`)."""
        return [t async for t in self.generate(prompt_ids, **kwargs)]

    def abort(self, request_id: Hashable) -> None:
        """Stop a request and free its blocks at the next step boundary, of the engine thread or
        of :meth:`step_once` (which then reports it as a finished ``"abort"`` event). The ids are
        those of requests added with ``scheduler.add(Request(request_id, ...))``; a ``generate``
        stream is aborted by leaving it, a ``submit`` future by cancelling it."""
        self._inbox.abort(request_id)

    # ------------------------------------------------------------------ the engine

    def _engine(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            # A fault of the loop itself (not of a step: those fail their requests): no engine
            # is left to serve, so end every request now and refuse new ones, instead of leaving
            # their callers waiting for ever.
            self.core.fail(self._inbox.fail(self.core.streams), exc)
            raise
        finally:
            self._inbox.stopped.set()

    def _serve(self) -> None:
        core, inbox = self.core, self._inbox
        while True:
            arrivals, aborts, closing = inbox.take(core.scheduler.has_work)
            if closing:
                core.shut_down(arrivals)
                return
            now = self.clock.now()  # the step's time: its arrivals' and its scheduling's
            wake = inbox.hand_over(functools.partial(core.admit, arrivals, now)) if arrivals else []
            step, events = core.step(now, aborts + inbox.take_aborts())
            wake += core.route(events)
            wake_all(w for w in wake if w is not None)
            if not step.requests and not arrivals and not aborts:
                inbox.wait_for_news(0.01)  # nothing could run (e.g. waiting on room): wait for news

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
        self._inbox.check_stepper()
        return self.core.step(self.clock.now(), self._inbox.take_aborts())

    def build_batch(self, step: ScheduledStep, device: Any = "cpu") -> StepBatch:
        """The :class:`StepBatch` that :meth:`step_once` hands the step function for ``step``
        (a ``Scheduler.schedule()`` result), on ``device``; for profiling and custom drivers."""
        return self.core.runner.build_batch(step, device)

    # ------------------------------------------------------------------ tuning (batchkit.control.TunableTarget)

    def queue_depth(self) -> int:
        """Requests waiting for admission now: submitted or preempted, not running."""
        return self._inbox.num_waiting()

    def free_seats(self) -> int:
        """Seats free now: ``max_num_seqs`` less the running requests. The next step admits
        waiting requests into them (KV blocks allowing): ``max_waiting`` bounds the requests
        waiting beyond them."""
        return self._inbox.free_seats()

    def latency_samples(self, since: int = 0) -> tuple[list[float], int]:
        """Time-per-output-token samples (seconds) after the first ``since``, and the next count."""
        return self.scheduler.tpot_samples(since)

    def set_batch_limit(self, size: int) -> None:
        """Run at most ``size`` requests at once from the next step on (``max_num_seqs``).

        Raises:
            ValueError: ``size`` < 1.
        """
        positive_int("the batch limit (max_num_seqs)", size)
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
        self._inbox.claim("run_engine")
        self._engine()

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

        self._inbox.claim("run_with")
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
        thread, orphans = self._inbox.close()
        if thread is None:
            # No engine ever ran (engine="caller" before run_engine()): nobody else will end the
            # requests waiting in the inbox, nor step the scheduler again (requests added with
            # scheduler.add() and driven by step_once()): end them here, their blocks back in the pool.
            self.core.shut_down(orphans)
        elif thread is not threading.current_thread():
            self._inbox.stopped.wait(timeout)

    async def aclose(self) -> None:
        import anyio

        await anyio.to_thread.run_sync(self.close)

    def __enter__(self) -> ContinuousDecodeLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def statistics(self) -> LoopStatistics:
        return self.core.statistics()

    def __repr__(self) -> str:
        s = self.scheduler
        return (
            f"<ContinuousDecodeLoop running={len(s.running)} waiting={len(s.waiting)} "
            f"max_num_seqs={s.max_num_seqs} max_num_batched_tokens={s.max_num_batched_tokens}>"
        )
