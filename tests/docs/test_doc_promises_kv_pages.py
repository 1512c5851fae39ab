"""Promises of docs/kv-cache.md, checked as a user reads them: slots and waste, the pool's
invariants under any sequence of operations (errors included), prefix caching's last token,
swap, quotas, and the memory plan (library and `batchkit plan --config`)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import pytest

import batchkit
from batchkit import KVCacheExhausted, PagedKVAllocator, kv
from batchkit.cli import main

GIB = 1024**3


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


def test_the_plan_follows_the_guide_formulas() -> None:
    """blocks = budget // (kv_bytes_per_token * block_size) and sequences =
    num_blocks // ceil(L / block_size), for lengths that are not a multiple of the block."""
    shape = batchkit.ModelShape(num_layers=32, num_kv_heads=32, head_dim=128, num_params=6_740_000_000)
    assert shape.kv_bytes_per_token == 2 * 1 * 32 * 32 * 128 * 2
    for mean_len in (1, 17, 1000, 1024):
        p = kv.plan(shape, device_bytes=80 * GIB, activation_bytes=2 * GIB, mean_seq_len=mean_len)
        budget = 80 * GIB * 0.9 - 6.74e9 * 2 - 2 * GIB
        assert p.num_blocks == int(budget // (shape.kv_bytes_per_token * 16)) == 7353
        assert p.max_tokens == 7353 * 16
        assert p.max_num_seqs == 7353 // math.ceil(mean_len / 16)


def test_grouped_query_attention_holds_four_times_the_tokens_per_byte() -> None:
    """Llama-3-8B (8 KV heads) against Llama-2-7B (32): a quarter of the KV bytes per token, so
    four times the tokens in the same cache."""
    l2 = batchkit.ModelShape(num_layers=32, num_kv_heads=32, head_dim=128)
    l3 = batchkit.ModelShape(num_layers=32, num_kv_heads=8, head_dim=128)
    assert l2.kv_bytes_per_token == 4 * l3.kv_bytes_per_token
    p2 = kv.plan(l2, device_bytes=80 * GIB, weight_bytes=13 * GIB)
    p3 = kv.plan(l3, device_bytes=80 * GIB, weight_bytes=13 * GIB)
    assert p3.max_tokens == pytest.approx(4 * p2.max_tokens, rel=1e-3)


def test_plan_config_reads_a_hugging_face_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`batchkit plan --config config.json` on Llama-2-7B's own config (no parameter count in it)
    prints the numbers of the guide's worked example."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vocab_size": 32000,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", "--config", str(path), "--device-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "32 layers, 32 KV heads x 128, 2 bytes per value" in out
    for row in ("weights                                     12.55 GiB", "7,353 x 16", "117,648", "114"):
        assert row in out


@pytest.mark.parametrize(
    "config",
    [
        {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257, "model_type": "gpt2"},
        {"model_type": "llava", "text_config": {"num_hidden_layers": 32, "num_attention_heads": 32}},
    ],
    ids=["gpt2-names", "nested-text-config"],
)
def test_plan_config_refuses_a_config_without_the_names_it_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any]
) -> None:
    """A config that does not name num_hidden_layers / num_attention_heads at its top level is
    refused (exit status 2, naming what it needs), not planned from guesses."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", "--config", str(path)]) == 2
    assert "num_hidden_layers" in capsys.readouterr().err


def test_plan_config_defaults_the_kv_heads_to_the_attention_heads() -> None:
    config = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "torch_dtype": "float16"}
    shape = batchkit.ModelShape.from_hf_config(config)
    assert (shape.num_kv_heads, shape.head_dim, shape.dtype_bytes) == (32, 128, 2)


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
