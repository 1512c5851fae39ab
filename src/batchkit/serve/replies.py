"""A generation request's answer, written from its :class:`~batchkit.serve.generation.Generation`
streams: :class:`GenerationReply` reads their texts (the first ones before the response starts)
and makes the JSON body of a request answered whole, or the Server-Sent Events of a streamed one.
The handlers of :mod:`batchkit.serve.app` send what it makes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio

from .generation import Generation
from .metrics import ServerMetrics
from .protocol import GenerationRequest
from .refusals import Refusals
from .responses import (
    TokenText,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_response,
    usage,
)
from .submitting import Submitter
from .transport import sse

__all__ = ["GenerationReply"]

T = TypeVar("T")


class GenerationReply:
    """The answer to ``req``, a request whose ``prompts`` (token ids) were submitted as ``gens``
    (choice ``i * n + j`` prompt ``i``'s sample ``j``), for the model named ``model``."""

    def __init__(
        self,
        gens: list[Generation],
        req: GenerationRequest,
        prompts: list[list[int]],
        model: str,
        *,
        submitter: Submitter,
        refusals: Refusals,
        metrics: ServerMetrics,
    ) -> None:
        self.gens = gens
        self.req = req
        self.prompts = prompts
        self.model = model
        self.submitter = submitter
        self.refusals = refusals
        self.metrics = metrics

    async def first_texts(self) -> list[list[str]]:
        """Each choice's first text ([] for a choice that ended without one)."""
        return await self._each(_first_text)

    async def texts(self, firsts: list[list[str]]) -> list[str]:
        """Each choice's whole text, after its ``firsts``."""
        return await self._each(lambda gen: _collect(gen, firsts[gen.index]))

    def body(self, texts: list[str], echoes: list[str]) -> dict[str, Any]:
        """The JSON body of a request answered whole."""
        gens, model = self.gens, self.model
        lead = gens[0]
        if lead.route == "chat":
            chat_choices = [
                chat_choice(
                    gen.index, text, gen.finish_reason, chat_logprobs(gen.take_logprobs()) if gen.detailed else None
                )
                for gen, text in zip(gens, texts, strict=True)
            ]
            return chat_response(lead.rid, model, chat_choices, _usage_of(gens))
        choices = [
            completion_choice(
                gen.index,
                echoes[gen.prompt_index] + text,
                gen.finish_reason,
                gen.completion_logprobs([*self._echoed_logprobs(gen), *gen.take_logprobs()]) if gen.detailed else None,
            )
            for gen, text in zip(gens, texts, strict=True)
        ]
        return completion_response(lead.rid, model, choices, _usage_of(gens))

    async def _each(self, work: Callable[[Generation], Awaitable[T]]) -> list[T]:
        """``work`` on every generation of a request at once. The first failure is the answer,
        made an OpenAI error (and counted) once for the request: the samples of a prompt refused
        together each raise the refusal."""
        gens = self.gens
        if len(gens) == 1:
            try:
                return [await work(gens[0])]
            except Exception as exc:  # noqa: BLE001 - every failure gets an OpenAI error body
                raise self.refusals.generation_error(exc) from None
        results: list[Any] = [None] * len(gens)
        errors: list[Exception] = []
        async with anyio.create_task_group() as tg:

            async def one(gen: Generation) -> None:
                try:
                    results[gen.index] = await work(gen)
                except Exception as exc:  # noqa: BLE001 - answered below, once, for the whole request
                    errors.append(exc)
                    tg.cancel_scope.cancel()

            for gen in gens:
                tg.start_soon(one, gen)
        if errors:
            raise self.refusals.generation_error(errors[0]) from None
        return results

    def _echoed_logprobs(self, gen: Generation) -> list[TokenText | str]:
        """With echo, the prompt's logprob entries: its first token (which no context predicts,
        so without a logprob), then the others'."""
        if not self.req.echo:
            return []
        return [self.submitter.token_string(self.prompts[gen.prompt_index][0]), *gen.prompt_entries()]

    def _piece(self, gen: Generation, text: str, echoed: bool = False) -> bytes:
        """The event that carries ``text`` of choice ``gen`` (with its logprobs, if asked for)."""
        lead = self.gens[0]
        if lead.route == "chat":
            lps = chat_logprobs(gen.take_logprobs()) if gen.detailed else None
            return sse(chat_chunk(lead.rid, lead.created, self.model, {"content": text}, None, None, lps, gen.index))
        lps = None
        if gen.detailed:
            entries = self._echoed_logprobs(gen) if echoed else gen.take_logprobs()
            lps = gen.completion_logprobs(entries)
        return sse(completion_chunk(lead.rid, lead.created, self.model, completion_choice(gen.index, text, None, lps)))

    def _final(self, gen: Generation) -> bytes:
        """The event that ends choice ``gen``: its finish reason, and without ``include_usage``,
        on the last choice, the request's usage."""
        gens, req, lead = self.gens, self.req, self.gens[0]
        final_usage = None if req.include_usage or gen is not gens[-1] else _usage_of(gens)
        if lead.route == "chat":
            chunk = chat_chunk(lead.rid, lead.created, self.model, {}, gen.finish_reason, final_usage, index=gen.index)
            return sse(chunk)
        choice = completion_choice(gen.index, "", gen.finish_reason)
        return sse(completion_chunk(lead.rid, lead.created, self.model, choice, final_usage))

    async def events(self, firsts: list[list[str]], echoes: list[str]) -> AsyncIterator[bytes]:
        """The events of a streamed request: its choices one after the other (all of them were
        submitted together: a later one's tokens wait in its stream meanwhile)."""
        gens, req, model = self.gens, self.req, self.model
        lead = gens[0]
        chat = lead.route == "chat"
        try:
            for gen in gens:
                if chat:
                    role = {"role": "assistant", "content": ""}
                    yield sse(chat_chunk(lead.rid, lead.created, model, role, index=gen.index))
                if req.echo:
                    yield self._piece(gen, echoes[gen.prompt_index], echoed=True)
                for text in firsts[gen.index]:
                    if text or gen.has_unsent_logprobs:
                        yield self._piece(gen, text)
                try:
                    while (more := await gen.next_text()) is not None:
                        if more or gen.has_unsent_logprobs:
                            yield self._piece(gen, more)
                except Exception as exc:  # noqa: BLE001 - the headers are sent: the error goes in the stream
                    err = self.refusals.generation_error(exc)
                    lead.status = err.status
                    yield sse(err.body())
                    yield sse("[DONE]")
                    return
                rest = gen.tail.finish()
                if rest or gen.has_unsent_logprobs:
                    yield self._piece(gen, rest)
                yield self._final(gen)
            if req.include_usage:
                if chat:
                    yield sse(chat_chunk(lead.rid, lead.created, model, None, None, _usage_of(gens)))
                else:
                    yield sse(completion_chunk(lead.rid, lead.created, model, None, _usage_of(gens)))
            yield sse("[DONE]")
            self.metrics.e2e.labels(lead.route).observe(time.perf_counter() - lead.t_arrival)
        finally:
            for gen in gens:
                await gen.close()


async def _first_text(gen: Generation) -> list[str]:
    text = await gen.next_text()
    return [] if text is None else [text]


async def _collect(gen: Generation, first: list[str]) -> str:
    parts = list(first)
    while (text := await gen.next_text()) is not None:
        parts.append(text)
    parts.append(gen.tail.finish())
    return "".join(parts)


def _usage_of(gens: list[Generation]) -> dict[str, int]:
    """A request's usage: each prompt's tokens once (however many samples it has), every output's."""
    prompt_tokens = {g.prompt_index: g.prompt_tokens for g in gens}
    return usage(sum(prompt_tokens.values()), sum(g.completion_tokens for g in gens))
