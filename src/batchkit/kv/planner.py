"""KV-cache memory planning: how many blocks fit, and how many sequences they serve.

The formula: ``kv_bytes = 2 * tokens * num_layers * num_kv_heads * head_dim * dtype_bytes`` (the 2
is K and V). A device's budget for the cache is what is left of ``gpu_memory_utilization`` of its
memory after the weights and the activation peak.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "KVPlan", "ModelShape", "kv_cache_bytes", "plan"]

# Published configs of a few well-known models (Hugging Face config.json fields).
PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "torch_dtype": "float16",
    },
    "llama-3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    },
    "llama-2-70b": {
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "torch_dtype": "float16",
    },
}

_DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "int8": 1,
}


def kv_cache_bytes(tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of K and V for ``tokens`` tokens: ``2 * tokens * layers * kv_heads * head_dim * dtype_bytes``."""
    for name, v in (("tokens", tokens), ("num_layers", num_layers), ("num_kv_heads", num_kv_heads)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0, got {v}")
    return 2 * tokens * num_layers * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the KV cache needs to know about a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    num_params: int | None = None

    @classmethod
    def from_hf_config(cls, config: Any, dtype_bytes: int | None = None) -> ModelShape:
        """Read a Hugging Face config (a ``transformers`` config object, a dict, or a path to
        ``config.json``): layers, KV heads (``num_key_value_heads``, falling back to
        ``num_attention_heads``), head_dim (``head_dim`` or ``hidden_size / num_attention_heads``)
        and the dtype (``torch_dtype``/``dtype``).
        """
        if isinstance(config, (str, Path)):
            config = json.loads(Path(config).read_text())
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        layers = get("num_hidden_layers")
        heads = get("num_attention_heads")
        if layers is None or heads is None:
            raise ValueError("config needs num_hidden_layers and num_attention_heads")
        kv_heads = get("num_key_value_heads") or heads
        head_dim = get("head_dim") or get("hidden_size") // heads
        if dtype_bytes is None:
            dt = str(get("torch_dtype") or get("dtype") or "float16").replace("torch.", "")
            dtype_bytes = _DTYPE_BYTES.get(dt, 2)
        num_params = _estimate_params(get) if get("hidden_size") else None
        return cls(int(layers), int(kv_heads), int(head_dim), int(dtype_bytes), num_params)

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_cache_bytes(1, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes)


def _estimate_params(get: Any) -> int:
    """Parameter count of a Llama-style decoder from its config."""
    h = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    kv = int(get("num_key_value_heads") or heads)
    hd = int(get("head_dim") or h // heads)
    inter = int(get("intermediate_size") or 4 * h)
    vocab = int(get("vocab_size") or 32000)
    layers = int(get("num_hidden_layers"))
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    mlp = 3 * h * inter
    per_layer = attn + mlp + 2 * h
    embed = vocab * h * (1 if get("tie_word_embeddings", False) else 2)
    return layers * per_layer + embed + h


@dataclass(frozen=True, slots=True)
class KVPlan:
    """The budget table of a KV-cache plan (bytes unless named otherwise)."""

    device_bytes: int
    usable_bytes: int
    weight_bytes: int
    activation_bytes: int
    reserve_bytes: int
    kv_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int
    max_tokens: int
    mean_seq_len: int
    max_num_seqs: int

    def table(self) -> str:
        """The budget as a printable table."""
        gib = 1024**3
        rows = [
            ("device memory", self.device_bytes),
            ("  reserve (1 - gpu_memory_utilization)", self.reserve_bytes),
            ("  weights", self.weight_bytes),
            ("  activation peak", self.activation_bytes),
            ("  KV cache", self.kv_bytes),
        ]
        lines = [f"{name:40} {b / gib:10.2f} GiB" for name, b in rows]
        lines += [
            f"{'KV bytes per token':40} {self.kv_bytes_per_token:10,d} B",
            f"{'blocks x block_size':40} {self.num_blocks:,d} x {self.block_size}",
            f"{'tokens that fit':40} {self.max_tokens:10,d}",
            f"{'max_num_seqs at mean length ' + str(self.mean_seq_len):40} {self.max_num_seqs:10,d}",
        ]
        return "\n".join(lines)


def plan(
    model: ModelShape,
    *,
    device_bytes: int,
    gpu_memory_utilization: float = 0.9,
    weight_bytes: int | None = None,
    activation_bytes: int = 0,
    block_size: int = 16,
    mean_seq_len: int = 1024,
) -> KVPlan:
    """How many KV blocks fit on a device, and how many sequences of ``mean_seq_len`` they hold.

    ``weight_bytes`` defaults to ``model.num_params * model.dtype_bytes`` when the parameter
    count is known.

    Raises:
        ValueError: bad fractions or sizes, or no memory left for the cache.
    """
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if block_size < 1 or mean_seq_len < 1:
        raise ValueError("block_size and mean_seq_len must be >= 1")
    if weight_bytes is None:
        if model.num_params is None:
            raise ValueError("pass weight_bytes (the model's parameter count is unknown)")
        weight_bytes = model.num_params * model.dtype_bytes
    usable = int(device_bytes * gpu_memory_utilization)
    kv_budget = usable - weight_bytes - activation_bytes
    if kv_budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {usable / 1024**3:.2f} GiB usable, weights "
            f"{weight_bytes / 1024**3:.2f} GiB, activations {activation_bytes / 1024**3:.2f} GiB"
        )
    per_token = model.kv_bytes_per_token
    per_block = per_token * block_size
    num_blocks = kv_budget // per_block
    tokens = num_blocks * block_size
    blocks_per_seq = -(-mean_seq_len // block_size)
    return KVPlan(
        device_bytes=device_bytes,
        usable_bytes=usable,
        weight_bytes=weight_bytes,
        activation_bytes=activation_bytes,
        reserve_bytes=device_bytes - usable,
        kv_bytes=num_blocks * per_block,
        kv_bytes_per_token=per_token,
        block_size=block_size,
        num_blocks=int(num_blocks),
        max_tokens=int(tokens),
        mean_seq_len=mean_seq_len,
        max_num_seqs=int(num_blocks // blocks_per_seq),
    )
