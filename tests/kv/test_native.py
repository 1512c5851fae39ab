"""The native CPU decode attention (batchkit.kv.native) against the torch path it replaces.

The kernel is built once per test session (about 30 s the first time, then loaded from torch's
extensions cache), and each test turns it on for itself only: other tests keep the torch path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from _support import scattered_pages
from batchkit.kv import native
from batchkit.kv.attention import plan_attention, planned_attention
from batchkit.kv.ops import paged_attention

torch = pytest.importorskip("torch")


def _pages(
    seed: int, ctx: list[int], dtype: Any, heads: int = 6, kv_heads: int = 2, d: int = 16, bs: int = 4
) -> tuple[Any, ...]:
    """Random decodes (one query per sequence) over pages scattered through a pool."""
    q, k, v, tables, lens, _ = scattered_pages(
        seed, [1] * len(ctx), ctx, heads=heads, kv_heads=kv_heads, d=d, bs=bs, dtype=dtype
    )
    return q, k, v, tables, lens


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("ctx", [[1], [4, 5, 1, 12], [33, 2, 16, 7, 40]])
def test_native_decodes_equal_the_reference_in_float32(
    native_on: None, heads: int, kv_heads: int, ctx: list[int]
) -> None:
    """Float32 decodes through planned_attention run on the kernel and equal ops.paged_attention
    (in float64) to float32 rounding: contexts of one token, of whole blocks and of partial
    ones, every grouping of query heads over KV heads."""
    q, k, v, tables, lens = _pages(sum(ctx), ctx, torch.float32, heads=heads, kv_heads=kv_heads)
    ones = torch.ones(len(ctx), dtype=torch.int64)
    plan = plan_attention(tables, lens, ones, block_size=4)
    got = planned_attention(q, k, v, plan)
    want = paged_attention(q.double(), k.double(), v.double(), tables, lens, ones)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    direct = native.decode_attention(q, k, v, plan.groups[0].tables.view(len(ctx), -1), lens.long(), 16**-0.5)
    assert direct is not None
    torch.testing.assert_close(direct, got, rtol=0, atol=0)  # planned_attention ran the kernel


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bs", [4, 16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decodes_at_the_head_dims_of_real_models(native_on: None, d: int, bs: int, dtype: Any) -> None:
    """Head dims 64 and 128 (with AVX-512, a path of their own: sixteen keys reduced at once),
    pages smaller and larger than sixteen keys, and a window that starts inside a page: the
    decodes equal the float64 reference to the dtype's rounding."""
    from batchkit.models.hf import _windowed

    ctx = [1, 15, 16, 17, 45, 70]
    q, k, v, tables, lens = _pages(d + bs, ctx, dtype, heads=9, kv_heads=3, d=d, bs=bs)
    table, scale = tables.long(), d**-0.5
    ones = torch.ones(len(ctx), dtype=torch.int64)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = native.decode_attention(q, k, v, table, lens.long(), scale)
    assert got is not None
    assert got.dtype == dtype
    want = paged_attention(q.double(), k.double(), v.double(), tables, lens, ones)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    windowed = native.decode_attention(q, k, v, table, lens.long(), scale, window=21)
    native._kernel = None
    plan = _windowed(plan_attention(tables, lens, ones, block_size=bs), 21)
    want = planned_attention(q.double(), k.double(), v.double(), plan, scale)
    assert windowed is not None
    torch.testing.assert_close(windowed.double(), want, rtol=tol, atol=tol)


def test_native_bfloat16_decodes_follow_the_torch_path(native_on: None, kernel: Callable[..., Any]) -> None:
    """bfloat16 pages: the kernel's result (accumulated in float32, rounded once) is within
    bfloat16 rounding of the torch path's and of the float64 reference."""
    ctx = [9, 30, 1, 17]
    q, k, v, tables, lens = _pages(3, ctx, torch.bfloat16)
    ones = torch.ones(len(ctx), dtype=torch.int64)
    plan = plan_attention(tables, lens, ones, block_size=4)
    got = planned_attention(q, k, v, plan)
    native._kernel = None
    torch_path = planned_attention(q, k, v, plan)
    native._kernel = kernel
    want = paged_attention(q.double(), k.double(), v.double(), tables, lens, ones)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, torch_path, rtol=3e-2, atol=3e-2)


def test_a_step_of_decodes_and_prefill_chunks_runs_each_where_it_belongs(native_on: None) -> None:
    """A mixed step: the decodes go to the kernel, the prefill chunks to torch's SDPA, and every
    token's output lands in its row (the reference, to float32 rounding)."""
    q_lens, ctx = [1, 5, 1, 3], [12, 5, 7, 9]
    q, k, v, tables, lens = _pages(5, ctx, torch.float32)
    q = torch.randn(sum(q_lens), q.shape[1], q.shape[2], generator=torch.Generator().manual_seed(6))
    query_lens = torch.tensor(q_lens)
    plan = plan_attention(tables, lens, query_lens, block_size=4)
    got = planned_attention(q, k, v, plan)
    want = paged_attention(q.double(), k.double(), v.double(), tables, lens, query_lens)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_query_sliced_from_wider_rows_is_read_where_it_lies(native_on: None, dtype: str) -> None:
    """A compiled step's query is the first heads of each token's q/k row (a slice: its
    sequences lie apart); the kernel's answer is the one for the same query made contiguous."""
    ctx = [9, 4, 17]
    q, k, v, tables, lens = _pages(11, ctx, getattr(torch, dtype))
    rows = torch.cat([q, torch.randn(len(ctx), 2, q.shape[2]).to(q.dtype)], dim=1)  # 2 more heads a token
    sliced = rows[:, : q.shape[1]]
    assert not sliced.is_contiguous()
    got = native.decode_attention(sliced, k, v, tables.long(), lens, 0.25)
    assert got is not None
    assert got.is_contiguous()
    assert torch.equal(got, native.decode_attention(q, k, v, tables.long(), lens, 0.25))


def test_pages_the_kernel_does_not_take_go_to_torch(native_on: None) -> None:
    """float16 and float64 pages, and pages that are not contiguous, are not the kernel's:
    decode_attention answers None and planned_attention's torch path runs them."""
    ctx = [6, 3]
    for dtype in (torch.float16, torch.float64):
        q, k, v, tables, lens = _pages(7, ctx, dtype)
        assert native.decode_attention(q, k, v, tables.long(), lens, 0.25) is None
        ones = torch.ones(len(ctx), dtype=torch.int64)
        got = planned_attention(q, k, v, plan_attention(tables, lens, ones, block_size=4))
        want = paged_attention(q.double(), k.double(), v.double(), tables, lens, ones)
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)
    q, k, v, tables, lens = _pages(8, ctx, torch.float32)
    strided = torch.cat([k, k], dim=-1)[..., : k.shape[-1]]
    assert not strided.is_contiguous()
    assert native.decode_attention(q, strided, v, tables.long(), lens, 0.25) is None


def test_a_failed_build_is_reported_once_and_leaves_torch_in_place(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """No compiler (the build raises): build_decode_attention answers False, says why once in the
    log, does not try again, and decode_attention answers None."""
    import torch.utils.cpp_extension as ext

    calls = []

    def no_compiler(**kwargs: Any) -> Any:
        calls.append(kwargs["name"])
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(ext, "load_inline", no_compiler)
    monkeypatch.setattr(native, "_kernel", None)
    monkeypatch.setattr(native, "_failed", None)
    with caplog.at_level(logging.WARNING, logger="batchkit.kv.native"):
        assert native.build_decode_attention() is False
        assert native.build_decode_attention() is False
    assert caplog.text.count("the native decode attention did not build") == 1
    assert len(calls) == 1
    assert calls[0].startswith("batchkit_decode_attention_")
    assert native._failed == "RuntimeError: no C++ compiler"
    q, k, v, tables, lens = _pages(9, [3], torch.float32)
    assert native.decode_attention(q, k, v, tables.long(), lens, 0.25) is None


def test_a_sliding_window_limits_the_keys_the_kernel_reads(native_on: None) -> None:
    """An HFStepModel layer with a sliding window attends over its last ``window`` keys: the
    windowed plan's decodes on the kernel equal the torch path over the same windowed mask."""
    from batchkit.models.hf import _windowed

    ctx = [3, 11, 20, 6]
    q, k, v, tables, lens = _pages(10, ctx, torch.float32)
    ones = torch.ones(len(ctx), dtype=torch.int64)
    plan = _windowed(plan_attention(tables, lens, ones, block_size=4), 5)
    assert plan.groups[0].window == 5
    got = planned_attention(q, k, v, plan)
    native._kernel = None
    want = planned_attention(q, k, v, plan)  # the torch path reads the window from the mask
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    full = planned_attention(q, k, v, plan_attention(tables, lens, ones, block_size=4))
    assert not torch.allclose(full[1:3], want[1:3])  # the window cut keys of the longer sequences


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_write_kv_writes_one_layers_slots_in_place(native_on: None, dtype: str) -> None:
    """torch.ops.batchkit_native.write_kv puts each token's K and V at its slot of the one layer
    named, converted to the cache's dtype, and touches nothing else."""
    from batchkit.kv.ops import write_slots

    cache = torch.zeros(3, 2, 5, 4, 2, 8, dtype=getattr(torch, dtype))
    key, value = torch.randn(4, 2, 8), torch.randn(4, 2, 8)  # float32: converted on the way in
    slots = torch.tensor([19, 0, 7, 8])
    want = cache.clone()
    write_slots(want[1, 0], want[1, 1], key, value, slots)
    storage = cache.data_ptr()
    torch.ops.batchkit_native.write_kv(cache, 1, key, value, slots)
    assert cache.data_ptr() == storage
    assert torch.equal(cache, want)


def test_native_write_kv_takes_keys_sliced_from_wider_rows(native_on: None) -> None:
    """The key and value of a compiled step are slices of each token's q/k/v row: each token's
    heads lie together, the tokens apart. They land as the same tensors made contiguous do."""
    from batchkit.kv.ops import write_slots

    cache = torch.zeros(1, 2, 3, 4, 2, 8)
    rows = torch.randn(5, 6, 8)  # per token: 2 query heads, then 2 key heads, then 2 value heads
    key, value, slots = rows[:, 2:4], rows[:, 4:], torch.tensor([3, 11, 0, 6, 7])
    assert not key.is_contiguous()
    assert not value.is_contiguous()
    want = cache.clone()
    write_slots(want[0, 0], want[0, 1], key.contiguous(), value.contiguous(), slots)
    torch.ops.batchkit_native.write_kv(cache, 0, key, value, slots)
    assert torch.equal(cache, want)


def test_native_write_kv_names_a_slot_outside_the_cache_and_writes_none(native_on: None) -> None:
    cache = torch.zeros(1, 2, 2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="slot 8 is outside the cache"):
        torch.ops.batchkit_native.write_kv(cache, 0, torch.ones(2, 1, 8), torch.ones(2, 1, 8), torch.tensor([1, 8]))
    assert not cache.any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_linear_follows_its_weight_through_writes_and_replacements(native_on: None, dtype: str) -> None:
    """torch.ops.batchkit_native.linear keeps a oneDNN copy of the weight per key and makes it again
    when the weight is written in place or replaced: its answer is F.linear's every time."""
    dt = getattr(torch, dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == "float32" else {"rtol": 2e-2, "atol": 2e-2}
    x = torch.randn(5, 32, dtype=dt)
    weight = torch.randn(48, 32, dtype=dt)
    try:
        for _ in range(2):  # the second call reads the copy made by the first
            torch.testing.assert_close(
                torch.ops.batchkit_native.linear(x, weight, 7), torch.nn.functional.linear(x, weight), **tol
            )
        weight.mul_(-2)  # written in place: its version moves
        torch.testing.assert_close(
            torch.ops.batchkit_native.linear(x, weight, 7), torch.nn.functional.linear(x, weight), **tol
        )
        other = torch.randn(48, 32, dtype=dt)  # another tensor under the same key
        torch.testing.assert_close(
            torch.ops.batchkit_native.linear(x, other, 7), torch.nn.functional.linear(x, other), **tol
        )
    finally:
        native.drop_linear(7)


def test_native_linear_runs_a_dtype_onednn_refuses_on_f_linear(native_on: None) -> None:
    x, weight = torch.randn(3, 16, dtype=torch.float64), torch.randn(8, 16, dtype=torch.float64)
    try:
        assert torch.equal(torch.ops.batchkit_native.linear(x, weight, 8), torch.nn.functional.linear(x, weight))
    finally:
        native.drop_linear(8)
