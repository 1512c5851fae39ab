"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from .grammar import Grammar

__all__ = ["GREEDY_BELOW", "MAX_LOGPROBS", "SamplingParams", "adjust_logits", "sample"]

Tensor = Any

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
MAX_LOGPROBS = 20  # alternatives per token, as OpenAI's top_logprobs and vLLM's default max_logprobs
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2], as OpenAI's
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-100, 100], as OpenAI's
# A temperature below float32's smallest normal number samples greedily: any two different
# logits are then infinitely far apart, and the smallest of these divide by zero in float32.
GREEDY_BELOW = 2.0**-126


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Args:
        max_new_tokens: generate at most this many tokens (>= 1).
        temperature: 0 is greedy (argmax), and so is any temperature below
            :data:`GREEDY_BELOW` (2**-126); otherwise logits are divided by it.
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
        presence_penalty: subtracted from the logit of every token the output holds already
            (-2 to 2; OpenAI's and vLLM's meaning: the prompt does not count).
        frequency_penalty: subtracted once per time a token occurs in the output so far (-2 to 2).
        repetition_penalty: divides the positive logits and multiplies the negative ones of every
            token of the prompt or the output (> 0; 1 is off; transformers' and vLLM's meaning).
        logit_bias: ``{token_id: bias}`` added to those logits (-100 to 100 each, as OpenAI's);
            an id past the vocabulary fails this request alone (the loop refuses it at submit when
            it knows the vocabulary). Kept as sorted ``(id, bias)`` pairs.
        min_p: when sampling, drop tokens less likely than ``min_p`` times the most likely one,
            after temperature (0 to 1; 0 is off). Greedy decoding ignores it.
        grammar: keep the output within this grammar (a :class:`~batchkit.continuous.grammar.Grammar`
            from :func:`~batchkit.continuous.grammar.json_grammar`): each step, the tokens it does not allow next
            are masked out of this request's logits, after penalties and biases. Its stop
            tokens join ``stop_token_ids`` (even with ``ignore_eos``): once the grammar is
            complete they are all it allows, and they end the request.
        min_tokens: generate at least this many tokens (0 to ``max_new_tokens``; vLLM's meaning):
            until then the stop tokens (``stop_token_ids``, and ``eos_token_id`` unless
            ``ignore_eos``) are masked out of the logits, and no stop string ends the output (one
            counts once it ends in the text of the ``min_tokens``-th token or a later one).

    Penalties and biases change the logits both greedy decoding and sampling read, in the order
    vLLM applies them (bias, then repetition, frequency and presence); the logprobs reported are
    those of the raw logits, before all of them, as OpenAI and vLLM report them.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | Iterable[tuple[int, float]] = field(default_factory=tuple)
    min_p: float = 0.0
    grammar: Grammar | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        # Everything is checked here, at submit: a value the sampler or the stop check could only
        # trip over inside a step would fail every request batched into that step.
        max_new = _index(self.max_new_tokens)  # a numpy or torch integer too, as for top_k and seed
        if max_new is None or max_new < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        object.__setattr__(self, "max_new_tokens", max_new)
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
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-2, 2] (0 is off), got {value!r}")
            object.__setattr__(self, name, float(value))
        if not _is_real(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0 (1 is off), got {self.repetition_penalty!r}"
            )
        object.__setattr__(self, "repetition_penalty", float(self.repetition_penalty))
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1] (0 is off), got {self.min_p!r}")
        object.__setattr__(self, "min_p", float(self.min_p))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        min_tokens = _index(self.min_tokens)
        if min_tokens is None or not 0 <= min_tokens <= max_new:
            raise ValueError(f"min_tokens must be an int in [0, max_new_tokens={max_new}], got {self.min_tokens!r}")
        object.__setattr__(self, "min_tokens", min_tokens)
        if self.grammar is not None:
            if not isinstance(self.grammar, Grammar):
                raise TypeError(f"grammar must be a batchkit Grammar (see json_grammar) or None, got {self.grammar!r}")
            own = self.stop_token_ids
            object.__setattr__(
                self, "stop_token_ids", own + tuple(t for t in self.grammar.stop_token_ids if t not in own)
            )

    @property
    def greedy(self) -> bool:
        """Whether the token is the argmax: a temperature of 0, or one below
        :data:`GREEDY_BELOW`, which is greedy in effect (and would divide the logits by a zero
        once in float32)."""
        return self.temperature < GREEDY_BELOW

    @property
    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as it is kept: ``(token_id, bias)`` pairs sorted by id."""
        return cast(tuple[tuple[int, float], ...], self.logit_bias)

    def holds_stops(self, num_output: int) -> bool:
        """Whether, with ``num_output`` tokens generated, the next token may not be a stop token
        (``min_tokens`` not reached, and there are stop tokens to mask)."""
        return num_output < self.min_tokens and bool(self.stop_ids)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The token ids that end the output: ``stop_token_ids``, and ``eos_token_id`` unless ``ignore_eos``."""
        eos = self.eos_token_id
        if eos is None or self.ignore_eos or eos in self.stop_token_ids:
            return self.stop_token_ids
        return (*self.stop_token_ids, eos)

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a bias changes this request's logits (see :func:`adjust_logits`)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """``{token_id: bias}`` (or its items) as sorted ``(id, bias)`` pairs, each checked."""
    if isinstance(bias, Mapping):
        items: Iterable[Any] = bias.items()
    elif isinstance(bias, Iterable) and not isinstance(bias, str | bytes):
        items = bias
    else:
        raise TypeError(f"logit_bias must be a mapping of token id to bias, got {bias!r}")
    out: dict[int, float] = {}
    for item in items:
        try:
            key, value = item
        except (TypeError, ValueError):
            raise TypeError(f"logit_bias must be a mapping of token id to bias, got the entry {item!r}") from None
        token = _index(key)
        if token is None or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
        if not _is_real(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def nth_seed(seed: int, i: int) -> int:
    """The seed of sample ``i`` of a request seeded ``seed``: ``seed + i``, wrapped into the
    seeds a torch generator takes ([-2**63, 2**64 - 1])."""
    span = _SEED_MAX - _SEED_MIN + 1
    return (seed + i - _SEED_MIN) % span + _SEED_MIN


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


def adjust_logits(
    logits: Tensor, params: Sequence[SamplingParams], tokens: Sequence[Sequence[int]], prompt_lens: Sequence[int]
) -> Tensor:
    """``logits`` ``[n, vocab]`` with each row's logit bias and penalties applied, in float32.

    Row ``i`` has seen ``tokens[i]``, its prompt (the first ``prompt_lens[i]``) then its output
    so far. Only the rows whose parameters adjust their logits are computed, all in one
    vectorised pass per kind; ``logits`` itself is returned, unchanged, when no row adjusts. A
    row whose ``min_tokens`` is not reached has its stop tokens masked (-inf) after the rest.
    """
    import torch

    holding = [p.holds_stops(len(t) - n) for p, t, n in zip(params, tokens, prompt_lens, strict=True)]
    rows = [i for i, p in enumerate(params) if p.adjusts_logits or holding[i]]
    if not rows:
        return logits
    device = logits.device
    row_index = torch.tensor(rows, device=device)
    x = logits.index_select(0, row_index).to(torch.float32)
    picked = [params[i] for i in rows]

    def scatter_index(seqs: list[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """(row, token) index tensors of every token of every picked row's sequence."""
        row_ids = [j for j, seq in enumerate(seqs) for _ in range(len(seq))]
        flat = [t for seq in seqs for t in seq]
        return (
            torch.tensor(row_ids, dtype=torch.long, device=device),
            torch.tensor(flat, dtype=torch.long, device=device),
        )

    biased = [(j, t, b) for j, p in enumerate(picked) for t, b in p.logit_bias_pairs]
    if biased:
        r, t, b = zip(*biased, strict=True)
        x.index_put_(
            (torch.tensor(r, device=device), torch.tensor(t, device=device)),
            torch.tensor(b, dtype=torch.float32, device=device),
            accumulate=True,
        )
    if any(p.repetition_penalty != 1.0 for p in picked):
        seen = torch.zeros_like(x, dtype=torch.bool)
        seen[
            scatter_index([tokens[i] if p.repetition_penalty != 1.0 else () for i, p in zip(rows, picked, strict=True)])
        ] = True
        penalty = torch.tensor([p.repetition_penalty for p in picked], dtype=torch.float32, device=device)[:, None]
        x = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)
    if any(p.presence_penalty or p.frequency_penalty for p in picked):
        counts = torch.zeros_like(x)
        outputs = [tokens[i][prompt_lens[i] :] for i in rows]
        index = scatter_index(outputs)
        counts.index_put_(index, torch.ones_like(index[0], dtype=torch.float32), accumulate=True)
        freq = torch.tensor([p.frequency_penalty for p in picked], dtype=torch.float32, device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in picked], dtype=torch.float32, device=device)[:, None]
        x -= freq * counts + presence * (counts > 0)
    held = [(j, t) for j, i in enumerate(rows) if holding[i] for t in params[i].stop_ids]
    if held:
        r, t = zip(*held, strict=True)
        x[torch.tensor(r, device=device), torch.tensor(t, device=device)] = float("-inf")
    out = logits.to(torch.float32, copy=True)
    out[row_index] = x
    return out


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

    # Greedy is each row's first best logit: max(dim).indices, which in bfloat16 on CPU ran in
    # about a third of argmax's time (16 rows of 49,152: 0.5-0.6 ms against 1.5 ms).
    if all(p.greedy for p in params):
        return [int(t) for t in logits.max(dim=-1).indices.tolist()]
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
            out.append(int(row.max(dim=0).indices))
            continue
        x = (xs - m).div_(p.temperature)
        if p.min_p > 0:  # the best logit is 0 here: p / p_best < min_p where x < log(min_p)
            x = x.masked_fill(x < math.log(p.min_p), float("-inf"))
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
