"""Effective bandwidth of the paged-KV CUDA kernels against torch's indexing path.

For each size, the bytes moved are counted as read + written (K and V, plus the index reads),
and scatter and gather are timed as CUDA-graph replays so that launch overhead does not hide
the memory traffic. The torch path is ``index_copy_`` (scatter) and ``index_select`` (gather),
the fastest graph-capturable torch equivalents. ``copy_blocks`` uploads its pairs on every call,
so it is not capturable: it is timed with CUDA events around plain calls (host overhead
included), against torch's indexed copy. Layout: Llama-3-8B-like rows (8 KV heads x 128, fp16
unless --dtype), block size 16.

Run on a CUDA machine:  .venv/bin/python benchmarks/kv_kernels.py [--peak-tbs 4.8] [--json out.json]
(or ``bash benchmarks/gpu_check.sh``, which runs it after the correctness checks).
"""

from __future__ import annotations

import sys

import _harness as harness
import torch

from batchkit import _cuda


def graph_time_us(fn, iters: int = 200, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median microseconds per call of ``fn`` replayed from a CUDA graph of ``reps`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters // reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return harness.median(times)


def event_time_us(fn, iters: int = 50) -> float:  # type: ignore[no-untyped-def]
    """Median microseconds per plain call of ``fn`` (not graph-captured), by CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return harness.median(times)


def report(record: harness.Record, op: str, n: int, moved: int, ours: float, ref: float, peak_tbs: float) -> None:
    """Print one table row and record its figures."""
    print(
        f"{op:8} {n:7d} {ours:11.2f} {moved / ours / 1e3:8.0f} {moved / ours / 1e6 / peak_tbs:7.1%} "
        f"{ref:9.2f} {moved / ref / 1e3:8.0f} {ref / ours:7.2f}x"
    )
    for path, us in (("batchkit", ours), ("torch", ref)):
        record.add(f"{path} {op}", us, "us", tokens_or_blocks=n, bytes=moved)
        record.add(f"{path} {op} bandwidth", moved / us / 1e3, "GB/s", tokens_or_blocks=n, bytes=moved)


def main() -> None:
    ap = harness.parser(__doc__, once=True)
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="device peak memory bandwidth, TB/s (H200: 4.8)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = ap.parse_args()
    record = harness.start(args)
    if not torch.cuda.is_available():
        print("kv_kernels: no CUDA device here; run this on a GPU machine", file=sys.stderr)
        sys.exit(0)
    _cuda.CHECK_INDICES = False  # no host synchronisation inside the captured graphs
    dtype = getattr(torch, args.dtype)
    heads, dim, bs = 8, 128, 16
    row = heads * dim
    esize = torch.tensor([], dtype=dtype).element_size()
    num_blocks = 65536  # 1M slots: 2 GiB per K or V cache in fp16
    kc = torch.zeros(num_blocks, bs, heads, dim, dtype=dtype, device="cuda")
    vc = torch.zeros_like(kc)
    kflat, vflat = kc.view(-1, heads, dim), vc.view(-1, heads, dim)
    device = torch.cuda.get_device_name()
    record.add("device", device)
    print(f"{device}; {args.dtype}; rows of {heads}x{dim}; peak {args.peak_tbs} TB/s")
    head = f"{'op':8} {'tokens':>7} {'batchkit us':>11} {'GB/s':>8} {'% peak':>7}"
    print(f"{head} {'torch us':>9} {'GB/s':>8} {'speed-up':>8}")
    for n in (64, 256, 8192):
        slots = torch.randperm(num_blocks * bs, device="cuda")[:n]
        k = torch.randn(n, heads, dim, device="cuda").to(dtype)
        v = torch.randn(n, heads, dim, device="cuda").to(dtype)
        moved = 4 * n * row * esize + n * 8
        ours = graph_time_us(lambda: _cuda.scatter_kv(kc, vc, k, v, slots))  # noqa: B023

        def torch_scatter() -> None:
            kflat.index_copy_(0, slots, k)  # noqa: B023
            vflat.index_copy_(0, slots, v)  # noqa: B023

        ref = graph_time_us(torch_scatter)
        report(record, "scatter", n, moved, ours, ref, args.peak_tbs)
    for n in (256, 8192):
        seqs = max(1, n // 512)
        per = n // seqs
        tables = torch.stack(
            [torch.randperm(num_blocks - 1, device="cuda")[: -(-per // bs)] + 1 for _ in range(seqs)]
        ).int()
        lens = torch.full((seqs,), per, device="cuda")
        slots = _slots(tables, lens, bs)
        moved = 2 * n * row * esize + n * 8
        ours = graph_time_us(lambda: _cuda.gather_kv(kc, tables, lens, total_tokens=n))  # noqa: B023
        ref = graph_time_us(lambda: kflat.index_select(0, slots))  # noqa: B023
        report(record, "gather", n, moved, ours, ref, args.peak_tbs)
    # copy_blocks: K and V of every layer of a 32-layer model in one call (num_caches = 64).
    layers = 32
    caches = kc.view(-1)[: 2 * layers * 1024 * bs * row].view(2 * layers, 1024, bs * row)
    for n in (16, 256):
        src = torch.randperm(512)[:n]
        dst = torch.randperm(512)[:n] + 512
        pairs = list(zip(src.tolist(), dst.tolist(), strict=True))
        moved = 2 * 2 * layers * n * bs * row * esize
        ours = event_time_us(lambda: _cuda.copy_blocks(caches, pairs))  # noqa: B023
        s_dev, d_dev = src.cuda(), dst.cuda()

        def torch_copy() -> None:
            caches[:, d_dev] = caches[:, s_dev]  # noqa: B023

        ref = event_time_us(torch_copy)
        report(record, "copy", n, moved, ours, ref, args.peak_tbs)
    record.write()


def _slots(tables: torch.Tensor, lens: torch.Tensor, bs: int) -> torch.Tensor:
    from batchkit.kv.ops import slots_for

    return slots_for(tables, lens, bs)


if __name__ == "__main__":
    main()
