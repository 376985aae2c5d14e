"""uvicorn's HTTP/1.1 protocol with the limits a public port needs.

- **Header read timeout**: a connection must deliver a whole request head within
  `header_timeout_s` of opening (or of its previous response), else it is closed. Plain uvicorn
  waits forever for the first request, so idle or trickling connections pile up.
- **Header size**: a request head larger than `max_header_bytes` is answered 431 and closed
  (plain uvicorn answers 400, or nothing).

Concurrent connections (`limit_concurrency`, 503 beyond) and the keep-alive timeout are uvicorn's
own settings; `batchinfer serve` sets them from its flags.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

HEAD_END = re.compile(rb"\n\r?\n")  # where h11 ends a request head (CRLF or bare LF)


class GuardedH11Protocol(H11Protocol):
    """`H11Protocol` with a header read timeout and a 431 for oversized request heads."""

    header_timeout_s = 10.0
    max_header_bytes = 64 << 10

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._start_header_timer()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def data_received(self, data: bytes) -> None:
        if self._between_requests() and self.conn.their_state == h11.IDLE:
            # Only the head counts: a client may send head and body in one write, so the
            # bytes buffered can pass the limit with a small head that has ended.
            pending = bytes(self.conn.trailing_data[0]) + data
            if len(pending) > self.max_header_bytes and \
                    HEAD_END.search(pending, 0, self.max_header_bytes + 4) is None:
                self._send_431()
                return
        super().data_received(data)

    def _start_header_timer(self) -> None:
        self._stop_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        # A request whose head arrived has a cycle; only a connection still without one (idle,
        # or trickling its head) is closed.
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()

    def _send_431(self) -> None:
        body = b"request header fields too large"
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
            + body
        )
        self.transport.close()


def guarded_protocol(header_timeout_s: float, max_header_bytes: int) -> type[GuardedH11Protocol]:
    """The protocol class with these limits (uvicorn takes a class, not an instance)."""
    return type("GuardedH11", (GuardedH11Protocol,), {
        "header_timeout_s": header_timeout_s, "max_header_bytes": max_header_bytes})
