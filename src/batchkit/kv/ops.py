"""Reference operations on paged KV tensors, in torch. They are the CPU path and the test oracle
of the CUDA kernels in :mod:`batchkit._cuda`.

Layout (per layer and per K or V): ``[num_blocks, block_size, num_kv_heads, head_dim]``, viewed
flat as ``[num_blocks * block_size, num_kv_heads, head_dim]`` so that a slot indexes one token's
row of ``num_kv_heads * head_dim`` contiguous elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "copy_blocks",
    "gather",
    "paged_attention",
    "scatter",
    "slots_for",
    "swap_blocks",
    "write_slots",
]

Tensor = Any  # torch.Tensor; torch is imported lazily


def _flat(cache: Tensor) -> Tensor:
    return cache.view(-1, cache.shape[-2], cache.shape[-1])


def scatter(key_cache: Tensor, value_cache: Tensor, key: Tensor, value: Tensor, slot_mapping: Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, heads, head_dim]`` at ``slot_mapping`` (negative: skip)."""
    if slot_mapping.numel() == 0 or int(slot_mapping.min()) >= 0:  # no padding: no masked copies
        slots = slot_mapping.long()
    else:
        keep = slot_mapping >= 0
        slots, key, value = slot_mapping[keep].long(), key[keep], value[keep]
    write_slots(key_cache, value_cache, key, value, slots)


def write_slots(key_cache: Tensor, value_cache: Tensor, key: Tensor, value: Tensor, slots: Tensor) -> None:
    """Write ``key``/``value`` at ``slots``: int64, none of them padding, all inside the cache."""
    # index_copy_ rather than an indexed assignment: several times faster on CPU for a step's rows.
    _flat(key_cache).index_copy_(0, slots, key.to(key_cache.dtype))
    _flat(value_cache).index_copy_(0, slots, value.to(value_cache.dtype))


def slots_for(block_tables: Tensor, seq_lens: Tensor, block_size: int) -> Tensor:
    """Slots of every token of every sequence, concatenated in sequence order (int64)."""
    import torch

    lens = seq_lens.long()
    total = int(lens.sum())
    seq_idx = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    starts = torch.cumsum(lens, 0) - lens
    pos = torch.arange(total, device=lens.device) - starts[seq_idx]
    blocks = block_tables.long()[seq_idx, pos // block_size]
    return blocks * block_size + pos % block_size


def gather(cache: Tensor, block_tables: Tensor, seq_lens: Tensor) -> Tensor:
    """Pages of the given sequences to contiguous ``[sum(seq_lens), heads, head_dim]``."""
    slots = slots_for(block_tables.to(cache.device), seq_lens.to(cache.device), cache.shape[1])
    return _flat(cache).index_select(0, slots)


def copy_blocks(caches: Sequence[Tensor], pairs: Sequence[tuple[int, int]] | Tensor) -> None:
    """Copy whole blocks ``src -> dst`` within each cache tensor (copy-on-write, compaction).

    Every source is read from a snapshot taken before any write, so the order of the pairs does
    not matter and a block may be both a source and a destination.

    Raises:
        ValueError: a destination named twice (which copy lands would be unspecified).
    """
    import torch

    if len(pairs) == 0:
        return
    p = torch.as_tensor(pairs, dtype=torch.long, device=caches[0].device).view(-1, 2)
    dsts = p[:, 1].tolist()
    if len(set(dsts)) != len(dsts):
        raise ValueError("a block is the destination of two pairs; each block may be written once per call")
    for c in caches:
        c[p[:, 1]] = c[p[:, 0]]


def swap_blocks(src: Tensor, dst: Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy blocks ``src[s] -> dst[d]`` between pools on different devices (device <-> CPU)."""
    import torch

    if len(pairs) == 0:
        return
    p = torch.as_tensor(pairs, dtype=torch.long)
    s = p[:, 0].to(src.device)
    d = p[:, 1].to(dst.device)
    dst[d] = src[s].to(dst.device, non_blocking=True)


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_lens: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Attention of new tokens over paged K/V (the torch reference).

    Single-token queries (decodes) are computed together over contexts padded to the longest;
    longer queries (prefill chunks) one sequence at a time.

    Args:
        query: ``[total_query_tokens, num_heads, head_dim]``, the sequences' new tokens in order.
        key_cache, value_cache: one layer's ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_blocks]``; seq_lens: context length of each sequence,
            new tokens included (their K/V must already be scattered).
        query_lens: new tokens per sequence (default: 1 each, i.e. decode). A sequence's queries
            are its last ``query_lens[i]`` positions; each attends causally.
        scale: softmax scale (default ``head_dim ** -0.5``).

    Grouped-query attention: ``num_heads`` must be a multiple of ``num_kv_heads``.

    Returns:
        ``[total_query_tokens, num_heads, head_dim]`` in ``query``'s dtype.
    """
    import torch

    n_seqs = int(seq_lens.numel())
    if query_lens is None:
        query_lens = torch.ones(n_seqs, dtype=torch.long)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv = key_cache.shape[2]
    if num_heads % num_kv:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv})")
    scale = head_dim**-0.5 if scale is None else scale
    q_lens = [int(x) for x in query_lens.tolist()]
    ctx = [int(x) for x in seq_lens.tolist()]
    if sum(q_lens) != query.shape[0]:
        raise ValueError(f"query has {query.shape[0]} tokens but query_lens sum to {sum(q_lens)}")
    out = torch.empty_like(query)
    starts = [0]
    for ql in q_lens:
        starts.append(starts[-1] + ql)
    decode = [i for i in range(n_seqs) if q_lens[i] == 1]
    together = set(decode) if len(decode) > 1 else set()
    if together:  # single-token queries (decodes) are attended together
        _decodes_together(out, query, key_cache, value_cache, block_tables, decode, starts, ctx, scale)
    for i in (i for i in range(n_seqs) if i not in together):
        if q_lens[i] > ctx[i]:
            raise ValueError(f"sequence {i}: {q_lens[i]} new tokens but context length {ctx[i]}")
        rows = slice(starts[i], starts[i + 1])
        out[rows] = _one_sequence(query[rows], key_cache, value_cache, block_tables[i : i + 1], ctx[i], scale)
    return out


def _decodes_together(
    out: Tensor,
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    decode: list[int],
    starts: list[int],
    ctx: list[int],
    scale: float,
) -> None:
    """Write into ``out`` the attention of the sequences ``decode`` (one query each), every
    context padded to the longest."""
    import torch

    num_heads, head_dim = query.shape[1], query.shape[2]
    bs, num_kv = key_cache.shape[1], key_cache.shape[2]
    acc = torch.promote_types(query.dtype, torch.float32)  # fp32 at least, fp64 stays fp64
    idx = torch.tensor(decode)
    lens = torch.tensor([ctx[i] for i in decode])
    if (lens < 1).any():
        raise ValueError("a decoding sequence has context length 0")
    nb = -(-int(lens.max()) // bs)
    # Gather whole blocks (contiguous runs of bs rows), not single tokens: [S, nb, bs, Hkv, D].
    # Table padding points at the null block; the mask below hides it and unused slots.
    tables = block_tables.index_select(0, idx.to(block_tables.device))[:, :nb].long().to(key_cache.device)
    s_, width = tables.shape[0], nb * bs
    k = key_cache[tables].reshape(s_, width, num_kv, head_dim).to(acc).transpose(1, 2)  # [S, Hkv, L, D]
    v = value_cache[tables].reshape(s_, width, num_kv, head_dim).to(acc).transpose(1, 2)
    pos = torch.arange(width)
    rows = torch.tensor([starts[i] for i in decode], device=query.device)
    q = query.index_select(0, rows).to(acc).unsqueeze(2)  # [S, H, 1, D]
    keep = (pos[None, :] < lens[:, None]).to(query.device)[:, None, None, :]  # [S, 1, 1, L]
    gqa = num_heads != num_kv
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=gqa)
    out[rows] = o.squeeze(2).to(query.dtype)


def _one_sequence(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, table: Tensor, length: int, scale: float
) -> Tensor:
    """Causal attention of one sequence's ``query`` rows (its last positions) over its ``length``
    tokens of context, by the block table row ``table`` ``[1, max_blocks]``."""
    import torch

    ql, group = query.shape[0], query.shape[1] // key_cache.shape[2]
    acc = torch.promote_types(query.dtype, torch.float32)
    slots = slots_for(table.to(key_cache.device), torch.tensor([length]), key_cache.shape[1])
    k = _flat(key_cache).index_select(0, slots.to(key_cache.device))
    v = _flat(value_cache).index_select(0, slots.to(key_cache.device))
    k = k.repeat_interleave(group, dim=1).to(acc)  # [L, H, D]
    v = v.repeat_interleave(group, dim=1).to(acc)
    scores = torch.einsum("qhd,khd->hqk", query.to(acc), k) * scale
    q_pos = torch.arange(length - ql, length).view(-1, 1)
    k_pos = torch.arange(length).view(1, -1)
    scores = scores.masked_fill((k_pos > q_pos).to(scores.device), float("-inf"))
    probs = scores.softmax(dim=-1)
    result: Tensor = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return result
