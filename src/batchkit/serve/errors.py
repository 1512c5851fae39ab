"""The server's errors: :class:`ApiError`, the HTTP answer (a status and an OpenAI-style body)
raised and caught inside the app. No I/O here.

``ApiError`` is not a :class:`~batchkit.BatchkitError`: it is what the server answers, not what
batchkit raises to its users.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ApiError"]


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
