"""The scratch steps a compiled step is warmed on (batchkit.models._scratch)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


@pytest.mark.parametrize("shape", [(30, 64, 3, 16), (2, 5, 7, 11), (4, 13, 17, 4)])
def test_one_step_of_each_shape_class_with_sizes_that_equal_nothing_else(shape: tuple[int, int, int, int]) -> None:
    """Decodes alone, one decode, a sampled prompt, an unsampled chunk and prompts beside
    decodes; every size above 1 differs from the others and from the cache's dimensions, and
    each step plans and fits its scratch cache."""
    from batchkit.kv.attention import plan_attention
    from batchkit.kv.cache import PagedKVCache
    from batchkit.models._scratch import scratch_steps

    layers, head_dim, kv_heads, block_size = shape
    like = PagedKVCache(layers, 3, block_size, kv_heads, head_dim)
    cache, steps = scratch_steps(like)
    assert cache.kv.shape[:2] == like.kv.shape[:2]
    assert cache.kv.shape[3:] == like.kv.shape[3:]
    sizes = [(step.num_tokens, len(step.sample_indices)) for step in steps]
    decodes, prompt, (tokens, rows) = sizes[0][0], sizes[2][0], sizes[4]
    assert sizes == [(decodes, decodes), (1, 1), (prompt, 1), (prompt, 0), (tokens, rows)]
    free = [decodes, prompt, tokens, rows]
    assert min(free) >= 2
    assert tokens > rows
    assert len({*free, cache.num_blocks}) == 5
    assert not {*free, cache.num_blocks} & set(like.kv.shape)
    for step in steps:
        plan_attention(step.block_tables, step.seq_lens, step.query_lens, cache.block_size)
        assert int(step.slot_mapping.min()) > 0  # block 0 is left alone
        assert int(step.slot_mapping.max()) < cache.num_blocks * block_size
        assert len(set(step.slot_mapping.tolist())) == step.num_tokens
        assert step.query_start[-1] == step.num_tokens
