"""PagedKVCache and the torch reference ops: scatter, gather, copy, swap, paged attention."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

import batchkit
from batchkit import PagedKVAllocator, PagedKVCache
from batchkit.kv import ops

if TYPE_CHECKING:
    import torch
else:
    torch = pytest.importorskip("torch")


def make_cache(**kw: object) -> PagedKVCache:
    args: dict[str, object] = {"num_layers": 2, "num_blocks": 32, "block_size": 4, "num_kv_heads": 2, "head_dim": 8}
    args.update(kw)
    return PagedKVCache(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scatter_then_gather_returns_exactly_what_was_written(dtype: torch.dtype, seed: int) -> None:
    """Random sequences written through their slot mappings read back bit-exactly; padding is skipped."""
    g = torch.Generator().manual_seed(seed)
    cache = make_cache(dtype=dtype)
    alloc = PagedKVAllocator(32, block_size=4)
    lens = [int(x) for x in torch.randint(1, 20, (4,), generator=g)]
    for i, n in enumerate(lens):
        alloc.allocate(i, n)
    slots = torch.cat([torch.from_numpy(alloc.slot_mapping(i)) for i in range(4)])
    n_tok = slots.numel()
    k = torch.randn(n_tok, 2, 8, generator=g).to(dtype)
    v = torch.randn(n_tok, 2, 8, generator=g).to(dtype)
    # Interleave padding tokens (slot -1) whose values must never land anywhere.
    pad_k = torch.full((3, 2, 8), 99.0, dtype=dtype)
    all_k = torch.cat([k, pad_k])
    all_v = torch.cat([v, pad_k])
    all_slots = torch.cat([slots, torch.full((3,), -1, dtype=torch.long)])
    cache.scatter(1, all_k, all_v, all_slots)
    tables = torch.from_numpy(alloc.block_tables(list(range(4))))
    gk, gv = cache.gather(1, tables, torch.tensor(lens))
    assert torch.equal(gk, k)
    assert torch.equal(gv, v)
    assert not (cache.key(1) == 99).any()
    assert not cache.key(0).any(), "other layers untouched"
    assert not cache.key(1)[0].any(), "the null block is never written"


def test_scatter_validates_shapes_and_slots() -> None:
    """Shape and range errors are caught before anything is written."""
    cache = make_cache()
    k = torch.zeros(2, 2, 8)
    with pytest.raises(ValueError, match="key and value must both be"):
        cache.scatter(0, torch.zeros(2, 3, 8), k, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="one slot per token"):
        cache.scatter(0, k, k, torch.tensor([1]))
    with pytest.raises(ValueError, match="outside the cache"):
        cache.scatter(0, k, k, torch.tensor([1, 32 * 4]))
    before = cache.key(0).clone()
    with pytest.raises(ValueError, match="integer slots"):  # 1.7 would have written at slot 1
        cache.scatter(0, torch.ones(2, 2, 8), k, torch.tensor([1.7, 2.2]))
    assert torch.equal(cache.key(0), before)


@pytest.mark.parametrize(
    ("tables", "lens", "message"),
    [
        ([[0, 1], [2, 3]], [3], "one length per block-table row"),  # a row without a length
        ([0, 1], [3], "2-D integer"),
        ([[0.0, 1.0]], [3], "2-D integer"),
        ([[0, 1]], [3.0], "1-D integers"),
        ([[0, 1]], [-1], ">= 0"),
        ([[0, 1]], [9], "longer than its block-table row"),  # 2 blocks of 4 hold 8
        ([[0, 32]], [5], "outside 0..31"),
        ([[0, -1]], [2], "outside 0..31"),
    ],
)
def test_gather_and_attention_refuse_tables_that_do_not_fit(
    tables: list[object], lens: list[float], message: str
) -> None:
    """The torch path checks what the CUDA gather kernel checks: no row silently ignored or
    read past, no float index truncated."""
    cache = make_cache()
    with pytest.raises(ValueError, match=message):
        cache.gather(0, torch.tensor(tables), torch.tensor(lens))
    with pytest.raises(ValueError, match=message):
        cache.paged_attention(0, torch.zeros(len(lens), 2, 8), torch.tensor(tables), torch.tensor(lens))


def test_gather_of_no_sequences_is_empty() -> None:
    k, v = make_cache().gather(0, [], [])
    assert k.shape == v.shape == (0, 2, 8)


def test_every_layer_of_a_step_writes_at_slots_checked_once() -> None:
    """The layers of a step scatter at the same slot_mapping: it is checked (two reductions) at
    the first layer only, and every layer still writes its own rows at those slots. Slots with
    padding are filtered at every call; a slot rewritten in place out of the cache is refused."""
    cache = PagedKVCache(num_layers=3, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    slots = torch.tensor([5, 0, 9])
    rows = [torch.full((3, 2, 8), float(layer + 1)) for layer in range(3)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for layer in range(3):
            cache.scatter(layer, rows[layer], -rows[layer], slots)
    reductions = {e.key: e.count for e in prof.key_averages() if e.key in ("aten::max", "aten::min")}
    assert reductions == {"aten::max": 1, "aten::min": 1}
    for layer in range(3):
        torch.testing.assert_close(cache.key(layer).reshape(-1, 2, 8)[slots], rows[layer])
        torch.testing.assert_close(cache.value(layer).reshape(-1, 2, 8)[slots], -rows[layer])

    padded = torch.tensor([-1, 3, -1])
    for layer in range(3):
        cache.scatter(layer, rows[2 - layer], rows[2 - layer], padded)
        assert float(cache.key(layer)[0, 3, 0, 0]) == 3 - layer
    slots[1] = 4 * 4  # past the last slot, in the tensor already checked
    with pytest.raises(IndexError):
        cache.scatter(0, rows[0], rows[0], slots)


def test_copy_blocks_copies_every_layer_k_and_v() -> None:
    """copy_blocks duplicates whole blocks in all layers (copy-on-write)."""
    cache = make_cache()
    cache.kv.normal_()
    before = cache.kv.clone()
    cache.copy_blocks([(3, 7), (5, 9)])
    assert torch.equal(cache.kv[:, :, 7], before[:, :, 3])
    assert torch.equal(cache.kv[:, :, 9], before[:, :, 5])
    assert torch.equal(cache.kv[:, :, 3], before[:, :, 3])
    with pytest.raises(ValueError, match="outside the pools"):
        cache.copy_blocks([(0, 32)])


def test_swap_blocks_round_trips_through_a_cpu_pool() -> None:
    """Blocks swapped out to another pool and back are unchanged."""
    dev = make_cache()
    cpu = make_cache(num_blocks=8)
    dev.kv.normal_()
    saved = dev.kv[:, :, [4, 6]].clone()
    dev.swap_blocks(cpu, [(4, 0), (6, 1)])
    dev.kv[:, :, [4, 6]] = 0
    cpu.swap_blocks(dev, [(0, 10), (1, 11)])
    assert torch.equal(dev.kv[:, :, [10, 11]], saved)


@pytest.mark.parametrize(("num_heads", "num_kv"), [(4, 4), (4, 2), (8, 1)])
def test_paged_attention_matches_sdpa(num_heads: int, num_kv: int) -> None:
    """Prefill (causal) and decode over paged K/V equal SDPA on the same contiguous data."""
    g = torch.Generator().manual_seed(num_heads * 10 + num_kv)
    d, bs = 16, 4
    cache = PagedKVCache(1, 64, bs, num_kv, d)
    alloc = PagedKVAllocator(64, block_size=bs)
    ctx = [9, 5, 13, 7]
    q_lens = [9, 1, 3, 1]  # a full prefill, two decodes, a chunk at the end of a context
    ks, vs = [], []
    for i, n in enumerate(ctx):
        alloc.allocate(i, n)
        k = torch.randn(n, num_kv, d, generator=g)
        v = torch.randn(n, num_kv, d, generator=g)
        cache.scatter(0, k, v, torch.from_numpy(alloc.slot_mapping(i)))
        ks.append(k)
        vs.append(v)
    q = torch.randn(sum(q_lens), num_heads, d, generator=g)
    out = cache.paged_attention(
        0, q, torch.from_numpy(alloc.block_tables([0, 1, 2, 3])), torch.tensor(ctx), torch.tensor(q_lens)
    )
    start = 0
    for i, (n, ql) in enumerate(zip(ctx, q_lens, strict=True)):
        qi = q[start : start + ql].transpose(0, 1)  # [H, ql, D]
        k = ks[i].repeat_interleave(num_heads // num_kv, dim=1).transpose(0, 1)
        v = vs[i].repeat_interleave(num_heads // num_kv, dim=1).transpose(0, 1)
        mask = torch.arange(n).view(1, -1) <= torch.arange(n - ql, n).view(-1, 1)
        want = torch.nn.functional.scaled_dot_product_attention(qi, k, v, attn_mask=mask).transpose(0, 1)
        torch.testing.assert_close(out[start : start + ql], want, rtol=1e-5, atol=1e-5)
        start += ql


def test_paged_attention_refuses_bad_head_counts() -> None:
    """num_heads must be a multiple of num_kv_heads."""
    cache = PagedKVCache(1, 8, 4, 3, 8)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ops.paged_attention(torch.zeros(1, 4, 8), cache.key(0), cache.value(0), torch.ones(1, 1), torch.tensor([1]))


def test_backend_choice_is_validated() -> None:
    """An unknown backend, or forcing CUDA on a CPU cache, is a clear error."""
    with pytest.raises(ValueError, match="backend must be"):
        make_cache(backend="tpu")
    cache = make_cache(backend="cuda")
    with pytest.raises(ValueError, match="needs the cache on a CUDA device"):
        cache.scatter(0, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), torch.tensor([4]))


def test_without_torch_the_cache_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without torch, PagedKVCache raises a ModuleNotFoundError that names the extra to install."""
    import sys

    from batchkit import PagedKVCache

    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'batchkit\[torch\]'"):
        PagedKVCache(1, 4, 2, 1, 2)


@pytest.mark.parametrize("layer", [-1, 2, 7])
def test_key_and_value_refuse_a_layer_outside_the_cache(layer: int) -> None:
    """A negative or too large layer index is an IndexError, not another layer's pages."""
    cache = PagedKVCache(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=2)
    with pytest.raises(IndexError, match="layer"):
        cache.key(layer)
    with pytest.raises(IndexError, match="layer"):
        cache.value(layer)
    assert cache.key(1).shape == (4, 2, 1, 2)


def test_a_cache_larger_than_the_machine_is_refused_with_its_size() -> None:
    """Far more blocks than memory holds: a MemoryError naming the bytes, before any allocation."""
    with pytest.raises(
        MemoryError, match=r"a KV cache of 2,000,000,000 blocks x 16 tokens .* needs [\d,.]+ GiB; cpu has"
    ):
        PagedKVCache(num_layers=30, num_blocks=2_000_000_000, block_size=16, num_kv_heads=3, head_dim=64)


def test_a_failed_allocation_is_a_memory_error_with_the_size(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(torch, "zeros", refuse)
    with pytest.raises(MemoryError, match=r"needs 0\.2 MiB; allocating it failed: DefaultCPUAllocator") as info:
        PagedKVCache(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=4096)
    assert isinstance(info.value.__cause__, RuntimeError)


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


def test_the_cache_takes_the_allocators_numpy_slots_and_tables_as_they_come() -> None:
    """The guide's flow: the allocator's slot_mapping (numpy int64) goes to kv.scatter, its
    block_tables (numpy int32) and the lengths to gather and paged_attention, without conversion."""
    torch = pytest.importorskip("torch")
    np = pytest.importorskip("numpy")
    alloc = PagedKVAllocator(num_blocks=16, block_size=4)
    cache = batchkit.PagedKVCache(num_layers=1, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8)
    alloc.allocate("a", 6)
    alloc.allocate("b", 3)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(9, 2, 8, generator=g), torch.randn(9, 2, 8, generator=g)
    slots = np.concatenate([alloc.slot_mapping("a"), alloc.slot_mapping("b")])
    cache.scatter(0, k, v, slots)
    tables = alloc.block_tables(["a", "b"])
    lens = np.array([6, 3])
    gk, gv = cache.gather(0, tables, lens)
    assert torch.equal(gk, k)
    assert torch.equal(gv, v)
    assert torch.equal(cache.gather(0, tables, [6, 3])[0], k)  # a list of lengths too
    query = torch.randn(9, 4, 8, generator=g)
    as_tensors = cache.paged_attention(0, query, torch.from_numpy(tables), torch.tensor([6, 3]), torch.tensor([6, 3]))
    assert torch.equal(cache.paged_attention(0, query, tables, lens, lens), as_tensors)
    cache.scatter(0, k[:0], v[:0], [])  # nothing to write
