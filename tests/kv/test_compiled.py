"""batchkit's custom operators for compiled steps: the KV write and paged attention."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from batchkit.kv import compiled, native
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


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [1, 3, 1]])
def test_the_native_operators_agree_with_batchkits_and_pass_opcheck(native_on: None, query_lens: list[int]) -> None:
    """With the native extension built, torch.ops.batchkit_native's write, attention and linear
    answer as batchkit's operators and F.linear do, and their schemas and fake kernels pass
    opcheck: decodes alone (the kernel's, in C++) and decodes beside a prefill chunk (Python's)."""
    kv = _cache()
    tables = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 0]], dtype=torch.int32)
    plan = plan_attention(tables, torch.tensor([9, 7, 5]), torch.tensor(query_lens), BLOCK)
    query = torch.randn(sum(query_lens), HEADS, DIM)
    with compiled.attention_plan(plan):
        got = torch.ops.batchkit_native.paged_attention(query, kv, 1, DIM**-0.5)
        want = torch.ops.batchkit.paged_attention(query, kv, 1, DIM**-0.5)
        torch.library.opcheck(torch.ops.batchkit_native.paged_attention.default, (query, kv, 0, DIM**-0.5))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    key, value, slots = torch.randn(2, KV_HEADS, DIM), torch.randn(2, KV_HEADS, DIM), torch.tensor([2, 9])
    torch.library.opcheck(torch.ops.batchkit_native.write_kv.default, (kv, 0, key, value, slots))
    x, weight = torch.randn(3, DIM), torch.randn(5, DIM)
    try:
        torch.library.opcheck(torch.ops.batchkit_native.linear.default, (x, weight, 11))
    finally:
        native.drop_linear(11)


def test_native_attention_runs_decodes_alone_in_cpp_and_forgets_them_after_the_step(native_on: None) -> None:
    """Inside native.decodes(...) the operator needs no Python plan (the kernel runs the decodes
    in C++); after the block it goes to batchkit::paged_attention again, which needs one."""
    kv = _cache()
    tables, lens = torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([9, 7])
    query = torch.randn(2, HEADS, DIM)
    with native.decodes(tables, lens):
        got = torch.ops.batchkit_native.paged_attention(query, kv, 1, DIM**-0.5)
    plan = plan_attention(tables, lens, torch.ones(2, dtype=torch.long), BLOCK)
    torch.testing.assert_close(got, planned_attention(query, kv[1, 0], kv[1, 1], plan), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="attention_plan"):
        torch.ops.batchkit_native.paged_attention(query, kv, 1, DIM**-0.5)
