"""Two jobs at once: a running job holds its output and its dead-letter file, so that a second
job sharing either is refused before it touches anything (a shared dead-letter file used to be
cut back by each job's next start, losing the other's dead letters)."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

from _support import SHOUT, write_lines
from _support import batchkit_run as _cli
from _support import jsonl_records as _records
from _support import write_module as _module
from batchkit.jobs import JobReport, JobStateError, run

WAIT = 30


class _Held:
    """A batch function that blocks until released (so its job holds its files meanwhile)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, records: list[dict[str, Any]]) -> list[Any]:
        self.started.set()
        assert self.release.wait(WAIT)
        return [ValueError("no") if r["id"] == "bad" else r["id"] for r in records]


def _write(path: Path, ids: list[str]) -> Path:
    path.write_text("".join(f'{{"id": "{i}"}}\n' for i in ids))
    return path


def _start(fn: _Held, src: Path, out: Path, dead: Path) -> tuple[threading.Thread, list[JobReport]]:
    reports: list[JobReport] = []
    t = threading.Thread(target=lambda: reports.append(run(fn, src, out, dead_letter=dead, retries=0)))
    t.start()
    assert fn.started.wait(WAIT)
    return t, reports


def test_a_dead_letter_file_in_use_by_a_running_job_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared.dead.jsonl"
    held = _Held()
    a_src = _write(tmp_path / "a.jsonl", ["a1", "bad"])
    thread, reports = _start(held, a_src, tmp_path / "a.out.jsonl", shared)
    try:
        b_src = _write(tmp_path / "b.jsonl", ["b1", "bad"])
        with pytest.raises(JobStateError, match="dead-letter"):
            run(lambda rs: [1 for _ in rs], b_src, tmp_path / "b.out.jsonl", dead_letter=shared)
        # nor may another job take the running job's dead-letter file as its output
        with pytest.raises(JobStateError, match=str(shared)):
            run(lambda rs: [1 for _ in rs], b_src, shared)
    finally:
        held.release.set()
        thread.join(WAIT)
    (report,) = reports
    assert (report.succeeded, report.failed) == (1, 1)
    assert len(shared.read_text().splitlines()) == 1  # only the first job's dead letter
    again = run(held, a_src, tmp_path / "a.out.jsonl", dead_letter=shared, retries=0)
    assert (again.items, again.skipped, again.dead_letters) == (0, 2, 1)


def test_a_job_where_nothing_failed_leaves_no_dead_letter_file(tmp_path: Path) -> None:
    """The dead-letter file exists only once something failed (it is locked while the job runs)."""
    src = _write(tmp_path / "in.jsonl", ["x", "y"])
    report = run(lambda rs: [r["id"] for r in rs], src, tmp_path / "out.jsonl")
    assert report.succeeded == 2
    assert not (tmp_path / "out.dead.jsonl").exists()
    assert (tmp_path / "out.jsonl").exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_dead_letter_path_that_is_not_a_regular_file_is_refused_and_left_alone(tmp_path: Path) -> None:
    """A pipe or a device as the dead-letter file (``/dev/null`` to drop them) cannot work: dead
    letters count as done and are read back to resume. It is refused before anything is written,
    and never removed."""
    fifo = tmp_path / "dead.fifo"
    os.mkfifo(fifo)
    src = _write(tmp_path / "in.jsonl", ["x", "y"])
    with pytest.raises(ValueError, match="not a regular file"):
        run(lambda rs: [r["id"] for r in rs], src, tmp_path / "out.jsonl", dead_letter=fifo)
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert not (tmp_path / "out.jsonl").exists()


# --------------------------------------------------------------------------- docs/jobs.md: the files and the journal


# docs/jobs.md, checked through `batchkit run` on real files: the files it writes, and the
# journal that refuses to mix jobs. Target modules written into a test's folder have names no
# other test uses.


def test_the_files_look_as_the_docs_show_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """ "The files": out.jsonl holds `{"id":"r1","output":"GREAT BATTERIES"}` lines, the journal's
    header names the absolute input, id field, dead-letter file and function, then `{"out": n,
    "dead": m, ...}` records whose last one is the committed lengths, with the input line and the
    BLAKE2b-64 digest of the line of each committed record."""
    mod = _module(tmp_path, "dp_jobs_files_shout", SHOUT)
    lines = ['{"id": "r1", "text": "great batteries"}', '{"id": 2, "text": 7}']
    write_lines(tmp_path / "in.jsonl", lines)
    status, _, _ = _cli(
        [f"{mod}:shout", "--input", "in.jsonl", "--output", "out.jsonl", "--retries", "0"],
        monkeypatch,
        capsys,
        tmp_path,
    )
    assert status == 1
    assert (tmp_path / "out.jsonl").read_text() == '{"id":"r1","output":"GREAT BATTERIES"}\n'
    (dead,) = _records(tmp_path / "out.dead.jsonl")
    assert dead == {"id": 2, "line": 2, "error": "AttributeError: 'int' object has no attribute 'upper'", "attempts": 1}
    header, *commits = _records(tmp_path / "out.jsonl.journal")
    assert header == {
        "batchkit_job": 2,
        "source": str(tmp_path / "in.jsonl"),
        "id_field": "id",
        "dead_letter": str(tmp_path / "out.dead.jsonl"),
        "fn": f"{mod}:shout",
        "fn_options": {},
    }
    digest = [hashlib.blake2b(line.encode(), digest_size=8).hexdigest() for line in lines]
    assert commits[-1] == {
        "out": (tmp_path / "out.jsonl").stat().st_size,
        "dead": (tmp_path / "out.dead.jsonl").stat().st_size,
        "out_lines": [1],
        "out_digests": digest[0],
        "dead_lines": [2],
        "dead_digests": digest[1],
    }


@pytest.mark.parametrize(
    ("change", "what"),
    [
        (["--id-field", "text"], "id field"),
        (["--dead-letter", "elsewhere.jsonl"], "dead-letter file"),
        (["--input", "copy.jsonl"], "input"),
    ],
)
def test_resuming_with_another_input_id_field_or_dead_letter_file_is_refused_before_anything_is_touched(
    change: list[str],
    what: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """ "The journal refuses to mix jobs: resuming with another input, --id-field or dead-letter
    file ... stops with a one-line error before anything is touched" (status 2, a usage error)."""
    mod = _module(tmp_path, f"dp_jobs_mix_{what.replace(' ', '_').replace('-', '_')}", SHOUT)
    lines = ['{"id": "a", "text": "x"}', '{"id": "b", "text": 1}']
    write_lines(tmp_path / "in.jsonl", lines)
    write_lines(tmp_path / "copy.jsonl", lines)
    argv = [f"{mod}:shout", "--input", "in.jsonl", "--output", "out.jsonl", "--retries", "0"]
    assert _cli(argv, monkeypatch, capsys, tmp_path)[0] == 1
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    status, _, err = _cli([*argv, *change], monkeypatch, capsys, tmp_path)
    assert status == 2
    assert len(err.splitlines()) == 1, err
    assert what in err
    assert not (tmp_path / "elsewhere.jsonl").exists()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
