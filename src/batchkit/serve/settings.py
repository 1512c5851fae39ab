"""The server's settings as one frozen value: :class:`ServeSettings`, built once (by ``batchkit
serve`` from its command line, by :class:`~batchkit.serve.ModelServer` from its keywords, or by
you), checked once, and read by every part of the server. No I/O, no web framework here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from .._validate import positive_int
from .protocol import MAX_EMBEDDING_INPUTS, MAX_PROMPTS_PER_REQUEST, MAX_REQUEST_BYTES

__all__ = ["ServeSettings"]


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """Everything a :class:`~batchkit.serve.ModelServer` is made with, as one frozen value: each
    field is the :class:`~batchkit.serve.ModelServer` keyword of that name, with its default.
    ``create_app(settings=ServeSettings(...))`` serves it.

    Raises:
        ValueError: neither ``model`` nor ``embedding_model``; ``max_request_bytes`` or
            ``max_prompts_per_request`` not an int >= 1.
    """

    model: Any = None
    embedding_model: Any = None
    model_name: str | None = None
    embedding_model_name: str | None = None
    num_blocks: int = 512
    block_size: int = 16
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 1024
    enable_prefix_caching: bool = True
    max_waiting: int | None = 64
    tenant_quotas: Mapping[str, int] | None = None
    default_max_tokens: int = 256
    embedding_max_batch: int = 32
    embedding_max_wait_ms: float = 5.0
    embedding_max_queue: int = 2 * MAX_EMBEDDING_INPUTS
    retry_after_s: int = 1
    max_request_bytes: int = MAX_REQUEST_BYTES
    max_prompts_per_request: int = MAX_PROMPTS_PER_REQUEST
    request_timeout_s: float | None = None
    shutdown_grace_s: float = 10.0
    warmup: bool = True
    on_load_error: Callable[[BaseException], None] | None = None
    dtype: Any = None
    device: Any = "cpu"
    engine: Literal["thread", "caller"] = "thread"
    tokenizer: str | os.PathLike[str] | None = None
    compile_step: bool | Literal["background"] = False
    native_attention: bool = False
    freeze_heap: bool = False

    def __post_init__(self) -> None:
        if self.model is None and self.embedding_model is None:
            raise ValueError("give a model, an embedding_model, or both")
        if self.compile_step not in (False, True, "background"):
            raise ValueError(f"compile_step must be False, True or 'background', got {self.compile_step!r}")
        positive_int("max_request_bytes", self.max_request_bytes, note="(bytes)")
        positive_int("max_prompts_per_request", self.max_prompts_per_request)
        if self.tenant_quotas is not None:  # a copy of its own, read-only: the value stays frozen
            object.__setattr__(self, "tenant_quotas", MappingProxyType(dict(self.tenant_quotas)))

    @property
    def embedding_max_inputs(self) -> int:
        """The most inputs one ``/v1/embeddings`` request may carry: each is one item of the
        batcher's queue, so a smaller queue lowers the limit (a request it could never hold is
        refused with 400, not for ever as "busy")."""
        return min(MAX_EMBEDDING_INPUTS, self.embedding_max_queue)

    def loop_options(self) -> dict[str, Any]:
        """The decode loop's keywords (``make_loop``'s, after the KV pool's shape)."""
        options: dict[str, Any] = {
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_prefix_caching": self.enable_prefix_caching,
            "max_waiting": self.max_waiting,
            "engine": self.engine,
        }
        if self.tenant_quotas:
            options["tenant_quotas"] = dict(self.tenant_quotas)
        return options

    def embedding_options(self) -> dict[str, Any]:
        """The embedding batcher's ``@batched`` keywords (its circuit breaker is the server's)."""
        return {
            "max_batch": self.embedding_max_batch,
            "max_wait_ms": self.embedding_max_wait_ms,
            "max_queue": self.embedding_max_queue,
            "on_full": "reject",
        }
