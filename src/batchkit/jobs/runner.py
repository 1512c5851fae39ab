"""``batchkit.jobs.run``: an offline bulk job, resumable and exactly once.

:func:`run` checks its arguments, opens the input, the output and the dead-letter file, builds
the batch function's :class:`~batchkit.jobs.target.Target`, opens the
:class:`~batchkit.jobs.store.JobStore` (which refuses a resume whose input, function or settings
changed), and hands the rest to :class:`~batchkit.jobs.job.Job`, the caller's thread reading,
submitting and committing; then it reports.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._clock import Clock, checked_clock
from .._validate import non_negative_float, positive_int
from ..dynamic.decorator import progress_bar
from .fingerprint import InputCheck, canonical_json, changed_input, record_key
from .job import Job
from .parquet import export_parquet, is_parquet, open_parquet, parquet_rows, read_parquet, require_pyarrow
from .report import JobProgress, JobReport
from .source import Row, count_lines, iter_lines, parse_line, read_jsonl, read_records
from .store import DoneSet, JobStore, dead_letter_path_for
from .target import Target, fn_identity, make_target

__all__ = ["JobProgress", "JobReport", "run"]

RESERVED_FIELDS = frozenset({"output", "error", "line", "attempts", "input"})


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


def _non_negative_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value!r}")


def _check_options(
    *,
    id_field: str | None,
    max_batch: int,
    concurrency: int,
    retries: int,
    max_in_flight: int | None,
    max_failures: int | None,
    fn_name: str | None,
    max_wait_ms: float,
    backoff_s: float,
    max_backoff_s: float,
    price_per_hour: float | None,
) -> None:
    """Refuse a bad argument of :func:`run` before anything is opened (the message names it)."""
    if id_field is not None and (not isinstance(id_field, str) or not id_field or id_field in RESERVED_FIELDS):
        raise ValueError(
            f"id_field must be a non-empty field name other than {', '.join(sorted(RESERVED_FIELDS))} "
            f"(or None for line numbers), got {id_field!r}"
        )
    positive_int("max_batch", max_batch)
    positive_int("concurrency", concurrency)
    _non_negative_int("retries", retries)
    if max_in_flight is not None:
        positive_int("max_in_flight", max_in_flight)
    if max_failures is not None:
        _non_negative_int("max_failures", max_failures)
    if fn_name is not None and (not isinstance(fn_name, str) or not fn_name):
        raise ValueError(f"fn_name must be a non-empty string (or None for the function's own name), got {fn_name!r}")
    non_negative_float("max_wait_ms", max_wait_ms)
    non_negative_float("backoff_s", backoff_s)
    non_negative_float("max_backoff_s", max_backoff_s)
    if price_per_hour is not None:
        non_negative_float("price_per_hour", price_per_hour)


@dataclass(frozen=True, slots=True)
class _Files:
    """Where a job reads and writes, checked before anything starts."""

    records: Iterator[Row]
    src: Path | None  # the input file, if the input is one
    source_name: str | None  # its resolved path, as the journal records it
    output: Path  # the JSONL the job commits to
    dead_letter: Path
    parquet: Path | None  # a Parquet sink, written from ``output`` once every record is committed


def _open_files(
    source: str | os.PathLike[str] | Iterable[Any],
    sink: str | os.PathLike[str],
    dead_letter: str | os.PathLike[str] | None,
) -> _Files:
    """The job's input, output and dead-letter file: three files, the output ones regular."""
    out_path, parquet_out = _sink_paths(sink)
    dead_path = Path(dead_letter) if dead_letter is not None else dead_letter_path_for(out_path)
    src, source_name, records = _open_source(source)
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
    return _Files(records, src, source_name, out_path, dead_path, parquet_out)


def _sink_paths(sink: str | os.PathLike[str]) -> tuple[Path, Path | None]:
    """The JSONL the job commits to, and the Parquet file made of it (None: a JSONL sink)."""
    if not isinstance(sink, (str, os.PathLike)):
        raise TypeError(f"sink must be a file path (the output JSONL), got {type(sink).__name__}")
    out_path = Path(sink)
    if not is_parquet(out_path):
        return out_path, None
    # The job journals JSONL beside it (that makes it resumable) and converts once complete.
    require_pyarrow()  # now, not once the whole job has run
    return out_path.with_name(out_path.name + ".jsonl"), out_path


def _open_source(source: str | os.PathLike[str] | Iterable[Any]) -> tuple[Path | None, str | None, Iterator[Row]]:
    """The input file (or None), its resolved name, and its numbered records."""
    if isinstance(source, (str, os.PathLike)):
        src = Path(source)
        if not src.is_file():
            raise FileNotFoundError(f"source {str(source)!r} is not a file: pass the input JSONL")
        if is_parquet(src):
            open_parquet(src)  # not Parquet: say so now, not once the job has started
            return src, str(src.resolve()), read_parquet(src)
        return src, str(src.resolve()), read_jsonl(src)
    if isinstance(source, Iterable):
        return None, None, read_records(source, canonical_json)
    raise TypeError(f"source must be a JSONL path or an iterable of dicts, got {type(source).__name__}")


def _start_target(
    fn: Any,
    files: _Files,
    sink: str | os.PathLike[str],
    *,
    max_in_flight: int | None,
    max_batch: int,
    max_wait_ms: float,
    concurrency: int,
    batch_timeout_s: float | None,
) -> tuple[Target, int]:
    """The job's target and its read-ahead window (``max_in_flight``, or the target's default,
    never above its queue's capacity)."""
    window = max_in_flight if max_in_flight is not None else 2 * max_batch * concurrency
    target = make_target(
        fn,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        concurrency=concurrency,
        batch_timeout_s=batch_timeout_s,
        owned_queue=window,
    )
    if files.parquet is not None and target.result_field != "output":
        target.close(False)
        raise ValueError(
            f"sink {str(sink)!r}: this function writes whole output lines (under {target.result_field!r}), which "
            "have no Parquet form here: name a .jsonl sink"
        )
    if max_in_flight is None:
        window = target.window
    if target.cap is not None:
        window = min(window, target.cap)
    return target, window


def _open_store(
    files: _Files,
    fn: Any,
    *,
    fn_name: str | None,
    id_field: str | None,
    retry_dead_letters: bool,
    result_field: str,
) -> tuple[JobStore, DoneSet, InputCheck]:
    """The job's store, what earlier runs did, and the check of the input against it (refused,
    before anything is written, if the input, the function or its settings changed)."""
    name, settings = fn_identity(fn)
    resume = _ResumeCheck(files.src, id_field, files.output.resolve())
    store, done = JobStore.open(
        files.output,
        files.dead_letter,
        source=files.source_name,
        id_field=id_field,
        fn=fn_name if fn_name is not None else name,
        fn_options=settings,
        retry_dead_letters=retry_dead_letters,
        check=resume,
        result_field=result_field,
    )
    assert resume.input_check is not None  # JobStore.open returned: it ran the check
    return store, done, resume.input_check


def _progress_bar(files: _Files, done: DoneSet) -> Any:
    """A progress bar over the records left to do (a total only for an input file)."""
    total = None
    if files.source_name is not None:
        name = files.source_name
        rows = parquet_rows(name) if is_parquet(name) else count_lines(name)
        total = max(0, rows - len(done.committed))
    return progress_bar(total, files.output.name, unit="item")


def _report(
    job: Job,
    files: _Files,
    store: JobStore,
    done: DoneSet,
    *,
    wall_s: float,
    tokens: bool,
    price_per_hour: float | None,
) -> JobReport:
    complete = files.parquet is not None and job.stopped is None
    return JobReport(
        # A stopped job's Parquet is not written yet: its results so far are in the journal.
        output=str(files.parquet.resolve() if complete and files.parquet is not None else store.output),
        dead_letter=str(store.dead_letter),
        succeeded=job.succeeded,
        failed=job.failed,
        malformed=job.malformed,
        skipped=job.skipped,
        duplicates=job.duplicates,
        retries=job.retried,
        dead_letters=done.dead_letters + job.failed,
        wall_s=wall_s,
        tokens=job.tokens if tokens else None,
        price_per_hour=price_per_hour,
        max_in_flight=job.window,
        peak_in_flight=job.peak_held,
        stopped=job.stopped,
    )


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
    _check_options(
        id_field=id_field,
        max_batch=max_batch,
        concurrency=concurrency,
        retries=retries,
        max_in_flight=max_in_flight,
        max_failures=max_failures,
        fn_name=fn_name,
        max_wait_ms=max_wait_ms,
        backoff_s=backoff_s,
        max_backoff_s=max_backoff_s,
        price_per_hour=price_per_hour,
    )
    files = _open_files(source, sink, dead_letter)
    clock = checked_clock(clock)
    target, window = _start_target(
        fn,
        files,
        sink,
        max_in_flight=max_in_flight,
        max_batch=max_batch,
        max_wait_ms=max_wait_ms,
        concurrency=concurrency,
        batch_timeout_s=batch_timeout_s,
    )
    store: JobStore | None = None
    bar = None
    drained = False
    try:  # the target's batcher is closed however this ends, a store that refuses the job included
        t0 = clock.now()
        store, done, check = _open_store(
            files,
            fn,
            fn_name=fn_name,
            id_field=id_field,
            retry_dead_letters=retry_dead_letters,
            result_field=target.result_field,
        )
        bar = _progress_bar(files, done) if progress else None
        job = Job(
            target,
            store,
            check,
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
        job.run(files.records)
        drained = job.stopped is None
    finally:
        target.close(drained)
        if store is not None:
            store.close()
        if bar is not None:
            bar.close()
    if files.parquet is not None and job.stopped is None:
        export_parquet(store.output, files.parquet, key_field=store.key_field)
    counts_tokens = target.counts_tokens or count_tokens is not None
    return _report(
        job, files, store, done, wall_s=clock.now() - t0, tokens=counts_tokens, price_per_hour=price_per_hour
    )
