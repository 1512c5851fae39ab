"""Tokenizing requests off the event loop: prompts on a pool of tokenizer copies in worker
threads (:class:`PromptTokenizer`), and long embedding inputs cut to what the encoder keeps
(:class:`InputCutter`).

A long prompt takes seconds to tokenize; on the event loop every other client's stream (and
``/health``) would stand still meanwhile, and on the model's own tokenizer it would hold the
lock that the engine's stop-string decoding takes. A few-token decode (a streamed token's text)
stays on the event loop: it costs about 20 us there against about 140 us for the hop to a worker
thread (SmolLM2's tokenizer on a CPU).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread

if TYPE_CHECKING:
    from ..models.pretrained import PretrainedLM

__all__ = ["InputCutter", "PromptTokenizer", "encoding_copy", "prefix_stable_copy"]

T = TypeVar("T")

#: The most prompts tokenized at once (fast tokenizers release the GIL while they encode).
MAX_TOKENIZER_THREADS = 4


def encoding_copy(lm: PretrainedLM) -> PretrainedLM:
    """``lm`` with a tokenizer and a lock of its own, for tokenizing prompts in worker threads:
    a long prompt then never holds the lock that the event loop's and the engine's decoding take."""
    return dataclasses.replace(lm, tokenizer=copy.deepcopy(lm.tokenizer), lock=threading.Lock())


class PromptTokenizer:
    """Runs tokenizer work in worker threads, at most ``max_threads`` at once, each on a copy of
    the model's tokenizer that no other thread uses meanwhile (a fast tokenizer is not safe from
    two threads at once). One copy is made at construction; more as concurrency needs them, from
    a template copy (also made then) that nothing tokenizes with, so that making one never
    waits for the model's own lock.
    """

    def __init__(self, lm: PretrainedLM, max_threads: int | None = None) -> None:
        if max_threads is None:
            max_threads = max(2, min(MAX_TOKENIZER_THREADS, os.cpu_count() or 1))
        self.lm = lm
        self.max_threads = max_threads
        self.limiter = anyio.CapacityLimiter(max_threads)
        self.template = encoding_copy(lm)
        self.free = [encoding_copy(lm)]  # copies no thread is using (one ready for the first prompt)
        self.num_copies = 1
        self.lock = threading.Lock()  # guards free and num_copies
        self.template_lock = threading.Lock()  # one copy of the template at a time

    async def run(self, work: Callable[[PretrainedLM], T]) -> T:
        """``work(copy)`` in a worker thread, on a tokenizer copy of its own."""
        return await anyio.to_thread.run_sync(self._on_a_copy, work, limiter=self.limiter)

    def _on_a_copy(self, work: Callable[[PretrainedLM], T]) -> T:
        with self.lock:
            own = self.free.pop() if self.free else None
        if own is None:  # the limiter lets at most max_threads threads get here: as many copies
            with self.template_lock:
                own = encoding_copy(self.template)
            with self.lock:
                self.num_copies += 1
        try:
            return work(own)
        finally:
            with self.lock:
                self.free.append(own)


_WORD_BREAK = re.compile("[ \t\n\r]")


class InputCutter:
    """Cuts an embedding input that the encoder truncates to a prefix holding every token it keeps,
    so that a long input is not tokenized whole in the encoder's batch (whose other inputs wait).

    A prefix that ends just before a space, tab or newline tokenizes to exactly the first tokens
    of the whole text when the tokenizer maps characters one by one (no normalizer, or BERT's)
    and splits words at whitespace before its model sees them (BERT's pre-tokenizer,
    ``Whitespace``, ``WhitespaceSplit``), and no added token holds whitespace: each word before
    the cut is tokenized alone, as in the whole text. A prefix of at least ``max_seq_length``
    tokens then gives the encoder the tokens the whole text would. Another tokenizer (or a text
    with no such break) gets the whole text, tokenized by the encoder.
    """

    def __init__(self, tokenizer: Any, max_seq_length: int) -> None:
        self.max_seq_length = max_seq_length
        self.min_chars = 8 * max_seq_length  # below it a text is cheap to tokenize whole: left alone
        self.tokenizer = tokenizer
        self.backend = prefix_stable_copy(tokenizer)
        self.lock = threading.Lock()

    def would_cut(self, text: str) -> bool:
        # A tokenizer that truncates on the left keeps the text's last tokens: no prefix holds them
        # (read at each cut: the attribute may be changed after the server started).
        right = getattr(self.tokenizer, "truncation_side", "right") == "right"
        return right and self.backend is not None and len(text) > self.min_chars

    def cut(self, text: str) -> str:
        """``text``, or a prefix of it that the encoder turns into the same tokens."""
        if not self.would_cut(text):
            return text
        end = self.min_chars
        while end < len(text):
            brk = _WORD_BREAK.search(text, end)
            if brk is None:
                break
            prefix = text[: brk.start()]
            with self.lock:
                num_tokens = len(self.backend.encode(prefix, add_special_tokens=False))
            if num_tokens >= self.max_seq_length:
                return prefix
            end = 4 * brk.start()  # geometric: all the tries together tokenize at most 4/3 of the text
        return text

    def cut_all(self, texts: list[str]) -> list[str]:
        return [self.cut(t) for t in texts]


def prefix_stable_copy(tokenizer: Any) -> Any:
    """A copy of ``tokenizer``'s fast backend without truncation or padding, when its prefixes
    cut at whitespace tokenize as the whole text begins (see :class:`InputCutter`); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    from tokenizers import normalizers, pre_tokenizers

    if backend.normalizer is not None and not isinstance(backend.normalizer, normalizers.BertNormalizer):
        return None
    splitters = (pre_tokenizers.BertPreTokenizer, pre_tokenizers.Whitespace, pre_tokenizers.WhitespaceSplit)
    if not isinstance(backend.pre_tokenizer, splitters):
        return None
    if any(_WORD_BREAK.search(t.content) for t in backend.get_added_tokens_decoder().values()):
        return None
    own = copy.deepcopy(backend)
    own.no_truncation()
    own.no_padding()
    return own
