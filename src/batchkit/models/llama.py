"""A small Llama-style decoder on :class:`~batchkit.PagedKVCache`: the reference step function.

RMSNorm, rotary position embeddings, grouped-query attention through ``paged_attention`` and a
SwiGLU MLP, with Hugging Face ``LlamaForCausalLM`` parameter names, so that a Llama state dict
loads as it is. It proves the step contract (``model(batch, kv) -> logits``) and serves the demo;
it is written for clarity on a CPU, not for speed on a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch
from torch import nn

from .._cpu import adapt_cpu_threads
from ..continuous.step import StepBatch
from ..kv.attention import AttentionPlan, plan_attention, planned_attention
from ..kv.cache import PagedKVCache
from ..kv.compiled import attention_plan  # also registers torch.ops.batchkit.write_kv / paged_attention
from ..kv.native import build_decode_attention, drop_linear
from ..kv.native import built as native_built
from ._scratch import scratch_steps

__all__ = ["LlamaConfig", "LlamaModel"]

logger = logging.getLogger(__name__)

_LinearFn = Callable[[torch.Tensor, nn.Linear], torch.Tensor]


@dataclass(frozen=True)
class LlamaConfig:
    """The shape of a Llama-style model (Hugging Face field names)."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        """Refuse a shape no model can have, here rather than at the first decode step.

        Raises:
            ValueError: a size below 1, or attention heads that are not a multiple of the KV heads.
        """
        sizes = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        )
        for name in sizes:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.head_dim is not None and (
            isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 1
        ):
            raise ValueError(f"head_dim must be an int >= 1 or None, got {self.head_dim!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.dim_per_head < 1:
            raise ValueError(
                f"hidden_size {self.hidden_size} gives no dimension per head for {self.num_attention_heads} heads"
            )

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, config: Any) -> LlamaConfig:
        """From a ``transformers.LlamaConfig`` (default RoPE, no biases, SiLU).

        Raises:
            TypeError: a dict (or another mapping) instead of a config object.
            ValueError: a RoPE scaling, attention or MLP biases, or an activation other than SiLU,
                which this model does not implement (its output would be wrong, not just slow).
        """
        if isinstance(config, Mapping):  # getattr() would read none of its keys: every check would pass
            raise TypeError(
                "from_hf takes a transformers.LlamaConfig, not a dict; build one with transformers.LlamaConfig(**d)"
            )
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(config, flag, False):
                raise ValueError(f"{flag}=True is not supported: LlamaModel's projections have no biases")
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"only the SiLU activation is supported, the config uses {act!r}")
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in ("default", None):
            raise ValueError(f"only default RoPE is supported, the config uses {rope_type!r}")
        theta = rope.get("rope_theta") if isinstance(rope, dict) else None
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads or config.num_attention_heads,
            head_dim=getattr(config, "head_dim", None),
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(theta or getattr(config, "rope_theta", None) or 10000.0),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == dtype and x.device.type == "cpu":
            # torch's rms_norm: the same operations dispatched from C++ in one call (fewer
            # Python steps in each of a step's 2 x layers + 1 norms), bit-equal to the
            # expression below in float32 on the CPU; not in bfloat16, where it rounds the
            # product once and transformers rounds it twice.
            return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.to(torch.promote_types(dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class _Fused(nn.Linear):
    """Projections of one input computed as one matmul: ``parts`` (name: output size) stacked
    along the output dimension in one weight. The module holding it reads and writes the parts
    under their own Hugging Face names (see :func:`_hold_fused`)."""

    def __init__(self, in_features: int, parts: dict[str, int]) -> None:
        super().__init__(in_features, sum(parts.values()), bias=False)
        self.parts = parts


def _hold_fused(module: nn.Module) -> None:
    """Make ``module``'s state dict name its :class:`_Fused` children's parts (``q_proj.weight``...)
    instead of the stacked weights, when saved and when loaded, so that a Llama state dict loads
    and saves as it is."""

    def split(module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, _: Any) -> None:
        for name, child in module.named_children():
            if isinstance(child, _Fused):
                parts = torch.split(state_dict.pop(prefix + name + ".weight"), list(child.parts.values()))
                state_dict.update((f"{prefix}{part}.weight", w) for part, w in zip(child.parts, parts, strict=True))

    def stack(module: nn.Module, state_dict: dict[str, torch.Tensor], prefix: str, *_: Any) -> None:
        for name, child in module.named_children():
            keys = [f"{prefix}{part}.weight" for part in getattr(child, "parts", ())]
            if keys and all(k in state_dict for k in keys):  # else the stacked weight is reported missing
                state_dict[prefix + name + ".weight"] = torch.cat([state_dict.pop(k) for k in keys])

    module.register_state_dict_post_hook(split)  # type: ignore[no-untyped-call]
    module.register_load_state_dict_pre_hook(stack)  # type: ignore[no-untyped-call]


class _Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d, h, kv = cfg.dim_per_head, cfg.num_attention_heads, cfg.num_key_value_heads
        self.qkv_proj = _Fused(cfg.hidden_size, {"q_proj": h * d, "k_proj": kv * d, "v_proj": kv * d})
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        _hold_fused(self)


class _MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = _Fused(cfg.hidden_size, {"gate_proj": size, "up_proj": size})
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=False)
        _hold_fused(self)


class _Pages(Protocol):
    """How a layer writes its new tokens' K/V and attends over its pages in one step."""

    def write(self, index: int, key: torch.Tensor, value: torch.Tensor) -> None: ...

    def attend(self, index: int, query: torch.Tensor) -> torch.Tensor: ...


class _EagerPages(NamedTuple):
    """The cache's own methods: padding slots skipped, CUDA kernels where the cache uses them."""

    batch: StepBatch
    kv: PagedKVCache
    plan: AttentionPlan

    def write(self, index: int, key: torch.Tensor, value: torch.Tensor) -> None:
        self.kv.scatter(index, key, value, self.batch.slot_mapping)

    def attend(self, index: int, query: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = planned_attention(query, self.kv.key(index), self.kv.value(index), self.plan)
        return out


class _OpPages(NamedTuple):
    """batchkit's custom operators (:mod:`batchkit.kv.compiled`), which a compiled step keeps as
    in-place calls on the cache tensor."""

    kv: torch.Tensor
    slots: torch.Tensor
    scale: float
    native: bool  # the write and attention in C++ (torch.ops.batchkit_native, once built), else Python

    def write(self, index: int, key: torch.Tensor, value: torch.Tensor) -> None:
        if self.native:
            torch.ops.batchkit_native.write_kv(self.kv, index, key, value, self.slots)
        else:
            torch.ops.batchkit.write_kv(self.kv, index, key, value, self.slots)

    def attend(self, index: int, query: torch.Tensor) -> torch.Tensor:
        if self.native:
            out: torch.Tensor = torch.ops.batchkit_native.paged_attention(query, self.kv, index, self.scale)
        else:
            out = torch.ops.batchkit.paged_attention(query, self.kv, index, self.scale)
        return out


class _Layer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _MLP(cfg)
        self.input_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: int, pages: _Pages, linear: _LinearFn
    ) -> torch.Tensor:
        attn, mlp = self.self_attn, self.mlp
        n, h, g, d = x.shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        qkv = linear(self.input_layernorm(x), attn.qkv_proj)
        qk = qkv[:, : (h + g) * d].view(n, h + g, d)  # the query and key heads, rotated together
        qk = qk * cos + qk.roll(d // 2, -1) * sin  # = x * cos + rotate_half(x) * sin (sin's sign folded in)
        pages.write(index, qk[:, h:], qkv[:, (h + g) * d :].view(n, g, d))
        o = pages.attend(index, qk[:, :h])
        x = x + linear(o.reshape(n, h * d), attn.o_proj)
        gate, up = linear(self.post_attention_layernorm(x), mlp.gate_up_proj).chunk(2, dim=-1)
        out: torch.Tensor = x + linear(nn.functional.silu(gate) * up, mlp.down_proj)
        return out


class _Decoder(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = _RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _plain_linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return nn.functional.linear(x, layer.weight)


class _Prepacked(NamedTuple):
    """A linear layer's weight reordered for oneDNN, and the oneDNN linear that runs on it."""

    weight: torch.Tensor
    linear: Callable[..., torch.Tensor]  # torch.ops.mkldnn._linear_pointwise

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, None, "none", [], "")


def _prepack(weight: torch.Tensor) -> _Prepacked | None:
    """``weight`` prepacked for oneDNN's linear, or None where oneDNN cannot run it (the plain
    matmul then serves).

    The oneDNN ops are torch's private ones: a build may lack them, or refuse a weight (bfloat16
    on a CPU without AVX512). Both are found here, once per weight, by reordering it and running
    the result on one row, so that no step meets the failure.
    """
    if weight.dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    try:
        ops = torch.ops.mkldnn
        prepacked = _Prepacked(ops._reorder_linear_weight(weight.detach(), None), ops._linear_pointwise)
        prepacked(weight.new_zeros(1, weight.shape[1]))
    except Exception as exc:  # noqa: BLE001 - whatever the reason (an op missing or refusing), F.linear serves
        logger.debug("a %s linear weight %s runs on F.linear, not oneDNN: %r", weight.dtype, tuple(weight.shape), exc)
        return None
    return prepacked


# The linear layers a compiled step calls, by key: torch.ops.batchkit.linear runs the model's own
# _linear (oneDNN weights made on first use and after a write), which a traced graph cannot call.
_LINEARS: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
# Keys are numbered in the order layers are compiled, not id()s: a key is a constant of the traced
# graph, so a step compiled the same way in another process is the same graph, which inductor's
# cache on disk then finds instead of generating its code again (half a minute a graph).
_keys = itertools.count(1)


def _register_linear(model: LlamaModel, layer: nn.Linear) -> int:
    """Make ``layer`` of ``model`` callable as ``torch.ops.batchkit.linear(x, layer.weight, key)``."""
    key, model_ref, layer_ref = next(_keys), weakref.ref(model), weakref.ref(layer)

    def run(x: torch.Tensor) -> torch.Tensor:
        owner, linear = model_ref(), layer_ref()
        if owner is None or linear is None:
            raise RuntimeError("the model this compiled step belongs to was deleted")
        return owner._linear(x, linear)

    _LINEARS[key] = run
    weakref.finalize(layer, _LINEARS.pop, key, None)
    return key


def _native_key(layer: nn.Linear) -> int:
    """``layer``'s key for ``torch.ops.batchkit_native.linear``, whose oneDNN copy of the weight
    is freed with the layer."""
    key = next(_keys)
    weakref.finalize(layer, drop_linear, key)
    return key


@torch.library.custom_op("batchkit::linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor, key: int) -> torch.Tensor:
    return _LINEARS[key](x)


@_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, key: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    d = config.dim_per_head
    return 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d))


class LlamaModel(nn.Module):
    """A Llama decoder whose forward is a batchkit step: ``model(batch, kv) -> logits``.

    The q/k/v projections of a layer are one matmul, and so are the MLP's gate and up
    projections (their weights stacked at load; the state dict keeps Hugging Face's names).
    On a CPU with oneDNN, :attr:`prepack_weights` (on by default) runs every linear layer on a
    copy of its weight reordered once for oneDNN, the first time it is used and again after the
    weight changes: decode steps of SmolLM2-135M of 16-48 rows ran 1.1-1.2x faster (see
    docs/benchmarks.md), for twice the weights' memory. Set it to False to keep only the
    weights (the reordered copies are then dropped at the next step). A layer whose weight
    oneDNN refuses, or a torch build without those (private) ops, runs on ``F.linear``.

    >>> model = LlamaModel(LlamaConfig(), dtype=torch.float32)
    >>> kv = model.make_cache(num_blocks=256, block_size=16)
    """

    prepack_weights: bool = True

    def __init__(self, config: LlamaConfig, *, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> None:
        if not isinstance(config, LlamaConfig):
            raise TypeError(
                f"config must be a batchkit.models.LlamaConfig (LlamaConfig.from_hf(...) reads a transformers "
                f"config), got {type(config).__name__}"
            )
        super().__init__()
        self.config = config
        self.model = _Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq = _rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.to(device=device, dtype=dtype)
        self.inv_freq = inv_freq.to(device)
        # Each linear layer's oneDNN copy of its weight, and which weight it was made from.
        self._packed: dict[int, tuple[tuple[int, int, torch.dtype], _Prepacked | None]] = {}
        self._compiled: Callable[..., torch.Tensor] | None = None  # see compile_step
        self._warmed = False  # compile_step(warm=True): the compiled step compiles no more
        # Each linear layer's key in the native extension's oneDNN copies, once compile_step
        # runs on it (None: the compiled step calls batchkit's Python operators).
        self._native_keys: dict[nn.Linear, int] | None = None
        self.eval()
        self.requires_grad_(False)

    @classmethod
    def empty(cls, config: LlamaConfig, *, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> LlamaModel:
        """A model whose weights are allocated but not initialised, to load weights into with
        :meth:`load_hf_state_dict` (skips the random initialisation, seconds on a CPU)."""
        with torch.device("meta"):
            model = cls(config, dtype=dtype, device="meta")
        model.to_empty(device=device)
        if config.tie_word_embeddings:  # to_empty gives each module its own tensor: tie them again
            model.lm_head.weight = model.model.embed_tokens.weight
        model.inv_freq = _rope_inv_freq(config).to(device)
        return model

    @classmethod
    def from_hf(cls, hf_model: Any, *, dtype: torch.dtype | None = None) -> LlamaModel:
        """Build from a ``transformers.LlamaForCausalLM`` (its config and weights)."""
        cfg = LlamaConfig.from_hf(hf_model.config)
        p = next(hf_model.parameters())
        model = cls.empty(cfg, dtype=dtype or p.dtype, device=p.device)
        model.load_hf_state_dict(hf_model.state_dict())
        return model

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load a Hugging Face Llama state dict (same names; rotary buffers ignored).

        Raises:
            ValueError: missing or unexpected weights, or shapes that do not match the config.
        """
        sd = {k: v for k, v in state_dict.items() if "rotary_emb" not in k}
        if self.config.tie_word_embeddings and "model.embed_tokens.weight" in sd:
            sd.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])
        try:
            result = self.load_state_dict(sd, strict=False)
        except RuntimeError as exc:
            raise ValueError(f"state dict does not fit this config: {exc}") from None
        # A stacked weight is missing when any of its parts is: name the parts, not the stack.
        expected = [p for k in result.missing_keys if k != "inv_freq" for p in self._hf_names(k)]
        missing = [k for k in expected if k not in sd]
        unexpected = [k for k in result.unexpected_keys if k not in expected]
        if missing or unexpected:
            raise ValueError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")

    def _hf_names(self, key: str) -> list[str]:
        """The Hugging Face names of the weight named ``key`` here (a stacked one has several)."""
        owner, _, name = key.rpartition(".")
        module = self.get_submodule(owner) if owner else self
        if name != "weight" or not isinstance(module, _Fused):
            return [key]
        base = owner.rpartition(".")[0]
        return [f"{base}.{part}.weight" if base else f"{part}.weight" for part in module.parts]

    def make_cache(self, num_blocks: int, block_size: int = 16, **kwargs: Any) -> PagedKVCache:
        """A :class:`PagedKVCache` shaped for this model (same dtype and device by default)."""
        p = next(self.parameters())
        kwargs.setdefault("dtype", p.dtype)
        kwargs.setdefault("device", p.device)
        return PagedKVCache(
            self.config.num_hidden_layers,
            num_blocks,
            block_size,
            self.config.num_key_value_heads,
            self.config.dim_per_head,
            **kwargs,
        )

    def forward(self, batch: StepBatch, kv: PagedKVCache) -> torch.Tensor:
        """The step: logits ``[len(batch.sample_indices), vocab_size]``.

        Raises:
            ValueError: ``kv`` is not shaped for this model (layers, KV heads, head size), e.g. a
                cache made by another model's :meth:`make_cache`.
        """
        adapt_cpu_threads()  # a team as wide as the CPUs other processes leave free (batchkit._cpu)
        cfg = self.config
        if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.dim_per_head,
        ):
            raise ValueError(
                f"the KV cache holds {kv.num_layers} layers x {kv.num_kv_heads} KV heads x head_dim {kv.head_dim}, "
                f"this model needs {cfg.num_hidden_layers} x {cfg.num_key_value_heads} x {cfg.dim_per_head}: "
                "build the cache with model.make_cache(num_blocks)"
            )
        # Tables, lengths and masks are the same in every layer: plan them once per step.
        plan = plan_attention(batch.block_tables.to(kv.device), batch.seq_lens, batch.query_lens, kv.block_size)
        compiled = self._compiled  # read once: compile_step(warm=True) may set it from another thread
        if compiled is not None and (slots := self._compilable_slots(batch, kv)) is not None:
            return self._run_compiled(compiled, batch, kv, plan, slots)
        cpu = batch.input_ids.device.type == "cpu"
        linear = self._linear if self.prepack_weights and cpu else _plain_linear
        if not self.prepack_weights:
            self._packed.clear()
            for key in (self._native_keys or {}).values():
                drop_linear(key)
        return self._layers(
            batch.input_ids, batch.positions, batch.sample_indices, _EagerPages(batch, kv, plan), linear
        )

    def _run_compiled(
        self,
        compiled: Callable[..., torch.Tensor],
        batch: StepBatch,
        kv: PagedKVCache,
        plan: AttentionPlan,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        ops = _OpPages(kv.kv, slots, float(self.config.dim_per_head**-0.5), self._native_keys is not None)
        sample = batch.sample_indices
        if not len(sample):  # an empty tensor's stride, which the graph guards on, is numpy's 0 or torch's 1
            sample = sample.new_empty(0)
        # Once warm, a step no graph fits runs eagerly rather than stall its requests to compile
        # (set_stance sets it when called, and puts the last one back when its block ends).
        with (
            attention_plan(plan),
            torch.compiler.set_stance("eager_on_recompile") if self._warmed else contextlib.nullcontext(),
        ):
            logits: torch.Tensor = compiled(batch.input_ids, batch.positions, sample, ops)
        return logits

    def _layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, sample: torch.Tensor, pages: _Pages, linear: _LinearFn
    ) -> torch.Tensor:
        """The step's arithmetic, eager or traced: embeddings, every layer, the LM head on ``sample``."""
        x = self.model.embed_tokens(input_ids)
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos = freqs.cos().repeat(1, 2).to(x.dtype)[:, None, :]
        # rotate_half(x) * sin is x rolled by half a head times sin with its first half negated.
        sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(x.dtype)[:, None, :]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, i, pages, linear)
        last = self.model.norm(x.index_select(0, sample))
        return linear(last, self.lm_head)

    def compile_step(self, *, backend: str | Callable[..., Any] = "inductor", warm: bool = False) -> bool:
        """Run later steps through ``torch.compile`` (inductor, dynamic shapes), eager as before
        until then. The first step compiles (a minute or more on a small CPU; inductor's cache on
        disk makes a later start faster); a step with padding slots, or on a cache that runs
        batchkit's CUDA kernels, runs eagerly.

        With ``warm=True`` it compiles before it returns instead: one step of each shape class
        (below) on a small scratch cache of its own, and the model's steps stay eager until then.
        Run it in a thread of its own beside a model that serves: steps in other threads go on
        eagerly while it compiles (slower: it takes a core), and the compiled step takes over at
        the first step after it returns. A later step of a shape no graph fits then runs eagerly
        rather than compile (``torch.compiler.set_stance("eager_on_recompile")`` around it).
        ``batchkit serve --compile-step background`` does this.

        With inductor, it first builds batchkit's native CPU decode attention
        (:func:`batchkit.kv.native.build_decode_attention`: about 30 s the first time on a small
        CPU, cached on disk after), which then runs every decode's attention, eager or compiled.
        A build that fails (no C++ compiler, which inductor needs too) is logged, and the
        steps stay eager, attention on torch.

        The K/V write and the attention run as batchkit's custom operators
        (:mod:`batchkit.kv.compiled`), so the compiled graph writes the cache in place; the
        linear layers run as one operator each, on oneDNN copies of the weights
        (:attr:`prepack_weights`). Where the native extension is built, the write, the
        attention of a step of decodes alone and the linear layers are its C++ operators
        (``torch.ops.batchkit_native``), and its oneDNN copies serve the eager steps too. On the
        Intel Xeon measured, a compiled 16-row step of SmolLM2-135M took 0.74-0.76x an eager
        one's time in float32 and 0.65-0.74x in bfloat16 (docs/benchmarks.md).

        Args:
            backend: ``torch.compile``'s backend (``"aot_eager"`` traces without generating code).
            warm: compile every shape class now, and only then run the compiled step.

        Returns:
            False where the step stays eager: the native build failed (inductor only).

        Raises:
            Exception: with ``warm=True``, whatever compiling raised; the steps then stay eager.

        Shapes are dynamic: a step of any number of rows runs the same graph, except one row
        or one sampled row (torch specializes sizes 0 and 1), and a step with as many tokens as
        rows (decodes alone) is a graph of its own, so a server compiles about five graphs,
        each once.
        """
        if backend == "inductor" and not build_decode_attention():
            # Inductor's generated code needs the C++ compiler the native build needed: without
            # it the first step would fail, so the steps stay eager.
            logger.warning("compile_step: the native CPU build failed (see above), so the step stays eager")
            return False
        layers = [layer for layer in self.modules() if isinstance(layer, nn.Linear)]
        if native_built():  # the linear layers and the K/V write in C++
            self._native_keys = {layer: _native_key(layer) for layer in layers}
            keys, op = self._native_keys, torch.ops.batchkit_native.linear
        else:
            keys, op = {layer: _register_linear(self, layer) for layer in layers}, torch.ops.batchkit.linear

        def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
            if not self.prepack_weights:
                return nn.functional.linear(x, layer.weight)
            out: torch.Tensor = op(x, layer.weight, keys[layer])
            return out

        def step(
            input_ids: torch.Tensor, positions: torch.Tensor, sample: torch.Tensor, pages: _OpPages
        ) -> torch.Tensor:
            return self._layers(input_ids, positions, sample, pages, linear)

        # Not fullgraph: past dynamo's recompile limit (several models in one process, say) a
        # step runs eagerly rather than failing.
        with warnings.catch_warnings():
            # Loading inductor imports a torch module that warns of its own use of
            # torch.jit.script_method (torch 2.13): nothing a caller can act on.
            warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)
            compiled = torch.compile(step, backend=backend, dynamic=True)
        if warm:
            self._warm(compiled)
        self._warmed = warm
        self._compiled = compiled
        return True

    def _warm(self, compiled: Callable[..., torch.Tensor]) -> None:
        """Compile ``compiled`` for each shape class on a scratch cache (see :mod:`._scratch`),
        as the decode loop calls a step: under ``inference_mode``."""
        started = time.perf_counter()
        cache, steps = scratch_steps(self.make_cache(num_blocks=2))
        with torch.inference_mode():
            for batch in steps:
                plan = plan_attention(batch.block_tables, batch.seq_lens, batch.query_lens, cache.block_size)
                self._run_compiled(compiled, batch, cache, plan, batch.slot_mapping)
        logger.info("compile_step: %d shape classes compiled in %.1f s", len(steps), time.perf_counter() - started)

    def _compilable_slots(self, batch: StepBatch, kv: PagedKVCache) -> torch.Tensor | None:
        """The step's slots as int64 for the compiled step, or None where the eager step runs
        (padding slots, a slot outside the cache, or the cache's CUDA kernels)."""
        if kv.kv.device.type != "cpu":
            return None
        slots = torch.as_tensor(batch.slot_mapping).long()
        if slots.numel() == 0 or int(slots.min()) < 0 or int(slots.max()) >= kv.num_blocks * kv.block_size:
            return None  # the eager step skips padding and names a bad slot
        return slots

    def _linear(self, x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
        """``layer(x)`` through oneDNN on a reordered copy of the weight, made on first use and
        again whenever the weight is replaced or written (its storage or version changes)."""
        w = layer.weight
        if self._native_keys is not None:  # compiled on the native extension: its copies serve both steps
            out: torch.Tensor = torch.ops.batchkit_native.linear(x, w, self._native_keys[layer])
            return out
        key = (w.data_ptr(), w._version, w.dtype)
        entry = self._packed.get(id(layer))
        if entry is None or entry[0] != key:
            entry = (key, _prepack(w))
            self._packed[id(layer)] = entry
        prepacked = entry[1]
        if prepacked is None:  # a dtype or build oneDNN does not run: the plain matmul
            return nn.functional.linear(x, w)
        return prepacked(x)
