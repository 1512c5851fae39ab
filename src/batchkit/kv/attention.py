"""Paged attention with its per-step metadata planned once, not once per layer.

Every layer of a step attends over the same sequences, block tables and lengths; only the query
and the layer's K/V differ. :func:`plan_attention` turns a step's block tables and lengths into the
index tensors and masks that attention needs (one host round trip per step), and
:func:`planned_attention` runs one layer with them: the decodes (one new token each) in one
batched ``scaled_dot_product_attention`` over their pages, a KV head's query heads as that head's
queries (or, for bfloat16 pages on a CPU without AMX, two batched matmuls), the prefill chunks in
another, each padded to its longest member. Once :func:`batchkit.kv.native.build_decode_attention`
has built it, the decodes run on batchkit's native CPU kernel instead, over the pages where they
lie. :func:`batchkit.kv.ops.paged_attention` stays the plain reference; they all agree (tests hold
them to it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .._cpu import has_amx
from .native import decode_attention

__all__ = ["AttentionPlan", "low_precision_attention", "plan_attention", "planned_attention"]

Tensor = Any


@dataclass(frozen=True, slots=True)
class _Group:
    """Sequences attended together: their pages, query rows and mask."""

    tables: Tensor  # [S * nb] int64 block ids, sequence by sequence (flat for index_select)
    lens: Tensor  # [S] int64 context lengths, the new tokens included
    query_index: Tensor  # [S, q_max] int64 rows of the flattened query (padding: row 0)
    mask: Tensor  # [S, 1, q_max, nb * block_size] bool, True where a query may attend
    out_rows: Tensor  # [n] rows of the flattened output that real queries fill
    out_select: Tensor  # [n] their positions in the flattened [S * q_max] result
    whole: bool  # one query per sequence, every query of the step, in order: no gather or scatter
    window: int | None = None  # a sliding window the mask holds (set with the mask; None: none)


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """One step's attention metadata (see :func:`plan_attention`)."""

    num_tokens: int
    groups: tuple[_Group, ...]


def plan_attention(block_tables: Tensor, seq_lens: Tensor, query_lens: Tensor, block_size: int) -> AttentionPlan:
    """Build the attention metadata of a step, on ``block_tables``' device.

    Args:
        block_tables: ``[num_seqs, max_blocks]`` block ids, padded with the null block.
        seq_lens: context length of each sequence after this step (new tokens included).
        query_lens: new tokens of each sequence; a sequence's queries are its last positions.
        block_size: token slots per block.

    Raises:
        ValueError: a sequence with more new tokens than context, or an empty context.
    """
    import torch

    device = block_tables.device
    q_lens = [int(x) for x in query_lens.tolist()]
    ctx = [int(x) for x in seq_lens.tolist()]
    if len(q_lens) != len(ctx) or len(ctx) != block_tables.shape[0]:
        raise ValueError(
            f"block_tables ({block_tables.shape[0]} rows), seq_lens ({len(ctx)}) and query_lens ({len(q_lens)}) "
            "must describe the same sequences"
        )
    starts = [0] * len(q_lens)
    total = 0
    for i, (ql, length) in enumerate(zip(q_lens, ctx, strict=True)):
        if length < 1 or not 1 <= ql <= length:
            raise ValueError(f"sequence {i}: {ql} new tokens with context length {length}")
        starts[i] = total
        total += ql
    decodes = [i for i, ql in enumerate(q_lens) if ql == 1]
    prefills = [i for i, ql in enumerate(q_lens) if ql > 1]
    groups = []
    for members in (decodes, prefills):
        if not members:
            continue
        q_max = max(q_lens[i] for i in members)
        nb = -(-max(ctx[i] for i in members) // block_size)
        width = nb * block_size
        rows = torch.tensor(members, dtype=torch.int64)
        tables = block_tables.index_select(0, rows.to(device))[:, :nb].long()
        qpos = torch.arange(q_max)
        lens = torch.tensor([ctx[i] for i in members])
        qls = torch.tensor([q_lens[i] for i in members])
        valid = qpos[None, :] < qls[:, None]  # [S, q_max]
        first = torch.tensor([starts[i] for i in members])
        query_index = torch.where(valid, first[:, None] + qpos[None, :], 0)
        # Query j of a sequence sits at position len - ql + j and sees keys up to it (causal);
        # padded queries see key 0 only, so that no softmax row is empty (their output is dropped).
        q_abs = (lens - qls)[:, None] + qpos[None, :]  # [S, q_max]
        k_pos = torch.arange(width)
        mask = (k_pos[None, None, :] <= q_abs[:, :, None]) & (k_pos[None, None, :] < lens[:, None, None])
        mask = torch.where(valid[:, :, None], mask, k_pos[None, None, :] == 0)
        flat_valid = valid.reshape(-1)
        groups.append(
            _Group(
                tables=tables.reshape(-1),
                lens=lens.to(device),
                query_index=query_index.to(device),
                mask=mask[:, None].to(device),
                out_rows=query_index.reshape(-1)[flat_valid].to(device),
                out_select=torch.nonzero(flat_valid).reshape(-1).to(device),
                whole=q_max == 1 and len(members) == len(q_lens),
            )
        )
    return AttentionPlan(num_tokens=total, groups=tuple(groups))


def low_precision_attention(device: Any) -> bool:
    """Whether bfloat16 / float16 pages on ``device`` go to SDPA as they are (its kernels
    accumulate them in float32): on CUDA, and on a CPU with AMX, where a float32 copy of every
    page of every layer cost more than the attention itself. On other CPUs (AVX512-BF16 without
    AMX, AVX2) SDPA's bfloat16 kernel ran up to 5x slower than the float32 one on a copy (copies
    included), so there :func:`planned_attention` runs bfloat16 decodes as two bfloat16 matmuls
    with a float32 softmax (0.14-0.26x SDPA's bfloat16 time, no page copied), and prefill chunks
    and float16 pages on a float32 copy (``benchmarks/cpu_dtype_kernels.py``)."""
    return getattr(device, "type", device) != "cpu" or has_amx()


def planned_attention(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, plan: AttentionPlan, scale: float | None = None
) -> Tensor:
    """Attention of a step's new tokens over one layer's paged K/V, using a :func:`plan_attention` plan.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, the sequences' new tokens in order.
        key_cache, value_cache: one layer's ``[num_blocks, block_size, num_kv_heads, head_dim]``;
            the new tokens' K/V must already be scattered.
        plan: the step's plan.
        scale: softmax scale (default ``head_dim ** -0.5``).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype, accumulated in float32 at
        least: bfloat16 and float16 pages go to SDPA as they are where
        :func:`low_precision_attention` says so (its kernels accumulate them in float32);
        elsewhere bfloat16 decodes are two bfloat16 matmuls (accumulated in float32, their
        results rounded to bfloat16 as transformers' eager attention rounds them) around a
        float32 softmax, and everything else is computed in float32 or wider. Decodes on the
        native kernel (:mod:`batchkit.kv.native`, once built) are accumulated in float32 and
        rounded once.

    Raises:
        ValueError: a query that does not match the plan, or heads that do not group.
    """
    import torch

    if query.shape[0] != plan.num_tokens:
        raise ValueError(f"query has {query.shape[0]} tokens but the plan was made for {plan.num_tokens}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv = key_cache.shape[2]
    if num_heads % num_kv:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv})")
    scale = head_dim**-0.5 if scale is None else scale
    low = (
        query.dtype in (torch.bfloat16, torch.float16)
        and key_cache.dtype == query.dtype
        and low_precision_attention(query.device)
    )
    acc = query.dtype if low else torch.promote_types(query.dtype, torch.float32)
    # bfloat16 decodes where SDPA's bfloat16 kernel is slow: matmuls in bfloat16, no float32 copy.
    by_matmul = not low and query.dtype == torch.bfloat16 and key_cache.dtype == query.dtype
    out = None if len(plan.groups) == 1 and plan.groups[0].whole else torch.empty_like(query)
    for g in plan.groups:
        s_, q_max = g.query_index.shape
        width = g.mask.shape[-1]
        q = query if g.whole else query.index_select(0, g.query_index.reshape(-1))
        # Decodes on the native kernel where it is built (batchkit.kv.native), else on torch.
        o = (
            decode_attention(q, key_cache, value_cache, g.tables.view(s_, -1), g.lens, scale, g.window)
            if q_max == 1
            else None
        )
        if o is None:
            # Whole blocks (contiguous runs of block_size rows), not single tokens: [S, W, Hkv, D].
            # index_select on dim 0, not advanced indexing: a row copy, several times faster on CPU.
            k = key_cache.index_select(0, g.tables).view(s_, width, num_kv, head_dim)
            v = value_cache.index_select(0, g.tables).view(s_, width, num_kv, head_dim)
            if by_matmul and q_max == 1:
                o = _decode_by_matmul(q, k, v, g.mask, scale)
            elif q_max == 1:
                # One query per sequence: each KV head's query heads are that head's queries, so
                # SDPA runs S x Hkv (sequence, KV head) pairs of `group` queries rather than S x H
                # pairs of one (1.5-1.8x faster on a CPU, where each pair costs a fixed overhead).
                k, v = k.to(acc).transpose(1, 2), v.to(acc).transpose(1, 2)  # [S, Hkv, W, D]
                q = q.view(s_, num_kv, num_heads // num_kv, head_dim).to(acc)  # head h reads KV head h // group
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)
                o = o.reshape(s_, num_heads, head_dim).to(query.dtype)
            else:
                k, v = k.to(acc).transpose(1, 2), v.to(acc).transpose(1, 2)  # [S, Hkv, W, D]
                q = q.view(s_, q_max, num_heads, head_dim).to(acc).transpose(1, 2)  # [S, H, q_max, D]
                o = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=g.mask, scale=scale, enable_gqa=num_heads != num_kv
                )
                o = o.transpose(1, 2).reshape(s_ * q_max, num_heads, head_dim).to(query.dtype)
        if out is None:  # the one group holds every query in order: its output is the step's
            return o
        out.index_copy_(0, g.out_rows, o.index_select(0, g.out_select))
    return out


def _decode_by_matmul(query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float) -> Tensor:
    """One query per sequence over its pages, as two batched matmuls in the pages' dtype.

    ``query`` ``[S, H, D]``, ``key`` / ``value`` ``[S, W, Hkv, D]``, ``mask`` ``[S, 1, 1, W]``.
    The matmuls accumulate in float32 and round their results to the pages' dtype, as
    transformers' eager attention does; the softmax runs in float32. Each query head reads its
    KV head's keys through a view (no repeat), and each KV head's keys are made contiguous once.
    """
    import torch

    s_, _, num_kv, head_dim = key.shape
    num_heads = query.shape[1]
    k = key.transpose(1, 2).contiguous()  # [S, Hkv, W, D]
    v = value.transpose(1, 2).contiguous()
    q = query.reshape(s_, num_kv, num_heads // num_kv, head_dim)  # head h reads KV head h // group
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [S, Hkv, group, W]
    probs = torch.softmax(torch.where(mask, scores, float("-inf")), dim=-1).to(query.dtype)
    out: Tensor = torch.matmul(probs, v).reshape(s_, num_heads, head_dim)
    return out
