"""PromptRoom: the server's one check of whether a request can ever run (model context, KV pool
above the watermark, tenant quota), and the output limit it leaves. WaitingRoom: a request's
samples (prompts times n) against the loop's max_waiting, let in or refused whole."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import pytest

from batchkit._errors import QueueFull
from batchkit.serve.admission import PromptRoom, Refused, WaitingRoom
from batchkit.serve.errors import ApiError


@dataclass
class FakeAllocator:
    total_blocks: int = 10
    watermark_blocks: int = 2
    block_size: int = 4
    quotas: dict[Hashable, int] = field(default_factory=dict)

    @property
    def max_admitted_tokens(self) -> int:  # as PagedKVAllocator.max_admitted_tokens
        return (self.total_blocks - self.watermark_blocks) * self.block_size

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


def test_an_echo_alone_may_hold_the_whole_context() -> None:
    """max_tokens 0 (echo: the prompt's logprobs, nothing generated) of a prompt of the model's
    whole context fits; one token more, or any output, does not."""
    room = _room(max_model_len=20)
    assert room.output_limit(20, 0, 256, "prompt", "max_tokens") == 0
    with pytest.raises(Refused):
        room.output_limit(20, 1, 256, "prompt", "max_tokens")
    with pytest.raises(Refused):
        room.output_limit(21, 0, 256, "prompt", "max_tokens")


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
    assert info.value.message == (
        "the prompt has 12 tokens but tenant 'acme' has a KV quota of 3 blocks, which hold 12; shorten the prompt"
    )
    with pytest.raises(Refused) as info:
        room.output_limit(10, 3, 256, "prompt", "max_completion_tokens")
    assert info.value.message == (
        "the prompt (10 tokens) plus max_completion_tokens (3) needs more than tenant 'acme' may hold: "
        "a KV quota of 3 blocks (12 tokens); lower max_completion_tokens or shorten the prompt"
    )
    assert (info.value.param, info.value.reason) == ("max_completion_tokens", "kv_exhausted")


class TestWaitingRoom:
    """max_waiting=4: every sample of a request waits at once, or none does."""

    def test_more_samples_than_max_waiting_is_a_400_naming_n_and_the_flag(self) -> None:
        """n=5 could never be admitted, not even on an idle server: not a 503 to retry."""
        with pytest.raises(ApiError) as info:
            WaitingRoom(4).check_fits(1, 5)
        assert (info.value.status, info.value.code, info.value.param) == (400, "invalid_value", "n")
        assert "n=5 samples" in info.value.message
        assert "--max-waiting 4" in info.value.message

    def test_the_samples_are_the_prompts_times_n(self) -> None:
        """3 prompts x n=2 are 6 samples; 5 prompts of n=1 blame the prompts; 4 fit."""
        room = WaitingRoom(4)
        with pytest.raises(ApiError, match=r"6 samples \(3 prompts x n=2\)") as info:
            room.check_fits(3, 2)
        assert info.value.param == "n"
        with pytest.raises(ApiError, match="send fewer prompts") as info:
            room.check_fits(5, 1)
        assert info.value.param == "prompt"
        room.check_fits(2, 2)
        room.check_fits(1, 4)

    def test_a_group_without_room_now_is_refused_whole_and_holds_nothing(self) -> None:
        """2 waiting in the loop: 2 more samples fit; 3 are refused, and hold no place."""
        room = WaitingRoom(4)
        with pytest.raises(
            QueueFull,
            match=r"3 samples would join the 2 already waiting for admission, past the 0 free seats and max_waiting=4",
        ):
            room.take(1, 3, num_waiting=2)
        assert room.num_held == 0
        places = room.take(2, 1, num_waiting=2)
        assert ([p.num_samples for p in places], room.num_held) == ([1, 1], 2)

    def test_free_seats_take_waiting_samples_first(self) -> None:
        """A burst at an idle server: 3 free seats and max_waiting 4 let in 7 samples (held here
        or queued in the loop) at once, not 4; the 8th is refused. A group of 5 fits whole."""
        room = WaitingRoom(4)
        room.take(5, 1, num_waiting=0, free_seats=3)
        room.take(1, 1, num_waiting=1, free_seats=3)  # a request of another server's queued in the loop
        with pytest.raises(QueueFull, match="1 samples would join the 7 already waiting"):
            room.take(1, 1, num_waiting=1, free_seats=3)
        assert room.num_held == 6

    def test_places_are_held_until_released_so_two_requests_cannot_take_the_last_ones(self) -> None:
        """Two requests checked before the loop has queued either: the second finds the first's
        places taken. Released (queued, or dropped unread), they count once, however often."""
        room = WaitingRoom(4)
        first = room.take(1, 3, num_waiting=0)
        with pytest.raises(QueueFull, match="would join the 3 already waiting"):
            room.take(1, 2, num_waiting=0)
        first[0].release()
        first[0].release()
        assert room.num_held == 0
        assert [p.num_samples for p in room.take(1, 2, num_waiting=2)] == [2]

    def test_an_unbounded_queue_refuses_nothing(self) -> None:
        room = WaitingRoom(None)
        room.check_fits(64, 128)
        assert len(room.take(64, 128, num_waiting=10**6)) == 64
