"""Two CPU kernel choices batchkit makes by dtype, measured on this machine.

- Decode attention: SDPA on bfloat16 pages as they are, against SDPA on a float32 copy (copies
  included), for 16 decode rows of SmolLM2's shape (9 heads of 64, 3 KV heads) over 128, 256 and
  512 positions. ``batchkit.kv.attention.low_precision_attention`` takes the pages as they are only
  on CUDA and on CPUs with AMX; this prints what that choice is worth here.
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

from batchkit.kv.attention import low_precision_attention


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
    rows, heads, kv_heads, dim = 16, 9, 3, 64
    print("| positions | bfloat16 SDPA µs | float32 copy + SDPA µs | copy / as they are |")
    print("| --- | --- | --- | --- |")
    for width in (128, 256, 512):
        # The layout planned_attention hands SDPA: gathered pages [rows, positions, kv heads,
        # dim] seen as [rows, kv heads, positions, dim] (a transposed view, not a copy).
        k = torch.randn(rows, width, kv_heads, dim).bfloat16()
        v = torch.randn(rows, width, kv_heads, dim).bfloat16()
        q = torch.randn(rows, 1, heads, dim).bfloat16()
        mask = torch.ones(rows, 1, 1, width, dtype=torch.bool)
        mask[..., width - 20 :] = False

        def as_they_are() -> object:
            t = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # noqa: B023
            return sdpa(*t, attn_mask=mask, enable_gqa=True)  # noqa: B023

        def copied() -> object:
            t = (q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2))  # noqa: B023
            return sdpa(*t, attn_mask=mask, enable_gqa=True).bfloat16()  # noqa: B023

        low, high = _us(as_they_are), _us(copied)
        print(f"| {width} | {low:,.0f} | {high:,.0f} | {high / low:.2f}x |")


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
