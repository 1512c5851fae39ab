"""Stop strings, once: where a stop string ends a request's output.

The scheduler (which ends the request) and ``batchkit serve`` (which cuts the text it sends)
both read the output's text through :class:`DecodedText` and ask :meth:`StopStrings.find` where a
stop string ends it, so they always agree. The rule:

- the text searched is the output's final text and what its latest tokens add, which may end in
  an incomplete character (U+FFFD): a stop string found before that character completes counts;
- a stop string counts only once ``min_tokens`` tokens are generated, and only if it ends past
  the text of the first ``min_tokens - 1`` tokens (the floor, fixed when that many exist);
- the search starts the longest stop string's length before the text already searched, so that
  a stop string split over tokens is found.

Nothing here knows the tokenizer beyond its ``decode`` callable, the request or the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["DecodedText", "StopStrings"]


class DecodedText:
    """The text of a growing token sequence (a request's output), decoded a short window at a time.

    Decoding the whole output at every token costs O(n) per token, O(n^2) per request. Here each
    :meth:`pending` decodes only the tokens from where the last final text began: the window
    starts on a token boundary whose text was complete, so a leading space or a multi-byte
    character reads as in the whole text, and what the window adds beyond that token's text is
    new.
    """

    __slots__ = ("_prefix", "_read", "decode", "text")

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.text = ""  # the final text of ids[:_read]
        self._prefix = 0  # the first token of the last text made final
        self._read = 0

    def pending(self, ids: Sequence[int]) -> str:
        """The text the tokens of ``ids`` after the final ones add to :attr:`text` (it may end in
        an incomplete character, U+FFFD, that a later token completes)."""
        p, r = self._prefix, self._read
        before = self.decode(ids[p:r]) if r > p else ""
        text = self.decode(ids[p:])
        return text[len(before) :] if len(text) > len(before) else ""

    def commit(self, pending: str, length: int) -> None:
        """Make ``pending``, what ``ids[:length]`` add to :attr:`text`, final."""
        self.text += pending
        self._prefix, self._read = self._read, length


class StopStrings:
    """One request's stop strings and ``min_tokens``: where in its output's text, read a token at
    a time, the first stop string that counts begins (the module's rule).

    Raises:
        ValueError: ``stop`` is empty or holds an empty string.
    """

    __slots__ = ("floor", "longest", "min_tokens", "stop")

    def __init__(self, stop: Sequence[str], min_tokens: int = 0) -> None:
        self.stop = tuple(stop)
        if not self.stop or not all(self.stop):
            raise ValueError(f"stop must hold non-empty strings, got {stop!r}")
        self.min_tokens = min_tokens
        self.longest = max(len(s) for s in self.stop)
        # With min_tokens: a stop string counts once it ends past this many characters, the text
        # of the first min_tokens - 1 tokens.
        self.floor = 0

    def find(self, text: str, num_tokens: int, searched: int) -> int:
        """Where the first stop string that counts begins in ``text``, the text of the first
        ``num_tokens`` tokens of the output, or -1. Call it once per token, in order (the floor is
        read on the way); ``searched``: the length of the text searched before (stop strings that
        end inside it were looked for then)."""
        if num_tokens == self.min_tokens - 1:
            self.floor = len(text)
        if num_tokens < self.min_tokens:
            return -1
        start = max(0, searched - self.longest)
        hits = [i for i in (text.find(s, max(start, self.floor - len(s) + 1)) for s in self.stop) if i >= 0]
        return min(hits) if hits else -1
