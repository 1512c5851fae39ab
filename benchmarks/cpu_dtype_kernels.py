"""Two CPU kernel choices batchkit makes by dtype, measured on this machine.

- Decode attention over bfloat16 pages, 16 decode rows of SmolLM2's shape (9 heads of 64, 3 KV
  heads) over 128, 256 and 512 positions, each variant gathering the rows' pages alike: SDPA on
  the pages as they are, SDPA on a float32 copy (copies included), and ``planned_attention``,
  what batchkit runs (``batchkit.kv.attention.low_precision_attention`` hands the pages to SDPA as
  they are on CUDA and on CPUs with AMX; elsewhere decodes are two bfloat16 matmuls with a
  float32 softmax).
- Greedy sampling: ``argmax`` against ``max(dim).indices`` (what ``batchkit.continuous.sample``
  uses) over 16 rows of a 49,152-token vocabulary, in float32 and bfloat16.

Each figure is the median of ``--repeat`` (5) timings of ``--calls`` (200) calls after one
unrecorded timing, 2 torch threads.

Run:  .venv/bin/python benchmarks/cpu_dtype_kernels.py [--repeat 5] [--calls 200] [--json PATH]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import _harness as harness
import torch

from batchkit.kv.attention import low_precision_attention, plan_attention, planned_attention


def _us(fn: Callable[[], object], args: argparse.Namespace) -> harness.Summary:
    """Microseconds per call of ``fn``: median and range over the timings."""
    runs = harness.measure(lambda: harness.per_call(fn, args.calls), args.repeat, args.warmup)
    return harness.Summary.of(1e6 * t for t in runs)


def attention_rows(args: argparse.Namespace, record: harness.Record) -> None:
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows, heads, kv_heads, dim, block = 16, 9, 3, 64, 16
    print(
        "| positions | bfloat16 SDPA µs | float32 copy + SDPA µs | planned_attention µs "
        "| copy / as they are | planned / as they are |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for width in (128, 256, 512):
        # Paged K/V as a layer holds them; every variant gathers the rows' pages the same way.
        blocks = rows * width // block
        kc = torch.randn(blocks + 1, block, kv_heads, dim).bfloat16()
        vc = torch.randn(blocks + 1, block, kv_heads, dim).bfloat16()
        tables = (1 + torch.randperm(blocks)).view(rows, width // block)
        lens = torch.full((rows,), width - 20)
        plan = plan_attention(tables, lens, torch.ones(rows, dtype=torch.int64), block)
        q = torch.randn(rows, heads, dim).bfloat16()
        mask = torch.ones(rows, 1, 1, width, dtype=torch.bool)
        mask[..., width - 20 :] = False

        def pages(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
            flat = tables.reshape(-1)  # noqa: B023
            k = kc.index_select(0, flat).view(rows, width, kv_heads, dim).to(dtype).transpose(1, 2)  # noqa: B023
            v = vc.index_select(0, flat).view(rows, width, kv_heads, dim).to(dtype).transpose(1, 2)  # noqa: B023
            return q.view(rows, 1, heads, dim).to(dtype).transpose(1, 2), k, v  # noqa: B023

        def as_they_are() -> object:
            return sdpa(*pages(torch.bfloat16), attn_mask=mask, enable_gqa=True)  # noqa: B023

        def copied() -> object:
            return sdpa(*pages(torch.float32), attn_mask=mask, enable_gqa=True).bfloat16()  # noqa: B023

        def planned() -> object:
            return planned_attention(q, kc, vc, plan)  # noqa: B023

        low, high, ours = (_us(fn, args) for fn in (as_they_are, copied, planned))
        record.add("bfloat16 SDPA", low, "us", positions=width)
        record.add("float32 copy + SDPA", high, "us", positions=width)
        record.add("planned_attention", ours, "us", positions=width)
        print(
            f"| {width} | {low.median:,.0f} | {high.median:,.0f} | {ours.median:,.0f} "
            f"| {high.median / low.median:.2f}x | {ours.median / low.median:.2f}x |"
        )


def argmax_rows(args: argparse.Namespace, record: harness.Record) -> None:
    print("| dtype | argmax µs | max(dim).indices µs | ratio |")
    print("| --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(16, 49152).to(dtype)
        if not torch.equal(x.argmax(-1), x.max(-1).indices):
            raise SystemExit("argmax and max(dim).indices disagree")
        a, m = _us(lambda: x.argmax(-1), args), _us(lambda: x.max(-1).indices, args)  # noqa: B023
        name = str(dtype).removeprefix("torch.")
        record.add("argmax", a, "us", dtype=name)
        record.add("max(dim).indices", m, "us", dtype=name)
        print(f"| {name} | {a.median:,.0f} | {m.median:,.0f} | {m.median / a.median:.2f}x |")


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--repeat", type=int, default=5, help="timings of each figure (default 5)")
    ap.add_argument("--warmup", type=int, default=1, help="unrecorded timings before them (default 1)")
    ap.add_argument("--calls", type=int, default=200, help="calls per timing")
    args = ap.parse_args()
    if args.calls < 1:
        ap.error("--calls must be at least 1")
    record = harness.start(args)
    torch.set_num_threads(2)
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        f"bfloat16 pages go to SDPA as they are here (CUDA or AMX): {low_precision_attention('cpu')}\n"
    )
    attention_rows(args, record)
    print()
    argmax_rows(args, record)
    record.write()


if __name__ == "__main__":
    main()
