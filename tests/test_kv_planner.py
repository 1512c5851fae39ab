"""KV memory planner: the formula, HF config reading, plans and the `batchkit plan` CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchkit import ModelShape, kv_cache_bytes
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
