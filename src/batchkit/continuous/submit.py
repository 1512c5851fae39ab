"""Submitter: the decode loop's one submit path, and the forms a caller reads a request in.

:meth:`Submitter.submit` checks a prompt and its :class:`RequestOptions` against the model and the
KV cache and puts the prompt's requests in the :class:`Inbox`; the loop's documented entry points
(``generate``, ``submit``, ``generate_n`` and their twins) are thin forms of it: an async
iterator, a blocking one, a future, or ``n`` async iterators.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Hashable, Iterator, Sequence
from typing import Any

from .._errors import KVCacheExhausted
from .inbox import Arrival, Inbox
from .options import RequestOptions, check_prompt
from .runner import StepRunner, logit_bias_past
from .scheduler import Scheduler
from .stream import RequestStream, read_async, read_sync

__all__ = ["Submitter"]


class Submitter:
    """Checks requests at submit and queues them in the inbox.

    Args:
        runner: the step's runner (the model's vocabulary, the width of its logits).
        scheduler: its allocator (whether a prompt can ever fit) and detokenize hook.
        inbox: where the requests go, and where a caller that leaves asks for its abort.
    """

    def __init__(self, runner: StepRunner, scheduler: Scheduler, inbox: Inbox) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.inbox = inbox

    def submit(
        self, prompt_ids: Sequence[int], options: RequestOptions, future: concurrent.futures.Future[Any] | None = None
    ) -> list[Arrival]:
        """Check a prompt and its options, and queue its ``options.n`` requests for the engine
        together (``max_waiting`` lets in all or none of them); with ``future``, the first one's
        stream resolves it.

        Raises:
            TypeError, ValueError: a prompt no step could embed, a ``logit_bias`` past the
                vocabulary, stop strings without a detokenize hook.
            KVCacheExhausted: the prompt can never fit. QueueFull, BatcherClosed: from the inbox.
        """
        vocab = self.runner.vocab_size()
        prompt = check_prompt(prompt_ids, vocab)
        width = vocab if vocab is not None else self.runner.logits_width
        if width is not None and (bias_error := logit_bias_past(options.params, width)) is not None:
            raise bias_error  # the samples differ only in their seeds
        if options.params.stop and self.scheduler.detokenize is None:
            raise ValueError(
                f"stop strings {options.params.stop!r} need a detokenize hook to be matched; pass detokenize= "
                "(token ids -> text) to ContinuousDecodeLoop, or stop on token ids with stop_token_ids="
            )
        self._check_fits(len(prompt), options.tenant)
        streams = [RequestStream(options.detailed) for _ in range(options.n)]
        streams[0].future = future
        return self.inbox.put(prompt, options, options.samples(), streams)

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
        problem = self.scheduler.allocator.never_fits(prompt_len + 1, tenant)
        if problem is not None:
            raise KVCacheExhausted(
                f"a {prompt_len}-token prompt, with its first generated token, {problem}; shorten the prompt "
                "or give the cache more blocks"
            )

    async def stream(self, prompt_ids: Sequence[int], options: Callable[[], RequestOptions]) -> AsyncIterator[Any]:
        """A request's items, submitted (``options()`` built and checked) when the iteration
        begins; leaving early aborts it."""
        [(req, stream)] = self.submit(prompt_ids, options())
        async with contextlib.aclosing(read_async(req.request_id, stream, self.inbox.abort)) as items:
            async for item in items:
                yield item

    def stream_sync(self, prompt_ids: Sequence[int], options: Callable[[], RequestOptions]) -> Iterator[Any]:
        """The blocking twin of :meth:`stream`."""
        [(req, stream)] = self.submit(prompt_ids, options())
        yield from read_sync(req.request_id, stream, self.inbox.abort)

    def future(self, prompt_ids: Sequence[int], options: RequestOptions) -> concurrent.futures.Future[Any]:
        """A request whose future resolves to its items; cancelling the future aborts it."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        [(req, _)] = self.submit(prompt_ids, options, fut)
        rid = req.request_id
        fut.add_done_callback(lambda f: self._cancelled(f, rid) if f.cancelled() else None)
        return fut

    def _cancelled(self, fut: concurrent.futures.Future[Any], rid: Hashable) -> None:
        # A cancelled future counts as done for concurrent.futures.wait() and as_completed() only
        # once notified; no one else calls set_running_or_notify_cancel() on these futures.
        fut.set_running_or_notify_cancel()
        self.inbox.abort(rid)

    def samples(
        self, prompt_ids: Sequence[int], n: int, options: Callable[[], RequestOptions]
    ) -> list[AsyncGenerator[Any, None]]:
        """``n`` async iterators, one per sample of ``options()``'s ``n``: the samples are queued
        together when any iterator is first read, and refused together (each iterator raises
        the refusal); leaving an iterator early aborts its own sample only."""
        queued: list[Arrival] = []
        refused: list[BaseException] = []

        def queue_all() -> None:
            if queued or refused:
                return
            try:
                queued.extend(self.submit(prompt_ids, options()))
            except BaseException as exc:
                refused.append(exc)
                raise

        async def sample_stream(i: int) -> AsyncGenerator[Any, None]:
            queue_all()
            if refused:
                raise refused[0]
            req, stream = queued[i]
            async with contextlib.aclosing(read_async(req.request_id, stream, self.inbox.abort)) as items:
                async for item in items:
                    yield item

        return [sample_stream(i) for i in range(n)]
