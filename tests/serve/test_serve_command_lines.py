"""batchkit.serve, ``batchkit serve`` as docs/serving.md shows it: where it listens, the ready line,
Ctrl-C; a bad --tenant-quotas file.

The promises of docs/serving.md's "batchkit serve" part.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _serve_app_support import EMBED, httpx
from _serve_app_support import needs_model_packages as needs_models

from _support import wait_until as _wait_until

pytestmark = [pytest.mark.timeout(600), needs_models]

WAIT_S = 120.0


def _serve(*args: str) -> list[str]:
    return [sys.executable, "-m", "batchkit", "serve", *args]


def test_batchkit_serve_says_where_it_listens_logs_ready_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    """The first line on stderr is `batchkit serve: listening on http://127.0.0.1:PORT ...` (the
    port taken for `--port 0`); `batchkit.serve: ready ...` follows, formatted as uvicorn's, naming
    the models served; Ctrl-C (SIGINT) drains and exits with status 0."""
    log = tmp_path / "stderr.txt"
    with (
        log.open("w") as err,
        subprocess.Popen(
            _serve("--embedding-model", EMBED, "--port", "0"), stdout=subprocess.DEVNULL, stderr=err
        ) as proc,
    ):
        try:
            _wait_until(lambda: "\n" in log.read_text(), "the first line")
            first = log.read_text().splitlines()[0]
            m = re.fullmatch(r"batchkit serve: listening on (http://127\.0\.0\.1:(\d+)) .*", first)
            assert m, first
            assert m.group(2) != "0"
            url = m.group(1)
            _wait_until(lambda: httpx.get(f"{url}/ready", timeout=30).status_code == 200, "ready")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=WAIT_S) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    lines = log.read_text().splitlines()
    assert f"INFO:     batchkit.serve: ready (embedding model {EMBED})" in lines, lines
    assert "Traceback" not in log.read_text()


def test_a_bad_tenant_quotas_file_is_a_usage_error_with_one_line(tmp_path: Path) -> None:
    """`--tenant-quotas quotas.json` with `{"bulk": 256}`: a file that is not such an object is a
    bad option: one line, status 2, before anything starts."""
    quotas = tmp_path / "quotas.json"
    quotas.write_text(json.dumps({"bulk": 0}))
    proc = subprocess.run(
        _serve("--embedding-model", EMBED, "--port", "0", "--tenant-quotas", str(quotas)),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("batchkit serve: error: argument --tenant-quotas:")
