"""`until`: wait for a condition instead of sleeping a guessed time, so tests order events by
state. It polls `condition()` and fails naming `what` once `timeout_s` passes: a slow machine
makes a test slower, never wrong, and a broken one fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def until(condition: Callable[[], bool], timeout_s: float = 120.0,
                what: str = "the condition") -> None:
    """Let the loop's other tasks (and threads) run until `condition()` holds."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s:g} s")
        await asyncio.sleep(0.001)

