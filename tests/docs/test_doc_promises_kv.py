"""docs/api.md and docs/kv-cache.md promises of the paged KV cache, checked from the outside."""

from __future__ import annotations

import pytest

import batchkit

torch = pytest.importorskip("torch")


def test_gather_refuses_a_total_tokens_that_is_not_the_sum_of_seq_lens() -> None:
    """total_tokens is sum(seq_lens): a different value is a ValueError on the torch path too (the
    CUDA kernels refuse it), never a silently ignored argument."""
    kv = batchkit.PagedKVCache(1, 8, 4, 1, 8, dtype=torch.float32)
    k = torch.randn(5, 1, 8)
    kv.scatter(0, k, k, torch.arange(4, 9))
    tables = torch.tensor([[1, 2]], dtype=torch.int32)
    lens = torch.tensor([5])
    with pytest.raises(ValueError, match="total_tokens"):
        kv.gather(0, tables, lens, total_tokens=4)
    got_k, got_v = kv.gather(0, tables, lens, total_tokens=5)
    assert torch.equal(got_k, k)
    assert torch.equal(got_v, k)


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
