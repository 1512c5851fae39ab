"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["MAX_LOGPROBS", "SamplingParams", "sample"]

Tensor = Any

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs and vLLM's default max_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Args:
        max_new_tokens: generate at most this many tokens (>= 1).
        temperature: 0 is greedy (argmax); otherwise logits are divided by it.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of tokens whose probability reaches top_p (1.0: all).
        seed: seeds this request's generator, so that sampling is reproducible.
        stop_token_ids: stop after generating any of these (the token is kept in the output).
        eos_token_id: stop at end-of-sequence unless ``ignore_eos``.
        stop: stop strings, matched on the text of the output (needs the loop's ``detokenize``).
        logprobs: report each generated token's logprob and its ``logprobs`` most likely
            alternatives (0 to 20; 0: the token's own only; None: nothing), from the raw logits
            before temperature and top-k/top-p (see :mod:`batchkit.continuous.logprobs`).
        prompt_logprobs: the same for every prompt token after the first (0 to 20); such a
            request computes its whole prompt (no prefix-cache hit: cached tokens have no logits).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    eos_token_id: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Everything is checked here, at submit: a value the sampler or the stop check could only
        # trip over inside a step would fail every request batched into that step.
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
        top_k = _index(self.top_k)
        if top_k is None or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 keeps all tokens), got {self.top_k!r}")
        object.__setattr__(self, "top_k", top_k)
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            seed = _index(self.seed)
            if seed is None:
                raise TypeError(f"seed must be an int or None, got {self.seed!r}")
            if not _SEED_MIN <= seed <= _SEED_MAX:  # what torch.Generator.manual_seed takes
                raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {seed}")
            object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "stop_token_ids", token_ids("stop_token_ids", self.stop_token_ids))
        if self.eos_token_id is not None:
            object.__setattr__(self, "eos_token_id", token_ids("eos_token_id", (self.eos_token_id,))[0])
        if not isinstance(self.ignore_eos, bool):
            if not isinstance(self.ignore_eos, np.bool_):  # numpy's bool is taken as a bool
                raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
            object.__setattr__(self, "ignore_eos", bool(self.ignore_eos))
        if isinstance(self.stop, str):
            stop: tuple[Any, ...] = (self.stop,)
        else:
            try:
                stop = tuple(self.stop)
            except TypeError:
                raise ValueError(
                    f"stop must be a string or a sequence of non-empty strings, got {self.stop!r}"
                ) from None
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be non-empty strings, got {s!r} (stop on token ids with stop_token_ids=)")
        object.__setattr__(self, "stop", stop)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                count = _index(value)
                if count is None or not 0 <= count <= MAX_LOGPROBS:
                    raise ValueError(f"{name} must be an int in [0, {MAX_LOGPROBS}] or None, got {value!r}")
                object.__setattr__(self, name, count)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_real(x: object) -> bool:
    """A real number (numpy's included), not a bool, not NaN."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and not math.isnan(x)


def _index(x: object) -> int | None:
    """``x`` as an int if it is an integer (numpy's included) and not a bool, else None."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return None


def token_ids(name: str, ids: Iterable[int] | int) -> tuple[int, ...]:
    """``ids`` as a tuple of ints (numpy and 0-d tensor integers accepted).

    Raises:
        TypeError: not a sequence of integers (e.g. one bare int).
    """
    if isinstance(ids, int | str | bytes) or not isinstance(ids, Iterable):
        raise TypeError(f"{name} must be a sequence of token ids (ints), got {ids!r}")
    out: list[int] = []
    for t in ids:
        try:
            if isinstance(t, bool):
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise TypeError(f"{name} must hold token ids (ints), got {t!r}") from None
    return tuple(out)


class DecodedText:
    """The text of a growing token sequence (a request's output), decoded a short window at a time.

    Decoding the whole output at every token costs O(n) per token, O(n^2) per request. Here each
    :meth:`pending` decodes only the tokens from where the last final text began: the window
    starts on a token boundary whose text was complete, so a leading space or a multi-byte
    character reads as in the whole text, and what the window adds beyond that token's text is
    new. The stop-string checks of the loop and of ``batchkit serve`` both read text through this
    class, so they always agree on where a stop string ends.
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


def find_stop(text: str, stop: Sequence[str], start: int) -> int:
    """Where the first stop string in ``text[start:]`` begins, or -1."""
    hits = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(hits) if hits else -1


def sample(logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[Any]) -> list[int]:
    """One token per row of ``logits`` ``[n, vocab]`` under each row's parameters.

    A row's ``+inf`` logits are certainties (one of them is drawn); a row must hold no NaN and
    at least one logit above ``-inf`` (the loop fails a request whose row does not, alone).

    Raises:
        ValueError: ``params`` and ``generators`` do not hold one entry per row of ``logits``.
    """
    import torch

    rows = int(logits.shape[0])
    if len(params) != rows or len(generators) != rows:
        raise ValueError(
            f"sample needs one SamplingParams and one generator (or None) per row of logits: {rows} rows, "
            f"{len(params)} params, {len(generators)} generators"
        )

    if all(p.greedy for p in params):
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    # Each row is shifted so that its best logit is 0: a tiny temperature then sends the others
    # to -inf instead of overflowing them all (inf - inf is NaN in the softmax). The row maxima
    # are taken for every row at once, and tell which rows hold +inf logits: those are
    # certainties, kept alone (as 0, the rest -inf). One pass and one device sync per step, not
    # per row (a row's softmax and draw stay per row).
    x_all = logits.to(torch.float32)
    best = x_all.amax(dim=1, keepdim=True)
    if bool(torch.isposinf(best).any()):
        top = torch.isposinf(x_all)
        certain = torch.zeros_like(x_all).masked_fill(~top, float("-inf"))
        x_all = torch.where(top.any(dim=1, keepdim=True), certain, x_all)
        best = x_all.amax(dim=1, keepdim=True)
    out: list[int] = []
    for row, xs, m, p, gen in zip(logits, x_all, best, params, generators, strict=True):
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        x = (xs - m).div_(p.temperature)
        if p.top_k and p.top_k < x.numel():
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, idx = torch.sort(x, descending=True)
            probs = sorted_x.softmax(-1)
            cum = probs.cumsum(-1)
            drop = cum - probs >= p.top_p  # keep the smallest prefix reaching top_p
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter(0, idx, sorted_x)
        probs = x.softmax(-1)
        out.append(int(torch.multinomial(probs, 1, generator=gen)))
    return out
