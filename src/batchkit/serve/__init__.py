"""``batchkit.serve``: an OpenAI-compatible ASGI app and ``batchkit serve`` (``pip install 'batchkit[serve]'``).

- :func:`create_app` / :class:`ModelServer`: chat and text completions on a
  ``ContinuousDecodeLoop``, embeddings on an ``@batched`` encoder, ``/health``, ``/ready``,
  ``/metrics`` (see docs/serving.md).
- :class:`ServeSettings`: all of a server's settings as one frozen value
  (``create_app(settings=...)``, ``ModelServer.from_settings``).
- :class:`BatchkitCollector`: Prometheus metrics for any batcher, decode loop or KV pool, usable
  without the server (it needs only ``prometheus-client``).

Names load on first access, so that importing one part does not import the web framework for the other.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import ModelServer, create_app
    from .metrics import BatchkitCollector
    from .settings import ServeSettings

__all__ = ["BatchkitCollector", "ModelServer", "ServeSettings", "create_app"]

_WHERE = {"create_app": ".app", "ModelServer": ".app", "BatchkitCollector": ".metrics", "ServeSettings": ".settings"}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(where, __name__)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.partition(".")[0] in ("starlette", "prometheus_client", "uvicorn"):
            raise ModuleNotFoundError(
                f"batchkit.serve needs {exc.name}: pip install 'batchkit[serve]'", name=exc.name
            ) from exc
        raise
    value = getattr(module, name)
    globals()[name] = value
    return value
