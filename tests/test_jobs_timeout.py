"""A batch that runs past ``batch_timeout_s`` does not say which of its records hung: each is
retried in a call of its own, so that only the culprit is dead-lettered (its batch-mates used to
be retried together with it, time out again and all end as dead letters)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from batchkit.jobs import run

WAIT = 30


def test_only_the_record_that_hangs_is_dead_lettered(tmp_path: Path) -> None:
    release = threading.Event()
    calls: list[list[str]] = []

    def fn(records: list[dict[str, Any]]) -> list[str]:
        ids = [r["id"] for r in records]
        calls.append(ids)
        if "hang" in ids:
            release.wait(WAIT)  # a call that never returns in time
        return ids

    records = [{"id": "a"}, {"id": "hang"}, {"id": "b"}]
    try:
        report = run(
            fn,
            records,
            tmp_path / "out.jsonl",
            max_batch=3,
            max_wait_ms=10_000,  # the three share the first call
            batch_timeout_s=1.0,  # far above a healthy call, however loaded the machine: only the hung calls time out
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
