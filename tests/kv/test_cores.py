"""The sans-I/O cores under PagedKVAllocator, each on its own: BlockPool, BlockTables,
PrefixCache, SwapSpace and TenantQuotas."""

from __future__ import annotations

import numpy as np
import pytest

from batchkit import KVCacheExhausted
from batchkit.kv.blocks import NULL_BLOCK, BlockPool
from batchkit.kv.prefix import PrefixCache
from batchkit.kv.quotas import TenantQuotas
from batchkit.kv.swap import SwapSpace
from batchkit.kv.tables import BlockTables


def blocks(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int32)


# ---------------------------------------------------------------------- BlockPool


def test_pool_hands_out_low_ids_first_and_never_the_null_block() -> None:
    """The free stack gives blocks 1, 2, 3, ... in order; block 0 is never on it."""
    pool = BlockPool(5)
    assert pool.total_blocks == 4
    assert pool.num_free == 4
    assert NULL_BLOCK not in pool.free_block_ids()
    assert pool.pop_free(3).tolist() == [1, 2, 3]
    assert pool.num_free == 1


def test_pool_release_returns_only_blocks_nobody_holds() -> None:
    """release drops one reference each and hands back the blocks whose last reference went;
    they are on no list until pushed back."""
    pool = BlockPool(5)
    got = pool.pop_free(2)
    pool.hold(got)
    pool.share(got[:1])  # block 1 now has two holders
    assert pool.num_shared == 1
    zero = pool.release(got)
    assert zero.tolist() == [2]
    assert pool.ref[1] == 1
    assert pool.num_shared == 0
    assert pool.num_free == 2
    pool.push_free(zero)
    assert pool.num_free == 3
    assert pool.pop_free(1).tolist() == [2], "a block pushed back is the next one out"


def test_pool_share_of_an_unheld_block_holds_it_without_sharing() -> None:
    """A block with no reference (a cached block coming back) is held by share, not shared."""
    pool = BlockPool(4)
    pool.share([3])
    assert pool.ref[3] == 1
    assert pool.num_shared == 0
    assert pool.num_used == 1


# ---------------------------------------------------------------------- BlockTables


def test_tables_map_positions_to_slots() -> None:
    """Token p of a row lives at table[p // bs] * bs + p % bs."""
    t = BlockTables(4)
    row = t.new_row()
    t.set_blocks(row, [7, 3], 6)
    assert t.blocks(row).tolist() == [7, 3]
    slots = t.slots(np.array([row]), np.array([2], dtype=np.int64), 4)
    assert slots.tolist() == [30, 31, 12, 13]


def test_tables_add_blocks_in_order_and_grow_columns() -> None:
    """add_blocks appends each row's share of the blocks in order, widening the array as needed."""
    t = BlockTables(2)
    r0, r1 = t.new_row(), t.new_row()
    t.set_blocks(r0, [1], 2)
    t.set_blocks(r1, [2], 1)
    t.add_blocks(np.array([r0, r1]), np.array([10, 1]), np.arange(3, 14, dtype=np.int32))
    assert t.blocks(r0).tolist() == [1, *range(3, 13)]
    assert t.blocks(r1).tolist() == [2, 13]
    t.add_blocks(np.array([r1]), None, blocks(20))
    assert t.blocks(r1).tolist() == [2, 13, 20]


def test_tables_row_slots_agree_with_slots() -> None:
    """row_slots (one row, plain ints) gives the same int64 slots as slots, for no position,
    one position and runs that cross block boundaries."""
    t = BlockTables(4)
    row = t.new_row()
    t.set_blocks(row, [7, 3, 9], 12)
    for start in range(12):
        for count in range(12 - start + 1):
            got = t.row_slots(row, start, count)
            want = t.slots(np.array([row]), np.array([start], dtype=np.int64), count)
            assert got.dtype == np.int64
            assert got.tolist() == want.tolist(), (start, count)


def test_tables_extend_row_appends_in_order_and_grows_columns() -> None:
    """extend_row appends blocks after the row's last one, widening the array as needed and
    leaving other rows alone."""
    t = BlockTables(2)
    r0, r1 = t.new_row(), t.new_row()
    t.set_blocks(r0, [1], 2)
    t.set_blocks(r1, [2], 1)
    t.extend_row(r0, 1, np.arange(3, 13, dtype=np.int32))
    assert t.blocks(r0).tolist() == [1, *range(3, 13)]
    assert t.blocks(r1).tolist() == [2]
    t.extend_row(r1, 1, blocks(20))
    assert t.blocks(r1).tolist() == [2, 20]


def test_tables_recycle_released_rows_empty() -> None:
    """A released row comes back from new_row with no blocks and no tokens; many rows grow
    the arrays without losing the old ones."""
    t = BlockTables(4)
    rows = [t.new_row() for _ in range(20)]
    t.set_blocks(rows[3], [5, 6], 5)
    t.release_row(rows[3])
    again = t.new_row()
    assert again == rows[3]
    assert t.blocks(again).tolist() == []
    assert int(t.lens[again]) == 0
    assert (t.table[again] == NULL_BLOCK).all()


def test_tables_detach_keeps_counts() -> None:
    """A detached (swapped-out) row points at the null block but keeps its counts; attach
    gives it new blocks."""
    t = BlockTables(4)
    row = t.new_row()
    t.set_blocks(row, [4, 5], 7)
    t.detach(row)
    assert t.blocks(row).tolist() == [0, 0]
    assert int(t.lens[row]) == 7
    t.attach(row, blocks(8, 9))
    assert t.blocks(row).tolist() == [8, 9]


# ---------------------------------------------------------------------- PrefixCache


def test_prefix_registers_only_computed_full_blocks() -> None:
    """mark_computed indexes the full blocks among the computed tokens, and lookup finds them,
    always leaving one prompt token to compute."""
    cache = PrefixCache(2)
    keys = cache.new_keys([1, 2, 3, 4, 5], None, [])
    assert len(cache) == 0, "keyed is not indexed"
    cache.mark_computed(keys, blocks(7, 8, 9), 3)
    assert keys.num_indexed == 1
    assert len(cache) == 1
    cache.mark_computed(keys, blocks(7, 8, 9), 5)
    assert len(cache) == 2
    assert cache.lookup([1, 2, 3, 4, 5], None)[0] == [7, 8]
    assert cache.lookup([1, 2, 3, 4], None)[0] == [7], "the last token is always left to compute"
    assert cache.lookup([1, 2, 3, 4, 5], "other tenant")[0] == []


def test_prefix_lookup_checks_tokens_on_a_hash_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two different blocks under one key: the second is not served the first one's block."""
    monkeypatch.setattr(PrefixCache, "block_hash", staticmethod(lambda prev, tokens, salt: 42))
    cache = PrefixCache(2)
    cache.mark_computed(cache.new_keys([1, 1, 0], None, []), blocks(5, 6), 2)
    assert cache.lookup([1, 1, 0], None)[0] == [5]
    assert cache.lookup([2, 2, 0], None)[0] == []


def test_prefix_parks_cached_blocks_and_evicts_them_lru() -> None:
    """Released cached blocks wait on an LRU list (uncached ones go back); evict hands out the
    least recently released first and forgets it; revive takes one off the list."""
    cache = PrefixCache(1)
    cache.mark_computed(cache.new_keys([1, 2, 3], None, []), blocks(4, 5, 6), 3)
    rest = cache.park(blocks(6, 9, 4))
    assert rest.tolist() == [9]
    cache.park(blocks(5))
    assert cache.evictable_blocks() == [6, 4, 5]
    cache.revive(4)
    assert cache.evict(1) == [6]
    assert 6 not in cache
    assert cache.evictions == 1
    assert cache.num_evictable == 1
    assert {b for _, b, _ in cache.entries()} == {4, 5}


def test_prefix_keys_keep_no_token_list() -> None:
    """A sequence's keys hold one key per full block, the tokens of its partial last block and
    of full blocks not yet indexed, and nothing more once its blocks are indexed; tokens arriving
    one by one key the same blocks as the same tokens given at once."""
    cache = PrefixCache(4)
    keys = cache.new_keys(list(range(10)), "t", [])
    assert (len(keys.hashes), len(keys.pending), keys.tail) == (2, 2, [8, 9])
    cache.mark_computed(keys, blocks(1, 2, 3), 10)
    assert (keys.num_indexed, keys.pending) == (2, [])
    one_by_one = cache.new_keys([0], "t", [])
    for t in range(1, 10):
        cache.extend(one_by_one, [t])
    assert one_by_one.hashes == keys.hashes
    fork = one_by_one.copy()
    cache.extend(fork, [10, 11])
    assert len(fork.hashes) == 3
    assert len(one_by_one.hashes) == 2, "a copy is independent"


def test_prefix_keys_do_not_depend_on_how_tokens_arrive() -> None:
    """Tokens given to extend in pieces of any size (inside one block, filling it exactly, or
    spanning several) leave the same keys, pending blocks and tail as all of them at once."""
    cache = PrefixCache(4)
    tokens = list(range(30))
    whole = cache.new_keys(tokens, "t", [])
    for pieces in ([1, 1, 2, 9, 3, 1, 13], [4, 4, 4, 4, 4, 4, 4, 2], [3, 27], [1] * 30):
        keys = cache.new_keys([], "t", [])
        i = 0
        for size in pieces:
            cache.extend(keys, tokens[i : i + size])
            i += size
        assert i == len(tokens)
        assert (keys.hashes, keys.pending, keys.tail) == (whole.hashes, whole.pending, whole.tail), pieces


def test_prefix_counts_hit_rate() -> None:
    """hit_rate is cached prompt tokens over prompt tokens looked up."""
    cache = PrefixCache(4)
    assert cache.hit_rate == 0.0
    cache.count_lookup(10, 8)
    cache.count_lookup(10, 0)
    assert cache.hit_rate == pytest.approx(0.4)


# ---------------------------------------------------------------------- SwapSpace


def test_swap_space_hands_out_and_takes_back_cpu_blocks() -> None:
    """swap_out takes CPU blocks (0 first) and counts; swap_in and discard give them back."""
    space = SwapSpace(4)
    assert space.can_swap_out(4)
    assert not space.can_swap_out(5)
    cpu = space.swap_out(3)
    assert cpu == [0, 1, 2]
    assert (space.num_free, space.num_swapped, space.swaps_out) == (1, 1, 1)
    space.swap_in(cpu)
    assert (space.num_free, space.num_swapped, space.swaps_in) == (4, 0, 1)
    space.discard(space.swap_out(2))
    assert (space.num_free, space.num_swapped, space.swaps_in) == (4, 0, 1)


# ---------------------------------------------------------------------- TenantQuotas


def test_quotas_charge_refund_and_check() -> None:
    """A tenant may take blocks up to its quota (an int or a fraction of the pool); past it,
    check raises KVCacheExhausted naming the tenant; tenants without a quota are unlimited."""
    q = TenantQuotas({"a": 3, "b": 0.5}, total_blocks=10)
    assert q
    assert q.quota_of("b") == 5
    assert q.quota_of("c") is None
    q.charge("a", 3)
    assert not q.allows("a", 1)
    with pytest.raises(KVCacheExhausted, match="tenant 'a' would hold 4 blocks, over its quota of 3"):
        q.check("a", 1)
    q.check("c", 1000)
    q.refund("a", 3)
    assert q.usage() == {}
    assert q.usage_of("a") == 0


def test_quotas_refuse_negative_values() -> None:
    """A negative quota is a ValueError naming the tenant."""
    with pytest.raises(ValueError, match=r"tenant_quotas\['x'\] must be >= 0"):
        TenantQuotas({"x": -1}, total_blocks=10)
    assert not TenantQuotas(None, total_blocks=10)
