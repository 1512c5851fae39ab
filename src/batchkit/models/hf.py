"""A batchkit step for any transformers causal LM: its own modeling code over batchkit's paged KV cache.

:class:`HFStepModel` wraps a ``transformers`` causal LM (Qwen2, Qwen3, Mistral, Gemma, Gemma2,
Phi3, OLMo2, Mixtral, Qwen2-MoE, Llama, ...) so that ``model(batch, kv) -> logits`` is a step of a
:class:`~batchkit.ContinuousDecodeLoop`. The model's forward runs as it is written; only its
attention is batchkit's, plugged in through transformers' public attention interface
(``AttentionInterface.register``, then ``attn_implementation="batchkit_paged"``):

- the step is one packed row: ``input_ids`` ``[1, num_tokens]``, ``position_ids`` from
  ``StepBatch.positions`` (so rotary and learned position embeddings see each token's position);
- each layer's attention writes the new K/V at ``slot_mapping`` (``kv.scatter``) and attends over
  ``block_tables``: causal within a sequence's new tokens, over all of its cached past, with a
  sliding window where the config gives the layer one, and Gemma2's attention logit soft-capping;
- logits are computed only at ``sample_indices`` (``logits_to_keep``).

What the paged attention cannot give is refused when the model is wrapped, with one line naming
the feature (encoder-decoder, cross-attention, attention sinks, layers that are not attention),
never run wrong. It knows nothing of scheduling or sampling: those are the loop's.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._cpu import adapt_cpu_threads
from ..continuous.step import StepBatch
from ..kv.attention import AttentionPlan, plan_attention, planned_attention
from ..kv.cache import PagedKVCache
from ..kv.planner import layer_windows

__all__ = [
    "ATTN_IMPLEMENTATION",
    "HFStepModel",
    "bypasses_attention_interface",
    "check_config",
    "check_supported",
    "paged_attention_forward",
    "register_attention",
]

ATTN_IMPLEMENTATION = "batchkit_paged"


@dataclass(frozen=True, slots=True)
class _Step:
    """What every layer's attention needs from one step (passed as an attention kwarg)."""

    kv: PagedKVCache
    slot_mapping: torch.Tensor
    plans: tuple[AttentionPlan, ...]  # one per layer (a sliding layer's masks are narrowed)
    layers_seen: list[int] = field(default_factory=list)  # checked after the forward: none bypassed us


def register_attention() -> None:
    """Register :func:`paged_attention_forward` with transformers as ``"batchkit_paged"`` (idempotent)."""
    import transformers

    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    batchkit_step: _Step | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over batchkit's pages.

    ``query`` is ``[1, num_heads, num_tokens, head_dim]``, ``key``/``value`` ``[1, num_kv_heads,
    num_tokens, head_dim]`` (the step's packed row); the output is ``[1, num_tokens, num_heads,
    head_dim]``. ``attention_mask`` is unused (the plan holds the masks), and so is the
    ``sliding_window`` kwarg: the window comes from the config, per layer, because not every model
    passes it (Qwen2-MoE does not).

    Raises:
        RuntimeError: called without a batchkit step, i.e. not from :meth:`HFStepModel.forward`.
    """
    if batchkit_step is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} runs only inside a batchkit step "
            "(HFStepModel(model)(batch, kv)); build the model with another attn_implementation to call it directly"
        )
    layer = int(module.layer_idx)  # type: ignore[arg-type]  # every transformers attention module has it
    batchkit_step.layers_seen.append(layer)
    kv = batchkit_step.kv
    # [1, H, N, D] -> [N, H, D] views; scatter and the planned gathers take strided tensors.
    kv.scatter(layer, key[0].transpose(0, 1), value[0].transpose(0, 1), batchkit_step.slot_mapping)
    q = query[0].transpose(0, 1)
    plan = batchkit_step.plans[layer]
    if softcap:
        out = _softcapped_attention(q, kv.key(layer), kv.value(layer), plan, scaling, float(softcap))
    else:
        out = planned_attention(q, kv.key(layer), kv.value(layer), plan, scale=scaling)
    return out.unsqueeze(0), None


def _windowed(plan: AttentionPlan, window: int) -> AttentionPlan:
    """``plan`` with each query seeing only the last ``window`` positions (itself included), as
    transformers' sliding-window mask does (key ``k`` visible from query ``q`` when ``k > q - window``).

    A query row of a plan's mask is causal and within the context, so it holds ``q + 1`` True
    entries: the query's position is read back from it (a padded row, key 0 only, stays as it is).
    """
    groups = []
    for g in plan.groups:
        q_pos = g.mask.sum(-1, keepdim=True) - 1  # [S, 1, q_max, 1]
        k_pos = torch.arange(g.mask.shape[-1], device=g.mask.device)
        groups.append(dataclasses.replace(g, mask=g.mask & (k_pos > q_pos - window), window=window))
    return AttentionPlan(num_tokens=plan.num_tokens, groups=tuple(groups))


def _softcapped_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float | None,
    softcap: float,
) -> torch.Tensor:
    """:func:`planned_attention` with the scores capped, ``softcap * tanh(scores / softcap)``,
    before the mask (Gemma2): written out, since scaled_dot_product_attention has no score hook."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv = key_cache.shape[2]
    scale = head_dim**-0.5 if scale is None else scale
    acc = torch.promote_types(query.dtype, torch.float32)
    out = torch.empty_like(query)
    for g in plan.groups:
        s_, q_max = g.query_index.shape
        width = g.mask.shape[-1]
        k = key_cache.index_select(0, g.tables).view(s_, width, num_kv, head_dim).to(acc).transpose(1, 2)
        v = value_cache.index_select(0, g.tables).view(s_, width, num_kv, head_dim).to(acc).transpose(1, 2)
        k = k.repeat_interleave(num_heads // num_kv, dim=1)
        v = v.repeat_interleave(num_heads // num_kv, dim=1)
        q = query.index_select(0, g.query_index.reshape(-1)).view(s_, q_max, num_heads, head_dim)
        scores = torch.matmul(q.to(acc).transpose(1, 2), k.transpose(2, 3)) * scale  # [S, H, q_max, W]
        scores = torch.tanh(scores / softcap) * softcap
        probs = scores.masked_fill(~g.mask, float("-inf")).softmax(dim=-1)
        o = torch.matmul(probs, v).transpose(1, 2).reshape(s_ * q_max, num_heads, head_dim)
        out.index_copy_(0, g.out_rows, o.index_select(0, g.out_select).to(query.dtype))
    return out


def _config_int(config: Any, name: str, default: int | None = None) -> int:
    value = getattr(config, name, None)
    if value is None:
        if default is None:
            raise ValueError(f"the model's config has no {name}")
        return default
    return int(value)


# RoPE types whose frequencies transformers recomputes from the longest position of the forward
# call: in a step that packs several sequences, a sequence's rotation would depend on the others.
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_types(config: Any) -> set[str]:
    """The RoPE types a config names (``rope_parameters`` or the older ``rope_scaling``; per layer
    type where it holds one set of parameters for each, as Gemma3's)."""
    out = set()
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if not isinstance(params, dict):
            continue
        for p in (params, *(v for v in params.values() if isinstance(v, dict))):
            kind = p.get("rope_type", p.get("type"))
            if isinstance(kind, str):
                out.add(kind)
    return out


def check_config(config: Any) -> None:
    """Refuse, from its config alone (before any weight is read), a model the paged attention
    would run wrong, with one line naming the feature.

    Raises:
        ValueError: an encoder-decoder, cross-attention, a layer that is not attention, or a RoPE
            recomputed from the sequence length (``dynamic``, ``longrope``).
    """
    kind = getattr(config, "model_type", "?")
    for rope in sorted(_rope_types(config) & set(LENGTH_DEPENDENT_ROPE)):
        raise ValueError(
            f"{kind!r} uses RoPE type {rope!r}, whose frequencies transformers recomputes from the longest "
            "sequence of a forward call: batched with others, a sequence's tokens would change"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{kind!r} is an encoder-decoder model: batchkit runs decoder-only causal LMs")
    if getattr(config, "add_cross_attention", False) or getattr(config, "cross_attention_layers", None):
        raise ValueError(f"{kind!r} uses cross-attention, which batchkit's paged KV cache does not hold")
    layer_windows(config)


def bypasses_attention_interface(model_type: str) -> ValueError:
    """The error for a model whose modeling code does not call transformers' attention
    interface (batchkit's paged attention plugs in there)."""
    return ValueError(
        f"the transformers modeling code of {model_type!r} does not call the attention interface, so batchkit "
        "cannot plug its paged attention in"
    )


def check_supported(hf_model: Any) -> None:
    """Refuse, with one line naming the feature, a model the paged attention would run wrong.

    Raises:
        ValueError: what :func:`check_config` refuses, attention sinks, or modeling code that
            does not call transformers' attention interface.
    """
    config = hf_model.config
    check_config(config)
    kind = getattr(config, "model_type", "?")
    if not getattr(hf_model, "is_backend_compatible", lambda: False)():
        raise bypasses_attention_interface(kind)
    if any(hasattr(m, "sinks") for m in hf_model.modules()):
        raise ValueError(f"{kind!r} uses attention sinks, which batchkit's paged attention does not implement")


class HFStepModel(nn.Module):
    """A transformers causal LM as a batchkit step: ``model(batch, kv) -> logits``.

    Args:
        hf_model: a ``transformers`` causal LM (``AutoModelForCausalLM``); its attention
            implementation is switched to ``"batchkit_paged"``. Its parameters stay where they are.

    Attributes:
        hf: the wrapped transformers model.
        config: its config (``vocab_size`` is what the loop checks prompts against).
        num_layers, num_kv_heads, head_dim: the shape of the KV cache it needs.
        windows: each layer's sliding window (None: full attention).
        sliding_window: the window when every layer slides over the same one, else None; a
            :class:`~batchkit.ContinuousDecodeLoop` then gives back the KV blocks that fall out of it.

    Raises:
        ValueError: a feature the paged attention cannot give (see :func:`check_supported`).

    >>> model = HFStepModel(transformers.AutoModelForCausalLM.from_pretrained(folder))  # doctest: +SKIP
    >>> kv = model.make_cache(num_blocks=256, block_size=16)  # doctest: +SKIP
    """

    def __init__(self, hf_model: Any) -> None:
        check_supported(hf_model)
        super().__init__()
        register_attention()
        hf_model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.hf = hf_model.eval()
        self.hf.requires_grad_(False)
        config = hf_model.config
        self.config = config
        heads = _config_int(config, "num_attention_heads")
        self.num_layers = _config_int(config, "num_hidden_layers")
        self.num_kv_heads = _config_int(config, "num_key_value_heads", heads)
        self.head_dim = _config_int(config, "head_dim", _config_int(config, "hidden_size") // heads)
        self.windows = layer_windows(config)
        self.sliding_window = self.windows[0] if len(set(self.windows)) == 1 else None
        self._logits_to_keep = "logits_to_keep" in inspect.signature(hf_model.forward).parameters

    @property
    def dtype(self) -> torch.dtype:
        weight: torch.Tensor = next(self.hf.parameters())
        return weight.dtype

    @property
    def device(self) -> torch.device:
        weight: torch.Tensor = next(self.hf.parameters())
        return weight.device

    def make_cache(self, num_blocks: int, block_size: int = 16, **kwargs: Any) -> PagedKVCache:
        """A :class:`PagedKVCache` shaped for this model (same dtype and device by default)."""
        kwargs.setdefault("dtype", self.dtype)
        kwargs.setdefault("device", self.device)
        return PagedKVCache(self.num_layers, num_blocks, block_size, self.num_kv_heads, self.head_dim, **kwargs)

    def forward(self, batch: StepBatch, kv: PagedKVCache) -> torch.Tensor:
        """The step: logits ``[len(batch.sample_indices), vocab_size]``.

        Raises:
            ValueError: ``kv`` is not shaped for this model (e.g. a cache another model made).
            RuntimeError: a layer's attention did not go through batchkit's (its modeling code
                bypassed the attention interface): its tokens would be wrong.
        """
        adapt_cpu_threads()  # a team as wide as the CPUs other processes leave free (batchkit._cpu)
        if (kv.num_layers, kv.num_kv_heads, kv.head_dim) != (self.num_layers, self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"the KV cache holds {kv.num_layers} layers x {kv.num_kv_heads} KV heads x head_dim {kv.head_dim}, "
                f"this model needs {self.num_layers} x {self.num_kv_heads} x {self.head_dim}: "
                "build the cache with model.make_cache(num_blocks)"
            )
        # Tables, lengths and masks are the same in every layer: plan them once per step (and
        # once more per distinct sliding window).
        full = plan_attention(batch.block_tables.to(kv.device), batch.seq_lens, batch.query_lens, kv.block_size)
        by_window = {w: full if w is None else _windowed(full, w) for w in set(self.windows)}
        step = _Step(kv, batch.slot_mapping, tuple(by_window[w] for w in self.windows))
        kwargs: dict[str, Any] = {}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = batch.sample_indices
        out = self.hf(
            input_ids=batch.input_ids[None],
            position_ids=batch.positions[None],
            use_cache=False,
            batchkit_step=step,
            **kwargs,
        )
        if len(step.layers_seen) != self.num_layers:
            raise RuntimeError(
                f"{len(step.layers_seen)} of the model's {self.num_layers} attention layers went through batchkit's "
                "paged attention: its modeling code bypasses the attention interface"
            )
        logits: torch.Tensor = out.logits[0]
        return logits if self._logits_to_keep else logits.index_select(0, batch.sample_indices)

    def __repr__(self) -> str:
        return (
            f"<HFStepModel {type(self.hf).__name__} layers={self.num_layers} kv_heads={self.num_kv_heads} "
            f"head_dim={self.head_dim} {self.dtype}>"
        )
