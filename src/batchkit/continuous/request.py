"""A request of the continuous path and what the path says about it.

:class:`Request` is one generation request and its progress. Its life is :data:`TRANSITIONS`,
one table over :class:`RequestStatus` and :class:`Transition`; :meth:`Request.move` is the only
writer of its status after it starts ``WAITING`` (the scheduler moves it, and keeps the lists and
the blocks that go with each status). :class:`ScheduledStep` is what one step runs, and
:class:`TokenEvent` what a step tells a request's caller. Nothing here knows the scheduler's
lists, the KV blocks or the model.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import numpy as np

from .logprobs import TokenLogprobs
from .sampling import SamplingParams
from .stops import DecodedText, StopStrings

__all__ = [
    "HOLDS_BLOCKS",
    "StepPlan",
    "TRANSITIONS",
    "Request",
    "RequestStatus",
    "ScheduledStep",
    "TokenEvent",
    "Transition",
]


class RequestStatus(enum.Enum):
    """Where a request is: each live one is in the scheduler's list of that name."""

    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"
    ABORTED = "aborted"


class Transition(enum.Enum):
    """What moves a request from one :class:`RequestStatus` to another (:data:`TRANSITIONS`)."""

    ADMIT = "admit"  # its prompt's blocks allocated
    SWAP_OUT = "swap_out"  # its blocks moved to the CPU pool
    SWAP_IN = "swap_in"  # back from the CPU pool
    RECOMPUTE = "recompute"  # its blocks freed: it waits again, its output part of its prompt
    FINISH = "finish"  # a stop condition
    FAIL = "fail"  # an error (a deadline, an outgrown cache or quota, a failing detokenize)
    ABORT = "abort"


_WAITING, _RUNNING, _SWAPPED = RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.SWAPPED
_FINISHED, _ABORTED = RequestStatus.FINISHED, RequestStatus.ABORTED

#: The request state machine, whole: ``TRANSITIONS[status][transition]`` is the next status; a
#: transition a status does not list is a scheduler bug. Every request starts ``WAITING``
#: (``Scheduler.add``); ``FINISHED`` and ``ABORTED`` are final.
TRANSITIONS: Mapping[RequestStatus, Mapping[Transition, RequestStatus]] = MappingProxyType(
    {
        _WAITING: MappingProxyType(
            {Transition.ADMIT: _RUNNING, Transition.FAIL: _FINISHED, Transition.ABORT: _ABORTED}
        ),
        _RUNNING: MappingProxyType(
            {
                Transition.SWAP_OUT: _SWAPPED,
                Transition.RECOMPUTE: _WAITING,
                Transition.FINISH: _FINISHED,
                Transition.FAIL: _FINISHED,
                Transition.ABORT: _ABORTED,
            }
        ),
        _SWAPPED: MappingProxyType(
            {
                Transition.SWAP_IN: _RUNNING,
                Transition.RECOMPUTE: _WAITING,
                Transition.FAIL: _FINISHED,
                Transition.ABORT: _ABORTED,
            }
        ),
        _FINISHED: MappingProxyType({}),
        _ABORTED: MappingProxyType({}),
    }
)
#: The statuses whose requests hold blocks (the device's, or the CPU pool's when swapped): a
#: transition out of them to a status not in this set frees the request's blocks.
HOLDS_BLOCKS: frozenset[RequestStatus] = frozenset({_RUNNING, _SWAPPED})


class Request:
    """One generation request and its progress."""

    __slots__ = (
        "after",
        "arrival",
        "deadline",
        "displaced_by",
        "finish_reason",
        "generator",
        "num_computed",
        "num_preemptions",
        "order",
        "output",
        "params",
        "priority",
        "prompt_len",
        "prompt_logprobs",
        "prompt_logprobs_done",
        "request_id",
        "status",
        "stop_strings",
        "stop_text",
        "t_first_scheduled",
        "t_last_token",
        "tenant",
        "tokens",
    )

    def __init__(
        self,
        request_id: Hashable,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        tenant: Hashable = None,
        arrival: float = 0.0,
        deadline: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.deadline = deadline  # on the scheduler's clock: dropped with DeadlineExceeded past it
        self.tokens: list[int] = [int(t) for t in prompt]  # prompt + output
        self.prompt_len = len(self.tokens)
        self.output: list[int] = []
        self.params = params
        self.priority = priority
        self.tenant = tenant
        self.arrival = arrival
        self.order = 0
        self.num_computed = 0  # tokens whose K/V are in the cache
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.t_first_scheduled: float | None = None
        self.t_last_token: float | None = None
        self.num_preemptions = 0
        self.generator: Any = None
        # With stop strings: the output's text, and where a stop string in it counts.
        self.stop_text: DecodedText | None = None
        self.stop_strings: StopStrings | None = None
        # params.prompt_logprobs: the prompt tokens' entries not yet handed out, and how many of
        # the prompt's positions (from 1 on) have theirs.
        self.prompt_logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs_done = 0
        # A request of the same prompt (n samples of one prompt): this one is admitted only once
        # that one's prompt is computed, so that it takes the prompt's full blocks from the
        # prefix cache instead of computing them again. Cleared at admission.
        self.after: Request | None = None
        # The better request that pushed this one out for its seat: until that one stops running,
        # this one comes back only to a seat no one else waits for. Cleared at admission.
        self.displaced_by: Request | None = None

    @property
    def ended(self) -> bool:
        """Whether the request is in a final status (finished, failed or aborted): no
        :data:`TRANSITIONS` entry leads out of it."""
        return not TRANSITIONS[self.status]

    @property
    def needs_prompt_logits(self) -> bool:
        """Whether this request still wants logits at prompt positions (``prompt_logprobs``)."""
        return self.params.prompt_logprobs is not None and self.prompt_logprobs_done < self.prompt_len - 1

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.order)

    def move(self, transition: Transition) -> tuple[RequestStatus, RequestStatus]:
        """Apply ``transition`` to the request's status (:data:`TRANSITIONS`); its old and new
        status. The one writer of :attr:`status` once the request is queued: the scheduler
        calls it and keeps its lists and the request's blocks in step with the answer.

        Raises:
            RuntimeError: the table has no such transition from the request's status (a bug).
        """
        old = self.status
        new = TRANSITIONS[old].get(transition)
        if new is None:
            raise RuntimeError(f"request {self.request_id!r}: no {transition.value!r} transition from {old.value!r}")
        self.status = new
        return old, new

    def __repr__(self) -> str:
        return (
            f"<Request {self.request_id!r} {self.status.value} prompt={self.prompt_len} "
            f"out={len(self.output)} computed={self.num_computed}>"
        )


@dataclass(frozen=True)
class ScheduledStep:
    """What one step runs: for each scheduled request, how many new tokens and whether it samples.

    Block moves the KV cache must perform before the step runs, in this order: ``swap_out``
    (device -> CPU), ``swap_in`` (CPU -> device), ``copies`` (copy-on-write, device).

    ``slot_mapping`` (int64, one entry per new token, request after request) is where each new
    token's K/V go, as the allocator handed the slots out while scheduling; None in a step
    built by hand, whose runtime then derives the slots from the block tables.
    """

    requests: tuple[Request, ...]
    num_new_tokens: tuple[int, ...]
    samples: tuple[bool, ...]
    swap_out: tuple[tuple[int, int], ...] = ()
    swap_in: tuple[tuple[int, int], ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    slot_mapping: np.ndarray | None = field(default=None, compare=False)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


@dataclass(frozen=True)
class TokenEvent:
    """A token produced for a request (or its end: ``token`` None when it ended without one)."""

    request_id: Hashable
    token: int | None
    finished: bool
    finish_reason: str | None = None
    error: BaseException | None = None
    logprobs: TokenLogprobs | None = None  # the token's, when its request asked (``logprobs=``)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # the prompt's (``prompt_logprobs=``), with the first token

    @classmethod
    def ended(cls, request_id: Hashable, reason: str, error: BaseException | None = None) -> TokenEvent:
        """The event of a request that ended without a token: ``reason`` is ``"abort"`` or
        ``"error"``, ``error`` what its caller raises (None: an abort asked for)."""
        return cls(request_id, None, True, reason, error)


@dataclass(eq=False, slots=True)
class StepPlan:
    """The step ``Scheduler.schedule()`` is deciding, filled in by its phases in turn (it becomes a
    :class:`ScheduledStep` once sealed)."""

    budget: int  # tokens left of max_num_batched_tokens
    requests: list[Request] = field(default_factory=list)  # scheduled, in order
    counts: list[int] = field(default_factory=list)  # each one's new tokens
    slots: list[np.ndarray] = field(default_factory=list)  # the slots of each one's new tokens
    scheduled: set[int] = field(default_factory=set)  # id() of each one, for the victim search
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    swapped_here: list[Request] = field(default_factory=list)  # swapped out by this step
    preempted: bool = False  # by the limit or for blocks: then nothing comes back or is admitted

    def take(self, req: Request, n: int, slots: np.ndarray) -> None:
        """Schedule ``n`` new tokens of ``req`` into ``slots``."""
        self.requests.append(req)
        self.counts.append(n)
        self.slots.append(slots)
        self.scheduled.add(id(req))
        self.budget -= n
