"""Two CPU kernel choices batchkit makes by dtype, measured on this machine.

- Decode attention over bfloat16 pages, 16 decode rows of SmolLM2's shape (9 heads of 64, 3 KV
  heads) over 128, 256 and 512 positions, each variant gathering the rows' pages alike: SDPA on
  the pages as they are, SDPA on a float32 copy (copies included), and ``planned_attention``,
  what batchkit runs (``batchkit.kv.attention.low_precision_attention`` hands the pages to SDPA as
  they are on CUDA and on CPUs with AMX; elsewhere decodes are two bfloat16 matmuls with a
  float32 softmax).
- Greedy sampling: ``argmax`` against ``max(dim).indices`` (what ``batchkit.continuous.sample``
  uses) over 16 rows of a 49,152-token vocabulary, in float32 and bfloat16.

Each figure is the median of 5 timings of 200 calls, 2 torch threads.

Run:  python benchmarks/cpu_dtype_kernels.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from batchkit.kv.attention import low_precision_attention, plan_attention, planned_attention


def _us(fn: Callable[[], object], calls: int = 200, timings: int = 5) -> float:
    for _ in range(10):
        fn()
    out = []
    for _ in range(timings):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(out)


def attention_rows() -> None:
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

        low, high, ours = _us(as_they_are), _us(copied), _us(planned)
        print(f"| {width} | {low:,.0f} | {high:,.0f} | {ours:,.0f} | {high / low:.2f}x | {ours / low:.2f}x |")


def argmax_rows() -> None:
    print("| dtype | argmax µs | max(dim).indices µs | ratio |")
    print("| --- | --- | --- | --- |")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(16, 49152).to(dtype)
        if not torch.equal(x.argmax(-1), x.max(-1).indices):
            raise SystemExit("argmax and max(dim).indices disagree")
        a, m = _us(lambda: x.argmax(-1)), _us(lambda: x.max(-1).indices)  # noqa: B023
        print(f"| {str(dtype).removeprefix('torch.')} | {a:,.0f} | {m:,.0f} | {m / a:.2f}x |")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    torch.set_num_threads(2)
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        f"bfloat16 pages go to SDPA as they are here (CUDA or AMX): {low_precision_attention('cpu')}\n"
    )
    attention_rows()
    print()
    argmax_rows()


if __name__ == "__main__":
    main()
