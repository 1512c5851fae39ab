"""The server's life, whole: :class:`ServerState` and its :data:`TRANSITIONS` table, written by
:meth:`Lifecycle.move` alone; and :class:`InFlight`, the requests a shutdown waits for. No I/O
here beyond waiting on an event.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import anyio

__all__ = ["TRANSITIONS", "InFlight", "Lifecycle", "ServerState", "Transition"]


class ServerState(enum.Enum):
    """Where the server is; the value is what ``GET /ready`` says of it."""

    LOADING = "loading"  # the models load and warm up: requests get 503 + Retry-After
    READY = "ready"
    STOPPING = "stopping"  # shutting down: new requests get 503, those in flight finish
    FAILED = "failed"  # loading or warming up raised (Lifecycle.load_error)


class Transition(enum.Enum):
    """What moves the server from one :class:`ServerState` to another (:data:`TRANSITIONS`)."""

    LOADED = "loaded"  # the models are loaded and warm
    FAIL = "fail"  # loading or warming up raised
    STOP = "stop"  # the shutdown began


_LOADING, _READY, _STOPPING, _FAILED = ServerState.LOADING, ServerState.READY, ServerState.STOPPING, ServerState.FAILED

#: The server's state machine, whole: ``TRANSITIONS[state][transition]`` is the next state; a
#: transition a state does not list is a bug. The server starts ``LOADING``. A load that ends
#: after the shutdown began leaves it ``STOPPING`` (nothing is served then); a failure is kept,
#: shut down or not, so that ``/ready`` and ``batchkit serve`` tell it.
TRANSITIONS: Mapping[ServerState, Mapping[Transition, ServerState]] = MappingProxyType(
    {
        _LOADING: MappingProxyType({Transition.LOADED: _READY, Transition.FAIL: _FAILED, Transition.STOP: _STOPPING}),
        _READY: MappingProxyType({Transition.STOP: _STOPPING}),
        _STOPPING: MappingProxyType(
            {Transition.LOADED: _STOPPING, Transition.FAIL: _FAILED, Transition.STOP: _STOPPING}
        ),
        _FAILED: MappingProxyType({Transition.STOP: _FAILED}),
    }
)


class Lifecycle:
    """The server's :class:`ServerState` (``LOADING`` at first) and, once failed, why
    (:attr:`load_error`). ``ready_gauge`` (a Prometheus gauge) reads 1 while ``READY``."""

    __slots__ = ("_ready_gauge", "load_error", "state")

    def __init__(self, ready_gauge: Any) -> None:
        self.state = ServerState.LOADING
        self.load_error: BaseException | None = None
        self._ready_gauge = ready_gauge

    @property
    def ready(self) -> bool:
        return self.state is ServerState.READY

    @property
    def accepting(self) -> bool:
        """Whether requests are taken (or, while loading, answered "retry later")."""
        return self.state in (ServerState.LOADING, ServerState.READY)

    def move(self, transition: Transition) -> ServerState:
        """Apply ``transition`` (:data:`TRANSITIONS`) and return the new state: the one writer of
        :attr:`state`.

        Raises:
            RuntimeError: the table has no such transition from the current state (a bug).
        """
        new = TRANSITIONS[self.state].get(transition)
        if new is None:
            raise RuntimeError(f"the server: no {transition.value!r} transition from {self.state.value!r}")
        self.state = new
        self._ready_gauge.set(1 if new is ServerState.READY else 0)
        return new

    def fail(self, exc: BaseException) -> None:
        """Loading or warming up raised ``exc``: keep it, and move to ``FAILED``."""
        self.load_error = exc
        self.move(Transition.FAIL)

    def __repr__(self) -> str:
        return f"<Lifecycle {self.state.value}>"


class InFlight:
    """The requests in flight, counted (``gauge``, a Prometheus gauge, shows the count), for the
    shutdown to wait for: :meth:`drain`. Bound to the event loop that serves the app."""

    __slots__ = ("_gauge", "_grace", "_idle", "_no_grace", "count")

    def __init__(self, gauge: Any) -> None:
        self.count = 0
        self._gauge = gauge
        self._idle: anyio.Event | None = None  # set when the last request in flight leaves
        self._grace: anyio.CancelScope | None = None  # the shutdown's wait for requests in flight
        self._no_grace = False  # set by end_grace()

    def enter(self) -> None:
        """Count a request in flight (the shutdown waits for it)."""
        self.count += 1
        if self.count == 1:
            self._idle = anyio.Event()
        self._gauge.set(self.count)

    def leave(self) -> None:
        """The end of a request :meth:`enter` counted."""
        self.count -= 1
        self._gauge.set(self.count)
        if self.count == 0 and self._idle is not None:
            self._idle.set()

    async def drain(self, grace_s: float) -> None:
        """Wait, at most ``grace_s`` seconds, for the requests in flight to leave (not at all after
        :meth:`end_grace`)."""
        if self.count and self._idle is not None and not self._no_grace:
            with anyio.move_on_after(grace_s) as self._grace:
                await self._idle.wait()
            self._grace = None

    def end_grace(self) -> None:
        """Stop :meth:`drain`'s wait now, and any later one's before it starts."""
        self._no_grace = True
        if self._grace is not None:
            self._grace.cancel()

    def __repr__(self) -> str:
        return f"<InFlight count={self.count}>"
