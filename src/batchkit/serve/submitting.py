"""Admitting and submitting generations: :class:`Submitter` checks a request against the
waiting room and the KV pool, tokenizes its prompts off the event loop, and submits its samples to
the decode loop as :class:`~batchkit.serve.generation.Generation` streams; it also answers the
tokenizer routes. No HTTP here: the handlers of :mod:`batchkit.serve.app` call it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .._errors import QueueFull
from ..continuous.logprobs import TokenLogprobs
from .admission import PromptRoom, Refused
from .errors import ApiError
from .generation import Generation
from .loading import ServedModels
from .metrics import ServerMetrics
from .protocol import GenerationRequest, TokenizeRequest, new_id
from .refusals import Refusals
from .responses import TokenString, TokenText, token_string
from .settings import ServeSettings
from .structured import compile_in_thread, grammar_for

if TYPE_CHECKING:
    from ..models.pretrained import PretrainedLM

__all__ = ["Submitter"]


class Submitter:
    """Admits and submits the generations of the chat model of ``models`` (once loaded), and
    answers its tokenizer routes."""

    def __init__(
        self, settings: ServeSettings, models: ServedModels, refusals: Refusals, metrics: ServerMetrics
    ) -> None:
        self.settings = settings
        self.models = models
        self.refusals = refusals
        self.metrics = metrics
        self._token_strings: dict[int, TokenString] = {}

    def check_samples(self, req: GenerationRequest) -> None:
        """Refuse, before anything is tokenized or submitted, a request with more samples (its
        prompts times ``n``) than may ever wait for admission at once.

        Raises:
            ApiError: 400 ``invalid_value`` naming ``n`` (or ``prompt``) and ``--max-waiting``.
        """
        self.models.waiting_room.check_fits(len(req.prompts) if req.messages is None else 1, req.n)

    async def prompt_ids(self, req: GenerationRequest) -> list[list[int]]:
        """Every prompt's token ids, tokenized off the event loop. A prompt given as token ids
        is the list the request holds (checked against the vocabulary, not copied).

        Raises:
            ApiError: 400 for a model without a chat template, a token id (in a prompt or in
                ``logit_bias``) past the vocabulary, or a ``response_format`` it cannot compile.
        """
        prompts, served = self.models.prompts, self.models.lm
        assert prompts is not None
        assert served is not None
        req.check_vocabulary(served.model.config.vocab_size)
        await compile_in_thread(req.response_format, served)  # then grammar_for (in submit) is a cache hit
        if req.messages is None and all(not isinstance(p, str) for p in req.prompts):
            return [p for p in req.prompts if not isinstance(p, str)]  # nothing to tokenize: no thread needed

        def run(lm: PretrainedLM) -> list[list[int]]:
            if req.messages is not None:
                try:
                    return [lm.chat_prompt(req.messages)]
                except ValueError as exc:
                    raise ApiError(400, str(exc), param="messages", code="invalid_value") from None
            return [lm.encode(p) if isinstance(p, str) else p for p in req.prompts]

        return await prompts.run(run)

    def output_limits(self, req: GenerationRequest, prompts: Sequence[Sequence[int]], tenant: str | None) -> list[int]:
        """Each prompt's output limit (see :class:`~batchkit.serve.admission.PromptRoom`).

        Raises:
            ApiError: 400 ``context_length_exceeded`` for a prompt that could never run.
        """
        lm, loop = self.models.lm, self.models.loop
        assert lm is not None
        assert loop is not None
        room = PromptRoom.of(lm.max_model_len, loop.allocator, tenant)
        try:
            return [
                room.output_limit(
                    len(p), req.max_tokens, self.settings.default_max_tokens, req.prompt_param(i), req.max_tokens_param
                )
                for i, p in enumerate(prompts)
            ]
        except Refused as refused:
            self.refusals.reject(refused.reason)
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
        lm, loop = self.models.lm, self.models.loop
        assert lm is not None
        assert loop is not None
        sampling = req.sampling_options(lm.stop_token_ids, grammar_for(req.response_format, lm))
        stop_ids = sampling["stop_token_ids"]
        detailed = req.logprobs is not None
        generate = loop.generate_logprobs if detailed else loop.generate
        rid = new_id("chatcmpl" if route == "chat" else "cmpl")
        n = req.n
        try:
            places = self.models.waiting_room.take(len(prompts), n, loop.queue_depth(), loop.free_seats())
        except QueueFull as exc:
            raise self.refusals.generation_error(exc) from None
        gens: list[Generation] = []
        try:
            for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
                # max_tokens=0 (echo alone) still runs the prompt: its last position's logits
                # sample one token, which the answer leaves out.
                options: dict[str, Any] = {
                    "priority": priority,
                    "tenant": tenant,
                    "deadline_s": self.settings.request_timeout_s,
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
        assert self.models.prompts is not None

        def run(lm: PretrainedLM) -> list[str]:
            return [
                p if isinstance(p, str) else lm.decode(ids, skip_special_tokens=False)
                for p, ids in zip(req.prompts, prompts, strict=True)
            ]

        return await self.models.prompts.run(run)

    def token_text(self, item: TokenLogprobs) -> TokenText:
        """A token's logprob entry as text: its own text, logprob and alternatives."""
        text = self.token_string
        return text(item.token), item.logprob, [(text(t), v) for t, v in item.top_logprobs]

    def token_string(self, token: int) -> TokenString:
        """One token's text alone, with its bytes (cached: a response may name the same tokens
        many times). Decoded on the event loop: one token costs less there than the hop to a thread."""
        lm = self.models.lm
        assert lm is not None
        return token_string(lm, self._token_strings, token)

    async def tokenize(self, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
        """``/tokenize``: the tokens of a prompt or chat and, if asked for, each one's string as the
        vocabulary spells it (``convert_ids_to_tokens``, as vLLM's): special tokens by name, not
        decoded text (a byte-level BPE spells a leading space ``Ġ``)."""
        assert self.models.prompts is not None

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

        return await self.models.prompts.run(run)

    async def detokenize(self, tokens: list[int]) -> str:
        assert self.models.prompts is not None
        # As vLLM's: special tokens kept, so that /tokenize then /detokenize gives the text back.
        return await self.models.prompts.run(lambda lm: lm.decode(tokens, skip_special_tokens=False))
