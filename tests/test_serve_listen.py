"""batchkit serve takes its port before loading models: from the "listening on" line on, a
client that connects is queued until the server accepts, not refused."""

from __future__ import annotations

import socket

import pytest

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
