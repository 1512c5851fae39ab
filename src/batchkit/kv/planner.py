"""KV-cache memory planning: how many blocks fit, and how many sequences they serve.

The formula: ``kv_bytes = 2 * tokens * num_layers * num_kv_heads * head_dim * dtype_bytes`` (the 2
is K and V). A device's budget for the cache is what is left of ``gpu_memory_utilization`` of its
memory after the weights and the activation peak.

A config's sliding window (Mistral, Gemma2, Qwen2 with ``use_sliding_window``) is read and
reported, but counts no saving: one block table serves every layer, admission reserves a
request's whole length, and only a model whose every layer slides (Mistral) gives blocks back as
it decodes (to other requests), so the plan counts a sliding layer as a full one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._validate import positive_int, positive_int_or_none

__all__ = [
    "PRESETS",
    "KVPlan",
    "ModelShape",
    "dtype_bytes_of",
    "kv_cache_bytes",
    "layer_windows",
    "plan",
    "read_hf_config",
]

# Layer types whose attention is full or sliding-window over the sequence: what paged K/V holds.
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")

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
    "float64": 8,
    "double": 8,
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8": 1,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
}


def dtype_bytes_of(dtype: object) -> int:
    """Bytes per value of a config's ``torch_dtype`` (``"float16"``, ``"torch.bfloat16"``, any
    ``float8_*`` variant such as ``"float8_e4m3fn"``, ...).

    Raises:
        ValueError: a dtype this table does not know (pass ``dtype_bytes`` explicitly).
    """
    name = str(dtype).removeprefix("torch.").lower()
    if name.startswith(("float8", "fp8")):
        return 1  # float8_e4m3fn, float8_e5m2, ...fnuz, float8_e8m0fnu: one byte each
    if name in _DTYPE_BYTES:
        return _DTYPE_BYTES[name]
    raise ValueError(f"unknown torch_dtype {dtype!r}: pass dtype_bytes (1 for fp8/int8, 2 for fp16/bf16, 4 for fp32)")


def kv_cache_bytes(tokens: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int = 2) -> int:
    """Bytes of K and V for ``tokens`` tokens: ``2 * tokens * layers * kv_heads * head_dim * dtype_bytes``."""
    for name, v in (
        ("tokens", tokens),
        ("num_layers", num_layers),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("dtype_bytes", dtype_bytes),
    ):
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
    sliding_window: int | None = None  # the window of the sliding layers (None: none)
    num_sliding_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            positive_int(f"ModelShape's {name}", getattr(self, name))
        w, k = self.sliding_window, self.num_sliding_layers
        positive_int_or_none("ModelShape's sliding_window", w)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.num_layers or (k > 0) != (w is not None):
            raise ValueError(
                f"ModelShape's num_sliding_layers must be in [0, num_layers], and > 0 exactly when there is a "
                f"sliding_window, got {k!r} with sliding_window={w!r}"
            )
        n = self.num_params
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ValueError(f"ModelShape's num_params must be an int >= 0 or None (unknown), got {n!r}")

    @classmethod
    def from_hf_config(cls, config: Any, dtype_bytes: int | None = None) -> ModelShape:
        """Read a Hugging Face config (a ``transformers`` config object, a dict, or a path to
        ``config.json``): layers, KV heads (``num_key_value_heads``, falling back to
        ``num_attention_heads``), head_dim (``head_dim`` or ``hidden_size / num_attention_heads``),
        the dtype (``torch_dtype``/``dtype``) and the sliding window (see :func:`layer_windows`).
        The parameter estimate
        counts every expert of a mixture-of-experts model (``num_local_experts``/``num_experts``).
        """
        if isinstance(config, (str, Path)):
            config = read_hf_config(config)
        get = _getter(config)
        if get("num_hidden_layers") is None or get("num_attention_heads") is None:
            # Named by the config itself (GPT-2's n_layer, or names nested in text_config, are not
            # planned from, even where transformers would map them).
            raise ValueError("config needs num_hidden_layers and num_attention_heads")
        config = as_transformers_config(config)
        get = _getter(config)
        layers = _positive_int(get, "num_hidden_layers")
        heads = _positive_int(get, "num_attention_heads")
        kv_heads = _positive_int(get, "num_key_value_heads") if get("num_key_value_heads") else heads
        if get("head_dim"):
            head_dim = _positive_int(get, "head_dim")
        elif get("hidden_size") is not None:
            hidden = _positive_int(get, "hidden_size")
            if hidden % heads:
                raise ValueError(
                    f"config's hidden_size {hidden} is not a multiple of num_attention_heads {heads}: add head_dim"
                )
            head_dim = hidden // heads
        else:
            raise ValueError("config needs hidden_size (or head_dim) to know the size of each attention head")
        if dtype_bytes is None:
            dtype_bytes = dtype_bytes_of(get("torch_dtype") or get("dtype") or "float16")
        else:
            positive_int("dtype_bytes", dtype_bytes)
        num_params = _estimate_params(get) if get("hidden_size") else None
        windows = [w for w in layer_windows(config) if w is not None]
        return cls(layers, kv_heads, head_dim, dtype_bytes, num_params, max(windows, default=None), len(windows))

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_cache_bytes(1, self.num_layers, self.num_kv_heads, self.head_dim, self.dtype_bytes)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """Read a Hugging Face ``config.json`` into a dict.

    Raises:
        OSError: the file cannot be read (missing, a directory, no permission).
        ValueError: the file is not UTF-8 JSON holding an object.
    """
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(f"{path} is a folder: pass the config.json inside it")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} is not a text file ({exc.reason}): pass a config.json") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object of config fields")
    return data


def as_transformers_config(config: Any) -> Any:
    """A config dict with a ``model_type`` transformers knows, as transformers' own config object
    for it, whose defaults fill what the dict leaves out (Gemma's head_dim, Gemma 2's alternating
    sliding layers, Qwen2's ``max_window_layers``...); anything else as it is (so without
    transformers installed, the dict's own fields are read)."""
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        return config
    try:
        import transformers
    except ImportError:
        return config
    try:
        return transformers.AutoConfig.for_model(**config)
    except (ValueError, KeyError, TypeError):  # a model_type this transformers does not know
        return config


def _getter(config: Any) -> Any:
    """``get(key, default)`` over a dict or a config object."""
    if isinstance(config, dict):
        return config.get
    return lambda k, d=None: getattr(config, k, d)


def layer_windows(config: Any) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention) of a config (object or dict: see
    :func:`as_transformers_config`), read as transformers reads it: ``layer_types`` when the
    config has them (``"sliding_attention"`` layers get ``sliding_window``), else
    ``sliding_window`` on every layer, unless ``use_sliding_window`` is false (Qwen2, Qwen3,
    Qwen2-MoE).

    Raises:
        ValueError: a layer type that is not attention over the sequence (linear attention,
            chunked attention, a convolution, ...): paged K/V cannot hold it.
    """
    get = _getter(as_transformers_config(config))
    num_layers = _positive_int(get, "num_hidden_layers")
    window = get("sliding_window") or None
    if get("use_sliding_window") is False:
        window = None
    types = get("layer_types")
    if types is None:
        return (int(window) if window else None,) * num_layers
    other = sorted({t for t in types if t not in _ATTENTION_LAYER_TYPES})
    if other:
        raise ValueError(
            f"layer type {other[0]!r} is not supported: batchkit's paged KV cache holds attention layers only"
        )
    if "sliding_attention" in types and not window:
        raise ValueError("the config has sliding_attention layers but no sliding_window")
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types)


def _positive_int(get: Any, key: str) -> int:
    value = get(key)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
        or value < 1
    ):
        raise ValueError(f"config's {key} must be a whole number >= 1, got {value!r}")
    return int(value)


def _estimate_params(get: Any) -> int:
    """Parameter count of a Llama-style decoder (or a mixture of experts) from its config."""
    h = _positive_int(get, "hidden_size")
    heads = _positive_int(get, "num_attention_heads")
    kv = _positive_int(get, "num_key_value_heads") if get("num_key_value_heads") else heads
    hd = _positive_int(get, "head_dim") if get("head_dim") else h // heads
    inter = _positive_int(get, "intermediate_size") if get("intermediate_size") else 4 * h
    vocab = _positive_int(get, "vocab_size") if get("vocab_size") else 32000
    layers = _positive_int(get, "num_hidden_layers")
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    mlp = 3 * h * inter
    experts_key = "num_local_experts" if get("num_local_experts") else "num_experts"  # Mixtral / Qwen-MoE
    if get(experts_key):
        n = _positive_int(get, experts_key)
        expert = _positive_int(get, "moe_intermediate_size") if get("moe_intermediate_size") else inter
        shared = _positive_int(get, "shared_expert_intermediate_size") if get("shared_expert_intermediate_size") else 0
        mlp = 3 * h * expert * n + 3 * h * shared + h * n  # every expert, the shared one, the router
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
    sliding_window: int | None = None
    num_sliding_layers: int = 0

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
        if self.sliding_window is not None:
            lines.append(
                f"{'sliding window (counted in full)':40} {self.sliding_window:10,d} tokens on "
                f"{self.num_sliding_layers} layers"
            )
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
        TypeError: ``model`` is not a :class:`ModelShape`.
        ValueError: bad fractions or sizes, no memory left for the cache, or not room for one block.
    """
    if not isinstance(model, ModelShape):
        raise TypeError(
            f"plan() takes a batchkit.ModelShape (e.g. ModelShape.from_hf_config(config)), got {type(model).__name__}"
        )
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    for name, v in (("block_size", block_size), ("mean_seq_len", mean_seq_len), ("device_bytes", device_bytes)):
        positive_int(name, v)
    for name, b in (("weight_bytes", weight_bytes), ("activation_bytes", activation_bytes)):
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 0):
            raise ValueError(f"{name} must be an int >= 0, got {b!r}")
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
    if num_blocks < 1:
        raise ValueError(
            f"one block of {block_size} tokens needs {per_block / 1024**3:.3g} GiB but the KV cache has "
            f"{kv_budget / 1024**3:.3g} GiB: use a smaller block_size"
        )
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
        sliding_window=model.sliding_window,
        num_sliding_layers=model.num_sliding_layers,
    )
