"""How the server says no: :class:`Refusals` turns what serving a request raised into the
:class:`~batchkit.serve.errors.ApiError` it is answered with (through the one map,
:func:`~batchkit.serve.errors.answer_for`), counts each refusal by reason and logs each failure.
"""

from __future__ import annotations

import logging

from .errors import ApiError, answer_for
from .metrics import ServerMetrics

__all__ = ["Refusals"]

logger = logging.getLogger("batchkit.serve.app")  # the name the server has always logged under


class Refusals:
    """The server's refusals: 503s the client may retry after ``retry_after_s`` seconds, and the
    answers for exceptions, counted in ``metrics``."""

    __slots__ = ("metrics", "retry_after_s")

    def __init__(self, retry_after_s: int, metrics: ServerMetrics) -> None:
        self.retry_after_s = retry_after_s
        self.metrics = metrics

    def reject(self, reason: str) -> None:
        """Count a request refused before running, by ``reason``."""
        self.metrics.rejections.labels(reason).inc()

    def retry_later(self, message: str, code: str) -> ApiError:
        """A 503 the client may retry after ``retry_after_s`` (busy, loading, shutting down)."""
        return ApiError(503, message, type="server_error", code=code, headers={"Retry-After": str(self.retry_after_s)})

    def stopped_by_the_http_server(self) -> ApiError:
        """The answer for a request the HTTP server cancelled: uvicorn does so to requests still
        running at its ``--timeout-graceful-shutdown`` (else they would get a bare 500)."""
        return self.retry_later("the server is shutting down; the request was stopped", "shutting_down")

    def error_for(self, exc: BaseException, what: str) -> ApiError:
        """The answer for an exception raised while serving a ``what`` (``"generation"``,
        ``"embedding"``), as :func:`~batchkit.serve.errors.answer_for` maps it, counted as a
        rejection where it is one (and logged where it is a failure): call it once per request."""
        if isinstance(exc, ApiError):
            return exc
        answer = answer_for(exc, what)
        if answer.rejection is not None:
            self.reject(answer.rejection)
        if answer.status == 500:
            logger.error("batchkit.serve: a %s failed", what, exc_info=exc)
        return answer.error(exc, self.retry_after_s)

    def generation_error(self, exc: BaseException) -> ApiError:
        """The answer for an exception a generation raised (at submit or from its stream); see
        :meth:`error_for`."""
        return self.error_for(exc, "generation")
