"""Run batch lines through a `Handler`, a bounded number at a time, and write the answers in
input order.

The handler is the caller's: `run-batch` and the server's batch jobs hand in the server app
in this process (`server.client.AppClient`), so a batch line gets exactly what the same
request over HTTP would: the same validation, the same OpenAI error bodies, the same
scheduling; this package imports nothing of the server. `run_lines` keeps at most
`max_in_flight` lines between admission and write: that bounds both the requests running and
the finished answers held back behind a slow earlier line. Stopping (cancel, expiry, Ctrl-C)
writes the finished prefix and drops the rest, so at most the lines in flight are lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from batchinfer.batch.lines import BatchLine, output_line, rejected_line
from batchinfer.core.api_errors import error_body

logger = logging.getLogger(__name__)

# (url, body) -> (status code, JSON body, request id)
Handler = Callable[[str, dict[str, Any]], Awaitable[tuple[int, Any, str | None]]]
# Answers that mean "not now": a full queue, a queue deadline, a model still loading. A batch
# line waits and retries them rather than recording them as its answer.
RETRY_CODES = ("queue_full", "overloaded", "queue_timeout", "loading")
RETRY_DELAY_S = 1.0


def retrying(handler: Handler, stop: asyncio.Event) -> Handler:
    """`handler` with the `RETRY_CODES` answers retried until they pass, and a server shutting
    down turned into this line's cancellation (it reruns at the next start) once `stop` is
    set."""
    async def handle(url: str, body: dict[str, Any]) -> tuple[int, Any, str | None]:
        while True:
            status, payload, request_id = await handler(url, body)
            error = payload.get("error") if isinstance(payload, dict) else None
            code = error.get("code") if isinstance(error, dict) else None
            if code == "shutting_down":
                await stop.wait()
                raise asyncio.CancelledError
            if code not in RETRY_CODES:
                return status, payload, request_id
            await asyncio.sleep(RETRY_DELAY_S)

    return handle


@dataclass
class LineCounts:
    """What `run_lines` wrote: lines, failed ones (status not 2xx), output tokens."""

    completed: int = 0
    failed: int = 0
    output_tokens: int = 0

    def add(self, result: dict[str, Any]) -> None:
        response = result["response"]
        if 200 <= response["status_code"] < 300:
            self.completed += 1
            usage = response["body"].get("usage") or {}
            self.output_tokens += int(usage.get("completion_tokens") or 0)
        else:
            self.failed += 1


async def run_lines(lines: Iterable[BatchLine], handler: Handler,
                    write: Callable[[BatchLine, dict[str, Any]], None], max_in_flight: int,
                    stop: asyncio.Event | None = None) -> LineCounts:
    """Answer every line (rejected ones with their 400 at once), calling `write(line,
    result)` in input order. With `stop` set, admission ends, running lines are cancelled and
    only the answers before the first unfinished line are written. Returns the counts. A
    `write` that raises (a full disk) stops the run the same way, then is raised here: the
    caller must not mistake a run that lost its output for a finished one."""
    stop = stop or asyncio.Event()
    window = asyncio.Semaphore(max_in_flight)
    done: dict[int, tuple[BatchLine, dict[str, Any]]] = {}
    running: set[asyncio.Task[None]] = set()
    counts = LineCounts()
    next_write = 0
    write_error: list[BaseException] = []

    def flush() -> None:
        nonlocal next_write
        while next_write in done and not write_error:
            line, result = done[next_write]
            try:
                write(line, result)
            except Exception as exc:
                write_error.append(exc)
                stop.set()
                return
            del done[next_write]
            counts.add(result)
            next_write += 1
            window.release()

    async def answer(seq: int, line: BatchLine) -> None:
        assert line.url is not None and line.body is not None
        try:
            status, body, request_id = await handler(line.url, line.body)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the engine died, a transport error: this line fails alone
            logger.exception("batch line %s failed", line.custom_id)
            status, body, request_id = 500, error_body(500, f"{type(exc).__name__}: {exc}",
                                                       code="internal_error"), None
        done[seq] = (line, output_line(line.custom_id, status, body, request_id))
        flush()

    stopped = asyncio.ensure_future(stop.wait())
    try:
        for seq, line in enumerate(lines):
            acquire = asyncio.ensure_future(window.acquire())
            await asyncio.wait((acquire, stopped), return_when=asyncio.FIRST_COMPLETED)
            if stop.is_set():
                if acquire.done():
                    window.release()
                else:
                    acquire.cancel()
                break
            if line.error is not None:
                done[seq] = (line, rejected_line(line))
                flush()
                continue
            task = asyncio.ensure_future(answer(seq, line))
            running.add(task)
            task.add_done_callback(running.discard)
        while running and not stop.is_set():
            await asyncio.wait([*running, stopped], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        for task in list(running):
            task.cancel()
        for task in list(running):
            with contextlib.suppress(asyncio.CancelledError):
                await task
        flush()
    if write_error:
        raise write_error[0]
    return counts
