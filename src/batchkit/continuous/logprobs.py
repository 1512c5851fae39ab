"""Token logprobs from a step's logits: one log-softmax and one top-k over the rows that ask.

A logprob is read from the raw logits (before temperature, top-k and top-p), as OpenAI and vLLM
report them. A token's own logprob is gathered from the same log-softmax row its top-k entries
come from, so a token that is its row's most likely one carries exactly the top entry's value
(lm-evaluation-harness decides greediness by comparing the two).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["TokenLogprobs", "logprobs_of"]

Tensor = Any


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A token and its logprob, with the most likely tokens at its position.

    ``top_logprobs``: ``(token, logprob)`` pairs, most likely first (as many as the request asked
    for). ``prompt``: True for a prompt token (``prompt_logprobs=``), False for a generated one.
    """

    token: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()
    prompt: bool = False


def logprobs_of(
    logits: Tensor, rows: Sequence[int], targets: Sequence[int], counts: Sequence[int], prompt: Sequence[bool]
) -> list[TokenLogprobs]:
    """For each ``rows[i]`` of ``logits`` ``[n, vocab]``: ``targets[i]``'s logprob and the
    ``counts[i]`` most likely tokens, computed in float32, all rows together (one device sync)."""
    import torch

    if not rows:
        return []
    device = logits.device
    lp = torch.log_softmax(logits.index_select(0, torch.tensor(rows, device=device)).to(torch.float32), dim=-1)
    chosen = lp.gather(1, torch.tensor(targets, device=device)[:, None]).squeeze(1).tolist()
    k = max(counts)
    if k:
        values, ids = lp.topk(k, dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    out = []
    for i, (target, logprob, n, is_prompt) in enumerate(zip(targets, chosen, counts, prompt, strict=True)):
        top = tuple(zip(top_ids[i][:n], top_values[i][:n], strict=True)) if n else ()
        out.append(TokenLogprobs(int(target), logprob, top, is_prompt))
    return out
