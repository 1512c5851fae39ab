"""RequestQueues: a scheduler's live requests, each in the list of its status, and their one writer.

A request enters ``WAITING`` in :meth:`RequestQueues.add`; from then on :meth:`RequestQueues.move`
alone moves it (through :meth:`Request.move`, the :data:`TRANSITIONS` table): to the list of its
new status, its blocks freed when it leaves :data:`HOLDS_BLOCKS`, counted when it ends. Deadlines
(a heap, dropped lazily) and the events of requests failed outside a step's results live here too.
Which request moves when is the :class:`Scheduler`'s policy; this module decides nothing.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Hashable

from .._errors import DeadlineExceeded
from ..kv.allocator import PagedKVAllocator
from .request import HOLDS_BLOCKS, Request, RequestStatus, TokenEvent, Transition

__all__ = ["RequestQueues"]


class RequestQueues:
    """The live requests of one scheduler, in three lists by status.

    Attributes:
        waiting: sorted by (priority, arrival order).
        running, swapped: in the order they entered (the scheduler sorts ``running``).
        finished: requests that ended ``FINISHED`` (failed ones included: a failure ends a
            request there). aborted: requests aborted. expired: requests failed past their
            deadline (:meth:`expire`).
    """

    def __init__(self, allocator: PagedKVAllocator) -> None:
        self.allocator = allocator
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self._lists: dict[RequestStatus, list[Request]] = {
            RequestStatus.WAITING: self.waiting,
            RequestStatus.RUNNING: self.running,
            RequestStatus.SWAPPED: self.swapped,
        }
        self._live: dict[Hashable, Request] = {}  # each in exactly one of the lists
        self._order = 0
        self._deadlines: list[tuple[float, int, Request]] = []  # heap; ended requests leave lazily
        self._events: list[TokenEvent] = []
        self.finished = 0
        self.aborted = 0
        self.expired = 0

    def get(self, request_id: Hashable) -> Request | None:
        """The live request of that id, or None (never added, or ended)."""
        return self._live.get(request_id)

    def is_live(self, req: Request) -> bool:
        """Whether ``req`` itself (not another request of its id) is live."""
        return self._live.get(req.request_id) is req

    def never_fits(self, req: Request, num_tokens: int) -> str | None:
        """Why a request holding ``num_tokens`` tokens (and about to take one more) could never be
        admitted again, even with the cache to itself; None if it could."""
        problem = self.allocator.never_fits(num_tokens + 1, req.tenant)
        return None if problem is None else f"request {req.request_id!r} with {num_tokens} tokens {problem}"

    def has_work(self) -> bool:
        """Whether any request is waiting, running or swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def add(self, request: Request, now: float) -> None:
        """Make a checked request live, ``WAITING``, arrived at ``now`` (its order is the next)."""
        request.arrival = now
        self._order += 1
        request.order = self._order
        request.status = RequestStatus.WAITING
        if request.params.seed is not None:
            import torch

            request.generator = torch.Generator().manual_seed(request.params.seed)
        self._live[request.request_id] = request
        bisect.insort(self.waiting, request, key=Request.sort_key)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, request.order, request))

    def move(self, req: Request, transition: Transition) -> None:
        """Apply ``transition`` to a live request (:meth:`Request.move`): move it to the list of
        its new status (none when it ends), free its blocks when it leaves :data:`HOLDS_BLOCKS`
        for a status outside it, and count it when it ends. Block moves (swap out, swap in) are
        the caller's, before the move; so is ``num_computed`` past a (re)start from 0.

        Raises:
            RuntimeError: the table has no such transition from the request's status (a bug).
        """
        old, new = req.move(transition)
        self._lists[old].remove(req)
        if old in HOLDS_BLOCKS and new not in HOLDS_BLOCKS:
            self.allocator.free(req.request_id)
        if new is RequestStatus.WAITING:
            req.num_computed = 0
            bisect.insort(self.waiting, req, key=Request.sort_key)
        elif new in self._lists:
            self._lists[new].append(req)
        else:
            del self._live[req.request_id]
            if new is RequestStatus.FINISHED:
                self.finished += 1
            else:
                self.aborted += 1

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request wherever it is and free its blocks. False if it is not live."""
        req = self._live.get(request_id)
        if req is None:
            return False
        self.move(req, Transition.ABORT)
        req.finish_reason = "abort"
        return True

    def fail(self, req: Request, error: BaseException) -> None:
        """End a live request with an error (its blocks freed); its event waits in :meth:`take_events`."""
        self.move(req, Transition.FAIL)
        req.finish_reason = "error"
        self._events.append(TokenEvent.ended(req.request_id, "error", error))

    def take_events(self) -> list[TokenEvent]:
        """The events of the requests failed since the last call."""
        out, self._events = self._events, []
        return out

    def expire(self, now: float) -> None:
        """Fail every request whose deadline has passed at ``now``, wherever it is, with
        :class:`DeadlineExceeded`; free its blocks."""
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            _, _, req = heapq.heappop(heap)
            if not self.is_live(req):
                continue  # finished or aborted already
            self.expired += 1
            self.fail(
                req,
                DeadlineExceeded(
                    f"request {req.request_id!r} passed its deadline ({now - req.arrival:.3f} s after arrival, "
                    f"{len(req.output)} tokens generated); give it a longer deadline or add capacity"
                ),
            )
