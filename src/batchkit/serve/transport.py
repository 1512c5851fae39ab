"""The HTTP side of the server, without the models: reading a body under a size limit, Server-Sent
Events that stop their producer when the client leaves, watching for a disconnect, telling the
HTTP server's own cancellation from the app's, and error responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from .errors import ApiError

__all__ = [
    "EventStream",
    "cancelled_by_the_http_server",
    "error_response",
    "http_error",
    "read_body",
    "sse",
    "unless_disconnected",
]


def sse(data: Mapping[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


class EventStream(Response):
    """A ``text/event-stream`` response whose producer is cancelled when the client disconnects.

    Starlette's StreamingResponse notices a departed client only on its next write on newer ASGI
    servers; a generation waiting for its next token would hold its KV blocks until then. Here a
    task watches ``receive()`` for ``http.disconnect`` and cancels the producer at once, and the
    producer's ``finally`` aborts the request. ``on_close`` is told whether the whole stream
    was sent (False: the client left first).

    Cancelled by the HTTP server itself (uvicorn at ``--timeout-graceful-shutdown``), the stream
    ends with ``on_abort()``'s bytes (an OpenAI error event and ``[DONE]``) instead of breaking off.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        on_close: Callable[[bool], Awaitable[None]],
        on_abort: Callable[[], bytes],
    ) -> None:
        # No body attribute: Response would declare a Content-Length for it.
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.events = events
        self.on_close = on_close
        self.on_abort = on_abort

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sent = False
        started = False
        start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        try:
            try:
                async with anyio.create_task_group() as tg:

                    async def watch() -> None:
                        while (await receive())["type"] != "http.disconnect":
                            pass
                        tg.cancel_scope.cancel()

                    tg.start_soon(watch)
                    try:
                        await send(start)
                        started = True
                        async for chunk in self.events:
                            await send({"type": "http.response.body", "body": chunk, "more_body": True})
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                        sent = True
                    except OSError:
                        pass  # the client went away mid-write (caught here: a task group would wrap it)
                    tg.cancel_scope.cancel()
            except anyio.get_cancelled_exc_class():
                if not cancelled_by_the_http_server():
                    raise
                with contextlib.suppress(OSError):
                    if not started:
                        await send(start)
                    await send({"type": "http.response.body", "body": self.on_abort(), "more_body": False})
                    sent = True
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.events, "aclose", None)
                if aclose is not None:
                    await aclose()
                await self.on_close(sent)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, read as it arrives; 413 (and nothing more read) once it passes ``limit``
    bytes, or at once for a ``Content-Length`` over it."""

    def too_large(size: str) -> ApiError:
        return ApiError(
            413,
            f"the request body is {size} bytes; this server takes at most {limit} (--max-request-bytes)",
            code="request_too_large",
        )

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(declared)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(f"more than {limit}")
        chunks.append(chunk)
    return b"".join(chunks)


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await ``work``, cancelling it if the client disconnects meanwhile (then return None)."""
    outcome: list[Any] = []
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            outcome.append(await work)
        except ApiError as err:
            outcome.append(err)
        finally:
            tg.cancel_scope.cancel()
    if not outcome:
        return None
    if isinstance(outcome[0], ApiError):
        raise outcome[0]
    return outcome[0]


def cancelled_by_the_http_server() -> bool:
    """Whether the cancellation being handled came from outside every cancel scope of this
    task: the HTTP server cancelling the request (uvicorn does at ``--timeout-graceful-shutdown``),
    which then wants the task to end, and an OpenAI error is the better ending. If so, the
    cancellation is taken back (``Task.uncancel``), so that the answer can be sent. A cancelled
    scope of the app's own or of an enclosing app is not: it must propagate."""
    if anyio.current_effective_deadline() == -math.inf:
        return False
    try:
        task = asyncio.current_task()
    except RuntimeError:  # not asyncio: every cancellation comes from a scope
        return False
    if task is None:
        return False
    if sys.version_info >= (3, 11):  # before 3.11 there is no count of cancellations to take back
        if task.cancelling() == 0:
            return False
        task.uncancel()
    return True


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(ApiError(exc.status_code, str(exc.detail), code=code, headers=exc.headers))  # 405: Allow
