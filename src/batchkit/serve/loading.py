"""The served models: :class:`ServedModels` loads the chat model and the embedding model (in a
worker thread), makes the decode loop and the embedding batcher over them, warms them up and
closes them. Nothing here knows of requests or HTTP.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..continuous.loop import ContinuousDecodeLoop
from ..control import CircuitBreaker
from ..dynamic.decorator import BatchedFunction, batched
from ..kv.native import build_decode_attention
from .admission import WaitingRoom
from .metrics import BatchkitCollector
from .settings import ServeSettings
from .tokenizing import InputCutter, PromptTokenizer

if TYPE_CHECKING:
    from ..models.pretrained import PretrainedLM, SentenceEncoder

__all__ = ["ServedModels"]

logger = logging.getLogger(__name__)


class ServedModels:
    """The models of ``settings`` (given, or sources loaded by :meth:`load`), the decode loop and
    the embedding batcher made over them, each registered with ``collector``. Each is None until
    loaded, and stays None for a model the settings do not name."""

    def __init__(self, settings: ServeSettings, collector: BatchkitCollector) -> None:
        self.settings = settings
        self.collector = collector
        self.lm: PretrainedLM | None = None
        self.encoder: SentenceEncoder | None = None
        self.prompts: PromptTokenizer | None = None  # tokenizes requests in worker threads
        self.input_cutter: InputCutter | None = None
        self.loop: ContinuousDecodeLoop | None = None
        self.waiting_room = WaitingRoom(None)  # the loop's max_waiting once the loop is made
        self.embed: BatchedFunction[str, tuple[list[float], int]] | None = None
        # How the chat model's steps run: "eager", "compiling" (in the background, eager
        # meanwhile) or "compiled"; GET /ready says it.
        self.decode_step = "eager"
        self.compile_thread: threading.Thread | None = None  # compile_in_background's

    @property
    def model_name(self) -> str | None:
        """The chat model's name in requests: the settings', else the model's own."""
        if self.settings.model_name:
            return self.settings.model_name
        return self.lm.name if self.lm is not None else _source_name(self.settings.model)

    @property
    def embedding_model_name(self) -> str | None:
        """The embedding model's name in requests: the settings', else the model's own."""
        if self.settings.embedding_model_name:
            return self.settings.embedding_model_name
        return self.encoder.name if self.encoder is not None else _source_name(self.settings.embedding_model)

    def load(self) -> None:
        """Load the models and build the loop and the batcher (blocking: run it in a worker thread)."""
        from ..models import pretrained  # torch and transformers: only once a server starts

        settings = self.settings
        kwargs: dict[str, Any] = {"device": settings.device}
        if settings.dtype is not None:
            kwargs["dtype"] = settings.dtype
        if settings.model is not None:
            src = settings.model
            if isinstance(src, pretrained.PretrainedLM):
                self.lm = src
            else:
                self.lm = pretrained.load_pretrained(src, tokenizer=settings.tokenizer, **kwargs)
            if _prepare_step(self.lm.model, settings):
                self.decode_step = "compiled"
            self.prompts = PromptTokenizer(self.lm)
            self.loop = self.lm.make_loop(settings.num_blocks, settings.block_size, **settings.loop_options())
            self.waiting_room = WaitingRoom(self.loop.max_waiting)
            self.collector.add_loop("chat", self.loop)
        if settings.embedding_model is not None:
            src = settings.embedding_model
            self.encoder = (
                src if isinstance(src, pretrained.SentenceEncoder) else pretrained.load_encoder(src, **kwargs)
            )
            self._make_batcher(self.encoder)

    def _make_batcher(self, encoder: SentenceEncoder) -> None:
        self.input_cutter = InputCutter(encoder.tokenizer, encoder.max_seq_length)

        def embed_batch(texts: list[str]) -> list[tuple[list[float], int]]:
            vectors, counts = encoder.encode(texts)
            return list(zip(vectors.tolist(), counts, strict=True))

        # A failing encoder fails fast (503) instead of taking every request down with it.
        breaker = CircuitBreaker(failure_threshold=5, reset_timeout_s=float(self.settings.retry_after_s))
        self.embed = batched(**self.settings.embedding_options(), circuit_breaker=breaker)(embed_batch)
        self.collector.add_batcher("embeddings", self.embed)

    async def warm_up(self) -> None:
        """One short generation and one embedding, so that the first requests do not pay for
        what the first call of a model costs."""
        if self.loop is not None and self.lm is not None:
            await self.loop.agenerate_all(self.lm.encode("Hello"), max_new_tokens=2)
        if self.embed is not None:
            await self.embed.acall("Hello")

    def compile_in_background(self, on_compiled: Callable[[], None]) -> threading.Thread | None:
        """With ``compile_step="background"``: compile the chat model's step in a daemon thread
        while the eager step serves (:meth:`LlamaModel.compile_step` with ``warm=True``), then
        call ``on_compiled``. None, and nothing started, where there is nothing to compile (no
        chat model, or one without a compiled step) or the device is not a CPU."""
        model = self.lm.model if self.lm is not None else None
        if self.settings.compile_step != "background" or model is None:
            return None
        if not str(self.settings.device).startswith("cpu"):  # a compiled step runs on a CPU cache only
            logger.info(
                "compile_step='background' compiles on a CPU only: the steps on %s stay eager", self.settings.device
            )
            return None
        compile_step = _compiled_form(model)
        if compile_step is None:
            return None
        self.decode_step = "compiling"

        def run() -> None:
            started = time.perf_counter()
            try:
                compiled = compile_step(warm=True)
            except Exception:
                logger.exception("compiling the decode step failed: the steps stay eager")
                compiled = False
            if not compiled:
                self.decode_step = "eager"
                return
            self.decode_step = "compiled"
            if self.settings.freeze_heap:
                settle_heap()  # what the compile left behind
            logger.info(
                "decode step compiled in %.0f s: the steps run compiled from now on", time.perf_counter() - started
            )
            on_compiled()

        thread = threading.Thread(target=run, name="batchkit-compile-step", daemon=True)
        thread.start()
        self.compile_thread = thread
        return thread

    def served(self) -> list[str]:
        """What is served, in words (``"chat model smollm2"``), for the log."""
        return [
            f"{what} {name}"
            for what, name, model in (
                ("chat model", self.model_name, self.loop),
                ("embedding model", self.embedding_model_name, self.embed),
            )
            if model is not None
        ]

    async def aclose(self) -> None:
        """Close the loop and the batcher (what they still run is aborted)."""
        if self.loop is not None:
            await self.loop.aclose()
        if self.embed is not None:
            await self.embed.aclose()


def settle_heap() -> None:
    """Collect the garbage, then move every object left out of the garbage collector's reach
    (``gc.freeze``). Loading a model leaves about 350,000 objects, compiling its step 900,000:
    a full collection then stops every thread for 0.2-1 s, and one that falls inside a step
    delays every request in it. Frozen objects are never collected, so this runs once the heap
    holds what serving keeps (``ServeSettings.freeze_heap``: it acts on the whole process)."""
    gc.collect()
    gc.freeze()


def _prepare_step(model: Any, settings: ServeSettings) -> bool:
    """Compile the chat model's step (``compile_step=True``: True where it compiles), or else
    build the native decode attention its eager step runs on (``native_attention``, or
    ``compile_step="background"`` for its eager steps until then; on a CPU only). A failed build
    is logged by :mod:`batchkit.kv.native`; attention then stays on torch."""
    if settings.compile_step is True:
        return _compile_step(model)
    if str(settings.device).startswith("cpu") and (settings.native_attention or settings.compile_step):
        build_decode_attention()  # compile_step="background": the eager steps' attention meanwhile
    return False


def _compiled_form(model: Any) -> Callable[..., bool] | None:
    """``model.compile_step``, or None, logged, where the model has no compiled form."""
    compile_step: Callable[..., bool] | None = getattr(model, "compile_step", None)
    if compile_step is None:
        logger.warning("%s has no compiled step: its steps run eagerly", type(model).__name__)
    return compile_step


def _compile_step(model: Any) -> bool:
    """Compile the chat model's step where it has a compiled form (the native ``LlamaModel``);
    any other model runs eagerly, and the log says so, its decodes' attention on the native CPU
    kernel where it builds (``HFStepModel``'s attention is batchkit's planned attention)."""
    compile_step = _compiled_form(model)
    if compile_step is None:
        build_decode_attention()
        return False
    if not compile_step():
        return False
    logger.info("%s: its step compiles at the first generation (the warm-up, if on)", type(model).__name__)
    return True


def _source_name(source: Any) -> str | None:
    if source is None:
        return None
    name = getattr(source, "name", None)
    if isinstance(name, str):
        return name
    text: str = os.fspath(source)
    base = os.path.basename(text.rstrip("/")) or text
    return base[: -len(".gguf")] if base.endswith(".gguf") else base
