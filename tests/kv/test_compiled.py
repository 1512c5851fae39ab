"""batchkit's custom operators for compiled steps: the KV write and paged attention."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from batchkit.kv import compiled
from batchkit.kv.attention import plan_attention, planned_attention
from batchkit.kv.ops import write_slots

LAYERS, BLOCKS, BLOCK, HEADS, KV_HEADS, DIM = 2, 8, 4, 4, 2, 8


def _cache() -> torch.Tensor:
    return torch.randn(LAYERS, 2, BLOCKS, BLOCK, KV_HEADS, DIM)


def test_write_kv_writes_one_layer_in_place() -> None:
    """write_kv writes the rows at their slots of the layer named, and nothing else."""
    kv = _cache()
    expected = kv.clone()
    key, value = torch.randn(3, KV_HEADS, DIM), torch.randn(3, KV_HEADS, DIM)
    slots = torch.tensor([0, 5, 17])
    write_slots(expected[1, 0], expected[1, 1], key, value, slots)
    torch.ops.batchkit.write_kv(kv, 1, key, value, slots)
    assert torch.equal(kv, expected)


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 3, 1]])
def test_paged_attention_equals_planned_attention(query_lens: list[int]) -> None:
    """The operator is planned_attention over the plan set for the thread: decodes alone (one
    group) and decodes beside a prefill chunk (two groups)."""
    kv = _cache()
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0]], dtype=torch.int32)
    seq_lens, q_lens = torch.tensor([9, 7, 5]), torch.tensor(query_lens)
    plan = plan_attention(tables, seq_lens, q_lens, BLOCK)
    query = torch.randn(sum(query_lens), HEADS, DIM)
    with compiled.attention_plan(plan):
        out = torch.ops.batchkit.paged_attention(query, kv, 1, DIM**-0.5)
    torch.testing.assert_close(out, planned_attention(query, kv[1, 0], kv[1, 1], plan))


def test_the_operators_pass_torch_library_opcheck() -> None:
    """The schemas (the cache declared mutated), fake kernels and dispatch agree with the real ones."""
    kv = _cache()
    slots = torch.tensor([2, 9])
    key, value = torch.randn(2, KV_HEADS, DIM), torch.randn(2, KV_HEADS, DIM)
    torch.library.opcheck(torch.ops.batchkit.write_kv.default, (kv, 0, key, value, slots))
    plan = plan_attention(
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 6]), torch.ones(2, dtype=torch.long), BLOCK
    )
    query = torch.randn(2, HEADS, DIM)
    with compiled.attention_plan(plan):
        torch.library.opcheck(torch.ops.batchkit.paged_attention.default, (query, kv, 0, DIM**-0.5))


def test_paged_attention_outside_a_plan_says_where_it_runs() -> None:
    """Called with no plan set in the thread, the operator names the context it needs."""
    with pytest.raises(RuntimeError, match="attention_plan"):
        torch.ops.batchkit.paged_attention(torch.randn(1, HEADS, DIM), _cache(), 0, 1.0)
