"""A job's records retried alone after a batch timeout run through the job's own batcher, so
that --concurrency still bounds the calls of the batch function (a second batcher for them
ran its calls beside the first one's: two calls at once under concurrency=1)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from batchkit.jobs import run

WAIT = 10.0


def test_retries_alone_keep_the_concurrency_limit(tmp_path: Path) -> None:
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
            batch_timeout_s=1.0,  # far above a healthy call, however loaded the machine: only the hung calls time out
            retries=1,
            backoff_s=0.001,
        )
    finally:
        release.set()
    assert report.failed >= 1  # the record that hangs is dead-lettered
    assert report.succeeded + report.failed == 40
    assert peak == 1  # healthy calls never ran two at once
