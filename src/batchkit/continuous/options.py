"""RequestOptions: what a caller of the decode loop asks for, beside its prompt, as one checked value.

Every way to submit (``generate``, ``submit``, ``generate_n``, their logprobs and blocking
twins) builds one :class:`RequestOptions` and hands it to the loop's one submit path. Here too:
the prompt's own check (:func:`check_prompt`) and the sampling fields with the loop's defaults
(:func:`sampling_params`).
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from .._validate import positive_float, positive_int
from .sampling import SamplingParams, nth_seed

__all__ = ["RequestOptions", "check_prompt", "sampling_params"]


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """One prompt's request: its sampling, its place in the queue and the form of its items.

    Attributes:
        params: the sampling of the first sample (the loop's end-of-sequence ids included).
        priority: lower is served first.
        tenant: whose KV quota the request counts against (hashable).
        deadline_s: the request must finish within this many seconds of its submission.
        n: samples of the prompt, sample ``i`` seeded ``seed + i``.
        detailed: the items are :class:`TokenLogprobs`, not token ids.

    Raises:
        TypeError: a ``priority`` that is not an int, a ``tenant`` that is not hashable.
        ValueError: a ``deadline_s`` that is not a finite number > 0 (nor None), an ``n`` < 1.
    """

    params: SamplingParams
    priority: int = 0
    tenant: Hashable = None
    deadline_s: float | None = None
    n: int = 1
    detailed: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise TypeError(f"priority must be an int (lower is served first), got {self.priority!r}")
        try:
            hash(self.tenant)
        except TypeError:
            raise TypeError(f"tenant must be hashable (a name, e.g. a string), got {self.tenant!r}") from None
        if self.deadline_s is not None:
            positive_float("deadline_s", self.deadline_s, note="(seconds, or None)")
        positive_int("n", self.n)

    def samples(self) -> list[SamplingParams]:
        """The sampling of each of the ``n`` samples: sample ``i`` seeded ``seed + i`` (wrapping
        within the seeds a generator takes; without a seed, each draws its own)."""
        first = self.params
        seed = first.seed
        return [first] + [
            first if seed is None else dataclasses.replace(first, seed=nth_seed(seed, i)) for i in range(1, self.n)
        ]


def sampling_params(
    fields: dict[str, Any], eos_token_id: int | None, extra_eos_ids: tuple[int, ...], *, detailed: bool = False
) -> SamplingParams:
    """The :class:`SamplingParams` of a call's keyword arguments, with the loop's defaults: its
    ``eos_token_id`` unless the call gives one, its ``extra_eos_ids`` as stop ids unless the
    call sets ``ignore_eos``; ``detailed`` (a call that returns logprobs): ``logprobs`` 0 (each
    token's own, no alternatives) unless the call asks for alternatives.

    Raises:
        TypeError, ValueError: a field :class:`SamplingParams` refuses.
    """
    if detailed and fields.get("logprobs") is None:
        fields = {**fields, "logprobs": 0}
    if "eos_token_id" not in fields and eos_token_id is not None:
        fields = {**fields, "eos_token_id": eos_token_id}
    params = SamplingParams(**fields)  # checks every field first
    if extra_eos_ids and not params.ignore_eos:
        own = params.stop_token_ids
        params = dataclasses.replace(params, stop_token_ids=own + tuple(t for t in extra_eos_ids if t not in own))
    return params


def check_prompt(prompt_ids: Sequence[int], vocab_size: int | None) -> list[int]:
    """The prompt as a list of token ids; refuse what no step could embed.

    Raises:
        TypeError: a string instead of token ids, or an id that is not an integer.
        ValueError: no token, a negative id, or an id past ``vocab_size``.
    """
    if isinstance(prompt_ids, str | bytes):
        raise TypeError("prompt_ids must be token ids (a sequence of ints), got a string; tokenize it first")
    try:
        items = list(prompt_ids)
    except TypeError:  # one bare id, None, a 0-d tensor...
        raise TypeError(f"prompt_ids must be token ids (a sequence of ints), got {prompt_ids!r}") from None
    prompt: list[int] = []
    for t in items:
        try:
            if isinstance(t, bool):
                raise TypeError
            prompt.append(operator.index(t))  # ints, numpy ints, 0-d integer tensors
        except TypeError:
            raise TypeError(f"prompt_ids must be ints (token ids), got {t!r}") from None
    if not prompt:
        raise ValueError("prompt_ids needs at least one token")
    low, high = min(prompt), max(prompt)
    if low < 0:
        raise ValueError(f"token ids must be >= 0, got {low}")
    if vocab_size is not None and high >= vocab_size:
        raise ValueError(f"token id {high} is past the model's vocabulary (vocab_size={vocab_size})")
    return prompt
