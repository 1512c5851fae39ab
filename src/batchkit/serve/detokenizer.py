"""A request's output as text: :class:`IncrementalDetokenizer` turns its tokens into the text
deltas a response sends, and ends the text at a stop string (the rule of
:mod:`batchkit.continuous.stops`). No I/O here.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

from ..continuous.stops import DecodedText, StopStrings

__all__ = ["IncrementalDetokenizer"]


class IncrementalDetokenizer:
    """Turns a request's tokens into text deltas: incremental detokenisation and stop strings.

    ``push(token)`` returns the text that became final with that token; ``finish()`` what is left
    when the request ends; ``stopped`` tells that a stop string was found (push nothing more).

    Text is emitted only when it is final: not while the decoded text ends in an incomplete
    UTF-8 sequence (U+FFFD), and not while its end could be the start of a stop string. A stop
    string ends the text before it (it is not part of the output), as OpenAI does; with
    ``include_stop`` after it (vLLM's ``include_stop_str_in_output``). With ``min_tokens``, a stop
    string counts once it ends in the text of the ``min_tokens``-th token or a later one, as the
    loop counts it (:class:`~batchkit.SamplingParams`). Each push
    decodes a short window of the latest tokens, not the whole output, and finds stop strings by
    the loop's own rule (:mod:`batchkit.continuous.stops`).

    :attr:`num_tokens_kept` counts the leading tokens known to belong to the output: those whose
    logprobs may be sent.
    """

    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop: Sequence[str],
        ids: Sequence[int] | None = None,
        *,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.decode = decode
        self.stop = tuple(stop)
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self._stops = StopStrings(self.stop, min_tokens) if self.stop else None
        # The tokens so far: this object's own list, or ``ids``, a caller's sequence that grows
        # by one token before each advance() (read, never copied).
        self.ids: Sequence[int] = [] if ids is None else ids
        self._decoded = DecodedText(decode)
        self.text = ""  # what may be sent: the final text, or the text before a stop string
        self.sent = 0
        self.stopped = False
        self._num_kept = 0  # with stop strings: the tokens the text sent needs (all, once finished)
        # With stop strings, where each final text ends: after final_tokens[i] tokens, final_chars[i]
        # characters (both strictly increasing), to find the tokens a prefix of the text needs.
        self._final_tokens = [0]
        self._final_chars = [0]

    def push(self, token: int, *, text: bool = True) -> str:
        """Add ``token`` (to this object's own list) and :meth:`advance`; with ``text=False``,
        a stop token whose text is left out: :meth:`end_before_last`."""
        if not isinstance(self.ids, list):
            raise TypeError("push() adds to the detokenizer's own list; with ids= given, call advance()")
        self.ids.append(token)
        return self.advance() if text else self.end_before_last()

    def advance(self) -> str:
        """The text that became final with the latest token of :attr:`ids`."""
        pending = self._decoded.pending(self.ids)
        if self._stops is not None:
            # Looked for before the incomplete-character check, as the loop does: a token that
            # completes a stop string while it begins a multi-byte character (byte-level BPE:
            # "f" + the first byte of "é") ends the request here.
            text = self._decoded.text + pending
            hit = self._stops.find(text, len(self.ids), searched=self.sent)
            if hit >= 0:
                if self.include_stop:  # the first stop string (in the order given) found there
                    hit += len(next(s for s in self.stop if text.startswith(s, hit)))
                self.stopped = True
                self.text = text[:hit]
                return self._take(hit)
        if not pending or pending.endswith("\ufffd"):
            return ""  # nothing final yet: the next token decodes this window again
        self._decoded.commit(pending, len(self.ids))
        self.text = self._decoded.text
        if self.stop:
            self._final_tokens.append(len(self.ids))
            self._final_chars.append(len(self.text))
            return self._take(len(self.text) - self._held_back(self.text))
        return self._take(len(self.text))

    @property
    def num_tokens_kept(self) -> int:
        """How many leading tokens of :attr:`ids` belong to the output for sure. With stop strings,
        the fewest tokens whose text begins with the text sent so far: a token whose text the stop
        string cuts is kept, those wholly past the cut are not; once finished without a stop
        string, every token. Without stop strings nothing is cut: every token."""
        return self._num_kept if self.stop else len(self.ids)

    def _num_tokens_for(self, end: int) -> int:
        """The fewest leading tokens whose text begins with ``text[:end]``."""
        chars, tokens = self._final_chars, self._final_tokens
        i = bisect.bisect_left(chars, end)
        if i < len(chars) and chars[i] == end:
            return tokens[i]
        # ``end`` falls in the text of the tokens after tokens[i - 1], made final together (a
        # character split over tokens, a token that decodes to nothing) or not final yet: read
        # them one at a time, each decoded in the window DecodedText decoded them in.
        first = tokens[i - 1]
        last = tokens[i] if i < len(tokens) else len(self.ids)
        context = tokens[i - 2] if i >= 2 else 0
        before = len(self.decode(self.ids[context:first])) if first > context else 0
        wanted = self.text[chars[i - 1] : end]
        for n in range(first + 1, last):
            if self.decode(self.ids[context:n])[before:].startswith(wanted):
                return n
        return last

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        for n in range(min(len(text), max(len(s) for s in self.stop) - 1), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def end_before_last(self) -> str:
        """End the output before the latest token of :attr:`ids`, a stop token whose text is no
        part of the output (vLLM leaves a stop token's text out unless
        ``include_stop_str_in_output``); return the text left to send. Its logprob entry stays:
        every token counts as kept."""
        head = self.ids[: len(self.ids) - 1]
        self._decoded.commit(self._decoded.pending(head), len(head))
        self.text = self._decoded.text
        self.stopped = True
        out = self._take(len(self.text))
        self._num_kept = len(self.ids)
        return out

    def finish(self) -> str:
        """What is left to send once the request has ended (including a trailing U+FFFD the model
        really produced; before the end it may still complete a character)."""
        if self.stopped:
            return self._take(len(self.text))
        self._decoded.commit(self._decoded.pending(self.ids), len(self.ids))
        self.text = self._decoded.text
        out = self._take(len(self.text))
        self._num_kept = len(self.ids)  # no stop string cut the output: every token is part of it
        return out

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        if self.stop:
            self._num_kept = self._num_tokens_for(end)
        return out
