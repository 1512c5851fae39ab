"""The bridge from the HTTP handlers to the engine: :class:`EngineBridge` puts together what serves
the requests once they are parsed, each part in its own module: the models
(:class:`~batchkit.serve.loading.ServedModels`), the server's life
(:class:`~batchkit.serve.lifecycle.Lifecycle`, :class:`~batchkit.serve.lifecycle.InFlight`),
refusals (:class:`~batchkit.serve.refusals.Refusals`), generations
(:class:`~batchkit.serve.submitting.Submitter`) and embeddings
(:class:`~batchkit.serve.embedding.Embedder`); it runs the start-up and the shutdown. No routes or
responses here (those are :mod:`batchkit.serve.app`'s).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import anyio.to_thread
from prometheus_client import CollectorRegistry

from .embedding import Embedder
from .errors import ApiError
from .lifecycle import InFlight, Lifecycle, ServerState, Transition
from .loading import ServedModels, settle_heap
from .metrics import BatchkitCollector, ServerMetrics
from .refusals import Refusals
from .settings import ServeSettings
from .submitting import Submitter

__all__ = ["EngineBridge"]

logger = logging.getLogger("batchkit.serve.app")  # the name the server has always logged under


class EngineBridge:
    """What serves the requests once they are parsed, made with ``settings`` (see
    :class:`~batchkit.serve.ModelServer` for each); :mod:`batchkit.serve.app` is the HTTP side."""

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        self.created = int(time.time())  # the models' "created" time: when this server was made
        self.registry = CollectorRegistry()
        # vLLM's names too: routers and autoscalers configured for vLLM then read this server as it is.
        self.collector = BatchkitCollector(vllm_names=True).register(self.registry)
        self.metrics = ServerMetrics(self.registry)
        self.lifecycle = Lifecycle(self.metrics.ready)
        self.in_flight = InFlight(self.metrics.in_flight)
        self.models = ServedModels(settings, self.collector)
        self.refusals = Refusals(settings.retry_after_s, self.metrics)
        self.submitter = Submitter(settings, self.models, self.refusals, self.metrics)
        self.embedder = Embedder(self.models, self.refusals)
        self._token: Any = None  # the event loop serving the app (set in the lifespan)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Load and warm the models; then report ready. Errors are logged and kept in
        ``lifecycle.load_error``."""
        try:
            await anyio.to_thread.run_sync(self.models.load)
            if self.lifecycle.state is ServerState.STOPPING:  # shut down while loading: the lifespan closes it
                return
            if self.settings.warmup:
                await self.models.warm_up()
            if self.settings.freeze_heap:
                settle_heap()
        except Exception as exc:
            self.lifecycle.fail(exc)
            on_load_error = self.settings.on_load_error
            if on_load_error is not None:
                # The callback reports it (``batchkit serve`` prints one line and exits); the
                # traceback is for debugging only.
                logger.debug("batchkit.serve: loading the models failed", exc_info=exc)
                on_load_error(exc)
            else:  # the app stays up with /ready at 503: the log is where the cause is told
                logger.error("batchkit.serve: loading the models failed", exc_info=exc)
            return
        if self.lifecycle.move(Transition.LOADED) is ServerState.READY:
            logger.info("batchkit.serve: ready (%s)", ", ".join(self.models.served()))
            self.metrics.step_compiled.set(self.models.decode_step == "compiled")
            self.models.compile_in_background(lambda: self.metrics.step_compiled.set(1))

    async def shutdown(self) -> None:
        """Stop admitting; give requests in flight ``shutdown_grace_s`` to finish; abort the rest; close."""
        self.lifecycle.move(Transition.STOP)
        await self.in_flight.drain(self.settings.shutdown_grace_s)
        await self.models.aclose()

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
            anyio.from_thread.run_sync(self.in_flight.end_grace, token=token)

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

    # ------------------------------------------------------------------ refusals

    def check_available(self, what: str) -> None:
        """503 while loading or shutting down, or after a failed load; 404 without a ``what`` model."""
        state, refusals = self.lifecycle.state, self.refusals
        if state is ServerState.STOPPING:
            refusals.reject("shutting_down")
            raise refusals.retry_later("the server is shutting down", "shutting_down")
        if state is ServerState.FAILED:
            error = self.lifecycle.load_error
            raise ApiError(503, f"the models failed to load: {error}", type="server_error", code="load_failed")
        if state is ServerState.LOADING:
            refusals.reject("loading")
            raise refusals.retry_later("the models are still loading; retry shortly", "loading")
        if (what == "chat" and self.models.loop is None) or (what == "embeddings" and self.models.embed is None):
            raise ApiError(404, f"this server has no {what} model", code="model_not_found")
