"""Load-test a running OpenAI-compatible server: ``batchkit bench --url``.

The client side of :mod:`batchkit.serve`: it streams ``/v1/chat/completions`` (or
``/v1/completions``) from any OpenAI-compatible endpoint (``batchkit serve``, vLLM, ...) over
httpx and measures what each caller sees:

- **TTFT**: request sent to the first chunk carrying text (to the end, for an answer without text);
- **TPOT**: ``(end-to-end - TTFT) / (output tokens - 1)``, the mean time between tokens after the first;
- **end-to-end**: request sent to ``data: [DONE]``;
- output tokens: the ``usage.completion_tokens`` the server reports, else the chunks that carried text.

Two shapes of load: a **closed loop** of ``concurrency`` clients, each sending its next request
when the last one ends, and an **open loop** of arrivals at ``rate`` per second whatever the server
does (Poisson for ``burstiness`` 1; gamma-distributed gaps otherwise: below 1 burstier, above 1
more regular, the mean rate unchanged). Requests start for ``duration_s`` seconds; the ones still
running then finish, each within ``timeout_s``. Goodput is the share of sent requests that
complete within every SLO given.

The parsing and the arithmetic (:class:`StreamTally`, :func:`arrival_times`, :func:`summarize`)
do no I/O; :func:`run_load_test` drives them with anyio and httpx.
"""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import BatchkitError
from .._validate import positive_float, positive_int
from ..metrics import percentiles

if TYPE_CHECKING:
    import httpx

__all__ = [
    "ENDPOINTS",
    "LoadTestFailed",
    "LoadTestReport",
    "RequestResult",
    "StreamTally",
    "arrival_times",
    "run_load_test",
    "summarize",
]

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
MAX_IN_FLIGHT = 10_000  # open loop: an arrival finding this many requests running is refused, and counted
PREFLIGHT_TIMEOUT_S = 10.0
LOADING_POLL_S = 0.5  # how often a run waits on GET /ready while the server loads its models


class LoadTestFailed(BatchkitError, RuntimeError):
    """The endpoint cannot be load-tested: unreachable, no model to name, or every request failed."""


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What one request saw. Times are seconds; ``start_s`` counts from the start of the run."""

    start_s: float
    e2e_s: float
    ttft_s: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None below two tokens."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


class StreamTally:
    """Reads the ``data:`` payloads of one streamed answer: first-text time, chunks, usage, errors.

    ``feed(data, t)`` takes one payload (the text after ``data:``) received ``t`` seconds after the
    request was sent; it returns True at ``[DONE]`` and raises ``ValueError`` for an error object or
    a payload that is not JSON.
    """

    __slots__ = ("done", "text_chunks", "ttft_s", "usage_tokens")

    def __init__(self) -> None:
        self.ttft_s: float | None = None
        self.text_chunks = 0
        self.usage_tokens: int | None = None
        self.done = False

    def feed(self, data: str, t: float) -> bool:
        if data == "[DONE]":
            self.done = True
            return True
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise ValueError(f"the stream sent a chunk that is not JSON: {data[:80]!r}") from None
        if not isinstance(chunk, dict):
            raise ValueError(f"the stream sent a chunk that is not a JSON object: {data[:80]!r}")
        if "error" in chunk:
            err = chunk["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            raise ValueError(f"the stream sent an error: {message}")
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                self.text_chunks += 1
                if self.ttft_s is None:
                    self.ttft_s = t
        return False

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.text_chunks


def arrival_times(rate: float, duration_s: float, *, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """Open-loop arrival offsets in ``[0, duration_s)``: gaps drawn from a gamma distribution of
    shape ``burstiness`` and mean ``1 / rate`` (burstiness 1: a Poisson process)."""
    if not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"rate must be a positive finite number, got {rate!r}")
    if not (math.isfinite(burstiness) and burstiness > 0):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness!r}")
    rng = np.random.default_rng(seed)
    scale = 1.0 / (rate * burstiness)
    t = 0.0
    while True:
        t += float(rng.gamma(burstiness, scale))
        if t >= duration_s:
            return
        yield t


@dataclass(frozen=True)
class LoadTestReport:
    """The figures of one load test. Latencies are in milliseconds (nan when nothing completed);
    ``goodput`` is the share of sent requests that completed within every SLO given."""

    url: str
    endpoint: str
    model: str
    load: str
    wall_s: float
    sent: int
    completed: int
    failed: int
    refused: int
    output_tokens: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    e2e_p50_ms: float
    e2e_p99_ms: float
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    slo_e2e_ms: float | None
    good: int
    goodput: float
    goodput_per_s: float
    errors: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}

    def to_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")

    def table(self) -> str:
        lines = [
            f"{self.url} ({self.endpoint}, model {self.model}): {self.load}",
            f"requests    {self.sent} sent, {self.completed} completed, {self.failed} failed"
            + (f", {self.refused} refused ({MAX_IN_FLIGHT:,} in flight)" if self.refused else ""),
            f"throughput  {self.requests_per_s:.2f} req/s, {self.output_tokens_per_s:.1f} output tok/s "
            f"({self.output_tokens} tokens in {self.wall_s:.2f} s)",
            f"{'':12}{'p50 ms':>10}{'p99 ms':>10}",
            f"{'TTFT':12}{self.ttft_p50_ms:10.1f}{self.ttft_p99_ms:10.1f}",
            f"{'TPOT':12}{self.tpot_p50_ms:10.2f}{self.tpot_p99_ms:10.2f}",
            f"{'end-to-end':12}{self.e2e_p50_ms:10.1f}{self.e2e_p99_ms:10.1f}",
        ]
        slos = [
            f"{name} <= {ms:g} ms"
            for name, ms in (("TTFT", self.slo_ttft_ms), ("TPOT", self.slo_tpot_ms), ("end-to-end", self.slo_e2e_ms))
            if ms is not None
        ]
        if slos:
            lines.append(
                f"goodput     {self.goodput:.1%} of requests within {' and '.join(slos)} "
                f"({self.good} requests, {self.goodput_per_s:.2f} req/s)"
            )
        for cause, n in sorted(self.errors.items(), key=lambda kv: -kv[1])[:5]:
            lines.append(f"failed      {n} x {cause}")
        return "\n".join(lines)


def _within(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None, slo_e2e_ms: float | None) -> bool:
    if not r.ok:
        return False
    if slo_ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1e3 > slo_ttft_ms):
        return False
    if slo_tpot_ms is not None and r.tpot_s is not None and r.tpot_s * 1e3 > slo_tpot_ms:
        return False
    return slo_e2e_ms is None or r.e2e_s * 1e3 <= slo_e2e_ms


def summarize(
    results: Sequence[RequestResult],
    wall_s: float,
    *,
    url: str = "",
    endpoint: str = "chat",
    model: str = "",
    load: str = "",
    refused: int = 0,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_e2e_ms: float | None = None,
) -> LoadTestReport:
    """The report of a finished run (``wall_s``: from the first request sent to the last answer)."""
    done = [r for r in results if r.ok]
    wall = max(wall_s, 1e-9)
    tokens = sum(r.output_tokens for r in done)
    ttft = percentiles([r.ttft_s * 1e3 for r in done if r.ttft_s is not None], (50, 99))
    tpot = percentiles([t * 1e3 for r in done if (t := r.tpot_s) is not None], (50, 99))
    e2e = percentiles([r.e2e_s * 1e3 for r in done], (50, 99))
    good = sum(_within(r, slo_ttft_ms, slo_tpot_ms, slo_e2e_ms) for r in results)
    errors = Counter(r.error for r in results if r.error is not None)
    return LoadTestReport(
        url=url,
        endpoint=endpoint,
        model=model,
        load=load,
        wall_s=wall_s,
        sent=len(results),
        completed=len(done),
        failed=len(results) - len(done),
        refused=refused,
        output_tokens=tokens,
        requests_per_s=len(done) / wall,
        output_tokens_per_s=tokens / wall,
        ttft_p50_ms=ttft[0],
        ttft_p99_ms=ttft[1],
        tpot_p50_ms=tpot[0],
        tpot_p99_ms=tpot[1],
        e2e_p50_ms=e2e[0],
        e2e_p99_ms=e2e[1],
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        slo_e2e_ms=slo_e2e_ms,
        good=good,
        goodput=good / len(results) if results else 0.0,
        goodput_per_s=good / wall,
        errors={str(k): v for k, v in errors.items()},
    )


# ---------------------------------------------------------------------- the runtime


def base_url(url: str) -> str:
    """``http://host:port``, ``.../`` and ``.../v1`` all name the same server."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _error_message(status: int, body: bytes) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
    except (ValueError, AttributeError):
        pass
    first = text.splitlines()[0][:160] if text else ""
    return f"HTTP {status}: {first}" if first else f"HTTP {status}"


async def _preflight(client: httpx.AsyncClient, url: str, model: str | None, timeout_s: float) -> str:
    """Prove the server answers (GET /v1/models) and pick the model: the one given, else its first."""
    import httpx

    try:
        resp = await client.get(f"{url}/v1/models", timeout=min(timeout_s, PREFLIGHT_TIMEOUT_S))
    except httpx.HTTPError as exc:
        raise LoadTestFailed(f"cannot reach {url}: {type(exc).__name__}: {exc}".rstrip(": ")) from None
    if model is not None:
        return model
    if resp.status_code != 200:
        raise LoadTestFailed(
            f"GET {url}/v1/models answered {_error_message(resp.status_code, resp.content)}: pass --model"
        )
    try:
        data = resp.json()["data"]
        return str(data[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise LoadTestFailed(f"GET {url}/v1/models names no model: pass --model") from None


async def _wait_while_loading(client: httpx.AsyncClient, url: str, timeout_s: float) -> None:
    """A ``batchkit serve`` that is still loading its models answers ``GET /ready`` 503
    ``loading`` (and every generation 503): wait up to ``timeout_s`` for it, so that a run started
    beside the server does not measure refusals. Other servers (no ``/ready``) start at once."""
    import anyio
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            resp = await client.get(f"{url}/ready", timeout=min(timeout_s, PREFLIGHT_TIMEOUT_S))
            loading = resp.status_code == 503 and resp.json().get("status") == "loading"
        except (httpx.HTTPError, ValueError, AttributeError):
            return
        if not loading:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise LoadTestFailed(f"{url} was still loading its models after {timeout_s:g} s (GET /ready)")
        await anyio.sleep(min(LOADING_POLL_S, left))


async def _one_request(
    client: httpx.AsyncClient, route: str, body: dict[str, Any], timeout_s: float, t0: float
) -> RequestResult:
    import anyio
    import httpx

    sent = time.perf_counter()
    tally = StreamTally()
    error: str | None = None
    try:
        with anyio.fail_after(timeout_s):
            async with client.stream("POST", route, json=body) as resp:
                if resp.status_code != 200:
                    error = _error_message(resp.status_code, await resp.aread())
                else:
                    async for line in resp.aiter_lines():
                        if line.startswith("data:") and tally.feed(line[5:].strip(), time.perf_counter() - sent):
                            break
                    if not tally.done:
                        error = "the stream ended without data: [DONE]"
    except TimeoutError:
        error = f"no complete answer within the timeout ({timeout_s:g} s)"
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    except ValueError as exc:
        error = str(exc)
    e2e = time.perf_counter() - sent
    ttft = tally.ttft_s
    if error is None and ttft is None:
        ttft = e2e  # an answer without text (EOS at once): all of it arrived at the end
    return RequestResult(
        start_s=sent - t0,
        e2e_s=e2e,
        ttft_s=ttft,
        output_tokens=tally.output_tokens if error is None else 0,
        error=error,
    )


def request_body(endpoint: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """The streamed request every client sends (usage asked for, so that tokens are the server's count)."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def run_load_test(
    url: str,
    *,
    model: str | None = None,
    endpoint: str = "chat",
    prompt: str = "Write a short story about a robot who learns to paint.",
    max_tokens: int = 64,
    concurrency: int | None = 8,
    rate: float | None = None,
    burstiness: float = 1.0,
    duration_s: float = 10.0,
    timeout_s: float = 60.0,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    slo_e2e_ms: float | None = None,
    seed: int = 0,
) -> LoadTestReport:
    """Load-test the server at ``url`` for ``duration_s`` seconds and return its report.

    Exactly one of ``concurrency`` (closed loop) and ``rate`` (open loop) is given. A ``batchkit
    serve`` still loading its models (``GET /ready``: 503 ``loading``) is waited for, up to
    ``timeout_s``, before the run starts. Raises :class:`LoadTestFailed` when the server cannot be
    reached, is still loading after ``timeout_s``, or no request completes. Needs httpx.
    """
    import anyio
    import httpx

    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {sorted(ENDPOINTS)}, got {endpoint!r}")
    if (concurrency is None) == (rate is None):
        raise ValueError("pass exactly one of concurrency (closed loop) and rate (open loop)")
    if concurrency is not None:
        positive_int("concurrency", concurrency)
    positive_float("duration_s", duration_s)
    positive_float("timeout_s", timeout_s)
    positive_int("max_tokens", max_tokens)
    url = base_url(url)
    results: list[RequestResult] = []
    refused = 0
    used_model = ""
    wall_s = 0.0

    async def main() -> None:
        nonlocal refused, used_model, wall_s
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        # The per-request limit is timeout_s (anyio.fail_after); httpx's own is the same bound.
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
            used_model = await _preflight(client, url, model, timeout_s)
            await _wait_while_loading(client, url, timeout_s)
            body = request_body(endpoint, used_model, prompt, max_tokens)
            t0 = time.perf_counter()
            arrivals = None if rate is None else arrival_times(rate, duration_s, burstiness=burstiness, seed=seed)
            sender = _Sender(client, ENDPOINTS[endpoint], body, timeout_s, t0, results)
            refused = await sender.run(concurrency, arrivals, t0 + duration_s)
            wall_s = time.perf_counter() - t0

    anyio.run(main)
    report = summarize(
        results,
        wall_s,
        url=url,
        endpoint=endpoint,
        model=used_model,
        load=_load_words(concurrency, rate, burstiness, duration_s),
        refused=refused,
        slo_ttft_ms=slo_ttft_ms,
        slo_tpot_ms=slo_tpot_ms,
        slo_e2e_ms=slo_e2e_ms,
    )
    if report.completed == 0:
        cause = max(report.errors.items(), key=lambda kv: kv[1])[0] if report.errors else "no request was sent"
        raise LoadTestFailed(f"no request to {url} completed ({report.failed} failed): {cause}")
    return report


def _load_words(concurrency: int | None, rate: float | None, burstiness: float, duration_s: float) -> str:
    """The load of a run, in words (the report's first line)."""
    if concurrency is not None:
        return f"closed loop, {concurrency} clients, {duration_s:g} s"
    shape = "Poisson" if burstiness == 1 else f"gamma arrivals (burstiness {burstiness:g})"
    return f"open loop, {shape} at {rate:g}/s, {duration_s:g} s"


class _Sender:
    """Sends a run's requests, each timed from ``t0``, its result appended to ``results``."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        route: str,
        body: dict[str, Any],
        timeout_s: float,
        t0: float,
        results: list[RequestResult],
    ) -> None:
        self.client, self.route, self.body, self.timeout_s, self.t0 = client, route, body, timeout_s, t0
        self.results = results
        self.in_flight = 0

    async def send(self) -> None:
        self.in_flight += 1
        try:
            self.results.append(await _one_request(self.client, self.route, self.body, self.timeout_s, self.t0))
        finally:
            self.in_flight -= 1

    async def run(self, concurrency: int | None, arrivals: Iterable[float] | None, t_end: float) -> int:
        """Send until ``t_end``: ``concurrency`` clients one request after the other (closed
        loop), or one request at each of the ``arrivals`` (seconds after ``t0``; open loop).
        Returns how many arrivals were not sent, ``MAX_IN_FLIGHT`` requests being in flight."""
        import anyio

        refused = 0

        async def closed_loop_client() -> None:
            while time.perf_counter() < t_end:
                await self.send()

        async with anyio.create_task_group() as tg:
            if concurrency is not None:
                for _ in range(concurrency):
                    tg.start_soon(closed_loop_client)
            elif arrivals is not None:
                for t in arrivals:
                    delay = self.t0 + t - time.perf_counter()
                    if delay > 0:
                        await anyio.sleep(delay)
                    if self.in_flight >= MAX_IN_FLIGHT:
                        refused += 1
                    else:
                        tg.start_soon(self.send)
        return refused
