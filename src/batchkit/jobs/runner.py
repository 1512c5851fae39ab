"""``batchkit.jobs.run``: an offline bulk job, resumable and exactly once.

One thread (the caller's) reads the input, submits records to the batch function's batcher,
collects results and commits them through a :class:`~batchkit.jobs.store.JobStore`. It holds at
most ``max_in_flight`` records at a time (read, not yet committed: waiting, running, retrying, or
waiting in the reorder buffer), so memory does not grow with the input. The batcher's threads run
the batch function; futures report back through one queue.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import json
import logging
import math
import os
import queue
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._clock import Clock, checked_clock
from .._errors import BatchTimeout, JobStateError, QueueFull
from ..dynamic.decorator import progress_bar
from .fingerprint import Fingerprints, InputCheck, canonical_json, content_digest, is_id, record_key
from .generate import Generation, LoopFunction, OutputLine, qualified_name
from .parquet import export_parquet, is_parquet, open_parquet, parquet_rows, read_parquet, require_pyarrow
from .source import Malformed, Row, count_lines, iter_lines, parse_line, read_jsonl, read_records
from .store import DoneSet, JobStore, dead_letter_path_for

__all__ = ["JobProgress", "JobReport", "run"]

logger = logging.getLogger(__name__)

RESERVED_FIELDS = frozenset({"output", "error", "line", "attempts", "input"})
FAIL_FAST_BATCHES = 3  # fail_fast: every record of this many batches failed, and none succeeded
_MISSING: Any = object()


@dataclass(frozen=True, slots=True)
class JobProgress:
    """Counts after a commit (this run only), passed to ``on_commit``."""

    succeeded: int
    failed: int
    skipped: int
    in_flight: int


@dataclass(frozen=True, slots=True)
class JobReport:
    """What a run did. Counts are this run's, except ``dead_letters`` (the whole dead-letter file).

    ``items = succeeded + failed``; ``skipped`` were done by an earlier run; ``duplicates`` repeat an
    id seen earlier in the input (the first occurrence is the one processed). ``stopped`` says why
    the run stopped before the end of its input (``max_failures``, ``fail_fast``), or is None.
    ``output`` is the file that holds the results: for a ``.parquet`` sink the Parquet file, or
    its JSONL journal (``<sink>.jsonl``) when the run stopped before writing it.
    """

    output: str
    dead_letter: str
    succeeded: int
    failed: int
    malformed: int
    skipped: int
    duplicates: int
    retries: int
    dead_letters: int
    wall_s: float
    tokens: int | None
    price_per_hour: float | None
    max_in_flight: int
    peak_in_flight: int
    stopped: str | None = None

    @property
    def items(self) -> int:
        """Items finished by this run: ``succeeded + failed``."""
        return self.succeeded + self.failed

    @property
    def items_per_s(self) -> float:
        return self.items / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float | None:
        if self.tokens is None:
            return None
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cost(self) -> float | None:
        """``price_per_hour * wall_s / 3600``, or None without a price."""
        return None if self.price_per_hour is None else self.price_per_hour * self.wall_s / 3600

    @property
    def cost_per_1k_tokens(self) -> float | None:
        """``C_token * 1000`` with ``C_token = C_gpu * T_run / N_tokens``; None without a price or tokens."""
        if self.cost is None or not self.tokens:
            return None
        return self.cost / self.tokens * 1000

    @property
    def exit_code(self) -> int:
        """0 when every item of the job has an output, 1 when the dead-letter file holds any or
        the run stopped early."""
        return 1 if self.dead_letters or self.stopped is not None else 0

    def summary(self) -> str:
        """A few lines for people: counts, rates, cost, and where the failures went."""
        lines = [
            f"{self.items:,} items in {self.wall_s:.2f} s ({self.items_per_s:,.1f} items/s): "
            f"{self.succeeded:,} succeeded, {self.failed:,} failed ({self.malformed:,} malformed), "
            f"{self.skipped:,} skipped (already done), {self.duplicates:,} duplicate ids, {self.retries:,} retries",
        ]
        if self.tokens is not None:
            lines.append(f"{self.tokens:,} tokens ({self.tokens_per_s or 0:,.1f} tokens/s)")
        if self.cost is not None:
            per_1k = self.cost_per_1k_tokens
            tail = f", {per_1k:.6f} per 1k tokens" if per_1k is not None else " (no token counts: no cost per token)"
            lines.append(f"cost {self.cost:.6f} at {self.price_per_hour:g} per hour{tail}")
        lines.append(f"output: {self.output}")
        if self.dead_letters:
            lines.append(f"{self.dead_letters:,} dead letters (with their errors) in {self.dead_letter}")
        if self.stopped is not None:
            lines.append(f"stopped early: {self.stopped}")
        return "\n".join(lines)


# ---------------------------------------------------------------------- targets


@dataclass
class _Target:
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


def _make_target(
    fn: Any, *, max_batch: int, max_wait_ms: float, concurrency: int, batch_timeout_s: float | None, owned_queue: int
) -> _Target:
    from ..continuous.loop import ContinuousDecodeLoop
    from ..dynamic.batcher import DynamicBatcher
    from ..dynamic.decorator import AsyncBatchedFunction, BatchedFunction

    def no_close(drain: bool) -> None:
        pass

    if isinstance(fn, LoopFunction):
        n = fn.max_num_seqs
        return _Target(fn.submit, lambda: None, no_close, 2 * n, None, True, n, result_field=fn.result_field)
    if isinstance(fn, ContinuousDecodeLoop):
        raise TypeError(
            "a ContinuousDecodeLoop generates from token ids: wrap it with its tokenizer, "
            "batchkit.jobs.generate_fn(loop, encode=tok.encode, decode=tok.decode, max_new_tokens=...)"
        )
    batcher: DynamicBatcher[Any, Any]
    if isinstance(fn, (BatchedFunction, AsyncBatchedFunction)):
        batcher = fn.batcher
    elif isinstance(fn, DynamicBatcher):
        batcher = fn
    elif callable(fn):
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

        return _Target(
            own.submit,
            own.flush,
            close_own,
            2 * max_batch * concurrency,
            owned_queue,
            False,
            max_batch,
            submit_alone if batch_timeout_s is not None else None,
        )
    else:
        raise TypeError(
            f"fn must be a batch function (a list of records -> one result per record), a @batched function or "
            f"batchkit.jobs.generate_fn(...), got {fn!r}"
        )
    # The user's batcher keeps its own batch size, wait and concurrency; the job only sizes its window.
    if not batcher.isolate_errors:  # fixed when the batcher was built: the job cannot turn it on
        logger.warning(
            "%s: isolate_errors is off, so a batch that raises fails every record in it (each retried, "
            "then dead-lettered with the batch's error); build it with isolate_errors=True "
            "(@batched(..., isolate_errors=True)) so that only the record that makes it raise fails",
            batcher.name,
        )
    window = 2 * batcher.max_batch_size * batcher.max_concurrent_batches
    return _Target(
        batcher.submit, batcher.flush, no_close, window, batcher.queue.maxsize, False, batcher.max_batch_size
    )


def _fn_identity(fn: Any) -> tuple[str, dict[str, Any]]:
    """The function's name and the settings that shape its results, as the journal records them."""
    from ..dynamic.batcher import DynamicBatcher

    if isinstance(fn, LoopFunction):
        return fn.job_name, fn.settings()
    if isinstance(fn, DynamicBatcher):
        fn = fn.fn
    return qualified_name(fn), {}


# ---------------------------------------------------------------------- the job


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


class _Job:
    def __init__(
        self,
        target: _Target,
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


def changed_input(output: Path, reason: str) -> JobStateError:
    """The refusal of a resume whose input no longer holds what the output was computed from."""
    return JobStateError(
        f"{output} holds results computed from other input: {reason}: restore the input as it was, or delete the "
        "output, its dead-letter file and its journal to start over (or choose another output)"
    )


def _input_lines(src: Path) -> Iterator[tuple[int, bytes]]:
    """Each record of an input file as ``(line, content)``: what its fingerprint is taken of."""
    if is_parquet(src):
        return ((n, content) for n, _, content in read_parquet(src))
    return iter_lines(src)


def _key_of(id_field: str | None) -> Callable[[int, bytes], Any]:
    """A line's key from its content (a JSONL line, or a record's JSON form)."""
    return lambda line, content: record_key(parse_line(content), id_field, line)


class _ResumeCheck:
    """The store's check before a resume: match what is done against the input (a file is read
    through once, now; an iterable later, as the job reads it) and refuse if it changed."""

    def __init__(self, src: Path | None, id_field: str | None, output: Path) -> None:
        self.src = src
        self.id_field = id_field
        self.output = output
        self.input_check: InputCheck | None = None

    def __call__(self, done: DoneSet) -> None:
        check = InputCheck(done.committed, keyed_by_line=self.id_field is None, key_of=_key_of(self.id_field))
        if self.src is not None and not check.done:
            reason = check.run(_input_lines(self.src))
            if reason is not None:
                raise changed_input(self.output, reason)
        self.input_check = check


# ---------------------------------------------------------------------- run


def _check_int(name: str, value: object, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name} must be an int >= {lo}, got {value!r}")


def _check_float(name: str, value: object, *, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):  # type: ignore[operator]
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")


def run(
    fn: Any,
    source: str | os.PathLike[str] | Iterable[Any],
    sink: str | os.PathLike[str],
    *,
    dead_letter: str | os.PathLike[str] | None = None,
    id_field: str | None = "id",
    max_batch: int = 32,
    max_wait_ms: float = 20.0,
    concurrency: int = 1,
    max_in_flight: int | None = None,
    retries: int = 2,
    backoff_s: float = 0.5,
    max_backoff_s: float = 30.0,
    ordered: bool = False,
    retry_dead_letters: bool = False,
    batch_timeout_s: float | None = None,
    max_failures: int | None = None,
    fail_fast: bool = True,
    fn_name: str | None = None,
    count_tokens: Callable[[dict[str, Any], Any], int] | None = None,
    price_per_hour: float | None = None,
    progress: bool = False,
    on_commit: Callable[[JobProgress], None] | None = None,
    clock: Clock | None = None,
    sleep: Callable[[float], None] | None = None,
) -> JobReport:
    """Run ``fn`` over every record of ``source`` and write one line per record to ``sink``, exactly
    once, resumably: rerun the same call after a crash (even SIGKILL) and it finishes the job.

    A resume checks that the input still holds every record an earlier run finished, as it was
    (each committed line's record is fingerprinted in the journal), and that ``fn`` is the same
    function (by ``fn_name``) with the same settings; if not, it is refused before anything is
    written.

    Args:
        fn: a batch function (a list of records -> one JSON-serialisable result per record, an
            ``Exception`` instance in a record's slot failing only that record), a ``@batched``
            function or a :class:`~batchkit.DynamicBatcher` (their own batch size, wait and
            concurrency apply), or :func:`~batchkit.jobs.generate_fn` around a decode loop.
        source: a JSONL file (one JSON object per line; blank lines are ignored), a ``.parquet``
            file (one record per row; needs pyarrow), or an iterable of dicts (their 1-based
            positions stand in for line numbers; iterate them in the same order on every run: a
            resume checks each record as it reads it, and stops at the first that changed).
        sink: the output JSONL file: ``{"<id_field>": id, "output": result}`` per record, in
            completion order (or input order with ``ordered``). A ``.parquet`` sink is journaled
            as ``<sink>.jsonl`` (resumable like any job) and written as Parquet, with the same
            columns, once every record is committed; results must then share one schema.
        dead_letter: where failed records go, ``{"<id_field>": id, "line": n, "error": "...",
            "attempts": k}`` (malformed lines: id null, and the line under ``"input"``); default
            ``<sink stem>.dead<suffix>`` beside the sink.
        id_field: the field that identifies a record (a string or an integer); a record without
            one is a dead letter. None: the line number is the id (``"line"`` in the output).
        max_batch, max_wait_ms, concurrency, batch_timeout_s: the batcher built for a plain
            batch function (``concurrency`` batches run at once; isolate_errors is on).
        max_in_flight: records read but not yet committed, at most (the read-ahead window);
            default ``2 * max_batch * concurrency`` (for a ``@batched`` function, from its own
            settings, and never above its queue's capacity).
        retries: further calls for a record whose call failed, each after ``backoff_s *
            2**(n-1)`` seconds (at most ``max_backoff_s``); then it is dead-lettered.
        ordered: write in input order (a reorder buffer, bounded by ``max_in_flight``).
        retry_dead_letters: empty the dead-letter file and try its records again (after fixing
            what made them fail); without it, dead letters count as done.
        max_failures: stop once more than this many records of this run failed (dead letters,
            malformed lines included); None: no limit.
        fail_fast: stop when the first ``3 * batch size`` records the function was called on all
            failed (for good, after their retries) before any succeeded: a broken function. A
            stopped run returns its report with ``stopped`` set; what it committed is done, what
            was in flight is not, and a rerun with ``retry_dead_letters`` resumes it.
        fn_name: the function's name in the journal (default: its ``module:qualname``; a
            :func:`generate_fn` job records its model's type, tokenizer and sampling settings
            too); a resume under another name is refused. Name what makes results differ that
            the qualified name does not tell (a callable object's checkpoint, say).
        count_tokens: ``count_tokens(record, result) -> int``, for tokens/s and the cost per
            token (a :func:`generate_fn` job counts generated tokens itself).
        price_per_hour: accelerator price per hour, for the report's cost per 1k tokens
            (``C_token = C_gpu * T_run / N_tokens``).
        progress: draw a progress bar with rate and ETA on stderr (tqdm's when installed).
        on_commit: called after each commit with a :class:`JobProgress`.
        clock, sleep: time source and sleep for the retry backoff (tests pass a MockClock and a
            sleep that advances it).

    Returns:
        A :class:`JobReport`; ``report.exit_code`` is 1 when the dead-letter file is not empty
        or the run stopped early.

    Raises:
        JobStateError: the sink belongs to another job (another input, function or settings, or
            an input whose finished records changed), is in use, or was edited (see
            :class:`~batchkit.jobs.JobStateError`).
        ValueError, TypeError: bad arguments (the message names the argument), a ``.parquet``
            source that is not Parquet, or results that fit no Parquet schema (the message names
            the JSONL beside the sink that holds them all): a rerun cannot help.
        Exception: an error of the input file or the batch function's submission; the job stops
            and a rerun resumes it.
    """
    if id_field is not None and (not isinstance(id_field, str) or not id_field or id_field in RESERVED_FIELDS):
        raise ValueError(
            f"id_field must be a non-empty field name other than {', '.join(sorted(RESERVED_FIELDS))} "
            f"(or None for line numbers), got {id_field!r}"
        )
    _check_int("max_batch", max_batch, 1)
    _check_int("concurrency", concurrency, 1)
    _check_int("retries", retries, 0)
    if max_in_flight is not None:
        _check_int("max_in_flight", max_in_flight, 1)
    if max_failures is not None:
        _check_int("max_failures", max_failures, 0)
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name):
        raise ValueError(f"fn_name must be a non-empty string (or None for the function's own name), got {fn_name!r}")
    _check_float("max_wait_ms", max_wait_ms)
    _check_float("backoff_s", backoff_s)
    _check_float("max_backoff_s", max_backoff_s)
    if price_per_hour is not None:
        _check_float("price_per_hour", price_per_hour)
    if not isinstance(sink, (str, os.PathLike)):
        raise TypeError(f"sink must be a file path (the output JSONL), got {type(sink).__name__}")
    out_path = Path(sink)
    parquet_out: Path | None = None
    if is_parquet(out_path):
        # The job journals JSONL beside it (that makes it resumable) and converts once complete.
        parquet_out, out_path = out_path, out_path.with_name(out_path.name + ".jsonl")
        require_pyarrow()  # now, not once the whole job has run
    dead_path = Path(dead_letter) if dead_letter is not None else dead_letter_path_for(out_path)
    source_name: str | None = None
    src: Path | None = None
    records: Iterator[Row]
    if isinstance(source, (str, os.PathLike)):
        src = Path(source)
        if not src.is_file():
            raise FileNotFoundError(f"source {str(source)!r} is not a file: pass the input JSONL")
        source_name = str(src.resolve())
        if is_parquet(src):
            open_parquet(src)  # not Parquet: say so now, not once the job has started
            records = read_parquet(src)
        else:
            records = read_jsonl(src)
    elif isinstance(source, Iterable):
        records = read_records(source, canonical_json)
    else:
        raise TypeError(f"source must be a JSONL path or an iterable of dicts, got {type(source).__name__}")
    paths = [out_path.resolve(), dead_path.resolve()]
    if source_name is not None:
        paths.append(Path(source_name))
    if len(set(paths)) != len(paths):
        raise ValueError(f"the input, the output and the dead-letter file must be three files, got {paths}")
    for name, path in (("sink", out_path), ("dead_letter", dead_path)):
        if path.exists() and not path.is_file():
            raise ValueError(
                f"{name} {str(path)!r} is not a regular file: a job reads its output and dead letters back "
                "to resume, so they must be files (not a folder, a pipe or a device such as /dev/null)"
            )

    clock = checked_clock(clock)
    window = max_in_flight if max_in_flight is not None else 2 * max_batch * concurrency
    target = _make_target(
        fn,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        concurrency=concurrency,
        batch_timeout_s=batch_timeout_s,
        owned_queue=window,
    )
    if parquet_out is not None and target.result_field != "output":
        target.close(False)
        raise ValueError(
            f"sink {str(sink)!r}: this function writes whole output lines (under {target.result_field!r}), which "
            "have no Parquet form here: name a .jsonl sink"
        )
    if max_in_flight is None:
        window = target.window
    if target.cap is not None:
        window = min(window, target.cap)
    t0 = clock.now()
    name, settings = _fn_identity(fn)
    resume = _ResumeCheck(src, id_field, out_path.resolve())
    store, done = JobStore.open(
        out_path,
        dead_path,
        source=source_name,
        id_field=id_field,
        fn=fn_name if fn_name is not None else name,
        fn_options=settings,
        retry_dead_letters=retry_dead_letters,
        check=resume,
        result_field=target.result_field,
    )
    assert resume.input_check is not None  # JobStore.open returned: it ran the check
    bar = None
    drained = False
    try:
        if progress:
            total = None
            if source_name is not None:
                rows = parquet_rows(source_name) if is_parquet(source_name) else count_lines(source_name)
                total = max(0, rows - len(done.committed))
            bar = progress_bar(total, out_path.name, unit="item")
        job = _Job(
            target,
            store,
            resume.input_check,
            id_field=id_field,
            window=window,
            retries=retries,
            backoff_s=backoff_s,
            max_backoff_s=max_backoff_s,
            ordered=ordered,
            count_tokens=count_tokens,
            on_commit=on_commit,
            bar=bar,
            clock=clock,
            sleep=sleep if sleep is not None else time.sleep,
            max_failures=max_failures,
            fail_fast=fail_fast,
        )
        job.run(records)
        drained = job.stopped is None
    finally:
        target.close(drained)
        store.close()
        if bar is not None:
            bar.close()
    if parquet_out is not None and job.stopped is None:
        export_parquet(store.output, parquet_out, key_field=store.key_field)
    wall = clock.now() - t0
    return JobReport(
        # A stopped job's Parquet is not written yet: its results so far are in the journal.
        output=str(parquet_out.resolve() if parquet_out is not None and job.stopped is None else store.output),
        dead_letter=str(store.dead_letter),
        succeeded=job.succeeded,
        failed=job.failed,
        malformed=job.malformed,
        skipped=job.skipped,
        duplicates=job.duplicates,
        retries=job.retried,
        dead_letters=done.dead_letters + job.failed,
        wall_s=wall,
        tokens=job.tokens if (target.counts_tokens or count_tokens is not None) else None,
        price_per_hour=price_per_hour,
        max_in_flight=window,
        peak_in_flight=job.peak_held,
        stopped=job.stopped,
    )
