"""Waiting-queue orders of the scheduling policies, and the ranks they compare requests by.

- `fcfs`: arrival order; a preempted request goes back to the front (it resumes first).
- `priority`: by effective priority, then arrival. A waiting request's effective priority is
  `priority - (now - arrival) / aging` (continuous aging: one level per `priority_aging_ms`), so a batch
  request (priority 10) ranks with an interactive one (priority 0) that arrives 10 intervals
  after it, and ahead of every later one: nothing starves. Because every waiting request ages at
  the same rate, the order is fixed at insertion: the key `priority + arrival / aging` sorts the
  same as the effective priority at any moment.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from batchinfer.core.request import Request


def effective_priority(request: Request, now: float, aging_s: float) -> float:
    """`priority` lowered by one level per `aging_s` since arrival (0: no aging)."""
    if aging_s <= 0:
        return float(request.priority)
    return request.priority - (now - request.arrival_s) / aging_s


class _Queue:
    """Waiting requests in policy order (iteration order = admission order)."""

    _items: deque[Request] | list[Request]

    def remove(self, request: Request) -> None:
        # Identity, not equality: two requests may hold equal values.
        for i, item in enumerate(self._items):
            if item is request:
                del self._items[i]
                return
        raise ValueError(f"request {request.request_id!r} is not waiting")

    def remove_all(self, requests: list[Request]) -> None:
        """Remove several waiting requests in one pass over the queue."""
        if not requests:
            return
        gone = {id(r) for r in requests}
        kept = [r for r in self._items if id(r) not in gone]
        if len(kept) != len(self._items) - len(gone):
            raise ValueError("a request to remove is not waiting")
        self._items.clear()
        self._items.extend(kept)

    def first(self) -> Request:
        return self._items[0]

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


class FCFSQueue(_Queue):
    """Arrival order; `requeue` puts a preempted request first."""

    def __init__(self) -> None:
        self._items: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._items.append(request)

    def requeue(self, request: Request) -> None:
        self._items.appendleft(request)


class PriorityQueue(_Queue):
    """Effective priority, then arrival (see the module docstring); `requeue` = `add`."""

    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s
        self._items: list[Request] = []

    def _key(self, request: Request) -> tuple[float, float]:
        rank = float(request.priority)
        if self.aging_s > 0:
            rank += request.arrival_s / self.aging_s
        return rank, request.arrival_s

    def add(self, request: Request) -> None:
        bisect.insort(self._items, request, key=self._key)

    requeue = add


WaitingQueue = FCFSQueue | PriorityQueue

