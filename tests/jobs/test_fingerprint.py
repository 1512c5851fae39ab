"""batchkit.jobs.fingerprint: the content a record's result depends on, and the resume check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from _support import SHOUT
from _support import batchkit_run as _cli
from _support import write_lines as _write
from _support import write_module as _module
from batchkit.jobs.fingerprint import canonical_json


def test_a_record_with_keys_of_mixed_types_has_a_fingerprint() -> None:
    """An iterable's record whose dict mixes int and str keys is fingerprinted (sorting its keys
    raised TypeError and crashed the job)."""
    assert canonical_json({"id": 1, 2: "x", "b": 1}) == b'{"2":"x","b":1,"id":1}'


def test_a_set_fingerprints_the_same_in_every_process() -> None:
    """A set's order follows string hashing, which differs per process: its fingerprint is that
    of its sorted items, so an unchanged iterable resumes under another PYTHONHASHSEED."""
    code = "from batchkit.jobs.fingerprint import canonical_json; print(canonical_json({'tags': set('abcdefgh')}))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert outs == {'b\'{"tags":["a","b","c","d","e","f","g","h"]}\'\n'}


# --------------------------------------------------------------------------- docs/jobs.md: the resume check


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ("edit", "the record with id 'a' changed since its result was written"),
        ("insert", "with --line-ids a line's number is its id"),
        ("function", "function 'dp_jobs_changed_function:shout', not function 'dp_jobs_changed_function:whisper'"),
    ],
)
def test_resuming_after_the_input_or_the_function_changed_is_refused_with_one_line(
    change: str, what: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """ "A resume checks that the input still holds every record an earlier run finished, as it
    was, and that the function is the same": an edit in place, a line inserted at the top with
    `--line-ids`, another function: status 2, one line, nothing touched."""
    source = SHOUT + "def whisper(records):\n    return [r['text'].lower() for r in records]\n"
    mod = _module(tmp_path, f"dp_jobs_changed_{change}", source)
    lines = ['{"id": "a", "text": "x"}', '{"id": "b", "text": "y"}']
    _write(tmp_path / "in.jsonl", lines)
    argv = [f"{mod}:shout", "--input", "in.jsonl", "--output", "out.jsonl"]
    if change == "insert":
        argv.append("--line-ids")
    assert _cli(argv, monkeypatch, capsys, tmp_path)[0] == 0
    if change == "edit":
        _write(tmp_path / "in.jsonl", ['{"id": "a", "text": "z"}', lines[1]])
    elif change == "insert":
        _write(tmp_path / "in.jsonl", ['{"id": "c", "text": "new"}', *lines])
    else:
        argv[0] = f"{mod}:whisper"
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    status, _, err = _cli(argv, monkeypatch, capsys, tmp_path)
    assert status == 2
    assert len(err.splitlines()) == 1, err
    assert what in err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before
