"""The command line's one-line messages for inputs a job cannot use."""

from __future__ import annotations

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

from _support import SHOUT
from _support import batchkit_run as _cli
from _support import jsonl_records as _records
from _support import write_lines as _write
from _support import write_module as _module
from batchkit import BatcherClosed, ContinuousDecodeLoop
from batchkit.cli import main


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_a_pipe_as_input_is_a_usage_error_that_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pipe (or /dev/stdin) exists but can be read only once, and a job rereads its input to
    resume: refused with status 2, and not as a file that 'does not exist'."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "edges_ident.py").write_text("def ident(rs):\n    return [r['id'] for r in rs]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    os.mkfifo(tmp_path / "in.fifo")
    assert main(["run", "edges_ident:ident", "--input", "in.fifo", "--output", "out.jsonl"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "argument --input" in err
    assert "not a regular file" in err
    assert "does not exist" not in err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize(
    ("output", "dead"),
    [("out.jsonl", "out.dead.jsonl"), ("res.ndjson", "res.dead.ndjson"), ("out.parquet", "out.parquet.dead.jsonl")],
)
def test_the_default_dead_letter_file_is_named_as_documented(
    output: str, dead: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/jobs.md: OUTPUT-stem.dead.SUFFIX beside the output; a Parquet output's dead letters
    sit beside its JSONL journal, out.parquet.jsonl."""
    if output.endswith(".parquet"):
        pytest.importorskip("pyarrow")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "edges_refuse.py").write_text("def refuse(rs):\n    return [ValueError('no') for r in rs]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "in.jsonl").write_text('{"id": 1}\n')
    assert main(["run", "edges_refuse:refuse", "--input", "in.jsonl", "--output", output, "--retries", "0"]) == 1
    assert f"in {tmp_path / dead}" in capsys.readouterr().out
    assert (tmp_path / dead).read_text().count("\n") == 1


def test_a_device_as_dead_letter_file_is_a_usage_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--dead-letter /dev/null failed mid-job (fdatasync on a device: EINVAL, status 1): refused
    at the start instead, one line, status 2."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "edges_ident.py").write_text("def ident(rs):\n    return [r['id'] for r in rs]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "in.jsonl").write_text('{"id": 1}\n')
    argv = ["run", "edges_ident:ident", "--input", "in.jsonl", "--output", "out.jsonl", "--dead-letter", os.devnull]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "argument --dead-letter" in err
    assert "not a regular file" in err
    assert Path(os.devnull).exists()


def test_a_target_that_fails_to_import_is_status_1_without_a_resume_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The target's own module raising at import is a failure (status 1, one line), but no job
    started, so the line does not tell the user to rerun to resume; a job that failed once
    started does."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "brokenmod.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "failmod.py").write_text("def f(rs):\n    return [1 for r in rs]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "in.jsonl").write_text('{"id": 1}\n')
    assert main(["run", "brokenmod:f", "--input", "in.jsonl", "--output", "out.jsonl"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "RuntimeError: boom at import" in err
    assert "resume" not in err
    assert not (tmp_path / "out.jsonl").exists()


_SLOW_FN = """\
import time

def work(records):
    time.sleep(0.005)  # a model call: the job runs long enough for the signal to land mid-job
    return [r["x"] * 2 for r in records]
"""


@pytest.mark.skipif(os.name != "posix", reason="SIGTERM")
def test_sigterm_stops_a_job_with_one_line_and_status_143_and_a_rerun_finishes_it(tmp_path: Path) -> None:
    """`kill` (or a scheduler stopping the job) sends SIGTERM: the job stops as Ctrl-C stops it,
    one line on stderr and status 143 instead of dying silently; the rerun finishes it with
    every id once."""
    n = 2000
    (tmp_path / "slowfn.py").write_text(_SLOW_FN)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"id": i, "x": i}) + "\n" for i in range(n)))
    out = tmp_path / "out.jsonl"
    argv = [sys.executable, "-m", "batchkit", "run", "slowfn:work", "--input", "in.jsonl", "--output", "out.jsonl"]
    argv += ["--max-batch", "4", "--no-progress"]
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while (out.stat().st_size if out.exists() else 0) == 0:
            assert proc.poll() is None, "the job ended before the signal"
            assert time.monotonic() < deadline, "the job never committed"
            time.sleep(0.001)  # polling the file size, not waiting for behaviour
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "batchkit run: terminated (SIGTERM): rerun the same command to resume"
    rerun = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert rerun.returncode == 0, rerun.stderr
    ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == list(range(n))


def _save_tiny_llama(folder: Path) -> None:
    """A seeded random-weight Llama in ``folder/model``, without a tokenizer, and a word
    tokenizer in ``folder/tok``."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from _support import word_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder / "model")
    word_tokenizer().save_pretrained(folder / "tok")


def test_model_without_a_tokenizer_takes_one_from_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`batchkit run --model DIR` whose directory has no tokenizer is a one-line usage error naming
    --tokenizer; with --tokenizer another directory's tokenizer is used and the job runs."""
    _save_tiny_llama(tmp_path)
    capsys.readouterr()  # transformers' progress bar while saving
    monkeypatch.chdir(tmp_path)
    Path("in.jsonl").write_text('{"id": 1, "prompt": "w5 w6"}\n{"id": 2, "prompt": "w7"}\n')
    args = ["run", "--model", "model", "--input", "in.jsonl", "--output", "out.jsonl", "--max-new-tokens", "2"]
    args += ["--num-blocks", "16"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "argument --model: model has no tokenizer files: pass --tokenizer" in err
    assert main([*args, "--tokenizer", "tok"]) == 0
    assert sorted(json.loads(line)["id"] for line in Path("out.jsonl").read_text().splitlines()) == [1, 2]
    assert main(["run", "--tokenizer", "tok", "--input", "in.jsonl", "--output", "o2.jsonl", "x:y"]) == 2
    assert "argument --tokenizer: goes with --model" in capsys.readouterr().err
    Path("empty").mkdir()
    args = ["run", "--model", "empty", "--tokenizer", "tok", "--input", "in.jsonl", "--output", "o3.jsonl"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "argument --model: empty holds no model: a Hugging Face directory needs a config.json" in err
    assert not Path("o3.jsonl").exists()


@pytest.mark.parametrize(
    ("output", "refusal"),
    [
        ("out.csv", "argument --output: batchkit run writes JSONL or Parquet"),
        ("in.jsonl", "argument --output: the input, the output and the dead-letter file must be three files"),
    ],
    ids=["csv-output", "output-is-the-input"],
)
def test_a_check_that_fails_after_the_model_loaded_closes_its_decode_loop(
    output: str, refusal: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`batchkit run --model` checks some files only once its decode loop is built: one of those
    checks failing is a usage error (status 2), and the loop it built is closed."""
    _save_tiny_llama(tmp_path)
    from batchkit.models.pretrained import PretrainedLM

    loops: list[ContinuousDecodeLoop] = []
    make_loop = PretrainedLM.make_loop

    def recorded_make_loop(lm: PretrainedLM, *args: Any, **kwargs: Any) -> ContinuousDecodeLoop:
        loops.append(make_loop(lm, *args, **kwargs))
        return loops[-1]

    monkeypatch.setattr(PretrainedLM, "make_loop", recorded_make_loop)
    monkeypatch.chdir(tmp_path)
    Path("in.jsonl").write_text('{"id": 1, "prompt": "w5 w6"}\n')
    argv = ["run", "--model", "model", "--tokenizer", "tok", "--input", "in.jsonl", "--output", output]
    assert main([*argv, "--num-blocks", "16", "--no-progress"]) == 2
    assert refusal in capsys.readouterr().err
    (loop,) = loops
    try:
        with pytest.raises(BatcherClosed, match="closed"):
            loop.submit([3], max_new_tokens=1)
    finally:
        loop.close()


# Each option of the batcher a job builds around a plain batch function, given at its default value.
_BATCHER_OPTIONS = [
    ["--max-batch", "32"],
    ["--max-wait-ms", "20"],
    ["--concurrency", "1"],
    ["--batch-timeout-s", "5"],
]

_SELF_BATCHING = """\
import batchkit

@batchkit.batched(max_batch=5, max_wait_ms=1)
def decorated(rs):
    return [r["x"] for r in rs]

def _plain(rs):
    return [r["x"] for r in rs]

batcher = batchkit.DynamicBatcher(_plain, max_batch_size=5, max_wait_ms=1)
"""


@pytest.mark.parametrize("option", _BATCHER_OPTIONS, ids=lambda o: o[0])
def test_batcher_options_with_model_are_usage_errors(
    option: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--model decodes continuously (--max-num-seqs at once) and would ignore the batch size, wait,
    concurrency and call timeout: each is refused, before the model loads, given at its default
    value too, with one line naming the option and --max-num-seqs."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    argv = ["run", "--model", "no-such-model", "--input", "in.jsonl", "--output", "out.jsonl", *option]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"batchkit run: error: argument {option[0]}: "), err
    assert "--max-num-seqs" in err
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.parametrize("option", _BATCHER_OPTIONS, ids=lambda o: o[0])
@pytest.mark.parametrize(("target", "kind"), [("decorated", "a @batched function"), ("batcher", "a DynamicBatcher")])
def test_batcher_options_with_a_target_that_batches_itself_are_usage_errors(
    option: list[str],
    target: str,
    kind: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A @batched function or a DynamicBatcher runs with its own batch size, wait, concurrency and
    call timeout: each option that would be ignored is refused, given at its default value too,
    with one line naming the option and where to set it instead."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "selfbatching.py").write_text(_SELF_BATCHING)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "in.jsonl").write_text('{"id": 1, "x": 2}\n')
    argv = ["run", f"selfbatching:{target}", "--input", "in.jsonl", "--output", "out.jsonl", *option]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"batchkit run: error: argument {option[0]}: selfbatching:{target} is {kind}"), err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_plain_batch_function_runs_with_every_batcher_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The batcher options size the batcher a job builds around a plain batch function: there
    they are all taken."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "selfbatching.py").write_text(_SELF_BATCHING)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "in.jsonl").write_text('{"id": 1, "x": 2}\n')
    argv = ["run", "selfbatching:_plain", "--input", "in.jsonl", "--output", "out.jsonl", "--no-progress"]
    assert main([*argv, *(arg for option in _BATCHER_OPTIONS for arg in option)]) == 0
    assert json.loads((tmp_path / "out.jsonl").read_text()) == {"id": 1, "output": 2}


_GENERATE_FN = """\
import batchkit
from batchkit.jobs import generate_fn
from batchkit.models import LlamaConfig, LlamaModel

model = LlamaModel(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1))
loop = batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=4, block_size=16), max_num_seqs=2)
job = generate_fn(loop, encode=lambda text: [1, 2], decode=lambda ids: "", max_new_tokens=2)
"""


def test_batcher_options_with_a_generate_fn_target_are_usage_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """generate_fn(...) around a decode loop batches continuously, its loop's max_num_seqs at once:
    --max-batch (given at its default value too) is refused with one line saying so."""
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "genjob.py").write_text(_GENERATE_FN)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    try:
        assert main(["run", "genjob:job", "--input", "in.jsonl", "--output", "out.jsonl", "--max-batch", "32"]) == 2
    finally:
        sys.modules["genjob"].loop.close()
    err = capsys.readouterr().err.strip()
    assert err == (
        "batchkit run: error: argument --max-batch: genjob:job is a decode loop (generate_fn), which batches "
        "continuously, max_num_seqs at once: drop --max-batch"
    )


# --------------------------------------------------------------------------- docs/jobs.md: batchkit run on real files


# docs/jobs.md's promises of `batchkit run`, checked as a user finds them. The command line runs
# in process except where a signal or a second process is the point; target modules written into
# a test's folder have names no other test uses.


WAIT_S = 60.0


def _wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


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
