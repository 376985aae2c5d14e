"""Work that stops when the HTTP client leaves: a non-streamed response has nobody to read it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def unless_disconnected(work: Awaitable[T], request: Request) -> T | None:
    """Await `work`; None, with `work` cancelled, if the client disconnects first. Exceptions
    of `work` propagate."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _wait_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect (if it ever comes).
    while (await request.receive())["type"] != "http.disconnect":
        pass
