"""KV memory planner: the formula, HF config reading, plans and the `batchkit plan` CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

import pytest

import batchkit
from batchkit import ModelShape, kv, kv_cache_bytes
from batchkit.cli import main
from batchkit.kv.planner import PRESETS, plan


def test_kv_bytes_formula() -> None:
    """2 * tokens * layers * kv_heads * head_dim * dtype_bytes; 0.5 MiB per token for Llama-2-7B in fp16."""
    assert kv_cache_bytes(1, 32, 32, 128, 2) == 524_288
    assert kv_cache_bytes(10, 2, 4, 8, 4) == 2 * 10 * 2 * 4 * 8 * 4


def test_shape_from_hf_config_dict_object_and_file(tmp_path: Path) -> None:
    """GQA heads, head_dim fallback and dtype are read from any config form."""
    cfg = dict(PRESETS["llama-3-8b"])
    shape = ModelShape.from_hf_config(cfg)
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype_bytes) == (32, 8, 128, 2)
    assert shape.num_params is not None
    assert 7.9e9 < shape.num_params < 8.2e9
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert ModelShape.from_hf_config(str(path)) == shape

    class Obj:
        num_hidden_layers, num_attention_heads, hidden_size, head_dim = 4, 8, 256, 32

    assert ModelShape.from_hf_config(Obj()).num_kv_heads == 8
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_hf_config({})


def test_plan_for_a_7b_model_on_an_80gb_device() -> None:
    """The worked example of docs/kv-cache.md."""
    shape = ModelShape.from_hf_config(PRESETS["llama-2-7b"])
    p = plan(shape, device_bytes=80 * 1024**3, activation_bytes=2 * 1024**3, block_size=16, mean_seq_len=1024)
    assert p.kv_bytes_per_token == 524_288
    budget = int(80 * 1024**3 * 0.9) - p.weight_bytes - 2 * 1024**3
    assert p.num_blocks == budget // (524_288 * 16)
    assert p.max_tokens == p.num_blocks * 16
    assert p.max_num_seqs == p.num_blocks // 64
    assert p.kv_bytes <= budget
    assert "KV cache" in p.table()


def test_plan_refuses_a_model_that_does_not_fit() -> None:
    """Weights larger than the usable memory is a clear error."""
    shape = ModelShape(32, 8, 128, 2)
    with pytest.raises(ValueError, match="no memory left"):
        plan(shape, device_bytes=10 * 1024**3, weight_bytes=16 * 1024**3)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        plan(shape, device_bytes=1, weight_bytes=0, gpu_memory_utilization=0)


def test_cli_plan_prints_the_budget_table(capsys: pytest.CaptureFixture[str]) -> None:
    """`batchkit plan` prints weights, activations, KV and reserve for a preset."""
    assert main(["plan", "--preset", "llama-2-7b", "--device-gib", "80"]) == 0
    out = capsys.readouterr().out
    for row in ("weights", "activation peak", "KV cache", "reserve", "max_num_seqs"):
        assert row in out
    assert main(["plan", "--preset", "nope"]) == 2


@pytest.mark.parametrize(
    ("dtype", "nbytes"),
    [
        ("float8_e4m3fn", 1),
        ("torch.float8_e5m2", 1),
        ("float8_e4m3fnuz", 1),
        ("bfloat16", 2),
        ("torch.float16", 2),
        ("float32", 4),
        ("float", 4),
    ],
)
def test_dtype_bytes_from_torch_dtype(dtype: str, nbytes: int) -> None:
    """Every fp8 variant is one byte (not the 2-byte fallback it used to get); the usual names map as torch does."""
    cfg = {**PRESETS["llama-2-7b"], "torch_dtype": dtype}
    assert ModelShape.from_hf_config(cfg).dtype_bytes == nbytes


def test_unknown_dtype_is_an_error_not_a_guess() -> None:
    """An unknown torch_dtype is refused with the fix (pass dtype_bytes), and dtype_bytes overrides it."""
    cfg = {**PRESETS["llama-2-7b"], "torch_dtype": "int4"}
    with pytest.raises(ValueError, match="pass dtype_bytes"):
        ModelShape.from_hf_config(cfg)
    assert ModelShape.from_hf_config(cfg, dtype_bytes=1).dtype_bytes == 1


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"num_hidden_layers": 4, "num_attention_heads": 8}, "needs hidden_size"),
        ({"num_hidden_layers": 0, "num_attention_heads": 8, "hidden_size": 64}, "num_hidden_layers must be"),
        ({"num_hidden_layers": 4, "num_attention_heads": "8", "hidden_size": 64}, "num_attention_heads must be"),
        ({"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": float("nan")}, "hidden_size must be"),
        ({"num_hidden_layers": 4, "num_attention_heads": 6, "hidden_size": 64}, "not a multiple"),
    ],
)
def test_bad_configs_are_value_errors(cfg: dict[str, object], match: str) -> None:
    """A config without the fields the cache needs, or with nonsense in them, names the field."""
    with pytest.raises(ValueError, match=match):
        ModelShape.from_hf_config(cfg)


def test_config_files_that_cannot_be_read(tmp_path: Path) -> None:
    """A folder, invalid JSON or a JSON list is a clear error naming the file, not a traceback from json."""
    with pytest.raises(IsADirectoryError, match="is a folder"):
        ModelShape.from_hf_config(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"num_hidden_layers": 4,')
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelShape.from_hf_config(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON list"):
        ModelShape.from_hf_config(bad)
    with pytest.raises(FileNotFoundError):
        ModelShape.from_hf_config(tmp_path / "missing.json")


def test_plan_refuses_a_block_that_does_not_fit() -> None:
    """A block larger than the whole KV budget is an error (it used to plan "0 blocks")."""
    shape = ModelShape(32, 32, 128, 2)  # 0.5 MiB per token
    with pytest.raises(ValueError, match="smaller block_size"):
        plan(shape, device_bytes=10 * 1024**3, weight_bytes=8 * 1024**3, block_size=4096)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weight_bytes": -100 * 1024**3}, "weight_bytes must be an int >= 0"),
        ({"activation_bytes": -1}, "activation_bytes must be an int >= 0"),
        ({"block_size": 0}, "block_size must be an int >= 1"),
        ({"device_bytes": 0}, "device_bytes must be an int >= 1"),
    ],
)
def test_plan_refuses_negative_or_empty_sizes(kwargs: dict[str, int], match: str) -> None:
    """Negative weights no longer plan a KV cache bigger than the device."""
    args: dict[str, int] = {"device_bytes": 80 * 1024**3, "weight_bytes": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan(ModelShape(32, 8, 128, 2), **args)


# Published config.json fields (the KV-relevant ones) of models beside Llama.
ARCHITECTURE_CONFIGS: dict[str, tuple[dict[str, Any], tuple[int, int, int, int | None, int]]] = {
    # name: (config, (layers, kv_heads, head_dim, sliding_window, sliding layers))
    "qwen2-7b": (
        {
            "model_type": "qwen2",
            "hidden_size": 3584,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "use_sliding_window": False,
            "sliding_window": 131072,
            "torch_dtype": "bfloat16",
        },
        (28, 4, 128, None, 0),
    ),
    "qwen3-0.6b": (  # head_dim 128, not hidden_size / heads = 64
        {"hidden_size": 1024, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8}
        | {"head_dim": 128},
        (28, 8, 128, None, 0),
    ),
    "mistral-7b": (  # one window on every layer
        {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}
        | {"sliding_window": 4096},
        (32, 8, 128, 4096, 32),
    ),
    "gemma-7b": (
        {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16}
        | {"head_dim": 256},
        (28, 16, 256, None, 0),
    ),
    "gemma2-like": (  # sliding and full layers alternating
        {"hidden_size": 2304, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4}
        | {"head_dim": 256, "sliding_window": 4096}
        | {"layer_types": ["sliding_attention", "full_attention"] * 2},
        (4, 4, 256, 4096, 2),
    ),
}


@pytest.mark.parametrize("name", sorted(ARCHITECTURE_CONFIGS))
def test_shape_reads_the_kv_fields_of_every_architecture(name: str) -> None:
    """Layers, KV heads, head_dim (explicit where it is not hidden / heads), and the sliding
    window with the layers it covers, from each family's config fields."""
    config, want = ARCHITECTURE_CONFIGS[name]
    shape = ModelShape.from_hf_config(config)
    got = (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.sliding_window, shape.num_sliding_layers)
    assert got == want


def test_a_mixture_of_experts_counts_every_expert_in_its_weights() -> None:
    """Mixtral-8x7B's eight experts per layer: about 46.7 billion parameters, not a 7B's."""
    mixtral = dict(PRESETS["llama-3-8b"]) | {"vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2}
    shape = ModelShape.from_hf_config(mixtral)
    assert shape.num_params is not None
    assert 46.4e9 < shape.num_params < 47.0e9


def test_a_sliding_window_is_printed_and_counted_in_full(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`batchkit plan --config` on a Mistral config names the window and its layers; the KV bytes
    per token are those of every layer in full (batchkit keeps blocks that leave the window)."""
    config, _ = ARCHITECTURE_CONFIGS["mistral-7b"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config | {"intermediate_size": 14336, "vocab_size": 32000}))
    assert main(["plan", "--config", str(path), "--device-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "sliding window (counted in full)" in out
    assert "4,096 tokens on 32 layers" in out
    assert ModelShape.from_hf_config(config).kv_bytes_per_token == kv_cache_bytes(1, 32, 8, 128, 2)


@pytest.mark.parametrize(
    ("config", "sliding", "head_dim"),
    [
        # Gemma 2 without layer_types: every other layer slides, head_dim 256 by the model's default
        ({"model_type": "gemma2", "num_hidden_layers": 26, "sliding_window": 4096}, 13, 256),
        # Qwen2: the layers from max_window_layers on slide
        ({"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 4096, "use_sliding_window": True,
          "max_window_layers": 2}, 2, 32),
    ],
)  # fmt: skip
def test_a_config_dict_or_file_is_read_with_its_models_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any], sliding: int, head_dim: int
) -> None:
    """A dict or config.json is read as transformers reads it, through the model's own config
    class (it read the dict's fields alone: Gemma 2's window on all 26 layers, Qwen2's on all 4,
    Gemma's head_dim as hidden_size / heads)."""
    pytest.importorskip("transformers")
    config = config | {"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 256}
    shape = ModelShape.from_hf_config(config)
    assert (shape.num_sliding_layers, shape.sliding_window, shape.head_dim) == (sliding, 4096, head_dim)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert ModelShape.from_hf_config(path) == shape
    assert main(["plan", "--config", str(path), "--device-gib", "80"]) == 0
    assert f"4,096 tokens on {sliding} layers" in capsys.readouterr().out


def test_a_layer_that_is_not_attention_is_refused_by_the_planner() -> None:
    """A config with linear-attention layers has no paged KV to plan: a ValueError naming the type."""
    config = dict(PRESETS["llama-3-8b"]) | {
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
    }
    with pytest.raises(ValueError, match=r"layer type 'linear_attention'"):
        ModelShape.from_hf_config(config)


GIB = 1024**3


def test_the_plan_follows_the_guide_formulas() -> None:
    """blocks = budget // (kv_bytes_per_token * block_size) and sequences =
    num_blocks // ceil(L / block_size), for lengths that are not a multiple of the block."""
    shape = batchkit.ModelShape(num_layers=32, num_kv_heads=32, head_dim=128, num_params=6_740_000_000)
    assert shape.kv_bytes_per_token == 2 * 1 * 32 * 32 * 128 * 2
    for mean_len in (1, 17, 1000, 1024):
        p = kv.plan(shape, device_bytes=80 * GIB, activation_bytes=2 * GIB, mean_seq_len=mean_len)
        budget = 80 * GIB * 0.9 - 6.74e9 * 2 - 2 * GIB
        assert p.num_blocks == int(budget // (shape.kv_bytes_per_token * 16)) == 7353
        assert p.max_tokens == 7353 * 16
        assert p.max_num_seqs == 7353 // math.ceil(mean_len / 16)


def test_grouped_query_attention_holds_four_times_the_tokens_per_byte() -> None:
    """Llama-3-8B (8 KV heads) against Llama-2-7B (32): a quarter of the KV bytes per token, so
    four times the tokens in the same cache."""
    l2 = batchkit.ModelShape(num_layers=32, num_kv_heads=32, head_dim=128)
    l3 = batchkit.ModelShape(num_layers=32, num_kv_heads=8, head_dim=128)
    assert l2.kv_bytes_per_token == 4 * l3.kv_bytes_per_token
    p2 = kv.plan(l2, device_bytes=80 * GIB, weight_bytes=13 * GIB)
    p3 = kv.plan(l3, device_bytes=80 * GIB, weight_bytes=13 * GIB)
    assert p3.max_tokens == pytest.approx(4 * p2.max_tokens, rel=1e-3)


def test_plan_config_reads_a_hugging_face_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`batchkit plan --config config.json` on Llama-2-7B's own config (no parameter count in it)
    prints the numbers of the guide's worked example."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vocab_size": 32000,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", "--config", str(path), "--device-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "32 layers, 32 KV heads x 128, 2 bytes per value" in out
    for row in ("weights                                     12.55 GiB", "7,353 x 16", "117,648", "114"):
        assert row in out


@pytest.mark.parametrize(
    "config",
    [
        {"n_layer": 12, "n_head": 12, "n_embd": 768, "vocab_size": 50257, "model_type": "gpt2"},
        {"model_type": "llava", "text_config": {"num_hidden_layers": 32, "num_attention_heads": 32}},
    ],
    ids=["gpt2-names", "nested-text-config"],
)
def test_plan_config_refuses_a_config_without_the_names_it_reads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: dict[str, Any]
) -> None:
    """A config that does not name num_hidden_layers / num_attention_heads at its top level is
    refused (exit status 2, naming what it needs), not planned from guesses."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main(["plan", "--config", str(path)]) == 2
    assert "num_hidden_layers" in capsys.readouterr().err


def test_plan_config_defaults_the_kv_heads_to_the_attention_heads() -> None:
    config = {"hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 32, "torch_dtype": "float16"}
    shape = batchkit.ModelShape.from_hf_config(config)
    assert (shape.num_kv_heads, shape.head_dim, shape.dtype_bytes) == (32, 128, 2)


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"head_dim": -128}, "head_dim"),
        ({"dtype_bytes": 0}, "dtype_bytes"),
        ({"num_layers": 2.5}, "num_layers"),
        ({"num_params": -1}, "num_params"),
    ],
)
def test_a_model_shape_no_model_has_is_a_value_error(fields: dict[str, Any], name: str) -> None:
    """A ModelShape whose KV bytes per token would be 0 or negative is refused (plan() divided by
    it: ZeroDivisionError, or a negative block size)."""
    shape: dict[str, Any] = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "num_params": 10**9, **fields}
    with pytest.raises(ValueError, match=name):
        batchkit.ModelShape(**shape)


def test_kv_cache_bytes_refuses_every_negative_size() -> None:
    """kv_cache_bytes is 2 * tokens * num_layers * num_kv_heads * head_dim * dtype_bytes: a
    negative factor is a ValueError naming it, never a negative byte count."""
    assert batchkit.kv_cache_bytes(3, 2, 4, 8, 1) == 2 * 3 * 2 * 4 * 8
    for name in ("head_dim", "dtype_bytes"):
        sizes: dict[str, int] = {"tokens": 1, "num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype_bytes": 2}
        sizes[name] = -1
        with pytest.raises(ValueError, match=name):
            batchkit.kv_cache_bytes(**sizes)


def test_plan_takes_a_model_shape() -> None:
    """kv.plan(model, ...) plans for a ModelShape; a model object instead is a TypeError saying so."""
    pytest.importorskip("torch")
    from batchkit.models import LlamaConfig, LlamaModel

    model = LlamaModel(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1))
    with pytest.raises(TypeError, match="ModelShape"):
        batchkit.kv.plan(cast(Any, model), device_bytes=10**9)
