"""Decode attention over paged K/V: one SDPA call per (sequence, KV head) against one per query head.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, 16-token blocks),
``--rows`` sequences of one new token each over 60-127 tokens of context spread over a pool of
blocks. Two forms of the same decode, both from the pages gathered by ``index_select``:

- ``planned_attention`` as batchkit runs it: each KV head's query heads are that head's queries
  (``S x Hkv`` pairs of ``group`` queries in one SDPA call);
- per query head: SDPA with ``enable_gqa`` over ``S x H`` pairs of one query each (the form
  batchkit ran before).

Prints the median microseconds per layer call of each (calls interleaved) and their ratio, and
checks that the two agree.

Run:  .venv/bin/python benchmarks/decode_attention.py [--rows 16,48] [--calls 200] [--threads 2] [--json PATH]
"""

from __future__ import annotations

from typing import Any

import _harness as harness
import torch

from batchkit.kv.attention import plan_attention, planned_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 9, 3, 64, 16, 2048


def per_query_head(q: Any, key_cache: Any, value_cache: Any, tables: Any, mask: Any) -> Any:
    """The decode as one SDPA pair per (sequence, query head)."""
    s_ = q.shape[0]
    k = key_cache.index_select(0, tables).view(s_, -1, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = value_cache.index_select(0, tables).view(s_, -1, KV_HEADS, HEAD_DIM).transpose(1, 2)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.view(s_, 1, HEADS, HEAD_DIM).transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True
    )
    return o.transpose(1, 2).reshape(s_, HEADS, HEAD_DIM)


def measure(dtype: torch.dtype, s_: int, calls: int, warmup: int, gen: torch.Generator, record: harness.Record) -> str:
    """One table row: both forms on the same random pages, calls interleaved."""
    lens = torch.randint(60, 128, (s_,), generator=gen)
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[: s_ * 8].view(s_, 8).int()
    plan = plan_attention(tables, lens, torch.ones(s_, dtype=torch.int64), BLOCK_SIZE)
    group = plan.groups[0]
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(s_, HEADS, HEAD_DIM, generator=gen).to(dtype)
    forms = {
        "planned": lambda: planned_attention(q, kc, vc, plan),
        "per head": lambda: per_query_head(q, kc, vc, group.tables, group.mask),
    }
    diff = float((forms["planned"]().float() - forms["per head"]().float()).abs().max())
    times = harness.interleave({n: lambda fn=fn: harness.timed(fn)[0] for n, fn in forms.items()}, calls, warmup)
    planned, per_head = (harness.median(times[n]) * 1e6 for n in forms)
    name = str(dtype).removeprefix("torch.")
    for n in forms:
        record.add(n, [t * 1e6 for t in times[n]], "us per layer call", dtype=name, rows=s_)
    return f"| {name} | {s_} | {planned:.0f} | {per_head:.0f} | {per_head / planned:.2f}x | {diff:.2g} |"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", default="16,48", help="comma-separated sequence counts")
    ap.add_argument("--calls", "--repeat", type=int, default=200, help="timed calls of each form")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls of each form before them")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    if min(rows) < 1 or args.calls < 1 or args.threads < 1:
        ap.error("--rows, --calls and --threads must be at least 1")
    record = harness.start(args)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"torch threads {args.threads}; {HEADS} query heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}\n")
    print("| dtype | rows | planned_attention us | per query head us | ratio | max abs difference |")
    print("| --- | --- | --- | --- | --- | --- |")
    for dtype in (torch.bfloat16, torch.float32):
        for s_ in rows:
            print(measure(dtype, s_, args.calls, args.warmup, gen, record))
    record.write()


if __name__ == "__main__":
    main()
