"""The bridge from the HTTP handlers to the engine: the models, the decode loop and the embedding
batcher, their loading and shutdown, admission, tokenizing, submitting generations, token
accounting, and the OpenAI errors the engine's exceptions become. No routes or responses here
(those are :mod:`batchkit.serve.app`'s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
from prometheus_client import CollectorRegistry

from .._errors import QueueFull
from ..continuous.logprobs import TokenLogprobs
from ..continuous.loop import ContinuousDecodeLoop
from ..control import CircuitBreaker
from ..dynamic.decorator import BatchedFunction, batched
from .admission import PromptRoom, Refused, WaitingRoom
from .errors import ApiError, answer_for
from .generation import Generation
from .metrics import BatchkitCollector, ServerMetrics
from .protocol import GenerationRequest, TokenizeRequest, TokenString, TokenText, new_id, token_string
from .structured import compile_in_thread, grammar_for
from .tokenizing import InputCutter, PromptTokenizer

if TYPE_CHECKING:
    from ..models.pretrained import PretrainedLM, SentenceEncoder

__all__ = ["EngineBridge"]

logger = logging.getLogger("batchkit.serve.app")  # the name the server has always logged under


class EngineBridge:
    """What serves the requests once they are parsed: see :class:`~batchkit.serve.ModelServer`
    for the arguments, and :mod:`batchkit.serve.app` for the HTTP side."""

    def __init__(
        self,
        model: Any,
        *,
        embedding_model: Any,
        model_name: str | None,
        embedding_model_name: str | None,
        num_blocks: int,
        block_size: int,
        loop_options: Mapping[str, Any],
        default_max_tokens: int,
        embedding_options: Mapping[str, Any],
        retry_after_s: int,
        request_timeout_s: float | None,
        shutdown_grace_s: float,
        warmup: bool,
        on_load_error: Callable[[BaseException], None] | None,
        dtype: Any,
        device: Any,
        tokenizer: str | os.PathLike[str] | None = None,
    ) -> None:
        self.model_source = model
        self.tokenizer_source = tokenizer
        self.embedding_source = embedding_model
        self._model_name = model_name
        self._embedding_model_name = embedding_model_name
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.loop_options = dict(loop_options)
        self.default_max_tokens = default_max_tokens
        self.embedding_options: dict[str, Any] = {
            **embedding_options,
            # A failing encoder fails fast (503) instead of taking every request down with it.
            "circuit_breaker": CircuitBreaker(failure_threshold=5, reset_timeout_s=float(retry_after_s)),
        }
        self.retry_after_s = retry_after_s
        self.request_timeout_s = request_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.warmup = warmup
        self.on_load_error = on_load_error
        self.dtype = dtype
        self.device = device
        self.lm: PretrainedLM | None = None
        self.encoder: SentenceEncoder | None = None
        self.prompts: PromptTokenizer | None = None  # tokenizes requests in worker threads
        self.input_cutter: InputCutter | None = None
        self._input_limiter = anyio.CapacityLimiter(1)  # the cutter has one tokenizer (and a lock)
        self.loop: ContinuousDecodeLoop | None = None
        self.waiting_room = WaitingRoom(None)  # the loop's max_waiting once the loop is made
        self.embed: BatchedFunction[str, tuple[list[float], int]] | None = None
        self.ready = False
        self.accepting = True
        self.created = int(time.time())  # the models' "created" time: when this server was made
        self.load_error: BaseException | None = None
        self.registry = CollectorRegistry()
        # vLLM's names too: routers and autoscalers configured for vLLM then read this server as it is.
        self.collector = BatchkitCollector(vllm_names=True).register(self.registry)
        self.metrics = ServerMetrics(self.registry)
        self._token_strings: dict[int, TokenString] = {}
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
        return self.lm.name if self.lm is not None else _source_name(self.model_source)

    @property
    def embedding_model_name(self) -> str | None:
        if self._embedding_model_name:
            return self._embedding_model_name
        return self.encoder.name if self.encoder is not None else _source_name(self.embedding_source)

    # ------------------------------------------------------------------ lifecycle

    def _load(self) -> None:
        """Load the models (worker thread) and build the loop and the batcher."""
        from ..models import pretrained

        kwargs: dict[str, Any] = {"device": self.device}
        if self.dtype is not None:
            kwargs["dtype"] = self.dtype
        if self.model_source is not None:
            src = self.model_source
            if isinstance(src, pretrained.PretrainedLM):
                self.lm = src
            else:
                self.lm = pretrained.load_pretrained(src, tokenizer=self.tokenizer_source, **kwargs)
            self.prompts = PromptTokenizer(self.lm)
            self.loop = self.lm.make_loop(self.num_blocks, self.block_size, **self.loop_options)
            self.waiting_room = WaitingRoom(self.loop.max_waiting)
            self.collector.add_loop("chat", self.loop)
        if self.embedding_source is not None:
            src = self.embedding_source
            self.encoder = (
                src if isinstance(src, pretrained.SentenceEncoder) else pretrained.load_encoder(src, **kwargs)
            )
            encoder = self.encoder
            self.input_cutter = InputCutter(encoder.tokenizer, encoder.max_seq_length)

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
        """Run :meth:`shutdown` on the app's event loop from another thread, and wait for it
        (see :meth:`batchkit.serve.ModelServer.shutdown_from_thread`)."""
        token = self._token
        if token is None:
            return
        with contextlib.suppress(RuntimeError):  # the event loop has already ended
            anyio.from_thread.run(self.shutdown, token=token)

    def end_grace_from_thread(self) -> None:
        """Cut the shutdown's ``shutdown_grace_s`` short, from another thread (see
        :meth:`batchkit.serve.ModelServer.end_grace_from_thread`)."""
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
        """Start loading in the background; on exit, :meth:`shutdown`."""
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

    def enter(self) -> None:
        """Count a request in flight (the shutdown waits for it)."""
        self._in_flight += 1
        if self._in_flight == 1:
            self._idle = anyio.Event()
        self.metrics.in_flight.set(self._in_flight)

    async def leave(self) -> None:
        """The end of a request :meth:`enter` counted."""
        self._in_flight -= 1
        self.metrics.in_flight.set(self._in_flight)
        if self._in_flight == 0 and self._idle is not None:
            self._idle.set()

    # ------------------------------------------------------------------ refusals

    def check_available(self, what: str) -> None:
        """503 while loading or shutting down, or after a failed load; 404 without a ``what`` model."""
        if not self.accepting:
            self.reject("shutting_down")
            raise self.retry_later("the server is shutting down", "shutting_down")
        if not self.ready:
            if self.load_error is not None:
                raise ApiError(
                    503, f"the models failed to load: {self.load_error}", type="server_error", code="load_failed"
                )
            self.reject("loading")
            raise self.retry_later("the models are still loading; retry shortly", "loading")
        if (what == "chat" and self.loop is None) or (what == "embeddings" and self.embed is None):
            raise ApiError(404, f"this server has no {what} model", code="model_not_found")

    def retry_later(self, message: str, code: str) -> ApiError:
        """A 503 the client may retry after ``retry_after_s`` (busy, loading, shutting down)."""
        return ApiError(503, message, type="server_error", code=code, headers={"Retry-After": str(self.retry_after_s)})

    def stopped_by_the_http_server(self) -> ApiError:
        """The answer for a request the HTTP server cancelled: uvicorn does so to requests still
        running at its ``--timeout-graceful-shutdown`` (else they would get a bare 500)."""
        return self.retry_later("the server is shutting down; the request was stopped", "shutting_down")

    def reject(self, reason: str) -> None:
        self.metrics.rejections.labels(reason).inc()

    def error_for(self, exc: BaseException, what: str) -> ApiError:
        """The answer for an exception raised while serving a ``what`` (``"generation"``,
        ``"embedding"``), as :func:`~batchkit.serve.errors.answer_for` maps it, counted as a
        rejection where it is one (and logged where it is a failure): call it once per request."""
        if isinstance(exc, ApiError):
            return exc
        answer = answer_for(exc, what)
        if answer.rejection is not None:
            self.reject(answer.rejection)
        if answer.status == 500:
            logger.error("batchkit.serve: a %s failed", what, exc_info=exc)
        return answer.error(exc, self.retry_after_s)

    def generation_error(self, exc: Exception) -> ApiError:
        """The answer for an exception a generation raised (at submit or from its stream); see
        :meth:`error_for`."""
        return self.error_for(exc, "generation")

    # ------------------------------------------------------------------ generations

    def check_samples(self, req: GenerationRequest) -> None:
        """Refuse, before anything is tokenized or submitted, a request with more samples (its
        prompts times ``n``) than may ever wait for admission at once.

        Raises:
            ApiError: 400 ``invalid_value`` naming ``n`` (or ``prompt``) and ``--max-waiting``.
        """
        self.waiting_room.check_fits(len(req.prompts) if req.messages is None else 1, req.n)

    async def prompt_ids(self, req: GenerationRequest) -> list[list[int]]:
        """Every prompt's token ids, tokenized off the event loop. A prompt given as token ids
        is the list the request holds (checked against the vocabulary, not copied).

        Raises:
            ApiError: 400 for a model without a chat template, a token id (in a prompt or in
                ``logit_bias``) past the vocabulary, or a ``response_format`` it cannot compile.
        """
        assert self.prompts is not None
        assert self.lm is not None
        req.check_vocabulary(self.lm.model.config.vocab_size)
        await compile_in_thread(req.response_format, self.lm)  # then grammar_for (in submit) is a cache hit
        if req.messages is None and all(not isinstance(p, str) for p in req.prompts):
            return [p for p in req.prompts if not isinstance(p, str)]  # nothing to tokenize: no thread needed

        def run(lm: PretrainedLM) -> list[list[int]]:
            if req.messages is not None:
                try:
                    return [lm.chat_prompt(req.messages)]
                except ValueError as exc:
                    raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
            return [lm.encode(p) if isinstance(p, str) else p for p in req.prompts]

        return await self.prompts.run(run)

    def output_limits(self, req: GenerationRequest, prompts: Sequence[Sequence[int]], tenant: str | None) -> list[int]:
        """Each prompt's output limit (see :class:`~batchkit.serve.admission.PromptRoom`).

        Raises:
            ApiError: 400 ``context_length_exceeded`` for a prompt that could never run.
        """
        lm, loop = self.lm, self.loop
        assert lm is not None
        assert loop is not None
        room = PromptRoom.of(lm.max_model_len, loop.allocator, tenant)
        try:
            return [
                room.output_limit(
                    len(p), req.max_tokens, self.default_max_tokens, req.prompt_param(i), req.max_tokens_param
                )
                for i, p in enumerate(prompts)
            ]
        except Refused as refused:
            self.reject(refused.reason)
            raise

    def submit(
        self,
        req: GenerationRequest,
        route: str,
        prompts: list[list[int]],
        limits: list[int],
        priority: int,
        tenant: str | None,
        t_arrival: float,
    ) -> list[Generation]:
        """``req.n`` generations per prompt, all of one request, choice ``i * n + j`` prompt
        ``i``'s sample ``j``. A prompt's samples are queued on the first read of any of them;
        until then they hold their places in :attr:`waiting_room` (closing them unread gives
        the places back).

        Raises:
            ApiError: 503 ``queue_full`` when the loop's waiting queue has no room now for every
                sample (none is submitted then); 400 for a ``response_format`` it cannot use.
        """
        lm, loop = self.lm, self.loop
        assert lm is not None
        assert loop is not None
        sampling = req.sampling_options(lm.stop_token_ids, grammar_for(req.response_format, lm))
        stop_ids = sampling["stop_token_ids"]
        detailed = req.logprobs is not None
        generate = loop.generate_logprobs if detailed else loop.generate
        rid = new_id("chatcmpl" if route == "chat" else "cmpl")
        n = req.n
        try:
            places = self.waiting_room.take(len(prompts), n, loop.queue_depth(), loop.free_seats())
        except QueueFull as exc:
            raise self.generation_error(exc) from None
        gens: list[Generation] = []
        try:
            for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
                # max_tokens=0 (echo alone) still runs the prompt: its last position's logits
                # sample one token, which the answer leaves out.
                options: dict[str, Any] = {
                    "priority": priority,
                    "tenant": tenant,
                    "deadline_s": self.request_timeout_s,
                    "max_new_tokens": max(1, limit),
                    **sampling,
                }
                if n == 1:
                    streams = [generate(prompt, **options)]
                else:  # samples of one prompt: queued together, sharing its KV blocks
                    streams = list(loop.generate_n(prompt, n, detailed=detailed, **options))
                gens.extend(
                    Generation(
                        stream,
                        route=route,
                        rid=rid,
                        index=i * n + j,
                        prompt_index=i,
                        prompt_tokens=len(prompt),
                        max_tokens=limit,
                        stop=req.stop,
                        stop_token_ids=stop_ids,
                        include_stop=req.include_stop_str_in_output,
                        min_tokens=req.min_tokens,
                        t_arrival=t_arrival,
                        decode=lm.decode,
                        token_text=self.token_text,
                        metrics=self.metrics,
                        detailed=detailed,
                        places=places[i],
                    )
                    for j, stream in enumerate(streams)
                )
        except BaseException:  # a sampling field the loop refuses: nothing was queued
            for reservation in places:
                reservation.release()
            raise
        return gens

    async def echo_texts(self, req: GenerationRequest, prompts: list[list[int]]) -> list[str]:
        """Each prompt's text that ``echo`` puts before its output ('' without echo); token-id
        prompts are decoded off the event loop, special tokens spelled by name (as a string prompt
        holds them)."""
        if not req.echo:
            return [""] * len(prompts)
        if all(isinstance(p, str) for p in req.prompts):
            return [str(p) for p in req.prompts]
        assert self.prompts is not None

        def run(lm: PretrainedLM) -> list[str]:
            return [
                p if isinstance(p, str) else lm.decode(ids, skip_special_tokens=False)
                for p, ids in zip(req.prompts, prompts, strict=True)
            ]

        return await self.prompts.run(run)

    def token_text(self, item: TokenLogprobs) -> TokenText:
        """A token's logprob entry as text: its own text, logprob and alternatives."""
        text = self.token_string
        return text(item.token), item.logprob, [(text(t), v) for t, v in item.top_logprobs]

    def token_string(self, token: int) -> TokenString:
        """One token's text alone, with its bytes (cached: a response may name the same tokens
        many times). Decoded on the event loop: one token costs less there than the hop to a thread."""
        assert self.lm is not None
        return token_string(self.lm, self._token_strings, token)

    # ------------------------------------------------------------------ the tokenizer routes

    async def tokenize(self, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        """``/tokenize``: the tokens of a prompt or chat and, if asked for, each one's string as the
        vocabulary spells it (``convert_ids_to_tokens``, as vLLM's): special tokens by name, not
        decoded text (a byte-level BPE spells a leading space ``Ġ``)."""
        assert self.prompts is not None

        def run(lm: PretrainedLM) -> tuple[list[int], list[str] | None]:
            if req.messages is not None:
                try:
                    tokens = lm.chat_prompt(req.messages)
                except ValueError as exc:
                    raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
            else:
                with lm.lock:
                    tokens = list(lm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
            if not req.return_token_strs:
                return tokens, None
            with lm.lock:
                strs = [str(s) for s in lm.tokenizer.convert_ids_to_tokens(tokens)]
            return tokens, strs

        return await self.prompts.run(run)

    async def detokenize(self, tokens: list[int]) -> str:
        assert self.prompts is not None
        # As vLLM's: special tokens kept, so that /tokenize then /detokenize gives the text back.
        return await self.prompts.run(lambda lm: lm.decode(tokens, skip_special_tokens=False))

    # ------------------------------------------------------------------ embeddings

    async def cut_inputs(self, inputs: list[str]) -> list[str]:
        """``inputs``, the long ones cut to what the encoder keeps (see :class:`InputCutter`)."""
        cutter = self.input_cutter
        assert cutter is not None
        if any(cutter.would_cut(text) for text in inputs):  # off the event loop: it tokenizes
            return await anyio.to_thread.run_sync(cutter.cut_all, inputs, limiter=self._input_limiter)
        return inputs

    async def embed_all(self, inputs: list[str]) -> list[tuple[list[float], int]]:
        """Each input's vector and token count, all submitted at once.

        Raises:
            ApiError: as :meth:`error_for` answers what the batcher raised: 503 when it is full,
                closing or its circuit is open; 500 for a failure of the model.
        """
        embed = self.embed
        assert embed is not None
        # A request whose inputs cannot all be queued now is refused whole, at once: submitted
        # one by one, the first ones would be queued (a task each on the event loop: thousands
        # of them stalled every other request) before the refusal, then cancelled.
        queue = embed.batcher.queue
        room = queue.maxsize - len(queue)
        if len(inputs) > room:
            full = QueueFull(f"{len(inputs)} inputs do not fit in the embedding queue, which has room for {room} now")
            raise self.error_for(full, "embedding")
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
            raise self.error_for(errors[0], "embedding")
        return results


def _source_name(source: Any) -> str | None:
    if source is None:
        return None
    name = getattr(source, "name", None)
    if isinstance(name, str):
        return name
    text: str = os.fspath(source)
    base = os.path.basename(text.rstrip("/")) or text
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
