"""Queue deadlines: a request that has waited, in all, longer than its limit leaves the queue.

A request's queue time is every wait it has had: before it first ran, plus each wait after a
preemption. Its limit is its own `queue_timeout_s`, else the engine's `max_queue_time_ms`, else
none. The scheduler ends an expired request with a `queue_timeout` error: it is never started
and then cut.
"""

from __future__ import annotations

from collections.abc import Iterable

from batchinfer.core.request import Request


class QueueDeadlines:
    """The deadlines of waiting requests; counts the requests that have a limit of their own, so
    that with no limit anywhere (the common case) the queue is never scanned."""

    def __init__(self, max_queue_time_ms: float | None) -> None:
        self.max_queue_time_ms = max_queue_time_ms
        self.num_with_timeout = 0  # requests (waiting or running) with their own limit

    def track(self, request: Request) -> None:
        """A request entered the scheduler."""
        self.num_with_timeout += request.queue_timeout_s is not None

    def untrack(self, request: Request) -> None:
        """A request left the scheduler."""
        self.num_with_timeout -= request.queue_timeout_s is not None

    @property
    def active(self) -> bool:
        """Whether any request may have a deadline at all."""
        return self.max_queue_time_ms is not None or self.num_with_timeout > 0

    def deadline_s(self, request: Request) -> float | None:
        """When a waiting request's queue time runs out (None: no limit)."""
        limit_s = request.queue_timeout_s
        if limit_s is None and self.max_queue_time_ms is not None:
            limit_s = self.max_queue_time_ms / 1000.0
        if limit_s is None:
            return None
        return request.wait_start_s + (limit_s - request.waited_s)

    def expired(self, waiting: Iterable[Request], now: float) -> list[Request]:
        """The waiting requests whose queue time has run out at `now`, in queue order."""
        if not self.active:
            return []
        return [r for r in waiting if (d := self.deadline_s(r)) is not None and now >= d]

    def earliest_s(self, waiting: Iterable[Request]) -> float | None:
        """The first deadline among the waiting requests (None: none has one)."""
        if not self.active:
            return None
        due = [d for r in waiting if (d := self.deadline_s(r)) is not None]
        return min(due) if due else None
