"""Errors a batcher gives its callers; pure Python so the server can map them without torch."""

from __future__ import annotations


class InputError(ValueError):
    """Bad user input. `param` names the argument (the request field on the HTTP side)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class OverloadedError(RuntimeError):
    """The queue holds `max_queue_size` items; retry after `retry_after_s` (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ItemTimeoutError(TimeoutError):
    """An item waited past its `timeout_ms` in the queue; it was never run (HTTP 504)."""


class BatcherClosedError(RuntimeError):
    """The batcher was closed before the item ran."""
