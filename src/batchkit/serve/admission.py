"""Whether a request can run: its prompt and output limit against the model's context, the
KV pool and the tenant's KV quota (:class:`PromptRoom`), and its samples against the loop's
waiting queue (:class:`WaitingRoom`). No I/O; the server's one place for these checks.

A request of P prompt tokens and M new ones holds at most P + M - 1 tokens' KV (the last token
sampled is never fed back), so P + M up to the pool's (or the quota's) tokens fits: refused
here, it could never run; let through, it is never cut short for lack of blocks. What this does
not know: how busy the pool is now (the loop's scheduler waits for room).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from .._errors import QueueFull
from .errors import ApiError

__all__ = ["KVAllocatorView", "PromptRoom", "Refused", "Reservation", "WaitingRoom"]


class KVAllocatorView(Protocol):
    """What :meth:`PromptRoom.of` reads of a :class:`~batchkit.kv.PagedKVAllocator`."""

    @property
    def max_admitted_tokens(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    def quota_of(self, tenant: Hashable) -> int | None: ...


class Refused(ApiError):
    """A 400 ``context_length_exceeded``; ``reason`` is the rejection it counts as
    (``prompt_too_long`` or ``kv_exhausted``)."""

    def __init__(self, reason: str, message: str, param: str) -> None:
        super().__init__(400, message, param=param, code="context_length_exceeded")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class PromptRoom:
    """The most tokens (prompt + output) one request of ``tenant`` may ever hold."""

    max_model_len: int
    kv_tokens: int  # the most tokens the allocator ever admits for one sequence
    block_size: int
    quota_blocks: int | None = None  # the tenant's KV quota; None: none
    tenant: Hashable = None

    @classmethod
    def of(cls, max_model_len: int, alloc: KVAllocatorView, tenant: Hashable) -> PromptRoom:
        return cls(max_model_len, alloc.max_admitted_tokens, alloc.block_size, alloc.quota_of(tenant), tenant)

    def output_limit(
        self, prompt_len: int, requested: int | None, default: int, prompt_param: str, limit_param: str
    ) -> int:
        """The request's output limit: ``requested``, or ``default`` capped by the room left.

        ``prompt_param``: the field a prompt too long is blamed on (``messages``, ``prompt``,
        ``prompt[i]``); ``limit_param``: the field the limit came from (``max_tokens`` or
        ``max_completion_tokens``).

        Raises:
            Refused: the prompt alone, or the prompt plus ``requested``, never fits.
        """
        room_ctx = self.max_model_len - prompt_len
        room_kv = self.kv_tokens - prompt_len
        # requested 0 (echo alone: the prompt's logprobs) reads the prompt and generates nothing:
        # a prompt of the whole context fits.
        if room_ctx < (0 if requested == 0 else 1):
            raise Refused(
                "prompt_too_long",
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has {prompt_len}",
                prompt_param,
            )
        if room_kv < 1:
            raise Refused(
                "prompt_too_long",
                f"the prompt has {prompt_len} tokens but the KV pool holds {self.kv_tokens}; shorten the prompt",
                prompt_param,
            )
        rooms = [room_ctx, room_kv]
        quota = self.quota_blocks
        if quota is not None:
            quota_tokens = quota * self.block_size
            if quota_tokens - prompt_len < 1:
                raise Refused(
                    "kv_exhausted",
                    f"the prompt has {prompt_len} tokens but tenant {self.tenant!r} has a KV quota of {quota} "
                    f"blocks, which hold {quota_tokens}; shorten the prompt",
                    prompt_param,
                )
            rooms.append(quota_tokens - prompt_len)
        if requested is None:
            return max(1, min(default, *rooms))
        if requested > room_ctx:
            raise Refused(
                "prompt_too_long",
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt ({prompt_len}) "
                f"plus {limit_param} ({requested}) asks for {prompt_len + requested}",
                limit_param,
            )
        if requested > room_kv:
            raise Refused(
                "prompt_too_long",
                f"the prompt ({prompt_len} tokens) plus {limit_param} ({requested}) needs more than the KV pool's "
                f"{self.kv_tokens} tokens; lower {limit_param} or shorten the prompt",
                limit_param,
            )
        if quota is not None and requested > rooms[-1]:
            raise Refused(
                "kv_exhausted",
                f"the prompt ({prompt_len} tokens) plus {limit_param} ({requested}) needs more than tenant "
                f"{self.tenant!r} may hold: a KV quota of {quota} blocks ({quota * self.block_size} tokens); lower "
                f"{limit_param} or shorten the prompt",
                limit_param,
            )
        return requested


class Reservation:
    """Places one prompt's samples hold in a :class:`WaitingRoom` until the loop queues them."""

    __slots__ = ("_room", "num_samples")

    def __init__(self, room: WaitingRoom, num_samples: int) -> None:
        self._room = room
        self.num_samples = num_samples

    def release(self) -> None:
        """Give the places back (the loop counts the samples now, or they will never be queued).
        Only the first call counts."""
        self._room.num_held -= self.num_samples
        self.num_samples = 0


class WaitingRoom:
    """The loop's waiting queue (``max_waiting``) as the server fills it: a request's samples
    (its prompts times ``n``) are let in together or refused together, never in part.

    The loop checks ``max_waiting`` one sample at a time, so a group it cannot hold whole would
    be partly queued, then aborted. Here the whole group is checked first, against the samples
    the loop holds and those let in here that the loop does not count yet: a prompt's samples
    are queued on their first read, after the handler has yielded to others, so each prompt's
    places are held (a :class:`Reservation`) until then. What this does not know: the engine
    thread moving requests back to waiting meanwhile (a preemption), and the loop's own count,
    which for a moment counts twice the requests it moves from its inbox to its scheduler; the
    loop may then refuse a sample itself, and the request is answered the same 503.
    """

    __slots__ = ("max_waiting", "num_held")

    def __init__(self, max_waiting: int | None) -> None:
        self.max_waiting = max_waiting  # None: unbounded
        self.num_held = 0  # samples let in and not yet queued by the loop

    def check_fits(self, num_prompts: int, n: int) -> None:
        """Refuse a request whose samples could never all wait at once, not even on an idle server.

        Raises:
            ApiError: 400 ``invalid_value`` naming ``n`` (``prompt`` when ``n`` is 1).
        """
        limit = self.max_waiting
        num_samples = num_prompts * n
        if limit is None or num_samples <= limit:
            return
        one = num_prompts == 1
        asked = f"n={n} samples" if one else f"{num_samples} samples ({num_prompts} prompts x n={n})"
        fix = "lower n" if one else "lower n or send fewer prompts per request"
        raise ApiError(
            400,
            f"this request asks for {asked}, but at most {limit} may wait for admission at once on this server "
            f"(--max-waiting {limit}), so it could never be admitted; {fix}, or raise --max-waiting",
            param="n" if n > 1 else "prompt",
            code="invalid_value",
        )

    def take(self, num_prompts: int, n: int, num_waiting: int, free_seats: int = 0) -> list[Reservation]:
        """Places for ``num_prompts`` prompts of ``n`` samples each beside the ``num_waiting``
        requests the loop holds now; one reservation per prompt, to release when the loop has
        queued its samples (their first read) or when they are dropped unread. ``free_seats``
        (the loop's seats free now) take as many waiting samples first: ``max_waiting`` bounds
        those beyond them, so a burst at an idle server fills its seats, then ``max_waiting``.

        Raises:
            QueueFull: the queue has no room for every sample now (nothing is held then).
        """
        num_samples = num_prompts * n
        if self.max_waiting is not None:
            waiting = num_waiting + self.num_held
            if waiting + num_samples - free_seats > self.max_waiting:
                raise QueueFull(
                    f"this request's {num_samples} samples would join the {waiting} already waiting for "
                    f"admission, past the {free_seats} free seats and max_waiting={self.max_waiting} more; "
                    "retry later"
                )
        self.num_held += num_samples
        return [Reservation(self, n) for _ in range(num_prompts)]
