"""batchkit.models.hf: any transformers causal LM as a step over the paged KV cache, token-equal to transformers."""

from __future__ import annotations

import copy
import random
import re
from pathlib import Path
from typing import Any

import pytest

from _support import TINY_LM, drain, hf_greedy, tiny_lm

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from batchkit import ContinuousDecodeLoop  # noqa: E402 - after the importorskips
from batchkit.continuous.request import Request  # noqa: E402
from batchkit.continuous.sampling import SamplingParams  # noqa: E402
from batchkit.kv.planner import layer_windows  # noqa: E402
from batchkit.models import LlamaModel, load_pretrained  # noqa: E402
from batchkit.models.hf import HFStepModel, check_config  # noqa: E402

VOCAB = TINY_LM["vocab_size"]
WINDOW = 6  # sliding windows shorter than every prompt and its output
# model_type -> what its tiny config sets beyond TINY_LM: the feature of the family each exercises.
ARCHITECTURES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # attention biases on q/k/v
    "qwen2-sliding": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3": ("qwen3", {"head_dim": 32}),  # q/k norms, head_dim != hidden / heads
    "mistral": ("mistral", {"sliding_window": WINDOW}),  # every layer sliding
    "gemma": ("gemma", {"head_dim": 32}),  # scaled embeddings, (1 + w) norms, GeGLU
    "gemma2": (  # alternating sliding / full layers, attention logit soft-capping
        "gemma2",
        {
            "head_dim": 32,
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 1.0,
            "initializer_range": 0.2,  # scores large enough for the cap to change tokens
        },
    ),
    "phi3": ("phi3", {}),  # fused qkv and gate/up projections
    "olmo2": ("olmo2", {}),  # q/k norms over all heads, post-norms
    "qwen2_moe": (
        "qwen2_moe",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
        },
    ),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}
NEW_TOKENS = 8


def _tiny(name: str, **overrides: Any) -> Any:
    """A seeded random-weight float32 transformers model of architecture ``name``."""
    model_type, extra = ARCHITECTURES[name]
    return tiny_lm(model_type, **{**extra, **overrides})


def _prompts() -> list[list[int]]:
    """Prompts of different lengths; every other one starts with a shared 8-token prefix."""
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(8)]
    return [
        (shared if i % 2 == 0 else []) + [rng.randrange(3, VOCAB) for _ in range(n)]
        for i, n in enumerate((3, 9, 5, 14, 1, 11))
    ]


def _hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    return hf_greedy(hf, prompt, NEW_TOKENS)


def _run(loop: ContinuousDecodeLoop, prompts: list[list[int]]) -> list[list[int]]:
    """Every prompt's greedy tokens, the loop stepped in this thread until it is idle."""
    return drain(loop, [SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)] * len(prompts), prompts)


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def arch(request: pytest.FixtureRequest) -> tuple[str, Any, list[list[int]]]:
    """(name, transformers model, its greedy tokens for every prompt, one at a time)."""
    hf = _tiny(request.param)
    return request.param, hf, [_hf_greedy(hf, p) for p in _prompts()]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_tokens_equal_transformers_through_the_loop(arch: tuple[str, Any, list[list[int]]], mode: str) -> None:
    """Six prompts of different lengths run together through the loop, in chunked prefills
    (8 tokens a step) into a pool too small for them all (preemption by recompute, with prefix
    caching, or by swap): each one's greedy tokens equal transformers' generate() in float32."""
    name, hf, want = arch
    model = HFStepModel(copy.deepcopy(hf))
    # A model whose every layer slides (Mistral) gives back the blocks behind its window, so
    # only a smaller pool, shared by more requests, still forces it to preempt.
    num_blocks, max_num_seqs = (8, 6) if model.sliding_window else (16, 4)
    loop = ContinuousDecodeLoop(
        model,
        model.make_cache(num_blocks=num_blocks, block_size=4),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8,
        watermark=0.0,
        preemption_mode=mode,  # type: ignore[arg-type]
        num_cpu_blocks=32 if mode == "swap" else 0,
        enable_prefix_caching=mode == "recompute",
    )
    assert _run(loop, _prompts()) == want, name
    assert loop.scheduler.statistics().preemptions > 0, "the pool was meant to force preemption"
    stats = loop.allocator.statistics()
    if mode == "recompute":
        assert stats.prefix_hits > 0, "the shared prefix was meant to hit the prefix cache"
    else:
        assert stats.swaps_out > 0
    assert stats.used_blocks == 0


def test_sliding_windows_are_read_per_layer_as_transformers_reads_them() -> None:
    """layer_types name the sliding layers (Qwen2, Gemma2); without them a sliding_window covers
    every layer (Mistral); none means full attention everywhere."""
    assert layer_windows(_tiny("qwen2-sliding").config) == (None, WINDOW)
    assert layer_windows(_tiny("gemma2").config) == (WINDOW, None)
    assert layer_windows(_tiny("mistral").config) == (WINDOW, WINDOW)
    assert layer_windows(_tiny("llama").config) == (None, None)


def test_a_sliding_window_model_decodes_past_its_window_like_transformers() -> None:
    """A window of 6 over prompts of 9 to 14 tokens and 8 new ones: each query sees only its
    last 6 positions; with the window ignored the tokens would differ (checked here too)."""
    hf = _tiny("mistral")
    wide = _tiny("mistral", sliding_window=None)
    prompts = _prompts()[2:5]
    want = [_hf_greedy(hf, p) for p in prompts]
    assert want != [_hf_greedy(wide, p) for p in prompts], "the window was meant to change the tokens"
    model = HFStepModel(copy.deepcopy(hf))
    assert _run(ContinuousDecodeLoop(model, model.make_cache(num_blocks=64, block_size=4)), prompts) == want


def test_a_model_whose_every_layer_slides_gives_back_the_blocks_behind_its_window() -> None:
    """Mistral (every layer sliding, window 6, blocks of 4): a 14-token prompt decoding 40 tokens
    holds 54 tokens' positions, 14 blocks, yet never more than the blocks its window and the
    current block span; the given-back blocks serve other requests, and the tokens still equal
    transformers'. Gemma2 (alternating layers) keeps all of its blocks."""
    hf = _tiny("mistral")
    prompt = _prompts()[3]
    new_tokens = 40
    want = hf_greedy(hf, prompt, new_tokens)
    model = HFStepModel(copy.deepcopy(hf))
    assert model.sliding_window == WINDOW
    assert HFStepModel(_tiny("gemma2")).sliding_window is None
    loop = ContinuousDecodeLoop(model, model.make_cache(num_blocks=64, block_size=4))
    loop.scheduler.add(Request(0, prompt, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)))
    got: list[int] = []
    peak = 0
    while loop.scheduler.has_work():
        _, events = loop.step_once()
        got += [ev.token for ev in events if ev.token is not None]
        peak = max(peak, loop.allocator.statistics().used_blocks)
    assert got == want
    # The window's 6 positions straddle at most 3 blocks of 4, plus the block being filled:
    # far fewer than the 14 blocks of its 54 positions (the prompt's own prefill holds 4).
    assert peak <= 4 < loop.allocator.blocks_needed(len(prompt) + new_tokens)
    assert loop.allocator.statistics().used_blocks == 0


def test_attention_soft_capping_changes_the_tokens_it_is_checked_against() -> None:
    """Gemma2's tiny config caps attention logits at 1: transformers' tokens with the cap differ
    from those without it, so the equality test above checks the cap."""
    prompts = _prompts()
    capped = [_hf_greedy(_tiny("gemma2"), p) for p in prompts]
    assert capped != [_hf_greedy(_tiny("gemma2", attn_logit_softcapping=None), p) for p in prompts]


def test_an_encoder_decoder_is_refused_naming_it() -> None:
    """A T5 (encoder-decoder) is refused at wrapping with one line that says so."""
    config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match=r"'t5' is an encoder-decoder model"):
        HFStepModel(transformers.T5ForConditionalGeneration(config))


def test_modeling_code_that_bypasses_the_attention_interface_is_refused_naming_the_model_type() -> None:
    """Falcon's transformers code calls its own attention: refused at wrapping, the model type
    named once, quoted (not 'falcon''s)."""
    refused = (
        "the transformers modeling code of 'falcon' does not call the attention interface, so batchkit cannot "
        "plug its paged attention in"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(refused)}$"):
        HFStepModel(tiny_lm("falcon"))


def test_a_layer_that_is_not_attention_is_refused_naming_its_type() -> None:
    """A layer type other than full or sliding attention (linear attention, convolutions) has no
    K/V in pages: refused with its name."""
    hf = _tiny("qwen2")
    hf.config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer type 'linear_attention' is not supported"):
        HFStepModel(hf)


@pytest.mark.parametrize(
    ("name", "rope"),
    [
        ("llama", {"rope_type": "dynamic", "factor": 2.0}),
        ("phi3", {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}),
    ],
)
def test_a_rope_recomputed_from_the_sequence_length_is_refused(name: str, rope: dict[str, Any]) -> None:
    """Dynamic NTK and LongRoPE frequencies follow the longest position of a forward call: in a
    packed step a sequence's tokens would depend on its neighbours'. Refused, by config and model."""
    config = _tiny(name).config
    config.rope_parameters = {**rope, "rope_theta": 10000.0, "original_max_position_embeddings": 16}
    with pytest.raises(ValueError, match=f"uses RoPE type '{rope['rope_type']}'.*batched with others"):
        check_config(config)


def test_modeling_code_with_its_own_attention_table_is_refused_at_load(tmp_path: Path) -> None:
    """GPT-Neo picks its attention class from a table of its own: a ValueError naming the
    attention interface, not transformers' KeyError."""
    config = transformers.GPTNeoConfig(
        vocab_size=VOCAB, hidden_size=16, num_layers=2, num_heads=2, attention_types=[[["global"], 2]]
    )
    transformers.GPTNeoForCausalLM(config).save_pretrained(tmp_path)
    _word_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"^the transformers modeling code of 'gpt_neo' does not call the attention interface"
    ):
        load_pretrained(tmp_path)


def test_a_cache_of_another_shape_is_refused_at_the_step() -> None:
    """A KV cache made for another model (head_dim 32 against 16) fails the step's requests with
    a ValueError naming make_cache."""
    model = HFStepModel(_tiny("llama"))
    other = HFStepModel(_tiny("qwen3"))
    loop = ContinuousDecodeLoop(model, other.make_cache(num_blocks=8, block_size=4))
    loop.scheduler.add(Request(0, [3, 4, 5], SamplingParams(max_new_tokens=1)))
    _, events = loop.step_once()
    assert isinstance(events[0].error, ValueError)
    assert "model.make_cache" in str(events[0].error)


def test_the_wrapped_model_called_outside_a_step_says_so() -> None:
    """After wrapping, the transformers model's own forward has no pages to attend over: a clear RuntimeError."""
    model = HFStepModel(_tiny("llama"))
    with pytest.raises(RuntimeError, match=r"runs only inside a batchkit step"):
        model.hf(torch.tensor([[3, 4, 5]]))


def _word_tokenizer() -> Any:
    """A whitespace word-level tokenizer: ``<unk>``, ``<s>``, ``</s>`` and words ``w3``..``w127``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


class TestLoadPretrained:
    """load_pretrained takes every architecture: the native LlamaModel where it applies, HFStepModel elsewhere."""

    def test_a_qwen2_directory_loads_on_the_generic_path_and_decodes_like_transformers(self, tmp_path: Path) -> None:
        """A saved Qwen2 directory loads as an HFStepModel whose greedy tokens equal transformers'."""
        hf = _tiny("qwen2")
        hf.save_pretrained(tmp_path)
        _word_tokenizer().save_pretrained(tmp_path)
        lm = load_pretrained(tmp_path)
        assert isinstance(lm.model, HFStepModel)
        prompts = _prompts()[:3]
        assert _run(lm.make_loop(num_blocks=32, block_size=4), prompts) == [_hf_greedy(hf, p) for p in prompts]

    def test_a_llama_the_native_model_implements_loads_natively(self, tmp_path: Path) -> None:
        """A plain Llama runs on the native LlamaModel (faster); one with a RoPE scaling it lacks on
        the generic path, which runs transformers' own rotary code."""
        _tiny("llama").save_pretrained(tmp_path / "plain")
        _tiny("llama", rope_scaling={"rope_type": "linear", "factor": 2.0}).save_pretrained(tmp_path / "scaled")
        for d in ("plain", "scaled"):
            _word_tokenizer().save_pretrained(tmp_path / d)
        assert isinstance(load_pretrained(tmp_path / "plain").model, LlamaModel)
        assert isinstance(load_pretrained(tmp_path / "scaled").model, HFStepModel)

    def test_a_directory_without_a_tokenizer_says_to_pass_one(self, tmp_path: Path) -> None:
        """Weights without tokenizer files fail in one line naming tokenizer=; with tokenizer= another
        directory's tokenizer is used."""
        _tiny("qwen3").save_pretrained(tmp_path / "model")
        _word_tokenizer().save_pretrained(tmp_path / "tok")
        with pytest.raises(FileNotFoundError, match=r"has no tokenizer .*: pass tokenizer= a directory that has one"):
            load_pretrained(tmp_path / "model")
        lm = load_pretrained(tmp_path / "model", tokenizer=tmp_path / "tok")
        assert lm.encode("w5 w6") == [5, 6]

    def test_an_encoder_decoder_directory_is_refused_before_its_weights_load(self, tmp_path: Path) -> None:
        """A T5 directory (its config alone) is refused with one line naming encoder-decoder."""
        transformers.T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1).save_pretrained(tmp_path)
        with pytest.raises(ValueError, match=r"'t5' is an encoder-decoder model"):
            load_pretrained(tmp_path)
