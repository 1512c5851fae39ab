"""The job's one thread: read, submit, collect, commit.

:class:`Job` reads the input, submits records to the batch function's :class:`Target`, collects
results and commits them through a :class:`~batchkit.jobs.store.JobStore`. It holds at most
``max_in_flight`` records at a time (read, not yet committed: waiting, running, retrying, or
waiting in the reorder buffer), so memory does not grow with the input. The target's threads run
the batch function; futures report back through one queue. Failures are retried with backoff,
then dead-lettered; ``max_failures`` and ``fail_fast`` stop the job early.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import json
import logging
import queue
from collections.abc import Callable, Iterator
from typing import Any

from .._clock import Clock
from .._errors import BatchTimeout, QueueFull
from .fingerprint import Fingerprints, InputCheck, changed_input, content_digest, is_id
from .generate import Generation, OutputLine
from .report import JobProgress
from .source import Malformed, Row, parse_line
from .store import JobStore
from .target import Target

__all__ = ["FAIL_FAST_BATCHES", "Job"]

logger = logging.getLogger(__name__)

FAIL_FAST_BATCHES = 3  # fail_fast: every record of this many batches failed, and none succeeded
_MISSING: Any = object()


class _Item:
    __slots__ = ("alone", "attempts", "digest", "key", "line", "record", "seq")

    def __init__(self, seq: int, line: int, key: Any, record: dict[str, Any], digest: str) -> None:
        self.seq = seq
        self.line = line
        self.key = key
        self.record = record
        self.digest = digest
        self.attempts = 0  # calls of the batch function that failed so far
        self.alone = False  # retried in a call of its own (its batch timed out)


def _to_json(obj: object) -> Any:
    tolist = getattr(obj, "tolist", None)  # numpy and torch scalars and arrays
    if callable(tolist):
        return tolist()
    raise TypeError(f"Object of type {type(obj).__name__} is not JSON serializable")


def _line(obj: dict[str, Any]) -> bytes:
    """One JSONL line. Strings stay readable UTF-8; NaN and infinities are refused (not JSON)."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"), default=_to_json)
    try:
        return (text + "\n").encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: keep them as \u escapes
        return (json.dumps(obj, allow_nan=False, separators=(",", ":"), default=_to_json) + "\n").encode()


def _error_text(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Job:
    """One job's state and its loop, run in the caller's thread (:meth:`run`): the read-ahead
    window, the records in flight, retries due, the reorder buffer, and the counts."""

    def __init__(
        self,
        target: Target,
        store: JobStore,
        check: InputCheck,
        *,
        id_field: str | None,
        window: int,
        retries: int,
        backoff_s: float,
        max_backoff_s: float,
        ordered: bool,
        count_tokens: Callable[[dict[str, Any], Any], int] | None,
        on_commit: Callable[[JobProgress], None] | None,
        bar: Any,
        clock: Clock,
        sleep: Callable[[float], None],
        max_failures: int | None,
        fail_fast: bool,
    ) -> None:
        self.target = target
        self.store = store
        self.id_field = id_field
        self.key_field = id_field if id_field is not None else "line"
        self.window = window
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.ordered = ordered
        self.count_tokens = count_tokens
        self.on_commit = on_commit
        self.bar = bar
        self.clock = clock
        self.sleep = sleep
        # What earlier runs finished, found in the input: a file's by the store before the job
        # starts, an iterable's (read only once) here as it is read.
        self.check = check
        self.max_failures = max_failures
        self.fail_fast_records = FAIL_FAST_BATCHES * target.batch_size if fail_fast else None
        self.stopped: str | None = None
        self.completions: queue.SimpleQueue[tuple[_Item, concurrent.futures.Future[Any]]] = queue.SimpleQueue()
        self.seen_now: set[Any] = set()  # ids read by this run (in flight or finished)
        self.retry_at: list[tuple[float, int, _Item]] = []
        self.held = 0  # read and not yet committed
        self.outstanding = 0  # submitted, future not yet back
        self.next_seq = 0
        self.next_commit = 0
        self.buffer: dict[int, tuple[bytes, bool, _Item]] = {}  # ordered: seq -> (line, is_dead, item)
        self.pending_out: list[tuple[bytes, _Item]] = []
        self.pending_dead: list[tuple[bytes, _Item]] = []
        self.submitted_since_flush = False
        # counters
        self.succeeded = 0
        self.failed = 0
        self.malformed = 0
        self.skipped = 0
        self.duplicates = 0
        self.retried = 0
        self.tokens = 0
        self.peak_held = 0
        self.dead_now = 0  # dead letters decided (committed or not), for max_failures
        self.calls_failed = 0  # records the function was called on that failed, for fail_fast
        self.calls_ok = 0

    # ------------------------------------------------------------------ the loop

    def run(self, records: Iterator[Row]) -> None:
        exhausted = False
        while True:
            while not exhausted and self.held < self.window and self.stopped is None:
                try:
                    line, rec, content = next(records)
                except StopIteration:
                    exhausted = True
                    self._check_finish()
                    break
                self._admit(line, rec, content)
            self._resubmit_due()
            self._drain(block=False)
            self._commit()
            if self.stopped is not None:
                return  # what is committed stays done; what is in flight is redone by a rerun
            if exhausted and self.held == 0:
                return
            if exhausted and self.submitted_since_flush:
                self.target.flush()  # nothing more is coming: do not wait for company
                self.submitted_since_flush = False
            if self.outstanding:
                self._drain(block=True)
            elif self.retry_at:
                self.sleep(max(0.0, self.retry_at[0][0] - self.clock.now()))
            elif exhausted or self.held >= self.window:  # pragma: no cover - a bug, not a state to wait in
                raise RuntimeError(f"job stalled: {self.held} held, none running or retrying")

    def _check_finish(self) -> None:
        if not self.check.done and (reason := self.check.finish()) is not None:
            raise changed_input(self.store.output, reason)

    def _admit(self, line: int, rec: dict[str, Any] | Malformed | None, content: bytes) -> None:
        if not self.check.done and (reason := self.check.feed(line, content)):
            raise changed_input(self.store.output, reason)
        done = self.check.found.pop(line, _MISSING)  # popped: the map shrinks as the job reads
        if done is not _MISSING:  # committed by an earlier run, from this very content
            if done is not None:
                self.seen_now.add(done)  # a later repeat of its id is a duplicate, as on the first run
            self.skipped += 1
            return
        if rec is None:  # a JSONL line: parsed only now, as a record that is not done
            rec = parse_line(content)
        if isinstance(rec, Malformed):
            self.malformed += 1
            self._dead(self._new(line, None, {}, content), rec.reason, quote=rec.text)
            return
        if self.id_field is None:
            key: Any = line
        else:
            key = rec.get(self.id_field, _MISSING)
            if key is _MISSING:
                self._dead(self._new(line, None, rec, content), f"the record has no {self.id_field!r} field")
                return
            if not is_id(key):
                self._dead(
                    self._new(line, None, rec, content),
                    f"the {self.id_field!r} field must be a string or an integer, got {key!r}",
                )
                return
        if key in self.seen_now:
            self.duplicates += 1
            if self.duplicates <= 10:
                logger.warning("line %d repeats id %r; only its first occurrence is processed", line, key)
            return
        self.seen_now.add(key)
        self._submit(self._new(line, key, rec, content))

    def _new(self, line: int, key: Any, rec: dict[str, Any], content: bytes) -> _Item:
        # Digested here, not as read: a resume skips most records (the store checked those).
        item = _Item(self.next_seq, line, key, rec, content_digest(content))
        self.next_seq += 1
        self.held += 1
        self.peak_held = max(self.peak_held, self.held)
        return item

    def _submit(self, item: _Item) -> None:
        submit = self.target.submit_alone if item.alone and self.target.submit_alone else self.target.submit
        try:
            fut = submit(item.record)
        except QueueFull:  # a shared batcher is busy: try again later, not counted as a failure
            heapq.heappush(self.retry_at, (self.clock.now() + self.backoff_s, item.seq, item))
            return
        self.outstanding += 1
        self.submitted_since_flush = True
        fut.add_done_callback(lambda f: self.completions.put((item, f)))

    def _resubmit_due(self) -> None:
        now = self.clock.now()
        while self.retry_at and self.retry_at[0][0] <= now:
            _, _, item = heapq.heappop(self.retry_at)
            self._submit(item)

    def _drain(self, *, block: bool) -> None:
        """Handle every finished future; with ``block``, wait for at least one (or a retry's time)."""
        timeout: float | None = None
        if self.retry_at:
            timeout = max(0.0, self.retry_at[0][0] - self.clock.now())
        while True:
            try:
                item, fut = self.completions.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return
            self.outstanding -= 1
            self._complete(item, fut)
            block = False

    def _complete(self, item: _Item, fut: concurrent.futures.Future[Any]) -> None:
        exc: BaseException | None
        if fut.cancelled():
            exc = concurrent.futures.CancelledError("the batcher cancelled this item")
        else:
            exc = fut.exception()
        if exc is not None:
            item.attempts += 1
            if isinstance(exc, BatchTimeout):
                item.alone = True
            if item.attempts <= self.retries:
                self.retried += 1
                delay = min(self.max_backoff_s, self.backoff_s * 2 ** (item.attempts - 1))
                heapq.heappush(self.retry_at, (self.clock.now() + delay, item.seq, item))
            else:
                self._call_failed(item, _error_text(exc))
            return
        result = fut.result()
        tokens: int | None = None
        line: dict[str, Any] | None = None
        if isinstance(result, Generation):
            tokens, result = result.num_tokens, result.text
        elif isinstance(result, OutputLine):
            tokens, line = result.num_tokens, result.fields
            if line.get(self.key_field, _MISSING) != item.key:  # a resume finds each line by its id
                self._call_failed(item, f"the output line does not hold the record's {self.key_field!r}")
                return
        elif self.count_tokens is not None:
            tokens = int(self.count_tokens(item.record, result))
        try:
            data = _line(line if line is not None else {self.key_field: item.key, "output": result})
        except (TypeError, ValueError) as e:  # retrying would give the same result
            self._call_failed(
                item, f"the result is not JSON-serialisable: {_error_text(e)}", attempts=item.attempts + 1
            )
            return
        if tokens is not None:
            self.tokens += tokens
        self.calls_ok += 1
        self._finish(item, data, dead=False)

    def _call_failed(self, item: _Item, error: str, *, attempts: int | None = None) -> None:
        """A record the function was called on failed for good: a dead letter, and evidence
        for ``fail_fast`` that the function itself is broken."""
        self.calls_failed += 1
        self._dead(item, error, attempts=attempts)
        n = self.fail_fast_records
        if n is not None and self.calls_ok == 0 and self.calls_failed >= n and self.stopped is None:
            self.stopped = (
                f"the first {self.calls_failed:,} records the function was called on all failed "
                f"({FAIL_FAST_BATCHES} batches of {self.target.batch_size}; the last with {error}), so the "
                "function looks broken (fail_fast)"
            )

    def _dead(self, item: _Item, error: str, *, quote: str | None = None, attempts: int | None = None) -> None:
        letter: dict[str, Any] = {}
        if self.id_field is not None:
            letter[self.id_field] = item.key
        letter["line"] = item.line
        letter["error"] = error
        letter["attempts"] = item.attempts if attempts is None else attempts
        if quote is not None:
            letter["input"] = quote
        self._finish(item, _line(letter), dead=True)
        self.dead_now += 1
        if self.max_failures is not None and self.dead_now > self.max_failures and self.stopped is None:
            self.stopped = f"more than {self.max_failures:,} records failed (max_failures={self.max_failures})"

    def _finish(self, item: _Item, data: bytes, *, dead: bool) -> None:
        if self.ordered:
            self.buffer[item.seq] = (data, dead, item)
        elif dead:
            self.pending_dead.append((data, item))
        else:
            self.pending_out.append((data, item))

    def _commit(self) -> None:
        if self.ordered:
            out: list[tuple[bytes, _Item]] = []
            dead: list[tuple[bytes, _Item]] = []
            while self.next_commit in self.buffer:
                data, is_dead, item = self.buffer.pop(self.next_commit)
                (dead if is_dead else out).append((data, item))
                self.next_commit += 1
        else:
            out, dead = self.pending_out, self.pending_dead
            self.pending_out, self.pending_dead = [], []
        n = len(out) + len(dead)
        if not n:
            return
        self.store.commit(b"".join(d for d, _ in out), b"".join(d for d, _ in dead), _origins(out), _origins(dead))
        self.held -= n
        self.succeeded += len(out)
        self.failed += len(dead)
        if self.bar is not None:
            self.bar.update(n)
        if self.on_commit is not None:
            self.on_commit(JobProgress(self.succeeded, self.failed, self.skipped, self.held))


def _origins(lines: list[tuple[bytes, _Item]]) -> Fingerprints:
    return Fingerprints([item.line for _, item in lines], [item.digest for _, item in lines])
