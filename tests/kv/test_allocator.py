"""PagedKVAllocator: block accounting, slot mapping, sharing, prefix caching, quotas and swap."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Hashable
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import batchkit
from batchkit import BatchkitError, KVCacheExhausted, PagedKVAllocator, UnknownSequence
from batchkit.kv.prefix import PrefixCache


def check_invariants(a: PagedKVAllocator) -> None:
    """The accounting identities every operation must preserve (read through the cores)."""
    s = a.statistics()
    assert s.free_blocks + s.used_blocks + s.cached_blocks == s.total_blocks
    ref = a.pool.ref
    assert (ref >= 0).all()
    assert ref[0] == 0, "the null block is never handed out"
    free = a.pool.free_block_ids()
    evictable = a.prefix.evictable_blocks()
    assert len(set(free)) == len(free), "a block is on the free list twice"
    assert all(ref[b] == 0 for b in free)
    assert all(ref[b] == 0 for b in evictable)
    assert not set(free) & set(evictable)
    # Reference counts equal the number of resident block tables holding each block.
    held: Counter[int] = Counter()
    for sid in list(a):
        if not a.is_swapped(sid):
            table = a.block_table(sid).tolist()
            assert len(table) == a.blocks_needed(a.num_tokens(sid))
            held.update(table)
            slots = a.slot_mapping(sid)
            assert set((slots // a.block_size).tolist()) <= set(table)
    for b in range(1, a.num_blocks):
        assert ref[b] == held[b], f"block {b}: refcount {ref[b]}, held by {held[b]} tables"
    assert a.pool.num_shared == int(np.maximum(ref - 1, 0).sum()), "the shared-reference counter drifted"
    # Cache index is consistent both ways.
    for h, b, tokens in a.prefix.entries():
        assert tokens, f"block {b} is indexed under {h} but keyed otherwise"


def test_bad_arguments_are_refused() -> None:
    """Sizes and fractions are validated with messages that name the argument."""
    with pytest.raises(ValueError, match="num_blocks must be an int >= 2"):
        PagedKVAllocator(1)
    with pytest.raises(ValueError, match="block_size"):
        PagedKVAllocator(8, 0)
    with pytest.raises(ValueError, match="watermark"):
        PagedKVAllocator(8, watermark=1.0)


def test_slots_follow_the_block_table_and_null_block_is_reserved() -> None:
    """Token p lives at block_table[p // bs] * bs + p % bs; block 0 is never used."""
    a = PagedKVAllocator(16, block_size=4)
    a.allocate("s", 6)
    table = a.block_table("s")
    assert 0 not in table.tolist()
    assert a.slot_mapping("s").tolist() == [table[p // 4] * 4 + p % 4 for p in range(6)]
    slots = a.append_slots("s", 3)
    assert slots.tolist() == [a.block_table("s")[p // 4] * 4 + p % 4 for p in range(6, 9)]
    check_invariants(a)


def test_append_allocates_a_block_only_when_one_fills() -> None:
    """Appending within the last block takes no new block."""
    a = PagedKVAllocator(16, block_size=4)
    a.allocate("s", 5)
    before = a.num_free_blocks
    a.append_slots("s", 3)  # positions 5..7 fill block 2
    assert a.num_free_blocks == before
    a.append_slots("s", 1)
    assert a.num_free_blocks == before - 1


def test_batch_append_equals_one_by_one() -> None:
    """append_slots_batch gives the same slots as appending to each sequence alone."""
    a, b = PagedKVAllocator(64, 4), PagedKVAllocator(64, 4)
    for alloc in (a, b):
        for i, n in enumerate([3, 4, 1, 8]):
            alloc.allocate(i, n)
    for _ in range(6):
        got = a.append_slots_batch([0, 1, 2, 3])
        want = np.concatenate([b.append_slots(i) for i in range(4)])
        assert got.tolist() == want.tolist()
    check_invariants(a)


def test_batch_handle_survives_frees_and_row_reuse() -> None:
    """A SeqBatch handle stays correct after other sequences are freed and their rows reused."""
    a, b = PagedKVAllocator(64, 4), PagedKVAllocator(64, 4)
    for alloc in (a, b):
        for i in range(4):
            alloc.allocate(i, i + 1)
    handle = a.batch([1, 3])
    a.append_slots_batch(handle)
    b.append_slots_batch([1, 3])
    for alloc in (a, b):
        alloc.free(0)
        alloc.free(2)
        alloc.allocate(9, 5)  # takes a freed row
    assert a.append_slots_batch(handle).tolist() == b.append_slots_batch([1, 3]).tolist()
    with pytest.raises(ValueError, match="once"):
        a.batch([1, 1])
    check_invariants(a)


def test_exhaustion_is_an_error_that_changes_nothing() -> None:
    """Asking for more than exists raises KVCacheExhausted and leaves the pool as it was."""
    a = PagedKVAllocator(5, block_size=4)  # 4 usable blocks
    a.allocate("x", 12)
    before = a.statistics()
    with pytest.raises(KVCacheExhausted, match="need 2 KV blocks"):
        a.allocate("y", 5)
    assert "y" not in a
    a.append_slots("x", 4)  # the last free block
    with pytest.raises(KVCacheExhausted):
        a.append_slots_batch(["x"])
    assert a.num_tokens("x") == 16
    assert before.num_seqs == a.statistics().num_seqs
    check_invariants(a)


def test_watermark_holds_back_admission_but_not_growth() -> None:
    """Admission leaves the watermark free; running sequences may still grow into it."""
    a = PagedKVAllocator(11, block_size=1, watermark=0.2)  # 10 blocks, 2 held back
    assert a.can_allocate(8)
    assert not a.can_allocate(9)
    a.allocate("s", 8)
    a.append_slots("s", 2)  # into the watermark: allowed
    assert a.num_free_blocks == 0


def test_unknown_and_double_free_are_clear_errors() -> None:
    """Freeing twice or naming an unknown sequence raises UnknownSequence."""
    a = PagedKVAllocator(8)
    a.allocate("s", 3)
    a.free("s")
    with pytest.raises(UnknownSequence, match="not allocated"):
        a.free("s")
    with pytest.raises(UnknownSequence):
        a.append_slots("nope")
    a.allocate("t", 1)
    with pytest.raises(ValueError, match="already allocated"):
        a.allocate("t", 1)


def test_fork_shares_full_blocks_and_copies_the_partial_one_on_write() -> None:
    """After fork, a write to the shared partial block copies it first (copy-on-write)."""
    a = PagedKVAllocator(32, block_size=4)
    a.allocate("p", 6)  # blocks: full, partial
    a.fork("p", "c")
    full, partial = a.block_table("p").tolist()
    assert a.ref_count(full) == 2
    assert a.ref_count(partial) == 2
    a.append_slots("c", 1)
    copies = a.take_copies()
    assert len(copies) == 1
    assert copies[0][0] == partial
    new = copies[0][1]
    assert a.block_table("c").tolist() == [full, new]
    assert a.ref_count(partial) == 1
    assert a.take_copies() == []
    check_invariants(a)


def test_prefix_cache_reuses_blocks_and_verifies_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt sharing full blocks with a cached one reuses them; different tokens never hit."""
    a = PagedKVAllocator(64, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 111))  # 11 tokens: 2 full blocks + 3
    assert a.allocate("a", prompt) == 0
    a.mark_computed("a", len(prompt))
    a.free("a")
    assert a.statistics().cached_blocks == 2
    assert a.allocate("b", [*prompt[:8], 7, 7]) == 8
    assert a.allocate("c", [1, 2, 3, 4, 5]) == 0
    # A forged collision: every block gets the same key, but the tokens differ.
    monkeypatch.setattr(PrefixCache, "block_hash", staticmethod(lambda prev, tokens, salt: hash("forged")))
    a.allocate("e", [9, 9, 9, 9, 9])
    a.mark_computed("e", 5)
    assert a.allocate("d", [8, 8, 8, 8, 8]) == 0
    assert a.allocate("f", [9, 9, 9, 9, 9]) == 4  # the control: equal tokens under that key hit
    check_invariants(a)


def test_prefix_cache_salts_by_tenant() -> None:
    """Tenants never share cached blocks, even for identical prompts."""
    a = PagedKVAllocator(64, block_size=4, enable_prefix_caching=True)
    prompt = list(range(9))
    a.allocate("a", prompt, tenant="t1")
    a.mark_computed("a", len(prompt))
    assert a.allocate("b", prompt, tenant="t2") == 0
    assert a.allocate("c", prompt, tenant="t1") == 8


def test_cached_blocks_are_evicted_lru_when_needed() -> None:
    """Freed cached blocks are reused for new work, least recently used first."""
    a = PagedKVAllocator(5, block_size=2, enable_prefix_caching=True)  # 4 blocks
    a.allocate("a", [1, 2, 3])
    a.mark_computed("a", 3)  # 1 full block cached
    a.free("a")
    a.allocate("b", 8)  # needs all 4: evicts the cached one
    assert a.statistics().evictions == 1
    assert a.statistics().cached_blocks == 0
    check_invariants(a)


def test_blocks_become_prefix_hits_only_once_computed() -> None:
    """A block whose K/V were never written (its sequence freed, or preempted, before the step
    that fills it ran) is never served as a prefix-cache hit; computed blocks are. Fails on the
    allocator that indexed every full prompt block at admission."""
    a = PagedKVAllocator(64, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 117))  # 17 tokens: 4 full blocks + 1
    assert a.allocate("a", prompt) == 0
    a.mark_computed("a", 4)  # only the first chunk's step ran
    a.free("a")  # aborted mid-prefill
    assert a.statistics().cached_blocks == 1
    assert a.allocate("b", prompt) == 4
    a.mark_computed("b", 7)  # a partial block is not indexed
    assert a.allocate("c", prompt) == 4
    a.mark_computed("b", 17)
    assert a.allocate("d", prompt) == 16
    with pytest.raises(ValueError, match="outside"):
        a.mark_computed("d", 18)
    check_invariants(a)


def test_tenant_quota_limits_only_that_tenant() -> None:
    """A tenant over its quota gets KVCacheExhausted; others still allocate."""
    a = PagedKVAllocator(33, block_size=1, tenant_quotas={"small": 4, "half": 0.5})
    a.allocate("s1", 4, tenant="small")
    with pytest.raises(KVCacheExhausted, match="quota"):
        a.allocate("s2", 1, tenant="small")
    with pytest.raises(KVCacheExhausted, match="quota"):
        a.append_slots("s1")
    a.allocate("h", 16, tenant="half")
    a.allocate("free-for-all", 10)
    assert a.statistics().tenant_usage == {"small": 4, "half": 16, None: 10}


def test_a_prefix_cache_hit_counts_against_the_quota_of_each_sequence_holding_it() -> None:
    """A shared cached block counts once for each sequence that holds it: a second sequence on the
    same prompt that would take its tenant over its quota is refused, nothing changed (its hits
    were charged without being checked, and the tenant went over)."""
    a = PagedKVAllocator(64, block_size=4, enable_prefix_caching=True, tenant_quotas={"t": 6})
    prompt = list(range(13))  # 4 blocks
    a.allocate("s1", prompt, tenant="t")
    a.mark_computed("s1", 13)
    before = a.statistics()
    with pytest.raises(KVCacheExhausted, match="quota"):
        a.allocate("s2", prompt, tenant="t")
    after = a.statistics()
    assert (after.tenant_usage, after.used_blocks) == (before.tenant_usage, before.used_blocks) == ({"t": 4}, 4)
    a.free("s1")
    assert a.allocate("s2", prompt, tenant="t") == 12  # alone, the same prompt fits and hits the cache


@pytest.mark.parametrize("bad", [1.5, 1.5j, None, "7"])
def test_a_token_id_that_is_not_an_int_changes_nothing(bad: object) -> None:
    """Errors leave the pool as it was: a bad generated token id (read only after the slots were
    taken, before) is a ValueError with the sequence's length and blocks unchanged."""
    a = PagedKVAllocator(16, block_size=4, enable_prefix_caching=True)
    a.allocate("s", [1, 2, 3, 4])
    with pytest.raises(ValueError, match="token_ids"):
        a.append_slots("s", 1, token_ids=[bad])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="token_ids"):
        a.append_slots_batch(["s"], token_ids=[bad])  # type: ignore[list-item]
    assert (a.num_tokens("s"), a.statistics().used_blocks) == (4, 1)
    a.append_slots("s", 1, token_ids=[5])
    assert a.num_tokens("s") == 5


def test_a_batched_step_of_forked_sequences_copies_their_shared_block_once() -> None:
    """Parent and child both write after a fork: the batched step copies the shared partial block
    for one and lets the other keep it, as one append_slots after the other does (it copied it
    for both: a block more than needed, and the shared one freed); with a third holder outside
    the step, both writers copy."""
    batched = PagedKVAllocator(16, block_size=4)
    batched.allocate("p", 6)
    batched.fork("p", "c")
    one_by_one = PagedKVAllocator(16, block_size=4)
    one_by_one.allocate("p", 6)
    one_by_one.fork("p", "c")
    assert batched.can_append_slots(["p", "c"])
    slots = batched.append_slots_batch(["p", "c"]).tolist()
    assert slots == [*one_by_one.append_slots("p").tolist(), *one_by_one.append_slots("c").tolist()]
    assert batched.take_copies() == one_by_one.take_copies() == [(2, 3)]
    assert batched.statistics().used_blocks == one_by_one.statistics().used_blocks == 3
    three = PagedKVAllocator(16, block_size=4)
    three.allocate("p", 6)
    three.fork("p", "c")
    three.fork("p", "d")
    three.append_slots_batch(["p", "c"])
    assert len(three.take_copies()) == 2  # d still holds the original


def test_swap_out_and_in_round_trip() -> None:
    """swap_out frees device blocks and returns the copies; swap_in restores the sequence."""
    a = PagedKVAllocator(16, block_size=4, num_cpu_blocks=8)
    a.allocate("s", 10)
    table = a.block_table("s").tolist()
    moves = a.swap_out("s")
    assert [g for g, _ in moves] == table
    assert a.is_swapped("s")
    assert a.statistics().used_blocks == 0
    with pytest.raises(BatchkitError, match="swapped out"):
        a.append_slots("s")
    back = a.swap_in("s")
    assert [c for c, _ in back] == [c for _, c in moves]
    assert a.block_table("s").tolist() == [g for _, g in back]
    assert a.num_tokens("s") == 10
    check_invariants(a)


def test_swap_out_without_cpu_room_changes_nothing() -> None:
    """A swap_out the CPU pool cannot hold is refused before anything moves."""
    a = PagedKVAllocator(16, block_size=4, num_cpu_blocks=1)
    a.allocate("s", 10)
    with pytest.raises(KVCacheExhausted, match="CPU blocks"):
        a.swap_out("s")
    assert not a.is_swapped("s")
    check_invariants(a)


def test_fragmentation_counts_unused_tail_slots() -> None:
    """Fragmentation is the share of allocated slots holding no token."""
    a = PagedKVAllocator(16, block_size=4)
    a.allocate("s", 5)  # 2 blocks, 8 slots, 3 empty
    assert a.statistics().fragmentation == pytest.approx(3 / 8)


class AllocatorMachine(RuleBasedStateMachine):
    """Random sequences of allocate/append/fork/free/swap/release (a sliding window giving blocks
    back) with prefix caching and eviction."""

    def __init__(self) -> None:
        super().__init__()
        self.a = PagedKVAllocator(40, block_size=4, enable_prefix_caching=True, num_cpu_blocks=24)
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def _resident(self) -> list[int]:
        return [s for s in self.tokens if not self.a.is_swapped(s)]

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=24))
    def allocate(self, prompt: list[int]) -> None:
        sid = self.next_id
        self.next_id += 1
        try:
            cached = self.a.allocate(sid, prompt)
        except KVCacheExhausted:
            assert sid not in self.a
            return
        assert cached % 4 == 0
        assert cached < len(prompt)
        self.tokens[sid] = list(prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 6))
    def append(self, data: st.DataObject, n: int) -> None:
        resident = self._resident()
        if not resident:
            return
        sid = data.draw(st.sampled_from(resident))
        ids = [7] * n
        try:
            slots = self.a.append_slots(sid, n, ids)
        except KVCacheExhausted:
            return
        self.tokens[sid] += ids
        self.a.take_copies()
        table = self.a.block_table(sid).tolist()
        assert set((slots // 4).tolist()) <= set(table)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def append_batch(self, data: st.DataObject) -> None:
        resident = self._resident()
        if not resident:
            return
        sids = data.draw(st.lists(st.sampled_from(resident), min_size=1, unique=True))
        if not self.a.can_append_slots(sids):
            with pytest.raises(KVCacheExhausted):
                self.a.append_slots_batch(sids, [5] * len(sids))
            return
        handle = self.a.batch(sids)
        self.a.append_slots_batch(handle, [5] * len(sids))
        for s in sids:
            self.tokens[s].append(5)
        self.a.take_copies()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        resident = self._resident()
        if not resident:
            return
        sid = data.draw(st.sampled_from(resident))
        self.a.mark_computed(sid, data.draw(st.integers(0, len(self.tokens[sid]))))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        resident = self._resident()
        if not resident:
            return
        parent = data.draw(st.sampled_from(resident))
        child = self.next_id
        self.next_id += 1
        self.a.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        resident = self._resident()
        if not resident:
            return
        sid = data.draw(st.sampled_from(resident))
        before = self.a.block_table(sid)
        released = self.a.release_before(sid, data.draw(st.integers(0, len(self.tokens[sid]))))
        after = self.a.block_table(sid)
        assert int((after == 0).sum()) - int((before == 0).sum()) == released
        assert after[-1] != 0, "the last block is always kept"

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.a.free(sid)
        del self.tokens[sid]
        with pytest.raises(UnknownSequence):
            self.a.free(sid)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap(self, data: st.DataObject) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tokens)))
        try:
            if self.a.is_swapped(sid):
                self.a.swap_in(sid)
            else:
                self.a.swap_out(sid)
        except KVCacheExhausted:
            pass

    @invariant()
    def accounting_holds(self) -> None:
        check_invariants(self.a)
        for sid, toks in self.tokens.items():
            assert self.a.num_tokens(sid) == len(toks)

    def teardown(self) -> None:
        for sid in list(self.tokens):
            self.a.free(sid)
        s = self.a.statistics()
        assert s.used_blocks == 0, "blocks leaked"
        assert s.free_blocks + s.cached_blocks == s.total_blocks
        assert s.cpu_free_blocks == s.cpu_total_blocks
        assert s.tenant_usage == {}


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class TestNeverFits:
    """never_fits: the one check of whether a sequence could ever be admitted, with its reason."""

    def test_a_sequence_over_the_cache_less_the_watermark_never_fits(self) -> None:
        """Blocks beyond the cache less the watermark: the reason names both counts; within: None."""
        alloc = PagedKVAllocator(10, 4, watermark=0.2)  # 9 usable blocks (block 0 is null), 1 kept back
        room = alloc.total_blocks - alloc.watermark_blocks
        assert alloc.never_fits(room * 4) is None
        reason = alloc.never_fits(room * 4 + 1)
        assert reason == (
            f"needs {room + 1} KV blocks but admission has {room} (the cache's {alloc.total_blocks} blocks "
            f"less the watermark's {alloc.watermark_blocks})"
        )

    def test_max_admitted_tokens_is_the_longest_sequence_that_can_fit(self) -> None:
        """max_admitted_tokens is admission_blocks in tokens: that many fit, one more never does."""
        alloc = PagedKVAllocator(10, 4, watermark=0.2)
        assert alloc.admission_blocks == alloc.total_blocks - alloc.watermark_blocks == 8  # block 0 is null
        assert alloc.max_admitted_tokens == 32
        assert alloc.never_fits(alloc.max_admitted_tokens) is None
        assert alloc.never_fits(alloc.max_admitted_tokens + 1) is not None

    def test_a_sequence_over_its_tenants_quota_never_fits(self) -> None:
        """A tenant's quota binds before the cache does; other tenants are not held to it."""
        alloc = PagedKVAllocator(16, 4, tenant_quotas={"a": 2})
        assert alloc.never_fits(8, "a") is None
        assert alloc.never_fits(9, "a") == "needs 3 KV blocks but tenant 'a' has a quota of 2"
        assert alloc.never_fits(9, "b") is None


class TestReleaseBefore:
    """release_before: a sliding window gives back the blocks no later step reads."""

    def test_blocks_wholly_before_the_position_go_back_and_read_as_the_null_block(self) -> None:
        """Tokens 0..9 in blocks of 4: before position 9, blocks 0 and 1 (tokens 0..7) go back."""
        alloc = PagedKVAllocator(16, 4, tenant_quotas={"t": 8})
        alloc.allocate("s", 10, tenant="t")
        held = alloc.block_table("s").tolist()
        free = alloc.num_free_blocks
        assert alloc.release_before("s", 9) == 2
        assert alloc.block_table("s").tolist() == [0, 0, held[2]]
        assert alloc.num_free_blocks == free + 2
        assert alloc.statistics().tenant_usage == {"t": 1}
        assert alloc.release_before("s", 9) == 0, "given back once"
        check_invariants(alloc)

    def test_the_last_block_is_kept_and_growth_continues_after_it(self) -> None:
        """Even past every token, the block the next token may land in stays; appends go on."""
        alloc = PagedKVAllocator(16, 4)
        alloc.allocate("s", 8)
        assert alloc.release_before("s", 8) == 1
        slots = alloc.append_slots("s", 3)
        assert (slots // 4 != 0).all()
        assert alloc.num_tokens("s") == 11
        check_invariants(alloc)

    def test_free_swap_and_fork_skip_the_given_back_blocks(self) -> None:
        """Swap-out copies and swap-in takes only the held blocks; a fork shares only those;
        freeing everything leaves no block used and no tenant charged."""
        alloc = PagedKVAllocator(16, 4, num_cpu_blocks=8, tenant_quotas={"t": 8})
        alloc.allocate("s", 13, tenant="t")
        alloc.release_before("s", 8)
        copies = alloc.swap_out("s")
        assert len(copies) == 2
        assert all(gpu != 0 for gpu, _ in copies)
        assert len(alloc.swap_in("s")) == 2
        assert alloc.block_table("s")[:2].tolist() == [0, 0]
        alloc.fork("s", "c")
        assert alloc.block_table("c")[:2].tolist() == [0, 0]
        assert alloc.statistics().tenant_usage == {"t": 4}
        check_invariants(alloc)
        alloc.free("s")
        alloc.free("c")
        stats = alloc.statistics()
        assert stats.used_blocks == 0
        assert stats.tenant_usage == {}

    def test_with_prefix_caching_only_computed_blocks_go_back_and_stay_hits(self) -> None:
        """A block not yet marked computed is kept (its key is not indexed yet); once computed,
        a given-back block is still a prefix-cache hit for the next sequence."""
        alloc = PagedKVAllocator(16, 4, enable_prefix_caching=True)
        prompt = list(range(10))
        alloc.allocate("s", prompt)
        assert alloc.release_before("s", 9) == 0
        alloc.mark_computed("s", 10)
        assert alloc.release_before("s", 9) == 2
        assert alloc.allocate("t", prompt) == 8
        check_invariants(alloc)

    def test_a_negative_position_is_refused(self) -> None:
        alloc = PagedKVAllocator(16, 4)
        alloc.allocate("s", 4)
        with pytest.raises(ValueError, match="num_tokens must be >= 0"):
            alloc.release_before("s", -1)


def test_a_swapped_out_sequence_refuses_appends_with_batchkit_error_and_keeps_the_pool() -> None:
    alloc = batchkit.PagedKVAllocator(8, 4, num_cpu_blocks=8)
    alloc.allocate("s", 6)
    alloc.swap_out("s")
    before = alloc.statistics()
    with pytest.raises(batchkit.BatchkitError, match="swapped out"):
        alloc.append_slots("s", 1)
    assert alloc.statistics() == before
    alloc.swap_in("s")
    assert alloc.num_tokens("s") == 6


def test_a_negative_token_count_and_a_quota_fraction_above_one_are_refused() -> None:
    """blocks_needed(-1) is a mistake, not 0 blocks; a float quota is a fraction of the pool, so
    1.5 means nothing (an int names blocks)."""
    alloc = batchkit.PagedKVAllocator(8, 4)
    assert alloc.blocks_needed(0) == 0
    assert alloc.blocks_needed(5) == 2
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        alloc.blocks_needed(-1)
    with pytest.raises(ValueError, match="fraction of the pool"):
        batchkit.PagedKVAllocator(8, 4, tenant_quotas={"a": 1.5})
    ok = batchkit.PagedKVAllocator(8, 4, tenant_quotas={"a": 0.5, "b": 3})
    assert (ok.quota_of("b"), ok.quota_of("c")) == (3, None)


def test_a_token_lives_in_the_slot_its_block_table_gives() -> None:
    """slot = block_table[p // block_size] * block_size + p % block_size, for every position."""
    alloc = PagedKVAllocator(num_blocks=64, block_size=4)
    alloc.allocate("s", 10)
    alloc.append_slots("s", 5)
    table, slots = alloc.block_table("s"), alloc.slot_mapping("s")
    assert len(slots) == 15
    assert all(slots[p] == table[p // 4] * 4 + p % 4 for p in range(15))
    assert 0 not in set(table.tolist())  # block 0 is the null block


@pytest.mark.parametrize("length", [1, 3, 4, 5, 16, 17])
def test_waste_is_at_most_block_size_minus_one_slots_per_sequence(length: int) -> None:
    """Only the last block can be partly empty: fragmentation = unused slots in last blocks over
    allocated slots, at most (block_size - 1) per sequence."""
    alloc = PagedKVAllocator(num_blocks=64, block_size=4)
    alloc.allocate("a", length)
    alloc.allocate("b", 4)
    s = alloc.statistics()
    unused = -length % 4
    assert s.used_blocks == math.ceil(length / 4) + 1
    assert s.fragmentation == pytest.approx(unused / (s.used_blocks * 4))
    assert unused <= 4 - 1


def _snapshot(alloc: PagedKVAllocator, names: list[str]) -> tuple[Any, ...]:
    tables: dict[str, Any] = {}
    for name in names:
        try:
            swapped = alloc.is_swapped(name)
            table = None if swapped else tuple(alloc.block_table(name).tolist())
            tables[name] = (swapped, alloc.num_tokens(name), table)
        except batchkit.UnknownSequence:
            tables[name] = None
    return (alloc.statistics(), tables, alloc.num_free_blocks)


@pytest.mark.parametrize("seed", range(40))
def test_errors_leave_the_pool_as_it_was_and_blocks_always_add_up(seed: int) -> None:
    """Random operations (many of them invalid: unknown ids, double frees, too-long prompts,
    swaps without CPU room, over-quota tenants): every refused one changes nothing, and
    free + used + cached == total after each."""
    rng = random.Random(seed)
    quotas: list[dict[Hashable, int | float] | None] = [None, {"t": 3}, {"t": 0.5}]
    alloc = PagedKVAllocator(
        num_blocks=rng.randint(4, 24),
        block_size=rng.choice([1, 2, 4]),
        watermark=rng.choice([0.0, 0.1]),
        enable_prefix_caching=rng.random() < 0.7,
        num_cpu_blocks=rng.choice([0, 4, 16]),
        tenant_quotas=rng.choice(quotas),
    )
    names = [f"s{i}" for i in range(6)]
    refused = 0
    for _ in range(120):
        op = rng.choice(["allocate", "append", "append_batch", "free", "fork", "mark", "swap_out", "swap_in", "copies"])
        seq, other = rng.choice(names), rng.choice(names)
        before = _snapshot(alloc, names)
        try:
            if op == "allocate":
                prompt = [rng.randint(0, 3) for _ in range(rng.randint(0, 20))]
                alloc.allocate(seq, prompt, tenant=rng.choice([None, "t"]))
            elif op == "append":
                alloc.append_slots(seq, rng.randint(0, 3))
            elif op == "append_batch":
                alloc.append_slots_batch(rng.sample(names, rng.randint(1, 3)))
            elif op == "free":
                alloc.free(seq)
            elif op == "fork":
                alloc.fork(seq, other)
            elif op == "mark":
                alloc.mark_computed(seq, rng.randint(0, 25))
            elif op == "swap_out":
                alloc.swap_out(seq)
            elif op == "swap_in":
                alloc.swap_in(seq)
            else:
                alloc.take_copies()
        except (batchkit.BatchkitError, ValueError):
            refused += 1
            changed = _snapshot(alloc, names) != before
            assert not changed, f"a refused {op} changed the pool"
        s = alloc.statistics()
        assert s.free_blocks + s.used_blocks + s.cached_blocks == s.total_blocks
    assert refused > 0


def test_an_error_is_one_of_the_named_types() -> None:
    """KVCacheExhausted, UnknownSequence (unknown or freed twice), InvalidBlock, ValueError."""
    alloc = PagedKVAllocator(num_blocks=8, block_size=4)
    with pytest.raises(KVCacheExhausted):
        alloc.allocate("big", 1000)
    alloc.allocate("s", 3)
    alloc.free("s")
    with pytest.raises(batchkit.UnknownSequence):
        alloc.free("s")
    with pytest.raises(batchkit.InvalidBlock):
        alloc.ref_count(99)
    alloc.allocate("t", 3)
    with pytest.raises(ValueError, match="already allocated"):
        alloc.allocate("t", 3)


def test_a_prompt_entirely_in_the_cache_still_leaves_a_token_to_compute() -> None:
    """At least one prompt token is always left to compute, so that the step yields logits: a
    block-aligned prompt whose every block is cached reuses all but its last block."""
    alloc = PagedKVAllocator(num_blocks=64, block_size=16, enable_prefix_caching=True)
    prompt = list(range(32))
    alloc.allocate("a", prompt)
    alloc.mark_computed("a", 32)
    cached = alloc.allocate("b", prompt)
    assert 0 < cached < len(prompt)
    assert cached == 16
    longer = [*prompt, 99]
    assert alloc.allocate("c", longer) == 32


def test_the_guide_example_reuses_two_full_blocks() -> None:
    """req-2 (req-1's 40 tokens and two more) reuses req-1's two full blocks: 32 tokens."""
    alloc = PagedKVAllocator(num_blocks=4096, block_size=16, watermark=0.01, enable_prefix_caching=True)
    alloc.allocate("req-1", list(range(40)))
    alloc.mark_computed("req-1", 40)
    assert alloc.allocate("req-2", [*range(40), 7, 7]) == 32
    assert alloc.statistics().prefix_hits == 32


def test_swap_out_frees_device_blocks_and_swap_in_returns_cpu_to_device_copies() -> None:
    """swap_out returns (device, cpu) pairs and frees the device blocks; swap_in returns
    (cpu, device) pairs onto the sequence's new block table."""
    alloc = PagedKVAllocator(num_blocks=16, block_size=4, num_cpu_blocks=8)
    alloc.allocate("s", 10)
    table = alloc.block_table("s").tolist()
    used = alloc.statistics().used_blocks
    out = alloc.swap_out("s")
    assert [d for d, _ in out] == table
    assert alloc.is_swapped("s")
    s = alloc.statistics()
    assert (s.used_blocks, s.cpu_free_blocks) == (used - 3, 8 - 3)
    back = alloc.swap_in("s")
    assert [c for c, _ in back] == [c for _, c in out]
    assert [d for _, d in back] == alloc.block_table("s").tolist()
    assert alloc.num_tokens("s") == 10
    s = alloc.statistics()
    assert (s.swaps_out, s.swaps_in, s.cpu_free_blocks) == (1, 1, 8)


def test_a_quota_is_an_int_or_a_fraction_of_the_pool_and_binds_only_its_tenant() -> None:
    alloc = PagedKVAllocator(num_blocks=17, block_size=4, tenant_quotas={"paid": 2, "free-tier": 0.25})
    assert (alloc.quota_of("paid"), alloc.quota_of("free-tier"), alloc.quota_of("other")) == (2, 4, None)
    with pytest.raises(KVCacheExhausted):
        alloc.allocate("p", 9, tenant="paid")  # 3 blocks over a quota of 2
    alloc.allocate("p", 8, tenant="paid")
    alloc.allocate("o", 9, tenant="other")
    assert alloc.statistics().tenant_usage["paid"] == 2


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda a: a.append_slots("s", 1.5), "n"),
        (lambda a: a.append_slots("s", True), "n"),
        (lambda a: a.can_append_slots(["s"], 0.5), "n"),
        (lambda a: a.allocate("t", 2.5), "prompt"),
        (lambda a: a.mark_computed("s", 1.5), "num_tokens"),
        (lambda a: a.blocks_needed(2.5), "num_tokens"),
        (lambda a: a.can_allocate(1.5), "num_tokens"),
        (lambda a: a.slot_mapping("s", 0.5, 2), "start"),
    ],
)
def test_a_token_count_that_is_not_an_int_changes_nothing(call: Any, name: str) -> None:
    """ "Every method checks its preconditions before changing anything": a fractional (or bool)
    count is a ValueError naming it. append_slots(seq, 1.5) handed out a slot of the null block 0
    and counted a token the caller never wrote."""
    a = batchkit.PagedKVAllocator(16, 4)
    a.allocate("s", [1, 2, 3])
    before = (a.num_tokens("s"), a.statistics())
    with pytest.raises(ValueError, match=name):
        call(a)
    assert (a.num_tokens("s"), a.statistics()) == before
    assert a.append_slots("s", cast(Any, np.int64(2))).tolist() == [7, 8]  # numpy ints are ints
    assert a.allocate("u", cast(Any, np.int64(3))) == 0
