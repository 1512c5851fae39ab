"""batchkit.models.llama's checks that need torch alone (tests/models/test_llama.py needs
transformers too): the reference model's config refuses shapes no model can have, when it is
made."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")

from batchkit.models import LlamaConfig


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_attention_heads": 8, "num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"num_hidden_layers": -1}, "num_hidden_layers"),
        ({"head_dim": 0}, "head_dim"),
        ({"hidden_size": 4, "num_attention_heads": 8, "num_key_value_heads": 4}, "dimension per head"),
    ],
)
def test_a_config_no_model_can_have_is_a_value_error(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**fields)


def test_the_default_and_a_gqa_config_with_explicit_head_dim_are_valid() -> None:
    assert LlamaConfig().dim_per_head == 32
    cfg = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    assert cfg.dim_per_head == 64
