"""Two transformers architectures through the continuous loop on a CUDA device, token-equal to
transformers' own generate() on the same device in float32.

Run on a machine with a GPU: ``pytest -m gpu tests/cuda/test_models_gpu.py`` (``bash
benchmarks/gpu_check.sh`` runs it as its ``models`` step). Qwen2 (attention biases, full
attention) and Mistral (every layer sliding, so the loop also gives back the blocks that leave
the window) cover both of the step's attention paths; the models are tiny and random, built
from configs (nothing is downloaded).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from _support import TINY_LM, drain, tiny_lm

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from batchkit import ContinuousDecodeLoop  # noqa: E402 - after the importorskips
from batchkit.continuous.sampling import SamplingParams  # noqa: E402
from batchkit.models.hf import HFStepModel  # noqa: E402

VOCAB = TINY_LM["vocab_size"]
NEW_TOKENS = 12
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen2": {},
    "mistral": {"sliding_window": 6},
}


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_greedy_tokens_on_the_gpu_equal_transformers(model_type: str) -> None:
    """Five prompts of 3 to 17 tokens run together (chunked prefill of 8 tokens a step, a pool of
    19 blocks of 4 shared by up to four requests): each one's greedy tokens equal transformers'."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 9, 17, 5, 12)]
    hf = tiny_lm(model_type, device="cuda", **CONFIGS[model_type])
    with torch.inference_mode():
        want = [_hf_greedy_cuda(hf, p) for p in prompts]
    model = HFStepModel(hf)
    assert model.device.type == "cuda"
    loop = ContinuousDecodeLoop(
        model, model.make_cache(num_blocks=20, block_size=4), max_num_seqs=4, max_num_batched_tokens=8
    )
    got = drain(loop, [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts), prompts)
    assert got == want, model_type
    assert loop.allocator.statistics().used_blocks == 0


def _hf_greedy_cuda(hf: Any, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt], device="cuda")
    out = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return [int(t) for t in out[0, len(prompt) :].tolist()]
