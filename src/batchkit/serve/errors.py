"""The server's errors: :class:`ApiError`, the HTTP answer (a status and an OpenAI-style body)
raised and caught inside the app, and :func:`answer_for`, the one map from what the engine raises
(batchkit's errors, a ``ValueError``) to that answer. No I/O here.

``ApiError`` is not a :class:`~batchkit.BatchkitError`: it is what the server answers, not what
batchkit raises to its users.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import BatcherClosed, CircuitOpen, DeadlineExceeded, KVCacheExhausted, QueueFull

__all__ = ["ANSWERS", "ApiError", "ErrorAnswer", "answer_for"]


class ApiError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class ErrorAnswer:
    """How the server answers one kind of exception: the status, the body's ``type`` and
    ``code``, the text put before the exception's message, the reason counted as a rejection
    (None: not one), and whether the client may retry after ``Retry-After`` seconds."""

    status: int
    code: str
    type: str = "invalid_request_error"
    prefix: str = ""
    rejection: str | None = None
    retry: bool = False

    def error(self, exc: BaseException, retry_after_s: int) -> ApiError:
        """The :class:`ApiError` this answer gives ``exc``."""
        headers = {"Retry-After": str(retry_after_s)} if self.retry else None
        return ApiError(self.status, f"{self.prefix}{exc}", type=self.type, code=self.code, headers=headers)


_BUSY = "server_error"

# The first row whose class the exception is an instance of answers it. No TypeError row: the
# request's own checks (serve.protocol, serve.structured) answer a field of the wrong type 400
# themselves, so a TypeError that gets here is a bug in batchkit or the model, a 500.
ANSWERS: tuple[tuple[type[BaseException], ErrorAnswer], ...] = (
    (QueueFull, ErrorAnswer(503, "queue_full", _BUSY, "the server is busy: ", "queue_full", retry=True)),
    (BatcherClosed, ErrorAnswer(503, "shutting_down", _BUSY, "the server is shutting down: ", retry=True)),
    (CircuitOpen, ErrorAnswer(503, "circuit_open", _BUSY, "the model is failing: ", "circuit_open", retry=True)),
    (KVCacheExhausted, ErrorAnswer(400, "context_length_exceeded", rejection="kv_exhausted")),
    (DeadlineExceeded, ErrorAnswer(504, "deadline_exceeded", _BUSY, rejection="deadline")),
    (ValueError, ErrorAnswer(400, "invalid_value")),  # a request the engine refuses (a sampling field)
)


def answer_for(exc: BaseException, what: str) -> ErrorAnswer:
    """The answer for ``exc``, raised by the engine while it served a ``what`` (``"generation"``,
    ``"embedding"``): its row of :data:`ANSWERS`, else a 500 ``{what}_failed``."""
    for cls, answer in ANSWERS:
        if isinstance(exc, cls):
            return answer
    return ErrorAnswer(500, f"{what}_failed", _BUSY, f"the {what} failed: ")
