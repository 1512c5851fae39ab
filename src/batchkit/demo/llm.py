"""The LLM workload shared by ``batchkit demo`` and ``benchmarks/continuous.py``.

A randomly initialised Llama-style model (no download) serves a set of requests with mixed
output lengths three ways, all through the same step function and KV cache code, so that only
the batching policy differs:

- one at a time: a continuous loop with ``max_num_seqs=1``;
- static batches: requests in arrival order, ``batch`` at a time; a batch runs until its longest
  request is done and every member keeps computing until then (as padded static generation
  does), but only each request's own tokens count as useful output;
- continuous: one loop with ``max_num_seqs=batch``; finished requests leave and waiting ones join
  at every step.

All requests arrive at time 0; TTFT counts from there.
"""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass
from typing import Any

from .._validate import positive_int
from ..continuous.loop import ContinuousDecodeLoop
from ..continuous.request import Request
from ..continuous.sampling import SamplingParams
from ..metrics import percentiles

__all__ = ["DemoRequest", "ServeReport", "make_model", "make_requests", "serve"]

MODEL_SHAPE = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


@dataclass(frozen=True)
class DemoRequest:
    prompt: list[int]
    max_new_tokens: int


def make_model(seed: int = 0, threads: int = 2) -> Any:
    """The demo model: a seeded, randomly initialised Llama-style decoder (float32, CPU)."""
    import torch

    from ..models.llama import LlamaConfig, LlamaModel

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    return LlamaModel(LlamaConfig(**MODEL_SHAPE))  # type: ignore[arg-type]


def make_requests(
    n: int, out_min: int, out_max: int, prompt_min: int = 8, prompt_max: int = 32, seed: int = 0
) -> list[DemoRequest]:
    """``n`` seeded requests with prompts of ``prompt_min..prompt_max`` tokens and outputs of
    ``out_min..out_max`` tokens.

    Raises:
        ValueError: ``n < 1``, or a range that is empty or starts below 1.
    """
    positive_int("n", n)
    for name, lo, hi in (("out", out_min, out_max), ("prompt", prompt_min, prompt_max)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name}_min..{name}_max must satisfy 1 <= min <= max, got {lo}..{hi}")
    rng = random.Random(seed)
    vocab = MODEL_SHAPE["vocab_size"]
    return [
        DemoRequest(
            [rng.randrange(vocab) for _ in range(rng.randint(prompt_min, prompt_max))], rng.randint(out_min, out_max)
        )
        for _ in range(n)
    ]


@dataclass(frozen=True)
class ServeReport:
    """Useful tokens per second, latency percentiles (ms) and batch-slot utilisation."""

    name: str
    tokens: int
    seconds: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    utilisation: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _run(
    model: Any, requests: list[DemoRequest], max_num_seqs: int, pad_to: list[int] | None, num_blocks: int
) -> tuple[dict[int, list[float]], int, float]:
    """Drive a loop in this thread; return token times per request, the number of steps, seconds."""
    kv = model.make_cache(num_blocks=num_blocks, block_size=16)
    loop = ContinuousDecodeLoop(model, kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=4096, watermark=0.0)
    times: dict[int, list[float]] = {i: [] for i in range(len(requests))}
    steps = 0
    for i, r in enumerate(requests):
        n = pad_to[i] if pad_to is not None else r.max_new_tokens
        loop.scheduler.add(Request(i, r.prompt, SamplingParams(max_new_tokens=n)))
    t0 = time.perf_counter()
    while loop.scheduler.has_work():
        _step, events = loop.step_once()
        now = time.perf_counter() - t0
        steps += 1
        for ev in events:
            if ev.error is not None:
                raise ev.error
            times[int(ev.request_id)].append(now)  # type: ignore[call-overload]
    return times, steps, time.perf_counter() - t0


def _report(
    name: str,
    requests: list[DemoRequest],
    times: dict[int, list[float]],
    offset: dict[int, float],
    seconds: float,
    utilisation: float,
) -> ServeReport:
    ttft, tpot = [], []
    tokens = 0
    for i, r in enumerate(requests):
        ts = [t + offset.get(i, 0.0) for t in times[i][: r.max_new_tokens]]
        tokens += len(ts)
        ttft.append(ts[0])
        tpot += [b - a for a, b in itertools.pairwise(ts)]
    t50, t99 = percentiles(ttft, [50, 99])
    p50, p99 = percentiles(tpot, [50, 99])
    return ServeReport(name, tokens, seconds, t50 * 1e3, t99 * 1e3, p50 * 1e3, p99 * 1e3, utilisation)


def serve(
    model: Any, requests: list[DemoRequest], mode: str, batch: int = 32, num_blocks: int | None = None
) -> ServeReport:
    """Serve ``requests`` one at a time (``"single"``), in static batches or continuously.

    ``num_blocks`` defaults to enough KV blocks (of 16 tokens, at least 2048) for ``batch`` of the
    longest requests at once, so that no policy is slowed by preemption.

    Raises:
        ValueError: an unknown mode, no requests, or ``batch < 1``.
    """
    if not requests:
        raise ValueError("requests is empty")
    positive_int("batch", batch)
    if num_blocks is None:
        longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
        num_blocks = max(2048, batch * -(-longest // 16) + 1)
    useful = sum(r.max_new_tokens for r in requests)
    if mode == "single":
        times, _, secs = _run(model, requests, 1, None, num_blocks)
        return _report("one at a time", requests, times, {}, secs, 1.0)
    if mode == "continuous":
        times, steps, secs = _run(model, requests, batch, None, num_blocks)
        # eta's analogue: the share of the K batch slots of every step that produced a token.
        return _report(f"continuous (max_num_seqs={batch})", requests, times, {}, secs, useful / (batch * steps))
    if mode == "static":
        all_times: dict[int, list[float]] = {}
        offset: dict[int, float] = {}
        total = 0.0
        slot_tokens = 0
        for start in range(0, len(requests), batch):
            chunk = requests[start : start + batch]
            longest = max(r.max_new_tokens for r in chunk)
            times, _, secs = _run(model, chunk, batch, [longest] * len(chunk), num_blocks)
            for j in range(len(chunk)):
                all_times[start + j] = times[j]
                offset[start + j] = total
            total += secs
            slot_tokens += len(chunk) * longest
        return _report(f"static batches of {batch}", requests, all_times, offset, total, useful / slot_tokens)
    raise ValueError(f"mode must be 'single', 'static' or 'continuous', got {mode!r}")
