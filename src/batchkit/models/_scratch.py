"""The steps a compiled step is warmed on before it serves: one of each shape class that
``torch.compile(dynamic=True)`` builds a graph of its own for, on a scratch cache.

torch specializes the sizes 0 and 1, and gives sizes that are equal when it traces one symbol
("duck sizing"), so that a later call where they differ compiles again. A step's sizes are its
tokens and its sampled rows, and the classes of a server's steps are: decodes alone (as many
rows as tokens), one decode, one prompt that samples its last token, a prompt chunk that
samples nothing, and prompts beside decodes (more tokens than rows, two rows or more). Every
size picked here differs from the others and from the cache's dimensions, so that no equality
is traced that a real step would break.
"""

from __future__ import annotations

import math

import torch

from ..continuous.step import StepBatch
from ..kv.cache import PagedKVCache

__all__ = ["scratch_steps"]


def _free_sizes(taken: set[int], count: int, start: int = 5) -> list[int]:
    """``count`` primes from ``start`` (odd) up, none in ``taken``."""
    sizes: list[int] = []
    n = start
    while len(sizes) < count:
        if n not in taken and all(n % p for p in range(2, math.isqrt(n) + 1)):
            sizes.append(n)
        n += 2
    return sizes


def scratch_steps(like: PagedKVCache) -> tuple[PagedKVCache, list[StepBatch]]:
    """A small cache shaped like ``like`` but for its number of blocks, and one step of each
    shape class over it (inference tensors, as the decode loop's steps are; the cache is not
    one, as a loop's is not)."""
    taken = set(like.kv.shape)
    decodes, prompt, rows, tokens = _free_sizes(taken, 4)  # ascending: rows < tokens
    shapes = [(decodes, decodes), (1, 1), (prompt, 1), (prompt, 0), (tokens, rows)]
    # As the decode loop makes its steps: under inference_mode, which a compiled graph guards on.
    with torch.inference_mode():
        steps = [_step(num_tokens, num_rows, like.block_size) for num_tokens, num_rows in shapes]
    needed = 1 + max(int(step.block_tables.max()) for step in steps)
    (blocks,) = _free_sizes(taken | {decodes, prompt, rows, tokens}, 1, start=needed | 1)
    cache = PagedKVCache(
        like.num_layers,
        blocks,
        like.block_size,
        like.num_kv_heads,
        like.head_dim,
        dtype=like.kv.dtype,
        device=like.kv.device,
    )
    return cache, steps


def _step(num_tokens: int, num_rows: int, block_size: int) -> StepBatch:
    """A step of ``num_tokens`` tokens that samples ``num_rows`` rows: a sequence of
    ``num_tokens`` new tokens that samples nothing where ``num_rows`` is 0, else
    ``num_rows - 1`` decodes beside one sequence of the rest, which samples. Each sequence's
    context is one token more than its new tokens, in blocks of its own from block 1 on."""
    q_lens = [1] * (num_rows - 1) + [num_tokens - max(num_rows - 1, 0)]
    ctx = [q + 1 for q in q_lens]
    width = max(-(-c // block_size) for c in ctx)
    tables = torch.zeros(len(q_lens), width, dtype=torch.int32)
    positions: list[int] = []
    slots: list[int] = []
    first = 1
    for i, (q, c) in enumerate(zip(q_lens, ctx, strict=True)):
        count = -(-c // block_size)
        tables[i, :count] = torch.arange(first, first + count, dtype=torch.int32)
        for pos in range(c - q, c):
            positions.append(pos)
            slots.append((first + pos // block_size) * block_size + pos % block_size)
        first += count
    ends = torch.tensor(q_lens).cumsum(0)
    sampling = tuple([True] * len(q_lens)) if num_rows else (False,)
    return StepBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        query_start=torch.cat((torch.zeros(1, dtype=torch.int64), ends)),
        query_lens=torch.tensor(q_lens, dtype=torch.int64),
        seq_lens=torch.tensor(ctx, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=tables,
        sample_indices=(ends - 1)[torch.tensor(sampling)],
        seq_ids=tuple(range(len(q_lens))),
        sampling=sampling,
    )
