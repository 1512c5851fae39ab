"""The OpenAI-compatible ASGI app: the HTTP handlers of chat and text completions, embeddings,
the tokenizer routes, health and readiness, Prometheus metrics.

:func:`create_app` builds a Starlette app around a :class:`ModelServer`, reachable as
``app.state.batchkit``. The server parses each request, hands it to its
:class:`~batchkit.serve.engine.EngineBridge` (the models, the decode loop, the embedding batcher,
admission, tokenizing) and writes the answer: a JSON body, or Server-Sent Events. Models load
and warm up in the background after start-up: ``/health`` answers at once, ``/ready`` and the
``/v1`` routes answer 503 (with ``Retry-After``) until the models are warm.

A request's life: read the body (413 past ``max_request_bytes``) -> validate (400/422; 400 for
more samples, prompts times ``n``, than ``max_waiting``) -> tokenize (in a worker thread, on a
tokenizer copy of its own) -> check the prompt against the model's context and the KV pool (400)
-> submit to the loop (503 + ``Retry-After`` when the waiting queue has no room for all its
samples now) -> wait for the first token, watching for the client leaving -> stream or collect.
A client that disconnects, at any point, aborts its request: the loop frees its KV blocks at the
next step boundary.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import anyio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..continuous.logprobs import TokenLogprobs
from ..continuous.loop import ContinuousDecodeLoop
from ..dynamic.decorator import BatchedFunction
from .engine import EngineBridge
from .errors import ApiError
from .lifecycle import ServerState
from .metrics import ServerMetrics
from .protocol import (
    MAX_EMBEDDING_INPUTS,
    MAX_PROMPTS_PER_REQUEST,
    MAX_REQUEST_BYTES,
    parse_body,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_embedding,
    parse_tokenize,
)
from .replies import GenerationReply
from .responses import TokenText, embedding_response
from .settings import ServeSettings
from .transport import (
    EventStream,
    cancelled_by_the_http_server,
    error_response,
    http_error,
    read_body,
    sse,
    unless_disconnected,
)

if TYPE_CHECKING:
    from ..models.pretrained import PretrainedLM, SentenceEncoder

__all__ = ["ModelServer", "create_app"]

TENANT_HEADER = "x-batchkit-tenant"
PRIORITY_HEADER = "x-batchkit-priority"
_INTEGER = re.compile(r"[+-]?[0-9]+")
MAX_TENANT_LENGTH = 64


ModelSource = Any  # a PretrainedLM / SentenceEncoder, or a source for load_pretrained / load_encoder


class ModelServer:
    """The HTTP handlers of the OpenAI routes, over an :class:`~batchkit.serve.engine.EngineBridge`
    (:attr:`engine`) that holds the models, the decode loop and the embedding batcher.

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
        max_waiting: samples (requests, ``n`` per prompt) that may wait for admission at once: a
            request whose samples the queue cannot hold now gets 503, one with more samples than
            this 400.
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
        tokenizer: where to read the chat model's tokenizer from when its directory has none (a
            directory, a ``.gguf`` file or an installed package; a source ``model`` only), as
            :func:`~batchkit.models.load_pretrained` takes it.
        compile_step: compile the chat model's decode step with ``torch.compile`` (the native
            Llama; any other model runs eagerly): True at load, before ``/ready``; ``"background"``
            in a thread once the server is ready, the eager step serving until it is done
            (``GET /ready``'s ``decode_step`` says it). Either builds the native attention too.
        native_attention: on a CPU, build batchkit's native decode attention
            (:func:`batchkit.kv.native.build_decode_attention`) at load, so that the eager step's
            decodes run on it: about 30 s the first time on a machine, cached after. A failed
            build is logged and attention stays on torch. ``batchkit serve`` turns it on
            (``--no-native-attention`` leaves it off).
        freeze_heap: once the models are warm (and again after a background compile), collect
            the garbage and ``gc.freeze()`` what is left, so that the garbage collector's full
            passes (0.2-1 s over a loaded, compiled model's objects) stop pausing the steps. It
            acts on the whole process, which is why only ``batchkit serve`` turns it on.

    The arguments become one frozen :class:`~batchkit.serve.settings.ServeSettings`, checked once
    (:attr:`settings`, the value the server runs with); :meth:`from_settings` takes one made
    elsewhere. :attr:`state` is where the server is (loading, ready, stopping, failed).

    Raises:
        ValueError: as :class:`~batchkit.serve.settings.ServeSettings` checks the arguments.
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
        tokenizer: str | os.PathLike[str] | None = None,
        compile_step: bool | Literal["background"] = False,
        native_attention: bool = False,
        freeze_heap: bool = False,
    ) -> None:
        self._use(
            ServeSettings(
                model=model,
                embedding_model=embedding_model,
                model_name=model_name,
                embedding_model_name=embedding_model_name,
                num_blocks=num_blocks,
                block_size=block_size,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_prefix_caching=enable_prefix_caching,
                max_waiting=max_waiting,
                tenant_quotas=tenant_quotas,
                default_max_tokens=default_max_tokens,
                embedding_max_batch=embedding_max_batch,
                embedding_max_wait_ms=embedding_max_wait_ms,
                embedding_max_queue=embedding_max_queue,
                retry_after_s=retry_after_s,
                max_request_bytes=max_request_bytes,
                max_prompts_per_request=max_prompts_per_request,
                request_timeout_s=request_timeout_s,
                shutdown_grace_s=shutdown_grace_s,
                warmup=warmup,
                on_load_error=on_load_error,
                dtype=dtype,
                device=device,
                engine=engine,
                tokenizer=tokenizer,
                compile_step=compile_step,
                native_attention=native_attention,
                freeze_heap=freeze_heap,
            )
        )

    @classmethod
    def from_settings(cls, settings: ServeSettings) -> ModelServer:
        """The server of ``settings`` (each field is the keyword of that name)."""
        server = cls.__new__(cls)
        server._use(settings)
        return server

    def _use(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.engine = EngineBridge(settings)
        # The engine's parts this server reads on every request.
        self.submitter, self.refusals = self.engine.submitter, self.engine.refusals
        self.registry: CollectorRegistry = self.engine.registry
        self.metrics: ServerMetrics = self.engine.metrics

    # ------------------------------------------------------------------ the engine's state

    @property
    def lm(self) -> PretrainedLM | None:
        return self.engine.models.lm

    @property
    def encoder(self) -> SentenceEncoder | None:
        return self.engine.models.encoder

    @property
    def loop(self) -> ContinuousDecodeLoop | None:
        """The decode loop (made once the model has loaded)."""
        return self.engine.models.loop

    @property
    def embed(self) -> BatchedFunction[str, tuple[list[float], int]] | None:
        """The embedding batcher (made once the encoder has loaded)."""
        return self.engine.models.embed

    @property
    def state(self) -> ServerState:
        """Where the server is: loading, ready, stopping or failed (``GET /ready`` says it)."""
        return self.engine.lifecycle.state

    @property
    def ready(self) -> bool:
        return self.engine.lifecycle.ready

    @property
    def accepting(self) -> bool:
        return self.engine.lifecycle.accepting

    @property
    def load_error(self) -> BaseException | None:
        return self.engine.lifecycle.load_error

    @property
    def model_name(self) -> str | None:
        return self.engine.models.model_name

    @property
    def embedding_model_name(self) -> str | None:
        return self.engine.models.embedding_model_name

    def lifespan(self, app: Any = None) -> contextlib.AbstractAsyncContextManager[None]:
        """Start loading in the background; on exit, :meth:`shutdown`. Enter it from a parent app's
        lifespan when this app is mounted (Starlette does not run a mounted app's lifespan)."""
        return self.engine.lifespan(app)

    async def start(self) -> None:
        """Load and warm the models; then report ready. Errors are logged and kept in ``load_error``."""
        await self.engine.start()

    async def shutdown(self) -> None:
        """Stop admitting; give requests in flight ``shutdown_grace_s`` to finish; abort the rest; close."""
        await self.engine.shutdown()

    def shutdown_from_thread(self) -> None:
        """Run :meth:`shutdown` on the app's event loop from another thread, and wait for it.

        For a server that stops on a signal: call it before telling the HTTP server to exit, so
        that new requests get 503 (``shutting_down``) and ``/ready`` 503 (``stopping``) while the
        requests in flight finish, and those still running after ``shutdown_grace_s`` end with an
        OpenAI error (not a bare 500 from the HTTP server cancelling them). Does nothing before
        the app's lifespan has started or after its event loop has ended.
        """
        self.engine.shutdown_from_thread()

    def end_grace_from_thread(self) -> None:
        """Cut the shutdown's ``shutdown_grace_s`` short, from another thread: what still runs is
        aborted now (503 ``shutting_down``). For a second Ctrl-C; a shutdown not yet begun will
        then not wait either. Does nothing before the app's lifespan has started or after its
        event loop has ended."""
        self.engine.end_grace_from_thread()

    def token_text(self, item: TokenLogprobs) -> TokenText:
        """A token's logprob entry as text: its own text, logprob and alternatives."""
        return self.submitter.token_text(item)

    # ------------------------------------------------------------------ request parsing

    @staticmethod
    def _check_model(requested: str | None, served: str | None) -> None:
        if requested is not None and requested != served:
            raise _model_not_found(requested, [served or ""], param="model")

    @staticmethod
    def _routing(request: Request) -> tuple[int, str | None]:
        raw = request.headers.get(PRIORITY_HEADER)
        priority = 0
        if raw is not None:
            if not _INTEGER.fullmatch(raw.strip()):  # ASCII digits only: int() takes "1_000" and other scripts' digits
                raise ApiError(
                    400, f"{PRIORITY_HEADER} must be an integer (lower runs first), got {raw!r}", code="invalid_header"
                )
            priority = int(raw)
        tenant = request.headers.get(TENANT_HEADER) or None
        if tenant is not None and len(tenant) > MAX_TENANT_LENGTH:
            raise ApiError(400, f"{TENANT_HEADER} is longer than {MAX_TENANT_LENGTH} characters", code="invalid_header")
        return priority, tenant

    async def _answer(
        self, request: Request, route: str, handler: Callable[[Request, str, Any, float], Awaitable[Response]]
    ) -> Response:
        t_arrival = time.perf_counter()
        try:
            body = parse_body(await read_body(request, self.settings.max_request_bytes))
            response = await handler(request, route, body, t_arrival)
        except ApiError as err:
            response = error_response(err)
        except anyio.get_cancelled_exc_class():
            if not cancelled_by_the_http_server():
                raise
            response = error_response(self.refusals.stopped_by_the_http_server())
        if not isinstance(response, EventStream):  # a stream is counted when it ends
            self.metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    # ------------------------------------------------------------------ routes

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readiness(self, request: Request) -> Response:
        state = self.state
        body = {"status": state.value}
        if self.settings.model is not None and self.settings.compile_step:  # how its steps run now
            body["decode_step"] = self.engine.models.decode_step
        if state is ServerState.READY:
            return JSONResponse(body)
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        return JSONResponse(body, status_code=503, headers=retry)

    async def metrics_endpoint(self, request: Request) -> Response:
        body = await anyio.to_thread.run_sync(generate_latest, self.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def _model_cards(self) -> list[dict[str, Any]]:
        engine = self.engine
        return [
            {"id": name, "object": "model", "created": engine.created, "owned_by": "batchkit"}
            for name, present in (
                (self.model_name, self.settings.model),
                (self.embedding_model_name, self.settings.embedding_model),
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
        return error_response(_model_not_found(wanted, [c["id"] for c in self._model_cards()]))

    async def tokenize(self, request: Request) -> Response:
        """``POST /tokenize`` (vLLM's): ``{"count", "max_model_len", "tokens", "token_strs"}``."""
        return await self._answer(request, "tokenize", self._tokenize)

    async def _tokenize(self, request: Request, route: str, body: Any, t_arrival: float) -> Response:
        self.engine.check_available("chat")
        req = parse_tokenize(body)
        self._check_model(req.model, self.model_name)
        tokens, strs = await self.submitter.tokenize(req)
        assert self.lm is not None
        return JSONResponse(
            {"count": len(tokens), "max_model_len": self.lm.max_model_len, "tokens": tokens, "token_strs": strs}
        )

    async def detokenize(self, request: Request) -> Response:
        """``POST /detokenize`` (vLLM's): ``{"prompt": text}``."""
        return await self._answer(request, "detokenize", self._detokenize)

    async def _detokenize(self, request: Request, route: str, body: Any, t_arrival: float) -> Response:
        self.engine.check_available("chat")
        assert self.lm is not None
        model, tokens = parse_detokenize(body, self.lm.model.config.vocab_size)
        self._check_model(model, self.model_name)
        return JSONResponse({"prompt": await self.submitter.detokenize(tokens)})

    async def tokenizer_info(self, request: Request) -> Response:
        """``GET /tokenizer_info`` (vLLM's): the tokenizer's class, special tokens and chat
        template, what lm-evaluation-harness's remote tokenizer reads instead of downloading one."""
        try:
            self.engine.check_available("chat")
        except ApiError as err:
            return error_response(err)
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

    # ------------------------------------------------------------------ generations

    async def _generate(self, request: Request, route: str, body: Any, t_arrival: float) -> Response:
        engine, submitter = self.engine, self.submitter
        engine.check_available("chat")
        max_prompts = self.settings.max_prompts_per_request
        req = parse_chat(body) if route == "chat" else parse_completion(body, max_prompts)
        self._check_model(req.model, self.model_name)
        priority, tenant = self._routing(request)
        submitter.check_samples(req)
        prompts = await submitter.prompt_ids(req)
        limits = submitter.output_limits(req, prompts, tenant)
        gens = submitter.submit(req, route, prompts, limits, priority, tenant, t_arrival)
        reply = GenerationReply(
            gens,
            req,
            prompts,
            self.model_name or "",
            submitter=submitter,
            refusals=self.refusals,
            metrics=self.metrics,
        )
        engine.in_flight.enter()
        handed_over = False
        try:
            # The first tokens are awaited before the response starts, so that refusals (queue
            # full, a prompt the pool can never hold) get their own status code.
            firsts = await unless_disconnected(request, reply.first_texts())
            if firsts is None:  # the client left
                return Response(status_code=499)
            self.metrics.prompt_tokens.labels(route).inc(sum(len(p) for p in prompts))
            echoes = await submitter.echo_texts(req, prompts)
            if req.stream:
                handed_over = True
                return self._event_stream(reply, firsts, echoes)
            texts = await unless_disconnected(request, reply.texts(firsts))
            if texts is None:
                return Response(status_code=499)
            self.metrics.e2e.labels(route).observe(time.perf_counter() - t_arrival)
            return JSONResponse(reply.body(texts, echoes))
        finally:
            if not handed_over:
                for gen in gens:
                    await gen.close()
                engine.in_flight.leave()

    def _event_stream(self, reply: GenerationReply, firsts: list[list[str]], echoes: list[str]) -> EventStream:
        """The streamed answer of ``reply``: it counts the request and ends its generations when
        it closes."""
        gens, route = reply.gens, reply.gens[0].route

        async def on_close(sent: bool) -> None:
            # 499 for a client that left mid-stream; a stream that ended with an error
            # event counts under that error's status.
            self.metrics.requests.labels(route, str(gens[0].status if sent else 499)).inc()
            for gen in gens:
                await gen.close()
            self.engine.in_flight.leave()

        def on_abort() -> bytes:
            err = self.refusals.stopped_by_the_http_server()
            gens[0].status = err.status
            return sse(err.body()) + sse("[DONE]")

        return EventStream(reply.events(firsts, echoes), on_close, on_abort)

    # ------------------------------------------------------------------ embeddings

    async def _embeddings(self, request: Request, route: str, body: Any, t_arrival: float) -> Response:
        engine = self.engine
        engine.check_available("embeddings")
        req = parse_embedding(body, self.settings.embedding_max_inputs)
        self._check_model(req.model, self.embedding_model_name)
        inputs = await engine.embedder.cut_inputs(req.inputs)
        engine.in_flight.enter()
        try:
            results = await unless_disconnected(request, engine.embedder.embed_all(inputs))
        finally:
            engine.in_flight.leave()
        if results is None:
            return Response(status_code=499)
        vectors = [v for v, _ in results]
        n_tokens = sum(n for _, n in results)
        self.metrics.prompt_tokens.labels(route).inc(n_tokens)
        self.metrics.e2e.labels(route).observe(time.perf_counter() - t_arrival)
        return JSONResponse(embedding_response(self.embedding_model_name or "", vectors, n_tokens, req.encoding_format))


def _model_not_found(requested: str, served: list[str], param: str | None = None) -> ApiError:
    """404 ``model_not_found`` for ``requested``, naming the models ``served`` (``'a', 'b'``)."""
    names = ", ".join(repr(name) for name in served)
    return ApiError(
        404, f"the model {requested!r} does not exist; this server serves {names}", param=param, code="model_not_found"
    )


def create_app(model: ModelSource = None, *, settings: ServeSettings | None = None, **options: Any) -> Starlette:
    """An OpenAI-compatible ASGI app serving ``model`` (chat and completions) and ``embedding_model``.

    ``options`` are :class:`ModelServer` keyword arguments (``embedding_model``, ``num_blocks``,
    ``max_waiting``, ...); or ``settings``, all of them as one
    :class:`~batchkit.serve.settings.ServeSettings` (then neither ``model`` nor ``options``). The
    server object is ``app.state.batchkit``.

    Raises:
        TypeError: ``settings`` together with ``model`` or ``options``.

    Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
    ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /tokenize``, ``POST /detokenize``,
    ``GET /tokenizer_info``, ``GET /health``, ``GET /ready``, ``GET /metrics``.
    """
    if settings is None:
        server = ModelServer(model, **options)
    elif model is not None or options:
        raise TypeError("create_app takes settings, or a model and keyword options, not both")
    else:
        server = ModelServer.from_settings(settings)
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
    app = Starlette(routes=routes, lifespan=server.lifespan, exception_handlers={HTTPException: http_error})
    app.state.batchkit = server
    return app
