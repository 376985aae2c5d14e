"""An httpx transport with one connection per request in flight, picked in O(1).

httpcore's connection pool scans every connection (and polls each idle socket) whenever a
request starts or a response closes. At 64 connections that scan cost the bench client more CPU
than reading the streams, which made the client the bottleneck (figures and commands in
docs/benchmarking.md, "The client is not the bottleneck"). Here each request takes a free
single-connection transport from a free list and gives it back when its response is closed;
the benchmark's semaphore bounds how many exist.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable

import httpx

from batchinfer.core.validation import check_int


class SlotTransport(httpx.AsyncBaseTransport):
    """Single-connection `httpx.AsyncHTTPTransport`s, reused, at most `max_slots` of them."""

    def __init__(self, max_slots: int, ssl_context: ssl.SSLContext | None = None) -> None:
        self.max_slots = check_int("max_slots", max_slots)
        self._ssl_context = ssl_context or httpx.create_ssl_context()
        self._free: list[httpx.AsyncHTTPTransport] = []
        self._all: list[httpx.AsyncHTTPTransport] = []

    def _take(self) -> httpx.AsyncHTTPTransport:
        if self._free:
            return self._free.pop()
        if len(self._all) >= self.max_slots:
            raise RuntimeError(f"more than {self.max_slots} requests in flight")
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        transport = httpx.AsyncHTTPTransport(verify=self._ssl_context, limits=limits)
        self._all.append(transport)
        return transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        transport = self._take()
        try:
            response = await transport.handle_async_request(request)
        except BaseException:
            self._free.append(transport)
            raise
        if not isinstance(response.stream, httpx.AsyncByteStream):
            raise RuntimeError("an async transport returned a sync response stream")
        stream = _ReleasingStream(response.stream, lambda: self._free.append(transport))
        return httpx.Response(response.status_code, headers=response.headers, stream=stream,
                              extensions=response.extensions)

    async def aclose(self) -> None:
        for transport in self._all:
            await transport.aclose()
        self._all.clear()
        self._free.clear()


class _ReleasingStream(httpx.AsyncByteStream):
    """A response stream that returns its transport to the free list once closed."""

    def __init__(self, stream: httpx.AsyncByteStream, release: Callable[[], None]) -> None:
        self._stream = stream
        self._release: Callable[[], None] | None = release

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._stream:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            if self._release is not None:
                self._release()
                self._release = None


def make_client(max_slots: int, timeout: httpx.Timeout) -> httpx.AsyncClient:
    """The benchmark's one `httpx.AsyncClient`: up to `max_slots` connections, O(1) each."""
    return httpx.AsyncClient(transport=SlotTransport(max_slots), timeout=timeout)
