"""A server in a subprocess for the benchmarks that load one over HTTP (gateway.py, servers.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    cmd: list[str],
    ready_url: str,
    threads: int | None = None,
    timeout_s: float = 300,
    env: dict[str, str] | None = None,
    settled: Callable[[httpx.Response], bool] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` (offline; ``threads`` OpenMP threads where given; in ``env``, default this
    process's environment) and wait until ``ready_url`` answers 200 (and ``settled(answer)``
    holds, where given).

    Raises:
        RuntimeError: the server exited first (its last stderr lines are in the message).
        TimeoutError: it did not answer within ``timeout_s``.
    """
    env = {**(os.environ if env is None else env), "HF_HUB_OFFLINE": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode()[-2000:] if proc.stderr else ""
            raise RuntimeError(f"{cmd[0]} exited: {err}")
        try:
            answer = httpx.get(ready_url, timeout=5)
            if answer.status_code == 200 and (settled is None or settled(answer)):
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{' '.join(cmd[:3])} did not answer {ready_url} within {timeout_s:g} s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 60 s."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
