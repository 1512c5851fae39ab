"""Two jobs at once: a running job holds its output and its dead-letter file, so that a second
job sharing either is refused before it touches anything (a shared dead-letter file used to be
cut back by each job's next start, losing the other's dead letters)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path
from typing import Any

import pytest

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
