"""batchkit.jobs.fingerprint: the content a record's result depends on, and the resume check."""

from __future__ import annotations

import os
import subprocess
import sys

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
