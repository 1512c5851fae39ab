"""Reference models written on batchkit's paged KV cache."""

from __future__ import annotations

from .llama import LlamaConfig, LlamaModel

__all__ = ["LlamaConfig", "LlamaModel"]
