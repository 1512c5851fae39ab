"""Planned paged attention (metadata built once per step) against the plain reference."""

from __future__ import annotations

from typing import Any

import pytest

from _support import scattered_pages
from batchkit.kv.attention import plan_attention, planned_attention
from batchkit.kv.ops import paged_attention

torch = pytest.importorskip("torch")


def _case(
    seed: int, q_lens: list[int], ctx: list[int], heads: int = 4, kv_heads: int = 2, bs: int = 4
) -> tuple[Any, ...]:
    """Random paged K/V with each sequence's blocks scattered over the pool (float64)."""
    return scattered_pages(seed, q_lens, ctx, heads=heads, kv_heads=kv_heads, bs=bs)


@pytest.mark.parametrize(
    ("q_lens", "ctx"),
    [
        ([1], [1]),
        ([1, 1, 1], [5, 1, 12]),
        ([7], [7]),
        ([3, 1, 5, 1], [10, 9, 5, 2]),
        ([1, 16, 2], [33, 20, 2]),
    ],
)
def test_planned_attention_equals_the_reference(q_lens: list[int], ctx: list[int]) -> None:
    """Decodes, prefill chunks and their mix (GQA, contexts spread over scattered blocks): the
    planned attention equals ops.paged_attention, the reference, to float64 rounding."""
    q, k, v, tables, seq_lens, query_lens = _case(sum(ctx), q_lens, ctx)
    plan = plan_attention(tables, seq_lens, query_lens, block_size=4)
    got = planned_attention(q, k, v, plan)
    want = paged_attention(q, k, v, tables, seq_lens, query_lens)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_decodes_read_their_own_kv_head_in_every_grouping(heads: int, kv_heads: int) -> None:
    """Decodes run as one SDPA call per (sequence, KV head) over that head's query heads: for
    every grouping of query heads over KV heads, alone and beside a prefill chunk, each query
    head reads its own KV head (the reference, to float64 rounding)."""
    for q_lens, ctx in (([1, 1, 1, 1], [3, 40, 17, 1]), ([1, 5, 1], [22, 5, 9])):
        q, k, v, tables, seq_lens, query_lens = _case(11, q_lens, ctx, heads=heads, kv_heads=kv_heads)
        plan = plan_attention(tables, seq_lens, query_lens, block_size=4)
        got = planned_attention(q, k, v, plan)
        want = paged_attention(q, k, v, tables, seq_lens, query_lens)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_one_plan_serves_every_layer() -> None:
    """A plan depends only on tables and lengths: reused with another layer's K/V and query it
    still equals the reference."""
    q, k, v, tables, seq_lens, query_lens = _case(1, [2, 1], [6, 9])
    plan = plan_attention(tables, seq_lens, query_lens, block_size=4)
    for layer in range(3):
        k2, v2, q2 = k * (layer + 1), v - layer, q.flip(0)
        torch.testing.assert_close(
            planned_attention(q2, k2, v2, plan), paged_attention(q2, k2, v2, tables, seq_lens, query_lens)
        )


def test_plan_refuses_inconsistent_lengths() -> None:
    """More new tokens than context, an empty context, or a query that does not match the plan
    are clear ValueErrors."""
    tables = torch.ones(1, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="new tokens"):
        plan_attention(tables, torch.tensor([2]), torch.tensor([3]), 4)
    with pytest.raises(ValueError, match="new tokens"):
        plan_attention(tables, torch.tensor([0]), torch.tensor([1]), 4)
    with pytest.raises(ValueError, match="same sequences"):
        plan_attention(tables, torch.tensor([2, 2]), torch.tensor([1, 1]), 4)
    plan = plan_attention(tables, torch.tensor([3]), torch.tensor([2]), 4)
    with pytest.raises(ValueError, match="plan was made for 2"):
        planned_attention(torch.zeros(3, 2, 4), torch.zeros(4, 4, 1, 4), torch.zeros(4, 4, 1, 4), plan)


def test_low_precision_attention_on_cuda_and_on_cpus_with_amx_only() -> None:
    from batchkit._cpu import has_amx
    from batchkit.kv.attention import low_precision_attention

    assert low_precision_attention(torch.device("cuda", 0))
    assert low_precision_attention(torch.device("cpu")) is has_amx()
    assert has_amx(frozenset({"avx512_bf16", "amx_bf16", "amx_tile"}))
    assert not has_amx(frozenset({"avx512_bf16", "avx2"}))


@pytest.mark.parametrize("as_they_are", [True, False])
def test_bfloat16_decodes_never_copy_their_pages_to_float32(as_they_are: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where low_precision_attention says so (CUDA, a CPU with AMX) bfloat16 query and pages go
    to SDPA as they are (it accumulates in float32); elsewhere decodes are two bfloat16 matmuls
    with a float32 softmax, SDPA's slow bfloat16 kernel left out. Either way no dtype copy of a
    layer's pages is made, and the result is as close to the float32 truth as an upcast one."""
    from batchkit.kv import attention

    monkeypatch.setattr(attention, "low_precision_attention", lambda device: as_they_are)
    q, k, v, tables, seq_lens, query_lens = _case(3, [1, 1, 1], [9, 30, 17])
    plan = plan_attention(tables, seq_lens, query_lens, block_size=4)
    truth = planned_attention(q, k, v, plan)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        got = planned_attention(qb, kb, vb, plan)
    ops = prof.key_averages(group_by_input_shape=True)
    width, head_dim = int(seq_lens.max() + 3) // 4 * 4, q.shape[-1]  # the pages: [S, width, Hkv, head_dim]
    copied = [e.input_shapes[0] for e in ops if e.key == "aten::_to_copy"]
    assert not [s for s in copied if s and width in s and s[-1] == head_dim], copied
    assert ("aten::scaled_dot_product_attention" in {e.key for e in ops}) is as_they_are
    assert got.dtype == torch.bfloat16
    upcast = paged_attention(qb, kb, vb, tables, seq_lens, query_lens).double()
    assert float((got.double() - truth).abs().max()) <= 2 * float((upcast - truth).abs().max()) + 1e-2


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 1)])
def test_bfloat16_decodes_by_matmul_follow_the_reference(
    heads: int, kv_heads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bfloat16 matmul decodes (a CPU without AMX) for every grouping of query heads over KV
    heads, alone and beside a prefill chunk (which still goes to SDPA on a float32 copy): each
    query head reads its own KV head, within bfloat16 rounding of the float64 reference."""
    from batchkit.kv import attention

    monkeypatch.setattr(attention, "low_precision_attention", lambda device: False)
    for q_lens, ctx in (([1, 1, 1, 1], [3, 40, 17, 1]), ([1, 5, 1], [22, 5, 9])):
        q, k, v, tables, seq_lens, query_lens = _case(7, q_lens, ctx, heads=heads, kv_heads=kv_heads)
        want = paged_attention(q, k, v, tables, seq_lens, query_lens)
        plan = plan_attention(tables, seq_lens, query_lens, block_size=4)
        got = planned_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), plan)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=0, atol=0.05)
