"""Reference models written on batchkit's paged KV cache (needs torch: ``pip install 'batchkit[torch]'``)."""

from __future__ import annotations

try:
    from .hf import HFStepModel
    from .llama import LlamaConfig, LlamaModel
    from .pretrained import PretrainedLM, SentenceEncoder, load_encoder, load_pretrained
except ModuleNotFoundError as exc:
    if exc.name is None or exc.name.partition(".")[0] != "torch":
        raise
    # Still a ModuleNotFoundError (code that catches ImportError keeps working), now naming the extra.
    raise ModuleNotFoundError(
        "batchkit.models needs torch: pip install 'batchkit[torch]'", name=exc.name, path=exc.path
    ) from exc

__all__ = [
    "HFStepModel",
    "LlamaConfig",
    "LlamaModel",
    "PretrainedLM",
    "SentenceEncoder",
    "load_encoder",
    "load_pretrained",
]
