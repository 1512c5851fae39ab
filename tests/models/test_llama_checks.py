"""batchkit.models.llama's checks that need torch alone (tests/models/test_llama.py needs
transformers too): the reference model's config refuses shapes no model can have, when it is
made."""

from __future__ import annotations

from typing import Any, cast

import pytest

pytest.importorskip("torch")

import batchkit
from batchkit.models import LlamaConfig

WAIT = 60.0


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


# --------------------------------------------------------------------------- docs/api.md: LlamaModel, from_hf


def test_a_llama_model_refuses_a_cache_shaped_for_another_model_naming_make_cache() -> None:
    """LlamaModel is a step function on PagedKVCache; a cache of other layers / KV heads / head
    size fails its requests with a ValueError saying to use make_cache (it was an IndexError
    from deep inside the attention, or a shape error about keys and values)."""
    from batchkit.models import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = LlamaModel(cfg)
    with batchkit.ContinuousDecodeLoop(model, model.make_cache(num_blocks=8, block_size=4)) as loop:
        assert len(loop.submit([1, 2], max_new_tokens=2).result(WAIT)) == 2
    for layers, heads, dim in ((1, 2, 8), (2, 1, 8), (2, 2, 4)):
        wrong = batchkit.PagedKVCache(layers, 8, 4, heads, dim)
        with batchkit.ContinuousDecodeLoop(model, wrong) as loop, pytest.raises(ValueError, match="make_cache"):
            loop.submit([1, 2], max_new_tokens=2).result(WAIT)
    with pytest.raises(TypeError, match="LlamaConfig"):
        LlamaModel(cast(Any, {"vocab_size": 32}))


def test_llama_config_from_hf_takes_a_config_object_not_a_dict() -> None:
    """LlamaConfig.from_hf(config): "from a transformers.LlamaConfig"; a dict read none of its
    keys (its unsupported-feature checks all passed) and then failed with an AttributeError."""
    from batchkit.models import LlamaConfig

    with pytest.raises(TypeError, match=r"transformers\.LlamaConfig\(\*\*d\)"):
        LlamaConfig.from_hf({"vocab_size": 32, "hidden_act": "gelu"})


def test_a_tied_model_given_a_state_dict_without_embeddings_names_what_is_missing() -> None:
    """load_hf_state_dict refuses a state dict that does not fit with a ValueError listing the
    missing weights; for a model with tied embeddings that lacked them it was a bare KeyError."""
    from batchkit.models import LlamaConfig, LlamaModel

    cfg = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, tie_word_embeddings=True
    )
    model = LlamaModel(cfg)
    state = {k: v for k, v in model.state_dict().items() if k not in ("model.embed_tokens.weight", "lm_head.weight")}
    with pytest.raises(ValueError, match=r"missing \['model\.embed_tokens\.weight'"):
        model.load_hf_state_dict(state)
