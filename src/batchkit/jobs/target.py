"""The batch function of a job behind one interface: submit a record, get a future.

A plain batch function gets a :class:`~batchkit.DynamicBatcher` of the job's own (errors
isolated, a record retried alone after a batch timeout in a call of its own); a ``@batched``
function or a batcher keeps its own settings; a :func:`~batchkit.jobs.generate_fn` job submits
to its decode loop. The job sizes its read-ahead window from what the target says.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..continuous.loop import ContinuousDecodeLoop
from ..dynamic.batcher import DynamicBatcher
from ..dynamic.decorator import AsyncBatchedFunction, BatchedFunction
from .generate import LoopFunction, qualified_name

__all__ = ["Target", "fn_identity", "make_target"]

logger = logging.getLogger(__name__)


@dataclass
class Target:
    """The batch function behind one interface: submit a record, get a future."""

    submit: Callable[[dict[str, Any]], concurrent.futures.Future[Any]]
    flush: Callable[[], None]
    close: Callable[[bool], None]  # close(drain)
    window: int  # the default max_in_flight
    cap: int | None  # a hard limit on max_in_flight (the batcher's queue)
    counts_tokens: bool
    batch_size: int  # records per call (fail_fast counts in batches of it)
    # Submit a record to be run in a call of its own: a batch that timed out does not say which
    # of its records hung, so each is retried alone and only the culprit times out again.
    submit_alone: Callable[[dict[str, Any]], concurrent.futures.Future[Any]] | None = None
    result_field: str = "output"  # the output lines' field that holds each result


def _no_close(drain: bool) -> None:
    pass


def make_target(
    fn: Any, *, max_batch: int, max_wait_ms: float, concurrency: int, batch_timeout_s: float | None, owned_queue: int
) -> Target:
    """``fn`` as a :class:`Target`: a decode loop's job function, a user's batcher (its own
    settings), or a plain batch function in a batcher built here.

    Raises:
        TypeError: ``fn`` is a bare decode loop (wrap it with ``generate_fn``) or not callable.
    """
    if isinstance(fn, LoopFunction):
        n = fn.max_num_seqs
        return Target(fn.submit, lambda: None, _no_close, 2 * n, None, True, n, result_field=fn.result_field)
    if isinstance(fn, ContinuousDecodeLoop):
        raise TypeError(
            "a ContinuousDecodeLoop generates from token ids: wrap it with its tokenizer, "
            "batchkit.jobs.generate_fn(loop, encode=tok.encode, decode=tok.decode, max_new_tokens=...)"
        )
    if isinstance(fn, (BatchedFunction, AsyncBatchedFunction)):
        return _users_batcher(fn.batcher)
    if isinstance(fn, DynamicBatcher):
        return _users_batcher(fn)
    if callable(fn):
        return _own_batcher(
            fn,
            max_batch=max_batch,
            max_wait_ms=max_wait_ms,
            concurrency=concurrency,
            batch_timeout_s=batch_timeout_s,
            owned_queue=owned_queue,
        )
    raise TypeError(
        f"fn must be a batch function (a list of records -> one result per record), a @batched function or "
        f"batchkit.jobs.generate_fn(...), got {fn!r}"
    )


def _own_batcher(
    fn: Callable[..., Any],
    *,
    max_batch: int,
    max_wait_ms: float,
    concurrency: int,
    batch_timeout_s: float | None,
    owned_queue: int,
) -> Target:
    """A plain batch function in a batcher of the job's own, closed with the job."""
    # A record retried alone (its batch timed out) runs in a call of its own through the same
    # batcher, so that --concurrency still bounds the calls: it costs more than a whole batch,
    # and an item over max_batch_cost runs alone. The cost is taken at submit.
    alone: set[int] = set()
    cost_options: dict[str, Any] = {}
    if batch_timeout_s is not None:
        cost_options = {
            "size_fn": lambda record: max_batch + 1 if id(record) in alone else 1,
            "max_batch_cost": max_batch,
        }
    own: DynamicBatcher[Any, Any] = DynamicBatcher(
        fn,
        max_batch_size=max_batch,
        max_wait_ms=max_wait_ms,
        max_concurrent_batches=concurrency,
        max_queue=owned_queue,
        # One bad record must not fail its batch-mates: a batch that raises is split until the
        # culprit is found, and only it is retried and dead-lettered.
        isolate_errors=True,
        batch_timeout_s=batch_timeout_s,
        name=f"job-{getattr(fn, '__name__', 'fn')}",
        **cost_options,
    )

    def submit_alone(record: dict[str, Any]) -> concurrent.futures.Future[Any]:
        alone.add(id(record))
        try:
            return own.submit(record)
        finally:
            alone.discard(id(record))

    def close_own(drain: bool) -> None:
        own.close(drain=drain, timeout=None if drain else 5.0)

    return Target(
        own.submit,
        own.flush,
        close_own,
        2 * max_batch * concurrency,
        owned_queue,
        False,
        max_batch,
        submit_alone if batch_timeout_s is not None else None,
    )


def _users_batcher(batcher: DynamicBatcher[Any, Any]) -> Target:
    """A user's batcher: it keeps its own batch size, wait and concurrency; the job only sizes
    its window, and never closes it."""
    if not batcher.isolate_errors:  # fixed when the batcher was built: the job cannot turn it on
        logger.warning(
            "%s: isolate_errors is off, so a batch that raises fails every record in it (each retried, "
            "then dead-lettered with the batch's error); build it with isolate_errors=True "
            "(@batched(..., isolate_errors=True)) so that only the record that makes it raise fails",
            batcher.name,
        )
    window = 2 * batcher.max_batch_size * batcher.max_concurrent_batches
    return Target(
        batcher.submit, batcher.flush, _no_close, window, batcher.queue.maxsize, False, batcher.max_batch_size
    )


def fn_identity(fn: Any) -> tuple[str, dict[str, Any]]:
    """The function's name and the settings that shape its results, as the journal records them."""
    if isinstance(fn, LoopFunction):
        return fn.job_name, fn.settings()
    if isinstance(fn, DynamicBatcher):
        fn = fn.fn
    return qualified_name(fn), {}
