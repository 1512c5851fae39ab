"""Decode attention over paged K/V: one SDPA call per (sequence, KV head) against one per query head.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads, head_dim 64, 16-token blocks),
``--rows`` sequences of one new token each over 60-127 tokens of context spread over a pool of
blocks. Two forms of the same decode, both from the pages gathered by ``index_select``:

- ``planned_attention`` as batchkit runs it: each KV head's query heads are that head's queries
  (``S x Hkv`` pairs of ``group`` queries in one SDPA call);
- per query head: SDPA with ``enable_gqa`` over ``S x H`` pairs of one query each (the form
  batchkit ran before);
- with ``--native``, ``planned_attention`` on batchkit's native CPU decode attention
  (``batchkit.kv.native``, built first: about 30 s the first time), which reads the pages where
  they lie; the two torch forms then run with it off.

Prints the median microseconds per layer call of each (calls interleaved) and their ratio, and
checks that the two agree.

Run:  .venv/bin/python benchmarks/decode_attention.py [--rows 16,48] [--calls 200] [--threads 2] [--native]
      [--json PATH]
"""

from __future__ import annotations

from typing import Any

import _harness as harness
import torch

from batchkit.kv import native
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


def with_kernel(kernel: Any, fn: Any) -> Any:
    """``fn()`` with the native decode attention set to ``kernel`` (None: torch's path)."""
    saved, native._kernel = native._kernel, kernel
    try:
        return fn()
    finally:
        native._kernel = saved


def measure(
    dtype: torch.dtype, s_: int, calls: int, warmup: int, gen: torch.Generator, record: harness.Record, kernel: Any
) -> str:
    """One table row: every form on the same random pages, calls interleaved."""
    lens = torch.randint(60, 128, (s_,), generator=gen)
    tables = torch.randperm(NUM_BLOCKS, generator=gen)[: s_ * 8].view(s_, 8).int()
    plan = plan_attention(tables, lens, torch.ones(s_, dtype=torch.int64), BLOCK_SIZE)
    group = plan.groups[0]
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    kc = torch.randn(shape, generator=gen).to(dtype)
    vc = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(s_, HEADS, HEAD_DIM, generator=gen).to(dtype)
    forms = {
        "planned": lambda: with_kernel(None, lambda: planned_attention(q, kc, vc, plan)),
        "per head": lambda: per_query_head(q, kc, vc, group.tables, group.mask),
    }
    if kernel is not None:
        forms["native"] = lambda: with_kernel(kernel, lambda: planned_attention(q, kc, vc, plan))
    want = forms["planned"]().float()
    diff = max(float((forms[n]().float() - want).abs().max()) for n in forms)
    times = harness.interleave({n: lambda fn=fn: harness.timed(fn)[0] for n, fn in forms.items()}, calls, warmup)
    us = {n: harness.median(times[n]) * 1e6 for n in forms}
    name = str(dtype).removeprefix("torch.")
    for n in forms:
        record.add(n, [t * 1e6 for t in times[n]], "us per layer call", dtype=name, rows=s_)
    row = f"| {name} | {s_} | {us['planned']:.0f} | {us['per head']:.0f} | {us['per head'] / us['planned']:.2f}x |"
    if kernel is not None:
        row += f" {us['native']:.0f} | {us['native'] / us['planned']:.2f}x |"
    return row + f" {diff:.2g} |"


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", default="16,48", help="comma-separated sequence counts")
    ap.add_argument("--calls", "--repeat", type=int, default=200, help="timed calls of each form")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls of each form before them")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--native", action="store_true", help="also time batchkit's native decode attention")
    args = ap.parse_args()
    rows = [int(x) for x in args.rows.split(",")]
    if min(rows) < 1 or args.calls < 1 or args.threads < 1:
        ap.error("--rows, --calls and --threads must be at least 1")
    record = harness.start(args)
    kernel = None
    if args.native:
        if not native.build_decode_attention():
            raise SystemExit(f"the native decode attention did not build: {native._failed}")
        kernel, native._kernel = native._kernel, None
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    print(f"torch threads {args.threads}; {HEADS} query heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}\n")
    native_columns = " native us | native / planned |" if kernel is not None else ""
    print(f"| dtype | rows | planned_attention us | per query head us | ratio |{native_columns} max abs difference |")
    print("| --- " * (6 + 2 * (kernel is not None)) + "|")
    for dtype in (torch.bfloat16, torch.float32):
        for s_ in rows:
            print(measure(dtype, s_, args.calls, args.warmup, gen, record, kernel))
    record.write()


if __name__ == "__main__":
    main()
