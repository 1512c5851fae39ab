"""Whether a request can ever run: its prompt and output limit against the model's context, the
KV pool and the tenant's KV quota. No I/O; the server's one place for this check.

A request of P prompt tokens and M new ones holds at most P + M - 1 tokens' KV (the last token
sampled is never fed back), so P + M up to the pool's (or the quota's) tokens fits: refused
here, it could never run; let through, it is never cut short for lack of blocks. What this does
not know: how busy the pool is now (the loop's scheduler waits for room).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from .protocol import ApiError

__all__ = ["KVAllocatorView", "PromptRoom", "Refused"]


class KVAllocatorView(Protocol):
    """What :meth:`PromptRoom.of` reads of a :class:`~batchkit.kv.PagedKVAllocator`."""

    @property
    def total_blocks(self) -> int: ...
    @property
    def watermark_blocks(self) -> int: ...
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
    kv_tokens: int  # the pool's tokens above the admission watermark
    block_size: int
    quota_blocks: int | None = None  # the tenant's KV quota; None: none
    tenant: Hashable = None

    @classmethod
    def of(cls, max_model_len: int, alloc: KVAllocatorView, tenant: Hashable) -> PromptRoom:
        kv_tokens = (alloc.total_blocks - alloc.watermark_blocks) * alloc.block_size
        return cls(max_model_len, kv_tokens, alloc.block_size, alloc.quota_of(tenant), tenant)

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
        if room_ctx < 1:
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
                    f"the prompt has {prompt_len} tokens but tenant {self.tenant!r}'s KV quota of {quota} blocks "
                    f"holds {quota_tokens}; shorten the prompt",
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
                f"{self.tenant!r}'s KV quota of {quota} blocks ({quota * self.block_size} tokens); lower "
                f"{limit_param} or shorten the prompt",
                limit_param,
            )
        return requested
