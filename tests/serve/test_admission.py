"""PromptRoom: the server's one check of whether a request can ever run (model context, KV pool
above the watermark, tenant quota), and the output limit it leaves."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import pytest

from batchkit.serve.admission import PromptRoom, Refused


@dataclass
class FakeAllocator:
    total_blocks: int = 10
    watermark_blocks: int = 2
    block_size: int = 4
    quotas: dict[Hashable, int] = field(default_factory=dict)

    def quota_of(self, tenant: Hashable) -> int | None:
        return self.quotas.get(tenant)


def _room(max_model_len: int = 100, tenant: Hashable = None, **alloc: int) -> PromptRoom:
    quotas = {"acme": 3}
    return PromptRoom.of(max_model_len, FakeAllocator(quotas=quotas, **alloc), tenant)  # type: ignore[arg-type]


def test_the_kv_room_is_the_pool_above_the_watermark_in_tokens() -> None:
    """10 blocks less 2 of watermark, 4 tokens each: 32 tokens; no quota for an unnamed tenant."""
    room = _room()
    assert (room.kv_tokens, room.quota_blocks) == (32, None)


def test_prompt_plus_output_may_fill_the_pool_but_not_pass_it() -> None:
    """P + M up to the pool's tokens fits (the last token is never fed back); one more does not."""
    room = _room()
    assert room.output_limit(30, 2, 256, "prompt", "max_tokens") == 2
    with pytest.raises(Refused) as info:
        room.output_limit(30, 3, 256, "prompt", "max_tokens")
    assert (info.value.status, info.value.param, info.value.reason) == (400, "max_tokens", "prompt_too_long")
    assert "KV pool's 32 tokens" in info.value.message


def test_a_prompt_that_fills_the_pool_is_blamed_on_the_prompt_field() -> None:
    with pytest.raises(Refused) as info:
        _room().output_limit(32, None, 256, "prompt[1]", "max_tokens")
    assert (info.value.param, info.value.code) == ("prompt[1]", "context_length_exceeded")
    assert "the KV pool holds 32" in info.value.message


def test_the_model_context_is_checked_before_the_pool() -> None:
    with pytest.raises(Refused) as info:
        _room(max_model_len=20).output_limit(20, None, 256, "messages", "max_tokens")
    assert "maximum context length is 20 tokens; the prompt has 20" in info.value.message


def test_without_a_limit_the_default_is_capped_by_the_smallest_room() -> None:
    """The default output limit shrinks to what context, pool and quota leave (at least 1)."""
    assert _room().output_limit(10, None, 256, "prompt", "max_tokens") == 22
    assert _room(max_model_len=15).output_limit(10, None, 256, "prompt", "max_tokens") == 5
    assert _room(tenant="acme").output_limit(10, None, 256, "prompt", "max_tokens") == 2
    assert _room().output_limit(10, None, 8, "prompt", "max_tokens") == 8


def test_a_tenant_quota_refusal_counts_as_kv_exhausted() -> None:
    """Tenant acme holds at most 3 blocks (12 tokens)."""
    room = _room(tenant="acme")
    with pytest.raises(Refused) as info:
        room.output_limit(12, None, 256, "prompt", "max_tokens")
    assert info.value.reason == "kv_exhausted"
    assert "tenant 'acme''s KV quota of 3 blocks holds 12" in info.value.message
    with pytest.raises(Refused) as info:
        room.output_limit(10, 3, 256, "prompt", "max_completion_tokens")
    assert (info.value.param, info.value.reason) == ("max_completion_tokens", "kv_exhausted")
