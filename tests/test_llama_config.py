"""LlamaConfig.from_hf: a Hugging Face config this model cannot run exactly is refused up front."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from batchkit.models import LlamaConfig  # noqa: E402

SMALL: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_a_plain_llama_config_is_taken_field_by_field() -> None:
    cfg = LlamaConfig.from_hf(transformers.LlamaConfig(**SMALL, rope_theta=5000.0, tie_word_embeddings=True))
    assert (cfg.hidden_size, cfg.num_key_value_heads, cfg.dim_per_head) == (32, 2, 8)
    assert cfg.rope_theta == 5000.0
    assert cfg.tie_word_embeddings


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "SiLU"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "RoPE"),
    ],
)
def test_what_the_model_does_not_implement_is_a_value_error(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LlamaConfig.from_hf(transformers.LlamaConfig(**SMALL, **extra))
