"""One accepted generation (one prompt) of a request: the loop's token stream read into one list
of output tokens, from which its text, its logprobs, its usage and its finish reason are read.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, overload

import anyio

from ..continuous.logprobs import TokenLogprobs
from .detokenizer import IncrementalDetokenizer
from .metrics import ServerMetrics
from .responses import TokenText, completion_logprobs, usage

if TYPE_CHECKING:
    from .admission import Reservation

__all__ = ["Generation", "TokenIds"]


class TokenIds(Sequence[int]):
    """The token ids of a list of :class:`TokenLogprobs`, read through (not copied)."""

    __slots__ = ("items",)

    def __init__(self, items: list[TokenLogprobs]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            return [item.token for item in self.items[i]]
        return self.items[i].token


class Generation:
    """A generation's stream, read one token at a time into :attr:`output`.

    :attr:`output` holds each generated token once: the bare ids, or (``detailed``) the
    :class:`TokenLogprobs` the loop streams; the text is decoded from it, and the logprob entries
    not yet sent are those from :attr:`logprobs_sent` to the detokenizer's ``num_tokens_kept``
    (with a stop string, the tokens of the text before it). With an echoed prompt's logprobs, the
    prompt's entries come first in the stream and go to :attr:`prompt_logprobs`. A ``max_tokens``
    of 0 (an echoed prompt alone) reads the first token's event only for the prompt's logprobs:
    the token itself is not part of the answer.

    ``places``: the waiting-queue places its prompt's samples hold until the loop queues them,
    which it does on the first read of any of them; given back then, or when closed unread.
    """

    def __init__(
        self,
        tokens: AsyncIterator[Any],
        *,
        route: str,
        rid: str,
        index: int,
        prompt_index: int | None = None,
        prompt_tokens: int,
        max_tokens: int,
        stop: Sequence[str],
        stop_token_ids: Sequence[int],
        include_stop: bool = False,
        min_tokens: int = 0,
        t_arrival: float,
        decode: Callable[[Sequence[int]], str],
        token_text: Callable[[TokenLogprobs], TokenText],
        metrics: ServerMetrics,
        detailed: bool = False,
        places: Reservation | None = None,
    ) -> None:
        self.tokens = tokens
        self.places = places
        self.route = route
        self.rid = rid
        self.index = index  # the choice's
        self.prompt_index = index if prompt_index is None else prompt_index  # its prompt's, in the request
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.include_stop = include_stop  # the stop string's or stop token's text ends the output
        self.t_arrival = t_arrival
        self.token_text = token_text
        self.metrics = metrics
        self.detailed = detailed
        self.output: list[Any] = []  # int, or TokenLogprobs when detailed
        ids: Sequence[int] = TokenIds(self.output) if detailed else self.output
        self.tail = IncrementalDetokenizer(decode, stop, ids, include_stop=include_stop, min_tokens=min_tokens)
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.logprobs_sent = 0  # how many of output's logprob entries are sent
        self.text_offset = 0  # characters of the token strings of the logprob entries sent
        self.t_last: float | None = None
        self.status = 200  # of a stream: the status of the error event that ended it, if any
        self.created = int(time.time())
        self.ended = False

    @property
    def completion_tokens(self) -> int:
        return len(self.output)

    async def next_text(self) -> str | None:
        """The next piece of text (possibly empty), or None once the request has ended."""
        if self.tail.stopped or self.ended:
            return None
        if self.places is not None:
            # The loop queues the samples within this first __anext__, before anything else
            # runs on the event loop: from then on it counts them itself.
            self.places.release()
            self.places = None
        try:
            item = await self.tokens.__anext__()
            while self.detailed and item.prompt:
                self.prompt_logprobs.append(item)
                item = await self.tokens.__anext__()
        except StopAsyncIteration:
            return None
        if self.max_tokens == 0:
            self.ended = True
            await self.close()
            return None
        now = time.perf_counter()
        m = self.metrics
        if self.t_last is None:
            m.ttft.labels(self.route).observe(now - self.t_arrival)
        else:
            m.itl.labels(self.route).observe(now - self.t_last)
        self.t_last = now
        self.output.append(item)
        m.generation_tokens.labels(self.route).inc()
        if self.tail.ids[-1] in self.stop_token_ids and not self.include_stop:
            text = self.tail.end_before_last()  # the request ends on it: its text is left out
        else:
            text = self.tail.advance()
        if self.tail.stopped:
            await self.close()  # the loop stops it at the same token; this frees it at once regardless
        return text

    @property
    def has_unsent_logprobs(self) -> bool:
        return self.detailed and self.logprobs_sent < self.tail.num_tokens_kept

    def take_logprobs(self) -> list[TokenText]:
        """The logprob entries not sent yet of the tokens known to be in the output: with a stop
        string, those whose text has been sent (a token the stop string cuts included, the tokens
        past it never)."""
        kept = self.tail.num_tokens_kept
        items = self.output[self.logprobs_sent : kept]
        self.logprobs_sent = kept
        return [self.token_text(item) for item in items]

    def completion_logprobs(self, entries: Sequence[TokenText | str]) -> dict[str, Any]:
        """OpenAI's completions ``logprobs`` of the next ``entries`` of this choice: their
        ``text_offset`` runs on from the entries sent before (in an earlier chunk of a stream,
        the echoed prompt's included)."""
        logprobs = completion_logprobs(entries, self.text_offset)
        self.text_offset += sum(len(token) for token in logprobs["tokens"])
        return logprobs

    def prompt_entries(self) -> list[TokenText]:
        """The echoed prompt's logprob entries, after its first token (which has none)."""
        return [self.token_text(item) for item in self.prompt_logprobs]

    @property
    def finish_reason(self) -> str:
        last = self.tail.ids[-1] if self.output else None
        if self.tail.stopped or last in self.stop_token_ids:
            return "stop"
        return "length" if self.completion_tokens >= self.max_tokens else "stop"

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.completion_tokens)

    async def close(self) -> None:
        if self.places is not None:  # never read: never queued
            self.places.release()
            self.places = None
        with anyio.CancelScope(shield=True):
            aclose = getattr(self.tokens, "aclose", None)
            if aclose is not None:
                await aclose()
