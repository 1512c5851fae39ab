"""The OpenAI-compatible ASGI app: chat and text completions on a ContinuousDecodeLoop, embeddings
on an ``@batched`` encoder, health and readiness, Prometheus metrics.

:func:`create_app` builds a Starlette app around a :class:`ModelServer`, which owns the models,
the decode loop and the embedding batcher and is reachable as ``app.state.batchkit``. Models load
and warm up in the background after start-up: ``/health`` answers at once, ``/ready`` and the
``/v1`` routes answer 503 (with ``Retry-After``) until the models are warm.

A request's life: read the body (413 past ``max_request_bytes``) -> validate (400/422) ->
tokenize (in a worker thread, on the server's own copy of the tokenizer) -> check the prompt
against the model's context and the KV pool (400) -> submit to the loop (503 + ``Retry-After``
when ``max_waiting`` requests already wait) -> wait for the first token, watching for the client
leaving -> stream or collect.
A client that disconnects, at any point, aborts its request: the loop frees its KV blocks at the
next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .._errors import BatcherClosed, CircuitOpen, DeadlineExceeded, KVCacheExhausted, QueueFull
from ..adaptive import CircuitBreaker
from ..continuous.logprobs import TokenLogprobs
from ..continuous.loop import ContinuousDecodeLoop
from ..decorator import BatchedFunction, batched
from .metrics import BatchkitCollector
from .protocol import (
    MAX_EMBEDDING_INPUTS,
    MAX_PROMPTS_PER_REQUEST,
    MAX_REQUEST_BYTES,
    ApiError,
    GenerationRequest,
    IncrementalDetokenizer,
    TokenText,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_response,
    embedding_response,
    new_id,
    parse_body,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_embedding,
    parse_tokenize,
    usage,
)

if TYPE_CHECKING:
    from ..models.pretrained import PretrainedLM, SentenceEncoder

__all__ = ["ModelServer", "create_app"]

logger = logging.getLogger(__name__)

TENANT_HEADER = "x-batchkit-tenant"
PRIORITY_HEADER = "x-batchkit-priority"
MAX_TENANT_LENGTH = 64

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

T = TypeVar("T")

ModelSource = Any  # a PretrainedLM / SentenceEncoder, or a source for load_pretrained / load_encoder


class _ServerMetrics:
    """The server's own request metrics (the primitives' come from :class:`BatchkitCollector`)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "batchkit_http_requests",
            "HTTP requests answered, by route and status.",
            ["route", "status"],
            registry=registry,
        )
        self.rejections = Counter(
            "batchkit_http_rejections", "Requests refused before running, by reason.", ["reason"], registry=registry
        )
        self.in_flight = Gauge("batchkit_http_in_flight", "Requests being served.", registry=registry)
        self.ready = Gauge("batchkit_ready", "1 once the models are loaded and warm.", registry=registry)
        self.prompt_tokens = Counter(
            "batchkit_request_prompt_tokens", "Prompt tokens of accepted requests.", ["route"], registry=registry
        )
        self.generation_tokens = Counter(
            "batchkit_request_generation_tokens", "Tokens generated for clients.", ["route"], registry=registry
        )
        self.ttft = Histogram(
            "batchkit_request_time_to_first_token_seconds",
            "From a request's arrival to its first token.",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "batchkit_request_inter_token_latency_seconds",
            "Between a request's consecutive tokens.",
            ["route"],
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "batchkit_request_duration_seconds",
            "From a request's arrival to its last byte (successful requests).",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )


class _Generation:
    """One accepted generation (one prompt): its token stream, text, logprobs, timings and outcome.

    With ``detailed``, the stream's items are :class:`TokenLogprobs` (the prompt's first, when
    echoed with logprobs), kept as text entries until a chunk or the response takes them. A
    ``max_tokens`` of 0 (an echoed prompt alone) reads the first token's event only for the
    prompt's logprobs: the token itself is not part of the answer.
    """

    def __init__(
        self,
        server: ModelServer,
        route: str,
        tokens: AsyncIterator[Any],
        prompt_tokens: int,
        max_tokens: int,
        stop: Sequence[str],
        stop_token_ids: Sequence[int],
        t_arrival: float,
        *,
        detailed: bool = False,
        index: int = 0,
        rid: str | None = None,
    ) -> None:
        lm = server.lm
        assert lm is not None
        self.server = server
        self.route = route
        self.tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.stop_token_ids = set(stop_token_ids)
        self.tail = IncrementalDetokenizer(lm.decode, stop)
        self.t_arrival = t_arrival
        self.t_last: float | None = None
        self.completion_tokens = 0
        self.last_token: int | None = None
        self.rid = rid or new_id("chatcmpl" if route == "chat" else "cmpl")
        self.status = 200  # of a stream: the status of the error event that ended it, if any
        self.created = int(time.time())
        self.detailed = detailed
        self.index = index
        self.prompt_logprobs: list[TokenText] = []
        self.pending_logprobs: list[TokenText] = []  # the generated tokens' not yet sent
        self.ended = False

    async def next_text(self) -> str | None:
        """The next piece of text (possibly empty), or None once the request has ended."""
        if self.tail.stopped or self.ended:
            return None
        try:
            item = await self.tokens.__anext__()
            while self.detailed and item.prompt:
                self.prompt_logprobs.append(self.server.token_text(item))
                item = await self.tokens.__anext__()
        except StopAsyncIteration:
            return None
        if self.max_tokens == 0:
            self.ended = True
            await self.close()
            return None
        token = item.token if self.detailed else item
        now = time.perf_counter()
        m = self.server.metrics
        if self.t_last is None:
            m.ttft.labels(self.route).observe(now - self.t_arrival)
        else:
            m.itl.labels(self.route).observe(now - self.t_last)
        self.t_last = now
        self.completion_tokens += 1
        self.last_token = token
        if self.detailed:
            self.pending_logprobs.append(self.server.token_text(item))
        m.generation_tokens.labels(self.route).inc()
        text = self.tail.push(token)
        if self.tail.stopped:
            await self.close()  # the loop stops it at the same token; this frees it at once regardless
        return text

    def take_logprobs(self) -> list[TokenText]:
        out, self.pending_logprobs = self.pending_logprobs, []
        return out

    @property
    def finish_reason(self) -> str:
        if self.tail.stopped or self.last_token in self.stop_token_ids:
            return "stop"
        return "length" if self.completion_tokens >= self.max_tokens else "stop"

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.completion_tokens)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            aclose = getattr(self.tokens, "aclose", None)
            if aclose is not None:
                await aclose()


def _sse(data: Mapping[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class _EventStream(Response):
    """A ``text/event-stream`` response whose producer is cancelled when the client disconnects.

    Starlette's StreamingResponse notices a departed client only on its next write on newer ASGI
    servers; a generation waiting for its next token would hold its KV blocks until then. Here a
    task watches ``receive()`` for ``http.disconnect`` and cancels the producer at once, and the
    producer's ``finally`` aborts the request. ``on_close`` is told whether the whole stream
    was sent (False: the client left first).

    Cancelled by the HTTP server itself (uvicorn at ``--timeout-graceful-shutdown``), the stream
    ends with ``on_abort()``'s bytes (an OpenAI error event and ``[DONE]``) instead of breaking off.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[bool], Awaitable[None]],
        on_abort: Callable[[], bytes],
    ) -> None:
        # No body attribute: Response would declare a Content-Length for it.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.on_close = on_close
        self.on_abort = on_abort

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = False
        started = False
        start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        try:
            try:
                async with anyio.create_task_group() as tg:

                    async def watch() -> None:
                        while (await receive())["type"] != "http.disconnect":
                            pass
                        tg.cancel_scope.cancel()

                    tg.start_soon(watch)
                    try:
                        await send(start)
                        started = True
                        async for chunk in self.events:
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                        sent = True
                    except OSError:
                        pass  # the client went away mid-write (caught here: a task group would wrap it)
                    tg.cancel_scope.cancel()
            except anyio.get_cancelled_exc_class():
                if not _cancelled_by_the_http_server():
                    raise
                with contextlib.suppress(OSError):
                    if not started:
                        await send(start)
                    await send({"type": "http.response.body", "body": self.on_abort(), "more_body": False})
                    sent = True
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.events, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self.on_close(sent)


class ModelServer:
    """The models, the decode loop and the embedding batcher behind the OpenAI routes.

    Args:
        model: a :class:`~batchkit.models.pretrained.PretrainedLM`, or a source for
            :func:`~batchkit.models.load_pretrained` (loaded in the background at start-up), or None
            for an embeddings-only server.
        embedding_model: a :class:`~batchkit.models.pretrained.SentenceEncoder` or a source for
            :func:`~batchkit.models.pretrained.load_encoder`, or None.
        model_name, embedding_model_name: the names clients pass as ``model`` (default: the
            models' own names). A request naming another model gets 404.
        num_blocks, block_size: the KV pool (``num_blocks * block_size`` tokens in all).
        max_num_seqs, max_num_batched_tokens, enable_prefix_caching: the loop's scheduling.
        max_waiting: requests that may wait for admission before new ones get 503.
        tenant_quotas: most KV blocks each tenant (``X-Batchkit-Tenant``) may hold at once; a
            tenant at its quota waits while other tenants' requests go on. Needs a
            ``ContinuousDecodeLoop``'s ``tenant_quotas``.
        default_max_tokens: output limit of a request that gives none (also capped by the context).
        embedding_max_batch, embedding_max_wait_ms, embedding_max_queue: the embedding batcher.
            Each input of a request is one item of its queue, so the default queue holds two
            requests of the most inputs one may carry (2048); a smaller queue lowers that limit
            to its own size (400 beyond it), so that no request is refused for ever as "busy".
        retry_after_s: the ``Retry-After`` header of 503 answers.
        max_prompts_per_request: the most prompts one ``/v1/completions`` request may carry (400
            beyond it); each runs as its own sequence, answered as ``choices`` by index.
        max_request_bytes: the largest request body taken; a longer one gets 413 as soon as its
            ``Content-Length`` or the bytes read so far pass it (the rest is not read).
        engine: the decode loop's ``engine``: ``"thread"`` (it steps the model on its own thread)
            or ``"caller"`` (a thread of yours calls ``app.state.batchkit.loop.run_engine()`` once
            the loop exists; ``batchkit serve`` does this from the main thread, which is faster on a
            CPU, see docs/benchmarks.md).
        request_timeout_s: a generation must finish within this many seconds of its arrival;
            past it the loop drops it (its KV blocks freed) and the client gets 504 (or, once
            streaming, an error event). None: no limit.
        shutdown_grace_s: on shutdown, how long requests in flight may finish before they are aborted.
        warmup: run one short generation and one embedding before reporting ready.
        on_load_error: called with the exception when loading or warming up fails (``batchkit
            serve`` stops the server then), which then reports it (the traceback is logged at
            DEBUG level); without it the server logs the error with its traceback and stays up
            with ``/ready`` at 503.
        dtype, device: where the models are loaded (sources only).
    """

    def __init__(
        self,
        model: ModelSource = None,
        *,
        embedding_model: ModelSource = None,
        model_name: str | None = None,
        embedding_model_name: str | None = None,
        num_blocks: int = 512,
        block_size: int = 16,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 1024,
        enable_prefix_caching: bool = True,
        max_waiting: int | None = 64,
        tenant_quotas: Mapping[str, int] | None = None,
        default_max_tokens: int = 256,
        embedding_max_batch: int = 32,
        embedding_max_wait_ms: float = 5.0,
        embedding_max_queue: int = 2 * MAX_EMBEDDING_INPUTS,
        retry_after_s: int = 1,
        max_request_bytes: int = MAX_REQUEST_BYTES,
        max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST,
        request_timeout_s: float | None = None,
        shutdown_grace_s: float = 10.0,
        warmup: bool = True,
        on_load_error: Callable[[BaseException], None] | None = None,
        dtype: Any = None,
        device: Any = "cpu",
        engine: Literal["thread", "caller"] = "thread",
    ) -> None:
        if model is None and embedding_model is None:
            raise ValueError("give a model, an embedding_model, or both")
        if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be an int >= 1 (bytes), got {max_request_bytes!r}")
        self._model_source = model
        self._embedding_source = embedding_model
        self._model_name = model_name
        self._embedding_model_name = embedding_model_name
        self.loop_options: dict[str, Any] = {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "enable_prefix_caching": enable_prefix_caching,
            "max_waiting": max_waiting,
            "engine": engine,
        }
        if tenant_quotas:
            self.loop_options["tenant_quotas"] = dict(tenant_quotas)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.default_max_tokens = default_max_tokens
        self.embedding_options: dict[str, Any] = {
            "max_batch": embedding_max_batch,
            "max_wait_ms": embedding_max_wait_ms,
            "max_queue": embedding_max_queue,
            "on_full": "reject",
            # A failing encoder fails fast (503) instead of taking every request down with it.
            "circuit_breaker": CircuitBreaker(failure_threshold=5, reset_timeout_s=float(retry_after_s)),
        }
        self.embedding_max_inputs = min(MAX_EMBEDDING_INPUTS, embedding_max_queue)
        self.retry_after_s = retry_after_s
        self.max_request_bytes = max_request_bytes
        if (
            isinstance(max_prompts_per_request, bool)
            or not isinstance(max_prompts_per_request, int)
            or max_prompts_per_request < 1
        ):
            raise ValueError(f"max_prompts_per_request must be an int >= 1, got {max_prompts_per_request!r}")
        self.max_prompts_per_request = max_prompts_per_request
        self._token_strings: dict[int, str] = {}
        self.request_timeout_s = request_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.warmup = warmup
        self.on_load_error = on_load_error
        self.dtype = dtype
        self.device = device
        self.lm: PretrainedLM | None = None
        self.encoder: SentenceEncoder | None = None
        # What requests are tokenized with, in worker threads (see _encoding_copy, _InputCutter),
        # one thread at a time each: the copies are not safe from two threads at once.
        self.prompt_lm: PretrainedLM | None = None
        self.input_cutter: _InputCutter | None = None
        self._prompt_limiter = anyio.CapacityLimiter(1)
        self._input_limiter = anyio.CapacityLimiter(1)
        self.loop: ContinuousDecodeLoop | None = None
        self.embed: BatchedFunction[str, tuple[list[float], int]] | None = None
        self.ready = False
        self.accepting = True
        self.created = int(time.time())  # the models' "created" time: when this server was made
        self.load_error: BaseException | None = None
        self.registry = CollectorRegistry()
        self.collector = BatchkitCollector().register(self.registry)
        self.metrics = _ServerMetrics(self.registry)
        self._in_flight = 0
        self._idle: anyio.Event | None = None  # set when the last request in flight leaves
        self._token: Any = None  # the event loop serving the app (set in the lifespan)
        self._grace: anyio.CancelScope | None = None  # the shutdown's wait for requests in flight
        self._no_grace = False  # set by end_grace_from_thread()

    # ------------------------------------------------------------------ names

    @property
    def model_name(self) -> str | None:
        if self._model_name:
            return self._model_name
        return self.lm.name if self.lm is not None else _source_name(self._model_source)

    @property
    def embedding_model_name(self) -> str | None:
        if self._embedding_model_name:
            return self._embedding_model_name
        return self.encoder.name if self.encoder is not None else _source_name(self._embedding_source)

    # ------------------------------------------------------------------ lifecycle

    def _load(self) -> None:
        """Load the models (worker thread) and build the loop and the batcher."""
        from ..models import pretrained

        kwargs: dict[str, Any] = {"device": self.device}
        if self.dtype is not None:
            kwargs["dtype"] = self.dtype
        if self._model_source is not None:
            src = self._model_source
            self.lm = src if isinstance(src, pretrained.PretrainedLM) else pretrained.load_pretrained(src, **kwargs)
            self.prompt_lm = _encoding_copy(self.lm)
            self.loop = self.lm.make_loop(self.num_blocks, self.block_size, **self.loop_options)
            self.collector.add_loop("chat", self.loop)
        if self._embedding_source is not None:
            src = self._embedding_source
            self.encoder = (
                src if isinstance(src, pretrained.SentenceEncoder) else pretrained.load_encoder(src, **kwargs)
            )
            encoder = self.encoder
            self.input_cutter = _InputCutter(encoder.tokenizer, encoder.max_seq_length)

            def embed_batch(texts: list[str]) -> list[tuple[list[float], int]]:
                vectors, counts = encoder.encode(texts)
                return list(zip(vectors.tolist(), counts, strict=True))

            self.embed = batched(**self.embedding_options)(embed_batch)
            self.collector.add_batcher("embeddings", self.embed)

    async def start(self) -> None:
        """Load and warm the models; then report ready. Errors are logged and kept in ``load_error``."""
        try:
            await anyio.to_thread.run_sync(self._load)
            if not self.accepting:  # shut down while loading: the lifespan closes what was made
                return
            if self.warmup:
                if self.loop is not None and self.lm is not None:
                    await self.loop.agenerate_all(self.lm.encode("Hello"), max_new_tokens=2)
                if self.embed is not None:
                    await self.embed.acall("Hello")
        except Exception as exc:
            self.load_error = exc
            if self.on_load_error is not None:
                # The callback reports it (``batchkit serve`` prints one line and exits); the
                # traceback is for debugging only.
                logger.debug("batchkit.serve: loading the models failed", exc_info=exc)
                self.on_load_error(exc)
            else:  # the app stays up with /ready at 503: the log is where the cause is told
                logger.error("batchkit.serve: loading the models failed", exc_info=exc)
            return
        self.ready = True
        self.metrics.ready.set(1)
        served = [
            f"{what} {name}"
            for what, name, model in (
                ("chat model", self.model_name, self.loop),
                ("embedding model", self.embedding_model_name, self.embed),
            )
            if model is not None
        ]
        logger.info("batchkit.serve: ready (%s)", ", ".join(served))

    async def shutdown(self) -> None:
        """Stop admitting; give requests in flight ``shutdown_grace_s`` to finish; abort the rest; close."""
        self.accepting = False
        self.ready = False
        self.metrics.ready.set(0)
        if self._in_flight and self._idle is not None and not self._no_grace:
            with anyio.move_on_after(self.shutdown_grace_s) as self._grace:
                await self._idle.wait()
            self._grace = None
        if self.loop is not None:
            await self.loop.aclose()
        if self.embed is not None:
            await self.embed.aclose()

    def shutdown_from_thread(self) -> None:
        """Run :meth:`shutdown` on the app's event loop from another thread, and wait for it.

        For a server that stops on a signal: call it before telling the HTTP server to exit, so
        that new requests get 503 (``shutting_down``) and ``/ready`` 503 (``stopping``) while the
        requests in flight finish, and those still running after ``shutdown_grace_s`` end with an
        OpenAI error (not a bare 500 from the HTTP server cancelling them). Does nothing before
        the app's lifespan has started or after its event loop has ended.
        """
        token = self._token
        if token is None:
            return
        with contextlib.suppress(RuntimeError):  # the event loop has already ended
            anyio.from_thread.run(self.shutdown, token=token)

    def end_grace_from_thread(self) -> None:
        """Cut the shutdown's ``shutdown_grace_s`` short, from another thread: what still runs is
        aborted now (503 ``shutting_down``). For a second Ctrl-C; a shutdown not yet begun will
        then not wait either. Does nothing before the app's lifespan has started or after its
        event loop has ended."""
        token = self._token
        if token is None:
            return
        with contextlib.suppress(RuntimeError):  # the event loop has already ended
            anyio.from_thread.run_sync(self._end_grace, token=token)

    def _end_grace(self) -> None:
        self._no_grace = True
        if self._grace is not None:
            self._grace.cancel()

    @asynccontextmanager
    async def lifespan(self, app: Any = None) -> AsyncIterator[None]:
        """Start loading in the background; on exit, :meth:`shutdown`. Enter it from a parent app's
        lifespan when this app is mounted (Starlette does not run a mounted app's lifespan)."""
        self._token = anyio.lowlevel.current_token()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.start)
                try:
                    yield
                finally:
                    tg.cancel_scope.cancel()
        finally:
            # After the task group: a load still running has finished (a worker thread cannot be
            # cancelled), so the loop and the batcher it made are closed too, not left running.
            with anyio.CancelScope(shield=True):
                await self.shutdown()

    def _enter(self) -> None:
        self._in_flight += 1
        if self._in_flight == 1:
            self._idle = anyio.Event()
        self.metrics.in_flight.set(self._in_flight)

    async def _leave(self) -> None:
        self._in_flight -= 1
        self.metrics.in_flight.set(self._in_flight)
        if self._in_flight == 0 and self._idle is not None:
            self._idle.set()

    # ------------------------------------------------------------------ common checks

    def _check_available(self, what: str) -> None:
        if not self.accepting:
            self._reject("shutting_down")
            raise self._retry_later("the server is shutting down", "shutting_down")
        if not self.ready:
            if self.load_error is not None:
                raise ApiError(
                    503, f"the models failed to load: {self.load_error}", type="server_error", code="load_failed"
                )
            self._reject("loading")
            raise self._retry_later("the models are still loading; retry shortly", "loading")
        if (what == "chat" and self.loop is None) or (what == "embeddings" and self.embed is None):
            raise ApiError(404, f"this server has no {what} model", code="model_not_found")

    def _check_model(self, requested: str | None, served: str | None) -> None:
        if requested is not None and requested != served:
            raise ApiError(
                404,
                f"the model {requested!r} does not exist; this server serves {served!r}",
                param="model",
                code="model_not_found",
            )

    def _retry_later(self, message: str, code: str) -> ApiError:
        """A 503 the client may retry after ``retry_after_s`` (busy, loading, shutting down)."""
        return ApiError(503, message, type="server_error", code=code, headers={"Retry-After": str(self.retry_after_s)})

    def _stopped_by_the_http_server(self) -> ApiError:
        """The answer for a request the HTTP server cancelled: uvicorn does so to requests still
        running at its ``--timeout-graceful-shutdown`` (else they would get a bare 500)."""
        return self._retry_later("the server is shutting down; the request was stopped", "shutting_down")

    def _reject(self, reason: str) -> None:
        self.metrics.rejections.labels(reason).inc()

    def _queue_full(self, exc: BaseException) -> ApiError:
        self._reject("queue_full")
        return self._retry_later(f"the server is busy: {exc}", "queue_full")

    @staticmethod
    def _routing(request: Request) -> tuple[int, str | None]:
        raw = request.headers.get(PRIORITY_HEADER)
        priority = 0
        if raw is not None:
            try:
                priority = int(raw)
            except ValueError:
                raise ApiError(
                    400, f"{PRIORITY_HEADER} must be an integer (lower runs first), got {raw!r}", code="invalid_header"
                ) from None
        tenant = request.headers.get(TENANT_HEADER) or None
        if tenant is not None and len(tenant) > MAX_TENANT_LENGTH:
            raise ApiError(400, f"{TENANT_HEADER} is longer than {MAX_TENANT_LENGTH} characters", code="invalid_header")
        return priority, tenant

    def _limit(
        self, prompt_len: int, requested: int | None, prompt_param: str, limit_param: str, tenant: str | None = None
    ) -> int:
        """The request's output limit, checked against the model's context, the KV pool and the
        tenant's KV quota: prompt + limit may fill each, not pass it (``prompt_param``: the field a
        prompt too long is blamed on, ``messages`` or ``prompt``; ``limit_param``: the field the
        limit came from, ``max_tokens`` or ``max_completion_tokens``).

        A request of P prompt tokens and M new ones holds at most P + M - 1 tokens' KV (the last
        token sampled is never fed back), so P + M up to the pool's (or the quota's) tokens fits:
        refused here, it could never run; let through, it is never cut short for lack of blocks.
        """
        lm = self.lm
        loop = self.loop
        assert lm is not None
        assert loop is not None
        alloc = loop.allocator
        kv_tokens = (alloc.total_blocks - alloc.watermark_blocks) * alloc.block_size
        quota = alloc.quota_of(tenant)
        room_ctx = lm.max_model_len - prompt_len
        room_kv = kv_tokens - prompt_len
        if room_ctx < 1:
            self._reject("prompt_too_long")
            raise ApiError(
                400,
                f"this model's maximum context length is {lm.max_model_len} tokens; the prompt has {prompt_len}",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if room_kv < 1:
            self._reject("prompt_too_long")
            raise ApiError(
                400,
                f"the prompt has {prompt_len} tokens but the KV pool holds {kv_tokens}; shorten the prompt",
                param=prompt_param,
                code="context_length_exceeded",
            )
        rooms = [room_ctx, room_kv]
        if quota is not None:
            quota_tokens = quota * alloc.block_size
            room_quota = quota_tokens - prompt_len
            if room_quota < 1:
                self._reject("kv_exhausted")
                raise ApiError(
                    400,
                    f"the prompt has {prompt_len} tokens but tenant {tenant!r}'s KV quota of {quota} blocks holds "
                    f"{quota_tokens}; shorten the prompt",
                    param=prompt_param,
                    code="context_length_exceeded",
                )
            rooms.append(room_quota)
        if requested is None:
            return max(1, min(self.default_max_tokens, *rooms))
        if requested > room_ctx:
            self._reject("prompt_too_long")
            raise ApiError(
                400,
                f"this model's maximum context length is {lm.max_model_len} tokens; the prompt ({prompt_len}) plus "
                f"{limit_param} ({requested}) asks for {prompt_len + requested}",
                param=limit_param,
                code="context_length_exceeded",
            )
        if requested > room_kv:
            self._reject("prompt_too_long")
            raise ApiError(
                400,
                f"the prompt ({prompt_len} tokens) plus {limit_param} ({requested}) needs more than the KV pool's "
                f"{kv_tokens} tokens; lower {limit_param} or shorten the prompt",
                param=limit_param,
                code="context_length_exceeded",
            )
        if quota is not None and requested > rooms[-1]:
            self._reject("kv_exhausted")
            raise ApiError(
                400,
                f"the prompt ({prompt_len} tokens) plus {limit_param} ({requested}) needs more than tenant "
                f"{tenant!r}'s KV quota of {quota} blocks ({quota * alloc.block_size} tokens); lower {limit_param} "
                "or shorten the prompt",
                param=limit_param,
                code="context_length_exceeded",
            )
        return requested

    # ------------------------------------------------------------------ routes

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readiness(self, request: Request) -> Response:
        if self.ready:
            return JSONResponse({"status": "ready"})
        status = "failed" if self.load_error is not None else ("stopping" if not self.accepting else "loading")
        return JSONResponse({"status": status}, status_code=503, headers={"Retry-After": str(self.retry_after_s)})

    async def metrics_endpoint(self, request: Request) -> Response:
        body = await anyio.to_thread.run_sync(generate_latest, self.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def _model_cards(self) -> list[dict[str, Any]]:
        return [
            {"id": name, "object": "model", "created": self.created, "owned_by": "batchkit"}
            for name, present in (
                (self.model_name, self._model_source),
                (self.embedding_model_name, self._embedding_source),
            )
            if present is not None and name
        ]

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": self._model_cards()})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{id}`` (what ``client.models.retrieve`` calls): one model's card."""
        wanted = request.path_params["model_id"]
        for card in self._model_cards():
            if card["id"] == wanted:
                return JSONResponse(card)
        served = [c["id"] for c in self._model_cards()]
        return _error_response(
            ApiError(404, f"the model {wanted!r} does not exist; this server serves {served}", code="model_not_found")
        )

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize`` (vLLM's): ``{"count", "max_model_len", "tokens", "token_strs"}``."""
        return await self._answer(request, "tokenize", self._tokenize)

    async def _tokenize(self, request: Request, route: str, body: Any, t_arrival: float) -> Response:
        self._check_available("chat")
        req = parse_tokenize(body)
        self._check_model(req.model, self.model_name)
        lm = self.prompt_lm
        assert lm is not None

        def run() -> list[int]:
            if req.messages is not None:
                try:
                    return lm.chat_prompt(req.messages)
                except ValueError as exc:
                    raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
            with lm.lock:
                return list(lm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))

        tokens = await anyio.to_thread.run_sync(run, limiter=self._prompt_limiter)
        assert self.lm is not None
        strs = [self._token_string(t) for t in tokens] if req.return_token_strs else None
        return JSONResponse(
            {"count": len(tokens), "max_model_len": self.lm.max_model_len, "tokens": tokens, "token_strs": strs}
        )

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize`` (vLLM's): ``{"prompt": text}``."""
        return await self._answer(request, "detokenize", self._detokenize)

    async def _detokenize(self, request: Request, route: str, body: Any, t_arrival: float) -> Response:
        self._check_available("chat")
        lm = self.prompt_lm
        assert lm is not None
        model, tokens = parse_detokenize(body, lm.model.config.vocab_size)
        self._check_model(model, self.model_name)
        text = await anyio.to_thread.run_sync(lm.decode, tokens, limiter=self._prompt_limiter)
        return JSONResponse({"prompt": text})

    async def tokenizer_info(self, request: Request) -> Response:
        """``GET /tokenizer_info`` (vLLM's): the tokenizer's class, special tokens and chat
        template, what lm-evaluation-harness's remote tokenizer reads instead of downloading one."""
        try:
            self._check_available("chat")
        except ApiError as err:
            return _error_response(err)
        lm = self.lm
        assert lm is not None
        tok = lm.tokenizer
        info: dict[str, Any] = {
            "tokenizer_class": type(tok).__name__,
            "model_max_length": lm.max_model_len,
            "vocab_size": lm.model.config.vocab_size,
        }
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = getattr(tok, name, None)
            info[name] = value if isinstance(value, str) else None
        template = getattr(tok, "chat_template", None)
        info["chat_template"] = template if isinstance(template, str) else None
        return JSONResponse(info)

    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, "chat", self._generate)

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, "completions", self._generate)

    async def embeddings(self, request: Request) -> Response:
        return await self._answer(request, "embeddings", self._embeddings)

    async def _answer(
        self, request: Request, route: str, handler: Callable[[Request, str, Any, float], Awaitable[Response]]
    ) -> Response:
        t_arrival = time.perf_counter()
        try:
            body = parse_body(await _read_body(request, self.max_request_bytes))
            response = await handler(request, route, body, t_arrival)
        except ApiError as err:
            response = _error_response(err)
        except anyio.get_cancelled_exc_class():
            if not _cancelled_by_the_http_server():
                raise
            response = _error_response(self._stopped_by_the_http_server())
        if not isinstance(response, _EventStream):  # a stream is counted when it ends
            self.metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    async def _generate(self, request: Request, route: str, body: Any, t_arrival: float) -> Response:
        self._check_available("chat")
        req = parse_chat(body) if route == "chat" else parse_completion(body, self.max_prompts_per_request)
        self._check_model(req.model, self.model_name)
        priority, tenant = self._routing(request)
        lm, loop = self.lm, self.loop
        assert lm is not None
        assert loop is not None
        # Off the event loop: a long prompt takes seconds to tokenize, and every other client's
        # stream (and /health) would stand still meanwhile.
        prompts = await anyio.to_thread.run_sync(self._all_prompt_ids, req, limiter=self._prompt_limiter)
        limits = [
            self._limit(len(p), req.max_tokens, self._prompt_param(req, i), req.max_tokens_param, tenant)
            for i, p in enumerate(prompts)
        ]
        stop_ids = () if req.ignore_eos else lm.stop_token_ids
        sampling: dict[str, Any] = {
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "ignore_eos": req.ignore_eos,
            "seed": req.seed,
            "stop_token_ids": stop_ids,
        }
        if req.stop:
            sampling["stop"] = req.stop
        detailed = req.logprobs is not None
        if detailed:
            sampling["logprobs"] = req.logprobs
            if req.echo:
                sampling["prompt_logprobs"] = req.logprobs
        generate = loop.generate_logprobs if detailed else loop.generate
        rid = new_id("chatcmpl" if route == "chat" else "cmpl")
        gens = [
            _Generation(
                self,
                route,
                # max_tokens=0 (echo alone) still runs the prompt: its last position's logits
                # sample one token, which the answer leaves out.
                generate(
                    prompt,
                    priority=priority,
                    tenant=tenant,
                    deadline_s=self.request_timeout_s,
                    max_new_tokens=max(1, limit),
                    **sampling,
                ),
                len(prompt),
                limit,
                req.stop,
                stop_ids,
                t_arrival,
                detailed=detailed,
                index=i,
                rid=rid,
            )
            for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True))
        ]
        self._enter()
        handed_over = False
        try:
            # The first tokens are awaited before the response starts, so that refusals (queue
            # full, a prompt the pool can never hold) get their own status code.
            firsts = await _unless_disconnected(request, self._each(gens, self._first_text))
            if firsts is None:  # the client left
                return Response(status_code=499)
            self.metrics.prompt_tokens.labels(route).inc(sum(len(p) for p in prompts))
            if req.stream:
                handed_over = True

                async def on_close(sent: bool) -> None:
                    # 499 for a client that left mid-stream; a stream that ended with an error
                    # event counts under that error's status.
                    self.metrics.requests.labels(route, str(gens[0].status if sent else 499)).inc()
                    for gen in gens:
                        await gen.close()
                    await self._leave()

                def on_abort() -> bytes:
                    err = self._stopped_by_the_http_server()
                    gens[0].status = err.status
                    return _sse(err.body()) + _sse("[DONE]")

                return _EventStream(self._stream(gens, req, prompts, firsts), on_close, on_abort)
            texts = await _unless_disconnected(
                request, self._each(gens, lambda gen: self._collect(gen, firsts[gen.index]))
            )
            if texts is None:
                return Response(status_code=499)
            self.metrics.e2e.labels(route).observe(time.perf_counter() - t_arrival)
            model = self.model_name or ""
            if route == "chat":
                gen = gens[0]
                logprobs = chat_logprobs(gen.take_logprobs()) if detailed else None
                return JSONResponse(chat_response(rid, model, texts[0], gen.finish_reason, gen.usage(), logprobs))
            choices = [
                completion_choice(
                    gen.index,
                    self._echo_text(req, prompts, gen.index) + text,
                    gen.finish_reason,
                    completion_logprobs([*self._echoed_logprobs(req, prompts, gen), *gen.take_logprobs()])
                    if detailed
                    else None,
                )
                for gen, text in zip(gens, texts, strict=True)
            ]
            return JSONResponse(completion_response(rid, model, choices, self._usage_of(gens)))
        finally:
            if not handed_over:
                for gen in gens:
                    await gen.close()
                await self._leave()

    async def _each(self, gens: list[_Generation], work: Callable[[_Generation], Awaitable[T]]) -> list[T]:
        """``work`` on every generation of a request at once; the first ApiError raised is the answer."""
        if len(gens) == 1:
            return [await work(gens[0])]
        results: list[Any] = [None] * len(gens)
        errors: list[ApiError] = []
        async with anyio.create_task_group() as tg:

            async def one(gen: _Generation) -> None:
                try:
                    results[gen.index] = await work(gen)
                except ApiError as err:
                    errors.append(err)
                    tg.cancel_scope.cancel()

            for gen in gens:
                tg.start_soon(one, gen)
        if errors:
            raise errors[0]
        return results

    @staticmethod
    def _usage_of(gens: list[_Generation]) -> dict[str, int]:
        return usage(sum(g.prompt_tokens for g in gens), sum(g.completion_tokens for g in gens))

    def token_text(self, item: TokenLogprobs) -> TokenText:
        """A token's logprob entry as text: its own text, logprob and alternatives."""
        text = self._token_string
        return text(item.token), item.logprob, [(text(t), v) for t, v in item.top_logprobs]

    def _token_string(self, token: int) -> str:
        """One token's text alone (cached: a response may name the same tokens many times)."""
        cache = self._token_strings
        text = cache.get(token)
        if text is None:
            lm = self.lm
            assert lm is not None
            text = cache[token] = lm.decode([token])
        return text

    def _echo_text(self, req: GenerationRequest, prompts: list[list[int]], index: int) -> str:
        """The prompt's text that ``echo`` puts before the output ('' without echo)."""
        if not req.echo:
            return ""
        given = req.prompts[index]
        if isinstance(given, str):
            return given
        lm = self.lm
        assert lm is not None
        return lm.decode(prompts[index])

    def _echoed_logprobs(
        self, req: GenerationRequest, prompts: list[list[int]], gen: _Generation
    ) -> list[TokenText | str]:
        """With echo, the prompt's logprob entries: its first token (which no context predicts,
        so without a logprob), then the others'."""
        if not req.echo:
            return []
        return [self._token_string(prompts[gen.index][0]), *gen.prompt_logprobs]

    @staticmethod
    def _prompt_param(req: GenerationRequest, index: int) -> str:
        if req.messages is not None:
            return "messages"
        return "prompt" if len(req.prompts) == 1 else f"prompt[{index}]"

    def _all_prompt_ids(self, req: GenerationRequest) -> list[list[int]]:
        """Every prompt's token ids (in a worker thread: tokenizes on :attr:`prompt_lm`).

        Raises:
            ApiError: 400 for a model without a chat template, or a token id past the vocabulary.
        """
        lm = self.prompt_lm
        assert lm is not None
        if req.messages is not None:
            try:
                return [lm.chat_prompt(req.messages)]
            except ValueError as exc:
                raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
        vocab = lm.model.config.vocab_size
        out = []
        for i, prompt in enumerate(req.prompts):
            if isinstance(prompt, str):
                out.append(lm.encode(prompt))
                continue
            if any(t < 0 or t >= vocab for t in prompt):
                raise ApiError(
                    400, f"token ids must be in [0, {vocab})", param=self._prompt_param(req, i), code="invalid_value"
                )
            out.append(list(prompt))
        return out

    def _generation_error(self, exc: Exception) -> ApiError:
        """The answer for an exception a generation raised (at submit or from its stream)."""
        if isinstance(exc, QueueFull):
            return self._queue_full(exc)
        if isinstance(exc, KVCacheExhausted):
            self._reject("kv_exhausted")
            return ApiError(400, str(exc), code="context_length_exceeded")
        if isinstance(exc, BatcherClosed):
            return self._retry_later(f"the server is shutting down: {exc}", "shutting_down")
        if isinstance(exc, DeadlineExceeded):
            self._reject("deadline")
            return ApiError(504, str(exc), type="server_error", code="deadline_exceeded")
        if isinstance(exc, ValueError):
            return ApiError(400, str(exc), code="invalid_value")
        logger.error("batchkit.serve: a generation failed", exc_info=exc)
        return ApiError(500, f"the generation failed: {exc}", type="server_error", code="generation_failed")

    async def _first_text(self, gen: _Generation) -> list[str]:
        try:
            text = await gen.next_text()
        except Exception as exc:  # noqa: BLE001 - every failure gets an OpenAI error body
            raise self._generation_error(exc) from None
        return [] if text is None else [text]

    async def _collect(self, gen: _Generation, first: list[str]) -> str:
        parts = list(first)
        try:
            while (text := await gen.next_text()) is not None:
                parts.append(text)
        except Exception as exc:  # noqa: BLE001 - every failure gets an OpenAI error body
            raise self._generation_error(exc) from None
        parts.append(gen.tail.finish())
        return "".join(parts)

    async def _stream(
        self, gens: list[_Generation], req: GenerationRequest, prompts: list[list[int]], firsts: list[list[str]]
    ) -> AsyncIterator[bytes]:
        """The events of a streamed request: its choices one after the other (all of them were
        submitted together: a later one's tokens wait in its stream meanwhile)."""
        model = self.model_name or ""
        lead = gens[0]
        chat = lead.route == "chat"

        def piece(gen: _Generation, text: str, echoed: bool = False) -> bytes:
            if chat:
                lps = chat_logprobs(gen.take_logprobs()) if gen.detailed else None
                return _sse(chat_chunk(lead.rid, lead.created, model, {"content": text}, None, None, lps))
            lps = None
            if gen.detailed:
                entries = self._echoed_logprobs(req, prompts, gen) if echoed else gen.take_logprobs()
                lps = completion_logprobs(entries)
            return _sse(completion_chunk(lead.rid, lead.created, model, completion_choice(gen.index, text, None, lps)))

        try:
            if chat:
                yield _sse(chat_chunk(lead.rid, lead.created, model, {"role": "assistant", "content": ""}))
            for gen in gens:
                if req.echo:
                    yield piece(gen, self._echo_text(req, prompts, gen.index), echoed=True)
                for text in firsts[gen.index]:
                    if text or gen.pending_logprobs:
                        yield piece(gen, text)
                try:
                    while (more := await gen.next_text()) is not None:
                        if more or gen.pending_logprobs:
                            yield piece(gen, more)
                except Exception as exc:  # noqa: BLE001 - the headers are sent: the error goes in the stream
                    err = self._generation_error(exc)
                    lead.status = err.status
                    yield _sse(err.body())
                    yield _sse("[DONE]")
                    return
                rest = gen.tail.finish()
                if rest or gen.pending_logprobs:
                    yield piece(gen, rest)
                # Without include_usage, the usage rides on the last choice's final chunk.
                final_usage = None if req.include_usage or gen is not gens[-1] else self._usage_of(gens)
                if chat:
                    yield _sse(chat_chunk(lead.rid, lead.created, model, {}, gen.finish_reason, final_usage))
                else:
                    choice = completion_choice(gen.index, "", gen.finish_reason)
                    yield _sse(completion_chunk(lead.rid, lead.created, model, choice, final_usage))
            if req.include_usage:
                if chat:
                    yield _sse(chat_chunk(lead.rid, lead.created, model, None, None, self._usage_of(gens)))
                else:
                    yield _sse(completion_chunk(lead.rid, lead.created, model, None, self._usage_of(gens)))
            yield _sse("[DONE]")
            self.metrics.e2e.labels(lead.route).observe(time.perf_counter() - lead.t_arrival)
        finally:
            for gen in gens:
                await gen.close()

    async def _embeddings(self, request: Request, route: str, body: Any, t_arrival: float) -> Response:
        self._check_available("embeddings")
        req = parse_embedding(body, self.embedding_max_inputs)
        self._check_model(req.model, self.embedding_model_name)
        embed, cutter = self.embed, self.input_cutter
        assert embed is not None
        assert cutter is not None
        inputs = req.inputs
        if any(cutter.would_cut(text) for text in inputs):  # off the event loop: it tokenizes
            inputs = await anyio.to_thread.run_sync(cutter.cut_all, inputs, limiter=self._input_limiter)
        self._enter()
        try:
            results = await _unless_disconnected(request, self._embed_all(embed, inputs))
        finally:
            await self._leave()
        if results is None:
            return Response(status_code=499)
        vectors = [v for v, _ in results]
        n_tokens = sum(n for _, n in results)
        self.metrics.prompt_tokens.labels(route).inc(n_tokens)
        self.metrics.e2e.labels(route).observe(time.perf_counter() - t_arrival)
        return JSONResponse(embedding_response(self.embedding_model_name or "", vectors, n_tokens, req.encoding_format))

    async def _embed_all(self, embed: Any, inputs: list[str]) -> list[tuple[list[float], int]]:
        results: list[Any] = [None] * len(inputs)
        errors: list[BaseException] = []
        async with anyio.create_task_group() as tg:

            async def one(i: int, text: str) -> None:
                try:
                    results[i] = await embed.acall(text)
                except Exception as exc:  # noqa: BLE001 - reported below, once, for the whole request
                    errors.append(exc)
                    tg.cancel_scope.cancel()

            for i, text in enumerate(inputs):
                tg.start_soon(one, i, text)
        if errors:
            exc = errors[0]
            if isinstance(exc, QueueFull):
                raise self._queue_full(exc)
            if isinstance(exc, BatcherClosed):
                raise self._retry_later(f"the server is shutting down: {exc}", "shutting_down")
            if isinstance(exc, CircuitOpen):
                self._reject("circuit_open")
                raise self._retry_later(f"the embedding model is failing: {exc}", "circuit_open")
            raise ApiError(500, f"embedding failed: {exc}", type="server_error")
        return results


# ---------------------------------------------------------------------------------------- tokenizing


def _encoding_copy(lm: PretrainedLM) -> PretrainedLM:
    """``lm`` with a tokenizer and a lock of its own, for tokenizing prompts in worker threads:
    a long prompt then never holds the lock that the event loop's and the engine's decoding take."""
    return dataclasses.replace(lm, tokenizer=copy.deepcopy(lm.tokenizer), lock=threading.Lock())


_WORD_BREAK = re.compile("[ \t\n\r]")


class _InputCutter:
    """Cuts an embedding input that the encoder truncates to a prefix holding every token it keeps,
    so that a long input is not tokenized whole in the encoder's batch (whose other inputs wait).

    A prefix that ends just before a space, tab or newline tokenizes to exactly the first tokens
    of the whole text when the tokenizer maps characters one by one (no normalizer, or BERT's)
    and splits words at whitespace before its model sees them (BERT's pre-tokenizer,
    ``Whitespace``, ``WhitespaceSplit``), and no added token holds whitespace: each word before
    the cut is tokenized alone, as in the whole text. A prefix of at least ``max_seq_length``
    tokens then gives the encoder the tokens the whole text would. Another tokenizer (or a text
    with no such break) gets the whole text, tokenized by the encoder.
    """

    def __init__(self, tokenizer: Any, max_seq_length: int) -> None:
        self.max_seq_length = max_seq_length
        self.min_chars = 8 * max_seq_length  # below it a text is cheap to tokenize whole: left alone
        self.tokenizer = tokenizer
        self.backend = _prefix_stable_copy(tokenizer)
        self.lock = threading.Lock()

    def would_cut(self, text: str) -> bool:
        # A tokenizer that truncates on the left keeps the text's last tokens: no prefix holds them
        # (read at each cut: the attribute may be changed after the server started).
        right = getattr(self.tokenizer, "truncation_side", "right") == "right"
        return right and self.backend is not None and len(text) > self.min_chars

    def cut(self, text: str) -> str:
        """``text``, or a prefix of it that the encoder turns into the same tokens."""
        if not self.would_cut(text):
            return text
        end = self.min_chars
        while end < len(text):
            brk = _WORD_BREAK.search(text, end)
            if brk is None:
                break
            prefix = text[: brk.start()]
            with self.lock:
                num_tokens = len(self.backend.encode(prefix, add_special_tokens=False))
            if num_tokens >= self.max_seq_length:
                return prefix
            end = 4 * brk.start()  # geometric: all the tries together tokenize at most 4/3 of the text
        return text

    def cut_all(self, texts: list[str]) -> list[str]:
        return [self.cut(t) for t in texts]


def _prefix_stable_copy(tokenizer: Any) -> Any:
    """A copy of ``tokenizer``'s fast backend without truncation or padding, when its prefixes
    cut at whitespace tokenize as the whole text begins (see :class:`_InputCutter`); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import normalizers, pre_tokenizers

    if backend.normalizer is not None and not isinstance(backend.normalizer, normalizers.BertNormalizer):
        return None
    splitters = (pre_tokenizers.BertPreTokenizer, pre_tokenizers.Whitespace, pre_tokenizers.WhitespaceSplit)
    if not isinstance(backend.pre_tokenizer, splitters):
        return None
    if any(_WORD_BREAK.search(t.content) for t in backend.get_added_tokens_decoder().values()):
        return None
    own = copy.deepcopy(backend)
    own.no_truncation()
    own.no_padding()
    return own


# ---------------------------------------------------------------------------------------- helpers


def _source_name(source: Any) -> str | None:
    if source is None:
        return None
    name = getattr(source, "name", None)
    if isinstance(name, str):
        return name
    text: str = os.fspath(source)
    base = os.path.basename(text.rstrip("/")) or text
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


async def _read_body(request: Request, limit: int) -> bytes:
    """The request's body, read as it arrives; 413 (and nothing more read) once it passes ``limit``
    bytes, or at once for a ``Content-Length`` over it."""

    def too_large(size: str) -> ApiError:
        return ApiError(
            413,
            f"the request body is {size} bytes; this server takes at most {limit} (--max-request-bytes)",
            code="request_too_large",
        )

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``, cancelling it if the client disconnects meanwhile (then return None)."""
    outcome: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            outcome.append(await work)
        except ApiError as err:
            outcome.append(err)
        finally:
            tg.cancel_scope.cancel()
    if not outcome:
        return None
    if isinstance(outcome[0], ApiError):
        raise outcome[0]
    return outcome[0]


def _cancelled_by_the_http_server() -> bool:
    """Whether the cancellation being handled came from outside every cancel scope of this
    task: the HTTP server cancelling the request (uvicorn does at ``--timeout-graceful-shutdown``),
    which then wants the task to end, and an OpenAI error is the better ending. If so, the
    cancellation is taken back (``Task.uncancel``), so that the answer can be sent. A cancelled
    scope of the app's own or of an enclosing app is not: it must propagate."""
    if anyio.current_effective_deadline() == -math.inf:
        return False
    try:
        task = asyncio.current_task()
    except RuntimeError:  # not asyncio: every cancellation comes from a scope
        return False
    if task is None:
        return False
    if sys.version_info >= (3, 11):  # before 3.11 there is no count of cancellations to take back
        if task.cancelling() == 0:
            return False
        task.uncancel()
    return True


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error_response(ApiError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))  # 405: Allow


def create_app(model: ModelSource = None, **options: Any) -> Starlette:
    """An OpenAI-compatible ASGI app serving ``model`` (chat and completions) and ``embedding_model``.

    ``options`` are :class:`ModelServer` keyword arguments (``embedding_model``, ``num_blocks``,
    ``max_waiting``, ...). The server object is ``app.state.batchkit``.

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
    ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``,
    ``GET /tokenizer_info``, ``GET /health``, ``GET /ready``, ``GET /metrics``.
    """
    server = ModelServer(model, **options)
    routes = [
        Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/embeddings", server.embeddings, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/tokenizer_info", server.tokenizer_info, methods=["GET"]),
        Route("/v1/models/{model_id:path}", server.model, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/ready", server.readiness, methods=["GET"]),
        Route("/metrics", server.metrics_endpoint, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=server.lifespan, exception_handlers={HTTPException: _http_error})
    app.state.batchkit = server
    return app
