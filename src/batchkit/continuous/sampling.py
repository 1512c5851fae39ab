"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeded per request."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SamplingParams", "sample"]

Tensor = Any


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

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 keeps all tokens), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[Any]) -> list[int]:
    """One token per row of ``logits`` ``[n, vocab]`` under each row's parameters."""
    import torch

    if all(p.greedy for p in params):
        return [int(t) for t in logits.argmax(dim=-1).tolist()]
    out: list[int] = []
    for row, p, gen in zip(logits, params, generators, strict=True):
        if p.greedy:
            out.append(int(row.argmax()))
            continue
        x = row.to(torch.float32) / p.temperature
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
