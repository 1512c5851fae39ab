"""Embeddings: :class:`Embedder` cuts the inputs of a ``/v1/embeddings`` request to what the
encoder keeps and submits them to the embedding batcher all at once, or refuses the request whole.
No HTTP here.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread

from .._errors import QueueFull
from .loading import ServedModels
from .refusals import Refusals

__all__ = ["Embedder"]


class Embedder:
    """Submits embedding requests to the batcher of ``models`` (once loaded)."""

    def __init__(self, models: ServedModels, refusals: Refusals) -> None:
        self.models = models
        self.refusals = refusals
        self._input_limiter = anyio.CapacityLimiter(1)  # the cutter has one tokenizer (and a lock)

    async def cut_inputs(self, inputs: list[str]) -> list[str]:
        """``inputs``, the long ones cut to what the encoder keeps (see :class:`InputCutter`)."""
        cutter = self.models.input_cutter
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
        embed = self.models.embed
        assert embed is not None
        # A request whose inputs cannot all be queued now is refused whole, at once: submitted
        # one by one, the first ones would be queued (a task each on the event loop: thousands
        # of them stalled every other request) before the refusal, then cancelled.
        queue = embed.batcher.queue
        room = queue.maxsize - len(queue)
        if len(inputs) > room:
            full = QueueFull(f"{len(inputs)} inputs do not fit in the embedding queue, which has room for {room} now")
            raise self.refusals.error_for(full, "embedding")
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
            raise self.refusals.error_for(errors[0], "embedding")
        return results
